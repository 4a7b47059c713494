//! Model Context Protocol (issue 15), both ways:
//! - [`source`]: configured MCP servers are tool sources beside the built-in integrations. Their
//!   tools join the registry as `mcp__<server>__<tool>` and go through the engine like every
//!   other tool: schema validation, rate limits (per user and server), the result cap, errors
//!   as sentences, idempotency for side effects, audit.
//! - [`expose`]: the gateway's own tools, served to MCP clients over streamable HTTP behind the
//!   same authentication and per-user scoping as the gRPC API.
//!
//! Names: model providers accept only letters, digits, `_` and `-` in tool names (OpenAI and
//! Anthropic refuse dots), so the canonical name is `mcp__<server>__<tool>`; the dotted
//! `mcp.<server>.<tool>` is an alias for people and grpcurl.

pub mod expose;
pub mod source;

use std::{collections::HashMap, sync::Arc};

use tokio_util::sync::CancellationToken;

pub use source::McpServer;

use crate::{
    config::McpConfig,
    domain::{McpSwitch, UserId},
    registry::RegisteredTool,
    store::{McpSwitchStore, StoreError},
};

const PREFIX: &str = "mcp__";
const ALIAS_PREFIX: &str = "mcp.";
/// The longest tool name OpenAI accepts.
pub const MAX_TOOL_NAME: usize = 64;

/// Whether `name` is in the MCP namespace (built-in tools may not use it).
pub fn is_mcp_name(name: &str) -> bool {
    name.starts_with(PREFIX) || name.starts_with(ALIAS_PREFIX)
}

/// The canonical name of `tool` of `server`: characters providers refuse become `_`, and a
/// name that would pass 64 characters is cut and given a short digest of the full name, so
/// two long names stay apart.
pub fn canonical_name(server: &str, tool: &str) -> String {
    let safe: String = tool
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    let name = format!("{PREFIX}{server}__{safe}");
    if name.len() <= MAX_TOOL_NAME {
        return name;
    }
    let digest = crate::registry::digest(&[server, tool]);
    let keep = MAX_TOOL_NAME - 9;
    format!("{}_{}", &name[..keep], &digest[..8])
}

/// The dotted alias, `mcp.<server>.<tool>`, with the tool named as its server names it.
pub fn alias_name(server: &str, tool: &str) -> String {
    format!("{ALIAS_PREFIX}{server}.{tool}")
}

/// Which server a namespaced name belongs to.
fn server_of(name: &str) -> Option<&str> {
    if let Some(rest) = name.strip_prefix(PREFIX) {
        return rest.split_once("__").map(|(server, _)| server);
    }
    name.strip_prefix(ALIAS_PREFIX)?
        .split_once('.')
        .map(|(server, _)| server)
}

/// One MCP tool as ListTools shows it to a user.
pub struct ListedMcpTool {
    pub tool: Arc<RegisteredTool>,
    /// Its server answers now; otherwise calls fail at once with "unavailable".
    pub available: bool,
}

/// Every configured MCP server, each kept connected by its own task.
pub struct McpHub {
    servers: HashMap<String, Arc<McpServer>>,
    /// Configuration order, for a stable listing.
    order: Vec<String>,
    switches: Arc<dyn McpSwitchStore>,
    stop: CancellationToken,
}

impl McpHub {
    /// Starts connecting to every server in the background: the gateway serves at once, and a
    /// server that is down only shows as unavailable.
    pub fn start(
        config: &McpConfig,
        switches: Arc<dyn McpSwitchStore>,
    ) -> Result<Arc<Self>, String> {
        let stop = CancellationToken::new();
        let mut servers = HashMap::new();
        let mut order = Vec::new();
        for server in &config.servers {
            let started =
                McpServer::start(server.clone(), config, switches.clone(), stop.child_token())?;
            order.push(server.name.clone());
            servers.insert(server.name.clone(), started);
        }
        Ok(Arc::new(Self {
            servers,
            order,
            switches,
            stop,
        }))
    }

    pub fn is_empty(&self) -> bool {
        self.servers.is_empty()
    }

    /// The tool by its namespaced name or alias, while its server lists it (also while the
    /// server is unavailable, so a call says so instead of "no such tool").
    pub fn get(&self, name: &str) -> Option<Arc<RegisteredTool>> {
        self.servers.get(server_of(name)?)?.get(name)
    }

    pub fn server(&self, name: &str) -> Option<&Arc<McpServer>> {
        self.servers.get(name)
    }

    /// The tools `user` has not turned off, server by server in configuration order.
    pub async fn listing(&self, user: &UserId) -> Result<Vec<ListedMcpTool>, StoreError> {
        if self.servers.is_empty() {
            return Ok(Vec::new());
        }
        let off = self.switches.disabled_mcp(user).await?;
        let mut out = Vec::new();
        for name in &self.order {
            let server = &self.servers[name];
            let available = server.is_available();
            for (remote, tool) in server.tools() {
                if off.iter().any(|s| s.covers(name, &remote)) {
                    continue;
                }
                out.push(ListedMcpTool { tool, available });
            }
        }
        Ok(out)
    }

    /// Turns a server or one of its tools off or on for `user`; returns what is off after.
    pub async fn set_enabled(
        &self,
        user: &UserId,
        switch: &McpSwitch,
        enabled: bool,
    ) -> Result<Vec<McpSwitch>, SwitchError> {
        if !self.servers.contains_key(&switch.server) {
            let known = if self.order.is_empty() {
                "no MCP server is configured".to_owned()
            } else {
                format!("the configured servers are {}", self.order.join(", "))
            };
            return Err(SwitchError::UnknownServer(format!(
                "there is no MCP server named {:?}; {known}",
                switch.server
            )));
        }
        if let Some(tool) = &switch.tool
            && (tool.is_empty() || tool.len() > 128)
        {
            return Err(SwitchError::Invalid(
                "tool must be 1 to 128 characters, or empty for the whole server".into(),
            ));
        }
        self.switches
            .set_mcp_enabled(user, switch, enabled)
            .await
            .map_err(SwitchError::Store)?;
        self.switches
            .disabled_mcp(user)
            .await
            .map_err(SwitchError::Store)
    }

    /// Disconnects from every server.
    pub fn stop(&self) {
        self.stop.cancel();
    }
}

impl Drop for McpHub {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SwitchError {
    #[error("{0}")]
    UnknownServer(String),
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Store(StoreError),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_what_every_provider_accepts() {
        assert_eq!(canonical_name("docs", "search"), "mcp__docs__search");
        assert_eq!(
            canonical_name("docs", "files.read/v2"),
            "mcp__docs__files_read_v2"
        );
        let long = canonical_name("docs", &"x".repeat(100));
        assert_eq!(long.len(), MAX_TOOL_NAME);
        assert_ne!(long, canonical_name("docs", &"x".repeat(101)));
        assert!(
            long.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        );
    }

    #[test]
    fn a_name_tells_its_server() {
        assert_eq!(server_of("mcp__docs__search"), Some("docs"));
        assert_eq!(server_of("mcp.docs.files.read"), Some("docs"));
        assert_eq!(server_of("search_gmail"), None);
        assert!(is_mcp_name("mcp.docs.x") && !is_mcp_name("mcpx"));
    }

    #[test]
    fn a_server_switch_covers_all_its_tools_and_a_tool_switch_one() {
        let server = McpSwitch {
            server: "docs".into(),
            tool: None,
        };
        let tool = McpSwitch {
            server: "docs".into(),
            tool: Some("search".into()),
        };
        assert!(server.covers("docs", "anything"));
        assert!(tool.covers("docs", "search") && !tool.covers("docs", "other"));
        assert!(!tool.covers("wiki", "search"));
    }
}
