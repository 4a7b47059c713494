//! gateway-svc configuration, loaded once from the environment and validated at start.

use std::net::SocketAddr;

use svc_kit::{
    config::{ConfigErrors, Vars},
    server_config::ServerConfig,
};

pub const DEFAULT_LISTEN: &str = "0.0.0.0:50052";

#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
}

impl Config {
    pub fn from_env() -> Result<Self, ConfigErrors> {
        Self::load(Vars::from_env())
    }

    pub fn load(mut vars: Vars<'_>) -> Result<Self, ConfigErrors> {
        let default_listen: SocketAddr = DEFAULT_LISTEN.parse().expect("constant address");
        let server = ServerConfig::load(&mut vars, "GATEWAY", default_listen);
        vars.finish(Self { server })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    #[test]
    fn an_empty_environment_listens_on_50052_with_the_in_memory_store() {
        let cfg = Config::load(Vars::from_map(&HashMap::new())).unwrap();
        assert_eq!(cfg.server.listen_addr.to_string(), DEFAULT_LISTEN);
        assert!(cfg.server.database.is_none());
    }

    #[test]
    fn a_message_limit_out_of_range_is_refused_by_name() {
        let map = HashMap::from([("GRPC_MAX_MESSAGE_BYTES".to_owned(), "1GiB".to_owned())]);
        let err = Config::load(Vars::from_map(&map)).unwrap_err();
        assert_eq!(err.0[0].var, "GRPC_MAX_MESSAGE_BYTES");
    }
}
