//! The embedded store: process memory, for local runs and tests with no database.

use std::{
    collections::HashMap,
    sync::Mutex,
    time::{Duration, SystemTime},
};

use serde_json::Value;

use super::{
    Action, ActionState, AgentStore, Approval, ApprovalState, Archive, LockOutcome, Message,
    MessageKind, MessageSource, NewRunOutcome, Run, RunPatch, RunState, StoreError, TaskAgent,
    Thread, transcript_text,
};

#[derive(Default)]
struct State {
    threads: HashMap<String, (Thread, Option<SystemTime>)>,
    messages: Vec<Message>,
    history: HashMap<String, Vec<Value>>,
    runs: HashMap<String, Run>,
    events: HashMap<String, Vec<Vec<u8>>>,
    approvals: HashMap<String, Approval>,
    actions: Vec<Action>,
    archives: Vec<(String, Archive, String)>,
    tasks: Vec<(TaskAgent, SystemTime, Option<SystemTime>)>,
    audit: Vec<(String, String, Value)>,
}

#[derive(Default)]
pub struct MemoryStore {
    state: Mutex<State>,
}

impl MemoryStore {
    pub fn new() -> Self {
        Self::default()
    }

    fn with<T>(&self, f: impl FnOnce(&mut State) -> T) -> Result<T, StoreError> {
        let mut state = self
            .state
            .lock()
            .map_err(|_| StoreError::Unavailable("in-memory store lock poisoned".into()))?;
        Ok(f(&mut state))
    }
}

#[async_trait::async_trait]
impl AgentStore for MemoryStore {
    fn backend(&self) -> &'static str {
        "memory"
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }

    async fn create_thread(
        &self,
        id: &str,
        owner: &str,
        title: &str,
    ) -> Result<Thread, StoreError> {
        let now = SystemTime::now();
        let thread = Thread {
            id: id.to_owned(),
            owner: owner.to_owned(),
            title: title.to_owned(),
            created_at: now,
            updated_at: now,
            active_run_id: None,
            last_run_id: None,
        };
        self.with(|s| s.threads.insert(id.to_owned(), (thread.clone(), None)))?;
        Ok(thread)
    }

    async fn get_thread(&self, owner: &str, id: &str) -> Result<Option<Thread>, StoreError> {
        self.with(|s| {
            s.threads
                .get(id)
                .filter(|(t, _)| t.owner == owner)
                .map(|(t, lease)| {
                    let mut t = t.clone();
                    if lease.is_none_or(|l| l <= SystemTime::now()) {
                        t.active_run_id = None;
                    }
                    t
                })
        })
    }

    async fn list_threads(
        &self,
        owner: &str,
        offset: usize,
        limit: usize,
    ) -> Result<Vec<Thread>, StoreError> {
        self.with(|s| {
            let mut mine: Vec<Thread> = s
                .threads
                .values()
                .filter(|(t, _)| t.owner == owner)
                .map(|(t, _)| t.clone())
                .collect();
            mine.sort_by(|a, b| b.updated_at.cmp(&a.updated_at).then(a.id.cmp(&b.id)));
            mine.into_iter().skip(offset).take(limit).collect()
        })
    }

    async fn lock_thread(
        &self,
        thread_id: &str,
        run_id: &str,
        lease: Duration,
    ) -> Result<LockOutcome, StoreError> {
        self.with(|s| {
            let Some((thread, expires)) = s.threads.get_mut(thread_id) else {
                return Err(StoreError::NotFound(format!("thread {thread_id}")));
            };
            let now = SystemTime::now();
            match (&thread.active_run_id, *expires) {
                (Some(holder), Some(until)) if until > now && holder != run_id => {
                    Ok(LockOutcome::Busy {
                        run_id: holder.clone(),
                    })
                }
                _ => {
                    thread.active_run_id = Some(run_id.to_owned());
                    thread.last_run_id = Some(run_id.to_owned());
                    thread.updated_at = now;
                    *expires = Some(now + lease);
                    Ok(LockOutcome::Acquired)
                }
            }
        })?
    }

    async fn renew_lock(
        &self,
        thread_id: &str,
        run_id: &str,
        lease: Duration,
    ) -> Result<(), StoreError> {
        self.with(|s| {
            if let Some((thread, expires)) = s.threads.get_mut(thread_id)
                && thread.active_run_id.as_deref() == Some(run_id)
            {
                *expires = Some(SystemTime::now() + lease);
            }
        })
    }

    async fn release_lock(&self, thread_id: &str, run_id: &str) -> Result<(), StoreError> {
        self.with(|s| {
            if let Some((thread, expires)) = s.threads.get_mut(thread_id)
                && thread.active_run_id.as_deref() == Some(run_id)
            {
                thread.active_run_id = None;
                *expires = None;
            }
        })
    }

    async fn add_message(
        &self,
        thread_id: &str,
        run_id: Option<&str>,
        source: MessageSource,
        kind: MessageKind,
        content: &str,
        metadata: Value,
    ) -> Result<Message, StoreError> {
        self.with(|s| {
            let message = Message {
                id: s.messages.len() as i64 + 1,
                thread_id: thread_id.to_owned(),
                run_id: run_id.map(str::to_owned),
                source,
                kind,
                content: content.to_owned(),
                metadata,
                created_at: SystemTime::now(),
            };
            s.messages.push(message.clone());
            if let Some((t, _)) = s.threads.get_mut(thread_id) {
                t.updated_at = message.created_at;
            }
            message
        })
    }

    async fn list_messages(
        &self,
        thread_id: &str,
        offset: usize,
        limit: usize,
    ) -> Result<Vec<Message>, StoreError> {
        self.with(|s| {
            s.messages
                .iter()
                .filter(|m| m.thread_id == thread_id)
                .skip(offset)
                .take(limit)
                .cloned()
                .collect()
        })
    }

    async fn history(&self, thread_id: &str) -> Result<Vec<Value>, StoreError> {
        self.with(|s| s.history.get(thread_id).cloned().unwrap_or_default())
    }

    async fn append_history(&self, thread_id: &str, turns: &[Value]) -> Result<(), StoreError> {
        self.with(|s| {
            s.history
                .entry(thread_id.to_owned())
                .or_default()
                .extend_from_slice(turns)
        })
    }

    async fn create_run(&self, run: &Run) -> Result<NewRunOutcome, StoreError> {
        self.with(|s| {
            if let Some(key) = &run.request_id
                && let Some(existing) = s
                    .runs
                    .values()
                    .find(|r| r.owner == run.owner && r.request_id.as_ref() == Some(key))
            {
                return NewRunOutcome::Duplicate {
                    run_id: existing.id.clone(),
                };
            }
            s.runs.insert(run.id.clone(), run.clone());
            NewRunOutcome::Created
        })
    }

    async fn get_run(&self, owner: &str, run_id: &str) -> Result<Option<Run>, StoreError> {
        self.with(|s| s.runs.get(run_id).filter(|r| r.owner == owner).cloned())
    }

    async fn find_run_by_request(
        &self,
        owner: &str,
        request_id: &str,
    ) -> Result<Option<Run>, StoreError> {
        self.with(|s| {
            s.runs
                .values()
                .find(|r| r.owner == owner && r.request_id.as_deref() == Some(request_id))
                .cloned()
        })
    }

    async fn update_run(&self, run_id: &str, p: RunPatch) -> Result<(), StoreError> {
        self.with(|s| {
            let Some(run) = s.runs.get_mut(run_id) else {
                return;
            };
            if let Some(v) = p.state {
                run.state = v;
            }
            if let Some(v) = p.model {
                run.model = v;
            }
            if let Some(v) = p.usage {
                run.usage = v;
            }
            if let Some(v) = p.iterations {
                run.iterations = v;
            }
            if let Some(v) = p.error {
                run.error = Some(v);
            }
            if let Some(v) = p.failure_kind {
                run.failure_kind = Some(v);
            }
            if let Some(v) = p.summary {
                run.summary = v;
            }
            if let Some(v) = p.started_at {
                run.started_at = Some(v);
            }
            if let Some(v) = p.finished_at {
                run.finished_at = Some(v);
            }
            if let Some(v) = p.prompt_sections {
                run.prompt_sections = v;
            }
        })
    }

    async fn request_cancel(&self, run_id: &str) -> Result<bool, StoreError> {
        self.with(|s| match s.runs.get_mut(run_id) {
            Some(run) if !run.state.is_terminal() => {
                run.cancel_requested = true;
                true
            }
            _ => false,
        })
    }

    async fn append_event(&self, run_id: &str, payload: &[u8]) -> Result<u64, StoreError> {
        self.with(|s| {
            let events = s.events.entry(run_id.to_owned()).or_default();
            events.push(payload.to_vec());
            let seq = events.len() as u64;
            if let Some(run) = s.runs.get_mut(run_id) {
                run.last_event_seq = seq;
            }
            seq
        })
    }

    async fn events_after(
        &self,
        run_id: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<(u64, Vec<u8>)>, StoreError> {
        self.with(|s| {
            s.events
                .get(run_id)
                .map(|events| {
                    events
                        .iter()
                        .enumerate()
                        .skip(after as usize)
                        .take(limit)
                        .map(|(i, e)| (i as u64 + 1, e.clone()))
                        .collect()
                })
                .unwrap_or_default()
        })
    }

    async fn unfinished_runs_before(&self, before: SystemTime) -> Result<Vec<Run>, StoreError> {
        self.with(|s| {
            s.runs
                .values()
                .filter(|r| {
                    matches!(
                        r.state,
                        RunState::Queued | RunState::Planning | RunState::Executing
                    )
                })
                .filter(|r| r.started_at.unwrap_or(r.created_at) < before)
                .cloned()
                .collect()
        })
    }

    async fn fail_if_unfinished(
        &self,
        run_id: &str,
        error: &str,
        failure_kind: &str,
    ) -> Result<bool, StoreError> {
        self.with(|s| match s.runs.get_mut(run_id) {
            Some(run)
                if matches!(
                    run.state,
                    RunState::Queued | RunState::Planning | RunState::Executing
                ) =>
            {
                run.state = RunState::Failed;
                run.error = Some(error.to_owned());
                run.failure_kind = Some(failure_kind.to_owned());
                run.finished_at = Some(SystemTime::now());
                true
            }
            _ => false,
        })
    }

    async fn archive_history(
        &self,
        thread_id: &str,
        owner: &str,
        summary: &str,
    ) -> Result<Option<Archive>, StoreError> {
        self.with(|s| {
            let turns = s.history.remove(thread_id).unwrap_or_default();
            if turns.is_empty() {
                return None;
            }
            let archive = Archive {
                thread_id: thread_id.to_owned(),
                summary: summary.to_owned(),
                turn_count: turns.len() as u32,
                archived_at: SystemTime::now(),
            };
            s.archives.push((
                owner.to_owned(),
                archive.clone(),
                format!("{summary}\n{}", transcript_text(&turns)).to_lowercase(),
            ));
            Some(archive)
        })
    }

    async fn recent_summaries(
        &self,
        owner: &str,
        limit: usize,
    ) -> Result<Vec<Archive>, StoreError> {
        self.with(|s| {
            s.archives
                .iter()
                .rev()
                .filter(|(o, _, _)| o == owner)
                .take(limit)
                .map(|(_, a, _)| a.clone())
                .collect()
        })
    }

    async fn search_archives(
        &self,
        owner: &str,
        query: &str,
        limit: usize,
    ) -> Result<Vec<Archive>, StoreError> {
        let words: Vec<String> = query.split_whitespace().map(str::to_lowercase).collect();
        self.with(|s| {
            let mut hits: Vec<(usize, Archive)> = s
                .archives
                .iter()
                .rev()
                .filter(|(o, _, _)| o == owner)
                .map(|(_, a, text)| {
                    (
                        words.iter().filter(|w| text.contains(w.as_str())).count(),
                        a.clone(),
                    )
                })
                .filter(|(score, _)| *score > 0)
                .collect();
            hits.sort_by_key(|h| std::cmp::Reverse(h.0));
            hits.into_iter().take(limit).map(|(_, a)| a).collect()
        })
    }

    async fn idle_threads_with_history(
        &self,
        before: SystemTime,
    ) -> Result<Vec<(String, String)>, StoreError> {
        self.with(|s| {
            s.threads
                .values()
                .filter(|(t, _)| {
                    t.updated_at < before && s.history.get(&t.id).is_some_and(|h| !h.is_empty())
                })
                .map(|(t, _)| (t.id.clone(), t.owner.clone()))
                .collect()
        })
    }

    async fn enqueue_task_agent(&self, task: &TaskAgent) -> Result<(), StoreError> {
        self.with(|s| s.tasks.push((task.clone(), SystemTime::now(), None)))
    }

    async fn claim_task_agent(
        &self,
        _worker: &str,
        lease: Duration,
    ) -> Result<Option<TaskAgent>, StoreError> {
        let now = SystemTime::now();
        self.with(|s| {
            let (task, next, claimed) = s.tasks.iter_mut().find(|(t, next, claimed)| {
                (t.state == "queued" && *next <= now)
                    || (t.state == "running" && claimed.is_some_and(|c| c < now))
            })?;
            let _ = next;
            task.state = "running".into();
            task.attempts += 1;
            *claimed = Some(now + lease);
            Some(task.clone())
        })
    }

    async fn settle_task_agent(
        &self,
        id: &str,
        state: &str,
        result: Option<&str>,
        error: Option<&str>,
        retry_at: Option<SystemTime>,
    ) -> Result<(), StoreError> {
        self.with(|s| {
            if let Some((task, next, claimed)) = s.tasks.iter_mut().find(|(t, _, _)| t.id == id) {
                task.state = state.to_owned();
                task.result = result.map(str::to_owned).or(task.result.take());
                task.last_error = error.map(str::to_owned).or(task.last_error.take());
                if let Some(at) = retry_at {
                    *next = at;
                }
                *claimed = None;
            }
        })
    }

    async fn get_task_agent(&self, owner: &str, id: &str) -> Result<Option<TaskAgent>, StoreError> {
        self.with(|s| {
            s.tasks
                .iter()
                .find(|(t, _, _)| t.id == id && t.owner == owner)
                .map(|(t, _, _)| t.clone())
        })
    }

    async fn create_action(&self, action: &Action) -> Result<(), StoreError> {
        self.with(|s| s.actions.push(action.clone()))
    }

    async fn update_action(
        &self,
        id: &str,
        state: ActionState,
        result: Option<(&str, Option<&str>)>,
        approval_id: Option<&str>,
    ) -> Result<(), StoreError> {
        self.with(|s| {
            if let Some(a) = s.actions.iter_mut().find(|a| a.id == id) {
                a.state = state;
                if let Some((text, kind)) = result {
                    a.result_text = Some(text.to_owned());
                    a.error_kind = kind.map(str::to_owned);
                }
                if let Some(approval) = approval_id {
                    a.approval_id = Some(approval.to_owned());
                }
                a.updated_at = SystemTime::now();
            }
        })
    }

    async fn list_actions(&self, run_id: &str) -> Result<Vec<Action>, StoreError> {
        self.with(|s| {
            s.actions
                .iter()
                .filter(|a| a.run_id == run_id)
                .cloned()
                .collect()
        })
    }

    async fn create_approval(&self, approval: &Approval) -> Result<(), StoreError> {
        self.with(|s| {
            s.approvals.insert(approval.id.clone(), approval.clone());
        })
    }

    async fn get_approval(&self, owner: &str, id: &str) -> Result<Option<Approval>, StoreError> {
        self.with(|s| s.approvals.get(id).filter(|a| a.owner == owner).cloned())
    }

    async fn decide_approval(
        &self,
        id: &str,
        state: ApprovalState,
        decider: &str,
    ) -> Result<Option<Approval>, StoreError> {
        self.with(|s| {
            let approval = s.approvals.get_mut(id)?;
            if approval.state == ApprovalState::Pending {
                approval.state = state;
                approval.decided_by = Some(decider.to_owned());
                approval.decided_at = Some(SystemTime::now());
            }
            Some(approval.clone())
        })
    }

    async fn record_audit(
        &self,
        owner: &str,
        kind: &str,
        _run_id: Option<&str>,
        detail: Value,
    ) -> Result<(), StoreError> {
        self.with(|s| s.audit.push((owner.to_owned(), kind.to_owned(), detail)))
    }

    async fn audit(&self, owner: &str) -> Result<Vec<(String, Value)>, StoreError> {
        self.with(|s| {
            s.audit
                .iter()
                .filter(|(o, _, _)| o == owner)
                .map(|(_, k, d)| (k.clone(), d.clone()))
                .collect()
        })
    }
}
