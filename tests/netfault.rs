//! Network partitions, per backend (PostgreSQL, MariaDB, MySQL 9, Redis 7, Redis 8, Valkey
//! 9.1). A throwaway server runs in its own network namespace
//! (`dlock_testkit::netns`) with two links to the test: the holder's link is cut with
//! nftables drop rules (silent: no RST, no FIN, like a real partition) while a second provider
//! reaches the server over the other link. Each test checks:
//!
//! 1. the holder on the cut link is told (`lost_token`) within the backend's bound: keepalive +
//!    ping timeout + 1 s for the session backends, and before its lease can have run out on the
//!    server for Redis / Valkey (the test reads what is left of it at that moment);
//! 2. nobody else gets the lock before the holder was told: a second provider waits for the
//!    key over the side link from the moment of the cut, and when the holder is told the key is
//!    still taken on the server and that wait has not been granted. The second provider then
//!    does get the key while the cut lasts: the server frees it when it gives up on the silent
//!    session (set to about 5 s in the namespace, longer than the session backends' bound, as
//!    any deployment must have it) or when the lease runs out;
//! 3. after `heal`, the cut provider takes the key again within a bound, the lost guard's
//!    release reports the loss, and nothing stays held: another provider takes the key.
//!
//! Linux and root only (namespaces, nftables); without them the tests fail as not run, whether
//! `CI` is set or not (CI runs as root).
#![cfg(all(feature = "postgres", feature = "mysql", feature = "redis"))]

use std::net::IpAddr;
use std::time::{Duration, Instant};

use dlock::{LockError, LockProvider};
use dlock_testkit::mysql::{DbServer, Flavor as DbFlavor};
use dlock_testkit::netns::Netns;
use dlock_testkit::postgres::PgServer;
use dlock_testkit::redis::{Flavor as RedisFlavor, RedisServer};
use dlock_testkit::unique_key;

/// The session backends' liveness check cadence in these tests.
const KEEPALIVE: Duration = Duration::from_millis(500);
/// How long the session backends give a liveness check.
const PING_TIMEOUT: Duration = Duration::from_secs(1);
/// The Redis / Valkey lease in these tests.
const LEASE: Duration = Duration::from_millis(1500);
/// The server's kernel starts probing a silent peer after this many seconds, and gives up at
/// the first unanswered probe a second later.
const SERVER_IDLE_SECS: u32 = 4;
/// Retransmissions of unacknowledged data before the server's kernel gives up: 0.2 s doubling,
/// about 6 s in all.
const SERVER_RETRIES: u32 = 4;
/// How long the second provider may wait for the key while the cut lasts.
const SIDE_WAIT: Duration = Duration::from_secs(12);
/// How long the cut provider may take to get the key again after the heal.
const RECOVER_WITHIN: Duration = Duration::from_secs(10);

struct Case<'a> {
    label: &'static str,
    netns: &'a Netns,
    url_cut: String,
    url_side: String,
    /// The holder must be told within this long after the cut.
    lost_within: Duration,
    /// What is left of the lock's time to live on the server, read over the side link (leases
    /// only).
    ttl_left: Option<TtlProbe<'a>>,
}

/// Reads the remaining time to live of a key's lock on the server.
type TtlProbe<'a> = Box<dyn Fn(&str) -> Duration + 'a>;

async fn connect(url: &str) -> LockProvider {
    LockProvider::connect(url)
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"))
}

async fn partition(case: Case<'_>) {
    let label = case.label;
    let cut_provider = connect(&case.url_cut).await;
    let side = connect(&case.url_side).await;
    let probe = connect(&case.url_side).await;
    let key = unique_key("netfault");

    let held = cut_provider
        .try_acquire(&key)
        .await
        .expect("the cut provider takes the key");
    assert!(
        matches!(
            side.try_acquire(&key).await,
            Err(LockError::AlreadyHeld { .. })
        ),
        "{label}: the key is held before the cut"
    );
    let lost = held.lost_token().clone();

    // 1. Cut; the holder must be told within the bound.
    case.netns.cut();
    let cut_at = Instant::now();
    let side_wait = tokio::spawn({
        let side = side.clone();
        let key = key.clone();
        let lost = lost.clone();
        async move {
            let guard = side.acquire(&key, SIDE_WAIT).await;
            (guard, Instant::now(), lost.is_cancelled())
        }
    });
    tokio::time::timeout(case.lost_within, lost.cancelled())
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{label}: the holder was not told within {:?} of the cut",
                case.lost_within
            )
        });
    let lost_after = cut_at.elapsed();

    // 2. At that moment the key is still taken on the server, and the side wait has not been
    // granted: nobody else held the lock before the holder was told.
    let ttl_left = case.ttl_left.as_ref().map(|ttl| ttl(&key));
    assert!(
        !side_wait.is_finished(),
        "{label}: the side provider's wait ended before the holder was told"
    );
    assert!(
        matches!(
            probe.try_acquire(&key).await,
            Err(LockError::AlreadyHeld { .. })
        ),
        "{label}: the key was free on the server when the holder was told"
    );
    if let Some(left) = ttl_left {
        assert!(
            !left.is_zero(),
            "{label}: the lease had run out on the server when the holder was told"
        );
    }

    let (side_guard, side_at, told_first) =
        tokio::time::timeout(SIDE_WAIT + Duration::from_secs(2), side_wait)
            .await
            .unwrap_or_else(|_| panic!("{label}: the side wait did not end"))
            .expect("side wait task");
    let side_guard = side_guard.unwrap_or_else(|e| {
        panic!("{label}: the side provider did not get the key while the cut lasted: {e}")
    });
    assert!(
        told_first,
        "{label}: the side provider got the key before the holder was told"
    );
    let side_after = side_at.duration_since(cut_at);

    // 3. Heal; the lost guard reports the loss, the cut provider takes the key again once it
    // is free, and nothing stays held.
    case.netns.heal();
    let healed_at = Instant::now();
    assert!(
        matches!(held.release().await, Err(LockError::Lost { .. })),
        "{label}: releasing the lost guard reports the loss"
    );
    side_guard
        .release()
        .await
        .expect("the side provider releases");
    let again = cut_provider
        .acquire(&key, RECOVER_WITHIN)
        .await
        .unwrap_or_else(|e| {
            panic!("{label}: the cut provider did not get the key back after the heal: {e}")
        });
    let recovered_after = healed_at.elapsed();
    assert!(!again.is_lost(), "{label}: the new guard is not lost");
    again.release().await.expect("release after recovery");
    let last = side
        .acquire(&key, Duration::from_secs(5))
        .await
        .unwrap_or_else(|e| panic!("{label}: the key stayed held after recovery: {e}"));
    last.release().await.expect("final release");

    let lease = match ttl_left {
        Some(left) => format!(", {} ms of lease left on the server", left.as_millis()),
        None => String::new(),
    };
    println!(
        "{label}: told after {} ms (bound {} ms{lease}); side provider got the key after {} ms; \
         recovered {} ms after the heal",
        lost_after.as_millis(),
        case.lost_within.as_millis(),
        side_after.as_millis(),
        recovered_after.as_millis()
    );
}

fn v4(addr: std::net::Ipv4Addr) -> IpAddr {
    IpAddr::V4(addr)
}

/// A namespace whose kernel gives up on silent peers after about 5 s.
fn namespace() -> Option<Netns> {
    let netns = Netns::new()?;
    netns.tcp_give_up(SERVER_IDLE_SECS, SERVER_RETRIES);
    Some(netns)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_partition() {
    let Some(netns) = namespace() else { return };
    let server = PgServer::start_with(netns.placement());
    let options = format!("keepalive={}ms&connect_timeout=3s", KEEPALIVE.as_millis());
    partition(Case {
        label: "postgres",
        netns: &netns,
        url_cut: server.url_at(v4(netns.cut_link().server), &options),
        url_side: server.url_at(v4(netns.side_link().server), &options),
        lost_within: KEEPALIVE + PING_TIMEOUT + Duration::from_secs(1),
        ttl_left: None,
    })
    .await;
}

/// MariaDB or MySQL in the namespace.
async fn db_partition(flavor: DbFlavor, label: &'static str) {
    let Some(netns) = namespace() else { return };
    let Some(server) = DbServer::start_with(flavor, netns.placement()) else {
        return;
    };
    let options = format!("keepalive={}ms&connect_timeout=3s", KEEPALIVE.as_millis());
    partition(Case {
        label,
        netns: &netns,
        url_cut: server.url_at(v4(netns.cut_link().server), &options),
        url_side: server.url_at(v4(netns.side_link().server), &options),
        lost_within: KEEPALIVE + PING_TIMEOUT + Duration::from_secs(1),
        ttl_left: None,
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_partition() {
    db_partition(DbFlavor::MariaDb, "mariadb").await;
}

async fn redis_partition(flavor: RedisFlavor, label: &'static str) {
    let Some(netns) = namespace() else { return };
    let Some(server) = RedisServer::start_with(flavor, netns.placement()) else {
        return;
    };
    let options = format!("lease={}ms&timeout=2s", LEASE.as_millis());
    let side = v4(netns.side_link().server);
    let backend = dlock::redis::RedisBackend::connect(&server.url_at(side, ""))
        .await
        .expect("a backend for key names");
    let server = &server;
    let ttl_left = move |key: &str| {
        let name = String::from_utf8(backend.storage_key(key)).expect("an ASCII key");
        let answer = server
            .raw_at(side, &["PTTL", &name])
            .expect("PTTL over the side link");
        let ms: i64 = answer
            .trim()
            .strip_prefix(':')
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("PTTL answered {answer:?}"));
        Duration::from_millis(ms.max(0) as u64)
    };
    partition(Case {
        label,
        netns: &netns,
        url_cut: server.url_at(v4(netns.cut_link().server), &options),
        url_side: server.url_at(side, &options),
        // The holder counts on 80% of the lease from the last renewal it sent, which was sent
        // before the cut: it must be told within the lease of the cut at the latest.
        lost_within: LEASE,
        ttl_left: Some(Box::new(ttl_left)),
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis7_partition() {
    redis_partition(RedisFlavor::Redis7, "redis 7").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkey91_partition() {
    redis_partition(RedisFlavor::Valkey91, "valkey 9.1").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mysql_partition() {
    db_partition(DbFlavor::MySql, "mysql").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis8_partition() {
    redis_partition(RedisFlavor::Redis8, "redis 8").await;
}
