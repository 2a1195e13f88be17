//! The guest SDKs speak the host's ABI: every result code, advice code and location code in
//! the C header (`sdk/c/twm.h`) and in the Rust guest crate (`tensor-wasm-mem-guest`) equals
//! the host's own. One place defines the ABI (this crate and the core); both SDKs are checked
//! against it here.

use std::collections::HashMap;

use tensor_wasm_mem_core::{Advice, DeviceId, Location};
use tensor_wasm_mem_guest as guest;
use tensor_wasm_mem_wasmtime::kernels;
use tensor_wasm_mem_wasmtime::{
    TWM_ERR_BACKEND, TWM_ERR_NOT_DEVICE_MEMORY, TWM_ERR_OUT_OF_RANGE, TWM_ERR_OVERFLOW,
    TWM_ERR_UNKNOWN_ADVICE, TWM_ERR_UNKNOWN_DEVICE, TWM_ERR_UNSUPPORTED, TWM_OK,
};

/// The host's result codes, by their C name.
const RESULTS: [(&str, i32); 12] = [
    ("TWM_OK", TWM_OK),
    ("TWM_ERR_OUT_OF_RANGE", TWM_ERR_OUT_OF_RANGE),
    ("TWM_ERR_OVERFLOW", TWM_ERR_OVERFLOW),
    ("TWM_ERR_UNKNOWN_ADVICE", TWM_ERR_UNKNOWN_ADVICE),
    ("TWM_ERR_UNKNOWN_DEVICE", TWM_ERR_UNKNOWN_DEVICE),
    ("TWM_ERR_BACKEND", TWM_ERR_BACKEND),
    ("TWM_ERR_NOT_DEVICE_MEMORY", TWM_ERR_NOT_DEVICE_MEMORY),
    ("TWM_ERR_UNSUPPORTED", TWM_ERR_UNSUPPORTED),
    ("TWM_ERR_UNKNOWN_KERNEL", kernels::TWM_ERR_UNKNOWN_KERNEL),
    ("TWM_ERR_BAD_ARGUMENTS", kernels::TWM_ERR_BAD_ARGUMENTS),
    ("TWM_ERR_KERNEL_FAULT", kernels::TWM_ERR_KERNEL_FAULT),
    ("TWM_ERR_BUSY", kernels::TWM_ERR_BUSY),
];

/// The host's advice codes, by their C name.
fn advice() -> [(&'static str, i32); 6] {
    let host = Location::Host;
    [
        (
            "TWM_ADVICE_SET_READ_MOSTLY",
            Advice::SetReadMostly.guest_code(),
        ),
        (
            "TWM_ADVICE_UNSET_READ_MOSTLY",
            Advice::UnsetReadMostly.guest_code(),
        ),
        (
            "TWM_ADVICE_SET_PREFERRED_LOCATION",
            Advice::SetPreferredLocation(host).guest_code(),
        ),
        (
            "TWM_ADVICE_UNSET_PREFERRED_LOCATION",
            Advice::UnsetPreferredLocation.guest_code(),
        ),
        (
            "TWM_ADVICE_SET_ACCESSED_BY",
            Advice::SetAccessedBy(host).guest_code(),
        ),
        (
            "TWM_ADVICE_UNSET_ACCESSED_BY",
            Advice::UnsetAccessedBy(host).guest_code(),
        ),
    ]
}

/// The `#define NAME value` lines of the C header with an integer value.
fn header_defines() -> HashMap<String, i32> {
    // This checkout's (cargo sets the variable when it runs the test), not the compiled-in
    // one: checkouts that share a target directory share this binary.
    let package = std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(
        || env!("CARGO_MANIFEST_DIR").into(),
        std::path::PathBuf::from,
    );
    let path = package.join("../../sdk/c/twm.h");
    let text = std::fs::read_to_string(path).expect("sdk/c/twm.h");
    text.lines()
        .filter_map(|line| {
            let rest = line.trim().strip_prefix("#define ")?;
            let (name, value) = rest.split_once(char::is_whitespace)?;
            let value = value.split("/*").next()?.trim();
            let value = value.trim_start_matches('(').trim_end_matches(')');
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect()
}

#[test]
fn the_c_header_has_the_hosts_codes() {
    let defines = header_defines();
    for (name, code) in RESULTS.into_iter().chain(advice()) {
        assert_eq!(defines.get(name), Some(&code), "{name} in twm.h");
    }
    assert_eq!(
        defines.get("TWM_LOCATION_HOST"),
        Some(&Location::Host.guest_code())
    );
    // Every integer define is one of those checked: nothing in the header goes unchecked.
    assert_eq!(
        defines.len(),
        RESULTS.len() + advice().len() + 1,
        "{defines:?}"
    );
}

#[test]
fn the_rust_guest_crate_has_the_hosts_codes() {
    let crate_results = [
        guest::codes::OK,
        guest::codes::ERR_OUT_OF_RANGE,
        guest::codes::ERR_OVERFLOW,
        guest::codes::ERR_UNKNOWN_ADVICE,
        guest::codes::ERR_UNKNOWN_DEVICE,
        guest::codes::ERR_BACKEND,
        guest::codes::ERR_NOT_DEVICE_MEMORY,
        guest::codes::ERR_UNSUPPORTED,
        guest::codes::ERR_UNKNOWN_KERNEL,
        guest::codes::ERR_BAD_ARGUMENTS,
        guest::codes::ERR_KERNEL_FAULT,
        guest::codes::ERR_BUSY,
    ];
    for ((name, host), ours) in RESULTS.into_iter().zip(crate_results) {
        assert_eq!(ours, host, "{name}");
    }
    let host = guest::Location::Host;
    let crate_advice = [
        guest::Advice::SetReadMostly,
        guest::Advice::UnsetReadMostly,
        guest::Advice::SetPreferredLocation(host),
        guest::Advice::UnsetPreferredLocation,
        guest::Advice::SetAccessedBy(host),
        guest::Advice::UnsetAccessedBy(host),
    ];
    for ((name, code), advice) in advice().into_iter().zip(crate_advice) {
        assert_eq!(advice.code(), code, "{name}");
    }
    for n in [0, 1, 7, u32::MAX] {
        assert_eq!(
            guest::Location::Device(n).code(),
            Location::Device(DeviceId(n)).guest_code()
        );
    }
    assert_eq!(guest::Location::Host.code(), Location::Host.guest_code());
}
