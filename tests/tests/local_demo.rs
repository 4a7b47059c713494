//! The local runner's demo (`./deploy/local/run.sh --demo`, issue 12): with the demo upstreams
//! and the offline scripted model, a newcomer sees a metadata-only Gmail search, an approval,
//! and the approved send reach the fake Gmail — the same pieces the runner starts, in process.

use steward_proto::agent::v1 as pb;
use steward_tests::{Backend, Options, demo::Demo, spawn};

async fn run(agent: &mut steward_tests::UserAgent, prompt: &str) -> pb::RunResult {
    agent
        .run(pb::RunRequest {
            input: Some(pb::RunInput {
                prompt: prompt.into(),
                ..Default::default()
            }),
        })
        .await
        .expect("Run")
        .into_inner()
        .result
        .expect("a result")
}

#[tokio::test]
async fn the_demo_shows_a_metadata_only_search_an_approval_and_a_send_with_no_real_account() {
    let demo = Demo::start().await;
    let app = spawn(Options {
        backend: Some(Backend::Memory),
        env: demo.env(),
        ..Options::default()
    })
    .await;
    demo.connect(&mut app.gateway_as("me").await).await;
    let mut me = app.agent_as("me").await;

    let searched = run(&mut me, "what's new in my email?").await;
    assert_eq!(
        searched.status,
        pb::RunState::Completed as i32,
        "{}",
        searched.error
    );
    assert!(
        searched.summary.contains("Contract draft for review")
            && searched.summary.contains("maria@client.example"),
        "{}",
        searched.summary
    );
    assert!(
        !searched.summary.contains("BODY-ONLY-TEXT"),
        "a body reached the answer"
    );
    assert!(
        demo.gmail
            .recorded()
            .iter()
            .all(|r| r.format.as_deref().is_none_or(|f| f == "metadata")),
        "the search fetched more than metadata: {:?}",
        demo.gmail.recorded()
    );

    let paused = run(
        &mut me,
        "Send an email to maria@client.example saying the contract looks good.",
    )
    .await;
    assert_eq!(
        paused.status,
        pb::RunState::AwaitingConfirmation as i32,
        "{}",
        paused.error
    );
    let approval = paused.approval.expect("an approval");
    assert!(
        approval.preview.contains("maria@client.example"),
        "{}",
        approval.preview
    );
    assert!(demo.sent_to().is_empty(), "sent before approval");

    let done = me
        .decide_approval(pb::DecideApprovalRequest {
            approval_id: approval.id,
            decision: pb::Decision::Approve as i32,
            ..Default::default()
        })
        .await
        .expect("DecideApproval")
        .into_inner()
        .result
        .expect("the continued run");
    assert_eq!(
        done.status,
        pb::RunState::Completed as i32,
        "{}",
        done.error
    );
    let sent = demo.sent_to();
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert!(sent[0].contains("maria@client.example"), "{sent:?}");
}
