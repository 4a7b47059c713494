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
    time::parse_when,
};

pub const DEFAULT_BASE_URL: &str = "https://www.googleapis.com";
const SERVICE: &str = "Google Calendar";

#[derive(Debug, Clone)]
pub struct CalendarApi {
    /// `GOOGLE_CALENDAR_API_BASE_URL`
    pub base_url: String,
}

#[derive(Deserialize, Default)]
struct Events {
    #[serde(default)]
    items: Vec<Event>,
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
struct Attendee {
    #[serde(default)]
    email: String,
}

impl Event {
    fn attendee_list(&self) -> Vec<String> {
        self.attendees.iter().map(|a| a.email.clone()).collect()
    }
}

#[derive(Deserialize, Default)]
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
                    let tz = self
                        .time_zone
                        .as_deref()
                        .map(crate::time::zone)
                        .unwrap_or(jiff::tz::TimeZone::UTC);
                    ts.to_zoned(tz).strftime("%b %-d %H:%M %Z").to_string()
                },
            ),
            (None, Some(d)) => format!("{d} (all day)"),
            (None, None) => "(no time)".into(),
        }
    }
}

fn render(e: &Event) -> String {
    let mut line = format!(
        "[{}] \"{}\" — {} to {}",
        e.id,
        e.summary,
        e.start.show(),
        e.end.show()
    );
    if !e.location.is_empty() {
        line.push_str(&format!(" — {}", e.location));
    }
    line
}

impl CalendarApi {
    fn events_url(&self, calendar: &str) -> String {
        let calendar: String = calendar
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || "@._-".contains(*c))
            .collect();
        format!(
            "{}/calendar/v3/calendars/{calendar}/events",
            self.base_url.trim_end_matches('/')
        )
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

async fn account(ctx: &CallContext, args: &Value, tool: &str) -> Result<String, ToolError> {
    let all = ctx.accounts(Integration::GoogleCalendar).await?;
    let named = text_arg(args, "account");
    let names: Vec<_> = all.iter().map(|a| a.account.clone()).collect();
    match named {
        Some(n) => names
            .into_iter()
            .find(|a| a.eq_ignore_ascii_case(&n))
            .ok_or_else(|| ToolError::InvalidArguments {
                tool: tool.into(),
                detail: format!("no connected calendar account {n:?}"),
            }),
        None if names.len() == 1 => Ok(names[0].clone()),
        None => Err(ToolError::InvalidArguments {
            tool: tool.into(),
            detail: format!("name the account to use: {}", names.join(", ")),
        }),
    }
}

fn rfc3339(args: &Value, field: &str, tool: &str) -> Result<Option<String>, ToolError> {
    let Some(raw) = text_arg(args, field) else {
        return Ok(None);
    };
    let t = parse_when(&raw).map_err(|detail| ToolError::InvalidArguments {
        tool: tool.into(),
        detail: format!("{field}: {detail}"),
    })?;
    Ok(Some(
        jiff::Timestamp::try_from(t)
            .map(|ts| ts.to_string())
            .unwrap_or(raw),
    ))
}

struct Search(CalendarApi);

#[async_trait::async_trait]
impl Tool for Search {
    fn spec(&self) -> ToolSpec {
        spec(
            "calendar_search",
            "Find events in the user's calendar between two times (default: the next 7 days), optionally matching text.",
            json!({"type": "object", "additionalProperties": false, "properties": {
                "time_min": {"type": "string", "description": "RFC 3339; default now"},
                "time_max": {"type": "string", "description": "RFC 3339; default 7 days after time_min"},
                "query": {"type": "string", "maxLength": 200},
                "calendar_id": {"type": "string", "default": "primary"},
                "max_results": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10},
                "account": {"type": "string"}}}),
        )
        .reading_external_content()
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let account = account(ctx, &args, "calendar_search").await?;
        let now =
            jiff::Timestamp::try_from(SystemTime::now()).unwrap_or(jiff::Timestamp::UNIX_EPOCH);
        let time_min =
            rfc3339(&args, "time_min", "calendar_search")?.unwrap_or_else(|| now.to_string());
        let default_max = time_min
            .parse::<jiff::Timestamp>()
            .ok()
            .and_then(|t| t.checked_add(jiff::SignedDuration::from_hours(24 * 7)).ok())
            .map(|t| t.to_string());
        let time_max = rfc3339(&args, "time_max", "calendar_search")?
            .or(default_max)
            .unwrap_or_default();
        let max = args
            .get("max_results")
            .and_then(Value::as_u64)
            .unwrap_or(10)
            .to_string();
        let calendar = text_arg(&args, "calendar_id").unwrap_or_else(|| "primary".into());
        let mut query = vec![
            ("timeMin", time_min.clone()),
            ("timeMax", time_max.clone()),
            ("singleEvents", "true".into()),
            ("orderBy", "startTime".into()),
            ("maxResults", max),
        ];
        if let Some(q) = text_arg(&args, "query") {
            query.push(("q", q));
        }
        ctx.charge(Integration::GoogleCalendar, &account, 1).await?;
        let url = self.0.events_url(&calendar);
        let r = ctx
            .send(Integration::GoogleCalendar, &account, |t| {
                ctx.http().get(&url).query(&query).bearer_auth(t)
            })
            .await?;
        if r.status == reqwest::StatusCode::NOT_FOUND {
            return Err(ToolError::NotFound(format!(
                "There is no calendar {calendar:?} in {account}."
            )));
        }
        let events: Events = r.json(SERVICE)?;
        if events.items.is_empty() {
            return Ok(ToolOutput::text(format!(
                "No events in {account} between {time_min} and {time_max}."
            )));
        }
        let lines: Vec<String> = events
            .items
            .iter()
            .enumerate()
            .map(|(i, e)| format!("{}. {}", i + 1, render(e)))
            .collect();
        Ok(ToolOutput::text(format!(
            "Events in {account} ({}):\n{}",
            events.items.len(),
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
            "start": {"type": "string", "description": "RFC 3339, e.g. 2026-11-25T09:00:00+01:00"},
            "end": {"type": "string", "description": "RFC 3339"},
            "time_zone": {"type": "string", "description": "IANA zone for the event, e.g. Europe/Berlin"},
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
        let field = |k: &str| text_arg(args, k).unwrap_or_default();
        let new_attendees: Option<Vec<String>> =
            args.get("attendees").and_then(Value::as_array).map(|l| {
                l.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            });
        let zone = field("time_zone");
        let when = |start: &str, end: &str| {
            format!(
                "{} to {}{}",
                line(start, 40),
                line(end, 40),
                if zone.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", line(&zone, 40))
                }
            )
        };
        if !self.update {
            let attendees = new_attendees.unwrap_or_default();
            let mut text = format!(
                "Create event \"{}\"\nWhen: {}\n",
                line(&field("summary"), 200),
                when(&field("start"), &field("end"))
            );
            push_attendees(&mut text, "Attendees (invited)", &attendees);
            push_optional(&mut text, "Location", &field("location"));
            push_optional(
                &mut text,
                "Description",
                &first_lines(&field("description"), 3),
            );
            return Ok(Preview {
                text,
                recipients: attendees,
                binding: String::new(),
            });
        }
        let account = account(ctx, args, "calendar_event_update").await?;
        let current = self.current(ctx, &account, args).await?;
        let old_attendees = current.attendee_list();
        let mut text = format!(
            "Update event [{}] \"{}\" in {account}\nNow: {} to {}\n",
            line(&current.id, 100),
            line(&current.summary, 200),
            current.start.show(),
            current.end.show()
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
            text.push_str(&format!(
                "- Time → {}\n",
                when(&field("start"), &field("end"))
            ));
        }
        let mut recipients = old_attendees.clone();
        if let Some(list) = &new_attendees {
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
            recipients = list.clone();
        }
        let mut bound = old_attendees.clone();
        bound.sort();
        Ok(Preview {
            text,
            recipients,
            binding: digest(&[
                &current.id,
                current
                    .start
                    .date_time
                    .as_deref()
                    .or(current.start.date.as_deref())
                    .unwrap_or(""),
                current
                    .end
                    .date_time
                    .as_deref()
                    .or(current.end.date.as_deref())
                    .unwrap_or(""),
                &bound.join(","),
            ]),
        })
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let tool = if self.update {
            "calendar_event_update"
        } else {
            "calendar_event_create"
        };
        let account = account(ctx, &args, tool).await?;
        let zone = text_arg(&args, "time_zone");
        if let Some(z) = &zone
            && jiff::tz::TimeZone::get(z).is_err()
        {
            return Err(ToolError::InvalidArguments {
                tool: tool.into(),
                detail: format!("time_zone {z:?} is not an IANA zone"),
            });
        }
        let mut body = Map::new();
        for (field, key) in [
            ("summary", "summary"),
            ("description", "description"),
            ("location", "location"),
        ] {
            if let Some(v) = text_arg(&args, field) {
                body.insert(key.into(), json!(v));
            }
        }
        let start = rfc3339(&args, "start", tool)?;
        let end = rfc3339(&args, "end", tool)?;
        if let (Some(s), Some(e)) = (&start, &end)
            && s >= e
        {
            return Err(ToolError::InvalidArguments {
                tool: tool.into(),
                detail: "end must be after start".into(),
            });
        }
        for (key, value) in [("start", start), ("end", end)] {
            if let Some(v) = value {
                let mut t = json!({ "dateTime": v });
                if let Some(z) = &zone {
                    t["timeZone"] = json!(z);
                }
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
        let calendar = text_arg(&args, "calendar_id").unwrap_or_else(|| "primary".into());
        let base = self.api.events_url(&calendar);
        ctx.charge(Integration::GoogleCalendar, &account, 1).await?;
        let body = Value::Object(body);
        let r = if self.update {
            let url = format!("{base}/{}", event_id(&args));
            ctx.send(Integration::GoogleCalendar, &account, |t| {
                ctx.http().patch(&url).json(&body).bearer_auth(t)
            })
            .await?
        } else {
            ctx.send(Integration::GoogleCalendar, &account, |t| {
                ctx.http().post(&base).json(&body).bearer_auth(t)
            })
            .await?
        };
        if r.status == reqwest::StatusCode::NOT_FOUND {
            return Err(ToolError::NotFound(format!(
                "I couldn't find that event in {account}'s calendar {calendar:?}."
            )));
        }
        let event: Event = r.json(SERVICE)?;
        let verb = if self.update { "Updated" } else { "Created" };
        Ok(ToolOutput::text(format!(
            "{verb} event {} in {account}.",
            render(&event)
        )))
    }
}

/// The event id as it goes into a URL: letters and digits only.
fn event_id(args: &Value) -> String {
    text_arg(args, "event_id")
        .unwrap_or_default()
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .collect()
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
    /// The event an update would change, as it is now.
    async fn current(
        &self,
        ctx: &CallContext,
        account: &str,
        args: &Value,
    ) -> Result<Event, ToolError> {
        let calendar = text_arg(args, "calendar_id").unwrap_or_else(|| "primary".into());
        let url = format!("{}/{}", self.api.events_url(&calendar), event_id(args));
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
