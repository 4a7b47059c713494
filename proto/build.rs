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
        .compile_fds(fds)?;
    Ok(())
}
