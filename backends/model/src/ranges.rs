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

    /// Sets `range` to `value` (or clears it with `None`), in O(log n + k) for the k spans it
    /// covers: only the span that straddles its start is found below it, and a new span is
    /// merged with equal neighbours, so setting one value piece by piece keeps one span.
    pub(crate) fn set(&mut self, range: Range<usize>, value: Option<V>) {
        if range.is_empty() {
            return;
        }
        let (mut start, mut end) = (range.start, range.end);
        // The span that starts below the range and reaches into it (or touches it).
        if let Some((&s, &(e, ref v))) = self.spans.range(..start).next_back()
            && e >= start
        {
            let v = v.clone();
            self.spans.remove(&s);
            if value.as_ref() == Some(&v) {
                start = s;
                end = end.max(e);
            } else {
                self.spans.insert(s, (start, v.clone()));
                if e > end {
                    self.spans.insert(end, (e, v));
                }
            }
        }
        // The spans that start inside the range (or where it ends).
        let inside: Vec<usize> = self.spans.range(start..=end).map(|(&s, _)| s).collect();
        for s in inside {
            let Some((e, v)) = self.spans.remove(&s) else {
                continue;
            };
            if value.as_ref() == Some(&v) {
                end = end.max(e);
            } else if e > end {
                // Reaches past the end (or starts there) with another value: keep its tail.
                self.spans.insert(end, (e, v));
            }
        }
        if let Some(v) = value {
            self.spans.insert(start, (end, v));
        }
    }

    /// Bytes of `range` whose value satisfies `keep` (`None`: no value set there), in
    /// O(log n + k) for the k spans it covers.
    pub(crate) fn bytes_where(
        &self,
        range: Range<usize>,
        keep: impl Fn(Option<&V>) -> bool,
    ) -> usize {
        let mut counted = 0;
        let mut at = range.start;
        let first = self
            .spans
            .range(..range.start)
            .next_back()
            .filter(|(_, (end, _))| *end > range.start);
        for (&s, (e, v)) in first
            .into_iter()
            .chain(self.spans.range(range.start..range.end))
        {
            let (s, e) = (s.max(range.start), (*e).min(range.end));
            if s > at && keep(None) {
                counted += s - at;
            }
            if keep(Some(v)) {
                counted += e - s;
            }
            at = e;
        }
        if range.end > at && keep(None) {
            counted += range.end - at;
        }
        counted
    }

    /// Number of spans.
    pub(crate) fn spans(&self) -> usize {
        self.spans.len()
    }

    /// The value at `offset`.
    pub(crate) fn get(&self, offset: usize) -> Option<&V> {
        self.spans
            .range(..=offset)
            .next_back()
            .filter(|(_, (end, _))| offset < *end)
            .map(|(_, (_, v))| v)
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

    /// Against a byte-per-byte reference, over many pseudo-random sets: every value right and
    /// no two touching spans with one value.
    #[test]
    fn set_matches_a_byte_map_and_keeps_spans_merged() {
        let mut m = RangeMap::new();
        let mut reference = [None::<u8>; 256];
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for _ in 0..5000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let a = (x % 256) as usize;
            let b = ((x >> 8) % 256) as usize;
            let (start, end) = (a.min(b), a.max(b) + 1);
            let value = match (x >> 16) % 4 {
                0 => None,
                v => Some(v as u8),
            };
            m.set(start..end, value);
            reference[start..end].fill(value);
            for (at, want) in reference.iter().enumerate() {
                assert_eq!(m.get(at), want.as_ref(), "at {at}");
            }
            let spans: Vec<_> = m.spans.iter().map(|(&s, &(e, v))| (s, e, v)).collect();
            for pair in spans.windows(2) {
                assert!(pair[0].1 <= pair[1].0, "overlap {pair:?}");
                assert!(
                    !(pair[0].1 == pair[1].0 && pair[0].2 == pair[1].2),
                    "unmerged {pair:?}"
                );
            }
        }
    }

    #[test]
    fn bytes_where_counts_spans_and_gaps() {
        let mut m = RangeMap::new();
        m.set(10..20, Some('a'));
        m.set(30..40, Some('b'));
        assert_eq!(m.bytes_where(0..50, |v| v.is_none()), 30);
        assert_eq!(m.bytes_where(0..50, |v| v == Some(&'a')), 10);
        assert_eq!(m.bytes_where(15..35, |v| v != Some(&'b')), 15);
        assert_eq!(m.bytes_where(12..18, |v| v == Some(&'a')), 6);
        assert_eq!(m.bytes_where(40..40, |_| true), 0);
    }

    #[test]
    fn setting_one_value_piece_by_piece_keeps_one_span() {
        let mut m = RangeMap::new();
        for at in (0..1 << 20).step_by(2) {
            m.set(at..at + 2, Some(()));
        }
        assert_eq!(m.spans(), 1);
        for at in (0..1 << 20).step_by(4) {
            m.set(at..at + 2, None);
        }
        assert_eq!(m.spans(), 1 << 18);
    }
}
