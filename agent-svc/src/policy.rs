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

/// Sends and drafts whose recipients the delegated allowlist can cover.
const ALLOWLISTABLE: [&str; 2] = ["gmail_send", "gmail_draft_create"];

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

    pub fn decide(&self, user: &str, tool: &str, side_effect: bool, args: &Value) -> Verdict {
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
        let trust = policy.map_or(self.default_trust, |p| p.trust);
        match trust {
            TrustLevel::Autonomous => Verdict::Allow,
            TrustLevel::Supervised => Verdict::NeedsApproval(format!(
                "{tool} has side effects and the user's trust level is supervised"
            )),
            TrustLevel::Delegated => {
                let allowlist: Vec<String> = policy
                    .map(|p| p.allowlist.iter().map(|a| a.to_lowercase()).collect())
                    .unwrap_or_default();
                let to = recipients(args);
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

/// A readable preview of what an action will do (P-4): recipients, subject and first lines; an
/// event's title and time; otherwise the arguments in short.
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
            p.decide("u", "search_gmail", false, &json!({})),
            Verdict::Allow
        );
        assert!(matches!(
            p.decide("u", "gmail_send", true, &json!({"to": "a@x.com"})),
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
        assert_eq!(p.decide("d", "gmail_send", true, &ok), Verdict::Allow);
        let stranger = json!({"to": ["boss@example.com", "stranger@else.com"]});
        assert!(matches!(
            p.decide("d", "gmail_send", true, &stranger),
            Verdict::NeedsApproval(_)
        ));
        assert!(matches!(
            p.decide("d", "calendar_event_create", true, &json!({})),
            Verdict::NeedsApproval(_)
        ));
        assert!(matches!(
            p.decide("d", "gmail_reply", true, &json!({"message_id": "m"})),
            Verdict::NeedsApproval(_)
        ));
    }

    #[test]
    fn autonomous_runs_and_the_kill_switch_denies_everyone() {
        let mut p = policy(&[("a", TrustLevel::Autonomous, &[])]);
        assert_eq!(
            p.decide("a", "gmail_send", true, &json!({})),
            Verdict::Allow
        );
        p.side_effects_enabled = false;
        assert!(
            matches!(p.decide("a", "gmail_send", true, &json!({})), Verdict::Deny(m) if m.contains("disabled"))
        );
        assert_eq!(
            p.decide("a", "list_tasks", false, &json!({})),
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
