//! The gateway-svc binary as an operator runs it: it refuses bad configuration by name and stops
//! gracefully on SIGTERM, and `migrate` applies its schema and exits (the Kubernetes Job).

use std::time::Duration;

use svc_kit::testing::{ServerProcess, check_migrate_subcommand, run_to_exit};

const BIN: &str = env!("CARGO_BIN_EXE_gateway-svc");

#[test]
fn a_bad_config_value_exits_non_zero_naming_the_variable_and_the_fix() {
    let exit = run_to_exit(
        BIN,
        &[
            ("GATEWAY_LISTEN_ADDR", "127.0.0.1:0"),
            ("GRPC_MAX_MESSAGE_BYTES", "lots"),
        ],
        Duration::from_secs(20),
    );
    assert_eq!(exit.status.code(), Some(2), "{}", exit.stderr);
    assert!(
        exit.stderr
            .contains("GRPC_MAX_MESSAGE_BYTES: \"lots\" is not a size"),
        "{}",
        exit.stderr
    );
    // The log line queued just before the exit is written too: the log writer's thread is
    // drained on the way out.
    assert!(
        exit.stderr.contains(r#""message":"refusing to start""#),
        "{}",
        exit.stderr
    );
}

#[test]
fn sigterm_drains_and_exits_zero() {
    let server = ServerProcess::start(
        BIN,
        &[
            ("GATEWAY_LISTEN_ADDR", "127.0.0.1:0"),
            ("GATEWAY_SERVICE_TOKEN", "binary-test-token-0123456789"),
        ],
    );
    assert!(server.addr.port() != 0);
    server.terminate();
    let exit = server.wait(Duration::from_secs(20));
    assert!(exit.status.success(), "{:?}\n{}", exit.status, exit.stderr);
    assert!(
        exit.stderr.contains("shutdown signal received"),
        "{}",
        exit.stderr
    );
    // The last line it logs, at the very end, reaches stderr before the process ends.
    assert!(exit.stderr.contains("server stopped"), "{}", exit.stderr);
}

#[test]
fn migrate_applies_the_schema_once_and_exits() {
    check_migrate_subcommand(
        BIN,
        &[("GATEWAY_SERVICE_TOKEN", "binary-test-token-0123456789")],
        "gateway_schema_history",
        12,
    );
}
