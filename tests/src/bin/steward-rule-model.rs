//! The rule-based fake model ([`steward_tests::rule_model`]) as a process, so that programs
//! outside this workspace (the peer agent frameworks of `bench/`) can be measured against the
//! very same model server. Prints `rule model: <base url>` (the URL includes `/v1`, as
//! `OPENAI_BASE_URL` expects) and serves until SIGINT or SIGTERM.
//!
//! `--delay-ms N` makes every answer wait N ms first (a model that takes its time).

use std::time::Duration;

use anyhow::{Context, bail};
use steward_tests::rule_model::{RuleModel, RuleOptions};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut options = RuleOptions::default();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--delay-ms" => {
                let ms: u64 = value.parse().with_context(|| {
                    format!("--delay-ms wants whole milliseconds, not {value:?}")
                })?;
                let d = Duration::from_millis(ms);
                options.delay = Some((d, d));
            }
            other => bail!("unknown flag {other}; use [--delay-ms N]"),
        }
    }
    let model = RuleModel::start_with(options).await;
    println!("rule model: {}", model.url);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(())
}
