//! Unit tests of the SQLite backend.

use super::*;
use crate::lease::MIN_LEASE;

#[test]
fn url_forms() {
    crate::options::assert_keys::<SqliteOption, _>(parse_url("sqlite://a.db?bogus=1"));
    assert_eq!(
        parse_url("sqlite://locks.db").unwrap().path,
        PathBuf::from("locks.db")
    );
    assert_eq!(
        parse_url("sqlite:///var/lib/x.db?lease=5s").unwrap().path,
        PathBuf::from("/var/lib/x.db")
    );
    assert_eq!(
        parse_url("sqlite://a.db?lease=5s&busy_timeout=250ms")
            .unwrap()
            .lease,
        Duration::from_secs(5)
    );
    // The scheme in any case, as `LockProvider::connect` accepts it.
    for scheme in ["SQLite", "SQLITE", "sQlItE"] {
        assert_eq!(
            parse_url(&format!("{scheme}://locks.db")).unwrap().path,
            PathBuf::from("locks.db")
        );
    }
    for bad in [
        "sqlite://",
        "sqlit://a.db",
        "é://a.db",
        "sqlite::memory:",
        "sqlite://a.db?lease=1ms",
        "sqlite://a.db?lease=forever",
        "sqlite://a.db?color=red",
        "sqlite://a.db?lease=8761h",
        "sqlite://a.db?busy_timeout=8761h",
    ] {
        let err = parse_url(bad).unwrap_err();
        assert_eq!(err.code(), "DistributedLock.Configuration", "{bad}: {err}");
    }
}

#[test]
fn owners_are_unique() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let backend = rt
        .block_on(SqliteBackend::open(dir.path().join("l.db")))
        .unwrap();
    let a = backend.shared.new_owner().unwrap();
    let b = backend.shared.new_owner().unwrap();
    assert_ne!(a, b);
    // The backend's id first (for its owner label), then 64 random bits.
    assert_eq!(a[..8], backend.shared.owner_label.id);
    assert_eq!(b[..8], backend.shared.owner_label.id);
    assert_ne!(a[8..], b[8..], "the rest is random");
    let other = rt
        .block_on(SqliteBackend::open(dir.path().join("l.db")))
        .unwrap();
    assert_ne!(other.shared.owner_label.id, backend.shared.owner_label.id);
}

async fn open(dir: &tempfile::TempDir, lease: Duration) -> SqliteBackend {
    SqliteBackend::builder(dir.path().join("l.db"))
        .lease(lease)
        .busy_timeout(Duration::from_millis(200))
        .open()
        .await
        .unwrap()
}

async fn take(backend: &SqliteBackend, key: &str) -> Option<Acquired> {
    backend.try_acquire(LockRequest::new(key)).await.unwrap()
}

/// The row of `key` as another connection sees it: (owner is set, fencing).
fn row(dir: &tempfile::TempDir, key: &str) -> Option<(bool, i64)> {
    let conn = Connection::open(dir.path().join("l.db")).unwrap();
    conn.query_row(
        "SELECT owner IS NOT NULL, fencing FROM __distributed_locks WHERE name = ?1",
        [key.as_bytes()],
        |r| Ok((r.get(0)?, r.get(1)?)),
    )
    .ok()
}

#[tokio::test]
async fn two_backends_on_one_file_exclude_each_other_and_tokens_increase() {
    let dir = tempfile::tempdir().unwrap();
    let a = open(&dir, Duration::from_secs(30)).await;
    let b = open(&dir, Duration::from_secs(30)).await;
    assert_eq!(a.name(), "sqlite");
    assert_eq!(a.path(), dir.path().join("l.db"));
    assert_eq!(a.lease(), Duration::from_secs(30));
    let first = take(&a, "k").await.unwrap();
    assert_eq!(first.fencing_token, Some(1));
    assert_eq!(row(&dir, "k"), Some((true, 1)));
    assert!(take(&b, "k").await.is_none());
    // Found held: the next poll reads first, and finds it held still.
    assert!(b.shared.seen_held(b"k"));
    assert!(take(&b, "k").await.is_none());
    assert!(!first.lost.is_cancelled());
    first.handle.release().await.unwrap();
    assert_eq!(row(&dir, "k"), Some((false, 1)));
    // The read says held no more; the write takes it.
    let second = take(&b, "k").await.unwrap();
    assert_eq!(second.fencing_token, Some(2));
    assert!(!b.shared.seen_held(b"k"));
    // Other keys are independent.
    let other = take(&a, "other").await.unwrap();
    assert_eq!(other.fencing_token, Some(1));
    second.handle.release().await.unwrap();
    other.handle.release().await.unwrap();
    // Three acquisitions and three releases were commits.
    assert_eq!(
        a.shared.commits.load(Ordering::Relaxed) + b.shared.commits.load(Ordering::Relaxed),
        6
    );
}

#[tokio::test]
async fn a_release_after_a_takeover_is_a_loss() {
    let dir = tempfile::tempdir().unwrap();
    let a = open(&dir, Duration::from_secs(30)).await;
    let held = take(&a, "k").await.unwrap();
    let conn = Connection::open(dir.path().join("l.db")).unwrap();
    conn.execute(
        "UPDATE __distributed_locks SET owner = zeroblob(16) WHERE name = ?1",
        [b"k".as_slice()],
    )
    .unwrap();
    let lost = held.lost.clone();
    let err = held.handle.release().await.unwrap_err();
    assert!(
        matches!(&err, LockError::Lost { key, .. } if &**key == "k"),
        "{err:?}"
    );
    assert!(lost.is_cancelled());
    // The other owner's row is left alone.
    assert_eq!(row(&dir, "k"), Some((true, 1)));
}

#[tokio::test]
async fn an_unrenewed_lease_runs_out_and_another_backend_takes_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let a = open(&dir, Duration::from_secs(30)).await;
    let b = open(&dir, Duration::from_secs(30)).await;
    let lease = Duration::from_millis(150);
    let held = a
        .try_acquire(LockRequest::new("k").with_lease(Some(lease)))
        .await
        .unwrap()
        .unwrap();
    // Dropping the handle stops its renewal; the lease ends the lock.
    drop(held.handle);
    let started = Instant::now();
    let taken = loop {
        if let Some(taken) = take(&b, "k").await {
            break taken;
        }
        assert!(started.elapsed() < Duration::from_secs(10), "never expired");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(started.elapsed() >= Duration::from_millis(100));
    assert_eq!(taken.fencing_token, Some(2));
    // A lease below the minimum is refused before anything is written.
    let err = b
        .try_acquire(LockRequest::new("j").with_lease(Some(Duration::from_millis(99))))
        .await
        .unwrap_err();
    assert!(matches!(err, LockError::Config { .. }), "{err:?}");
    assert_eq!(row(&dir, "j"), None);
}

#[tokio::test]
async fn a_renewed_lease_outlives_itself() {
    let dir = tempfile::tempdir().unwrap();
    let a = open(&dir, Duration::from_millis(150)).await;
    let b = open(&dir, Duration::from_millis(150)).await;
    let held = take(&a, "k").await.unwrap();
    tokio::time::sleep(Duration::from_millis(450)).await;
    assert!(take(&b, "k").await.is_none());
    assert!(!held.lost.is_cancelled());
    held.handle.release().await.unwrap();
}

#[tokio::test]
async fn a_busy_file_is_contention_for_an_acquisition_and_unavailable_for_a_release() {
    let dir = tempfile::tempdir().unwrap();
    let a = open(&dir, Duration::from_secs(30)).await;
    let held = take(&a, "k").await.unwrap();
    let mut conn = Connection::open(dir.path().join("l.db")).unwrap();
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .unwrap();
    let started = Instant::now();
    assert!(take(&a, "free").await.is_none());
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert!(started.elapsed() < Duration::from_secs(5));
    let err = held.handle.release().await.unwrap_err();
    assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
    drop(tx);
    assert_eq!(row(&dir, "free"), None);
}

#[test]
fn held_keys_are_remembered_for_a_while_and_in_bounded_number() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let backend = rt.block_on(open(&dir, Duration::from_secs(30)));
    let shared = &backend.shared;
    assert!(!shared.seen_held(b"a"));
    shared.note_held(b"a");
    assert!(shared.seen_held(b"a"));
    assert!(!shared.seen_held(b"b"));
    shared.forget_held(b"a");
    assert!(!shared.seen_held(b"a"));
    // An old memory counts for nothing.
    shared
        .held_recently()
        .insert(Box::from(&b"old"[..]), Instant::now() - HELD_MEMORY);
    assert!(!shared.seen_held(b"old"));
    shared.note_held(b"old");
    assert!(shared.seen_held(b"old"));
    // Full: stale entries go first, then everything.
    shared.held_recently().clear();
    for i in 0..HELD_MEMORY_KEYS - 1 {
        shared.note_held(format!("k{i}").as_bytes());
    }
    shared
        .held_recently()
        .insert(Box::from(&b"stale"[..]), Instant::now() - HELD_MEMORY);
    assert_eq!(shared.held_recently().len(), HELD_MEMORY_KEYS);
    shared.note_held(b"k0");
    assert_eq!(shared.held_recently().len(), HELD_MEMORY_KEYS);
    shared.note_held(b"new");
    assert_eq!(shared.held_recently().len(), HELD_MEMORY_KEYS);
    assert!(!shared.held_recently().contains_key(&b"stale"[..]));
    shared.note_held(b"newer");
    assert_eq!(shared.held_recently().len(), 1);
    assert!(shared.seen_held(b"newer"));
}

#[test]
fn owner_tokens_are_handed_out_once_across_fetches() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let backend = rt.block_on(open(&dir, Duration::from_secs(30)));
    let owners: std::collections::HashSet<[u8; 16]> = (0..3 * OWNERS_PER_FETCH)
        .map(|_| backend.shared.new_owner().unwrap())
        .collect();
    assert_eq!(owners.len(), 3 * OWNERS_PER_FETCH);
    assert!(!owners.contains(&[0u8; 16]));
}

#[test]
fn transaction_locks_take_tokens_that_a_rollback_does_not_give_back() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.db");
    let backend = rt.block_on(open(&dir, Duration::from_secs(30)));
    let mut conn = Connection::open(&path).unwrap();
    let tx = conn.transaction().unwrap();
    let first = try_acquire_in_transaction(&tx, "k").unwrap();
    assert_eq!(first.fencing_token(), Some(1));
    tx.rollback().unwrap();
    let tx = conn.transaction().unwrap();
    let second = acquire_in_transaction(&tx, "k", Duration::from_secs(1)).unwrap();
    assert_eq!(second.fencing_token(), Some(2));
    tx.commit().unwrap();
    // A session acquisition issues tokens above the record.
    let taken = rt.block_on(take(&backend, "k")).unwrap();
    assert_eq!(taken.fencing_token, Some(3));
    let tx = conn.transaction().unwrap();
    let err = try_acquire_in_transaction(&tx, "k").unwrap_err();
    assert!(matches!(err, LockError::AlreadyHeld { .. }), "{err:?}");
    let started = Instant::now();
    let err = acquire_in_transaction(&tx, "k", Duration::from_millis(60)).unwrap_err();
    assert!(matches!(err, LockError::Timeout { .. }), "{err:?}");
    assert!(started.elapsed() >= Duration::from_millis(60));
    let err = acquire_in_transaction(&tx, "k", Duration::ZERO).unwrap_err();
    assert!(matches!(err, LockError::AlreadyHeld { .. }), "{err:?}");
    assert!(matches!(
        try_acquire_in_transaction(&tx, ""),
        Err(LockError::InvalidKey { .. })
    ));
    drop(tx);
    rt.block_on(taken.handle.release()).unwrap();
    // A backend opened after the record exists raises its tokens above it at once.
    let late = rt.block_on(open(&dir, Duration::from_secs(30)));
    assert!(late.shared.fencing.attached());
    let next = rt.block_on(take(&late, "k")).unwrap();
    assert_eq!(next.fencing_token, Some(4));
    drop(next);
    let mut memory = Connection::open_in_memory().unwrap();
    let tx = memory.transaction().unwrap();
    assert!(matches!(
        try_acquire_in_transaction(&tx, "k"),
        Err(LockError::Config { .. })
    ));
}

#[tokio::test]
async fn settings_out_of_bounds_are_refused_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.db");
    let low = SqliteBackend::builder(&path)
        .lease(Duration::from_millis(99))
        .open()
        .await
        .unwrap_err();
    assert!(low.to_string().contains("at least 100ms"), "{low}");
    let high = SqliteBackend::builder(&path)
        .busy_timeout(MAX_SETTING + Duration::from_secs(1))
        .open()
        .await
        .unwrap_err();
    assert!(high.to_string().contains("busy_timeout"), "{high}");
    let ok = SqliteBackend::builder(&path)
        .lease(MIN_LEASE)
        .open()
        .await
        .unwrap();
    assert_eq!(ok.lease(), MIN_LEASE);
    let defaults = SqliteBackend::open(&path).await.unwrap();
    assert_eq!(defaults.lease(), DEFAULT_LEASE);
    assert_eq!(defaults.shared.busy_timeout, DEFAULT_BUSY_TIMEOUT);
    let url = format!("SQLITE://{}?busy_timeout=250ms", path.display());
    let from_url = SqliteBackend::connect(&url).await.unwrap();
    assert_eq!(from_url.shared.busy_timeout, Duration::from_millis(250));
    let not_a_db = dir.path().join("text");
    std::fs::write(&not_a_db, vec![b'x'; 4096]).unwrap();
    let err = SqliteBackend::open(&not_a_db).await.unwrap_err();
    assert!(
        err.to_string().contains("is not a SQLite database"),
        "{err}"
    );
    let err = SqliteBackend::open(dir.path()).await.unwrap_err();
    assert!(matches!(err, LockError::Config { .. }), "{err}");
}

#[test]
fn checkpoints_run_every_thousand_commits() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let backend = rt.block_on(open(&dir, Duration::from_secs(30)));
    let shared = &backend.shared;
    rt.block_on(async {
        for _ in 0..CHECKPOINT_EVERY - 1 {
            shared.count_commit();
        }
        assert!(!shared.checkpointing.load(Ordering::Acquire));
        // A write under way holds the checkpoint back (it waits for the gate).
        let writing = shared.gate.read().await;
        shared.count_commit();
        assert!(shared.checkpointing.load(Ordering::Acquire));
        drop(writing);
        // The flag is cleared once the checkpoint is done.
        let started = Instant::now();
        while shared.checkpointing.load(Ordering::Acquire) {
            assert!(started.elapsed() < Duration::from_secs(10));
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    });
    // Outside a runtime, nothing is started.
    for _ in 0..CHECKPOINT_EVERY {
        shared.count_commit();
    }
    assert!(!shared.checkpointing.load(Ordering::Acquire));
    assert!(checkpoint_busy(0) && !checkpoint_busy(CHECKPOINT_TRIES));
}

/// A backend that looked for the `-fencing` file before it existed looks again once that
/// look is too old, and raises its token above a rolled-back transaction lock's.
#[test]
fn a_session_lock_takes_a_token_above_a_rolled_back_transaction_lock() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let backend = rt.block_on(open(&dir, Duration::from_secs(30)));
    // A look that finds no file.
    let first = rt.block_on(take(&backend, "j")).unwrap();
    rt.block_on(first.handle.release()).unwrap();
    assert!(!backend.shared.fencing.attached());
    let mut conn = Connection::open(dir.path().join("l.db")).unwrap();
    let tx = conn.transaction().unwrap();
    assert_eq!(
        try_acquire_in_transaction(&tx, "k")
            .unwrap()
            .fencing_token(),
        Some(1)
    );
    tx.commit().unwrap();
    let tx = conn.transaction().unwrap();
    assert_eq!(
        try_acquire_in_transaction(&tx, "k")
            .unwrap()
            .fencing_token(),
        Some(2)
    );
    tx.rollback().unwrap();
    // The row says 1; the record says 2 was handed out.
    assert_eq!(row(&dir, "k"), Some((false, 1)));
    let taken = rt.block_on(take(&backend, "k")).unwrap();
    assert_eq!(taken.fencing_token, Some(3));
    assert!(backend.shared.fencing.attached());
    rt.block_on(taken.handle.release()).unwrap();
}

fn failure(code: std::os::raw::c_int) -> rusqlite::Error {
    rusqlite::Error::SqliteFailure(rusqlite::ffi::Error::new(code), None)
}

/// Failures are told apart by what the caller can do about them: fix the file (`Config`),
/// try again later (`Unavailable`), or read the database's code (`Backend`).
#[test]
fn errors_say_what_the_caller_can_do() {
    use rusqlite::ffi;
    let path = Path::new("/srv/l.db");
    for code in [ffi::SQLITE_READONLY, ffi::SQLITE_PERM] {
        let err = sqlite_error(path, "releasing a lock", failure(code));
        assert!(matches!(err, LockError::Config { .. }), "{err:?}");
        assert!(err.to_string().contains("cannot be written"), "{err}");
    }
    let err = sqlite_error(path, "releasing a lock", failure(ffi::SQLITE_FULL));
    assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
    assert!(err.to_string().contains("is full"), "{err}");
    let err = sqlite_error(path, "releasing a lock", failure(ffi::SQLITE_IOERR));
    assert!(matches!(err, LockError::Unavailable { .. }), "{err:?}");
    assert!(
        err.to_string().contains("I/O error on `/srv/l.db`"),
        "{err}"
    );
    let err = sqlite_error(path, "releasing a lock", failure(ffi::SQLITE_CONSTRAINT));
    assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
    assert_eq!(err.db_code(), Some("SQLITE_19"));

    assert!(is_busy(&failure(ffi::SQLITE_BUSY)));
    assert!(is_busy(&failure(ffi::SQLITE_LOCKED)));
    assert!(!is_busy(&failure(ffi::SQLITE_CONSTRAINT)));
    assert!(!is_busy(&rusqlite::Error::QueryReturnedNoRows));
}

/// A lock file of the earlier version (wall-clock `expires_at`, no boot column) is
/// converted when opened: held locks keep what was left of their lease, free ones stay
/// free, and counters go on from where they were.
#[tokio::test]
async fn a_lock_file_of_the_earlier_version_is_converted() {
    let dir = tempfile::tempdir().unwrap();
    let conn = Connection::open(dir.path().join("l.db")).unwrap();
    conn.execute_batch(
        "CREATE TABLE __distributed_locks (name BLOB NOT NULL PRIMARY KEY, owner BLOB, \
         expires_at INTEGER NOT NULL DEFAULT 0, fencing INTEGER NOT NULL DEFAULT 0) \
         WITHOUT ROWID",
    )
    .unwrap();
    let wall_now = millis(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap(),
    );
    conn.execute(
        "INSERT INTO __distributed_locks VALUES (?1, zeroblob(16), ?2, 7), (?3, NULL, 0, 3)",
        params![&b"held"[..], wall_now + 60_000, &b"free"[..]],
    )
    .unwrap();
    drop(conn);

    let backend = open(&dir, Duration::from_secs(30)).await;
    assert!(take(&backend, "held").await.is_none());
    let free = take(&backend, "free").await.unwrap();
    assert_eq!(free.fencing_token, Some(4));
    free.handle.release().await.unwrap();
    let conn = Connection::open(dir.path().join("l.db")).unwrap();
    let legacy: i64 = conn.query_row(LEGACY_SQL, [], |r| r.get(0)).unwrap();
    assert_eq!(legacy, 0);
    // What was left of the held lease is kept (not the whole remaining clock).
    let lease_end: i64 = conn
        .query_row(
            "SELECT lease_end FROM __distributed_locks WHERE name = ?1",
            [&b"held"[..]],
            |r| r.get(0),
        )
        .unwrap();
    let left = lease_end - LeaseClock::get().unwrap().now_ms();
    assert!((50_000..=60_000).contains(&left), "{left}");
}

/// A counter that cannot be a fencing token is an error, and the row just taken is given
/// back instead of staying locked for its lease.
#[tokio::test]
async fn a_counter_that_is_not_a_positive_integer_gives_the_row_back() {
    let dir = tempfile::tempdir().unwrap();
    let backend = open(&dir, Duration::from_secs(30)).await;
    let conn = Connection::open(dir.path().join("l.db")).unwrap();
    conn.execute(
        "INSERT INTO __distributed_locks (name, owner, lease_end, fencing) \
         VALUES (?1, NULL, 0, -10)",
        [&b"k"[..]],
    )
    .unwrap();
    let err = backend
        .try_acquire(LockRequest::new("k"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("not a positive integer"), "{err}");
    assert_eq!(row(&dir, "k"), Some((false, -9)));
}

/// Statements the file refuses (here by a trigger, as a constraint would) are failures,
/// not contention: they are neither retried for the busy timeout nor answered as "held".
#[test]
fn refused_statements_are_errors_not_contention() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.db");
    let backend = rt
        .block_on(
            SqliteBackend::builder(&path)
                .busy_timeout(Duration::from_secs(20))
                .open(),
        )
        .unwrap();
    let held = rt.block_on(take(&backend, "k")).unwrap();
    let mut conn = Connection::open(&path).unwrap();
    conn.execute_batch(
        "CREATE TRIGGER no_insert BEFORE INSERT ON __distributed_locks \
         BEGIN SELECT RAISE(ABORT, 'refused'); END; \
         CREATE TRIGGER no_release BEFORE UPDATE ON __distributed_locks \
         WHEN new.owner IS NULL BEGIN SELECT RAISE(ABORT, 'refused'); END;",
    )
    .unwrap();
    let started = Instant::now();
    let err = rt
        .block_on(backend.try_acquire(LockRequest::new("new")))
        .unwrap_err();
    assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
    let err = rt.block_on(held.handle.release()).unwrap_err();
    assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
    let tx = conn.transaction().unwrap();
    let err = try_acquire_in_transaction(&tx, "t").unwrap_err();
    assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
    drop(tx);
    assert!(started.elapsed() < Duration::from_secs(10));
}

/// A release that finds the file busy waits for it, within the busy timeout.
#[tokio::test]
async fn a_release_waits_for_a_busy_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.db");
    let backend = SqliteBackend::builder(&path)
        .busy_timeout(Duration::from_secs(20))
        .open()
        .await
        .unwrap();
    let held = take(&backend, "k").await.unwrap();
    let (locked, is_locked) = std::sync::mpsc::channel();
    let (free, unlock) = std::sync::mpsc::channel::<()>();
    let writer = std::thread::spawn(move || {
        let mut conn = Connection::open(&path).unwrap();
        let tx = conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .unwrap();
        locked.send(()).unwrap();
        // Held until the release has found the file busy at least once.
        unlock.recv().unwrap();
        drop(tx);
    });
    is_locked.recv().unwrap();
    let release = tokio::spawn(held.handle.release());
    // The release is retrying (it cannot get through while the write lock is held).
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(!release.is_finished());
    free.send(()).unwrap();
    release.await.unwrap().unwrap();
    writer.join().unwrap();
    assert_eq!(row(&dir, "k"), Some((false, 1)));
}

/// A transaction lock on a file another connection is writing is held, as far as one try
/// can tell.
#[test]
fn a_transaction_lock_on_a_busy_file_is_already_held() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.db");
    drop(rt.block_on(open(&dir, Duration::from_secs(30))));
    let mut writer = Connection::open(&path).unwrap();
    let writing = writer
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .unwrap();
    let mut conn = Connection::open(&path).unwrap();
    conn.busy_timeout(Duration::from_millis(20)).unwrap();
    let tx = conn.transaction().unwrap();
    let err = try_acquire_in_transaction(&tx, "k").unwrap_err();
    assert!(matches!(err, LockError::AlreadyHeld { .. }), "{err:?}");
    drop(tx);
    drop(writing);
}

/// Failures other than a busy file are not retried while the file is opened.
#[tokio::test]
async fn a_file_that_is_not_a_database_is_refused_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("text");
    std::fs::write(&path, vec![b'x'; 4096]).unwrap();
    let started = Instant::now();
    let err = SqliteBackend::builder(&path)
        .busy_timeout(Duration::from_secs(60))
        .open()
        .await
        .unwrap_err();
    assert!(matches!(err, LockError::Config { .. }), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// A file another connection keeps locked (exclusive locking mode) cannot be opened: the
/// open gives up once the busy timeout has passed instead of waiting for the file.
#[tokio::test]
async fn opening_a_file_locked_for_good_gives_up_after_the_busy_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("l.db");
    let conn = Connection::open(&path).unwrap();
    conn.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))
        .unwrap();
    conn.execute_batch(
        "PRAGMA locking_mode = EXCLUSIVE; BEGIN IMMEDIATE; CREATE TABLE other (x); COMMIT;",
    )
    .unwrap();
    let started = Instant::now();
    let err = SqliteBackend::builder(&path)
        .busy_timeout(Duration::from_millis(200))
        .open()
        .await
        .unwrap_err();
    assert!(matches!(err, LockError::Backend { .. }), "{err:?}");
    assert_eq!(err.db_code(), Some("SQLITE_5"), "{err:?}");
    assert!(started.elapsed() >= Duration::from_millis(200));
    drop(conn);
    // Once the file is let go, it opens.
    SqliteBackend::open(&path).await.unwrap();
}
