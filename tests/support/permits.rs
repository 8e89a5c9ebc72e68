//! Tries for permits straight at a backend's [`PermitStore`], for the engines' own tests, and
//! the contention check they share.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use dlock::LockError;
use dlock::backend::{Acquired, LockBackend, PermitRequest, PermitStore, PermitTry};

/// The backend's permit store (it must have one).
pub fn store(backend: &impl LockBackend) -> &dyn PermitStore {
    backend
        .semaphores()
        .expect("the backend keeps semaphores natively")
}

/// One single try: the permit, or `None` when the semaphore is full. Fails the test on an
/// error.
pub async fn try_permit(backend: &impl LockBackend, key: &str, n: u32) -> Option<Acquired> {
    answer(
        store(backend)
            .try_acquire_permit(PermitRequest::new(key, n))
            .await,
    )
}

/// One try of the waiter at the head of the queue (a waiting mark of 1 s).
pub async fn try_waiting(backend: &impl LockBackend, key: &str, n: u32) -> Option<Acquired> {
    let request = PermitRequest::new(key, n).with_waiting(Some(Duration::from_secs(1)));
    answer(store(backend).try_acquire_permit(request).await)
}

fn answer(tried: Result<PermitTry, LockError>) -> Option<Acquired> {
    match tried {
        Ok(PermitTry::Acquired(acquired)) => Some(acquired),
        Ok(PermitTry::Full { .. }) => None,
        Ok(other) => panic!("an answer this test does not know: {other:?}"),
        Err(err) => panic!("a permit try failed: {err}"),
    }
}

/// A single try that must be refused for another count: the error's message.
pub async fn refused(backend: &impl LockBackend, key: &str, n: u32) -> String {
    match store(backend)
        .try_acquire_permit(PermitRequest::new(key, n))
        .await
    {
        Err(LockError::Config { message }) => message,
        Ok(PermitTry::Acquired(acquired)) => {
            let _ = acquired.handle.release().await;
            panic!("a count of {n} was served while another is in use")
        }
        other => panic!("a count of {n} while another is in use: {other:?}"),
    }
}

/// Gives a permit back.
pub async fn release(acquired: Acquired) {
    acquired.handle.release().await.expect("release");
}

/// `tasks` tasks on each backend take permits of the semaphore `key` of `n` permits, hold
/// each for 1 to 4 ms and give it back, for `run`: never more than `n` inside at once, and `n`
/// inside at some moment. `check` runs every few milliseconds meanwhile with the number
/// inside at that moment, to compare with the server's own view. Returns the permits taken.
pub async fn contend<B, F, Fut>(
    backends: &[B],
    tasks: usize,
    key: &str,
    n: u32,
    run: Duration,
    check: F,
) -> usize
where
    B: LockBackend + Clone,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = usize>,
{
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let taken = Arc::new(AtomicUsize::new(0));
    let until = Instant::now() + run;
    let mut handles = Vec::new();
    for backend in backends {
        for _ in 0..tasks {
            let (backend, key) = (backend.clone(), key.to_owned());
            let (inside, most, taken) =
                (Arc::clone(&inside), Arc::clone(&most), Arc::clone(&taken));
            handles.push(tokio::spawn(async move {
                while Instant::now() < until {
                    let Some(permit) = try_permit(&backend, &key, n).await else {
                        tokio::time::sleep(Duration::from_micros(fastrand::u64(100..1000))).await;
                        continue;
                    };
                    let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    assert!(now <= n as usize, "{now} holders of a semaphore of {n}");
                    taken.fetch_add(1, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(fastrand::u64(1..5))).await;
                    inside.fetch_sub(1, Ordering::SeqCst);
                    release(permit).await;
                }
            }));
        }
    }
    while handles.iter().any(|h| !h.is_finished()) {
        let seen = check().await;
        assert!(
            seen <= n as usize,
            "the server shows {seen} permits of a semaphore of {n}"
        );
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    for handle in handles {
        handle.await.expect("a contending task failed");
    }
    assert_eq!(
        most.load(Ordering::SeqCst),
        n as usize,
        "the semaphore never had {n} holders at once"
    );
    taken.load(Ordering::SeqCst)
}

/// What [`hold_in_child`] prints once it holds its permit.
const HELD: &str = "holds its permit";

/// The variable that tells [`hold_in_child`] what to hold: the URL, the key and the count,
/// one a line.
pub const HOLDER_ENV: &str = "DLOCK_TEST_PERMIT_HOLDER";

/// A child process that holds a permit until it is killed: this test binary run again for
/// the one (ignored) test `test`, which calls [`hold_in_child`].
pub struct PermitHolder {
    child: std::process::Child,
}

impl PermitHolder {
    /// Starts the child and waits until it says it holds a permit of `key` of `n`.
    pub fn start(test: &str, url: &str, key: &str, n: u32) -> PermitHolder {
        use std::io::{BufRead, BufReader};
        use std::process::{Command, Stdio};
        let mut child = Command::new(std::env::current_exe().expect("the test binary"))
            .args([
                "--exact",
                test,
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(HOLDER_ENV, format!("{url}\n{key}\n{n}"))
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn the holder");
        let stdout = child.stdout.take().expect("the holder's stdout");
        let holder = PermitHolder { child };
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // libtest may have begun the line with the test's name.
                if line.ends_with(HELD) {
                    let _ = tx.send(());
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(60))
            .expect("the holder reports that it holds a permit within 60 s");
        holder
    }

    /// SIGKILL, and wait for the process to be gone.
    pub fn kill(mut self) {
        self.child.kill().expect("kill the holder");
        self.child.wait().expect("reap the holder");
    }
}

impl Drop for PermitHolder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The child's side of [`PermitHolder`]: takes a permit as [`HOLDER_ENV`] says (trying for up
/// to 30 s), says so on stdout, and sleeps until killed.
pub async fn hold_in_child<B, F, Fut>(connect: F)
where
    B: LockBackend,
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = B>,
{
    use std::io::Write;
    let spec = std::env::var(HOLDER_ENV)
        .expect("run by PermitHolder::start, which sets DLOCK_TEST_PERMIT_HOLDER");
    let mut parts = spec.lines();
    let (url, key, n) = (
        parts.next().expect("url").to_owned(),
        parts.next().expect("key").to_owned(),
        parts.next().expect("count").parse::<u32>().expect("count"),
    );
    let backend = connect(url).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let permit = loop {
        if let Some(permit) = try_permit(&backend, &key, n).await {
            break permit;
        }
        assert!(Instant::now() < deadline, "no permit within 30 s");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    println!("{HELD}");
    std::io::stdout().flush().expect("flush");
    std::future::pending::<()>().await;
    drop(permit);
}

/// The checks every session engine's store passes, for the engines whose server is named by
/// an environment variable (SQL Server, Oracle). `connect` opens a backend with the given
/// extra URL options (`a=b&c=d`, or empty).
pub mod checks {
    use super::*;

    /// One lane session (connections=1) shared by two clones of a backend holds `n` distinct
    /// slots, one per try, and the next try is full, for it and for another backend; a
    /// permit given back is taken by the other.
    pub async fn one_session_never_takes_a_slot_it_holds<B, F, Fut>(connect: F)
    where
        B: LockBackend + Clone,
        F: Fn(&'static str) -> Fut,
        Fut: std::future::Future<Output = B>,
    {
        let key = dlock_testkit::unique_key("sem-lane");
        let one = connect("connections=1").await;
        let clones = [one.clone(), one.clone()];
        let mut held = Vec::new();
        for i in 0..5 {
            held.push(
                try_permit(&clones[i % 2], &key, 5)
                    .await
                    .unwrap_or_else(|| panic!("permit {i} of 5 on one session")),
            );
        }
        assert!(try_permit(&one, &key, 5).await.is_none(), "a sixth permit");
        assert_eq!(store(&one).holders(&key, 5).await.expect("holders"), 5);
        let other = connect("connections=1").await;
        assert!(try_permit(&other, &key, 5).await.is_none());
        release(held.pop().expect("a permit")).await;
        let theirs = try_permit(&other, &key, 5).await.expect("a free slot");
        assert!(try_permit(&one, &key, 5).await.is_none());
        release(theirs).await;
        for permit in held {
            release(permit).await;
        }
        assert_eq!(store(&one).holders(&key, 5).await.expect("holders"), 0);
    }

    /// The count record: another count is refused, naming both, while permits are held, and
    /// taken once they have all been given back.
    pub async fn another_count_is_refused_while_permits_are_held<B, F, Fut>(connect: F)
    where
        B: LockBackend,
        F: Fn(&'static str) -> Fut,
        Fut: std::future::Future<Output = B>,
    {
        let key = dlock_testkit::unique_key("sem-count");
        let (a, b) = (connect("").await, connect("").await);
        assert!(store(&a).keeps_count_record());
        let first = try_permit(&a, &key, 2).await.expect("free");
        let second = try_permit(&b, &key, 2).await.expect("free");
        let message = refused(&b, &key, 5).await;
        assert!(
            message.contains("max_count 2") && message.contains("max_count 5"),
            "{message}"
        );
        assert!(store(&a).holders(&key, 5).await.is_err());
        release(first).await;
        refused(&a, &key, 5).await;
        release(second).await;
        let five = try_permit(&a, &key, 5).await.expect("the new count");
        let message = refused(&b, &key, 2).await;
        assert!(message.contains("max_count 5"), "{message}");
        release(five).await;
    }

    /// `max` is served; more is a configuration error naming the bound.
    pub async fn counts_past_the_bound_are_refused<B: LockBackend>(backend: &B, max: u32) {
        let key = dlock_testkit::unique_key("sem-bound");
        assert_eq!(store(backend).max_permits(), max);
        let permit = try_permit(backend, &key, max)
            .await
            .expect("the bound is served");
        release(permit).await;
        for n in [max + 1, u32::MAX, 0] {
            let err = store(backend)
                .try_acquire_permit(PermitRequest::new(&key, n))
                .await
                .expect_err("refused");
            assert_eq!(err.code(), "DistributedLock.Configuration", "{n}: {err}");
        }
    }

    /// While another backend holds the semaphore's queue lock, a single try is full and a
    /// waiting try is served.
    pub async fn single_tries_wait_behind_the_head_waiter<B: LockBackend>(tries: &B, waiter: &B) {
        let key = dlock_testkit::unique_key("sem-mark");
        let queue = PermitRequest::new(&key, 3).queue_key();
        let head = waiter
            .try_acquire(dlock::backend::LockRequest::new(&queue))
            .await
            .expect("try")
            .expect("the queue lock is free");
        assert!(
            try_permit(tries, &key, 3).await.is_none(),
            "a single try went ahead"
        );
        let served = try_waiting(waiter, &key, 3)
            .await
            .expect("the head waiter is served");
        head.handle.release().await.expect("release the queue lock");
        let single = try_permit(tries, &key, 3).await.expect("no waiter is left");
        release(served).await;
        release(single).await;
    }

    /// Tries cut off at every moment leave nothing held.
    pub async fn tries_cut_off_leave_nothing_held<B: LockBackend>(backend: &B, watcher: &B) {
        let key = dlock_testkit::unique_key("sem-cut");
        for round in 0..30 {
            let cut = Duration::from_micros(fastrand::u64(0..20_000));
            if let Ok(Some(permit)) = tokio::time::timeout(cut, try_permit(backend, &key, 1)).await
            {
                release(permit).await;
            }
            dlock_testkit::wait_until(
                &format!("round {round}: the cut-off try's permit is given back"),
                Duration::from_secs(10),
                async || store(watcher).holders(&key, 1).await.expect("holders") == 0,
            )
            .await;
        }
    }

    /// With fencing, tokens increase strictly per semaphore across holders and backends.
    pub async fn fencing_tokens_increase_per_semaphore<B: LockBackend>(a: &B, b: &B) {
        let key = dlock_testkit::unique_key("sem-fence");
        let mut last = 0;
        let mut held = Vec::new();
        for i in 0..8 {
            let backend = if i % 2 == 0 { a } else { b };
            let permit = try_permit(backend, &key, 3).await.expect("a permit");
            let token = permit.fencing_token.expect("fencing=true issues tokens");
            assert!(token > last, "token {token} after {last}");
            last = token;
            held.push(permit);
            if held.len() == 3 {
                release(held.remove(fastrand::usize(..3))).await;
            }
        }
        for permit in held {
            release(permit).await;
        }
    }
}
