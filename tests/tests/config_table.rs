//! The README's configuration table and the variables the code reads cannot drift apart
//! (issue 12): every variable either service's configuration asks for is documented for that
//! service, and every documented variable is read by the service(s) the table names.
//!
//! What is read is recorded, not grepped: each service's `Config::load` runs against a lookup
//! that notes every name asked for, under several environments so that variables read only in
//! some configurations (a provider named in the chain, a database, a JWT key) are asked for too.

use std::{
    cell::RefCell,
    collections::{BTreeMap, BTreeSet, HashMap},
};

use svc_kit::config::Vars;

/// Variables read outside `Config::load`: the log and trace setup reads these before any config.
const READ_BY_THE_LOG_SETUP: [&str; 3] = ["LOG_FORMAT", "RUST_LOG", "OTEL_EXPORTER_OTLP_ENDPOINT"];

/// The environments each service's configuration is loaded under.
fn environments() -> Vec<HashMap<String, String>> {
    let env = |pairs: &[(&str, &str)]| -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    };
    vec![
        env(&[]),
        env(&[
            ("DATABASE_URL", "postgres://u@h/db"),
            (
                "MODEL_CHAIN",
                "anthropic/claude-sonnet-4,openai/gpt-4o,gemini/gemini-2.0-flash",
            ),
            ("AUTH_JWT_HS256_SECRET", "0123456789abcdef0123456789abcdef"),
            ("GATEWAY_SERVICE_TOKEN", "token-0123456789abcdef"),
        ]),
        env(&[
            ("AUTH_JWKS_URL", "http://127.0.0.1:1/jwks.json"),
            ("AUTH_DEV_USER_HEADER", "true"),
            ("GOOGLE_CLIENT_ID", "id"),
            ("GOOGLE_CLIENT_SECRET", "secret"),
        ]),
    ]
}

/// Every name `load` asks for, over every environment.
fn read_by(load: impl Fn(Vars<'_>)) -> BTreeSet<String> {
    let asked = RefCell::new(BTreeSet::new());
    for env in environments() {
        load(Vars::new(|name: &str| {
            asked.borrow_mut().insert(name.to_owned());
            env.get(name).cloned()
        }));
    }
    asked.into_inner()
}

/// Variable → the services the README's configuration table documents it for.
fn documented() -> BTreeMap<String, BTreeSet<&'static str>> {
    let readme = include_str!("../../README.md");
    let table = readme
        .split("## Configuration")
        .nth(1)
        .expect("the README has a Configuration section");
    let mut out: BTreeMap<String, BTreeSet<&'static str>> = BTreeMap::new();
    for row in table.lines().take_while(|l| !l.starts_with("## ")) {
        let cells: Vec<&str> = row.split('|').map(str::trim).collect();
        if cells.len() < 4 || !cells[1].starts_with('`') {
            continue;
        }
        let services: &[&'static str] = match cells[2] {
            "agent" => &["agent"],
            "gateway" => &["gateway"],
            "both" => &["agent", "gateway"],
            other => panic!("unknown service column {other:?} in row {row}"),
        };
        // A row may name several variables: `A`, `B` or `A` / `B`.
        for name in cells[1].split('`').skip(1).step_by(2) {
            out.entry(name.to_owned())
                .or_default()
                .extend(services.iter().copied());
        }
    }
    out
}

#[test]
fn every_variable_the_services_read_is_documented_and_every_documented_one_is_read() {
    let mut read: BTreeMap<String, BTreeSet<&'static str>> = BTreeMap::new();
    let agent = read_by(|vars| {
        let _ = agent_svc::Config::load(vars);
    });
    let gateway = read_by(|vars| {
        let _ = gateway_svc::Config::load(vars);
    });
    for (service, names) in [("agent", agent), ("gateway", gateway)] {
        for name in names
            .into_iter()
            .chain(READ_BY_THE_LOG_SETUP.map(str::to_owned))
        {
            read.entry(name).or_default().insert(service);
        }
    }
    let documented = documented();

    let undocumented: Vec<String> = read
        .iter()
        .filter(|(name, services)| documented.get(*name).is_none_or(|d| !services.is_subset(d)))
        .map(|(name, services)| format!("{name} (read by {services:?})"))
        .collect();
    let stale: Vec<String> = documented
        .iter()
        .filter(|(name, services)| read.get(*name).is_none_or(|r| !services.is_subset(r)))
        .map(|(name, services)| format!("{name} (documented for {services:?})"))
        .collect();
    assert!(
        undocumented.is_empty(),
        "read by the code but not in the README's configuration table: {undocumented:?}"
    );
    assert!(
        stale.is_empty(),
        "in the README's configuration table but not read by that service: {stale:?}"
    );
}

#[test]
fn o2_no_secret_appears_in_either_services_debug_printed_configuration() {
    let secrets = [
        ("GATEWAY_SERVICE_TOKEN", "service-token-SECRET-0123456789"),
        (
            "AUTH_JWT_HS256_SECRET",
            "jwt-hs256-SECRET-0123456789abcdefghijkl",
        ),
        ("AUTH_JWT_AUDIENCE", "steward"),
        ("ANTHROPIC_API_KEY", "sk-ant-SECRET-1"),
        ("OPENAI_API_KEY", "sk-SECRET-2"),
        ("GEMINI_API_KEY", "gem-SECRET-3"),
        (
            "MODEL_CHAIN",
            "anthropic/claude-sonnet-4,openai/gpt-4o,gemini/gemini-2.0-flash",
        ),
        (
            "DATABASE_URL",
            "postgres://steward:pg-SECRET-4@db:5432/steward",
        ),
        (
            "CREDENTIALS_KEY",
            "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=",
        ),
        ("GOOGLE_CLIENT_ID", "client-id"),
        ("GOOGLE_CLIENT_SECRET", "google-SECRET-5"),
    ];
    let env: HashMap<String, String> = secrets
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    let agent = agent_svc::Config::load(Vars::from_map(&env)).expect("the agent config loads");
    let gateway =
        gateway_svc::Config::load(Vars::from_map(&env)).expect("the gateway config loads");
    let printed = format!("{agent:?}\n{gateway:?}");
    for (name, value) in secrets {
        if value.contains("SECRET") || name == "CREDENTIALS_KEY" {
            assert!(!printed.contains(value), "{name} is printed by Debug");
        }
    }
    assert!(printed.contains("[redacted]"));
}
