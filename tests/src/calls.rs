//! One-line gateway calls for tests and benches, acting as a user.

use steward_proto::gateway::v1::{self as pb, tool_call::Arguments};

use crate::UserGateway;

/// Runs `tool` with `args` through ExecuteTool; tool failures come back as results.
pub async fn call_tool(g: &mut UserGateway, tool: &str, args: serde_json::Value) -> pb::ToolResult {
    call_tool_keyed(g, tool, args, "").await
}

/// As [`call_tool`], with an idempotency key (required by side-effect tools).
pub async fn call_tool_keyed(
    g: &mut UserGateway,
    tool: &str,
    args: serde_json::Value,
    key: &str,
) -> pb::ToolResult {
    execute(g, tool, args, key, "").await
}

/// As [`call_tool`], made by a run in the user's zone `time_zone`.
pub async fn call_tool_in_zone(
    g: &mut UserGateway,
    time_zone: &str,
    tool: &str,
    args: serde_json::Value,
) -> pb::ToolResult {
    execute(g, tool, args, "", time_zone).await
}

async fn execute(
    g: &mut UserGateway,
    tool: &str,
    args: serde_json::Value,
    key: &str,
    time_zone: &str,
) -> pb::ToolResult {
    g.execute_tool(pb::ExecuteToolRequest {
        call: Some(pb::ToolCall {
            call_id: "c".into(),
            tool: tool.into(),
            arguments: Some(Arguments::ArgsJson(args.to_string())),
            idempotency_key: key.into(),
            time_zone: time_zone.into(),
            ..Default::default()
        }),
    })
    .await
    .expect("tool failures are results, not RPC errors")
    .into_inner()
    .result
    .expect("a result")
}

/// Connects `account` with an access token valid until 2096, so no refresh happens.
pub async fn connect_account(
    g: &mut UserGateway,
    integration: pb::Integration,
    account: &str,
    token: &str,
) {
    g.connect_account(pb::ConnectAccountRequest {
        integration: integration as i32,
        account: account.into(),
        access_token: token.into(),
        refresh_token: format!("refresh-{token}"),
        expires_at: Some(prost_types::Timestamp {
            seconds: 4_000_000_000,
            nanos: 0,
        }),
        scopes: vec![],
    })
    .await
    .expect("connect the account");
}
