//! The one mapping from gateway-svc errors to gRPC status codes. Tool failures are never here:
//! they are results (G-4). Only transport, authentication and malformed requests are RPC errors.

use tonic::Status;

use crate::{credentials::CredentialError, store::StoreError};

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    Unauthenticated(&'static str),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    FailedPrecondition(String),
    /// What was asked about is under way and will be known later: ask again.
    #[error("{0}")]
    StillRunning(String),
    /// Stored data this build cannot read (one written by a newer build, say).
    #[error("{0}")]
    Unreadable(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<CredentialError> for ApiError {
    fn from(e: CredentialError) -> Self {
        match e {
            CredentialError::Store(s) => ApiError::Store(s),
            CredentialError::Invalid(m) => ApiError::InvalidArgument(m),
            CredentialError::NoKey => ApiError::FailedPrecondition(e.to_string()),
        }
    }
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Self {
        let message = e.to_string();
        match e {
            ApiError::Unauthenticated(_) => Status::unauthenticated(message),
            ApiError::InvalidArgument(_) => Status::invalid_argument(message),
            ApiError::NotFound(_) => Status::not_found(message),
            ApiError::FailedPrecondition(_) => Status::failed_precondition(message),
            ApiError::StillRunning(_) => Status::unavailable(message),
            ApiError::Unreadable(_) => Status::data_loss(message),
            ApiError::Store(StoreError::Unavailable(_)) => Status::unavailable(message),
            ApiError::Store(StoreError::InProgress(_) | StoreError::MayHaveActed(_)) => {
                Status::aborted(message)
            }
            ApiError::Store(StoreError::Rejected { .. }) => Status::internal(message),
        }
    }
}
