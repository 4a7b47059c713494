//! TLS to PostgreSQL as DATABASE_URL asks for it, with libpq's `sslmode` words (O-5), in the
//! URL form (`?sslmode=…&sslrootcert=…`) or the key=value form: `disable`, `allow` and
//! `prefer` (the default) connect in plaintext — unlike libpq, `prefer` does not try TLS
//! first; `require` encrypts without checking the certificate, or, as in libpq, checks its
//! chain like `verify-ca` when `sslrootcert` names a CA file; `verify-ca` checks the chain
//! against `sslrootcert` (or the public web roots); `verify-full` checks the chain and the
//! host name. tokio-postgres itself knows only disable/prefer/require and no `sslrootcert`,
//! so the connection string is translated here.

use std::sync::Arc;

use futures_util::{Stream, StreamExt};
use rustls::{
    CertificateError, DigitallySignedStruct, SignatureScheme,
    client::{
        WebPkiServerVerifier,
        danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    },
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

/// How much of the server's certificate is checked.
#[derive(Clone, Copy)]
enum Check {
    /// Encrypted, the certificate taken as it comes (libpq's `require` without a CA file).
    EncryptOnly,
    /// Signed by a trusted CA, whatever name it is for (`verify-ca`).
    Chain,
    /// Signed by a trusted CA and for the host connected to (`verify-full`).
    ChainAndName,
}

impl Target {
    pub fn parse(url: &str) -> Result<Self, PgError> {
        // The URL form carries options in its query; the key=value form is space-separated words.
        let url_form = url.contains("://");
        let (base, options): (&str, Vec<&str>) = if url_form {
            let (base, query) = url.split_once('?').unwrap_or((url, ""));
            (base, query.split('&').filter(|p| !p.is_empty()).collect())
        } else {
            ("", url.split_whitespace().collect())
        };
        let mut mode = None;
        let mut root = None;
        let mut kept = Vec::new();
        for pair in options {
            match pair.split_once('=') {
                Some(("sslmode", m)) => mode = Some(m.to_owned()),
                Some(("sslrootcert", path)) if url_form => root = Some(percent_decoded(path)),
                Some(("sslrootcert", path)) => root = Some(path.to_owned()),
                _ => kept.push(pair.to_owned()),
            }
        }
        let check = match mode.as_deref() {
            None | Some("disable" | "prefer" | "allow") => None,
            Some("require") if root.is_some() => Some(Check::Chain),
            Some("require") => Some(Check::EncryptOnly),
            Some("verify-ca") => Some(Check::Chain),
            Some("verify-full") => Some(Check::ChainAndName),
            Some(other) => {
                return Err(PgError::Tls(format!(
                    "sslmode={other} is not a mode; use disable, prefer, require, verify-ca or verify-full"
                )));
            }
        };
        let tls = check
            .map(|check| client_config(root.as_deref(), check))
            .transpose()?;
        if tls.is_some() {
            kept.push("sslmode=require".into());
        } else if let Some(m) = mode.filter(|m| m != "allow") {
            kept.push(format!("sslmode={m}"));
        }
        let url = match (url_form, kept.is_empty()) {
            (true, true) => base.to_owned(),
            (true, false) => format!("{base}?{}", kept.join("&")),
            (false, _) => kept.join(" "),
        };
        Ok(Self {
            config: url.parse().map_err(PgError::BadUrl)?,
            tls: tls.map(MakeRustlsConnect::new),
        })
    }

    /// One connection. The returned stream is the connection's driver: the caller must poll it
    /// (for as long as the client is used), and it yields the notifications and notices.
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

fn client_config(root: Option<&str>, check: Check) -> Result<rustls::ClientConfig, PgError> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| PgError::Tls(e.to_string()))?;
    if let Check::EncryptOnly = check {
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
    if let Check::ChainAndName = check {
        return Ok(builder.with_root_certificates(roots).with_no_client_auth());
    }
    let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .map_err(|e| PgError::Tls(e.to_string()))?;
    Ok(builder
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(ChainOnly(webpki)))
        .with_no_client_auth())
}

/// `%XX` escapes of a URL query value decoded (a CA file path with spaces or `&`).
fn percent_decoded(value: &str) -> String {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (
            bytes[i],
            bytes.get(i + 1).copied().and_then(hex),
            bytes.get(i + 2).copied().and_then(hex),
        ) {
            (b'%', Some(hi), Some(lo)) => {
                out.push((hi * 16 + lo) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// libpq's `verify-ca`: webpki's whole check, except that a certificate for another name is
/// accepted. webpki checks the name only after the chain, so that error means the chain held.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_connection_string_forms_are_translated_and_escapes_decoded() {
        let url = Target::parse("postgres://u@h/db?sslmode=disable&application_name=x").unwrap();
        assert!(url.tls.is_none());
        let words = Target::parse("host=h user=u dbname=db sslmode=prefer").unwrap();
        assert!(words.tls.is_none());
        assert_eq!(words.config.get_dbname(), Some("db"));
        assert_eq!(percent_decoded("/etc/my%20ca%26.pem"), "/etc/my ca&.pem");
        assert_eq!(percent_decoded("100%"), "100%");
        let err = Target::parse("host=h sslmode=verify-maybe")
            .err()
            .expect("refused")
            .to_string();
        assert!(err.contains("sslmode=verify-maybe"), "{err}");
        let missing =
            Target::parse("postgres://u@h/db?sslmode=verify-ca&sslrootcert=/nonexistent.pem")
                .err()
                .expect("refused")
                .to_string();
        assert!(missing.contains("/nonexistent.pem"), "{missing}");
    }
}
