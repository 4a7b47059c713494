//! Compiles the contracts with protox (pure Rust, no system `protoc`) and writes the encoded
//! descriptor set next to the generated code so both services can serve reflection from it.

use std::{env, fs, path::PathBuf};

use prost::Message;

const PROTOS: &[&str] = &[
    "steward/agent/v1/agent.proto",
    "steward/gateway/v1/gateway.proto",
];

fn main() -> Result<(), Box<dyn std::error::Error>> {
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let fds = protox::compile(PROTOS, ["."])?;
    let out = PathBuf::from(env::var("OUT_DIR")?);
    fs::write(out.join("steward_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .codec_path("crate::codec::SmallBufferCodec")
        // A run event is as big as its largest kind: the result (600 bytes) and the approval
        // request (304) made every event 680 bytes, in each run's live log and each watch
        // queue, though most events are deltas and tool calls of under 130. Boxed, they are
        // ~230 (issue 13: agent memory per run in flight).
        .boxed(".steward.agent.v1.RunEvent.kind.result")
        .boxed(".steward.agent.v1.RunEvent.kind.approval_required")
        .compile_fds(fds)?;
    Ok(())
}
