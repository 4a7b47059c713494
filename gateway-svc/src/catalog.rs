//! Which tools a user can use now, and whether each answers: one answer for ListTools (gRPC)
//! and for `tools/list` of the gateway's MCP endpoint.

use std::sync::Arc;

use crate::{
    credentials::Credentials, domain::UserId, registry::RegisteredTool, registry::Registry,
    store::AccountStatus, store::StoreError,
};

pub struct Listed {
    pub tool: Arc<RegisteredTool>,
    /// False: offered, but calls fail at once (an account to reconnect, an MCP server down).
    pub available: bool,
}

/// Built-in tools of the integrations the user connected (and the built-in data, always),
/// then the MCP servers' tools the user has not turned off.
pub async fn tools_for(
    registry: &Registry,
    credentials: &Credentials,
    user: &UserId,
) -> Result<Vec<Listed>, StoreError> {
    let accounts = credentials.list(user).await?;
    let mut listed: Vec<Listed> = registry
        .builtin()
        .filter_map(|t| {
            let integration = t.spec.integration;
            if integration.provider().is_none() {
                return Some((t, true));
            }
            let mine: Vec<_> = accounts
                .iter()
                .filter(|a| a.integration == integration)
                .collect();
            // Not offered: the model cannot use what the user has not connected.
            (!mine.is_empty()).then(|| {
                let connected = mine.iter().any(|a| a.status == AccountStatus::Connected);
                (t, connected)
            })
        })
        .map(|(tool, available)| Listed {
            tool: tool.clone(),
            available,
        })
        .collect();
    if let Some(hub) = registry.mcp() {
        listed.extend(hub.listing(user).await?.into_iter().map(|m| Listed {
            tool: m.tool,
            available: m.available,
        }));
    }
    Ok(listed)
}
