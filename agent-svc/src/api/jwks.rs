//! Signing keys from a JWKS URL: the identity provider's published key set, fetched on
//! first use and again when a token names a key id the cached set lacks (key rotation), at
//! most once per [`REFETCH_AFTER`], by one caller at a time.

use std::{
    collections::HashMap,
    time::{Duration, Instant},
};

use jsonwebtoken::{Algorithm, DecodingKey, jwk::JwkSet};
use tokio::sync::{Mutex, RwLock};

/// A token naming an unknown key id refetches the set no more often than this.
pub(super) const REFETCH_AFTER: Duration = Duration::from_secs(30);
/// Largest key set read.
const MAX_JWKS_BYTES: usize = 256 << 10;

pub struct Jwks {
    url: String,
    http: reqwest::Client,
    keys: RwLock<HashMap<String, (DecodingKey, Algorithm)>>,
    /// When the set was last fetched (successfully or not); the lock makes fetches single-flight.
    fetched: Mutex<Option<Instant>>,
}

impl std::fmt::Debug for Jwks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Jwks({})", self.url)
    }
}

/// Why a token's key is not at hand: the key set could not be read (the caller's token may be
/// fine: try again), or it does not list the key (the token is not ours).
#[derive(Debug)]
pub enum KeyError {
    Unavailable,
    Unknown(String),
}

impl Jwks {
    pub fn new(url: &str) -> Self {
        Self {
            url: url.to_owned(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap_or_default(),
            keys: RwLock::default(),
            fetched: Mutex::new(None),
        }
    }

    /// The key and algorithm for `kid`, fetching the set if it is not known yet.
    pub async fn key(&self, kid: &str) -> Result<(DecodingKey, Algorithm), KeyError> {
        if let Some(k) = self.keys.read().await.get(kid) {
            return Ok(k.clone());
        }
        {
            let mut fetched = self.fetched.lock().await;
            // Another caller may have fetched while this one waited.
            if let Some(k) = self.keys.read().await.get(kid) {
                return Ok(k.clone());
            }
            if fetched.is_none_or(|at| at.elapsed() >= REFETCH_AFTER) {
                *fetched = Some(Instant::now());
                match self.fetch().await {
                    Ok(keys) => *self.keys.write().await = keys,
                    Err(e) => {
                        // The details (the identity provider's URL) stay in the log.
                        tracing::error!(url = %self.url, error = %e, "could not fetch the JWKS");
                        return Err(KeyError::Unavailable);
                    }
                }
            }
        }
        self.keys.read().await.get(kid).cloned().ok_or_else(|| {
            KeyError::Unknown(format!(
                "it is signed with key id {kid:?}, which the JWKS does not list"
            ))
        })
    }

    async fn fetch(&self) -> Result<HashMap<String, (DecodingKey, Algorithm)>, String> {
        let mut response = self
            .http
            .get(&self.url)
            .send()
            .await
            .map_err(|e| format!("request failed: {e}"))?;
        if !response.status().is_success() {
            return Err(format!("HTTP {}", response.status().as_u16()));
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| e.to_string())? {
            body.extend_from_slice(&chunk);
            if body.len() > MAX_JWKS_BYTES {
                return Err(format!("the key set is larger than {MAX_JWKS_BYTES} bytes"));
            }
        }
        let set: JwkSet =
            serde_json::from_slice(&body).map_err(|e| format!("not a JWK set: {e}"))?;
        let mut keys = HashMap::new();
        for jwk in &set.keys {
            // Keys without an id or a signing algorithm cannot be chosen safely: skipped.
            let (Some(kid), Some(alg)) = (&jwk.common.key_id, jwk.common.key_algorithm) else {
                continue;
            };
            let (Ok(alg), Ok(key)) = (Algorithm::try_from(alg), DecodingKey::from_jwk(jwk)) else {
                continue;
            };
            keys.insert(kid.clone(), (key, alg));
        }
        if keys.is_empty() {
            return Err("no usable signing key (each needs kid and alg)".into());
        }
        Ok(keys)
    }
}
