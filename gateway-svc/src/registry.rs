//! The tool registry (G-1): every tool declares its name, aliases, description, JSON Schema,
//! side-effect flag, integration and upstream cost; the registry compiles each schema once and
//! validates arguments with it before anything else runs (G-3).

use std::{collections::HashMap, sync::Arc};

use serde_json::Value;

use crate::{context::CallContext, domain::Integration, enforce::ToolError};

/// What a tool declares about itself.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub aliases: Vec<String>,
    pub description: String,
    /// JSON Schema of the arguments object.
    pub schema: Value,
    /// Sends, creates or changes something outside Steward. Policy keys off this. A tool
    /// without it may still write Steward's own data (tasks, memories, reminders): whether a
    /// call writes anything at all is [`Tool::read_only`].
    pub side_effect: bool,
    pub integration: Integration,
    /// Upstream API calls one call costs with default arguments.
    pub upstream_cost: u32,
    /// Its output carries words written by others (email, invitations, chat): a run that read
    /// it has seen untrusted content (issue 14).
    pub reads_external_content: bool,
    /// What it stores shows up in later prompts (memories).
    pub writes_memory: bool,
}

impl ToolSpec {
    /// A tool that changes nothing outside Steward (not read-only unless its `Tool` says so,
    /// see [`Tool::read_only`]), with no aliases, costing one upstream call
    /// for integrations with an upstream and none for built-in data; the methods below adjust.
    pub fn new(name: &str, integration: Integration, description: &str, schema: Value) -> Self {
        Self {
            name: name.into(),
            aliases: Vec::new(),
            description: description.into(),
            schema,
            side_effect: false,
            integration,
            upstream_cost: u32::from(integration.provider().is_some()),
            reads_external_content: false,
            writes_memory: false,
        }
    }

    /// Marks the tool's output as someone else's words.
    pub fn reading_external_content(mut self) -> Self {
        self.reads_external_content = true;
        self
    }

    /// Marks the tool as storing what later prompts show.
    pub fn writing_memory(mut self) -> Self {
        self.writes_memory = true;
        self
    }

    /// Marks the tool as acting on the outside world (approval policy keys off this).
    pub fn with_side_effect(mut self) -> Self {
        self.side_effect = true;
        self
    }

    pub fn with_aliases(mut self, aliases: &[&str]) -> Self {
        self.aliases = aliases.iter().map(|a| (*a).to_owned()).collect();
        self
    }

    pub fn with_cost(mut self, upstream_calls: u32) -> Self {
        self.upstream_cost = upstream_calls;
        self
    }
}

/// What a tool produced: text for the model (capped by the engine), optionally a display
/// payload that never goes to the model.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolOutput {
    pub text: String,
    pub display: Option<Value>,
    /// This output carries others' words although the tool does not always (memories taken
    /// from external content); tools flagged `reads_external_content` always do.
    pub external: bool,
}

impl ToolOutput {
    pub fn text(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            display: None,
            external: false,
        }
    }
}

/// What a call would do, resolved as its execution would resolve it, without doing it (P-4,
/// issue 14): the text a person approves, every address it would reach, and a binding — a
/// digest of what was resolved from upstream (not of the arguments, which an approval binds by
/// itself) — that execution can be held to.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Preview {
    pub text: String,
    pub recipients: Vec<String>,
    pub binding: String,
}

/// Longest preview text: enough to decide, never a body dump, with room for every recipient
/// of a message (`gmail`'s recipient budget) besides its sender, subject and first lines.
pub const MAX_PREVIEW_CHARS: usize = 8000;

#[async_trait::async_trait]
pub trait Tool: Send + Sync + 'static {
    fn spec(&self) -> ToolSpec;

    /// The tool only reads: it writes nothing, outside Steward (no side effect) or inside it
    /// (no task, memory, reminder or other stored change). Only such calls' audit records may
    /// be deferred to the batching writer (`crate::audit`); every other call's records are
    /// written before it returns. The default, `false`, is the conservative one: a tool that
    /// does not declare itself read-only is audited synchronously. A read-only tool may not
    /// declare a side effect or memory writes ([`Registry::new`] refuses it).
    fn read_only(&self) -> bool {
        false
    }

    /// How errors name what answered (or did not): the integration, unless the tool knows
    /// better (an MCP tool names its server).
    fn service(&self) -> &'static str {
        self.spec().integration.label()
    }

    /// Runs the call. `args` already passed the schema. Charge the rate limiter through `ctx`
    /// before each upstream call; return errors, never panic.
    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError>;

    /// What the call would do. Side-effect tools whose effect depends on upstream state (a
    /// reply's recipients, an event's current time) resolve it here exactly as `call` does;
    /// the default shows the arguments in short and binds nothing.
    async fn preview(&self, _ctx: &CallContext, args: &Value) -> Result<Preview, ToolError> {
        let compact = args.to_string();
        Ok(Preview {
            text: format!("{} {}", self.spec().name, clip(&compact, 300)),
            ..Preview::default()
        })
    }
}

/// Arguments with every integral number as an integer (`7.0` → `7`), at any depth. JSON
/// Schema's "integer" accepts `7.0`, but `Value::as_i64`/`as_u64` read it as no integer at all,
/// so a tool would act on a default ("task #0"); normalised once where calls enter the engine,
/// every tool reads what was validated. Beyond 2^53 a float is left as it is: not exact.
pub fn integral_numbers(value: Value) -> Value {
    const EXACT: f64 = 9_007_199_254_740_992.0;
    match value {
        Value::Number(n) => match n.as_f64() {
            Some(f) if n.is_f64() && f.fract() == 0.0 && f.abs() <= EXACT => Value::from(f as i64),
            _ => Value::Number(n),
        },
        Value::Array(items) => Value::Array(items.into_iter().map(integral_numbers).collect()),
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(k, v)| (k, integral_numbers(v)))
                .collect(),
        ),
        other => other,
    }
}

/// At most `max` characters of `text`, cut on a character boundary, with "…" when cut.
pub fn clip(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        Some((at, _)) => format!("{}…", &text[..at]),
        None => text.to_owned(),
    }
}

/// A single-line field (a subject, an address, a title) as one line of at most `max`
/// characters: line breaks, other control characters, Unicode's line and paragraph separators
/// and its bidirectional overrides become spaces, so a value can neither forge further lines (a
/// fake "To:") nor reorder what a person reads in the preview they approve.
pub fn line(text: &str, max: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| if is_layout_control(c) { ' ' } else { c })
        .collect();
    clip(&flat, max)
}

/// `text` as one quoted name, its `"` and `\` escaped: a name such as `Alice", bob` reads as
/// one name, never as two, nor as a name and something else.
pub fn quoted(text: &str) -> String {
    format!("\"{}\"", text.replace('\\', "\\\\").replace('"', "\\\""))
}

/// Several names, each [`quoted`], joined by ", ": a name holding ", " stays one name.
pub fn quoted_list(names: &[String]) -> String {
    names
        .iter()
        .map(|n| quoted(n))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Characters that break a line or change the reading order when displayed.
pub(crate) fn is_layout_control(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{2028}' | '\u{2029}' | '\u{200E}' | '\u{200F}' | '\u{061C}'
        )
        || ('\u{202A}'..='\u{202E}').contains(&c)
        || ('\u{2066}'..='\u{2069}').contains(&c)
}

/// The first `n` lines of `text`, each clipped and flattened like [`line`] (a stray `\r`
/// cannot start a forged line), with "…" when more follow.
pub fn first_lines(text: &str, n: usize) -> String {
    let mut lines: Vec<String> = text.lines().take(n).map(|l| line(l, 200)).collect();
    if text.lines().count() > n {
        lines.push("…".into());
    }
    lines.join("\n")
}

/// Hex SHA-256 of the parts, joined by newlines: a binding's digest.
pub fn digest(parts: &[&str]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(parts.join("\n").as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Every part of `spec` ListTools sends, each prefixed by its length (no two specs hash the
/// same parts), with the schema as sent.
fn listing_digest(spec: &ToolSpec, schema_json: &str) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    // Every field by name: one added to ToolSpec fails to compile here until it is hashed (or
    // said not to be), so a list can never keep its fingerprint while what it sends changes.
    let ToolSpec {
        name,
        aliases,
        description,
        schema: _, // hashed as sent, `schema_json`
        side_effect,
        integration,
        upstream_cost,
        reads_external_content,
        writes_memory,
    } = spec;
    let mut hash = Sha256::new();
    let mut part = |bytes: &[u8]| {
        hash.update((bytes.len() as u64).to_le_bytes());
        hash.update(bytes);
    };
    part(name.as_bytes());
    part(&(aliases.len() as u64).to_le_bytes());
    for alias in aliases {
        part(alias.as_bytes());
    }
    part(description.as_bytes());
    part(schema_json.as_bytes());
    part(format!("{integration:?}").as_bytes());
    part(&upstream_cost.to_le_bytes());
    part(&[
        u8::from(*side_effect),
        u8::from(*reads_external_content),
        u8::from(*writes_memory),
    ]);
    hash.finalize().into()
}

pub struct RegisteredTool {
    pub spec: ToolSpec,
    pub tool: Arc<dyn Tool>,
    /// [`Tool::read_only`], asked once at registration.
    pub read_only: bool,
    /// [`Tool::service`], asked once at registration.
    pub service: &'static str,
    /// The schema as JSON text, serialised once: every ListTools (one per run) sends it, and
    /// serialising every tool's schema per call was a fifth of the gateway's CPU per run.
    pub schema_json: String,
    /// SHA-256 of what ListTools sends of the tool, taken once: a list's fingerprint hashes
    /// these, not every description and schema per call (see `catalog::fingerprint`).
    pub listing_digest: [u8; 32],
    validator: jsonschema::Validator,
}

impl RegisteredTool {
    /// Compiles the tool's schema and asks it once whether it only reads.
    pub fn new(tool: Arc<dyn Tool>) -> Result<Self, RegistryError> {
        let spec = tool.spec();
        let validator =
            jsonschema::validator_for(&spec.schema).map_err(|e| RegistryError::BadSchema {
                tool: spec.name.clone(),
                detail: e.to_string(),
            })?;
        let read_only = tool.read_only();
        if read_only && (spec.side_effect || spec.writes_memory) {
            return Err(RegistryError::ReadOnlyWrites(spec.name.clone()));
        }
        let schema_json = spec.schema.to_string();
        Ok(Self {
            service: tool.service(),
            listing_digest: listing_digest(&spec, &schema_json),
            schema_json,
            spec,
            tool,
            read_only,
            validator,
        })
    }

    /// Checks `args` against the schema; the error lists every violation with its JSON pointer.
    pub fn validate(&self, args: &Value) -> Result<(), ToolError> {
        let problems: Vec<String> = self
            .validator
            .iter_errors(args)
            .take(5)
            .map(|e| {
                let path = e.instance_path().to_string();
                if path.is_empty() {
                    e.to_string()
                } else {
                    format!("{path}: {e}")
                }
            })
            .collect();
        if problems.is_empty() {
            Ok(())
        } else {
            Err(ToolError::InvalidArguments {
                tool: self.spec.name.clone(),
                detail: problems.join("; "),
            })
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("tool {tool}: its schema does not compile: {detail}")]
    BadSchema { tool: String, detail: String },
    #[error("the name {0:?} is declared twice")]
    Duplicate(String),
    #[error("tool {0}: declared read-only, yet it declares a side effect or memory writes")]
    ReadOnlyWrites(String),
    #[error("the name {0:?} is reserved for MCP servers' tools (mcp__… and mcp.…)")]
    Reserved(String),
}

/// The built-in tools, fixed at start, and the tools of MCP servers, which come and go with
/// their servers' lists (`crate::mcp`).
#[derive(Default)]
pub struct Registry {
    tools: Vec<Arc<RegisteredTool>>,
    by_name: HashMap<String, usize>,
    mcp: Option<Arc<crate::mcp::McpHub>>,
}

impl Registry {
    pub fn new(tools: Vec<Arc<dyn Tool>>) -> Result<Self, RegistryError> {
        let mut registry = Registry::default();
        for tool in tools {
            let registered = RegisteredTool::new(tool)?;
            let index = registry.tools.len();
            let spec = &registered.spec;
            for name in std::iter::once(&spec.name).chain(&spec.aliases) {
                if crate::mcp::is_mcp_name(name) {
                    return Err(RegistryError::Reserved(name.clone()));
                }
                if registry.by_name.insert(name.clone(), index).is_some() {
                    return Err(RegistryError::Duplicate(name.clone()));
                }
            }
            registry.tools.push(Arc::new(registered));
        }
        Ok(registry)
    }

    /// Adds the MCP servers' tools to what `get` finds.
    pub fn with_mcp(mut self, hub: Arc<crate::mcp::McpHub>) -> Self {
        self.mcp = Some(hub);
        self
    }

    /// By canonical name or alias; an MCP tool by its namespaced name, while its server lists it.
    pub fn get(&self, name: &str) -> Option<Arc<RegisteredTool>> {
        match self.by_name.get(name) {
            Some(&i) => Some(self.tools[i].clone()),
            None => self.mcp.as_ref()?.get(name),
        }
    }

    /// The built-in tools (the MCP servers' are listed by [`crate::mcp::McpHub::listing`]).
    pub fn builtin(&self) -> impl Iterator<Item = &Arc<RegisteredTool>> {
        self.tools.iter()
    }

    pub fn mcp(&self) -> Option<&Arc<crate::mcp::McpHub>> {
        self.mcp.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    #[test]
    fn clipping_marks_the_cut_and_keeps_short_text() {
        assert_eq!(clip("héllo wörld", 5), "héllo…");
        assert_eq!(clip("short", 10), "short");
        assert_eq!(first_lines("a\nb\nc", 2), "a\nb\n…");
        assert_eq!(digest(&["a", "b"]).len(), 64);
        assert_ne!(digest(&["a", "b"]), digest(&["ab"]));
    }

    #[test]
    fn a_field_cannot_break_its_line_or_reverse_what_follows() {
        let flat = line(
            "Budget\u{2028}To: attacker@evil.test\u{202E}txt.exe\u{2066}x",
            100,
        );
        assert_eq!(flat, "Budget To: attacker@evil.test txt.exe x");
    }

    #[test]
    fn g3_integral_numbers_become_integers_at_any_depth_and_others_stay() {
        let args = serde_json::json!({"id": 7.0, "list": [1.0, 2.5, -3.0], "o": {"n": 0.0},
                                      "big": 1e300, "s": "7.0", "i": 4});
        assert_eq!(
            integral_numbers(args),
            serde_json::json!({"id": 7, "list": [1, 2.5, -3], "o": {"n": 0},
                               "big": 1e300, "s": "7.0", "i": 4})
        );
    }

    proptest! {
        // preview building blocks never panic (any Unicode, any cut point) and stay short.
        #[test]
        fn clip_and_first_lines_are_bounded(text in "(?s).{0,400}", max in 0usize..50, n in 0usize..8) {
            prop_assert!(clip(&text, max).chars().count() <= max + 1);
            let flat = line(&text, max);
            prop_assert!(!flat.contains(['\n', '\r', '\u{2028}', '\u{2029}', '\u{202E}']), "{:?}", flat);
            let lines = first_lines(&text, n);
            prop_assert!(lines.lines().count() <= n + 1);
            // n lines of at most 200 characters and a "…", their n newlines, and a final "…".
            prop_assert!(lines.chars().count() <= n * 202 + 1);
            prop_assert!(!lines.contains('\r'));
        }
    }
}
