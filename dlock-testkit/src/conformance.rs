//! The conformance suite: plain async functions that take a [`Harness`], run identically
//! against every backend. A backend's test file implements `Harness` and calls
//! [`conformance_suite!`](crate::conformance_suite), which makes one `#[tokio::test]` per case
//! so that each failure is reported on its own.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dlock::{CancellationToken, Leader, LockError, LockGuard, LockProvider, ReleaseOutcome};

use crate::unique_key;

/// What the suite needs from a backend.
pub trait Harness: Send + Sync + 'static {
    /// A new provider on the shared store. Two providers stand for two processes: they have
    /// separate in-process tables and separate connections.
    fn provider(&self) -> impl Future<Output = LockProvider> + Send;

    /// Makes the store drop or hand over the lock behind `guard` without the guard's knowledge
    /// (kill its connection, steal its row or key), so that the backend must report the loss.
    fn break_lock(&self, guard: &LockGuard) -> impl Future<Output = ()> + Send;

    /// How soon after `break_lock` the guard's lost token must fire.
    fn lost_within(&self) -> Duration;

    /// Whether acquisitions carry fencing tokens.
    fn fencing(&self) -> bool;

    /// How soon after a lost lock was reported (`break_lock`) another provider must be able to
    /// take the key: a session store frees a killed session's locks once the server has ended
    /// it (three seconds); a lease store once the lease of whoever took the key over has run
    /// out.
    fn retake_within(&self) -> Duration {
        Duration::from_secs(3)
    }

    /// How soon after abandoned acquisitions (timeout 5 s, dropped within 2 ms) the key must
    /// be free for another provider: two seconds. `None` for a backend with a known, open bug
    /// here (the case then fails, saying so: a known bug is not a pass).
    fn abandon_bound(&self) -> Option<Duration> {
        Some(Duration::from_secs(2))
    }

    /// `count` providers on clones of one backend, as an application that builds several
    /// providers over one backend value gets them: they share the backend's connections (one
    /// lock connection, where the backend has that setting) but each has its own in-process
    /// table. Exclusion must hold between them as between processes.
    fn shared_providers(&self, count: usize) -> impl Future<Output = Vec<LockProvider>> + Send;

    /// Whether the backend grants read (shared) locks. When not, the read-lock cases check
    /// that every read-lock call answers [`LockError::Unsupported`] and leaves nothing behind.
    fn read_locks(&self) -> bool {
        false
    }

    /// Why waits on this backend are not fair between the providers of one process, if they
    /// are not (a known, open bug, or a backend that has no fair waits across providers:
    /// then a semaphore's waiters, which queue on an ordinary lock of the backend, are served
    /// as unevenly as its lock waits), or `None` (the default). The semaphore fairness case
    /// then checks that the bound is kept and reached and prints each provider's share and
    /// the wait tail without asserting them (saying why).
    fn unfair_waits(&self) -> Option<&'static str> {
        None
    }

    /// What [`LockProvider::store_locks`] answers on this backend, as the harness's account
    /// sees it. Every harness declares it (there is no default), and the inspection case fails
    /// when the answer differs: a backend that lists locks must not drift into `Unsupported`
    /// or a permission error unnoticed, nor one without inspection start answering.
    fn store_inspection(&self) -> StoreInspection;
}

/// What a harness declares [`LockProvider::store_locks`] answers ([`Harness::store_inspection`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreInspection {
    /// The store's locks are listed.
    Listed,
    /// The backend has no store inspection: [`LockError::Unsupported`] ("store inspection").
    Unsupported,
    /// The backend has it, but the harness's account may not use it: a
    /// [`LockError::Backend`] whose `db_code` is this (Redis `NOPERM` for an ACL user without
    /// `SCAN`).
    Denied(&'static str),
}

/// Generates one test per conformance case for the harness that `$make` (an async expression)
/// builds. `conformance_suite!(optional $make)` takes a `$make` that yields `Option<Harness>`:
/// `None` fails every case as not run ([`crate::not_run`]; this kit's fixtures fail the test
/// themselves, with the reason, where their server binaries are missing). `conformance_suite!(attributes [#[...]] $make)` puts those attributes on every case:
/// dlock's SQL Server and Oracle suites are ignored, with the reason, when their server's URL
/// was not set at build time. The cases are `#[tokio::test]`s: the calling crate needs `tokio`
/// with its `macros` and `rt-multi-thread` features.
#[macro_export]
macro_rules! conformance_suite {
    (@harness required $make:expr) => {
        $make.await
    };
    (@harness optional $make:expr) => {
        match $make.await {
            Some(harness) => harness,
            None => $crate::conformance::no_harness(),
        }
    };
    (@sync_harness required $make:expr) => {
        async { Some($make.await) }
    };
    (@sync_harness optional $make:expr) => {
        $make
    };
    (@case $mode:ident [$(#[$attr:meta])*] $make:expr; $case:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        $(#[$attr])*
        async fn $case() {
            let harness = $crate::conformance_suite!(@harness $mode $make);
            $crate::conformance::$case(&harness).await;
        }
    };
    (@sync_case $mode:ident [$(#[$attr:meta])*] $make:expr; $case:ident) => {
        #[test]
        $(#[$attr])*
        fn $case() {
            $crate::conformance::$case(|| $crate::conformance_suite!(@sync_harness $mode $make));
        }
    };
    (@cases $mode:ident $attributes:tt $make:expr; $($case:ident),* $(,)?) => {
        $(
            $crate::conformance_suite!(@case $mode $attributes $make; $case);
        )*
    };
    (@all $mode:ident [$(#[$attr:meta])*] $make:expr) => {
        $crate::conformance_suite!(@cases $mode [$(#[$attr])*] $make;
            try_vs_held, acquire_waits_then_gets, timeout_is_bounded, zero_timeout_is_one_try,
            waits_that_run_out_are_timeouts,
            max_timeout_does_not_overflow, cancellation_ends_a_wait, cancel_meets_release,
            precancelled_token,
            release_on_drop, explicit_release_cycles, non_reentrant, local_waiters_queue,
            fencing_increases, with_lock_releases_on_error, with_lock_releases_on_panic,
            with_lock_returns_output, many_keys_at_once, bad_keys, distinct_keys_do_not_collide,
            exclusion_under_contention, lost_detection, acquisition_dropped_midway,
            cancellation_sweep, shared_backend_excludes, shared_backend_contention, ping_answers,
            lease_control, many_all_or_none, many_never_deadlock, run_exclusive_once,
            leader_hands_over, semaphore_bounds_holders, semaphore_under_contention,
            semaphore_fairness, semaphore_huge_counts, semaphore_counts_must_agree,
            semaphore_timeouts, semaphore_waits_leave_nothing, semaphore_holders_counted,
            held_locks_are_listed, read_locks_share, read_write_exclusion,
            writer_not_starved, read_shared_backend, read_cancellation_sweep,
            store_locks_list_holders, renewal_started_later, force_release_ends_a_lock
        );
        // Cases that make and drop Tokio runtimes of their own.
        $crate::conformance_suite!(@sync_case $mode [$(#[$attr])*] $make;
            background_runtime_dropped);
        $crate::conformance_suite!(@sync_case $mode [$(#[$attr])*] $make;
            guard_dropped_by_its_runtime);
    };
    (attributes [$(#[$attr:meta])*] $make:expr) => {
        $crate::conformance_suite!(@all required [$(#[$attr])*] $make);
    };
    (optional $make:expr) => {
        $crate::conformance_suite!(@all optional [] $make);
    };
    ($make:expr) => {
        $crate::conformance_suite!(@all required [] $make);
    };
}

/// Fails a case whose harness could not be made (an `optional` harness that is `None`): the
/// case was not run, which must never count as a pass.
#[doc(hidden)]
#[track_caller]
pub fn no_harness() -> ! {
    crate::not_run(
        "no harness for this suite's store here",
        "its fixture returned None; this kit's fixtures say why themselves",
    )
}

/// Waits until `waiter`, an acquisition through `provider` (which holds nothing else), has
/// started: the key is in the provider's table. The window in which a case then checks that
/// the waiter is still waiting starts only once it is waiting.
async fn waiting<T>(provider: &LockProvider, waiter: &tokio::task::JoinHandle<T>) {
    crate::wait_until(
        "the waiter is acquiring",
        Duration::from_secs(5),
        async || {
            assert!(!waiter.is_finished(), "the waiter got a held lock");
            provider.local_key_count() == 1
        },
    )
    .await;
}

fn assert_held<T: std::fmt::Debug>(result: Result<T, LockError>) {
    match result {
        Err(LockError::AlreadyHeld { .. }) => {}
        other => panic!("expected AlreadyHeld, got {other:?}"),
    }
}

/// A held key answers `AlreadyHeld` to another provider and to its own; once released, the
/// other provider gets it.
pub async fn try_vs_held(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let key = unique_key("try");
    let guard = a.try_acquire(&key).await.expect("free key");
    assert_eq!(guard.key(), key);
    assert_held(b.try_acquire(&key).await);
    assert_held(a.try_acquire(&key).await);
    guard.release().await.expect("release");
    let again = b.try_acquire(&key).await.expect("free again");
    again.release().await.expect("release");
}

/// A waiting acquisition gets the lock when the holder lets go.
pub async fn acquire_waits_then_gets(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let key = unique_key("wait");
    let guard = a
        .acquire(&key, Duration::from_secs(5))
        .await
        .expect("free key");
    let waiter = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move { b.acquire(&key, Duration::from_secs(30)).await })
    };
    waiting(&b, &waiter).await;
    // The waiter must still be waiting while the lock is held.
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert!(!waiter.is_finished(), "the waiter got a held lock");
    guard.release().await.expect("release");
    let got = waiter.await.expect("join").expect("waiter gets the lock");
    assert_eq!(got.key(), key);
    got.release().await.expect("release");
}

/// A timeout is answered after at least the timeout, and not long after it.
pub async fn timeout_is_bounded(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let key = unique_key("timeout");
    let _guard = a.try_acquire(&key).await.expect("free key");
    let timeout = Duration::from_millis(400);
    let started = Instant::now();
    match b.acquire(&key, timeout).await {
        Err(LockError::Timeout { timeout: t, .. }) => assert_eq!(t, timeout),
        other => panic!("expected Timeout, got {other:?}"),
    }
    let elapsed = started.elapsed();
    assert!(
        elapsed >= timeout,
        "answered after {elapsed:?}, before the timeout"
    );
    assert!(
        elapsed < timeout + Duration::from_millis(1500),
        "answered {elapsed:?} after a {timeout:?} timeout"
    );
    // The same through the provider's own table.
    let started = Instant::now();
    assert!(matches!(
        a.acquire(&key, timeout).await,
        Err(LockError::Timeout { .. })
    ));
    assert!(started.elapsed() >= timeout);
}

/// `Duration::ZERO` is one try, answered with `AlreadyHeld`.
pub async fn zero_timeout_is_one_try(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let key = unique_key("zero");
    let _guard = a.try_acquire(&key).await.expect("free key");
    assert_held(b.acquire(&key, Duration::ZERO).await);
    assert_held(a.acquire(&key, Duration::ZERO).await);
}

/// A wait that runs out of time answers `Timeout`, never the `AlreadyHeld` of a single try,
/// however little time it had: a timeout shorter than any round trip to the store, on a lock,
/// a read lock (where the backend has them) and a multi-key acquisition. There the deadline
/// has passed by the time the first key (free) is taken, and the second is held elsewhere:
/// the answer names the second key and the caller's timeout, and the first is given back.
pub async fn waits_that_run_out_are_timeouts(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    // "out-a..." sorts before "out-b...": the free key is taken first.
    let (free, held) = (unique_key("out-a"), unique_key("out-b"));
    let guard = a.try_acquire(&held).await.expect("free key");
    let tiny = Duration::from_nanos(1);
    let timed_out = |what: &str, outcome: Result<Vec<LockGuard>, LockError>| match outcome {
        Err(LockError::Timeout { key, timeout }) => {
            assert_eq!((&*key, timeout), (held.as_str(), tiny), "{what}");
        }
        other => panic!("{what}: expected Timeout, got {other:?}"),
    };
    timed_out("acquire", b.acquire(&held, tiny).await.map(|g| vec![g]));
    timed_out(
        "a local wait",
        a.acquire(&held, tiny).await.map(|g| vec![g]),
    );
    if h.read_locks() {
        timed_out(
            "acquire_read",
            b.acquire_read(&held, tiny).await.map(|g| vec![g]),
        );
    }
    timed_out(
        "acquire_many, free key first",
        b.acquire_many(&[&held, &free], tiny).await,
    );
    timed_out(
        "acquire_many, held key first",
        b.acquire_many(&[&held, &unique_key("out-c")], tiny).await,
    );
    assert_eq!(
        b.local_key_count(),
        0,
        "a timed-out wait left a table entry"
    );
    a.try_acquire(&free)
        .await
        .expect("the key taken before the deadline passed was given back")
        .release()
        .await
        .expect("release");
    guard.release().await.expect("release");
}

/// `Duration::MAX` neither overflows nor returns early.
pub async fn max_timeout_does_not_overflow(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let key = unique_key("max");
    let guard = a.acquire(&key, Duration::MAX).await.expect("free key");
    let waiter = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move { b.acquire(&key, Duration::MAX).await })
    };
    waiting(&b, &waiter).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiter.is_finished(), "the waiter got a held lock");
    drop(guard);
    let got = waiter.await.expect("join").expect("waiter gets it");
    got.release().await.expect("release");
}

/// A cancellation token ends a wait with `Canceled`, and leaves nothing held.
pub async fn cancellation_ends_a_wait(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let key = unique_key("cancel");
    let guard = a.try_acquire(&key).await.expect("free key");
    let token = CancellationToken::new();
    let waiter = {
        let (key, token) = (key.clone(), token.clone());
        let b = b.clone();
        tokio::spawn(async move { b.lock(&key).cancel_on(&token).acquire().await })
    };
    waiting(&b, &waiter).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!waiter.is_finished(), "the waiter got a held lock");
    token.cancel();
    match tokio::time::timeout(Duration::from_secs(5), waiter).await {
        Ok(Ok(Err(LockError::Canceled { key: k }))) => assert_eq!(&*k, key),
        other => panic!("expected Canceled, got {other:?}"),
    }
    guard.release().await.expect("release");
    let again = b.try_acquire(&key).await.expect("nothing stranded");
    again.release().await.expect("release");
}

/// Rounds of [`cancel_meets_release`].
pub const CANCEL_RACE_ROUNDS: usize = 40;

/// A wait cancelled just as its key comes free leaves nothing held, whichever the server
/// saw first: the wait ends with `Canceled` or with the lock, and once it has, the waiting
/// provider's next try gets the key. (A server wait that was told to stop may still be
/// granted the key while it winds down; the engine must not call the wait over before that
/// grant, if any, has been given back.)
pub async fn cancel_meets_release(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let mut rng = fastrand::Rng::new();
    cancel_race(&a, &b, CANCEL_RACE_ROUNDS, async |_key: &str| {
        if b.local_key_count() != 1 {
            return false;
        }
        // Somewhere between the local queue and the server's own wait.
        tokio::time::sleep(Duration::from_micros(rng.u64(0..4_000))).await;
        true
    })
    .await;
}

/// Races the cancellation of `b`'s wait for a key `a` holds against `a`'s release of it,
/// `rounds` times, each on a key of its own: once `queued(key)` says the wait is where the
/// race should begin (a backend's own test can look for the wait on the server), the two go
/// at once, in either order, half the time up to 2 ms apart. The wait must end with
/// `Canceled` or the lock, and `b`'s next try must get the key. Returns how many waits ended
/// `Canceled`. A failure names the round and the seed.
pub async fn cancel_race(
    a: &LockProvider,
    b: &LockProvider,
    rounds: usize,
    mut queued: impl AsyncFnMut(&str) -> bool,
) -> usize {
    let seed = fastrand::u64(..);
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut cancelled = 0;
    for round in 0..rounds {
        let key = unique_key("cancel-race");
        let guard = a
            .try_acquire(&key)
            .await
            .unwrap_or_else(|e| panic!("round {round} (seed {seed}): the holder: {e}"));
        let token = CancellationToken::new();
        let waiter = {
            let (b, key, token) = (b.clone(), key.clone(), token.clone());
            tokio::spawn(async move { b.lock(&key).cancel_on(&token).acquire().await })
        };
        crate::wait_until("the wait is queued", Duration::from_secs(5), async || {
            assert!(!waiter.is_finished(), "the waiter got a held lock");
            queued(&key).await
        })
        .await;
        let gap = if rng.bool() {
            Duration::from_micros(rng.u64(0..2_000))
        } else {
            Duration::ZERO
        };
        let release_first = rng.bool();
        let release = async {
            if !release_first {
                tokio::time::sleep(gap).await;
            }
            guard.release().await
        };
        let cancel = async {
            if release_first {
                tokio::time::sleep(gap).await;
            }
            token.cancel();
        };
        let (released, ()) = tokio::join!(release, cancel);
        released.expect("release");
        match tokio::time::timeout(Duration::from_secs(10), waiter).await {
            Ok(Ok(Ok(got))) => got.release().await.expect("release"),
            Ok(Ok(Err(LockError::Canceled { .. }))) => cancelled += 1,
            other => {
                panic!("round {round} (seed {seed}): expected Canceled or the lock, got {other:?}")
            }
        }
        let again = b.try_acquire(&key).await.unwrap_or_else(|e| {
            panic!("round {round} (seed {seed}): the cancelled wait left the key held: {e}")
        });
        again.release().await.expect("release");
    }
    cancelled
}

/// A token cancelled before the call answers `Canceled` without trying.
pub async fn precancelled_token(h: &impl Harness) {
    let a = h.provider().await;
    let key = unique_key("precancel");
    let token = CancellationToken::new();
    token.cancel();
    assert!(matches!(
        a.lock(&key).cancel_on(&token).acquire().await,
        Err(LockError::Canceled { .. })
    ));
    let guard = a.try_acquire(&key).await.expect("still free");
    guard.release().await.expect("release");
}

/// Dropping a guard frees the lock for another provider within 100 ms.
pub async fn release_on_drop(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let key = unique_key("drop");
    let guard = a.try_acquire(&key).await.expect("free key");
    drop(guard);
    let got = b
        .acquire(&key, Duration::from_millis(100))
        .await
        .expect("the dropped lock is free within 100 ms");
    got.release().await.expect("release");
}

/// Release, take again, release again: each release is clean and each take succeeds.
pub async fn explicit_release_cycles(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let key = unique_key("cycles");
    for round in 0..5 {
        let provider = if round % 2 == 0 { &a } else { &b };
        let guard = provider
            .try_acquire(&key)
            .await
            .expect("free after release");
        assert!(!guard.is_lost());
        guard.release().await.expect("release");
    }
    assert_eq!(a.local_key_count(), 0, "released keys leave the table");
    assert_eq!(b.local_key_count(), 0);
}

/// A second acquisition through the same provider is contention, not re-entry.
pub async fn non_reentrant(h: &impl Harness) {
    let a = h.provider().await;
    let key = unique_key("reentrant");
    let guard = a.try_acquire(&key).await.expect("free key");
    assert_held(a.try_acquire(&key).await);
    assert!(matches!(
        a.acquire(&key, Duration::from_millis(150)).await,
        Err(LockError::Timeout { .. })
    ));
    guard.release().await.expect("release");
    let again = a.try_acquire(&key).await.expect("free");
    again.release().await.expect("release");
}

/// Local waiters are served one at a time as the local holder lets go.
pub async fn local_waiters_queue(h: &impl Harness) {
    let a = h.provider().await;
    let key = unique_key("queue");
    let inside = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicUsize::new(0));
    let guard = a.try_acquire(&key).await.expect("free key");
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let (a, key, inside, done) = (a.clone(), key.clone(), inside.clone(), done.clone());
            tokio::spawn(async move {
                let g = a
                    .acquire(&key, Duration::from_secs(30))
                    .await
                    .expect("queued waiter");
                assert!(
                    !inside.swap(true, Ordering::SeqCst),
                    "two local holders at once"
                );
                tokio::time::sleep(Duration::from_millis(5)).await;
                inside.store(false, Ordering::SeqCst);
                done.fetch_add(1, Ordering::SeqCst);
                g.release().await.expect("release");
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(done.load(Ordering::SeqCst), 0);
    guard.release().await.expect("release");
    for t in tasks {
        t.await.expect("waiter task");
    }
    assert_eq!(done.load(Ordering::SeqCst), 6);
}

/// Fencing tokens strictly increase across successive holders of a key.
pub async fn fencing_increases(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let key = unique_key("fencing");
    let mut last: Option<u64> = None;
    for round in 0..10 {
        let provider = if round % 2 == 0 { &a } else { &b };
        let guard = provider
            .acquire(&key, Duration::from_secs(5))
            .await
            .expect("lock");
        match (h.fencing(), guard.fencing_token()) {
            (true, Some(token)) => {
                if let Some(last) = last {
                    assert!(token > last, "token {token} after {last}");
                }
                last = Some(token);
            }
            (true, None) => panic!("the backend promises fencing tokens but gave none"),
            (false, token) => assert_eq!(token, None),
        }
        guard.release().await.expect("release");
    }
}

/// `with_lock` releases when the closure's work fails.
pub async fn with_lock_releases_on_error(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let key = unique_key("with-err");
    let outcome: Result<Result<(), &str>, LockError> = a
        .with_lock(&key, Duration::from_secs(5), |_lost| async {
            Err("work failed")
        })
        .await;
    assert_eq!(outcome.expect("lock taken"), Err("work failed"));
    let guard = b.try_acquire(&key).await.expect("released after the error");
    guard.release().await.expect("release");
}

/// `with_lock` releases when the closure panics.
pub async fn with_lock_releases_on_panic(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let key = unique_key("with-panic");
    let task = {
        let key = key.clone();
        tokio::spawn(async move {
            a.with_lock(&key, Duration::from_secs(5), |_lost| async {
                panic!("work panicked");
            })
            .await
        })
    };
    assert!(task.await.expect_err("the task panicked").is_panic());
    let guard = b
        .acquire(&key, Duration::from_secs(2))
        .await
        .expect("released after the panic");
    guard.release().await.expect("release");
}

/// `with_lock` hands back the closure's output and a live lost token.
pub async fn with_lock_returns_output(h: &impl Harness) {
    let a = h.provider().await;
    let key = unique_key("with-ok");
    let n = a
        .with_lock(&key, Duration::from_secs(5), |lost| async move {
            assert!(!lost.is_cancelled());
            21 * 2
        })
        .await
        .expect("lock");
    assert_eq!(n, 42);
    assert_eq!(a.local_key_count(), 0);
}

/// Many keys held at once by one provider, all exclusive, all released.
pub async fn many_keys_at_once(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let prefix = unique_key("many");
    let keys: Vec<String> = (0..200).map(|i| format!("{prefix}:{i}")).collect();
    let guards =
        futures::future::try_join_all(keys.iter().map(|k| a.acquire(k, Duration::from_secs(10))))
            .await
            .expect("all keys");
    assert_eq!(a.local_key_count(), keys.len());
    for k in keys.iter().step_by(17) {
        assert_held(b.try_acquire(k).await);
    }
    futures::future::try_join_all(guards.into_iter().map(LockGuard::release))
        .await
        .expect("release all");
    assert_eq!(a.local_key_count(), 0);
    for k in keys.iter().step_by(17) {
        b.try_acquire(k)
            .await
            .expect("free")
            .release()
            .await
            .expect("release");
    }
}

/// Awkward keys are locked exactly; the empty key is a typed error.
pub async fn bad_keys(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    match a.try_acquire("").await {
        Err(LockError::InvalidKey { reason }) => assert!(reason.contains("empty")),
        other => panic!("expected InvalidKey, got {other:?}"),
    }
    assert!(matches!(
        a.acquire("", Duration::from_secs(1)).await,
        Err(LockError::InvalidKey { .. })
    ));
    let salt = unique_key("");
    let awkward = [
        format!("{salt}\0nul"),
        format!("{salt}'; DROP TABLE __distributed_locks; --"),
        format!("{salt}\"quoted\" and 'single'"),
        format!("{salt}line\nbreak\r\n"),
        format!("{salt}ü:ключ:鍵"),
        format!("{salt}{{hash}}:tag"),
        format!("{salt}redis.call('FLUSHALL')"),
        format!("{salt}{}", "x".repeat(1 << 20)),
    ];
    for key in &awkward {
        let guard = a.try_acquire(key).await.expect("awkward key locks");
        assert_eq!(guard.key(), key);
        assert_held(b.try_acquire(key).await);
        guard.release().await.expect("release");
        b.try_acquire(key)
            .await
            .expect("free")
            .release()
            .await
            .expect("release");
    }
}

/// Keys that differ only slightly are different locks.
pub async fn distinct_keys_do_not_collide(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let salt = unique_key("");
    let pairs = [
        ("Jobs", "jobs"),
        ("a\0b", "a\0c"),
        ("x", "x\0"),
        ("k ", "k"),
        ("é", "e\u{301}"),
    ];
    for (x, y) in pairs {
        let (x, y) = (format!("{salt}{x}"), format!("{salt}{y}"));
        let gx = a.try_acquire(&x).await.expect("first key");
        let gy = b
            .try_acquire(&y)
            .await
            .unwrap_or_else(|e| panic!("{x:?} and {y:?} must be different locks, got {e}"));
        gx.release().await.expect("release");
        gy.release().await.expect("release");
    }
    // Long keys that share a long prefix stay distinct.
    let long = "p".repeat(10_000);
    let gx = a
        .try_acquire(&format!("{salt}{long}1"))
        .await
        .expect("long 1");
    let gy = b
        .try_acquire(&format!("{salt}{long}2"))
        .await
        .expect("long 2");
    gx.release().await.expect("release");
    gy.release().await.expect("release");
}

/// Several providers and tasks hammering one key never overlap.
pub async fn exclusion_under_contention(h: &impl Harness) {
    let key = unique_key("hot");
    let inside = Arc::new(AtomicBool::new(false));
    let sections = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let provider = h.provider().await;
        for _ in 0..3 {
            let (p, key, inside, sections) = (
                provider.clone(),
                key.clone(),
                inside.clone(),
                sections.clone(),
            );
            tasks.push(tokio::spawn(async move {
                for _ in 0..15 {
                    let g = p
                        .acquire(&key, Duration::from_secs(60))
                        .await
                        .expect("lock");
                    assert!(!inside.swap(true, Ordering::SeqCst), "two holders at once");
                    tokio::task::yield_now().await;
                    inside.store(false, Ordering::SeqCst);
                    sections.fetch_add(1, Ordering::SeqCst);
                    g.release().await.expect("release");
                }
            }));
        }
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(sections.load(Ordering::SeqCst), 3 * 3 * 15);
}

/// When the store loses the lock behind a guard, the guard's lost token fires in time and
/// the release reports the loss.
pub async fn lost_detection(h: &impl Harness) {
    let a = h.provider().await;
    let key = unique_key("lost");
    let guard = a.try_acquire(&key).await.expect("free key");
    assert!(!guard.is_lost());
    h.break_lock(&guard).await;
    let fired = tokio::time::timeout(h.lost_within(), guard.lost_token().cancelled()).await;
    assert!(
        fired.is_ok(),
        "lost token did not fire within {:?}",
        h.lost_within()
    );
    assert!(guard.is_lost());
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
    // The key is not stranded: another provider takes it within the backend's bound.
    let b = h.provider().await;
    let bound = h.retake_within();
    let started = Instant::now();
    let next = b.acquire(&key, bound).await.unwrap_or_else(|e| {
        panic!(
            "the key is stranded after its loss: not taken again within {bound:?} ({e} after {:?})",
            started.elapsed()
        )
    });
    next.release().await.expect("release");
    // The provider that lost it still works afterwards.
    let other = a
        .try_acquire(&unique_key("after-lost"))
        .await
        .expect("provider recovers");
    other.release().await.expect("release");
}

/// Acquisitions abandoned at arbitrary points never leave a lock behind.
pub async fn acquisition_dropped_midway(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let key = unique_key("abandon");
    for i in 0..40u64 {
        // Abandon after 0..2 ms: before, during or after the store's answer.
        let budget = Duration::from_micros((i * 53) % 2000);
        let _ = tokio::time::timeout(budget, a.acquire(&key, Duration::from_secs(5))).await;
    }
    let Some(bound) = h.abandon_bound() else {
        panic!(
            "this backend can strand a lock after abandoned waits (its harness declares an open bug)"
        );
    };
    let guard = b
        .acquire(&key, bound)
        .await
        .expect("nothing stranded by abandoned acquisitions");
    guard.release().await.expect("release");
    assert!(
        crate::eventually(Duration::from_secs(2), || a.local_key_count() == 0).await,
        "abandoned acquisitions leave the table"
    );
}

/// How many acquisitions one run of [`cancellation_sweep`] abandons. Every backend's suite
/// runs it (PostgreSQL, MySQL and Redis more than once), so a full test run drops well over
/// 10,000 acquisitions and releases at random points.
pub const SWEEP_ROUNDS: usize = 1_000;

/// Acquisitions and releases dropped at random points, many at once on a few keys: by a short
/// timeout around `acquire`, a `try_acquire` or `release` cut short, a guard dropped without
/// release, or the whole task aborted at a random moment. Afterwards every key is free for
/// another provider within the backend's bound, and nothing is left in the in-process table.
pub async fn cancellation_sweep(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let keys: Vec<String> = (0..6).map(|i| unique_key(&format!("sweep{i}"))).collect();
    let seed = fastrand::u64(..);
    let mut rng = fastrand::Rng::with_seed(seed);
    let panics_before = crate::foreign_panics().len();
    // What the sweep did: acquisitions that got their lock, acquisitions cut short by their
    // timeout, and tasks ended by an abort that landed. A sweep whose every acquisition
    // failed, or whose every cut came too late, would test nothing it claims.
    let granted = Arc::new(AtomicUsize::new(0));
    let cut = Arc::new(AtomicUsize::new(0));
    let aborted = AtomicUsize::new(0);
    // A task may end by the abort the sweep aimed at it; any other way it ends (a panic in
    // dlock or in the sweep's own asserts) fails the test.
    let reap = |done: Option<Result<(), tokio::task::JoinError>>| {
        if let Some(Err(err)) = done {
            assert!(
                err.is_cancelled(),
                "a sweep task failed (seed {seed}): {err}"
            );
            aborted.fetch_add(1, Ordering::Relaxed);
        }
    };
    let mut tasks = tokio::task::JoinSet::new();
    for round in 0..SWEEP_ROUNDS {
        while tasks.len() >= 24 {
            reap(tasks.join_next().await);
        }
        let key = keys[round % keys.len()].clone();
        let locks = a.clone();
        let budget = Duration::from_micros(rng.u64(0..3_000));
        let mode = rng.u8(0..4);
        let abort_after = rng.bool().then(|| Duration::from_micros(rng.u64(0..3_000)));
        let (granted, cut) = (granted.clone(), cut.clone());
        let work = async move {
            let got = |ok: bool| {
                if ok {
                    granted.fetch_add(1, Ordering::Relaxed);
                }
            };
            let timed_out = |elapsed: bool| {
                if elapsed {
                    cut.fetch_add(1, Ordering::Relaxed);
                }
            };
            match mode {
                // A wait cut short.
                0 => {
                    match tokio::time::timeout(budget, locks.acquire(&key, Duration::from_secs(5)))
                        .await
                    {
                        Ok(taken) => got(taken.is_ok()),
                        Err(_) => timed_out(true),
                    }
                }
                // A try cut short.
                1 => match tokio::time::timeout(budget, locks.try_acquire(&key)).await {
                    Ok(taken) => got(taken.is_ok()),
                    Err(_) => timed_out(true),
                },
                // A release cut short.
                2 => {
                    if let Ok(guard) = locks.acquire(&key, budget).await {
                        got(true);
                        let _ = tokio::time::timeout(budget / 2, guard.release()).await;
                    }
                }
                // A guard dropped while held. Taken by a wait, so that guards are taken on
                // every backend: on etcd a try finds a cut acquisition's entry still queued
                // ahead of it nearly every time (2 to 4 tries of 1,000 got a lock).
                _ => {
                    if let Ok(guard) = locks.acquire(&key, Duration::from_secs(2)).await {
                        got(true);
                        tokio::time::sleep(budget).await;
                        drop(guard);
                    }
                }
            }
        };
        let handle = tasks.spawn(work);
        if let Some(after) = abort_after {
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                handle.abort();
            });
        }
    }
    while let Some(done) = tasks.join_next().await {
        reap(Some(done));
    }
    let (granted, cut, aborted) = (
        granted.load(Ordering::Relaxed),
        cut.load(Ordering::Relaxed),
        aborted.load(Ordering::Relaxed),
    );
    eprintln!(
        "sweep (seed {seed}): {granted} of {SWEEP_ROUNDS} acquisitions got their lock, {cut} \
         were cut short by their timeout, {aborted} tasks ended by an abort"
    );
    assert!(
        granted > 0 && cut > 0,
        "the sweep must both take locks and cut work short (seed {seed}): {granted} granted, \
         {cut} timed out, {aborted} aborted"
    );
    let bound = h.abandon_bound().unwrap_or(Duration::from_secs(30));
    for key in &keys {
        let started = Instant::now();
        let guard = b.acquire(key, bound).await.unwrap_or_else(|e| {
            panic!(
                "{key} stranded after the sweep (seed {seed}): {e} after {:?}",
                started.elapsed()
            )
        });
        guard.release().await.expect("release");
    }
    assert!(
        crate::eventually(Duration::from_secs(5), || a.local_key_count() == 0).await,
        "abandoned acquisitions leave the table (seed {seed})"
    );
    // Nor did anything panic where no `JoinHandle` of the sweep sees it (a background
    // release, a connection or renewal task).
    let panics = &crate::foreign_panics()[panics_before..];
    assert!(
        panics.is_empty(),
        "{} panics outside the test code during the sweep (seed {seed}; or in another test of \
         this binary at the same time), the first:\n{}",
        panics.len(),
        panics[..panics.len().min(5)].join("\n")
    );
}

/// Providers on clones of one backend exclude each other: a try, a bounded wait and a try
/// from an independent provider all see the key held; a waiter on another clone gets it when
/// the holder lets go. (A server session re-entering its own lock would let every provider on
/// the shared connection in.)
pub async fn shared_backend_excludes(h: &impl Harness) {
    let providers = h.shared_providers(3).await;
    let outsider = h.provider().await;
    let key = unique_key("shared");
    let guard = providers[0].try_acquire(&key).await.expect("free key");
    for other in &providers[1..] {
        assert_held(other.try_acquire(&key).await);
        match other.acquire(&key, Duration::from_millis(150)).await {
            Err(LockError::Timeout { .. }) => {}
            got => panic!("a provider on the same backend waited and got {got:?}"),
        }
    }
    assert_held(outsider.try_acquire(&key).await);
    let waiter = {
        let (p, key) = (providers[2].clone(), key.clone());
        tokio::spawn(async move { p.acquire(&key, Duration::from_secs(30)).await })
    };
    // Still waiting while the first provider holds the key.
    assert!(
        !crate::eventually(Duration::from_millis(200), || waiter.is_finished()).await,
        "a provider on the same backend got a held key"
    );
    guard.release().await.expect("release");
    let got = tokio::time::timeout(Duration::from_secs(10), waiter)
        .await
        .expect("the waiter gets the key once it is released")
        .expect("join")
        .expect("acquire");
    assert_held(providers[0].try_acquire(&key).await);
    assert_held(providers[1].try_acquire(&key).await);
    assert_held(outsider.try_acquire(&key).await);
    got.release().await.expect("release");
    let again = outsider
        .try_acquire(&key)
        .await
        .expect("free after release");
    again.release().await.expect("release");
}

/// Tasks on providers over one cloned backend hammering one key never overlap, with tries and
/// waits mixed, and every section gets a larger fencing token than the one before.
pub async fn shared_backend_contention(h: &impl Harness) {
    let providers = h.shared_providers(3).await;
    let key = unique_key("shared-hot");
    let inside = Arc::new(AtomicBool::new(false));
    let sections = Arc::new(AtomicUsize::new(0));
    let last_token = Arc::new(std::sync::Mutex::new(None::<u64>));
    let fencing = h.fencing();
    let mut tasks = Vec::new();
    for (n, provider) in providers.iter().enumerate() {
        for t in 0..3 {
            let (p, key, inside, sections, last_token) = (
                provider.clone(),
                key.clone(),
                inside.clone(),
                sections.clone(),
                last_token.clone(),
            );
            tasks.push(tokio::spawn(async move {
                let mut done = 0;
                while done < 10 {
                    let got = if (n + t) % 2 == 0 {
                        p.try_acquire(&key).await
                    } else {
                        p.acquire(&key, Duration::from_secs(60)).await
                    };
                    let g = match got {
                        Ok(g) => g,
                        Err(LockError::AlreadyHeld { .. }) => {
                            tokio::task::yield_now().await;
                            continue;
                        }
                        Err(e) => panic!("acquire: {e}"),
                    };
                    assert!(!inside.swap(true, Ordering::SeqCst), "two holders at once");
                    {
                        let mut last = last_token.lock().unwrap();
                        match (fencing, g.fencing_token()) {
                            (true, Some(token)) => {
                                assert!(
                                    last.is_none_or(|l| token > l),
                                    "token {token} after {last:?}"
                                );
                                *last = Some(token);
                            }
                            (true, None) => panic!("a fenced backend gave no token"),
                            (false, _) => {}
                        }
                    }
                    tokio::task::yield_now().await;
                    inside.store(false, Ordering::SeqCst);
                    sections.fetch_add(1, Ordering::SeqCst);
                    g.release().await.expect("release");
                    done += 1;
                }
            }));
        }
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(sections.load(Ordering::SeqCst), 3 * 3 * 10);
}

/// The runtime that opened a provider and took its first lock (starting whatever background
/// work the backend runs there: connection tasks, lease renewal) is dropped while a lock taken
/// from a second runtime is held. Either that lock stays alive, or its holder hears of the loss
/// before anyone else can take the key; and the provider keeps working from the second runtime.
///
/// `make` builds the harness: `None` fails the case as not run ([`no_harness`]).
pub fn background_runtime_dropped<F, Fut, H>(make: F)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Option<H>>,
    H: Harness,
{
    let runtime = crate::runtime;
    let main = runtime(1);
    let Some(h) = main.block_on(make()) else {
        no_harness()
    };
    let first = runtime(2);
    let (provider, key) = first.block_on(async {
        let provider = h.provider().await;
        warm_up(&h, &provider).await;
        (provider, unique_key("runtime-drop"))
    });
    let second = runtime(2);
    let guard = second
        .block_on(provider.try_acquire(&key))
        .expect("free key");
    let outsider = main.block_on(h.provider());
    first.shutdown_timeout(Duration::from_secs(10));
    second.block_on(async {
        let watch_for = h.lost_within() * 3;
        let started = Instant::now();
        while started.elapsed() < watch_for {
            // Whether the holder has been told, read just before the outsider asks: a grant
            // to this try comes later than the reading, so a holder told in time was told by
            // then. (Read after the grant, `is_lost` would find the lease's deadline passed
            // whenever the store had let the key go, and could not fail.)
            let told = guard.is_lost();
            match outsider.try_acquire(&key).await {
                Ok(other) => {
                    assert!(
                        told,
                        "another provider took the key {:?} after the runtime was dropped, \
                         while its holder had not been told when that try was sent",
                        started.elapsed()
                    );
                    eprintln!(
                        "the key was taken {:?} after the runtime was dropped, its holder told \
                         before",
                        started.elapsed()
                    );
                    other.release().await.expect("release");
                    break;
                }
                Err(LockError::AlreadyHeld { .. }) => {}
                Err(e) => panic!("outsider: {e}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if !guard.is_lost() {
            eprintln!("the lock stayed held for {watch_for:?} after the runtime was dropped");
        }
        // The provider still works from the runtime that is left.
        let other = provider
            .try_acquire(&unique_key("after-runtime-drop"))
            .await
            .expect("the provider works on after its first runtime is gone");
        other.release().await.expect("release");
        contended_wait(&h, &provider).await;
        let lost = guard.is_lost();
        match guard.release().await {
            Err(LockError::Lost { .. }) if lost => {}
            Ok(()) if !lost => {}
            other => panic!("release after the runtime drop (lost: {lost}): {other:?}"),
        }
    });
    drop(second);
}

/// A guard held on a runtime that is then dropped goes with that runtime's shutdown, which
/// refuses new tasks, while the provider's connections live on a runtime that stays: the key
/// must come free (the release runs elsewhere, or the session or lease that held it ends),
/// for another provider and for the same one, and never stays held by nobody. Once for a lock
/// taken by a try, once for one granted to a waiting acquisition.
pub fn guard_dropped_by_its_runtime<F, Fut, H>(make: F)
where
    F: FnOnce() -> Fut,
    Fut: Future<Output = Option<H>>,
    H: Harness,
{
    let main = crate::runtime(1);
    let Some(h) = main.block_on(make()) else {
        no_harness()
    };
    let (provider, outsider) = main.block_on(async {
        let provider = h.provider().await;
        // Its connections open here, on the runtime that stays.
        warm_up(&h, &provider).await;
        (provider, h.provider().await)
    });
    for waits in [false, true] {
        let key = unique_key("dropped-with-its-runtime");
        let blocker = waits.then(|| main.block_on(outsider.try_acquire(&key)).expect("free key"));
        let doomed = crate::runtime(1);
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let holder = doomed.spawn({
            let (provider, key) = (provider.clone(), key.clone());
            async move {
                let guard = provider.acquire(&key, Duration::from_secs(30)).await;
                let _ = held_tx.send(guard.as_ref().map(drop).map_err(ToString::to_string));
                // Held until the runtime drops this task.
                let _guard = guard;
                std::future::pending::<()>().await;
            }
        });
        if let Some(blocker) = blocker {
            main.block_on(async {
                waiting(&provider, &holder).await;
                blocker.release().await.expect("release");
            });
        }
        held_rx
            .recv_timeout(Duration::from_secs(30))
            .expect("the acquisition ended")
            .expect("the key was granted");
        doomed.shutdown_timeout(Duration::from_secs(10));
        main.block_on(async {
            let limit = h.retake_within();
            let started = Instant::now();
            loop {
                match outsider.try_acquire(&key).await {
                    Ok(other) => {
                        other.release().await.expect("release");
                        break;
                    }
                    Err(LockError::AlreadyHeld { .. }) if started.elapsed() < limit => {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    other => panic!(
                        "the key stayed held {:?} after its guard's runtime was dropped \
                         (waited: {waits}): {other:?}",
                        started.elapsed()
                    ),
                }
            }
            let again = provider
                .try_acquire(&key)
                .await
                .expect("the provider takes the key again after its guard's runtime was dropped");
            again.release().await.expect("release");
        });
    }
}

/// A lock taken and released, and a wait, through `provider`: whatever serves tries and waits
/// (lock and wait connections, their tasks) starts on the current runtime.
async fn warm_up(h: &impl Harness, provider: &LockProvider) {
    let warm = provider
        .try_acquire(&unique_key("warm"))
        .await
        .expect("warm-up");
    warm.release().await.expect("release");
    contended_wait(h, provider).await;
}

/// `provider` waits for a key another provider holds until it lets go.
async fn contended_wait(h: &impl Harness, provider: &LockProvider) {
    let blocker = h.provider().await;
    let key = unique_key("contended");
    let held = blocker.try_acquire(&key).await.expect("free key");
    let before = provider.local_key_count();
    let mut waiter = {
        let (p, key) = (provider.clone(), key.clone());
        tokio::spawn(async move { p.acquire(&key, Duration::from_secs(30)).await })
    };
    tokio::select! {
        outcome = &mut waiter => panic!("the waiter finished while the key was held: {outcome:?}"),
        () = crate::wait_until(
            "the waiter is acquiring",
            Duration::from_secs(5),
            async || provider.local_key_count() == before + 1,
        ) => {}
    }
    held.release().await.expect("release");
    let got = waiter
        .await
        .expect("join")
        .expect("the waiter gets the key once it is released");
    got.release().await.expect("release");
}

/// `ping` answers from the store, holds nothing, and keeps answering after the store dropped
/// a lock behind a guard (a killed session is replaced, not reported as a store that is down).
pub async fn ping_answers(h: &impl Harness) {
    let a = h.provider().await;
    a.ping().await.expect("ping of a store that is up");
    assert_eq!(a.local_key_count(), 0, "a ping takes nothing");
    let guard = a.try_acquire(&unique_key("ping")).await.expect("free key");
    h.break_lock(&guard).await;
    // Every lock connection of the backend is asked in turn (at most 64 of them).
    for _ in 0..8 {
        a.ping()
            .await
            .expect("ping after a lock connection was killed");
    }
    drop(guard);
}

/// Handle-level lease control. A leased lock (its guard has a `remaining_lease`) can be
/// extended, verified, and left to expire; a lock the store dropped is reported as lost by
/// each of them. A session lock answers `Unsupported` to each, and releases as `Released`.
pub async fn lease_control(h: &impl Harness) {
    let a = h.provider().await;
    let guard = a.try_acquire(&unique_key("lease")).await.expect("free key");
    let Some(left) = guard.remaining_lease() else {
        let unsupported = |result: Result<_, LockError>| {
            assert!(
                matches!(result, Err(LockError::Unsupported { .. })),
                "a session lock has no lease to control"
            )
        };
        unsupported(guard.extend(Duration::from_secs(60)).await);
        unsupported(guard.verify_still_held().await.map(drop));
        unsupported(guard.stop_renewal());
        assert_eq!(
            guard.release_outcome().await.expect("release"),
            ReleaseOutcome::Released
        );
        return;
    };
    assert!(left > Duration::ZERO);
    assert!(guard.verify_still_held().await.expect("verify"));
    guard
        .extend(Duration::from_secs(300))
        .await
        .expect("extend");
    let extended = guard.remaining_lease().expect("still leased");
    assert!(
        extended > Duration::from_secs(200),
        "four fifths of the new 300 s lease, less a round trip: {extended:?}"
    );
    assert!(matches!(
        guard.extend(Duration::ZERO).await,
        Err(LockError::Config { .. })
    ));
    assert!(!guard.is_lost(), "a refused extension loses nothing");
    h.break_lock(&guard).await;
    assert!(!guard.verify_still_held().await.expect("verify"));
    assert!(
        guard.lost_token().is_cancelled(),
        "verify reported the loss"
    );
    assert_eq!(guard.remaining_lease(), Some(Duration::ZERO));
    assert!(matches!(
        guard.extend(Duration::from_secs(60)).await,
        Err(LockError::Lost { .. })
    ));
    let outcome = guard.release_outcome().await.expect("release");
    assert_ne!(
        outcome,
        ReleaseOutcome::Released,
        "the store no longer had it"
    );

    // A lock whose renewal stops expires with its lease: its lost token fires, and another
    // provider then takes the key. Renewed (the control), the same lease outlives itself.
    let lease = Duration::from_millis(600);
    let (key, control) = (unique_key("unrenewed"), unique_key("renewed"));
    let stopped = a
        .lock(&key)
        .lease(lease)
        .try_acquire()
        .await
        .expect("free key");
    let renewed = a
        .lock(&control)
        .lease(lease)
        .try_acquire()
        .await
        .expect("free key");
    stopped.stop_renewal().expect("stop");
    tokio::time::timeout(Duration::from_secs(10), stopped.lost_token().cancelled())
        .await
        .expect("the unrenewed lock is presumed lost at its deadline");
    let b = h.provider().await;
    let next = b
        .acquire(&key, Duration::from_secs(10))
        .await
        .expect("the unrenewed lock expired in the store");
    assert!(!renewed.is_lost(), "the renewed lock is still held");
    assert!(matches!(
        b.try_acquire(&control).await,
        Err(LockError::AlreadyHeld { .. })
    ));
    // Taken without renewal from the start, a lock expires the same way.
    let unrenewed = a
        .lock(&unique_key("never-renewed"))
        .lease(lease)
        .renewal(false)
        .try_acquire()
        .await
        .expect("free key");
    tokio::time::timeout(Duration::from_secs(10), unrenewed.lost_token().cancelled())
        .await
        .expect("a lock taken without renewal is presumed lost at its deadline");
    for guard in [next, renewed] {
        guard.release().await.expect("release");
    }
    assert!(matches!(
        stopped.release().await,
        Err(LockError::Lost { .. })
    ));
    drop(unrenewed);
}

/// Renewals started later ([`LockGuard::start_renewal`](dlock::LockGuard::start_renewal)): a
/// leased lock taken without renewal, whose renewals then start, is still held (and another
/// provider is refused) well past the end of the lease it was taken with. Once its local
/// deadline has passed, renewals do not start (a renewal must not revive a lease another owner
/// may hold by then): `Lost`. A session lock answers `Unsupported`, and so may a lease control
/// of another crate's written before the method (dlock's own lease backends must not).
pub async fn renewal_started_later(h: &impl Harness) {
    let a = h.provider().await;
    let lease = Duration::from_millis(600);
    let key = unique_key("started");
    let guard = a
        .lock(&key)
        .lease(lease)
        .renewal(false)
        .try_acquire()
        .await
        .expect("free key");
    if guard.remaining_lease().is_none() {
        assert!(
            matches!(guard.start_renewal(), Err(LockError::Unsupported { .. })),
            "a session lock has no lease to renew"
        );
        guard.release().await.expect("release");
        return;
    }
    match guard.start_renewal() {
        // A lease control written before `start_renewal` (dlock's own all have it).
        Err(LockError::Unsupported { .. })
            if !["sqlite", "redis", "redlock", "etcd"].contains(&a.backend_name()) =>
        {
            guard.release().await.expect("release");
            return;
        }
        started => started.expect("start renewals"),
    }
    guard
        .start_renewal()
        .expect("starting them again does nothing");
    let b = h.provider().await;
    let started = std::time::Instant::now();
    // Three leases: without renewals, the lock would have been presumed lost at four fifths
    // of the first and freed in the store at its end.
    while started.elapsed() < lease * 3 {
        assert!(!guard.is_lost(), "lost {:?} in", started.elapsed());
        assert_held(b.try_acquire(&key).await);
        tokio::time::sleep(lease / 4).await;
    }
    assert!(guard.verify_still_held().await.expect("verify"));
    guard.release().await.expect("release");

    let late = a
        .lock(&unique_key("late"))
        .lease(lease)
        .renewal(false)
        .try_acquire()
        .await
        .expect("free key");
    tokio::time::timeout(Duration::from_secs(10), late.lost_token().cancelled())
        .await
        .expect("a lock taken without renewal is presumed lost at its deadline");
    assert!(
        matches!(late.start_renewal(), Err(LockError::Lost { .. })),
        "renewals never start on a lock presumed lost"
    );
    drop(late);
}

/// Force release ([`LockProvider::force_release`]): another provider ends a lock held with a
/// 3 s lease; the holder's lost token fires at its next renewal (a third of the lease), before
/// the lease's local deadline (at 2.4 s) could have fired it; the next holder's token is
/// greater; a free key answers `false`. Read locks, where the backend has them, end for every
/// reader. A backend that refuses says why (dlock's own lease backends must not refuse).
pub async fn force_release_ends_a_lock(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let lease = Duration::from_secs(3);
    let key = unique_key("forced");
    let guard = a
        .lock(&key)
        .lease(lease)
        .try_acquire()
        .await
        .expect("free key");
    let forced = std::time::Instant::now();
    let ended = match b.force_release(&key).await {
        Err(LockError::Unsupported { message, .. }) => {
            assert!(
                guard.remaining_lease().is_none()
                    || !["sqlite", "redis", "redlock", "etcd"].contains(&a.backend_name()),
                "dlock's lease stores all end a lock by force: {message}"
            );
            assert!(message.len() > 40, "the refusal says what to do: {message}");
            guard.release().await.expect("release");
            return;
        }
        other => other.expect("force release"),
    };
    assert!(ended, "a held lock was ended");
    tokio::time::timeout(Duration::from_secs(2), guard.lost_token().cancelled())
        .await
        .expect("the holder hears of it at its next renewal");
    assert!(forced.elapsed() < Duration::from_secs(2));
    let next = b.try_acquire(&key).await.expect("the key is free");
    if let (Some(ended), Some(next)) = (guard.fencing_token(), next.fencing_token()) {
        assert!(next > ended, "token {next} after the ended {ended}");
    }
    assert!(matches!(guard.release().await, Err(LockError::Lost { .. })));
    next.release().await.expect("release");
    assert!(
        !b.force_release(&key).await.expect("force release"),
        "nothing was held"
    );
    assert!(matches!(
        b.force_release("").await,
        Err(LockError::InvalidKey { .. })
    ));

    let key = unique_key("forced-read");
    let Ok(first) = a.lock(&key).lease(lease).read().try_acquire().await else {
        return;
    };
    let second = b
        .lock(&key)
        .lease(lease)
        .read()
        .try_acquire()
        .await
        .expect("readers share");
    assert!(b.force_release(&key).await.expect("force release"));
    for reader in [&first, &second] {
        tokio::time::timeout(Duration::from_secs(2), reader.lost_token().cancelled())
            .await
            .expect("each reader hears of it at its next renewal");
    }
    let read = second.fencing_token();
    for reader in [first, second] {
        assert!(matches!(
            reader.release().await,
            Err(LockError::Lost { .. })
        ));
    }
    let writer = a.try_acquire(&key).await.expect("the key is free");
    if let (Some(read), Some(written)) = (read, writer.fencing_token()) {
        assert!(written > read);
    }
    writer.release().await.expect("release");
}

/// Multi-key acquisitions are all or none: a set with one held key leaves none of its other
/// keys held, a wait gets the whole set once the key is free, a timeout gives back what it
/// took, and a key given twice is refused.
pub async fn many_all_or_none(h: &impl Harness) {
    let (a, b, c) = (h.provider().await, h.provider().await, h.provider().await);
    let (w, x, y) = (
        unique_key("many-w"),
        unique_key("many-x"),
        unique_key("many-y"),
    );
    let held = a.try_acquire(&x).await.expect("free key");
    assert_held(b.try_acquire_many(&[&y, &x, &w]).await);
    let rest = c
        .try_acquire_many(&[&w, &y])
        .await
        .expect("the keys taken before the held one were given back");
    for guard in rest {
        guard.release().await.expect("release");
    }
    // A timed-out wait gives back the keys it took (w is taken before x).
    let outcome = b.acquire_many(&[&x, &w], Duration::from_millis(300)).await;
    assert!(
        matches!(outcome, Err(LockError::Timeout { timeout, .. }) if timeout == Duration::from_millis(300)),
        "{outcome:?}"
    );
    c.try_acquire(&w)
        .await
        .expect("a timed-out multi-key wait gave its keys back")
        .release()
        .await
        .expect("release");
    // A wait gets every key once the held one is free; the guards follow the given order.
    let waiter = tokio::spawn({
        let b = b.clone();
        let keys = [y.clone(), x.clone(), w.clone()];
        async move {
            let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
            b.acquire_many(&keys, Duration::from_secs(10)).await
        }
    });
    crate::wait_until(
        "the multi-key wait holds its first key",
        Duration::from_secs(5),
        async || {
            assert!(
                !waiter.is_finished(),
                "the wait finished while a key was held"
            );
            b.local_key_count() == 2
        },
    )
    .await;
    held.release().await.expect("release");
    let guards = waiter
        .await
        .expect("join")
        .expect("every key once x is free");
    let got: Vec<&str> = guards.iter().map(LockGuard::key).collect();
    assert_eq!(got, [y.as_str(), x.as_str(), w.as_str()]);
    for key in [&w, &x, &y] {
        assert_held(c.try_acquire(key).await);
    }
    for guard in guards {
        guard.release().await.expect("release");
    }
    assert!(matches!(
        a.try_acquire_many(&[&w, &x, &w]).await,
        Err(LockError::InvalidKey { .. })
    ));
    assert!(a.try_acquire_many(&[]).await.expect("no keys").is_empty());
    assert_eq!(a.local_key_count(), 0);
}

/// Two providers taking one pair of keys, given in opposite orders, never wait on each other
/// in a cycle; multi-key waits dropped at random points leave no key behind.
pub async fn many_never_deadlock(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let (k1, k2) = (unique_key("pair-1"), unique_key("pair-2"));
    let c = h.provider().await;
    for _ in 0..5 {
        // Both callers wait while a third holds the pair, then it lets go of both: with keys
        // taken in their given order, each would get one key and wait for the other's.
        let blockers = c.try_acquire_many(&[&k1, &k2]).await.expect("free keys");
        let take = |provider: &LockProvider, keys: [&String; 2]| {
            let provider = provider.clone();
            let keys = keys.map(String::clone);
            tokio::spawn(async move {
                let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                let guards = provider
                    .acquire_many(&keys, Duration::from_secs(10))
                    .await?;
                for guard in guards {
                    guard.release().await?;
                }
                Ok::<_, LockError>(())
            })
        };
        let one = take(&a, [&k1, &k2]);
        let other = take(&b, [&k2, &k1]);
        crate::wait_until("both callers wait", Duration::from_secs(5), async || {
            a.local_key_count() == 1 && b.local_key_count() == 1
        })
        .await;
        // k2 first: a caller waiting on it gets it while the other still waits on k1.
        for guard in blockers.into_iter().rev() {
            guard.release().await.expect("release");
        }
        one.await.expect("join").expect("first caller");
        other
            .await
            .expect("join")
            .expect("second caller, keys in the other order");
    }
    let held = a.try_acquire(&k2).await.expect("free key");
    let pair = [k1.as_str(), k2.as_str()];
    for _ in 0..20 {
        let wait = b.acquire_many(&pair, Duration::from_secs(5));
        let cut = Duration::from_micros(fastrand::u64(0..3000));
        assert!(tokio::time::timeout(cut, wait).await.is_err(), "k2 is held");
    }
    held.release().await.expect("release");
    let bound = h.abandon_bound().unwrap_or(Duration::from_secs(5));
    let guards = c
        .acquire_many(&[&k1, &k2], bound)
        .await
        .expect("abandoned multi-key waits left no key behind");
    for guard in guards {
        guard.release().await.expect("release");
    }
}

/// `run_exclusive` runs a job on one provider at a time, skips it elsewhere without waiting,
/// and keeps the lock for `at_least_for` after a quick run.
pub async fn run_exclusive_once(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let key = unique_key("job");
    let most = Duration::from_secs(30);
    let started = Arc::new(tokio::sync::Notify::new());
    let finish = Arc::new(tokio::sync::Notify::new());
    let running = tokio::spawn({
        let (a, key, started, finish) = (a.clone(), key.clone(), started.clone(), finish.clone());
        async move {
            a.run_exclusive(&key, most, Duration::ZERO, |_lost| async move {
                started.notify_one();
                finish.notified().await;
                "ran"
            })
            .await
        }
    });
    started.notified().await;
    let ran_here = AtomicBool::new(false);
    let skipped = b
        .run_exclusive(&key, most, Duration::ZERO, |_| async {
            ran_here.store(true, Ordering::SeqCst);
        })
        .await
        .expect("a skipped run is not an error");
    assert_eq!(skipped, None);
    assert!(
        !ran_here.load(Ordering::SeqCst),
        "the job ran on two providers at once"
    );
    finish.notify_one();
    assert_eq!(
        running.await.expect("join").expect("the job ran"),
        Some("ran")
    );
    assert_eq!(
        b.run_exclusive(&key, most, Duration::ZERO, |_| async { 2 })
            .await
            .expect("run"),
        Some(2),
        "with no at_least_for the lock is free once the job returns"
    );

    // A quick run keeps the lock for at_least_for from its start.
    let least = Duration::from_millis(800);
    let key = unique_key("job-least");
    let start = Instant::now();
    let first = a.run_exclusive(&key, most, least, |_| async { 1 }).await;
    assert_eq!(first.expect("run"), Some(1));
    assert_eq!(
        b.run_exclusive(&key, most, least, |_| async { 2 })
            .await
            .expect("skip"),
        None
    );
    let mut next = None;
    crate::wait_until(
        "the job runs again after at_least_for",
        Duration::from_secs(10),
        async || {
            next = b
                .run_exclusive(&key, most, least, |_| async { 3 })
                .await
                .expect("run");
            next.is_some()
        },
    )
    .await;
    assert!(
        start.elapsed() >= least,
        "the job ran again {:?} after the first start, before at_least_for",
        start.elapsed()
    );
    assert!(matches!(
        a.run_exclusive(&key, least, most, |_| async {}).await,
        Err(LockError::Config { .. })
    ));
}

/// Two leaders on one key: one leads at a time; the leader stepping down on shutdown hands
/// over to the other at once, with a larger fencing token.
pub async fn leader_hands_over(h: &impl Harness) {
    let key = unique_key("leader");
    let leading = Arc::new(std::sync::Mutex::new(Vec::<(usize, Option<u64>)>::new()));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let mut runs = Vec::new();
    let mut shutdowns = Vec::new();
    for id in 0..2 {
        let provider = h.provider().await;
        let shutdown = CancellationToken::new();
        let (key, leading, overlaps, stop) = (
            key.clone(),
            leading.clone(),
            overlaps.clone(),
            shutdown.clone(),
        );
        runs.push(tokio::spawn(async move {
            Leader::new(&provider, key)
                .run(&stop, |term| {
                    let (leading, overlaps) = (leading.clone(), overlaps.clone());
                    async move {
                        {
                            let mut now = leading.lock().unwrap();
                            if !now.is_empty() {
                                overlaps.fetch_add(1, Ordering::SeqCst);
                            }
                            now.push((id, term.fencing_token()));
                        }
                        term.ended().await;
                        leading.lock().unwrap().retain(|(who, _)| *who != id);
                    }
                })
                .await
        }));
        shutdowns.push(shutdown);
    }
    let first = {
        let mut found = None;
        crate::wait_until("a leader is elected", Duration::from_secs(10), async || {
            found = leading.lock().unwrap().first().copied();
            found.is_some()
        })
        .await;
        found.expect("a leader")
    };
    shutdowns[first.0].cancel();
    let second = {
        let mut found = None;
        crate::wait_until(
            "the other takes over",
            Duration::from_secs(10),
            async || {
                found = leading
                    .lock()
                    .unwrap()
                    .first()
                    .copied()
                    .filter(|(who, _)| *who != first.0);
                found.is_some()
            },
        )
        .await;
        found.expect("a second leader")
    };
    if h.fencing() {
        assert!(second.1 > first.1, "tokens {first:?} then {second:?}");
    }
    shutdowns[second.0].cancel();
    for run in runs {
        run.await
            .expect("join")
            .expect("a leader's run ends cleanly on shutdown");
    }
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "two leaders at once");
    assert!(leading.lock().unwrap().is_empty());
}

/// A semaphore admits up to `max_count` holders across providers, refuses the next, admits
/// again when one leaves, and lives apart from the lock of the same key.
pub async fn semaphore_bounds_holders(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let key = unique_key("sem");
    let mut held = vec![
        a.try_acquire_semaphore(&key, 3).await.expect("slot 1"),
        b.try_acquire_semaphore(&key, 3).await.expect("slot 2"),
        a.try_acquire_semaphore(&key, 3).await.expect("slot 3"),
    ];
    assert_held(a.try_acquire_semaphore(&key, 3).await);
    assert_held(b.try_acquire_semaphore(&key, 3).await);
    let timed = b
        .acquire_semaphore(&key, 3, Duration::from_millis(200))
        .await;
    assert!(matches!(timed, Err(LockError::Timeout { .. })), "{timed:?}");
    if h.fencing() {
        assert!(held.iter().all(|guard| guard.fencing_token().is_some()));
    }
    // The lock of the same key is another thing.
    a.try_acquire(&key)
        .await
        .expect("the lock `key` is free while its semaphore is full")
        .release()
        .await
        .expect("release");
    held.pop()
        .expect("a guard")
        .release()
        .await
        .expect("release");
    let again = b
        .acquire_semaphore(&key, 3, Duration::from_secs(5))
        .await
        .expect("a slot once one was released");
    held.push(again);
    for guard in held {
        guard.release().await.expect("release");
    }
    assert!(matches!(
        a.try_acquire_semaphore(&key, 0).await,
        Err(LockError::Config { .. })
    ));
    assert!(matches!(
        a.try_acquire(&format!("dlock\u{0}semaphore\u{0}0\u{0}{key}"))
            .await,
        Err(LockError::InvalidKey { .. })
    ));
}

/// Two holders of a semaphore of two are inside at once (each waits, permit held, for the
/// other); then tasks of three providers contend for it: never more than two inside at once;
/// waits dropped at random points leave no slot behind.
pub async fn semaphore_under_contention(h: &impl Harness) {
    let key = unique_key("sem-contended");
    // First, a rendezvous: two holders on two providers each keep their permit until both
    // are inside. A semaphore that admitted one holder at a time would keep the second
    // waiting on the first, which waits for it, until the generous limit ends both.
    const RENDEZVOUS: Duration = Duration::from_secs(30);
    let arrived = Arc::new(AtomicUsize::new(0));
    let mut holders = Vec::new();
    for _ in 0..2 {
        let provider = h.provider().await;
        let (key, arrived) = (key.clone(), arrived.clone());
        holders.push(tokio::spawn(async move {
            let guard = provider
                .acquire_semaphore(&key, 2, RENDEZVOUS)
                .await
                .expect("a permit of a semaphore of two, while at most one other is held");
            arrived.fetch_add(1, Ordering::SeqCst);
            let all_in =
                crate::eventually(RENDEZVOUS, || arrived.load(Ordering::SeqCst) == 2).await;
            guard.release().await.expect("release");
            all_in
        }));
    }
    for holder in holders {
        assert!(
            holder.await.expect("a holder panicked"),
            "two holders of a semaphore of two were never inside at once"
        );
    }
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let provider = h.provider().await;
        for _ in 0..3 {
            let (provider, key, inside, most) =
                (provider.clone(), key.clone(), inside.clone(), most.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..4 {
                    let guard = provider
                        .acquire_semaphore(&key, 2, Duration::from_secs(30))
                        .await
                        .expect("a slot");
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    guard.release().await.expect("release");
                }
            }));
        }
    }
    for task in tasks {
        task.await.expect("a task panicked");
    }
    // Never more than two inside, and the semaphore did admit two at once (a semaphore that
    // admitted one holder at a time would pass the bound alone).
    assert_eq!(
        most.load(Ordering::SeqCst),
        2,
        "the most holders inside at once, of a semaphore of two"
    );
    let a = h.provider().await;
    for _ in 0..20 {
        let wait = a.acquire_semaphore(&key, 2, Duration::from_secs(5));
        let cut = Duration::from_micros(fastrand::u64(0..3000));
        let _ = tokio::time::timeout(cut, wait).await;
    }
    let bound = h.abandon_bound().unwrap_or(Duration::from_secs(5));
    let b = h.provider().await;
    let first = b
        .acquire_semaphore(&key, 2, bound)
        .await
        .expect("slot left free");
    let second = b
        .acquire_semaphore(&key, 2, bound)
        .await
        .expect("both slots left free");
    first.release().await.expect("release");
    second.release().await.expect("release");
}

/// Defect 1 of issue 43: 3 providers × 8 tasks loop acquire / hold 5–25 ms / release on a
/// semaphore of 3 until 240 permits have been granted (about 1.5 s; at most 20 s on a slow
/// store). Every task gets permits, each provider's share is within 25 % of an equal one,
/// the 99th percentile wait is within 5× the median, and the semaphore both never exceeds 3
/// holders and does reach 3. (With waits that never queued, a releasing holder took its
/// permit straight back: on SQLite one provider took all 344 acquisitions of 2 s.)
pub async fn semaphore_fairness(h: &impl Harness) {
    const PROVIDERS: usize = 3;
    const TASKS: usize = 8;
    const PERMITS: u32 = 3;
    const GRANTS: usize = 240;
    const LIMIT: Duration = Duration::from_secs(20);
    let key = unique_key("sem-fair");
    let mut providers = Vec::new();
    for _ in 0..PROVIDERS {
        providers.push(h.provider().await);
    }
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let granted = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let end = started + LIMIT;
    let mut tasks = Vec::new();
    for (p, provider) in providers.iter().enumerate() {
        for _ in 0..TASKS {
            let (provider, key, inside, most, granted) = (
                provider.clone(),
                key.clone(),
                inside.clone(),
                most.clone(),
                granted.clone(),
            );
            tasks.push(tokio::spawn(async move {
                let mut waits = Vec::new();
                while granted.load(Ordering::SeqCst) < GRANTS && Instant::now() < end {
                    let asked = Instant::now();
                    let timeout = end.saturating_duration_since(asked) + Duration::from_secs(20);
                    let guard = provider
                        .acquire_semaphore(&key, PERMITS, timeout)
                        .await
                        .expect("a permit within the run and 20 s");
                    let got = Instant::now();
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    // Counted while the run lasts: once it is over, waits are cut short.
                    if granted.fetch_add(1, Ordering::SeqCst) < GRANTS && got < end {
                        waits.push(got - asked);
                    }
                    tokio::time::sleep(Duration::from_millis(fastrand::u64(5..=25))).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    guard.release().await.expect("release");
                }
                (p, waits)
            }));
        }
    }
    let mut counts = [0usize; PROVIDERS];
    let mut per_task = Vec::new();
    let mut waits = Vec::new();
    for task in tasks {
        let (p, task_waits) = tokio::time::timeout(LIMIT + Duration::from_secs(60), task)
            .await
            .expect("every task ends within a minute of the run")
            .expect("a task panicked");
        counts[p] += task_waits.len();
        per_task.push(task_waits.len());
        waits.extend(task_waits);
    }
    let took = started.elapsed();
    let most = most.load(Ordering::SeqCst);
    assert!(most <= PERMITS as usize, "{most} holders at once");
    assert_eq!(
        most, PERMITS as usize,
        "the semaphore never had {PERMITS} holders at once"
    );
    let total: usize = counts.iter().sum();
    assert!(
        total >= 2 * PROVIDERS * TASKS,
        "too few acquisitions to judge in {took:?}: {counts:?}"
    );
    waits.sort_unstable();
    let at = |q: f64| waits[((waits.len() as f64 * q).ceil() as usize).saturating_sub(1)];
    let (median, p99) = (at(0.5), at(0.99));
    eprintln!(
        "semaphore fairness ({}): {total} permits in {took:?}, per provider {counts:?}, per \
         task {per_task:?}, wait median {median:?}, p99 {p99:?}",
        providers[0].backend_name()
    );
    if let Some(why) = h.unfair_waits() {
        eprintln!(
            "not checked: every task served, each provider's share and the wait tail, \
             because {why}"
        );
        return;
    }
    assert!(
        per_task.iter().all(|&n| n > 0),
        "a task got no permit: permits per task {per_task:?}, per provider {counts:?}"
    );
    let share = total as f64 / PROVIDERS as f64;
    for (p, &n) in counts.iter().enumerate() {
        assert!(
            (n as f64 - share).abs() <= 0.25 * share,
            "provider {p} got {n} of {total} permits (an equal share is {share:.0}): {counts:?}"
        );
    }
    assert!(
        p99 <= median.max(Duration::from_millis(1)) * 5,
        "the 99th percentile wait {p99:?} is over 5× the median {median:?} ({counts:?})"
    );
}

/// Defect 2 of issue 43: a semaphore of `u32::MAX` permits (which aborted the process,
/// allocating a list of every slot) or of a million is served where the backend keeps
/// semaphores natively without a bound, and refused with `Config` naming the limit on the slot
/// scheme and on stores with a bound of their own, whose largest count
/// ([`LockProvider::max_semaphore_count`]) is served.
pub async fn semaphore_huge_counts(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let key = unique_key("sem-huge");
    let limit = a.max_semaphore_count();
    if limit == u32::MAX {
        for count in [u32::MAX, 1_000_000] {
            let key = format!("{key}:{count}");
            let first = a
                .try_acquire_semaphore(&key, count)
                .await
                .expect("a permit of a huge semaphore");
            assert_eq!(first.key(), key);
            let second = b
                .acquire_semaphore(&key, count, Duration::from_secs(5))
                .await
                .expect("a second permit");
            if h.fencing() {
                assert!(second.fencing_token() > first.fencing_token());
            }
            first.release().await.expect("release");
            second.release().await.expect("release");
        }
        return;
    }
    // The slot scheme (`MAX_SLOT_PERMITS`), or a store with a bound of its own.
    for count in [u32::MAX, 1_000_000, limit + 1] {
        for timeout in [Duration::ZERO, Duration::from_secs(5)] {
            match a.acquire_semaphore(&key, count, timeout).await {
                Err(LockError::Config { message }) => {
                    assert!(message.contains(&limit.to_string()), "{message}");
                }
                other => panic!("a semaphore of {count} on the slot scheme: {other:?}"),
            }
        }
    }
    let guard = a
        .try_acquire_semaphore(&key, limit)
        .await
        .expect("the largest count of the slot scheme");
    assert_eq!(guard.key(), key);
    guard.release().await.expect("release");
}

/// Defect 3 of issue 43: callers that disagree on `max_count` (2 and 5 on one key) got 5
/// holders. Where the backend keeps semaphores natively, another count is refused with
/// `Config` naming both while anyone holds a permit, and taken once all have left; where the
/// backend cannot record the count ([`LockProvider::records_semaphore_counts`]: the slot
/// scheme, MySQL/MariaDB), the larger count is served (as documented).
pub async fn semaphore_counts_must_agree(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let key = unique_key("sem-count");
    let first = a.try_acquire_semaphore(&key, 2).await.expect("a permit");
    if !a.records_semaphore_counts() {
        let mut more = Vec::new();
        for _ in 0..4 {
            more.push(b.try_acquire_semaphore(&key, 5).await.expect("slot scheme"));
        }
        assert_held(b.try_acquire_semaphore(&key, 5).await);
        first.release().await.expect("release");
        for guard in more {
            guard.release().await.expect("release");
        }
        return;
    }
    let refused = |result: Result<LockGuard, LockError>| match result {
        Err(LockError::Config { message }) => {
            assert!(
                message.contains("max_count 2") && message.contains("max_count 5"),
                "the refusal names both counts: {message}"
            );
        }
        other => panic!("a count of 5 while 2 is in use: {other:?}"),
    };
    refused(b.try_acquire_semaphore(&key, 5).await);
    // A wait is refused at once, not after its timeout.
    let started = Instant::now();
    refused(b.acquire_semaphore(&key, 5, Duration::from_secs(30)).await);
    assert!(started.elapsed() < Duration::from_secs(10));
    let second = b.try_acquire_semaphore(&key, 2).await.expect("a permit");
    assert_held(b.try_acquire_semaphore(&key, 2).await);
    refused(a.try_acquire_semaphore(&key, 5).await);
    first.release().await.expect("release");
    refused(a.try_acquire_semaphore(&key, 5).await);
    second.release().await.expect("release");
    // Nobody holds or waits: the new count is taken, and holds from now on.
    let mut five = Vec::new();
    for provider in [&a, &b, &a, &b, &a] {
        five.push(
            provider
                .try_acquire_semaphore(&key, 5)
                .await
                .expect("a new count once all had left"),
        );
    }
    assert_held(b.try_acquire_semaphore(&key, 5).await);
    match a.try_acquire_semaphore(&key, 2).await {
        Err(LockError::Config { message }) => assert!(message.contains("max_count 5")),
        other => panic!("a count of 2 while 5 is in use: {other:?}"),
    }
    for guard in five {
        guard.release().await.expect("release");
    }
}

/// [`LockProvider::semaphore_holders`]: the permits two providers hold are counted by both
/// (and by a third that holds none), a waiter is not, a released permit no longer is, and
/// another `max_count` is refused with `Config` naming both counts where the store records
/// the count (as an acquisition is), or answered where it cannot. A backend that cannot
/// count answers `Unsupported`.
pub async fn semaphore_holders_counted(h: &impl Harness) {
    let (a, b, c) = (h.provider().await, h.provider().await, h.provider().await);
    let key = unique_key("sem-holders");
    match c.semaphore_holders(&key, 2).await {
        Err(LockError::Unsupported { operation, .. }) => {
            assert_eq!(operation, "semaphore occupancy");
            return;
        }
        Ok(n) => assert_eq!(n, 0, "a semaphore nobody used has no holders"),
        Err(e) => panic!("semaphore_holders: {e}"),
    }
    assert!(matches!(
        c.semaphore_holders(&key, 0).await,
        Err(LockError::Config { .. })
    ));
    let first = a.try_acquire_semaphore(&key, 2).await.expect("a permit");
    for provider in [&a, &b, &c] {
        assert_eq!(provider.semaphore_holders(&key, 2).await.expect("count"), 1);
    }
    let second = b.try_acquire_semaphore(&key, 2).await.expect("a permit");
    let waiter = {
        let c = c.clone();
        let key = key.clone();
        tokio::spawn(async move { c.acquire_semaphore(&key, 2, Duration::from_secs(30)).await })
    };
    waiting(&c, &waiter).await;
    for provider in [&a, &b] {
        assert_eq!(
            provider.semaphore_holders(&key, 2).await.expect("count"),
            2,
            "two holders (the waiter is not one)"
        );
    }
    // The semaphore "x" and the lock "x" are unrelated.
    let lock = a
        .try_acquire(&key)
        .await
        .expect("the lock of the semaphore's key");
    assert_eq!(b.semaphore_holders(&key, 2).await.expect("count"), 2);
    lock.release().await.expect("release");
    if a.records_semaphore_counts() {
        match b.semaphore_holders(&key, 5).await {
            Err(LockError::Config { message }) => assert!(
                message.contains("max_count 2") && message.contains("max_count 5"),
                "the refusal names both counts: {message}"
            ),
            other => panic!("counting with 5 while 2 is in use: {other:?}"),
        }
    } else {
        b.semaphore_holders(&key, 5)
            .await
            .expect("a store without a count record answers any count");
    }
    first.release().await.expect("release");
    // The waiter takes the permit given back.
    let third = waiter.await.expect("join").expect("the waiter's permit");
    assert_eq!(a.semaphore_holders(&key, 2).await.expect("count"), 2);
    second.release().await.expect("release");
    third.release().await.expect("release");
    assert_eq!(
        a.semaphore_holders(&key, 2).await.expect("count"),
        0,
        "released permits are not counted"
    );
    // Nobody holds it: another count is answered (and, where recorded, will be taken).
    assert_eq!(a.semaphore_holders(&key, 5).await.expect("count"), 0);
}

/// A semaphore wait that runs out of time answers `Timeout` naming the semaphore (defect 4
/// of issue 43 for semaphores), whether it waited for a permit or behind another waiter;
/// a zero timeout is one try, answered `AlreadyHeld`.
pub async fn semaphore_timeouts(h: &impl Harness) {
    let (a, b, c) = (h.provider().await, h.provider().await, h.provider().await);
    let key = unique_key("sem-timeout");
    let held = a.try_acquire_semaphore(&key, 1).await.expect("a permit");
    let timeout = Duration::from_millis(300);
    let started = Instant::now();
    match b.acquire_semaphore(&key, 1, timeout).await {
        Err(LockError::Timeout {
            key: named,
            timeout: t,
        }) => {
            assert_eq!(&*named, key);
            assert_eq!(t, timeout);
        }
        other => panic!("a wait on a full semaphore: {other:?}"),
    }
    assert!(started.elapsed() >= timeout);
    assert_held(b.acquire_semaphore(&key, 1, Duration::ZERO).await);
    // One waiter ahead (it holds the queue, on backends that have one), another behind it.
    let first = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move { b.acquire_semaphore(&key, 1, Duration::from_secs(30)).await })
    };
    waiting(&b, &first).await;
    match c.acquire_semaphore(&key, 1, timeout).await {
        Err(LockError::Timeout { key: named, .. }) => assert_eq!(&*named, key),
        other => panic!("a wait behind another waiter: {other:?}"),
    }
    held.release().await.expect("release");
    let got = first.await.expect("join").expect("the first waiter");
    assert_eq!(got.key(), key);
    got.release().await.expect("release");
}

/// Waits of a full semaphore dropped at random points, or ended by the provider's shutdown,
/// leave no permit and no place in the queue behind: once the holders leave, another
/// provider takes every permit, each at once, and the provider that dropped them does too.
pub async fn semaphore_waits_leave_nothing(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let key = unique_key("sem-dropped");
    let held = [
        a.try_acquire_semaphore(&key, 2).await.expect("a permit"),
        a.try_acquire_semaphore(&key, 2).await.expect("a permit"),
    ];
    let mut canceled = 0;
    for round in 0..20 {
        if round % 5 == 4 {
            // Ended by the provider's shutdown while it waits (behind another waiter of the
            // same provider, every other time).
            let shutdown = CancellationToken::new();
            let stopping = b.with_shutdown(&shutdown);
            let ahead = (round % 10 == 9).then(|| {
                let (b, key) = (b.clone(), key.clone());
                tokio::spawn(
                    async move { b.acquire_semaphore(&key, 2, Duration::from_secs(30)).await },
                )
            });
            let wait = {
                let key = key.clone();
                tokio::spawn(async move {
                    stopping
                        .acquire_semaphore(&key, 2, Duration::from_secs(30))
                        .await
                })
            };
            tokio::time::sleep(Duration::from_millis(fastrand::u64(1..20))).await;
            shutdown.cancel();
            match wait.await.expect("join") {
                Err(LockError::Canceled { key: named }) => {
                    assert_eq!(&*named, key);
                    canceled += 1;
                }
                other => panic!("a wait ended by the shutdown: {other:?}"),
            }
            if let Some(ahead) = ahead {
                ahead.abort();
                let _ = ahead.await;
            }
            continue;
        }
        let wait = b.acquire_semaphore(&key, 2, Duration::from_secs(5));
        let cut = Duration::from_micros(fastrand::u64(0..3000));
        assert!(
            tokio::time::timeout(cut, wait).await.is_err(),
            "a wait on a full semaphore ended within {cut:?}"
        );
    }
    assert_eq!(canceled, 4);
    for guard in held {
        guard.release().await.expect("release");
    }
    let bound = h.abandon_bound().unwrap_or(Duration::from_secs(5));
    for provider in [&h.provider().await, &b] {
        let started = Instant::now();
        let taken = [
            provider
                .acquire_semaphore(&key, 2, bound)
                .await
                .expect("a permit left free"),
            provider
                .acquire_semaphore(&key, 2, bound)
                .await
                .expect("both permits left free"),
        ];
        assert_held(provider.try_acquire_semaphore(&key, 2).await);
        eprintln!("both permits after {:?}", started.elapsed());
        for guard in taken {
            guard.release().await.expect("release");
        }
    }
    // A wait dropped midway (the aborted one ahead) gives its queue lock back on a task of
    // its own: awaited, within the bound, so a key kept for good still fails.
    crate::wait_until("the provider keeps no key", bound, async || {
        b.local_key_count() == 0
    })
    .await;
}

/// `held_locks` lists what a provider holds, sorted by key, with each lock's fencing token,
/// a lease where there is one, and a loss once it is known; a released lock leaves the list.
pub async fn held_locks_are_listed(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let (first, second) = (unique_key("listed-a"), unique_key("listed-b"));
    let before = std::time::SystemTime::now();
    let guards = [
        a.try_acquire(&second).await.expect("free key"),
        a.try_acquire(&first).await.expect("free key"),
    ];
    assert!(b.held_locks().is_empty(), "another provider holds nothing");
    let listed = a.held_locks();
    let keys: Vec<&str> = listed.iter().map(|info| info.key.as_str()).collect();
    assert_eq!(keys, [first.as_str(), second.as_str()]);
    for (info, guard) in listed.iter().zip([&guards[1], &guards[0]]) {
        assert_eq!(info.fencing_token, guard.fencing_token());
        assert_eq!(
            info.remaining_lease.is_some(),
            guard.remaining_lease().is_some()
        );
        assert!(info.since >= before && !info.lost);
    }
    let [held_second, held_first] = guards;
    h.break_lock(&held_first).await;
    tokio::time::timeout(h.lost_within(), held_first.lost_token().cancelled())
        .await
        .expect("the loss is detected");
    let listed = a.held_locks();
    assert!(listed[0].lost, "{listed:?}");
    assert!(!listed[1].lost, "{listed:?}");
    drop(held_first.release().await);
    held_second.release().await.expect("release");
    assert!(a.held_locks().is_empty());
}

/// Answers whether the case goes on: for a backend without read locks, checks that each
/// read-lock call answers `Unsupported` with no lock left behind, and ends the case.
async fn read_locks_or_unsupported(h: &impl Harness) -> bool {
    if h.read_locks() {
        return true;
    }
    let a = h.provider().await;
    let key = unique_key("no-read");
    for got in [
        a.try_acquire_read(&key).await,
        a.acquire_read(&key, Duration::from_millis(100)).await,
        a.lock(&key).read().try_acquire().await,
    ] {
        match got {
            Err(LockError::Unsupported { operation, .. }) => assert_eq!(operation, "read locks"),
            other => {
                panic!("expected Unsupported from a backend without read locks, got {other:?}")
            }
        }
    }
    assert_eq!(
        a.local_key_count(),
        0,
        "a refused read lock left a table entry"
    );
    let guard = h
        .provider()
        .await
        .try_acquire(&key)
        .await
        .expect("a refused read lock leaves the key free");
    guard.release().await.expect("release");
    false
}

/// Readers share a key, across providers and within one; a writer is excluded while any
/// reader holds it, and readers while a writer does; each side gets the key once the other
/// has let go. A backend without read locks answers `Unsupported` instead.
pub async fn read_locks_share(h: &impl Harness) {
    if !read_locks_or_unsupported(h).await {
        return;
    }
    let (a, b, c) = (h.provider().await, h.provider().await, h.provider().await);
    let key = unique_key("rw");
    let r1 = a.try_acquire_read(&key).await.expect("first reader");
    let r2 = a
        .try_acquire_read(&key)
        .await
        .expect("a second reader in one provider");
    let r3 = b
        .acquire_read(&key, Duration::from_secs(5))
        .await
        .expect("a reader in another provider");
    assert_eq!(a.held_locks().iter().filter(|l| l.shared).count(), 2);
    // Writers are excluded, from every provider, tried and waited.
    assert_held(a.try_acquire(&key).await);
    assert_held(c.try_acquire(&key).await);
    match c.acquire(&key, Duration::from_millis(200)).await {
        Err(LockError::Timeout { .. }) => {}
        got => panic!("a writer waited while readers held the key and got {got:?}"),
    }
    r1.release().await.expect("release");
    r2.release().await.expect("release");
    // One reader left: still no writer.
    assert_held(c.try_acquire(&key).await);
    let writer = {
        let (c, key) = (c.clone(), key.clone());
        tokio::spawn(async move { c.acquire(&key, Duration::from_secs(30)).await })
    };
    assert!(
        !crate::eventually(Duration::from_millis(200), || writer.is_finished()).await,
        "a writer got a key a reader holds"
    );
    r3.release().await.expect("release");
    let w = tokio::time::timeout(Duration::from_secs(10), writer)
        .await
        .expect("the writer gets the key once the last reader leaves")
        .expect("join")
        .expect("acquire");
    // While the writer holds it, readers are excluded everywhere.
    assert_held(a.try_acquire_read(&key).await);
    assert_held(c.try_acquire_read(&key).await);
    match b.acquire_read(&key, Duration::from_millis(200)).await {
        Err(LockError::Timeout { .. }) => {}
        got => panic!("a reader waited while a writer held the key and got {got:?}"),
    }
    let reader = {
        let (b, key) = (b.clone(), key.clone());
        tokio::spawn(async move { b.acquire_read(&key, Duration::from_secs(30)).await })
    };
    assert!(
        !crate::eventually(Duration::from_millis(200), || reader.is_finished()).await,
        "a reader got a key a writer holds"
    );
    w.release().await.expect("release");
    let r = tokio::time::timeout(Duration::from_secs(10), reader)
        .await
        .expect("the reader gets the key once the writer leaves")
        .expect("join")
        .expect("acquire_read");
    // Readers and writers of other keys are unaffected.
    let other = c
        .try_acquire(&unique_key("rw-other"))
        .await
        .expect("other key");
    other.release().await.expect("release");
    r.release().await.expect("release");
    let last = a.try_acquire(&key).await.expect("free once everyone left");
    last.release().await.expect("release");
    assert_eq!(a.local_key_count(), 0);
}

/// Readers and writers on several providers hammering one key: a writer never overlaps
/// anyone, readers do overlap, and a fenced backend gives every writer a token larger than
/// every token handed out before its section.
pub async fn read_write_exclusion(h: &impl Harness) {
    if !read_locks_or_unsupported(h).await {
        return;
    }
    let key = unique_key("rw-hot");
    // Readers inside (count) and whether a writer is inside.
    let readers = Arc::new(AtomicUsize::new(0));
    let writer = Arc::new(AtomicBool::new(false));
    let most_readers = Arc::new(AtomicUsize::new(0));
    let writes = Arc::new(AtomicUsize::new(0));
    let highest = Arc::new(std::sync::Mutex::new(None::<u64>));
    let fencing = h.fencing();
    let mut tasks = Vec::new();
    for n in 0..3 {
        let provider = h.provider().await;
        for t in 0..4 {
            let (p, key, readers, writer, most_readers, writes, highest) = (
                provider.clone(),
                key.clone(),
                readers.clone(),
                writer.clone(),
                most_readers.clone(),
                writes.clone(),
                highest.clone(),
            );
            // One writer task per provider, three readers.
            let writes_here = t == 0;
            tasks.push(tokio::spawn(async move {
                for round in 0..8 {
                    if writes_here {
                        let g = p
                            .acquire(&key, Duration::from_secs(60))
                            .await
                            .expect("write");
                        assert!(!writer.swap(true, Ordering::SeqCst), "two writers at once");
                        assert_eq!(readers.load(Ordering::SeqCst), 0, "a writer among readers");
                        if fencing {
                            let token = g.fencing_token().expect("a fenced backend gave no token");
                            let mut highest = highest.lock().unwrap();
                            if let Some(before) = *highest {
                                assert!(token > before, "writer token {token} after {before}");
                            }
                            *highest = Some(token);
                        }
                        tokio::task::yield_now().await;
                        assert_eq!(readers.load(Ordering::SeqCst), 0, "a reader came in");
                        writer.store(false, Ordering::SeqCst);
                        writes.fetch_add(1, Ordering::SeqCst);
                        g.release().await.expect("release");
                    } else {
                        let g = p
                            .acquire_read(&key, Duration::from_secs(60))
                            .await
                            .expect("read");
                        assert!(!writer.load(Ordering::SeqCst), "a reader among a writer");
                        let now = readers.fetch_add(1, Ordering::SeqCst) + 1;
                        most_readers.fetch_max(now, Ordering::SeqCst);
                        if fencing {
                            let token = g.fencing_token().expect("a fenced backend gave no token");
                            let mut highest = highest.lock().unwrap();
                            *highest = Some(highest.map_or(token, |h| h.max(token)));
                        }
                        // Hold long enough for other readers to join.
                        tokio::time::sleep(Duration::from_millis(2 + (n + round) as u64 % 3)).await;
                        assert!(!writer.load(Ordering::SeqCst), "a writer came in");
                        readers.fetch_sub(1, Ordering::SeqCst);
                        g.release().await.expect("release");
                    }
                }
            }));
        }
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(writes.load(Ordering::SeqCst), 3 * 8);
    assert!(
        most_readers.load(Ordering::SeqCst) > 1,
        "readers never shared the key"
    );
}

/// A writer gets the key within a bound while readers on two other providers keep it read
/// without a gap (each new reader arrives before the previous one leaves): readers that
/// arrive after a waiting writer wait behind it.
pub async fn writer_not_starved(h: &impl Harness) {
    if !read_locks_or_unsupported(h).await {
        return;
    }
    let key = unique_key("rw-starve");
    let (a, b, w) = (h.provider().await, h.provider().await, h.provider().await);
    let stop = CancellationToken::new();
    let first = a.try_acquire_read(&key).await.expect("first reader");
    let mut readers = Vec::new();
    for p in [a.clone(), b.clone()] {
        let (key, stop) = (key.clone(), stop.clone());
        readers.push(tokio::spawn(async move {
            // Overlapping readers: take a new share, then let the older one go. A reader
            // that cannot get a new share soon (a writer is queued ahead of it) lets its old
            // one go anyway, as any reader ends its read in bounded time.
            let mut held: Option<LockGuard> = None;
            while !stop.is_cancelled() {
                match p
                    .lock(&key)
                    .read()
                    .timeout(Duration::from_millis(30))
                    .cancel_on(&stop)
                    .acquire()
                    .await
                {
                    Ok(g) => {
                        if let Some(old) = held.replace(g) {
                            old.release().await.expect("release");
                        }
                    }
                    Err(LockError::Timeout { .. }) => {
                        if let Some(old) = held.take() {
                            old.release().await.expect("release");
                        }
                    }
                    Err(LockError::Canceled { .. }) => break,
                    Err(e) => panic!("reader: {e}"),
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if let Some(g) = held {
                g.release().await.expect("release");
            }
        }));
    }
    // The stream of readers is under way once both providers hold a share.
    crate::wait_until(
        "both reader providers hold a share",
        Duration::from_secs(10),
        async || a.held_locks().len() >= 2 && !b.held_locks().is_empty(),
    )
    .await;
    first.release().await.expect("release");
    let started = Instant::now();
    let got = w.acquire(&key, Duration::from_secs(20)).await;
    let waited = started.elapsed();
    stop.cancel();
    let g = got.expect("the writer got the key while readers kept arriving");
    assert!(
        waited < Duration::from_secs(10),
        "the writer waited {waited:?} behind a stream of readers"
    );
    g.release().await.expect("release");
    for r in readers {
        r.await.expect("reader task");
    }
}

/// Providers on clones of one backend: their readers share the key, and a writer on another
/// clone is excluded until the last of them leaves (a server session re-entering its own lock
/// must not let the writer in).
pub async fn read_shared_backend(h: &impl Harness) {
    if !read_locks_or_unsupported(h).await {
        return;
    }
    let providers = h.shared_providers(3).await;
    let key = unique_key("rw-shared");
    let r0 = providers[0].try_acquire_read(&key).await.expect("reader");
    let r1 = providers[1]
        .try_acquire_read(&key)
        .await
        .expect("reader on a clone");
    assert_held(providers[2].try_acquire(&key).await);
    r0.release().await.expect("release");
    assert_held(providers[2].try_acquire(&key).await);
    r1.release().await.expect("release");
    let w = providers[2]
        .try_acquire(&key)
        .await
        .expect("free after readers");
    assert_held(providers[0].try_acquire_read(&key).await);
    assert_held(providers[1].try_acquire_read(&key).await);
    w.release().await.expect("release");
    // And the other way round: a writer on a clone excludes readers of the clone it is on.
    let w = providers[0].try_acquire(&key).await.expect("free");
    assert_held(providers[1].try_acquire_read(&key).await);
    w.release().await.expect("release");
    let r = providers[1]
        .try_acquire_read(&key)
        .await
        .expect("free again");
    r.release().await.expect("release");
}

/// Read acquisitions and releases dropped at random points, mixed with writers: afterwards a
/// writer on another provider gets every key within the backend's bound.
pub async fn read_cancellation_sweep(h: &impl Harness) {
    if !read_locks_or_unsupported(h).await {
        return;
    }
    let (a, b) = (h.provider().await, h.provider().await);
    let keys: Vec<String> = (0..4).map(|i| unique_key(&format!("rsweep{i}"))).collect();
    let seed = fastrand::u64(..);
    let mut rng = fastrand::Rng::with_seed(seed);
    let panics_before = crate::foreign_panics().len();
    // What the sweep did, as in `cancellation_sweep`: read guards taken, and acquisitions or
    // releases cut short by their timeout. A sweep that took no read lock, or cut nothing,
    // would test nothing it claims.
    let granted = Arc::new(AtomicUsize::new(0));
    let cut = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for round in 0..SWEEP_ROUNDS / 4 {
        while tasks.len() >= 16 {
            if let Some(Err(err)) = tasks.join_next().await {
                assert!(
                    err.is_cancelled(),
                    "a sweep task failed (seed {seed}): {err}"
                );
            }
        }
        let key = keys[round % keys.len()].clone();
        let locks = a.clone();
        let budget = Duration::from_micros(rng.u64(0..3_000));
        let mode = rng.u8(0..4);
        let (granted, cut) = (granted.clone(), cut.clone());
        let handle = tasks.spawn(async move {
            let got = |ok: bool| {
                if ok {
                    granted.fetch_add(1, Ordering::Relaxed);
                }
            };
            let timed_out = || {
                cut.fetch_add(1, Ordering::Relaxed);
            };
            match mode {
                // A read wait cut short.
                0 => match tokio::time::timeout(
                    budget,
                    locks.acquire_read(&key, Duration::from_secs(5)),
                )
                .await
                {
                    Ok(taken) => got(taken.is_ok()),
                    Err(_) => timed_out(),
                },
                // A read try cut short.
                1 => match tokio::time::timeout(budget, locks.try_acquire_read(&key)).await {
                    Ok(taken) => got(taken.is_ok()),
                    Err(_) => timed_out(),
                },
                // A read lock's release cut short. Taken by a wait, so that read guards are
                // taken on every backend whatever the budget.
                2 => {
                    if let Ok(guard) = locks.acquire_read(&key, Duration::from_secs(2)).await {
                        got(true);
                        if tokio::time::timeout(budget / 2, guard.release())
                            .await
                            .is_err()
                        {
                            timed_out();
                        }
                    }
                }
                // A writer among the readers, its guard dropped while held.
                _ => {
                    if let Ok(guard) = locks.acquire(&key, budget).await {
                        tokio::time::sleep(budget).await;
                        drop(guard);
                    }
                }
            }
        });
        if rng.bool() {
            let after = Duration::from_micros(rng.u64(0..3_000));
            tokio::spawn(async move {
                tokio::time::sleep(after).await;
                handle.abort();
            });
        }
    }
    while let Some(done) = tasks.join_next().await {
        if let Err(err) = done {
            assert!(
                err.is_cancelled(),
                "a sweep task failed (seed {seed}): {err}"
            );
        }
    }
    let (granted, cut) = (granted.load(Ordering::Relaxed), cut.load(Ordering::Relaxed));
    eprintln!(
        "read sweep (seed {seed}): {granted} read guards taken, {cut} acquisitions or releases \
         cut short by their timeout"
    );
    assert!(
        granted > 0 && cut > 0,
        "the read sweep must both take read locks and cut work short (seed {seed}): {granted} \
         granted, {cut} timed out"
    );
    let bound = h.abandon_bound().unwrap_or(Duration::from_secs(30));
    for key in &keys {
        let guard = b
            .acquire(key, bound)
            .await
            .unwrap_or_else(|e| panic!("{key} stranded after the read sweep (seed {seed}): {e}"));
        guard.release().await.expect("release");
    }
    assert!(
        crate::eventually(Duration::from_secs(5), || a.local_key_count() == 0).await,
        "abandoned read acquisitions leave the table (seed {seed})"
    );
    let panics = &crate::foreign_panics()[panics_before..];
    assert!(
        panics.is_empty(),
        "{} panics outside the test code during the read sweep (seed {seed}; or in another \
         test of this binary at the same time), the first:\n{}",
        panics.len(),
        panics[..panics.len().min(5)].join("\n")
    );
}

/// Store inspection, where the backend has it: a lock held by one provider is listed by
/// another (by key where the store keeps keys), readers are counted, and a released lock is no
/// longer listed. A backend without it answers `Unsupported`.
pub async fn store_locks_list_holders(h: &impl Harness) {
    let (a, b) = (h.provider().await, h.provider().await);
    let declared = h.store_inspection();
    let answer = b.store_locks().await;
    match (declared, &answer) {
        (StoreInspection::Listed, Ok(_)) => {}
        (StoreInspection::Unsupported, Err(LockError::Unsupported { operation, .. })) => {
            assert_eq!(*operation, "store inspection");
            // Nor does a held lock change the answer.
            let guard = a.try_acquire(&unique_key("unlisted")).await.expect("free");
            let again = a.store_locks().await;
            assert!(
                matches!(again, Err(LockError::Unsupported { .. })),
                "declared unsupported, answered {again:?} with a lock held"
            );
            guard.release().await.expect("release");
            return;
        }
        // An account with only the grants locking needs (inspection is an admin's).
        (StoreInspection::Denied(code), Err(LockError::Backend { db_code, .. }))
            if db_code.as_deref() == Some(code) =>
        {
            eprintln!("this account may not list the store's keys ({code}), as declared");
            return;
        }
        _ => panic!("store inspection declared {declared:?}, answered {answer:?}"),
    }
    let key = unique_key("listed");
    let guard = a.try_acquire(&key).await.expect("free");
    let mine = a.store_locks().await.expect("store_locks");
    let entry = mine
        .iter()
        .find(|l| l.key.as_deref() == Some(key.as_str()))
        .unwrap_or_else(|| panic!("the holder does not see its own lock {key} in {mine:?}"))
        .clone();
    assert!(entry.held_here, "{entry:?}");
    assert_eq!(entry.readers, 0);
    let theirs = b.store_locks().await.expect("store_locks");
    let seen = theirs
        .iter()
        .find(|l| l.resource == entry.resource)
        .unwrap_or_else(|| panic!("another provider does not see {key}"));
    assert!(!seen.held_here);
    if let Some(k) = &seen.key {
        assert_eq!(k, &key);
    }
    if let (Some(listed), Some(token)) = (seen.fencing_token, guard.fencing_token()) {
        assert_eq!(listed, token, "the listed token is the holder's");
    }
    if let Some(left) = seen.remaining_lease {
        assert!(left > Duration::ZERO);
    }
    guard.release().await.expect("release");
    let after = b.store_locks().await.expect("store_locks");
    assert!(
        after.iter().all(|l| l.resource != entry.resource),
        "a released lock is still listed: {after:?}"
    );
    if h.read_locks() {
        let r1 = a.try_acquire_read(&key).await.expect("reader");
        let r2 = b.try_acquire_read(&key).await.expect("reader");
        let listed = a.store_locks().await.expect("store_locks");
        let read = listed
            .iter()
            .find(|l| l.resource == entry.resource)
            .unwrap_or_else(|| panic!("a key readers hold is not listed: {listed:?}"));
        assert_eq!(read.readers, 2, "{read:?}");
        r1.release().await.expect("release");
        r2.release().await.expect("release");
        let after = b.store_locks().await.expect("store_locks");
        assert!(after.iter().all(|l| l.resource != entry.resource));
    }
}
