use std::process::ExitCode;

use agent_svc::{App, Config, store::postgres::PgStore};
use svc_kit::process::{self, Command};

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
