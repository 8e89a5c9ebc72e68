//! Section 10: the multi-node deployments (Redis Cluster, Redis Sentinel, Redlock over
//! independent nodes, etcd), each started here as a throwaway deployment on loopback:
//! uncontended acquire + release against a raw client sending the same commands (and `rslock`
//! on the Redlock nodes), handover, and the server's commands while 100 waiters wait.

use std::cell::RefCell;
use std::time::{Duration, Instant};

use dlock::LockProvider;
use tokio::runtime::Runtime;

use crate::measure::{Batch, Contender, interleave, median, quantile, sized};
use crate::output::{Report, Row, Target, time};
use crate::peers::Peers;
use crate::servers::{batch, on_worker, rounds};
use dlock_suite::raw;
use dlock_testkit::redis::{Flavor, RedisCluster, RedisServer, SentinelDeployment};

/// Section 10's title.
pub const S10: &str = "10. Multi-node deployments: Redis Cluster (3 masters + 3 replicas), \
                       Sentinel (master + replica + 3 sentinels), Redlock (3 nodes), etcd (3 members)";

/// How section 10 measures, for the report's notes.
pub const NOTE: &str = "10: each deployment is started for this section on loopback (Redis \
     Cluster: 3 masters with a replica each; Sentinel: a master, a replica and 3 sentinels, \
     dlock connecting through the sentinels; Redlock: 3 independent Redis nodes; etcd: 3 \
     members). dlock / raw as 1 (etcd: batches 5 times longer): on Redis, dlock \
     `fencing=false` against a raw client sending the same commands, `SET NX PX` then the Lua \
     compare-and-delete, through a cluster connection routing by the key's slot (Cluster), on \
     the master the sentinels name (Sentinel), or to all 3 nodes at once, a quorum of 2 \
     required (Redlock); on etcd, dlock's default against `etcd-client` sending `LeaseGrant`, a \
     transaction that puts a key on the lease if none is under the lock's prefix, a \
     transaction that deletes it if still the one put, and `LeaseRevoke` in the background, as \
     dlock releases. `rslock` (benches/peers) takes the lock on the same 3 Redlock nodes; on \
     etcd, etcd's own Lock service (the one `etcdctl lock` uses) through `etcd-client`: \
     `LeaseGrant`, `Lock` on the lease, `Unlock`, `LeaseRevoke` in the background. \
     Handover as 2; its p99 is held to 2 ms where one node's release announcement wakes the \
     waiters (Cluster, Sentinel). The herd as 3, with a 20 s window for every deployment: \
     `INFO commandstats` (less `INFO`) summed over the masters that serve slots (Cluster), \
     the master (Sentinel) or all 3 nodes (Redlock, where every try runs on each node: 15 /s \
     is its target), and etcd's `grpc_server_msg_received_total` of every member's `/metrics` \
     (requests and stream messages received; etcd waiters watch the key ahead of theirs and \
     renew their own leases, and no target is set for them). From each count the deployment's own traffic \
     (sentinels' pings and hellos, replicas' acknowledgements, members' own) is taken, \
     measured over the same window before any client connected; the count is first checked \
     to see 20 requests of another client. \
     The Cluster's handover key lives on another master than the URL's first; the waiters \
     subscribe on the key's own master, found in the slot map. Before they did (they \
     subscribed on the URL's first node, and each release reached them over the cluster bus), \
     the Cluster's p99 was 38-42 ms: in a check of 400 `PUBLISH`es on another master, 1 to 3 \
     arrived about 40 ms late, none when published on the subscriber's own node (at most \
     0.7 ms).";

/// The key every dlock and raw acquisition of the uncontended comparison takes.
const RAW_KEY: &str = "bench:deploy-raw";

/// The key dlock takes in the uncontended comparison.
const DLOCK_KEY: &str = "bench:deploy-dlock";

/// The lock name a peer takes in the uncontended comparison.
#[cfg(feature = "etcd")]
const PEER_KEY: &str = "bench:deploy-peer";

/// One throwaway deployment.
enum Deployment {
    /// Redis Cluster: 3 masters with a replica each.
    Cluster(RedisCluster),
    /// A master, one replica and three sentinels.
    Sentinel(SentinelDeployment),
    /// Three independent Redis nodes.
    Redlock(Vec<RedisServer>),
    /// Three etcd members.
    #[cfg(feature = "etcd")]
    Etcd(dlock_testkit::etcd::EtcdCluster),
}

/// A deployment under test, or why it cannot be.
struct Setup {
    /// `Redis Cluster`, `Redis Sentinel`, `Redlock` or `etcd` (what `--backend` matches).
    label: &'static str,
    deployment: Result<Deployment, String>,
    /// Its server binary is not installed (or the build lacks its feature): no failure.
    excused: bool,
}

impl Setup {
    /// A row of this deployment not measured, and why; no failure when it is excused.
    fn not_measured(&self, name: &str, why: &str, target: &str) -> Row {
        Row::not_measured(S10, &format!("{}: {name}", self.label), why, target)
            .excused_if(self.excused)
    }
}

impl Deployment {
    /// The URL dlock connects with, with `options`.
    fn dlock_url(&self, options: &str) -> String {
        match self {
            Deployment::Cluster(c) => c.url(options),
            Deployment::Sentinel(s) => s.url(options),
            Deployment::Redlock(nodes) => {
                let hosts: Vec<String> = nodes
                    .iter()
                    .map(|n| format!("127.0.0.1:{}", n.port()))
                    .collect();
                let mut url = format!("redlock://{}", hosts.join(","));
                if !options.is_empty() {
                    url.push_str("/?");
                    url.push_str(options);
                }
                url
            }
            #[cfg(feature = "etcd")]
            Deployment::Etcd(e) => e.url(options),
        }
    }

    /// The options of the uncontended comparison: on Redis, `fencing=false`, whose commands
    /// (`SET NX PX`, the Lua compare-and-delete) the raw client sends.
    fn compared_options(&self) -> &'static str {
        match self {
            #[cfg(feature = "etcd")]
            Deployment::Etcd(_) => "",
            _ => "fencing=false",
        }
    }

    /// The Redis data nodes whose commands are counted: the masters of a cluster, the master
    /// behind the sentinels, every Redlock node.
    fn counted_nodes(&self) -> Vec<&RedisServer> {
        match self {
            Deployment::Cluster(c) => c.masters().into_iter().map(|p| c.node(p)).collect(),
            Deployment::Sentinel(s) => vec![s.node(s.master_port())],
            Deployment::Redlock(nodes) => nodes.iter().collect(),
            #[cfg(feature = "etcd")]
            Deployment::Etcd(_) => Vec::new(),
        }
    }
}

/// Runs `start`, turning a panic into its message and `None` into "not installed".
pub(crate) fn caught<T>(
    start: impl FnOnce() -> Option<T> + std::panic::UnwindSafe,
) -> Result<T, String> {
    match std::panic::catch_unwind(start) {
        Ok(Some(t)) => Ok(t),
        Ok(None) => Err(NOT_INSTALLED.to_owned()),
        Err(e) => Err(e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "the deployment did not start".to_owned())),
    }
}

/// Why a deployment is missing when a binary it needs is not installed.
const NOT_INSTALLED: &str = "server binary not installed";

/// Whether the Redis 7 server binary is installed.
fn redis_installed() -> bool {
    Flavor::Redis7.binary().is_some_and(|p| p.is_file())
}

/// Starts the deployments a partial run chose (`--backend`), each or why not.
fn start_all() -> Vec<Setup> {
    type Start = Box<dyn FnOnce() -> (Result<Deployment, String>, bool)>;
    let redis = |start: fn() -> Option<Deployment>| -> Start {
        Box::new(move || {
            if !redis_installed() {
                return (Err(NOT_INSTALLED.to_owned()), true);
            }
            let started = caught(start);
            let excused = started.as_ref().is_err_and(|e| e == NOT_INSTALLED);
            (started, excused)
        })
    };
    let all: Vec<(&'static str, Start)> = vec![
        (
            "Redis Cluster",
            redis(|| RedisCluster::start().map(Deployment::Cluster)),
        ),
        (
            "Redis Sentinel",
            redis(|| {
                // Failover is not measured: the default down-after of the tests will do.
                SentinelDeployment::start(Duration::from_secs(1)).map(Deployment::Sentinel)
            }),
        ),
        (
            "Redlock",
            redis(|| {
                (0..3)
                    .map(|_| RedisServer::start(Flavor::Redis7))
                    .collect::<Option<Vec<_>>>()
                    .map(Deployment::Redlock)
            }),
        ),
        ("etcd", Box::new(start_etcd)),
    ];
    all.into_iter()
        .filter(|(label, _)| crate::measure::backend(label))
        .map(|(label, start)| {
            eprintln!(" starting {label}");
            let (deployment, excused) = start();
            Setup {
                label,
                deployment,
                excused,
            }
        })
        .collect()
}

/// Starts 3 etcd members.
#[cfg(feature = "etcd")]
fn start_etcd() -> (Result<Deployment, String>, bool) {
    if dlock_testkit::etcd::binary().is_none() {
        return (Err(NOT_INSTALLED.to_owned()), true);
    }
    let started = caught(|| dlock_testkit::etcd::EtcdCluster::start(3).map(Deployment::Etcd));
    let excused = started.as_ref().is_err_and(|e| e == NOT_INSTALLED);
    (started, excused)
}

/// Without the `etcd` feature there is no etcd deployment (no failure).
#[cfg(not(feature = "etcd"))]
fn start_etcd() -> (Result<Deployment, String>, bool) {
    (
        Err("built without the `etcd` feature (run with --all-features)".to_owned()),
        true,
    )
}

/// Section 10: per deployment, uncontended acquire + release against the raw client (and
/// `rslock` on the Redlock nodes), handover, and the herd.
pub fn run(rt: &Runtime, peers: &RefCell<Peers>, report: &mut Report) {
    for setup in start_all() {
        eprintln!(" {}", setup.label);
        let d = match &setup.deployment {
            Ok(d) => d,
            Err(e) => {
                for (name, target) in [
                    ("dlock / raw", "≤ 1.10×"),
                    ("release → next holder, median / p99", "—"),
                    ("commands/s while 100 waiters wait", "—"),
                ] {
                    report.add(setup.not_measured(name, e, target));
                }
                if matches!(setup.label, "Redlock") {
                    report.add(setup.not_measured("rslock / dlock", e, "≥ 1.00×"));
                }
                continue;
            }
        };
        uncontended(rt, &setup, d, peers, report);
        handover_row(rt, &setup, d, report);
        herd_row(rt, &setup, d, report);
    }
}

/// dlock's acquire + release on `key`, `n` times, on a worker thread.
fn dlock_batch<'a>(rt: &'a Runtime, locks: &'a LockProvider, key: &'a str) -> Box<Batch<'a>> {
    Box::new(move |n| {
        let (locks, key) = (locks.clone(), key.to_owned());
        on_worker(rt, async move {
            let t = Instant::now();
            for _ in 0..n {
                let guard = locks.try_acquire(&key).await.map_err(|e| e.to_string())?;
                guard.release().await.map_err(|e| e.to_string())?;
            }
            Ok(t.elapsed())
        })
    })
}

/// The raw client's acquire + release on one deployment: the commands dlock sends, straight
/// through the driver.
fn raw_batch<'a>(rt: &'a Runtime, d: &Deployment) -> Result<Box<Batch<'a>>, String> {
    let script = redis::Script::new(raw::REDIS_RELEASE_LUA);
    Ok(match d {
        Deployment::Cluster(c) => {
            // The same commands, routed by the key's slot to its master.
            let urls: Vec<String> = c
                .ports()
                .iter()
                .map(|p| format!("redis://127.0.0.1:{p}/"))
                .collect();
            let client = redis::cluster::ClusterClient::new(urls).map_err(|e| e.to_string())?;
            let conn = rt
                .block_on(client.get_async_connection())
                .map_err(|e| e.to_string())?;
            Box::new(move |n| {
                let (mut conn, script) = (conn.clone(), script.clone());
                on_worker(rt, async move {
                    let t = Instant::now();
                    for _ in 0..n {
                        raw::redis(&mut conn, &script, RAW_KEY).await;
                    }
                    Ok(t.elapsed())
                })
            })
        }
        Deployment::Sentinel(s) => {
            // The master the sentinels name, as dlock finds it once and then keeps.
            let master = s.node(s.master_port());
            let conn = rt
                .block_on(redis::aio::ConnectionManager::new(master.client()))
                .map_err(|e| e.to_string())?;
            Box::new(move |n| {
                let (mut conn, script) = (conn.clone(), script.clone());
                on_worker(rt, async move {
                    let t = Instant::now();
                    for _ in 0..n {
                        raw::redis(&mut conn, &script, RAW_KEY).await;
                    }
                    Ok(t.elapsed())
                })
            })
        }
        Deployment::Redlock(nodes) => {
            let conns = nodes
                .iter()
                .map(|n| rt.block_on(redis::aio::ConnectionManager::new(n.client())))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| e.to_string())?;
            Box::new(move |n| {
                let (conns, script) = (conns.clone(), script.clone());
                on_worker(rt, async move {
                    let t = Instant::now();
                    for _ in 0..n {
                        raw_redlock(&conns, &script).await?;
                    }
                    Ok(t.elapsed())
                })
            })
        }
        #[cfg(feature = "etcd")]
        Deployment::Etcd(e) => {
            let client = rt
                .block_on(dlock::etcd::etcd_client::Client::connect(
                    e.endpoints(),
                    None,
                ))
                .map_err(|e| e.to_string())?;
            Box::new(move |n| {
                let client = client.clone();
                on_worker(rt, async move {
                    let t = Instant::now();
                    for _ in 0..n {
                        raw_etcd(&client).await?;
                    }
                    Ok(t.elapsed())
                })
            })
        }
    })
}

/// Redlock on the driver: `SET NX PX` on every node at once, then the Lua compare-and-delete
/// on every node at once; a quorum (2 of 3) must grant and release.
async fn raw_redlock(
    conns: &[redis::aio::ConnectionManager],
    script: &redis::Script,
) -> Result<(), String> {
    let token = "token-0123456789";
    let set = futures::future::join_all(conns.iter().map(|c| {
        let mut c = c.clone();
        async move {
            redis::cmd("SET")
                .arg(RAW_KEY)
                .arg(token)
                .arg("NX")
                .arg("PX")
                .arg(30_000)
                .query_async::<Option<String>>(&mut c)
                .await
        }
    }))
    .await;
    let quorum = conns.len() / 2 + 1;
    if set.iter().filter(|r| matches!(r, Ok(Some(_)))).count() < quorum {
        return Err("a quorum did not grant the key".to_owned());
    }
    let deleted = futures::future::join_all(conns.iter().map(|c| {
        let mut c = c.clone();
        async move {
            script
                .key(RAW_KEY)
                .arg(token)
                .invoke_async::<i64>(&mut c)
                .await
        }
    }))
    .await;
    if deleted.iter().filter(|r| matches!(r, Ok(1))).count() < quorum {
        return Err("a quorum did not release the key".to_owned());
    }
    Ok(())
}

/// etcd on the client: `LeaseGrant`; a transaction that puts a key of the lease's under the
/// queue prefix if none is there; a transaction that deletes the key if it is still the one
/// put; `LeaseRevoke` in the background, as dlock releases.
#[cfg(feature = "etcd")]
async fn raw_etcd(client: &dlock::etcd::etcd_client::Client) -> Result<(), String> {
    use dlock::etcd::etcd_client::{
        Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget, Txn, TxnOp,
    };
    let e = |e: dlock::etcd::etcd_client::Error| e.to_string();
    let queue = format!("dlock/{RAW_KEY}/").into_bytes();
    let lease = client.lease_client().grant(30, None).await.map_err(e)?.id();
    let mut key = queue.clone();
    key.extend_from_slice(format!("{lease:x}").as_bytes());
    let head = GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
        .with_limit(1);
    let put = Txn::new()
        .when([Compare::create_revision(queue.clone(), CompareOp::Equal, 0).with_prefix()])
        .and_then([TxnOp::put(
            key.clone(),
            [],
            Some(PutOptions::new().with_lease(lease)),
        )])
        .or_else([TxnOp::get(queue.clone(), Some(head))]);
    let answer = client.kv_client().txn(put).await.map_err(e)?;
    if !answer.succeeded() {
        return Err("the key was not free".to_owned());
    }
    let revision = answer
        .header()
        .map(|h| h.revision())
        .ok_or("no header in the answer")?;
    let delete = Txn::new()
        .when([Compare::create_revision(
            key.clone(),
            CompareOp::Equal,
            revision,
        )])
        .and_then([TxnOp::delete(key, None)])
        .or_else([TxnOp::get(
            queue,
            Some(
                GetOptions::new()
                    .with_prefix()
                    .with_limit(1)
                    .with_keys_only(),
            ),
        )]);
    let answer = client.kv_client().txn(delete).await.map_err(e)?;
    if !answer.succeeded() {
        return Err("the release deleted nothing".to_owned());
    }
    let mut leases = client.lease_client();
    tokio::spawn(async move {
        let _ = leases.revoke(lease).await;
    });
    Ok(())
}

/// The uncontended comparison of one deployment: raw, dlock (and `rslock` on Redlock) in
/// interleaved rounds.
fn uncontended(
    rt: &Runtime,
    setup: &Setup,
    d: &Deployment,
    peers: &RefCell<Peers>,
    report: &mut Report,
) {
    let name = "dlock / raw";
    let locks = match rt.block_on(LockProvider::connect(&d.dlock_url(d.compared_options()))) {
        Ok(l) => l,
        Err(e) => {
            report.add(setup.not_measured(name, &e.to_string(), "≤ 1.10×"));
            return;
        }
    };
    let mut raw_side = match raw_batch(rt, d) {
        Ok(b) => b,
        Err(e) => {
            report.add(setup.not_measured(name, &e, "≤ 1.10×"));
            return;
        }
    };
    let mut dlock_side = dlock_batch(rt, &locks, DLOCK_KEY);
    // The peer where one supports the deployment: rslock on the Redlock nodes, through the
    // peers' workspace; etcd's own Lock service, through `etcd-client`.
    let mut peer: Option<Result<Box<Batch<'_>>, String>> = None;
    let mut peer_name = "";
    if let Deployment::Redlock(nodes) = d {
        let urls: Vec<String> = nodes
            .iter()
            .map(|n| format!("redis://127.0.0.1:{}/", n.port()))
            .collect();
        let set_up = peers.borrow_mut().setup("rslock", &urls.join(","));
        peer_name = "rslock";
        peer = Some(set_up.map(|()| -> Box<Batch<'_>> {
            Box::new(move |n| peers.borrow_mut().run("rslock", n))
        }));
    }
    #[cfg(feature = "etcd")]
    if let Deployment::Etcd(e) = d {
        peer_name = "etcd Lock service";
        peer = Some(etcd_lock_service_batch(rt, e));
    }
    let mut contenders = vec![
        Contender::new("raw", &mut *raw_side),
        Contender::new("dlock", &mut *dlock_side),
    ];
    if let Some(Ok(p)) = peer.as_mut() {
        contenders.push(Contender::new(peer_name, &mut **p));
    }
    // etcd answers in milliseconds (each write is agreed and synced to disk): longer
    // batches, so that each holds more than a few cycles.
    let batch_time = match d {
        #[cfg(feature = "etcd")]
        Deployment::Etcd(_) => sized(batch() * 5, batch()),
        _ => batch(),
    };
    let results = interleave(&mut contenders, rounds(), batch_time);
    drop(contenders);
    let dlock_label = if d.compared_options().is_empty() {
        "dlock"
    } else {
        "dlock fencing=false"
    };
    match (&results[0], &results[1]) {
        (Ok(raw), Ok(dl)) => report.add(Row::ratio(
            S10,
            &format!("{}: {name}", setup.label),
            (dlock_label, dl),
            ("raw", raw),
            Target::AtMost(1.10),
        )),
        (Err(e), _) | (_, Err(e)) => report.add(setup.not_measured(name, e, "≤ 1.10×")),
    }
    let skipped = peers.borrow().skipped();
    let peer_row = format!("{peer_name} / dlock");
    match (peer, results.get(2), &results[1]) {
        (None, _, _) => {}
        (Some(Err(e)), _, _) => report.add(
            setup
                .not_measured(&peer_row, &e, "≥ 1.00×")
                .excused_if(setup.excused || skipped),
        ),
        (Some(Ok(_)), Some(Ok(p)), Ok(dl)) => report.add(Row::ratio(
            S10,
            &format!("{}: {peer_row}", setup.label),
            (peer_name, p),
            (dlock_label, dl),
            Target::AtLeast(1.0),
        )),
        (Some(Ok(_)), Some(Err(e)), _) | (Some(Ok(_)), _, Err(e)) => {
            report.add(setup.not_measured(&peer_row, e, "≥ 1.00×"))
        }
        (Some(Ok(_)), None, _) => report.add(setup.not_measured(&peer_row, "no result", "≥ 1.00×")),
    }
}

/// etcd's own Lock service (`etcdctl lock`'s, server-side: a key on the caller's lease under
/// the lock's prefix, granted once every earlier key is gone) through `etcd-client`, doing
/// what dlock does for one uncontended lock: `LeaseGrant`, `Lock`, `Unlock`, and
/// `LeaseRevoke` in the background.
#[cfg(feature = "etcd")]
fn etcd_lock_service_batch<'a>(
    rt: &'a Runtime,
    e: &dlock_testkit::etcd::EtcdCluster,
) -> Result<Box<Batch<'a>>, String> {
    use dlock::etcd::etcd_client::{Client, LockOptions};
    let client = rt
        .block_on(Client::connect(e.endpoints(), None))
        .map_err(|e| e.to_string())?;
    Ok(Box::new(move |n| {
        let client = client.clone();
        on_worker(rt, async move {
            let e = |e: dlock::etcd::etcd_client::Error| e.to_string();
            let t = Instant::now();
            for _ in 0..n {
                let lease = client.lease_client().grant(30, None).await.map_err(e)?.id();
                let locked = client
                    .lock_client()
                    .lock(PEER_KEY, Some(LockOptions::new().with_lease(lease)))
                    .await
                    .map_err(e)?;
                client.lock_client().unlock(locked.key()).await.map_err(e)?;
                let mut leases = client.lease_client();
                tokio::spawn(async move {
                    let _ = leases.revoke(lease).await;
                });
            }
            Ok(t.elapsed())
        })
    }))
}

/// Handover on one deployment: 16 waiters over 4 providers (as section 2).
fn handover_row(rt: &Runtime, setup: &Setup, d: &Deployment, report: &mut Report) {
    let name = "release → next holder, median / p99";
    match rt.block_on(crate::servers::handover(
        &d.dlock_url(&std::env::var("HANDOVER_OPTS").unwrap_or_default()),
        "bench:deploy-handover",
    )) {
        Ok(samples) if samples.is_empty() => {
            report.add(setup.not_measured(name, "no handover seen", "—"))
        }
        Ok(samples) => {
            let p99 = quantile(&samples, 0.99);
            let text = format!(
                "{} / {} ({} handovers)",
                time(median(&samples)),
                time(p99),
                samples.len()
            );
            let row_name = format!("{}: {name}", setup.label);
            report.add(match d {
                // Waiters woken by the release's announcement, on the one node that holds
                // the key, as on a single Redis server: the p99 is held to 2 ms.
                Deployment::Cluster(_) | Deployment::Sentinel(_) => {
                    Row::text_figure(S10, &row_name, text, p99, "ns", Target::AtMost(2e6))
                }
                _ => Row::info(S10, &row_name, text),
            });
        }
        Err(e) => report.add(setup.not_measured(name, &e, "—")),
    }
}

/// What the herd's count reads: Redis data nodes' `INFO commandstats` (less `INFO` itself),
/// or the etcd members' gRPC messages received (`grpc_server_msg_received_total` of
/// `/metrics`, which the HTTP read itself does not add to).
enum Count<'a> {
    Redis(Vec<&'a RedisServer>),
    #[cfg(feature = "etcd")]
    Etcd(Vec<String>),
}

impl Count<'_> {
    /// The total now, over every counted node.
    async fn total(&self) -> Result<u64, String> {
        match self {
            Count::Redis(nodes) => Ok(nodes
                .iter()
                .flat_map(|n| n.command_calls())
                .filter(|(name, _)| name != "info")
                .map(|(_, calls)| calls)
                .sum()),
            #[cfg(feature = "etcd")]
            Count::Etcd(endpoints) => {
                let http = reqwest::Client::new();
                let mut sum = 0.0;
                for endpoint in endpoints {
                    let text = http
                        .get(format!("{endpoint}/metrics"))
                        .send()
                        .await
                        .map_err(|e| e.to_string())?
                        .text()
                        .await
                        .map_err(|e| e.to_string())?;
                    sum += text
                        .lines()
                        .filter(|l| l.starts_with("grpc_server_msg_received_total{"))
                        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                        .sum::<f64>();
                }
                Ok(sum as u64)
            }
        }
    }

    /// Checks that the count sees another client's requests: 20 must add at least 20.
    async fn check(&self, d: &Deployment) -> Result<(), String> {
        let before = self.total().await?;
        match (self, d) {
            (Count::Redis(nodes), _) => {
                let node = nodes.first().ok_or("no node to count")?;
                for _ in 0..20 {
                    node.raw(&["PING"]).ok_or("PING failed")?;
                }
            }
            #[cfg(feature = "etcd")]
            (Count::Etcd(_), Deployment::Etcd(e)) => {
                let client = dlock::etcd::etcd_client::Client::connect(e.endpoints(), None)
                    .await
                    .map_err(|e| e.to_string())?;
                for _ in 0..20 {
                    client
                        .kv_client()
                        .get("bench:count-check", None)
                        .await
                        .map_err(|e| e.to_string())?;
                }
            }
            #[cfg(feature = "etcd")]
            (Count::Etcd(_), _) => return Err("no etcd deployment".to_owned()),
        }
        let after = self.total().await?;
        if after < before + 20 {
            return Err(format!(
                "the count saw {} of 20 test requests",
                after.saturating_sub(before)
            ));
        }
        Ok(())
    }
}

/// The herd on one deployment: 100 waiters (10 providers × 10) while an 11th provider holds
/// the key; the deployment's commands per second, less its own traffic (sentinels, replicas,
/// members) measured as long before any client connected.
fn herd_row(rt: &Runtime, setup: &Setup, d: &Deployment, report: &mut Report) {
    let name = "commands/s while 100 waiters wait";
    // Redis waiters sleep until a release, the lease's end or the fallback poll (each try
    // runs on every Redlock node); etcd waiters watch, and renew their own leases.
    let (target, shown) = match d {
        Deployment::Cluster(_) | Deployment::Sentinel(_) => (Target::AtMost(5.0), "≤ 5 /s"),
        Deployment::Redlock(_) => (Target::AtMost(15.0), "≤ 15 /s"),
        #[cfg(feature = "etcd")]
        Deployment::Etcd(_) => (Target::None, "—"),
    };
    match rt.block_on(herd(d)) {
        Ok((net, gross, own)) => report.add(Row::described(
            S10,
            &format!("{}: {name}", setup.label),
            format!("{net:.1} /s ({gross:.1} /s less the deployment's own {own:.1} /s)"),
            net,
            "/s",
            target,
        )),
        Err(e) => report.add(setup.not_measured(name, &e, shown)),
    }
}

/// (net, counted, the deployment's own) requests per second of the herd.
async fn herd(d: &Deployment) -> Result<(f64, f64, f64), String> {
    let count = match d {
        #[cfg(feature = "etcd")]
        Deployment::Etcd(e) => Count::Etcd(e.endpoints()),
        _ => Count::Redis(d.counted_nodes()),
    };
    count.check(d).await?;
    // Past a fallback poll (15 s) and a keep-alive (every 10 s), as section 3 on Redis.
    let window = sized(Duration::from_secs(20), Duration::from_millis(500));
    // The deployment's own traffic first: sentinels' pings and hellos, replicas' acks.
    let before = count.total().await?;
    let started = Instant::now();
    tokio::time::sleep(window).await;
    let own = count.total().await?.saturating_sub(before) as f64 / started.elapsed().as_secs_f64();

    let url = d.dlock_url("");
    let key = "bench:deploy-herd";
    let holder = LockProvider::connect(&url)
        .await
        .map_err(|e| e.to_string())?;
    let guard = holder.try_acquire(key).await.map_err(|e| e.to_string())?;
    let (n_providers, n_waiters) = (sized(10, 2), sized(100, 10));
    let mut providers = Vec::new();
    for _ in 0..n_providers {
        providers.push(
            LockProvider::connect(&url)
                .await
                .map_err(|e| e.to_string())?,
        );
    }
    let waiters: Vec<_> = (0..n_waiters)
        .map(|i| {
            let p = providers[i % n_providers].clone();
            tokio::spawn(async move { p.acquire(key, Duration::from_secs(60)).await.is_ok() })
        })
        .collect();
    tokio::time::sleep(sized(
        Duration::from_millis(500),
        Duration::from_millis(200),
    ))
    .await;
    let before = count.total().await?;
    let started = Instant::now();
    tokio::time::sleep(window).await;
    let after = count.total().await?;
    let elapsed = started.elapsed().as_secs_f64();
    // Every waiter must still be waiting: one that gave up would make the servers quiet.
    let ended = waiters.iter().filter(|w| w.is_finished()).count();
    for w in &waiters {
        w.abort();
    }
    for w in waiters {
        let _ = w.await;
    }
    if ended > 0 {
        return Err(format!(
            "{ended} of {n_waiters} waiters stopped waiting early"
        ));
    }
    guard.release().await.map_err(|e| e.to_string())?;
    let gross = after.saturating_sub(before) as f64 / elapsed;
    Ok(((gross - own).max(0.0), gross, own))
}
