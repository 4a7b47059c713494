//! Gemini's `streamGenerateContent?alt=sse`, as scripted answers: GenerateContentResponse
//! chunks with text, thought and functionCall parts, usageMetadata, and a finishReason on the
//! last chunk (no terminator event).

use serde_json::{Value, json};

use super::model_server::{ModelServer, Prepared, frames};

pub async fn start(answers: Vec<Prepared>) -> ModelServer {
    ModelServer::start("/v1beta/models/{call}", answers).await
}

fn chunk(parts: Value, finish: Option<&str>) -> (Option<&'static str>, Value) {
    let mut candidate = json!({"content": {"role": "model", "parts": parts}, "index": 0});
    if let Some(f) = finish {
        candidate["finishReason"] = json!(f);
    }
    (
        None,
        json!({"candidates": [candidate],
                  "usageMetadata": {"promptTokenCount": 80, "candidatesTokenCount": 9, "cachedContentTokenCount": 64, "totalTokenCount": 89}}),
    )
}

pub fn text(text: &str) -> Prepared {
    let mut e = vec![chunk(
        json!([{"text": "Considering the request.", "thought": true}]),
        None,
    )];
    let words: Vec<&str> = text.split_inclusive(' ').collect();
    for (i, w) in words.iter().enumerate() {
        e.push(chunk(
            json!([{ "text": w }]),
            (i + 1 == words.len()).then_some("STOP"),
        ));
    }
    Prepared::Sse {
        body: frames(&e),
        chunk: 17,
    }
}

pub fn function_calls(calls: &[(&str, Value)]) -> Prepared {
    let parts: Vec<Value> = calls
        .iter()
        .map(|(name, args)| json!({"functionCall": {"name": name, "args": args}}))
        .collect();
    Prepared::Sse {
        body: frames(&[chunk(Value::Array(parts), Some("STOP"))]),
        chunk: 10,
    }
}

pub fn error(status: u16) -> Prepared {
    let s = if status == 429 {
        "RESOURCE_EXHAUSTED"
    } else {
        "INTERNAL"
    };
    Prepared::Error {
        status,
        retry_after: None,
        body:
            json!({"error": {"code": status, "message": format!("scripted {status}"), "status": s}})
                .to_string(),
    }
}
