use std::process::ExitCode;

use agent_svc::{App, Config};

#[tokio::main]
async fn main() -> ExitCode {
    svc_kit::process::main("agent-svc", Config::from_env, App::build, App::run).await
}
