//! Model configuration (L-1, L-3, L-4, L-5, E-6..E-8, E-10): which providers exist, the ordered
//! fallback chain, the summary model, retries, output and context limits, and prices. The
//! offline scripted model is used only when no provider is configured, and says so.

use std::{collections::HashMap, sync::Arc, time::Duration};

use svc_kit::config::Vars;

use crate::{
    executor::{ModelSetup, Price},
    llm::{
        BaseUrl, ModelProvider,
        anthropic::Anthropic,
        gemini::Gemini,
        openai::OpenAi,
        resilient::{ChainEntry, RetryPolicy},
        scripted::{self, ScriptedModel},
    },
};

pub const DEFAULT_OPENAI_BASE_URL: &str = "https://api.openai.com/v1";
/// Earlier turns beyond this go out of the prompt (still searchable with the history tool):
/// a long thread's runs stay cheap (issue 13: ≤ 8K input tokens after 50 turns).
pub const DEFAULT_HISTORY_TOKENS: usize = 3_000;
pub const DEFAULT_ANTHROPIC_BASE_URL: &str = "https://api.anthropic.com";
pub const DEFAULT_GEMINI_BASE_URL: &str = "https://generativelanguage.googleapis.com";
pub const DEFAULT_CONTEXT_WINDOW: usize = 128_000;

/// One provider's settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ProviderConfig {
    pub base_url: BaseUrl,
    pub api_key: Option<svc_kit::secret::Secret>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelsConfig {
    /// (provider, model), in fallback order. `MODEL_CHAIN`.
    pub chain: Vec<(String, String)>,
    /// `SUMMARY_MODEL`: the cheap model for summaries (L-5); defaults to the chain's last entry.
    pub summary: (String, String),
    pub openai: ProviderConfig,
    pub anthropic: ProviderConfig,
    pub gemini: ProviderConfig,
    /// `ANTHROPIC_PROMPT_CACHE`: cache breakpoints on the stable prefix (tools, system, history).
    pub anthropic_prompt_cache: bool,
    /// `MODEL_RETRIES` (E-6, S0 AC-19): retries per chain entry, set explicitly.
    pub retries: u32,
    /// `MODEL_MAX_OUTPUT_TOKENS` (E-7).
    pub max_output_tokens: u32,
    /// `MODEL_CALL_TIMEOUT`
    pub call_timeout: Duration,
    /// `MODEL_CONTEXT_WINDOWS`: per-model windows, `model=tokens,...`.
    pub context_windows: HashMap<String, usize>,
    /// `MODEL_PRICES`: `model=input/output/cached,...` in US dollars per million tokens.
    pub prices: HashMap<String, Price>,
    /// `AGENT_HISTORY_TOKENS`: the thread's earlier turns sent with a call, at most (0: no
    /// limit but the context window).
    pub history_tokens: usize,
}

const PROVIDERS: [&str; 4] = ["openai", "anthropic", "gemini", scripted::NAME];

fn parse_pair(entry: &str) -> Option<(String, String)> {
    let (provider, model) = entry.trim().split_once('/')?;
    let provider = provider.trim().to_ascii_lowercase();
    (PROVIDERS.contains(&provider.as_str()) && !model.trim().is_empty())
        .then(|| (provider, model.trim().to_owned()))
}

impl ModelsConfig {
    pub fn load(vars: &mut Vars<'_>) -> Self {
        let provider = |vars: &mut Vars<'_>, prefix: &str, default: &str| {
            let var = format!("{prefix}_BASE_URL");
            let default = BaseUrl::parse(default).expect("the default base URLs are valid");
            let base_url = match vars.raw(&var).map(|raw| BaseUrl::parse(&raw)) {
                None => default,
                Some(Ok(url)) => url,
                Some(Err(problem)) => {
                    vars.error(&var, format!("{problem}, e.g. {}", default.as_str()));
                    default
                }
            };
            ProviderConfig {
                base_url,
                api_key: vars
                    .optional_string(&format!("{prefix}_API_KEY"))
                    .map(svc_kit::secret::Secret::from),
            }
        };
        let openai = provider(vars, "OPENAI", DEFAULT_OPENAI_BASE_URL);
        let anthropic = provider(vars, "ANTHROPIC", DEFAULT_ANTHROPIC_BASE_URL);
        let gemini = provider(vars, "GEMINI", DEFAULT_GEMINI_BASE_URL);
        let anthropic_prompt_cache = vars.bool("ANTHROPIC_PROMPT_CACHE", true);
        let history_tokens = vars.int_in(
            "AGENT_HISTORY_TOKENS",
            DEFAULT_HISTORY_TOKENS,
            0,
            10_000_000,
        );

        let chain = match vars.raw("MODEL_CHAIN") {
            None => {
                tracing::warn!(
                    "MODEL_CHAIN is not set: runs use the offline scripted model ({})",
                    scripted::NAME
                );
                vec![(scripted::NAME.to_owned(), scripted::NAME.to_owned())]
            }
            Some(raw) => {
                let parsed: Option<Vec<_>> = raw.split(',').map(parse_pair).collect();
                match parsed {
                    Some(chain) if !chain.is_empty() => chain,
                    _ => {
                        vars.error(
                            "MODEL_CHAIN",
                            format!(
                                "{raw:?} is not a list of provider/model (providers: {}), e.g. anthropic/claude-sonnet-4-5,openai/gpt-4o-mini",
                                PROVIDERS.join(", ")
                            ),
                        );
                        vec![(scripted::NAME.to_owned(), scripted::NAME.to_owned())]
                    }
                }
            }
        };
        for (p, _) in &chain {
            let key = match p.as_str() {
                "openai" => &openai.api_key,
                "anthropic" => &anthropic.api_key,
                "gemini" => &gemini.api_key,
                _ => &Some(svc_kit::secret::Secret::new("")),
            };
            // OpenAI-compatible local servers (Ollama, vLLM) need no key; the hosted two do.
            if key.is_none() && p != "openai" {
                vars.error(
                    &format!("{}_API_KEY", p.to_ascii_uppercase()),
                    format!("is required: MODEL_CHAIN uses {p}"),
                );
            }
        }
        let summary = match vars.raw("SUMMARY_MODEL") {
            None => chain.last().cloned().unwrap_or_default(),
            Some(raw) => parse_pair(&raw).unwrap_or_else(|| {
                vars.error("SUMMARY_MODEL", format!("{raw:?} is not provider/model"));
                chain.last().cloned().unwrap_or_default()
            }),
        };
        let retries = vars.int_in("MODEL_RETRIES", 2u32, 0, 10);
        let max_output_tokens = vars.int_in("MODEL_MAX_OUTPUT_TOKENS", 2048u32, 64, 64_000);
        let call_timeout = vars.duration_in(
            "MODEL_CALL_TIMEOUT",
            Duration::from_secs(120),
            Duration::from_secs(1),
            Duration::from_secs(900),
        );
        let context_windows = keyed_list(vars, "MODEL_CONTEXT_WINDOWS", "model=tokens", |v| {
            v.parse::<usize>().ok().filter(|n| *n >= 1000)
        });
        let prices = keyed_list(
            vars,
            "MODEL_PRICES",
            "model=input/output[/cached[/cache write]] (USD per million tokens)",
            |v| {
                let nums: Vec<f64> = v
                    .split('/')
                    .map(|n| n.trim().parse::<f64>())
                    .collect::<Result<_, _>>()
                    .ok()?;
                // Cache writes cost what Anthropic's 5-minute cache charges unless given.
                let (input, output, cached_input, cache_write) = match nums.as_slice() {
                    [i, o] => (*i, *o, *i, *i * 1.25),
                    [i, o, c] => (*i, *o, *c, *i * 1.25),
                    [i, o, c, w] => (*i, *o, *c, *w),
                    _ => return None,
                };
                Some(Price {
                    input,
                    output,
                    cached_input,
                    cache_write,
                })
            },
        );
        Self {
            chain,
            summary,
            openai,
            anthropic,
            gemini,
            anthropic_prompt_cache,
            retries,
            max_output_tokens,
            call_timeout,
            context_windows,
            prices,
            history_tokens,
        }
    }

    fn provider(
        &self,
        name: &str,
        http: &reqwest::Client,
        offline: &Arc<ScriptedModel>,
    ) -> Arc<dyn ModelProvider> {
        match name {
            "openai" => Arc::new(OpenAi::new(
                "openai",
                &self.openai.base_url,
                self.openai.api_key.as_ref().map(|k| k.expose().to_owned()),
                http.clone(),
            )),
            "anthropic" => Arc::new(Anthropic::new(
                &self.anthropic.base_url,
                self.anthropic
                    .api_key
                    .as_ref()
                    .map(|k| k.expose().to_owned()),
                http.clone(),
                self.anthropic_prompt_cache,
            )),
            "gemini" => Arc::new(Gemini {
                base_url: self.gemini.base_url.clone(),
                api_key: self.gemini.api_key.as_ref().map(|k| k.expose().to_owned()),
                http: http.clone(),
            }),
            _ => offline.clone(),
        }
    }

    /// The executor's model setup, the summary model, and whether the offline model is in use.
    pub fn build(&self, http: &reqwest::Client) -> (ModelSetup, ChainEntry) {
        let offline = Arc::new(ScriptedModel::offline());
        let entry = |(p, m): &(String, String)| ChainEntry {
            provider: self.provider(p, http, &offline),
            model: m.clone(),
        };
        let chain: Vec<ChainEntry> = self.chain.iter().map(entry).collect();
        // One fit serves the whole chain, so it is made for the smallest window in it: a
        // fallback model is never sent more than it can take.
        let context_window = self
            .chain
            .iter()
            .map(|(_, m)| {
                self.context_windows
                    .get(m)
                    .copied()
                    .unwrap_or(DEFAULT_CONTEXT_WINDOW)
            })
            .min()
            .unwrap_or(DEFAULT_CONTEXT_WINDOW);
        let setup = ModelSetup {
            chain,
            retry: RetryPolicy {
                retries: self.retries,
                call_timeout: self.call_timeout,
                ..RetryPolicy::default()
            },
            max_output_tokens: self.max_output_tokens,
            context_window,
            history_tokens: self.history_tokens,
            prices: self.prices.clone(),
            final_turn_grace: Duration::from_secs(10),
        };
        (setup, entry(&self.summary))
    }
}

/// `key=value,key=value` with each value parsed by `parse`.
fn keyed_list<T>(
    vars: &mut Vars<'_>,
    var: &str,
    shape: &str,
    parse: impl Fn(&str) -> Option<T>,
) -> HashMap<String, T> {
    let Some(raw) = vars.raw(var) else {
        return HashMap::new();
    };
    let mut out = HashMap::new();
    for item in raw.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        match item
            .split_once('=')
            .and_then(|(k, v)| Some((k.trim().to_owned(), parse(v.trim())?)))
        {
            Some((k, v)) => {
                out.insert(k, v);
            }
            None => vars.error(var, format!("{item:?} is not {shape}")),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(pairs: &[(&str, &str)]) -> Result<ModelsConfig, svc_kit::config::ConfigErrors> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let mut vars = Vars::from_map(&map);
        let cfg = ModelsConfig::load(&mut vars);
        vars.finish(cfg)
    }

    #[test]
    fn with_nothing_configured_the_offline_model_is_used_and_named() {
        let cfg = load(&[]).unwrap();
        assert_eq!(
            cfg.chain,
            [(scripted::NAME.to_owned(), scripted::NAME.to_owned())]
        );
        assert_eq!((cfg.retries, cfg.max_output_tokens), (2, 2048));
        let (setup, _) = cfg.build(&reqwest::Client::new());
        assert_eq!(setup.chain[0].provider.name(), "scripted-offline");
    }

    #[test]
    fn a_chain_with_keys_prices_and_windows_is_read_in_order() {
        let cfg = load(&[
            (
                "MODEL_CHAIN",
                "anthropic/claude-sonnet-4-5, openai/gpt-4o-mini",
            ),
            ("ANTHROPIC_API_KEY", "k"),
            (
                "MODEL_PRICES",
                "claude-sonnet-4-5=3/15/0.3,gpt-4o-mini=0.15/0.6",
            ),
            (
                "MODEL_CONTEXT_WINDOWS",
                "claude-sonnet-4-5=200000,gpt-4o-mini=100000",
            ),
            ("SUMMARY_MODEL", "openai/gpt-4o-mini"),
        ])
        .unwrap();
        assert_eq!(
            cfg.chain[1],
            ("openai".to_owned(), "gpt-4o-mini".to_owned())
        );
        assert_eq!(
            cfg.prices["claude-sonnet-4-5"],
            Price {
                input: 3.0,
                output: 15.0,
                cached_input: 0.3,
                cache_write: 3.75,
            }
        );
        let (setup, summary) = cfg.build(&reqwest::Client::new());
        // The fallback's smaller window is what every call is fitted to.
        assert_eq!(setup.context_window, 100_000);
        assert_eq!(setup.chain[0].provider.name(), "anthropic");
        assert_eq!(summary.model, "gpt-4o-mini");
    }

    #[test]
    fn e10_anthropic_cache_writes_cost_more_than_input_and_reads_less() {
        let cfg = load(&[(
            "MODEL_PRICES",
            "claude-sonnet-4-5=3/15/0.3,claude-haiku=1/5/0.1/2",
        )])
        .unwrap();
        let sonnet = cfg.prices["claude-sonnet-4-5"];
        assert_eq!(sonnet.cache_write, 3.75, "1.25 x input unless given");
        assert_eq!(cfg.prices["claude-haiku"].cache_write, 2.0);
        // 1M input tokens: 600K read from the cache, 300K written to it, 100K plain.
        let usage = crate::llm::TokenUsage {
            input_tokens: 1_000_000,
            output_tokens: 0,
            cached_tokens: 600_000,
            cache_write_tokens: 300_000,
        };
        let cost = sonnet.cost(&usage);
        let expected = 0.1 * 3.0 + 0.6 * 0.3 + 0.3 * 3.75;
        assert!((cost - expected).abs() < 1e-9, "{cost} != {expected}");
    }

    #[test]
    fn mistakes_are_named() {
        let err = load(&[("MODEL_CHAIN", "claude"), ("MODEL_PRICES", "x=cheap")]).unwrap_err();
        let vars: Vec<_> = err.0.iter().map(|e| e.var.as_str()).collect();
        assert_eq!(vars, ["MODEL_CHAIN", "MODEL_PRICES"]);
        let err = load(&[("MODEL_CHAIN", "gemini/gemini-2.5-flash")]).unwrap_err();
        assert_eq!(err.0[0].var, "GEMINI_API_KEY");
    }

    /// A mistyped provider URL is named at start, not met as a failed model call on every
    /// run; a good one keeps its own path, the way the calls use it.
    #[test]
    fn base_urls_that_are_not_http_urls_are_named_at_start() {
        let err = load(&[
            ("OPENAI_BASE_URL", "localhost:11434/v1"),
            ("ANTHROPIC_BASE_URL", "api.anthropic.com"),
            ("GEMINI_BASE_URL", "https://x/v1beta?key=sk-secret"),
        ])
        .unwrap_err();
        let named: Vec<_> = err
            .0
            .iter()
            .map(|e| (e.var.as_str(), e.problem.as_str()))
            .collect();
        assert_eq!(named.len(), 3, "{named:?}");
        assert_eq!(named[0].0, "OPENAI_BASE_URL");
        assert!(named[0].1.contains("not http: or https:"), "{named:?}");
        assert_eq!(named[1].0, "ANTHROPIC_BASE_URL");
        assert!(named[1].1.contains("is not a URL"), "{named:?}");
        assert!(
            named[1].1.ends_with("e.g. https://api.anthropic.com/"),
            "the provider's own default as the example: {named:?}"
        );
        assert_eq!(named[2].0, "GEMINI_BASE_URL");
        assert!(named[2].1.contains("query"), "{named:?}");
        assert!(
            !format!("{named:?}").contains("sk-secret"),
            "the value is never repeated"
        );

        let cfg = load(&[("OPENAI_BASE_URL", " http://127.0.0.1:11434/v1/ ")]).unwrap();
        assert_eq!(
            cfg.openai.base_url.join("/chat/completions").as_str(),
            "http://127.0.0.1:11434/v1/chat/completions"
        );
        assert_eq!(
            cfg.anthropic.base_url.join("/v1/messages").as_str(),
            "https://api.anthropic.com/v1/messages"
        );
    }
}
