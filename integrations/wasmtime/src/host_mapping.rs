//! Host virtual memory with guard pages: the raw system calls of the guarded backings
//! ([`GuardedHostCreator`](crate::GuardedHostCreator) and the device-visible guarded backing),
//! in one place.

use crate::error::TwmError;

/// The host page size.
pub(crate) fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size)
        .ok()
        .filter(|&s| s > 0)
        .unwrap_or(4096)
}

/// One reservation of host address space, `PROT_NONE` until parts of it are opened with
/// [`open`](Self::open); unmapped on drop. Lazily committed: address space costs nothing until
/// a page is touched.
#[derive(Debug)]
pub(crate) struct HostMapping {
    base: usize,
    len: usize,
    /// Left mapped at drop (the driver still holds part of it).
    kept: bool,
}

impl HostMapping {
    /// Reserves `len` bytes (rounded up to whole pages, at least one).
    pub(crate) fn reserve(len: usize) -> Result<Self, TwmError> {
        let page = page_size();
        let len = len
            .checked_next_multiple_of(page)
            .ok_or(TwmError::Plan(
                tensor_wasm_mem_core::PlanError::TooLargeForHost { bytes: len as u64 },
            ))?
            .max(page);
        // SAFETY: an anonymous private PROT_NONE mapping at an address of the kernel's choice
        // touches no existing memory; the result is checked.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(TwmError::HostMapping(std::io::Error::last_os_error()));
        }
        Ok(Self {
            base: ptr as usize,
            len,
            kept: false,
        })
    }

    /// Leaves the reservation mapped when this value drops: for address space a driver still
    /// holds registered, which must not be unmapped (nor reused) under it.
    pub(crate) fn keep_mapped(&mut self) {
        self.kept = true;
    }

    /// The first byte.
    pub(crate) fn base(&self) -> usize {
        self.base
    }

    /// Bytes reserved (a whole number of pages).
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Page-aligned `offset..offset + len` of the reservation, or an error naming the range.
    fn range(&self, offset: usize, len: usize) -> Result<*mut libc::c_void, TwmError> {
        let page = page_size();
        let inside = offset.checked_add(len).is_some_and(|end| {
            end <= self.len && offset.is_multiple_of(page) && len.is_multiple_of(page)
        });
        if inside {
            Ok((self.base + offset) as *mut libc::c_void)
        } else {
            Err(TwmError::GuestRange(
                tensor_wasm_mem_core::RangeError::OutOfBounds {
                    offset: offset as u64,
                    len: len as u64,
                    bound: self.len as u64,
                },
            ))
        }
    }

    /// Makes page-aligned `offset..offset + len` readable and writable.
    pub(crate) fn open(&self, offset: usize, len: usize) -> Result<(), TwmError> {
        self.protect(offset, len, libc::PROT_READ | libc::PROT_WRITE)
    }

    /// Makes page-aligned `offset..offset + len` inaccessible again (a guard).
    pub(crate) fn close(&self, offset: usize, len: usize) -> Result<(), TwmError> {
        self.protect(offset, len, libc::PROT_NONE)
    }

    fn protect(&self, offset: usize, len: usize, prot: libc::c_int) -> Result<(), TwmError> {
        if len == 0 {
            return Ok(());
        }
        let at = self.range(offset, len)?;
        // SAFETY: `at..at + len` lies inside our own mapping, page-aligned (checked by `range`).
        if unsafe { libc::mprotect(at, len, prot) } != 0 {
            return Err(TwmError::HostMapping(std::io::Error::last_os_error()));
        }
        Ok(())
    }

    /// Drops the pages of page-aligned `offset..offset + len` (`MADV_DONTNEED`): they read as
    /// zeros afterwards and hold no memory, as Wasmtime's pooling allocator scrubs a slot.
    ///
    /// # Safety
    ///
    /// No one may hold a reference into the range, and no device may use it (registered host
    /// memory must be unregistered first: a pinned page would keep its old contents for the
    /// device while the host sees a fresh zero page).
    pub(crate) unsafe fn discard(&self, offset: usize, len: usize) -> Result<(), TwmError> {
        if len == 0 {
            return Ok(());
        }
        let at = self.range(offset, len)?;
        // SAFETY: inside our own private anonymous mapping (checked); the caller guarantees no
        // one uses the range.
        if unsafe { libc::madvise(at, len, libc::MADV_DONTNEED) } != 0 {
            return Err(TwmError::HostMapping(std::io::Error::last_os_error()));
        }
        Ok(())
    }
}

impl Drop for HostMapping {
    fn drop(&mut self) {
        if self.kept {
            return;
        }
        // SAFETY: `base..base + len` is exactly the mapping made in `reserve`, used by no one
        // once its owner drops it.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}
