//! The demo upstreams of `./deploy/local/run.sh --demo` as a process: starts fake Gmail,
//! Calendar and Slack on loopback, writes the gateway settings that point at them to the file
//! named by `--env-file` (KEY=value lines), waits for gateway-svc at `--gateway` to serve,
//! connects the demo accounts of `--user`, then reports each message the fake Gmail sends or
//! drafts until SIGINT or SIGTERM. The service secret comes from `GATEWAY_SERVICE_TOKEN`.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use steward_tests::{demo::Demo, gateway_with_token};
use tonic::transport::Channel;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

/// How long gateway-svc may take to start (it may still be compiling nothing, but migrating).
const GATEWAY_START: Duration = Duration::from_secs(120);

struct Args {
    env_file: String,
    gateway: String,
    user: String,
}

fn args() -> anyhow::Result<Args> {
    let mut env_file = None;
    let mut gateway = "http://127.0.0.1:50052".to_owned();
    let mut user = "me".to_owned();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--env-file" => env_file = Some(value),
            "--gateway" => gateway = value,
            "--user" => user = value,
            other => bail!("unknown flag {other}; use --env-file PATH [--gateway URL] [--user ID]"),
        }
    }
    Ok(Args {
        env_file: env_file.context("--env-file PATH is required")?,
        gateway,
        user,
    })
}

/// A channel to gateway-svc once its health says SERVING (it starts after this process).
async fn serving_gateway(url: &str) -> anyhow::Result<Channel> {
    let endpoint = Channel::from_shared(url.to_owned()).context("--gateway is not a URL")?;
    let deadline = Instant::now() + GATEWAY_START;
    loop {
        if let Ok(channel) = endpoint.connect().await {
            let status = HealthClient::new(channel.clone())
                .check(HealthCheckRequest::default())
                .await
                .map(|r| r.into_inner().status());
            if status.is_ok_and(|s| s == ServingStatus::Serving) {
                return Ok(channel);
            }
        }
        if Instant::now() > deadline {
            bail!("gateway-svc at {url} did not serve within {GATEWAY_START:?}");
        }
        // A start-up wait for another process, not a test synchronisation.
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = args()?;
    let token = std::env::var("GATEWAY_SERVICE_TOKEN")
        .context("GATEWAY_SERVICE_TOKEN must be set to the gateway's service secret")?;
    let demo = Demo::start().await;
    let lines: String = demo
        .env()
        .iter()
        .map(|(k, v)| format!("{k}={v}\n"))
        .collect();
    // Written whole, then renamed: the runner reads it as soon as it is there.
    let partial = format!("{}.partial", args.env_file);
    std::fs::write(&partial, lines).with_context(|| format!("write {partial}"))?;
    std::fs::rename(&partial, &args.env_file)
        .with_context(|| format!("rename {partial} to {}", args.env_file))?;
    println!("demo upstreams: settings written to {}", args.env_file);

    let channel = serving_gateway(&args.gateway).await?;
    demo.connect(&mut gateway_with_token(channel, &args.user, &token))
        .await;
    println!(
        "demo upstreams: Gmail {}, Calendar {}, Slack {}; user {:?} has {} connected to all three",
        demo.gmail.url,
        demo.calendar.url,
        demo.slack.url,
        args.user,
        steward_tests::demo::ADDRESS
    );

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    let mut reported = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return Ok(()),
            _ = term.recv() => return Ok(()),
            _ = tick.tick() => {
                let sent = demo.sent_to();
                for to in &sent[reported..] {
                    println!("demo Gmail: a message to {to} was sent (or saved as a draft)");
                }
                reported = sent.len();
            }
        }
    }
}
