//! Tokens at rest (G-8): AES-256-GCM with a random 96-bit nonce per encryption, stored as
//! nonce || ciphertext. The row's identity (user, integration, account) is the associated data,
//! so a ciphertext copied onto another row does not decrypt.

use aes_gcm::{
    Aes256Gcm, KeyInit, Nonce,
    aead::{Aead, Payload},
};
use base64::Engine;

const NONCE_LEN: usize = 12;

#[derive(Clone)]
pub struct TokenCipher {
    cipher: Aes256Gcm,
}

impl std::fmt::Debug for TokenCipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TokenCipher(<key>)")
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CipherError {
    #[error("a stored token could not be decrypted (wrong CREDENTIALS_KEY, or a damaged row)")]
    Decrypt,
    #[error("a token could not be encrypted")]
    Encrypt,
}

impl TokenCipher {
    /// From `CREDENTIALS_KEY`: 32 bytes, standard base64.
    pub fn from_base64(key: &str) -> Result<Self, String> {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(key.trim())
            .map_err(|_| "is not base64; generate one with `openssl rand -base64 32`".to_owned())?;
        if bytes.len() != 32 {
            return Err(format!(
                "decodes to {} bytes; AES-256 needs exactly 32",
                bytes.len()
            ));
        }
        let cipher = Aes256Gcm::new_from_slice(&bytes)
            .map_err(|_| "is not a valid AES-256 key".to_owned())?;
        Ok(Self { cipher })
    }

    /// A random key for a process whose stored tokens die with it (the in-memory store).
    pub fn ephemeral() -> Self {
        let mut key = [0u8; 32];
        rand::fill(&mut key);
        Self {
            cipher: Aes256Gcm::new_from_slice(&key).expect("32-byte key"),
        }
    }

    pub fn encrypt(&self, plaintext: &str, row: &str) -> Result<Vec<u8>, CipherError> {
        let mut nonce = [0u8; NONCE_LEN];
        rand::fill(&mut nonce);
        let ciphertext = self
            .cipher
            .encrypt(
                Nonce::from_slice(&nonce),
                Payload {
                    msg: plaintext.as_bytes(),
                    aad: row.as_bytes(),
                },
            )
            .map_err(|_| CipherError::Encrypt)?;
        let mut out = nonce.to_vec();
        out.extend_from_slice(&ciphertext);
        Ok(out)
    }

    pub fn decrypt(&self, stored: &[u8], row: &str) -> Result<String, CipherError> {
        if stored.len() < NONCE_LEN {
            return Err(CipherError::Decrypt);
        }
        let (nonce, ciphertext) = stored.split_at(NONCE_LEN);
        let plain = self
            .cipher
            .decrypt(
                Nonce::from_slice(nonce),
                Payload {
                    msg: ciphertext,
                    aad: row.as_bytes(),
                },
            )
            .map_err(|_| CipherError::Decrypt)?;
        String::from_utf8(plain).map_err(|_| CipherError::Decrypt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="; // "0123456789abcdef" x2

    #[test]
    fn a_token_round_trips_and_is_not_stored_in_the_clear() {
        let c = TokenCipher::from_base64(KEY).unwrap();
        let stored = c.encrypt("ya29.secret-token", "u1/gmail/a@b").unwrap();
        assert!(!stored.windows(6).any(|w| w == b"secret"));
        assert_eq!(
            c.decrypt(&stored, "u1/gmail/a@b").unwrap(),
            "ya29.secret-token"
        );
    }

    #[test]
    fn a_ciphertext_moved_to_another_row_does_not_decrypt() {
        let c = TokenCipher::from_base64(KEY).unwrap();
        let stored = c.encrypt("t", "u1/gmail/a@b").unwrap();
        assert_eq!(
            c.decrypt(&stored, "u2/gmail/a@b"),
            Err(CipherError::Decrypt)
        );
        assert_eq!(
            c.decrypt(&stored[..5], "u1/gmail/a@b"),
            Err(CipherError::Decrypt)
        );
    }

    #[test]
    fn bad_keys_are_explained() {
        assert!(
            TokenCipher::from_base64("not base64!")
                .unwrap_err()
                .contains("not base64")
        );
        assert!(
            TokenCipher::from_base64("c2hvcnQ=")
                .unwrap_err()
                .contains("exactly 32")
        );
    }
}
