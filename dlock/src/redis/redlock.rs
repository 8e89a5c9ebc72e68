//! Redlock: one lock on a majority of independent Redis or Valkey nodes (see [`RedlockBackend`]).

use std::fmt;
use std::future::poll_fn;
use std::sync::Arc;
use std::task::Poll;
use std::time::{Duration, Instant};

use tokio::sync::OnceCell;
use tokio_util::sync::CancellationToken;

use super::commands::Script;
use super::hosts::HostListUrl;
use super::quorums::{Followed, Quorums, held_until};
use super::{RedisBackend, check_lease};
use crate::LockError;
use crate::backend::{
    Acquired, BoxFuture, HeldLock, LeaseControl, LeaseDeadline, LockBackend, LockRequest,
    ReleaseOutcome, ReleaseWatch, WaitTry,
};
use crate::settling::{SETTLE_LIMIT, Settling};

pub(super) const NAME: &str = "redlock";

/// Raises a fencing counter to at least `ARGV[1]`: `KEYS[1]` the counter.
const RAISE_LUA: &str = "\
local c = tonumber(redis.call('GET', KEYS[1]) or '0')
local t = tonumber(ARGV[1])
if c < t then redis.call('SET', KEYS[1], ARGV[1]) end
return 1";

/// Refuses `fencing_counters` on redlock nodes: the lock's token is raised on every granted
/// node's own counter of the key, which shared counters do not have.
fn refuse_shared_counters(set: bool) -> Result<(), LockError> {
    if set {
        return Err(LockError::config(
            "redlock: the option `fencing_counters` is not available on redlock nodes (the \
             lock's token is raised on each node's own counter of the key); use per-key \
             counters, the default",
        ));
    }
    Ok(())
}

/// Redlock: one lock on a majority of independent Redis or Valkey nodes.
///
/// A lock is held when it was taken, under one owner token per node, on a **quorum** (more
/// than half) of N independent servers, within a time short enough that the leases still run
/// long after it. Each node's lock is an ordinary lock of the [single-node backend](super::RedisBackend)
/// (same keys, scripts, renewal and lost detection), so a node is any Redis 7+, Redis 8.4+ or
/// Valkey server, and a lock taken through `redlock://a,b,c` is the same Redis key on each of
/// them as one taken through `redis://a` with the same options.
///
/// | step | what happens |
/// |---|---|
/// | acquire | the lock is asked of every node at once, each with a timeout of a fifth of the lease (at least 50 ms; each command is also bounded by the `timeout` option). It counts when a quorum granted it and the lease left, **validity = lease − elapsed − drift** (drift: 1 % of the lease + 2 ms, for clocks that run at different rates), is at least half the lease; otherwise what was granted is given back at once, and the attempt answers "held" (or [`LockError::Unavailable`] when too few nodes answered at all). |
/// | wait | a waiter subscribes to the key's release channel on every connected node (see *Waiting* in [`crate::redis`]) and tries again when any node announces a release, or when enough holders' leases run out for a quorum to be free; while no node's subscription is live, it polls with backoff and jitter. |
/// | fencing | each granted node `INCR`s the key's counter as the single-node backend does; the lock's token is the **largest** of them, and before the lock counts every granted node's counter is raised to it (a compare-and-set script), on a quorum at least. Any two quorums share a node, whose counter only grows, so the next holder's token is larger. |
/// | hold | every node renews its own lease; the lock is lost when fewer than a quorum of node locks are still held, or when the quorum's local deadline (the quorum-th latest node deadline, less the drift) passes without renewals moving it. |
/// | release | every node is released at once; a release that a quorum confirmed succeeds. |
///
/// # URL
///
/// `redlock://[user[:password]@]host:port,host:port,host:port[/db][?options]`: the nodes,
/// with one set of credentials, database and options for all of them. The options are those of
/// `redis://` (`lease`, `prefix`, `key_layout`, `fencing`, `timeout`, `renew_every`,
/// `protocol`). Use an odd number of nodes, three or five: the quorum of N is N / 2 + 1, so
/// three nodes survive the loss of one, five the loss of two. Nodes that cannot be reached when
/// the backend is made are connected later, at first use, as long as a quorum answered.
/// [`RedlockBackend::from_nodes`] takes backends the application built itself.
///
/// `rediss+redlock://...` reaches every node over TLS, as `rediss://` does one node: the
/// option `ca` (a PEM file) names the CA that signed the nodes' certificates (the system's
/// roots without it), and a certificate that fails verification is a
/// [`LockError::Config`] saying which check failed.
///
/// # Where the guarantee ends
///
/// Redlock trades consensus for speed, and its safety rests on timing:
///
/// - **Process pauses.** A holder paused (a stopped process, a long collection, a suspended
///   VM) past its validity may resume believing it holds the lock while another holder has it.
///   The local deadline makes [`LockGuard::is_lost`](crate::LockGuard::is_lost) say so as soon
///   as it runs again, but a write already on its way cannot be recalled.
/// - **Clocks.** Leases expire on each server's clock. A server whose clock jumps forward
///   (an operator, a bad NTP step) expires a lease early, which can let a second holder in.
///   Redis measures key expiry with its monotonic clock since 7.0, which removes wall-clock
///   steps but not a server that is restarted.
/// - **Restarts without persistence.** A node that restarts with an empty data set forgets
///   the locks and counters it held: a second holder may then reach a quorum, and tokens may
///   go back. Run the nodes with `appendfsync always`, or keep a restarted node out for at
///   least one lease (Redlock's "delayed restart").
/// - **Asynchronous replicas.** Each node must be a single independent server, not a replica
///   set with failover: a failover loses writes.
///
/// This is why fencing tokens remain the defence: the store the lock protects refuses a
/// token lower than one it has seen, so a holder that lost its lock without knowing it cannot
/// undo a later holder's work. When exclusion must survive the loss of any one machine with
/// no timing assumptions, use a consensus store (etcd).
///
/// # Semaphores
///
/// Redlock keeps no native semaphores ([`LockBackend::semaphores`] is `None`): a semaphore of
/// `max_count` permits is `max_count` slots, each an ordinary Redlock lock (see
/// [`MAX_SLOT_PERMITS`](crate::backend::MAX_SLOT_PERMITS) for the limit and the cost), so it
/// admits at most `max_count` holders under the same assumptions as one Redlock lock admits
/// one. The count is not recorded, and a try walks the slots.
///
/// The single-node backend's permit sets (see [Semaphores](super#semaphores)) cannot be
/// carried over node by node: a permit counted on a quorum of nodes does not bound the
/// holders. Each node admits `max_count` permits, and a holder needs `Q` of the `N` nodes, so
/// up to `N × max_count / Q` holders fit: with 3 nodes (quorum 2) and `max_count` 3, four
/// holders, each counted on two nodes (eight of the nine places). A bound of `max_count`
/// would need every node for every permit (no node may be down: less available than one
/// lock), or per-node counts of `max_count × Q / N` rounded down, which admits nobody at small
/// counts (`max_count` 1 on 3 nodes: 0 per node).
///
/// Made through [`LockProvider::connect`](crate::LockProvider::connect) with a `redlock://`
/// URL, or with [`RedlockBackend::from_nodes`].
#[derive(Clone)]
pub struct RedlockBackend {
    shared: Arc<Shared>,
}

struct Shared {
    nodes: Vec<Node>,
    quorum: usize,
    lease: Duration,
    fencing: bool,
    raise: Script,
    /// Node locks of abandoned acquisitions being given back, per lock name: the name's next
    /// acquisition waits for them.
    settling: Arc<Settling<Arc<str>>>,
    /// The held locks, followed by one task.
    quorums: Arc<Quorums>,
}

/// One node: connected, or to be connected at first use.
struct Node {
    /// The node's `redis://` URL (may hold a password: never shown).
    url: Option<String>,
    backend: OnceCell<RedisBackend>,
}

impl Node {
    /// The node's backend, connected at first use. The connection's future is boxed: it is
    /// needed once, and held inline it made every node try of every acquisition 5 KB larger.
    async fn get(&self) -> Result<&RedisBackend, LockError> {
        if let Some(backend) = self.backend.get() {
            return Ok(backend);
        }
        Box::pin(self.connect()).await
    }

    async fn connect(&self) -> Result<&RedisBackend, LockError> {
        self.backend
            .get_or_try_init(|| async {
                match &self.url {
                    Some(url) => RedisBackend::connect(url).await,
                    None => Err(LockError::unavailable(NAME, "node not connected", None)),
                }
            })
            .await
    }
}

impl fmt::Debug for RedlockBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockBackend")
            .field("nodes", &self.shared.nodes.len())
            .field(
                "connected",
                &self
                    .shared
                    .nodes
                    .iter()
                    .filter(|n| n.backend.initialized())
                    .count(),
            )
            .field("quorum", &self.shared.quorum)
            .field("lease", &self.shared.lease)
            .field("fencing", &self.shared.fencing)
            .finish()
    }
}

impl RedlockBackend {
    /// Connects to the nodes named by a `redlock://` or `rediss+redlock://` URL (see
    /// [URL](RedlockBackend#url)).
    /// Fails when fewer than a quorum of nodes could be reached; the others are connected at
    /// first use.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future closes the connections it was opening.
    pub async fn connect(url: &str) -> Result<RedlockBackend, LockError> {
        let urls = node_urls(url)?;
        // Checks every node's options before connecting anywhere.
        for url in &urls {
            let checked = RedisBackend::builder_from_url(url)?;
            refuse_shared_counters(checked.fencing_counters.is_some())?;
        }
        let nodes: Vec<Node> = urls
            .into_iter()
            .map(|url| Node {
                url: Some(url),
                backend: OnceCell::new(),
            })
            .collect();
        let outcomes: Vec<Result<&RedisBackend, LockError>> = join(
            nodes
                .iter()
                .map(|node| Box::pin(node.get()) as BoxFuture<'_, _>),
        )
        .await;
        let connected = outcomes.iter().filter(|outcome| outcome.is_ok()).count();
        let quorum = nodes.len() / 2 + 1;
        if connected < quorum {
            let mut failures: Vec<LockError> =
                outcomes.into_iter().filter_map(Result::err).collect();
            // A configuration every failed node refused (a certificate of the wrong CA, a
            // wrong password) is said as such, not as nodes out of reach.
            let refused = failures
                .iter()
                .all(|err| matches!(err, LockError::Config { .. }));
            if refused && !failures.is_empty() {
                return Err(failures.swap_remove(0));
            }
            // Each node's own failure, which names its address.
            let why = if failures.is_empty() {
                String::new()
            } else {
                let each: Vec<String> = failures
                    .iter()
                    .map(|err| match err {
                        LockError::Unavailable { message, .. }
                        | LockError::Backend { message, .. }
                        | LockError::Config { message } => message.clone(),
                        other => other.to_string(),
                    })
                    .collect();
                format!(" ({})", each.join("; "))
            };
            return Err(LockError::unavailable(
                NAME,
                format!(
                    "only {connected} of the {} nodes could be reached, fewer than the quorum of \
                     {quorum}{why}",
                    nodes.len()
                ),
                None,
            ));
        }
        let first = nodes
            .iter()
            .find_map(|node| node.backend.get())
            .ok_or_else(|| LockError::unavailable(NAME, "no node could be reached", None))?;
        let (lease, fencing) = (first.lease(), first.fencing());
        Ok(RedlockBackend::with_nodes(nodes, lease, fencing))
    }

    /// A backend on nodes the application connected itself (one [`RedisBackend`] per
    /// independent server; its options, notably the prefix and the key layout, must be the
    /// same on every node). The lease and fencing are the first node's.
    pub fn from_nodes(nodes: Vec<RedisBackend>) -> Result<RedlockBackend, LockError> {
        let Some(first) = nodes.first() else {
            return Err(LockError::config(
                "a redlock backend needs at least one node",
            ));
        };
        let (lease, fencing) = (first.lease(), first.fencing());
        refuse_shared_counters(nodes.iter().any(|n| n.fencing_counters().is_some()))?;
        if nodes.iter().any(|n| n.fencing() != fencing) {
            return Err(LockError::config(
                "the redlock nodes disagree on fencing: turn it on (or off) on every node",
            ));
        }
        let nodes = nodes
            .into_iter()
            .map(|backend| Node {
                url: None,
                backend: OnceCell::new_with(Some(backend)),
            })
            .collect();
        Ok(RedlockBackend::with_nodes(nodes, lease, fencing))
    }

    fn with_nodes(nodes: Vec<Node>, lease: Duration, fencing: bool) -> RedlockBackend {
        let quorum = nodes.len() / 2 + 1;
        RedlockBackend {
            shared: Arc::new(Shared {
                nodes,
                quorum,
                lease,
                fencing,
                raise: Script::new(RAISE_LUA, &["get", "set"]),
                settling: Arc::default(),
                quorums: Arc::default(),
            }),
        }
    }

    /// How many nodes must grant a lock: more than half of them.
    pub fn quorum(&self) -> usize {
        self.shared.quorum
    }

    /// How many nodes there are.
    pub fn nodes(&self) -> usize {
        self.shared.nodes.len()
    }
}

/// The allowance for clocks that run at different rates: 1 % of the lease, plus 2 ms.
pub(super) fn drift(lease: Duration) -> Duration {
    lease / 100 + Duration::from_millis(2)
}

/// How long one node may take to answer an acquisition: a fifth of the lease, at least 50 ms.
fn node_wait(lease: Duration) -> Duration {
    (lease / 5).max(Duration::from_millis(50))
}

/// How a `redlock://` URL is written.
const URL: HostListUrl = HostListUrl {
    scheme: "redlock",
    tls_scheme: "rediss+redlock",
    leads_to: "Redlock",
    noun: "node",
    default_port: 6379,
    example: "redlock://[user:password@]host:6379,host:6379,host:6379[/db][?lease=30s]",
};

/// Splits a `redlock://` URL into one `redis://` URL per node (`rediss+redlock://`: one
/// `rediss://` URL per node), each with the URL's credentials, database and options.
fn node_urls(url: &str) -> Result<Vec<String>, LockError> {
    let split = URL.split(url)?;
    // Checks the credentials and the host list; the nodes' URLs repeat them as written.
    let hosts = URL.hosts(&split)?;
    Ok(hosts
        .nodes
        .iter()
        .map(|(host, port)| {
            let mut node = String::from(if split.tls { "rediss://" } else { "redis://" });
            if let Some(userinfo) = split.userinfo() {
                node.push_str(userinfo);
                node.push('@');
            }
            if host.contains(':') {
                node.push_str(&format!("[{host}]:{port}"));
            } else {
                node.push_str(&format!("{host}:{port}"));
            }
            if !split.path.is_empty() || !split.query.is_empty() {
                node.push('/');
                node.push_str(split.path);
            }
            if !split.query.is_empty() {
                node.push('?');
                node.push_str(split.query);
            }
            node
        })
        .collect())
}

/// Runs `futures` at once and gives their outputs in order.
async fn join<'a, T>(futures: impl IntoIterator<Item = BoxFuture<'a, T>>) -> Vec<T> {
    join_within(None, futures)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// Runs `futures` at once, for at most `limit` when given, and gives their outputs in order:
/// `None` for those still running at the limit, which are dropped. One timer for all of
/// them: they start together, so it is the timer each would have had.
async fn join_within<'a, T>(
    limit: Option<Duration>,
    futures: impl IntoIterator<Item = BoxFuture<'a, T>>,
) -> Vec<Option<T>> {
    let mut pending: Vec<Option<BoxFuture<'a, T>>> = futures.into_iter().map(Some).collect();
    let mut done: Vec<Option<T>> = pending.iter().map(|_| None).collect();
    let mut timer = std::pin::pin!(limit.map(tokio::time::sleep));
    poll_fn(|cx| {
        let mut waiting = false;
        for (slot, out) in pending.iter_mut().zip(done.iter_mut()) {
            if let Some(future) = slot {
                match future.as_mut().poll(cx) {
                    Poll::Ready(value) => {
                        *out = Some(value);
                        *slot = None;
                    }
                    Poll::Pending => waiting = true,
                }
            }
        }
        // Polled only while some future still runs: its waker then wakes this join.
        let out_of_time = waiting
            && timer
                .as_mut()
                .as_pin_mut()
                .is_some_and(|timer| timer.poll(cx).is_ready());
        if waiting && !out_of_time {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    drop(pending);
    done
}

/// Why a node gave no answer to an acquisition.
enum Failure {
    /// It did not answer in time.
    Slow,
    /// It answered with an error, or could not be reached.
    Failed(LockError),
}

/// A node lock taken during an acquisition: given back in the background if dropped before
/// the acquisition hands it over (the acquisition was dropped, or failed to reach a quorum).
struct Taken<'a> {
    node: usize,
    acquired: Option<Acquired>,
    /// The lock's name, and where its release in the background is registered.
    key: &'a str,
    settling: &'a Arc<Settling<Arc<str>>>,
}

impl Taken<'_> {
    fn into_inner(mut self) -> Option<Acquired> {
        self.acquired.take()
    }
}

impl Drop for Taken<'_> {
    fn drop(&mut self) {
        if let Some(acquired) = self.acquired.take() {
            let release = acquired.handle.release();
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => {
                    let settle = self.settling.begin(Arc::from(self.key));
                    runtime.spawn(async move {
                        let _ = release.await;
                        drop(settle);
                    });
                }
                // Without a runtime the node lock's lease frees it.
                Err(_) => drop(release),
            }
        }
    }
}

/// The answer when fewer nodes than the quorum answered: `answered` says how many, and the
/// first failure is quoted.
fn short_of_quorum(
    shared: &Shared,
    answered: String,
    first: Option<impl std::fmt::Display>,
) -> LockError {
    let first = first
        .map(|e| format!(" (first failure: {e})"))
        .unwrap_or_default();
    let quorum = shared.quorum;
    let message = format!("{answered}, fewer than the quorum of {quorum}{first}");
    LockError::unavailable(NAME, message, None)
}

impl RedlockBackend {
    /// Ends the lock of `key` on every node at once (see `force.rs`).
    pub(super) async fn force_release_nodes(&self, key: &str) -> Result<bool, LockError> {
        use crate::backend::ForceRelease as _;
        let shared = &*self.shared;
        let answers: Vec<Result<bool, LockError>> = join(shared.nodes.iter().map(|node| {
            Box::pin(async move { node.get().await?.force_release(key).await }) as BoxFuture<'_, _>
        }))
        .await;
        if answers.iter().any(|answer| matches!(answer, Ok(true))) {
            return Ok(true);
        }
        match answers.into_iter().find_map(Result::err) {
            Some(err) => Err(err),
            None => Ok(false),
        }
    }
}

impl LockBackend for RedlockBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn force_releases(&self) -> Result<&dyn crate::backend::ForceRelease, LockError> {
        Ok(self)
    }

    /// Every node is read at once (one pipeline each); a lock counts as held when a quorum of
    /// nodes hold it, as a Redlock lock is. An error when fewer than a quorum answered.
    fn held_keys<'a>(&'a self, keys: &'a [String]) -> BoxFuture<'a, Result<Vec<bool>, LockError>> {
        Box::pin(async move {
            let shared = &*self.shared;
            let answers: Vec<Result<Vec<bool>, LockError>> =
                join(shared.nodes.iter().map(|node| {
                    Box::pin(async move { node.get().await?.held_keys(keys).await })
                        as BoxFuture<'_, _>
                }))
                .await;
            let up = answers.iter().filter(|a| a.is_ok()).count();
            if up < shared.quorum {
                let first = answers.into_iter().find_map(Result::err);
                let answered = format!("{up} of {} nodes answered", shared.nodes.len());
                return Err(short_of_quorum(shared, answered, first));
            }
            let mut counts = vec![0usize; keys.len()];
            for held in answers.iter().flatten() {
                for (count, held) in counts.iter_mut().zip(held) {
                    *count += usize::from(*held);
                }
            }
            Ok(counts
                .into_iter()
                .map(|count| count >= shared.quorum)
                .collect())
        })
    }

    fn shared_locks(&self) -> Result<(), LockError> {
        // Read locks are the nodes' own: there when every connected node has them.
        match self.shared.nodes.iter().find_map(|n| n.backend.get()) {
            Some(node) => node.shared_locks().map_err(|err| match err {
                LockError::Unsupported {
                    operation, message, ..
                } => LockError::unsupported(NAME, operation, message),
                other => other,
            }),
            None => Err(LockError::unavailable(NAME, "no node is connected", None)),
        }
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), LockError>> {
        Box::pin(async move {
            let shared = &*self.shared;
            let answers: Vec<Result<(), LockError>> = join(shared.nodes.iter().map(|node| {
                Box::pin(async move { node.get().await?.ping().await }) as BoxFuture<'_, _>
            }))
            .await;
            let up = answers.iter().filter(|a| a.is_ok()).count();
            if up >= shared.quorum {
                return Ok(());
            }
            let first = answers.into_iter().find_map(Result::err);
            let answered = format!("{up} of {} nodes answered", shared.nodes.len());
            Err(short_of_quorum(shared, answered, first))
        })
    }

    fn try_acquire<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        Box::pin(async move {
            Ok(match self.attempt(request, false).await? {
                WaitTry::Acquired(acquired) => Some(acquired),
                WaitTry::Held { .. } => None,
            })
        })
    }

    /// A waiter's try: on contention, how soon enough holders' leases run out for a quorum
    /// of nodes to be free.
    fn try_acquire_in_wait<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Result<WaitTry, LockError>> {
        Box::pin(self.attempt(request, true))
    }

    /// Subscribes to the key's release channel on every connected node: woken by a release
    /// announced on any of them (a release goes to every node), live while one subscription
    /// is.
    fn watch_releases<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Option<Box<dyn ReleaseWatch>>> {
        Box::pin(async move {
            let watches = join(
                self.shared
                    .nodes
                    .iter()
                    .filter_map(|node| node.backend.get())
                    .map(|backend| backend.watch_releases(request)),
            )
            .await;
            let watches: Vec<Box<dyn ReleaseWatch>> = watches.into_iter().flatten().collect();
            if watches.is_empty() {
                None
            } else {
                Some(Box::new(RedlockWatch { watches }) as Box<dyn ReleaseWatch>)
            }
        })
    }
}

/// The release watches of one key on the nodes: see [`RedlockBackend::watch_releases`].
#[derive(Debug)]
struct RedlockWatch {
    watches: Vec<Box<dyn ReleaseWatch>>,
}

impl ReleaseWatch for RedlockWatch {
    fn is_live(&self) -> bool {
        self.watches.iter().any(|watch| watch.is_live())
    }

    fn mark_seen(&mut self) {
        for watch in &mut self.watches {
            watch.mark_seen();
        }
    }

    fn woken(&mut self) -> BoxFuture<'_, ()> {
        // Each node's `woken` is cancel safe: dropping the others loses no wake-up.
        let woken: Vec<BoxFuture<'_, ()>> =
            self.watches.iter_mut().map(|watch| watch.woken()).collect();
        Box::pin(async move {
            futures_util::future::select_all(woken).await;
        })
    }
}

/// How soon a quorum of nodes may be free without a release, from the holders' times to live
/// on the nodes that refused (`hints`, `None` where unknown), when `taken` nodes granted the
/// lock: the time by which enough more of them have run out. `None` when unknown.
fn quorum_free_within(
    mut hints: Vec<Option<Duration>>,
    taken: usize,
    quorum: usize,
) -> Option<Duration> {
    let needed = quorum.checked_sub(taken)?.checked_sub(1)?;
    hints.sort_by_key(|hint| hint.unwrap_or(Duration::MAX));
    hints.get(needed).copied().flatten()
}

impl RedlockBackend {
    /// One try on every node at once (a waiter's when `in_wait`, which also learns how soon
    /// the holders' leases run out).
    async fn attempt(&self, request: LockRequest<'_>, in_wait: bool) -> Result<WaitTry, LockError> {
        {
            let shared = &*self.shared;
            let lease = request.lease.unwrap_or(shared.lease);
            check_lease(lease)?;
            tokio::runtime::Handle::try_current().map_err(|_| {
                LockError::config("dlock runs on Tokio: acquire locks from within a Tokio runtime")
            })?;
            // Node locks of an abandoned acquisition of this name may still be being given
            // back: a try sent now would find them taken.
            shared.settling.wait(request.key, SETTLE_LIMIT).await;
            let started = Instant::now();
            let wait = node_wait(lease);
            let answers = join_within(
                Some(wait),
                shared.nodes.iter().enumerate().map(|(i, node)| {
                    Box::pin(async move {
                        let attempt = async {
                            let backend = node.get().await?;
                            let once = || async {
                                if in_wait {
                                    backend.try_acquire_in_wait(request).await
                                } else {
                                    Ok(match backend.try_acquire(request).await? {
                                        Some(acquired) => WaitTry::Acquired(acquired),
                                        None => WaitTry::Held { retry_within: None },
                                    })
                                }
                            };
                            let taken = match once().await {
                                // A connection found broken is opened again by the next
                                // command (a node that restarted): one more try, within the wait.
                                Err(LockError::Unavailable { .. }) => once().await?,
                                other => other?,
                            };
                            Ok::<_, LockError>(match taken {
                                WaitTry::Acquired(acquired) => Ok(Taken {
                                    node: i,
                                    acquired: Some(acquired),
                                    key: request.key,
                                    settling: &shared.settling,
                                }),
                                WaitTry::Held { retry_within } => Err(retry_within),
                            })
                        };
                        attempt.await.map_err(Failure::Failed)
                    }) as BoxFuture<'_, _>
                }),
            )
            .await;
            let mut taken = Vec::new();
            let mut failures = Vec::new();
            let mut hints = Vec::new();
            let (mut refused, mut slow) = (0, 0);
            for answer in answers {
                match answer.unwrap_or(Err(Failure::Slow)) {
                    Ok(Ok(t)) => taken.push(t),
                    Ok(Err(hint)) => {
                        refused += 1;
                        hints.push(hint);
                    }
                    Err(Failure::Slow) => {
                        slow += 1;
                        failures.push(LockError::unavailable(
                            NAME,
                            format!("a node did not answer within {wait:?}"),
                            None,
                        ));
                    }
                    Err(Failure::Failed(err)) => failures.push(err),
                }
            }
            // A node that refuses for its configuration (per-key counters on a prefix that
            // had shared ones, see `dlock::redis`) is not a node that is down: a quorum of
            // the others must not hide it. `taken` is given back as it drops.
            if let Some(at) = failures
                .iter()
                .position(|err| matches!(err, LockError::Config { .. }))
            {
                return Err(failures.swap_remove(at));
            }
            if taken.len() < shared.quorum {
                // `taken` is given back as it drops.
                if refused + taken.len() < shared.quorum
                    && refused + taken.len() + slow >= shared.quorum
                {
                    // Nodes that may be up, only slow to answer (a loaded server, a node
                    // reconnecting after a restart): a wait tries again, as after a late
                    // answer of a single node.
                    return Err(LockError::Lost {
                        key: Arc::from(request.key),
                        reason: format!(
                            "{slow} nodes did not answer within {wait:?}, too many to reach the \
                             quorum of {}; the node locks taken were given back",
                            shared.quorum
                        ),
                    });
                }
                if refused + taken.len() < shared.quorum {
                    let answered = format!(
                        "only {} of {} nodes answered ({slow} too slowly)",
                        refused + taken.len(),
                        shared.nodes.len()
                    );
                    let first = failures.into_iter().next();
                    return Err(short_of_quorum(shared, answered, first));
                }
                return Ok(WaitTry::Held {
                    retry_within: quorum_free_within(hints, taken.len(), shared.quorum),
                });
            }
            let fencing_token = if shared.fencing {
                match self.raise_fences(request.key, &taken).await {
                    Some(token) => Some(token),
                    // Too few counters could be raised: the token would not be safe.
                    None => return Ok(WaitTry::Held { retry_within: None }),
                }
            } else {
                None
            };
            let elapsed = started.elapsed();
            let validity = lease.saturating_sub(elapsed).saturating_sub(drift(lease));
            if validity < lease / 2 {
                tracing::warn!(
                    took_ms = elapsed.as_millis() as u64,
                    lease_ms = lease.as_millis() as u64,
                    "a redlock quorum was reached too late to count on its leases; giving it back"
                );
                return Err(LockError::Lost {
                    key: Arc::from(request.key),
                    reason: format!(
                        "the quorum took {elapsed:?}, leaving less than half of the {lease:?} \
                         lease; the node locks were given back"
                    ),
                });
            }
            let nodes: Vec<NodeLock> = taken
                .into_iter()
                .filter_map(|t| {
                    let node = t.node;
                    t.into_inner().map(|acquired| NodeLock { node, acquired })
                })
                .collect();
            let lost = CancellationToken::new();
            let followed_nodes: Vec<_> = nodes
                .iter()
                .map(|n| (n.acquired.lost.clone(), n.acquired.lease_deadline.clone()))
                .collect();
            // Fewer than a quorum still held already: a deadline passed, the lock is lost.
            let now = Instant::now();
            let deadline = LeaseDeadline::new(
                held_until(&followed_nodes, shared.quorum, lease, now).unwrap_or(now),
            );
            let followed = Followed {
                nodes: followed_nodes,
                quorum: shared.quorum,
                lease,
                lost: lost.clone(),
                deadline: deadline.clone(),
            };
            let mut held = RedlockHeld {
                key: Arc::from(request.key),
                nodes: nodes
                    .into_iter()
                    .map(|n| (n.node, n.acquired.handle))
                    .collect(),
                quorum: shared.quorum,
                lease,
                lost: lost.clone(),
                deadline: deadline.clone(),
                quorums: Arc::clone(&shared.quorums),
                followed: None,
            };
            // An error means the runtime is shutting down, and nothing could give the node
            // locks back now: they stop being renewed as `held` drops, and their leases end them.
            held.followed = Some(shared.quorums.follow(followed)?);
            Ok(WaitTry::Acquired(
                Acquired::new(fencing_token, lost, Box::new(held)).with_lease_deadline(deadline),
            ))
        }
    }
}

impl RedlockBackend {
    /// The lock's fencing token, the largest of the granted nodes' tokens, once the counter of
    /// a quorum of nodes is at least that large; `None` when too few could be raised.
    async fn raise_fences(&self, key: &str, taken: &[Taken<'_>]) -> Option<u64> {
        let shared = &*self.shared;
        let tokens: Vec<u64> = taken
            .iter()
            .filter_map(|t| t.acquired.as_ref()?.fencing_token)
            .collect();
        let token = tokens.iter().copied().max()?;
        let text = token.to_string();
        let raised: Vec<Option<redis::Value>> = join(taken.iter().map(|t| {
            let (node, text) = (&shared.nodes[t.node], &text);
            Box::pin(async move {
                let backend = node.backend.get()?;
                let counter = backend.fencing_key(key);
                let (keys, args) = ([counter.as_slice()], [text.as_bytes()]);
                let raise = backend.shared.conn.eval(&shared.raise, &keys, &args);
                backend
                    .shared
                    .bounded("raising a fencing counter", raise)
                    .await
                    .ok()
            }) as BoxFuture<'_, _>
        }))
        .await;
        let raised = raised.iter().filter(|r| r.is_some()).count();
        (raised >= shared.quorum).then_some(token)
    }
}

/// A node's lock, once the quorum counted.
struct NodeLock {
    node: usize,
    acquired: Acquired,
}

/// The `n`-th latest of `times` (1 is the latest), if there are that many.
pub(super) fn nth_latest(mut times: Vec<Instant>, n: usize) -> Option<Instant> {
    times.sort_unstable_by(|a, b| b.cmp(a));
    n.checked_sub(1).and_then(|i| times.get(i).copied())
}

/// A Redlock lock: its node locks.
struct RedlockHeld {
    key: Arc<str>,
    nodes: Vec<(usize, Box<dyn HeldLock>)>,
    quorum: usize,
    lease: Duration,
    lost: CancellationToken,
    deadline: LeaseDeadline,
    /// What follows the node locks, and this lock's id there (`None` until it is followed).
    quorums: Arc<Quorums>,
    followed: Option<u64>,
}

impl fmt::Debug for RedlockHeld {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedlockHeld")
            .field("key", &self.key)
            .field(
                "nodes",
                &self.nodes.iter().map(|(n, _)| n).collect::<Vec<_>>(),
            )
            .field("quorum", &self.quorum)
            .finish_non_exhaustive()
    }
}

impl Drop for RedlockHeld {
    fn drop(&mut self) {
        self.forget();
    }
}

impl RedlockHeld {
    /// Ends the following of the node locks (released, or the guard dropped).
    fn forget(&mut self) {
        if let Some(id) = self.followed.take() {
            self.quorums.forget(id);
        }
    }

    /// Counts the node operations that answered `Ok(true)`; the lock counts as lost when fewer
    /// than a quorum did.
    async fn quorum_of<'a>(
        &'a self,
        op: impl Fn(&'a dyn LeaseControl) -> BoxFuture<'a, Result<bool, LockError>>,
    ) -> Result<bool, LockError> {
        let answers = join(
            self.nodes
                .iter()
                .map(|(_, handle)| match handle.lease_control() {
                    Some(control) => op(control),
                    None => Box::pin(async { Ok(false) }) as BoxFuture<'_, _>,
                }),
        )
        .await;
        let yes = answers.iter().filter(|a| matches!(a, Ok(true))).count();
        if yes >= self.quorum {
            return Ok(true);
        }
        let answered = answers.iter().filter(|a| a.is_ok()).count();
        if answered >= self.quorum || answers.iter().all(Result::is_ok) {
            self.lost.cancel();
            return Ok(false);
        }
        Err(answers
            .into_iter()
            .find_map(Result::err)
            .unwrap_or_else(|| LockError::unavailable(NAME, "too few nodes answered", None)))
    }
}

impl LeaseControl for RedlockHeld {
    fn extend(&self, lease: Duration) -> BoxFuture<'_, Result<bool, LockError>> {
        Box::pin(async move {
            let sent = Instant::now();
            let held = self.quorum_of(|control| control.extend(lease)).await?;
            if held {
                let at = sent + crate::lease::safe_window(lease);
                self.deadline
                    .set(at.checked_sub(drift(lease)).unwrap_or(sent));
            }
            Ok(held)
        })
    }

    fn verify_still_held(&self) -> BoxFuture<'_, Result<bool, LockError>> {
        Box::pin(self.quorum_of(|control| control.verify_still_held()))
    }

    fn stop_renewal(&self) {
        for (_, handle) in &self.nodes {
            if let Some(control) = handle.lease_control() {
                control.stop_renewal();
            }
        }
    }

    /// Every node lock still held renews again; the lock is counted on while a quorum of them
    /// do (and its own deadline has not passed).
    fn start_renewal(&self) -> Result<bool, LockError> {
        if self.lost.is_cancelled() || self.deadline.has_passed() {
            return Ok(false);
        }
        let mut renewed = 0;
        for (_, handle) in &self.nodes {
            if let Some(control) = handle.lease_control()
                && control.start_renewal()?
            {
                renewed += 1;
            }
        }
        Ok(renewed >= self.quorum)
    }
}

impl HeldLock for RedlockHeld {
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        let (key, quorum, total, lease) = (
            Arc::clone(&self.key),
            self.quorum,
            self.nodes.len(),
            self.lease,
        );
        let outcome = self.release_outcome();
        Box::pin(async move {
            match outcome.await? {
                ReleaseOutcome::Released => Ok(()),
                _ => Err(LockError::Lost {
                    key,
                    reason: format!(
                        "fewer than the quorum of {quorum} of the {total} node locks were still \
                         held at release (lease {lease:?})"
                    ),
                }),
            }
        })
    }

    fn release_outcome(
        mut self: Box<Self>,
    ) -> BoxFuture<'static, Result<ReleaseOutcome, LockError>> {
        self.forget();
        let nodes = std::mem::take(&mut self.nodes);
        let (quorum, lost) = (self.quorum, self.lost.clone());
        Box::pin(async move {
            let answers = join(
                nodes
                    .into_iter()
                    .map(|(_, handle)| handle.release_outcome()),
            )
            .await;
            let count = |outcome: ReleaseOutcome| {
                answers
                    .iter()
                    .filter(|a| matches!(a, Ok(o) if *o == outcome))
                    .count()
            };
            if count(ReleaseOutcome::Released) >= quorum {
                return Ok(ReleaseOutcome::Released);
            }
            lost.cancel();
            let not_owned = count(ReleaseOutcome::NotOwned) > 0;
            let answered = answers.iter().filter(|a| a.is_ok()).count();
            if answered < quorum
                && let Some(err) = answers.into_iter().find_map(Result::err)
            {
                return Err(err);
            }
            Ok(if not_owned {
                ReleaseOutcome::NotOwned
            } else {
                ReleaseOutcome::AlreadyReleased
            })
        })
    }

    fn lease_control(&self) -> Option<&dyn LeaseControl> {
        Some(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_quorum_is_free_when_enough_of_the_holders_leases_have_run_out() {
        let s = Duration::from_secs;
        // Three nodes, quorum two, none granted: the second shortest lease.
        assert_eq!(
            quorum_free_within(vec![Some(s(3)), Some(s(1)), Some(s(2))], 0, 2),
            Some(s(2))
        );
        // One granted: the shortest will do.
        assert_eq!(
            quorum_free_within(vec![Some(s(3)), Some(s(1))], 1, 2),
            Some(s(1))
        );
        // Unknown where it matters: unknown; unknown beyond it: no matter.
        assert_eq!(quorum_free_within(vec![None, Some(s(1))], 0, 2), None);
        assert_eq!(
            quorum_free_within(vec![Some(s(1)), Some(s(2)), None], 0, 2),
            Some(s(2))
        );
        // Too few refusals to reach a quorum, or a quorum granted already: none to wait for.
        assert_eq!(quorum_free_within(vec![Some(s(1))], 0, 2), None);
        assert_eq!(quorum_free_within(vec![Some(s(1))], 2, 2), None);
    }

    #[test]
    fn urls_split_into_nodes_with_shared_credentials_and_options() {
        let nodes =
            node_urls("redlock://u:p%40ss@a:1,b:2, c:3/2?lease=10s&prefix=x:").expect("valid");
        assert_eq!(
            nodes,
            [
                "redis://u:p%40ss@a:1/2?lease=10s&prefix=x:",
                "redis://u:p%40ss@b:2/2?lease=10s&prefix=x:",
                "redis://u:p%40ss@c:3/2?lease=10s&prefix=x:",
            ]
        );
        assert_eq!(node_urls("REDLOCK://a:1").expect("valid"), ["redis://a:1"]);
        // The default port, IPv6, an empty path.
        assert_eq!(
            node_urls("redlock://a,[::1]:7/?lease=2s").expect("valid"),
            ["redis://a:6379/?lease=2s", "redis://[::1]:7/?lease=2s"]
        );
        // Over TLS: every node, with the URL's CA.
        assert_eq!(
            node_urls("rediss+redlock://a:1,b:2?ca=/ca.pem").expect("valid"),
            ["rediss://a:1/?ca=/ca.pem", "rediss://b:2/?ca=/ca.pem"]
        );
        for bad in [
            "redis://a:1",
            "redlock://a:1,,b:2",
            "redlock://a:1,A:1",
            "redlock://",
            "redlock://a:0",
            "redlock://[::1",
            "redlock://u:hunter2@",
        ] {
            super::super::hosts::config_error(bad, node_urls);
        }
    }

    #[test]
    fn the_quorum_deadline_is_the_quorum_th_latest() {
        let now = Instant::now();
        let at = |ms| now + Duration::from_millis(ms);
        assert_eq!(nth_latest(vec![at(1), at(5), at(3)], 2), Some(at(3)));
        assert_eq!(nth_latest(vec![at(1), at(5), at(3)], 1), Some(at(5)));
        assert_eq!(nth_latest(vec![at(1)], 2), None);
        assert_eq!(nth_latest(vec![at(1)], 0), None);
        assert_eq!(drift(Duration::from_secs(10)), Duration::from_millis(102));
        assert_eq!(
            node_wait(Duration::from_millis(100)),
            Duration::from_millis(50)
        );
        assert_eq!(node_wait(Duration::from_secs(30)), Duration::from_secs(6));
    }
}
