//! The [`StreamProvider`] trait: which stream (and context) an instance's GPU work goes to.

use crate::device::DeviceId;
use crate::driver::{DriverContext, DriverStream};
use crate::error::ErrorType;
use crate::isolation::IsolationLevel;
use crate::ledger::{TenantId, TenantKey};

/// The raw value of the shared (default) stream.
pub const DEFAULT_STREAM: u64 = 0;

/// A stream handle: the backend's stream and its context (typed driver handles) plus what it
/// was made for.
///
/// Not `Clone`: [`StreamProvider::release_stream`] takes it by value.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct Stream {
    stream: DriverStream,
    context: DriverContext,
    level: IsolationLevel,
    tenant: TenantKey,
    device: DeviceId,
}

impl Stream {
    /// Builds a handle (for backends), on device 0 (see [`on_device`](Self::on_device)).
    #[must_use]
    pub const fn new(
        stream: DriverStream,
        context: DriverContext,
        level: IsolationLevel,
        tenant: TenantKey,
    ) -> Self {
        Self {
            stream,
            context,
            level,
            tenant,
            device: DeviceId(0),
        }
    }

    /// The driver stream.
    #[must_use]
    pub const fn driver_stream(&self) -> DriverStream {
        self.stream
    }

    /// The driver context the stream lives in.
    #[must_use]
    pub const fn driver_context(&self) -> DriverContext {
        self.context
    }

    /// The same handle, on `device` (for backends).
    #[must_use]
    pub const fn on_device(self, device: DeviceId) -> Self {
        Self { device, ..self }
    }

    /// The device its work runs on.
    #[must_use]
    pub const fn device(&self) -> DeviceId {
        self.device
    }

    /// The stream's value for a foreign call (`CUstream` as an integer; [`DEFAULT_STREAM`] is
    /// the default stream): what an embedder's own driver code launches on.
    #[must_use]
    pub const fn raw(&self) -> u64 {
        self.stream.raw()
    }

    /// The context's value for a foreign call (`CUcontext` as an integer).
    #[must_use]
    pub const fn context(&self) -> u64 {
        self.context.raw()
    }

    /// The isolation level it was acquired for.
    #[must_use]
    pub const fn level(&self) -> IsolationLevel {
        self.level
    }

    /// The id of the tenant it was acquired for.
    #[must_use]
    pub const fn tenant(&self) -> TenantId {
        self.tenant.id()
    }

    /// The identity of the tenant it was acquired for (what backends check).
    #[must_use]
    pub const fn tenant_key(&self) -> TenantKey {
        self.tenant
    }

    /// `true` for the shared default stream.
    #[must_use]
    pub const fn is_shared(&self) -> bool {
        matches!(self.level, IsolationLevel::Shared)
    }

    /// Its key: what names it without owning it (to wait for it later).
    #[must_use]
    pub const fn key(&self) -> StreamKey {
        StreamKey {
            stream: self.stream,
            context: self.context,
            level: self.level,
            tenant: self.tenant,
            device: self.device,
        }
    }
}

/// What names a stream without owning it: a stream's identity (driver stream, context,
/// isolation level, tenant, device), to wait for its work with [`StreamProvider::wait_for`].
///
/// A key cannot release its stream, and a provider checks it like a [`Stream`]: a key whose
/// stream was released (or was never handed out) is refused, never trusted. It is what a
/// record that must wait for a stream it does not own keeps (a Store's guest streams, waited
/// for before that Store's memory is freed), where a copy of the [`Stream`] would be a second
/// owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StreamKey {
    pub(crate) stream: DriverStream,
    pub(crate) context: DriverContext,
    pub(crate) level: IsolationLevel,
    pub(crate) tenant: TenantKey,
    pub(crate) device: DeviceId,
}

impl StreamKey {
    /// The device its work runs on.
    #[must_use]
    pub const fn device(&self) -> DeviceId {
        self.device
    }
}

/// Hands out streams by isolation level.
///
/// # The contract per [`IsolationLevel`]
///
/// | level | stream | context |
/// |---|---|---|
/// | `Shared` | the default stream, the same handle value for every caller; releasing it does nothing | the primary context |
/// | `StreamIsolated` | a new stream per call, distinct from every other live one, destroyed on release | the primary context |
/// | `ContextIsolated` | a new stream per call | one context per tenant, created with the tenant's first stream and destroyed with its last |
///
/// A handle that this provider did not hand out (or already took back) is rejected with an
/// error, never trusted.
pub trait StreamProvider: ErrorType {
    /// A stream on `device` for one instance of `tenant` at `level` (the shared default stream
    /// and the primary context are `device`'s; a context-isolated tenant's context is made on
    /// the device of its first stream). A device that does not exist is refused.
    ///
    /// Context-isolated streams of one [`TenantKey`] share one context; two keys never do, even
    /// when their [`TenantId`]s are equal.
    fn acquire_stream_on(
        &self,
        tenant: TenantKey,
        level: IsolationLevel,
        device: DeviceId,
    ) -> Result<Stream, Self::Error>;

    /// [`acquire_stream_on`](Self::acquire_stream_on) device 0.
    fn acquire_stream(
        &self,
        tenant: TenantKey,
        level: IsolationLevel,
    ) -> Result<Stream, Self::Error> {
        self.acquire_stream_on(tenant, level, DeviceId(0))
    }

    /// Gives a stream back: waits for the work queued on it, then destroys it (and the
    /// tenant's context after its last stream) where the level says so. The shared default
    /// stream is not destroyed, but it is waited for too (with whatever other shared tenants
    /// queued on it): a shared tenant's work must also be done before its memory goes. The wait is what orders
    /// teardown after the tenant's GPU work: once the stream is destroyed, nothing queued on it
    /// can still touch memory that is then scrubbed, freed or handed to another tenant. If
    /// another call is using the stream at that moment, the stream is retired at once (refused
    /// to every new use) and the last such call waits and destroys it when it finishes. A
    /// failed wait (a context the driver has poisoned) is reported, and the stream destroyed
    /// all the same. The handle is consumed either way: on an error the driver may still
    /// hold the stream, and the backend counts it as live rather than hiding the leak.
    fn release_stream(&self, stream: Stream) -> Result<(), Self::Error>;

    /// Waits until all work queued on `stream` has finished.
    fn synchronize(&self, stream: &Stream) -> Result<(), Self::Error> {
        self.wait_for(stream.key())
    }

    /// Waits until all work queued on the stream `key` names has finished; a key whose stream
    /// this provider did not hand out, or already took back, is refused.
    fn wait_for(&self, key: StreamKey) -> Result<(), Self::Error>;
}

macro_rules! forward_streams {
    ($($ty:ty),*) => {$(
        impl<T: StreamProvider + ?Sized> StreamProvider for $ty {
            fn acquire_stream_on(
                &self,
                tenant: TenantKey,
                level: IsolationLevel,
                device: DeviceId,
            ) -> Result<Stream, Self::Error> {
                T::acquire_stream_on(self, tenant, level, device)
            }
            fn acquire_stream(
                &self,
                tenant: TenantKey,
                level: IsolationLevel,
            ) -> Result<Stream, Self::Error> {
                T::acquire_stream(self, tenant, level)
            }
            fn release_stream(&self, stream: Stream) -> Result<(), Self::Error> {
                T::release_stream(self, stream)
            }
            fn synchronize(&self, stream: &Stream) -> Result<(), Self::Error> {
                T::synchronize(self, stream)
            }
            fn wait_for(&self, key: StreamKey) -> Result<(), Self::Error> {
                T::wait_for(self, key)
            }
        }
    )*};
}

forward_streams!(&T, alloc::boxed::Box<T>, alloc::sync::Arc<T>);

/// A stream that goes back to its provider when dropped.
#[derive(Debug)]
pub struct StreamLease<P: StreamProvider> {
    provider: P,
    stream: Option<Stream>,
}

impl<P: StreamProvider> StreamLease<P> {
    /// Acquires a stream on device 0 from `provider` (which may be `&T`, `Arc<T>` or an owned
    /// provider).
    pub fn acquire(
        provider: P,
        tenant: TenantKey,
        level: IsolationLevel,
    ) -> Result<Self, P::Error> {
        Self::acquire_on(provider, tenant, level, DeviceId(0))
    }

    /// Acquires a stream on `device` from `provider`.
    pub fn acquire_on(
        provider: P,
        tenant: TenantKey,
        level: IsolationLevel,
        device: DeviceId,
    ) -> Result<Self, P::Error> {
        let stream = provider.acquire_stream_on(tenant, level, device)?;
        Ok(Self {
            provider,
            stream: Some(stream),
        })
    }

    /// The stream.
    #[must_use]
    pub fn stream(&self) -> &Stream {
        // The option is `Some` from construction until `release`/drop consume it.
        self.stream.as_ref().unwrap_or_else(|| unreachable!())
    }

    /// The provider.
    #[must_use]
    pub fn provider(&self) -> &P {
        &self.provider
    }

    /// Releases now and reports the provider's answer (dropping releases and ignores it).
    pub fn release(mut self) -> Result<(), P::Error> {
        match self.stream.take() {
            Some(s) => self.provider.release_stream(s),
            None => Ok(()),
        }
    }
}

impl<P: StreamProvider> Drop for StreamLease<P> {
    fn drop(&mut self) {
        if let Some(s) = self.stream.take() {
            // A failed release cannot be reported from `drop`; backends count it.
            let _ = self.provider.release_stream(s);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;
    use crate::mocks::{MockBackend, MockError};

    #[test]
    fn lease_releases_on_drop_and_reports_on_release() {
        let mut mock = MockBackend::new();
        mock.expect_acquire_stream_on()
            .withf(|_, _, device| *device == DeviceId(0))
            .returning(|tenant, level, _| {
                Ok(Stream::new(
                    crate::DriverStream::from_raw(42),
                    crate::DriverContext::from_raw(7),
                    level,
                    tenant,
                ))
            });
        mock.expect_release_stream()
            .withf(|s| s.raw() == 42 && s.tenant() == TenantId(5))
            .times(2)
            .returning(|_| Ok(()));
        let tenant = TenantKey::fresh(TenantId(5));
        let lease = StreamLease::acquire(&mock, tenant, IsolationLevel::StreamIsolated).unwrap();
        assert_eq!(lease.stream().raw(), 42);
        assert_eq!(lease.stream().context(), 7);
        assert!(!lease.stream().is_shared());
        drop(lease);
        let lease = StreamLease::acquire(&mock, tenant, IsolationLevel::StreamIsolated).unwrap();
        lease.release().unwrap();
    }

    #[test]
    fn acquire_failure_is_passed_on() {
        let mut mock = MockBackend::new();
        mock.expect_acquire_stream_on()
            .returning(|_, _, _| Err(MockError(ErrorKind::Driver)));
        mock.expect_release_stream().never();
        let result = StreamLease::acquire(
            &mock,
            TenantKey::fresh(TenantId(1)),
            IsolationLevel::ContextIsolated,
        );
        assert_eq!(result.err(), Some(MockError(ErrorKind::Driver)));
    }
}
