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
