//! Configuration values that must never be printed: keys, tokens, the service secret, database
//! passwords. `Debug` shows `[redacted]`, so a config logged or panicked with `{:?}` leaks
//! nothing; the value is reached only through [`Secret::expose`], where it is used.

use std::fmt;

#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value itself, for the one place that sends or checks it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl From<String> for Secret {
    fn from(value: String) -> Self {
        Self(value)
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

/// A connection URL with its password replaced by `[redacted]`, for logs and `Debug`.
pub fn redact_url_password(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_owned();
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    match authority.rfind('@') {
        Some(at) => match authority[..at].split_once(':') {
            Some((user, _)) => format!(
                "{}{user}:[redacted]{}",
                &url[..scheme_end],
                &url[scheme_end + at..]
            ),
            None => url.to_owned(),
        },
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_and_url_passwords_never_print() {
        assert_eq!(format!("{:?}", Secret::new("hunter2")), "[redacted]");
        assert_eq!(
            redact_url_password("postgres://app:s3cr%40t@db:5432/steward?sslmode=require"),
            "postgres://app:[redacted]@db:5432/steward?sslmode=require"
        );
        assert_eq!(
            redact_url_password("postgres://app@db/x"),
            "postgres://app@db/x"
        );
        assert_eq!(redact_url_password("not a url"), "not a url");
    }
}
