//! [`GuardedHostCreator`]: linear memory in host memory with real `PROT_NONE` guard pages, which
//! honours Wasmtime's reservation and guard so compiled code can run without explicit bounds
//! checks. Host memory only: not device-accessible, and its [`Capabilities`] say so.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use tensor_wasm_mem_core::{Capabilities, MemoryPlan, MemoryType as PlanType, PlanLimits};
use wasmtime::{Config, Engine, LinearMemory, MemoryCreator, MemoryType};

use crate::config::configure;
use crate::error::TwmError;
use crate::host_mapping::{HostMapping, page_size};

/// What the guarded backing offers: host memory, zeroed, with guard pages; nothing on a device.
pub const GUARDED_CAPABILITIES: Capabilities = Capabilities {
    host_accessible: true,
    device_accessible: false,
    managed: false,
    comes_zeroed: true,
    guard_pages: true,
    concurrent_managed_access: false,
    pageable_memory_access: false,
};

/// A `MemoryCreator` of guarded host memories.
#[derive(Clone)]
pub struct GuardedHostCreator {
    limits: PlanLimits,
    created: Arc<AtomicU64>,
}

impl fmt::Debug for GuardedHostCreator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuardedHostCreator")
            .field("limits", &self.limits)
            .field("created", &self.created.load(Ordering::Relaxed))
            .finish()
    }
}

impl GuardedHostCreator {
    /// A creator planning memories under `limits`.
    #[must_use]
    pub fn new(limits: PlanLimits) -> Self {
        Self {
            limits,
            created: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Memories created so far.
    #[must_use]
    pub fn created(&self) -> u64 {
        self.created.load(Ordering::Acquire)
    }

    /// Makes `config` use the guard-page recipe ([`configure`] with [`GUARDED_CAPABILITIES`]) and
    /// installs this creator.
    pub fn install<'c>(&self, config: &'c mut Config) -> &'c mut Config {
        configure(config, &GUARDED_CAPABILITIES).with_host_memory(Arc::new(self.clone()))
    }

    /// An engine with the guard-page Config and this creator installed.
    pub fn engine(&self) -> wasmtime::Result<Engine> {
        let mut config = Config::new();
        self.install(&mut config);
        Engine::new(&config)
    }

    fn create(
        &self,
        ty: &MemoryType,
        reserved: Option<usize>,
        guard: usize,
    ) -> Result<GuardedHostMemory, TwmError> {
        crate::error::check_memory_type(ty)?;
        let plan = MemoryPlan::new(
            &PlanType {
                minimum_pages: ty.minimum(),
                maximum_pages: ty.maximum(),
                page_size_log2: ty.page_size_log2(),
                memory64: ty.is_64(),
            },
            &self.limits,
        )?;
        let capacity = plan.capacity_usize()?;
        // Reserve what Wasmtime expects (it elides checks against reservation + guard), and at
        // least our capacity; everything past the accessible size is PROT_NONE.
        let span = reserved
            .unwrap_or(0)
            .max(capacity)
            .checked_add(guard)
            .ok_or(TwmError::Plan(
                tensor_wasm_mem_core::PlanError::TooLargeForHost { bytes: u64::MAX },
            ))?;
        let mut memory = GuardedHostMemory {
            mapping: HostMapping::reserve(span)?,
            len: 0,
            accessible: 0,
            capacity,
            page: page_size(),
        };
        // On failure `memory` drops and unmaps.
        memory.grow(plan.initial_usize()?)?;
        self.created.fetch_add(1, Ordering::AcqRel);
        Ok(memory)
    }
}

// SAFETY: every memory returned is a `GuardedHostMemory` (see its `LinearMemory` impl): zero
// filled (fresh anonymous pages), with `reserved + guard` bytes of address space of which only the
// current size is accessible, so checks Wasmtime elides against its reservation and guard land on
// PROT_NONE pages and fault.
unsafe impl MemoryCreator for GuardedHostCreator {
    fn new_memory(
        &self,
        ty: MemoryType,
        _minimum: usize,
        _maximum: Option<usize>,
        reserved_size_in_bytes: Option<usize>,
        guard_size_in_bytes: usize,
    ) -> Result<Box<dyn LinearMemory>, String> {
        self.create(&ty, reserved_size_in_bytes, guard_size_in_bytes)
            .map(|m| Box::new(m) as Box<dyn LinearMemory>)
            .map_err(|e| e.to_string())
    }
}

/// One guarded host memory: a PROT_NONE reservation whose first `byte_size` bytes (rounded up to
/// host pages) are readable and writable.
pub struct GuardedHostMemory {
    mapping: HostMapping,
    len: usize,
    accessible: usize,
    capacity: usize,
    page: usize,
}

impl fmt::Debug for GuardedHostMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GuardedHostMemory")
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .field("mapped", &self.mapping.len())
            .finish()
    }
}

impl GuardedHostMemory {
    fn grow(&mut self, new_size: usize) -> Result<(), TwmError> {
        if new_size > self.capacity {
            return Err(TwmError::CapacityExceeded {
                requested: new_size,
                capacity: self.capacity,
            });
        }
        let want = new_size.next_multiple_of(self.page);
        if want > self.accessible {
            self.mapping.open(self.accessible, want - self.accessible)?;
            self.accessible = want;
        }
        self.len = self.len.max(new_size);
        Ok(())
    }
}

// SAFETY: `as_ptr` is the base of a mapping of at least `capacity + guard` bytes (and Wasmtime's
// reservation) owned by this memory until it drops (then unmapped) and never moved; `byte_size` bytes from it are readable and writable
// (mprotect'ed before `len` grows), fresh pages read as zero, and everything past the accessible
// pages is PROT_NONE up to the end of the reservation and guard.
unsafe impl LinearMemory for GuardedHostMemory {
    fn byte_size(&self) -> usize {
        self.len
    }

    fn byte_capacity(&self) -> usize {
        self.capacity
    }

    fn grow_to(&mut self, new_size: usize) -> wasmtime::Result<()> {
        self.grow(new_size).map_err(wasmtime::Error::new)
    }

    fn as_ptr(&self) -> *mut u8 {
        self.mapping.base() as *mut u8
    }
}
