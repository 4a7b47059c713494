//! The gRPC serving loop both services use: a tonic server over a pre-bound listener (so tests
//! can bind port 0 and read the address first), health and reflection mounted beside the
//! service, and a graceful drain bounded by a deadline.

use std::{future::Future, time::Duration};

use tokio::net::TcpListener;
use tonic::{
    service::Routes,
    transport::{Server, server::TcpIncoming},
};

use crate::health::Readiness;

/// Limits and timings of the transport, from each service's config.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// How long in-flight calls and streams may take to finish after a shutdown signal.
    pub drain_timeout: Duration,
    /// HTTP/2 keepalive pings keep idle streams (RunStream, Execute) alive through proxies and
    /// detect dead peers.
    pub keepalive_interval: Duration,
    /// After this a connection is sent GOAWAY, so clients reconnect and rebalance across pods.
    pub max_connection_age: Duration,
    /// How long calls on an aged connection may still take before it is closed.
    pub max_connection_age_grace: Duration,
    /// TLS (and mTLS with a client CA) on the listener; `None` serves plaintext.
    pub tls: Option<crate::tls::ServerTls>,
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot build the reflection service: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("gRPC transport failed: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// The services every Steward process serves beside its own.
pub const COMMON_SERVICES: [&str; 3] = [
    "grpc.health.v1.Health",
    "grpc.reflection.v1.ServerReflection",
    "grpc.reflection.v1alpha.ServerReflection",
];

/// The token of an `authorization` value in the Bearer scheme, whose name is
/// case-insensitive (RFC 7235): `bearer` is as good as `Bearer`. None for any other scheme.
pub fn bearer_token(authorization: &str) -> Option<&str> {
    let (scheme, token) = authorization.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_start())
}

/// Health and reflection (v1 and v1alpha, since grpcurl 1.8 speaks v1alpha) for the Steward
/// contracts and the health protocol, so grpcurl works with no proto files at hand. Only
/// `service_name` and the common services are advertised: the descriptor set holds both
/// services' contracts, but a process lists only what it answers (O-5).
pub fn with_reflection(routes: Routes, service_name: &str) -> Result<Routes, ServeError> {
    let names = || std::iter::once(service_name).chain(COMMON_SERVICES);
    let mut v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(steward_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
    let mut v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(steward_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET);
    for name in names() {
        v1 = v1.with_service_name(name);
        v1alpha = v1alpha.with_service_name(name);
    }
    Ok(routes
        .add_service(v1.build_v1()?)
        .add_service(v1alpha.build_v1alpha()?))
}

/// Serves `routes` on `listener` until `shutdown` resolves, then reports NOT_SERVING, stops
/// accepting, and waits at most `drain_timeout` for in-flight calls before returning.
pub async fn serve(
    listener: TcpListener,
    routes: Routes,
    readiness: Readiness,
    options: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let incoming = TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(options.keepalive_interval));
    let (drain_started_tx, drain_started) = tokio::sync::oneshot::channel::<()>();
    let signal = {
        let readiness = readiness.clone();
        async move {
            shutdown.await;
            readiness.stop().await;
            let _ = drain_started_tx.send(());
        }
    };
    let mut builder = Server::builder();
    if let Some(tls) = &options.tls {
        builder = builder.tls_config(tls.tonic_config())?;
    }
    let server = builder
        .http2_keepalive_interval(Some(options.keepalive_interval))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .max_connection_age(options.max_connection_age)
        .max_connection_age_grace(options.max_connection_age_grace)
        .layer(crate::metrics::GrpcMetricsLayer)
        .add_routes(routes)
        .serve_with_incoming_shutdown(incoming, signal);
    tokio::pin!(server);

    let drain_deadline = async {
        if drain_started.await.is_err() {
            // The server ended on its own; nothing to bound.
            return std::future::pending().await;
        }
        tokio::time::sleep(options.drain_timeout).await;
    };
    tokio::select! {
        result = &mut server => {
            tracing::info!("server stopped");
            result.map_err(ServeError::from)
        }
        () = drain_deadline => {
            tracing::warn!(
                drain_timeout = ?options.drain_timeout,
                "drain deadline passed with calls still open; closing them"
            );
            Ok(())
        }
    }
}

/// Runs one service to completion: mounts health (NOT_SERVING until `probe` first passes) and
/// reflection beside `service_routes`, keeps probing every `config.health_probe_interval`, and
/// serves until `shutdown`, draining within `config.serve.drain_timeout`.
pub async fn run<F, Fut, E>(
    listener: TcpListener,
    service_name: &'static str,
    service_routes: Routes,
    config: &crate::server_config::ServerConfig,
    metrics: Option<crate::metrics::Endpoint>,
    probe: F,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = Result<(), E>> + Send,
    E: std::fmt::Display,
{
    let (readiness, health) = Readiness::new(&[service_name]).await;
    let routes = with_reflection(service_routes.add_service(health), service_name)?;
    let probe_task = readiness.spawn_probe(config.health_probe_interval, probe);
    let metrics_task = metrics.map(crate::metrics::Endpoint::serve);
    let result = serve(listener, routes, readiness, config.serve.clone(), shutdown).await;
    probe_task.abort();
    if let Some(task) = metrics_task {
        task.abort();
    }
    result
}
