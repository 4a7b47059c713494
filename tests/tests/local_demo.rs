//! The local runner's demo (`./deploy/local/run.sh --demo`, issue 12): with the demo upstreams
//! and the offline scripted model, a newcomer sees a metadata-only Gmail search, an approval,
//! and the approved send reach the fake Gmail — the same pieces the runner starts, in process.

use steward_proto::agent::v1 as pb;
use steward_tests::{Backend, Options, agent_calls::run_once, demo::Demo, spawn};

async fn run(agent: &mut steward_tests::UserAgent, prompt: &str) -> pb::RunResult {
    run_once(agent, prompt, "").await.expect("Run")
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

/// The runner's handshake with the real binary: it writes the gateway's settings to the file it
/// is given, waits for gateway-svc to serve, connects the demo accounts with the service token,
/// says so on stdout, and stops on SIGTERM.
#[tokio::test]
async fn the_demo_upstreams_binary_hands_its_settings_over_and_connects_the_accounts() {
    use std::io::BufRead;

    let dir = std::env::temp_dir().join(format!("steward-demo-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).expect("a temp dir");
    let settings = dir.join("settings.env");
    // The gateway's port is chosen first, as the runner's is fixed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_steward-demo-upstreams"))
        .args(["--env-file", settings.to_str().unwrap(), "--user", "me"])
        .args(["--gateway", &format!("http://127.0.0.1:{port}")])
        .env("GATEWAY_SERVICE_TOKEN", steward_tests::SERVICE_TOKEN)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start steward-demo-upstreams");
    let (lines_tx, lines) = std::sync::mpsc::channel();
    let stdout = child.stdout.take().expect("piped");
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
        {
            let _ = lines_tx.send(line);
        }
    });
    let first = lines
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("the binary says where its settings are");
    assert!(first.contains("settings written"), "{first}");

    // The settings are there before the gateway starts: the runner sources them into it.
    let mut env: Vec<(String, String)> = std::fs::read_to_string(&settings)
        .expect("the settings file")
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    assert_eq!(env.len(), 3, "{env:?}");
    env.push(("GATEWAY_LISTEN_ADDR".into(), format!("127.0.0.1:{port}")));
    let app = spawn(Options {
        backend: Some(Backend::Memory),
        env,
        ..Options::default()
    })
    .await;
    let said =
        tokio::task::spawn_blocking(move || lines.recv_timeout(std::time::Duration::from_secs(30)))
            .await
            .unwrap()
            .expect("the binary reports the connected accounts");
    assert!(said.contains("connected to all three"), "{said}");

    let mut me = app.agent_as("me").await;
    let searched = run(&mut me, "what's new in my email?").await;
    assert!(
        searched.summary.contains("Contract draft for review"),
        "{}",
        searched.summary
    );

    svc_kit::testing::signal(child.id(), "-TERM").expect("SIGTERM");
    let exit = svc_kit::testing::wait_until_exit(&mut child, std::time::Duration::from_secs(10))
        .expect("it stops on SIGTERM");
    assert!(exit.success(), "{exit:?}");
    let _ = std::fs::remove_dir_all(&dir);
}
