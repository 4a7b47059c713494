//! Who is calling: agent-svc (or an operator) proves itself with the service token, and names
//! the user the call acts for in `x-steward-user-id`. The user id never comes from tool
//! arguments.

use tonic::metadata::MetadataMap;

use super::ApiError;
use crate::{config::CallerAuth, domain::UserId};

pub(crate) const USER_ID_HEADER: &str = "x-steward-user-id";

pub(super) fn authenticate(auth: &CallerAuth, metadata: &MetadataMap) -> Result<UserId, ApiError> {
    authenticate_headers(auth, metadata.as_ref())
}

/// The same check on plain HTTP headers: the gateway's MCP endpoint (`crate::mcp::expose`).
pub fn authenticate_headers(
    auth: &CallerAuth,
    metadata: &http::HeaderMap,
) -> Result<UserId, ApiError> {
    if let CallerAuth::ServiceToken(expected) = auth {
        let presented = metadata
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(svc_kit::grpc::bearer_token)
            .ok_or(ApiError::Unauthenticated(
                "missing `authorization: Bearer <service token>` metadata",
            ))?;
        if !constant_time_eq(presented.as_bytes(), expected.expose().as_bytes()) {
            return Err(ApiError::Unauthenticated("the service token is not valid"));
        }
    }
    let raw = metadata
        .get(USER_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .ok_or(ApiError::Unauthenticated(
            "missing `x-steward-user-id` metadata naming the user",
        ))?;
    UserId::parse(raw).map_err(|e| ApiError::InvalidArgument(format!("x-steward-user-id {e}")))
}

/// Compares secrets without leaking where they differ through timing.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(pairs: &[(&'static str, &'static str)]) -> MetadataMap {
        let mut m = MetadataMap::new();
        for (k, v) in pairs {
            m.insert(*k, v.parse().unwrap());
        }
        m
    }

    #[test]
    fn the_service_token_and_the_user_are_both_required() {
        let auth = CallerAuth::ServiceToken(svc_kit::secret::Secret::new("0123456789abcdefXYZ"));
        assert!(matches!(
            authenticate(&auth, &md(&[])),
            Err(ApiError::Unauthenticated(_))
        ));
        let wrong = md(&[("authorization", "Bearer nope"), (USER_ID_HEADER, "u1")]);
        assert!(matches!(
            authenticate(&auth, &wrong),
            Err(ApiError::Unauthenticated(_))
        ));
        let good = md(&[
            ("authorization", "Bearer 0123456789abcdefXYZ"),
            (USER_ID_HEADER, "u1"),
        ]);
        assert_eq!(authenticate(&auth, &good).unwrap().as_str(), "u1");
        let lower = md(&[
            ("authorization", "bearer 0123456789abcdefXYZ"),
            (USER_ID_HEADER, "u1"),
        ]);
        assert_eq!(
            authenticate(&auth, &lower).unwrap().as_str(),
            "u1",
            "any case"
        );
        let no_user = md(&[("authorization", "Bearer 0123456789abcdefXYZ")]);
        assert!(matches!(
            authenticate(&auth, &no_user),
            Err(ApiError::Unauthenticated(_))
        ));
    }
}
