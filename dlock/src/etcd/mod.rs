#![doc = include_str!("docs.md")]

mod inspect;
mod io;
mod keeper;
mod permits;

use std::sync::Arc;
use std::time::{Duration, Instant};

pub use etcd_client;
use etcd_client::{
    Compare, CompareOp, ConnectOptions, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    TxnOpResponse, TxnResponse, WatchFilterType, WatchOptions,
};

use crate::LockError;
use crate::backend::{
    Acquired, BoxFuture, HeldLock, LeaseControl, LockBackend, LockRequest, PermitStore,
    ReleaseOutcome,
};
use crate::lease::{DEFAULT_LEASE, retry_after};
use crate::options::{UrlForm, parse_duration, percent_decode, read_query, url_keys};
use crate::time::check_limit;

use io::Io;
use keeper::{Entry, Keeper};

const NAME: &str = "etcd";
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// The first pause before a request that failed in a way that may pass is sent again; it
/// doubles up to [`LAST_RETRY_PAUSE`].
const FIRST_RETRY_PAUSE: Duration = Duration::from_millis(20);

/// The longest pause between two attempts of a request.
const LAST_RETRY_PAUSE: Duration = Duration::from_millis(500);
const DEFAULT_PREFIX: &str = "dlock/";
const DEFAULT_PORT: u16 = 2379;

/// The etcd v3 backend. Usually made through
/// [`LockProvider::connect`](crate::LockProvider::connect) with an `etcd://` URL; see the
/// [module docs](self).
#[derive(Clone)]
pub struct EtcdBackend {
    shared: Arc<Shared>,
}

struct Shared {
    client: etcd_client::Client,
    lease: Duration,
    prefix: Vec<u8>,
    timeout: Duration,
    /// The renewal cadence set by the application, if any.
    renew_every: Option<Duration>,
    /// The owner label, the value of every lock key this backend puts (see
    /// [`LockBackend::set_owner_label`]); empty until set.
    owner_label: std::sync::Mutex<Arc<[u8]>>,
    /// Declared last: the I/O thread ends after everything else of the backend is dropped.
    io: Io,
}

enum Source {
    Endpoints {
        endpoints: Vec<String>,
        user: Option<(String, String)>,
    },
    Client(Box<etcd_client::Client>),
}

/// Builds an [`EtcdBackend`] with options.
#[must_use]
pub struct EtcdBuilder {
    source: Source,
    lease: Duration,
    prefix: String,
    timeout: Duration,
    connect_timeout: Duration,
    renew_every: Option<Duration>,
}

impl std::fmt::Debug for EtcdBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let endpoints = match &self.source {
            Source::Endpoints { endpoints, .. } => endpoints.join(","),
            Source::Client(_) => "(a client)".to_owned(),
        };
        f.debug_struct("EtcdBuilder")
            .field("endpoints", &endpoints)
            .field("lease", &self.lease)
            .field("prefix", &self.prefix)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("renew_every", &self.renew_every)
            .finish_non_exhaustive()
    }
}

impl EtcdBuilder {
    fn on(source: Source) -> EtcdBuilder {
        EtcdBuilder {
            source,
            lease: DEFAULT_LEASE,
            prefix: DEFAULT_PREFIX.to_owned(),
            timeout: DEFAULT_TIMEOUT,
            connect_timeout: DEFAULT_TIMEOUT,
            renew_every: None,
        }
    }

    /// The lease of each lock (default 30 s, at least 100 ms, at most 365 days), renewed
    /// every third of it. The etcd lease's TTL is this rounded up to whole seconds (and at
    /// least the server's minimum TTL); the holder counts on four fifths of what was asked.
    /// Checked by [`connect`](EtcdBuilder::connect).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Prepended to every lock's key (default `dlock/`). End it with `/`: the prefixes `a`
    /// and `ab` would otherwise share keys.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// Limit for each request (default 5 s; above zero, at most 365 days). Checked by
    /// [`connect`](EtcdBuilder::connect).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Limit for connecting (default 5 s; above zero, at most 365 days): the first request,
    /// which checks that the cluster answers, must be answered within it. Checked by
    /// [`connect`](EtcdBuilder::connect).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How often held locks' leases are kept alive (default: every third of each lock's
    /// lease; 10 ms to 365 days, checked by [`connect`](EtcdBuilder::connect)). A cadence
    /// longer than half of a lock's lease is cut to that half, so that failed keep-alives can
    /// still be retried before the lock's local deadline.
    pub fn renew_every(mut self, cadence: Duration) -> Self {
        self.renew_every = Some(cadence);
        self
    }

    /// Connects (unless built on a client), checks that the cluster answers (a linearizable
    /// read of one key, so a cluster without a quorum fails here), and makes the backend.
    /// Both are tried again within `connect_timeout` while they fail in a way that may pass:
    /// a member of the URL that is down does not fail the connect while a majority is up.
    /// A lease or timeout out of bounds is a [`LockError::Config`], before anything is sent.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future drops the connection it was opening.
    pub async fn connect(self) -> Result<EtcdBackend, LockError> {
        check_lease(self.lease)?;
        check_limit("the etcd `timeout`", self.timeout)?;
        check_limit("the etcd `connect_timeout`", self.connect_timeout)?;
        if let Some(cadence) = self.renew_every {
            crate::lease::check_cadence("the etcd `renew_every`", cadence)?;
        }
        let io = Io::start()?;
        // Errors name the endpoints (never the user or password).
        let what = match &self.source {
            Source::Endpoints { endpoints, .. } => {
                format!("connecting to {}", endpoints.join(", "))
            }
            Source::Client(_) => "connecting".to_owned(),
        };
        let client = match self.source {
            Source::Client(client) => *client,
            Source::Endpoints { endpoints, user } => {
                // HTTP/2 pings find a silent connection within a timeout or two, and the
                // client moves on to another endpoint.
                let mut options = ConnectOptions::new()
                    .with_require_leader(true)
                    .with_connect_timeout(self.connect_timeout)
                    .with_keep_alive(self.timeout, self.timeout)
                    .with_keep_alive_while_idle(true);
                if let Some((name, password)) = user {
                    options = options.with_user(name, password);
                }
                // With credentials, making the client authenticates: one request, which the
                // client's balancer may send to a member that is down. Tried again, as every
                // request is (see `Shared::retrying`), within the connect timeout.
                let connecting_to = what.clone();
                let connecting = io.run(async move {
                    let mut pause = FIRST_RETRY_PAUSE;
                    loop {
                        match etcd_client::Client::connect(&endpoints, Some(options.clone())).await
                        {
                            Ok(client) => break Ok(client),
                            Err(err) => {
                                let failure = etcd_error(&connecting_to, err);
                                if !failure.is_retryable() {
                                    break Err(failure);
                                }
                                tracing::debug!(error = %failure, "connecting to etcd failed; trying again");
                                tokio::time::sleep(pause).await;
                                pause = (pause * 2).min(LAST_RETRY_PAUSE);
                            }
                        }
                    }
                });
                match tokio::time::timeout(self.connect_timeout, connecting).await {
                    Ok(Some(Ok(client))) => client,
                    Ok(Some(Err(err))) => return Err(err),
                    Ok(None) => {
                        return Err(LockError::unavailable(
                            NAME,
                            format!("{what}: the etcd I/O thread stopped"),
                            None,
                        ));
                    }
                    Err(_) => {
                        return Err(LockError::unavailable(
                            NAME,
                            format!("{what} timed out after {:?}", self.connect_timeout),
                            None,
                        ));
                    }
                }
            }
        };
        let backend = EtcdBackend {
            shared: Arc::new(Shared {
                client,
                lease: self.lease,
                prefix: self.prefix.into_bytes(),
                timeout: self.timeout,
                renew_every: self.renew_every,
                owner_label: std::sync::Mutex::new(Arc::from(&b""[..])),
                io,
            }),
        };
        let check = backend.shared.check(&what);
        match tokio::time::timeout(self.connect_timeout, check).await {
            Ok(outcome) => outcome?,
            Err(_) => {
                return Err(LockError::unavailable(
                    NAME,
                    format!(
                        "{what}: the cluster did not answer within {:?} (is a majority of \
                         its members up?)",
                        self.connect_timeout
                    ),
                    None,
                ));
            }
        }
        Ok(backend)
    }
}

impl EtcdBackend {
    /// A builder on a client the application already has. The client's requests run on the
    /// runtime that made it: keep that runtime alive as long as the backend.
    pub fn builder(client: etcd_client::Client) -> EtcdBuilder {
        EtcdBuilder::on(Source::Client(Box::new(client)))
    }

    /// A builder on these endpoints (`host:port` or `http://host:port`), without
    /// authentication.
    pub fn builder_on_endpoints<E: Into<String>>(
        endpoints: impl IntoIterator<Item = E>,
    ) -> EtcdBuilder {
        EtcdBuilder::on(Source::Endpoints {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            user: None,
        })
    }

    /// Parses an `etcd://` URL with the options of the [module docs](self) into a builder,
    /// without connecting.
    pub fn builder_from_url(url: &str) -> Result<EtcdBuilder, LockError> {
        parse_url(url)
    }

    /// Connects to the cluster named by an `etcd://` URL (see the [module docs](self)).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`EtcdBuilder::connect`].
    pub async fn connect(url: &str) -> Result<EtcdBackend, LockError> {
        parse_url(url)?.connect().await
    }

    /// The default lease.
    pub fn lease(&self) -> Duration {
        self.shared.lease
    }

    /// The client the backend sends its requests with.
    pub fn client(&self) -> &etcd_client::Client {
        &self.shared.client
    }

    /// The prefix under which the lock `key` queues its holders' and waiters' keys
    /// (`<prefix><key'>/`, see [How a lock is kept](self#how-a-lock-is-kept)): the key with
    /// the smallest create revision under it holds the lock.
    pub fn queue_prefix(&self, key: &str) -> Vec<u8> {
        queue_prefix(&self.shared.prefix, key)
    }
}

impl std::fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdBackend")
            .field("lease", &self.shared.lease)
            .field("prefix", &String::from_utf8_lossy(&self.shared.prefix))
            .field("timeout", &self.shared.timeout)
            .finish_non_exhaustive()
    }
}

/// How long a lock's name may be in its key, encoded, before it is shortened.
const LONG_NAME: usize = 256;

/// How much of a long name's encoding its shortened form keeps, before the hash.
const KEPT_OF_LONG_NAME: usize = 64;

/// `<prefix><key'>/`, where `key'` is `key` with `%` and `/` percent-encoded: no `/` is left in
/// `key'`, so the queues of distinct keys never nest, and the mapping is injective. A `key'`
/// longer than [`LONG_NAME`] bytes is shortened to its first [`KEPT_OF_LONG_NAME`] bytes (at
/// a character boundary), `%#` and the SHA-256 of `key` in hex: a short `key'` never holds
/// `%#` (its only `%` start `%25` and `%2F`), so a shortened name is never a short one.
fn queue_prefix(prefix: &[u8], key: &str) -> Vec<u8> {
    let mut name = String::with_capacity(key.len());
    for c in key.chars() {
        match c {
            '%' => name.push_str("%25"),
            '/' => name.push_str("%2F"),
            other => name.push(other),
        }
    }
    if name.len() > LONG_NAME {
        use sha2::Digest;
        let mut cut = KEPT_OF_LONG_NAME;
        while !name.is_char_boundary(cut) {
            cut -= 1;
        }
        name.truncate(cut);
        name.push_str("%#");
        for byte in sha2::Sha256::digest(key.as_bytes()) {
            name.push_str(&format!("{byte:02x}"));
        }
    }
    let mut out = Vec::with_capacity(prefix.len() + name.len() + 1);
    out.extend_from_slice(prefix);
    out.extend_from_slice(name.as_bytes());
    out.push(b'/');
    out
}

/// The key of the queue entry on `lease_id`: the queue prefix, then the lease id in hex (as
/// etcd's own lock recipe names it).
fn entry_key(queue: &[u8], lease_id: i64) -> Vec<u8> {
    let mut key = queue.to_vec();
    key.extend_from_slice(format!("{lease_id:x}").as_bytes());
    key
}

/// The TTL of the etcd lease for a lock of `lease`: whole seconds, rounded up.
fn ttl_seconds(lease: Duration) -> i64 {
    let seconds = lease.as_secs() + u64::from(lease.subsec_nanos() > 0);
    i64::try_from(seconds.max(1)).unwrap_or(i64::MAX)
}

impl Shared {
    /// The owner label, as lock keys carry it.
    fn owner_label(&self) -> Arc<[u8]> {
        Arc::clone(
            &self
                .owner_label
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// Sends a request (made anew by `request` for each attempt) until it is answered: a
    /// failure that may pass (no leader during an election, a member that went away, a
    /// request that timed out) is tried again after a pause, until `timeout` has passed
    /// since the first attempt. Each attempt gets a third of `timeout` at most: a write
    /// that a follower forwarded to a leader that then died waits for the server's own
    /// timeout, while a new leader may have been elected long before. Only requests that
    /// may safely run twice are sent this way.
    async fn retrying<T, F, Fut>(&self, what: &str, mut request: F) -> Result<T, LockError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let started = Instant::now();
        let mut pause = FIRST_RETRY_PAUSE;
        loop {
            let remaining = self.timeout.saturating_sub(started.elapsed());
            let attempt = remaining.min(self.timeout / 3);
            let failure = match tokio::time::timeout(attempt, request()).await {
                Ok(Ok(answer)) => return Ok(answer),
                Ok(Err(err)) => etcd_error(what, err),
                Err(_) => LockError::unavailable(
                    NAME,
                    format!("{what} was not answered within {:?}", self.timeout),
                    None,
                ),
            };
            if !failure.is_retryable() || started.elapsed() + pause >= self.timeout {
                return Err(failure);
            }
            tracing::debug!(error = %failure, "an etcd request failed; trying again");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(LAST_RETRY_PAUSE);
        }
    }

    /// A linearizable read of the prefix's own key: the cluster has a leader and a quorum.
    /// Tried again as every request is ([`retrying`](Shared::retrying)): the client's balancer
    /// may send one attempt to a member that is down while a majority is up.
    async fn check(&self, what: &str) -> Result<(), LockError> {
        self.retrying(what, || {
            let mut client = self.client.kv_client();
            let options = GetOptions::new().with_count_only();
            let key = self.prefix.clone();
            async move { client.get(key, Some(options)).await }
        })
        .await
        .map(drop)
    }

    async fn grant(&self, lease: Duration) -> Result<i64, LockError> {
        let ttl = ttl_seconds(lease);
        let granted = self
            .retrying("granting a lease", || {
                let mut client = self.client.lease_client();
                async move { client.grant(ttl, None).await }
            })
            .await?;
        if !granted.error().is_empty() || granted.id() == 0 {
            return Err(LockError::backend(
                NAME,
                format!("granting a lease: the server answered {}", granted.error()),
                None,
                None,
            ));
        }
        Ok(granted.id())
    }

    /// Revokes `lease_id` (deleting any key on it), ignoring failures: the lease expires
    /// anyway.
    async fn revoke(&self, lease_id: i64) {
        let revoked = self
            .retrying("revoking a lease", || {
                let mut client = self.client.lease_client();
                async move { client.revoke(lease_id).await }
            })
            .await;
        if let Err(err) = revoked {
            tracing::debug!(error = %err, "an etcd lease could not be revoked; it expires with its TTL");
        }
    }

    /// Revokes `lease_id` in the background, on the backend's own runtime.
    fn revoke_later(self: &Arc<Self>, lease_id: i64) {
        let shared = Arc::clone(self);
        self.io.spawn(async move { shared.revoke(lease_id).await });
    }

    /// Whether `lease_id` still exists.
    async fn lease_alive(&self, lease_id: i64) -> Result<bool, LockError> {
        let answer = self
            .retrying("reading a lease", || {
                let mut client = self.client.lease_client();
                async move { client.time_to_live(lease_id, None).await }
            })
            .await?;
        Ok(answer.ttl() > 0)
    }

    /// Runs a transaction (whose comparisons make it safe to run twice), retrying as
    /// [`retrying`](Shared::retrying) does; also says how many attempts were sent.
    async fn txn(&self, what: &str, txn: Txn) -> Result<(TxnResponse, u32), LockError> {
        let mut attempts = 0;
        let answer = self
            .retrying(what, || {
                attempts += 1;
                let (mut client, txn) = (self.client.kv_client(), txn.clone());
                async move { client.txn(txn).await }
            })
            .await?;
        Ok((answer, attempts))
    }
}

/// Revokes a lease granted for an acquisition that did not finish, in the background.
struct Claim {
    shared: Arc<Shared>,
    lease_id: i64,
    armed: bool,
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.armed {
            self.shared.revoke_later(self.lease_id);
        }
    }
}

/// A queue entry with its keeper running, and the lease to revoke if it is abandoned.
struct Queued {
    entry: Arc<Entry>,
    keeper: Keeper,
    claim: Claim,
}

impl Queued {
    fn into_acquired(mut self, name: &str) -> Acquired {
        self.claim.armed = false;
        let entry = Arc::clone(&self.entry);
        let deadline = entry.deadline();
        Acquired::new(
            u64::try_from(entry.revision).ok(),
            entry.lost.clone(),
            Box::new(EtcdHeld {
                name: Arc::from(name),
                entry: self.entry,
                keeper: Some(self.keeper),
                permit: false,
            }),
        )
        .with_lease_deadline(deadline)
    }
}

/// What a waiter found when it looked at the queue.
enum Turn {
    /// Its key heads the queue: the lock is its.
    Mine,
    /// The timeout ran out.
    TimedOut,
    /// Its key or lease is gone: it queues again.
    Lost,
}

impl EtcdBackend {
    /// Grants a lease and puts the entry's key, on the condition `when`; `None` when the
    /// condition failed (the lease is then revoked in the background).
    async fn enqueue(
        &self,
        queue: &[u8],
        lease: Duration,
        renew: bool,
        only_if_free: bool,
    ) -> Result<Option<(Queued, Instant)>, LockError> {
        let shared = &self.shared;
        let sent = Instant::now();
        let lease_id = shared.grant(lease).await?;
        let claim = Claim {
            shared: Arc::clone(shared),
            lease_id,
            armed: true,
        };
        let key = entry_key(queue, lease_id);
        // Safe to send twice: an attempt whose answer was lost may have put the key, which
        // the second finds (the head of the queue, or the key itself) on our lease.
        let (condition, otherwise) = if only_if_free {
            // Every key under the queue prefix has create revision 0: there is none.
            let head = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend)
                .with_limit(1);
            (
                Compare::create_revision(queue.to_vec(), CompareOp::Equal, 0).with_prefix(),
                TxnOp::get(queue.to_vec(), Some(head)),
            )
        } else {
            (
                Compare::create_revision(key.clone(), CompareOp::Equal, 0),
                TxnOp::get(key.clone(), None),
            )
        };
        let label = shared.owner_label();
        let put = TxnOp::put(
            key.clone(),
            label.to_vec(),
            Some(PutOptions::new().with_lease(lease_id)),
        );
        let txn = Txn::new()
            .when([condition])
            .and_then([put])
            .or_else([otherwise]);
        let (answer, _) = shared.txn("queueing for a lock", txn).await?;
        let revision = if answer.succeeded() {
            answer.header().map(|h| h.revision())
        } else {
            // Ours only if an earlier attempt put it.
            let mine =
                first_kv(&answer).filter(|kv| kv.key() == key.as_slice() && kv.lease() == lease_id);
            match mine {
                Some(kv) => Some(kv.create_revision()),
                None => return Ok(None),
            }
        };
        let Some(revision) = revision else {
            return Err(LockError::backend(
                NAME,
                "queueing for a lock: the server's answer had no header",
                None,
                None,
            ));
        };
        let entry = Entry::new(
            Arc::clone(shared),
            key,
            revision,
            lease_id,
            lease,
            sent,
            renew,
        );
        let keeper = entry.keep();
        Ok(Some((
            Queued {
                entry,
                keeper,
                claim,
            },
            sent,
        )))
    }

    /// Waits until `queued` heads its queue, its key is lost, or `deadline` passes.
    async fn wait_turn(
        &self,
        queue: &[u8],
        queued: &Queued,
        deadline: Option<tokio::time::Instant>,
    ) -> Result<Turn, LockError> {
        let shared = &self.shared;
        let entry = &queued.entry;
        let expire = async {
            match deadline {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(expire);
        loop {
            if !entry.is_live() {
                return Ok(Turn::Lost);
            }
            // If our key is still ours: the key just ahead of it.
            let ahead = GetOptions::new()
                .with_prefix()
                .with_max_create_revision(entry.revision - 1)
                .with_sort(SortTarget::Create, SortOrder::Descend)
                .with_limit(1)
                .with_keys_only();
            let txn = Txn::new()
                .when([Compare::create_revision(
                    entry.key.clone(),
                    CompareOp::Equal,
                    entry.revision,
                )])
                .and_then([TxnOp::get(queue.to_vec(), Some(ahead))]);
            let looked = tokio::select! {
                biased;
                () = entry.lost.cancelled() => return Ok(Turn::Lost),
                () = &mut expire => return Ok(Turn::TimedOut),
                answer = shared.txn("waiting for a lock", txn) => answer.map(|(answer, _)| answer),
            };
            let answer = match looked {
                Ok(answer) => answer,
                Err(err) if err.is_retryable() => {
                    // The cluster may be electing a leader: the keeper keeps our lease, or
                    // reports it lost, meanwhile.
                    tracing::debug!(error = %err, "an etcd wait could not read its queue; retrying");
                    tokio::select! {
                        biased;
                        () = entry.lost.cancelled() => return Ok(Turn::Lost),
                        () = &mut expire => return Ok(Turn::TimedOut),
                        () = tokio::time::sleep(retry_after(shared.lease)) => continue,
                    }
                }
                Err(err) => return Err(err),
            };
            if !answer.succeeded() {
                return Ok(Turn::Lost);
            }
            let store_revision = answer.header().map_or(entry.revision, |h| h.revision());
            let Some(predecessor) = first_kv(&answer).map(|kv| kv.key().to_vec()) else {
                return Ok(if entry.is_live() {
                    Turn::Mine
                } else {
                    Turn::Lost
                });
            };
            // Wait for its delete, from just after the read.
            let watched = async {
                let options = WatchOptions::new()
                    .with_start_revision(store_revision + 1)
                    .with_filters([WatchFilterType::NoPut]);
                let mut stream = shared
                    .client
                    .watch_client()
                    .watch(predecessor, Some(options))
                    .await?;
                while let Some(answer) = stream.message().await? {
                    let deleted = answer
                        .events()
                        .iter()
                        .any(|event| event.event_type() == etcd_client::EventType::Delete);
                    if deleted || answer.canceled() || answer.compact_revision() > 0 {
                        break;
                    }
                }
                Ok::<(), etcd_client::Error>(())
            };
            tokio::select! {
                biased;
                () = entry.lost.cancelled() => return Ok(Turn::Lost),
                () = &mut expire => return Ok(Turn::TimedOut),
                outcome = watched => {
                    if let Err(err) = outcome {
                        tracing::debug!(error = %err, "an etcd wait's watch failed; looking again");
                        tokio::select! {
                            biased;
                            () = entry.lost.cancelled() => return Ok(Turn::Lost),
                            () = &mut expire => return Ok(Turn::TimedOut),
                            () = tokio::time::sleep(retry_after(shared.lease)) => {}
                        }
                    }
                }
            }
        }
    }
}

impl LockBackend for EtcdBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    fn supports_native_wait(&self) -> bool {
        true
    }

    /// Semaphores are keys in etcd's FIFO order (see [Semaphores](self#semaphores)).
    fn semaphores(&self) -> Option<&dyn PermitStore> {
        Some(self)
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), LockError>> {
        Box::pin(self.shared.check("checking the cluster"))
    }

    fn force_releases(&self) -> Result<&dyn crate::backend::ForceRelease, LockError> {
        Ok(self)
    }

    /// The label is the value of every lock key the backend puts (in the put it makes
    /// anyway); keys put before it was set, or by `etcdctl lock`, carry none.
    fn set_owner_label(&self, label: &str) {
        *self
            .shared
            .owner_label
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Arc::from(label.as_bytes());
    }

    /// One range read of the prefix (each queue's oldest key holds its lock; waiters and
    /// semaphores are left out), then one lease read per held lock for its time to live.
    fn store_locks<'a>(
        &'a self,
        known: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<crate::StoreLock>, LockError>> {
        Box::pin(self.list_locks(known))
    }

    fn try_acquire<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        Box::pin(async move {
            let lease = request.lease.unwrap_or(self.shared.lease);
            check_lease(lease)?;
            let queue = self.queue_prefix(request.key);
            let Some((queued, sent)) = self.enqueue(&queue, lease, request.renew, true).await?
            else {
                return Ok(None);
            };
            // The lease began when the server granted it, at some moment after `sent`: an
            // answer that comes late leaves too little of it to count on. Such a lock is
            // given back (the claim revokes the lease) and reported lost.
            crate::lease::check_answer_time(request.key, lease, sent.elapsed(), "lock", NAME)?;
            Ok(Some(queued.into_acquired(request.key)))
        })
    }

    fn acquire_wait<'a>(
        &'a self,
        request: LockRequest<'a>,
        timeout: Duration,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        Box::pin(async move {
            let lease = request.lease.unwrap_or(self.shared.lease);
            check_lease(lease)?;
            let deadline = tokio::time::Instant::now().checked_add(timeout);
            let queue = self.queue_prefix(request.key);
            loop {
                let Some((queued, _)) = self.enqueue(&queue, lease, request.renew, false).await?
                else {
                    // A key of the same name exists (a lease id reused after an extension
                    // moved an older key off it): queue again on a new lease.
                    continue;
                };
                match self.wait_turn(&queue, &queued, deadline).await? {
                    Turn::Mine => return Ok(Some(queued.into_acquired(request.key))),
                    Turn::TimedOut => return Ok(None),
                    Turn::Lost => {
                        // Our key or lease went while we waited: queue again at the back
                        // (the claim revokes the old lease), unless the time is up.
                        if deadline.is_some_and(|at| tokio::time::Instant::now() >= at) {
                            return Ok(None);
                        }
                    }
                }
            }
        })
    }
}

/// A held etcd lock.
struct EtcdHeld {
    /// The lock's name, as the caller gave it.
    name: Arc<str>,
    entry: Arc<Entry>,
    /// Its keeper, stopped when the lock is released or this handle dropped.
    keeper: Option<Keeper>,
    /// A permit of a semaphore (whose other keys are other holders, not a takeover).
    permit: bool,
}

impl Drop for EtcdHeld {
    /// Revokes the lease on the backend's own runtime: after a release, and just as well
    /// without one (the guard went with its runtime's shutdown, which refused the release's
    /// task, or the release future was dropped), when it takes the key with it at once rather
    /// than when its TTL runs out.
    fn drop(&mut self) {
        drop(self.keeper.take());
        self.entry.shared.revoke_later(self.entry.lease_id());
    }
}

impl std::fmt::Debug for EtcdHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdHeld")
            .field("name", &self.name)
            .field("key", &String::from_utf8_lossy(&self.entry.key))
            .field("revision", &self.entry.revision)
            .finish_non_exhaustive()
    }
}

impl HeldLock for EtcdHeld {
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        let released = self.release_outcome();
        Box::pin(async move { released.await.map(drop) })
    }

    fn release_outcome(
        mut self: Box<Self>,
    ) -> BoxFuture<'static, Result<ReleaseOutcome, LockError>> {
        Box::pin(async move {
            drop(self.keeper.take());
            let entry = &self.entry;
            let shared = &entry.shared;
            let head = GetOptions::new()
                .with_prefix()
                .with_limit(1)
                .with_keys_only();
            let queue = queue_of(&entry.key);
            let txn = Txn::new()
                .when([Compare::create_revision(
                    entry.key.clone(),
                    CompareOp::Equal,
                    entry.revision,
                )])
                .and_then([TxnOp::delete(entry.key.clone(), None)])
                .or_else([TxnOp::get(queue, Some(head))]);
            let answer = shared.txn("releasing a lock", txn).await;
            let lease_id = entry.lease_id();
            let (answer, attempts) = match answer {
                Ok(answered) => answered,
                Err(err) => {
                    // The lease goes anyway (and with it the key, if the delete did not run):
                    // dropping the handle revokes it.
                    return Err(err);
                }
            };
            let outcome = if answer.succeeded() {
                ReleaseOutcome::Released
            } else if attempts > 1 && shared.lease_alive(lease_id).await.unwrap_or(false) {
                // An attempt whose answer was lost deleted it: the key cannot have expired
                // while its lease lives.
                ReleaseOutcome::Released
            } else if !self.permit && first_kv(&answer).is_some() {
                ReleaseOutcome::NotOwned
            } else {
                ReleaseOutcome::AlreadyReleased
            };
            if outcome != ReleaseOutcome::Released {
                entry.lost.cancel();
            }
            // Dropping the handle revokes the lease.
            Ok(outcome)
        })
    }

    fn lease_control(&self) -> Option<&dyn LeaseControl> {
        Some(self)
    }
}

/// The first key-value pair of the first read in a transaction's answer.
fn first_kv(answer: &TxnResponse) -> Option<etcd_client::KeyValue> {
    answer.op_responses().into_iter().find_map(|op| match op {
        TxnOpResponse::Get(get) => get.kvs().first().cloned(),
        _ => None,
    })
}

/// The queue prefix of an entry's key: up to and including its last `/`.
fn queue_of(key: &[u8]) -> Vec<u8> {
    let end = key.iter().rposition(|&b| b == b'/').map_or(0, |at| at + 1);
    key[..end].to_vec()
}

impl LeaseControl for EtcdHeld {
    fn extend(&self, lease: Duration) -> BoxFuture<'_, Result<bool, LockError>> {
        Box::pin(async move {
            check_lease(lease)?;
            let entry = &self.entry;
            let shared = &entry.shared;
            let sent = Instant::now();
            let lease_id = shared.grant(lease).await?;
            let mut claim = Claim {
                shared: Arc::clone(shared),
                lease_id,
                armed: true,
            };
            // Moves the key (value kept) to the new lease, if it is still ours.
            let txn = Txn::new()
                .when([Compare::create_revision(
                    entry.key.clone(),
                    CompareOp::Equal,
                    entry.revision,
                )])
                .and_then([TxnOp::put(
                    entry.key.clone(),
                    [],
                    Some(PutOptions::new().with_lease(lease_id).with_ignore_value()),
                )]);
            let (answer, _) = shared.txn("extending a lock", txn).await?;
            if !answer.succeeded() {
                entry.lost.cancel();
                return Ok(false);
            }
            claim.armed = false;
            let old = entry.moved(lease_id, lease, sent);
            shared.revoke_later(old);
            Ok(true)
        })
    }

    fn verify_still_held(&self) -> BoxFuture<'_, Result<bool, LockError>> {
        Box::pin(async move {
            let entry = &self.entry;
            let answer = entry
                .shared
                .retrying("reading a lock", || {
                    let mut client = entry.shared.client.kv_client();
                    let options = GetOptions::new().with_keys_only();
                    let key = entry.key.clone();
                    async move { client.get(key, Some(options)).await }
                })
                .await?;
            let held = answer
                .kvs()
                .first()
                .is_some_and(|kv| kv.create_revision() == entry.revision);
            if !held {
                entry.lost.cancel();
            }
            Ok(held)
        })
    }

    fn stop_renewal(&self) {
        self.entry.stop_renewal();
    }

    fn start_renewal(&self) -> Result<bool, LockError> {
        Ok(self.entry.start_renewal())
    }
}

impl crate::backend::ForceRelease for EtcdBackend {
    /// Deletes the head of the key's queue (the holder's key, on the holder's lease): the
    /// holder's watch of its key sees the delete and fires its lost token, and the next key in
    /// the queue, whose waiter watches the key ahead of it, holds the lock. Fencing tokens are
    /// create revisions, which only grow. The delete is conditional on the head's create
    /// revision, so a holder that gave the lock back meanwhile is not mistaken for another.
    fn force_release<'a>(&'a self, key: &'a str) -> BoxFuture<'a, Result<bool, LockError>> {
        Box::pin(async move {
            let shared = &self.shared;
            let queue = self.queue_prefix(key);
            let head = GetOptions::new()
                .with_prefix()
                .with_sort(SortTarget::Create, SortOrder::Ascend)
                .with_limit(1);
            let (answer, _) = shared
                .txn(
                    "ending a lock by force",
                    Txn::new().and_then([TxnOp::get(queue.clone(), Some(head))]),
                )
                .await?;
            let Some(holder) = first_kv(&answer) else {
                return Ok(false);
            };
            let (holder_key, revision) = (holder.key().to_vec(), holder.create_revision());
            let delete = Txn::new()
                .when([Compare::create_revision(
                    holder_key.clone(),
                    CompareOp::Equal,
                    revision,
                )])
                .and_then([TxnOp::delete(holder_key, None)]);
            let (answer, _) = shared.txn("ending a lock by force", delete).await?;
            Ok(answer.succeeded())
        })
    }
}

/// A lease is 100 ms to 365 days.
fn check_lease(lease: Duration) -> Result<Duration, LockError> {
    crate::lease::check_lease("the etcd `lease`", lease)
}

/// Maps a client error to a [`LockError`], saying what was being done.
/// Whether the cause of `err` is a connection the other side refused.
fn refused(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut cause = Some(err);
    while let Some(err) = cause {
        if err
            .downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
        {
            return true;
        }
        cause = err.source();
    }
    false
}

fn etcd_error(what: &str, err: etcd_client::Error) -> LockError {
    use etcd_client::Error;
    use tonic::Code;
    match &err {
        Error::GRpcStatus(status) if status.code() == Code::Unavailable && refused(status) => {
            LockError::unavailable(
                NAME,
                format!(
                    "{what}: the connection was refused ({}); is an etcd member listening there?",
                    status.message()
                ),
                Some(Box::new(err)),
            )
        }
        Error::GRpcStatus(status) => {
            let code = status.code();
            let message = format!("{what}: the server answered {code:?}: {}", status.message());
            match code {
                Code::Unauthenticated => LockError::config(format!(
                    "{message} (check the user name and password of the etcd URL)"
                )),
                Code::PermissionDenied
                | Code::InvalidArgument
                | Code::FailedPrecondition
                | Code::OutOfRange
                | Code::AlreadyExists
                | Code::NotFound
                | Code::ResourceExhausted
                | Code::Unimplemented => LockError::backend(
                    NAME,
                    message,
                    Some(format!("{code:?}")),
                    Some(Box::new(err)),
                ),
                _ => LockError::unavailable(NAME, message, Some(Box::new(err))),
            }
        }
        Error::InvalidArgs(_) | Error::InvalidUri(_) => {
            LockError::config(format!("{what}: the etcd endpoints are not valid ({err})"))
        }
        _ => LockError::unavailable(NAME, format!("{what}: {err}"), Some(Box::new(err))),
    }
}

const FORM: UrlForm = UrlForm {
    backend: "etcd",
    schemes: &["etcd"],
    example: "etcd://host1:2379,host2:2379,host3:2379?lease=30s",
};

url_keys! {
    /// The etcd URL options.
    enum EtcdOption for FORM {
        Lease = "lease",
        Prefix = "prefix",
        Timeout = "timeout",
        ConnectTimeout = "connect_timeout",
        RenewEvery = "renew_every",
    }
}

fn parse_url(url: &str) -> Result<EtcdBuilder, LockError> {
    let (rest, query) = FORM.split(url)?;
    let Some(authority) = rest.strip_prefix("//") else {
        return Err(FORM.error("has no hosts after the scheme"));
    };
    let authority = authority.strip_suffix('/').unwrap_or(authority);
    if authority.contains('/') {
        return Err(FORM.error("has a path; it names hosts only"));
    }
    let (user, hosts) = match authority.rsplit_once('@') {
        Some((userinfo, hosts)) => {
            let (name, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
            let decode = |text: &str, what: &str| {
                percent_decode(text).ok_or_else(|| {
                    FORM.error(format_args!(
                        "has a {what} that is not percent-encoded UTF-8"
                    ))
                })
            };
            let name = decode(name, "user name")?;
            if name.is_empty() {
                return Err(FORM.error("has a password but no user name"));
            }
            (Some((name, decode(password, "password")?)), hosts)
        }
        None => (None, authority),
    };
    let mut endpoints = Vec::new();
    for host in hosts.split(',') {
        endpoints.push(endpoint(host)?);
    }
    let mut builder = EtcdBuilder::on(Source::Endpoints { endpoints, user });
    read_query(query, |key: EtcdOption, value| {
        let name = key.as_ref();
        match key {
            EtcdOption::Lease => builder.lease = check_lease(parse_duration(name, &value)?)?,
            EtcdOption::Prefix => builder.prefix = value,
            EtcdOption::Timeout => {
                builder.timeout = check_limit("the etcd `timeout`", parse_duration(name, &value)?)?;
            }
            EtcdOption::ConnectTimeout => {
                builder.connect_timeout =
                    check_limit("the etcd `connect_timeout`", parse_duration(name, &value)?)?;
            }
            EtcdOption::RenewEvery => {
                let cadence = parse_duration(name, &value)?;
                crate::lease::check_cadence("the etcd `renew_every`", cadence)?;
                builder.renew_every = Some(cadence);
            }
        }
        Ok(())
    })?;
    Ok(builder)
}

/// `host[:port]` as the client's endpoint `http://host:port`.
fn endpoint(host: &str) -> Result<String, LockError> {
    if host.is_empty() {
        return Err(FORM.error("has an empty host (hosts are separated by single commas)"));
    }
    let parsed = url::Url::parse(&format!("http://{host}"))
        .ok()
        .filter(|parsed| parsed.path() == "/" && parsed.query().is_none())
        .filter(|parsed| parsed.username().is_empty() && parsed.password().is_none());
    let Some(parsed) = parsed else {
        return Err(FORM.error(format_args!(
            "has a host that is not `host` or `host:port` (`{}`)",
            crate::options::shown(host)
        )));
    };
    let Some(name) = parsed.host_str().filter(|name| !name.is_empty()) else {
        return Err(FORM.error("has an empty host"));
    };
    let port = parsed.port().unwrap_or(DEFAULT_PORT);
    Ok(format!("http://{name}:{port}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoints(builder: &EtcdBuilder) -> (&[String], Option<&(String, String)>) {
        match &builder.source {
            Source::Endpoints { endpoints, user } => (endpoints, user.as_ref()),
            Source::Client(_) => panic!("a client"),
        }
    }

    #[test]
    fn urls() {
        crate::options::assert_keys::<EtcdOption, _>(parse_url("etcd://h/?bogus=1"));
        let b = parse_url(
            "etcd://127.0.0.1:1,[::1]:2,host?lease=2s&prefix=locks/&timeout=1s&connect_timeout=3s&renew_every=250ms",
        )
        .unwrap();
        assert_eq!(
            endpoints(&b).0,
            ["http://127.0.0.1:1", "http://[::1]:2", "http://host:2379"]
        );
        assert_eq!(b.lease, Duration::from_secs(2));
        assert_eq!(b.prefix, "locks/");
        assert_eq!(b.timeout, Duration::from_secs(1));
        assert_eq!(b.connect_timeout, Duration::from_secs(3));
        assert_eq!(b.renew_every, Some(Duration::from_millis(250)));
        let b = parse_url("ETCD://u%40x:p%3Aw@h:7/").unwrap();
        let (hosts, user) = endpoints(&b);
        assert_eq!(hosts, ["http://h:7"]);
        assert_eq!(user, Some(&("u@x".to_owned(), "p:w".to_owned())));
        assert_eq!(b.lease, DEFAULT_LEASE);
        assert_eq!(b.prefix, DEFAULT_PREFIX);
        for bad in [
            "etcd://h/?lease=soon",
            "etcd://h/?lease=10ms",
            "etcd://h/?timeout=0s",
            "etcd://h/?renew_every=1ms",
            "etcd://h/?colour=blue",
            "etcd://h1,,h2",
            "etcd://",
            "etcd:h",
            "etcd://h/path",
            "etcd://h:99999",
            "etcd://user:hunter2@h:x",
            "etcd://:hunter2@h",
            "redis://h",
        ] {
            let err = parse_url(bad).expect_err(bad);
            assert_eq!(err.code(), "DistributedLock.Configuration", "{bad}: {err}");
            assert!(!err.to_string().contains("hunter2"), "{err}");
        }
    }

    #[test]
    fn queues_never_nest() {
        assert_eq!(queue_prefix(b"p/", "a/b%c"), b"p/a%2Fb%25c/".to_vec());
        assert_eq!(queue_prefix(b"", "%2F"), b"%252F/".to_vec());
        assert_ne!(queue_prefix(b"p/", "a/b"), queue_prefix(b"p/", "a%2Fb"));
        let long = "é".repeat(200);
        let short = queue_prefix(b"p/", &long);
        assert_eq!(
            short.len(),
            2 + 64 + 2 + 64 + 1,
            "{}",
            String::from_utf8_lossy(&short)
        );
        assert!(short.starts_with(format!("p/{}%#", "é".repeat(32)).as_bytes()));
        assert_ne!(short, queue_prefix(b"p/", &format!("{long}x")));
        let edge = "x".repeat(LONG_NAME);
        assert_eq!(queue_prefix(b"", &edge), format!("{edge}/").into_bytes());
        let key = entry_key(b"p/k/", 0x1f);
        assert_eq!(key, b"p/k/1f".to_vec());
        assert_eq!(queue_of(&key), b"p/k/".to_vec());
    }

    #[test]
    fn ttls_round_up() {
        assert_eq!(ttl_seconds(Duration::from_millis(100)), 1);
        assert_eq!(ttl_seconds(Duration::from_secs(2)), 2);
        assert_eq!(ttl_seconds(Duration::from_millis(2001)), 3);
        assert_eq!(ttl_seconds(crate::time::MAX_SETTING), 365 * 86_400);
    }
}
