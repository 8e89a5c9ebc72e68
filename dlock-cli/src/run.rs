//! `dlock run`: a command under a lock.

use std::time::Duration;

use dlock::{LockError, LockGuard, LockProvider};
use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM};
use signal_hook::iterator::SignalsInfo;
use signal_hook::iterator::exfiltrator::WithOrigin;
use signal_hook::low_level::siginfo::Cause;
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::cli::RunArgs;
use crate::{Store, chatty, exit};

/// The signals passed on to CMD.
const FORWARDED: [i32; 4] = [SIGINT, SIGTERM, SIGHUP, SIGQUIT];

/// How long an acquisition waits before a waiting run says so (on a terminal).
const QUIET_WAIT: Duration = Duration::from_millis(200);

/// How often the lease's local deadline is looked at while CMD runs (the backend's renewal
/// task fires the lost token too; this catches a deadline passed while it was late).
const LOSS_CHECK: Duration = Duration::from_millis(250);

/// A signal sent to `dlock`.
#[derive(Debug, Clone, Copy)]
struct Received {
    signal: i32,
    /// Sent by the kernel, not by a process: a terminal's Ctrl-C, Ctrl-\ or hang-up, which
    /// went to the whole foreground process group, CMD included.
    by_terminal: bool,
}

/// The signals sent to this process, from a thread of their own (registered before the lock
/// is taken, so that no signal ends `dlock` with the lock held and CMD running).
fn watch_signals() -> std::io::Result<mpsc::UnboundedReceiver<Received>> {
    let mut signals = SignalsInfo::<WithOrigin>::new(FORWARDED)?;
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::Builder::new()
        .name("dlock-signals".to_owned())
        .spawn(move || {
            for origin in signals.forever() {
                let received = Received {
                    signal: origin.signal,
                    by_terminal: matches!(origin.cause, Cause::Kernel),
                };
                if tx.send(received).is_err() {
                    break;
                }
            }
        })?;
    Ok(rx)
}

pub(crate) async fn run(store: &Store, args: RunArgs) -> u8 {
    let mut signals = match watch_signals() {
        Ok(signals) => signals,
        Err(err) => {
            eprintln!("dlock: cannot watch signals: {err}");
            return exit::UNAVAILABLE;
        }
    };
    let locks = match store.connect().await {
        Ok(locks) => locks,
        Err(code) => return code,
    };
    let timeout = args.timeout.unwrap_or(Duration::ZERO);

    let guard = {
        let acquisition = acquire(&locks, &args, timeout);
        tokio::pin!(acquisition);
        let note = tokio::time::sleep(QUIET_WAIT);
        tokio::pin!(note);
        let mut noted = timeout.is_zero() || !chatty();
        loop {
            tokio::select! {
                outcome = &mut acquisition => break outcome,
                Some(received) = signals.recv() => {
                    // The wait ends (the acquisition is cancel safe: nothing is left held),
                    // as the signal would have ended dlock.
                    return 128 + u8::try_from(received.signal).unwrap_or(0);
                }
                () = &mut note, if !noted => {
                    noted = true;
                    eprintln!(
                        "dlock: waiting up to {} for {} `{}`, held elsewhere...",
                        humantime::format_duration(timeout),
                        what(&args),
                        args.key
                    );
                }
            }
        }
    };
    let guard = match guard {
        Ok(guard) => guard,
        Err(LockError::AlreadyHeld { .. }) => {
            if chatty() {
                eprintln!(
                    "dlock: {} `{}` is held elsewhere; not running the command",
                    what(&args),
                    args.key
                );
            }
            return args.conflict_exit_code;
        }
        Err(LockError::Timeout { .. }) => {
            if chatty() {
                eprintln!(
                    "dlock: {} `{}` stayed held elsewhere for {}; not running the command",
                    what(&args),
                    args.key,
                    humantime::format_duration(timeout)
                );
            }
            return args.conflict_exit_code;
        }
        Err(err) => return store.fail(&err),
    };
    supervise(store, &args, guard, &mut signals).await
}

/// What the run takes, for messages.
fn what(args: &RunArgs) -> &'static str {
    if args.read {
        "read lock"
    } else if args.permits.is_some() {
        "semaphore"
    } else {
        "lock"
    }
}

async fn acquire(
    locks: &LockProvider,
    args: &RunArgs,
    timeout: Duration,
) -> Result<LockGuard, LockError> {
    if let Some(permits) = args.permits {
        return locks.acquire_semaphore(&args.key, permits, timeout).await;
    }
    let mut lock = locks.lock(&args.key).timeout(timeout);
    if let Some(lease) = args.lease {
        lock = lock.lease(lease);
    }
    if args.read {
        lock = lock.read();
    }
    if timeout.is_zero() {
        lock.try_acquire().await
    } else {
        lock.acquire().await
    }
}

/// Runs CMD under `guard`, passes signals on to it, ends it when the lock is lost, and
/// releases the lock once it has ended. Returns the exit status.
async fn supervise(
    store: &Store,
    args: &RunArgs,
    guard: LockGuard,
    signals: &mut mpsc::UnboundedReceiver<Received>,
) -> u8 {
    let mut command = tokio::process::Command::new(&args.command[0]);
    command.args(&args.command[1..]).env("DLOCK_KEY", &args.key);
    match guard.fencing_token() {
        Some(token) => command.env("DLOCK_FENCING_TOKEN", token.to_string()),
        // Never a token left in the environment by an outer run.
        None => command.env_remove("DLOCK_FENCING_TOKEN"),
    };
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(err) => {
            let shown = args.command[0].to_string_lossy();
            eprintln!("dlock: cannot run `{shown}`: {err}");
            if let Err(err) = guard.release().await {
                store.say(format_args!("releasing `{}`: {err}", args.key));
            }
            return if err.kind() == std::io::ErrorKind::NotFound {
                exit::NOT_FOUND
            } else {
                exit::CANNOT_RUN
            };
        }
    };
    let pid = child
        .id()
        .and_then(|id| rustix::process::Pid::from_raw(i32::try_from(id).ok()?));
    let send = |signal: rustix::process::Signal| {
        if let Some(pid) = pid {
            // It may have exited already: nothing to do then.
            let _ = rustix::process::kill_process(pid, signal);
        }
    };

    let lost = guard.lost_token().clone();
    let mut lost_seen = false;
    let mut kill_at: Option<Instant> = None;
    let mut check = tokio::time::interval(LOSS_CHECK);
    let status = loop {
        tokio::select! {
            status = child.wait() => break status,
            Some(received) = signals.recv() => {
                if !received.by_terminal
                    && let Some(signal) = rustix::process::Signal::from_named_raw(received.signal)
                {
                    send(signal);
                }
            }
            () = lost.cancelled(), if !lost_seen => {
                lost_seen = true;
                eprintln!(
                    "dlock: the {} `{}` was lost while the command ran; sending it SIGTERM{}",
                    what(args),
                    args.key,
                    if args.kill_after.is_zero() {
                        String::new()
                    } else {
                        format!(", and SIGKILL in {}", humantime::format_duration(args.kill_after))
                    }
                );
                send(rustix::process::Signal::TERM);
                kill_at = Some(Instant::now() + args.kill_after);
            }
            _ = check.tick(), if !lost_seen => {
                // Fires the lost token when the lease's local deadline has passed.
                let _ = guard.is_lost();
            }
            () = sleep_until(kill_at), if kill_at.is_some() => {
                kill_at = None;
                eprintln!("dlock: the command outlived --kill-after; sending it SIGKILL");
                send(rustix::process::Signal::KILL);
            }
        }
    };
    let released = guard.release().await;
    let status = match status {
        Ok(status) => status,
        Err(err) => {
            eprintln!("dlock: waiting for the command failed: {err}");
            return exit::UNAVAILABLE;
        }
    };
    if lost_seen {
        return exit::LOST;
    }
    match released {
        Ok(()) => exit::of_status(status),
        Err(err @ LockError::Lost { .. }) => {
            store.say(format_args!(
                "{err}; the command's work may have overlapped another holder's"
            ));
            exit::LOST
        }
        Err(err) => {
            // The command ran under the lock; the store will end the lock with its lease or
            // session.
            store.say(format_args!("releasing `{}` failed: {err}", args.key));
            exit::of_status(status)
        }
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
