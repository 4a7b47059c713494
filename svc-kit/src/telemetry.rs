//! Structured logs and traces. JSON lines by default (what log pipelines in Kubernetes expect);
//! `LOG_FORMAT=pretty` for humans at a terminal. `RUST_LOG` filters as usual.
//!
//! Traces (O-2): when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, spans are exported over OTLP
//! (HTTP/protobuf to `<endpoint>/v1/traces`, batched; the standard `OTEL_*` variables tune it)
//! and W3C trace context is propagated: agent-svc injects it into its gRPC metadata to
//! gateway-svc, and both servers continue the caller's trace (see `metrics::GrpcMetricsLayer`),
//! so one trace shows a run's model calls and its tool calls on the gateway.

use std::sync::OnceLock;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::{EnvFilter, fmt, prelude::*};

use crate::json_log::{JsonLines, JsonSpanFields};

static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// Keeps the log writer's thread: log lines are queued by the threads that log them and
/// written by that one thread, so a slow reader of stderr (a full pipe, a busy node agent)
/// never blocks a tokio worker in write(2), and lines that come together go out in one write.
/// Dropping it writes out what is still queued; hold it for the life of the process.
#[must_use = "hold it until the process ends: dropping it stops the log writer"]
pub struct Logs {
    _writer: Option<tracing_appender::non_blocking::WorkerGuard>,
}

/// Lines the log queue holds before a thread that logs waits for the writer (never dropped:
/// a log line is evidence). The queue's slots are allocated and touched up front (~32 bytes
/// each), so this is not tracing-appender's default of 128K lines (4 MiB of resident memory).
const LOG_QUEUE_LINES: usize = 8 * 1024;

/// Installs the global subscriber once; later calls (e.g. from tests) are no-ops and return
/// a guard that holds nothing.
pub fn init(service: &'static str) -> Logs {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let pretty = std::env::var("LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("pretty"));
    let traces = otlp_tracer(service).map(|t| tracing_opentelemetry::layer().with_tracer(t));
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(false)
        .buffered_lines_limit(LOG_QUEUE_LINES)
        .thread_name("logs")
        .finish(std::io::BufWriter::new(std::io::stderr()));
    let registry = tracing_subscriber::registry().with(filter).with(traces);
    let installed = if pretty {
        registry.with(fmt::layer().with_writer(writer)).try_init()
    } else {
        registry
            .with(
                fmt::layer()
                    .fmt_fields(JsonSpanFields)
                    .event_format(JsonLines)
                    .with_ansi(false)
                    .with_writer(writer),
            )
            .try_init()
    };
    if installed.is_err() {
        return Logs { _writer: None };
    }
    tracing::info!(
        service,
        version = env!("CARGO_PKG_VERSION"),
        traces = PROVIDER.get().is_some(),
        "logging initialised"
    );
    Logs {
        _writer: Some(guard),
    }
}

/// The OTLP tracer, when `OTEL_EXPORTER_OTLP_ENDPOINT` asks for one.
fn otlp_tracer(service: &'static str) -> Option<opentelemetry_sdk::trace::Tracer> {
    std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
        .ok()
        .filter(|e| !e.trim().is_empty())?;
    // The exporter reads OTEL_EXPORTER_OTLP_ENDPOINT itself and appends /v1/traces.
    let exporter = match opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
    {
        Ok(e) => e,
        Err(e) => {
            eprintln!(
                "{service}: OTEL_EXPORTER_OTLP_ENDPOINT is set but the exporter cannot start: {e}"
            );
            return None;
        }
    };
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(service)
                .build(),
        )
        .build();
    opentelemetry::global::set_text_map_propagator(
        opentelemetry_sdk::propagation::TraceContextPropagator::new(),
    );
    let tracer = provider.tracer(service);
    let _ = PROVIDER.set(provider);
    Some(tracer)
}

/// Flushes and stops the trace exporter (at the end of the process).
pub fn shutdown() {
    if let Some(provider) = PROVIDER.get()
        && let Err(e) = provider.shutdown()
    {
        eprintln!("traces could not be flushed at shutdown: {e}");
    }
}

/// Adds the current span's W3C trace context to outgoing gRPC metadata.
pub fn inject(metadata: &mut tonic::metadata::MetadataMap) {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let context = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|p| {
        p.inject_context(&context, &mut MetadataInjector(metadata))
    });
}

/// Continues the caller's trace (W3C `traceparent` in the request headers) in `span`, and
/// records the trace id in the span's `trace_id` field (declared `Empty`), so JSON log lines
/// inside it carry it.
pub fn continue_trace(span: &tracing::Span, headers: &http::HeaderMap) {
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let parent =
        opentelemetry::global::get_text_map_propagator(|p| p.extract(&HeaderExtractor(headers)));
    let _ = span.set_parent(parent);
    record_trace_id(span);
}

/// Writes `span`'s trace id (when traces are on) into its `trace_id` field.
pub fn record_trace_id(span: &tracing::Span) {
    use opentelemetry::trace::TraceContextExt;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    if PROVIDER.get().is_none() {
        return;
    }
    let id = span.context().span().span_context().trace_id();
    if id != opentelemetry::trace::TraceId::INVALID {
        span.record("trace_id", tracing::field::display(id));
    }
}

struct MetadataInjector<'a>(&'a mut tonic::metadata::MetadataMap);

impl opentelemetry::propagation::Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(k), Ok(v)) = (
            tonic::metadata::MetadataKey::from_bytes(key.as_bytes()),
            tonic::metadata::MetadataValue::try_from(value.as_str()),
        ) {
            self.0.insert(k, v);
        }
    }
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl opentelemetry::propagation::Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}
