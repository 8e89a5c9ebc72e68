//! The conformance kit of dlock: the suite every dlock backend passes, and the throwaway servers
//! and helpers its tests run on, for anyone who writes a [`LockBackend`](dlock::backend::LockBackend) of
//! their own.
//!
//! A backend's test file implements [`Harness`] (how to open providers on the store, how to
//! break a held lock behind the holder's back, the bounds the backend promises) and invokes
//! [`conformance_suite!`], which makes one `#[tokio::test]` per case of [`conformance`]:
//! exclusion between providers and between tasks, waits, timeouts, cancellation, release on
//! drop, fencing tokens, loss detection, and acquisitions abandoned at random points. The
//! calling crate needs `tokio` (with the `macros` and `rt-multi-thread` features) among its
//! dev-dependencies, as `#[tokio::test]` names it.
//!
//! # Running the suite on your own backend
//!
//! Here the backend is an in-process table, as small as a [`LockBackend`](dlock::backend::LockBackend)
//! can be; yours talks to its store instead. The harness breaks a lock by taking the key from
//! its holder in the store.
//!
//! (This is `tests/memory.rs` of this crate, which runs it.)
#![doc = concat!("```\n", include_str!("../tests/memory.rs"), "# fn main() {}\n```\n")]
//!
//! `conformance_suite!(optional $make)` takes a `$make` that yields `Option<Harness>` and fails
//! every case as not run on `None`, and `conformance_suite!(attributes
//! [#[ignore = "..."]] $make)` puts attributes on every case. Each case is also a plain async
//! function of [`conformance`], for a test that runs one of them in a setting of its own.
//!
//! # Throwaway servers and helpers
//!
//! With the matching feature, the modules `postgres`, `mysql` (MariaDB and MySQL) and `redis`
//! (Redis and Valkey) start servers from their installed binaries in temp dirs on free loopback
//! ports, or inside a network namespace of [`netns`] ([`Placement`]), and `etcd` single
//! servers and clusters of several members on loopback; `tls` makes certificate
//! authorities and server certificates for them. A fixture whose server binary (or root, for
//! [`netns`]) is missing fails the test, saying it was not run and how to install what it
//! needs ([`not_run`], [`server_binary`]), whether `CI` is set or not: a test that could not
//! run never counts as passed. The free functions here ([`unique_key`],
//! [`wait_until`], [`eventually`], [`runtime`], [`foreign_panics`]) serve every test.
//!
//! # Features
//!
//! `sqlite`, `postgres`, `mysql`, `redis`, `etcd`, `mssql` and `oracle` turn on dlock's backend
//! of that name; `postgres`, `mysql`, `redis` and `etcd` also the throwaway servers of that
//! name, and with any of the first three `tls`.
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod conformance;
#[cfg(feature = "etcd")]
pub mod etcd;
#[cfg(feature = "mysql")]
pub mod mysql;
pub mod netns;
mod placement;
#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub mod redis;
#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
pub mod tls;

pub use conformance::{Harness, StoreInspection};
pub use placement::{Placement, ServerTls};

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A writer that keeps all that is written to it, for a `tracing_subscriber` writer
/// (`.with_writer(move || captured.clone())`); clones share one buffer.
#[derive(Debug, Clone, Default)]
pub struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Captured {
    /// What was written so far, as text.
    pub fn text(&self) -> String {
        self.text_from(0)
    }

    /// How many bytes were written so far (a mark for [`text_from`](Captured::text_from)).
    pub fn len(&self) -> usize {
        self.bytes().len()
    }

    /// Whether nothing was written yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What was written from byte `start` on, as text.
    pub fn text_from(&self, start: usize) -> String {
        let bytes = self.bytes();
        String::from_utf8_lossy(bytes.get(start..).unwrap_or_default()).into_owned()
    }

    fn bytes(&self) -> std::sync::MutexGuard<'_, Vec<u8>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.bytes().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Spawns `sh -c script`, whose script starts with `cat >/dev/null`: it waits until the
/// returned end of its standard input closes (when it is dropped, or when this process exits,
/// even without dropping it), then stops what a fixture started and removes its files. Nobody
/// waits for the process: it is tiny and ends by itself.
#[cfg(any(feature = "postgres", feature = "mysql", feature = "redis"))]
pub(crate) fn reaper(script: &str) -> std::process::ChildStdin {
    let mut reaper = std::process::Command::new("sh")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn reaper");
    let stdin = reaper.stdin.take().expect("reaper stdin");
    std::mem::forget(reaper);
    stdin
}

/// What a test that cannot run here says, `bash .ci/run` being the way to get everything the
/// suite runs on.
pub const INSTALL_HINT: &str = "run `bash .ci/run`, which installs the servers";

/// Fails the calling test because `missing` (something it needs: a server binary, root, a
/// tool) is not there, saying so and `remedy`: `not run: {missing} ({remedy})`. Every fixture
/// of this kit calls it where what it needs is missing, whether `CI` is set or not: a test that
/// could not run must never count as passed, and libtest shows a failing test's message where
/// it hides a passing one's.
#[track_caller]
pub fn not_run(missing: &str, remedy: &str) -> ! {
    panic!("not run: {missing} ({remedy})")
}

/// The binary of `server` (`"Redis 8 server"`) that the variable `env` names, if it is set, or
/// else the one `find` finds (on PATH, in an installed package); fails the test
/// ([`not_run`]) when there is none, naming `env` and how to install the servers. A variable
/// naming no file is an error too, not a reason to look elsewhere.
#[track_caller]
pub fn server_binary(
    server: &str,
    env: &str,
    find: impl FnOnce() -> Option<std::path::PathBuf>,
) -> std::path::PathBuf {
    match std::env::var_os(env) {
        Some(named) => {
            let path = std::path::PathBuf::from(&named);
            if !path.is_file() {
                not_run(
                    &format!("no {server} binary here"),
                    &format!(
                        "{env}={} is not a file: point it at the binary, or unset it and {INSTALL_HINT}",
                        path.display()
                    ),
                );
            }
            path
        }
        None => find().unwrap_or_else(|| {
            not_run(
                &format!("no {server} binary here"),
                &format!("set {env} or {INSTALL_HINT}"),
            )
        }),
    }
}

/// A key no other test (or earlier run against the same server) uses: `name`, this process's
/// id, a counter and a random number.
pub fn unique_key(name: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    format!(
        "{name}:{}:{}:{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed),
        fastrand::u64(..)
    )
}

/// Every panic raised so far in this test binary outside the test code (the calling crate's
/// `tests/` and this kit's own files): in dlock, in the backend under test, or in a dependency
/// they called, as `file:line: message`. The first call installs a panic hook that records them
/// before it runs the hook that was there. A panic in a task a backend spawns (a background
/// release, a connection task) never reaches a test's `JoinHandle`; this is how a test sees it.
/// Tests run in parallel threads of one binary, so a count taken around a test also sees panics
/// of the library in other tests of the same binary: each one is a defect all the same.
pub fn foreign_panics() -> Vec<String> {
    use std::sync::{Mutex, OnceLock};
    static PANICS: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    let panics = PANICS.get_or_init(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let (file, line) = info.location().map_or(("?", 0), |l| (l.file(), l.line()));
            if !is_test_code(file) {
                let message = info
                    .payload()
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| info.payload().downcast_ref::<String>().cloned())
                    .unwrap_or_default();
                if let Some(panics) = PANICS.get() {
                    panics
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push(format!("{file}:{line}: {message}"));
                }
            }
            previous(info);
        }));
        Mutex::new(Vec::new())
    });
    panics
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone()
}

/// Whether a panic at `file` is the test code's own: an integration test of the calling crate
/// (`tests/...`) or a case or fixture of this kit (its source folder, however the kit was
/// built: as a member of the calling workspace or from a registry).
fn is_test_code(file: &str) -> bool {
    let kit = file!().rsplit_once(['/', '\\']).map_or("", |(dir, _)| dir);
    file.starts_with("tests/") || (!kit.is_empty() && file.starts_with(kit))
}

/// Polls `condition` (an async closure, so it may ask a server) every few milliseconds until
/// it holds, and fails the test, naming `what`, if it does not hold within `limit`: for
/// waiting on something that can be observed (a wait has reached the server, a renewal has
/// happened) instead of sleeping and hoping it has.
pub async fn wait_until(what: &str, limit: Duration, mut condition: impl AsyncFnMut() -> bool) {
    let started = std::time::Instant::now();
    loop {
        if condition().await {
            return;
        }
        assert!(
            started.elapsed() < limit,
            "timed out after {limit:?} waiting until {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A multi-thread Tokio runtime of `workers` threads, for tests that make and drop runtimes of
/// their own.
pub fn runtime(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("a Tokio runtime")
}

/// Sends `signal` (`"STOP"`, `"CONT"`) to the process `child`: whether it was delivered (not
/// when the process has exited). A stopped server holds its connections open and answers
/// nothing, as one behind a silent network or in a long pause.
pub fn signal(child: &std::process::Child, signal: &str) -> bool {
    std::process::Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(child.id().to_string())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

/// Waits for `condition` to hold, checking every few milliseconds, for at most `limit`: whether
/// it did.
pub async fn eventually(limit: Duration, mut condition: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if condition() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
