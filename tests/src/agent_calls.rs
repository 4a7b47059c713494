//! Agent calls the fault suites make over and over, with errors as text for their reports.

use steward_proto::agent::v1 as pb;

use crate::UserAgent;

/// GetRun, its error as text.
pub async fn get_run(client: &mut UserAgent, run_id: &str) -> Result<pb::GetRunResponse, String> {
    client
        .get_run(pb::GetRunRequest {
            run_id: run_id.to_owned(),
        })
        .await
        .map(tonic::Response::into_inner)
        .map_err(|e| format!("GetRun {run_id}: {:?} {}", e.code(), e.message()))
}

/// A run's events after `after_seq`, to the next terminal one (a pause's, or its end).
pub async fn watched(
    client: &mut UserAgent,
    run_id: &str,
    after_seq: u64,
) -> Result<Vec<pb::RunEvent>, String> {
    use tokio_stream::StreamExt;
    let stream = client
        .watch_run(pb::WatchRunRequest {
            run_id: run_id.to_owned(),
            after_seq,
        })
        .await
        .map_err(|e| format!("WatchRun {run_id}: {:?} {}", e.code(), e.message()))?
        .into_inner();
    let answers: Vec<Result<pb::WatchRunResponse, tonic::Status>> = stream.collect().await;
    answers
        .into_iter()
        .filter_map(|r| {
            r.map(|r| r.event)
                .map_err(|e| format!("WatchRun {run_id}: {:?} {}", e.code(), e.message()))
                .transpose()
        })
        .collect()
}

/// Every message of a thread, all pages.
pub async fn messages(client: &mut UserAgent, thread_id: &str) -> Result<Vec<pb::Message>, String> {
    let mut all = Vec::new();
    let mut token = String::new();
    loop {
        let page = client
            .list_messages(pb::ListMessagesRequest {
                thread_id: thread_id.to_owned(),
                page_size: 200,
                page_token: token.clone(),
            })
            .await
            .map_err(|e| format!("ListMessages {thread_id}: {:?} {}", e.code(), e.message()))?
            .into_inner();
        all.extend(page.messages);
        if page.next_page_token.is_empty() {
            return Ok(all);
        }
        token = page.next_page_token;
    }
}

/// One Run on `thread_id` (empty: a new thread).
pub async fn run_once(
    client: &mut UserAgent,
    prompt: &str,
    thread_id: &str,
) -> Result<pb::RunResult, tonic::Status> {
    let input = pb::RunInput {
        prompt: prompt.to_owned(),
        thread_id: thread_id.to_owned(),
        ..Default::default()
    };
    run_input(client, input).await
}

/// One Run on a new thread with `attached` context items.
pub async fn run_with_attached(
    client: &mut UserAgent,
    prompt: &str,
    attached: Vec<pb::AttachedContext>,
) -> Result<pb::RunResult, tonic::Status> {
    let input = pb::RunInput {
        prompt: prompt.to_owned(),
        attached_context: attached,
        ..Default::default()
    };
    run_input(client, input).await
}

async fn run_input(
    client: &mut UserAgent,
    input: pb::RunInput,
) -> Result<pb::RunResult, tonic::Status> {
    let result = client
        .run(pb::RunRequest { input: Some(input) })
        .await?
        .into_inner()
        .result;
    result.ok_or_else(|| tonic::Status::internal("Run returned no result"))
}
