//! The gRPC edge of agent-svc: authenticate, validate, convert proto to domain types, call in,
//! convert back. Nothing proto-shaped goes deeper than this module.

pub mod identity;
mod status;

use std::pin::Pin;

use steward_proto::agent::v1::{self as pb, agent_service_server::AgentService};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

pub use status::ApiError;

use crate::store::SharedStore;

type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send + 'static>>;

/// The AgentService implementation.
pub struct AgentApi {
    #[allow(dead_code)] // read by the RPCs as they are implemented
    store: SharedStore,
}

impl AgentApi {
    pub fn new(store: SharedStore) -> Self {
        Self { store }
    }
}

/// The issue that will implement each RPC, so an UNIMPLEMENTED answer says when to expect it.
const API_ISSUE: u32 = 7;
const SESSIONS_ISSUE: u32 = 8;

#[tonic::async_trait]
impl AgentService for AgentApi {
    type RunStreamStream = EventStream<pb::RunStreamResponse>;
    type WatchRunStream = EventStream<pb::WatchRunResponse>;

    async fn run(&self, _: Request<pb::RunRequest>) -> Result<Response<pb::RunResponse>, Status> {
        Err(ApiError::Unimplemented {
            rpc: "Run",
            issue: API_ISSUE,
        }
        .into())
    }

    async fn run_stream(
        &self,
        _: Request<pb::RunStreamRequest>,
    ) -> Result<Response<Self::RunStreamStream>, Status> {
        Err(ApiError::Unimplemented {
            rpc: "RunStream",
            issue: API_ISSUE,
        }
        .into())
    }

    async fn open_session(
        &self,
        _: Request<pb::OpenSessionRequest>,
    ) -> Result<Response<pb::OpenSessionResponse>, Status> {
        Err(ApiError::Unimplemented {
            rpc: "OpenSession",
            issue: SESSIONS_ISSUE,
        }
        .into())
    }

    async fn decide_approval(
        &self,
        _: Request<pb::DecideApprovalRequest>,
    ) -> Result<Response<pb::DecideApprovalResponse>, Status> {
        Err(ApiError::Unimplemented {
            rpc: "DecideApproval",
            issue: API_ISSUE,
        }
        .into())
    }

    async fn get_run(
        &self,
        _: Request<pb::GetRunRequest>,
    ) -> Result<Response<pb::GetRunResponse>, Status> {
        Err(ApiError::Unimplemented {
            rpc: "GetRun",
            issue: API_ISSUE,
        }
        .into())
    }

    async fn list_threads(
        &self,
        _: Request<pb::ListThreadsRequest>,
    ) -> Result<Response<pb::ListThreadsResponse>, Status> {
        Err(ApiError::Unimplemented {
            rpc: "ListThreads",
            issue: API_ISSUE,
        }
        .into())
    }

    async fn list_messages(
        &self,
        _: Request<pb::ListMessagesRequest>,
    ) -> Result<Response<pb::ListMessagesResponse>, Status> {
        Err(ApiError::Unimplemented {
            rpc: "ListMessages",
            issue: API_ISSUE,
        }
        .into())
    }

    async fn cancel_run(
        &self,
        _: Request<pb::CancelRunRequest>,
    ) -> Result<Response<pb::CancelRunResponse>, Status> {
        Err(ApiError::Unimplemented {
            rpc: "CancelRun",
            issue: API_ISSUE,
        }
        .into())
    }

    async fn watch_run(
        &self,
        _: Request<pb::WatchRunRequest>,
    ) -> Result<Response<Self::WatchRunStream>, Status> {
        Err(ApiError::Unimplemented {
            rpc: "WatchRun",
            issue: API_ISSUE,
        }
        .into())
    }
}
