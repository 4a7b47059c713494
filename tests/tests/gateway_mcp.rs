//! MCP both ways (issue 15; G-1..G-9, S3, S4). Against an independent MCP server — the Python
//! SDK's, started by each test as its own process — the gateway lists the server's tools with
//! their schemas, runs every call through its enforcement (validation, the result cap, rate
//! limits, idempotency, errors as sentences, audit) and survives the server dying mid-call. And
//! an MCP client (the Python SDK's) lists and calls the gateway's own tools with a valid token
//! and is refused without one.

use std::time::Duration;

use serde_json::{Value, json};
use steward_proto::{agent::v1 as agent_pb, gateway::v1 as pb};
use steward_tests::{
    Backend, Options, SERVICE_TOKEN, TestApp,
    calls::{call_tool, call_tool_keyed},
    fakes::openai::{Answer, FakeOpenAi},
    mcp_python::{McpDemoServer, run_client, wait_for_log_line},
    spawn,
};

/// A bound on waiting for the gateway to see a change on the MCP server (it connects in the
/// background and probes every MCP_RECONNECT_INTERVAL).
const PATIENCE: Duration = Duration::from_secs(20);

async fn demo_server(token: Option<&str>) -> McpDemoServer {
    let token = token.map(str::to_owned);
    tokio::task::spawn_blocking(move || McpDemoServer::start(token.as_deref()))
        .await
        .unwrap()
}

/// The gateway (and agent) with the demo server configured as "demo", its token passed as a
/// secret header.
async fn app_with(server: &McpDemoServer, backend: Backend, extra: &[(&str, &str)]) -> TestApp {
    let mut env = vec![
        ("MCP_SERVERS".to_owned(), format!("demo={}", server.url)),
        (
            "MCP_SERVER_HEADERS".to_owned(),
            json!({"demo": {"Authorization": "Bearer demo-secret"}}).to_string(),
        ),
        ("MCP_RECONNECT_INTERVAL".to_owned(), "200ms".to_owned()),
        ("MCP_CONNECT_TIMEOUT".to_owned(), "3s".to_owned()),
    ];
    env.extend(
        extra
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned())),
    );
    spawn(Options {
        backend: Some(backend),
        env,
        ..Options::default()
    })
    .await
}

async fn list(app: &TestApp, user: &str) -> Vec<pb::ToolSpec> {
    app.gateway_as(user)
        .await
        .list_tools(pb::ListToolsRequest::default())
        .await
        .unwrap()
        .into_inner()
        .tools
}

/// Polls ListTools until `ready` holds for it (the gateway follows the MCP server in the
/// background), within [`PATIENCE`].
async fn until_listed(
    app: &TestApp,
    user: &str,
    what: &str,
    ready: impl Fn(&[pb::ToolSpec]) -> bool,
) -> Vec<pb::ToolSpec> {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        let tools = list(app, user).await;
        if ready(&tools) {
            return tools;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "ListTools never showed {what}; it shows {:?}",
            tools.iter().map(|t| &t.name).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Starts alice's call of the demo server's `slow` tool (it sleeps `seconds`) under a
/// deadline of `deadline_secs`; the result comes when the call ends.
async fn start_slow_call(
    app: &TestApp,
    seconds: u64,
    deadline_secs: i64,
) -> tokio::task::JoinHandle<pb::ToolResult> {
    let mut caller = app.gateway_as("alice").await;
    tokio::spawn(async move {
        caller
            .execute_tool(pb::ExecuteToolRequest {
                call: Some(pb::ToolCall {
                    call_id: "slow".into(),
                    tool: "mcp__demo__slow".into(),
                    arguments: Some(pb::tool_call::Arguments::ArgsJson(
                        json!({ "seconds": seconds }).to_string(),
                    )),
                    timeout: Some(prost_types::Duration {
                        seconds: deadline_secs,
                        nanos: 0,
                    }),
                    ..Default::default()
                }),
            })
            .await
            .unwrap()
            .into_inner()
            .result
            .unwrap()
    })
}

fn named<'a>(tools: &'a [pb::ToolSpec], name: &str) -> Option<&'a pb::ToolSpec> {
    tools.iter().find(|t| t.name == name)
}

async fn listed_demo(app: &TestApp, user: &str) -> Vec<pb::ToolSpec> {
    until_listed(app, user, "the demo server's tools", |t| {
        named(t, "mcp__demo__lookup").is_some()
    })
    .await
}

#[tokio::test]
async fn g15_an_mcp_servers_tools_are_listed_with_their_schemas_and_annotations_decide_side_effects()
 {
    let server = demo_server(Some("demo-secret")).await;
    let app = app_with(&server, Backend::Memory, &[]).await;
    let tools = listed_demo(&app, "alice").await;

    let lookup = named(&tools, "mcp__demo__lookup").unwrap();
    assert_eq!(lookup.integration, pb::Integration::Mcp as i32);
    assert_eq!(lookup.availability, pb::ToolAvailability::Ok as i32);
    assert_eq!(lookup.aliases, ["mcp.demo.lookup"]);
    assert!(lookup.description.contains("[MCP server demo]"));
    let schema: Value = serde_json::from_str(&lookup.parameters_json_schema).unwrap();
    assert_eq!(schema["required"], json!(["query"]));
    assert_eq!(schema["properties"]["limit"]["maximum"], json!(10));
    assert_eq!(schema["additionalProperties"], json!(false));
    // readOnlyHint: true → no side effect; no annotations at all → a side effect.
    assert!(!lookup.side_effect);
    assert!(named(&tools, "mcp__demo__write_note").unwrap().side_effect);
    assert!(named(&tools, "mcp__demo__add_tool").unwrap().side_effect);
    // The built-in tools are still there beside them.
    assert!(named(&tools, "list_tasks").is_some());

    let mut alice = app.gateway_as("alice").await;
    let found = call_tool(&mut alice, "mcp__demo__lookup", json!({"query": "cats"})).await;
    assert!(found.ok, "{}", found.text);
    assert_eq!(found.text, "found: cats");
    assert_eq!(found.upstream_calls, 1);
    // The dotted alias reaches the same tool.
    let by_alias = call_tool(&mut alice, "mcp.demo.lookup", json!({"query": "dogs"})).await;
    assert_eq!(by_alias.text, "found: dogs");
    // An unannotated tool is a side effect, so it needs an idempotency key like any other.
    let unkeyed = call_tool(&mut alice, "mcp__demo__write_note", json!({"text": "x"})).await;
    assert_eq!(unkeyed.error_kind, pb::ErrorKind::InvalidArguments as i32);
    assert!(unkeyed.text.contains("idempotency_key"), "{}", unkeyed.text);
    let noted = call_tool_keyed(
        &mut alice,
        "mcp__demo__write_note",
        json!({"text": "buy milk"}),
        "note-1",
    )
    .await;
    assert_eq!(noted.text, "noted: buy milk");
    let replayed = call_tool_keyed(
        &mut alice,
        "mcp__demo__write_note",
        json!({"text": "buy milk"}),
        "note-1",
    )
    .await;
    assert!(
        replayed.replayed,
        "a repeated key replays instead of calling again"
    );
    let writes = server
        .calls()
        .iter()
        .filter(|c| c["tool"] == "write_note")
        .count();
    assert_eq!(writes, 1, "the side effect reached the server exactly once");
}

#[tokio::test]
async fn g15_a_40kb_result_comes_back_capped_with_the_notice() {
    let server = demo_server(None).await;
    let app = app_with(&server, Backend::Memory, &[]).await;
    listed_demo(&app, "alice").await;
    let mut alice = app.gateway_as("alice").await;

    let report = call_tool(&mut alice, "mcp__demo__big_report", json!({})).await;
    assert!(report.ok, "{}", report.text);
    assert!(report.truncated);
    assert_eq!(report.original_chars, 40_000);
    assert!(
        report.text.chars().count() < 7_000,
        "capped at MAX_TOOL_RESULT_CHARS"
    );
    assert!(
        report
            .text
            .ends_with("[... truncated: showing first 6000 of 40000 chars]"),
        "{}",
        &report.text[report.text.len() - 80..]
    );
}

#[tokio::test]
async fn g15_invalid_arguments_never_reach_the_server() {
    let server = demo_server(None).await;
    let app = app_with(&server, Backend::Memory, &[]).await;
    listed_demo(&app, "alice").await;
    let mut alice = app.gateway_as("alice").await;

    for bad in [
        json!({"limit": 3}),
        json!({"query": "cats", "limit": 99}),
        json!({"query": 7}),
        json!({"query": "cats", "sneaky": true}),
    ] {
        let refused = call_tool(&mut alice, "mcp__demo__lookup", bad.clone()).await;
        assert_eq!(
            refused.error_kind,
            pb::ErrorKind::InvalidArguments as i32,
            "{bad}: {}",
            refused.text
        );
        assert!(
            refused
                .text
                .contains("Invalid arguments for mcp__demo__lookup")
        );
        assert_eq!(refused.upstream_calls, 0);
    }
    let good = call_tool(&mut alice, "mcp__demo__lookup", json!({"query": "ok"})).await;
    assert!(good.ok, "{}", good.text);
    let calls = server.calls();
    assert_eq!(calls.len(), 1, "only the valid call reached it: {calls:?}");
    assert_eq!(calls[0]["args"], json!({"query": "ok"}));
}

#[tokio::test]
async fn g15_p1_a_remote_tools_own_error_text_is_marked_as_another_partys_words() {
    let server = demo_server(None).await;
    let app = app_with(&server, Backend::Memory, &[]).await;
    listed_demo(&app, "alice").await;
    let mut alice = app.gateway_as("alice").await;

    // The server answers with isError and its own sentence: the gateway passes it on as an
    // upstream error that quotes the server, flagged so the agent fences it as data.
    let refused = call_tool_keyed(
        &mut alice,
        "mcp__demo__add_tool",
        json!({"name": "lookup"}),
        "add-lookup-again",
    )
    .await;
    assert!(!refused.ok);
    assert_eq!(
        refused.error_kind,
        pb::ErrorKind::UpstreamError as i32,
        "{}",
        refused.text
    );
    assert!(
        refused.text.contains("already exists"),
        "the server's words are kept: {}",
        refused.text
    );
    assert!(refused.carries_external_content, "{}", refused.text);

    // A failure Steward itself words carries no one else's text.
    let invalid = call_tool(&mut alice, "mcp__demo__lookup", json!({"limit": 3})).await;
    assert_eq!(invalid.error_kind, pb::ErrorKind::InvalidArguments as i32);
    assert!(!invalid.carries_external_content);
}

#[tokio::test]
async fn g15_a_servers_list_changed_notification_refreshes_listtools() {
    let server = demo_server(None).await;
    // No periodic probe within the test: only the notification can bring the new tool.
    let app = app_with(
        &server,
        Backend::Memory,
        &[("MCP_RECONNECT_INTERVAL", "10m")],
    )
    .await;
    let before = listed_demo(&app, "alice").await;
    assert!(named(&before, "mcp__demo__hello_tool").is_none());

    let mut alice = app.gateway_as("alice").await;
    let added = call_tool_keyed(
        &mut alice,
        "mcp__demo__add_tool",
        json!({"name": "hello_tool"}),
        "add-1",
    )
    .await;
    assert!(added.ok, "{}", added.text);
    let after = until_listed(&app, "alice", "the added tool", |t| {
        named(t, "mcp__demo__hello_tool").is_some()
    })
    .await;
    assert!(!named(&after, "mcp__demo__hello_tool").unwrap().side_effect);
    let hello = call_tool(&mut alice, "mcp__demo__hello_tool", json!({})).await;
    assert_eq!(hello.text, "hello from hello_tool");
}

#[tokio::test]
async fn g15_killing_the_server_mid_call_gives_a_clear_failure_and_an_unavailable_mark() {
    let mut server = demo_server(None).await;
    // No periodic probe within the test: the failed call itself marks the server.
    let app = app_with(
        &server,
        Backend::Memory,
        &[("MCP_RECONNECT_INTERVAL", "10m")],
    )
    .await;
    listed_demo(&app, "alice").await;

    let slow = start_slow_call(&app, 60, 15).await;
    let started = tokio::task::spawn_blocking(move || {
        let seen = server.wait_for_call_line("slow-started", PATIENCE);
        server.kill9();
        (seen, server)
    })
    .await
    .unwrap();
    assert!(started.0, "the slow call reached the server");

    let failed = slow.await.unwrap();
    assert!(!failed.ok);
    assert_eq!(
        failed.error_kind,
        pb::ErrorKind::UpstreamUnavailable as i32,
        "{}",
        failed.text
    );
    assert!(
        failed.text.contains("MCP server \"demo\""),
        "{}",
        failed.text
    );

    let tools = until_listed(&app, "alice", "the demo tools marked unavailable", |t| {
        named(t, "mcp__demo__lookup")
            .is_some_and(|l| l.availability == pb::ToolAvailability::SourceUnavailable as i32)
    })
    .await;
    assert_eq!(
        named(&tools, "list_tasks").unwrap().availability,
        pb::ToolAvailability::Ok as i32
    );
    let mut alice = app.gateway_as("alice").await;
    let now = call_tool(&mut alice, "mcp__demo__lookup", json!({"query": "x"})).await;
    assert_eq!(now.error_kind, pb::ErrorKind::UpstreamUnavailable as i32);
    assert!(now.text.contains("unavailable"), "{}", now.text);
    // Nothing else stalls: a built-in tool answers at once.
    let tasks = call_tool(&mut alice, "list_tasks", json!({})).await;
    assert!(tasks.ok, "{}", tasks.text);
    drop(started.1);
}

#[tokio::test]
async fn g15_a_slow_server_costs_only_its_own_calls_deadline_and_stays_available() {
    let server = demo_server(None).await;
    let app = app_with(&server, Backend::Memory, &[]).await;
    listed_demo(&app, "alice").await;

    let slow = start_slow_call(&app, 30, 2).await;
    let log = server.calls_log.clone();
    let seen =
        tokio::task::spawn_blocking(move || wait_for_log_line(&log, "slow-started", PATIENCE))
            .await
            .unwrap();
    assert!(seen, "the slow call reached the server");

    // While it waits, the same server and the built-in tools answer.
    let mut alice = app.gateway_as("alice").await;
    let quick = call_tool(&mut alice, "mcp__demo__lookup", json!({"query": "q"})).await;
    assert!(quick.ok, "{}", quick.text);
    assert!(call_tool(&mut alice, "list_tasks", json!({})).await.ok);
    assert!(!slow.is_finished(), "the slow call is still waiting");

    let timed_out = slow.await.unwrap();
    assert_eq!(timed_out.error_kind, pb::ErrorKind::UpstreamTimeout as i32);
    assert!(
        timed_out.text.contains("MCP server \"demo\""),
        "{}",
        timed_out.text
    );
    // A slow answer is not a dead server: it stays available.
    let after = call_tool(&mut alice, "mcp__demo__lookup", json!({"query": "r"})).await;
    assert!(after.ok, "{}", after.text);
    assert_eq!(
        named(&list(&app, "alice").await, "mcp__demo__lookup")
            .unwrap()
            .availability,
        pb::ToolAvailability::Ok as i32
    );
}

#[tokio::test]
async fn g15_a_disabled_tool_disappears_for_that_user_only_and_is_refused() {
    let server = demo_server(None).await;
    let app = app_with(&server, Backend::Postgres, &[]).await;
    listed_demo(&app, "alice").await;
    let mut alice = app.gateway_as("alice").await;

    let off = alice
        .set_mcp_enabled(pb::SetMcpEnabledRequest {
            server: "demo".into(),
            tool: "lookup".into(),
            enabled: false,
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        off.disabled,
        [pb::McpSwitch {
            server: "demo".into(),
            tool: "lookup".into()
        }]
    );
    let alices = list(&app, "alice").await;
    assert!(named(&alices, "mcp__demo__lookup").is_none());
    assert!(named(&alices, "mcp__demo__big_report").is_some());
    assert!(named(&list(&app, "bob").await, "mcp__demo__lookup").is_some());

    let reached_before = server.calls().len();
    let refused = call_tool(&mut alice, "mcp__demo__lookup", json!({"query": "x"})).await;
    assert_eq!(refused.error_kind, pb::ErrorKind::PermissionDenied as i32);
    assert_eq!(
        server.calls().len(),
        reached_before,
        "the refused call never reached it"
    );
    assert!(
        refused.text.contains("turned lookup off"),
        "{}",
        refused.text
    );
    let mut bob = app.gateway_as("bob").await;
    assert!(
        call_tool(&mut bob, "mcp__demo__lookup", json!({"query": "x"}))
            .await
            .ok
    );

    // The whole server off, then back on.
    let switch = |enabled| pb::SetMcpEnabledRequest {
        server: "demo".into(),
        tool: String::new(),
        enabled,
    };
    alice.set_mcp_enabled(switch(false)).await.unwrap();
    assert!(
        !list(&app, "alice")
            .await
            .iter()
            .any(|t| t.name.starts_with("mcp__demo__"))
    );
    alice.set_mcp_enabled(switch(true)).await.unwrap();
    let mut lookup_on = switch(true);
    lookup_on.tool = "lookup".into();
    let on = alice.set_mcp_enabled(lookup_on).await.unwrap().into_inner();
    assert!(on.disabled.is_empty());
    assert!(named(&list(&app, "alice").await, "mcp__demo__lookup").is_some());

    // Stored, and audited like every call.
    let db = steward_tests::db::connect(app.db.as_ref().unwrap()).await;
    let audited: i64 = db
        .query_one(
            "SELECT count(*) FROM gateway.audit WHERE tool = 'mcp__demo__lookup' \
             AND kind = 'tool_call'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(audited >= 1);

    let unknown = alice
        .set_mcp_enabled(pb::SetMcpEnabledRequest {
            server: "nope".into(),
            tool: String::new(),
            enabled: false,
        })
        .await
        .unwrap_err();
    assert_eq!(unknown.code(), tonic::Code::NotFound);
    assert!(unknown.message().contains("demo"), "{}", unknown.message());
}

#[tokio::test]
async fn g15_mcp_calls_are_rate_limited_per_user_and_server() {
    let server = demo_server(None).await;
    let app = app_with(&server, Backend::Memory, &[("RATE_LIMITS_MCP", "2/hour")]).await;
    listed_demo(&app, "alice").await;
    let mut alice = app.gateway_as("alice").await;
    for _ in 0..2 {
        assert!(
            call_tool(&mut alice, "mcp__demo__lookup", json!({"query": "x"}))
                .await
                .ok
        );
    }
    let limited = call_tool(&mut alice, "mcp__demo__lookup", json!({"query": "x"})).await;
    assert_eq!(limited.error_kind, pb::ErrorKind::RateLimited as i32);
    assert!(limited.text.contains("rate limit"), "{}", limited.text);
    assert!(limited.retry_after_seconds > 0);
    let mut bob = app.gateway_as("bob").await;
    assert!(
        call_tool(&mut bob, "mcp__demo__lookup", json!({"query": "x"}))
            .await
            .ok,
        "another user has their own budget"
    );
    assert_eq!(server.calls().len(), 3);
}

#[tokio::test]
async fn g15_p1_a_tool_without_annotations_requires_approval_under_the_supervised_policy() {
    let server = demo_server(None).await;
    let model = FakeOpenAi::start(vec![
        Answer::tool_calls(&[(
            "call_note",
            "mcp__demo__write_note",
            r#"{"text":"remember the milk"}"#,
        )]),
        Answer::text("Noted."),
    ])
    .await;
    let app = app_with(
        &server,
        Backend::Postgres,
        &[
            ("MODEL_CHAIN", "openai/gpt-4o"),
            ("OPENAI_BASE_URL", &model.url),
        ],
    )
    .await;
    listed_demo(&app, "alice").await;

    let paused = app
        .agent_as("alice")
        .await
        .run(agent_pb::RunRequest {
            input: Some(agent_pb::RunInput {
                prompt: "note: remember the milk".into(),
                ..Default::default()
            }),
        })
        .await
        .unwrap()
        .into_inner()
        .result
        .unwrap();
    assert_eq!(
        paused.status,
        agent_pb::RunState::AwaitingConfirmation as i32
    );
    let approval = paused.approval.unwrap();
    assert_eq!(approval.tool, "mcp__demo__write_note");
    assert!(
        approval.preview.contains("write_note on MCP server demo"),
        "{}",
        approval.preview
    );
    assert!(
        server.calls().is_empty(),
        "nothing reaches the server before approval"
    );
}

#[tokio::test]
async fn g15_an_mcp_client_uses_the_gateways_tools_with_a_token_and_is_refused_without() {
    let app = spawn(Options {
        backend: Some(Backend::Memory),
        env: vec![("MCP_LISTEN_ADDR".into(), "127.0.0.1:0".into())],
        ..Options::default()
    })
    .await;
    let url = format!("http://{}/mcp", app.gateway_mcp_addr.unwrap());
    let client = |headers: Vec<(&'static str, String)>, call: Option<(&'static str, Value)>| {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            let headers: Vec<(&str, &str)> =
                headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
            run_client(&url, &headers, call)
        })
    };
    let bearer = format!("Bearer {SERVICE_TOKEN}");

    let created = client(
        vec![
            ("Authorization", bearer.clone()),
            ("x-steward-user-id", "alice".into()),
        ],
        Some(("add_task", json!({"title": "File the MCP report"}))),
    )
    .await
    .unwrap();
    assert_eq!(created["ok"], json!(true), "{created}");
    let names: Vec<&str> = created["tools"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_str)
        .collect();
    assert!(
        names.contains(&"list_tasks") && names.contains(&"add_task"),
        "{names:?}"
    );
    assert!(
        !names.contains(&"search_gmail"),
        "only what alice connected: {names:?}"
    );
    assert!(created["tool_schemas"]["add_task"]["properties"]["title"].is_object());
    assert_eq!(created["call"]["is_error"], json!(false), "{created}");

    // Another client's call (request ids start over with every client, and the endpoint keeps
    // no sessions) is its own call, not a replay of the first.
    let again = client(
        vec![
            ("Authorization", bearer.clone()),
            ("x-steward-user-id", "alice".into()),
        ],
        Some(("add_task", json!({"title": "File the MCP report"}))),
    )
    .await
    .unwrap();
    assert_eq!(again["call"]["is_error"], json!(false), "{again}");

    // Scoped to the user the caller named: alice has the tasks, bob does not.
    let mut alice = app.gateway_as("alice").await;
    let tasks = call_tool(&mut alice, "list_tasks", json!({})).await;
    assert_eq!(
        tasks.text.matches("File the MCP report").count(),
        2,
        "{}",
        tasks.text
    );
    let mut bob = app.gateway_as("bob").await;
    let bobs = call_tool(&mut bob, "list_tasks", json!({})).await;
    assert!(!bobs.text.contains("File the MCP report"), "{}", bobs.text);

    // Enforcement is the gateway's: bad arguments come back as the gateway's sentence.
    let invalid = client(
        vec![
            ("Authorization", bearer.clone()),
            ("x-steward-user-id", "alice".into()),
        ],
        Some(("add_task", json!({"nope": 1}))),
    )
    .await
    .unwrap();
    assert_eq!(invalid["call"]["is_error"], json!(true), "{invalid}");
    assert!(
        invalid["call"]["text"]
            .as_str()
            .unwrap()
            .contains("Invalid arguments for add_task"),
        "{invalid}"
    );

    for headers in [
        vec![("x-steward-user-id", "alice".to_owned())],
        vec![
            ("Authorization", "Bearer wrong-token-0123456789".to_owned()),
            ("x-steward-user-id", "alice".to_owned()),
        ],
    ] {
        let refused = client(headers, None).await.unwrap();
        assert_eq!(refused["ok"], json!(false), "{refused}");
        assert_eq!(refused["http_status"], json!(401), "{refused}");
    }
}
