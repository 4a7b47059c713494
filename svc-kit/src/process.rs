//! The life of a service process, the same for both binaries: logs, signal handlers, config
//! (exit 2 naming every bad variable), build (exit 1), serve until SIGTERM/SIGINT (exit 0).

use std::{fmt::Display, future::Future, pin::Pin, process::ExitCode};

use crate::config::ConfigErrors;

/// The future a service's `run` is given: resolves on the first shutdown signal.
pub type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

pub async fn main<C, A, BE, RE, B, R>(
    service: &'static str,
    load: impl FnOnce() -> Result<C, ConfigErrors>,
    build: impl FnOnce(C) -> B,
    run: impl FnOnce(A, Shutdown) -> R,
) -> ExitCode
where
    B: Future<Output = Result<A, BE>>,
    R: Future<Output = Result<(), RE>>,
    BE: Display,
    RE: Display,
{
    crate::telemetry::init(service);
    // Installed before any start-up work, so a SIGTERM during migrations is a drain, not a kill.
    let shutdown: Shutdown = Box::pin(crate::shutdown::signal());
    let config = match load() {
        Ok(config) => config,
        Err(errors) => {
            // Plain stderr as well as the log: an operator reading `kubectl logs` or a terminal
            // sees which variable to fix either way.
            eprintln!("{service}: {errors}");
            tracing::error!(%errors, "refusing to start");
            return ExitCode::from(2);
        }
    };
    let app = match build(config).await {
        Ok(app) => app,
        Err(e) => {
            eprintln!("{service}: {e}");
            tracing::error!(error = %e, "failed to start");
            return ExitCode::FAILURE;
        }
    };
    match run(app, shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "server failed");
            ExitCode::FAILURE
        }
    }
}
