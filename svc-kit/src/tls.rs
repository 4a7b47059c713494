//! TLS material from the environment (O-5): PEM files named by variables, read at start so a
//! missing or unreadable file stops the service naming the variable. Private keys never print.

use crate::config::Vars;

/// A certificate chain and its private key, PEM.
#[derive(Clone)]
pub struct KeyPair {
    pub cert: Vec<u8>,
    pub key: Vec<u8>,
}

impl std::fmt::Debug for KeyPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyPair")
            .field("cert_bytes", &self.cert.len())
            .field("key", &"[redacted]")
            .finish()
    }
}

/// The server side: its own key pair and, for mTLS, the CA that signs acceptable client
/// certificates (a client without one is refused at the handshake).
#[derive(Debug, Clone)]
pub struct ServerTls {
    pub identity: KeyPair,
    pub client_ca: Option<Vec<u8>>,
}

/// Reads a PEM file named by `var`; `None` when the variable is unset.
pub fn pem_file(vars: &mut Vars<'_>, var: &str) -> Option<Vec<u8>> {
    let path = vars.optional_string(var)?;
    match std::fs::read(&path) {
        Ok(bytes) if String::from_utf8_lossy(&bytes).contains("-----BEGIN ") => Some(bytes),
        Ok(_) => {
            vars.error(var, format!("{path:?} is not a PEM file"));
            None
        }
        Err(e) => {
            vars.error(var, format!("cannot read {path:?}: {e}"));
            None
        }
    }
}

/// `<cert_var>` and `<key_var>` together, or neither.
pub fn key_pair(vars: &mut Vars<'_>, cert_var: &str, key_var: &str) -> Option<KeyPair> {
    match (pem_file(vars, cert_var), pem_file(vars, key_var)) {
        (Some(cert), Some(key)) => Some(KeyPair { cert, key }),
        (None, None) => None,
        _ => {
            if vars.raw(cert_var).is_some() != vars.raw(key_var).is_some() {
                vars.error(
                    cert_var,
                    format!("{cert_var} and {key_var} must be set together"),
                );
            }
            None
        }
    }
}

/// `GRPC_TLS_CERT` + `GRPC_TLS_KEY` (TLS on the server), `GRPC_TLS_CLIENT_CA` (mTLS).
pub fn load_server(vars: &mut Vars<'_>) -> Option<ServerTls> {
    let identity = key_pair(vars, "GRPC_TLS_CERT", "GRPC_TLS_KEY");
    let client_ca = pem_file(vars, "GRPC_TLS_CLIENT_CA");
    match identity {
        Some(identity) => Some(ServerTls {
            identity,
            client_ca,
        }),
        None => {
            if client_ca.is_some() {
                vars.error(
                    "GRPC_TLS_CLIENT_CA",
                    "needs GRPC_TLS_CERT and GRPC_TLS_KEY: client certificates are checked only on a TLS server",
                );
            }
            None
        }
    }
}

impl ServerTls {
    pub fn tonic_config(&self) -> tonic::transport::ServerTlsConfig {
        let mut config = tonic::transport::ServerTlsConfig::new().identity(
            tonic::transport::Identity::from_pem(&self.identity.cert, &self.identity.key),
        );
        if let Some(ca) = &self.client_ca {
            config = config.client_ca_root(tonic::transport::Certificate::from_pem(ca));
        }
        config
    }
}

/// The client side of a TLS channel: whom to trust (a private CA, else the public web roots),
/// an optional client key pair for mTLS, and an optional name to verify instead of the URL's
/// host.
#[derive(Debug, Clone, Default)]
pub struct ClientTls {
    pub ca: Option<Vec<u8>>,
    pub identity: Option<KeyPair>,
    pub domain: Option<String>,
}

impl ClientTls {
    /// `<prefix>_TLS_CA`, `<prefix>_TLS_CERT` + `<prefix>_TLS_KEY`, `<prefix>_TLS_DOMAIN`.
    pub fn load(vars: &mut Vars<'_>, prefix: &str) -> Self {
        Self {
            ca: pem_file(vars, &format!("{prefix}_TLS_CA")),
            identity: key_pair(
                vars,
                &format!("{prefix}_TLS_CERT"),
                &format!("{prefix}_TLS_KEY"),
            ),
            domain: vars.optional_string(&format!("{prefix}_TLS_DOMAIN")),
        }
    }

    /// Whether any of it was configured.
    pub fn is_set(&self) -> bool {
        self.ca.is_some() || self.identity.is_some() || self.domain.is_some()
    }

    pub fn tonic_config(&self) -> tonic::transport::ClientTlsConfig {
        let mut config = tonic::transport::ClientTlsConfig::new();
        config = match &self.ca {
            Some(ca) => config.ca_certificate(tonic::transport::Certificate::from_pem(ca)),
            None => config.with_webpki_roots(),
        };
        if let Some(id) = &self.identity {
            config = config.identity(tonic::transport::Identity::from_pem(&id.cert, &id.key));
        }
        if let Some(domain) = &self.domain {
            config = config.domain_name(domain.clone());
        }
        config
    }
}
