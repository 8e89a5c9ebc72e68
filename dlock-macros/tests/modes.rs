//! `keys(...)` (several keys, all or none), `permits = N` (a semaphore) and `mode = read` (a
//! shared lock) at run time, on SQLite.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use dlock::sqlite::SqliteBackend;
use dlock::{LockError, LockProvider, distributed_lock};
use tempfile::TempDir;
use tokio::sync::{Notify, oneshot};

#[derive(Debug)]
enum AppError {
    Lock(LockError),
    Overlap,
    Stalled,
}

impl From<LockError> for AppError {
    fn from(err: LockError) -> Self {
        AppError::Lock(err)
    }
}

/// Two providers on one lock file: two processes, as far as the locks go.
async fn two_providers() -> (TempDir, LockProvider, LockProvider) {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}/locks.db", dir.path().display());
    let a = LockProvider::connect(&url).await.expect("connect");
    let b = LockProvider::connect(&url).await.expect("connect");
    (dir, a, b)
}

/// The accounts a transfer is touching; a flag per account (0..4).
struct Ledger {
    busy: [AtomicBool; 4],
    transfers: AtomicUsize,
}

impl Ledger {
    fn new() -> Ledger {
        Ledger {
            busy: Default::default(),
            transfers: AtomicUsize::new(0),
        }
    }
}

#[distributed_lock(keys("account:{from}", "account:{to}"), timeout = 10, guard = locked)]
async fn transfer(
    locks: &LockProvider,
    from: usize,
    to: usize,
    ledger: &Ledger,
) -> Result<usize, AppError> {
    let accounts = if from == to {
        vec![from]
    } else {
        vec![from, to]
    };
    assert_eq!(locked.len(), accounts.len(), "one guard per distinct key");
    for &account in &accounts {
        if ledger.busy[account].swap(true, Ordering::SeqCst) {
            return Err(AppError::Overlap);
        }
    }
    tokio::time::sleep(Duration::from_millis(1)).await;
    for &account in &accounts {
        ledger.busy[account].store(false, Ordering::SeqCst);
    }
    Ok(ledger.transfers.fetch_add(1, Ordering::SeqCst) + 1)
}

/// One try (no timeout), and the guards in the order of `keys(...)`.
#[distributed_lock(keys("account:{from}", "account:{to}"), guard = locked)]
async fn try_transfer(locks: &LockProvider, from: u64, to: u64) -> Result<Vec<String>, AppError> {
    Ok(locked.iter().map(|guard| guard.key().to_owned()).collect())
}

/// Four threads, each with its own runtime and provider on one lock file (four processes, as
/// far as the locks go), transfer between accounts 1 and 2 in both directions, and sometimes
/// touch account 3 or transfer an account to itself.
#[test]
fn swapped_transfers_never_overlap_and_never_deadlock() {
    const ROUNDS: usize = 40;
    const THREADS: usize = 4;
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}/locks.db", dir.path().display());
    let ledger = Arc::new(Ledger::new());
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    for thread in 0..THREADS {
        let (url, ledger, done) = (url.clone(), Arc::clone(&ledger), done_tx.clone());
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            let result = runtime.block_on(async {
                let locks = LockProvider::connect(&url).await?;
                for round in 0..ROUNDS {
                    let (from, to) = match (thread % 2, round % 8) {
                        (_, 0) => (2, 3),
                        (_, 1) => (1, 1),
                        (0, _) => (1, 2),
                        _ => (2, 1),
                    };
                    transfer(&locks, from, to, &ledger).await?;
                }
                Ok::<_, AppError>(())
            });
            let _ = done.send(result);
        });
    }
    // A deadlock leaves threads waiting until their 10 s timeouts, which fail the test; this
    // bound only keeps a broken build from hanging the run.
    for _ in 0..THREADS {
        let result = done_rx
            .recv_timeout(Duration::from_secs(120))
            .expect("the transfers completed");
        assert!(
            result.is_ok(),
            "every transfer ran alone on its accounts: {result:?}"
        );
    }
    assert_eq!(ledger.transfers.load(Ordering::SeqCst), THREADS * ROUNDS);
}

/// The case a written-order acquisition deadlocks on, set up on purpose: both accounts are
/// held while `transfer(1, 2)` and `transfer(2, 1)` wait, then account 2 is freed before
/// account 1. Taking the keys in the order written, the second transfer would take account 2
/// and wait for account 1, and whenever the first transfer then gets account 1 the two wait on
/// each other until both time out (about one run in two; five runs). In the canonical order
/// both wait for account 1 first, and both always complete.
#[tokio::test]
async fn transfers_waiting_on_both_accounts_complete_in_either_direction() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}/locks.db", dir.path().display());
    let connect = || async { LockProvider::connect(&url).await.expect("connect") };
    let (holder, forward_locks, backward_locks) =
        (connect().await, connect().await, connect().await);
    let ledger = Arc::new(Ledger::new());
    for _ in 0..5 {
        let held = holder
            .try_acquire_many(&["account:1", "account:2"])
            .await
            .expect("hold both accounts");
        let forward = tokio::spawn({
            let (locks, ledger) = (forward_locks.clone(), Arc::clone(&ledger));
            async move { transfer(&locks, 1, 2, &ledger).await }
        });
        let backward = tokio::spawn({
            let (locks, ledger) = (backward_locks.clone(), Arc::clone(&ledger));
            async move { transfer(&locks, 2, 1, &ledger).await }
        });
        // Both are acquiring.
        tokio::time::timeout(Duration::from_secs(10), async {
            while forward_locks.local_key_count() == 0 || backward_locks.local_key_count() == 0 {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("both transfers are waiting");
        let mut held = held.into_iter();
        let (account_1, account_2) = (held.next().expect("guard"), held.next().expect("guard"));
        account_2.release().await.expect("release");
        // Not needed for a correct order (nobody takes account 2 now); it gives a
        // written-order acquisition the time to take it, so that such a build fails here.
        tokio::time::sleep(Duration::from_millis(100)).await;
        account_1.release().await.expect("release");
        let both = tokio::time::timeout(Duration::from_secs(60), async {
            (forward.await.expect("task"), backward.await.expect("task"))
        })
        .await
        .expect("the transfers completed");
        assert!(matches!(both, (Ok(_), Ok(_))), "{both:?}");
    }
}

#[tokio::test]
async fn a_transfer_is_refused_while_either_account_is_held_and_takes_neither() {
    let (_dir, a, b) = two_providers().await;
    for held_key in ["account:7", "account:9"] {
        let held = b.try_acquire(held_key).await.expect("hold one account");
        match try_transfer(&a, 7, 9).await {
            Err(AppError::Lock(LockError::AlreadyHeld { key })) => assert_eq!(&*key, held_key),
            other => panic!("expected AlreadyHeld for {held_key}, got {other:?}"),
        }
        // All or none: the other account was not kept.
        for key in ["account:7", "account:9"] {
            if key != held_key {
                b.try_acquire(key)
                    .await
                    .unwrap_or_else(|err| panic!("{key} is free: {err}"))
                    .release()
                    .await
                    .expect("release");
            }
        }
        held.release().await.expect("release");
    }
    assert_eq!(
        try_transfer(&a, 9, 7).await.expect("both free"),
        ["account:9", "account:7"]
    );
    // Both released when the function returned.
    let guards = b
        .try_acquire_many(&["account:7", "account:9"])
        .await
        .expect("released");
    for guard in guards {
        guard.release().await.expect("release");
    }
}

#[distributed_lock(keys("pair:{x}", "pair:{y}"), timeout = 1)]
async fn failing(locks: &LockProvider, x: u32, y: u32, fail: bool) -> Result<u32, AppError> {
    if fail {
        return Err(AppError::Overlap);
    }
    Ok(x + y)
}

#[tokio::test]
async fn every_lock_is_released_on_every_way_out() {
    let (_dir, a, b) = two_providers().await;
    assert!(matches!(
        failing(&a, 1, 2, true).await,
        Err(AppError::Overlap)
    ));
    b.try_acquire_many(&["pair:1", "pair:2"])
        .await
        .expect("released after an error");
    // (The guards above are dropped: released in the background, and awaited below.)
    let (_dir, a, b) = two_providers().await;
    assert_eq!(failing(&a, 1, 2, false).await.expect("runs"), 3);
    for guard in b
        .try_acquire_many(&["pair:1", "pair:2"])
        .await
        .expect("released after Ok")
    {
        guard.release().await.expect("release");
    }
}

/// A timeout shorter than any round trip: it has passed once the first key is taken.
#[distributed_lock(keys("slot:{x}", "slot:{y}"), timeout = 0.000000001)]
async fn in_a_hurry(locks: &LockProvider, x: u32, y: u32) -> Result<(), AppError> {
    Ok(())
}

/// A `keys(...)` function whose wait runs out answers `Timeout`, as a one-key function does,
/// not the `AlreadyHeld` of a single try: here its deadline has passed between the two keys.
#[tokio::test]
async fn a_multi_key_wait_that_runs_out_is_a_timeout() {
    let (_dir, a, b) = two_providers().await;
    let held = b.try_acquire("slot:2").await.expect("free");
    let outcome = in_a_hurry(&a, 1, 2).await;
    assert!(
        matches!(&outcome, Err(AppError::Lock(LockError::Timeout { key, .. })) if &**key == "slot:2"),
        "{outcome:?}"
    );
    b.try_acquire("slot:1")
        .await
        .expect("the first key was given back")
        .release()
        .await
        .expect("release");
    held.release().await.expect("release");
}

/// At most two at once; `peak` records the most seen.
#[distributed_lock("exports:{tenant}", permits = 2, timeout = 20)]
async fn export(
    locks: &LockProvider,
    tenant: &str,
    running: &AtomicUsize,
    peak: &AtomicUsize,
    two_seen: &Notify,
) -> Result<(), AppError> {
    let now = running.fetch_add(1, Ordering::SeqCst) + 1;
    peak.fetch_max(now, Ordering::SeqCst);
    if now >= 2 {
        two_seen.notify_waiters();
    }
    // Stay until two bodies have run at once (with one permit this never happens).
    let wait = async {
        loop {
            let notified = two_seen.notified();
            if peak.load(Ordering::SeqCst) >= 2 {
                break;
            }
            notified.await;
        }
    };
    let result = tokio::time::timeout(Duration::from_secs(10), wait).await;
    tokio::task::yield_now().await;
    running.fetch_sub(1, Ordering::SeqCst);
    result.map_err(|_| AppError::Stalled)
}

#[tokio::test]
async fn two_permits_let_two_bodies_run_at_once_and_never_three() {
    let (_dir, a, b) = two_providers().await;
    let running = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let two_seen = Arc::new(Notify::new());
    let mut tasks = Vec::new();
    for i in 0..6 {
        let locks = if i % 2 == 0 { a.clone() } else { b.clone() };
        let (running, peak, two_seen) = (running.clone(), peak.clone(), two_seen.clone());
        tasks.push(tokio::spawn(async move {
            export(&locks, "acme", &running, &peak, &two_seen).await
        }));
    }
    for task in tasks {
        let result = tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("the exports completed")
            .expect("task");
        assert!(result.is_ok(), "{result:?}");
    }
    assert_eq!(peak.load(Ordering::SeqCst), 2, "two at once, never three");
}

#[distributed_lock("exports:{tenant}", permits = 2, guard = slot)]
async fn hold_export(
    locks: &LockProvider,
    tenant: &str,
    started: oneshot::Sender<Option<u64>>,
    done: oneshot::Receiver<()>,
) -> Result<(), AppError> {
    let _ = started.send(slot.fencing_token());
    let _ = done.await;
    Ok(())
}

#[distributed_lock("exports:{tenant}", permits = 2)]
async fn try_export(locks: &LockProvider, tenant: &str) -> Result<(), AppError> {
    Ok(())
}

#[tokio::test]
async fn a_third_caller_is_refused_while_two_hold_the_permits() {
    let (_dir, a, b) = two_providers().await;
    let mut holders = Vec::new();
    for locks in [a.clone(), b.clone()] {
        let (started_tx, started_rx) = oneshot::channel();
        let (done_tx, done_rx) = oneshot::channel();
        let task =
            tokio::spawn(async move { hold_export(&locks, "acme", started_tx, done_rx).await });
        started_rx.await.expect("holding");
        holders.push((task, done_tx));
    }
    assert!(matches!(
        try_export(&a, "acme").await,
        Err(AppError::Lock(LockError::AlreadyHeld { .. }))
    ));
    // Another tenant is another semaphore; the lock "exports:acme" is unrelated.
    try_export(&a, "globex").await.expect("another tenant");
    b.try_acquire("exports:acme")
        .await
        .expect("the lock of the same name is unrelated")
        .release()
        .await
        .expect("release");
    let (task, done) = holders.pop().expect("holder");
    done.send(()).expect("holder waits");
    task.await.expect("task").expect("holder ran");
    try_export(&a, "acme")
        .await
        .expect("a permit is free again");
    for (task, done) in holders {
        done.send(()).expect("holder waits");
        task.await.expect("task").expect("holder ran");
    }
}

/// A provider with a short lease, so a stolen lock is found lost quickly.
async fn leased() -> (TempDir, LockProvider) {
    let dir = tempfile::tempdir().expect("temp dir");
    let backend = SqliteBackend::builder(dir.path().join("locks.db"))
        .lease(Duration::from_millis(900))
        .open()
        .await
        .expect("open lock file");
    (dir, LockProvider::from_backend(backend))
}

fn steal(dir: &TempDir, key: &str) {
    let conn = rusqlite::Connection::open(dir.path().join("locks.db")).expect("open");
    let changed = conn
        .execute(
            "UPDATE __distributed_locks SET owner = X'00' WHERE name = ?1",
            [key.as_bytes()],
        )
        .expect("steal row");
    assert_eq!(changed, 1, "the row of {key} is in the lock file");
}

#[distributed_lock(keys("move:{from}", "move:{to}"), on_lost = cancel)]
async fn long_move(
    locks: &LockProvider,
    from: u32,
    to: u32,
    started: oneshot::Sender<()>,
    reached_end: Arc<AtomicBool>,
) -> Result<(), AppError> {
    let _ = started.send(());
    tokio::time::sleep(Duration::from_secs(3600)).await;
    reached_end.store(true, Ordering::SeqCst);
    Ok(())
}

#[distributed_lock(keys("move:{from}", "move:{to}"))]
async fn finishing_move(
    locks: &LockProvider,
    from: u32,
    to: u32,
    started: oneshot::Sender<()>,
    lost: oneshot::Receiver<()>,
) -> Result<(), AppError> {
    let _ = started.send(());
    let _ = lost.await;
    Ok(())
}

#[tokio::test]
async fn on_lost_cancel_stops_the_body_when_either_lock_is_lost() {
    for stolen in ["move:1", "move:2"] {
        let (dir, locks) = leased().await;
        let reached_end = Arc::new(AtomicBool::new(false));
        let (started_tx, started_rx) = oneshot::channel();
        let job = tokio::spawn({
            let (locks, reached_end) = (locks.clone(), Arc::clone(&reached_end));
            async move { long_move(&locks, 1, 2, started_tx, reached_end).await }
        });
        started_rx.await.expect("the body started");
        steal(&dir, stolen);
        let result = tokio::time::timeout(Duration::from_secs(30), job)
            .await
            .expect("the body was stopped long before its end")
            .expect("task");
        match result {
            Err(AppError::Lock(LockError::Lost { key, .. })) => assert_eq!(&*key, stolen),
            other => panic!("expected Lost for {stolen}, got {other:?}"),
        }
        assert!(!reached_end.load(Ordering::SeqCst));
    }
}

#[tokio::test]
async fn a_lock_lost_while_the_body_ran_is_the_functions_error() {
    let (dir, locks) = leased().await;
    let (started_tx, started_rx) = oneshot::channel();
    let (lost_tx, lost_rx) = oneshot::channel();
    let job = tokio::spawn({
        let locks = locks.clone();
        async move { finishing_move(&locks, 1, 2, started_tx, lost_rx).await }
    });
    started_rx.await.expect("the body started");
    // Another owner takes one row over while the body runs; the body then ends normally,
    // and the release of that lock finds it taken.
    steal(&dir, "move:2");
    lost_tx.send(()).expect("body waits");
    let result = job.await.expect("task");
    assert!(
        matches!(result, Err(AppError::Lock(LockError::Lost { .. }))),
        "{result:?}"
    );
}

#[distributed_lock("report:{name}", mode = read, timeout = 10)]
async fn read_report(
    locks: &LockProvider,
    name: &str,
    inside: &AtomicUsize,
    all_in: &Notify,
    readers: usize,
) -> Result<(), AppError> {
    // Every reader waits inside until all of them are: they only get there together.
    if inside.fetch_add(1, Ordering::SeqCst) + 1 == readers {
        all_in.notify_waiters();
    } else {
        let notified = all_in.notified();
        if inside.load(Ordering::SeqCst) < readers {
            tokio::time::timeout(Duration::from_secs(20), notified)
                .await
                .map_err(|_| AppError::Stalled)?;
        }
    }
    Ok(())
}

#[distributed_lock("report:{name}", mode = write)]
async fn write_report(locks: &LockProvider, name: &str) -> Result<(), AppError> {
    Ok(())
}

#[tokio::test]
async fn readers_run_together_and_a_writer_waits_for_them() {
    let (_dir, a, b) = two_providers().await;
    let inside = Arc::new(AtomicUsize::new(0));
    let all_in = Arc::new(Notify::new());
    let readers = 4;
    let held = a
        .try_acquire_read("report:q3")
        .await
        .expect("a reader holds the key");
    // A writer (timeout 0: one try) is refused while a reader holds the key.
    assert!(matches!(
        write_report(&b, "q3").await,
        Err(AppError::Lock(LockError::AlreadyHeld { .. }))
    ));
    let mut tasks = Vec::new();
    for n in 0..readers {
        let locks = if n % 2 == 0 { a.clone() } else { b.clone() };
        let (inside, all_in) = (Arc::clone(&inside), Arc::clone(&all_in));
        tasks.push(tokio::spawn(async move {
            read_report(&locks, "q3", &inside, &all_in, readers).await
        }));
    }
    for task in tasks {
        task.await
            .expect("task")
            .expect("every reader got in while the others were in");
    }
    held.release().await.expect("release");
    write_report(&b, "q3")
        .await
        .expect("free once the readers left");
}
