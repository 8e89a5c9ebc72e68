//! Fair waiting across processes: 3 worker processes of 4 tasks each take one key again and
//! again for a few seconds (`dlock-worker fairness`), on each store. Every process must get
//! a fair share of the acquisitions and no wait may be far longer than the typical one.
//!
//! The bounds here are loose on purpose (a shared CI machine is noisy): each process within
//! half of an equal share, the 99th percentile wait within 8× the median on the stores whose
//! fairness is dlock's own doing (SQLite, Redis), 20× on those that queue on the server
//! (PostgreSQL's tail reached 5.5–7.8× in runs here, 13–17× in some). The report's
//! fairness table measures against the targets (25 % and 5×). Without cross-process queueing,
//! a lease store that hands the key to the holder's own next waiter fails: on SQLite one
//! process took 3,269 of 3,269 sections (the share bound); on Redis, without the releasing
//! process holding off for waiters elsewhere, the 99th percentile wait was 11–14× the median
//! (2–2.5× with it).

mod support;

use std::sync::Mutex;

use dlock_testkit::unique_key;
use support::{Fairness, run_fairness};

/// The runs measure waits: one at a time, so that they do not slow each other down.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const PROCESSES: usize = 3;
const TASKS: usize = 4;
const SECONDS: u64 = 3;

/// The tail bound where a store's own queue is not in question (the session engines and
/// etcd queue on the server; see the report for their figures).
#[cfg_attr(
    not(any(feature = "postgres", feature = "mysql", feature = "etcd")),
    allow(dead_code)
)]
const LOOSE_TAIL: f64 = 20.0;
/// The tail bound for the stores whose fairness is dlock's own doing (SQLite's waiters
/// queue, Redis's hold-off after a release that woke waiters elsewhere).
const TAIL: f64 = 8.0;

fn fair(url: &str, tail: f64) -> Fairness {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let run = run_fairness(url, &unique_key("fair"), PROCESSES, TASKS, SECONDS);
    assert_eq!(run.counts.len(), PROCESSES, "{run:?}");
    assert!(
        run.counts.iter().sum::<usize>() >= 10 * PROCESSES,
        "too few sections to judge: {run:?}"
    );
    assert!(
        run.spread <= 0.5,
        "a process got less than half (or more than 1.5×) of an equal share on {url}: {run:?}"
    );
    assert!(
        run.p99_ms <= tail * run.p50_ms.max(1.0),
        "the 99th percentile wait is over {tail}× the median on {url}: {run:?}"
    );
    run
}

#[test]
fn sqlite() {
    let dir = tempfile::tempdir().unwrap();
    fair(&format!("sqlite://{}/fair.db", dir.path().display()), TAIL);
}

#[cfg(feature = "postgres")]
#[test]
fn postgres() {
    let server = dlock_testkit::postgres::PgServer::start();
    fair(&server.url(""), LOOSE_TAIL);
}

#[cfg(feature = "mysql")]
#[test]
fn mariadb() {
    let server = dlock_testkit::mysql::DbServer::start(dlock_testkit::mysql::Flavor::MariaDb)
        .expect("MariaDB server");
    fair(&server.url(""), LOOSE_TAIL);
}

#[cfg(feature = "mysql")]
#[test]
fn mysql() {
    let Some(server) = dlock_testkit::mysql::DbServer::start(dlock_testkit::mysql::Flavor::MySql)
    else {
        return;
    };
    fair(&server.url(""), LOOSE_TAIL);
}

#[cfg(feature = "redis")]
#[test]
fn redis7() {
    let Some(server) =
        dlock_testkit::redis::RedisServer::start(dlock_testkit::redis::Flavor::Redis7)
    else {
        return;
    };
    fair(&server.url(""), TAIL);
}

#[cfg(feature = "redis")]
#[test]
fn valkey9() {
    let Some(server) =
        dlock_testkit::redis::RedisServer::start(dlock_testkit::redis::Flavor::Valkey91)
    else {
        return;
    };
    fair(&server.url(""), TAIL);
}

#[cfg(feature = "redis")]
#[test]
fn redis8() {
    let Some(server) =
        dlock_testkit::redis::RedisServer::start(dlock_testkit::redis::Flavor::Redis8)
    else {
        return;
    };
    fair(&server.url(""), TAIL);
}

#[cfg(feature = "etcd")]
#[test]
fn etcd() {
    let Some(cluster) = dlock_testkit::etcd::EtcdCluster::start(1) else {
        return;
    };
    fair(&cluster.url(""), LOOSE_TAIL);
}
