//! The shared library answers to the driver's SONAME, `libcuda.so.1`, as the real one does.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
