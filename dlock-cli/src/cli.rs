//! The command line: every subcommand, flag, help text and example, in one place. The `--help`
//! output and the man pages in `dlock-cli/man/` are both made from it (a test checks that the
//! committed man pages are current).

use std::time::Duration;

use clap::{Args, CommandFactory, Parser, Subcommand};

use crate::exit;

/// The exit statuses, as `--help` and the man pages list them (a macro, for `concat!`).
macro_rules! exit_statuses {
    () => {
        "\
Exit status:
  dlock run exits with CMD's status, or 128+N when CMD was ended by signal N (as shells do).
  Its own statuses:
    75   the lock is held elsewhere (or stayed held for the whole --timeout); CMD did not run
         (--conflict-exit-code N changes it)
    79   the lock was lost while CMD ran (CMD was sent SIGTERM, then SIGKILL after
         --kill-after), or its release found it lost: the work may have overlapped another
         holder's
    64   a usage error (a bad flag or value)
    69   the store could not be reached, or failed
    78   the store or this build cannot do what was asked (a bad URL, an unsupported option)
    126  CMD could not be run; 127 CMD was not found
  dlock ping exits 0 when the store answers, 1 otherwise. dlock release exits 0 when a lock
  was ended, 1 when none was held or the confirmation was declined, 78 when the store cannot
  end one lock (session stores), 64 when it was not confirmed."
    };
}

/// The examples of `--help` and the man pages.
macro_rules! examples {
    () => {
        "\
Examples:
  # Run the nightly report on one host of many; the others skip it (exit 75):
  DLOCK_URL=redis://locks.internal:6379 dlock run --key reports:nightly -- ./nightly-report.sh

  # From cron, on every host: one of them runs it, the others exit quietly with status 0:
  */5 * * * * DLOCK_URL=postgres://app@db/app dlock run --key jobs:sync --conflict-exit-code 0 -- /opt/app/sync

  # Wait up to two minutes for the lock, with a 30 s lease renewed while the job runs:
  dlock run --url sqlite:///var/lib/app/locks.db --key migrate --timeout 2m --lease 30s -- make migrate

  # At most three exports at once across the fleet:
  dlock run --key exports --permits 3 --timeout 10m -- ./export.sh

  # Who holds what, as JSON lines:
  dlock ls --prefix jobs: --json

  # Clear a lock left by a stuck deployment (its holder finds it lost at its next renewal):
  dlock release --force jobs:sync --yes

  # Check the store from a health probe:
  dlock ping"
    };
}

/// Run a command under a distributed lock, list the locks in a store, check a store.
///
/// The store is named by a URL, from --url or the DLOCK_URL environment variable, as
/// dlock::LockProvider::connect takes it: sqlite://, postgres://, mysql://, mariadb://,
/// mssql://, oracle://, redis://, rediss://, redis+sentinel://, redis+cluster://, redlock://,
/// etcd://. Durations are written like 30s, 500ms, 2m, 1h 30m, or a bare number of seconds.
#[derive(Debug, Parser)]
#[command(
    name = "dlock",
    version,
    propagate_version = true,
    after_help = examples!(),
    after_long_help = concat!(examples!(), "\n\n", exit_statuses!()),
)]
pub struct Cli {
    /// The lock store's URL (it may carry a password: messages never show it).
    #[arg(
        long,
        env = "DLOCK_URL",
        hide_env_values = true,
        global = true,
        value_name = "URL"
    )]
    pub url: Option<String>,

    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run CMD while holding a lock; exit with CMD's status, or 75 when the lock is held
    /// elsewhere.
    ///
    /// Takes the lock KEY (one try, or waiting up to --timeout), runs CMD with DLOCK_KEY and,
    /// where the store issues one, DLOCK_FENCING_TOKEN in its environment, and releases the
    /// lock when CMD exits. On a lease store (SQLite, Redis, etcd) the lease is renewed while
    /// CMD runs.
    ///
    /// If the lock is lost while CMD runs (its lease could not be renewed, its connection
    /// died, someone ended it with `dlock release --force`), CMD is sent SIGTERM, then SIGKILL
    /// after --kill-after, and dlock exits 79. SIGINT, SIGTERM, SIGHUP and SIGQUIT sent to
    /// dlock are passed on to CMD (a signal a terminal sent to the whole foreground process
    /// group reached CMD already, and is not sent twice); the lock is released once CMD has
    /// ended. Signals go to CMD's own process: a shell script should `exec` its last command
    /// or pass them on to its children. If dlock itself is killed with SIGKILL it cannot stop
    /// CMD: the lock then ends with its lease or its session while CMD may still run.
    ///
    /// Progress goes to stderr only when stderr is a terminal (a waiting run says what it
    /// waits for; a run that finds the lock held says so), so that cron sends no mail for a
    /// run skipped because another host has the lock.
    #[command(after_long_help = exit_statuses!())]
    Run(RunArgs),

    /// List the locks held in the store, by any process.
    ///
    /// Columns: the key, its owner (the holder's owner label, where the store keeps one),
    /// since when it is held (where the store records it: SQLite), how long its lease still runs, its
    /// latest fencing token, and how many readers share it (0: an exclusive lock). Where a
    /// store keeps only a number for a lock (PostgreSQL's advisory lock id), the key column
    /// shows that number. Stores that cannot list their locks (SQL Server, Oracle, Redlock,
    /// MySQL/MariaDB without read access to performance_schema) answer with an error.
    ///
    /// With --semaphore KEY --permits N, how many of the N permits of the semaphore KEY are
    /// held now, on every store.
    Ls(LsArgs),

    /// End a lock in the store, whoever holds it (needs --force).
    ///
    /// For a lock left by a stuck or dead process. On a lease store (SQLite, Redis, etcd) the
    /// lock is deleted; its holder is not told at once, but finds the lock lost at its next
    /// renewal (a third of its lease later; at once on etcd), and a holder run by `dlock run`
    /// then ends its command and exits 79. Fencing tokens stay increasing: the next holder's
    /// is greater. Session stores (PostgreSQL, MySQL, SQL Server, Oracle) refuse: a lock there
    /// ends only with the session that holds it, and ending the session ends every other lock
    /// it holds; the message says how to find that session.
    ///
    /// Asks for confirmation on a terminal unless --yes is given; refuses (exit 64) when it
    /// cannot ask and --yes is not given.
    Release(ReleaseArgs),

    /// Check that the store answers: exit 0, or 1 with the reason.
    Ping,
}

/// `dlock run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// The lock's key.
    #[arg(long, value_name = "KEY")]
    pub key: String,

    /// Wait up to this long for the lock (default: one try, no waiting).
    #[arg(long, value_name = "DURATION", value_parser = duration("--timeout"))]
    pub timeout: Option<Duration>,

    /// The lease to ask for on a lease store (SQLite, Redis, etcd), renewed while CMD runs
    /// (default: the store's, 30 s unless its URL says otherwise). Session stores ignore it.
    #[arg(long, value_name = "DURATION", value_parser = duration("--lease"))]
    pub lease: Option<Duration>,

    /// Take a read lock, shared with other readers of KEY and excluding its exclusive holders.
    #[arg(long, conflicts_with = "permits")]
    pub read: bool,

    /// Take one of N permits of the semaphore KEY: at most N runs at once (a semaphore KEY
    /// and a lock KEY are unrelated).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..), conflicts_with = "lease")]
    pub permits: Option<u32>,

    /// The exit status when the lock is held elsewhere or stays held for the whole --timeout
    /// (75 is EX_TEMPFAIL; `flock -E` sets the same).
    #[arg(long, value_name = "N", default_value_t = exit::CONFLICT)]
    pub conflict_exit_code: u8,

    /// After the lock is lost and CMD was sent SIGTERM, how long to wait before SIGKILL.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = duration("--kill-after"))]
    pub kill_after: Duration,

    /// The command and its arguments.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "CMD"
    )]
    pub command: Vec<std::ffi::OsString>,
}

/// `dlock ls`.
#[derive(Debug, Args)]
pub struct LsArgs {
    /// Only the locks whose key starts with P.
    #[arg(long, value_name = "P")]
    pub prefix: Option<String>,

    /// One JSON object a line instead of a table: key, resource, owner, since (RFC 3339),
    /// lease_left_ms, fencing_token, readers (null where unknown). With --semaphore: semaphore,
    /// max_count, holders.
    #[arg(long)]
    pub json: bool,

    /// Instead of the locks, how many permits of the semaphore KEY are held now, by any
    /// process (waiters and expired leases are not counted). Needs --permits, the count its
    /// holders use: a store that records the count refuses another one.
    #[arg(
        long,
        value_name = "KEY",
        requires = "permits",
        conflicts_with = "prefix"
    )]
    pub semaphore: Option<String>,

    /// The semaphore's count (its max_count), with --semaphore.
    #[arg(long, value_name = "N", requires = "semaphore", value_parser = clap::value_parser!(u32).range(1..))]
    pub permits: Option<u32>,
}

/// `dlock release`.
#[derive(Debug, Args)]
pub struct ReleaseArgs {
    /// End the lock whoever holds it (required: dlock never ends another's lock otherwise).
    #[arg(long, required = true)]
    pub force: bool,

    /// Do not ask for confirmation.
    #[arg(long)]
    pub yes: bool,

    /// The lock's key.
    #[arg(value_name = "KEY")]
    pub key: String,
}

/// A parser of durations as dlock reads them in URLs (`dlock::parse_duration`).
fn duration(option: &'static str) -> impl Fn(&str) -> Result<Duration, String> + Clone {
    move |value| dlock::parse_duration(option, value).map_err(|err| err.to_string())
}

/// The command line's definition, for the man pages.
pub fn command() -> clap::Command {
    Cli::command()
}
