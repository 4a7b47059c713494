//! Prometheus metrics and per-RPC trace spans (O-2). One recorder per process (the `metrics` facade is global), served
//! as text on `METRICS_LISTEN_ADDR` at `/metrics`; off when that is unset. RPC counts and
//! latencies come from [`GrpcMetricsLayer`] on the server, not from handlers; the services
//! record their own domain series with the `metrics` macros where the event happens.

use std::{
    future::Future,
    net::SocketAddr,
    pin::Pin,
    sync::OnceLock,
    task::{Context, Poll, ready},
    time::{Duration, Instant},
};

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::net::TcpListener;

/// Latency buckets in seconds: from a cached tool call to a ten-minute run.
const SECONDS_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
];

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// The process's recorder, installed on first use. Several services in one process (tests)
/// share it, as they share the `metrics` facade.
pub fn recorder() -> PrometheusHandle {
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
                .expect("the bucket list is not empty")
                .build_recorder();
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics may be empty");
            }
            handle
        })
        .clone()
}

/// A bound metrics listener, served by [`Endpoint::serve`].
pub struct Endpoint {
    listener: TcpListener,
}

impl Endpoint {
    /// Binds `addr` (at build time, so a bad address stops the start and port 0 can be read).
    pub async fn bind(addr: Option<SocketAddr>) -> std::io::Result<Option<Self>> {
        match addr {
            None => Ok(None),
            Some(addr) => {
                let listener = TcpListener::bind(addr).await?;
                if let Ok(bound) = listener.local_addr() {
                    tracing::info!(metrics_addr = %bound, "metrics endpoint bound at /metrics");
                }
                Ok(Some(Self { listener }))
            }
        }
    }

    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Serves `GET /metrics` until the task is dropped or aborted.
    pub fn serve(self) -> tokio::task::JoinHandle<()> {
        let handle = recorder();
        let upkeep = handle.clone();
        tokio::spawn(async move {
            // Histograms are drained by upkeep; render does it too, this keeps memory flat
            // between scrapes.
            let keeper = tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(5));
                loop {
                    tick.tick().await;
                    upkeep.run_upkeep();
                }
            });
            let app = axum::Router::new().route(
                "/metrics",
                axum::routing::get(move || {
                    let handle = handle.clone();
                    async move {
                        handle.run_upkeep();
                        (
                            [("content-type", "text/plain; version=0.0.4")],
                            handle.render(),
                        )
                    }
                }),
            );
            if let Err(e) = axum::serve(self.listener, app).await {
                tracing::error!(error = %e, "the metrics endpoint stopped");
            }
            keeper.abort();
        })
    }
}

/// Counts and times every RPC by service, method and gRPC status code:
/// `grpc_server_handled_total` and `grpc_server_handling_seconds`. A stream is timed to its
/// end; its code is read from the trailers (or the headers of a trailers-only response).
#[derive(Debug, Clone, Copy, Default)]
pub struct GrpcMetricsLayer;

impl<S> tower_layer::Layer<S> for GrpcMetricsLayer {
    type Service = GrpcMetrics<S>;

    fn layer(&self, inner: S) -> Self::Service {
        GrpcMetrics { inner }
    }
}

#[derive(Debug, Clone)]
pub struct GrpcMetrics<S> {
    inner: S,
}

/// Service and method of a gRPC path `/pkg.Service/Method`.
fn labels(path: &str) -> (String, String) {
    let mut parts = path.trim_start_matches('/').splitn(2, '/');
    let service = parts.next().unwrap_or_default().to_owned();
    let method = parts.next().unwrap_or_default().to_owned();
    (service, method)
}

fn code_name(value: Option<&http::HeaderValue>) -> Option<String> {
    let n: i32 = value?.to_str().ok()?.parse().ok()?;
    Some(format!("{:?}", tonic::Code::from_i32(n)))
}

/// What is recorded once per call.
struct Call {
    service: String,
    method: String,
    started: Instant,
}

impl Call {
    fn record(self, code: &str) {
        let (service, method) = (self.service, self.method);
        metrics::counter!("grpc_server_handled_total", "grpc_service" => service.clone(),
            "grpc_method" => method.clone(), "grpc_code" => code.to_owned())
        .increment(1);
        metrics::histogram!("grpc_server_handling_seconds", "grpc_service" => service,
            "grpc_method" => method)
        .record(self.started.elapsed().as_secs_f64());
    }
}

impl<S, ReqBody, ResBody> tower_service::Service<http::Request<ReqBody>> for GrpcMetrics<S>
where
    S: tower_service::Service<http::Request<ReqBody>, Response = http::Response<ResBody>>,
{
    type Response = http::Response<MeteredBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<tracing::instrument::Instrumented<S::Future>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<ReqBody>) -> Self::Future {
        let (service, method) = labels(request.uri().path());
        // Each RPC is a span, continuing the caller's trace when it sent one (traceparent).
        let span = tracing::info_span!(
            "grpc",
            otel.name = %format!("{service}/{method}"),
            otel.kind = "server",
            rpc.service = %service,
            rpc.method = %method,
            trace_id = tracing::field::Empty,
        );
        crate::telemetry::continue_trace(&span, request.headers());
        let inner = {
            let _entered = span.enter();
            self.inner.call(request)
        };
        ResponseFuture {
            inner: tracing::Instrument::instrument(inner, span),
            call: Some(Call {
                service,
                method,
                started: Instant::now(),
            }),
        }
    }
}

pin_project_lite::pin_project! {
    pub struct ResponseFuture<F> {
        #[pin]
        inner: F,
        call: Option<Call>,
    }
}

impl<F, B, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<http::Response<B>, E>>,
{
    type Output = Result<http::Response<MeteredBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        match ready!(this.inner.poll(cx)) {
            Ok(response) => {
                // A trailers-only response (most errors) carries its status in the headers.
                let code = code_name(response.headers().get("grpc-status"));
                let call = this.call.take();
                Poll::Ready(Ok(response.map(|inner| MeteredBody { inner, call, code })))
            }
            Err(e) => {
                if let Some(call) = this.call.take() {
                    call.record("TransportError");
                }
                Poll::Ready(Err(e))
            }
        }
    }
}

pin_project_lite::pin_project! {
    /// The response body, recording the call when it ends (or is dropped: the client left).
    pub struct MeteredBody<B> {
        #[pin]
        inner: B,
        call: Option<Call>,
        code: Option<String>,
    }

    impl<B> PinnedDrop for MeteredBody<B> {
        fn drop(this: Pin<&mut Self>) {
            let this = this.project();
            if let Some(call) = this.call.take() {
                call.record(this.code.as_deref().unwrap_or("Cancelled"));
            }
        }
    }
}

impl<B: http_body::Body> http_body::Body for MeteredBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let this = self.project();
        let frame = ready!(this.inner.poll_frame(cx));
        match &frame {
            Some(Ok(f)) => {
                if let Some(trailers) = f.trailers_ref()
                    && let Some(code) = code_name(trailers.get("grpc-status"))
                {
                    *this.code = Some(code);
                }
            }
            Some(Err(_)) => *this.code = Some("TransportError".into()),
            None => {
                if let Some(call) = this.call.take() {
                    call.record(this.code.as_deref().unwrap_or("Ok"));
                }
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_codes_become_labels() {
        assert_eq!(
            labels("/steward.agent.v1.AgentService/RunStream"),
            ("steward.agent.v1.AgentService".into(), "RunStream".into())
        );
        assert_eq!(
            code_name(Some(&http::HeaderValue::from_static("5"))).as_deref(),
            Some("NotFound")
        );
        assert_eq!(code_name(Some(&http::HeaderValue::from_static("x"))), None);
    }
}
