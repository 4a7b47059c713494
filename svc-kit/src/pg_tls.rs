//! TLS to PostgreSQL as DATABASE_URL asks for it, with libpq's `sslmode` words (O-5):
//! `disable` / `prefer` (the default) connect in plaintext; `require` encrypts (and verifies the
//! server's chain and name when `sslrootcert` names a CA file); `verify-full` encrypts and
//! verifies against `sslrootcert` or the public web roots. tokio-postgres itself knows only
//! disable/prefer/require and no `sslrootcert`, so the URL is translated here.

use std::sync::Arc;

use futures_util::{Stream, StreamExt};
use rustls::{
    DigitallySignedStruct, SignatureScheme,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
};
use rustls_pki_types::{CertificateDer, ServerName, UnixTime, pem::PemObject};
use tokio_postgres::{AsyncMessage, Client, NoTls};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::pg::PgError;

/// A parsed DATABASE_URL: what tokio-postgres connects to, and how.
#[derive(Clone)]
pub struct Target {
    pub config: tokio_postgres::Config,
    pub tls: Option<MakeRustlsConnect>,
}

impl Target {
    pub fn parse(url: &str) -> Result<Self, PgError> {
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let mut mode = None;
        let mut root = None;
        let mut kept = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some(("sslmode", m)) => mode = Some(m.to_owned()),
                Some(("sslrootcert", path)) => root = Some(path.to_owned()),
                _ => kept.push(pair.to_owned()),
            }
        }
        let tls = match mode.as_deref() {
            None | Some("disable" | "prefer" | "allow") => None,
            Some("require") => Some(client_config(root.as_deref(), root.is_some())?),
            Some("verify-full") => Some(client_config(root.as_deref(), true)?),
            Some(other) => {
                return Err(PgError::Tls(format!(
                    "sslmode={other} is not supported; use disable, prefer, require or verify-full"
                )));
            }
        };
        if tls.is_some() {
            kept.push("sslmode=require".into());
        } else if let Some(m) = mode.filter(|m| m != "allow") {
            kept.push(format!("sslmode={m}"));
        }
        let url = if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        Ok(Self {
            config: url.parse().map_err(PgError::BadUrl)?,
            tls: tls.map(MakeRustlsConnect::new),
        })
    }

    /// One connection, its driver spawned; the stream yields its notifications and notices.
    pub async fn connect(
        &self,
    ) -> Result<
        (
            Client,
            std::pin::Pin<
                Box<dyn Stream<Item = Result<AsyncMessage, tokio_postgres::Error>> + Send>,
            >,
        ),
        PgError,
    > {
        match &self.tls {
            None => {
                let (client, mut connection) =
                    self.config.connect(NoTls).await.map_err(PgError::Connect)?;
                let messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
                Ok((client, messages.boxed()))
            }
            Some(tls) => {
                let (client, mut connection) = self
                    .config
                    .connect(tls.clone())
                    .await
                    .map_err(PgError::Connect)?;
                let messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
                Ok((client, messages.boxed()))
            }
        }
    }
}

fn client_config(root: Option<&str>, verify: bool) -> Result<rustls::ClientConfig, PgError> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| PgError::Tls(e.to_string()))?;
    if !verify {
        // libpq's `require` without a root certificate: encrypted, the server not verified.
        return Ok(builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(EncryptOnly(provider)))
            .with_no_client_auth());
    }
    let mut roots = rustls::RootCertStore::empty();
    match root {
        Some(path) => {
            for cert in CertificateDer::pem_file_iter(path)
                .map_err(|e| PgError::Tls(format!("sslrootcert {path:?}: {e}")))?
            {
                let cert = cert.map_err(|e| PgError::Tls(format!("sslrootcert {path:?}: {e}")))?;
                roots
                    .add(cert)
                    .map_err(|e| PgError::Tls(format!("sslrootcert {path:?}: {e}")))?;
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    Ok(builder.with_root_certificates(roots).with_no_client_auth())
}

/// Accepts any server certificate but still checks the handshake signatures.
#[derive(Debug)]
struct EncryptOnly(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for EncryptOnly {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}
