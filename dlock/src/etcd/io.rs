//! The thread that runs a backend's etcd I/O: the client's connections (when dlock opened
//! them), and every held lock's keep-alives and watch.
//!
//! It keeps the backend independent of the runtimes it is called from: a lock taken on a
//! runtime that later shuts down keeps its lease alive, and the client's connections (tonic
//! drives them from tasks of the runtime that made them) outlive every caller's runtime.

use std::future::Future;

use tokio::sync::oneshot;

use crate::LockError;

use super::NAME;

/// A current-thread runtime on a thread of its own, until this value is dropped.
pub(super) struct Io {
    handle: tokio::runtime::Handle,
    /// Dropping it ends the thread, and with it every task still on it.
    _stop: oneshot::Sender<()>,
}

impl Io {
    /// Starts the thread.
    pub(super) fn start() -> Result<Io, LockError> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|err| {
                LockError::unavailable(
                    NAME,
                    format!("could not start the etcd I/O runtime ({err})"),
                    Some(Box::new(err)),
                )
            })?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        std::thread::Builder::new()
            .name("dlock-etcd-io".to_owned())
            .spawn(move || {
                runtime.block_on(async move {
                    // Ends when the sender is dropped (it never sends).
                    let _ = stopped.await;
                });
                // Outside `block_on`: the tasks still there are dropped with the runtime.
                drop(runtime);
            })
            .map_err(|err| {
                LockError::unavailable(
                    NAME,
                    format!("could not start the etcd I/O thread ({err})"),
                    Some(Box::new(err)),
                )
            })?;
        Ok(Io {
            handle,
            _stop: stop,
        })
    }

    /// Runs `task` on the I/O thread, detached.
    pub(super) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        drop(self.handle.spawn(task));
    }

    /// Runs `task` on the I/O thread and waits for its output; `None` when the thread is gone.
    pub(super) async fn run<T: Send + 'static>(
        &self,
        task: impl Future<Output = T> + Send + 'static,
    ) -> Option<T> {
        self.handle.spawn(task).await.ok()
    }
}

impl std::fmt::Debug for Io {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Io").finish_non_exhaustive()
    }
}
