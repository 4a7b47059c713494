//! Google Calendar over its REST API (I-4): calendar_search, calendar_event_create,
//! calendar_event_update. Times are RFC 3339; an event's own time zone is kept and shown.

use std::{sync::Arc, time::SystemTime};

use serde::Deserialize;
use serde_json::{Map, Value, json};

use super::text_arg;
use crate::{
    context::CallContext,
    domain::Integration,
    enforce::ToolError,
    registry::{Preview, Tool, ToolOutput, ToolSpec, digest, first_lines, line},
    time::{self, Written},
};

pub const DEFAULT_BASE_URL: &str = "https://www.googleapis.com";
const SERVICE: &str = "Google Calendar";
/// Pages of events.list one search may read (each one upstream call).
const MAX_SEARCH_PAGES: usize = 3;

#[derive(Debug, Clone)]
pub struct CalendarApi {
    /// `GOOGLE_CALENDAR_API_BASE_URL`
    pub base_url: String,
}

#[derive(Deserialize, Default)]
struct Events {
    #[serde(default)]
    items: Vec<Event>,
    /// Present when more events match than this page holds.
    #[serde(default, rename = "nextPageToken")]
    next_page_token: Option<String>,
}

#[derive(Deserialize, Default)]
struct Event {
    #[serde(default)]
    id: String,
    #[serde(default)]
    summary: String,
    #[serde(default)]
    location: String,
    #[serde(default)]
    start: EventTime,
    #[serde(default)]
    end: EventTime,
    #[serde(default)]
    attendees: Vec<Attendee>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct Attendee {
    #[serde(default)]
    email: String,
    /// This attendee is the calendar's own user.
    #[serde(default, rename = "self")]
    is_self: bool,
    /// "needsAction", "declined", "tentative" or "accepted".
    #[serde(default)]
    response_status: String,
}

impl Event {
    fn attendee_list(&self) -> Vec<String> {
        self.attendees.iter().map(|a| a.email.clone()).collect()
    }

    /// The user is invited and said no: Google still lists the event, and a model that is
    /// not told would speak of a meeting the user will not attend.
    fn declined_by_user(&self) -> bool {
        self.attendees
            .iter()
            .any(|a| a.is_self && a.response_status == "declined")
    }
}

#[derive(Deserialize, Default, Debug)]
#[serde(rename_all = "camelCase")]
struct EventTime {
    date_time: Option<String>,
    date: Option<String>,
    time_zone: Option<String>,
}

impl EventTime {
    fn show(&self) -> String {
        match (&self.date_time, &self.date) {
            (Some(dt), _) => dt.parse::<jiff::Timestamp>().ok().map_or_else(
                || dt.clone(),
                |ts| {
                    // The event's own zone; else the offset Google wrote the time with (the
                    // calendar's), never UTC in its place.
                    let tz = match self.time_zone.as_deref() {
                        Some(zone) => crate::time::zone(zone),
                        None => jiff::fmt::temporal::Pieces::parse(dt)
                            .ok()
                            .and_then(|p| p.offset())
                            .map_or(jiff::tz::TimeZone::UTC, |o| {
                                jiff::tz::TimeZone::fixed(o.to_numeric_offset())
                            }),
                    };
                    crate::time::with_zone(ts, &tz)
                },
            ),
            (None, Some(d)) => format!("{d} (all day)"),
            (None, None) => "(no time)".into(),
        }
    }
}

/// When an event happens, as the model reads it. An all-day event's end date from Google is
/// the day after its last; it is shown as the last day, so "to" reads inclusive.
fn span(start: &EventTime, end: &EventTime) -> String {
    let day = |t: &EventTime| {
        t.date
            .as_deref()
            .filter(|_| t.date_time.is_none())
            .and_then(|d| d.parse::<jiff::civil::Date>().ok())
    };
    match (day(start), day(end).and_then(|d| d.yesterday().ok())) {
        (Some(first), Some(last)) if last <= first => format!("{first} (all day)"),
        (Some(first), Some(last)) => format!("{first} to {last} (all day)"),
        _ => format!("{} to {}", start.show(), end.show()),
    }
}

/// One event as one line: its title and location are written by whoever made the event, so
/// each is flattened (a line break cannot fake a line of the result) and the title quoted
/// with its quotes escaped (it cannot close its quotes early and say more).
fn render(e: &Event) -> String {
    let mut text = format!(
        "[{}] {} — {}",
        line(&e.id, 100),
        crate::registry::quoted(&line(&e.summary, 200)),
        span(&e.start, &e.end)
    );
    if !e.location.is_empty() {
        text.push_str(&format!(" — {}", line(&e.location, 200)));
    }
    if e.declined_by_user() {
        text.push_str(" (you declined)");
    }
    text
}

impl CalendarApi {
    /// The events of the calendar `args` name (`calendar_id`, "primary" when omitted).
    fn events_url(&self, args: &Value, tool: &str) -> Result<(String, String), ToolError> {
        let calendar = text_arg(args, "calendar_id").unwrap_or_else(|| "primary".into());
        let segment = super::path_segment(&calendar, "calendar_id", tool)?;
        let url = format!(
            "{}/calendar/v3/calendars/{segment}/events",
            self.base_url.trim_end_matches('/')
        );
        Ok((calendar, url))
    }
}

pub fn tools(api: CalendarApi) -> Vec<Arc<dyn Tool>> {
    vec![
        Arc::new(Search(api.clone())),
        Arc::new(Write {
            api: api.clone(),
            update: false,
        }),
        Arc::new(Write { api, update: true }),
    ]
}

fn spec(name: &str, description: &str, schema: Value) -> ToolSpec {
    ToolSpec::new(name, Integration::GoogleCalendar, description, schema)
}

/// The account a call uses: the named one (refused as needing reconnection when it does), or
/// the only usable one.
async fn account(ctx: &CallContext, args: &Value, tool: &str) -> Result<String, ToolError> {
    Ok(account_and_left_out(ctx, args, tool).await?.0)
}

/// [`account`], and what a search of it must add when it was picked as the only usable one
/// of several: the accounts that need reconnecting, which it did not search (G-8).
async fn account_and_left_out(
    ctx: &CallContext,
    args: &Value,
    tool: &str,
) -> Result<(String, String), ToolError> {
    let named = text_arg(args, "account");
    let all = ctx
        .accounts_named(Integration::GoogleCalendar, named.as_deref())
        .await?;
    let left_out = match named {
        Some(_) => String::new(),
        None => all
            .left_out("searched")
            .map(|note| format!("\n{note}"))
            .unwrap_or_default(),
    };
    let names: Vec<_> = all.usable.iter().map(|a| a.account.clone()).collect();
    match named {
        Some(n) => {
            all.named(&n)?
                .map(|a| a.account.clone())
                .ok_or_else(|| ToolError::InvalidArguments {
                    tool: tool.into(),
                    detail: format!("no connected calendar account {n:?}"),
                })
        }
        None if names.len() == 1 => Ok(names[0].clone()),
        None => Err(ToolError::InvalidArguments {
            tool: tool.into(),
            detail: format!("name the account to use: {}", names.join(", ")),
        }),
    }
    .map(|account| (account, left_out))
}

/// A time argument as the calendar takes it: an instant, or a whole day (a plain date), which
/// is an all-day event's date and, in a search, the bounds of that day. A plain date is never
/// turned into some instant of it: a search from "2026-11-25" starts at its first moment, and
/// an event on it lasts the day.
#[derive(Debug, Clone, Copy, PartialEq)]
enum When {
    At(jiff::Timestamp),
    Day(jiff::civil::Date),
}

impl When {
    /// The first moment of the day in `tz`, or the instant.
    fn first_moment(self, tz: &jiff::tz::TimeZone) -> jiff::Timestamp {
        match self {
            When::At(t) => t,
            When::Day(d) => day_start(d, tz),
        }
    }

    /// The moment just after the day in `tz`, or the instant: an exclusive upper bound.
    fn after(self, tz: &jiff::tz::TimeZone) -> jiff::Timestamp {
        match self {
            When::At(t) => t,
            When::Day(d) => d
                .tomorrow()
                .map_or(jiff::Timestamp::MAX, |d| day_start(d, tz)),
        }
    }
}

fn day_start(d: jiff::civil::Date, tz: &jiff::tz::TimeZone) -> jiff::Timestamp {
    d.to_zoned(tz.clone())
        .map_or(jiff::Timestamp::MAX, |z| z.timestamp())
}

/// The `time_zone` argument: an IANA zone, or none (plain dates and local times are then the
/// user's, in the call's zone; a local time with neither is refused).
fn zone_arg(args: &Value, tool: &str) -> Result<Option<(String, jiff::tz::TimeZone)>, ToolError> {
    let Some(name) = text_arg(args, "time_zone") else {
        return Ok(None);
    };
    match jiff::tz::TimeZone::get(&name) {
        Ok(tz) => Ok(Some((name, tz))),
        Err(_) => Err(ToolError::InvalidArguments {
            tool: tool.into(),
            detail: format!("time_zone {name:?} is not an IANA zone"),
        }),
    }
}

/// A time argument: RFC 3339 with an offset; a local date-time (no offset) read in `zone` (the
/// `time_zone` argument's, else the user's); or exactly a date (`YYYY-MM-DD`) for a whole day.
/// A local time with no zone to read it in is refused, never guessed.
fn when(
    args: &Value,
    field: &str,
    tool: &str,
    zone: Option<&jiff::tz::TimeZone>,
) -> Result<Option<When>, ToolError> {
    let Some(raw) = text_arg(args, field) else {
        return Ok(None);
    };
    let raw = raw.trim();
    let invalid = |detail: String| ToolError::InvalidArguments {
        tool: tool.into(),
        detail: format!("{field}: {detail}"),
    };
    match Written::read(raw) {
        Some(Written::At(t)) => Ok(Some(When::At(t))),
        Some(Written::Day(d)) => Ok(Some(When::Day(d))),
        Some(Written::Local(local)) => {
            let Some(tz) = zone else {
                return Err(invalid(format!(
                    "{raw:?} has no offset; add one (2026-11-25T09:00:00+01:00 or Z) or give time_zone"
                )));
            };
            time::local_in(local, tz)
                .map(|t| Some(When::At(t)))
                .map_err(invalid)
        }
        None => Err(invalid(format!(
            "{raw:?} is not a time; use RFC 3339 like 2026-11-25T09:00:00+01:00, or a date like 2026-11-25 for a whole day"
        ))),
    }
}

/// An event's `start` and `end` as Google Calendar takes them: both instants (`dateTime`, in
/// `zone` when given) or both days (`date`; the user's `end` is the last day, Google's is the
/// day after). `None` for a time not given (an update keeps it).
fn event_times(
    start: Option<When>,
    end: Option<When>,
    zone: Option<&str>,
    tool: &str,
) -> Result<[Option<Value>; 2], ToolError> {
    let invalid = |detail: &str| ToolError::InvalidArguments {
        tool: tool.into(),
        detail: detail.into(),
    };
    match (start, end) {
        (Some(When::Day(s)), Some(When::Day(e))) => {
            if e < s {
                return Err(invalid("end must be on or after start"));
            }
            let after = e
                .tomorrow()
                .map_err(|_| invalid("end is past the last date a calendar holds"))?;
            // The other kind's fields are cleared: an update merges into what the event has.
            Ok([
                Some(json!({ "date": s.to_string(), "dateTime": null, "timeZone": null })),
                Some(json!({ "date": after.to_string(), "dateTime": null, "timeZone": null })),
            ])
        }
        (Some(When::Day(_)), _) | (_, Some(When::Day(_))) => Err(invalid(
            "an all-day event needs both start and end as dates (YYYY-MM-DD); a timed one needs both as date-times (RFC 3339, or local like 2026-11-25T09:00)",
        )),
        (start, end) => {
            if let (Some(When::At(s)), Some(When::At(e))) = (start, end)
                && s >= e
            {
                return Err(invalid("end must be after start"));
            }
            let timed = |w: Option<When>| {
                w.map(|w| {
                    let mut t = json!({
                        "dateTime": w.first_moment(&jiff::tz::TimeZone::UTC).to_string(),
                        "date": null,
                    });
                    if let Some(z) = zone {
                        t["timeZone"] = json!(z);
                    }
                    t
                })
            };
            Ok([timed(start), timed(end)])
        }
    }
}

struct Search(CalendarApi);

#[async_trait::async_trait]
impl Tool for Search {
    /// Reads only: its audit records may be written after it answers.
    fn read_only(&self) -> bool {
        true
    }

    fn spec(&self) -> ToolSpec {
        spec(
            "calendar_search",
            "Find events in the user's calendar between two times (default: the next 7 days), optionally matching text.",
            json!({"type": "object", "additionalProperties": false, "properties": {
                "time_min": {"type": "string", "description": "RFC 3339, a local time (in time_zone, else the user's) or a date; default now"},
                "time_max": {"type": "string", "description": "RFC 3339, a local time or a date (through its end); default 7 days after time_min"},
                "time_zone": {"type": "string", "description": "IANA zone of dates and local times; default: the user's"},
                "query": {"type": "string", "maxLength": 200},
                "calendar_id": {"type": "string", "default": "primary"},
                "max_results": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10},
                "account": {"type": "string"}}}),
        )
        .reading_external_content()
        .with_cost(MAX_SEARCH_PAGES as u32)
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let (account, left_out) = account_and_left_out(ctx, &args, "calendar_search").await?;
        let now =
            jiff::Timestamp::try_from(SystemTime::now()).unwrap_or(jiff::Timestamp::UNIX_EPOCH);
        let tool = "calendar_search";
        let zone = zone_arg(&args, tool)?;
        // Days and local times are the user's unless the call names another zone.
        let local = zone.as_ref().map(|(_, tz)| tz).or(ctx.time_zone.as_ref());
        let days_in = local.unwrap_or(ctx.zone()).clone();
        let from = when(&args, "time_min", tool, local)?.map_or(now, |w| w.first_moment(&days_in));
        let until = match when(&args, "time_max", tool, local)? {
            Some(w) => w.after(&days_in),
            None => from
                .checked_add(jiff::SignedDuration::from_hours(24 * 7))
                .unwrap_or(jiff::Timestamp::MAX),
        };
        if until <= from {
            return Err(ToolError::InvalidArguments {
                tool: tool.into(),
                detail: "time_max must be after time_min".into(),
            });
        }
        let (time_min, time_max) = (from.to_string(), until.to_string());
        let max = args
            .get("max_results")
            .and_then(Value::as_u64)
            .unwrap_or(10)
            .to_string();
        let (calendar, url) = self.0.events_url(&args, tool)?;
        let mut query = vec![
            ("timeMin", time_min.clone()),
            ("timeMax", time_max.clone()),
            ("singleEvents", "true".into()),
            ("orderBy", "startTime".into()),
            ("maxResults", max.clone()),
        ];
        if let Some(q) = text_arg(&args, "query") {
            query.push(("q", q));
        }
        // Google may answer a page with fewer events than maxResults, even none, while more
        // match (its nextPageToken says so): pages are followed, each one call, until there
        // are enough events, no token, or MAX_SEARCH_PAGES were read. Every page the search
        // may read is reserved before the first is asked for, so a user out of budget is
        // refused before any request, never part-way through; fewer left than that reads
        // fewer pages. The pages not read are given back.
        let mut reservation = ctx
            .reserve_up_to(
                Integration::GoogleCalendar,
                &account,
                1,
                MAX_SEARCH_PAGES as u32,
            )
            .await?;
        let page_budget = reservation.cost() as usize;
        let wanted: usize = max.parse().unwrap_or(10);
        let mut items = Vec::new();
        let mut token: Option<String> = None;
        let mut pages = 0;
        // Why a later page could not be read: the events before it are still shown.
        let mut stopped: Option<ToolError> = None;
        // Pages asked for, read or not: each was a call made.
        let mut asked = 0;
        loop {
            let mut page_query = query.clone();
            if let Some(t) = &token {
                page_query.push(("pageToken", t.clone()));
            }
            asked += 1;
            // Cancelled from here on: only the pages after this one surely were not asked for.
            reservation.unused_if_dropped((page_budget - asked) as u32);
            let fetched: Result<Events, ToolError> = async {
                let r = ctx
                    .send(Integration::GoogleCalendar, &account, |t| {
                        ctx.http().get(&url).query(&page_query).bearer_auth(t)
                    })
                    .await?;
                if r.status == reqwest::StatusCode::NOT_FOUND {
                    return Err(ToolError::NotFound(format!(
                        "There is no calendar {calendar:?} in {account}."
                    )));
                }
                r.json(SERVICE)
            }
            .await;
            let page = match fetched {
                Ok(page) => page,
                Err(e) if !items.is_empty() => {
                    tracing::warn!(error = %e, pages, "a later page of a calendar search failed; showing the events read");
                    stopped = Some(e);
                    break;
                }
                Err(e) => {
                    reservation.refund((page_budget - asked) as u32).await;
                    return Err(e);
                }
            };
            pages += 1;
            items.extend(page.items);
            token = page.next_page_token.filter(|t| !t.is_empty());
            if token.is_none() || items.len() >= wanted || pages >= page_budget {
                break;
            }
        }
        reservation.refund((page_budget - asked) as u32).await;
        let cut = items.len() > wanted;
        items.truncate(wanted);
        // Never "no events" while Google says more exist: the listing stopped short.
        let incomplete = token.is_some() && items.len() < wanted;
        // Stopped by the user's own request budget, not by Google: said so, so the model
        // waits rather than narrowing a search that was fine.
        let budget_cut = incomplete && stopped.is_none() && page_budget < MAX_SEARCH_PAGES;
        if items.is_empty() && budget_cut {
            return Ok(ToolOutput::text(format!(
                "The events in {account} between {time_min} and {time_max} could not be listed \
                 completely: your Google Calendar rate limit left room for only {pages} of the \
                 {MAX_SEARCH_PAGES} pages a search reads, and they held no events while Google \
                 said more exist. Try again shortly.{left_out}"
            )));
        }
        if items.is_empty() {
            return Ok(ToolOutput::text(if incomplete {
                format!(
                    "The events in {account} between {time_min} and {time_max} could not be listed \
                     completely: Google Calendar returned {pages} pages without events but said more \
                     exist. Narrow the time range or the query, or try again.{left_out}"
                )
            } else {
                format!("No events in {account} between {time_min} and {time_max}.{left_out}")
            }));
        }
        let lines: Vec<String> = items
            .iter()
            .enumerate()
            .map(|(i, e)| format!("{}. {}", i + 1, render(e)))
            .collect();
        let failed_page = stopped.map(|e| {
            format!(
                "\n(The listing is incomplete: reading the next page failed: {e} Try again, or narrow the time range.)"
            )
        });
        let more = match token.is_some() || cut {
            false => "",
            _ if failed_page.is_some() => failed_page.as_deref().unwrap_or_default(),
            true if budget_cut => {
                "\n(The listing is incomplete: your Google Calendar rate limit left room for fewer pages than a search reads; try again shortly to see the rest.)"
            }
            true if incomplete => {
                "\n(The listing is incomplete: Google Calendar has more pages than were read; narrow the time range to see the rest.)"
            }
            true if max == "50" => {
                "\n(More events match than the 50 shown; narrow the time range.)"
            }
            true => {
                "\n(More events match; narrow the time range or ask for more with max_results, up to 50.)"
            }
        };
        Ok(ToolOutput::text(format!(
            "Events in {account} ({}):\n{}{more}{left_out}",
            items.len(),
            lines.join("\n")
        )))
    }
}

struct Write {
    api: CalendarApi,
    update: bool,
}

#[async_trait::async_trait]
impl Tool for Write {
    fn spec(&self) -> ToolSpec {
        let mut properties = json!({
            "summary": {"type": "string", "minLength": 1, "maxLength": 500},
            "start": {"type": "string", "description": "RFC 3339, e.g. 2026-11-25T09:00:00+01:00; a local time, e.g. 2026-11-25T09:00, in time_zone or else the user's zone; a date for all day"},
            "end": {"type": "string", "description": "As start; a date (the last day) for all day"},
            "time_zone": {"type": "string", "description": "IANA zone for the event and its local times, e.g. Europe/Berlin; default: the user's"},
            "description": {"type": "string", "maxLength": 8000},
            "location": {"type": "string", "maxLength": 500},
            "attendees": {"type": "array", "maxItems": 100, "items": {"type": "string"}},
            "calendar_id": {"type": "string", "default": "primary"},
            "account": {"type": "string"}});
        if self.update {
            properties["event_id"] = json!({"type": "string", "minLength": 1});
            spec("calendar_event_update", "Change an existing event's title, time, description, location or attendees.", json!({"type": "object", "additionalProperties": false, "required": ["event_id"], "minProperties": 2,
                       "properties": properties})).with_side_effect()
        } else {
            spec("calendar_event_create", "Create an event in the user's calendar.", json!({"type": "object", "additionalProperties": false, "required": ["summary", "start", "end"],
                       "properties": properties})).with_side_effect()
        }
    }

    /// Title, time, attendees and place as they will be; for an update, the event as it is
    /// now and what changes, bound to its current time and attendees.
    async fn preview(&self, ctx: &CallContext, args: &Value) -> Result<Preview, ToolError> {
        // Times the call would refuse are refused here, before anyone approves them.
        self.event_body(ctx, args)?;
        let zone = ctx.time_zone.as_ref();
        if !self.update {
            return Ok(create_preview(args, zone));
        }
        changes_something(args)?;
        let account = account(ctx, args, "calendar_event_update").await?;
        let current = self.current(ctx, &account, args).await?;
        Ok(update_preview(&account, &current, args, zone))
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let tool = self.tool();
        if self.update {
            changes_something(&args)?;
        }
        let account = account(ctx, &args, tool).await?;
        let body = self.event_body(ctx, &args)?;
        let (calendar, base) = self.api.events_url(&args, tool)?;
        // Checked before the charge: a bad id costs the user nothing.
        let event_url = match self.update {
            true => Some(format!("{base}/{}", event_id(&args, tool)?)),
            false => None,
        };
        // Without sendUpdates Google tells no one: attendees would not be invited, nor told
        // of a new time, although the preview says they are.
        let notify: &[(&str, &str)] = if sends_updates(&args, self.update) {
            &[("sendUpdates", "all")]
        } else {
            &[]
        };
        ctx.charge(Integration::GoogleCalendar, &account, 1).await?;
        let body = Value::Object(body);
        let r = if let Some(url) = &event_url {
            ctx.send(Integration::GoogleCalendar, &account, |t| {
                ctx.http()
                    .patch(url)
                    .query(notify)
                    .json(&body)
                    .bearer_auth(t)
            })
            .await?
        } else {
            ctx.send(Integration::GoogleCalendar, &account, |t| {
                ctx.http()
                    .post(&base)
                    .query(notify)
                    .json(&body)
                    .bearer_auth(t)
            })
            .await?
        };
        if r.status == reqwest::StatusCode::NOT_FOUND {
            return Err(ToolError::NotFound(format!(
                "I couldn't find that event in {account}'s calendar {calendar:?}."
            )));
        }
        let verb = if self.update { "Updated" } else { "Created" };
        // Calendar accepted the write: an answer that cannot be read does not undo it.
        let event: Event = match r.json(SERVICE) {
            Ok(event) => event,
            Err(e) => {
                tracing::warn!(error = %e, "Calendar accepted a write but its answer could not be read");
                return Ok(ToolOutput::text(with_local_notes(
                    format!(
                        "{verb} the event in {account} (Calendar's answer could not be read, so its id is unknown)."
                    ),
                    ctx,
                    &args,
                    tool,
                )));
            }
        };
        Ok(ToolOutput::text(with_local_notes(
            format!("{verb} event {} in {account}.", render(&event)),
            ctx,
            &args,
            tool,
        )))
    }
}

/// The fields an update can change: with none of them given its PATCH would be empty, so
/// it would change nothing while reporting "Updated".
const CHANGEABLE: [&str; 6] = [
    "summary",
    "start",
    "end",
    "description",
    "location",
    "attendees",
];

/// Refuses an update that gives only where the event is (`calendar_id`, `account`) or how its
/// times are read (`time_zone`): it would change nothing.
fn changes_something(args: &Value) -> Result<(), ToolError> {
    let given = |k: &str| match k {
        "attendees" => args.get(k).is_some_and(Value::is_array),
        _ => text_arg(args, k).is_some(),
    };
    if CHANGEABLE.iter().any(|k| given(k)) {
        return Ok(());
    }
    Err(ToolError::InvalidArguments {
        tool: "calendar_event_update".into(),
        detail: "nothing to change: give at least one of summary, start and end, description, \
                 location or attendees (time_zone only says how start and end are read; \
                 calendar_id and account only say where the event is)"
            .into(),
    })
}

/// The event id as it goes into a URL, whole (a recurring event's instance ids hold `_`).
fn event_id(args: &Value, tool: &str) -> Result<String, ToolError> {
    super::path_segment(
        &text_arg(args, "event_id").unwrap_or_default(),
        "event_id",
        tool,
    )
}

/// Whether a write emails the event's attendees (`sendUpdates=all`): a create that invites
/// anyone; an update that sets the attendees (invites or removes some) or moves the time
/// (Google emails only the event's guests, so an event without any emails no one).
fn sends_updates(args: &Value, update: bool) -> bool {
    let attendees = attendees_arg(args);
    if update {
        attendees.is_some() || text_arg(args, "start").is_some() || text_arg(args, "end").is_some()
    } else {
        attendees.is_some_and(|a| !a.is_empty())
    }
}

/// The attendees an event write names, when it names them.
fn attendees_arg(args: &Value) -> Option<Vec<String>> {
    args.get("attendees").and_then(Value::as_array).map(|l| {
        l.iter()
            .filter_map(Value::as_str)
            .map(str::to_owned)
            .collect()
    })
}

/// "start to end (zone)" from a write's arguments, each part on one clipped line. The zone is
/// the `time_zone` argument, else the user's when either time is local (an approver is never
/// shown "09:00" without knowing whose). With a local time, what each time is there follows
/// ("Mar 10 03:30 EDT"): a time a daylight-saving change moves is seen moved before approval.
fn when_arg(args: &Value, user_zone: Option<&jiff::tz::TimeZone>) -> String {
    let field = |k: &str| text_arg(args, k).unwrap_or_default();
    let raw = [field("start"), field("end")];
    let written = raw.clone().map(|r| Written::read(&r));
    let any_local = written.iter().any(|w| matches!(w, Some(Written::Local(_))));
    let named = field("time_zone");
    let (label, tz) = match user_zone {
        _ if !named.is_empty() => (named.clone(), jiff::tz::TimeZone::get(&named).ok()),
        Some(tz) if any_local => (
            tz.iana_name().unwrap_or("the user's zone").to_owned(),
            Some(tz.clone()),
        ),
        _ => (String::new(), None),
    };
    let text = format!("{} to {}", line(&raw[0], 40), line(&raw[1], 40));
    let notes = local_notes(args, tz.as_ref()).join("; ");
    // A time with its zone in brackets can be noted with no zone to name.
    let or_notes = |before: String| match (before.is_empty(), notes.is_empty()) {
        (_, true) => before,
        (true, false) => notes.clone(),
        (false, false) => format!("{before} — {notes}"),
    };
    if label.is_empty() {
        return match notes.is_empty() {
            true => text,
            false => format!("{text} ({notes})"),
        };
    }
    let label = line(&label, 40);
    let Some(tz) = tz.filter(|_| any_local) else {
        return format!("{text} ({})", or_notes(label));
    };
    let shown: Vec<String> = written
        .iter()
        .zip(&raw)
        .filter(|(_, r)| !r.is_empty())
        .map(|(w, r)| match w {
            Some(Written::Local(t)) => {
                time::local_in(*t, &tz).map_or_else(|_| line(r, 40), |at| time::with_zone(at, &tz))
            }
            Some(Written::At(at)) => time::with_zone(*at, &tz),
            _ => line(r, 40),
        })
        .collect();
    format!(
        "{text} ({})",
        or_notes(format!("{label}: {}", shown.join(" to ")))
    )
}

/// A write's result with what the clocks did to its local times, read in the zone its times
/// were read in (the `time_zone` argument's, else the user's).
fn with_local_notes(said: String, ctx: &CallContext, args: &Value, tool: &str) -> String {
    let zone = zone_arg(args, tool).ok().flatten().map(|(_, tz)| tz);
    let notes = local_notes(args, zone.as_ref().or(ctx.time_zone.as_ref()));
    match notes.is_empty() {
        true => said,
        false => format!("{said} ({}.)", notes.join("; ")),
    }
}

/// What the clocks do to a write's `start` and `end` when they skip or repeat them: a local
/// time's in `zone` ([`time::local_note`]), one with its zone in brackets in that zone
/// ([`time::zone_note`]). Said with the preview and the result, so the time the event gets
/// is never a surprise.
fn local_notes(args: &Value, zone: Option<&jiff::tz::TimeZone>) -> Vec<String> {
    ["start", "end"]
        .into_iter()
        .filter_map(|field| {
            let raw = text_arg(args, field)?;
            match Written::read(&raw)? {
                Written::Local(t) => time::local_note(t, zone?),
                Written::At(_) => time::zone_note(&raw),
                Written::Day(_) => None,
            }
        })
        .collect()
}

/// What `calendar_event_create` will create. Pure, so property tests can feed it anything.
fn create_preview(args: &Value, user_zone: Option<&jiff::tz::TimeZone>) -> Preview {
    let field = |k: &str| text_arg(args, k).unwrap_or_default();
    let attendees = attendees_arg(args).unwrap_or_default();
    let mut text = format!(
        "Create event \"{}\"\nWhen: {}\n",
        line(&field("summary"), 200),
        when_arg(args, user_zone)
    );
    push_attendees(&mut text, "Attendees (invited)", &attendees);
    push_optional(&mut text, "Location", &field("location"));
    push_optional(
        &mut text,
        "Description",
        &first_lines(&field("description"), 3),
    );
    Preview {
        text,
        recipients: attendees,
        binding: String::new(),
    }
}

/// What `calendar_event_update` will change on `current` (as the calendar has it now), bound
/// to the event's current time and attendees. Pure, like [`create_preview`].
fn update_preview(
    account: &str,
    current: &Event,
    args: &Value,
    user_zone: Option<&jiff::tz::TimeZone>,
) -> Preview {
    let old_attendees = current.attendee_list();
    let mut text = format!(
        "Update event [{}] \"{}\" in {}\nNow: {}\n",
        line(&current.id, 100),
        line(&current.summary, 200),
        line(account, 200),
        line(&span(&current.start, &current.end), 130),
    );
    push_attendees(&mut text, "Attendees now", &old_attendees);
    text.push_str("Changes:\n");
    for (key, label) in [
        ("summary", "Title"),
        ("location", "Location"),
        ("description", "Description"),
    ] {
        if let Some(v) = text_arg(args, key) {
            text.push_str(&format!("- {label} → {}\n", line(&v, 300)));
        }
    }
    if args.get("start").is_some() || args.get("end").is_some() {
        text.push_str(&format!("- Time → {}\n", when_arg(args, user_zone)));
    }
    let mut recipients = old_attendees.clone();
    if let Some(list) = attendees_arg(args) {
        let added: Vec<String> = list
            .iter()
            .filter(|a| !old_attendees.contains(a))
            .cloned()
            .collect();
        let removed: Vec<String> = old_attendees
            .iter()
            .filter(|a| !list.contains(a))
            .cloned()
            .collect();
        push_attendees(&mut text, "- Invites", &added);
        push_attendees(&mut text, "- Removes", &removed);
        recipients = list;
    }
    if sends_updates(args, true) && !(old_attendees.is_empty() && recipients.is_empty()) {
        text.push_str("The attendees are emailed about this change.\n");
    }
    let mut bound = old_attendees;
    bound.sort();
    let time = |t: &EventTime| t.date_time.clone().or(t.date.clone()).unwrap_or_default();
    Preview {
        text,
        recipients,
        binding: digest(&[
            &current.id,
            &time(&current.start),
            &time(&current.end),
            &bound.join(","),
        ]),
    }
}

fn push_attendees(text: &mut String, label: &str, list: &[String]) {
    if !list.is_empty() {
        text.push_str(&format!("{label}: {}\n", line(&list.join(", "), 500)));
    }
}

fn push_optional(text: &mut String, label: &str, value: &str) {
    if !value.is_empty() {
        text.push_str(&format!("{label}: {}\n", line(value, 300)));
    }
}

impl Write {
    fn tool(&self) -> &'static str {
        if self.update {
            "calendar_event_update"
        } else {
            "calendar_event_create"
        }
    }

    /// What the call sends Google: the fields given, the times read (`time_zone`'s zone, else
    /// the user's) and checked. Pure, so the preview refuses exactly what the call would.
    fn event_body(&self, ctx: &CallContext, args: &Value) -> Result<Map<String, Value>, ToolError> {
        let tool = self.tool();
        let zone = zone_arg(args, tool)?;
        let local = zone.as_ref().map(|(_, tz)| tz).or(ctx.time_zone.as_ref());
        let mut body = Map::new();
        for (field, key) in [
            ("summary", "summary"),
            ("description", "description"),
            ("location", "location"),
        ] {
            if let Some(v) = text_arg(args, field) {
                body.insert(key.into(), json!(v));
            }
        }
        let [start, end] = event_times(
            when(args, "start", tool, local)?,
            when(args, "end", tool, local)?,
            zone.as_ref().map(|(name, _)| name.as_str()),
            tool,
        )?;
        for (key, value) in [("start", start), ("end", end)] {
            if let Some(t) = value {
                body.insert(key.into(), t);
            }
        }
        if let Some(list) = args.get("attendees").and_then(Value::as_array) {
            let attendees: Vec<Value> = list
                .iter()
                .filter_map(Value::as_str)
                .map(|a| json!({ "email": a }))
                .collect();
            body.insert("attendees".into(), Value::Array(attendees));
        }
        Ok(body)
    }

    /// The event an update would change, as it is now.
    async fn current(
        &self,
        ctx: &CallContext,
        account: &str,
        args: &Value,
    ) -> Result<Event, ToolError> {
        let tool = "calendar_event_update";
        let (calendar, base) = self.api.events_url(args, tool)?;
        let url = format!("{base}/{}", event_id(args, tool)?);
        ctx.charge(Integration::GoogleCalendar, account, 1).await?;
        let r = ctx
            .send(Integration::GoogleCalendar, account, |t| {
                ctx.http().get(&url).bearer_auth(t)
            })
            .await?;
        if r.status == reqwest::StatusCode::NOT_FOUND {
            return Err(ToolError::NotFound(format!(
                "I couldn't find that event in {account}'s calendar {calendar:?}."
            )));
        }
        r.json(SERVICE)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;
    use serde_json::json;

    use super::*;

    fn times(start: &str, end: &str) -> Result<[Option<Value>; 2], ToolError> {
        let args = json!({"start": start, "end": end});
        let berlin = jiff::tz::TimeZone::get("Europe/Berlin").unwrap();
        event_times(
            when(&args, "start", "t", Some(&berlin))?,
            when(&args, "end", "t", Some(&berlin))?,
            Some("Europe/Berlin"),
            "t",
        )
    }

    #[test]
    fn plain_dates_make_an_all_day_event_through_its_last_day() {
        let [start, end] = times("2026-11-25", "2026-11-26").unwrap();
        let day = |d: &str| json!({"date": d, "dateTime": null, "timeZone": null});
        assert_eq!(start, Some(day("2026-11-25")));
        // Google's end date is exclusive: the day after the last day.
        assert_eq!(end, Some(day("2026-11-27")));
        let [_, one_day] = times("2026-11-25", "2026-11-25").unwrap();
        assert_eq!(one_day, Some(day("2026-11-26")));
    }

    #[test]
    fn timed_events_keep_their_instants_and_zone() {
        let [start, end] = times("2026-11-25T09:00:00+01:00", "2026-11-25T10:00:00+01:00").unwrap();
        let at = |t: &str| json!({"dateTime": t, "date": null, "timeZone": "Europe/Berlin"});
        assert_eq!(start, Some(at("2026-11-25T08:00:00Z")));
        assert_eq!(end, Some(at("2026-11-25T09:00:00Z")));
        // A local time is read in the event's zone, never taken for a whole day.
        let [start, _] = times("2026-11-25T09:00:00", "2026-11-25T10:00:00").unwrap();
        assert_eq!(start, Some(at("2026-11-25T08:00:00Z")));
        let args = json!({"start": "2026-11-25T09:00:00"});
        let unzoned = when(&args, "start", "t", None).unwrap_err().to_string();
        assert!(unzoned.contains("has no offset"), "{unzoned}");
    }

    #[test]
    fn mixed_backwards_or_unreadable_times_are_refused_with_what_to_fix() {
        let mixed = times("2026-11-25", "2026-11-25T10:00:00Z")
            .unwrap_err()
            .to_string();
        assert!(mixed.contains("both start and end as dates"), "{mixed}");
        let backwards = times("2026-11-25", "2026-11-24").unwrap_err().to_string();
        assert!(backwards.contains("on or after start"), "{backwards}");
        let timed = times("2026-11-25T10:00:00Z", "2026-11-25T09:00:00Z").unwrap_err();
        assert!(timed.to_string().contains("after start"), "{timed}");
        let vague = times("tomorrow", "2026-11-25").unwrap_err().to_string();
        assert!(
            vague.contains("start: \"tomorrow\" is not a time"),
            "{vague}"
        );
    }

    #[test]
    fn i4_a_time_with_an_offset_and_no_zone_is_shown_at_that_offset_not_in_utc() {
        let at = |dt: &str| EventTime {
            date_time: Some(dt.into()),
            ..EventTime::default()
        };
        assert_eq!(at("2026-11-25T09:00:00+01:00").show(), "Nov 25 09:00 +01");
        assert_eq!(
            at("2026-11-25T09:30:00-05:30").show(),
            "Nov 25 09:30 -05:30"
        );
        assert_eq!(at("2026-11-25T09:00:00Z").show(), "Nov 25 09:00 UTC");
        let berlin = EventTime {
            time_zone: Some("Europe/Berlin".into()),
            ..at("2026-11-25T08:00:00Z")
        };
        assert_eq!(berlin.show(), "Nov 25 09:00 CET");
    }

    #[test]
    fn i4_a_preview_names_the_zone_a_local_time_is_read_in() {
        let local =
            json!({"summary": "Sync", "start": "2026-11-25T09:00", "end": "2026-11-25T10:00"});
        let new_york = time::zone("America/New_York");
        let shown = create_preview(&local, Some(&new_york)).text;
        assert!(
            shown.contains(
                "When: 2026-11-25T09:00 to 2026-11-25T10:00 (America/New_York: Nov 25 09:00 EST to Nov 25 10:00 EST)\n"
            ),
            "{shown}"
        );
        // An instant says its own offset; no zone is added to it.
        let instant = json!({"summary": "Sync", "start": "2026-11-25T09:00:00Z", "end": "2026-11-25T10:00:00Z"});
        let shown = create_preview(&instant, Some(&new_york)).text;
        assert!(
            shown.contains("When: 2026-11-25T09:00:00Z to 2026-11-25T10:00:00Z\n"),
            "{shown}"
        );
        // The event's own zone wins over the user's.
        let zoned = json!({"summary": "Sync", "start": "2026-11-25T09:00", "end": "2026-11-25T10:00", "time_zone": "Asia/Tokyo"});
        let shown = create_preview(&zoned, Some(&new_york)).text;
        assert!(
            shown.contains("(Asia/Tokyo: Nov 25 09:00 JST to Nov 25 10:00 JST)"),
            "{shown}"
        );
        // A whole day has no zone; none is named.
        let day = json!({"summary": "Off", "start": "2026-11-25", "end": "2026-11-25"});
        let shown = create_preview(&day, Some(&new_york)).text;
        assert!(
            shown.contains("When: 2026-11-25 to 2026-11-25\n"),
            "{shown}"
        );
    }

    #[test]
    fn i4_a_local_time_a_clock_change_skips_is_read_after_it_and_shown_moved_and_said() {
        let new_york = time::zone("America/New_York");
        // 02:30 does not happen in New York on 2030-03-10: the clocks go from 02:00 to 03:00.
        let args =
            json!({"summary": "Sync", "start": "2030-03-10T02:30", "end": "2030-03-10T04:00"});
        let Some(When::At(start)) = when(&args, "start", "t", Some(&new_york)).unwrap() else {
            panic!("a local time is an instant");
        };
        assert_eq!(start.to_string(), "2030-03-10T07:30:00Z", "03:30 EDT");
        let shown = create_preview(&args, Some(&new_york)).text;
        assert!(
            shown.contains("(America/New_York: Mar 10 03:30 EDT to Mar 10 04:00 EDT — 02:30 on Mar 10 does not exist in America/New_York (the clocks go forward an hour then), so it was read as Mar 10 03:30 EDT)"),
            "{shown}"
        );
        // A time repeated when the clocks go back is the first of the two (EDT, not EST), and
        // the approver is told how the other would be written.
        let args =
            json!({"summary": "Sync", "start": "2030-11-03T01:30", "end": "2030-11-03T03:00"});
        let Some(When::At(start)) = when(&args, "start", "t", Some(&new_york)).unwrap() else {
            panic!("a local time is an instant");
        };
        assert_eq!(start.to_string(), "2030-11-03T05:30:00Z");
        let shown = create_preview(&args, Some(&new_york)).text;
        assert!(
            shown.contains("it was read as the first, Nov 3 01:30 EDT; for the second, Nov 3 01:30 EST, write 2030-11-03T01:30:00-05:00"),
            "{shown}"
        );
        // Ordinary times: nothing to say.
        assert!(local_notes(&json!({"start": "2030-11-03T03:00"}), Some(&new_york)).is_empty());
    }

    #[test]
    fn i4_a_time_with_its_zone_in_brackets_a_clock_change_skips_is_said_with_no_zone_given() {
        let args = json!({"summary": "Sync", "start": "2030-03-10T02:30[America/New_York]", "end": "2030-03-10T04:00[America/New_York]"});
        let shown = create_preview(&args, None).text;
        assert!(
            shown.contains("When: 2030-03-10T02:30[America/New_York] to 2030-03-10T04:00[America/New_York] (02:30 on Mar 10 does not exist in America/New_York (the clocks go forward an hour then), so it was read as Mar 10 03:30 EDT)\n"),
            "{shown}"
        );
        // Beside a zone argument, after its name.
        let named = json!({"summary": "Sync", "start": "2030-03-10T02:30[America/New_York]", "end": "2030-03-10T04:00-04:00", "time_zone": "Europe/Paris"});
        let shown = create_preview(&named, None).text;
        assert!(
            shown.contains("(Europe/Paris — 02:30 on Mar 10 does not exist in America/New_York"),
            "{shown}"
        );
        // The zone's own, whatever the user's.
        assert_eq!(
            local_notes(&args, Some(&time::zone("Asia/Tokyo"))).len(),
            1,
            "the start alone is skipped"
        );
    }

    #[test]
    fn i4_every_form_of_a_time_is_read_as_what_it_is() {
        let new_york = time::zone("America/New_York");
        let read = |raw: &str| {
            when(&json!({"t": raw}), "t", "t", Some(&new_york))
                .unwrap()
                .unwrap()
        };
        let day = jiff::civil::date(2026, 11, 25);
        assert_eq!(read("2026-11-25"), When::Day(day));
        assert_eq!(
            read("20261125"),
            When::Day(day),
            "a compact date is a day, not its midnight"
        );
        assert_eq!(read("2026-11-25[Asia/Tokyo]"), When::Day(day));
        // A zone in brackets is that zone's time, not the user's.
        assert_eq!(
            read("2026-11-25T09:00[Asia/Tokyo]"),
            When::At("2026-11-25T00:00:00Z".parse().unwrap())
        );
        assert_eq!(
            read("2026-11-25T09:00"),
            When::At("2026-11-25T14:00:00Z".parse().unwrap())
        );
        let mangled = when(
            &json!({"t": "2026-11-25 and then some"}),
            "t",
            "t",
            Some(&new_york),
        );
        assert!(mangled.unwrap_err().to_string().contains("is not a time"));
    }

    #[test]
    fn i4_previews_say_attendees_are_invited_or_emailed_exactly_when_google_is_asked_to() {
        let create = json!({"summary": "Sync", "start": "2026-11-25T09:00:00Z",
                            "end": "2026-11-25T10:00:00Z", "attendees": ["bob@example.com"]});
        assert!(sends_updates(&create, false));
        assert!(
            create_preview(&create, None)
                .text
                .contains("Attendees (invited): bob@example.com\n")
        );
        assert!(!sends_updates(&json!({"summary": "Solo"}), false));
        let current = Event {
            id: "e1".into(),
            attendees: vec![Attendee {
                email: "bob@example.com".into(),
                ..Attendee::default()
            }],
            ..Event::default()
        };
        let emailed = "The attendees are emailed about this change.";
        let moved = json!({"event_id": "e1", "start": "2026-11-25T11:00:00Z"});
        assert!(
            update_preview("me@example.com", &current, &moved, None)
                .text
                .contains(emailed)
        );
        let renamed = json!({"event_id": "e1", "summary": "Sync v2"});
        assert!(!sends_updates(&renamed, true));
        assert!(
            !update_preview("me@example.com", &current, &renamed, None)
                .text
                .contains(emailed)
        );
    }

    #[test]
    fn an_all_day_event_reads_through_its_last_day() {
        let day = |d: &str| EventTime {
            date: Some(d.into()),
            ..EventTime::default()
        };
        assert_eq!(
            span(&day("2031-03-04"), &day("2031-03-05")),
            "2031-03-04 (all day)"
        );
        assert_eq!(
            span(&day("2031-03-04"), &day("2031-03-07")),
            "2031-03-04 to 2031-03-06 (all day)"
        );
        // An end no later than the start (not what Google sends) still reads as one day.
        assert_eq!(
            span(&day("2031-03-04"), &day("2031-03-04")),
            "2031-03-04 (all day)"
        );
    }

    #[test]
    fn a_searched_day_runs_from_its_first_moment_to_the_next_day_in_its_zone() {
        let day = When::Day("2026-11-25".parse().unwrap());
        let utc = jiff::tz::TimeZone::UTC;
        assert_eq!(day.first_moment(&utc).to_string(), "2026-11-25T00:00:00Z");
        assert_eq!(day.after(&utc).to_string(), "2026-11-26T00:00:00Z");
        let la = jiff::tz::TimeZone::get("America/Los_Angeles").unwrap();
        assert_eq!(day.first_moment(&la).to_string(), "2026-11-25T08:00:00Z");
        assert_eq!(day.after(&la).to_string(), "2026-11-26T08:00:00Z");
    }

    /// A time as the calendar may send it: a real timestamp in a real zone, an all-day date,
    /// or anything at all (other people's invitations are hostile too).
    fn event_time() -> impl Strategy<Value = EventTime> {
        let zone = proptest::option::of(prop_oneof![
            Just("Europe/Berlin".to_owned()),
            Just("America/New_York".to_owned()),
            "(?s).{0,40}",
        ]);
        let stamp = (0i64..4_000_000_000).prop_map(|s| {
            jiff::Timestamp::from_second(s)
                .expect("in range")
                .to_string()
        });
        prop_oneof![
            (stamp, zone.clone()).prop_map(|(dt, time_zone)| EventTime {
                date_time: Some(dt),
                date: None,
                time_zone,
            }),
            "(?s).{0,40}".prop_map(|d| EventTime {
                date_time: None,
                date: Some(d),
                time_zone: None,
            }),
            ("(?s).{0,80}", zone).prop_map(|(dt, time_zone)| EventTime {
                date_time: Some(dt),
                date: None,
                time_zone,
            }),
        ]
    }

    /// A time a clock change skips or repeats, local or with its zone in brackets: each is
    /// noted in the preview's "When:" line, the longest line it can make.
    fn changed_time() -> impl Strategy<Value = String> {
        let at = prop_oneof![
            Just("2030-03-10T02:30"),
            Just("2030-11-03T01:30:59"),
            Just("2026-10-04T02:15"),
            Just("2026-04-04T23:30"),
        ];
        let zone = prop_oneof![
            Just(""),
            Just("[America/New_York]"),
            Just("[Australia/Lord_Howe]"),
            Just("[America/Santiago]"),
        ];
        (at, zone).prop_map(|(at, zone)| format!("{at}{zone}"))
    }

    /// An optional text argument: absent, or anything.
    fn maybe(max: usize) -> impl Strategy<Value = Option<String>> {
        proptest::option::of(proptest::string::string_regex(&format!("(?s).{{0,{max}}}")).unwrap())
    }

    /// Every line of a preview starts with one of `labels`: no field, whoever wrote it, can add
    /// a line of its own (a forged "Attendees" or "Changes") to what a person approves.
    fn assert_lines(text: &str, labels: &[&str]) -> Result<(), TestCaseError> {
        for l in text.lines() {
            prop_assert!(
                labels.iter().any(|p| l.starts_with(p)),
                "unexpected line {:?} in\n{}",
                l,
                text
            );
        }
        Ok(())
    }

    proptest! {
        // Q-3, U-3: whatever the model puts in the arguments, a create preview is built without
        // panicking, keeps its structure and stays short enough to read.
        #[test]
        fn create_previews_never_panic_and_keep_their_lines(
            summary in "(?s).{0,300}",
            start in prop_oneof!["(?s).{0,60}", changed_time()],
            end in prop_oneof!["(?s).{0,60}", changed_time()],
            zone in prop_oneof![
                "(?s).{0,60}",
                Just(String::new()),
                Just("America/Argentina/ComodRivadavia".to_owned()),
            ],
            user_zone in proptest::option::of(Just(time::zone("America/New_York"))),
            location in "(?s).{0,400}",
            description in "(?s).{0,2000}",
            attendees in proptest::collection::vec("(?s).{0,80}", 0..30),
        ) {
            let args = json!({"summary": summary, "start": start, "end": end, "time_zone": zone,
                              "location": location, "description": description, "attendees": attendees});
            let p = create_preview(&args, user_zone.as_ref());
            prop_assert!(p.text.starts_with("Create event \""));
            let when = p.text.lines().nth(1).unwrap_or_default();
            prop_assert!(when.starts_with("When: "));
            assert_lines(&p.text, &["Create event \"", "When: ", "Attendees (invited): ", "Location: ", "Description: "])?;
            prop_assert_eq!(p.recipients, attendees);
            // Two times and their zone, each shown at most 40 characters, and a note for each
            // time a clock change skips or repeats (a note names its zone, which must exist).
            prop_assert!(when.chars().count() <= 700, "{} characters: {}", when.chars().count(), when);
            prop_assert!(p.text.chars().count() <= 230 + 700 + 530 + 330 + 330);
        }

        // The same for an update, whose current event comes from the calendar (other people's
        // invitations included), so its id, title, times and attendees are hostile too.
        #[test]
        fn update_previews_never_panic_keep_their_lines_and_bind_the_current_event(
            id in "(?s).{0,120}",
            current_summary in "(?s).{0,300}",
            current_start in event_time(),
            current_end in event_time(),
            current_attendees in proptest::collection::vec("(?s).{0,80}", 0..20),
            changes in (maybe(300), maybe(60), maybe(60), maybe(60), maybe(400), maybe(2000)),
            attendees in proptest::option::of(proptest::collection::vec("(?s).{0,80}", 0..20)),
        ) {
            let current = Event {
                id,
                summary: current_summary,
                location: String::new(),
                start: current_start,
                end: current_end,
                attendees: current_attendees.iter().map(|e| Attendee { email: e.clone(), ..Attendee::default() }).collect(),
            };
            let mut args = json!({"event_id": "e"});
            let (summary, start, end, zone, location, description) = changes;
            for (key, value) in [("summary", summary), ("start", start), ("end", end), ("time_zone", zone),
                                 ("location", location), ("description", description)] {
                if let Some(v) = value { args[key] = json!(v); }
            }
            if let Some(a) = &attendees { args["attendees"] = json!(a); }
            let p = update_preview("me@example.com", &current, &args, None);
            prop_assert!(p.text.starts_with("Update event ["));
            assert_lines(&p.text, &["Update event [", "Now: ", "Attendees now: ", "Changes:",
                                    "- Title → ", "- Location → ", "- Description → ", "- Time → ",
                                    "- Invites: ", "- Removes: ",
                                    "The attendees are emailed about this change."])?;
            prop_assert_eq!(p.binding.len(), 64);
            prop_assert_eq!(&p.recipients, attendees.as_ref().unwrap_or(&current_attendees));
            // The binding follows the current event, not what the call asks to change.
            let unchanged = update_preview("me@example.com", &current, &json!({"event_id": "e"}), None);
            prop_assert_eq!(p.binding, unchanged.binding);
        }
    }
}
