//! The bootstrap context (I-8, S0 AC-12/AC-13): tasks, reminders and unread email summarised
//! for a session opening, without a model and without message content. The sources run
//! concurrently, each under its own deadline; one that fails or is slow is "(unavailable)" and
//! never holds up the others. A short per-user cache absorbs rapid reconnects.

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use jiff::tz::TimeZone;

use crate::{
    context::{CallContext, Services},
    domain::{Channel, Integration, UserId},
    integrations::{gmail::GmailApi, quoted},
    store::{NoteStore, ReminderStore, TaskFilter, TaskStore},
    time::{overdue_days, time_or_datetime, zone},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SourceStatus {
    Ok,
    Unavailable,
    Empty,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TaskBrief {
    pub id: i64,
    pub title: String,
    pub due_at: Option<SystemTime>,
    pub overdue_days: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TasksSummary {
    pub status: SourceStatus,
    pub line: String,
    pub pending: u32,
    pub completed: u32,
    pub overdue: u32,
    pub overdue_items: Vec<TaskBrief>,
    pub top: Option<TaskBrief>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct RemindersSummary {
    pub status: SourceStatus,
    pub line: String,
    pub upcoming: u32,
    pub next: Option<(String, SystemTime)>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct AccountUnread {
    pub account: String,
    pub status: SourceStatus,
    pub unread: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub struct EmailSummary {
    pub status: SourceStatus,
    pub line: String,
    pub accounts: Vec<AccountUnread>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct BootstrapContext {
    pub tasks: TasksSummary,
    pub reminders: RemindersSummary,
    pub email: EmailSummary,
    pub new_user: bool,
    pub rendered: String,
    pub generated_at: SystemTime,
}

const UNAVAILABLE: &str = "(unavailable)";
/// How many upcoming reminders are counted.
const REMINDER_HORIZON: usize = 50;

#[derive(Clone)]
pub struct Bootstrap {
    pub tasks: Arc<dyn TaskStore>,
    pub reminders: Arc<dyn ReminderStore>,
    pub notes: Arc<dyn NoteStore>,
    pub services: Arc<Services>,
    pub gmail: GmailApi,
    /// Each source's deadline; the whole call takes about this long at most.
    pub source_timeout: Duration,
    pub cache: Option<moka::future::Cache<(UserId, String), Arc<BootstrapContext>>>,
}

impl Bootstrap {
    pub fn cache(
        ttl: Duration,
    ) -> Option<moka::future::Cache<(UserId, String), Arc<BootstrapContext>>> {
        (!ttl.is_zero()).then(|| {
            moka::future::Cache::builder()
                .max_capacity(100_000)
                .time_to_live(ttl)
                .build()
        })
    }

    /// The context for `user`, times rendered in `time_zone` (IANA name; UTC if empty).
    pub async fn context(&self, user: &UserId, time_zone: &str) -> Arc<BootstrapContext> {
        match &self.cache {
            // Concurrent requests for one key wait for a single computation.
            Some(cache) => {
                cache
                    .get_with((user.clone(), time_zone.to_owned()), async {
                        Arc::new(self.compute(user, time_zone).await)
                    })
                    .await
            }
            None => Arc::new(self.compute(user, time_zone).await),
        }
    }

    async fn compute(&self, user: &UserId, time_zone: &str) -> BootstrapContext {
        let now = SystemTime::now();
        let tz = zone(time_zone);
        let deadline = self.source_timeout;
        let (tasks, reminders, email, notes) = tokio::join!(
            tokio::time::timeout(deadline, self.tasks_summary(user, now, &tz)),
            tokio::time::timeout(deadline, self.reminders_summary(user, now, &tz)),
            tokio::time::timeout(deadline, self.email_summary(user)),
            tokio::time::timeout(deadline, self.notes.count_notes(user)),
        );
        let tasks = tasks.ok().flatten().unwrap_or_else(unavailable_tasks);
        let (reminders, reminders_total) = reminders
            .ok()
            .flatten()
            .unwrap_or_else(|| (unavailable_reminders(), None));
        let email = email.unwrap_or_else(|_| unavailable_email());
        let notes = notes.ok().and_then(Result::ok);
        // New only when every source answered and all are empty: a failure must not send a
        // returning user down the onboarding path.
        let new_user = tasks.status != SourceStatus::Unavailable
            && tasks.pending + tasks.completed == 0
            && reminders_total == Some(0)
            && notes == Some(0);
        let rendered = format!(
            "Tasks: {}\nReminders: {}\nEmail: {}",
            tasks.line, reminders.line, email.line
        );
        BootstrapContext {
            tasks,
            reminders,
            email,
            new_user,
            rendered,
            generated_at: now,
        }
    }

    async fn tasks_summary(
        &self,
        user: &UserId,
        now: SystemTime,
        tz: &TimeZone,
    ) -> Option<TasksSummary> {
        let all = match self.tasks.list_tasks(user, TaskFilter::All).await {
            Ok(all) => all,
            Err(e) => {
                tracing::warn!(user = %user, error = %e, "bootstrap: tasks unavailable");
                return None;
            }
        };
        let brief = |t: &crate::store::Task| TaskBrief {
            id: t.id,
            title: t.title.clone(),
            due_at: t.due_at,
            overdue_days: t.due_at.map_or(0, |d| overdue_days(d, now, tz)),
        };
        // Listed pending-first by due date, so the first pending task is the most overdue or
        // the soonest due.
        let pending: Vec<TaskBrief> = all
            .iter()
            .filter(|t| t.completed_at.is_none())
            .map(brief)
            .collect();
        let completed = all.len() - pending.len();
        let overdue_items: Vec<TaskBrief> = pending
            .iter()
            .filter(|t| t.overdue_days > 0)
            .cloned()
            .collect();
        let top = pending.first().cloned();
        let line = match &top {
            None => "No active tasks.".to_owned(),
            Some(top) => {
                let plural = if pending.len() == 1 { "task" } else { "tasks" };
                let overdue = if overdue_items.is_empty() {
                    String::new()
                } else {
                    format!(" ({} overdue)", overdue_items.len())
                };
                let top_note = if top.overdue_days > 0 {
                    format!(" (overdue {}d)", top.overdue_days)
                } else {
                    String::new()
                };
                format!(
                    "{} active {plural}{overdue}. Top: {}{top_note}",
                    pending.len(),
                    quoted(&top.title).replace('"', "'")
                )
            }
        };
        Some(TasksSummary {
            status: if pending.is_empty() {
                SourceStatus::Empty
            } else {
                SourceStatus::Ok
            },
            line,
            pending: pending.len() as u32,
            completed: completed as u32,
            overdue: overdue_items.len() as u32,
            overdue_items,
            top,
        })
    }

    async fn reminders_summary(
        &self,
        user: &UserId,
        now: SystemTime,
        tz: &TimeZone,
    ) -> Option<(RemindersSummary, Option<u64>)> {
        let (upcoming, total) = tokio::join!(
            self.reminders
                .upcoming_reminders(user, now, REMINDER_HORIZON),
            self.reminders.count_reminders(user)
        );
        let upcoming = match upcoming {
            Ok(u) => u,
            Err(e) => {
                tracing::warn!(user = %user, error = %e, "bootstrap: reminders unavailable");
                return None;
            }
        };
        let summary = match upcoming.first() {
            None => RemindersSummary {
                status: SourceStatus::Empty,
                line: "No upcoming reminders.".into(),
                upcoming: 0,
                next: None,
            },
            Some(next) => {
                let plural = if upcoming.len() == 1 {
                    "reminder"
                } else {
                    "reminders"
                };
                RemindersSummary {
                    status: SourceStatus::Ok,
                    line: format!(
                        "{} upcoming {plural}. Next: {} at {}",
                        upcoming.len(),
                        quoted(&next.text).replace('"', "'"),
                        time_or_datetime(next.due_at, now, tz)
                    ),
                    upcoming: upcoming.len() as u32,
                    next: Some((next.text.clone(), next.due_at)),
                }
            }
        };
        Some((summary, total.ok()))
    }

    async fn email_summary(&self, user: &UserId) -> EmailSummary {
        let (accounts, to_reconnect) = match self
            .services
            .credentials
            .accounts(user, Integration::Gmail)
            .await
        {
            Ok(all) if all.usable.is_empty() && all.to_reconnect.is_empty() => {
                return EmailSummary {
                    status: SourceStatus::Empty,
                    line: "No email account connected.".into(),
                    accounts: vec![],
                };
            }
            Ok(all) => (all.usable, all.to_reconnect),
            Err(e) => {
                tracing::warn!(user = %user, error = %e, "bootstrap: email accounts unavailable");
                return unavailable_email();
            }
        };
        // Each account under its own slightly shorter deadline, so one hanging account still
        // lets the others report before the source deadline.
        let per_account = self.source_timeout.mul_f32(0.9);
        let mut fetches = tokio::task::JoinSet::new();
        for (index, account) in accounts.iter().enumerate() {
            let mut ctx = CallContext::new(
                self.services.clone(),
                user.clone(),
                Channel::SessionOpen,
                format!("bootstrap-{index}"),
                None,
                "bootstrap_context".into(),
            );
            // Kept, and handed to the batching writer when the context is dropped, after the
            // account's deadline: written inside it, a slow audit store would time the read out.
            ctx.audit_later = true;
            let (gmail, name) = (self.gmail.clone(), account.account.clone());
            fetches.spawn(async move {
                let unread =
                    tokio::time::timeout(per_account, gmail.unread_inbox(&ctx, &name)).await;
                (index, name, unread)
            });
        }
        let mut results: Vec<AccountUnread> = Vec::new();
        let mut ordered = Vec::new();
        while let Some(joined) = fetches.join_next().await {
            if let Ok((index, account, unread)) = joined {
                let entry = match unread {
                    Ok(Ok(unread)) => AccountUnread {
                        account,
                        status: SourceStatus::Ok,
                        unread,
                    },
                    Ok(Err(e)) => {
                        tracing::warn!(user = %user, account = %account, error = %e, "bootstrap: unread count failed");
                        AccountUnread {
                            account,
                            status: SourceStatus::Unavailable,
                            unread: 0,
                        }
                    }
                    Err(_) => {
                        tracing::warn!(user = %user, account = %account, "bootstrap: unread count timed out");
                        AccountUnread {
                            account,
                            status: SourceStatus::Unavailable,
                            unread: 0,
                        }
                    }
                };
                ordered.push((index, entry));
            }
        }
        ordered.sort_by_key(|(i, _)| *i);
        results.extend(ordered.into_iter().map(|(_, e)| e));
        // Each account name quoted (and on one line): one holding ", " or a count of its own
        // (a Slack workspace "Acme, Inc", a name someone else chose) reads as one account.
        let name = |account: &str| crate::registry::quoted(&crate::registry::line(account, 200));
        let mut parts: Vec<String> = results
            .iter()
            .map(|a| match a.status {
                SourceStatus::Ok => format!("{} {}", name(&a.account), a.unread),
                _ => format!("{} {UNAVAILABLE}", name(&a.account)),
            })
            .collect();
        // An account that needs reconnecting is not counted, and says why (G-8): never left
        // out as if it were not there.
        for account in to_reconnect {
            parts.push(format!("{} (needs to be reconnected)", name(&account)));
            results.push(AccountUnread {
                account,
                status: SourceStatus::Unavailable,
                unread: 0,
            });
        }
        let status = if results.iter().any(|a| a.status == SourceStatus::Ok) {
            SourceStatus::Ok
        } else {
            SourceStatus::Unavailable
        };
        EmailSummary {
            status,
            line: format!("Unread: {}", parts.join(", ")),
            accounts: results,
        }
    }
}

fn unavailable_tasks() -> TasksSummary {
    TasksSummary {
        status: SourceStatus::Unavailable,
        line: UNAVAILABLE.into(),
        pending: 0,
        completed: 0,
        overdue: 0,
        overdue_items: vec![],
        top: None,
    }
}

fn unavailable_reminders() -> RemindersSummary {
    RemindersSummary {
        status: SourceStatus::Unavailable,
        line: UNAVAILABLE.into(),
        upcoming: 0,
        next: None,
    }
}

fn unavailable_email() -> EmailSummary {
    EmailSummary {
        status: SourceStatus::Unavailable,
        line: UNAVAILABLE.into(),
        accounts: vec![],
    }
}
