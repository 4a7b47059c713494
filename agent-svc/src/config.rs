//! agent-svc configuration, loaded once from the environment and validated at start.

use std::net::SocketAddr;

use svc_kit::{
    config::{ConfigErrors, Vars},
    server_config::ServerConfig,
};

pub const DEFAULT_LISTEN: &str = "0.0.0.0:50051";
pub const DEFAULT_GATEWAY_URL: &str = "http://127.0.0.1:50052";

#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    /// `GATEWAY_URL`: where gateway-svc listens.
    pub gateway_url: String,
}

impl Config {
    pub fn from_env() -> Result<Self, ConfigErrors> {
        Self::load(Vars::from_env())
    }

    pub fn load(mut vars: Vars<'_>) -> Result<Self, ConfigErrors> {
        let default_listen: SocketAddr = DEFAULT_LISTEN.parse().expect("constant address");
        let server = ServerConfig::load(&mut vars, "AGENT", default_listen);
        let gateway_url = vars.string("GATEWAY_URL", DEFAULT_GATEWAY_URL);
        if !(gateway_url.starts_with("http://") || gateway_url.starts_with("https://"))
            || gateway_url.parse::<tonic::transport::Uri>().is_err()
        {
            vars.error(
                "GATEWAY_URL",
                format!("{gateway_url:?} is not an http(s) URL; use e.g. {DEFAULT_GATEWAY_URL}"),
            );
        }
        vars.finish(Self {
            server,
            gateway_url,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn load(pairs: &[(&str, &str)]) -> Result<Config, ConfigErrors> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        Config::load(Vars::from_map(&map))
    }

    #[test]
    fn an_empty_environment_gives_a_working_local_default() {
        let cfg = load(&[]).unwrap();
        assert_eq!(cfg.server.listen_addr.to_string(), DEFAULT_LISTEN);
        assert!(cfg.server.database.is_none());
        assert_eq!(cfg.gateway_url, DEFAULT_GATEWAY_URL);
    }

    #[test]
    fn a_bad_listen_address_and_gateway_url_are_both_named() {
        let err = load(&[
            ("AGENT_LISTEN_ADDR", "localhost"),
            ("GATEWAY_URL", "gateway:50052"),
        ])
        .unwrap_err();
        let vars: Vec<_> = err.0.iter().map(|e| e.var.as_str()).collect();
        assert_eq!(vars, ["AGENT_LISTEN_ADDR", "GATEWAY_URL"]);
    }
}
