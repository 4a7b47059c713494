//! Who is calling: a bearer JWT in metadata, verified with the configured HS256 secret or
//! RS256 public key (exp and nbf always, iss and aud when configured); its `sub` is the user.
//! A clearly named, opt-in dev mode takes `x-user-id` instead and is logged loudly at start.
//! Never from the request body.

use jsonwebtoken::{Algorithm, DecodingKey, Validation, decode};
use serde::Deserialize;
use tonic::metadata::MetadataMap;

use super::ApiError;

pub const DEV_USER_HEADER: &str = "x-user-id";
/// User ids are at most this long (what the gateway accepts too).
const MAX_USER_ID: usize = 128;

#[derive(Clone)]
pub enum Identity {
    Jwt {
        key: DecodingKey,
        validation: Box<Validation>,
    },
    /// AUTH_DEV_USER_HEADER=true: trusts `x-user-id`. Local runs only.
    DevHeader,
}

impl std::fmt::Debug for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Identity::Jwt { validation, .. } => write!(f, "Jwt({:?})", validation.algorithms),
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

    fn jwt(
        key: DecodingKey,
        algorithm: Algorithm,
        issuer: Option<&str>,
        audience: Option<&str>,
    ) -> Self {
        let mut validation = Validation::new(algorithm);
        validation.validate_nbf = true;
        validation.leeway = 30;
        validation.set_required_spec_claims(&["exp", "sub"]);
        if let Some(iss) = issuer {
            validation.set_issuer(&[iss]);
        }
        match audience {
            Some(aud) => validation.set_audience(&[aud]),
            None => validation.validate_aud = false,
        }
        Identity::Jwt {
            key,
            validation: Box::new(validation),
        }
    }

    /// The caller's user id, or UNAUTHENTICATED saying what is missing or wrong.
    pub fn user(&self, metadata: &MetadataMap) -> Result<String, ApiError> {
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
            Identity::Jwt { key, validation } => {
                let token = metadata
                    .get("authorization")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.strip_prefix("Bearer "))
                    .ok_or_else(|| {
                        ApiError::Unauthenticated(
                            "missing `authorization: Bearer <JWT>` metadata".into(),
                        )
                    })?;
                let data = decode::<Claims>(token, key, validation).map_err(|e| {
                    ApiError::Unauthenticated(format!("the bearer token is not valid: {e}"))
                })?;
                data.claims.sub
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

    #[test]
    fn a_valid_hs256_token_names_the_user() {
        let id = Identity::hs256(b"s3cret", Some("steward-auth"), Some("steward"));
        let token = hs(
            serde_json::json!({"sub": "alice", "exp": now() + 600, "iss": "steward-auth", "aud": "steward"}),
        );
        assert_eq!(id.user(&md(&token)).unwrap(), "alice");
    }

    #[test]
    fn expired_wrong_issuer_wrong_key_and_missing_tokens_are_refused() {
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
                matches!(id.user(&md(&token)), Err(ApiError::Unauthenticated(_))),
                "{token}"
            );
        }
        assert!(
            matches!(id.user(&MetadataMap::new()), Err(ApiError::Unauthenticated(m)) if m.contains("authorization"))
        );
    }

    #[test]
    fn rs256_tokens_verify_with_the_public_key() {
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
        assert_eq!(id.user(&md(&token)).unwrap(), "bob");
        // An HS256 token signed with the public key's bytes (the classic confusion) is refused.
        let forged = encode(
            &Header::new(Algorithm::HS256),
            &serde_json::json!({"sub": "bob", "exp": now() + 600}),
            &EncodingKey::from_secret(&public),
        )
        .unwrap();
        assert!(id.user(&md(&forged)).is_err());
    }

    #[test]
    fn dev_mode_reads_the_header() {
        let mut m = MetadataMap::new();
        m.insert(DEV_USER_HEADER, "carol".parse().unwrap());
        assert_eq!(Identity::DevHeader.user(&m).unwrap(), "carol");
        assert!(Identity::DevHeader.user(&MetadataMap::new()).is_err());
    }
}
