use std::process::ExitCode;

use gateway_svc::{App, Config, store::postgres::PgStore};
use svc_kit::process::{self, Command};

#[tokio::main]
async fn main() -> ExitCode {
    match process::command("gateway-svc") {
        Ok(Command::Serve) => {
            process::main("gateway-svc", Config::from_env, App::build, App::run).await
        }
        Ok(Command::Migrate) => {
            process::migrate(
                "gateway-svc",
                Config::from_env,
                |c: &Config| c.server.database.as_ref().map(|d| d.url.clone()),
                |url| async move { PgStore::migrate(&url).await },
            )
            .await
        }
        Err(code) => code,
    }
}
