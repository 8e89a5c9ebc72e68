//! Holders paused past their lease: a child process (`dlock-worker paused`) holds a lock
//! through each API of dlock (a guard, a `Leader`'s term, `run_exclusive`, `with_lock` and the
//! builder's `with_lock`, a handler's `HeldLock` behind the axum layer, `#[distributed_lock]`
//! with `on_lost = finish` and `on_lost = cancel`); this process stops it (`SIGSTOP`), takes
//! every one of its locks over once their leases have run out, keeps it stopped for more than
//! a lease, and resumes it (`SIGCONT`). At the work's first step after the pause, every check
//! the API offers must answer "lost": the process may no longer hold the lock, and another
//! does. That includes tasks the work spawned with a guard's `LostSignal`, a `LeaderTerm` or a
//! `HeldLock`, which dlock does not poll. Eight pauses per backend, on every lease backend: SQLite, Redis, Redlock and etcd.
//!
//! Session engines (PostgreSQL, MySQL/MariaDB, SQL Server, Oracle) are not here: a stopped
//! process keeps its session, and with it its lock, so nobody can take it over meanwhile.
//!
//! The worker also reports, as `lag_...`, checks the docs say may lag: a guard's bare lost
//! token (which no code of dlock polls), and the bare tokens dlock hands the work when the
//! pause fell inside the poll of the work that took the step (after dlock's check of the
//! clock before that poll; the worker tells this from when that poll began). This test prints
//! how often they lagged, without requiring them.

mod support;

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant};

use dlock::{LockGuard, LockProvider};

/// The APIs the worker checks (its `paused::APIS`).
const APIS: [&str; 8] = [
    "guard",
    "leader",
    "run-exclusive",
    "with-lock",
    "builder-with-lock",
    "held-lock",
    "macro-finish",
    "macro-cancel",
];

/// Pauses per backend: enough that a check which answers "still held" after some pauses
/// cannot pass by luck (the outside test saw the leader's term say so in 8 of 8 pauses on
/// Redis, 5 of 8 on SQLite).
const ROUNDS: usize = 8;

/// The lease of every lock (`run_exclusive`'s `at_most_for` too).
const LEASE: Duration = Duration::from_secs(1);

/// The worker, with its stdout lines read by a thread.
struct Paused {
    child: Child,
    lines: Receiver<String>,
}

impl Paused {
    fn spawn(url: &str, id: u64) -> Paused {
        use std::io::BufRead;
        let mut child = Command::new(support::worker_bin())
            .args([
                "paused",
                url,
                &id.to_string(),
                &ROUNDS.to_string(),
                &LEASE.as_millis().to_string(),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the worker");
        let stdout = child.stdout.take().expect("stdout");
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Paused { child, lines }
    }

    /// The worker's next line, within `limit`; `awaited` says what for, if it does not come.
    fn line(&self, limit: Duration, awaited: &str) -> String {
        tokio::task::block_in_place(|| self.lines.recv_timeout(limit)).unwrap_or_else(|_| {
            panic!("the worker said nothing for {limit:?}, while this waited for {awaited}")
        })
    }

    fn signal(&self, signal: &str) {
        assert!(
            dlock_testkit::signal(&self.child, signal),
            "kill -{signal} the worker"
        );
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        let _ = dlock_testkit::signal(&self.child, "CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Takes every key in `keys` that `taken` does not hold yet, each waiting up to `limit`.
async fn take_over(
    provider: &LockProvider,
    keys: &[String],
    taken: &mut BTreeMap<String, LockGuard>,
    limit: Duration,
) -> Vec<String> {
    let waits = keys
        .iter()
        .filter(|key| !taken.contains_key(*key))
        .map(|key| {
            let (provider, key) = (provider.clone(), key.clone());
            tokio::spawn(async move {
                let got = provider.acquire(&key, limit).await;
                (key, got)
            })
        })
        .collect::<Vec<_>>();
    let mut failures = Vec::new();
    for wait in waits {
        let (key, got) = wait.await.expect("join");
        match got {
            Ok(guard) => {
                taken.insert(key, guard);
            }
            Err(err) => failures.push(format!("{key}: {err}")),
        }
    }
    failures
}

/// Runs the worker's rounds on `url`: per round, stop it once every API holds, take every
/// lock over, keep it stopped for more than a lease, resume it, and read its checks. Fails
/// naming each check that answered "still held" and in how many pauses.
async fn paused_holders_are_told(url: &str) {
    let id = fastrand::u64(..);
    let worker = Paused::spawn(url, id);
    let provider = LockProvider::connect(url).await.expect("connect");
    let keys: Vec<String> = APIS
        .iter()
        .map(|api| format!("paused-{id}:{api}"))
        .collect();
    // (API, check) -> pauses in which it answered "still held".
    let mut held_after_pause: BTreeMap<String, usize> = BTreeMap::new();
    // (API, check) -> pauses in which a check documented as lagging did lag.
    let mut lagged: BTreeMap<String, usize> = BTreeMap::new();
    let mut checked = 0;
    for round in 0..ROUNDS {
        let ready = format!("ready {round}");
        assert_eq!(worker.line(Duration::from_secs(90), &ready), ready);
        worker.signal("STOP");
        let mut stopped = Instant::now();
        let mut taken = BTreeMap::new();
        // A stopped SQLite holder may be stopped inside a renewal's write transaction, which
        // blocks every writer of the file: let it finish it, and stop it again.
        let mut failures = Vec::new();
        for attempt in 0..4 {
            failures = take_over(&provider, &keys, &mut taken, LEASE * 3).await;
            if failures.is_empty() {
                break;
            }
            eprintln!("round {round}, attempt {attempt}: not taken over: {failures:?}");
            worker.signal("CONT");
            tokio::time::sleep(Duration::from_millis(50)).await;
            worker.signal("STOP");
            stopped = Instant::now();
        }
        assert!(failures.is_empty(), "round {round}: {failures:?}");
        // Paused for more than a lease (the worker tells a pause by a step that comes more
        // than a lease after the one before it).
        tokio::time::sleep_until((stopped + LEASE + Duration::from_millis(300)).into()).await;
        worker.signal("CONT");
        let mut reported = Vec::new();
        for _ in APIS {
            let missing: Vec<&str> = APIS
                .iter()
                .copied()
                .filter(|api| !reported.contains(api))
                .collect();
            let line = worker.line(
                Duration::from_secs(30),
                &format!("the checks of round {round} from {missing:?}"),
            );
            let (api, rest) = line
                .strip_prefix(&format!("checked {round} "))
                .and_then(|rest| rest.split_once(' '))
                .unwrap_or_else(|| panic!("round {round}: {line}"));
            let api = *APIS
                .iter()
                .find(|known| **known == api)
                .unwrap_or_else(|| panic!("round {round}: {line}"));
            assert!(!reported.contains(&api), "round {round}: twice: {line}");
            reported.push(api);
            for pair in rest.split(' ') {
                let (name, value) = pair.split_once('=').expect("name=value");
                let lost = value == "true";
                if name.starts_with("lag_") {
                    if !lost {
                        *lagged.entry(format!("{api} {name}")).or_default() += 1;
                    }
                    continue;
                }
                checked += 1;
                if !lost {
                    *held_after_pause.entry(format!("{api} {name}")).or_default() += 1;
                }
            }
        }
        let done = format!("done {round}");
        assert_eq!(worker.line(Duration::from_secs(30), &done), done);
        for (_, guard) in taken {
            guard.release().await.expect("release");
        }
    }
    eprintln!(
        "{url}: {checked} checks over {ROUNDS} pauses, all \"lost\"; checks documented as \
         lagging that lagged: {lagged:?}"
    );
    let held: Vec<String> = held_after_pause
        .iter()
        .map(|(check, n)| format!("{check}: still held after {n} of {ROUNDS} pauses"))
        .collect();
    assert!(held.is_empty(), "{held:#?}");
}

#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!(
        "sqlite://{}/paused.db?lease={}ms",
        dir.path().display(),
        LEASE.as_millis()
    );
    paused_holders_are_told(&url).await;
}

#[cfg(feature = "redis")]
mod on_redis {
    use super::*;
    use dlock_testkit::redis::{Flavor, RedisServer};

    fn server() -> Option<RedisServer> {
        tokio::task::block_in_place(|| RedisServer::start(Flavor::Redis7))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis() {
        let Some(server) = server() else { return };
        paused_holders_are_told(&server.url(&format!("lease={}ms", LEASE.as_millis()))).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redlock() {
        let Some(servers) = (0..3).map(|_| server()).collect::<Option<Vec<_>>>() else {
            return;
        };
        let hosts: Vec<String> = servers
            .iter()
            .map(|s| format!("127.0.0.1:{}", s.port()))
            .collect();
        let url = format!(
            "redlock://{}/?lease={}ms",
            hosts.join(","),
            LEASE.as_millis()
        );
        paused_holders_are_told(&url).await;
    }
}

#[cfg(feature = "etcd")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd() {
    let Some(cluster) = tokio::task::block_in_place(dlock_testkit::etcd::EtcdCluster::single)
    else {
        return;
    };
    paused_holders_are_told(&cluster.url(&format!("lease={}ms", LEASE.as_millis()))).await;
}
