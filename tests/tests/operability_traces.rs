//! One trace spans a run on agent-svc and its tool call on gateway-svc (issue 12, O-2): both
//! services run as real processes exporting OTLP (HTTP/protobuf) to a collector the test
//! serves on loopback, which decodes the real export requests.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use axum::{Router, body::Bytes, extract::State, routing::post};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use prost::Message;
use steward_tests::{
    agent_calls::run_once,
    procs::{Cluster, ClusterOptions},
};

/// (service.name, trace id, span name) of every span received.
type Spans = Arc<Mutex<Vec<(String, Vec<u8>, String)>>>;

async fn export(
    State(spans): State<Spans>,
    body: Bytes,
) -> ([(&'static str, &'static str); 1], Vec<u8>) {
    let request = ExportTraceServiceRequest::decode(body).expect("an OTLP trace export");
    let mut seen = spans.lock().unwrap();
    for resource in request.resource_spans {
        let service = resource
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|a| a.key == "service.name")
            .and_then(|a| a.value.as_ref())
            .map(|v| format!("{:?}", v.value))
            .unwrap_or_default();
        for scope in resource.scope_spans {
            for span in scope.spans {
                seen.push((service.clone(), span.trace_id, span.name));
            }
        }
    }
    (
        [("content-type", "application/x-protobuf")],
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
}

/// Trace id → (service, span name) pairs of that trace.
fn traces(spans: &Spans) -> BTreeMap<Vec<u8>, BTreeSet<(String, String)>> {
    let mut out: BTreeMap<Vec<u8>, BTreeSet<(String, String)>> = BTreeMap::new();
    for (service, trace, name) in spans.lock().unwrap().iter() {
        let service = if service.contains("agent-svc") {
            "agent-svc"
        } else if service.contains("gateway-svc") {
            "gateway-svc"
        } else {
            "other"
        };
        out.entry(trace.clone())
            .or_default()
            .insert((service.to_owned(), name.clone()));
    }
    out
}

#[tokio::test]
async fn o2_one_trace_spans_the_run_on_agent_svc_and_its_tool_call_on_gateway_svc() {
    let spans: Spans = Arc::default();
    let (collector, _) = steward_tests::fakes::serve(
        Router::new()
            .route("/v1/traces", post(export))
            .with_state(spans.clone()),
    )
    .await;
    let otel = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT".to_owned(), collector),
        ("OTEL_BSP_SCHEDULE_DELAY".to_owned(), "100".to_owned()),
    ];
    let cluster = Cluster::start(ClusterOptions {
        agents: 1,
        agent_env: otel.clone(),
        gateway_env: otel,
        ..ClusterOptions::default()
    })
    .await;
    let mut alice = cluster.agent(0, "alice").await;
    let result = run_once(&mut alice, "what tasks do I have?", "")
        .await
        .expect("a run with a tool call");
    assert!(result.error.is_empty(), "{}", result.error);

    // Spans arrive in batches; wait (bounded) for one trace holding both sides.
    let joined = tokio::time::timeout(Duration::from_secs(15), async {
        loop {
            let found = traces(&spans).into_values().find(|t| {
                t.contains(&("agent-svc".to_owned(), "run".to_owned()))
                    && t.contains(&("agent-svc".to_owned(), "iteration".to_owned()))
                    && t.iter().any(|(s, n)| s == "agent-svc" && n == "model_call")
                    && t.iter()
                        .any(|(s, n)| s == "gateway-svc" && n == "tool_call list_tasks")
            });
            if let Some(trace) = found {
                return trace;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("no trace joins both services: {:?}", traces(&spans)));
    assert!(
        joined
            .iter()
            .any(|(s, n)| s == "agent-svc" && n == "steward.agent.v1.AgentService/Run"),
        "the caller's RPC starts the trace: {joined:?}"
    );

    // JSON log lines inside the run carry its ids and the trace id; the gateway's tool call
    // lines carry the same trace id.
    let field = |line: &str, name: &str| -> Option<String> {
        let v: serde_json::Value = serde_json::from_str(line).ok()?;
        v.get("span")
            .and_then(|s| s.get(name))
            .and_then(|f| f.as_str())
            .map(str::to_owned)
    };
    let agent_trace = cluster.agents[0]
        .log()
        .iter()
        .find_map(|l| {
            (field(l, "run_id") == Some(result.run_id.clone()))
                .then(|| field(l, "trace_id"))
                .flatten()
        })
        .expect("a log line of the run with its trace id");
    assert!(
        cluster
            .gateway
            .log()
            .iter()
            .any(|l| l.contains("tool call") && field(l, "trace_id") == Some(agent_trace.clone())),
        "the gateway's tool call log line carries the run's trace id {agent_trace}"
    );
}
