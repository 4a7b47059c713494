//! A throwaway PostgreSQL server of a test's own, for faults that stop the database itself (the
//! machine's shared server at 127.0.0.1:5432 is never touched).
//!
//! [`PgServer::start`] runs `initdb` (trust auth, user `postgres`) in a fresh directory under
//! `/tmp` and starts the postmaster directly as a child process, listening on 127.0.0.1 at a
//! free port with its unix socket in that directory. `fsync` is off: safe when only the server
//! dies, not the machine. `synchronous_commit` stays on: an immediate stop loses asynchronous
//! commits the clients were already told had succeeded. PostgreSQL refuses to run as root, so
//! under root both run as the `postgres` OS user (set on the child itself, no `runuser` in
//! between, so the child's pid is the postmaster's). Readiness is the server's own "ready to
//! accept connections" log line; an exit is reported by the thread that reaps it.
//!
//! [`PgServer::stop_immediate`] is `pg_ctl stop -m immediate`: SIGQUIT to the postmaster, which
//! quits every backend at once without a checkpoint, so the next start runs crash recovery.
//! (`kill -9` of the postmaster alone would leave its backends behind holding the shared memory,
//! and the next start would refuse.) [`PgServer::restart_same_port`] starts it again on the same
//! port and data directory. Dropping the server stops it and removes the directory; a watchdog
//! does both if the test process dies without running destructors.
//!
//! [`PgServer::start_tls`] gives the server a certificate (`ssl=on`) and accepts TCP clients only
//! over TLS (`hostssl` in pg_hba.conf), for the tests of DATABASE_URL's `sslmode`.
//!
//! The binaries come from `STEWARD_PG_BIN` (default: the newest `/usr/lib/postgresql/<n>/bin`). The server's
//! log is echoed with `TEST_LOG=1`.

use std::{
    io::{BufRead, BufReader},
    net::TcpListener,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::{Arc, Mutex, mpsc},
    time::{Duration, Instant},
};

use tokio_postgres::NoTls;

/// How long initdb or a (re)start may take.
const START_TIMEOUT: Duration = Duration::from_secs(30);
/// How long the postmaster may take to exit after SIGQUIT before it gets SIGKILL.
const STOP_TIMEOUT: Duration = Duration::from_secs(10);
const READY_LINE: &str = "database system is ready to accept connections";

/// `STEWARD_PG_BIN`, or the newest Debian-packaged server (`/usr/lib/postgresql/<n>/bin`).
fn bin_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("STEWARD_PG_BIN") {
        return PathBuf::from(dir);
    }
    let newest = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .max()
        .unwrap_or(15);
    PathBuf::from(format!("/usr/lib/postgresql/{newest}/bin"))
}

/// The real uid of this process, from /proc (std has no getuid).
fn real_uid() -> Option<u32> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

/// The uid and gid of the `postgres` OS user, from /etc/passwd.
fn postgres_user() -> Result<(u32, u32), String> {
    let passwd =
        std::fs::read_to_string("/etc/passwd").map_err(|e| format!("read /etc/passwd: {e}"))?;
    passwd
        .lines()
        .map(|l| l.split(':').collect::<Vec<_>>())
        .find(|f| f.len() > 3 && f[0] == "postgres")
        .and_then(|f| Some((f[2].parse().ok()?, f[3].parse().ok()?)))
        .ok_or_else(|| "no `postgres` user in /etc/passwd (PostgreSQL cannot run as root)".into())
}

/// What a postmaster's two watching threads report.
enum Report {
    /// Its log said it is ready.
    Ready,
    /// The thread that reaps it saw it exit.
    Exited(ExitStatus),
}

/// One postmaster process.
struct Postmaster {
    pid: u32,
    reports: mpsc::Receiver<Report>,
    status: Option<ExitStatus>,
    /// `sh` blocked reading a pipe only this test process holds: if the test process dies, the
    /// pipe closes and it stops this postmaster and removes the directory.
    watchdog: Option<Child>,
}

impl Postmaster {
    fn has_exited(&mut self) -> bool {
        while self.status.is_none() {
            match self.reports.try_recv() {
                Ok(Report::Exited(status)) => self.status = Some(status),
                Ok(Report::Ready) => {}
                Err(_) => break,
            }
        }
        self.status.is_some()
    }

    fn signal(&mut self, signal: &str) {
        if self.has_exited() {
            return;
        }
        // The postmaster's own pid, never a name.
        let _ = Command::new("kill")
            .args([signal, &self.pid.to_string()])
            .stderr(Stdio::null())
            .status();
    }

    /// Waits for the exit the reaper reports, at most `bound`.
    fn wait_exit(&mut self, bound: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + bound;
        while self.status.is_none() {
            match self
                .reports
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(Report::Exited(status)) => self.status = Some(status),
                Ok(Report::Ready) => {}
                Err(_) => break,
            }
        }
        self.status
    }

    fn stop_watchdog(&mut self) {
        if let Some(mut w) = self.watchdog.take() {
            let _ = w.kill();
            let _ = w.wait();
        }
    }

    /// SIGQUIT (immediate shutdown), then SIGKILL if it lingers; reaped either way.
    fn stop(&mut self) -> Result<ExitStatus, String> {
        self.stop_watchdog();
        self.signal("-QUIT");
        if let Some(status) = self.wait_exit(STOP_TIMEOUT) {
            return Ok(status);
        }
        self.signal("-KILL");
        self.wait_exit(STOP_TIMEOUT).ok_or_else(|| {
            format!(
                "postmaster {} did not exit after SIGQUIT and SIGKILL",
                self.pid
            )
        })
    }
}

/// A private PostgreSQL server, stopped and deleted when dropped.
pub struct PgServer {
    dir: PathBuf,
    data: PathBuf,
    port: u16,
    /// (uid, gid) the server runs as, when this process is root.
    run_as: Option<(u32, u32)>,
    postmaster: Option<Postmaster>,
    log: Arc<Mutex<Vec<String>>>,
    /// Whether the postmaster is started with `ssl=on` (its certificate is in the data directory).
    tls: bool,
}

impl PgServer {
    /// initdb in a fresh directory, then the postmaster on a free port, ready. Blocking; see
    /// [`PgServer::spawn`].
    pub fn start() -> Result<Self, String> {
        Self::start_with(None)
    }

    /// As [`PgServer::start`], serving TLS with this PEM certificate chain and key and refusing
    /// TCP clients that do not use it.
    pub fn start_tls(cert_pem: &str, key_pem: &str) -> Result<Self, String> {
        Self::start_with(Some((cert_pem, key_pem)))
    }

    fn start_with(tls: Option<(&str, &str)>) -> Result<Self, String> {
        let bin = bin_dir();
        if !bin.join("postgres").exists() {
            return Err(format!(
                "no PostgreSQL server binaries in {} (set STEWARD_PG_BIN)",
                bin.display()
            ));
        }
        let run_as = match real_uid() {
            Some(0) => Some(postgres_user()?),
            _ => None,
        };
        let dir =
            std::env::temp_dir().join(format!("steward-pg-{}", uuid::Uuid::new_v4().simple()));
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&dir)
                .map_err(|e| format!("create {}: {e}", dir.display()))?;
        }
        // From here on, dropping `server` removes the directory.
        let mut server = Self {
            data: dir.join("data"),
            dir,
            port: 0,
            run_as,
            postmaster: None,
            log: Arc::default(),
            tls: tls.is_some(),
        };
        if let Some((uid, gid)) = run_as {
            std::os::unix::fs::chown(&server.dir, Some(uid), Some(gid))
                .map_err(|e| format!("chown {}: {e}", server.dir.display()))?;
        }
        let out = server
            .command("initdb")
            .arg("-D")
            .arg(&server.data)
            .args([
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-locale",
                "--no-sync",
                "--no-instructions",
            ])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("run initdb: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "initdb failed ({}):\n{}{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        if let Some((cert, key)) = tls {
            server.install_certificate(cert, key)?;
        }
        // A free port: bind port 0, read it, let go. Another process could take it in between;
        // the start then fails loudly.
        server.port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("pick a free port: {e}"))?
            .port();
        server.launch()?;
        Ok(server)
    }

    /// Writes the certificate and key where `ssl=on` looks for them (the key readable by the
    /// server's user only, as PostgreSQL insists) and turns every TCP `host` rule into `hostssl`.
    fn install_certificate(&self, cert: &str, key: &str) -> Result<(), String> {
        use std::os::unix::fs::PermissionsExt;
        for (name, pem, mode) in [("server.crt", cert, 0o644), ("server.key", key, 0o600)] {
            let path = self.data.join(name);
            std::fs::write(&path, pem).map_err(|e| format!("write {}: {e}", path.display()))?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
                .map_err(|e| format!("chmod {}: {e}", path.display()))?;
            if let Some((uid, gid)) = self.run_as {
                std::os::unix::fs::chown(&path, Some(uid), Some(gid))
                    .map_err(|e| format!("chown {}: {e}", path.display()))?;
            }
        }
        let hba = self.data.join("pg_hba.conf");
        let rules = std::fs::read_to_string(&hba)
            .map_err(|e| format!("read {}: {e}", hba.display()))?
            .lines()
            .map(|line| match line.strip_prefix("host ") {
                Some(rest) => format!("hostssl {rest}"),
                None => line.to_owned(),
            })
            .collect::<Vec<_>>()
            .join("\n");
        std::fs::write(&hba, rules + "\n").map_err(|e| format!("write {}: {e}", hba.display()))
    }

    /// [`PgServer::start`] off the async runtime.
    pub async fn spawn() -> Result<Self, String> {
        tokio::task::spawn_blocking(Self::start)
            .await
            .map_err(|e| e.to_string())?
    }

    /// A command for one of the server binaries, as the server's user, in its directory.
    fn command(&self, name: &str) -> Command {
        let mut cmd = Command::new(bin_dir().join(name));
        cmd.env_clear()
            .env("PATH", std::env::var_os("PATH").unwrap_or_default())
            .env("LC_ALL", "C")
            .current_dir(&self.dir);
        if let Some((uid, gid)) = self.run_as {
            use std::os::unix::process::CommandExt;
            // std drops the supplementary groups when root sets a uid.
            cmd.uid(uid).gid(gid);
        }
        cmd
    }

    /// Starts the postmaster on `self.port` and waits for its ready line.
    fn launch(&mut self) -> Result<(), String> {
        let mut child = self
            .command("postgres")
            .arg("-D")
            .arg(&self.data)
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(&self.dir)
            .args([
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "fsync=off",
                "-c",
                "full_page_writes=off",
                "-c",
                "shared_buffers=32MB",
                "-c",
                "max_connections=200",
                "-c",
                "logging_collector=off",
            ])
            .args(["-c", if self.tls { "ssl=on" } else { "ssl=off" }])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("start postgres: {e}"))?;
        let pid = child.id();
        let stderr = child.stderr.take().expect("stderr is piped");
        let (reports_tx, reports) = mpsc::channel();
        let echo = std::env::var_os("TEST_LOG").is_some();
        {
            let log = self.log.clone();
            let ready = reports_tx.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    if echo {
                        eprintln!("postgres[{pid}] {line}");
                    }
                    if line.contains(READY_LINE) {
                        let _ = ready.send(Report::Ready);
                    }
                    log.lock().unwrap_or_else(|e| e.into_inner()).push(line);
                }
            });
        }
        std::thread::spawn(move || {
            if let Ok(status) = child.wait() {
                let _ = reports_tx.send(Report::Exited(status));
            }
        });
        let watchdog = Command::new("sh")
            .args([
                "-c",
                // Cleanup after the test process died: not a synchronisation of the test.
                "read _ignored; kill -QUIT \"$1\" 2>/dev/null; sleep 3; kill -9 \"$1\" 2>/dev/null; rm -rf \"$2\"",
                "pg-watchdog",
                &pid.to_string(),
            ])
            .arg(&self.dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok();
        let mut postmaster = Postmaster {
            pid,
            reports,
            status: None,
            watchdog,
        };
        // Ready, or an exit (a taken port, a bad setting): whichever is reported first.
        let failed = match postmaster.reports.recv_timeout(START_TIMEOUT) {
            Ok(Report::Ready) => None,
            Ok(Report::Exited(status)) => {
                postmaster.status = Some(status);
                Some(format!("postgres exited at start ({status})"))
            }
            Err(_) => Some(format!("postgres was not ready within {START_TIMEOUT:?}")),
        };
        if let Some(why) = failed {
            let _ = postmaster.stop();
            return Err(format!("{why}:\n{}", self.log_tail(30)));
        }
        self.postmaster = Some(postmaster);
        Ok(())
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The postmaster's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.postmaster.as_ref().map(|p| p.pid)
    }

    /// A connection URL for database `db`.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// A key=value connection string for database `db` over the server's unix socket, which
    /// pg_hba.conf trusts whether or not TCP clients must use TLS.
    pub fn socket_dsn(&self, db: &str) -> String {
        format!(
            "host={} port={} user=postgres dbname={db}",
            self.dir.display(),
            self.port
        )
    }

    /// Creates database `name`.
    pub async fn create_database(&self, name: &str) -> Result<(), String> {
        // Over the unix socket, which pg_hba.conf trusts with or without TLS on TCP.
        let (client, conn) = tokio_postgres::connect(&self.socket_dsn("postgres"), NoTls)
            .await
            .map_err(|e| format!("connect to the private PostgreSQL: {e}"))?;
        let conn = tokio::spawn(conn);
        let created = client
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .map_err(|e| format!("CREATE DATABASE {name}: {e}"));
        drop(client);
        let _ = conn.await;
        created
    }

    /// `pg_ctl stop -m immediate`: SIGQUIT to the postmaster; every backend quits at once, no
    /// checkpoint (the next start recovers from the WAL). Returns once the postmaster exited.
    pub fn stop_immediate(&mut self) -> Result<(), String> {
        let Some(mut postmaster) = self.postmaster.take() else {
            return Err("the server is not running".into());
        };
        postmaster.stop().map(|_| ())
    }

    /// Starts the server again on the same port and data directory, ready.
    pub fn restart_same_port(&mut self) -> Result<(), String> {
        if self.postmaster.is_some() {
            return Err("the server is still running".into());
        }
        self.launch()
    }

    /// The last `n` lines the server logged.
    pub fn log_tail(&self, n: usize) -> String {
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        log[log.len().saturating_sub(n)..].join("\n")
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        if let Some(mut postmaster) = self.postmaster.take()
            && let Err(e) = postmaster.stop()
        {
            eprintln!("{e}");
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
