//! Dates as users and models write and read them: RFC 3339, a plain date or a local time in
//! (the last read in the user's zone), short readable forms out ("Nov 25", "Nov 25 09:30"), in
//! the user's time zone when known.

use std::time::SystemTime;

use jiff::{
    Timestamp, Zoned,
    civil::{Date, DateTime},
    fmt::temporal::Pieces,
    tz::{AmbiguousOffset, Offset, TimeZone},
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

/// What the clocks of `tz` do to `local` when it is not simply read: a time they skip (read
/// as [`local_in`] does, later than written) or one they repeat (read as the first of two) —
/// said so that whoever set it is told, not shown a time they did not write or left to
/// guess which of two was meant. `None` for an ordinary time.
pub fn local_note(local: DateTime, tz: &TimeZone) -> Option<String> {
    let zone = tz.iana_name().unwrap_or("the user's time zone");
    // As written: to the second, and its fraction, when it has them.
    let written = match (local.second(), local.subsec_nanosecond()) {
        (0, 0) => local.strftime("%H:%M on %b %-d"),
        _ => local.strftime("%H:%M:%S%.f on %b %-d"),
    };
    match tz.to_ambiguous_timestamp(local).offset() {
        AmbiguousOffset::Unambiguous { .. } => None,
        AmbiguousOffset::Gap { before, after } => Some(format!(
            "{written} does not exist in {zone} (the clocks go forward {} then), so it was read as {}",
            shift(before, after),
            with_zone(local_in(local, tz).ok()?, tz),
        )),
        AmbiguousOffset::Fold { before, after } => {
            let second = after.to_timestamp(local).ok()?;
            Some(format!(
                "{written} happens twice in {zone} (the clocks go back {} then): it was read as the first, {}; for the second, {}, write {}{}",
                shift(after, before),
                with_zone(before.to_timestamp(local).ok()?, tz),
                with_zone(second, tz),
                local.strftime("%Y-%m-%dT%H:%M:%S%.f"),
                rfc3339_offset(after),
            ))
        }
    }
}

/// [`local_note`] for a time written with a zone in brackets and no offset
/// (`2030-03-10T02:30[America/New_York]`), which [`Written::read`] takes as an instant: jiff
/// reads a time that zone skips or repeats as [`local_in`] does, and the writer is told so
/// as for a local time. `None` for every other form (an offset says which of two it is).
pub fn zone_note(raw: &str) -> Option<String> {
    let pieces = Pieces::parse(raw.trim()).ok()?;
    let time = pieces.time()?;
    if pieces.offset().is_some() {
        return None;
    }
    let tz = pieces.to_time_zone().ok()??;
    local_note(pieces.date().to_datetime(time), &tz)
}

/// How far the clocks move between two offsets: "an hour", "30 minutes".
fn shift(from: Offset, to: Offset) -> String {
    match (to.seconds() - from.seconds()).unsigned_abs() / 60 {
        60 => "an hour".into(),
        m if m.is_multiple_of(60) => format!("{} hours", m / 60),
        m => format!("{m} minutes"),
    }
}

/// "-05:00", as RFC 3339 writes an offset.
fn rfc3339_offset(o: Offset) -> String {
    let secs = o.seconds();
    let sign = if secs < 0 { '-' } else { '+' };
    let mins = secs.unsigned_abs() / 60;
    format!("{sign}{:02}:{:02}", mins / 60, mins % 60)
}

/// A time argument as read: the instant, and what its writer must be told about how it was
/// read (see [`local_note`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    pub at: SystemTime,
    pub note: Option<String>,
}

impl Resolved {
    /// `said` with the note after it, when there is one: `Reminder #3 set for Mar 8 03:30 EDT:
    /// "Water plants". (02:30 on Mar 8 does not exist …)`.
    pub fn noted(&self, said: String) -> String {
        match &self.note {
            Some(note) => format!("{said} ({note}.)"),
            None => said,
        }
    }
}

/// An RFC 3339 date-time (`2026-11-25T17:00:00Z`, `2026-11-25T17:00:00+01:00`); a date
/// (`2026-11-25`: by the end of that day in `local`, the user's zone, else UTC's); or a local
/// date-time (`2026-11-25T17:00`) read in `local`, noted when that zone's clocks skip or
/// repeat it. A local time with no zone to read it in is refused, never guessed: an hour off
/// is a reminder at the wrong time.
pub fn parse_when(raw: &str, local: Option<&TimeZone>) -> Result<Resolved, String> {
    let raw = raw.trim();
    let mut note = None;
    let at = match Written::read(raw) {
        Some(Written::At(ts)) => {
            note = zone_note(raw);
            ts
        }
        Some(Written::Day(date)) => day_end(date, local.unwrap_or(&TimeZone::UTC))?,
        Some(Written::Local(t)) => match local {
            Some(tz) => {
                note = local_note(t, tz);
                local_in(t, tz)?
            }
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
    Ok(Resolved {
        at: SystemTime::from(at),
        note,
    })
}

/// The end of `date` in `tz`, as a deadline "by" that day means: 23:59:59, and the later of
/// the two where the clocks go back at midnight and repeat the day's last hour
/// (America/Santiago), so the deadline is not an hour before the day ends.
fn day_end(date: Date, tz: &TimeZone) -> Result<Timestamp, String> {
    tz.to_ambiguous_timestamp(date.at(23, 59, 59, 0))
        .later()
        .map_err(|e| format!("{date} is out of range ({e})"))
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
        let t = parse_when("2026-11-25T17:00:00Z", None).unwrap().at;
        assert_eq!(short_datetime(t, &TimeZone::UTC), "Nov 25 17:00");
        assert_eq!(short_datetime(t, &zone("Europe/Berlin")), "Nov 25 18:00");
        let d = parse_when("2026-11-25", None).unwrap().at;
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
        let t = parse_when("2026-11-25T17:00", Some(&berlin)).unwrap().at;
        assert_eq!(short_datetime(t, &TimeZone::UTC), "Nov 25 16:00");
        let d = parse_when("2026-11-25", Some(&berlin)).unwrap().at;
        assert_eq!(short_datetime(d, &TimeZone::UTC), "Nov 25 22:59");
        let refused = parse_when("2026-11-25T17:00:00", None).unwrap_err();
        assert!(refused.contains("no offset"), "{refused}");
        assert!(refused.contains("time zone is not known"), "{refused}");
    }

    #[test]
    fn a_local_time_the_clocks_skip_is_read_later_and_says_so() {
        let new_york = zone("America/New_York");
        let read = parse_when("2026-03-08T02:30", Some(&new_york)).unwrap();
        assert_eq!(short_datetime_zoned(read.at, &new_york), "Mar 8 03:30 EDT");
        assert_eq!(
            read.note.as_deref(),
            Some(
                "02:30 on Mar 8 does not exist in America/New_York (the clocks go forward an hour then), so it was read as Mar 8 03:30 EDT"
            )
        );
    }

    #[test]
    fn a_local_time_the_clocks_repeat_is_read_as_the_first_and_says_how_to_write_the_second() {
        let new_york = zone("America/New_York");
        let read = parse_when("2026-11-01T01:30", Some(&new_york)).unwrap();
        assert_eq!(short_datetime_zoned(read.at, &new_york), "Nov 1 01:30 EDT");
        let note = read.note.expect("a repeated time is noted");
        assert_eq!(
            note,
            "01:30 on Nov 1 happens twice in America/New_York (the clocks go back an hour then): it was read as the first, Nov 1 01:30 EDT; for the second, Nov 1 01:30 EST, write 2026-11-01T01:30:00-05:00"
        );
        // A fraction of a second is kept in both.
        let exact = parse_when("2026-11-01T01:30:00.25", Some(&new_york))
            .unwrap()
            .note
            .unwrap();
        assert!(
            exact.starts_with("01:30:00.25 on Nov 1 happens twice")
                && exact.ends_with("write 2026-11-01T01:30:00.25-05:00"),
            "{exact}"
        );
        let second = parse_when("2026-11-01T01:30:00-05:00", Some(&new_york)).unwrap();
        assert_eq!(
            short_datetime_zoned(second.at, &new_york),
            "Nov 1 01:30 EST"
        );
        assert_eq!(second.note, None, "an offset says which: nothing to note");
    }

    #[test]
    fn an_ordinary_local_time_and_a_half_hour_shift_are_noted_as_they_are() {
        let new_york = zone("America/New_York");
        assert_eq!(
            parse_when("2026-03-08T04:30", Some(&new_york))
                .unwrap()
                .note,
            None
        );
        // Lord Howe Island moves its clocks by half an hour.
        let lord_howe = zone("Australia/Lord_Howe");
        let note = parse_when("2026-10-04T02:15", Some(&lord_howe))
            .unwrap()
            .note
            .expect("skipped");
        assert!(note.contains("forward 30 minutes"), "{note}");
    }

    #[test]
    fn a_time_with_its_zone_in_brackets_and_no_offset_is_noted_as_a_local_time_is() {
        let new_york = zone("America/New_York");
        // Read in the zone it names, whatever the user's.
        let skipped = parse_when("2030-03-10T02:30[America/New_York]", None).unwrap();
        assert_eq!(
            short_datetime_zoned(skipped.at, &new_york),
            "Mar 10 03:30 EDT"
        );
        assert_eq!(
            skipped.note.as_deref(),
            Some(
                "02:30 on Mar 10 does not exist in America/New_York (the clocks go forward an hour then), so it was read as Mar 10 03:30 EDT"
            )
        );
        let repeated =
            parse_when("2030-11-03T01:30[America/New_York]", Some(&TimeZone::UTC)).unwrap();
        assert_eq!(
            short_datetime_zoned(repeated.at, &new_york),
            "Nov 3 01:30 EDT"
        );
        assert!(
            repeated
                .note
                .is_some_and(|n| n.contains("write 2030-11-03T01:30:00-05:00")),
        );
        // An offset beside the zone says which of the two: nothing to note.
        let second = parse_when("2030-11-03T01:30-05:00[America/New_York]", None).unwrap();
        assert_eq!(
            short_datetime_zoned(second.at, &new_york),
            "Nov 3 01:30 EST"
        );
        assert_eq!(second.note, None);
        assert_eq!(
            parse_when("2030-11-03T09:00[America/New_York]", None)
                .unwrap()
                .note,
            None
        );
    }

    #[test]
    fn a_day_ends_at_its_last_second_where_the_clocks_go_back_at_midnight() {
        // Chile's clocks go back from Apr 5 00:00 to Apr 4 23:00 in 2026: 23:59:59 on Apr 4
        // happens twice, and the day ends at the second.
        let santiago = zone("America/Santiago");
        let due = parse_when("2026-04-04", Some(&santiago)).unwrap();
        assert_eq!(
            Timestamp::try_from(due.at).unwrap().to_string(),
            "2026-04-05T03:59:59Z"
        );
        assert_eq!(due.note, None, "the end of the day is what was meant");
        // Elsewhere, the day's 23:59:59.
        let new_york = parse_when("2026-11-01", Some(&zone("America/New_York"))).unwrap();
        assert_eq!(
            Timestamp::try_from(new_york.at).unwrap().to_string(),
            "2026-11-02T04:59:59Z"
        );
    }

    #[test]
    fn overdue_days_count_the_users_days() {
        let utc = TimeZone::UTC;
        let due = parse_when("2026-11-20T10:00:00Z", None).unwrap().at;
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
        let due = parse_when("2026-11-20T23:00:00Z", None).unwrap().at;
        assert_eq!(short_date(due, &new_york), "Nov 20");
        let now = parse_when("2026-11-22T01:00:00Z", None).unwrap().at;
        assert_eq!(overdue_days(due, now, &new_york), 1);
        assert_eq!(overdue_days(due, now, &utc), 2);
    }
}
