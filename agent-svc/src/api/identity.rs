//! Who is calling: a bearer JWT in metadata, verified with the configured HS256 secret,
//! RS256 public key or the keys of a JWKS URL (exp and nbf always, aud required unless
//! explicitly waived, iss when configured); its `sub` is the user.
//! A clearly named, opt-in dev mode takes `x-user-id` instead and is logged loudly at start.
//! Never from the request body.

use std::sync::Arc;

use jsonwebtoken::{Algorithm, DecodingKey, Validation, decode, decode_header};
use serde::Deserialize;
use tonic::metadata::MetadataMap;

use super::{ApiError, jwks::Jwks};

pub const DEV_USER_HEADER: &str = "x-user-id";
/// User ids are at most this long (what the gateway accepts too).
const MAX_USER_ID: usize = 128;

#[derive(Clone)]
pub enum Identity {
    Jwt {
        key: DecodingKey,
        validation: Box<Validation>,
    },
    /// AUTH_JWKS_URL: the key (and its algorithm) named by the token's `kid`; `validation`
    /// carries issuer, audience and required claims.
    Jwks {
        keys: Arc<Jwks>,
        validation: Box<Validation>,
    },
    /// AUTH_DEV_USER_HEADER=true: trusts `x-user-id`. Local runs only.
    DevHeader,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Identity::Jwt { validation, .. } => write!(f, "Jwt({:?})", validation.algorithms),
            Identity::Jwks { keys, .. } => write!(f, "{keys:?}"),
            Identity::DevHeader => f.write_str("DevHeader"),
        }
    }
}

#[derive(Deserialize)]
struct Claims {
    sub: String,
}

impl Identity {
    pub fn hs256(secret: &[u8], issuer: Option<&str>, audience: Option<&str>) -> Self {
        Self::jwt(
            DecodingKey::from_secret(secret),
            Algorithm::HS256,
            issuer,
            audience,
        )
    }

    pub fn rs256(
        public_pem: &[u8],
        issuer: Option<&str>,
        audience: Option<&str>,
    ) -> Result<Self, String> {
        let key = DecodingKey::from_rsa_pem(public_pem)
            .map_err(|e| format!("not an RSA public key in PEM form ({e})"))?;
        Ok(Self::jwt(key, Algorithm::RS256, issuer, audience))
    }

    pub fn jwks(url: &str, issuer: Option<&str>, audience: Option<&str>) -> Self {
        Identity::Jwks {
            keys: Arc::new(Jwks::new(url)),
            validation: Box::new(validation(Algorithm::RS256, issuer, audience)),
        }
    }

    fn jwt(
        key: DecodingKey,
        algorithm: Algorithm,
        issuer: Option<&str>,
        audience: Option<&str>,
    ) -> Self {
        Identity::Jwt {
            key,
            validation: Box::new(validation(algorithm, issuer, audience)),
        }
    }
}

/// exp and nbf always (30 s leeway); aud required and checked when configured; iss when set.
fn validation(algorithm: Algorithm, issuer: Option<&str>, audience: Option<&str>) -> Validation {
    let mut validation = Validation::new(algorithm);
    validation.validate_nbf = true;
    validation.leeway = 30;
    if let Some(iss) = issuer {
        validation.set_issuer(&[iss]);
    }
    match audience {
        Some(aud) => {
            // A token without `aud` must not pass for one with ours.
            validation.set_required_spec_claims(&["exp", "sub", "aud"]);
            validation.set_audience(&[aud]);
        }
        None => {
            validation.set_required_spec_claims(&["exp", "sub"]);
            validation.validate_aud = false;
        }
    }
    validation
}

impl Identity {
    /// The caller's user id, or UNAUTHENTICATED saying what is missing or wrong.
    pub async fn user(&self, metadata: &MetadataMap) -> Result<String, ApiError> {
        let user = match self {
            Identity::DevHeader => metadata
                .get(DEV_USER_HEADER)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
                .ok_or_else(|| {
                    ApiError::Unauthenticated(
                        "missing x-user-id metadata (dev identity mode)".into(),
                    )
                })?,
            Identity::Jwt { key, validation } => subject(bearer(metadata)?, key, validation)?,
            Identity::Jwks { keys, validation } => {
                let token = bearer(metadata)?;
                let header = decode_header(token).map_err(|e| invalid(&e.to_string()))?;
                let kid = header
                    .kid
                    .ok_or_else(|| invalid("it names no key id (kid), which a JWKS needs"))?;
                let (key, algorithm) = keys.key(&kid).await.map_err(|e| match e {
                    super::jwks::KeyError::Unknown(why) => invalid(&why),
                    super::jwks::KeyError::Unavailable => ApiError::Unavailable(
                        "the signing keys that verify tokens are unavailable right now; try again shortly"
                            .into(),
                    ),
                })?;
                let mut validation = (**validation).clone();
                validation.algorithms = vec![algorithm];
                subject(token, &key, &validation)?
            }
        };
        if user.is_empty()
            || user.len() > MAX_USER_ID
            || !user.bytes().all(|b| b.is_ascii_graphic())
        {
            return Err(ApiError::Unauthenticated(
                "the user id must be 1 to 128 visible ASCII characters".into(),
            ));
        }
        Ok(user)
    }
}

fn bearer(metadata: &MetadataMap) -> Result<&str, ApiError> {
    metadata
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(svc_kit::grpc::bearer_token)
        .ok_or_else(|| {
            ApiError::Unauthenticated("missing `authorization: Bearer <JWT>` metadata".into())
        })
}

fn invalid(why: &str) -> ApiError {
    ApiError::Unauthenticated(format!("the bearer token is not valid: {why}"))
}

fn subject(token: &str, key: &DecodingKey, validation: &Validation) -> Result<String, ApiError> {
    decode::<Claims>(token, key, validation)
        .map(|data| data.claims.sub)
        .map_err(|e| invalid(&e.to_string()))
}

#[cfg(test)]
mod tests {
    use jsonwebtoken::{EncodingKey, Header, encode};

    use super::*;

    fn md(token: &str) -> MetadataMap {
        let mut m = MetadataMap::new();
        m.insert("authorization", format!("Bearer {token}").parse().unwrap());
        m
    }

    fn now() -> i64 {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64
    }

    fn hs(claims: serde_json::Value) -> String {
        encode(
            &Header::new(Algorithm::HS256),
            &claims,
            &EncodingKey::from_secret(b"s3cret"),
        )
        .unwrap()
    }

    #[tokio::test]
    async fn a_valid_hs256_token_names_the_user() {
        let id = Identity::hs256(b"s3cret", Some("steward-auth"), Some("steward"));
        let token = hs(
            serde_json::json!({"sub": "alice", "exp": now() + 600, "iss": "steward-auth", "aud": "steward"}),
        );
        assert_eq!(id.user(&md(&token)).await.unwrap(), "alice");
        let mut lower = MetadataMap::new();
        lower.insert("authorization", format!("bearer {token}").parse().unwrap());
        assert_eq!(
            id.user(&lower).await.unwrap(),
            "alice",
            "the scheme in any case"
        );
    }

    #[tokio::test]
    async fn expired_wrong_issuer_wrong_key_and_missing_tokens_are_refused() {
        let id = Identity::hs256(b"s3cret", Some("steward-auth"), None);
        let cases = [
            hs(serde_json::json!({"sub": "alice", "exp": now() - 3600, "iss": "steward-auth"})),
            hs(serde_json::json!({"sub": "alice", "exp": now() + 600, "iss": "someone-else"})),
            hs(
                serde_json::json!({"sub": "alice", "exp": now() + 600, "nbf": now() + 3600, "iss": "steward-auth"}),
            ),
            encode(
                &Header::new(Algorithm::HS256),
                &serde_json::json!({"sub": "a", "exp": now() + 600, "iss": "steward-auth"}),
                &EncodingKey::from_secret(b"other"),
            )
            .unwrap(),
        ];
        for token in cases {
            assert!(
                matches!(
                    id.user(&md(&token)).await,
                    Err(ApiError::Unauthenticated(_))
                ),
                "{token}"
            );
        }
        assert!(
            matches!(id.user(&MetadataMap::new()).await, Err(ApiError::Unauthenticated(m)) if m.contains("authorization"))
        );
    }

    #[tokio::test]
    async fn a9_tokens_for_another_audience_or_none_are_refused() {
        let id = Identity::hs256(b"s3cret", Some("steward-auth"), Some("steward"));
        let ok = hs(
            serde_json::json!({"sub": "alice", "exp": now() + 600, "iss": "steward-auth", "aud": "steward"}),
        );
        assert_eq!(id.user(&md(&ok)).await.unwrap(), "alice");
        for claims in [
            serde_json::json!({"sub": "alice", "exp": now() + 600, "iss": "steward-auth", "aud": "billing"}),
            serde_json::json!({"sub": "alice", "exp": now() + 600, "iss": "steward-auth"}),
        ] {
            let token = hs(claims);
            assert!(
                matches!(
                    id.user(&md(&token)).await,
                    Err(ApiError::Unauthenticated(_))
                ),
                "{token}"
            );
        }
    }

    #[tokio::test]
    async fn rs256_tokens_verify_with_the_public_key() {
        let private = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/jwt-test.key.pem"
        ))
        .unwrap();
        let public = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/jwt-test.pub.pem"
        ))
        .unwrap();
        let id = Identity::rs256(&public, None, None).unwrap();
        let token = encode(
            &Header::new(Algorithm::RS256),
            &serde_json::json!({"sub": "bob", "exp": now() + 600}),
            &EncodingKey::from_rsa_pem(&private).unwrap(),
        )
        .unwrap();
        assert_eq!(id.user(&md(&token)).await.unwrap(), "bob");
        // An HS256 token signed with the public key's bytes (the classic confusion) is refused.
        let forged = encode(
            &Header::new(Algorithm::HS256),
            &serde_json::json!({"sub": "bob", "exp": now() + 600}),
            &EncodingKey::from_secret(&public),
        )
        .unwrap();
        assert!(id.user(&md(&forged)).await.is_err());
    }

    /// Serves the fixture key set over loopback HTTP/1.1; counts the fetches.
    async fn jwks_server() -> (String, Arc<std::sync::atomic::AtomicUsize>) {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let body = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/jwt-test.jwks.json"
        ))
        .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/jwks.json", listener.local_addr().unwrap());
        let fetches = Arc::new(AtomicUsize::new(0));
        let counted = fetches.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                counted.fetch_add(1, Ordering::SeqCst);
                let mut request = [0u8; 4096];
                let _ = socket.read(&mut request).await;
                let response = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(response.as_bytes()).await;
            }
        });
        (url, fetches)
    }

    fn rs256_token(kid: &str, claims: serde_json::Value) -> String {
        let private = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/jwt-test.key.pem"
        ))
        .unwrap();
        let mut header = Header::new(Algorithm::RS256);
        header.kid = Some(kid.to_owned());
        encode(
            &header,
            &claims,
            &EncodingKey::from_rsa_pem(&private).unwrap(),
        )
        .unwrap()
    }

    #[tokio::test]
    async fn a9_jwks_keys_verify_tokens_by_kid_and_unknown_kids_refetch_at_most_once() {
        let (url, fetches) = jwks_server().await;
        let id = Identity::jwks(&url, Some("idp"), Some("steward"));
        let claims = |aud: &str| serde_json::json!({"sub": "erin", "exp": now() + 600, "iss": "idp", "aud": aud});
        let good = rs256_token("test-key-1", claims("steward"));
        assert_eq!(id.user(&md(&good)).await.unwrap(), "erin");
        assert_eq!(id.user(&md(&good)).await.unwrap(), "erin");
        let other_audience = rs256_token("test-key-1", claims("billing"));
        assert!(matches!(
            id.user(&md(&other_audience)).await,
            Err(ApiError::Unauthenticated(_))
        ));
        assert_eq!(fetches.load(std::sync::atomic::Ordering::SeqCst), 1);
        let rotated = rs256_token("key-2", claims("steward"));
        let err = id.user(&md(&rotated)).await.unwrap_err();
        assert!(err.to_string().contains("key-2"), "{err}");
        // A flood of unknown key ids cannot turn into a flood of fetches.
        assert!(id.user(&md(&rotated)).await.is_err());
        assert_eq!(fetches.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn dev_mode_reads_the_header() {
        let mut m = MetadataMap::new();
        m.insert(DEV_USER_HEADER, "carol".parse().unwrap());
        assert_eq!(Identity::DevHeader.user(&m).await.unwrap(), "carol");
        assert!(Identity::DevHeader.user(&MetadataMap::new()).await.is_err());
    }
}
