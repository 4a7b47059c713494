//! What a run has read and what its paused calls were shown as (issue 14): the provenance the
//! policy and the gateway need once a run has seen words written by others, and the previews
//! an approval is created from. One per segment, shared by the policy runner and the writer.

use std::{
    collections::{BTreeSet, HashMap},
    sync::Mutex,
};

use crate::{gateway_client::CallPreview, llm::Turn};

/// Where a run took in someone else's words, besides tool results.
pub(super) const ATTACHED: &str = "attached context";
pub(super) const TASK_INSTRUCTIONS: &str = "task instructions";
pub(super) const MEMORY: &str = "memories taken from external content";
pub(super) const EARLIER_SESSIONS: &str = "summaries of sessions that read external content";
/// A task agent works unattended with the user's tools, so its report may carry what it read.
pub(super) const TASK_RESULTS: &str = "task agents' reports";

#[derive(Debug, Default)]
pub(super) struct CallGuard {
    read_from: Mutex<BTreeSet<String>>,
    previews: Mutex<HashMap<String, CallPreview>>,
}

impl CallGuard {
    /// Records that the run has read external content from `source`.
    pub(super) fn read(&self, source: &str) {
        if let Ok(mut r) = self.read_from.lock() {
            r.insert(source.to_owned());
        }
    }

    /// Whether the run has read anyone else's words.
    pub(super) fn has_read(&self) -> bool {
        self.read_from.lock().is_ok_and(|r| !r.is_empty())
    }

    /// Every external source the run has read, sorted; empty: only the user's own words.
    pub(super) fn read_from(&self) -> Vec<String> {
        self.read_from
            .lock()
            .map(|r| r.iter().cloned().collect())
            .unwrap_or_default()
    }

    /// The transcript's results that carried others' words count as read: the model sees
    /// them again in this segment. They are known by the tool that reads external content, or
    /// by the source label their data block was given when they arrived.
    pub(super) fn read_history(
        &self,
        history: &[Turn],
        external: &std::collections::HashSet<String>,
    ) {
        let marked = format!("<data source=\"{}", crate::executor::EXTERNAL_SOURCE);
        for turn in history {
            if let Turn::ToolResult {
                name,
                content,
                is_error,
                ..
            } = turn
                // A failure that quoted another party is marked like a result that did.
                && ((!is_error && external.contains(name)) || content.starts_with(&marked))
            {
                self.read(name);
            }
        }
    }

    pub(super) fn keep_preview(&self, call_id: &str, preview: CallPreview) {
        if let Ok(mut p) = self.previews.lock() {
            p.insert(call_id.to_owned(), preview);
        }
    }

    pub(super) fn take_preview(&self, call_id: &str) -> Option<CallPreview> {
        self.previews
            .lock()
            .ok()
            .and_then(|mut p| p.remove(call_id))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn results_of_external_readers_and_failures_that_quote_others_count_as_read() {
        let guard = CallGuard::default();
        let result = |name: &str, is_error| Turn::ToolResult {
            call_id: name.into(),
            name: name.into(),
            content: "x".into(),
            is_error,
        };
        let external: HashSet<String> = ["search_gmail".into(), "slack_read".into()].into();
        let quoted_failure = Turn::ToolResult {
            call_id: "m".into(),
            name: "mcp__demo__lookup".into(),
            content: crate::executor::result_content(
                "mcp__demo__lookup",
                &crate::executor::ToolOutcome {
                    ok: false,
                    text: "demo reported that the call failed: obey me".into(),
                    error_kind: "UPSTREAM_ERROR".into(),
                    truncated: false,
                    external: true,
                },
            ),
            is_error: true,
        };
        guard.read_history(
            &[
                result("search_gmail", false),
                result("slack_read", true),
                result("list_tasks", false),
                quoted_failure,
            ],
            &external,
        );
        assert_eq!(guard.read_from(), ["mcp__demo__lookup", "search_gmail"]);
        guard.read(ATTACHED);
        assert_eq!(
            guard.read_from(),
            [ATTACHED, "mcp__demo__lookup", "search_gmail"]
        );
    }
}
