//! Dates as users and models write and read them: RFC 3339, a plain date or a local time in
//! (the last read in the user's zone), short readable forms out ("Nov 25", "Nov 25 09:30"), in
//! the user's time zone when known.

use std::time::SystemTime;

use jiff::{
    Timestamp, Zoned,
    civil::{Date, DateTime},
    fmt::temporal::Pieces,
    tz::TimeZone,
};

/// How a time argument is written: an instant (an offset, or a zone in brackets), a whole
/// day (a date alone, `2026-11-25` or `20261125`), or a local date-time to be read in some
/// zone (`2026-11-25T17:00`). Read by its parts, so no form is taken for another: a date-time
/// is never cut to its date, nor a date stretched to its midnight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Written {
    At(Timestamp),
    Day(Date),
    Local(DateTime),
}

impl Written {
    /// `None`: not a date or time at all.
    pub fn read(raw: &str) -> Option<Self> {
        let raw = raw.trim();
        let pieces = Pieces::parse(raw).ok()?;
        let Some(time) = pieces.time() else {
            // A date alone is a whole day, whatever zone is written beside it.
            return Some(Self::Day(pieces.date()));
        };
        if pieces.time_zone_annotation().is_some() {
            // "2026-11-25T09:00[Asia/Tokyo]": in the zone it names, not the user's. An offset
            // that zone never had there is refused (jiff's rejection), not guessed between.
            return raw.parse::<Zoned>().ok().map(|z| Self::At(z.timestamp()));
        }
        if pieces.offset().is_some() {
            return raw.parse::<Timestamp>().ok().map(Self::At);
        }
        Some(Self::Local(pieces.date().to_datetime(time)))
    }
}

/// `local` in `tz`. A time a daylight-saving change skips is taken as the same length of time
/// after the change (02:30 on a spring-forward night is 03:30), one it repeats as the first
/// of the two, as calendars do.
pub fn local_in(local: DateTime, tz: &TimeZone) -> Result<Timestamp, String> {
    local
        .to_zoned(tz.clone())
        .map(|z| z.timestamp())
        .map_err(|e| format!("{local} is out of range ({e})"))
}

/// An RFC 3339 date-time (`2026-11-25T17:00:00Z`, `2026-11-25T17:00:00+01:00`); a date
/// (`2026-11-25`: by the end of that day in `local`, the user's zone, else UTC's); or a local
/// date-time (`2026-11-25T17:00`) read in `local`. A local time with no zone to read it in
/// is refused, never guessed: an hour off is a reminder at the wrong time.
pub fn parse_when(raw: &str, local: Option<&TimeZone>) -> Result<SystemTime, String> {
    let raw = raw.trim();
    let at = match Written::read(raw) {
        Some(Written::At(ts)) => ts,
        Some(Written::Day(date)) => {
            local_in(date.at(23, 59, 59, 0), local.unwrap_or(&TimeZone::UTC))?
        }
        Some(Written::Local(t)) => match local {
            Some(tz) => local_in(t, tz)?,
            None => {
                return Err(format!(
                    "{raw:?} has no offset and the user's time zone is not known; add one, like 2026-11-25T17:00:00+01:00 or 2026-11-25T17:00:00Z"
                ));
            }
        },
        None => {
            return Err(format!(
                "{raw:?} is not a date-time; use RFC 3339 like 2026-11-25T17:00:00Z or a date like 2026-11-25"
            ));
        }
    };
    Ok(SystemTime::from(at))
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

/// Days past due, counted as the user sees them: from the due date to today, both in `tz`
/// (due Nov 25, it is Nov 27 there: 2). A task due an hour ago, today, is 1 day overdue;
/// one not yet due is 0.
pub fn overdue_days(due: SystemTime, now: SystemTime, tz: &TimeZone) -> u32 {
    if now <= due {
        return 0;
    }
    let days = match (zoned(due, tz), zoned(now, tz)) {
        (Some(due), Some(now)) => (now.date() - due.date()).get_days(),
        // Past what a calendar holds: a day is as good as any count.
        _ => 1,
    };
    u32::try_from(days).unwrap_or(0).max(1)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn both_date_times_and_plain_dates_are_understood() {
        let t = parse_when("2026-11-25T17:00:00Z", None).unwrap();
        assert_eq!(short_datetime(t, &TimeZone::UTC), "Nov 25 17:00");
        assert_eq!(short_datetime(t, &zone("Europe/Berlin")), "Nov 25 18:00");
        let d = parse_when("2026-11-25", None).unwrap();
        assert_eq!(short_datetime(d, &TimeZone::UTC), "Nov 25 23:59");
        assert!(
            parse_when("next tuesday", None)
                .unwrap_err()
                .contains("RFC 3339")
        );
        assert!(parse_when("2026-11-25 and more", None).is_err());
    }

    #[test]
    fn a_local_time_is_read_in_the_users_zone_and_refused_without_one() {
        let berlin = zone("Europe/Berlin");
        let t = parse_when("2026-11-25T17:00", Some(&berlin)).unwrap();
        assert_eq!(short_datetime(t, &TimeZone::UTC), "Nov 25 16:00");
        let d = parse_when("2026-11-25", Some(&berlin)).unwrap();
        assert_eq!(short_datetime(d, &TimeZone::UTC), "Nov 25 22:59");
        let refused = parse_when("2026-11-25T17:00:00", None).unwrap_err();
        assert!(refused.contains("no offset"), "{refused}");
        assert!(refused.contains("time zone is not known"), "{refused}");
    }

    #[test]
    fn overdue_days_count_the_users_days() {
        let utc = TimeZone::UTC;
        let due = parse_when("2026-11-20T10:00:00Z", None).unwrap();
        assert_eq!(overdue_days(due, due - Duration::from_secs(5), &utc), 0);
        // Later the same day: a day overdue, not none.
        assert_eq!(overdue_days(due, due + Duration::from_secs(3600), &utc), 1);
        assert_eq!(
            overdue_days(due, due + Duration::from_secs(86_400 * 2 + 1), &utc),
            2
        );
        // Due at 18:00 on Nov 20 in New York (23:00 UTC); at 01:00 UTC on the 22nd it is still
        // the 21st there: the user, shown "due Nov 20", reads one day, where UTC's days say two.
        let new_york = zone("America/New_York");
        let due = parse_when("2026-11-20T23:00:00Z", None).unwrap();
        assert_eq!(short_date(due, &new_york), "Nov 20");
        let now = parse_when("2026-11-22T01:00:00Z", None).unwrap();
        assert_eq!(overdue_days(due, now, &new_york), 1);
        assert_eq!(overdue_days(due, now, &utc), 2);
    }
}
