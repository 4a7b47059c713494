//! The local runner's demo upstreams (`./deploy/local/run.sh --demo`): the fake Gmail, Calendar
//! and Slack the tests use, with a small made-up world in them, and a demo user's accounts
//! connected to gateway-svc, so a newcomer can watch a metadata-only search, an approval and a
//! send with no Google or Slack account. Everything stays on loopback and in memory.

use serde_json::json;
use steward_proto::gateway::v1 as gw;

use crate::{
    UserGateway,
    calls::connect_account,
    fakes::{
        calendar::{self, FakeCalendar},
        gmail::{FakeGmail, FakeMessage},
        slack::{self, FakeSlack},
    },
};

/// The Gmail access token of the demo mailbox.
pub const GMAIL_TOKEN: &str = "demo-gmail-token";
/// The demo user's mail address.
pub const ADDRESS: &str = "demo@steward.example";

/// The running demo upstreams.
pub struct Demo {
    pub gmail: FakeGmail,
    pub calendar: FakeCalendar,
    pub slack: FakeSlack,
}

impl Demo {
    /// Starts the three fakes on loopback ports and fills them: an inbox with two ordinary
    /// messages and three 12 KB HTML newsletters (the bodies a search must never pull in), one
    /// meeting tomorrow, and Slack's channels.
    pub async fn start() -> Self {
        let gmail = FakeGmail::start().await;
        let mut inbox: Vec<FakeMessage> = (1..=3)
            .map(|n| FakeMessage::html_newsletter(&format!("19c90da{n}"), n))
            .collect();
        let plain = |id: &str, from: &str, subject: &str, snippet: &str, minutes: u64| {
            let mut m = FakeMessage::html_newsletter(id, 0);
            m.from = from.into();
            m.to = ADDRESS.into();
            m.subject = subject.into();
            m.snippet = snippet.into();
            m.message_id = format!("<{id}@mail.example>");
            m.internal_date_ms += minutes * 60_000;
            m.parts = vec![(
                "text/plain".into(),
                "utf-8".into(),
                snippet.as_bytes().to_vec(),
                None,
            )];
            m
        };
        inbox.push(plain(
            "19c90db1",
            "Maria Lopez <maria@client.example>",
            "Contract draft for review",
            "Hi, attached is the revised contract. Could you confirm by Friday?",
            90,
        ));
        inbox.push(plain(
            "19c90db2",
            "GitHub <notifications@github.com>",
            "PR #85 merged",
            "Merged #85 into main.",
            120,
        ));
        gmail.add_messages(GMAIL_TOKEN, inbox);
        gmail.set_unread(GMAIL_TOKEN, 5);

        let calendar = FakeCalendar::start().await;
        let tomorrow = jiff::Timestamp::now() + jiff::SignedDuration::from_hours(24);
        let end = tomorrow + jiff::SignedDuration::from_mins(30);
        calendar.state.events.lock().expect("lock").push(json!({
            "id": "evt1", "status": "confirmed", "summary": "Contract call with Maria",
            "start": {"dateTime": tomorrow.to_string()}, "end": {"dateTime": end.to_string()},
            "attendees": [{"email": "maria@client.example"}, {"email": ADDRESS}],
        }));

        let slack = FakeSlack::start().await;
        Self {
            gmail,
            calendar,
            slack,
        }
    }

    /// gateway-svc's settings that point it at these fakes.
    pub fn env(&self) -> Vec<(String, String)> {
        [
            ("GMAIL_API_BASE_URL", &self.gmail.url),
            ("GOOGLE_CALENDAR_API_BASE_URL", &self.calendar.url),
            ("SLACK_API_BASE_URL", &self.slack.url),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.clone()))
        .collect()
    }

    /// Connects the demo user's Gmail, Calendar and Slack accounts through `gateway`.
    pub async fn connect(&self, gateway: &mut UserGateway) {
        for (integration, token) in [
            (gw::Integration::Gmail, GMAIL_TOKEN),
            (gw::Integration::GoogleCalendar, calendar::TOKEN),
            (gw::Integration::Slack, slack::TOKEN),
        ] {
            connect_account(gateway, integration, ADDRESS, token).await;
        }
    }

    /// The recipients (`To:` lines) of the messages sent so far, oldest first.
    pub fn sent_to(&self) -> Vec<String> {
        self.gmail
            .sent()
            .iter()
            .filter_map(|(raw, _)| {
                raw.lines()
                    .find_map(|l| l.strip_prefix("To: "))
                    .map(str::to_owned)
            })
            .collect()
    }
}
