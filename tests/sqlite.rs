//! The SQLite backend: the conformance suite, plus what only a lock file can do wrong.
#![cfg(feature = "sqlite")]

mod conformance;
mod support;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use dlock::sqlite::{SqliteBackend, acquire_in_transaction, try_acquire_in_transaction};
use dlock::{LockError, LockGuard, LockProvider};
use support::{Holder, unique_key};

const LEASE: Duration = Duration::from_millis(900);

struct SqliteHarness {
    dir: tempfile::TempDir,
}

impl SqliteHarness {
    async fn new() -> Self {
        SqliteHarness {
            dir: tempfile::tempdir().expect("temp dir"),
        }
    }

    fn path(&self) -> PathBuf {
        self.dir.path().join("locks.db")
    }

    fn url(&self) -> String {
        format!(
            "sqlite://{}?lease={}ms",
            self.path().display(),
            LEASE.as_millis()
        )
    }
}

impl conformance::Harness for SqliteHarness {
    async fn provider(&self) -> LockProvider {
        LockProvider::connect(&self.url())
            .await
            .expect("open lock file")
    }

    async fn break_lock(&self, guard: &LockGuard) {
        // Another owner takes the row over, as if the lease had run out and been taken.
        let conn = rusqlite::Connection::open(self.path()).expect("open");
        let changed = conn
            .execute(
                "UPDATE __distributed_locks SET owner = X'00' WHERE name = ?1",
                [guard.key().as_bytes()],
            )
            .expect("steal row");
        assert_eq!(changed, 1);
    }

    fn lost_within(&self) -> Duration {
        LEASE / 3 + Duration::from_secs(1)
    }

    fn fencing(&self) -> bool {
        true
    }
}

conformance_suite!(SqliteHarness::new());

#[test]
fn multi_process_exclusion() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/mp.db", dir.path().display());
    support::run_multi_process(&url, "jobs:multi-process", 4, 60);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_holder_frees_the_lock_when_its_lease_ends() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/kill.db?lease=1s", dir.path().display());
    let key = unique_key("killed");
    let holder = Holder::start(&url, &key);
    let first_token = holder.fencing_token.expect("sqlite issues tokens");
    let locks = LockProvider::connect(&url).await.unwrap();
    assert!(matches!(
        locks.try_acquire(&key).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    holder.kill();
    let killed_at = Instant::now();
    let guard = locks
        .acquire(&key, Duration::from_secs(10))
        .await
        .expect("the lease of a killed holder runs out");
    let freed_after = killed_at.elapsed();
    eprintln!("free {freed_after:?} after the kill (lease 1 s)");
    // Not before the lease: the holder renewed at most a third of the lease before it was
    // killed, so its lease had at least two thirds left (0.6 allows for scheduling).
    assert!(
        freed_after >= Duration::from_millis(600),
        "the killed holder's lock was free after {freed_after:?}, before its lease could have ended"
    );
    // And not long after it: lease + 2 s (polling and scheduling).
    assert!(
        freed_after <= Duration::from_secs(3),
        "the killed holder's lock stayed held {freed_after:?}"
    );
    assert!(guard.fencing_token().unwrap() > first_token);
    guard.release().await.unwrap();
}

/// A holder frozen (SIGSTOP) past its lease cannot renew: another process takes the lock
/// with a larger fencing token once the lease has run out, and the holder, resumed, reports
/// the loss within a second.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_holder_learns_of_its_loss_when_resumed() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/stop.db?lease=1s", dir.path().display());
    let key = unique_key("stopped");
    let holder = Holder::start(&url, &key);
    let first_token = holder.fencing_token.expect("sqlite issues tokens");
    holder.signal("STOP");
    let stopped_at = Instant::now();
    let locks = LockProvider::connect(&url).await.unwrap();
    let guard = locks
        .acquire(&key, Duration::from_secs(10))
        .await
        .expect("the stopped holder's lease runs out");
    assert!(
        stopped_at.elapsed() >= Duration::from_millis(500),
        "taken over after {:?}, before the lease could have run out",
        stopped_at.elapsed()
    );
    assert!(guard.fencing_token().unwrap() > first_token);
    holder.signal("CONT");
    let resumed_at = Instant::now();
    assert!(
        holder.lost_within(Duration::from_secs(3)).is_some(),
        "the resumed holder reports the loss"
    );
    assert!(
        resumed_at.elapsed() < Duration::from_secs(2),
        "{:?}",
        resumed_at.elapsed()
    );
    guard.release().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_keeps_a_lock_past_its_lease() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/renew.db?lease=300ms", dir.path().display());
    let (a, b) = (
        LockProvider::connect(&url).await.unwrap(),
        LockProvider::connect(&url).await.unwrap(),
    );
    let key = unique_key("renew");
    let guard = a.try_acquire(&key).await.unwrap();
    // Three leases later it is still held: renewals ran.
    let outcome = b.acquire(&key, Duration::from_millis(1200)).await;
    assert!(
        matches!(outcome, Err(LockError::Timeout { .. })),
        "{outcome:?}"
    );
    assert!(!guard.is_lost());
    guard.release().await.unwrap();
}

#[tokio::test]
async fn fencing_tokens_survive_reopening_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/fence.db", dir.path().display());
    let key = unique_key("fence");
    let first = {
        let locks = LockProvider::connect(&url).await.unwrap();
        let g = locks.try_acquire(&key).await.unwrap();
        let t = g.fencing_token().unwrap();
        g.release().await.unwrap();
        t
    };
    let locks = LockProvider::connect(&url).await.unwrap();
    let g = locks.try_acquire(&key).await.unwrap();
    assert!(g.fencing_token().unwrap() > first);
    g.release().await.unwrap();
}

#[tokio::test]
async fn lease_option_and_per_acquisition_lease() {
    let dir = tempfile::tempdir().unwrap();
    let backend = SqliteBackend::builder(dir.path().join("l.db"))
        .lease(Duration::from_secs(7))
        .open()
        .await
        .unwrap();
    assert_eq!(backend.lease(), Duration::from_secs(7));
    let locks = LockProvider::from_backend(backend);
    let key = unique_key("lease");
    let g = locks
        .lock(&key)
        .lease(Duration::from_secs(2))
        .try_acquire()
        .await
        .unwrap();
    let conn = rusqlite::Connection::open(dir.path().join("l.db")).unwrap();
    let expires: i64 = conn
        .query_row(
            "SELECT expires_at FROM __distributed_locks WHERE name = ?1",
            [key.as_bytes()],
            |r| r.get(0),
        )
        .unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    let left = expires - now;
    assert!((0..=2000).contains(&left), "lease left {left} ms");
    g.release().await.unwrap();
    assert!(matches!(
        locks
            .lock(&key)
            .lease(Duration::from_millis(1))
            .try_acquire()
            .await,
        Err(LockError::Config { .. })
    ));
}

#[tokio::test]
async fn bad_files_are_clear_errors_and_stay_untouched() {
    let dir = tempfile::tempdir().unwrap();
    // A directory.
    let err = LockProvider::connect(&format!("sqlite://{}", dir.path().display()))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "DistributedLock.Configuration", "{err}");
    // A file in a directory that does not exist.
    let err = LockProvider::connect(&format!(
        "sqlite://{}/no/such/dir/l.db",
        dir.path().display()
    ))
    .await
    .unwrap_err();
    assert_eq!(err.code(), "DistributedLock.Configuration", "{err}");
    assert!(err.to_string().contains("cannot open"), "{err}");
    // A file that is not a database is reported and left exactly as it was.
    let junk = dir.path().join("notes.txt");
    let content = b"these are my notes, not a database\n".repeat(200);
    std::fs::write(&junk, &content).unwrap();
    let err = LockProvider::connect(&format!("sqlite://{}", junk.display()))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not a SQLite database"), "{err}");
    assert_eq!(std::fs::read(&junk).unwrap(), content);
    assert!(!dir.path().join("notes.txt-wal").exists());
}

#[tokio::test]
async fn bad_urls_name_the_accepted_schemes() {
    for url in [
        "",
        "locks.db",
        "ftp://x",
        "sqlite://",
        "sqlite::memory:",
        "sqlite://x.db?lease=soon",
    ] {
        let err = LockProvider::connect(url).await.unwrap_err();
        assert_eq!(err.code(), "DistributedLock.Configuration", "{url}: {err}");
    }
    let err = LockProvider::connect("ftp://user:secret@host/")
        .await
        .unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("sqlite://") && message.contains("redis://"),
        "{message}"
    );
    assert!(
        !message.contains("secret"),
        "the URL's password leaked: {message}"
    );
}

#[test]
fn transaction_locks_end_with_their_transaction() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tx.db");
    let url = format!("sqlite://{}?busy_timeout=100ms", path.display());
    let locks = rt.block_on(LockProvider::connect(&url)).unwrap();
    let key = unique_key("tx");

    let mut conn = rusqlite::Connection::open(&path).unwrap();
    for finish in ["commit", "rollback"] {
        let tx = conn.transaction().unwrap();
        let lock = try_acquire_in_transaction(&tx, &key).unwrap();
        assert!(lock.fencing_token() > 0);
        // While the transaction is open, a session lock on the key cannot be had.
        assert!(matches!(
            rt.block_on(locks.try_acquire(&key)),
            Err(LockError::AlreadyHeld { .. })
        ));
        match finish {
            "commit" => tx.commit().unwrap(),
            _ => tx.rollback().unwrap(),
        }
        let g = rt
            .block_on(locks.try_acquire(&key))
            .expect("free after {finish}");
        rt.block_on(g.release()).unwrap();
    }

    // A key held by a session lock cannot be taken in a transaction.
    let g = rt.block_on(locks.try_acquire(&key)).unwrap();
    let tx = conn.transaction().unwrap();
    assert!(matches!(
        try_acquire_in_transaction(&tx, &key),
        Err(LockError::AlreadyHeld { .. })
    ));
    let started = Instant::now();
    assert!(matches!(
        acquire_in_transaction(&tx, &key, Duration::from_millis(200)),
        Err(LockError::Timeout { .. })
    ));
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert!(matches!(
        try_acquire_in_transaction(&tx, ""),
        Err(LockError::InvalidKey { .. })
    ));
    tx.rollback().unwrap();
    rt.block_on(g.release()).unwrap();
}

#[test]
fn renewal_restarts_on_a_new_runtime() {
    // A provider outlives the runtime it was first used on: its renewal task went with that
    // runtime, and the next acquisition on a new runtime must start it again.
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/rt.db?lease=300ms", dir.path().display());
    let first = tokio::runtime::Runtime::new().unwrap();
    let locks = first.block_on(LockProvider::connect(&url)).unwrap();
    first.block_on(async {
        let g = locks.try_acquire("rt:first").await.unwrap();
        g.release().await.unwrap();
    });
    drop(first);

    let second = tokio::runtime::Runtime::new().unwrap();
    second.block_on(async {
        let other = LockProvider::connect(&url).await.unwrap();
        let guard = locks.try_acquire("rt:second").await.unwrap();
        // Three leases later the lock is still held and not lost: renewals ran.
        let outcome = other
            .acquire("rt:second", Duration::from_millis(1000))
            .await;
        assert!(
            matches!(outcome, Err(LockError::Timeout { .. })),
            "{outcome:?}"
        );
        assert!(!guard.is_lost());
        guard.release().await.unwrap();
    });
}

/// A small tmpfs of its own, unmounted on drop: a place that can fill up or turn read-only.
struct SmallDisk {
    dir: tempfile::TempDir,
}

impl SmallDisk {
    /// `None` (after saying so) where mounting is not allowed, unless `CI` is set.
    fn mount(size: &str) -> Option<SmallDisk> {
        let dir = tempfile::tempdir().unwrap();
        let mounted = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        if !mounted {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI must be able to mount a tmpfs (run as root)"
            );
            eprintln!("skipped: cannot mount a tmpfs here (not root?)");
            return None;
        }
        Some(SmallDisk { dir })
    }

    fn path(&self) -> &std::path::Path {
        self.dir.path()
    }

    fn remount(&self, options: &str) {
        let status = std::process::Command::new("mount")
            .args(["-o", &format!("remount,{options}")])
            .arg(self.dir.path())
            .status()
            .unwrap();
        assert!(status.success(), "remount {options}");
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(self.dir.path())
            .status();
    }
}

/// A full disk and a read-only file system: acquisitions get typed errors (no panic, no
/// hang), a lock taken before is still held and released normally, and once space is back
/// the file works again with nothing lost (fencing tokens keep increasing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_and_read_only_disks_are_errors_and_lose_nothing() {
    let Some(disk) = SmallDisk::mount("2m") else {
        return;
    };
    let url = format!("sqlite://{}/locks.db", disk.path().display());
    let locks = LockProvider::connect(&url).await.unwrap();
    let held = locks.try_acquire("jobs:held").await.unwrap();
    let first = held.fencing_token().unwrap();
    // Many distinct keys so that the file must grow.
    let mut keys = (0..).map(|i| format!("fill:{i}:{}", "x".repeat(512)));

    // Fill the disk to the last byte.
    let filler = disk.path().join("filler");
    let mut file = std::fs::File::create(&filler).unwrap();
    let block = vec![0u8; 64 * 1024];
    while std::io::Write::write_all(&mut file, &block).is_ok() {}
    while std::io::Write::write_all(&mut file, &block[..512]).is_ok() {}
    drop(file);
    // Held locks are rows that stay, so the file must grow until there is no room.
    let mut guards = Vec::new();
    let mut refused = None;
    for _ in 0..5_000 {
        let key = keys.next().unwrap();
        let started = Instant::now();
        match tokio::time::timeout(Duration::from_secs(10), locks.try_acquire(&key)).await {
            Ok(Ok(guard)) => guards.push(guard),
            Ok(Err(err)) => {
                assert!(started.elapsed() < Duration::from_secs(5));
                refused = Some(err);
                break;
            }
            Err(_) => panic!("an acquisition on a full disk hung"),
        }
    }
    let err = refused.expect("a full disk refuses new lock rows");
    eprintln!(
        "{} locks taken before the disk refused: {err}",
        guards.len()
    );
    assert!(
        matches!(
            err.code(),
            "DistributedLock.Backend" | "DistributedLock.Unavailable"
        ),
        "{err}"
    );
    assert!(!held.is_lost(), "the lock held before is not lost");

    // Space back: everything works, the locks held before still exclude others.
    std::fs::remove_file(&filler).unwrap();
    assert!(guards.iter().all(|g| !g.is_lost()), "no lock was lost");
    for guard in guards {
        guard.release().await.unwrap();
    }
    let other = LockProvider::connect(&url).await.unwrap();
    assert!(matches!(
        other.try_acquire("jobs:held").await,
        Err(LockError::AlreadyHeld { .. })
    ));
    held.release().await.unwrap();

    // Read-only (remounting needs every writer closed): opening the file or taking a lock is
    // an error, not a panic or a hang.
    drop((locks, other));
    disk.remount("ro");
    let started = Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(10), async {
        let locks = LockProvider::connect(&url).await?;
        locks.try_acquire("jobs:held").await.map(drop)
    })
    .await
    .expect("no hang on a read-only file system");
    let err = outcome.expect_err("a read-only file takes no lock");
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(
        matches!(
            err.code(),
            "DistributedLock.Backend"
                | "DistributedLock.Unavailable"
                | "DistributedLock.Configuration"
        ),
        "{err}"
    );
    disk.remount("rw");
    let other = LockProvider::connect(&url).await.unwrap();
    let again = other.try_acquire("jobs:held").await.unwrap();
    assert!(
        again.fencing_token().unwrap() > first,
        "tokens keep increasing"
    );
    again.release().await.unwrap();
}
