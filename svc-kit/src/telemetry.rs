//! Structured logs. JSON lines by default (what log pipelines in Kubernetes expect);
//! `LOG_FORMAT=pretty` for humans at a terminal. `RUST_LOG` filters as usual.

use tracing_subscriber::{EnvFilter, fmt, prelude::*};

/// Installs the global subscriber once; later calls (e.g. from tests) are no-ops.
pub fn init(service: &str) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let pretty = std::env::var("LOG_FORMAT").is_ok_and(|v| v.eq_ignore_ascii_case("pretty"));
    let registry = tracing_subscriber::registry().with(filter);
    let installed = if pretty {
        registry
            .with(fmt::layer().with_writer(std::io::stderr))
            .try_init()
    } else {
        registry
            .with(
                fmt::layer()
                    .json()
                    .flatten_event(true)
                    .with_current_span(true)
                    .with_writer(std::io::stderr),
            )
            .try_init()
    };
    if installed.is_ok() {
        tracing::info!(
            service,
            version = env!("CARGO_PKG_VERSION"),
            "logging initialised"
        );
    }
}
