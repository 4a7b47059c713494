//! Gmail over its REST API (I-1..I-3). So far: the unread count of an account's inbox
//! (`users.labels.get INBOX`, 1 quota unit, no message content), used by the bootstrap context.

use serde::Deserialize;

use crate::{context::CallContext, domain::Integration, enforce::ToolError};

pub const DEFAULT_BASE_URL: &str = "https://gmail.googleapis.com";

#[derive(Debug, Clone)]
pub struct GmailApi {
    /// `GMAIL_API_BASE_URL`, so tests and the local stack can point at a fake.
    pub base_url: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct Label {
    messages_unread: Option<u32>,
}

impl GmailApi {
    /// Unread messages in `account`'s inbox. Charged to the rate limiter as one call.
    pub async fn unread_inbox(&self, ctx: &CallContext, account: &str) -> Result<u32, ToolError> {
        ctx.charge(Integration::Gmail, account, 1).await?;
        let url = format!(
            "{}/gmail/v1/users/me/labels/INBOX",
            self.base_url.trim_end_matches('/')
        );
        let response = ctx
            .send(Integration::Gmail, account, |token| {
                ctx.http().get(&url).bearer_auth(token)
            })
            .await?;
        if response.status == reqwest::StatusCode::NOT_FOUND {
            return Err(ToolError::NotFound(format!(
                "Gmail has no INBOX label for {account}."
            )));
        }
        let label: Label = response.json("Gmail")?;
        Ok(label.messages_unread.unwrap_or(0))
    }
}
