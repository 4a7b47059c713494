//! TLS between the services and to their callers (issue 12, O-5): with certificates made by the
//! test (a private CA, a server certificate for localhost, a client certificate), a run goes
//! caller → agent-svc over TLS and agent-svc → gateway-svc over mTLS; a client without a
//! certificate and a plaintext client are refused by the mTLS gateway. Both services also reach a
//! private PostgreSQL that accepts TLS only, as DATABASE_URL's `sslmode` asks.

use std::{collections::HashMap, path::PathBuf, time::Duration};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair,
};
use steward_proto::{AGENT_SERVICE_NAME, agent::v1 as pb};
use steward_tests::{
    agent_calls::run_once,
    agent_over,
    fakes::openai::{Answer, FakeOpenAi},
    pg_server::PgServer,
    start_agent, start_gateway, wait_for_status,
};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity};
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

/// PEM files of one test's PKI, removed with it.
struct Pki {
    dir: PathBuf,
    ca: String,
    client_cert: String,
    client_key: String,
}

impl Pki {
    fn create() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "steward-tls-{}-{}",
            std::process::id(),
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).expect("a temp dir");
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "steward test CA");
        let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate().unwrap()).unwrap();

        let leaf = |name: &str, purpose: ExtendedKeyUsagePurpose| {
            let mut params =
                CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
                    .unwrap();
            params.distinguished_name.push(DnType::CommonName, name);
            params.extended_key_usages = vec![purpose];
            let key = KeyPair::generate().unwrap();
            let cert = params.signed_by(&key, &ca).unwrap();
            (cert.pem(), key.serialize_pem())
        };
        let (server_cert, server_key) = leaf("steward server", ExtendedKeyUsagePurpose::ServerAuth);
        // PostgreSQL's certificate names `localhost` only, so connecting to 127.0.0.1 tells
        // verify-ca (chain) from verify-full (chain and name).
        let (pg_cert, pg_key) = {
            let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
            params
                .distinguished_name
                .push(DnType::CommonName, "postgres");
            let key = KeyPair::generate().unwrap();
            (
                params.signed_by(&key, &ca).unwrap().pem(),
                key.serialize_pem(),
            )
        };
        let (client_cert, client_key) = leaf("agent-svc", ExtendedKeyUsagePurpose::ClientAuth);
        let pki = Self {
            dir,
            ca: ca.pem(),
            client_cert,
            client_key,
        };
        for (name, pem) in [
            ("ca.pem", pki.ca.as_str()),
            ("server.pem", server_cert.as_str()),
            ("server.key", server_key.as_str()),
            ("client.pem", pki.client_cert.as_str()),
            ("client.key", pki.client_key.as_str()),
            ("pg.pem", pg_cert.as_str()),
            ("pg.key", pg_key.as_str()),
        ] {
            std::fs::write(pki.dir.join(name), pem).expect("write a PEM file");
        }
        pki
    }

    fn path(&self, name: &str) -> String {
        self.dir.join(name).display().to_string()
    }

    /// A TLS server on loopback with these certificates; mTLS when `client_ca`.
    fn server_env(&self, prefix: &str, client_ca: bool) -> HashMap<String, String> {
        let mut env: HashMap<String, String> = [
            (format!("{prefix}_LISTEN_ADDR"), "127.0.0.1:0".to_owned()),
            ("GRPC_TLS_CERT".to_owned(), self.path("server.pem")),
            ("GRPC_TLS_KEY".to_owned(), self.path("server.key")),
            (
                "GATEWAY_SERVICE_TOKEN".to_owned(),
                steward_tests::SERVICE_TOKEN.to_owned(),
            ),
            ("HEALTH_PROBE_INTERVAL".to_owned(), "100ms".to_owned()),
            ("SHUTDOWN_DRAIN_TIMEOUT".to_owned(), "1s".to_owned()),
        ]
        .into_iter()
        .collect();
        if client_ca {
            env.insert("GRPC_TLS_CLIENT_CA".into(), self.path("ca.pem"));
        }
        env
    }

    fn client(&self, with_certificate: bool) -> ClientTlsConfig {
        let config = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&self.ca))
            .domain_name("localhost");
        if with_certificate {
            config.identity(Identity::from_pem(&self.client_cert, &self.client_key))
        } else {
            config
        }
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn tls_channel(port: u16, tls: ClientTlsConfig) -> Result<Channel, tonic::transport::Error> {
    Channel::from_shared(format!("https://localhost:{port}"))
        .expect("a URL")
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await
}

async fn health(channel: Channel, service: &str) -> Result<i32, tonic::Status> {
    Ok(HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.to_owned(),
        })
        .await?
        .into_inner()
        .status)
}

#[tokio::test]
async fn o5_a_run_crosses_tls_to_the_agent_and_mtls_to_the_gateway_and_others_are_refused() {
    let pki = Pki::create();
    let model = FakeOpenAi::start(vec![
        Answer::tool_calls(&[("call_tasks", "list_tasks", "{}")]),
        Answer::text("You have no tasks."),
    ])
    .await;
    let mut gateway = start_gateway(&pki.server_env("GATEWAY", true))
        .await
        .expect("a TLS gateway starts");
    let mut agent_env = pki.server_env("AGENT", false);
    agent_env.extend([
        (
            "GATEWAY_URL".to_owned(),
            format!("https://localhost:{}", gateway.addr.port()),
        ),
        ("GATEWAY_TLS_CA".to_owned(), pki.path("ca.pem")),
        ("GATEWAY_TLS_CERT".to_owned(), pki.path("client.pem")),
        ("GATEWAY_TLS_KEY".to_owned(), pki.path("client.key")),
        ("MODEL_CHAIN".to_owned(), "openai/gpt-4o".to_owned()),
        ("OPENAI_BASE_URL".to_owned(), model.url.clone()),
    ]);
    let mut agent = start_agent(&agent_env).await.expect("a TLS agent starts");

    // The caller reaches agent-svc over TLS (no client certificate needed there).
    let channel = tls_channel(agent.addr.port(), pki.client(false))
        .await
        .expect("a TLS connection to agent-svc");
    wait_for_status(channel.clone(), AGENT_SERVICE_NAME, ServingStatus::Serving).await;
    let result = run_once(
        &mut agent_over(channel, "alice"),
        "what tasks do I have?",
        "",
    )
    .await
    .expect("Run over TLS");
    assert_eq!(
        result.status,
        pb::RunState::Completed as i32,
        "{}",
        result.error
    );
    // The tool call crossed mTLS to the gateway and came back with a real result.
    let second = &model.requests()[1].1;
    let tool_result = second["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "tool")
        .expect("the tool result reached the model");
    assert!(
        tool_result["content"]
            .as_str()
            .unwrap()
            .contains("No pending tasks."),
        "{tool_result}"
    );

    // The mTLS gateway refuses a TLS client without a certificate, and a plaintext one.
    let gw_port = gateway.addr.port();
    let anonymous = match tls_channel(gw_port, pki.client(false)).await {
        Ok(channel) => health(channel, "")
            .await
            .map(|_| ())
            .map_err(|s| s.to_string()),
        Err(e) => Err(e.to_string()),
    };
    assert!(anonymous.is_err(), "a client without a certificate got in");
    let plaintext = Channel::from_shared(format!("http://127.0.0.1:{gw_port}"))
        .unwrap()
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await;
    let plaintext = match plaintext {
        Ok(channel) => health(channel, "")
            .await
            .map(|_| ())
            .map_err(|s| s.to_string()),
        Err(e) => Err(e.to_string()),
    };
    assert!(plaintext.is_err(), "a plaintext client got in");

    agent.stop().await.expect("agent-svc stops");
    gateway.stop().await.expect("gateway-svc stops");
}

#[tokio::test]
async fn a_plaintext_gateway_url_with_tls_settings_or_a_missing_certificate_stops_the_start() {
    let pki = Pki::create();
    let mut env = pki.server_env("AGENT", false);
    env.insert("GATEWAY_URL".into(), "http://127.0.0.1:50052".into());
    env.insert("GATEWAY_TLS_CA".into(), pki.path("ca.pem"));
    let err = start_agent(&env).await.err().expect("refused");
    assert!(
        err.contains("GATEWAY_URL") && err.contains("https://"),
        "{err}"
    );

    let mut env = pki.server_env("GATEWAY", false);
    env.insert("GRPC_TLS_KEY".into(), pki.path("missing.key"));
    let err = start_gateway(&env).await.err().expect("refused");
    assert!(
        err.contains("GRPC_TLS_KEY") && err.contains("cannot read"),
        "{err}"
    );
}

/// Connections of the test database's services, as the server sees them: (over TLS, not).
async fn connections_by_tls(pg: &PgServer, db: &str) -> (i64, i64) {
    let (client, conn) = tokio_postgres::connect(&pg.socket_dsn("postgres"), tokio_postgres::NoTls)
        .await
        .expect("the private server's socket");
    tokio::spawn(conn);
    let row = client
        .query_one(
            "SELECT count(*) FILTER (WHERE s.ssl), count(*) FILTER (WHERE NOT s.ssl) \
             FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
             WHERE a.datname = $1 AND a.client_addr IS NOT NULL",
            &[&db],
        )
        .await
        .expect("read pg_stat_ssl");
    (row.get(0), row.get(1))
}

/// One round trip through a pool on `url`, its error as text.
async fn ping(url: &str) -> Result<(), String> {
    let pool = svc_kit::pg::pool(
        url,
        &svc_kit::pg::PoolOptions {
            max_connections: 1,
            acquire_timeout: Duration::from_secs(5),
            ..svc_kit::pg::PoolOptions::default()
        },
    )
    .map_err(|e| e.to_string())?;
    svc_kit::pg::ping(&pool).await.map_err(|e| e.to_string())
}

#[tokio::test]
async fn o5_both_services_reach_a_tls_only_postgresql_and_each_sslmode_checks_what_libpq_checks() {
    let pki = Pki::create();
    let read = |name: &str| std::fs::read_to_string(pki.path(name)).expect("a PEM file");
    let (cert, key) = (read("pg.pem"), read("pg.key"));
    let pg = tokio::task::spawn_blocking(move || PgServer::start_tls(&cert, &key))
        .await
        .unwrap()
        .expect("a private PostgreSQL with a certificate");
    pg.create_database("steward_tls").await.expect("a database");
    let url = |host: &str, query: &str| {
        format!(
            "postgres://postgres@{host}:{}/steward_tls?{query}",
            pg.port()
        )
    };
    let ca = format!("sslrootcert={}", pki.path("ca.pem"));
    let verified = url("localhost", &format!("sslmode=verify-full&{ca}"));

    let env = |database_url: &str| -> HashMap<String, String> {
        steward_tests::env(&[
            ("GATEWAY_LISTEN_ADDR", "127.0.0.1:0"),
            ("AGENT_LISTEN_ADDR", "127.0.0.1:0"),
            ("DATABASE_URL", database_url),
            ("GATEWAY_SERVICE_TOKEN", steward_tests::SERVICE_TOKEN),
            ("HEALTH_PROBE_INTERVAL", "100ms"),
            ("SHUTDOWN_DRAIN_TIMEOUT", "1s"),
        ])
    };
    let mut gateway = start_gateway(&env(&verified))
        .await
        .expect("gateway-svc migrates and serves over TLS to PostgreSQL");
    let mut agent_env = env(&verified);
    agent_env.insert(
        "GATEWAY_URL".into(),
        format!("http://127.0.0.1:{}", gateway.addr.port()),
    );
    let mut agent = start_agent(&agent_env)
        .await
        .expect("agent-svc migrates and serves over TLS to PostgreSQL");

    // A run that writes through agent-svc's store and reads tasks from gateway-svc's.
    let channel = Channel::from_shared(format!("http://{}", agent.addr))
        .unwrap()
        .connect()
        .await
        .expect("agent-svc");
    let result = run_once(
        &mut agent_over(channel, "alice"),
        "what tasks do I have?",
        "",
    )
    .await
    .expect("Run");
    assert_eq!(
        result.status,
        pb::RunState::Completed as i32,
        "{}",
        result.error
    );
    assert!(
        result.summary.contains("No pending tasks."),
        "{}",
        result.summary
    );
    let (encrypted, plain) = connections_by_tls(&pg, "steward_tls").await;
    assert!(encrypted > 0, "no TLS connection from the services");
    assert_eq!(plain, 0, "a service connected in plaintext");
    agent.stop().await.expect("agent-svc stops");
    gateway.stop().await.expect("gateway-svc stops");

    // 127.0.0.1 is not a name on the certificate: only the modes that check names refuse it.
    for query in [
        format!("sslmode=verify-ca&{ca}"),
        format!("sslmode=require&{ca}"),
        "sslmode=require".to_owned(),
    ] {
        ping(&url("127.0.0.1", &query))
            .await
            .unwrap_or_else(|e| panic!("{query}: {e}"));
    }
    let err = ping(&url("127.0.0.1", &format!("sslmode=verify-full&{ca}")))
        .await
        .expect_err("another name refused");
    assert!(err.contains("certificate not valid for name"), "{err}");
    // Plaintext to the TLS-only server: PostgreSQL's own refusal, not "db error".
    let err = start_gateway(&env(&url("127.0.0.1", "sslmode=disable")))
        .await
        .err()
        .expect("plaintext refused");
    assert!(err.contains("no encryption"), "{err}");
    // TLS, but the server's CA is not trusted (the public web roots): a certificate error.
    let err = ping(&url("localhost", "sslmode=verify-full"))
        .await
        .expect_err("an unknown issuer refused");
    assert!(err.contains("UnknownIssuer"), "{err}");
    // A mode that does not exist is named at start, not ignored.
    let err = start_gateway(&env(&url("localhost", "sslmode=verify-maybe")))
        .await
        .err()
        .expect("an unknown mode refused");
    assert!(err.contains("sslmode=verify-maybe"), "{err}");
}
