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
    /// Sends, creates or changes something outside Steward. Policy keys off this.
    pub side_effect: bool,
    pub integration: Integration,
    /// Upstream API calls one call costs with default arguments.
    pub upstream_cost: u32,
}

impl ToolSpec {
    /// A tool that changes nothing outside Steward, with no aliases, costing one upstream call
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
        }
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
}

impl ToolOutput {
    pub fn text(text: impl Into<String>) -> Self {
        Self {
            text: text.into(),
            display: None,
        }
    }
}

#[async_trait::async_trait]
pub trait Tool: Send + Sync + 'static {
    fn spec(&self) -> ToolSpec;

    /// Runs the call. `args` already passed the schema. Charge the rate limiter through `ctx`
    /// before each upstream call; return errors, never panic.
    async fn call(&self, ctx: &CallContext, args: Value) -> Result<ToolOutput, ToolError>;
}

pub struct RegisteredTool {
    pub spec: ToolSpec,
    pub tool: Arc<dyn Tool>,
    validator: jsonschema::Validator,
}

impl RegisteredTool {
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
}

#[derive(Default)]
pub struct Registry {
    tools: Vec<Arc<RegisteredTool>>,
    by_name: HashMap<String, usize>,
}

impl Registry {
    pub fn new(tools: Vec<Arc<dyn Tool>>) -> Result<Self, RegistryError> {
        let mut registry = Registry::default();
        for tool in tools {
            let spec = tool.spec();
            let validator =
                jsonschema::validator_for(&spec.schema).map_err(|e| RegistryError::BadSchema {
                    tool: spec.name.clone(),
                    detail: e.to_string(),
                })?;
            let index = registry.tools.len();
            for name in std::iter::once(&spec.name).chain(&spec.aliases) {
                if registry.by_name.insert(name.clone(), index).is_some() {
                    return Err(RegistryError::Duplicate(name.clone()));
                }
            }
            registry.tools.push(Arc::new(RegisteredTool {
                spec,
                tool,
                validator,
            }));
        }
        Ok(registry)
    }

    /// By canonical name or alias.
    pub fn get(&self, name: &str) -> Option<&Arc<RegisteredTool>> {
        self.by_name.get(name).map(|&i| &self.tools[i])
    }

    pub fn all(&self) -> impl Iterator<Item = &Arc<RegisteredTool>> {
        self.tools.iter()
    }
}
