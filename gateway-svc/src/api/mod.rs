//! The gRPC edge of gateway-svc: authenticate the caller, validate, convert proto to domain
//! types, call in, convert back. Nothing proto-shaped goes deeper than this module.

mod status;

use std::pin::Pin;

use steward_proto::gateway::v1::{self as pb, gateway_service_server::GatewayService};
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

pub use status::ApiError;

use crate::store::SharedStore;

type ResultStream = Pin<Box<dyn Stream<Item = Result<pb::ExecuteResponse, Status>> + Send>>;

/// The GatewayService implementation.
pub struct GatewayApi {
    #[allow(dead_code)] // read by the RPCs as they are implemented
    store: SharedStore,
}

impl GatewayApi {
    pub fn new(store: SharedStore) -> Self {
        Self { store }
    }
}

/// The issues that will implement each RPC, so an UNIMPLEMENTED answer says when to expect it.
const CORE_ISSUE: u32 = 3;
const BOOTSTRAP_ISSUE: u32 = 5;

#[tonic::async_trait]
impl GatewayService for GatewayApi {
    type ExecuteStream = ResultStream;

    async fn list_tools(
        &self,
        _: Request<pb::ListToolsRequest>,
    ) -> Result<Response<pb::ListToolsResponse>, Status> {
        Err(ApiError::Unimplemented {
            rpc: "ListTools",
            issue: CORE_ISSUE,
        }
        .into())
    }

    async fn execute(
        &self,
        _: Request<Streaming<pb::ExecuteRequest>>,
    ) -> Result<Response<Self::ExecuteStream>, Status> {
        Err(ApiError::Unimplemented {
            rpc: "Execute",
            issue: CORE_ISSUE,
        }
        .into())
    }

    async fn execute_tool(
        &self,
        _: Request<pb::ExecuteToolRequest>,
    ) -> Result<Response<pb::ExecuteToolResponse>, Status> {
        Err(ApiError::Unimplemented {
            rpc: "ExecuteTool",
            issue: CORE_ISSUE,
        }
        .into())
    }

    async fn get_bootstrap_context(
        &self,
        _: Request<pb::GetBootstrapContextRequest>,
    ) -> Result<Response<pb::GetBootstrapContextResponse>, Status> {
        Err(ApiError::Unimplemented {
            rpc: "GetBootstrapContext",
            issue: BOOTSTRAP_ISSUE,
        }
        .into())
    }

    async fn connect_account(
        &self,
        _: Request<pb::ConnectAccountRequest>,
    ) -> Result<Response<pb::ConnectAccountResponse>, Status> {
        Err(ApiError::Unimplemented {
            rpc: "ConnectAccount",
            issue: CORE_ISSUE,
        }
        .into())
    }

    async fn list_accounts(
        &self,
        _: Request<pb::ListAccountsRequest>,
    ) -> Result<Response<pb::ListAccountsResponse>, Status> {
        Err(ApiError::Unimplemented {
            rpc: "ListAccounts",
            issue: CORE_ISSUE,
        }
        .into())
    }

    async fn disconnect_account(
        &self,
        _: Request<pb::DisconnectAccountRequest>,
    ) -> Result<Response<pb::DisconnectAccountResponse>, Status> {
        Err(ApiError::Unimplemented {
            rpc: "DisconnectAccount",
            issue: CORE_ISSUE,
        }
        .into())
    }
}
