//! Work that outlives its caller: a release started by a drop, the rest of an operation whose
//! future was dropped. It runs on a task of its own, on the first runtime that still takes
//! tasks.
//!
//! A Tokio runtime that is shutting down still answers [`Handle::try_current`], and its
//! `spawn` still returns a [`JoinHandle`](tokio::task::JoinHandle); it drops the future unrun
//! instead of running it. Shutdown drops every task of the runtime, so a guard held there is
//! dropped while its own runtime already refuses work: its release, spawned there, would never
//! run, and a lock whose connection lives on another runtime would stay held by a session
//! that nothing gives it back from. [`spawn_first`] sees the refusal (the task is finished
//! before `spawn` returns, with the work still in its slot) and offers the work to the next
//! runtime.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::runtime::Handle;

/// Spawns `work` on the first of `runtimes` that takes it. Returns `work` back when none does
/// (each refused it, or there were none), so the caller can end it another way.
pub(crate) fn spawn_first<F>(runtimes: impl IntoIterator<Item = Handle>, work: F) -> Result<(), F>
where
    F: Future<Output = ()> + Send + 'static,
{
    let slot = Arc::new(Mutex::new(Some(work)));
    for runtime in runtimes {
        let taken = Arc::clone(&slot);
        let task = runtime.spawn(async move {
            let work = taken.lock().unwrap_or_else(PoisonError::into_inner).take();
            if let Some(work) = work {
                work.await;
            }
        });
        // Refused: the task was cancelled inside `spawn`, before it could take the work. (A
        // task that finished this fast on a running runtime took the work first.)
        if !task.is_finished() {
            return Ok(());
        }
        if slot
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_none()
        {
            return Ok(());
        }
    }
    let left = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
    left.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Duration;

    use super::*;

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    }

    /// Work dropped inside a runtime's shutdown goes to the next runtime, and runs there.
    #[test]
    fn work_refused_by_a_runtime_shutting_down_runs_on_the_next() {
        let (dying, living) = (runtime(), runtime());
        let ran = Arc::new(AtomicBool::new(false));
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        struct OnDrop(Option<Box<dyn FnOnce() + Send>>);
        impl Drop for OnDrop {
            fn drop(&mut self) {
                if let Some(f) = self.0.take() {
                    f();
                }
            }
        }
        let fallback = living.handle().clone();
        let flag = Arc::clone(&ran);
        let refused_first = Arc::new(AtomicBool::new(false));
        let refused = Arc::clone(&refused_first);
        // A task that is dropped by the shutdown, and spawns work from its drop.
        let (parked_tx, parked_rx) = std::sync::mpsc::channel();
        dying.spawn(async move {
            let _on_drop = OnDrop(Some(Box::new(move || {
                // The dying runtime refuses this one.
                let probe = Handle::current().spawn(async {});
                refused.store(probe.is_finished(), Ordering::SeqCst);
                let work = async move {
                    flag.store(true, Ordering::SeqCst);
                    let _ = done_tx.send(());
                };
                assert!(spawn_first([Handle::current(), fallback], work).is_ok());
            })));
            let _ = parked_tx.send(());
            std::future::pending::<()>().await;
        });
        parked_rx.recv().unwrap();
        dying.shutdown_timeout(Duration::from_secs(2));
        done_rx
            .recv_timeout(Duration::from_secs(5))
            .expect("the work ran on the living runtime");
        assert!(ran.load(Ordering::SeqCst));
        assert!(
            refused_first.load(Ordering::SeqCst),
            "the shutting-down runtime refused work (else this test proves nothing)"
        );
        drop(living);
    }

    /// With no runtime that takes it, the work comes back unrun.
    #[test]
    fn work_no_runtime_takes_comes_back() {
        let dead = runtime();
        let handle = dead.handle().clone();
        dead.shutdown_timeout(Duration::from_secs(1));
        let back = spawn_first([handle], async {});
        assert!(back.is_err());
        assert!(spawn_first(std::iter::empty(), async {}).is_err());
    }

    /// A running runtime takes the work, whether or not it has run by the time `spawn`
    /// returns.
    #[test]
    fn a_running_runtime_takes_the_work() {
        let rt = runtime();
        for _ in 0..200 {
            let (tx, rx) = std::sync::mpsc::channel();
            let work = async move {
                let _ = tx.send(());
            };
            assert!(spawn_first([rt.handle().clone()], work).is_ok());
            rx.recv_timeout(Duration::from_secs(5)).unwrap();
        }
    }
}
