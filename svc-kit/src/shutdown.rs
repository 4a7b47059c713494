//! Process signals: the first SIGTERM or SIGINT starts a graceful drain; a second one exits at
//! once, for an operator who does not want to wait.

use std::future::Future;

/// Resolves on the first SIGTERM or SIGINT, and arms a watcher that exits the process on the
/// next one.
pub fn signal() -> impl Future<Output = ()> + Send + 'static {
    async {
        wait_for_signal().await;
        tracing::info!("shutdown signal received; draining (send it again to exit at once)");
        tokio::spawn(async {
            wait_for_signal().await;
            tracing::warn!("second shutdown signal; exiting without draining");
            std::process::exit(130);
        });
    }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match (
            signal(SignalKind::terminate()),
            signal(SignalKind::interrupt()),
        ) {
            (Ok(mut term), Ok(mut int)) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = int.recv() => {}
                }
            }
            _ => {
                tracing::error!("cannot install signal handlers; falling back to ctrl-c only");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
