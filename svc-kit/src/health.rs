//! Readiness as the gRPC health service reports it. Everything starts NOT_SERVING; a probe loop
//! flips the overall status ("") and each named service to SERVING only while the service's own
//! check (its store answering) passes, and back when it fails. Shutdown sets NOT_SERVING first so
//! load balancers stop routing before the drain.

use std::{future::Future, sync::Arc, time::Duration};

use tokio::sync::watch;
use tonic_health::{ServingStatus, server::HealthReporter};

/// The health name liveness probes ask for: SERVING for as long as the process answers, whatever
/// its store says and through its drain. A liveness probe that read readiness would restart every
/// pod while the database is down; one that only opened a TCP connection would pass a process
/// whose runtime is wedged (the kernel accepts connections for it).
pub const LIVENESS: &str = "liveness";

/// The health state of one process, shared by the probe loop and the shutdown path.
#[derive(Clone)]
pub struct Readiness {
    reporter: HealthReporter,
    services: Arc<[&'static str]>,
    stopping: watch::Sender<bool>,
}

impl Readiness {
    /// Creates the reporter and the health service to mount, with every status NOT_SERVING.
    pub async fn new(
        services: &[&'static str],
    ) -> (
        Self,
        tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
    ) {
        let (reporter, service) = tonic_health::server::health_reporter();
        let (stopping, _) = watch::channel(false);
        let readiness = Self {
            reporter,
            services: services.into(),
            stopping,
        };
        readiness.set(false).await;
        readiness
            .reporter
            .set_service_status(LIVENESS, ServingStatus::Serving)
            .await;
        (readiness, service)
    }

    async fn set(&self, serving: bool) {
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        self.reporter.set_service_status("", status).await;
        for name in self.services.iter() {
            self.reporter.set_service_status(*name, status).await;
        }
    }

    /// Marks the process as going away: NOT_SERVING from now on, whatever the probe says.
    pub async fn stop(&self) {
        self.stopping.send_replace(true);
        self.set(false).await;
    }

    /// Runs `probe` now and then every `interval` until [`Readiness::stop`], reporting SERVING
    /// exactly while it succeeds. Transitions are logged once, not on every tick.
    pub fn spawn_probe<F, Fut, E>(
        &self,
        interval: Duration,
        probe: F,
    ) -> tokio::task::JoinHandle<()>
    where
        F: Fn() -> Fut + Send + 'static,
        Fut: Future<Output = Result<(), E>> + Send,
        E: std::fmt::Display,
    {
        let this = self.clone();
        let mut stopping = self.stopping.subscribe();
        tokio::spawn(async move {
            let mut serving = None;
            loop {
                if *stopping.borrow() {
                    return;
                }
                let ok = match probe().await {
                    Ok(()) => true,
                    Err(e) => {
                        if serving != Some(false) {
                            tracing::error!(error = %e, "readiness probe failed; reporting NOT_SERVING");
                        }
                        false
                    }
                };
                if *stopping.borrow() {
                    return;
                }
                if serving != Some(ok) {
                    if ok {
                        tracing::info!("readiness probe passed; reporting SERVING");
                    }
                    this.set(ok).await;
                    serving = Some(ok);
                }
                tokio::select! {
                    _ = tokio::time::sleep(interval) => {}
                    _ = stopping.changed() => return,
                }
            }
        })
    }
}
