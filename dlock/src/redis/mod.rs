#![doc = include_str!("docs.md")]

mod bounded;
mod cluster;
mod commands;
mod fair;
mod fence;
mod force;
mod hosts;
mod inspect;
mod owner;
mod permits;
mod quorums;
mod read;
mod redlock;
mod renewals;
mod sentinel;
mod subscribers;
mod token;
mod wake;

use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{ErrorKind, RedisError, ServerErrorKind};
use tokio_util::sync::CancellationToken;

use crate::LockError;
use crate::backend::{
    Acquired, BoxFuture, HeldLock, LeaseControl, LockBackend, LockRequest, ReleaseWatch, WaitTry,
};
use crate::key::validate_key;
use crate::lease::DEFAULT_LEASE;
use crate::options::{UrlForm, parse_bool, parse_duration, read_query, url_keys};
use crate::settling::Settling;
use crate::time::check_limit;

use commands::Conn;
pub use commands::{CommandPath, ReleaseOutcome};
pub use fence::ConnectionFencing;
use fence::{Attempt, Fence, fenced};
pub use redlock::RedlockBackend;
use renewals::Renewals;
pub use token::OwnerToken;

const NAME: &str = "redis";
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);
const DEFAULT_PREFIX: &str = "dlock:";

/// The Redis / Valkey backend. Usually made through
/// [`LockProvider::connect`](crate::LockProvider::connect) with a `redis://` or `rediss://` URL;
/// see the [module docs](self).
///
/// Besides serving a [`LockProvider`](crate::LockProvider), it has a **raw-token API** for locks
/// that several processes share under a token they agree on: [`try_take`](RedisBackend::try_take),
/// [`reset_expiry`](RedisBackend::reset_expiry), [`release`](RedisBackend::release),
/// [`owner_token`](RedisBackend::owner_token), [`verify_still_held`](RedisBackend::verify_still_held).
/// These do not renew anything: the lock lives as long as its lease unless someone resets it.
#[derive(Clone)]
pub struct RedisBackend {
    shared: Arc<Shared>,
}

struct Shared {
    conn: Conn,
    lease: Duration,
    prefix: Vec<u8>,
    layout: KeyLayout,
    fencing: bool,
    /// The shared counters of `fencing_counters`, if set.
    counters: Option<bounded::Counters>,
    /// Without them, the check that the store never had them.
    per_key: bounded::PerKey,
    timeout: Duration,
    /// The renewal cadence set by the application, if any.
    renew_every: Option<Duration>,
    /// `WAIT` after each acquisition: for how many replicas, and how long at most.
    wait: Option<(u32, Duration)>,
    renewals: Arc<Renewals>,
    /// Where this backend's waiting writers left intents (see [Read locks](self#read-locks)).
    intents: read::Intents,
    /// The subscribers that wake this backend's waiters (see [Waiting](self#waiting)).
    wakes: subscribers::Subscribers,
    /// Keys given back to waiters elsewhere (see [Fair waiting](self#fair-waiting)); `None`
    /// with `fair_waits=false`.
    hold_offs: Option<Arc<fair::HoldOffs>>,
    /// The clean-ups of abandoned acquisitions under way (see [Cancellation](self#cancellation)).
    settling: Arc<Settling<Arc<[u8]>>>,
    /// The backend's id (the first half of its owner tokens) and owner label.
    owner_label: owner::OwnerLabel,
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Lets the renewal driver see that the backend is gone and end.
        self.renewals.shut_down();
        self.wakes.shut_down();
    }
}

enum Source {
    Client(Box<redis::Client>),
    Manager(ConnectionManager),
    Sentinel(Box<sentinel::Sentinels>),
    /// A Redis Cluster; with a URL, a client for its first node, whose address and
    /// credentials the subscribers of wake-ups connect with (see `subscribers.rs`), and the
    /// addresses of the URL's nodes, for error messages.
    Cluster(Box<(redis::cluster::ClusterClient, Option<redis::Client>, String)>),
}

/// The default [`RedisBuilder::check_master_every`].
const DEFAULT_CHECK_MASTER_EVERY: Duration = Duration::from_secs(1);

/// The default [`RedisBuilder::wait_timeout`].
const DEFAULT_WAIT_TIMEOUT: Duration = Duration::from_secs(1);

/// Builds a [`RedisBackend`] with options.
#[must_use]
pub struct RedisBuilder {
    source: Source,
    lease: Duration,
    prefix: String,
    layout: KeyLayout,
    fencing: bool,
    fencing_counters: Option<u32>,
    timeout: Duration,
    renew_every: Option<Duration>,
    /// CA certificates (PEM) that replace the system's roots for `rediss://`.
    ca: Option<Vec<u8>>,
    wait_replicas: u32,
    wait_timeout: Duration,
    check_master_every: Duration,
    fair_waits: bool,
    /// A Sentinel setting given to a builder that is not on sentinels.
    misuse: Option<&'static str>,
}

impl std::fmt::Debug for RedisBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBuilder")
            .field("lease", &self.lease)
            .field("prefix", &self.prefix)
            .field("layout", &self.layout)
            .field("fencing", &self.fencing)
            .field("fencing_counters", &self.fencing_counters)
            .field("timeout", &self.timeout)
            .field("ca", &self.ca.as_ref().map(|_| "(PEM)"))
            .field("wait_replicas", &self.wait_replicas)
            .field("wait_timeout", &self.wait_timeout)
            .field("fair_waits", &self.fair_waits)
            .finish_non_exhaustive()
    }
}

impl RedisBuilder {
    fn on(source: Source) -> RedisBuilder {
        RedisBuilder {
            source,
            lease: DEFAULT_LEASE,
            prefix: DEFAULT_PREFIX.to_owned(),
            layout: KeyLayout::Tagged,
            fencing: true,
            fencing_counters: None,
            timeout: DEFAULT_TIMEOUT,
            renew_every: None,
            ca: None,
            wait_replicas: 0,
            wait_timeout: DEFAULT_WAIT_TIMEOUT,
            check_master_every: DEFAULT_CHECK_MASTER_EVERY,
            fair_waits: true,
            misuse: None,
        }
    }

    fn sentinels(&mut self, setting: &'static str) -> Option<&mut sentinel::Sentinels> {
        match &mut self.source {
            Source::Sentinel(sentinels) => Some(sentinels),
            _ => {
                self.misuse = Some(setting);
                None
            }
        }
    }

    /// Behind Sentinel: the user name (`None` for the default user) and password the
    /// **sentinels** ask for (`requirepass` / ACL of the sentinel processes). Without it the
    /// sentinels are asked without authentication. The URL options are `sentinel_username`
    /// and `sentinel_password`. On a builder that is not on sentinels,
    /// [`connect`](RedisBuilder::connect) answers [`LockError::Config`].
    pub fn sentinel_credentials(mut self, username: Option<&str>, password: &str) -> Self {
        if let Some(sentinels) = self.sentinels("sentinel_credentials") {
            let mut auth = std::mem::take(&mut sentinels.auth).set_password(password);
            if let Some(username) = username {
                auth = auth.set_username(username);
            }
            sentinels.auth = auth;
        }
        self
    }

    /// Behind Sentinel: the user name (`None` for the default user) and password of the
    /// **master** (and of any replica promoted in its place), as a `redis+sentinel://` URL's
    /// user information gives them. On a builder that is not on sentinels,
    /// [`connect`](RedisBuilder::connect) answers [`LockError::Config`] (a `redis::Client`
    /// carries its own credentials).
    pub fn master_credentials(mut self, username: Option<&str>, password: &str) -> Self {
        if let Some(sentinels) = self.sentinels("master_credentials") {
            let mut master = std::mem::take(&mut sentinels.master).set_password(password);
            if let Some(username) = username {
                master = master.set_username(username);
            }
            sentinels.master = master;
        }
        self
    }

    /// Behind Sentinel: reaches the sentinels and the master (and any replica promoted in its
    /// place) over TLS, as a `rediss+sentinel://` URL does, trusting the system's root
    /// certificates or those of [`ca_certificates`](RedisBuilder::ca_certificates). See
    /// [TLS](self#tls). On a builder that is not on sentinels,
    /// [`connect`](RedisBuilder::connect) answers [`LockError::Config`] (a `redis::Client`
    /// carries its own TLS settings).
    pub fn sentinel_tls(mut self) -> Self {
        if let Some(sentinels) = self.sentinels("sentinel_tls") {
            sentinels.tls.get_or_insert_with(HostTls::default);
        }
        self
    }

    /// Behind Sentinel: how often the sentinels are asked whether the master in use still is
    /// the master (default 1 s; 10 ms to 365 days), besides right after any failure that may
    /// mean it moved. Each check asks a sentinel one question, on a connection the backend
    /// keeps open to it (opened again only after it failed); a command that finds a check
    /// due waits for that one round trip. After a failover that leaves the old
    /// master running, this is how long the backend may go on writing to it (see
    /// [Sentinel](self#sentinel)). URL option `check_master_every`. On a builder that is not
    /// on sentinels, [`connect`](RedisBuilder::connect) answers [`LockError::Config`].
    pub fn check_master_every(mut self, every: Duration) -> Self {
        if self.sentinels("check_master_every").is_some() {
            self.check_master_every = every;
        }
        self
    }

    /// Behind Sentinel: the master's database number (default 0; the URL's `/SERVICE/db`).
    /// On a builder that is not on sentinels, [`connect`](RedisBuilder::connect) answers
    /// [`LockError::Config`].
    pub fn database(mut self, db: i64) -> Self {
        if let Some(sentinels) = self.sentinels("database") {
            sentinels.master = std::mem::take(&mut sentinels.master).set_db(db);
        }
        self
    }

    /// After each acquisition's write succeeds, waits until `replicas` replicas have it
    /// (`WAIT replicas timeout`, on the same connection), for at most
    /// [`wait_timeout`](RedisBuilder::wait_timeout); fewer in time and the lock is given back
    /// and the acquisition answers [`LockError::Unavailable`]. 0 (the default) waits for
    /// nothing. URL option `wait_replicas`. See [Replicas and failover](self#replicas-and-failover)
    /// for what this does and does not guarantee, and what it costs. Exclusive locks, readers'
    /// shares and semaphore permits all wait.
    pub fn wait_replicas(mut self, replicas: u32) -> Self {
        self.wait_replicas = replicas;
        self
    }

    /// How long an acquisition waits for [`wait_replicas`](RedisBuilder::wait_replicas)
    /// (default 1 s; above zero and below the command `timeout`, checked by
    /// [`connect`](RedisBuilder::connect)). URL option `wait_timeout`.
    pub fn wait_timeout(mut self, timeout: Duration) -> Self {
        self.wait_timeout = timeout;
        self
    }

    /// Trusts these CA certificates (PEM, one or more) for `rediss://`, **instead of** the
    /// system's root certificates: a private CA, as inside many clusters. The server's
    /// certificate must be signed by one of them and carry the host name (or IP address) the
    /// URL names. Checked by [`connect`](RedisBuilder::connect): PEM without a certificate, a
    /// `redis://` (plain) client, or a builder on an existing connection manager (which brings
    /// its own TLS settings) is a [`LockError::Config`]. The URL's `ca` option reads such a
    /// file.
    pub fn ca_certificates(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.ca = Some(pem.into());
        self
    }

    /// Uses a connection manager the application already has instead of opening one.
    pub fn manager(mut self, manager: ConnectionManager) -> Self {
        self.source = Source::Manager(manager);
        self
    }

    /// The lease of each lock (default 30 s, at least 100 ms, at most 365 days). Renewed every
    /// third of it. Checked by [`connect`](RedisBuilder::connect).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// Prepended to every lock key (default `dlock:`); may not contain `{` or `}` in the
    /// default [`KeyLayout::Tagged`].
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How a lock's name becomes its Redis key (default [`KeyLayout::Tagged`]; see
    /// [Keys](self#keys)). [`KeyLayout::Plain`] stores the lock `k` under `prefix + k` as it
    /// is, for clients that are not dlock and lock the same key with the same owner-token
    /// protocol. The URL option is `key_layout=plain`.
    pub fn key_layout(mut self, layout: KeyLayout) -> Self {
        self.layout = layout;
        self
    }

    /// Whether acquisitions issue fencing tokens (default `true`). Fencing takes the lock with
    /// a Lua script; without it, acquisition is a plain `SET NX PX`.
    pub fn fencing(mut self, fencing: bool) -> Self {
        self.fencing = fencing;
        self
    }

    /// Keep at most `counters` fencing counters (1 to 65,536) instead of one per key ever
    /// locked: a key's tokens come from counter number
    /// [`fencing_counter`](crate::fencing_counter)`(key, counters)` and still increase
    /// strictly per key (see [Bounded fencing counters](self#bounded-fencing-counters)).
    /// Checked by [`connect`](RedisBuilder::connect); needs `fencing`. The URL option is
    /// `fencing_counters=N`.
    pub fn fencing_counters(mut self, counters: u32) -> Self {
        self.fencing_counters = Some(counters);
        self
    }

    /// Whether waiters of this backend let waiters of other backends go first after a release
    /// that woke them (default `true`; see [Fair waiting](self#fair-waiting)). With `false`,
    /// this process's next waiter tries at once after its own release, as a plain client
    /// would: more acquisitions per second on a key that many processes take in turn, and an
    /// uneven share among them. The URL option is `fair_waits=false`.
    pub fn fair_waits(mut self, fair: bool) -> Self {
        self.fair_waits = fair;
        self
    }

    /// Limit for connecting and for each command (default 5 s; above zero, at most 365 days).
    /// Checked by [`connect`](RedisBuilder::connect). A lease shorter than it is allowed; see
    /// the [module docs](self#url) for the effect.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How often held locks are renewed (default: every third of each lock's lease; 10 ms to
    /// 365 days, checked by [`connect`](RedisBuilder::connect)). A cadence longer than half of
    /// a lock's lease is cut to that half, so that failed renewals can still be retried before
    /// the lock's local deadline. Shorter cadences cost more commands and find a lost lock
    /// sooner.
    pub fn renew_every(mut self, cadence: Duration) -> Self {
        self.renew_every = Some(cadence);
        self
    }

    /// Connects (unless built on an existing manager) and makes the backend. A lease, timeout
    /// or prefix out of bounds is a [`LockError::Config`], before anything is sent.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: dropping the future closes the connection it was opening.
    pub async fn connect(self) -> Result<RedisBackend, LockError> {
        check_lease(self.lease)?;
        check_limit("the redis `timeout`", self.timeout)?;
        if let Some(cadence) = self.renew_every {
            crate::lease::check_cadence("the redis `renew_every`", cadence)?;
        }
        crate::lease::check_cadence("the redis `check_master_every`", self.check_master_every)?;
        if let Some(setting) = self.misuse {
            return Err(LockError::config(format!(
                "the redis builder's `{setting}` applies to a backend behind Redis Sentinel \
                 (RedisBackend::sentinel_builder or a redis+sentinel:// URL)"
            )));
        }
        let wait = if self.wait_replicas == 0 {
            None
        } else {
            if self.wait_timeout.is_zero() || self.wait_timeout >= self.timeout {
                return Err(LockError::config(format!(
                    "the redis `wait_timeout` ({:?}) must be above zero and below the command \
                     `timeout` ({:?}), which bounds the acquisition and its WAIT together",
                    self.wait_timeout, self.timeout
                )));
            }
            Some((self.wait_replicas, self.wait_timeout))
        };
        if let Some(n) = self.fencing_counters {
            crate::counters::check(n)?;
            if !self.fencing {
                return Err(LockError::config(
                    "the redis option `fencing_counters` bounds the fencing counters, but \
                     `fencing` is off: turn fencing on, or drop fencing_counters",
                ));
            }
        }
        if self.layout == KeyLayout::Tagged && self.prefix.contains(['{', '}']) {
            return Err(LockError::config(
                "the redis key prefix may not contain `{` or `}`: the lock keys use braces as their \
                 Cluster hash tag (with `key_layout=plain` it may)",
            ));
        }
        if self.fencing_counters.is_some() && matches!(self.source, Source::Cluster(_)) {
            // The shared counters and their record live in slots of their own, which no
            // acquisition's script may reach on a Cluster (CROSSSLOT).
            return Err(LockError::config(
                "the redis option `fencing_counters` does not work on a Redis Cluster: the shared \
                 counters live in slots of their own, outside the locks'; drop it (one counter \
                 per key)",
            ));
        }
        let mut found_master = None;
        let mut on_cluster = None;
        let (manager, rebuild): (cluster::Link, _) = match self.source {
            Source::Cluster(_) if self.ca.is_some() => {
                return Err(LockError::config(
                    "the redis `ca` applies to connections dlock opens; a ClusterClient brings \
                     its own TLS settings (ClusterClientBuilder::certs), or use a \
                     rediss+cluster:// URL with the option `ca`",
                ));
            }
            Source::Cluster(source) => {
                let (client, subscribe, nodes) = *source;
                let cluster = cluster::Cluster {
                    client,
                    config: cluster::cluster_config(self.timeout),
                };
                let what = if nodes.is_empty() {
                    "connecting to the cluster".to_owned()
                } else {
                    format!("connecting to the cluster at {nodes}")
                };
                let connection = within_connect(
                    self.timeout,
                    &what,
                    self.prefix.as_bytes(),
                    cluster.connect(),
                )
                .await?;
                on_cluster = Some((cluster, subscribe));
                (cluster::Link::Cluster(connection), None)
            }
            Source::Sentinel(ref sentinels) if self.ca.is_some() && sentinels.tls.is_none() => {
                return Err(LockError::config(
                    "the redis `ca` needs a TLS connection: use a rediss+sentinel:// URL (or \
                     RedisBuilder::sentinel_tls)",
                ));
            }
            Source::Sentinel(sentinels) if sentinels.nodes.is_empty() => {
                return Err(LockError::config(
                    "RedisBackend::sentinel_builder was given no sentinel address",
                ));
            }
            Source::Sentinel(sentinels) if sentinels.service.is_empty() => {
                return Err(LockError::config(
                    "RedisBackend::sentinel_builder was given an empty service name (the name \
                     the sentinels monitor the master by)",
                ));
            }
            Source::Sentinel(sentinels) => {
                let mut sentinels = *sentinels;
                sentinels.timeout = self.timeout;
                sentinels.check_every = self.check_master_every;
                sentinels.links = Arc::default();
                if let (Some(tls), Some(pem)) = (&mut sentinels.tls, self.ca.clone()) {
                    check_ca(&pem)?;
                    tls.ca = Some(pem);
                }
                let found = within_connect(
                    self.timeout * 2,
                    "finding the master through the sentinels",
                    self.prefix.as_bytes(),
                    sentinels.discover(None),
                )
                .await?;
                let config = manager_config(self.timeout);
                let Some(client) = found.client else {
                    return Err(LockError::unavailable(
                        NAME,
                        "the sentinels named no master",
                        None,
                    ));
                };
                let connecting = ConnectionManager::new_with_config(client.clone(), config.clone());
                let manager = within_connect(
                    self.timeout,
                    &format!(
                        "connecting to the master {}",
                        client.get_connection_info().addr()
                    ),
                    self.prefix.as_bytes(),
                    connecting,
                )
                .await?;
                found_master = Some((sentinels, found.addr));
                (manager.into(), Some((client, config)))
            }
            Source::Manager(_) if self.ca.is_some() => {
                return Err(LockError::config(
                    "the redis `ca` applies to connections dlock opens; a ConnectionManager \
                     brings its own TLS settings (build its client with \
                     redis::Client::build_with_tls)",
                ));
            }
            Source::Manager(manager) => (manager.into(), None),
            Source::Client(client) => {
                let client = match self.ca {
                    Some(pem) => with_ca(&client, pem)?,
                    None => *client,
                };
                let tls = matches!(
                    client.get_connection_info().addr(),
                    redis::ConnectionAddr::TcpTls { .. }
                );
                if tls {
                    use_default_crypto();
                }
                let config = manager_config(self.timeout);
                let connecting = ConnectionManager::new_with_config(client.clone(), config.clone());
                match tokio::time::timeout(self.timeout, connecting).await {
                    Ok(Ok(manager)) => (manager.into(), Some((client, config))),
                    Ok(Err(err)) => {
                        let what = format!("connecting to {}", client.get_connection_info().addr());
                        return Err(connect_error(&what, err, self.prefix.as_bytes()));
                    }
                    Err(_) => {
                        // A port that does not speak TLS never answers the client's
                        // hello: the handshake waits for the timeout.
                        let hint = if tls {
                            " (TLS: no TLS handshake completed; is the port a TLS port, \
                             `tls-port` of the server?)"
                        } else {
                            ""
                        };
                        return Err(LockError::unavailable(
                            NAME,
                            format!("connecting timed out after {:?}{hint}", self.timeout),
                            None,
                        ));
                    }
                }
            }
        };
        let own_client = rebuild.is_some();
        let mut conn = Conn::new(manager, rebuild).marking_waits(self.layout == KeyLayout::Tagged);
        if let Some((sentinels, addr)) = found_master {
            conn = conn.with_sentinels(sentinels, addr);
        }
        // The subscriber reconnects with the client the connection uses at the time: behind
        // Sentinel, the master's after a failover. On a cluster, each master's.
        let hold_offs = self.fair_waits.then(|| Arc::new(fair::HoldOffs::default()));
        let heard = hold_offs.as_ref().map(|hold_offs| wake::Heard {
            own: conn.announcer(),
            hold_offs: Arc::clone(hold_offs),
        });
        let mut wakes = subscribers::Subscribers::One(Arc::new(wake::Wakes::new(
            own_client.then(|| conn.client_slot()),
            self.timeout,
            heard.clone(),
        )));
        if let Some((cluster, subscribe)) = on_cluster {
            conn = conn.with_cluster(cluster);
            wakes = match subscribe {
                Some(client) => {
                    subscribers::Subscribers::PerMaster(Box::new(subscribers::PerMaster::new(
                        client,
                        manager_config(self.timeout),
                        self.timeout,
                        heard,
                    )))
                }
                None => subscribers::Subscribers::One(Arc::new(wake::Wakes::new(
                    None,
                    self.timeout,
                    None,
                ))),
            };
        }
        conn.watch_runtime(true);
        let counters = self
            .fencing_counters
            .map(|n| bounded::Counters::new(n, self.prefix.as_bytes(), self.layout));
        let per_key = bounded::PerKey::new(self.prefix.as_bytes(), self.layout);
        Ok(RedisBackend {
            shared: Arc::new(Shared {
                conn,
                lease: self.lease,
                prefix: self.prefix.into_bytes(),
                layout: self.layout,
                fencing: self.fencing,
                counters,
                per_key,
                timeout: self.timeout,
                renew_every: self.renew_every,
                wait,
                renewals: Arc::default(),
                intents: read::Intents::default(),
                wakes,
                hold_offs,
                settling: Arc::default(),
                owner_label: owner::OwnerLabel::new()?,
            }),
        })
    }
}

/// How the backend's connection managers are configured.
fn manager_config(timeout: Duration) -> ConnectionManagerConfig {
    ConnectionManagerConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout))
        .set_number_of_retries(2)
}

impl RedisBackend {
    /// A builder for a master behind Redis Sentinel: `sentinels` are the sentinels' addresses
    /// (asked in this order), `service` the name they monitor the master by. Set the
    /// credentials with [`RedisBuilder::master_credentials`] and
    /// [`RedisBuilder::sentinel_credentials`], the database with [`RedisBuilder::database`].
    /// See [Sentinel](self#sentinel).
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), dlock::LockError> {
    /// use dlock::redis::RedisBackend;
    /// let backend = RedisBackend::sentinel_builder(
    ///     [("10.0.0.1", 26379), ("10.0.0.2", 26379), ("10.0.0.3", 26379)],
    ///     "locks",
    /// )
    /// .master_credentials(Some("dlock_app"), "secret")
    /// .wait_replicas(1)
    /// .connect()
    /// .await?;
    /// let locks = dlock::LockProvider::from_backend(backend);
    /// # Ok(()) }
    /// ```
    pub fn sentinel_builder<H: Into<String>>(
        sentinels: impl IntoIterator<Item = (H, u16)>,
        service: impl Into<String>,
    ) -> RedisBuilder {
        let nodes: Vec<(String, u16)> = sentinels
            .into_iter()
            .map(|(host, port)| (host.into(), port))
            .collect();
        let service = service.into();
        RedisBuilder::on(Source::Sentinel(Box::new(sentinel::Sentinels {
            nodes,
            service,
            auth: redis::RedisConnectionInfo::default(),
            master: redis::RedisConnectionInfo::default(),
            tls: None,
            timeout: DEFAULT_TIMEOUT,
            check_every: DEFAULT_CHECK_MASTER_EVERY,
            first: Arc::default(),
            links: Arc::default(),
        })))
    }

    /// Behind Sentinel, the address of the master in use (as the sentinels named it); `None`
    /// for a backend that is not behind Sentinel.
    pub fn sentinel_master(&self) -> Option<(String, u16)> {
        self.shared.conn.master_addr()
    }

    /// A builder for a Redis Cluster on a `redis::cluster::ClusterClient` (which knows the
    /// initial nodes, the credentials and the protocol). The backend's `timeout` replaces the
    /// client's connection and response timeouts; its retries stay as the client sets them:
    /// the driver's default waits at least 1.28 s before each retry (of a `TRYAGAIN` while a
    /// slot migrates, of a lost connection), so that a few retries outlast the command
    /// `timeout`; a `redis+cluster://` URL's client waits 20 ms doubling to 500 ms
    /// (`ClusterClientBuilder::retry_wait_formula(10, 2)`, `min_retry_wait(5)`,
    /// `max_retry_wait(500)`). Waiters of a backend built here poll (the
    /// subscriber of wake-ups needs a node's address, which a `redis+cluster://` URL gives).
    /// See [Cluster](self#cluster).
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), Box<dyn std::error::Error>> {
    /// use dlock::redis::RedisBackend;
    /// let client = redis::cluster::ClusterClient::builder(["redis://10.0.0.1:6379", "redis://10.0.0.2:6379"])
    ///     .password("secret")
    ///     .build()?;
    /// let backend = RedisBackend::cluster_builder(client).connect().await?;
    /// let locks = dlock::LockProvider::from_backend(backend);
    /// # Ok(()) }
    /// ```
    pub fn cluster_builder(client: redis::cluster::ClusterClient) -> RedisBuilder {
        RedisBuilder::on(Source::Cluster(Box::new((client, None, String::new()))))
    }

    /// Whether the backend is on a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        self.shared.conn.is_cluster()
    }

    /// A builder on a `redis::Client` (which knows the server's address and credentials).
    pub fn builder(client: redis::Client) -> RedisBuilder {
        RedisBuilder::on(Source::Client(Box::new(client)))
    }

    /// A builder on a connection manager the application already has.
    pub fn builder_on_manager(manager: ConnectionManager) -> RedisBuilder {
        RedisBuilder::on(Source::Manager(manager))
    }

    /// A backend on a connection manager the application already has, with default options.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: nothing is sent.
    pub async fn from_manager(manager: ConnectionManager) -> Result<RedisBackend, LockError> {
        RedisBackend::builder_on_manager(manager).connect().await
    }

    /// Parses a `redis://` or `rediss://` URL with the options of the [module docs](self)
    /// into a builder, without connecting.
    pub fn builder_from_url(url: &str) -> Result<RedisBuilder, LockError> {
        parse_url(url)
    }

    /// Connects to the server named by a `redis://` or `rediss://` URL (see the
    /// [module docs](self) for the options).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe, as [`RedisBuilder::connect`].
    pub async fn connect(url: &str) -> Result<RedisBackend, LockError> {
        parse_url(url)?.connect().await
    }

    /// The default lease.
    pub fn lease(&self) -> Duration {
        self.shared.lease
    }

    /// Whether acquisitions issue fencing tokens.
    pub fn fencing(&self) -> bool {
        self.shared.fencing
    }

    /// Whether this backend's waiters let waiters of other backends go first after a release
    /// that woke them ([`RedisBuilder::fair_waits`]).
    pub fn fair_waits(&self) -> bool {
        self.shared.hold_offs.is_some()
    }

    /// The number of shared fencing counters (`fencing_counters`), or `None` with one counter
    /// per key (the default).
    pub fn fencing_counters(&self) -> Option<u32> {
        self.shared.counters.as_ref().map(|c| c.n)
    }

    /// The Redis key that holds the lock `key` (see [Keys](self#keys)).
    pub fn storage_key(&self, key: &str) -> Vec<u8> {
        self.shared.lock_key(key)
    }

    /// The Redis key of the fencing counter of the lock `key` (see [Keys](self#keys)); with
    /// `fencing_counters`, the shared counter the key increments (see [Bounded fencing
    /// counters](self#bounded-fencing-counters)).
    pub fn fencing_key(&self, key: &str) -> Vec<u8> {
        match &self.shared.counters {
            Some(counters) => counters.key_of(key),
            None => fence_key(self.shared.layout, &self.shared.lock_key(key)),
        }
    }

    /// How lock names become Redis keys.
    pub fn key_layout(&self) -> KeyLayout {
        self.shared.layout
    }

    /// What [connection fencing](self#connection-fencing) has done so far: whether it is on,
    /// how many connections it killed, how many uncertain commands it could not fence.
    pub fn connection_fencing(&self) -> ConnectionFencing {
        ConnectionFencing::of(&self.shared)
    }

    /// Takes the lock `key` under `token` for `lease` if it is free (`SET NX PX`): `Ok(true)`
    /// when taken, `Ok(false)` when the key is held (by any token, this one included). Nothing
    /// renews it: call [`reset_expiry`](RedisBackend::reset_expiry) to keep it. The lease runs
    /// from when the server ran the command: count on it from before the call, not from the
    /// answer (which may come late; the provider's acquisitions do this for you, see
    /// [Lost locks](self#lost-locks)). A `lease` shorter than 100 ms or longer than 365 days
    /// is a [`LockError::Config`].
    ///
    /// # Cancel safety
    ///
    /// If the future is dropped before the answer, the lock may have been taken under `token`;
    /// the caller, who owns the token, gives it back with [`release`](RedisBackend::release) (or
    /// lets the lease run out).
    pub async fn try_take(
        &self,
        key: &str,
        token: &OwnerToken,
        lease: Duration,
    ) -> Result<bool, LockError> {
        validate_key(key)?;
        check_lease(lease)?;
        let lock_key = self.shared.lock_key(key);
        let taken = self
            .shared
            .bounded(
                "taking a lock",
                self.shared.conn.acquire(&lock_key, None, token, lease),
            )
            .await?;
        Ok(taken.is_some())
    }

    /// Gives back the lock `key` if `token` owns it. Reports
    /// [`Released`](ReleaseOutcome::Released), [`AlreadyReleased`](ReleaseOutcome::AlreadyReleased)
    /// (no lock under the key) or [`NotOwned`](ReleaseOutcome::NotOwned) (another token holds
    /// it; left alone). On servers with a native conditional delete, telling the last two apart
    /// takes one more read, which is not atomic with the delete.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: the release is one conditional command (or script) that either ran or did
    /// not; calling it again is harmless.
    pub async fn release(
        &self,
        key: &str,
        token: &OwnerToken,
    ) -> Result<ReleaseOutcome, LockError> {
        validate_key(key)?;
        let lock_key = self.shared.lock_key(key);
        let (outcome, _) = self
            .shared
            .bounded(
                "releasing a lock",
                self.shared.conn.release(&lock_key, token),
            )
            .await?;
        Ok(outcome)
    }

    /// Sets the lease of the lock `key` to `lease` **from now** (not added to what is left) if
    /// `token` owns it: `Ok(true)` when done; `Ok(false)` when the lock is missing, expired or
    /// held by another token, in which case nothing is created or changed.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: one conditional command that either ran or did not.
    pub async fn reset_expiry(
        &self,
        key: &str,
        token: &OwnerToken,
        lease: Duration,
    ) -> Result<bool, LockError> {
        validate_key(key)?;
        check_lease(lease)?;
        let lock_key = self.shared.lock_key(key);
        let (done, _) = self
            .shared
            .bounded(
                "renewing a lock",
                self.shared.conn.extend(&lock_key, token, lease),
            )
            .await?;
        Ok(done)
    }

    /// The token that holds the lock `key` right now, if any.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a read.
    pub async fn owner_token(&self, key: &str) -> Result<Option<OwnerToken>, LockError> {
        Ok(self.owner_and_ttl(key).await?.0)
    }

    /// Whether `token` holds the lock `key` at the moment the server answers.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a read.
    pub async fn verify_still_held(
        &self,
        key: &str,
        token: &OwnerToken,
    ) -> Result<bool, LockError> {
        Ok(self.owner_token(key).await?.as_ref() == Some(token))
    }

    /// An **estimate** of how much of the lease of `token` on `key` is left: the server's time
    /// to live when it read it, already a round trip old when it arrives (and the server's clock
    /// is not the caller's). `None` when `token` does not hold the lock.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: a read.
    pub async fn remaining_lease(
        &self,
        key: &str,
        token: &OwnerToken,
    ) -> Result<Option<Duration>, LockError> {
        let (owner, ttl_ms) = self.owner_and_ttl(key).await?;
        Ok(match (owner, u64::try_from(ttl_ms)) {
            (Some(owner), Ok(ms)) if owner == *token => Some(Duration::from_millis(ms)),
            _ => None,
        })
    }

    async fn owner_and_ttl(&self, key: &str) -> Result<(Option<OwnerToken>, i64), LockError> {
        validate_key(key)?;
        let lock_key = self.shared.lock_key(key);
        let (value, ttl) = self
            .shared
            .bounded("reading a lock", self.shared.conn.owner_and_ttl(&lock_key))
            .await?;
        // An empty value is no token of ours (tokens are never empty).
        let owner = value.and_then(|bytes| OwnerToken::from_bytes(bytes).ok());
        Ok((owner, ttl))
    }
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("lease", &self.shared.lease)
            .field("prefix", &String::from_utf8_lossy(&self.shared.prefix))
            .field("layout", &self.shared.layout)
            .field("fencing", &self.shared.fencing)
            .field("timeout", &self.shared.timeout)
            .field("connection", &self.shared.conn)
            .finish()
    }
}

impl Shared {
    fn lock_key(&self, key: &str) -> Vec<u8> {
        match self.layout {
            KeyLayout::Tagged => storage_key(&self.prefix, key),
            KeyLayout::Plain => [&self.prefix[..], key.as_bytes()].concat(),
        }
    }

    /// Runs one operation under the command timeout (see [`within`] for why this is not an
    /// `async fn`).
    fn bounded<T>(
        &self,
        what: &str,
        operation: impl Future<Output = Result<T, RedisError>>,
    ) -> impl Future<Output = Result<T, LockError>> {
        within(self.timeout, what, &self.prefix, operation)
    }
}

/// redis-rs uses rustls's process-wide crypto provider, which rustls cannot choose by itself
/// once both aws-lc-rs and ring are built in (another crate of the application may bring ring):
/// aws-lc-rs, rustls's default (with post-quantum key exchange), unless the application chose.
/// Called before the first TLS connection.
fn use_default_crypto() {
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
}

/// Checks that `pem` holds CA certificates.
fn check_ca(pem: &[u8]) -> Result<(), LockError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let certificates = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|err| LockError::config(format!("the redis `ca` is not valid PEM ({err})")))?;
    if certificates.is_empty() {
        return Err(LockError::config(
            "the redis `ca` holds no certificate (expected PEM: -----BEGIN CERTIFICATE-----)",
        ));
    }
    Ok(())
}

/// TLS to the hosts of a `rediss+cluster://` or `rediss+sentinel://` URL: the CA certificates
/// to trust instead of the system's roots (PEM, checked), if any.
#[derive(Clone, Default)]
pub(crate) struct HostTls {
    pub(crate) ca: Option<Vec<u8>>,
}

impl HostTls {
    /// The driver's form of the certificates to trust.
    fn certificates(&self) -> Option<redis::TlsCertificates> {
        self.ca.clone().map(trusting)
    }
}

/// The driver's TLS settings that trust the CA certificates in `pem` (no client certificate).
fn trusting(pem: Vec<u8>) -> redis::TlsCertificates {
    redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(pem),
    }
}

/// A client for the host `host:port` of a multi-host URL, with `settings` (database, user,
/// password, protocol): over TLS with `tls`, in clear without.
pub(crate) fn host_client(
    tls: Option<&HostTls>,
    host: &str,
    port: u16,
    settings: redis::RedisConnectionInfo,
) -> Result<redis::Client, RedisError> {
    use redis::IntoConnectionInfo as _;
    let Some(tls) = tls else {
        let info = redis::ConnectionAddr::Tcp(host.to_owned(), port)
            .into_connection_info()?
            .set_redis_settings(settings);
        return redis::Client::open(info);
    };
    use_default_crypto();
    let info = redis::ConnectionAddr::TcpTls {
        host: host.to_owned(),
        port,
        insecure: false,
        tls_params: None,
    }
    .into_connection_info()?
    .set_redis_settings(settings);
    match tls.certificates() {
        Some(certificates) => redis::Client::build_with_tls(info, certificates),
        None => redis::Client::open(info),
    }
}

/// `client`'s settings and TLS (CA included) for the node at `host:port`.
pub(crate) fn client_at(
    client: &redis::Client,
    host: &str,
    port: u16,
) -> Result<redis::Client, RedisError> {
    let info = client.get_connection_info();
    let addr = match info.addr() {
        redis::ConnectionAddr::TcpTls {
            insecure,
            tls_params,
            ..
        } => redis::ConnectionAddr::TcpTls {
            host: host.to_owned(),
            port,
            insecure: *insecure,
            tls_params: tls_params.clone(),
        },
        _ => redis::ConnectionAddr::Tcp(host.to_owned(), port),
    };
    redis::Client::open(info.clone().set_addr(addr))
}

/// The host and port `client` connects to, over TCP with or without TLS.
pub(crate) fn host_port_of(client: &redis::Client) -> Option<(String, u16)> {
    match client.get_connection_info().addr() {
        redis::ConnectionAddr::Tcp(host, port)
        | redis::ConnectionAddr::TcpTls { host, port, .. } => Some((host.clone(), *port)),
        _ => None,
    }
}

/// `client` again, trusting the CA certificates in `pem` instead of the system's roots.
fn with_ca(client: &redis::Client, pem: Vec<u8>) -> Result<redis::Client, LockError> {
    check_ca(&pem)?;
    if !matches!(
        client.get_connection_info().addr(),
        redis::ConnectionAddr::TcpTls { .. }
    ) {
        return Err(LockError::config(
            "the redis `ca` needs a TLS connection: use a rediss:// URL",
        ));
    }
    let certificates = trusting(pem);
    redis::Client::build_with_tls(client.get_connection_info().clone(), certificates).map_err(
        |err| {
            LockError::config(format!(
                "the redis `ca` cannot be used ({:?}: {})",
                err.kind(),
                err.detail().unwrap_or("")
            ))
        },
    )
}

/// `{prefix}{key'}`: see [Keys](self#keys).
fn storage_key(prefix: &[u8], key: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(prefix.len() + key.len() + 2);
    out.extend_from_slice(prefix);
    out.push(b'{');
    for byte in key.bytes() {
        match byte {
            b'%' => out.extend_from_slice(b"%25"),
            b'{' => out.extend_from_slice(b"%7B"),
            b'}' => out.extend_from_slice(b"%7D"),
            other => out.push(other),
        }
    }
    out.push(b'}');
    out
}

/// The fencing counter of the lock stored under `lock_key`: `lock_key:fence` when tagged
/// (never a lock key: those end with `}`), `lock_key` + byte 0xFF + `:fence` when plain (never
/// a lock key either: those are UTF-8, where 0xFF cannot occur).
fn fence_key(layout: KeyLayout, lock_key: &[u8]) -> Vec<u8> {
    let mut key = lock_key.to_vec();
    if layout == KeyLayout::Plain {
        key.push(PLAIN_FENCE_MARK);
    }
    key.extend_from_slice(b":fence");
    key
}

/// The byte between a plain lock key and `:fence` in its counter's key: not UTF-8, so no lock
/// name can produce it.
const PLAIN_FENCE_MARK: u8 = 0xff;

/// How a lock's name becomes its Redis key; see [Keys](self#keys).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum KeyLayout {
    /// `prefix{name'}` (the default): the name, with `%`, `{` and `}` escaped, is the
    /// key's Cluster hash tag, shared with its fencing counter `prefix{name'}:fence`. Distinct
    /// names are always distinct keys.
    #[default]
    Tagged,
    /// `prefix` + `name`, as it is: the key another client uses for the same lock name. The
    /// fencing counter is `prefix` + `name` + byte 0xFF + `:fence`.
    Plain,
}

/// A lease is 100 ms to 365 days (whose milliseconds `PX` takes easily).
fn check_lease(lease: Duration) -> Result<Duration, LockError> {
    crate::lease::check_lease("the redis `lease`", lease)
}

/// Runs `operation` within `limit`: a driver error becomes `what`'s [`redis_error`], the limit
/// running out `what`'s [`timed_out`].
///
/// A plain function whose future holds `operation` once, inside the timeout. As an `async fn`
/// it held the argument and the timeout built from it side by side, so each layer of these
/// wrappers doubled the size of the command's future (13 KB for one `SET` under
/// [`Shared::bounded`]), and each move of it copied all of that.
fn within<T>(
    limit: Duration,
    what: &str,
    prefix: &[u8],
    operation: impl Future<Output = Result<T, RedisError>>,
) -> impl Future<Output = Result<T, LockError>> {
    use futures_util::FutureExt as _;
    tokio::time::timeout(limit, operation).map(move |outcome| match outcome {
        Ok(outcome) => outcome.map_err(|err| redis_error(what, err, prefix)),
        Err(_) => Err(timed_out(what, limit)),
    })
}

/// [`within`] for opening the backend's connections: a driver error becomes `what`'s
/// [`connect_error`].
async fn within_connect<T>(
    limit: Duration,
    what: &str,
    prefix: &[u8],
    operation: impl Future<Output = Result<T, RedisError>>,
) -> Result<T, LockError> {
    match tokio::time::timeout(limit, operation).await {
        Ok(outcome) => outcome.map_err(|err| connect_error(what, err, prefix)),
        Err(_) => Err(timed_out(what, limit)),
    }
}

/// Maps a driver error met while opening the backend's connections, `what` naming where to
/// ("connecting to 10.0.0.5:6379"): a refused connection says so, and a connection that failed
/// before it was ready says that, without the remark [`redis_error`] makes on established
/// connections (which close with the runtime that ran them).
fn connect_error(what: &str, err: RedisError, prefix: &[u8]) -> LockError {
    let tls = crate::tls::describe(&err, "ca").is_some()
        || crate::tls::describe_text(&err.to_string(), "ca").is_some();
    if tls || !err.is_connection_dropped() {
        return redis_error(what, err, prefix);
    }
    let message = if err.is_connection_refusal() {
        format!("{what}: the connection was refused ({err}); is a server listening there?")
    } else {
        format!("{what}: the connection failed ({err})")
    };
    LockError::unavailable(NAME, message, Some(Box::new(err)))
}

/// `what` did not finish within `limit`.
fn timed_out(what: &str, limit: Duration) -> LockError {
    LockError::unavailable(NAME, format!("{what} timed out after {limit:?}"), None)
}

/// Maps a driver error to a [`LockError`], saying what was being done.
fn redis_error(what: &str, err: RedisError, prefix: &[u8]) -> LockError {
    let failure = crate::tls::describe(&err, "ca")
        .or_else(|| crate::tls::describe_text(&err.to_string(), "ca"));
    if let Some(failure) = failure {
        return failure.into_error(NAME, what, Box::new(err));
    }
    match err.kind() {
        ErrorKind::Server(ServerErrorKind::NoPerm) => {
            let detail = err.detail().unwrap_or("NOPERM");
            let prefix = String::from_utf8_lossy(prefix);
            let what_is_missing = match commands::refused_command(detail) {
                Some(command) => format!("may not run `{command}` (grant `+{command}`)"),
                None if detail.contains("key") => format!(
                    "may not use the keys of the prefix `{prefix}`: its key pattern must be \
                     `~{prefix}{{*`"
                ),
                None if detail.contains("the script runs") => {
                    "may not run a command of a script".to_owned()
                }
                None => "lacks a permission".to_owned(),
            };
            LockError::backend(
                NAME,
                format!(
                    "{what}: the Redis user {what_is_missing} (NOPERM: {detail}). Grant the \
                     commands dlock runs on this server, on the keys `~{prefix}{{*` (see \
                     Permissions in the dlock::redis docs); no other command is tried instead"
                ),
                Some("NOPERM".to_owned()),
                Some(Box::new(err)),
            )
        }
        _ if cluster::is_cross_slot(&err) => LockError::backend(
            NAME,
            format!(
                "{what}: the keys of one lock are in different Cluster slots (CROSSSLOT {}). \
                 With `key_layout=plain` a lock's fencing counter (and its readers' keys, and \
                 a semaphore's keys) are other keys than the lock's: put a hash tag in the \
                 names (`{{order:42}}`), or for exclusive locks set `fencing=false` (see Keys \
                 in the dlock::redis docs)",
                err.detail().unwrap_or("")
            ),
            Some("CROSSSLOT".to_owned()),
            Some(Box::new(err)),
        ),
        ErrorKind::Server(_) | ErrorKind::Extension => {
            let code = err.code().map(str::to_owned);
            LockError::backend(
                NAME,
                format!(
                    "{what}: the server answered {} {}",
                    err.code().unwrap_or("an error"),
                    err.detail().unwrap_or("")
                ),
                code,
                Some(Box::new(err)),
            )
        }
        ErrorKind::AuthenticationFailed => LockError::config(format!(
            "{what}: the server refused the credentials of the redis URL"
        )),
        ErrorKind::InvalidClientConfig => {
            LockError::config(format!("{what}: the redis client configuration is invalid"))
        }
        _ if err.is_connection_refusal() => LockError::unavailable(
            NAME,
            format!(
                "{what}: the server refused the connection ({err}); the next command tries again"
            ),
            Some(Box::new(err)),
        ),
        _ if err.is_connection_dropped() => LockError::unavailable(
            NAME,
            format!(
                "{what}: the connection to the server is closed ({err}); the next command \
                 connects again (a connection also closes when the Tokio runtime that ran it \
                 shuts down)"
            ),
            Some(Box::new(err)),
        ),
        _ => LockError::unavailable(NAME, format!("{what}: {err}"), Some(Box::new(err))),
    }
}

const FORM: UrlForm = UrlForm {
    backend: "Redis",
    schemes: &["redis", "rediss"],
    example: "redis://user:password@host:6379/0?lease=30s",
};

url_keys! {
    /// The redis URL options.
    enum RedisOption for FORM {
        Lease = "lease",
        Prefix = "prefix",
        Fencing = "fencing",
        FencingCounters = "fencing_counters",
        Timeout = "timeout",
        RenewEvery = "renew_every",
        Protocol = "protocol",
        Ca = "ca",
        KeyLayout = "key_layout",
        WaitReplicas = "wait_replicas",
        WaitTimeout = "wait_timeout",
        SentinelUsername = "sentinel_username",
        SentinelPassword = "sentinel_password",
        CheckMasterEvery = "check_master_every",
        FairWaits = "fair_waits",
    }
}

/// The options of a `redis://`, `rediss://` or `redis+sentinel://` URL.
struct UrlOptions {
    lease: Duration,
    prefix: String,
    fencing: bool,
    fencing_counters: Option<u32>,
    timeout: Duration,
    renew_every: Option<Duration>,
    ca: Option<Vec<u8>>,
    layout: KeyLayout,
    /// Options passed on to the client (`protocol`).
    passed_on: Vec<(String, String)>,
    wait_replicas: u32,
    wait_timeout: Duration,
    sentinel_username: Option<String>,
    sentinel_password: Option<String>,
    check_master_every: Option<Duration>,
    fair_waits: bool,
}

impl UrlOptions {
    /// The `protocol` passed on (`resp2`, the default, or `resp3`; any case), for the URLs
    /// whose client dlock builds itself from the parts.
    fn protocol(&self) -> Result<redis::ProtocolVersion, LockError> {
        let mut protocol = redis::ProtocolVersion::RESP2;
        for (name, value) in &self.passed_on {
            if name == "protocol" {
                protocol = match value.to_ascii_lowercase().as_str() {
                    "resp2" => redis::ProtocolVersion::RESP2,
                    "resp3" => redis::ProtocolVersion::RESP3,
                    _ => {
                        return Err(LockError::config(
                            "the redis option `protocol` is `resp2` (the default) or `resp3`",
                        ));
                    }
                };
            }
        }
        Ok(protocol)
    }

    fn apply(self, mut builder: RedisBuilder) -> RedisBuilder {
        builder = builder
            .lease(self.lease)
            .prefix(self.prefix)
            .key_layout(self.layout)
            .fencing(self.fencing)
            .timeout(self.timeout)
            .wait_replicas(self.wait_replicas)
            .wait_timeout(self.wait_timeout)
            .fair_waits(self.fair_waits);
        if let Some(cadence) = self.renew_every {
            builder = builder.renew_every(cadence);
        }
        if let Some(n) = self.fencing_counters {
            builder = builder.fencing_counters(n);
        }
        if let Some(pem) = self.ca {
            builder = builder.ca_certificates(pem);
        }
        if let Some(every) = self.check_master_every {
            builder = builder.check_master_every(every);
        }
        builder
    }
}

/// Reads a URL's options; `tls`: a `rediss://` URL; `sentinel`: a `redis+sentinel://` URL.
fn read_options(query: &str, tls: bool, sentinel: bool) -> Result<UrlOptions, LockError> {
    let mut lease = DEFAULT_LEASE;
    let mut prefix = DEFAULT_PREFIX.to_owned();
    let mut fencing = true;
    let mut fencing_counters = None;
    let mut timeout = DEFAULT_TIMEOUT;
    let mut renew_every = None;
    let mut ca = None;
    let mut layout = KeyLayout::Tagged;
    let mut passed_on = Vec::new();
    let mut wait_replicas = 0;
    let mut wait_timeout = DEFAULT_WAIT_TIMEOUT;
    let mut sentinel_username = None;
    let mut sentinel_password = None;
    let mut check_master_every = None;
    let mut fair_waits = true;
    read_query(query, |key: RedisOption, value| {
        let name = key.as_ref();
        match key {
            RedisOption::WaitReplicas => {
                wait_replicas =
                    u32::try_from(crate::options::parse_count(name, &value)?).map_err(|_| {
                        LockError::config("the redis option `wait_replicas` is too large")
                    })?;
            }
            RedisOption::WaitTimeout => wait_timeout = parse_duration(name, &value)?,
            RedisOption::SentinelUsername
            | RedisOption::SentinelPassword
            | RedisOption::CheckMasterEvery
                if !sentinel =>
            {
                return Err(LockError::config(format!(
                    "the redis option `{name}` is for redis+sentinel:// URLs (the sentinels' \
                     own credentials)"
                )));
            }
            RedisOption::SentinelUsername => sentinel_username = Some(value),
            RedisOption::SentinelPassword => sentinel_password = Some(value),
            RedisOption::CheckMasterEvery => {
                let every = parse_duration(name, &value)?;
                crate::lease::check_cadence("the redis `check_master_every`", every)?;
                check_master_every = Some(every);
            }
            RedisOption::Lease => lease = check_lease(parse_duration(name, &value)?)?,
            RedisOption::Prefix => prefix = value,
            RedisOption::Timeout => {
                timeout = check_limit("the redis `timeout`", parse_duration(name, &value)?)?
            }
            RedisOption::RenewEvery => {
                let cadence = parse_duration(name, &value)?;
                crate::lease::check_cadence("the redis `renew_every`", cadence)?;
                renew_every = Some(cadence);
            }
            RedisOption::Fencing => fencing = parse_bool(name, &value)?,
            RedisOption::FairWaits => fair_waits = parse_bool(name, &value)?,
            RedisOption::FencingCounters => {
                fencing_counters = Some(crate::counters::parse(name, &value)?);
            }
            RedisOption::Protocol => passed_on.push((name.to_owned(), value)),
            RedisOption::KeyLayout => {
                layout = match value.as_str() {
                    "tagged" => KeyLayout::Tagged,
                    "plain" => KeyLayout::Plain,
                    other => {
                        return Err(LockError::config(format!(
                            "the redis option `key_layout` is `tagged` (the default) or \
                             `plain`, not `{other}`"
                        )));
                    }
                }
            }
            RedisOption::Ca if !tls => {
                return Err(LockError::config(
                    "the redis option `ca` needs a TLS connection: use a rediss:// URL \
                     (rediss+cluster://, rediss+sentinel://)",
                ));
            }
            RedisOption::Ca => {
                ca = Some(std::fs::read(&value).map_err(|err| {
                    LockError::config(format!(
                        "the redis option `ca` names a file that cannot be read ({value}: {err})"
                    ))
                })?);
            }
        }
        Ok(())
    })?;
    Ok(UrlOptions {
        lease,
        prefix,
        fencing,
        fencing_counters,
        timeout,
        renew_every,
        ca,
        layout,
        passed_on,
        wait_replicas,
        wait_timeout,
        sentinel_username,
        sentinel_password,
        check_master_every,
        fair_waits,
    })
}

/// Parses a `redis+cluster://` URL into a builder, without connecting.
fn parse_cluster_url(url: &str) -> Result<RedisBuilder, LockError> {
    let parts = cluster::split_url(url)?;
    let mut options = read_options(&parts.query, parts.tls, false)?;
    let protocol = options.protocol()?;
    let node = parts
        .hosts
        .credentials(redis::RedisConnectionInfo::default().set_protocol(protocol));
    // `rediss+cluster://`: every node over TLS, the CA (if any) given to the cluster client
    // here, since the builder cannot change a client's TLS afterwards.
    let tls = parts.tls.then(|| HostTls {
        ca: options.ca.take(),
    });
    if let Some(pem) = tls.as_ref().and_then(|tls| tls.ca.as_deref()) {
        check_ca(pem)?;
    }
    let mut clients = Vec::with_capacity(parts.hosts.nodes.len());
    for (host, port) in &parts.hosts.nodes {
        // The driver's messages are not repeated: they may quote the password.
        let client = host_client(tls.as_ref(), host, *port, node.clone())
            .map_err(|err| cluster_url_error(&err))?;
        clients.push(client);
    }
    let subscribe = clients[0].clone();
    let nodes = clients
        .iter()
        .map(|c| c.get_connection_info().addr().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    // Redirections are retried quickly (20 ms doubling to 500 ms, jittered, 16 times): a
    // lock's keys are split between two masters only for the moment of a migration, and the
    // driver's default (at least 1.28 s per retry) would outlast the command timeout.
    let mut client = redis::cluster::ClusterClient::builder(
        clients.iter().map(|c| c.get_connection_info().clone()),
    )
    .use_protocol(protocol)
    .retry_wait_formula(10, 2)
    .min_retry_wait(5)
    .max_retry_wait(500);
    if let Some(certificates) = tls.as_ref().and_then(HostTls::certificates) {
        client = client.certs(certificates);
    }
    let client = client.build().map_err(|err| cluster_url_error(&err))?;
    let builder = RedisBuilder::on(Source::Cluster(Box::new((client, Some(subscribe), nodes))));
    Ok(options.apply(builder))
}

fn cluster_url_error(err: &RedisError) -> LockError {
    LockError::config(format!(
        "the redis+cluster URL is not valid ({:?})",
        err.kind()
    ))
}

/// Parses a `redis+sentinel://` URL into a builder, without connecting.
fn parse_sentinel_url(url: &str) -> Result<RedisBuilder, LockError> {
    let parts = sentinel::split_url(url)?;
    let options = read_options(&parts.query, parts.tls, true)?;
    let master = parts.hosts.credentials(
        redis::RedisConnectionInfo::default()
            .set_db(parts.db)
            .set_protocol(options.protocol()?),
    );
    let mut auth = redis::RedisConnectionInfo::default();
    if let Some(user) = &options.sentinel_username {
        auth = auth.set_username(user);
    }
    if let Some(password) = &options.sentinel_password {
        auth = auth.set_password(password);
    }
    let builder = RedisBuilder::on(Source::Sentinel(Box::new(sentinel::Sentinels {
        nodes: parts.hosts.nodes,
        service: parts.service,
        auth,
        master,
        tls: parts.tls.then(HostTls::default),
        timeout: DEFAULT_TIMEOUT,
        check_every: DEFAULT_CHECK_MASTER_EVERY,
        first: Arc::default(),
        links: Arc::default(),
    })));
    Ok(options.apply(builder))
}

fn parse_url(url: &str) -> Result<RedisBuilder, LockError> {
    let scheme = url
        .split_once("://")
        .map(|(scheme, _)| scheme.to_ascii_lowercase());
    match scheme.as_deref() {
        Some("redis+sentinel" | "rediss+sentinel") => return parse_sentinel_url(url),
        Some("redis+cluster" | "rediss+cluster") => return parse_cluster_url(url),
        _ => {}
    }
    let mut parsed = FORM.parse(url)?;
    let tls = parsed.scheme() == "rediss";
    let options = read_options(parsed.query().unwrap_or(""), tls, false)?;
    let passed_on = &options.passed_on;
    if passed_on.is_empty() {
        parsed.set_query(None);
    } else {
        parsed
            .query_pairs_mut()
            .clear()
            .extend_pairs(passed_on.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    }
    // The driver's messages are not repeated: they may quote the URL, password included.
    let client = redis::Client::open(parsed.as_str())
        .map_err(|err| FORM.error(format!("is not valid ({:?})", err.kind())))?;
    Ok(options.apply(RedisBackend::builder(client)))
}

impl LockBackend for RedisBackend {
    fn name(&self) -> &'static str {
        NAME
    }

    /// Read locks are readers' shares of the key under leases of their own (see
    /// [Read locks](self#read-locks)).
    fn shared_locks(&self) -> Result<(), LockError> {
        Ok(())
    }

    /// Semaphores are sorted sets of permits, one script per try (see
    /// [Semaphores](self#semaphores)).
    fn semaphores(&self) -> Option<&dyn crate::backend::PermitStore> {
        Some(self)
    }

    /// The locks under the prefix, found with `SCAN` (which walks the whole keyspace; on a
    /// cluster, that of each master).
    fn store_locks<'a>(
        &'a self,
        _known: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<crate::StoreLock>, LockError>> {
        Box::pin(inspect::store_locks(&self.shared))
    }

    /// One `GET` of each lock key, in one pipeline (one round trip; on a Cluster, one
    /// pipeline per key, all at once).
    fn held_keys<'a>(&'a self, keys: &'a [String]) -> BoxFuture<'a, Result<Vec<bool>, LockError>> {
        Box::pin(inspect::held_keys(&self.shared, keys))
    }

    fn force_releases(&self) -> Result<&dyn crate::backend::ForceRelease, LockError> {
        Ok(self)
    }

    fn set_owner_label(&self, label: &str) {
        self.shared.owner_label.set(label);
    }

    fn ping(&self) -> BoxFuture<'_, Result<(), LockError>> {
        Box::pin(async move {
            let cmd = redis::cmd("PING");
            let ping = self.shared.conn.query(&cmd);
            self.shared
                .bounded("checking the server", ping)
                .await
                .map(drop)
        })
    }

    fn try_acquire<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Result<Option<Acquired>, LockError>> {
        Box::pin(async move {
            Ok(match take(&self.shared, request).await? {
                WaitTry::Acquired(acquired) => Some(acquired),
                _ => None,
            })
        })
    }

    /// A try that meets contention also reads the holder's time to live (in the acquisition
    /// script, or a `PTTL` after a plain `SET`), so that a waiter tries again when the lease
    /// runs out (see [Waiting](self#waiting)).
    fn try_acquire_in_wait<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Result<WaitTry, LockError>> {
        Box::pin(take(&self.shared, request))
    }

    /// Subscribes to the key's channel on the backend's subscriber connection (see
    /// [Waiting](self#waiting)).
    fn watch_releases<'a>(
        &'a self,
        request: LockRequest<'a>,
    ) -> BoxFuture<'a, Option<Box<dyn ReleaseWatch>>> {
        Box::pin(async move {
            let channel = self.shared.lock_key(request.key);
            let shared = &self.shared;
            let watch = shared
                .wakes
                .watch(&channel, || inspect::cluster_nodes(shared))
                .await?;
            Some(Box::new(QueuedWatch {
                watch: Some(watch),
                shared: Arc::clone(shared),
                key: Arc::from(channel),
            }) as Box<dyn ReleaseWatch>)
        })
    }
}

/// A waiter's watch on a lock's releases that, once the backend watches the key no more (its
/// last waiter of the key is gone: it took the lock, gave up, or was dropped), takes the
/// backend out of the key's queue of waiters in the background (see
/// [Fair waiting](self#fair-waiting)).
struct QueuedWatch {
    watch: Option<Box<dyn ReleaseWatch>>,
    shared: Arc<Shared>,
    key: Arc<[u8]>,
}

impl std::fmt::Debug for QueuedWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuedWatch")
            .field("watch", &self.watch)
            .finish_non_exhaustive()
    }
}

impl Drop for QueuedWatch {
    fn drop(&mut self) {
        drop(self.watch.take());
        if self.shared.wakes.wanted(&self.key) || self.shared.conn.queue_keys(&self.key).is_none() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (shared, key) = (Arc::clone(&self.shared), Arc::clone(&self.key));
        drop(runtime.spawn(async move {
            let leaving = shared.conn.leave_queue(&key);
            let _ = tokio::time::timeout(shared.timeout, leaving).await;
        }));
    }
}

impl ReleaseWatch for QueuedWatch {
    fn is_live(&self) -> bool {
        self.watch.as_ref().is_some_and(|watch| watch.is_live())
    }

    fn mark_seen(&mut self) {
        if let Some(watch) = &mut self.watch {
            watch.mark_seen();
        }
    }

    fn woken(&mut self) -> BoxFuture<'_, ()> {
        match &mut self.watch {
            Some(watch) => watch.woken(),
            None => Box::pin(std::future::pending()),
        }
    }
}

/// How long until a lock whose holder's time to live is `ttl` ms may be free with no release:
/// just past its lease. `None` when unknown or without expiry; a key already gone answers a
/// short pause.
fn expiry_hint(ttl: Option<i64>) -> Option<Duration> {
    match ttl? {
        // Gone already (freed between the try and the read).
        -2 => Some(Duration::from_millis(1)),
        ms if ms >= 0 => Some(Duration::from_millis(ms.unsigned_abs().saturating_add(1))),
        // -1: no expiry (a key set by another client without a lease); -3: not readable.
        _ => None,
    }
}

/// One try: the lock, or on contention how soon to try again (for a waiter's try, which has a
/// poll pause).
async fn take(shared: &Arc<Shared>, request: LockRequest<'_>) -> Result<WaitTry, LockError> {
    if request.shared {
        return read::try_acquire(shared, request).await;
    }
    let lease = request.lease.unwrap_or(shared.lease);
    check_lease(lease)?;
    let lock_key: Arc<[u8]> = Arc::from(shared.lock_key(request.key));
    // A waiter woken by the key's releases queues (see [Fair waiting](self#fair-waiting)):
    // the queue, not a hold-off or the order of the subscribers, decides who goes next.
    let queued = request.poll_pause.is_some()
        && shared.hold_offs.is_some()
        && shared.fencing
        && shared.conn.queue_keys(&lock_key).is_some()
        && shared.wakes.live(&lock_key);
    if request.poll_pause.is_some()
        && !queued
        && let Some(hold_offs) = &shared.hold_offs
        && let Some(left) = hold_offs.left(&lock_key)
    {
        // This backend just gave the key to waiters elsewhere: one of them takes it first.
        return Ok(WaitTry::Held {
            retry_within: Some(left),
        });
    }
    // An abandoned acquisition of this key may still be giving it back: a try sent now would
    // find it taken (see [Cancellation](self#cancellation)).
    shared.settling.wait(&lock_key, shared.timeout).await;
    let token = shared.owner_label.token()?;
    let plan = bounded::plan(shared, request.key, &lock_key).await?;
    // From here until the answer is read, a drop (or a failure) may leave the lock
    // taken under our token: the cleanup deletes it again in the background.
    let mut cleanup = Cleanup {
        shared: Arc::clone(shared),
        key: Arc::clone(&lock_key),
        token: token.clone(),
        armed: true,
        kind: Kind::Lock,
    };
    let sent = Instant::now();
    let waiting = request.poll_pause.is_some();
    let taking = shared
        .bounded(
            "acquiring a lock",
            shared.conn.take(
                &lock_key,
                plan.counter(),
                &token,
                lease,
                request
                    .poll_pause
                    .map(|pause| commands::WaiterTry { pause, queued }),
                shared.wait,
            ),
        )
        .await;
    let (taken, acked) = match taking {
        // A cluster still moving the key's slot after the driver's retries refused the
        // command without running it: a waiter tries again soon, within its timeout.
        Err(ref err) if waiting && shared.conn.is_cluster() && cluster::refused_in_motion(err) => {
            cleanup.armed = false;
            return Ok(WaitTry::Held {
                retry_within: Some(cluster::IN_MOTION_RETRY),
            });
        }
        other => other.map_err(|err| plan.refine(shared, err))?,
    };
    let fencing_token = match taken {
        commands::Taking::Taken(count) => plan.token(count)?,
        commands::Taking::Held(ttl) => {
            cleanup.armed = false;
            let mut retry_within = expiry_hint(ttl);
            if let Some(pause) = request.poll_pause
                && let Some(intent) = read::writer_waits(shared, &lock_key, pause).await
            {
                // Readers hold the key: the next try renews the intent before it lapses.
                let renew = intent / 2;
                retry_within = Some(retry_within.map_or(renew, |within| within.min(renew)));
            }
            return Ok(WaitTry::Held { retry_within });
        }
    };
    if waiting && !queued {
        // This backend's subscriber goes behind the other backends' for the key's next release.
        shared.wakes.to_back(&lock_key);
    }
    hold(shared, &request, cleanup, lease, sent, fencing_token, acked).await
}

/// The end of an acquisition that took the lock (or, with `cleanup.read`, a reader's share
/// of it) with a command sent at `sent`, `cleanup` still armed: gives it back and reports it
/// lost when the answer came too late to count on its lease; gives it back when fewer
/// replicas than `wait_replicas` asks for acknowledged it (`acked`); otherwise registers it
/// for renewal and hands out the guard's parts.
async fn hold(
    shared: &Arc<Shared>,
    request: &LockRequest<'_>,
    mut cleanup: Cleanup,
    lease: Duration,
    sent: Instant,
    fencing_token: Option<u64>,
    acked: Option<u64>,
) -> Result<WaitTry, LockError> {
    let kind = cleanup.kind;
    let what = kind.what();
    // The lease began when the server ran the command, at some moment after `sent`:
    // an answer that comes late leaves too little of it to hold the lock, or none (the
    // server may have let someone else take it already). Such a lock is given back,
    // by the still armed cleanup, and reported lost: a wait tries again.
    crate::lease::check_answer_time(request.key, lease, sent.elapsed(), what, NAME)?;
    if let (Some((wanted, wait)), Some(acked)) = (shared.wait, acked)
        && acked < u64::from(wanted)
    {
        // The still armed cleanup gives the lock back. Behind Sentinel, a master left
        // without its replicas may have been replaced: the next command asks.
        shared.conn.suspect_master();
        return Err(LockError::unavailable(
            NAME,
            format!(
                "the {what} was taken, but only {acked} of the {wanted} replicas asked for \
                 (`wait_replicas`) acknowledged it within {wait:?}; it was given back, \
                 since a failover could lose it (are the replicas up and connected?)"
            ),
            None,
        ));
    }
    let lock_key = Arc::clone(&cleanup.key);
    let token = cleanup.token.clone();
    if kind == Kind::Lock {
        // Still armed: dropped while the intent's `DEL` is on its way, the lock is given back.
        read::writer_got(shared, &lock_key).await;
    }
    // Nothing is awaited from here to the handle's hand-over.
    cleanup.armed = false;
    let lost = CancellationToken::new();
    let (renewal, deadline) = match Renewals::register(
        shared,
        kind,
        Arc::clone(&lock_key),
        token.clone(),
        lease,
        sent,
        lost.clone(),
        request.renew,
    ) {
        Ok(registered) => registered,
        Err(err) => {
            // Without renewal the lock could not be kept: give it back.
            let release = give_back(shared, kind, &lock_key, &token);
            let _ = shared.bounded("releasing a lock", release).await;
            return Err(err);
        }
    };
    shared.write_owner_label(sent);
    Ok(WaitTry::Acquired(
        Acquired::new(
            fencing_token,
            lost.clone(),
            Box::new(RedisHeld {
                shared: Arc::clone(shared),
                key: lock_key,
                token,
                lost,
                renewal,
                kind,
            }),
        )
        .with_lease_deadline(deadline),
    ))
}

/// What a backend holds under an owner token: a lock, a reader's share of one, or a
/// semaphore's permit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A lock: its key holds the token (see the module docs).
    Lock,
    /// A reader's share of a lock, in its readers' set (see [Read locks](self#read-locks)).
    Read,
    /// A semaphore's permit, in its permits' set (see [Semaphores](self#semaphores)).
    Permit,
}

impl Kind {
    /// What it is called in messages.
    fn what(self) -> &'static str {
        match self {
            Kind::Lock => "lock",
            Kind::Read => "read lock",
            Kind::Permit => "semaphore permit",
        }
    }
}

/// Gives back what `token` holds under `key` (a lock's key; a semaphore's permits' key).
async fn give_back(
    shared: &Shared,
    kind: Kind,
    key: &[u8],
    token: &OwnerToken,
) -> Result<(ReleaseOutcome, CommandPath), RedisError> {
    match kind {
        Kind::Lock => shared.conn.release(key, token).await,
        Kind::Read => read::release(shared, key, token).await,
        Kind::Permit => permits::release(shared, key, token).await,
    }
}

/// Gives back a possibly taken lock (or reader's share, or permit) of an acquisition that did
/// not finish.
struct Cleanup {
    shared: Arc<Shared>,
    /// The lock's key (a semaphore's permits' key).
    key: Arc<[u8]>,
    token: OwnerToken,
    armed: bool,
    /// What the acquisition takes, and so what is given back.
    kind: Kind,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (shared, key, token, kind) = (
            Arc::clone(&self.shared),
            Arc::clone(&self.key),
            self.token.clone(),
            self.kind,
        );
        // Registered before the acquisition's future is gone: the key's next acquisition
        // through this backend waits until it has run.
        let settle = shared.settling.begin(Arc::clone(&key));
        drop(runtime.spawn(async move {
            let _settle = settle;
            let what = "cleaning up an abandoned acquisition";
            let outcome = shared
                .bounded(what, give_back(&shared, kind, &key, &token))
                .await;
            if let Err(err) = outcome {
                tracing::warn!(error = %err, kind = kind.what(), "an abandoned redis acquisition could not be cleaned up; it frees itself when its lease runs out");
            }
        }));
    }
}

struct RedisHeld {
    shared: Arc<Shared>,
    /// The lock's Redis key (its name is read back from it for an error, see
    /// [`RedisHeld::name`]).
    key: Arc<[u8]>,
    token: OwnerToken,
    lost: CancellationToken,
    /// Its entry in the backend's renewals.
    renewal: u64,
    /// A lock, a reader's share of one, or a semaphore's permit (whose key is the permits').
    kind: Kind,
}

impl RedisHeld {
    /// The lock's (or semaphore's) name, as the caller gave it: read back from its key, where
    /// it is kept once.
    fn name(&self) -> Arc<str> {
        let (layout, prefix) = (self.shared.layout, &self.shared.prefix[..]);
        let name = match self.kind {
            Kind::Permit => permits::semaphore_name(layout, prefix, &self.key),
            Kind::Lock | Kind::Read => inspect::lock_name(layout, prefix, &self.key),
        }
        .unwrap_or_else(|| String::from_utf8_lossy(&self.key).into_owned());
        Arc::from(name)
    }
}

impl Drop for RedisHeld {
    fn drop(&mut self) {
        // Released or not, it is no longer renewed (a no-op after `release`).
        self.shared.renewals.remove(self.renewal);
    }
}

impl std::fmt::Debug for RedisHeld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisHeld")
            .field("key", &String::from_utf8_lossy(&self.key))
            .finish_non_exhaustive()
    }
}

impl RedisHeld {
    /// The release's command (a script or compare-and-delete, and the wake-up of waiters).
    async fn send_release(&self) -> Result<(ReleaseOutcome, CommandPath), RedisError> {
        if self.kind != Kind::Lock {
            return give_back(&self.shared, self.kind, &self.key, &self.token).await;
        }
        let sent = Instant::now();
        let (outcome, path, woke) = self
            .shared
            .conn
            .release_waking(&self.key, &self.token)
            .await?;
        if let Some(hold_offs) = &self.shared.hold_offs {
            // The backend's own subscriber, if it watches the key, heard it too.
            let own = u64::from(self.shared.wakes.wanted(&self.key));
            hold_offs.released(&self.key, woke.saturating_sub(own), sent.elapsed());
        }
        Ok((outcome, path))
    }

    /// The extension's owner-checked command.
    async fn send_extend(&self, lease: Duration) -> Result<(bool, CommandPath), RedisError> {
        match self.kind {
            Kind::Lock => self.shared.conn.extend(&self.key, &self.token, lease).await,
            Kind::Read => read::extend(&self.shared, &self.key, &self.token, lease).await,
            Kind::Permit => permits::extend(&self.shared, &self.key, &self.token, lease).await,
        }
    }
}

impl HeldLock for RedisHeld {
    fn release(self: Box<Self>) -> BoxFuture<'static, Result<(), LockError>> {
        let released = self.release_outcome();
        // Gone or taken over while we held it: the lost token fired, and the guard reports it.
        Box::pin(async move { released.await.map(drop) })
    }

    fn release_outcome(self: Box<Self>) -> BoxFuture<'static, Result<ReleaseOutcome, LockError>> {
        Box::pin(async move {
            self.shared.renewals.remove(self.renewal);
            let what = "releasing a lock";
            let started = Instant::now();
            let mut refusals = 0;
            // The command's future is made inside the call: held in a local, it would take
            // room in this future beside the fenced one that it moves into.
            let attempt = loop {
                let attempt = fenced(
                    &self.shared,
                    what,
                    Some(self.lost.clone()),
                    self.send_release(),
                )
                .await;
                // A node that stopped being the key's master while the topology moved (a
                // failover behind Sentinel or in a Cluster, a slot migration) refused the
                // delete without running it; the refusal made the connection look the master
                // up again. The owner-checked delete goes again there, within the timeout,
                // so the lock does not stay held until its lease runs out.
                if let Attempt::Failed(err) = &attempt
                    && self.shared.conn.can_move()
                    && cluster::refused_in_motion(err)
                    && started.elapsed() < self.shared.timeout
                {
                    refusals += 1;
                    tokio::time::sleep(cluster::IN_MOTION_RETRY * refusals).await;
                    continue;
                }
                break attempt;
            };
            match attempt {
                Attempt::Done((outcome, _)) => {
                    if outcome != ReleaseOutcome::Released {
                        self.lost.cancel();
                    }
                    Ok(outcome)
                }
                Attempt::Failed(err)
                | Attempt::Unknown {
                    error: err,
                    fence: Fence::NotFenced(_),
                } => Err(err),
                Attempt::Unknown {
                    fence: Fence::Killed(id),
                    ..
                } => {
                    // The delete ran before the kill or never will: which, nobody can say.
                    self.lost.cancel();
                    Err(LockError::Lost {
                        key: self.name(),
                        reason: format!(
                            "the release timed out after {:?} with its outcome unknown; the \
                             connection that sent it was killed (CLIENT KILL ID {id}), so the \
                             delete cannot run later. The lock counts as lost: if the delete \
                             did not run, it frees itself when its lease runs out",
                            self.shared.timeout
                        ),
                    })
                }
            }
        })
    }

    fn lease_control(&self) -> Option<&dyn LeaseControl> {
        Some(self)
    }
}

impl LeaseControl for RedisHeld {
    fn extend(&self, lease: Duration) -> BoxFuture<'_, Result<bool, LockError>> {
        Box::pin(async move {
            check_lease(lease)?;
            let sent = Instant::now();
            let what = "extending a lock";
            let extended = match fenced(&self.shared, what, None, self.send_extend(lease)).await {
                Attempt::Done((extended, _)) => extended,
                Attempt::Failed(err)
                | Attempt::Unknown {
                    error: err,
                    fence: Fence::NotFenced(_),
                } => return Err(err),
                Attempt::Unknown {
                    fence: Fence::Killed(id),
                    ..
                } => {
                    return Err(LockError::unavailable(
                        NAME,
                        format!(
                            "extending a lock timed out after {:?} with its outcome unknown; \
                             the connection that sent it was killed (CLIENT KILL ID {id}), so \
                             the extension ran before or never will, and the lock is renewed \
                             as before",
                            self.shared.timeout
                        ),
                        None,
                    ));
                }
            };
            if extended {
                self.shared.renewals.extended(self.renewal, lease, sent);
            } else {
                self.shared.renewals.lose(self.renewal);
            }
            Ok(extended)
        })
    }

    fn verify_still_held(&self) -> BoxFuture<'_, Result<bool, LockError>> {
        Box::pin(async move {
            if self.kind != Kind::Lock {
                let (shared, key, token) = (&self.shared, &self.key, &self.token);
                let held = if self.kind == Kind::Read {
                    let verify = read::verify(shared, key, token);
                    shared.bounded("reading a read lock", verify).await?
                } else {
                    let verify = permits::verify(shared, key, token);
                    shared.bounded("reading a semaphore permit", verify).await?
                };
                if !held {
                    self.shared.renewals.lose(self.renewal);
                }
                return Ok(held);
            }
            // One `GET`: the owner is all that is asked (no transaction, so `+get` is the only
            // permission it needs).
            let mut get = redis::cmd("GET");
            get.arg(&self.key[..]);
            let read = self.shared.conn.query(&get);
            let owner = self.shared.bounded("reading a lock", read).await?;
            let held = matches!(&owner, redis::Value::BulkString(bytes) if bytes[..] == *self.token.as_bytes());
            if !held {
                self.shared.renewals.lose(self.renewal);
            }
            Ok(held)
        })
    }

    fn stop_renewal(&self) {
        self.shared.renewals.stop(self.renewal);
    }

    fn start_renewal(&self) -> Result<bool, LockError> {
        Ok(self.shared.renewals.resume(self.renewal))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn urls() {
        crate::options::assert_keys::<RedisOption, _>(parse_url("redis://h/?bogus=1"));
        let b = parse_url("redis://127.0.0.1:1/0?lease=2s&prefix=locks:&fencing=false&timeout=1s")
            .unwrap();
        assert_eq!(b.lease, Duration::from_secs(2));
        assert_eq!(b.prefix, "locks:");
        assert!(!b.fencing);
        assert_eq!(b.timeout, Duration::from_secs(1));
        assert_eq!(b.layout, KeyLayout::Tagged);
        let plain = parse_url("redis://h/?key_layout=plain&prefix=a{b}:").unwrap();
        assert_eq!(plain.layout, KeyLayout::Plain);
        let tagged = parse_url("redis://h/?key_layout=tagged").unwrap();
        assert_eq!(tagged.layout, KeyLayout::Tagged);
        for bad in [
            "redis://h/?lease=soon",
            "redis://h/?colour=blue",
            "redis://h/?fencing=maybe",
            "redis://h/?key_layout=flat",
            "redis://user:hunter2@[::1/",
        ] {
            let err = parse_url(bad).expect_err(bad);
            assert_eq!(err.code(), "DistributedLock.Configuration", "{bad}: {err}");
            assert!(!err.to_string().contains("hunter2"), "{err}");
        }
    }

    /// `protocol` reads alike on the URLs whose client dlock builds from the parts.
    #[test]
    fn protocol_option_on_cluster_and_sentinel_urls() {
        let sentinel = |query: &str| parse_url(&format!("redis+sentinel://a:26379/m?{query}"));
        for url in ["protocol=resp2", "protocol=RESP3", "lease=2s"] {
            assert!(sentinel(url).is_ok(), "{url}");
        }
        for (bad, url) in [
            ("sentinel", sentinel("protocol=resp4")),
            ("cluster", parse_url("redis+cluster://a:7000?protocol=3")),
        ] {
            let err = url.expect_err(bad);
            assert!(
                err.to_string()
                    .contains("`protocol` is `resp2` (the default) or `resp3`"),
                "{bad}: {err}"
            );
        }
    }

    #[tokio::test]
    async fn fair_waits_option() {
        for url in [
            "redis://h/",
            "redis+cluster://a:7000",
            "redis+sentinel://a:26379/m",
        ] {
            assert!(parse_url(url).unwrap().fair_waits, "{url}");
            let off = parse_url(&format!("{url}?fair_waits=false")).unwrap();
            assert!(!off.fair_waits, "{url}");
            let err = parse_url(&format!("{url}?fair_waits=maybe")).expect_err(url);
            assert!(err.to_string().contains("fair_waits"), "{url}: {err}");
        }
    }

    #[tokio::test]
    async fn cluster_urls() {
        let b =
            parse_url("redis+cluster://a:7000,b:7001?lease=2s&prefix=p:&wait_replicas=1").unwrap();
        assert!(matches!(b.source, Source::Cluster(_)));
        assert_eq!(b.lease, Duration::from_secs(2));
        assert_eq!(b.prefix, "p:");
        assert_eq!(b.wait_replicas, 1);
        assert!(parse_url("redis+cluster://u:hunter2@a:7000/?protocol=resp3").is_ok());
        for bad in [
            "redis+cluster://a:7000?ca=/x.pem",
            "rediss+cluster://a:7000?sentinel_username=x",
            "redis+cluster://a:7000?sentinel_username=x",
            "redis+cluster://a:7000?check_master_every=1s",
            "redis+cluster://a:7000?protocol=resp4",
            "redis+cluster://u:hunter2@a:7000/1",
            "redis+cluster://a:7000?bogus=1",
        ] {
            let err = parse_url(bad).expect_err(bad);
            assert_eq!(err.code(), "DistributedLock.Configuration", "{bad}: {err}");
            assert!(!err.to_string().contains("hunter2"), "{err}");
        }
        // Sentinel settings on a cluster builder are refused when connecting.
        let err = parse_url("redis+cluster://127.0.0.1:1")
            .unwrap()
            .database(1)
            .connect()
            .await
            .unwrap_err();
        assert!(err.to_string().contains("`database`"), "{err}");
        for code in ["TRYAGAIN", "MOVED", "ASK", "CLUSTERDOWN", "READONLY"] {
            assert!(cluster::is_in_motion(code));
        }
        // Over TLS: the CA goes to the cluster client and the subscriber's client, not to the
        // builder (which would refuse it for a cluster); a CA file that is not PEM, or that
        // cannot be read, is refused before connecting.
        let dir = std::env::temp_dir().join(format!("dlock-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let not_pem = dir.join("not.pem");
        std::fs::write(&not_pem, "hello").unwrap();
        let b = parse_url("rediss+cluster://a:7000,b:7001?lease=2s").unwrap();
        assert!(b.ca.is_none());
        match &b.source {
            Source::Cluster(source) => assert!(matches!(
                source.1.as_ref().map(|c| c.get_connection_info().addr()),
                Some(redis::ConnectionAddr::TcpTls { host, port: 7000, .. }) if host == "a"
            )),
            _ => panic!("a cluster"),
        }
        for (url, says) in [
            (
                format!("rediss+cluster://a:7000?ca={}", not_pem.display()),
                "holds no certificate",
            ),
            (
                "rediss+cluster://a:7000?ca=/no/such.pem".to_owned(),
                "cannot be read",
            ),
            (
                "redis+sentinel://a:1/s?ca=/x.pem".to_owned(),
                "needs a TLS connection",
            ),
        ] {
            let err = parse_url(&url).expect_err(&url);
            assert!(err.to_string().contains(says), "{url}: {err}");
        }
        let b = parse_url("REDISS+SENTINEL://a:1,b:2/mymaster?lease=2s").unwrap();
        assert!(matches!(&b.source, Source::Sentinel(s) if s.tls.is_some()));
        let b = parse_url("redis+sentinel://a:1/mymaster").unwrap();
        assert!(matches!(&b.source, Source::Sentinel(s) if s.tls.is_none()));
        // `sentinel_tls` and a CA without TLS on a sentinel builder.
        let err = RedisBackend::builder(redis::Client::open("redis://127.0.0.1:1").unwrap())
            .sentinel_tls()
            .connect()
            .await
            .unwrap_err();
        assert!(err.to_string().contains("`sentinel_tls`"), "{err}");
        let err = RedisBackend::sentinel_builder([("127.0.0.1", 1)], "s")
            .ca_certificates(b"x".to_vec())
            .connect()
            .await
            .unwrap_err();
        assert!(err.to_string().contains("rediss+sentinel://"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(!cluster::is_in_motion("NOPERM") && !cluster::is_in_motion("UNBLOCKED"));
    }

    #[test]
    fn keys_keep_their_hash_tag() {
        assert_eq!(storage_key(b"p:", "a{b}c%"), b"p:{a%7Bb%7Dc%25}".to_vec());
        assert_eq!(storage_key(b"", "}"), b"{%7D}".to_vec());
        assert_eq!(storage_key(b"", "%7D"), b"{%257D}".to_vec());
        assert_eq!(
            fence_key(KeyLayout::Tagged, b"p:{k}"),
            b"p:{k}:fence".to_vec()
        );
        assert_eq!(
            fence_key(KeyLayout::Plain, b"p:k"),
            b"p:k\xff:fence".to_vec()
        );
    }
}
