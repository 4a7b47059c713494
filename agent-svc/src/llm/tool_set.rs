//! A run's tool declarations, prepared once per tool set (issue 13): each provider's wire form
//! is serialised once and the declarations are token-counted once per tokenizer, then shared by
//! every model call of every run that offers the same set. Before this, each model call cloned
//! the schemas three times, rebuilt them as JSON and re-encoded them with tiktoken — the largest
//! share of agent CPU per run.

use std::{
    collections::HashMap,
    hash::{Hash, Hasher},
    sync::{Arc, LazyLock, Mutex, OnceLock},
};

use serde_json::{Value, json};

use super::ToolDecl;

/// Tool sets kept for reuse across runs. Users with the same integrations share one set, so a
/// few hundred covers every combination in practice; past that the cache starts over.
const SHARED_SETS: usize = 256;

/// Tokenizers a set is counted with (see `executor::budget::TokenCounter`).
pub const COUNTERS: usize = 3;

#[derive(Debug, Default)]
pub struct ToolSet {
    decls: Vec<ToolDecl>,
    tokens: [OnceLock<usize>; COUNTERS],
    openai: OnceLock<String>,
    /// Without and with a cache breakpoint on the last tool.
    anthropic: [OnceLock<String>; 2],
    gemini: OnceLock<String>,
}

impl PartialEq for ToolSet {
    fn eq(&self, other: &Self) -> bool {
        self.decls == other.decls
    }
}

impl std::ops::Deref for ToolSet {
    type Target = [ToolDecl];

    fn deref(&self) -> &[ToolDecl] {
        &self.decls
    }
}

impl ToolSet {
    /// A set of its own, not shared (tests, one-off requests).
    pub fn new(decls: Vec<ToolDecl>) -> Self {
        Self {
            decls,
            ..Self::default()
        }
    }

    /// No tools: the model must answer in text.
    pub fn none() -> Arc<ToolSet> {
        static NONE: LazyLock<Arc<ToolSet>> = LazyLock::new(Arc::default);
        NONE.clone()
    }

    /// The shared set equal to `decls`, prepared by an earlier run when there was one.
    pub fn shared(decls: Vec<ToolDecl>) -> Arc<ToolSet> {
        static SETS: LazyLock<Mutex<HashMap<u64, Arc<ToolSet>>>> = LazyLock::new(Mutex::default);
        let key = fingerprint(&decls);
        let mut sets = SETS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(set) = sets.get(&key)
            && set.decls == decls
        {
            return set.clone();
        }
        if sets.len() >= SHARED_SETS {
            sets.clear();
        }
        let set = Arc::new(ToolSet::new(decls));
        sets.insert(key, set.clone());
        set
    }

    /// The set's tokens under tokenizer `slot`, counted by `count` the first time.
    pub fn tokens(&self, slot: usize, count: impl FnOnce(&str) -> usize) -> usize {
        *self.tokens[slot % COUNTERS].get_or_init(|| {
            let measured: Vec<Value> = self
                .decls
                .iter()
                .map(|t| json!({"name": t.name, "description": t.description, "parameters": t.parameters}))
                .collect();
            count(&Value::Array(measured).to_string())
        })
    }

    /// OpenAI Chat Completions `tools`, as JSON text.
    pub fn openai_wire(&self) -> &str {
        self.openai.get_or_init(|| {
            let tools: Vec<Value> = self
                .decls
                .iter()
                .map(|t| json!({"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}))
                .collect();
            Value::Array(tools).to_string()
        })
    }

    /// Anthropic Messages `tools`, as JSON text. With `cache` the last tool carries a cache
    /// breakpoint, so the declarations are read from the provider's prompt cache after the
    /// first call (they come first in the prompt, before the system text).
    pub fn anthropic_wire(&self, cache: bool) -> &str {
        self.anthropic[usize::from(cache)].get_or_init(|| {
            let mut tools: Vec<Value> = self
                .decls
                .iter()
                .map(|t| json!({"name": t.name, "description": t.description, "input_schema": t.parameters}))
                .collect();
            if let Some(last) = tools.last_mut().filter(|_| cache) {
                last["cache_control"] = json!({"type": "ephemeral"});
            }
            Value::Array(tools).to_string()
        })
    }

    /// Gemini `tools`, as JSON text.
    pub fn gemini_wire(&self) -> &str {
        self.gemini.get_or_init(|| {
            let declarations: Vec<Value> = self
                .decls
                .iter()
                .map(|t| json!({"name": t.name, "description": t.description, "parametersJsonSchema": t.parameters}))
                .collect();
            json!([{ "functionDeclarations": declarations }]).to_string()
        })
    }
}

/// `body` serialised with `tools` (JSON text) as its `tools` member, without rebuilding the
/// tools as values: the object's closing brace is replaced by the member.
///
/// The body is written into a per-thread scratch buffer first and then copied once into a
/// buffer of exactly its final size: the request body lives until the model's response
/// begins, and a buffer grown by doubling held up to twice its length, for every run in
/// flight, in pages each growth faulted in (issue 13).
pub fn encode_with_tools(body: &impl serde::Serialize, tools: Option<&str>) -> Vec<u8> {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    /// A body bigger than this is not kept as the next call's scratch space.
    const KEEP: usize = 256 * 1024;
    SCRATCH.with(|scratch| {
        let Ok(mut scratch) = scratch.try_borrow_mut() else {
            return join(
                &serde_json::to_vec(body).unwrap_or_else(|_| b"{}".to_vec()),
                tools,
            );
        };
        scratch.clear();
        if serde_json::to_writer(&mut *scratch, body).is_err() {
            scratch.clear();
            scratch.extend_from_slice(b"{}");
        }
        let out = join(&scratch, tools);
        if scratch.capacity() > KEEP {
            *scratch = Vec::new();
        }
        out
    })
}

/// `body` (a serialised object) with `tools` as its last member, in a buffer of exact size.
fn join(body: &[u8], tools: Option<&str>) -> Vec<u8> {
    let Some(tools) = tools.filter(|_| body.last() == Some(&b'}')) else {
        return body.to_vec();
    };
    let head = &body[..body.len() - 1];
    let mut out = Vec::with_capacity(head.len() + tools.len() + 10);
    out.extend_from_slice(head);
    if head.len() > 1 {
        out.push(b',');
    }
    out.extend_from_slice(b"\"tools\":");
    out.extend_from_slice(tools.as_bytes());
    out.push(b'}');
    out
}

fn fingerprint(decls: &[ToolDecl]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for d in decls {
        d.name.hash(&mut h);
        d.description.hash(&mut h);
        hash_value(&d.parameters, &mut h);
    }
    h.finish()
}

/// Hashes a JSON value by walking it, without serialising it.
fn hash_value(v: &Value, h: &mut impl Hasher) {
    match v {
        Value::Null => 0u8.hash(h),
        Value::Bool(b) => (1u8, b).hash(h),
        Value::Number(n) => (2u8, n.to_string()).hash(h),
        Value::String(s) => (3u8, s).hash(h),
        Value::Array(items) => {
            (4u8, items.len()).hash(h);
            items.iter().for_each(|i| hash_value(i, h));
        }
        Value::Object(map) => {
            (5u8, map.len()).hash(h);
            for (k, v) in map {
                k.hash(h);
                hash_value(v, h);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn decl(name: &str) -> ToolDecl {
        ToolDecl {
            name: name.into(),
            description: format!("does {name}"),
            parameters: json!({"type": "object", "properties": {"q": {"type": "string"}}}),
        }
    }

    #[test]
    fn equal_sets_are_shared_and_different_sets_are_not() {
        let a = ToolSet::shared(vec![decl("x"), decl("y")]);
        let b = ToolSet::shared(vec![decl("x"), decl("y")]);
        let c = ToolSet::shared(vec![decl("x")]);
        assert!(
            Arc::ptr_eq(&a, &b),
            "one prepared set for equal declarations"
        );
        assert!(!Arc::ptr_eq(&a, &c));
        let mut changed = decl("y");
        changed.parameters["properties"]["q"]["type"] = json!("integer");
        let d = ToolSet::shared(vec![decl("x"), changed]);
        assert!(!Arc::ptr_eq(&a, &d), "a changed schema is a different set");
    }

    #[test]
    fn tokens_are_counted_once_per_tokenizer() {
        let set = ToolSet::new(vec![decl("x")]);
        let mut counted = 0;
        for _ in 0..3 {
            set.tokens(0, |s| {
                counted += 1;
                s.len()
            });
        }
        assert_eq!(counted, 1);
    }

    #[test]
    fn tools_are_spliced_into_the_body_as_valid_json() {
        let set = ToolSet::new(vec![decl("x"), decl("y")]);
        let body = json!({"model": "m", "stream": true});
        let bytes = encode_with_tools(&body, Some(set.openai_wire()));
        let parsed: Value = serde_json::from_slice(&bytes).expect("valid JSON");
        assert_eq!(parsed["model"], "m");
        assert_eq!(parsed["tools"][1]["function"]["name"], "y");
        let empty = encode_with_tools(&json!({}), Some("[]"));
        assert_eq!(
            serde_json::from_slice::<Value>(&empty).expect("valid"),
            json!({"tools": []})
        );
        assert_eq!(
            serde_json::from_slice::<Value>(&encode_with_tools(&body, None)).expect("valid"),
            body
        );
    }

    #[test]
    fn anthropic_tools_end_with_a_cache_breakpoint() {
        let set = ToolSet::new(vec![decl("x"), decl("y")]);
        let tools: Value = serde_json::from_str(set.anthropic_wire(true)).expect("valid");
        assert!(tools[0].get("cache_control").is_none());
        assert_eq!(tools[1]["cache_control"]["type"], "ephemeral");
        let plain: Value = serde_json::from_str(set.anthropic_wire(false)).expect("valid");
        assert!(plain[1].get("cache_control").is_none());
    }
}
