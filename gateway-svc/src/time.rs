//! Dates as users and models write and read them: RFC 3339 or a plain date in, short readable
//! forms out ("Nov 25", "Nov 25 09:30"), in the user's time zone when known.

use std::time::{Duration, SystemTime};

use jiff::{Timestamp, civil::Date, tz::TimeZone};

/// An RFC 3339 date-time (`2026-11-25T17:00:00Z`, `2026-11-25T17:00:00+01:00`) or a date
/// (`2026-11-25`: due by the end of that day in `tz`, the user's zone).
pub fn parse_when(raw: &str, tz: &TimeZone) -> Result<SystemTime, String> {
    let raw = raw.trim();
    if let Ok(ts) = raw.parse::<Timestamp>() {
        return Ok(SystemTime::from(ts));
    }
    if let Ok(date) = raw.parse::<Date>() {
        let end = date
            .at(23, 59, 59, 0)
            .to_zoned(tz.clone())
            .map_err(|e| format!("{raw:?} is out of range ({e})"))?;
        return Ok(SystemTime::from(end.timestamp()));
    }
    Err(format!(
        "{raw:?} is not a date-time; use RFC 3339 like 2026-11-25T17:00:00Z or a date like 2026-11-25"
    ))
}

/// The named IANA zone, or UTC when empty or unknown.
pub fn zone(name: &str) -> TimeZone {
    if name.is_empty() {
        return TimeZone::UTC;
    }
    TimeZone::get(name).unwrap_or(TimeZone::UTC)
}

fn zoned(t: SystemTime, tz: &TimeZone) -> Option<jiff::Zoned> {
    Timestamp::try_from(t)
        .ok()
        .map(|ts| ts.to_zoned(tz.clone()))
}

/// "Nov 25"
pub fn short_date(t: SystemTime, tz: &TimeZone) -> String {
    zoned(t, tz).map_or_else(
        || "(invalid date)".into(),
        |z| z.strftime("%b %-d").to_string(),
    )
}

/// "Nov 25 09:30 CET": a time the model passes on, with the zone it is in.
pub fn short_datetime_zoned(t: SystemTime, tz: &TimeZone) -> String {
    Timestamp::try_from(t).map_or_else(|_| "(invalid date)".into(), |ts| with_zone(ts, tz))
}

/// As [`short_datetime_zoned`], for an instant read from upstream.
pub fn with_zone(ts: Timestamp, tz: &TimeZone) -> String {
    ts.to_zoned(tz.clone())
        .strftime("%b %-d %H:%M %Z")
        .to_string()
}

/// "Nov 25 09:30"
pub fn short_datetime(t: SystemTime, tz: &TimeZone) -> String {
    zoned(t, tz).map_or_else(
        || "(invalid date)".into(),
        |z| z.strftime("%b %-d %H:%M").to_string(),
    )
}

/// "09:30" when `t` is on the same local day as `now`, else "Nov 25 09:30".
pub fn time_or_datetime(t: SystemTime, now: SystemTime, tz: &TimeZone) -> String {
    match (zoned(t, tz), zoned(now, tz)) {
        (Some(a), Some(b)) if a.date() == b.date() => a.strftime("%H:%M").to_string(),
        _ => short_datetime(t, tz),
    }
}

/// Whole days past due, rounded up (a task due an hour ago is 1 day overdue); 0 if not overdue.
pub fn overdue_days(due: SystemTime, now: SystemTime) -> u32 {
    match now.duration_since(due) {
        Ok(d) if d > Duration::ZERO => {
            u32::try_from(d.as_secs().div_ceil(86_400)).unwrap_or(u32::MAX)
        }
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_date_times_and_plain_dates_are_understood() {
        let t = parse_when("2026-11-25T17:00:00Z", &TimeZone::UTC).unwrap();
        assert_eq!(short_datetime(t, &TimeZone::UTC), "Nov 25 17:00");
        assert_eq!(short_datetime(t, &zone("Europe/Berlin")), "Nov 25 18:00");
        let d = parse_when("2026-11-25", &TimeZone::UTC).unwrap();
        assert_eq!(short_datetime(d, &TimeZone::UTC), "Nov 25 23:59");
        assert!(
            parse_when("next tuesday", &TimeZone::UTC)
                .unwrap_err()
                .contains("RFC 3339")
        );
    }

    #[test]
    fn overdue_days_round_up() {
        let due = parse_when("2026-11-20T10:00:00Z", &TimeZone::UTC).unwrap();
        assert_eq!(overdue_days(due, due - Duration::from_secs(5)), 0);
        assert_eq!(overdue_days(due, due + Duration::from_secs(3600)), 1);
        assert_eq!(
            overdue_days(due, due + Duration::from_secs(86_400 * 2 + 1)),
            3
        );
    }
}
