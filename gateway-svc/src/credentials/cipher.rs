//! Tokens at rest (G-8): AES-256-GCM with a random 96-bit nonce per encryption, stored as
//! nonce || ciphertext. The row's identity (user, integration, account) is the associated data,
//! so a ciphertext copied onto another row does not decrypt.
//!
//! Rotation: a cipher may hold the key it replaces (`CREDENTIALS_KEY_PREVIOUS`). Decryption
//! tries the current key, then the previous one; encryption always uses the current key, so an
//! account moves to the new key the next time it is saved (a token refresh, a reconnect). Only
//! this type knows two keys exist.

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use aes_gcm::{
    Aes256Gcm, KeyInit, Nonce,
    aead::{Aead, Payload},
};
use base64::Engine;

const NONCE_LEN: usize = 12;

#[derive(Clone)]
pub struct TokenCipher {
    current: Aes256Gcm,
    previous: Option<Aes256Gcm>,
    /// Set once a token has been read with the previous key, so that is logged once per
    /// process (shared by clones).
    read_previous: Arc<AtomicBool>,
}

impl std::fmt::Debug for TokenCipher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.previous {
            Some(_) => f.write_str("TokenCipher(<key>, previous: <key>)"),
            None => f.write_str("TokenCipher(<key>)"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CipherError {
    #[error("a stored token could not be decrypted (wrong CREDENTIALS_KEY, or a damaged row)")]
    Decrypt,
    #[error("a token could not be encrypted")]
    Encrypt,
}

/// Which key read a token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyUsed {
    Current,
    Previous,
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
        Ok(Self::of(cipher))
    }

    fn of(current: Aes256Gcm) -> Self {
        Self {
            current,
            previous: None,
            read_previous: Arc::default(),
        }
    }

    /// A random key for a process whose stored tokens die with it (the in-memory store).
    pub fn ephemeral() -> Self {
        let mut key = [0u8; 32];
        rand::fill(&mut key);
        Self::of(Aes256Gcm::new_from_slice(&key).expect("32-byte key"))
    }

    /// This cipher, also reading tokens stored under `previous`'s key (`CREDENTIALS_KEY_PREVIOUS`).
    pub fn with_previous(self, previous: TokenCipher) -> Self {
        Self {
            previous: Some(previous.current),
            ..self
        }
    }

    /// True when a previous key is held.
    pub fn has_previous(&self) -> bool {
        self.previous.is_some()
    }

    pub fn encrypt(&self, plaintext: &str, row: &str) -> Result<Vec<u8>, CipherError> {
        let mut nonce = [0u8; NONCE_LEN];
        rand::fill(&mut nonce);
        let ciphertext = self
            .current
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

    /// The token stored in `stored` for `row`, read with the current key or else the previous
    /// one.
    pub fn decrypt(&self, stored: &[u8], row: &str) -> Result<String, CipherError> {
        let (plain, used) = self.decrypt_which(stored, row)?;
        if used == KeyUsed::Previous && !self.read_previous.swap(true, Ordering::Relaxed) {
            tracing::info!(
                "a stored token was read with CREDENTIALS_KEY_PREVIOUS (logged once per process): \
                 rotation is under way; each account moves to CREDENTIALS_KEY when it is next saved or the background walk reaches it"
            );
        }
        Ok(plain)
    }

    /// As [`Self::decrypt`], saying which key read it (the start-up key check).
    pub fn decrypt_which(
        &self,
        stored: &[u8],
        row: &str,
    ) -> Result<(String, KeyUsed), CipherError> {
        if stored.len() < NONCE_LEN {
            return Err(CipherError::Decrypt);
        }
        let (nonce, ciphertext) = stored.split_at(NONCE_LEN);
        let open = |key: &Aes256Gcm| {
            key.decrypt(
                Nonce::from_slice(nonce),
                Payload {
                    msg: ciphertext,
                    aad: row.as_bytes(),
                },
            )
            .ok()
        };
        let (plain, used) = match open(&self.current) {
            Some(plain) => (plain, KeyUsed::Current),
            None => match self.previous.as_ref().and_then(open) {
                Some(plain) => (plain, KeyUsed::Previous),
                None => return Err(CipherError::Decrypt),
            },
        };
        let plain = String::from_utf8(plain).map_err(|_| CipherError::Decrypt)?;
        Ok((plain, used))
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

    const OTHER_KEY: &str = "YWJjZGVmMDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODk="; // "abcdef0123456789" x2
    const THIRD_KEY: &str = "Wlp6enl5eHh3d3Z2dXV0dHNzcnJxcXBwb29ubm1tbGw=";

    #[test]
    fn with_a_previous_key_tokens_of_both_keys_are_read_and_new_ones_are_written_with_the_current()
    {
        let old = TokenCipher::from_base64(KEY).unwrap();
        let new = TokenCipher::from_base64(OTHER_KEY).unwrap();
        let rotating = TokenCipher::from_base64(OTHER_KEY)
            .unwrap()
            .with_previous(TokenCipher::from_base64(KEY).unwrap());
        let row = "u1/gmail/a@b";
        let under_old = old.encrypt("old-token", row).unwrap();
        let under_new = new.encrypt("new-token", row).unwrap();
        assert_eq!(
            rotating.decrypt_which(&under_old, row).unwrap(),
            ("old-token".to_owned(), KeyUsed::Previous)
        );
        assert_eq!(
            rotating.decrypt_which(&under_new, row).unwrap(),
            ("new-token".to_owned(), KeyUsed::Current)
        );
        assert_eq!(rotating.decrypt(&under_old, row).unwrap(), "old-token");

        let written = rotating.encrypt("fresh", row).unwrap();
        assert_eq!(new.decrypt(&written, row).unwrap(), "fresh");
        assert_eq!(old.decrypt(&written, row), Err(CipherError::Decrypt));
    }

    #[test]
    fn a_token_of_neither_the_current_nor_the_previous_key_does_not_decrypt() {
        let rotating = TokenCipher::from_base64(OTHER_KEY)
            .unwrap()
            .with_previous(TokenCipher::from_base64(KEY).unwrap());
        let row = "u1/gmail/a@b";
        let foreign = TokenCipher::from_base64(THIRD_KEY)
            .unwrap()
            .encrypt("t", row)
            .unwrap();
        assert_eq!(rotating.decrypt(&foreign, row), Err(CipherError::Decrypt));
        // The previous key still binds the row: a ciphertext moved to another row fails too.
        let under_old = TokenCipher::from_base64(KEY)
            .unwrap()
            .encrypt("t", row)
            .unwrap();
        assert_eq!(
            rotating.decrypt(&under_old, "u2/gmail/a@b"),
            Err(CipherError::Decrypt)
        );
    }

    #[test]
    fn a_cipher_without_a_previous_key_does_not_read_a_token_of_another_key() {
        let row = "u1/gmail/a@b";
        let under_old = TokenCipher::from_base64(KEY)
            .unwrap()
            .encrypt("t", row)
            .unwrap();
        let new = TokenCipher::from_base64(OTHER_KEY).unwrap();
        assert!(!new.has_previous());
        assert_eq!(new.decrypt(&under_old, row), Err(CipherError::Decrypt));
    }
}
