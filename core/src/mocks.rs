//! `mockall` doubles of the three backend traits (feature `mockall`; brings in std).
//!
//! [`MockBackend`] implements [`ManagedAllocator`], [`Advisor`] and [`StreamProvider`] with
//! [`MockError`] as its error type. Its `unsafe impl` is only as sound as the expectations a test
//! sets: return allocations that point to real memory of the stated size.

use crate::{
    Advice, Advisor, Allocation, BackendError, Capabilities, DeviceId, ErrorKind, ErrorType,
    IsolationLevel, Location, ManagedAllocator, Refused, Stream, StreamKey, StreamProvider,
    TenantKey,
};

/// The error type of [`MockBackend`]: whatever kind the test chooses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("mock backend error: {0}")]
pub struct MockError(pub ErrorKind);

impl BackendError for MockError {
    fn kind(&self) -> ErrorKind {
        self.0
    }
}

mockall::mock! {
    /// A mock of all three backend traits.
    pub Backend {}

    impl ErrorType for Backend {
        type Error = MockError;
    }

    // SAFETY: only as sound as the test's expectations (see the module docs).
    unsafe impl ManagedAllocator for Backend {
        fn capabilities(&self) -> Capabilities;
        fn device_count(&self) -> u32;
        fn allocate(&self, device: DeviceId, bytes: usize) -> Result<Allocation, MockError>;
        unsafe fn free(&self, allocation: Allocation) -> Result<(), Refused<Allocation, MockError>>;
        unsafe fn zero(
            &self,
            allocation: &Allocation,
            offset: usize,
            len: usize,
        ) -> Result<(), MockError>;
    }

    impl Advisor for Backend {
        fn advise(
            &self,
            allocation: &Allocation,
            offset: usize,
            len: usize,
            advice: Advice,
        ) -> Result<(), MockError>;
        fn prefetch(
            &self,
            allocation: &Allocation,
            offset: usize,
            len: usize,
            to: Location,
            stream: &Stream,
        ) -> Result<(), MockError>;
        fn reset_hints(
            &self,
            allocation: &Allocation,
            offset: usize,
            len: usize,
        ) -> Result<(), MockError>;
    }

    impl StreamProvider for Backend {
        fn acquire_stream_on(
            &self,
            tenant: TenantKey,
            level: IsolationLevel,
            device: DeviceId,
        ) -> Result<Stream, MockError>;
        fn acquire_stream(
            &self,
            tenant: TenantKey,
            level: IsolationLevel,
        ) -> Result<Stream, MockError>;
        fn release_stream(&self, stream: Stream) -> Result<(), MockError>;
        fn synchronize(&self, stream: &Stream) -> Result<(), MockError>;
        fn wait_for(&self, key: StreamKey) -> Result<(), MockError>;
    }
}
