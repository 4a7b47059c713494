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
    // Dropped last, on every way out: what is still queued in the log is written then.
    let _logs = crate::telemetry::init(service);
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
    let code = match run(app, shutdown).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %e, "server failed");
            ExitCode::FAILURE
        }
    };
    crate::telemetry::shutdown();
    code
}

/// The `migrate` subcommand: load the config as for serving (exit 2 naming bad variables),
/// apply the database migrations and exit 0; exit 2 when no database is configured, 1 when
/// migrating fails. For a Kubernetes Job that runs before a rollout.
pub async fn migrate<C, E, M>(
    service: &'static str,
    load: impl FnOnce() -> Result<C, ConfigErrors>,
    database_url: impl FnOnce(&C) -> Option<String>,
    apply: impl FnOnce(String) -> M,
) -> ExitCode
where
    M: Future<Output = Result<(), E>>,
    E: Display,
{
    let _logs = crate::telemetry::init(service);
    let config = match load() {
        Ok(config) => config,
        Err(errors) => {
            eprintln!("{service}: {errors}");
            return ExitCode::from(2);
        }
    };
    let Some(url) = database_url(&config) else {
        eprintln!("{service} migrate: DATABASE_URL is not set; there is nothing to migrate");
        return ExitCode::from(2);
    };
    match apply(url).await {
        Ok(()) => {
            tracing::info!("migrations applied");
            eprintln!("{service} migrate: the schema is up to date");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{service} migrate: {e}");
            tracing::error!(error = %e, "migrations failed");
            ExitCode::FAILURE
        }
    }
}

/// What the binary was asked to do: serve (no arguments) or `migrate`.
pub enum Command {
    Serve,
    Migrate,
}

/// Reads the command line; anything else is exit 2 with usage.
pub fn command(service: &str) -> Result<Command, ExitCode> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        [] => Ok(Command::Serve),
        ["migrate"] => Ok(Command::Migrate),
        _ => {
            eprintln!(
                "{service}: unknown arguments {args:?}; run with none to serve, or `{service} migrate` to apply the database migrations and exit"
            );
            Err(ExitCode::from(2))
        }
    }
}
