//! An independent MCP implementation to test gateway-svc's MCP support against: the Python SDK's
//! (`mcp` on PyPI), so the two sides do not share a bug. [`McpDemoServer`] runs
//! `tests/python/mcp_demo_server.py` (an MCP server over streamable HTTP) as a child process, and
//! [`run_client`] runs `tests/python/mcp_client.py` (an MCP client) once.
//!
//! Both run on a virtualenv that [`python`] builds on first use at `<target>/mcp-venv`, from
//! `tests/python/requirements-mcp.txt` (pinned versions; PyPI must be reachable the first time).
//! Editing that file makes the next test rebuild the venv.
//!
//! Everything here blocks; from async tests call it through `tokio::task::spawn_blocking`.

use std::{
    fs::File,
    io::{BufRead, BufReader, Read},
    path::{Path, PathBuf},
    process::{Child, ChildStdin, Command, Output, Stdio},
    sync::{
        OnceLock,
        atomic::{AtomicU64, Ordering},
        mpsc,
    },
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use serde_json::Value;

/// How long the demo server may take to print `LISTENING <port>` (a cold interpreter importing
/// the SDK takes about a second; the rest is slack for a loaded 2-core machine).
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Bound on one `mcp_client.py` run; the script bounds itself at [`CLIENT_SCRIPT_TIMEOUT_SECS`]
/// and this is the backstop if even that fails.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(60);

/// What `mcp_client.py` is told to bound itself to (connect, list, call, all together).
const CLIENT_SCRIPT_TIMEOUT_SECS: u32 = 20;

/// Marker written into a finished venv: the requirements it was built from.
const MARKER: &str = "steward-requirements.txt";

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_path_buf()
}

/// `tests/python`, where the scripts and the requirements file live.
pub fn scripts_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("python")
}

fn requirements_file() -> PathBuf {
    scripts_dir().join("requirements-mcp.txt")
}

fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        // Cargo reads a relative CARGO_TARGET_DIR against where it was run; the workspace root
        // is the usual place, and the best guess available to a test process.
        Some(dir) if !dir.is_empty() => {
            let dir = PathBuf::from(dir);
            if dir.is_absolute() {
                dir
            } else {
                workspace_root().join(dir)
            }
        }
        _ => workspace_root().join("target"),
    }
}

/// A name no other process or thread is using right now.
fn unique_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{}-{nanos}-{n}", std::process::id())
}

fn venv_python(venv: &Path) -> PathBuf {
    venv.join("bin").join("python")
}

/// A venv is usable when it was built from exactly these requirements and its interpreter is
/// still there (`bin/python` is a symlink to the base interpreter, which can go away).
fn venv_is_current(venv: &Path, requirements: &str) -> bool {
    venv_python(venv).exists()
        && std::fs::read_to_string(venv.join(MARKER)).is_ok_and(|m| m == requirements)
}

fn run_or_panic(what: &str, cmd: &mut Command) -> Output {
    let out = cmd.stdin(Stdio::null()).output().unwrap_or_else(|e| {
        panic!("creating the MCP test venv: could not run {cmd:?} ({what}): {e}")
    });
    if !out.status.success() {
        panic!(
            "creating the MCP test venv: {cmd:?} ({what}) failed with {}\nstderr:\n{}\nstdout:\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            String::from_utf8_lossy(&out.stdout),
        );
    }
    out
}

/// Builds a venv in a fresh directory beside `venv`, then moves it into place. Another test
/// process may be doing the same at the same time: whichever rename lands first wins, and the
/// loser deletes its own copy and uses the winner's.
fn build_venv(venv: &Path, requirements: &str) {
    let parent = venv.parent().expect("the venv's parent directory");
    std::fs::create_dir_all(parent).unwrap_or_else(|e| {
        panic!(
            "creating the MCP test venv: mkdir {}: {e}",
            parent.display()
        )
    });
    let tmp = parent.join(format!("mcp-venv.tmp-{}", unique_suffix()));
    eprintln!(
        "building the MCP test venv at {} from {} (once; needs PyPI)",
        venv.display(),
        requirements_file().display()
    );
    run_or_panic(
        "create the venv",
        Command::new("python3").arg("-m").arg("venv").arg(&tmp),
    );
    run_or_panic(
        "install the requirements",
        Command::new(venv_python(&tmp))
            .args([
                "-m",
                "pip",
                "install",
                "--disable-pip-version-check",
                "-q",
                "-r",
            ])
            .arg(requirements_file()),
    );
    // Written last: a directory with the marker is a finished venv.
    std::fs::write(tmp.join(MARKER), requirements)
        .unwrap_or_else(|e| panic!("creating the MCP test venv: write the marker: {e}"));

    for _ in 0..3 {
        if std::fs::rename(&tmp, venv).is_ok() {
            return;
        }
        // The rename failed because something is at `venv` (a directory that is not empty).
        if venv_is_current(venv, requirements) {
            // Another process won the race with the same requirements: use theirs.
            let _ = std::fs::remove_dir_all(&tmp);
            return;
        }
        // A stale venv (other requirements, or a half-deleted one): move it aside first, so
        // that the swap is a rename, then delete it.
        let old = parent.join(format!("mcp-venv.old-{}", unique_suffix()));
        if std::fs::rename(venv, &old).is_ok() {
            let _ = std::fs::remove_dir_all(&old);
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
    panic!(
        "creating the MCP test venv: could not move the new venv into {}",
        venv.display()
    );
}

/// The venv's interpreter, building the venv first if it is missing or was built from other
/// requirements. Panics, naming the failed command and its stderr, if that fails.
pub fn python() -> PathBuf {
    static PYTHON: OnceLock<PathBuf> = OnceLock::new();
    PYTHON
        .get_or_init(|| {
            let requirements = std::fs::read_to_string(requirements_file()).unwrap_or_else(|e| {
                panic!("read {}: {e}", requirements_file().display());
            });
            let venv = target_dir().join("mcp-venv");
            if !venv_is_current(&venv, &requirements) {
                build_venv(&venv, &requirements);
            }
            venv_python(&venv)
        })
        .clone()
}

/// Where the demo server sends `notifications/tools/list_changed` after `add_tool`, on a
/// session that used the initialize handshake (2026-07-28 clients get it through
/// `subscriptions/listen` whatever this says).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ListChangedOn {
    /// On the `tools/call` response stream, before the result: deterministic.
    #[default]
    Request,
    /// On the session's standalone GET stream, as most servers do; the SDK drops it if the
    /// client has not opened that stream yet.
    Standalone,
    /// Both: the client gets it twice.
    Both,
}

impl ListChangedOn {
    fn as_arg(self) -> &'static str {
        match self {
            Self::Request => "request",
            Self::Standalone => "standalone",
            Self::Both => "both",
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct McpDemoOptions {
    /// Every HTTP request must carry `Authorization: Bearer <token>`, else 401.
    pub require_token: Option<String>,
    pub list_changed_on: ListChangedOn,
}

/// `tests/python/mcp_demo_server.py` running on 127.0.0.1, serving MCP at [`Self::url`].
///
/// Tools: `lookup` {query, limit 1..10} → "found: <query>"; `big_report` → 40,000 ASCII
/// characters; `slow` {seconds} → "done" after that long; `write_note` {text} (no
/// annotations) → "noted: <text>"; `add_tool` {name} → registers a read-only tool `name`
/// (→ "hello from <name>") and sends `notifications/tools/list_changed`. All but `write_note`
/// and `add_tool` are annotated `readOnlyHint: true`.
pub struct McpDemoServer {
    pub port: u16,
    /// `http://127.0.0.1:<port>/mcp`
    pub url: String,
    /// One JSON line per tool call that reached the server (see [`Self::calls`]).
    pub calls_log: PathBuf,
    pub pid: u32,
    child: Child,
    /// Held open for the server's life: `--exit-on-stdin-eof` makes the server exit when it
    /// closes, so a test process that dies without running destructors takes the server along.
    stdin: Option<ChildStdin>,
    stderr_log: PathBuf,
    dir: PathBuf,
    dead: bool,
}

impl McpDemoServer {
    /// Starts the server (optionally requiring a bearer token) and waits for it to listen.
    pub fn start(require_token: Option<&str>) -> McpDemoServer {
        Self::start_with(McpDemoOptions {
            require_token: require_token.map(str::to_owned),
            ..McpDemoOptions::default()
        })
    }

    /// Starts the server and waits (at most a minute) for its `LISTENING <port>` line; panics
    /// with its stderr if it does not get there.
    pub fn start_with(options: McpDemoOptions) -> McpDemoServer {
        let python = python();
        let dir = std::env::temp_dir().join(format!("steward-mcp-demo-{}", unique_suffix()));
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let calls_log = dir.join("calls.jsonl");
        // stderr goes to a file, not a pipe: nothing has to drain it, and it is still there to
        // read after the process is gone.
        let stderr_log = dir.join("stderr.log");
        let stderr = File::create(&stderr_log)
            .unwrap_or_else(|e| panic!("create {}: {e}", stderr_log.display()));

        let mut cmd = Command::new(&python);
        cmd.arg(scripts_dir().join("mcp_demo_server.py"))
            .args(["--port", "0", "--exit-on-stdin-eof"])
            .arg("--calls-log")
            .arg(&calls_log)
            .args(["--list-changed-on", options.list_changed_on.as_arg()]);
        if let Some(token) = &options.require_token {
            cmd.args(["--require-token", token]);
        }
        let mut child = cmd
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(stderr))
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
        let pid = child.id();
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("stdout is piped");

        // The reader hands over the LISTENING line, then keeps reading to the end so the
        // server can never block on a full stdout pipe.
        let (tx, rx) = mpsc::channel();
        let echo = std::env::var_os("TEST_LOG").is_some();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if echo {
                    eprintln!("mcp-demo[{pid}] stdout: {line}");
                }
                if let Some(port) = line
                    .strip_prefix("LISTENING ")
                    .and_then(|p| p.trim().parse::<u16>().ok())
                    && let Some(tx) = tx.take()
                {
                    let _ = tx.send(port);
                }
            }
            // Dropping `tx` here (if it is still held) tells the waiter the server exited.
        });

        let mut server = McpDemoServer {
            port: 0,
            url: String::new(),
            calls_log,
            pid,
            child,
            stdin,
            stderr_log,
            dir,
            dead: false,
        };
        match rx.recv_timeout(START_TIMEOUT) {
            Ok(port) => {
                server.port = port;
                server.url = format!("http://127.0.0.1:{port}/mcp");
                server
            }
            Err(e) => {
                let why = match e {
                    mpsc::RecvTimeoutError::Timeout => {
                        format!("did not print LISTENING within {START_TIMEOUT:?}")
                    }
                    mpsc::RecvTimeoutError::Disconnected => {
                        "exited before printing LISTENING".to_owned()
                    }
                };
                server.kill9();
                panic!(
                    "the MCP demo server (pid {pid}) {why}; stderr:\n{}",
                    server.stderr()
                );
            }
        }
    }

    /// What the server wrote to stderr so far (uvicorn and SDK warnings, tracebacks).
    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr_log).unwrap_or_default()
    }

    /// Every line of the calls log so far, as written.
    pub fn log_lines(&self) -> Vec<String> {
        std::fs::read_to_string(&self.calls_log)
            .unwrap_or_default()
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// The tool calls that reached the server, in order: `{"tool": name, "args": {...}}`, the
    /// arguments exactly as received. Other log lines (`slow`'s
    /// `{"event": "slow-started", ...}` marker) are left out.
    pub fn calls(&self) -> Vec<Value> {
        self.log_lines()
            .iter()
            // A line still being written (no newline yet) may not parse; it is skipped here
            // and seen complete on the next read.
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v.get("tool").is_some())
            .collect()
    }

    /// Waits at most `bound` for a calls-log line containing `needle` (e.g. `slow-started`, or
    /// `"tool":"lookup"`), polling the file; true if one appeared.
    pub fn wait_for_call_line(&self, needle: &str, bound: Duration) -> bool {
        wait_for_log_line(&self.calls_log, needle, bound)
    }

    /// SIGKILL to the server's own pid (`Child::kill`), then reaps it: open sessions and
    /// streams die with it, mid-response if need be.
    pub fn kill9(&mut self) {
        if self.dead {
            return;
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.stdin = None;
        self.dead = true;
    }

    pub fn is_dead(&self) -> bool {
        self.dead
    }
}

impl Drop for McpDemoServer {
    fn drop(&mut self) {
        self.kill9();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Runs `mcp_client.py` against `url` once: initialize, `tools/list`, then the call if one is
/// given. `headers` are sent on every HTTP request (e.g. `("Authorization", "Bearer t")`).
///
/// Returns the script's JSON line: `{"ok": true, "protocol_version", "tools": [names],
/// "tool_schemas": {name: inputSchema}, "tool_annotations": {name: {...} or null},
/// "call": {"is_error", "text"}, "notifications": [methods]}`, or `{"ok": false, "stage",
/// "error", "http_status"?, "code"?}` (a JSON-RPC error from the call is `ok: false` with its
/// `code`; an HTTP 401 has `http_status: 401`).
pub fn run_client(url: &str, headers: &[(&str, &str)], call: Option<(&str, Value)>) -> Value {
    let mut args = vec!["--url".to_owned(), url.to_owned()];
    for (name, value) in headers {
        args.push("--header".to_owned());
        args.push(format!("{name}: {value}"));
    }
    if let Some((tool, arguments)) = call {
        args.extend(["--call".to_owned(), tool.to_owned()]);
        args.extend(["--args".to_owned(), arguments.to_string()]);
    }
    run_client_args(&args)
}

/// `mcp_client.py` with any arguments (e.g. `--list-after`, `--mode 2026-07-28`; see the
/// script); bounded at a minute. Panics with its stderr when it prints no JSON line.
pub fn run_client_args(args: &[String]) -> Value {
    let python = python();
    let mut cmd = Command::new(&python);
    cmd.arg(scripts_dir().join("mcp_client.py"))
        .args(["--timeout", &CLIENT_SCRIPT_TIMEOUT_SECS.to_string()])
        .args(args)
        .env("PYTHONUNBUFFERED", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {cmd:?}: {e}"));
    let mut stdout = child.stdout.take().expect("stdout is piped");
    let mut stderr = child.stderr.take().expect("stderr is piped");
    // Both pipes are read to the end on their own threads, so neither can fill up and stall
    // the client; the end of stdout is the client exiting.
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut out = String::new();
        let _ = stdout.read_to_string(&mut out);
        let _ = tx.send(out);
    });
    let err_reader = std::thread::spawn(move || {
        let mut err = String::new();
        let _ = stderr.read_to_string(&mut err);
        err
    });
    let out = match rx.recv_timeout(CLIENT_TIMEOUT) {
        Ok(out) => out,
        Err(_) => {
            let _ = child.kill();
            let _ = child.wait();
            let err = err_reader.join().unwrap_or_default();
            panic!("{cmd:?} did not finish within {CLIENT_TIMEOUT:?}; stderr:\n{err}");
        }
    };
    let status = child.wait();
    let err = err_reader.join().unwrap_or_default();
    let line = out.lines().rev().find(|l| !l.trim().is_empty());
    match line.map(serde_json::from_str::<Value>) {
        Some(Ok(value)) => value,
        _ => {
            panic!("{cmd:?} printed no JSON line (exit {status:?}); stdout:\n{out}\nstderr:\n{err}")
        }
    }
}

/// Whether a line containing `needle` appears in the server's calls log (`calls_log`) within
/// `bound`; usable without the [`McpDemoServer`] itself (from a blocking task, say).
pub fn wait_for_log_line(calls_log: &Path, needle: &str, bound: Duration) -> bool {
    let deadline = Instant::now() + bound;
    loop {
        if std::fs::read_to_string(calls_log)
            .is_ok_and(|log| log.lines().any(|l| l.contains(needle)))
        {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        // The server only writes a file; there is nothing to wait on but the file itself.
        std::thread::sleep(Duration::from_millis(20));
    }
}
