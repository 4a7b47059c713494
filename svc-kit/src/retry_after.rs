//! An upstream's `Retry-After` (RFC 9110 §10.2.3), read the same way by both services: a
//! number of seconds or an HTTP date.

use std::time::{Duration, SystemTime};

/// The longest wait a `Retry-After` is taken to ask for: past it, a number is read as this.
const LONGEST: Duration = Duration::from_secs(86_400);

/// How long `value` asks to wait: `None` when it is neither form. A date already past asks
/// for no wait.
pub fn parse(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs).min(LONGEST));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(
        at.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO)
            .min(LONGEST),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seconds_and_http_dates_are_read_and_anything_else_is_not() {
        assert_eq!(parse(" 7 "), Some(Duration::from_secs(7)));
        assert_eq!(parse("99999999999"), Some(LONGEST));
        let soon = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(120));
        let wait = parse(&soon).expect("a date");
        assert!(
            wait > Duration::from_secs(110) && wait <= Duration::from_secs(120),
            "{wait:?}"
        );
        assert_eq!(parse("Wed, 21 Oct 2015 07:28:00 GMT"), Some(Duration::ZERO));
        assert_eq!(parse("soon"), None);
        assert_eq!(parse("-3"), None);
    }
}
