//! A WASI guest's host resources are limited per Store (`WasiLimits`): descriptors past the
//! limit are `EMFILE` while the host keeps its own, a poll past its subscriptions is `EINVAL`
//! before anything is read, the resource table has a ceiling, and a read-only preopen cannot be
//! written through.

use std::sync::Arc;

use tensor_wasm_mem_core::IsolationLevel;
use tensor_wasm_mem_mock::MockBackend;
use tensor_wasm_mem_wasmtime::wasi::{
    FsPerms, LimitedWasi, WasiCtxBuilder, WasiLimits, add_wasi_to_linker,
};
use tensor_wasm_mem_wasmtime::wasmtime::{Instance, Linker, Module, Result, Store};
use tensor_wasm_mem_wasmtime::{
    ChargeMode, Tenant, TenantStore, TensorWasmMemoryCreator, instantiate, new_store,
};

const EMFILE: i32 = 33;
const EINVAL: i32 = 28;
const CREATE: i32 = 1;
const TRUNCATE: i32 = 8;
/// `fd_read`, `fd_seek`, `fd_tell`, `fd_filestat_get`: what reading a file needs.
const READ: i64 = (1 << 1) | (1 << 2) | (1 << 5) | (1 << 21);
/// Every right preview 1 defines.
const ALL: i64 = 0x1FFF_FFFF;

const GUEST: &str = r#"(module
  (import "wasi_snapshot_preview1" "path_open"
    (func $open (param i32 i32 i32 i32 i32 i64 i64 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "poll_oneoff"
    (func $poll (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_symlink"
    (func $symlink (param i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write"
    (func $write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_filestat_set_size"
    (func $set_size (param i32 i64) (result i32)))
  (import "wasi_snapshot_preview1" "path_rename"
    (func $rename (param i32 i32 i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_unlink_file"
    (func $unlink (param i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_create_directory"
    (func $mkdir (param i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "path_remove_directory"
    (func $rmdir (param i32 i32 i32) (result i32)))
  (memory (export "memory") 2)
  (data (i32.const 16) "file.txt")
  (data (i32.const 32) "../../../../../../../../etc/passwd")
  (data (i32.const 80) "escape")
  (data (i32.const 96) "other.txt")
  (data (i32.const 112) "moved")
  (data (i32.const 128) "made")
  (data (i32.const 144) "sub")
  (data (i32.const 160) "y")
  ;; One iovec: the byte at 160.
  (data (i32.const 176) "\a0\00\00\00\01\00\00\00")
  ;; Opens file.txt with every right (no flags): the errno, the descriptor at 8.
  (func $open_file (result i32)
    (call $open (i32.const 3) (i32.const 0) (i32.const 16) (i32.const 8) (i32.const 0)
      (i64.const 0x1FFFFFFF) (i64.const 0x1FFFFFFF) (i32.const 0) (i32.const 8)))
  ;; Writes "y" into file.txt: the errno of the open or the write.
  (func (export "write_file") (result i32) (local $e i32)
    (local.set $e (call $open_file))
    (if (local.get $e) (then (return (local.get $e))))
    (call $write (i32.load (i32.const 8)) (i32.const 176) (i32.const 1) (i32.const 184)))
  ;; Truncates file.txt to 0 bytes through a descriptor: the errno of the open or the call.
  (func (export "truncate_file") (result i32) (local $e i32)
    (local.set $e (call $open_file))
    (if (local.get $e) (then (return (local.get $e))))
    (call $set_size (i32.load (i32.const 8)) (i64.const 0)))
  (func (export "rename_file") (result i32)
    (call $rename (i32.const 3) (i32.const 96) (i32.const 9) (i32.const 3) (i32.const 112)
      (i32.const 5)))
  (func (export "unlink_file") (result i32)
    (call $unlink (i32.const 3) (i32.const 16) (i32.const 8)))
  (func (export "make_dir") (result i32)
    (call $mkdir (i32.const 3) (i32.const 128) (i32.const 4)))
  (func (export "remove_dir") (result i32)
    (call $rmdir (i32.const 3) (i32.const 144) (i32.const 3)))
  ;; Makes the symlink "escape" -> ../../(...)/etc/passwd: the errno.
  (func (export "symlink_out") (result i32)
    (call $symlink (i32.const 32) (i32.const 34) (i32.const 3) (i32.const 80) (i32.const 6)))
  ;; Opens "escape", following symlinks: the errno.
  (func (export "follow") (result i32)
    (call $open (i32.const 3) (i32.const 1) (i32.const 80) (i32.const 6) (i32.const 0)
      (i64.const 2) (i64.const 2) (i32.const 0) (i32.const 8)))
  ;; Opens file.txt in the preopen (fd 3) until refused or $max opens: the count at 0, the
  ;; refusal's errno (0 if none) returned.
  (func (export "open_until_refused") (param $max i32) (param $oflags i32) (param $rights i64)
    (result i32)
    (local $n i32) (local $e i32)
    (block $done
      (loop $again
        (br_if $done (i32.ge_u (local.get $n) (local.get $max)))
        (local.set $e (call $open (i32.const 3) (i32.const 0) (i32.const 16) (i32.const 8)
          (local.get $oflags) (local.get $rights) (local.get $rights) (i32.const 0)
          (i32.const 8)))
        (br_if $done (local.get $e))
        (local.set $n (i32.add (local.get $n) (i32.const 1)))
        (br $again)))
    (i32.store (i32.const 0) (local.get $n))
    (local.get $e))
  (func (export "opened") (result i32) (i32.load (i32.const 0)))
  ;; One poll of $n subscriptions at 4096 (the first $fill of them clocks with timeout 0),
  ;; events at 65536.
  (func (export "poll") (param $fill i32) (param $n i32) (result i32)
    (local $i i32)
    (block $done
      (loop $next
        (br_if $done (i32.ge_u (local.get $i) (local.get $fill)))
        (i32.store
          (i32.add (i32.const 4112) (i32.mul (local.get $i) (i32.const 48)))
          (i32.const 1))
        (local.set $i (i32.add (local.get $i) (i32.const 1)))
        (br $next)))
    (call $poll (i32.const 4096) (i32.const 65536) (local.get $n) (i32.const 12))))"#;

type Data = TenantStore<MockBackend, LimitedWasi>;

struct Guest {
    store: Store<Data>,
    instance: Instance,
    dir: TempDir,
}

struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn guest(limits: WasiLimits, perms: FsPerms) -> Guest {
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("twm-wasi-limits-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    std::fs::write(dir.join("file.txt"), b"x").expect("file");
    std::fs::write(dir.join("other.txt"), b"o").expect("file");
    std::fs::create_dir(dir.join("sub")).expect("directory");
    let creator = TensorWasmMemoryCreator::builder(Arc::new(MockBackend::default()))
        .build()
        .expect("creator");
    let engine = creator.engine().expect("engine");
    let mut linker = Linker::new(&engine);
    add_wasi_to_linker(&mut linker).expect("wasi");
    let module = Module::new(&engine, GUEST).expect("module");
    let tenant = Tenant::new(1, "guest", 64 << 20, IsolationLevel::StreamIsolated);
    let mut builder = WasiCtxBuilder::new();
    builder.preopened_dir(&dir, ".", perms).expect("preopen");
    let wasi = LimitedWasi {
        ctx: builder.build_p1(),
        limits,
    };
    let mut store = new_store(
        &engine,
        TenantStore::new(&creator, &tenant, ChargeMode::Touched, wasi),
    );
    let instance = instantiate(&mut store, &linker, &module).expect("instance");
    Guest {
        store,
        instance,
        dir: TempDir(dir),
    }
}

impl Guest {
    /// Opens until refused (at most `max` times) with `oflags` and `rights`: the errno.
    fn open(&mut self, max: i32, oflags: i32, rights: i64) -> Result<i32> {
        self.instance
            .get_typed_func::<(i32, i32, i64), i32>(&mut self.store, "open_until_refused")?
            .call(&mut self.store, (max, oflags, rights))
    }

    /// One poll of `n` subscriptions (the first 1000 at most filled in): the errno.
    fn poll(&mut self, n: i32) -> Result<i32> {
        self.instance
            .get_typed_func::<(i32, i32), i32>(&mut self.store, "poll")?
            .call(&mut self.store, (n.clamp(0, 1000), n))
    }

    fn nullary(&mut self, name: &str) -> Result<i32> {
        self.instance
            .get_typed_func::<(), i32>(&mut self.store, name)?
            .call(&mut self.store, ())
    }

    fn opened(&mut self) -> i32 {
        self.instance
            .get_typed_func::<(), i32>(&mut self.store, "opened")
            .expect("opened")
            .call(&mut self.store, ())
            .expect("opened")
    }
}

/// The process's descriptors open on `dir` or a file in it (the guest's only): other tests of
/// this binary open and close their own at the same time.
fn descriptors_in(dir: &std::path::Path) -> usize {
    std::fs::read_dir("/proc/self/fd").map_or(0, |fds| {
        fds.filter_map(Result::ok)
            .filter_map(|fd| std::fs::read_link(fd.path()).ok())
            .filter(|target| target.starts_with(dir))
            .count()
    })
}

#[test]
fn past_its_descriptor_limit_a_guest_gets_emfile_and_the_host_keeps_its_own() {
    let limits = WasiLimits {
        descriptors: 16,
        ..WasiLimits::DEFAULT
    };
    let mut guest = guest(limits, FsPerms::ReadWrite);
    let dir = guest.dir.0.clone();
    let before = descriptors_in(&dir);
    let errno = guest.open(10_000, 0, ALL).expect("no trap");
    let opened = guest.opened();
    assert_eq!(errno, EMFILE, "refused with EMFILE after {opened} opens");
    assert_eq!(
        opened, 12,
        "stdio and the preopen count against the 16, from the first call on"
    );
    // The host's descriptors grew by what the guest holds, no more, and the host still opens.
    let held = descriptors_in(&dir) - before;
    assert!(held <= 16, "the guest holds {held} host descriptors");
    let host_file = std::fs::File::open("/proc/self/status").expect("the host still opens files");
    drop(host_file);
    // Refused again, as often as asked: nothing is opened past the limit.
    assert_eq!(guest.open(10_000, 0, ALL).unwrap(), EMFILE);
    assert_eq!(guest.opened(), 0);
    drop(guest.store);
    assert_eq!(
        descriptors_in(&dir),
        0,
        "every descriptor went with the Store"
    );
}

#[test]
fn under_its_limit_a_guest_opens_what_it_asks() {
    let mut guest = guest(WasiLimits::DEFAULT, FsPerms::ReadWrite);
    assert_eq!(guest.open(100, 0, ALL).unwrap(), 0);
    assert_eq!(guest.opened(), 100);
}

#[test]
fn a_poll_past_its_subscription_limit_is_einval_before_anything_is_read() {
    let limits = WasiLimits {
        poll_subscriptions: 256,
        ..WasiLimits::DEFAULT
    };
    let mut guest = guest(limits, FsPerms::ReadWrite);
    assert_eq!(guest.poll(1).unwrap(), 0, "one clock: answered");
    assert_eq!(guest.poll(256).unwrap(), 0, "at the limit: answered");
    assert_eq!(guest.poll(257).unwrap(), EINVAL);
    assert_eq!(guest.poll(1000).unwrap(), EINVAL);
    assert_eq!(guest.poll(-1).unwrap(), EINVAL, "a count past i32");
}

#[test]
fn the_resource_table_has_a_ceiling_of_its_own() {
    let limits = WasiLimits {
        descriptors: 1000,
        poll_subscriptions: 1000,
        resources: 8,
    };
    let mut guest = guest(limits, FsPerms::ReadWrite);
    // A descriptor limit above the table's ceiling counts as the ceiling: opening stops with
    // the errno a program handles, not a trap.
    assert_eq!(limits.open_files(), 8);
    assert_eq!(guest.open(10_000, 0, ALL).expect("no trap"), EMFILE);
    let opened = guest.opened();
    assert!((1..8).contains(&opened), "{opened} opened");
    // Anything else that would add an entry past the ceiling (a poll's clocks) traps.
    let error = guest
        .poll(4)
        .expect_err("a call past the table's ceiling traps");
    assert!(
        format!("{error:?}").contains("resource table has no free keys"),
        "{error:?}"
    );
}

/// Every way preview 1 changes a directory or a file: each call's errno.
fn every_change(guest: &mut Guest) -> Vec<(&'static str, i32)> {
    let mut errnos = vec![
        ("O_CREAT", guest.open(1, CREATE, ALL).unwrap()),
        ("O_TRUNC", guest.open(1, TRUNCATE, ALL).unwrap()),
    ];
    for name in [
        "write_file",
        "truncate_file",
        "make_dir",
        "remove_dir",
        "rename_file",
        "unlink_file",
        "symlink_out",
    ] {
        errnos.push((name, guest.nullary(name).unwrap()));
    }
    errnos
}

/// The names in `dir`, sorted, and file.txt's bytes.
fn contents(dir: &std::path::Path) -> (Vec<String>, Option<Vec<u8>>) {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    (names, std::fs::read(dir.join("file.txt")).ok())
}

#[test]
fn a_read_only_preopen_cannot_be_written_through() {
    let mut guest = guest(WasiLimits::DEFAULT, FsPerms::ReadOnly);
    let before = contents(&guest.dir.0);
    // Reading is allowed.
    assert_eq!(guest.open(1, 0, READ).unwrap(), 0);
    // Every change is refused with an errno (no trap), and nothing on the host changes.
    for (call, errno) in every_change(&mut guest) {
        assert_ne!(errno, 0, "{call} in a read-only preopen is refused");
    }
    assert_eq!(contents(&guest.dir.0), before);
    assert_eq!(before.1.as_deref(), Some(&b"x"[..]));
}

#[test]
fn a_writable_preopen_takes_every_change_the_read_only_one_refuses() {
    // The same calls succeed with write access: the refusals above are the permission's.
    let mut guest = guest(WasiLimits::DEFAULT, FsPerms::ReadWrite);
    for (call, errno) in every_change(&mut guest) {
        assert_eq!(errno, 0, "{call} in a writable preopen");
    }
    let (names, file) = contents(&guest.dir.0);
    assert_eq!(names, ["escape", "made", "moved"]);
    assert_eq!(file, None, "file.txt was unlinked");
}

#[test]
fn a_guest_may_make_a_symlink_out_of_its_preopen_but_not_follow_it() {
    let mut writable = guest(WasiLimits::DEFAULT, FsPerms::ReadWrite);
    assert_eq!(
        writable.nullary("symlink_out").unwrap(),
        0,
        "made (docs/SAFETY.md)"
    );
    let link = writable.dir.0.join("escape");
    assert!(link.symlink_metadata().is_ok_and(|m| m.is_symlink()));
    assert_ne!(writable.nullary("follow").unwrap(), 0, "never followed");
    // A read-only preopen refuses to make one.
    let mut read_only = guest(WasiLimits::DEFAULT, FsPerms::ReadOnly);
    assert_ne!(read_only.nullary("symlink_out").unwrap(), 0);
    assert!(read_only.dir.0.join("escape").symlink_metadata().is_err());
}
