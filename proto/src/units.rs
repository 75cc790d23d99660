//! Quantities as people write them on a command line or in a file.

/// Sizes like `512m`, `16g`, `2GiB`, `1.5g` (k, m, g, t, powers of 1024;
/// a plain number is bytes).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let t = t.trim_end_matches("ib").trim_end_matches('b');
    let (num, mult) = match t.char_indices().last() {
        Some((i, 'k')) => (&t[..i], 1u64 << 10),
        Some((i, 'm')) => (&t[..i], 1 << 20),
        Some((i, 'g')) => (&t[..i], 1 << 30),
        Some((i, 't')) => (&t[..i], 1 << 40),
        _ => (t, 1),
    };
    let bad = || format!("{s:?} is not a size like 512m or 16g");
    let n: f64 = num.parse().map_err(|_| bad())?;
    if !n.is_finite() || n < 0.0 {
        return Err(bad());
    }
    let bytes = n * mult as f64;
    if bytes >= u64::MAX as f64 {
        return Err(format!("{s:?} is too large"));
    }
    Ok(bytes as u64)
}

/// A size as people read it: `512m`, `1.5g`, `300` (bytes), the way
/// [`parse_size`] takes it back.
pub fn format_size(bytes: u64) -> String {
    for (unit, shift) in [("t", 40), ("g", 30), ("m", 20), ("k", 10)] {
        let whole = 1u64 << shift;
        if bytes >= whole {
            let n = bytes as f64 / whole as f64;
            return if bytes.is_multiple_of(whole) {
                format!("{}{unit}", bytes >> shift)
            } else {
                format!("{n:.1}{unit}")
            };
        }
    }
    bytes.to_string()
}

/// A rate in bytes a second, as a size (`10m`); at least one byte.
pub fn parse_rate(s: &str) -> Result<u64, String> {
    match parse_size(s)? {
        0 => Err("at least 1 byte a second".into()),
        n => Ok(n),
    }
}

/// A number of CPUs (`2`, `0.5`) in thousandths of a CPU.
pub fn parse_cpus(s: &str) -> Result<u64, String> {
    let n: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of CPUs like 2 or 0.5"))?;
    if !n.is_finite() || !(0.0..=1e12).contains(&n) {
        return Err(format!("{s:?} is not a number of CPUs like 2 or 0.5"));
    }
    Ok((n * 1000.0).round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512m"), Ok(512 << 20));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("1.5g"), Ok(3 << 29));
        assert_eq!(parse_size("100"), Ok(100));
        assert!(parse_size("lots").is_err());
        assert!(parse_size("-1g").is_err());
        assert!(parse_size("nan").is_err());
        assert!(parse_size("99999999999t").is_err());
    }

    #[test]
    fn rates_are_sizes_of_at_least_a_byte() {
        assert_eq!(parse_rate("10m"), Ok(10 << 20));
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("fast").is_err());
    }

    #[test]
    fn cpus() {
        assert_eq!(parse_cpus("2"), Ok(2000));
        assert_eq!(parse_cpus("0.5"), Ok(500));
        assert!(parse_cpus("-1").is_err());
        assert!(parse_cpus("inf").is_err());
        assert!(parse_cpus("two").is_err());
    }
}
