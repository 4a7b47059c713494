//! Process signals: the first SIGTERM or SIGINT starts a graceful drain; a second one exits at
//! once, for an operator who does not want to wait.

use std::future::Future;

/// Installs the handlers now (call it first thing in `main`, so a signal during start-up is not
/// fatal) and returns a future that resolves on the first SIGTERM or SIGINT. After that, the next
/// signal exits the process immediately.
pub fn signal() -> impl Future<Output = ()> + Send + 'static {
    let mut signals = Signals::install();
    async move {
        signals.recv().await;
        tracing::info!("shutdown signal received; draining (send it again to exit at once)");
        tokio::spawn(async move {
            signals.recv().await;
            tracing::warn!("second shutdown signal; exiting without draining");
            std::process::exit(130);
        });
    }
}

struct Signals {
    #[cfg(unix)]
    unix: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
}

impl Signals {
    fn install() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            match (
                signal(SignalKind::terminate()),
                signal(SignalKind::interrupt()),
            ) {
                (Ok(term), Ok(int)) => Self {
                    unix: Some((term, int)),
                },
                _ => {
                    tracing::error!("cannot install signal handlers; falling back to ctrl-c only");
                    Self { unix: None }
                }
            }
        }
        #[cfg(not(unix))]
        {
            Self {}
        }
    }

    async fn recv(&mut self) {
        #[cfg(unix)]
        if let Some((term, int)) = &mut self.unix {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            return;
        }
        let _ = tokio::signal::ctrl_c().await;
    }
}
