//! The one mapping from agent-svc errors to gRPC status codes. Handlers return
//! [`ApiError`]; nothing else builds a `Status`.

use tonic::Status;

use crate::store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    Unauthenticated(String),
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0} was not found")]
    NotFound(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    Aborted(String),
    #[error("{0}")]
    Unavailable(String),
    /// A fair-use cap: the message names the cap and what to do.
    #[error("{0}")]
    ResourceExhausted(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Self {
        let message = e.to_string();
        match e {
            ApiError::Unauthenticated(_) => Status::unauthenticated(message),
            ApiError::InvalidArgument(_) => Status::invalid_argument(message),
            ApiError::NotFound(_) => Status::not_found(message),
            ApiError::FailedPrecondition(_) => Status::failed_precondition(message),
            ApiError::Aborted(_) => Status::aborted(message),
            ApiError::Unavailable(_) => Status::unavailable(message),
            ApiError::ResourceExhausted(_) => Status::resource_exhausted(message),
            ApiError::Store(StoreError::Unavailable(_) | StoreError::LeaseLost) => {
                Status::unavailable(message)
            }
            ApiError::Store(StoreError::NotFound(_)) => Status::not_found(message),
            ApiError::Store(StoreError::Conflict(_)) => Status::already_exists(message),
            ApiError::Store(StoreError::Corrupt(_) | StoreError::Rejected(_)) => {
                Status::internal(message)
            }
        }
    }
}
