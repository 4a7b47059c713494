//! Steward's gRPC contracts. Everything proto-shaped lives here; the services convert to their
//! own domain types at their `api/` edge.

#![allow(unreachable_pub, clippy::all, clippy::pedantic)]

pub mod agent {
    pub mod v1 {
        tonic::include_proto!("steward.agent.v1");
    }
}

pub mod gateway {
    pub mod v1 {
        tonic::include_proto!("steward.gateway.v1");
    }
}

pub mod codec;
pub mod wellknown;

/// Encoded `FileDescriptorSet` of both contracts (with their imports), for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/steward_descriptor.bin"));

/// Fully qualified service names, as health checks and reflection report them.
pub const AGENT_SERVICE_NAME: &str = "steward.agent.v1.AgentService";
pub const GATEWAY_SERVICE_NAME: &str = "steward.gateway.v1.GatewayService";
