//! The only raw system calls of the mock: anonymous private mappings, which the kernel backs
//! lazily with zero pages, so address space costs nothing until touched.

use core::ptr::NonNull;

/// The host page size.
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size)
        .ok()
        .filter(|&s| s > 0)
        .unwrap_or(4096)
}

/// Reserves `len` bytes of zero-filled, read-write, lazily committed memory.
pub(crate) fn map(len: usize) -> Result<NonNull<u8>, i32> {
    // SAFETY: an anonymous private mapping at an address of the kernel's choice touches no
    // existing memory; the result is checked below.
    let ptr = unsafe {
        libc::mmap(
            core::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
    }
    NonNull::new(ptr.cast()).ok_or(libc::ENOMEM)
}

/// Unmaps a mapping made by [`map`].
///
/// # Safety
///
/// `ptr..ptr + len` must be exactly one mapping returned by [`map`], not used afterwards.
pub(crate) unsafe fn unmap(ptr: NonNull<u8>, len: usize) {
    // SAFETY: guaranteed by the caller.
    let rc = unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
    debug_assert_eq!(rc, 0, "munmap of a mapping we made failed");
}

/// Zeroes `ptr..ptr + len`, giving whole pages back to the kernel (they read as zero afterwards
/// and cost no resident memory) and writing zeros to the partial pages at the edges.
///
/// # Safety
///
/// The range must lie inside one mapping made by [`map`], with no concurrent access.
pub(crate) unsafe fn zero(ptr: *mut u8, len: usize) {
    const MADVISE_FROM: usize = 256 << 10;
    let page = page_size();
    let start = ptr as usize;
    let end = start + len;
    let inner_start = start.next_multiple_of(page);
    let inner_end = end / page * page;
    if len >= MADVISE_FROM && inner_end > inner_start {
        // SAFETY: the caller guarantees the range is ours and unaliased; the edges lie inside it.
        unsafe { ptr.write_bytes(0, inner_start - start) };
        // SAFETY: whole pages inside a private anonymous mapping of ours; MADV_DONTNEED makes
        // them read as zero-fill-on-demand pages.
        let rc = unsafe {
            libc::madvise(
                inner_start as *mut libc::c_void,
                inner_end - inner_start,
                libc::MADV_DONTNEED,
            )
        };
        if rc == 0 {
            // SAFETY: as above, the tail edge lies inside the range.
            unsafe { (inner_end as *mut u8).write_bytes(0, end - inner_end) };
            return;
        }
    }
    // SAFETY: guaranteed by the caller.
    unsafe { ptr.write_bytes(0, len) };
}

/// Whether every page of `start..start + len` is mapped readable in this process (what a device
/// reaching host memory through its page tables, or pinning it, needs). Each page's first byte
/// is read with `process_vm_readv` on ourselves, which answers `EFAULT` for an inaccessible page
/// instead of raising a signal. Writability is not checked: the memory the model is shown is
/// mapped read-write or `PROT_NONE`, never read-only.
pub(crate) fn accessible(start: usize, len: usize) -> bool {
    if len == 0 {
        return true;
    }
    let page = page_size();
    let Some(end) = start.checked_add(len) else {
        return false;
    };
    let mut at = start;
    // SAFETY: getpid has no preconditions.
    let pid = unsafe { libc::getpid() };
    while at < end {
        let mut byte = 0u8;
        let local = libc::iovec {
            iov_base: (&raw mut byte).cast(),
            iov_len: 1,
        };
        let remote = libc::iovec {
            iov_base: at as *mut libc::c_void,
            iov_len: 1,
        };
        // SAFETY: `local` is one valid byte of ours; the kernel checks `remote` and answers an
        // error for an address that is not readable, touching nothing.
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        if n != 1 {
            return false;
        }
        at = (at / page + 1) * page;
    }
    true
}
