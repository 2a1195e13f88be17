//! Devices, locations, memory hints and what a backend can do.

use core::fmt;
use core::str::FromStr;

/// An ordinal of a device as the driver numbers them (`0` is the first GPU).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DeviceId(pub u32);

impl fmt::Display for DeviceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "device:{}", self.0)
    }
}

/// Where a range of managed memory should live or be accessed from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Location {
    /// Host (CPU) memory.
    Host,
    /// The memory of one device.
    Device(DeviceId),
}

impl Location {
    /// Decodes the guest ABI form: `-1` is the host, `n >= 0` is device `n`; anything else is
    /// `None`.
    #[must_use]
    pub const fn from_guest_code(code: i32) -> Option<Self> {
        match code {
            -1 => Some(Self::Host),
            n if n >= 0 => Some(Self::Device(DeviceId(n as u32))),
            _ => None,
        }
    }

    /// The guest ABI form: `-1` for the host, `n` for device `n` (saturating at `i32::MAX`).
    #[must_use]
    pub const fn guest_code(self) -> i32 {
        match self {
            Self::Host => -1,
            Self::Device(DeviceId(n)) => {
                if n > i32::MAX as u32 {
                    i32::MAX
                } else {
                    n as i32
                }
            }
        }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Host => f.write_str("host"),
            Self::Device(d) => d.fmt(f),
        }
    }
}

/// A `cuMemAdvise`-style hint on a range of managed memory.
///
/// Each variant has a stable name ([`Advice::name`]) and a stable guest code
/// ([`Advice::guest_code`], used by the `twm.advise` host function).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Advice {
    /// The range is mostly read: the driver may keep read-only copies where it is read.
    SetReadMostly,
    /// Undoes [`Advice::SetReadMostly`].
    UnsetReadMostly,
    /// The range should preferably live at this location.
    SetPreferredLocation(Location),
    /// Undoes [`Advice::SetPreferredLocation`].
    UnsetPreferredLocation,
    /// The range will be accessed from this location: keep it mapped there.
    SetAccessedBy(Location),
    /// Undoes [`Advice::SetAccessedBy`] for this location.
    UnsetAccessedBy(Location),
}

impl Advice {
    /// Every advice code the guest ABI knows, in code order.
    pub const GUEST_CODES: [i32; 6] = [0, 1, 2, 3, 4, 5];

    /// A stable snake_case name.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::SetReadMostly => "set_read_mostly",
            Self::UnsetReadMostly => "unset_read_mostly",
            Self::SetPreferredLocation(_) => "set_preferred_location",
            Self::UnsetPreferredLocation => "unset_preferred_location",
            Self::SetAccessedBy(_) => "set_accessed_by",
            Self::UnsetAccessedBy(_) => "unset_accessed_by",
        }
    }

    /// The stable guest code: 0 set_read_mostly, 1 unset_read_mostly, 2 set_preferred_location,
    /// 3 unset_preferred_location, 4 set_accessed_by, 5 unset_accessed_by.
    #[must_use]
    pub const fn guest_code(self) -> i32 {
        match self {
            Self::SetReadMostly => 0,
            Self::UnsetReadMostly => 1,
            Self::SetPreferredLocation(_) => 2,
            Self::UnsetPreferredLocation => 3,
            Self::SetAccessedBy(_) => 4,
            Self::UnsetAccessedBy(_) => 5,
        }
    }

    /// Builds an advice from its guest code and the location argument (ignored by the codes that
    /// take none). `None` for an unknown code.
    #[must_use]
    pub const fn from_guest_code(code: i32, location: Location) -> Option<Self> {
        Some(match code {
            0 => Self::SetReadMostly,
            1 => Self::UnsetReadMostly,
            2 => Self::SetPreferredLocation(location),
            3 => Self::UnsetPreferredLocation,
            4 => Self::SetAccessedBy(location),
            5 => Self::UnsetAccessedBy(location),
            _ => return None,
        })
    }

    /// The location this advice names, if any.
    #[must_use]
    pub const fn location(self) -> Option<Location> {
        match self {
            Self::SetPreferredLocation(l) | Self::SetAccessedBy(l) | Self::UnsetAccessedBy(l) => {
                Some(l)
            }
            _ => None,
        }
    }
}

impl fmt::Display for Advice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.location() {
            Some(l) => write!(f, "{}({l})", self.name()),
            None => f.write_str(self.name()),
        }
    }
}

/// What a backend's memory offers. Backends must be honest: generic code and the Wasmtime
/// integration decide safety-relevant settings from these flags.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Capabilities {
    /// The host can read and write the memory through its pointer.
    pub host_accessible: bool,
    /// A device (GPU) can read and write the memory through the same address.
    pub device_accessible: bool,
    /// The memory is managed (unified): pages migrate between host and device on demand.
    pub managed: bool,
    /// Fresh allocations read as zeros without an explicit zeroing call.
    pub comes_zeroed: bool,
    /// Allocations are followed by inaccessible guard pages that fault on access.
    pub guard_pages: bool,
    /// Host and device may access managed memory concurrently (no whole-device sync needed).
    pub concurrent_managed_access: bool,
    /// The device can access pageable host memory (HMM / ATS).
    pub pageable_memory_access: bool,
}

impl Capabilities {
    /// A backend that can do nothing (the reserved slots).
    pub const NONE: Self = Self {
        host_accessible: false,
        device_accessible: false,
        managed: false,
        comes_zeroed: false,
        guard_pages: false,
        concurrent_managed_access: false,
        pageable_memory_access: false,
    };

    /// `true` when the memory is unified: managed, and reachable from both host and device.
    #[must_use]
    pub const fn is_uvm(&self) -> bool {
        self.managed && self.host_accessible && self.device_accessible
    }
}

/// What one device offers and holds now, as [`ManagedAllocator::device_report`] answers it
/// (for `twm probe`, placement by free memory, and metrics).
///
/// [`ManagedAllocator::device_report`]: crate::ManagedAllocator::device_report
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceReport {
    /// The device.
    pub device: DeviceId,
    /// `CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS` of this device.
    pub concurrent_managed_access: bool,
    /// `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS` of this device.
    pub pageable_memory_access: bool,
    /// Whether host memory registered device-mapped is accessible at its own address
    /// (`CU_DEVICE_ATTRIBUTE_HOST_REGISTER_SUPPORTED` and
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`).
    pub host_registration: bool,
    /// Its memory in bytes (`cuMemGetInfo`'s total), where the backend can say.
    pub total_bytes: Option<u64>,
    /// Its free memory in bytes now (`cuMemGetInfo`'s free), where the backend can say.
    pub free_bytes: Option<u64>,
}

impl DeviceReport {
    /// A report from a backend's capabilities alone (memory figures unknown): what
    /// [`ManagedAllocator::device_report`](crate::ManagedAllocator::device_report) answers by
    /// default.
    #[must_use]
    pub const fn from_capabilities(device: DeviceId, caps: &Capabilities) -> Self {
        Self {
            device,
            concurrent_managed_access: caps.concurrent_managed_access,
            pageable_memory_access: caps.pageable_memory_access,
            host_registration: false,
            total_bytes: None,
            free_bytes: None,
        }
    }
}

/// Parses a [`Location`] from `host`, `device:N` or `N`.
impl FromStr for Location {
    type Err = ParseNameError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "host" {
            return Ok(Self::Host);
        }
        let n = s.strip_prefix("device:").unwrap_or(s);
        n.parse::<u32>()
            .map(|n| Self::Device(DeviceId(n)))
            .map_err(|_| ParseNameError { what: "location" })
    }
}

/// A name that does not denote any value of the type being parsed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown {what} name")]
pub struct ParseNameError {
    /// What was being parsed.
    pub what: &'static str,
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;

    #[test]
    fn advice_codes_round_trip() {
        let loc = Location::Device(DeviceId(3));
        for code in Advice::GUEST_CODES {
            let advice = Advice::from_guest_code(code, loc).unwrap();
            assert_eq!(advice.guest_code(), code);
        }
        assert_eq!(Advice::from_guest_code(6, loc), None);
        assert_eq!(Advice::from_guest_code(-1, loc), None);
        assert_eq!(
            Advice::SetAccessedBy(Location::Host).to_string(),
            "set_accessed_by(host)"
        );
    }

    #[test]
    fn location_codes() {
        assert_eq!(Location::from_guest_code(-1), Some(Location::Host));
        assert_eq!(
            Location::from_guest_code(2),
            Some(Location::Device(DeviceId(2)))
        );
        assert_eq!(Location::from_guest_code(-2), None);
        assert_eq!(Location::Device(DeviceId(2)).guest_code(), 2);
        assert_eq!(Location::Host.guest_code(), -1);
        assert_eq!("device:4".parse(), Ok(Location::Device(DeviceId(4))));
        assert_eq!("host".parse(), Ok(Location::Host));
        assert!("gpu".parse::<Location>().is_err());
    }

    #[test]
    fn uvm_needs_all_three() {
        let mut c = Capabilities {
            host_accessible: true,
            device_accessible: true,
            managed: true,
            ..Capabilities::NONE
        };
        assert!(c.is_uvm());
        c.device_accessible = false;
        assert!(!c.is_uvm());
        assert!(!Capabilities::NONE.is_uvm());
    }
}
