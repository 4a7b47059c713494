//! Tools that exist only in tests, registered beside the real ones, to drive the gateway's
//! enforcement path (validation, limits, credentials, caps, idempotency, cancellation) against
//! the fake probe upstream. They use the same `CallContext` every real integration uses.

use std::sync::Arc;

use gateway_svc::{
    context::CallContext,
    domain::Integration,
    enforce::ToolError,
    registry::{Tool, ToolOutput, ToolSpec},
};
use serde_json::{Value, json};

/// `probe_fetch {path}`: GET `{base}{path}` as the user's first Gmail account, charged 1 call.
pub struct ProbeFetch {
    pub base: String,
}

/// `probe_send {to, slow?}`: POST `{base}/send` as the user's first Gmail account; a side
/// effect. With `slow`, the upstream counts the send and then never answers.
pub struct ProbeSend {
    pub base: String,
}

/// `probe_charge {account}`: charges one Gmail call for `account` (which must be connected,
/// as every charge needs usable credentials) and makes none.
pub struct ProbeCharge;

/// `probe_echo {text}`: no upstream at all; returns its text.
pub struct ProbeEcho;

pub fn all(base: &str) -> Vec<Arc<dyn Tool>> {
    vec![
        Arc::new(ProbeFetch {
            base: base.to_owned(),
        }),
        Arc::new(ProbeSend {
            base: base.to_owned(),
        }),
        Arc::new(ProbeCharge),
        Arc::new(ProbeEcho),
    ]
}

fn spec(
    name: &str,
    schema: Value,
    side_effect: bool,
    integration: Integration,
    cost: u32,
) -> ToolSpec {
    ToolSpec {
        name: name.into(),
        aliases: vec![],
        description: format!("test probe {name}"),
        schema,
        side_effect,
        integration,
        upstream_cost: cost,
        reads_external_content: false,
        writes_memory: false,
    }
}

async fn first_account(ctx: &CallContext) -> Result<String, ToolError> {
    Ok(ctx
        .accounts(Integration::Gmail)
        .await?
        .usable
        .remove(0)
        .account)
}

#[async_trait::async_trait]
impl Tool for ProbeFetch {
    fn spec(&self) -> ToolSpec {
        spec(
            "probe_fetch",
            json!({"type": "object", "properties": {"path": {"type": "string", "pattern": "^/"}},
                   "required": ["path"], "additionalProperties": false}),
            false,
            Integration::Gmail,
            1,
        )
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let account = first_account(ctx).await?;
        ctx.charge(Integration::Gmail, &account, 1).await?;
        let url = format!("{}{}", self.base, args["path"].as_str().unwrap_or("/"));
        let response = ctx
            .send(Integration::Gmail, &account, |token| {
                ctx.http().get(&url).bearer_auth(token)
            })
            .await?;
        Ok(ToolOutput::text(String::from_utf8_lossy(&response.body)))
    }
}

#[async_trait::async_trait]
impl Tool for ProbeSend {
    fn spec(&self) -> ToolSpec {
        spec(
            "probe_send",
            json!({"type": "object", "properties": {"to": {"type": "string"}, "slow": {"type": "boolean"}}, "required": ["to"]}),
            true,
            Integration::Gmail,
            1,
        )
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        let account = first_account(ctx).await?;
        ctx.charge(Integration::Gmail, &account, 1).await?;
        let slow = if args["slow"].as_bool() == Some(true) {
            "?slow=true"
        } else {
            ""
        };
        let url = format!("{}/send{slow}", self.base);
        let response = ctx
            .send(Integration::Gmail, &account, |token| {
                ctx.http().post(&url).bearer_auth(token)
            })
            .await?;
        Ok(ToolOutput::text(String::from_utf8_lossy(&response.body)))
    }
}

#[async_trait::async_trait]
impl Tool for ProbeCharge {
    fn spec(&self) -> ToolSpec {
        spec(
            "probe_charge",
            json!({"type": "object", "properties": {"account": {"type": "string"}}, "required": ["account"]}),
            false,
            Integration::Gmail,
            1,
        )
    }

    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        ctx.charge(
            Integration::Gmail,
            args["account"].as_str().unwrap_or_default(),
            1,
        )
        .await?;
        Ok(ToolOutput::text("charged"))
    }
}

#[async_trait::async_trait]
impl Tool for ProbeEcho {
    fn spec(&self) -> ToolSpec {
        spec(
            "probe_echo",
            json!({"type": "object", "properties": {"text": {"type": "string"}}}),
            false,
            Integration::Tasks,
            0,
        )
    }

    /// It only reads, so its audit goes through the batching writer, as a search's does.
    fn read_only(&self) -> bool {
        true
    }

    async fn call(&self, _ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError> {
        Ok(ToolOutput::text(args["text"].as_str().unwrap_or("echo")))
    }
}
