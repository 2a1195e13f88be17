//! Byte-count arguments: `65536`, `64KiB`, `16MiB`, `1GiB` (also `K`, `M`, `G`, `KB`...: all
//! binary multiples).

/// Parses a byte count with an optional binary unit.
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '_')
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let digits: String = digits.chars().filter(|&c| c != '_').collect();
    if digits.is_empty() {
        return Err(format!(
            "{text:?} is not a byte count (try 65536, 64KiB, 16MiB, 1GiB)"
        ));
    }
    let value: u64 = digits
        .parse()
        .map_err(|_| format!("{text:?} is too large"))?;
    let shift = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        other => return Err(format!("unknown byte unit {other:?} (use KiB, MiB or GiB)")),
    };
    value
        .checked_mul(1 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

/// Formats a byte count with the largest binary unit that divides it exactly.
pub fn format_bytes(bytes: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    format!("{bytes}B")
}

/// Formats a byte count in the largest binary unit it reaches, to one decimal (`15.9GiB`).
pub fn approx_bytes(bytes: u64) -> String {
    for (shift, unit) in [(30, "GiB"), (20, "MiB"), (10, "KiB")] {
        if bytes >= 1 << shift {
            return format!("{:.1}{unit}", bytes as f64 / (1u64 << shift) as f64);
        }
    }
    format!("{bytes}B")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(parse_bytes("65536"), Ok(65536));
        assert_eq!(parse_bytes("64KiB"), Ok(65536));
        assert_eq!(parse_bytes("16MiB"), Ok(16 << 20));
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("1 gib"), Ok(1 << 30));
        assert_eq!(parse_bytes("2K"), Ok(2048));
        assert_eq!(parse_bytes("1_000"), Ok(1000));
        assert!(parse_bytes("").is_err());
        assert!(parse_bytes("MiB").is_err());
        assert!(parse_bytes("-1").is_err());
        assert!(parse_bytes("1PiB").is_err());
        assert!(parse_bytes("99999999999999999999").is_err());
        assert!(parse_bytes("17179869184GiB").is_err());
        assert_eq!(format_bytes(65536), "64KiB");
        assert_eq!(format_bytes(3 << 20), "3MiB");
        assert_eq!(format_bytes(100), "100B");
    }
}
