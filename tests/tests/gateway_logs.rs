//! G-9: secrets, tokens and message bodies never appear in logs. This binary installs a global
//! subscriber that records every event of every crate at TRACE, then drives the paths that
//! touch secrets: connecting an account, refreshing its token, and reading a body upstream.

use std::{
    io::Write,
    sync::{Arc, Mutex},
};

use steward_proto::gateway::v1::{self as pb, tool_call::Arguments};
use steward_tests::{
    Backend, Options,
    fakes::{oauth::FakeOAuth, probe::FakeProbe},
    probe_tools,
    spawn::spawn,
};

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log buffer").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[tokio::test]
async fn tokens_and_bodies_never_reach_the_logs_even_at_trace() {
    let captured = Captured::default();
    let writer = captured.clone();
    tracing_subscriber::fmt()
        .json()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .init();

    let probe = FakeProbe::start().await;
    let oauth = FakeOAuth::start().await;
    let app = spawn(Options {
        backend: Some(Backend::Memory),
        env: vec![
            ("GOOGLE_CLIENT_ID".into(), "client-id".into()),
            ("GOOGLE_CLIENT_SECRET".into(), "CLIENT-SECRET-5e1f".into()),
            ("GOOGLE_OAUTH_TOKEN_URL".into(), oauth.url.clone()),
        ],
        gateway_tools: probe_tools::all(&probe.url),
    })
    .await;
    let mut g = app.gateway_as("u1").await;
    g.connect_account(pb::ConnectAccountRequest {
        integration: pb::Integration::Gmail as i32,
        account: "me@example.com".into(),
        access_token: "ACCESS-SECRET-7c2a".into(),
        refresh_token: "REFRESH-SECRET-91bd".into(),
        expires_at: Some(prost_types::Timestamp {
            seconds: 1,
            nanos: 0,
        }), // long expired
        scopes: vec![],
    })
    .await
    .unwrap();
    let result = g
        .execute_tool(pb::ExecuteToolRequest {
            call: Some(pb::ToolCall {
                call_id: "c1".into(),
                tool: "probe_fetch".into(),
                arguments: Some(Arguments::ArgsJson(
                    r#"{"path":"/data?size=3&unit=BODY-SECRET-"}"#.into(),
                )),
                ..Default::default()
            }),
        })
        .await
        .unwrap()
        .into_inner()
        .result
        .unwrap();
    assert!(result.ok, "{}", result.text);
    assert_eq!(oauth.refreshes(), 1, "the refresh path ran");
    assert!(
        result.text.contains("BODY-SECRET-"),
        "the model does get the body"
    );

    let logs = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(logs.contains("tool call"), "the capture works");
    for secret in [
        "ACCESS-SECRET-7c2a",
        "REFRESH-SECRET-91bd",
        "fresh-access-1",
        "CLIENT-SECRET-5e1f",
        "BODY-SECRET-",
        "test-service-token",
    ] {
        assert!(!logs.contains(secret), "{secret} leaked into the logs");
    }
}
