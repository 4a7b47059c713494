//! When a schedule is due (E-2, B-4): a five-field cron expression read in the user's IANA time
//! zone, or a fixed interval. Validation here is what CreateSchedule and UpdateSchedule report
//! (INVALID_ARGUMENT naming the field); the store calls [`Recurrence::next_due`] when it claims
//! an occurrence, so every replica computes the same next time.
//!
//! Daylight saving: cron times are civil times in the zone. They are searched on the wall
//! clock (`jiff-cron` over civil time, where no hour is missing or repeated) and each one found
//! is then placed in the zone, so every civil time in the expression fires once a day across
//! both transitions — a daily 09:00 stays 09:00 local, and "every two hours" keeps its twelve
//! a day. A time that does not exist on a spring-forward day fires shifted forward by the gap
//! (02:30 in Europe/Berlin fires at 03:30 that day); a time that exists twice on a fall-back
//! day fires once, at the first of the two (RFC 5545's rule, jiff's `compatible`).

use std::{str::FromStr, time::Duration, time::SystemTime};

use jiff::{Timestamp, Zoned, tz::TimeZone};

/// An IANA time zone by name, as a user gives it: a run's, a session's, a schedule's. Refused
/// (saying what to give instead): a name the zone database does not hold, and the names it
/// holds that are not a place — the server's own zone (`localtime`), `Factory`, `posixrules`,
/// `Etc/Unknown` — which would tell the model nothing it can use.
pub fn user_zone(field: &str, name: &str) -> Result<TimeZone, String> {
    const NOT_A_PLACE: [&str; 4] = ["localtime", "factory", "posixrules", "etc/unknown"];
    let name = name.trim();
    TimeZone::get(name)
        .ok()
        .filter(|z| {
            z.iana_name()
                .is_some_and(|n| !NOT_A_PLACE.contains(&n.to_ascii_lowercase().as_str()))
                && !NOT_A_PLACE.contains(&name.to_ascii_lowercase().as_str())
        })
        .ok_or_else(|| {
            format!("{field} {name:?} is not an IANA time zone name (e.g. \"Europe/Berlin\")")
        })
}

/// What the schedule's next occurrence is computed from.
#[derive(Debug, Clone)]
pub enum Recurrence {
    Cron {
        expr: String,
        zone: TimeZone,
        schedule: Box<jiff_cron::Schedule>,
    },
    /// Every `period` from the schedule's anchor (its creation), whatever the clock on the wall.
    Every { period: Duration },
}

/// Three hours of minutes: the longest gap or fold in the zone database, minute by minute
/// (see `next_due`).
const FOLD_MINUTES: usize = 3 * 60 + 1;

/// Day-of-week names in standard cron order (0 = Sunday; 7 is Sunday too).
const DAYS: [&str; 7] = ["Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"];

impl Recurrence {
    /// A standard five-field cron expression (minute hour day-of-month month day-of-week) in
    /// `zone`. Errors name the field (`cron` or `time_zone`) and what to fix.
    pub fn cron(expr: &str, zone: &str) -> Result<Self, String> {
        let zone_name = zone.trim();
        if zone_name.is_empty() {
            return Err(
                "time_zone is required with cron: an IANA name such as \"Europe/Berlin\"".into(),
            );
        }
        let tz = user_zone("time_zone", zone_name)?;
        let fields: Vec<&str> = expr.split_whitespace().collect();
        if fields.len() != 5 {
            return Err(format!(
                "cron {expr:?} has {} fields; write five: minute hour day-of-month month day-of-week (e.g. \"0 9 * * 1-5\")",
                fields.len()
            ));
        }
        if fields[2] != "*" && fields[4] != "*" {
            return Err(format!(
                "cron {expr:?} restricts both day-of-month and day-of-week; restrict one of them"
            ));
        }
        let days = weekdays(fields[4]).map_err(|e| format!("cron {expr:?}: day-of-week {e}"))?;
        // jiff-cron counts weekdays 1..7 from Sunday; standard cron counts 0..6. Names are the
        // same in both, so the field is handed over as names.
        let full = format!(
            "0 {} {} {} {} {}",
            fields[0], fields[1], fields[2], fields[3], days
        );
        let schedule = jiff_cron::Schedule::from_str(&full)
            .map_err(|e| format!("cron {expr:?} is not a valid expression: {e}"))?;
        let recurrence = Recurrence::Cron {
            expr: fields.join(" "),
            zone: tz,
            schedule: Box::new(schedule),
        };
        if recurrence
            .next_due(SystemTime::now(), SystemTime::now())
            .is_none()
        {
            return Err(format!("cron {expr:?} never fires"));
        }
        Ok(recurrence)
    }

    pub fn every(period: Duration) -> Self {
        Recurrence::Every { period }
    }

    /// The first occurrence strictly after `after`. `anchor` is where an interval counts from.
    pub fn next_due(&self, anchor: SystemTime, after: SystemTime) -> Option<SystemTime> {
        match self {
            Recurrence::Every { period } => {
                let period = period.as_secs().max(1);
                let since = after
                    .duration_since(anchor)
                    .map(|d| d.as_secs() / period + 1)
                    .unwrap_or(0);
                anchor.checked_add(Duration::from_secs(since.checked_mul(period)?))
            }
            Recurrence::Cron { zone, schedule, .. } => {
                let at = Timestamp::try_from(after).ok()?;
                // Searched in the zone itself, the library stepped by absolute hours and, landing
                // on an hour the expression does not hold (03:00 after 00:00 + 2 h on a spring
                // day), gave up the rest of the day. On the wall clock (UTC has no transitions)
                // every civil time is met once.
                let wall = Zoned::new(at, zone.clone())
                    .datetime()
                    .to_zoned(TimeZone::UTC)
                    .ok()?;
                // Placing is not monotonic where the clock jumps: a civil time in a gap is
                // shifted forward past later civil times (02:30 fires at 03:30, after 03:00),
                // and one in a fold lands on its first pass. So the search starts a fold's or
                // gap's length before `after` on the wall, and the earliest placed time after
                // `after` wins, once the civil times are past that length after it.
                let horizon = jiff::SignedDuration::from_hours(3);
                let start = wall.checked_sub(horizon).ok()?;
                let end = wall.checked_add(horizon).ok()?;
                let mut earliest: Option<Timestamp> = None;
                for civil in schedule.after(start).take(3 * FOLD_MINUTES) {
                    let placed = zone.to_ambiguous_zoned(civil.datetime()).compatible().ok();
                    if let Some(t) = placed.map(|p| p.timestamp()).filter(|t| *t > at) {
                        earliest = Some(earliest.map_or(t, |e| e.min(t)));
                    }
                    if earliest.is_some() && civil > end {
                        break;
                    }
                }
                earliest.map(SystemTime::from)
            }
        }
    }

    /// The shortest gap between the next few occurrences after `from`: what "too frequent" is
    /// judged by. A cron expression is judged on the wall clock, as written: a spring-forward
    /// day's missing hour (01:00 then 03:00 for "every two hours") does not make it more
    /// frequent than it is.
    pub fn shortest_gap(&self, from: SystemTime) -> Duration {
        let wall = match self {
            Recurrence::Every { period } => return *period,
            Recurrence::Cron { expr, schedule, .. } => Recurrence::Cron {
                expr: expr.clone(),
                zone: TimeZone::UTC,
                schedule: schedule.clone(),
            },
        };
        let mut shortest = Duration::MAX;
        let mut last = match wall.next_due(from, from) {
            Some(t) => t,
            None => return shortest,
        };
        for _ in 0..48 {
            let Some(next) = wall.next_due(from, last) else {
                break;
            };
            shortest = shortest.min(next.duration_since(last).unwrap_or_default());
            last = next;
        }
        shortest
    }

    /// The cron expression as the user wrote it (normalised spacing), if this is one.
    pub fn cron_expr(&self) -> Option<&str> {
        match self {
            Recurrence::Cron { expr, .. } => Some(expr),
            Recurrence::Every { .. } => None,
        }
    }
}

/// A standard cron day-of-week field (`*`, lists, ranges, `a/step` and `a-b/step`, numbers 0–7
/// where 0 and 7 are Sunday, three-letter or full English names) as a comma-separated list of
/// day names.
fn weekdays(field: &str) -> Result<String, String> {
    if field == "*" {
        return Ok("*".into());
    }
    const NAMES: [&[&str]; 7] = [
        &["sun", "sunday"],
        &["mon", "monday"],
        &["tue", "tues", "tuesday"],
        &["wed", "wednesday"],
        &["thu", "thur", "thurs", "thursday"],
        &["fri", "friday"],
        &["sat", "saturday"],
    ];
    // 0..=7, keeping 7 (Sunday at the end of a range) distinct from 0 until the set is built.
    let day = |s: &str| -> Result<usize, String> {
        if let Ok(n) = s.parse::<usize>() {
            return if n <= 7 {
                Ok(n)
            } else {
                Err(format!("{n} is out of range 0-7"))
            };
        }
        let lower = s.to_ascii_lowercase();
        NAMES
            .iter()
            .position(|names| names.contains(&lower.as_str()))
            .ok_or_else(|| format!("{s:?} is not a day (0-7 or Sun..Sat)"))
    };
    let mut set = [false; 7];
    for part in field.split(',') {
        let (range, step) = match part.split_once('/') {
            Some((r, s)) => (
                r,
                Some(
                    s.parse::<usize>()
                        .ok()
                        .filter(|s| *s > 0)
                        .ok_or_else(|| format!("step {s:?} must be a positive number"))?,
                ),
            ),
            None => (part, None),
        };
        let (from, to) = match range.split_once('-') {
            _ if range == "*" => (0, 6),
            Some((a, b)) => {
                let (a, b) = (day(a)?, day(b)?);
                if a > b {
                    return Err(format!("range {range:?} runs backwards"));
                }
                (a, b)
            }
            // "a/step" runs from a to the end of the week, as in standard cron.
            None if step.is_some() => (day(range)?, 6),
            None => (day(range)?, day(range)?),
        };
        for d in (from..=to).step_by(step.unwrap_or(1)) {
            set[d % 7] = true;
        }
    }
    Ok(DAYS
        .iter()
        .zip(set)
        .filter(|(_, on)| *on)
        .map(|(d, _)| *d)
        .collect::<Vec<_>>()
        .join(","))
}

#[cfg(test)]
mod tests {
    use super::*;
    use jiff::civil::date;

    #[test]
    fn a_users_zone_is_a_place_in_the_zone_database() {
        for given in [
            " Europe/Berlin ",
            "Etc/GMT+3",
            "UTC",
            "America/Argentina/Buenos_Aires",
        ] {
            let zone = user_zone("time_zone", given).unwrap();
            assert!(zone.iana_name().is_some(), "{given}");
        }
        for refused in [
            "localtime",
            "Factory",
            "posixrules",
            "Etc/Unknown",
            "Mars/Olympus_Mons",
            "UTC+3",
            "",
        ] {
            let said = user_zone("time_zone", refused).unwrap_err();
            assert!(
                said.contains("is not an IANA time zone name"),
                "{refused}: {said}"
            );
        }
    }

    fn at(s: &str) -> SystemTime {
        let z: Zoned = s.parse().unwrap();
        SystemTime::from(z.timestamp())
    }

    fn local(t: SystemTime, zone: &str) -> String {
        Zoned::new(
            Timestamp::try_from(t).unwrap(),
            TimeZone::get(zone).unwrap(),
        )
        .strftime("%Y-%m-%d %H:%M %Z")
        .to_string()
    }

    fn occurrences(r: &Recurrence, from: SystemTime, n: usize) -> Vec<SystemTime> {
        let mut out = Vec::new();
        let mut t = from;
        for _ in 0..n {
            t = r.next_due(from, t).unwrap();
            out.push(t);
        }
        out
    }

    #[test]
    fn e2_a_daily_nine_oclock_briefing_neither_skips_nor_doubles_across_daylight_saving() {
        let r = Recurrence::cron("0 9 * * *", "Europe/Berlin").unwrap();
        for (start, label) in [
            (
                "2026-03-27T12:00:00+01:00[Europe/Berlin]",
                "spring forward on 03-29",
            ),
            (
                "2026-10-23T12:00:00+02:00[Europe/Berlin]",
                "fall back on 10-25",
            ),
        ] {
            let got: Vec<String> = occurrences(&r, at(start), 4)
                .into_iter()
                .map(|t| local(t, "Europe/Berlin"))
                .collect();
            let day = |d: i8, m: i8| {
                let z = date(2026, m, d)
                    .at(9, 0, 0, 0)
                    .in_tz("Europe/Berlin")
                    .unwrap();
                z.strftime("%Y-%m-%d %H:%M %Z").to_string()
            };
            let want: Vec<String> = if label.starts_with("spring") {
                (28..=31).map(|d| day(d, 3)).collect()
            } else {
                (24..=27).map(|d| day(d, 10)).collect()
            };
            assert_eq!(got, want, "{label}");
        }
    }

    #[test]
    fn e2_a_time_inside_the_gap_fires_once_after_it_and_a_repeated_time_fires_once() {
        let r = Recurrence::cron("30 2 * * *", "Europe/Berlin").unwrap();
        let spring = occurrences(&r, at("2026-03-28T12:00:00+01:00[Europe/Berlin]"), 2);
        assert_eq!(local(spring[0], "Europe/Berlin"), "2026-03-29 03:30 CEST");
        assert_eq!(local(spring[1], "Europe/Berlin"), "2026-03-30 02:30 CEST");
        let autumn = occurrences(&r, at("2026-10-24T12:00:00+02:00[Europe/Berlin]"), 2);
        assert_eq!(local(autumn[0], "Europe/Berlin"), "2026-10-25 02:30 CEST");
        assert_eq!(local(autumn[1], "Europe/Berlin"), "2026-10-26 02:30 CET");
    }

    /// Local times of the occurrences on `day` (YYYY-MM-DD, local), stepping from the day before.
    fn one_day(expr: &str, zone: &str, start: &str, day: &str) -> Vec<String> {
        let r = Recurrence::cron(expr, zone).unwrap();
        occurrences(&r, at(start), 40)
            .into_iter()
            .map(|t| local(t, zone))
            .filter(|l| l.starts_with(day))
            .map(|l| l[11..].to_owned())
            .collect()
    }

    #[test]
    fn e2_several_hours_a_day_keep_every_one_across_daylight_saving_and_none_doubles() {
        let hours = |h: &[&str]| h.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
        // Spring forward in Berlin: 02:00 does not exist and fires at 03:00 (once).
        assert_eq!(
            one_day(
                "0 */2 * * *",
                "Europe/Berlin",
                "2026-03-28T21:00:00+01:00[Europe/Berlin]",
                "2026-03-29"
            ),
            hours(&[
                "00:00 CET",
                "03:00 CEST",
                "04:00 CEST",
                "06:00 CEST",
                "08:00 CEST",
                "10:00 CEST",
                "12:00 CEST",
                "14:00 CEST",
                "16:00 CEST",
                "18:00 CEST",
                "20:00 CEST",
                "22:00 CEST"
            ])
        );
        // Fall back in Berlin: 02:00 happens twice and fires once.
        let autumn = one_day(
            "0 */2 * * *",
            "Europe/Berlin",
            "2026-10-24T21:00:00+02:00[Europe/Berlin]",
            "2026-10-25",
        );
        assert_eq!(autumn.len(), 12, "{autumn:?}");
        assert_eq!(&autumn[..3], ["00:00 CEST", "02:00 CEST", "04:00 CET"]);
        assert_eq!(
            one_day(
                "0 0,12 * * *",
                "America/New_York",
                "2026-03-07T18:00:00-05:00[America/New_York]",
                "2026-03-08"
            ),
            hours(&["00:00 EST", "12:00 EDT"])
        );
        // Fall back in New York: 01:00 happens twice and fires once.
        assert_eq!(
            one_day(
                "0 1-3 * * *",
                "America/New_York",
                "2026-10-31T18:00:00-04:00[America/New_York]",
                "2026-11-01"
            ),
            hours(&["01:00 EDT", "02:00 EST", "03:00 EST"])
        );
        // Two times inside the spring-forward gap: each fires, shifted forward by the gap.
        assert_eq!(
            one_day(
                "0,30 2 * * *",
                "Europe/Berlin",
                "2026-03-28T21:00:00+01:00[Europe/Berlin]",
                "2026-03-29"
            ),
            hours(&["03:00 CEST", "03:30 CEST"])
        );
        assert_eq!(
            one_day(
                "*/20 2,3 * * *",
                "Europe/Berlin",
                "2026-03-28T21:00:00+01:00[Europe/Berlin]",
                "2026-03-29"
            ),
            hours(&["03:00 CEST", "03:20 CEST", "03:40 CEST"])
        );
        // Every minute, seen from inside the repeated hour's second pass: its minutes fired in
        // the first, so the next is the first minute after the fold.
        let r = Recurrence::cron("* * * * *", "America/New_York").unwrap();
        let next = r
            .next_due(
                SystemTime::UNIX_EPOCH,
                at("2026-11-01T01:30:00-05:00[America/New_York]"),
            )
            .unwrap();
        assert_eq!(local(next, "America/New_York"), "2026-11-01 02:00 EST");
    }

    #[test]
    fn weekdays_count_from_sunday_zero_as_in_standard_cron() {
        let r = Recurrence::cron("0 9 * * 1-5", "UTC").unwrap();
        // 2026-11-20 is a Friday: the next two are Monday and Tuesday.
        let got = occurrences(&r, at("2026-11-20T10:00:00+00:00[UTC]"), 2);
        assert_eq!(local(got[0], "UTC"), "2026-11-23 09:00 UTC");
        assert_eq!(local(got[1], "UTC"), "2026-11-24 09:00 UTC");
        assert_eq!(weekdays("0").unwrap(), "Sun");
        assert_eq!(weekdays("7").unwrap(), "Sun");
        assert_eq!(weekdays("5-7").unwrap(), "Sun,Fri,Sat");
        assert_eq!(weekdays("*/2").unwrap(), "Sun,Tue,Thu,Sat");
        assert_eq!(weekdays("mon,WED").unwrap(), "Mon,Wed");
        assert_eq!(weekdays("0-7").unwrap(), "Sun,Mon,Tue,Wed,Thu,Fri,Sat");
        assert_eq!(weekdays("1-5/2").unwrap(), "Mon,Wed,Fri");
        assert_eq!(weekdays("5/1").unwrap(), "Fri,Sat");
        assert_eq!(weekdays("Thursday,sun").unwrap(), "Sun,Thu");
        assert!(weekdays("Monkey").unwrap_err().contains("not a day"));
        assert!(weekdays("5-1").unwrap_err().contains("backwards"));
        assert!(weekdays("*/0").unwrap_err().contains("positive"));
    }

    #[test]
    fn e2_every_two_hours_is_two_hours_apart_even_in_the_days_before_daylight_saving() {
        let r = Recurrence::cron("0 */2 * * *", "Europe/Berlin").unwrap();
        // Two days before 2027-03-28, when 02:00 does not exist and 00:00 is followed by 03:00.
        let before = at("2027-03-26T12:00:00+01:00[Europe/Berlin]");
        assert_eq!(r.shortest_gap(before), Duration::from_secs(2 * 3600));
        let fall = at("2027-10-29T12:00:00+02:00[Europe/Berlin]");
        assert_eq!(r.shortest_gap(fall), Duration::from_secs(2 * 3600));
    }

    #[test]
    fn every_minute_is_sixty_seconds_apart_and_an_interval_counts_from_its_anchor() {
        let r = Recurrence::cron("* * * * *", "Europe/Berlin").unwrap();
        assert_eq!(r.shortest_gap(SystemTime::now()), Duration::from_secs(60));
        let anchor = at("2026-11-22T10:00:00+00:00[UTC]");
        let e = Recurrence::every(Duration::from_secs(3600));
        assert_eq!(
            e.next_due(anchor, anchor),
            Some(anchor + Duration::from_secs(3600))
        );
        assert_eq!(
            e.next_due(anchor, anchor + Duration::from_secs(3 * 3600 + 5)),
            Some(anchor + Duration::from_secs(4 * 3600))
        );
    }

    #[test]
    fn bad_expressions_and_zones_name_what_to_fix() {
        let err = |e: &str, z: &str| Recurrence::cron(e, z).unwrap_err();
        assert!(err("0 9 * *", "UTC").contains("4 fields"));
        assert!(err("61 9 * * *", "UTC").starts_with("cron "));
        assert!(err("0 9 1 * 1", "UTC").contains("both day-of-month and day-of-week"));
        assert!(err("0 9 * * 8", "UTC").contains("out of range"));
        assert!(err("0 9 * * *", "Mars/Olympus").contains("time_zone"));
        assert!(err("0 9 * * *", "").contains("time_zone is required"));
        assert!(err("0 0 30 2 *", "UTC").contains("never fires"));
    }
}
