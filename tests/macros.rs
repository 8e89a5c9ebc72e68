//! `#[distributed_lock]` at run time, on SQLite: two providers on one lock file stand for two
//! processes.
#![cfg(all(feature = "macros", feature = "sqlite"))]

use std::collections::HashMap;
use std::fmt::Display;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use dlock::{LockError, LockGuard, LockProvider, LockedCommand, distributed_lock};
use tempfile::TempDir;
use tokio::sync::oneshot;

#[derive(Debug)]
enum AppError {
    Lock(LockError),
    Boom,
}

impl From<LockError> for AppError {
    fn from(err: LockError) -> Self {
        AppError::Lock(err)
    }
}

impl AppError {
    fn code(&self) -> &'static str {
        match self {
            AppError::Lock(err) => err.code(),
            AppError::Boom => "boom",
        }
    }
}

/// Two providers on one lock file, and the file's directory (kept alive with them).
async fn two_providers() -> (TempDir, LockProvider, LockProvider) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/locks.db", dir.path().display());
    let a = LockProvider::connect(&url).await.unwrap();
    let b = LockProvider::connect(&url).await.unwrap();
    (dir, a, b)
}

/// Asserts that `key` is free for `provider` right now (one try), and leaves it free.
async fn assert_free(provider: &LockProvider, key: &str) {
    match provider.try_acquire(key).await {
        Ok(guard) => guard.release().await.unwrap(),
        Err(err) => panic!("`{key}` should be free: {err}"),
    }
}

async fn assert_held(provider: &LockProvider, key: &str) {
    match provider.try_acquire(key).await {
        Err(LockError::AlreadyHeld { .. }) => {}
        Ok(_) => panic!("`{key}` should be held"),
        Err(err) => panic!("`{key}` should be held, got {err}"),
    }
}

/// Holds `account:{account_id}` from `entered` until `leave` fires.
#[distributed_lock("account:{account_id}", timeout = 0)]
async fn hold(
    locks: &LockProvider,
    account_id: u64,
    entered: oneshot::Sender<()>,
    leave: oneshot::Receiver<()>,
) -> Result<u64, AppError> {
    entered.send(()).unwrap();
    leave.await.unwrap();
    Ok(account_id)
}

#[distributed_lock("account:{account_id}", timeout = 0)]
async fn probe(locks: &LockProvider, account_id: u64, runs: &AtomicUsize) -> Result<(), AppError> {
    runs.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn excludes_across_providers() {
    let (_dir, a, b) = two_providers().await;
    let (entered_tx, entered) = oneshot::channel();
    let (leave, leave_rx) = oneshot::channel();
    let holder = tokio::spawn({
        let a = a.clone();
        async move { hold(&a, 7, entered_tx, leave_rx).await }
    });
    entered.await.unwrap();

    let runs = AtomicUsize::new(0);
    let err = probe(&b, 7, &runs).await.unwrap_err();
    assert_eq!(err.code(), "DistributedLock.AlreadyHeld");
    assert_eq!(
        runs.load(Ordering::SeqCst),
        0,
        "the body ran without the lock"
    );
    // The same provider does not re-enter either.
    let err = probe(&a, 7, &runs).await.unwrap_err();
    assert_eq!(err.code(), "DistributedLock.AlreadyHeld");
    // Another key is another lock.
    probe(&b, 8, &runs).await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 1);

    leave.send(()).unwrap();
    assert_eq!(holder.await.unwrap().unwrap(), 7);
    probe(&b, 7, &runs).await.unwrap();
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

#[distributed_lock("counter:{id}", timeout = 30)]
async fn critical(
    locks: LockProvider,
    id: u32,
    inside: Arc<AtomicBool>,
    done: Arc<AtomicUsize>,
) -> Result<(), AppError> {
    assert!(!inside.swap(true, Ordering::SeqCst), "two holders at once");
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    inside.store(false, Ordering::SeqCst);
    done.fetch_add(1, Ordering::SeqCst);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_callers_never_overlap() {
    let (_dir, a, b) = two_providers().await;
    let inside = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let locks = if i % 2 == 0 { a.clone() } else { b.clone() };
            tokio::spawn(critical(locks, 1, inside.clone(), done.clone()))
        })
        .collect();
    for task in tasks {
        task.await.unwrap().unwrap();
    }
    assert_eq!(done.load(Ordering::SeqCst), 8);
}

enum Exit {
    Question,
    ReturnErr,
    ReturnOk,
    Tail,
}

fn boom() -> Result<u32, AppError> {
    Err(AppError::Boom)
}

#[distributed_lock("exit:{id}", timeout = 1, guard = lock)]
async fn exits(locks: &LockProvider, id: u32, exit: Exit) -> Result<u32, AppError> {
    assert_eq!(lock.key(), format!("exit:{id}"));
    match exit {
        Exit::Question => {
            boom()?;
        }
        Exit::ReturnErr => return Err(AppError::Boom),
        Exit::ReturnOk => return Ok(1),
        Exit::Tail => {}
    }
    Ok(2)
}

#[tokio::test]
async fn releases_on_every_way_out_of_the_body() {
    let (_dir, a, b) = two_providers().await;
    assert_eq!(
        exits(&a, 1, Exit::Question).await.unwrap_err().code(),
        "boom"
    );
    // The release was awaited: the lock is free for another provider right away.
    assert_free(&b, "exit:1").await;
    assert_eq!(
        exits(&a, 1, Exit::ReturnErr).await.unwrap_err().code(),
        "boom"
    );
    assert_free(&b, "exit:1").await;
    assert_eq!(exits(&a, 1, Exit::ReturnOk).await.unwrap(), 1);
    assert_free(&b, "exit:1").await;
    assert_eq!(exits(&a, 1, Exit::Tail).await.unwrap(), 2);
    assert_free(&b, "exit:1").await;
    assert_eq!(a.local_key_count(), 0);
}

#[distributed_lock("panic:{id}", timeout = 1)]
async fn panics(locks: LockProvider, id: u32) -> Result<(), AppError> {
    panic!("the body of {id} panicked");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_on_panic() {
    let (_dir, a, b) = two_providers().await;
    let outcome = tokio::spawn(panics(a.clone(), 3)).await;
    assert!(outcome.unwrap_err().is_panic());
    // The guard was dropped while unwinding: the release runs in the background, so wait
    // for the lock (rather than try once) from both providers.
    let guard = b.acquire("panic:3", Duration::from_secs(10)).await.unwrap();
    guard.release().await.unwrap();
    let guard = a.acquire("panic:3", Duration::from_secs(10)).await.unwrap();
    guard.release().await.unwrap();
}

#[distributed_lock("cancel:{id}", timeout = 1)]
async fn runs_until_cancelled(
    locks: &LockProvider,
    id: u32,
    entered: oneshot::Sender<()>,
) -> Result<(), AppError> {
    entered.send(()).unwrap();
    std::future::pending::<()>().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_on_cancellation() {
    let (_dir, a, b) = two_providers().await;
    let (entered_tx, entered) = oneshot::channel();
    let task = tokio::spawn({
        let a = a.clone();
        async move { runs_until_cancelled(&a, 4, entered_tx).await }
    });
    entered.await.unwrap();
    assert_held(&b, "cancel:4").await;
    task.abort();
    assert!(task.await.unwrap_err().is_cancelled());
    let guard = b
        .acquire("cancel:4", Duration::from_secs(10))
        .await
        .unwrap();
    guard.release().await.unwrap();

    // Dropping the future without a task around it does the same.
    let (entered_tx, entered) = oneshot::channel();
    let mut call = Box::pin(runs_until_cancelled(&a, 5, entered_tx));
    tokio::select! {
        _ = &mut call => unreachable!("the body never finishes"),
        _ = entered => {}
    }
    assert_held(&b, "cancel:5").await;
    drop(call);
    let guard = b
        .acquire("cancel:5", Duration::from_secs(10))
        .await
        .unwrap();
    guard.release().await.unwrap();
}

// The spelling of the issue, verbatim.
#[distributed_lock("account:<account_id>", timeout = 10)]
async fn debit(
    locks: &LockProvider,
    account_id: u64,
    amount: i64,
    entered: Option<oneshot::Sender<()>>,
    leave: Option<oneshot::Receiver<()>>,
) -> Result<i64, AppError> {
    if let Some(entered) = entered {
        entered.send(()).unwrap();
    }
    if let Some(leave) = leave {
        leave.await.unwrap();
    }
    Ok(100 - amount)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn angle_bracket_spelling_locks_the_named_parameter_and_waits() {
    let (_dir, a, b) = two_providers().await;
    let (entered_tx, entered) = oneshot::channel();
    let (leave, leave_rx) = oneshot::channel();
    let first = tokio::spawn({
        let a = a.clone();
        async move { debit(&a, 42, 30, Some(entered_tx), Some(leave_rx)).await }
    });
    entered.await.unwrap();
    assert_held(&b, "account:42").await;
    assert_free(&b, "account:<account_id>").await;
    assert_free(&b, "account:{account_id}").await;

    // A second caller waits (timeout = 10) instead of failing, and runs once the first is done.
    let second = tokio::spawn({
        let b = b.clone();
        async move { debit(&b, 42, 50, None, None).await }
    });
    tokio::time::timeout(Duration::from_secs(10), async {
        while b.local_key_count() == 0 {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the second caller is waiting");
    assert!(!second.is_finished());
    leave.send(()).unwrap();
    assert_eq!(first.await.unwrap().unwrap(), 70);
    assert_eq!(second.await.unwrap().unwrap(), 50);
}

struct Owner {
    name: String,
}

#[distributed_lock("account:<account_id>:{owner.name}", timeout = 0.25)]
struct DebitAccount {
    account_id: u64,
    owner: Owner,
    amount: i64,
}

#[tokio::test]
async fn struct_form_with_acquire_for() {
    let (_dir, a, b) = two_providers().await;
    let command = DebitAccount {
        account_id: 42,
        owner: Owner {
            name: "ann:{x}".to_owned(),
        },
        amount: 5,
    };
    assert_eq!(command.lock_key(), "account:42:ann%3A%7Bx%7D");
    assert_eq!(command.lock_timeout(), Duration::from_millis(250));
    assert_eq!(command.amount, 5);

    let guard = a.acquire_for(&command).await.unwrap();
    assert_eq!(guard.key(), command.lock_key());
    let err = b.acquire_for(&command).await.unwrap_err();
    assert_eq!(err.code(), "DistributedLock.Timeout");
    guard.release().await.unwrap();
    b.acquire_for(&command)
        .await
        .unwrap()
        .release()
        .await
        .unwrap();
}

#[distributed_lock("pair:{a}:{b}")]
struct Pair {
    a: String,
    b: String,
}

#[distributed_lock("pair:{a}:{b}", guard = lock)]
async fn pair_key(locks: &LockProvider, a: &str, b: &str) -> Result<String, LockError> {
    Ok(lock.key().to_owned())
}

/// Short random strings over the characters that could confuse a key.
fn tricky_string(rng: &mut fastrand::Rng) -> String {
    const ALPHABET: &[&str] = &[
        "1", "2", "a", ":", "%", "3A", "%3A", "{", "}", "<", ">", "{{", "\n", "\0", "\u{7f}",
        "\u{85}", "é", "鍵", " ", "pair:",
    ];
    (0..rng.usize(0..4))
        .map(|_| ALPHABET[rng.usize(..ALPHABET.len())])
        .collect()
}

#[test]
fn keys_are_injective() {
    let key = |a: &str, b: &str| {
        Pair {
            a: a.to_owned(),
            b: b.to_owned(),
        }
        .lock_key()
    };
    assert_ne!(key("1:2", "3"), key("1", "2:3"));
    assert_eq!(key("1:2", "3"), "pair:1%3A2:3");

    let mut rng = fastrand::Rng::with_seed(0x5eed_d10c);
    let mut seen: HashMap<String, (String, String)> = HashMap::new();
    let mut naive: HashMap<String, (String, String)> = HashMap::new();
    let mut naive_collisions = 0;
    for _ in 0..50_000 {
        let (a, b) = (tricky_string(&mut rng), tricky_string(&mut rng));
        let k = key(&a, &b);
        assert!(
            !k.chars().skip("pair:".len()).any(char::is_control),
            "{k:?}"
        );
        if let Some(previous) = seen.insert(k.clone(), (a.clone(), b.clone())) {
            assert_eq!(previous, (a.clone(), b.clone()), "both give the key {k:?}");
        }
        // The same values without encoding do collide: the sample is hard enough.
        let plain = format!("pair:{a}:{b}");
        if let Some(previous) = naive.insert(plain, (a.clone(), b.clone())) {
            naive_collisions += usize::from(previous != (a, b));
        }
    }
    assert!(naive_collisions > 100, "only {naive_collisions} collisions");
}

#[tokio::test]
async fn functions_and_structs_build_the_same_keys() {
    let (_dir, a, _b) = two_providers().await;
    let mut rng = fastrand::Rng::with_seed(7);
    for _ in 0..50 {
        let (x, y) = (tricky_string(&mut rng), tricky_string(&mut rng));
        let from_fn = pair_key(&a, &x, &y).await.unwrap();
        let from_struct = Pair { a: x, b: y }.lock_key();
        assert_eq!(from_fn, from_struct);
    }
}

#[distributed_lock("fenced:{id}", timeout = 5, guard = lock)]
async fn fenced(locks: &LockProvider, id: u32) -> Result<(String, Option<u64>), AppError> {
    let held: &LockGuard = lock;
    assert!(!held.is_lost());
    assert!(!held.lost_token().is_cancelled());
    Ok((held.key().to_owned(), held.fencing_token()))
}

#[tokio::test]
async fn guard_binding_gives_key_and_fencing_token() {
    let (_dir, a, b) = two_providers().await;
    let (key, first) = fenced(&a, 9).await.unwrap();
    assert_eq!(key, "fenced:9");
    let (_, second) = fenced(&b, 9).await.unwrap();
    let (_, third) = fenced(&a, 9).await.unwrap();
    let (first, second, third) = (first.unwrap(), second.unwrap(), third.unwrap());
    assert!(first < second && second < third, "{first} {second} {third}");
}

#[distributed_lock("lost:{id}", timeout = 5, guard = lock)]
async fn outlives_its_lock(locks: &LockProvider, id: u32, db: &str) -> Result<u32, AppError> {
    // Another owner takes the row over behind the provider's back.
    let conn = rusqlite::Connection::open(db).unwrap();
    conn.busy_timeout(Duration::from_secs(5)).unwrap();
    let changed = conn
        .execute(
            "UPDATE __distributed_locks SET owner = x'00' WHERE name = ?1",
            [lock.key().as_bytes()],
        )
        .unwrap();
    assert_eq!(changed, 1);
    // The next lease renewal notices.
    lock.lost_token().cancelled().await;
    Ok(id)
}

#[tokio::test]
async fn a_lock_lost_during_the_body_is_the_functions_error() {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("locks.db");
    let url = format!("sqlite://{}?lease=300ms", db.display());
    let locks = LockProvider::connect(&url).await.unwrap();
    let outcome = tokio::time::timeout(
        Duration::from_secs(30),
        outlives_its_lock(&locks, 1, db.to_str().unwrap()),
    )
    .await
    .expect("the loss was not detected");
    assert_eq!(outcome.unwrap_err().code(), "DistributedLock.Lost");
}

struct Service {
    locks: LockProvider,
    name: String,
}

impl Service {
    #[distributed_lock("svc:{self.name}:{id}", provider = self.locks, timeout = 0)]
    async fn run(
        &self,
        id: u32,
        gate: Option<(oneshot::Sender<()>, oneshot::Receiver<()>)>,
    ) -> Result<u32, AppError> {
        if let Some((entered, leave)) = gate {
            entered.send(()).unwrap();
            leave.await.unwrap();
        }
        Ok(id)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn methods_lock_through_self() {
    let (_dir, a, b) = two_providers().await;
    let first = Arc::new(Service {
        locks: a,
        name: "mail".to_owned(),
    });
    let second = Service {
        locks: b.clone(),
        name: "mail".to_owned(),
    };
    let (entered_tx, entered) = oneshot::channel();
    let (open, gate) = oneshot::channel();
    let running = tokio::spawn({
        let first = Arc::clone(&first);
        async move { first.run(1, Some((entered_tx, gate))).await }
    });
    entered.await.unwrap();
    assert_held(&b, "svc:mail:1").await;
    let err = second.run(1, None).await.unwrap_err();
    assert_eq!(err.code(), "DistributedLock.AlreadyHeld");
    assert_eq!(second.run(2, None).await.unwrap(), 2);
    open.send(()).unwrap();
    assert_eq!(running.await.unwrap().unwrap(), 1);
    assert_eq!(second.run(1, None).await.unwrap(), 1);
}

// Stand-ins for axum's extractors, destructured in the parameter list as handlers do.
struct Path<T>(T);
struct State<T>(T);

#[derive(Clone)]
struct AppState {
    locks: LockProvider,
}

#[distributed_lock("account:{account_id}:{kind}", provider = state.locks, timeout = 0, guard = lock)]
async fn handler(
    State(state): State<AppState>,
    Path((account_id, kind)): Path<(u64, String)>,
) -> Result<String, AppError> {
    Ok(lock.key().to_owned())
}

#[distributed_lock("generic:{id}", timeout = 0, guard = lock)]
async fn generic<T: Display>(locks: &LockProvider, id: T) -> Result<String, AppError> {
    Ok(lock.key().to_owned())
}

#[tokio::test]
async fn handlers_with_extractors_and_generic_functions() {
    let (_dir, a, b) = two_providers().await;
    let state = AppState { locks: a };
    let key = handler(State(state.clone()), Path((5, "debit".to_owned())))
        .await
        .unwrap();
    assert_eq!(key, "account:5:debit");
    let held = b.try_acquire("account:5:debit").await.unwrap();
    let err = handler(State(state), Path((5, "debit".to_owned())))
        .await
        .unwrap_err();
    assert_eq!(err.code(), "DistributedLock.AlreadyHeld");
    held.release().await.unwrap();

    assert_eq!(generic(&b, 3.5).await.unwrap(), "generic:3.5");
    assert_eq!(generic(&b, "x>y").await.unwrap(), "generic:x%3Ey");
}
