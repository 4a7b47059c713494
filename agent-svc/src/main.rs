use std::process::ExitCode;

use agent_svc::{App, Config, store::postgres::PgStore};
use svc_kit::process::{self, Command};

/// jemalloc, not glibc malloc: tasks move between worker threads, so memory is often freed on
/// another thread than the one that allocated it, which glibc pays for in arena locks; under
/// load that was a third of the CPU per run (issue 13, docs/BENCHMARKS.md "Allocator").
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[tokio::main]
async fn main() -> ExitCode {
    match process::command("agent-svc") {
        Ok(Command::Serve) => {
            process::main("agent-svc", Config::from_env, App::build, App::run).await
        }
        Ok(Command::Migrate) => {
            process::migrate(
                "agent-svc",
                Config::from_env,
                |c: &Config| c.server.database.as_ref().map(|d| d.url.clone()),
                |url| async move { PgStore::migrate(&url).await },
            )
            .await
        }
        Err(code) => code,
    }
}
