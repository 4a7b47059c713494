use std::process::ExitCode;

use gateway_svc::{App, Config};

#[tokio::main]
async fn main() -> ExitCode {
    svc_kit::telemetry::init("gateway-svc");
    let shutdown = svc_kit::shutdown::signal();
    let config = match Config::from_env() {
        Ok(config) => config,
        Err(errors) => {
            // Plain stderr as well as the log: an operator reading `kubectl logs` or a terminal
            // sees which variable to fix either way.
            eprintln!("gateway-svc: {errors}");
            tracing::error!(%errors, "refusing to start");
            return ExitCode::from(2);
        }
    };
    let app = match App::build(config).await {
        Ok(app) => app,
        Err(e) => {
            eprintln!("gateway-svc: {e}");
            tracing::error!(error = %e, "failed to start");
            return ExitCode::FAILURE;
        }
    };
    match app.run(shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "server failed");
            ExitCode::FAILURE
        }
    }
}
