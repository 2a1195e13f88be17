//! Streams and per-tenant contexts of a [`DriverBackend`]: the records, their state machines, and
//! [`StreamProvider`].
//!
//! A stream record is used by driver calls made outside the lock (a prefetch, a synchronize, a
//! pool allocation on it, a pool teardown ordered on it). Each such call holds a [`StreamUse`]
//! (the record's `busy` count) for its duration, so a release that comes meanwhile does not
//! destroy the stream under it: the release retires the record at once (no new use can start)
//! and the last use to finish destroys it. A context-isolated tenant's context is destroyed only
//! after its last stream is, so no call ever runs in a destroyed stream or context.

use crate::device::DeviceId;
use crate::driver::{DriverApi, DriverBackend, DriverContext, DriverStream, Life, Refusal};
use crate::isolation::IsolationLevel;
use crate::ledger::TenantKey;
use crate::stream::{Stream, StreamKey, StreamProvider};

/// A stream of ours.
#[derive(Debug)]
pub(super) struct StreamRecord {
    pub(super) tenant: TenantKey,
    pub(super) context: DriverContext,
    pub(super) device: DeviceId,
    /// Recorded here, never taken from a caller's handle: it decides whether a release leaves
    /// the tenant's context.
    pub(super) level: IsolationLevel,
    /// Driver calls using the stream now.
    pub(super) busy: u32,
    /// Uses ever started (a user that waits as the last one knows whether any came after).
    pub(super) started: u64,
    pub(super) life: Life,
}

/// A context-isolated tenant's context. Changed only under the state lock, so "first user makes
/// it" and "last user destroys it" are each one decision: `users` counts the tenant's streams in
/// it plus the acquirers between [`join`](DriverBackend::join_tenant_context) and their stream
/// (or their failure), and the entry leaves the table in the same step that takes `users` to 0.
#[derive(Debug)]
pub(super) struct TenantContextEntry {
    pub(super) context: Option<DriverContext>,
    /// The device its context is (or is being made) on: the first user's.
    pub(super) device: DeviceId,
    pub(super) users: u64,
    /// A kernel fault poisoned it (counted once): it goes with the tenant's last stream.
    pub(super) lost: bool,
}

impl TenantContextEntry {
    /// A new entry for a tenant's context on `device`: no context yet, no user yet.
    fn on(device: DeviceId) -> Self {
        Self {
            context: None,
            device,
            users: 0,
            lost: false,
        }
    }
}

/// One driver call's use of a stream: the stream cannot be destroyed until it is dropped.
pub(super) struct StreamUse<'b, D: DriverApi> {
    backend: &'b DriverBackend<D>,
    /// Its place in its device's gate: no reset while the stream is used (dropped after the
    /// use ends, its teardown included).
    _call: super::recovery::DeviceCall<'b>,
    /// `None`: the shared default stream (no record; never destroyed).
    raw: Option<DriverStream>,
    pub(super) context: DriverContext,
    pub(super) tenant: Option<TenantKey>,
    pub(super) device: DeviceId,
}

impl<D: DriverApi> StreamUse<'_, D> {
    /// The raw stream to enqueue on.
    pub(super) fn raw(&self) -> DriverStream {
        self.raw.unwrap_or(DriverStream::DEFAULT)
    }
}

impl<D: DriverApi> Drop for StreamUse<'_, D> {
    fn drop(&mut self) {
        if let Some(raw) = self.raw {
            // A failure is counted in the stats (no caller is left to hear of it).
            let _ = self.backend.end_use(raw, None);
        }
    }
}

impl<D: DriverApi> DriverBackend<D> {
    /// Starts a use of a stream handle of ours: checked against its live record (tenant,
    /// context and level must match), or the shared default stream.
    pub(super) fn stream_use(&self, stream: StreamKey) -> Result<StreamUse<'_, D>, Refusal> {
        self.stream_use_with(stream, false)
    }

    /// [`stream_use`](Self::stream_use), refused while a reset of the device runs, or, with
    /// `outlast_reset`, started once it is over ([`enter_teardown`](Self::enter_teardown)).
    fn stream_use_with(
        &self,
        stream: StreamKey,
        outlast_reset: bool,
    ) -> Result<StreamUse<'_, D>, Refusal> {
        let raw = stream.stream;
        let entered = if outlast_reset {
            self.enter_teardown(stream.device)
        } else {
            self.enter(stream.device, true)
        };
        let call = entered.map_err(|e| match e {
            Refusal::InvalidDevice { .. } => Refusal::UnknownStream { stream: raw },
            other => other,
        })?;
        if raw == DriverStream::DEFAULT {
            let device = stream.device;
            if matches!(stream.level, IsolationLevel::Shared)
                && device.0 < self.driver.device_count()
            {
                return Ok(StreamUse {
                    backend: self,
                    _call: call,
                    raw: None,
                    context: self.driver.primary_context(device),
                    tenant: None,
                    device,
                });
            }
            return Err(Refusal::UnknownStream { stream: raw });
        }
        let mut state = self.state.lock();
        match state.streams.get_mut(&raw) {
            Some(r)
                if r.life == Life::Live
                    && r.tenant == stream.tenant
                    && r.context == stream.context
                    && r.device == stream.device
                    && r.level == stream.level =>
            {
                r.busy += 1;
                r.started += 1;
                Ok(StreamUse {
                    backend: self,
                    _call: call,
                    raw: Some(raw),
                    context: r.context,
                    tenant: Some(r.tenant),
                    device: r.device,
                })
            }
            _ => Err(Refusal::UnknownStream { stream: raw }),
        }
    }

    /// Starts a use of the stream `raw` if it is still the live stream of `tenant` in
    /// `context` (a pool block's stream at teardown); `None` if it is gone or is another's.
    pub(super) fn stream_use_if(
        &self,
        raw: DriverStream,
        tenant: TenantKey,
        context: DriverContext,
    ) -> Option<StreamUse<'_, D>> {
        let device = self.state.lock().streams.get(&raw)?.device;
        let call = self.enter(device, true).ok()?;
        let mut state = self.state.lock();
        let r = state.streams.get_mut(&raw)?;
        // A retired stream still serves a teardown: it is waited for after its last use.
        if r.life == Life::Failed || r.tenant != tenant || r.context != context {
            return None;
        }
        r.busy += 1;
        r.started += 1;
        Some(StreamUse {
            backend: self,
            _call: call,
            raw: Some(raw),
            context: r.context,
            tenant: Some(r.tenant),
            device: r.device,
        })
    }

    /// Ends one use of `raw`. The last use of a retired stream waits for it with its use still
    /// held (the record stays in the table meanwhile, so a teardown orders its frees on the
    /// stream rather than beside it), then takes the record out and destroys it, unless another
    /// use started meanwhile (then it waits again, or that use is the last). `synced`: the
    /// caller already waited, at that `started` mark.
    pub(super) fn end_use(
        &self,
        raw: DriverStream,
        mut synced: Option<u64>,
    ) -> Result<(), D::Error> {
        loop {
            let (context, mark) = {
                let mut state = self.state.lock();
                let Some(r) = state.streams.get_mut(&raw) else {
                    return Ok(());
                };
                if r.busy > 1 || r.life != Life::Releasing {
                    r.busy = r.busy.saturating_sub(1);
                    return Ok(());
                }
                if synced == Some(r.started) {
                    let record = state.streams.remove(&raw);
                    drop(state);
                    return match record {
                        Some(record) => self.destroy_stream(raw, record),
                        None => Ok(()),
                    };
                }
                (r.context, r.started)
            };
            // A failed wait does not keep the stream (as in `destroy_stream`).
            let _ = self.in_context(context, |d| d.synchronize(raw));
            synced = Some(mark);
        }
    }

    /// Destroys a stream that was waited for and that no one uses any more (its record already
    /// out of the table), and leaves its tenant's context if it was context-isolated. If the
    /// driver refuses the destroy, the record goes back, retired, counted and retried at drop.
    fn destroy_stream(&self, raw: DriverStream, record: StreamRecord) -> Result<(), D::Error> {
        if let Err(e) = self.in_context(record.context, |d| d.stream_destroy(raw)) {
            let (tenant, level) = (record.tenant, record.level);
            {
                let mut state = self.state.lock();
                state.streams.insert(
                    raw,
                    StreamRecord {
                        life: Life::Failed,
                        busy: 0,
                        ..record
                    },
                );
                state.release_failed(true);
            }
            if level == IsolationLevel::ContextIsolated {
                // The tenant's own context goes all the same once its last user leaves, and
                // takes the refused stream with it (a context poisoned by a kernel fault refuses
                // every call but its own destroy: this is how it recovers).
                let _ = self.leave_tenant_context(tenant);
            }
            return Err(e);
        }
        self.state.lock().stats.live_streams -= 1;
        if record.level == IsolationLevel::ContextIsolated {
            self.leave_tenant_context(record.tenant)?;
        }
        Ok(())
    }

    /// Joins `tenant`'s context on `device`, making it if the tenant has none: one more user
    /// until [`leave_tenant_context`](Self::leave_tenant_context).
    ///
    /// The context is made outside the lock (it is slow on a GPU). Two first users of one tenant
    /// may both make one; the first to install it wins and the other destroys its own, so the
    /// tenant is only ever handed one (the driver holds both for that moment).
    fn join_tenant_context(
        &self,
        tenant: TenantKey,
        device: DeviceId,
    ) -> Result<DriverContext, D::Error> {
        let installed = {
            let mut state = self.state.lock();
            let entry = state
                .contexts
                .entry(tenant)
                .or_insert_with(|| TenantContextEntry::on(device));
            if entry.device != device {
                // Handed its context on the other device, the stream would be made there and
                // recorded here (the entry has users: it is not empty).
                return Err(Refusal::ContextOnAnotherDevice {
                    device,
                    context_device: entry.device,
                }
                .into());
            }
            entry.users += 1;
            entry.context
        };
        if let Some(context) = installed {
            return Ok(context);
        }
        let made = match self.driver.context_create(device) {
            Ok(made) => made,
            Err(e) => {
                // A failed leave is counted where it happens; the creation error is the answer.
                let _ = self.leave_tenant_context(tenant);
                return Err(e);
            }
        };
        let mut state = self.state.lock();
        // This call's user keeps the entry in the table.
        let entry = state
            .contexts
            .entry(tenant)
            .or_insert_with(|| TenantContextEntry::on(device));
        match entry.context {
            Some(installed) => {
                drop(state);
                // The other user's context serves; a failed destroy of ours is counted there.
                let _ = self.destroy_context(made);
                Ok(installed)
            }
            None => {
                entry.context = Some(made);
                state.stats.live_contexts += 1;
                Ok(made)
            }
        }
    }

    /// One user of `tenant`'s context leaves; the last one destroys it.
    fn leave_tenant_context(&self, tenant: TenantKey) -> Result<(), D::Error> {
        let last = {
            let mut state = self.state.lock();
            let Some(entry) = state.contexts.get_mut(&tenant) else {
                return Ok(());
            };
            entry.users = entry.users.saturating_sub(1);
            if entry.users > 0 {
                return Ok(());
            }
            let context = state.contexts.remove(&tenant).and_then(|e| e.context);
            if context.is_some() {
                state.stats.live_contexts -= 1;
            }
            context
        };
        match last {
            Some(context) => self.destroy_context(context),
            None => Ok(()),
        }
    }

    /// Destroys a context no one uses; if the driver refuses, it stays counted and retired.
    /// Destroyed, it takes with it the streams in it whose destroy the driver refused before.
    fn destroy_context(&self, context: DriverContext) -> Result<(), D::Error> {
        match self.driver.context_destroy(context) {
            Ok(()) => {
                let mut state = self.state.lock();
                let before = state.streams.len();
                state
                    .streams
                    .retain(|_, r| !(r.context == context && r.life == Life::Failed));
                let gone = (before - state.streams.len()) as u64;
                state.stats.live_streams -= gone;
                state.stats.pending_releases = state.stats.pending_releases.saturating_sub(gone);
                Ok(())
            }
            Err(e) => {
                let mut state = self.state.lock();
                state.retired_contexts.push(context);
                state.stats.live_contexts += 1;
                state.release_failed(true);
                Err(e)
            }
        }
    }
}

impl<D: DriverApi> StreamProvider for DriverBackend<D> {
    fn acquire_stream_on(
        &self,
        tenant: TenantKey,
        level: IsolationLevel,
        device: DeviceId,
    ) -> Result<Stream, D::Error> {
        let _call = self.enter(device, false)?;
        let context = match level {
            IsolationLevel::Shared => {
                let primary = self.driver.primary_context(device);
                return Ok(
                    Stream::new(DriverStream::DEFAULT, primary, level, tenant).on_device(device)
                );
            }
            IsolationLevel::StreamIsolated => self.driver.primary_context(device),
            IsolationLevel::ContextIsolated => self.join_tenant_context(tenant, device)?,
        };
        match self.in_context(context, D::stream_create) {
            Ok(raw) => {
                let record = StreamRecord {
                    tenant,
                    context,
                    device,
                    level,
                    busy: 0,
                    started: 0,
                    life: Life::Live,
                };
                let mut state = self.state.lock();
                // A handle the driver still holds is never handed out again, so nothing of
                // ours is under `raw`: releases take their record out before destroying.
                state.streams.insert(raw, record);
                state.stats.live_streams += 1;
                Ok(Stream::new(raw, context, level, tenant).on_device(device))
            }
            Err(e) => {
                if level == IsolationLevel::ContextIsolated {
                    // A failed leave is counted where it happens; the creation error is the
                    // answer.
                    let _ = self.leave_tenant_context(tenant);
                }
                Err(e)
            }
        }
    }

    fn release_stream(&self, stream: Stream) -> Result<(), D::Error> {
        let raw = stream.driver_stream();
        if raw == DriverStream::DEFAULT {
            // Nothing to destroy, but the tenant's work on the shared stream must be done
            // before its memory is scrubbed or freed (on the device's non-blocking zeroing
            // stream, which the legacy default stream does not order): wait for the default
            // stream, and with it for what other shared tenants queued. A reset under way is
            // waited out (`enter_teardown`): a release refused for it would leave the memory
            // kept as if its work might still run.
            let using = self.stream_use_with(stream.key(), true)?;
            return self.in_context(using.context, |d| d.synchronize(DriverStream::DEFAULT));
        }
        // No reset of its device while the release runs (the record leaves the table below);
        // one under way is waited out, never a refusal that would leave the record live with
        // no handle left to release it (every later recovery would count it in use).
        let _call = self.enter_teardown(stream.device())?;
        // Retired under the lock (no new use but a teardown's starts), then waited for with a
        // use of its own held; the last use takes the record out and destroys the stream.
        let (context, mark) = {
            let mut state = self.state.lock();
            let Some(r) = state.streams.get_mut(&raw).filter(|r| {
                r.life == Life::Live
                    && r.tenant == stream.tenant_key()
                    && r.context == stream.driver_context()
                    && r.device == stream.device()
                    && r.level == stream.level()
            }) else {
                return Err(Refusal::UnknownStream { stream: raw }.into());
            };
            r.life = Life::Releasing;
            r.busy += 1;
            r.started += 1;
            (r.context, r.started)
        };
        let waited = self.in_context(context, |d| d.synchronize(raw));
        let ended = self.end_use(raw, Some(mark));
        ended.and(waited)
    }

    fn wait_for(&self, stream: StreamKey) -> Result<(), D::Error> {
        // A stream in a tenant's own context outlives a reset of the device's primary context,
        // and so may its work: a reset under way is waited out, not answered as a lost context
        // (a caller would take the work for abandoned, and give its memory back under it). A
        // primary-context stream's work ends with the reset: that refusal stands.
        let own_context = stream.device.0 < self.driver.device_count()
            && stream.context != self.driver.primary_context(stream.device);
        let using = self.stream_use_with(stream, own_context)?;
        self.in_context(using.context, |d| d.synchronize(using.raw()))
    }
}
