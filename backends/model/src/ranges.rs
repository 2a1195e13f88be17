//! A map from byte ranges to values: setting a range splits and overwrites what it covers.

use std::collections::BTreeMap;
use std::ops::Range;

/// Disjoint ranges, each with a value.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct RangeMap<V> {
    /// start -> (end, value), ranges disjoint and non-empty.
    spans: BTreeMap<usize, (usize, V)>,
}

impl<V: Clone + PartialEq> RangeMap<V> {
    pub(crate) fn new() -> Self {
        Self {
            spans: BTreeMap::new(),
        }
    }

    /// Sets `range` to `value` (or clears it with `None`).
    pub(crate) fn set(&mut self, range: Range<usize>, value: Option<V>) {
        if range.is_empty() {
            return;
        }
        // Cut the span that straddles the start, and the one that straddles the end.
        let mut kept = Vec::new();
        let overlapping: Vec<usize> = self
            .spans
            .range(..range.end)
            .filter(|(_, (end, _))| *end > range.start)
            .map(|(start, _)| *start)
            .collect();
        for start in overlapping {
            if let Some((end, v)) = self.spans.remove(&start) {
                if start < range.start {
                    kept.push((start, range.start, v.clone()));
                }
                if end > range.end {
                    kept.push((range.end, end, v));
                }
            }
        }
        for (s, e, v) in kept {
            self.spans.insert(s, (e, v));
        }
        if let Some(v) = value {
            self.spans.insert(range.start, (range.end, v));
        }
    }

    /// The value at `offset`.
    pub(crate) fn get(&self, offset: usize) -> Option<&V> {
        self.spans
            .range(..=offset)
            .next_back()
            .filter(|(_, (end, _))| offset < *end)
            .map(|(_, (_, v))| v)
    }

    /// Number of spans (for tests).
    #[cfg(test)]
    pub(crate) fn spans(&self) -> usize {
        self.spans.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn set_splits_and_overwrites() {
        let mut m = RangeMap::new();
        m.set(0..100, Some('a'));
        m.set(10..20, Some('b'));
        m.set(90..120, Some('c'));
        assert_eq!(m.get(0), Some(&'a'));
        assert_eq!(m.get(9), Some(&'a'));
        assert_eq!(m.get(10), Some(&'b'));
        assert_eq!(m.get(19), Some(&'b'));
        assert_eq!(m.get(20), Some(&'a'));
        assert_eq!(m.get(89), Some(&'a'));
        assert_eq!(m.get(90), Some(&'c'));
        assert_eq!(m.get(119), Some(&'c'));
        assert_eq!(m.get(120), None);
        assert_eq!(m.spans(), 4);
        m.set(5..95, None);
        assert_eq!(m.get(4), Some(&'a'));
        assert_eq!(m.get(5), None);
        assert_eq!(m.get(94), None);
        assert_eq!(m.get(95), Some(&'c'));
        m.set(0..200, Some('z'));
        assert_eq!(m.spans(), 1);
        m.set(50..50, Some('q'));
        assert_eq!(m.get(50), Some(&'z'));
    }
}
