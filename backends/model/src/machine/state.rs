//! The machine's state: handles, queues and the work a device runs.

use super::*;

impl State {
    pub(super) fn handle(&mut self) -> u64 {
        self.next_handle += 1;
        0x7100_0000 + self.next_handle * 0x10
    }

    pub(super) fn queue_context(&self, queue: Queue) -> Option<u64> {
        match queue {
            Queue::Default(ctx) => Some(ctx),
            Queue::Stream(s) => self.streams.get(&s).map(|r| r.context),
        }
    }

    /// The allocation (managed or pool) holding `start..end`: its base and record.
    pub(super) fn containing(&self, start: usize, end: usize) -> Option<(usize, &Record)> {
        let (&base, record) = self.allocations.range(..=start).next_back()?;
        (end <= base + record.len).then_some((base, record))
    }

    pub(super) fn containing_mut(
        &mut self,
        start: usize,
        end: usize,
    ) -> Option<(usize, &mut Record)> {
        let (&base, record) = self.allocations.range_mut(..=start).next_back()?;
        (end <= base + record.len).then_some((base, record))
    }

    /// Whether `start..end` is covered by host ranges registered for `device`, one or several
    /// adjacent ones (the device maps each at its own address, so a kernel may run across the
    /// boundary of two registrations, as on a GPU; a registration without
    /// `CU_MEMHOSTREGISTER_PORTABLE` is for its context's device only).
    pub(super) fn registered_over(&self, start: usize, end: usize, device: Option<u32>) -> bool {
        let mut at = start;
        while at < end {
            let covering = self
                .registered
                .range(..=at)
                .next_back()
                .filter(|&(&base, r)| at < base + r.len && Some(r.device) == device);
            match covering {
                Some((&base, r)) => at = base + r.len,
                None => return false,
            }
        }
        true
    }

    /// Whether any registered host range overlaps `start..end`.
    pub(super) fn registration_overlaps(&self, start: usize, end: usize) -> bool {
        self.registered
            .range(..end)
            .next_back()
            .is_some_and(|(&base, r)| start < base + r.len)
    }

    /// Whether work queued anywhere but `except` touches `start..end`.
    pub(super) fn pending_over(&self, start: usize, end: usize, except: Option<Queue>) -> bool {
        self.queues
            .iter()
            .filter(|(q, _)| Some(**q) != except)
            .flat_map(|(_, w)| w)
            .any(|w| w.overlaps(start, end))
    }

    pub(super) fn is_scrub_queue(&self, queue: Queue) -> bool {
        matches!(queue, Queue::Stream(s) if self.scrub_streams.contains(&s))
    }

    /// Queues `work` on `queue`, and counts a scrub over another queue's pending work: a memset
    /// on any stream (the backends' own zeroing streams are streams like any other), or a
    /// prefetch on the model's zeroing stream.
    pub(super) fn enqueue(&mut self, queue: Queue, work: Work) {
        if matches!(work, Work::Memset { .. }) || self.is_scrub_queue(queue) {
            let [(start, end), _] = work.spans();
            if start < end && self.pending_over(start, end, Some(queue)) {
                self.stats.scrubs_over_pending_work += 1;
            }
        }
        self.queues.entry(queue).or_default().push_back(work);
    }

    /// Runs everything queued on `queue`, in order.
    pub(super) fn drain(&mut self, queue: Queue) {
        while self.run_one(queue) {}
    }

    /// Runs the oldest item queued on `queue`; `false` if there was none.
    pub(super) fn run_one(&mut self, queue: Queue) -> bool {
        let Some(work) = self.queues.get_mut(&queue).and_then(VecDeque::pop_front) else {
            self.queues.remove(&queue);
            return false;
        };
        match work {
            Work::Wait {
                event,
                generation,
                source,
            } => {
                // The device waits for the record's stream to reach the record (abandoned work,
                // after a fault, is gone from the queue and waits for nothing).
                if let Some(source) = source.filter(|&q| q != queue) {
                    while self.queues.get(&source).is_some_and(|w| {
                        w.iter().any(|w| {
                            matches!(*w, Work::Signal { event: e, generation: g }
                                if e == event && g == generation)
                        })
                    }) && self.run_one(source)
                    {}
                }
            }
            Work::Signal { event, generation } => self.signal(event, generation),
            Work::PoolFree { ptr } => self.release_pool_block(ptr),
            Work::Memset { start, end, value } => {
                if let Some(device) = self.queue_device(queue) {
                    self.place(start, end, Location::Device(DeviceId(device)));
                }
                if self.containing(start, end).is_some() {
                    let (ptr, len) = (start as *mut u8, end - start);
                    if value == 0 {
                        // SAFETY: `start..end` lies inside a live mapping of ours (found just
                        // now); a device write races host readers as it does on a GPU, which is
                        // what this simulates.
                        unsafe { host::zero(ptr, len) };
                    } else {
                        // SAFETY: as above.
                        unsafe { ptr.write_bytes(value, len) };
                    }
                }
            }
            Work::Prefetch { start, end, to } => self.place(start, end, to),
            Work::Kernel { kernel, args } => {
                let device = self
                    .queue_context(queue)
                    .and_then(|c| self.contexts.get(&c))
                    .map(|c| c.device);
                let legal = work.spans().iter().all(|&(s, e)| {
                    s == e
                        || self.containing(s, e).is_some()
                        || self.registered_over(s, e, device)
                        || (self.pageable && host::accessible(s, e - s))
                });
                if !legal || kernel.asserts(args) {
                    self.fault(queue);
                    return true;
                }
                if let Some(device) = device {
                    for (s, e) in work.spans() {
                        self.place(s, e, Location::Device(DeviceId(device)));
                    }
                }
                // SAFETY: every range the kernel touches lies inside a live mapping of ours, a
                // registered host range (pinned: mapped readable and writable while registered,
                // by `cuMemHostRegister`'s own check), or host memory found readable and writable
                // just now with pageable access on (checked just now); the launch's caller
                // guaranteed nothing else accesses them.
                unsafe { run_kernel(kernel, args) };
            }
        }
        self.stats.work_completed += 1;
        true
    }

    /// The device `queue`'s work runs on.
    fn queue_device(&self, queue: Queue) -> Option<u32> {
        self.queue_context(queue)
            .and_then(|c| self.contexts.get(&c))
            .map(|c| c.device)
    }

    /// Pages of managed memory (or of pageable system memory) in `start..end` are now at `to`:
    /// a prefetch, or device work touching them. What was elsewhere moved, and is counted (pages
    /// never placed are on the host). Device pool blocks and registered host memory never
    /// move.
    pub(super) fn place(&mut self, start: usize, end: usize, to: Location) {
        if start >= end {
            return;
        }
        let pageable = self.pageable
            && self
                .registered
                .range(..end)
                .next_back()
                .is_none_or(|(&base, r)| base + r.len <= start);
        let (moved, residency) = match self.containing_mut(start, end) {
            Some((base, record)) if record.pool.is_none() => {
                let range = start - base..end - base;
                let map = &mut record.hints.residency;
                let moved = map.bytes_where(range.clone(), |at| {
                    at.copied().unwrap_or(Location::Host) != to
                });
                map.set(range, Some(to));
                (moved, true)
            }
            Some(_) => (0, false),
            None if pageable => {
                let map = &mut self.system.residency;
                let moved =
                    map.bytes_where(start..end, |at| at.copied().unwrap_or(Location::Host) != to);
                map.set(start..end, Some(to));
                (moved, true)
            }
            None => (0, false),
        };
        if residency {
            let moved = moved as u64;
            match to {
                Location::Device(_) => self.stats.migrated_to_device_bytes += moved,
                Location::Host => self.stats.migrated_to_host_bytes += moved,
            }
        }
    }

    /// A kernel on `queue` hit an illegal address: its context is poisoned and the work queued
    /// in it is abandoned (pool frees still return their blocks, records still complete, so no
    /// memory is lost to the fault).
    pub(super) fn fault(&mut self, queue: Queue) {
        self.stats.kernel_faults += 1;
        let Some(context) = self.queue_context(queue) else {
            return;
        };
        if let Some(c) = self.contexts.get_mut(&context) {
            c.poisoned = true;
        }
        let mine: Vec<Queue> = self
            .queues
            .keys()
            .copied()
            .filter(|&q| self.queue_context(q) == Some(context))
            .collect();
        for q in mine {
            for work in self.queues.remove(&q).unwrap_or_default() {
                match work {
                    Work::PoolFree { ptr } => self.release_pool_block(ptr),
                    Work::Signal { event, generation } => self.signal(event, generation),
                    _ => {}
                }
            }
        }
    }

    /// The device reached record `generation` of `event`.
    pub(super) fn signal(&mut self, event: u64, generation: u64) {
        if let Some(e) = self.events.get_mut(&event) {
            e.completed = e.completed.max(generation);
        }
    }

    /// A pool block's free has run: kept for reuse, or given back past the release threshold
    /// (or when its pool is destroyed).
    pub(super) fn release_pool_block(&mut self, ptr: usize) {
        let Some(record) = self.allocations.remove(&ptr) else {
            return;
        };
        let Some(pool_raw) = record.pool else {
            self.allocations.insert(ptr, record);
            return;
        };
        let Some(pool) = self.pools.get_mut(&pool_raw) else {
            // Its pool is gone: the block goes back to the device at once.
            self.used[record.device as usize] -= record.mapped as u64;
            self.stats.pool_reserved_bytes -= record.mapped as u64;
            if let Some(ptr) = core::ptr::NonNull::new(ptr as *mut u8) {
                // SAFETY: a block of a pool that no longer exists, mapped with this length and
                // just taken out of the table: no one else holds it.
                unsafe { host::unmap(ptr, record.mapped) };
            }
            return;
        };
        pool.live -= 1;
        pool.cached.push(Mapping {
            address: ptr,
            mapped: record.mapped,
        });
        let keep = if pool.destroyed {
            0
        } else {
            pool.release_threshold
        };
        self.trim(pool_raw, keep);
        if let Some(pool) = self.pools.get(&pool_raw)
            && pool.destroyed
            && pool.live == 0
        {
            self.pools.remove(&pool_raw);
        }
    }

    /// Gives kept blocks of `pool` back until it holds at most `keep` bytes (or what is live).
    pub(super) fn trim(&mut self, pool_raw: u64, keep: u64) {
        while let Some(pool) = self.pools.get(&pool_raw)
            && pool.reserved > keep
        {
            // A block that queued work still targets stays (unmapping it would let the address
            // go to another allocation that the stale work would then write).
            let free = pool
                .cached
                .iter()
                .rposition(|b| !self.pending_over(b.address, b.end(), None));
            let Some(pool) = self.pools.get_mut(&pool_raw) else {
                break;
            };
            let Some(Mapping {
                address: ptr,
                mapped,
            }) = free.map(|i| pool.cached.swap_remove(i))
            else {
                break;
            };
            pool.reserved -= mapped as u64;
            self.used[pool.device as usize] -= mapped as u64;
            self.stats.pool_reserved_bytes -= mapped as u64;
            if let Some(ptr) = core::ptr::NonNull::new(ptr as *mut u8) {
                // SAFETY: a kept block of this pool, mapped with this length, held by no one.
                unsafe { host::unmap(ptr, mapped) };
            }
        }
    }
}

/// Runs a simulated kernel.
///
/// # Safety
///
/// Every range it touches lies inside a live mapping, and nothing else accesses them meanwhile
/// (beyond what a GPU's concurrent host access would race).
unsafe fn run_kernel(kernel: Kernel, args: [u64; 4]) {
    let ptr = |a: u64| a as usize as *mut u8;
    let len = |n: u64| usize::try_from(n).unwrap_or(0);
    match kernel {
        Kernel::Fill => {
            // SAFETY: the caller's contract; raw accesses, no references formed.
            unsafe { ptr(args[0]).write_bytes(args[2] as u8, len(args[1])) }
        }
        Kernel::Increment => {
            for i in 0..len(args[1]) {
                let p = ptr(args[0]).wrapping_add(i);
                // SAFETY: `i < len`, inside the checked range.
                let byte = unsafe { p.read() };
                // SAFETY: as above.
                unsafe { p.write(byte.wrapping_add(1)) };
            }
        }
        Kernel::Poke => {
            // SAFETY: `index < len` (its assert ran before), inside the checked range.
            unsafe { ptr(args[0]).wrapping_add(len(args[2])).write(args[3] as u8) }
        }
        // SAFETY: both ranges checked; `copy` allows overlap.
        Kernel::Copy => unsafe { std::ptr::copy(ptr(args[1]), ptr(args[0]), len(args[2])) },
        Kernel::Axpy => {
            let a = f32::from_bits(args[0] as u32);
            for i in 0..len(args[3]) {
                let x = ptr(args[1]).cast::<f32>().wrapping_add(i);
                let y = ptr(args[2]).cast::<f32>().wrapping_add(i);
                // SAFETY: `i < n`, inside both checked ranges (`n * 4` bytes each); unaligned
                // accesses, as device pointers need not be aligned here.
                let xv = unsafe { x.read_unaligned() };
                // SAFETY: as above.
                let yv = unsafe { y.read_unaligned() };
                // SAFETY: as above.
                unsafe { y.write_unaligned(a * xv + yv) };
            }
        }
    }
}
