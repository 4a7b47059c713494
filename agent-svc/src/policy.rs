//! Approval policy (P-1..P-3): whether a side-effecting tool call may run now, must wait for
//! the user's approval, or is denied. Whether a tool has side effects comes from the gateway's
//! specs, never from the model.

use std::collections::HashMap;

use serde::Deserialize;
use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TrustLevel {
    /// Every side effect needs approval.
    Supervised,
    /// Side effects need approval, except Gmail sends and drafts to allowlisted recipients.
    Delegated,
    /// Side effects run without approval.
    Autonomous,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct UserPolicy {
    pub trust: TrustLevel,
    #[serde(default)]
    pub allowlist: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Policy {
    /// `AGENT_SIDE_EFFECTS_ENABLED=false` denies every side-effect tool (P-2).
    pub side_effects_enabled: bool,
    /// `AGENT_DEFAULT_TRUST_LEVEL`
    pub default_trust: TrustLevel,
    /// `AGENT_USER_POLICIES`: `{"user": {"trust": "delegated", "allowlist": ["a@x.com"]}}`.
    pub users: HashMap<String, UserPolicy>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Allow,
    /// Not run; the model is told why.
    Deny(String),
    /// Paused for the user's decision; the reason is stored with the approval.
    NeedsApproval(String),
}

/// Sends, replies and drafts whose recipients the delegated allowlist can cover (P-1). A
/// reply's recipients are the ones the gateway resolved from the original message.
const ALLOWLISTABLE: [&str; 3] = ["gmail_send", "gmail_reply", "gmail_draft_create"];

fn recipients(args: &Value) -> Vec<String> {
    ["to", "cc", "bcc"]
        .iter()
        .flat_map(|field| match args.get(*field) {
            Some(Value::String(s)) => s
                .split(',')
                .map(|a| a.trim().to_lowercase())
                .collect::<Vec<_>>(),
            Some(Value::Array(items)) => items
                .iter()
                .filter_map(Value::as_str)
                .map(|a| a.trim().to_lowercase())
                .collect(),
            _ => Vec::new(),
        })
        .filter(|a| !a.is_empty())
        .collect()
}

impl Policy {
    pub fn permissive() -> Self {
        Self {
            side_effects_enabled: true,
            default_trust: TrustLevel::Supervised,
            users: HashMap::new(),
        }
    }

    pub fn trust(&self, user: &str) -> TrustLevel {
        self.users.get(user).map_or(self.default_trust, |p| p.trust)
    }

    /// Whether deciding on a side-effect call needs its preview first: every decision that
    /// may ask the user or check recipients does.
    pub fn wants_preview(&self, user: &str) -> bool {
        self.side_effects_enabled && self.trust(user) != TrustLevel::Autonomous
    }

    /// A memory write in a run that has read words written by others (issue 14): what it
    /// stores would steer every later prompt, so only an autonomous user skips the approval.
    pub fn decide_memory_write(&self, user: &str, tool: &str, read_from: &[String]) -> Verdict {
        match self.trust(user) {
            TrustLevel::Autonomous => Verdict::Allow,
            TrustLevel::Supervised | TrustLevel::Delegated => Verdict::NeedsApproval(format!(
                "{tool} would remember something after this run read content written by others ({}); \
                 the user decides what Steward remembers",
                read_from.join(", ")
            )),
        }
    }

    /// `resolved`: the recipients as the gateway resolved them (a preview); without it, the
    /// recipients named in the arguments.
    pub fn decide(
        &self,
        user: &str,
        tool: &str,
        side_effect: bool,
        args: &Value,
        resolved: Option<&[String]>,
    ) -> Verdict {
        if !side_effect {
            return Verdict::Allow;
        }
        if !self.side_effects_enabled {
            return Verdict::Deny(format!(
                "Denied: {tool} changes things outside Steward and side effects are disabled in this deployment. \
                 Tell the user it could not be done."
            ));
        }
        let policy = self.users.get(user);
        match self.trust(user) {
            TrustLevel::Autonomous => Verdict::Allow,
            TrustLevel::Supervised => Verdict::NeedsApproval(format!(
                "{tool} has side effects and the user's trust level is supervised"
            )),
            TrustLevel::Delegated => {
                let allowlist: Vec<String> = policy
                    .map(|p| p.allowlist.iter().map(|a| a.to_lowercase()).collect())
                    .unwrap_or_default();
                let to = resolved.map_or_else(
                    || recipients(args),
                    |r| r.iter().map(|a| a.trim().to_lowercase()).collect(),
                );
                if ALLOWLISTABLE.contains(&tool)
                    && !to.is_empty()
                    && to.iter().all(|r| allowlist.contains(r))
                {
                    Verdict::Allow
                } else {
                    Verdict::NeedsApproval(format!(
                        "{tool} has side effects and not every recipient is on the user's allowlist (trust level delegated)"
                    ))
                }
            }
        }
    }
}

/// A preview made from the arguments alone, for when the gateway's (which resolves what the
/// call will really do) is missing: recipients, subject and first lines; an event's title and
/// time; otherwise the arguments in short.
pub fn preview(tool: &str, args: &Value) -> String {
    let s = |k: &str| args.get(k).and_then(Value::as_str).unwrap_or_default();
    let first_lines = |text: &str| text.lines().take(3).collect::<Vec<_>>().join("\n");
    match tool {
        "gmail_send" | "gmail_draft_create" => {
            format!(
                "To: {}\nSubject: {}\n\n{}",
                recipients(args).join(", "),
                s("subject"),
                first_lines(s("body"))
            )
        }
        "gmail_reply" => format!(
            "Reply to email {}\n\n{}",
            s("message_id"),
            first_lines(s("body"))
        ),
        "calendar_event_create" | "calendar_event_update" => {
            format!("Event: {} — {} to {}", s("summary"), s("start"), s("end"))
                .trim_end_matches(" —  to ")
                .to_owned()
        }
        _ => {
            let compact = args.to_string();
            let short: String = compact.chars().take(200).collect();
            format!("{tool} {short}")
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn policy(users: &[(&str, TrustLevel, &[&str])]) -> Policy {
        Policy {
            side_effects_enabled: true,
            default_trust: TrustLevel::Supervised,
            users: users
                .iter()
                .map(|(u, t, a)| {
                    (
                        (*u).to_owned(),
                        UserPolicy {
                            trust: *t,
                            allowlist: a.iter().map(|x| (*x).to_owned()).collect(),
                        },
                    )
                })
                .collect(),
        }
    }

    #[test]
    fn reads_always_run_and_supervised_side_effects_wait() {
        let p = policy(&[]);
        assert_eq!(
            p.decide("u", "search_gmail", false, &json!({}), None),
            Verdict::Allow
        );
        assert!(matches!(
            p.decide("u", "gmail_send", true, &json!({"to": "a@x.com"}), None),
            Verdict::NeedsApproval(_)
        ));
    }

    #[test]
    fn delegated_sends_to_allowlisted_recipients_run() {
        let p = policy(&[(
            "d",
            TrustLevel::Delegated,
            &["boss@example.com", "Team@Example.com"],
        )]);
        let ok = json!({"to": ["boss@example.com"], "cc": "team@example.com", "subject": "s", "body": "b"});
        assert_eq!(p.decide("d", "gmail_send", true, &ok, None), Verdict::Allow);
        let stranger = json!({"to": ["boss@example.com", "stranger@else.com"]});
        assert!(matches!(
            p.decide("d", "gmail_send", true, &stranger, None),
            Verdict::NeedsApproval(_)
        ));
        assert!(matches!(
            p.decide("d", "calendar_event_create", true, &json!({}), None),
            Verdict::NeedsApproval(_)
        ));
        assert!(matches!(
            p.decide("d", "gmail_reply", true, &json!({"message_id": "m"}), None),
            Verdict::NeedsApproval(_)
        ));
    }

    #[test]
    fn p1_a_delegated_reply_is_judged_by_the_recipients_the_gateway_resolved() {
        let p = policy(&[("d", TrustLevel::Delegated, &["boss@example.com"])]);
        let args = json!({"message_id": "m", "body": "ok"});
        let boss = ["Boss@Example.com".to_owned()];
        assert_eq!(
            p.decide("d", "gmail_reply", true, &args, Some(&boss)),
            Verdict::Allow
        );
        let hijacked = [
            "boss@example.com".to_owned(),
            "attacker@evil.test".to_owned(),
        ];
        assert!(matches!(
            p.decide("d", "gmail_reply", true, &args, Some(&hijacked)),
            Verdict::NeedsApproval(_)
        ));
        // Recipients named in the arguments do not count when the gateway resolved others.
        let claims = json!({"to": "boss@example.com", "subject": "s", "body": "b"});
        assert!(matches!(
            p.decide("d", "gmail_send", true, &claims, Some(&hijacked)),
            Verdict::NeedsApproval(_)
        ));
    }

    #[test]
    fn p1_memory_writes_after_external_content_wait_unless_autonomous() {
        let p = policy(&[
            ("a", TrustLevel::Autonomous, &[]),
            ("d", TrustLevel::Delegated, &["x@y.z"]),
        ]);
        let read = ["search_gmail".to_owned()];
        assert!(
            matches!(p.decide_memory_write("s", "save_memory", &read), Verdict::NeedsApproval(r) if r.contains("search_gmail"))
        );
        assert!(matches!(
            p.decide_memory_write("d", "save_memory", &read),
            Verdict::NeedsApproval(_)
        ));
        assert_eq!(
            p.decide_memory_write("a", "save_memory", &read),
            Verdict::Allow
        );
        assert!(p.wants_preview("s") && !p.wants_preview("a"));
    }

    #[test]
    fn autonomous_runs_and_the_kill_switch_denies_everyone() {
        let mut p = policy(&[("a", TrustLevel::Autonomous, &[])]);
        assert_eq!(
            p.decide("a", "gmail_send", true, &json!({}), None),
            Verdict::Allow
        );
        p.side_effects_enabled = false;
        assert!(
            matches!(p.decide("a", "gmail_send", true, &json!({}), None), Verdict::Deny(m) if m.contains("disabled"))
        );
        assert_eq!(
            p.decide("a", "list_tasks", false, &json!({}), None),
            Verdict::Allow
        );
    }

    #[test]
    fn previews_show_what_will_happen() {
        let p = preview(
            "gmail_send",
            &json!({"to": ["a@x.com"], "subject": "Lunch", "body": "Friday?\nAt 12.\nOk?\nMore"}),
        );
        assert_eq!(p, "To: a@x.com\nSubject: Lunch\n\nFriday?\nAt 12.\nOk?");
    }
}
