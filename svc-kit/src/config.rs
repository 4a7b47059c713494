//! Typed configuration from environment-style key/value lookups.
//!
//! Services read their settings through [`Vars`], which takes any lookup function so tests can
//! build a configuration from a map without touching the process environment. Every error names
//! the variable, the offending value and what a good value looks like.

use std::{collections::HashMap, fmt, net::SocketAddr, str::FromStr, time::Duration};

/// A configuration value that could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{var}: {problem}")]
pub struct ConfigError {
    /// The environment variable at fault.
    pub var: String,
    /// What is wrong and how to fix it.
    pub problem: String,
}

impl ConfigError {
    pub fn new(var: &str, problem: impl Into<String>) -> Self {
        Self {
            var: var.to_owned(),
            problem: problem.into(),
        }
    }
}

/// All the problems found in one configuration, so an operator fixes them in one pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "invalid configuration:")?;
        for e in &self.0 {
            writeln!(f, "  - {e}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

type Lookup<'a> = Box<dyn Fn(&str) -> Option<String> + 'a>;

/// Reads variables and collects every error instead of stopping at the first.
pub struct Vars<'a> {
    lookup: Lookup<'a>,
    errors: Vec<ConfigError>,
}

impl<'a> Vars<'a> {
    /// Variables from the process environment.
    pub fn from_env() -> Vars<'static> {
        Vars::new(|k| std::env::var(k).ok())
    }

    /// Variables from a map, for tests.
    pub fn from_map(map: &'a HashMap<String, String>) -> Self {
        Vars::new(move |k| map.get(k).cloned())
    }

    pub fn new(lookup: impl Fn(&str) -> Option<String> + 'a) -> Self {
        Self {
            lookup: Box::new(lookup),
            errors: Vec::new(),
        }
    }

    /// The raw value; empty and whitespace-only values count as unset.
    pub fn raw(&self, var: &str) -> Option<String> {
        (self.lookup)(var)
            .map(|v| v.trim().to_owned())
            .filter(|v| !v.is_empty())
    }

    /// Records a problem found while validating a combination of values.
    pub fn error(&mut self, var: &str, problem: impl Into<String>) {
        self.errors.push(ConfigError::new(var, problem));
    }

    /// Parses a value with `FromStr`, or returns the default when unset. On error the default is
    /// returned too (so loading can go on and report every problem) and the error is recorded.
    pub fn parse<T>(&mut self, var: &str, default: T, expected: &str) -> T
    where
        T: FromStr,
    {
        match self.raw(var) {
            None => default,
            Some(v) => match v.parse() {
                Ok(parsed) => parsed,
                Err(_) => {
                    self.error(var, format!("{v:?} is not {expected}"));
                    default
                }
            },
        }
    }

    pub fn optional_string(&self, var: &str) -> Option<String> {
        self.raw(var)
    }

    pub fn string(&self, var: &str, default: &str) -> String {
        self.raw(var).unwrap_or_else(|| default.to_owned())
    }

    pub fn socket_addr(&mut self, var: &str, default: SocketAddr) -> SocketAddr {
        self.parse(
            var,
            default,
            "a socket address such as 0.0.0.0:50051 or [::1]:50051",
        )
    }

    /// A boolean: true/false, 1/0, yes/no, on/off.
    pub fn bool(&mut self, var: &str, default: bool) -> bool {
        match self.raw(var).map(|v| v.to_ascii_lowercase()) {
            None => default,
            Some(v) => match v.as_str() {
                "true" | "1" | "yes" | "on" => true,
                "false" | "0" | "no" | "off" => false,
                _ => {
                    self.error(var, format!("{v:?} is not a boolean (use true or false)"));
                    default
                }
            },
        }
    }

    /// An integer in `min..=max`.
    pub fn int_in<T>(&mut self, var: &str, default: T, min: T, max: T) -> T
    where
        T: FromStr + PartialOrd + Copy + fmt::Display,
    {
        let expected = format!("a whole number from {min} to {max}");
        let value = self.parse(var, default, &expected);
        if value < min || value > max {
            self.error(var, format!("{value} is out of range: use {expected}"));
            return default;
        }
        value
    }

    /// A duration such as `500ms`, `30s`, `30m`, `2h`, `7d` or a bare number of seconds, within
    /// bounds.
    pub fn duration_in(
        &mut self,
        var: &str,
        default: Duration,
        min: Duration,
        max: Duration,
    ) -> Duration {
        let Some(raw) = self.raw(var) else {
            return default;
        };
        match parse_duration(&raw) {
            Some(d) if d >= min && d <= max => d,
            Some(d) => {
                self.error(var, out_of_range(&raw, d, min, max));
                default
            }
            None => {
                self.error(var, not_a_duration(&raw, min, max));
                default
            }
        }
    }

    /// As [`Vars::duration_in`], or `off` for none: a setting that can be switched off (a
    /// retention, say). Unset gives `default`.
    pub fn duration_or_off(
        &mut self,
        var: &str,
        default: Option<Duration>,
        min: Duration,
        max: Duration,
    ) -> Option<Duration> {
        let Some(raw) = self.raw(var) else {
            return default;
        };
        if raw.trim().eq_ignore_ascii_case("off") {
            return None;
        }
        // Its own messages, not `duration_in`'s: each names `off` as the other choice.
        match parse_duration(&raw) {
            Some(d) if d >= min && d <= max => Some(d),
            Some(d) => {
                self.error(var, out_of_range(&raw, d, min, max) + ", or off");
                default
            }
            None => {
                self.error(var, not_a_duration(&raw, min, max) + ", or off");
                default
            }
        }
    }

    /// A size in bytes such as `4MiB`, `512KiB` or a bare number of bytes, within bounds.
    pub fn bytes_in(&mut self, var: &str, default: usize, min: usize, max: usize) -> usize {
        let Some(raw) = self.raw(var) else {
            return default;
        };
        match parse_bytes(&raw) {
            Some(b) if b >= min && b <= max => b,
            Some(_) => {
                self.error(
                    var,
                    format!("{raw:?} is out of range: use {min} to {max} bytes"),
                );
                default
            }
            None => {
                self.error(
                    var,
                    format!("{raw:?} is not a size (use e.g. 4MiB, 512KiB or bytes)"),
                );
                default
            }
        }
    }

    /// Finishes loading: the value when every variable was good, else every problem found.
    pub fn finish<T>(self, value: T) -> Result<T, ConfigErrors> {
        if self.errors.is_empty() {
            Ok(value)
        } else {
            Err(ConfigErrors(self.errors))
        }
    }
}

/// Why text that is no duration is refused: what one looks like, and the range allowed.
fn not_a_duration(raw: &str, min: Duration, max: Duration) -> String {
    format!(
        "{raw:?} is not a duration: use one from {} to {}, written as a number and a unit \
         (ms, s, m, h or d; seconds without one)",
        format_duration(min),
        format_duration(max)
    )
}

/// Why a duration outside `min..=max` is refused, in the units it is written in.
fn out_of_range(raw: &str, d: Duration, min: Duration, max: Duration) -> String {
    let side = if d < min {
        format!("shorter than {}", format_duration(min))
    } else {
        format!("longer than {}", format_duration(max))
    };
    format!(
        "{raw:?} is {side}: use a duration from {} to {}",
        format_duration(min),
        format_duration(max)
    )
}

/// `d` as [`parse_duration`] reads it back, in its largest whole unit: `36500d`, `1h`,
/// `90s`, `500ms` (not `Debug`'s `3153600000s`).
pub fn format_duration(d: Duration) -> String {
    if !d.subsec_nanos().is_multiple_of(1_000_000) {
        return format!("{d:?}");
    }
    if d.subsec_millis() != 0 || d.is_zero() {
        return format!("{}ms", d.as_millis());
    }
    let secs = d.as_secs();
    match [(86_400, "d"), (3600, "h"), (60, "m")]
        .into_iter()
        .find(|(unit, _)| secs.is_multiple_of(*unit))
    {
        Some((unit, name)) => format!("{}{name}", secs / unit),
        None => format!("{secs}s"),
    }
}

/// `500ms`, `30s`, `30m`, `2h`, `7d` or a bare number of seconds; `None` for anything else.
pub fn parse_duration(raw: &str) -> Option<Duration> {
    let raw = raw.trim();
    let split = raw.find(|c: char| !c.is_ascii_digit()).unwrap_or(raw.len());
    let (num, unit) = raw.split_at(split);
    let n: u64 = num.parse().ok()?;
    let secs = |mult: u64| n.checked_mul(mult).map(Duration::from_secs);
    match unit.trim() {
        "" | "s" => secs(1),
        "ms" => Some(Duration::from_millis(n)),
        "m" | "min" => secs(60),
        "h" => secs(3600),
        "d" => secs(86_400),
        _ => None,
    }
}

fn parse_bytes(raw: &str) -> Option<usize> {
    let raw = raw.trim();
    let split = raw.find(|c: char| !c.is_ascii_digit()).unwrap_or(raw.len());
    let (num, unit) = raw.split_at(split);
    let n: usize = num.parse().ok()?;
    let mult = match unit.trim() {
        "" | "B" => 1,
        "KiB" | "K" | "KB" => 1 << 10,
        "MiB" | "M" | "MB" => 1 << 20,
        "GiB" | "G" | "GB" => 1 << 30,
        _ => return None,
    };
    n.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn unset_and_blank_values_take_the_default() {
        let map = vars(&[("A", "  ")]);
        let mut v = Vars::from_map(&map);
        assert_eq!(v.int_in("A", 7u32, 1, 10), 7);
        assert_eq!(v.int_in("B", 8u32, 1, 10), 8);
        assert!(v.finish(()).is_ok());
    }

    #[test]
    fn every_bad_value_is_reported_by_name() {
        let map = vars(&[("PORT_ADDR", "nope"), ("STEPS", "99"), ("FLAG", "maybe")]);
        let mut v = Vars::from_map(&map);
        v.socket_addr("PORT_ADDR", "0.0.0.0:1".parse().unwrap());
        v.int_in("STEPS", 8u32, 1, 15);
        v.bool("FLAG", true);
        let err = v.finish(()).unwrap_err();
        let names: Vec<_> = err.0.iter().map(|e| e.var.as_str()).collect();
        assert_eq!(names, ["PORT_ADDR", "STEPS", "FLAG"]);
        let text = err.to_string();
        assert!(
            text.contains("STEPS: 99 is out of range: use a whole number from 1 to 15"),
            "{text}"
        );
    }

    #[test]
    fn durations_and_sizes_accept_units() {
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("30"), Some(Duration::from_secs(30)));
        assert_eq!(parse_duration("30m"), Some(Duration::from_secs(1800)));
        assert_eq!(parse_duration("2h"), Some(Duration::from_secs(7200)));
        assert_eq!(parse_duration("7d"), Some(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_duration("2 weeks"), None);
        assert_eq!(parse_duration("99999999999999999999h"), None);
        assert_eq!(parse_bytes("4MiB"), Some(4 << 20));
        assert_eq!(parse_bytes("512"), Some(512));
        assert_eq!(parse_bytes("lots"), None);
    }

    #[test]
    fn out_of_range_duration_is_refused() {
        let map = vars(&[("DRAIN", "2h")]);
        let mut v = Vars::from_map(&map);
        let d = v.duration_in(
            "DRAIN",
            Duration::from_secs(5),
            Duration::ZERO,
            Duration::from_secs(60),
        );
        assert_eq!(d, Duration::from_secs(5));
        assert_eq!(v.finish(()).unwrap_err().0[0].var, "DRAIN");
    }

    #[test]
    fn a_duration_that_can_be_switched_off_takes_off_a_duration_or_its_default() {
        let day = Duration::from_secs(86_400);
        let (hour, year) = (Duration::from_secs(3600), 365 * day);
        let map = vars(&[
            ("KEEP", "Off"),
            ("KEEP_FOR", "30d"),
            ("TOO_SHORT", "1m"),
            ("GARBLED", "soon"),
        ]);
        let mut v = Vars::from_map(&map);
        assert_eq!(v.duration_or_off("KEEP", Some(day), hour, year), None);
        assert_eq!(
            v.duration_or_off("KEEP_FOR", None, hour, year),
            Some(30 * day)
        );
        assert_eq!(v.duration_or_off("UNSET", Some(day), hour, year), Some(day));
        assert_eq!(v.duration_or_off("UNSET", None, hour, year), None);
        v.duration_or_off("TOO_SHORT", Some(day), hour, year);
        v.duration_or_off("GARBLED", Some(day), hour, year);
        let err = v.finish(()).unwrap_err();
        assert_eq!(err.0.len(), 2);
        assert_eq!(err.0[0].var, "TOO_SHORT");
        assert_eq!(err.0[1].var, "GARBLED");
        // Each says how to switch it off, not only what duration to give.
        for e in &err.0 {
            assert!(e.to_string().contains(", or off"), "{e}");
        }
        assert!(
            err.0[0]
                .problem
                .contains("is shorter than 1h: use a duration from 1h to 365d, or off"),
            "{}",
            err.0[0]
        );
    }

    #[test]
    fn a_duration_is_shown_in_the_units_it_is_written_in() {
        for (d, shown) in [
            (Duration::ZERO, "0ms"),
            (Duration::from_millis(500), "500ms"),
            (Duration::from_millis(1500), "1500ms"),
            (Duration::from_secs(90), "90s"),
            (Duration::from_secs(1800), "30m"),
            (Duration::from_secs(7200), "2h"),
            (Duration::from_secs(36_500 * 86_400), "36500d"),
            (Duration::from_nanos(1500), "1.5µs"),
        ] {
            assert_eq!(format_duration(d), shown);
            if d.subsec_nanos().is_multiple_of(1_000_000) {
                assert_eq!(parse_duration(&format_duration(d)), Some(d), "{shown}");
            }
        }
    }
}
