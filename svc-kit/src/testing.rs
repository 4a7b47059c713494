//! Helpers for tests that run a service binary as a real process (feature `testing`): start it
//! with a chosen environment, learn its port from its own "listening" log line, signal it.

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
    let mut child = command(bin, env).spawn().expect("spawn the service binary");
    let lines = pump_stderr(&mut child);
    let status = wait_with_timeout(&mut child, timeout);
    Exit {
        status,
        stderr: lines.try_iter().collect::<Vec<_>>().join("\n"),
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
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -TERM failed");
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

fn wait_with_timeout(child: &mut Child, timeout: Duration) -> ExitStatus {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait().expect("wait on the child") {
            return status;
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            panic!("the process did not exit within {timeout:?}");
        }
        // A child process has no async exit notification in std; a short poll is the honest
        // option here and it does not synchronise test logic, it only reaps.
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Extracts a string field from a flat JSON log line without a JSON dependency.
fn json_field(line: &str, field: &str) -> Option<String> {
    let key = format!("\"{field}\":\"");
    let start = line.find(&key)? + key.len();
    let end = line[start..].find('"')?;
    Some(line[start..start + end].to_owned())
}
