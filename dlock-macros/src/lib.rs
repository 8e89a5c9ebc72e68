//! The `#[distributed_lock]` attribute of [dlock](https://docs.rs/dlock-rs) (the crate
//! `dlock-rs`, whose library is named `dlock`).
//!
//! Use it as `dlock::distributed_lock` (cargo feature `macros` of `dlock`, on by default)
//! rather than from this crate: the code it generates refers to `::dlock`.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

use proc_macro::TokenStream;

mod attr;
mod expand;

/// Takes a distributed lock around an `async fn`, or names the lock of a command struct.
///
/// ```text
/// #[distributed_lock("<key template>", timeout = <seconds> | "<duration>", provider = <expr>, guard = <name>,
///                   on_lost = cancel | finish, permits = <n>, mode = read | write)]
/// #[distributed_lock(keys("<template>", "<template>", ...), timeout = ..., provider = ...,
///                   guard = ..., on_lost = ...)]
/// ```
///
/// # On an `async fn`
///
/// The lock is taken before the body runs and released after it, whichever way the body ends.
///
/// ```
/// use dlock::{LockError, LockProvider, distributed_lock};
///
/// #[derive(Debug)]
/// enum AppError {
///     Lock(LockError),
///     Overdrawn,
/// }
///
/// impl From<LockError> for AppError {
///     fn from(err: LockError) -> Self {
///         AppError::Lock(err)
///     }
/// }
///
/// #[distributed_lock("account:{account_id}", timeout = 10)]
/// async fn debit(locks: &LockProvider, account_id: u64, amount: i64) -> Result<i64, AppError> {
///     // Only one caller at a time, in any process sharing the lock store, gets here
///     // for a given `account_id` (the key is "account:42" for account 42).
///     let balance = 100 - amount;
///     if balance < 0 {
///         return Err(AppError::Overdrawn); // the lock is released on every way out
///     }
///     Ok(balance)
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), AppError> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let url = format!("sqlite://{}/locks.db", dir.path().display());
/// let locks = LockProvider::connect(&url).await?;
/// assert_eq!(debit(&locks, 42, 30).await?, 70);
///
/// assert!(matches!(debit(&locks, 42, 130).await, Err(AppError::Overdrawn)));
///
/// // While "account:42" is held elsewhere, a call waits up to 10 s for it, then returns
/// // `LockError::Timeout` (as `AppError::Lock`) without running the body.
/// # Ok(()) }
/// ```
///
/// - **The function** must be `async` and return a `Result` (`Result<T, E>`, `io::Result<T>`,
///   `anyhow::Result<T>`, any alias whose name ends in `Result`) whose error type implements
///   `From<dlock::LockError>`: a lock that cannot be taken is returned as that error, and the
///   body does not run.
/// - **The provider** is the parameter whose type is `LockProvider` (spelled any way: `&LockProvider`,
///   `dlock::LockProvider`, `&&LockProvider`...). Without one, or to choose among several, name it
///   with `provider = <expr>`: any expression that borrows as a `&LockProvider`
///   (`provider = self.locks`, `provider = state.locks`, an `Arc<LockProvider>`).
/// - **Release.** After the body, the lock is released and the release is awaited, so it is
///   free again when the function returns, whether it returns `Ok`, `Err` through `?`, or
///   early through `return`. If the body panics or the returned future is dropped
///   (cancelled), the guard is dropped with it and the lock is released in the background.
/// - **A failed release** is reported when it matters: if the body returned `Ok` but the release
///   fails, most importantly with `LockError::Lost` (the lock was lost
///   while the body ran, so its work may have overlapped with another holder's), the function
///   returns that error, converted with `From<LockError>`, instead of the body's value. If the
///   body returned `Err`, that error is returned and a failed release is only logged.
/// - **`guard = <name>`** binds the held lock as `&dlock::LockGuard` for the body: its
///   `fencing_token()` for the resource the lock protects, its `lost_token()` to stop when the
///   lock is lost.
/// - **Not reentrant.** The body runs as the holder of its lock (`dlock::run_holding`): taking
///   the same key again inside it, by calling another `#[distributed_lock]` function on the
///   key or by hand, through the same provider or a clone, fails at once with
///   `LockError::Reentrant` ("already held by this request (locks are not reentrant)") rather
///   than wait out its timeout for itself. The same holds for an axum handler behind a
///   `dlock_axum::LockLayer` that holds the key. Take the lock in one place and pass what
///   needs it the guard (`guard = g`).
/// - **`on_lost = cancel`** stops the body as soon as the lock is lost (the body's future is
///   dropped at its next `.await`) and returns `LockError::Lost`, converted with
///   `From<LockError>`, at once. Without it (or with `on_lost = finish`, the default) the body
///   runs to its end and the function then returns `Lost` instead of the body's `Ok`.
/// - **A pause of the process** (stopped, suspended) past a leased lock's lease: either way,
///   the loss is checked before each poll of the body with `LockGuard::is_lost`, which reads
///   the clock, so the body's next step after the pause is not run (`on_lost = cancel`), or
///   finds `guard.is_lost()` true and the guard's lost token cancelled (`on_lost = finish`).
///   A task the body spawns with the token is not polled by the function: give it
///   `guard.lost_signal()`, whose `is_lost()` reads the clock too.
///
/// ```
/// use dlock::{LockError, LockProvider, distributed_lock};
///
/// #[derive(Debug)]
/// enum JobError {
///     Lock(LockError),
/// }
///
/// impl From<LockError> for JobError {
///     fn from(err: LockError) -> Self {
///         JobError::Lock(err)
///     }
/// }
///
/// // A long job that must not go on once another replica may have taken over: if the lock
/// // is lost, the loop is stopped at its next `.await` and `rebuild` returns
/// // `Err(JobError::Lock(LockError::Lost { .. }))`.
/// #[distributed_lock("index:{name}", on_lost = cancel, guard = lock)]
/// async fn rebuild(locks: &LockProvider, name: &str) -> Result<u64, JobError> {
///     let mut batches = 0;
///     while batches < 3 {
///         // ... index a batch, tagged with lock.fencing_token() ...
///         tokio::task::yield_now().await;
///         batches += 1;
///     }
///     Ok(batches)
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), JobError> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let url = format!("sqlite://{}/locks.db", dir.path().display());
/// let locks = LockProvider::connect(&url).await?;
/// assert_eq!(rebuild(&locks, "orders").await?, 3);
/// # Ok(()) }
/// ```
///
/// Methods, generic functions and functions with destructured parameters work; every name a
/// parameter's pattern binds can be a placeholder. On an axum handler, the key is made from the
/// value the extractor parsed: `/accounts/42`, `/accounts/042` and `/accounts/+42` all lock
/// `account:42` below. (A `dlock_axum::LockLayer::new(locks, "account:{account_id}")` template
/// on the same route would lock the path's text, `account:042` for the second; the layer's
/// `LockLayer::with_extractor(locks, |Path(id): Path<u64>| format!("account:{id}"))` locks the
/// macro's key for every spelling.)
///
/// ```
/// # use dlock::{LockError, LockProvider, distributed_lock};
/// # pub struct Path<T>(pub T);
/// # pub struct State<T>(pub T);
/// #[derive(Clone)]
/// struct AppState {
///     locks: LockProvider,
/// }
///
/// #[distributed_lock("account:{account_id}", provider = state.locks, timeout = 0.5, guard = lock)]
/// async fn debit(
///     State(state): State<AppState>,
///     Path(account_id): Path<u64>,
/// ) -> Result<String, LockError> {
///     Ok(format!("debited {account_id} under fencing token {:?}", lock.fencing_token()))
/// }
///
/// struct Ledger {
///     locks: LockProvider,
///     name: String,
/// }
///
/// impl Ledger {
///     #[distributed_lock("ledger:{self.name}:{day}", provider = self.locks, timeout = 10)]
///     async fn close_day(&self, day: u32) -> Result<(), LockError> {
///         Ok(())
///     }
/// }
/// ```
///
/// # Several keys: `keys(...)`
///
/// `keys("account:{from}", "account:{to}")` takes two or more keys **all or none**, through
/// `LockProvider::acquire_many` (one try each when the timeout is 0): in a canonical order, so
/// `transfer(a, b)` and `transfer(b, a)` running at once never wait on each other. A key that
/// is held elsewhere fails the call (`AlreadyHeld`, or `Timeout` naming the missing key) and
/// no key is kept. A key rendered twice (`transfer(a, a)`) is taken once. `guard = g` binds
/// `g: &[dlock::LockGuard]`, one guard per distinct key in the order of `keys(...)`. Every
/// lock is released after the body and the releases awaited; when the body returned `Ok`, a
/// failed release is the function's error, `Lost` first. `on_lost = cancel` stops the body
/// when any of the locks is lost.
///
/// ```
/// # use dlock::{LockError, LockProvider, distributed_lock};
/// #[distributed_lock(keys("account:{from}", "account:{to}"), timeout = 10, guard = held)]
/// async fn transfer(locks: &LockProvider, from: u64, to: u64, amount: i64) -> Result<usize, LockError> {
///     // Both accounts are locked here; `held[0]` is "account:{from}".
///     Ok(held.len())
/// }
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), LockError> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let locks = LockProvider::connect(&format!("sqlite://{}/l.db", dir.path().display())).await?;
/// assert_eq!(transfer(&locks, 1, 2, 5).await?, 2);
/// assert_eq!(transfer(&locks, 1, 1, 5).await?, 1);
/// # Ok(()) }
/// ```
///
/// # A semaphore: `permits = N`
///
/// `#[distributed_lock("exports:{tenant}", permits = 5, timeout = 10)]` lets up to 5 calls
/// run at once for one tenant: it takes one of the 5 permits of the semaphore through
/// `LockProvider::acquire_semaphore` (`try_acquire_semaphore` when the timeout is 0, so a
/// full semaphore answers `AlreadyHeld`); waiting calls are served in turn, across processes.
/// Semaphore keys are their own namespace: the lock `"exports:acme"` is unrelated.
/// `guard = g` binds the permit's `&LockGuard`, whose `key()` is the semaphore's key. Every
/// function that names one semaphore must give it the same `permits`: where the backend keeps
/// semaphores natively (SQLite, etcd) another count is refused with `LockError::Config` while
/// the semaphore is in use, and a backend that keeps them as slot locks takes at most 1,024
/// (more is a `LockError::Config` at run time). `permits` and `keys(...)` do not combine.
///
/// # A read lock: `mode = read`
///
/// `#[distributed_lock("prices:{region}", mode = read, timeout = 5)]` takes a read lock through
/// `LockProvider::acquire_read` (`try_acquire_read` when the timeout is 0): any number of
/// callers read at once, while a function with the default `mode = write` on the same key
/// excludes them all and is excluded by each. Backends without a shared lock mode answer
/// `LockError::Unsupported`. `mode = read` does not combine with `permits` or `keys(...)`.
///
/// ```
/// use dlock::{LockError, LockProvider, distributed_lock};
///
/// #[distributed_lock("prices:{region}", mode = read, timeout = 5)]
/// async fn quote(locks: &LockProvider, region: &str) -> Result<u64, LockError> {
///     Ok(42)
/// }
///
/// #[distributed_lock("prices:{region}", mode = write, timeout = 5)]
/// async fn reprice(locks: &LockProvider, region: &str) -> Result<(), LockError> {
///     Ok(())
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), LockError> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let url = format!("sqlite://{}/locks.db", dir.path().display());
/// # let locks = LockProvider::connect(&url).await?;
/// let held = locks.try_acquire_read("prices:eu").await?;
/// assert_eq!(quote(&locks, "eu").await?, 42); // readers share
/// held.release().await?;
/// reprice(&locks, "eu").await?;
/// # Ok(()) }
/// ```
///
/// # On a struct
///
/// The struct gets an implementation of `dlock::LockedCommand`: `lock_key(&self)` fills the
/// template from its fields and `lock_timeout(&self)` returns the timeout.
/// `LockProvider::acquire_for(&command)` takes the lock for it.
///
/// ```
/// use std::time::Duration;
/// use dlock::{LockProvider, LockedCommand, distributed_lock};
///
/// struct Owner {
///     name: String,
/// }
///
/// #[distributed_lock("account:<account_id>:{owner.name}", timeout = 0.25)]
/// struct DebitAccount {
///     account_id: u64,
///     owner: Owner,
///     amount: i64,
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), dlock::LockError> {
/// # let dir = tempfile::tempdir().unwrap();
/// # let url = format!("sqlite://{}/locks.db", dir.path().display());
/// # let locks = LockProvider::connect(&url).await?;
/// let command = DebitAccount { account_id: 42, owner: Owner { name: "ann".into() }, amount: 5 };
/// assert_eq!(command.lock_key(), "account:42:ann");
/// assert_eq!(command.lock_timeout(), Duration::from_millis(250));
///
/// let guard = locks.acquire_for(&command).await?;
/// assert_eq!(guard.key(), "account:42:ann");
/// guard.release().await?;
/// # Ok(()) }
/// ```
///
/// Tuple structs name their fields by position (`"job:{0}"`). `provider`, `guard`,
/// `on_lost`, `permits`, `mode` and `keys(...)` are options of functions only (`LockedCommand` names
/// one exclusive lock).
///
/// # The key template
///
/// - `{name}` and `<name>` are the same placeholder: the value of the parameter or field
///   `name`. `{a.b}` reaches into it (`{cmd.account_id}`, `{self.name}`, `{0}` on tuple
///   structs, `{cmd.r#type}` for a field named with a keyword). `{{` `}}` `<<` `>>` are
///   literal `{` `}` `<` `>`. The grammar is the one `dlock::key_template::KeyTemplate`
///   parses at run time (both use the `dlock-template` crate), so a template means the same
///   in the attribute and in the axum layer.
/// - Values are formatted with `Display`, and `:` `%` `{` `}` `<` `>` and control characters in
///   them are percent-encoded (`%3A`, uppercase hex of the UTF-8 bytes), as
///   `dlock::key_template::encode_component` does. So distinct values never give the same key:
///   `"transfer:{from}:{to}"` gives `transfer:1%3A2:3` for `("1:2", "3")` and
///   `transfer:1:2%3A3` for `("1", "2:3")`.
/// - For that to hold, the text between two placeholders must contain one of `:` `{` `}` `<`
///   `>` (a `:` by convention): `"{a}-{b}"` is rejected, since `("x-y", "z")` and `("x", "y-z")`
///   would both give `x-y-z`.
///
/// # Options
///
/// - `timeout = <seconds>` or `timeout = "<duration>"`: how long to wait for the lock, a
///   non-negative integer or decimal literal of seconds (`timeout = 10`, `timeout = 0.25`), or a
///   string in the duration grammar of URL options (`timeout = "10s"`, `"500ms"`, `"1m 30s"`;
///   see `dlock::parse_duration`). `timeout = 0` tries once: a held lock fails at
///   once with `LockError::AlreadyHeld`. **Without `timeout`, the lock is tried once**, so a
///   forgotten timeout fails fast rather than leaving callers waiting.
/// - `provider = <expr>`: the provider to lock with (functions only).
/// - `guard = <name>`: binds `&LockGuard` for the body (functions only).
/// - `on_lost = cancel` or `on_lost = finish` (the default): whether a lost lock stops the
///   body at once or lets it run to its end; either way the function returns `Lost`
///   (functions only).
/// - `permits = <n>`: a semaphore of `n` (1 to `u32::MAX`; 1,024 at most on a backend that
///   keeps semaphores as slot locks) holders instead of a lock (functions only, one key).
/// - `mode = read` or `mode = write` (the default): a read lock shared with other readers,
///   or an exclusive lock (functions only, one key, not with `permits`).
///
/// # Compile errors
///
/// Mistakes are reported at the mistake, and the item is kept as written so the rest of the
/// code still compiles: an unknown placeholder (listing the parameters or fields), a function
/// that is not `async`, a function without a provider, an unknown or repeated option, a bad
/// timeout, a return type that is not a `Result`, an error type without `From<LockError>`, a
/// malformed template; a template beside `keys(...)`, an empty or one-key `keys()`, a
/// template repeated in it, `permits` that is 0, not a whole number or combined with
/// `keys(...)`, an unknown `mode` or `mode = read` combined with `permits` or `keys(...)`,
/// and any of these on a struct.
#[proc_macro_attribute]
pub fn distributed_lock(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::distributed_lock(args.into(), item.into()).into()
}
