use std::process::ExitCode;

use gateway_svc::{App, Config};

#[tokio::main]
async fn main() -> ExitCode {
    svc_kit::process::main("gateway-svc", Config::from_env, App::build, App::run).await
}
