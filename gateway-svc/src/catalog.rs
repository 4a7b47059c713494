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

/// The list's fingerprint (ListToolsResponse.fingerprint): each tool's listing digest (a
/// SHA-256 taken once, at registration), in order, with whether it is available — everything
/// ListTools sends — hashed per call into 32 hex digits. The per-call hash is two seeded
/// foldhash passes, not another SHA-256: that cost a tenth of the gateway's instructions per
/// run, more than encoding the list. Equal on every replica of one build. foldhash resists no
/// chosen collision and its two passes are not independent, so this is not a 128-bit bound;
/// but what it hashes are SHA-256 digests, which nobody can steer, and two different lists
/// share a fingerprint only by chance (about 2^-64 or less).
pub fn fingerprint(listed: &[Listed]) -> String {
    use std::hash::{BuildHasher, Hasher};
    let half = |seed: u64| {
        let mut h = foldhash::fast::FixedState::with_seed(seed).build_hasher();
        for l in listed {
            h.write(&l.tool.listing_digest);
            h.write_u8(u8::from(l.available));
        }
        h.finish()
    };
    format!(
        "{:016x}{:016x}",
        half(0x5374_6577_6172_6431),
        half(0x5374_6577_6172_6432)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::integrations::gmail::{self, GmailApi};

    /// Gmail's tools, registered afresh as another replica would, each available or not.
    fn listed(available: &[bool]) -> Vec<Listed> {
        let api = GmailApi {
            base_url: "http://127.0.0.1:9".into(),
        };
        gmail::tools(api)
            .into_iter()
            .zip(available)
            .map(|(tool, &available)| Listed {
                tool: Arc::new(RegisteredTool::new(tool).unwrap()),
                available,
            })
            .collect()
    }

    #[test]
    fn equal_lists_registered_apart_share_a_fingerprint_and_any_difference_changes_it() {
        let list = listed(&[true, true, true]);
        assert_eq!(fingerprint(&list), fingerprint(&listed(&[true; 3])));
        assert_eq!(fingerprint(&list).len(), 32);
        let one_unavailable = listed(&[true, false, true]);
        assert_ne!(fingerprint(&list), fingerprint(&one_unavailable));
        assert_ne!(fingerprint(&list), fingerprint(&list[..2]));
        let mut reordered = listed(&[true; 3]);
        reordered.swap(0, 1);
        assert_ne!(fingerprint(&list), fingerprint(&reordered));
    }
}
