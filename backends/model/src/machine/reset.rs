//! `cuDevicePrimaryCtxReset_v2`: what resetting a device's primary context destroys.

use super::*;

/// What one [`ModelDriver::reset_primary`] destroyed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ResetReport {
    /// Managed allocations freed (unmapped; their addresses may be handed out again).
    pub allocations: u64,
    /// Bytes in them.
    pub bytes: u64,
    /// Pools destroyed, with every block they held.
    pub pools: u64,
    /// Host registrations dropped (the host pages stay mapped: they are the host's).
    pub registrations: u64,
    /// Streams destroyed (the model's own zeroing stream is kept, as a backend makes its own
    /// again).
    pub streams: u64,
    /// Events destroyed.
    pub events: u64,
    /// Modules unloaded (their functions with them).
    pub modules: u64,
    /// Work items queued in the context, abandoned.
    pub abandoned_work: u64,
}

impl ModelDriver {
    /// `cuDevicePrimaryCtxReset_v2`: destroys everything made in `device`'s primary context and
    /// clears its sticky fault, as a real reset does: its managed allocations (unmapped), its
    /// pools and their blocks, its host registrations, its streams, events (those made with it
    /// current), modules and functions, and the work queued there (abandoned). The context's
    /// handle stays valid (a reset does not release the primary context) and usable at once.
    /// Contexts made with `cuCtxCreate` on the device are not touched. What was queued elsewhere
    /// over a destroyed allocation finds no memory when it runs (a kernel faults), and such a
    /// mapping is kept from reuse until the machine goes.
    ///
    /// A device failed with [`fail_device`](Self::fail_device) refuses the reset as any other
    /// call.
    ///
    /// # Safety
    ///
    /// As for freeing every allocation of the context: nothing may use them (or the host
    /// ranges' device mappings) afterwards.
    pub unsafe fn reset_primary(&self, device: DeviceId) -> Result<ResetReport, ModelError> {
        let call = Call::PrimaryCtxReset;
        let mut state = self.state();
        self.enter(&mut state, call, false)?;
        let Some(&primary) = state.primaries.get(device.0 as usize) else {
            return Err(error(call, code::INVALID_DEVICE));
        };
        Self::device_down(&state, call, device.0)?;
        let mut report = ResetReport::default();
        let scrub = state.scrub_streams[device.0 as usize];
        // The work queued in the context is abandoned (pool frees still return their blocks,
        // records still complete, as at a fault: no wait elsewhere waits forever).
        let queues: Vec<Queue> = state
            .queues
            .keys()
            .copied()
            .filter(|&q| state.queue_context(q) == Some(primary))
            .collect();
        for queue in queues {
            for work in state.queues.remove(&queue).unwrap_or_default() {
                report.abandoned_work += 1;
                match work {
                    Work::PoolFree { ptr } => state.release_pool_block(ptr),
                    Work::Signal { event, generation } => state.signal(event, generation),
                    _ => {}
                }
            }
        }
        let streams: Vec<u64> = state
            .streams
            .iter()
            .filter(|&(&h, s)| s.context == primary && h != scrub)
            .map(|(&h, _)| h)
            .collect();
        for s in streams {
            state.streams.remove(&s);
            state.stats.live_streams -= 1;
            state.stats.streams_destroyed += 1;
            report.streams += 1;
        }
        let events: Vec<u64> = state
            .events
            .iter()
            .filter(|(_, e)| e.owner == primary)
            .map(|(&h, _)| h)
            .collect();
        for e in events {
            state.events.remove(&e);
            state.stats.live_events -= 1;
            report.events += 1;
        }
        // Modules loaded with the context current.
        let modules: Vec<u64> = state
            .modules
            .iter()
            .filter(|&(_, &c)| c == primary)
            .map(|(&m, _)| m)
            .collect();
        for m in modules {
            state.modules.remove(&m);
            state.functions.retain(|_, f| f.module != m);
            report.modules += 1;
        }
        // Pools: every block goes with its pool, live or kept.
        let pools: Vec<u64> = state
            .pools
            .iter()
            .filter(|(_, p)| p.device == device.0)
            .map(|(&h, _)| h)
            .collect();
        for raw in pools {
            let Some(pool) = state.pools.remove(&raw) else {
                continue;
            };
            if !pool.destroyed {
                state.stats.live_pools -= 1;
            }
            report.pools += 1;
            let blocks: Vec<(usize, usize)> = state
                .allocations
                .iter()
                .filter(|(_, r)| r.pool == Some(raw))
                .map(|(&a, r)| (a, r.mapped))
                .chain(pool.cached.iter().map(|m| (m.address, m.mapped)))
                .collect();
            for (address, mapped) in blocks {
                if state.allocations.remove(&address).is_some() {
                    state.stats.live_pool_allocations -= 1;
                }
                state.used[device.0 as usize] -= mapped as u64;
                state.stats.pool_reserved_bytes -= mapped as u64;
                state.unmap_or_quarantine(address, mapped);
            }
        }
        // Managed allocations of the device (all made in its primary context).
        let managed: Vec<usize> = state
            .allocations
            .iter()
            .filter(|(_, r)| r.pool.is_none() && r.device == device.0)
            .map(|(&a, _)| a)
            .collect();
        for address in managed {
            let Some(record) = state.allocations.remove(&address) else {
                continue;
            };
            state.used[device.0 as usize] -= record.mapped as u64;
            state.stats.live_allocations -= 1;
            state.stats.live_bytes -= record.len as u64;
            report.allocations += 1;
            report.bytes += record.len as u64;
            state.unmap_or_quarantine(address, record.mapped);
        }
        let registrations: Vec<usize> = state
            .registered
            .iter()
            .filter(|(_, r)| r.device == device.0)
            .map(|(&a, _)| a)
            .collect();
        for address in registrations {
            if let Some(r) = state.registered.remove(&address) {
                state.stats.registered_ranges -= 1;
                state.stats.registered_bytes -= r.len as u64;
                report.registrations += 1;
            }
        }
        if let Some(c) = state.contexts.get_mut(&primary) {
            c.poisoned = false;
        }
        state.stats.primary_resets += 1;
        drop(state);
        self.late_return(call);
        Ok(report)
    }
}

impl State {
    /// Unmaps a mapping taken out of the tables, or keeps it from reuse (until the machine goes)
    /// while queued work still targets it.
    fn unmap_or_quarantine(&mut self, address: usize, mapped: usize) {
        if self.pending_over(address, address + mapped, None) {
            self.quarantine.push(Mapping { address, mapped });
        } else if let Some(p) = core::ptr::NonNull::new(address as *mut u8) {
            // SAFETY: a mapping of ours just taken out of its table; the reset's caller
            // guarantees nothing uses it afterwards, and no queued work targets it.
            unsafe { host::unmap(p, mapped) };
        }
    }
}
