//! Isolation levels: how much of the driver's execution state an instance shares.

use core::fmt;
use core::str::FromStr;

use crate::device::ParseNameError;

/// How an instance's GPU work is isolated from other instances'.
///
/// The names (`shared`, `stream_isolated`, `context_isolated`) are stable: they appear in spans,
/// metrics and command lines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IsolationLevel {
    /// Every instance uses the default stream of the primary context.
    Shared,
    /// One stream per instance in the primary context, released with the instance (the default).
    #[default]
    StreamIsolated,
    /// One context per tenant (MPS where present), one stream per instance inside it.
    ContextIsolated,
}

impl IsolationLevel {
    /// All levels, from least to most isolated.
    pub const ALL: [Self; 3] = [Self::Shared, Self::StreamIsolated, Self::ContextIsolated];

    /// The stable name.
    #[must_use]
    pub const fn name(self) -> &'static str {
        match self {
            Self::Shared => "shared",
            Self::StreamIsolated => "stream_isolated",
            Self::ContextIsolated => "context_isolated",
        }
    }
}

impl fmt::Display for IsolationLevel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for IsolationLevel {
    type Err = ParseNameError;

    /// Accepts exactly the stable names.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|l| l.name() == s)
            .ok_or(ParseNameError {
                what: "isolation level",
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use alloc::string::ToString;

    #[test]
    fn names_round_trip() {
        for level in IsolationLevel::ALL {
            assert_eq!(level.to_string().parse::<IsolationLevel>(), Ok(level));
        }
        assert_eq!(IsolationLevel::default(), IsolationLevel::StreamIsolated);
        assert_eq!(
            IsolationLevel::ContextIsolated.to_string(),
            "context_isolated"
        );
        assert!("Shared".parse::<IsolationLevel>().is_err());
        assert!("".parse::<IsolationLevel>().is_err());
    }
}
