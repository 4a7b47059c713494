//! Helpers for tests that run a service binary as a real process (feature `testing`): start it
//! with a chosen environment, learn its port from its own "listening" log line, signal it; and
//! one throwaway PostgreSQL database per test ([`TestDb`]).

mod db;

pub use db::TestDb;

use std::{
    io::{BufRead, BufReader},
    net::SocketAddr,
    process::{Child, Command, ExitStatus, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

/// A service binary running as a child process.
pub struct ServerProcess {
    child: Child,
    pub addr: SocketAddr,
    /// Every stderr line seen so far, and the ones still coming.
    lines: mpsc::Receiver<String>,
}

/// How the process ended, with what it printed.
#[derive(Debug)]
pub struct Exit {
    pub status: ExitStatus,
    pub stderr: String,
}

/// Runs `bin` to completion with `env` (the parent's environment is cleared but for PATH), for
/// start-up failures. Gives up after `timeout`.
pub fn run_to_exit(bin: &str, env: &[(&str, &str)], timeout: Duration) -> Exit {
    run_to_exit_with_args(bin, &[], env, timeout)
}

/// As [`run_to_exit`], with command-line arguments (a subcommand such as `migrate`).
pub fn run_to_exit_with_args(
    bin: &str,
    args: &[&str],
    env: &[(&str, &str)],
    timeout: Duration,
) -> Exit {
    let mut child = command(bin, env)
        .args(args)
        .spawn()
        .expect("spawn the service binary");
    let lines = pump_stderr(&mut child);
    let status = wait_with_timeout(&mut child, timeout);
    // The pump may still be reading what the process wrote last: take lines until it sees the
    // pipe close (it then drops its sender), not just those already read.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut stderr = Vec::new();
    while let Ok(line) = lines.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        stderr.push(line);
    }
    Exit {
        status,
        stderr: stderr.join("\n"),
    }
}

impl ServerProcess {
    /// Starts `bin` and waits until it logs that it is listening. Pass `<PREFIX>_LISTEN_ADDR`
    /// with port 0 to get a free port.
    pub fn start(bin: &str, env: &[(&str, &str)]) -> Self {
        let mut child = command(bin, env).spawn().expect("spawn the service binary");
        let lines = pump_stderr(&mut child);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match lines.recv_timeout(left) {
                Ok(line) => line,
                Err(_) => {
                    let _ = child.kill();
                    panic!("{bin} did not log that it was listening within 30 s");
                }
            };
            if line.contains("listening") {
                let addr = json_field(&line, "addr").expect("the listening line carries addr");
                let addr = addr.parse().expect("addr is a socket address");
                return Self { child, addr, lines };
            }
        }
    }

    /// Sends SIGTERM, as Kubernetes does before stopping a pod.
    pub fn terminate(&self) {
        signal(self.child.id(), "-TERM").expect("SIGTERM");
    }

    /// Waits for the process to exit, killing it after `timeout`.
    pub fn wait(mut self, timeout: Duration) -> Exit {
        let status = wait_with_timeout(&mut self.child, timeout);
        Exit {
            status,
            stderr: self.lines.try_iter().collect::<Vec<_>>().join("\n"),
        }
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn command(bin: &str, env: &[(&str, &str)]) -> Command {
    let mut cmd = Command::new(bin);
    cmd.env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    cmd
}

fn pump_stderr(child: &mut Child) -> mpsc::Receiver<String> {
    let stderr = child.stderr.take().expect("stderr is piped");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

/// `kill <signal> <pid>`: a signal to one process by its own pid, never by name.
pub fn signal(pid: u32, signal: &str) -> Result<(), String> {
    let status = Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .map_err(|e| format!("run kill: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("kill {signal} {pid} failed"))
    }
}

/// The child's exit status once it exits, or `None` if it is still running after `timeout`.
pub fn wait_until_exit(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(Some(status)) = child.try_wait() {
            return Some(status);
        }
        if Instant::now() >= deadline {
            return None;
        }
        // std offers no wait with a timeout; polling the child is the portable way.
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_with_timeout(child: &mut Child, timeout: Duration) -> ExitStatus {
    wait_until_exit(child, timeout).unwrap_or_else(|| {
        let _ = child.kill();
        panic!("the process did not exit within {timeout:?}");
    })
}

/// Extracts a string field from a flat JSON log line without a JSON dependency.
fn json_field(line: &str, field: &str) -> Option<String> {
    let key = format!("\"{field}\":\"");
    let start = line.find(&key)? + key.len();
    let end = line[start..].find('"')?;
    Some(line[start..start + end].to_owned())
}

/// Checks `bin migrate` as a Kubernetes Job runs it: on a fresh database it applies every
/// migration up to `latest` (read from `history_table`) and exits 0; a second run finds nothing
/// to do and exits 0; with no DATABASE_URL it exits 2 naming the variable; unknown arguments
/// exit 2 with usage. `env` is the rest of the service's configuration.
pub fn check_migrate_subcommand(bin: &str, env: &[(&str, &str)], history_table: &str, latest: i32) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let db = rt.block_on(TestDb::create()).expect("a test database");
    let mut with_db = env.to_vec();
    with_db.push(("DATABASE_URL", db.url()));
    for round in ["first", "second"] {
        let exit = run_to_exit_with_args(bin, &["migrate"], &with_db, Duration::from_secs(60));
        assert!(
            exit.status.success(),
            "{round} migrate: {:?}\n{}",
            exit.status,
            exit.stderr
        );
        assert!(
            exit.stderr.contains("the schema is up to date"),
            "{}",
            exit.stderr
        );
    }
    let applied: i32 = rt.block_on(async {
        let (client, conn) = tokio_postgres::connect(db.url(), tokio_postgres::NoTls)
            .await
            .expect("connect to the migrated database");
        let conn = tokio::spawn(conn);
        let v = client
            .query_one(&format!("SELECT max(version) FROM {history_table}"), &[])
            .await
            .expect("the history table exists")
            .get(0);
        drop(client);
        let _ = conn.await;
        v
    });
    assert_eq!(applied, latest);

    let exit = run_to_exit_with_args(bin, &["migrate"], env, Duration::from_secs(30));
    assert_eq!(exit.status.code(), Some(2), "{}", exit.stderr);
    assert!(
        exit.stderr.contains("DATABASE_URL is not set"),
        "{}",
        exit.stderr
    );
    let exit = run_to_exit_with_args(bin, &["migrat"], env, Duration::from_secs(30));
    assert_eq!(exit.status.code(), Some(2), "{}", exit.stderr);
    assert!(exit.stderr.contains("migrate` to apply"), "{}", exit.stderr);
}
