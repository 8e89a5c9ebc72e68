//! Sections 1, 2, 3, 4 and 7: everything measured against a store.

use std::cell::RefCell;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dlock::LockProvider;
use futures::StreamExt;
use tokio::runtime::Runtime;

use crate::measure::{Batch, Contender, interleave, median, quantile, sized};

use crate::output::{Report, Row, Target, time};
use crate::peers::Peers;
use dlock_suite::raw;
use dlock_testkit::mysql::{DbServer, Flavor as MyFlavor};
use dlock_testkit::postgres::PgServer;
use dlock_testkit::redis::{Flavor as RedisFlavor, RedisServer};

pub const S1: &str = "1. Uncontended acquire + release against the raw driver";
pub const S2: &str = "2. Handover, 16 waiters on one key across 4 providers";
pub const S3: &str =
    "3. Server queries while 100 waiters wait for one held key (3 s; Redis and Valkey 20 s)";
pub const S4: &str = "4. Locks held at once per connection";
pub const S7: &str = "7. Peers: uncontended acquire + release, peer / dlock";

/// Rounds and batch length of the interleaved comparisons.
pub(crate) fn rounds() -> usize {
    sized(20, 2)
}
pub(crate) fn batch() -> Duration {
    sized(Duration::from_millis(40), Duration::from_millis(5))
}

/// One store that dlock can use.
pub(crate) enum Store {
    Sqlite(tempfile::TempDir),
    Postgres(PgServer),
    My(DbServer),
    Redis(RedisServer),
}

/// A backend under test, or why it cannot be.
pub(crate) struct Backend {
    pub(crate) label: &'static str,
    pub(crate) store: Result<Store, String>,
}

/// Why a store is missing when its server's binary is not installed (no failure in quick mode).
const NOT_INSTALLED: &str = "server binary not installed";

impl Backend {
    /// Whether the server's binary is missing here (as opposed to a server that failed).
    pub(crate) fn missing(&self) -> bool {
        self.store
            .as_ref()
            .is_err_and(|e| e.starts_with(NOT_INSTALLED) || e.starts_with("no server binary at"))
    }

    /// A row of this backend not measured, and why; no failure when its server is missing.
    pub(crate) fn not_measured(&self, section: &str, name: &str, why: &str, target: &str) -> Row {
        Row::not_measured(section, name, why, target).excused_if(self.missing())
    }

    pub(crate) fn dlock_url(&self, options: &str) -> String {
        match self.store.as_ref().expect("running") {
            Store::Sqlite(dir) => {
                let mut url = format!("sqlite://{}/locks.db", dir.path().display());
                if !options.is_empty() {
                    url.push('?');
                    url.push_str(options);
                }
                url
            }
            Store::Postgres(s) => s.url(options),
            Store::My(s) => s.url(options),
            Store::Redis(s) => s.url(options),
        }
    }

    /// A pool of one connection to this server (PostgreSQL, MySQL or MariaDB), for counting.
    pub(crate) async fn pool<DB: sqlx::Database>(&self) -> Result<sqlx::Pool<DB>, String> {
        sqlx::pool::PoolOptions::<DB>::new()
            .max_connections(1)
            .connect(&self.driver_url())
            .await
            .map_err(|e| e.to_string())
    }

    /// The URL plain drivers (and the peers) use.
    pub(crate) fn driver_url(&self) -> String {
        match self.store.as_ref().expect("running") {
            Store::My(s) => s.url("").replacen("mariadb://", "mysql://", 1),
            _ => self.dlock_url(""),
        }
    }
}

pub struct Servers {
    pub(crate) backends: Vec<Backend>,
}

fn caught<T>(f: impl FnOnce() -> Option<T> + std::panic::UnwindSafe) -> Result<T, String> {
    match std::panic::catch_unwind(f) {
        Ok(Some(t)) => Ok(t),
        Ok(None) => Err(NOT_INSTALLED.to_owned()),
        Err(e) => Err(e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "server did not start".to_owned())),
    }
}

impl Servers {
    /// Starts every server that is installed and records its version.
    pub fn start(rt: &Runtime, report: &mut Report) -> Servers {
        let redis = |flavor: RedisFlavor| {
            match flavor.binary() {
                None => return Err(NOT_INSTALLED.to_owned()),
                Some(path) if !path.is_file() => {
                    return Err(format!("no server binary at {}", path.display()));
                }
                Some(_) => {}
            }
            caught(move || RedisServer::start(flavor)).map(Store::Redis)
        };
        type Start<'a> = Box<dyn FnOnce() -> Result<Store, String> + 'a>;
        let all: Vec<(&'static str, Start<'_>)> = vec![
            (
                "SQLite",
                Box::new(|| {
                    tempfile::tempdir()
                        .map(Store::Sqlite)
                        .map_err(|e| e.to_string())
                }),
            ),
            (
                "PostgreSQL",
                Box::new(|| caught(|| Some(PgServer::start())).map(Store::Postgres)),
            ),
            (
                "MariaDB",
                Box::new(|| caught(|| DbServer::start(MyFlavor::MariaDb)).map(Store::My)),
            ),
            (
                "MySQL 9",
                Box::new(|| caught(|| DbServer::start(MyFlavor::MySql)).map(Store::My)),
            ),
            ("Redis 7", Box::new(|| redis(RedisFlavor::Redis7))),
            ("Valkey 9.1", Box::new(|| redis(RedisFlavor::Valkey91))),
        ];
        // Only the backends a partial run chose are started.
        let backends: Vec<Backend> = all
            .into_iter()
            .filter(|(label, _)| crate::measure::backend(label))
            .map(|(label, start)| Backend {
                label,
                store: start(),
            })
            .collect();
        for b in &backends {
            let version = match &b.store {
                Err(e) => format!("not measured: {e}"),
                Ok(Store::Sqlite(_)) => format!("{} (rusqlite bundled)", rusqlite::version()),
                Ok(Store::Postgres(_)) => rt
                    .block_on(async {
                        let pool = sqlx::PgPool::connect(&b.driver_url()).await?;
                        sqlx::query_scalar::<_, String>("SHOW server_version")
                            .fetch_one(&pool)
                            .await
                    })
                    .unwrap_or_else(|e| e.to_string()),
                Ok(Store::My(_)) => rt
                    .block_on(async {
                        let pool = sqlx::MySqlPool::connect(&b.driver_url()).await?;
                        sqlx::query_scalar::<_, String>("SELECT VERSION()")
                            .fetch_one(&pool)
                            .await
                    })
                    .unwrap_or_else(|e| e.to_string()),
                Ok(Store::Redis(s)) => {
                    let info = s.info("server");
                    info.get("valkey_version")
                        .map(|v| format!("valkey {v}"))
                        .or_else(|| info.get("redis_version").map(|v| format!("redis {v}")))
                        .unwrap_or_default()
                }
            };
            report.env(&format!("server: {}", b.label), version);
        }
        Servers { backends }
    }
}

/// Runs a timed loop as a task on the runtime's worker threads, where a service's code runs.
/// (`block_on` alone would drive it on this thread, outside the runtime, and every wake-up
/// from a worker would cross threads: a cost real callers do not pay.)
pub(crate) fn on_worker(
    rt: &Runtime,
    timed: impl std::future::Future<Output = Result<Duration, String>> + Send + 'static,
) -> Result<Duration, String> {
    rt.block_on(rt.spawn(timed)).map_err(|e| e.to_string())?
}

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

fn peer_batch<'a>(peers: &'a RefCell<Peers>, peer: &'static str) -> Box<Batch<'a>> {
    Box::new(move |n| peers.borrow_mut().run(peer, n))
}

/// The peers measured on a backend.
fn peers_of(label: &str) -> &'static [&'static str] {
    match label {
        "PostgreSQL" => &["sqlx PgAdvisoryLock", "distributed-lock-postgres"],
        "MariaDB" | "MySQL 9" => &["distributed-lock-mysql"],
        "Redis 7" | "Valkey 9.1" => &["distributed-lock-redis", "rslock"],
        _ => &[],
    }
}

/// Sections 1 and 7: per backend, dlock beside its raw baseline and its peers, interleaved.
pub fn uncontended_all(
    rt: &Runtime,
    servers: &Servers,
    peers: &RefCell<Peers>,
    report: &mut Report,
) {
    for b in &servers.backends {
        let store = match &b.store {
            Ok(s) => s,
            Err(e) => {
                report.add(b.not_measured(S1, &format!("{}: dlock / raw", b.label), e, "≤ 1.10×"));
                for peer in peers_of(b.label) {
                    report.add(b.not_measured(
                        S7,
                        &format!("{}: {peer} / dlock", b.label),
                        e,
                        "≥ 1.00×",
                    ));
                }
                continue;
            }
        };
        eprintln!(" {}", b.label);
        // On Redis, the comparison with the raw commands uses the same commands
        // (`fencing=false`); the default (fencing tokens) is shown beside it.
        let options = if matches!(store, Store::Redis(_)) {
            "fencing=false"
        } else {
            ""
        };
        let locks = match rt.block_on(LockProvider::connect(&b.dlock_url(options))) {
            Ok(l) => l,
            Err(e) => {
                report.add(b.not_measured(
                    S1,
                    &format!("{}: dlock / raw", b.label),
                    &e.to_string(),
                    "≤ 1.10×",
                ));
                continue;
            }
        };
        let mut dlock = dlock_batch(rt, &locks, "bench:dlock");
        // (name, batch); the first is the raw baseline, the second dlock.
        let mut extra: Vec<(&'static str, Box<Batch<'_>>)> = Vec::new();
        let mut peer_names: Vec<&'static str> = Vec::new();
        let mut not_measured: Vec<(&'static str, String)> = Vec::new();
        let mut setup_peer = |name: &'static str, peer_names: &mut Vec<&'static str>| match peers
            .borrow_mut()
            .setup(name, &b.driver_url())
        {
            Ok(()) => peer_names.push(name),
            Err(e) => not_measured.push((name, e)),
        };
        let raw_batch: Box<Batch<'_>>;
        let fenced_locks;
        // Redis: the raw commands with a fencing token, the same work as dlock's default.
        let mut raw_fenced: Option<Box<Batch<'_>>> = None;
        // PostgreSQL, MySQL: the same statements on a connection taken from a sqlx pool each
        // time (which pings it when it goes back), shown beside the baseline.
        let mut raw_pooled: Option<Box<Batch<'_>>> = None;
        match store {
            Store::Sqlite(dir) => {
                let path = dir.path().join("locks.db");
                let raw_conn = RefCell::new(raw::Sqlite::open(&path));
                raw_batch = Box::new(move |n| {
                    let t = Instant::now();
                    let mut c = raw_conn.borrow_mut();
                    for _ in 0..n {
                        c.acquire_release(b"bench:raw");
                    }
                    Ok(t.elapsed())
                });
                fenced_locks = None;
            }
            Store::Postgres(_) => {
                let pool = rt
                    .block_on(
                        sqlx::postgres::PgPoolOptions::new()
                            .max_connections(4)
                            // The baseline runs the two statements and nothing else: no
                            // health-check round trip when a connection leaves the pool.
                            .test_before_acquire(false)
                            .connect(&b.driver_url()),
                    )
                    .expect("pool");
                let id = dlock::lock_id("bench:raw");
                let pool2 = pool.clone();
                // The baseline: the two statements on a connection of its own, as dlock runs
                // them on its lock connections.
                let conn = Arc::new(tokio::sync::Mutex::new(
                    rt.block_on(<sqlx::PgConnection as sqlx::Connection>::connect(
                        &b.driver_url(),
                    ))
                    .expect("connection"),
                ));
                raw_batch = Box::new(move |n| {
                    let conn = Arc::clone(&conn);
                    on_worker(rt, async move {
                        let mut conn = conn.lock().await;
                        let t = Instant::now();
                        for _ in 0..n {
                            raw::postgres_on(&mut conn, id).await;
                        }
                        Ok(t.elapsed())
                    })
                });
                let pool3 = pool.clone();
                let pooled_id = dlock::lock_id("bench:raw-pooled");
                raw_pooled = Some(Box::new(move |n| {
                    let pool = pool3.clone();
                    on_worker(rt, async move {
                        let t = Instant::now();
                        for _ in 0..n {
                            raw::postgres(&pool, pooled_id).await;
                        }
                        Ok(t.elapsed())
                    })
                }));
                let advisory = sqlx::postgres::PgAdvisoryLock::new("bench:sqlx");
                extra.push((
                    "sqlx PgAdvisoryLock",
                    Box::new(move |n| {
                        let (pool2, advisory) = (pool2.clone(), advisory.clone());
                        on_worker(rt, async move {
                            let t = Instant::now();
                            for _ in 0..n {
                                let conn = pool2.acquire().await.map_err(|e| e.to_string())?;
                                match advisory
                                    .try_acquire(conn)
                                    .await
                                    .map_err(|e| e.to_string())?
                                {
                                    sqlx::Either::Left(guard) => {
                                        guard.release_now().await.map_err(|e| e.to_string())?;
                                    }
                                    sqlx::Either::Right(_) => return Err("not free".to_owned()),
                                }
                            }
                            Ok(t.elapsed())
                        })
                    }),
                ));
                setup_peer("distributed-lock-postgres", &mut peer_names);
                fenced_locks = None;
            }
            Store::My(_) => {
                let pool = rt
                    .block_on(
                        sqlx::mysql::MySqlPoolOptions::new()
                            .max_connections(4)
                            // The baseline runs the two statements and nothing else: no
                            // health-check round trip when a connection leaves the pool.
                            .test_before_acquire(false)
                            .connect(&b.driver_url()),
                    )
                    .expect("pool");
                let name = dlock::mysql::server_lock_name("bench:raw");
                // The baseline: the two statements on a connection of its own, as dlock runs
                // them on its lock connections.
                let conn = Arc::new(tokio::sync::Mutex::new(
                    rt.block_on(<sqlx::MySqlConnection as sqlx::Connection>::connect(
                        &b.driver_url(),
                    ))
                    .expect("connection"),
                ));
                raw_batch = Box::new(move |n| {
                    let (conn, name) = (Arc::clone(&conn), name.clone());
                    on_worker(rt, async move {
                        let mut conn = conn.lock().await;
                        let t = Instant::now();
                        for _ in 0..n {
                            raw::mysql_on(&mut conn, &name).await;
                        }
                        Ok(t.elapsed())
                    })
                });
                let pooled_name = dlock::mysql::server_lock_name("bench:raw-pooled");
                raw_pooled = Some(Box::new(move |n| {
                    let (pool, name) = (pool.clone(), pooled_name.clone());
                    on_worker(rt, async move {
                        let t = Instant::now();
                        for _ in 0..n {
                            raw::mysql(&pool, &name).await;
                        }
                        Ok(t.elapsed())
                    })
                }));
                setup_peer("distributed-lock-mysql", &mut peer_names);
                fenced_locks = None;
            }
            Store::Redis(server) => {
                let manager = rt
                    .block_on(redis::aio::ConnectionManager::new(server.client()))
                    .expect("connect");
                let script = redis::Script::new(raw::REDIS_RELEASE_LUA);
                raw_batch = Box::new(move |n| {
                    let (mut conn, script) = (manager.clone(), script.clone());
                    on_worker(rt, async move {
                        let t = Instant::now();
                        for _ in 0..n {
                            raw::redis(&mut conn, &script, "bench:raw").await;
                        }
                        Ok(t.elapsed())
                    })
                });
                setup_peer("distributed-lock-redis", &mut peer_names);
                setup_peer("rslock", &mut peer_names);
                fenced_locks = Some(
                    rt.block_on(LockProvider::connect(&b.dlock_url("")))
                        .expect("provider"),
                );
                let manager = rt
                    .block_on(redis::aio::ConnectionManager::new(server.client()))
                    .expect("connect");
                let acquire = redis::Script::new(RAW_FENCED_ACQUIRE_LUA);
                let release = redis::Script::new(raw::REDIS_RELEASE_LUA);
                raw_fenced = Some(Box::new(move |n| {
                    let (mut conn, acquire, release) =
                        (manager.clone(), acquire.clone(), release.clone());
                    on_worker(rt, async move {
                        let t = Instant::now();
                        for _ in 0..n {
                            raw_redis_fenced(&mut conn, &acquire, &release).await?;
                        }
                        Ok(t.elapsed())
                    })
                }));
            }
        }
        let mut fenced = fenced_locks
            .as_ref()
            .map(|l| dlock_batch(rt, l, "bench:dlock-fenced"));
        let mut raw_batch = raw_batch;
        let mut peer_batches: Vec<Box<Batch<'_>>> =
            peer_names.iter().map(|p| peer_batch(peers, p)).collect();

        let mut contenders = vec![
            Contender::new("raw", &mut *raw_batch),
            Contender::new("dlock", &mut *dlock),
        ];
        if let (Some(f), Some(r)) = (fenced.as_mut(), raw_fenced.as_mut()) {
            contenders.push(Contender::new("dlock (fencing tokens)", &mut **f));
            contenders.push(Contender::new("raw with fencing tokens", &mut **r));
        }
        let pooled_at = contenders.len();
        if let Some(p) = raw_pooled.as_mut() {
            contenders.push(Contender::new("raw through a sqlx pool", &mut **p));
        }
        let first_extra = contenders.len();
        let extra_names: Vec<&'static str> = extra.iter().map(|(n, _)| *n).collect();
        for (name, batch) in extra.iter_mut() {
            contenders.push(Contender::new(name, &mut **batch));
        }
        for (name, batch) in peer_names.iter().zip(peer_batches.iter_mut()) {
            contenders.push(Contender::new(name, &mut **batch));
        }
        let results = interleave(&mut contenders, rounds(), batch());
        drop(contenders);
        // Per contender, its per-round samples (round-aligned: a contender that fails sits
        // out the rest, and is then reported as not measured).
        let med: Vec<Result<Vec<f64>, String>> = results;
        let dlock_label = if fenced.is_some() {
            "dlock fencing=false"
        } else {
            "dlock"
        };
        match (&med[0], &med[1]) {
            (Ok(raw), Ok(d)) => report.add(Row::ratio(
                S1,
                &format!("{}: dlock / raw", b.label),
                (dlock_label, d),
                ("raw", raw),
                Target::AtMost(1.10),
            )),
            (Err(e), _) | (_, Err(e)) => {
                report.add(b.not_measured(S1, &format!("{}: dlock / raw", b.label), e, "≤ 1.10×"))
            }
        }
        if raw_pooled.is_some()
            && let (Ok(pooled), Ok(d)) = (&med[pooled_at], &med[1])
        {
            report.add(Row::ratio(
                S1,
                &format!(
                    "{}: dlock / raw through a sqlx pool (which pings each connection it takes back)",
                    b.label
                ),
                ("dlock", d),
                ("pooled raw", pooled),
                Target::None,
            ));
        }
        if let (Some(f), Some(r), Store::Redis(server)) =
            (fenced.as_mut(), raw_fenced.as_mut(), store)
        {
            let name = format!(
                "{}: dlock default (fencing tokens) / raw with fencing tokens",
                b.label
            );
            match (&med[2], &med[3]) {
                (Ok(d), Ok(raw)) => report.add(Row::ratio(
                    S1,
                    &name,
                    ("dlock", d),
                    ("raw", raw),
                    Target::AtMost(1.10),
                )),
                (Err(e), _) | (_, Err(e)) => report.add(b.not_measured(S1, &name, e, "≤ 1.10×")),
            }
            if let (Ok(raw), Ok(d)) = (&med[0], &med[2]) {
                report.add(Row::ratio(
                    S1,
                    &format!(
                        "{}: dlock default (fencing tokens) / raw without tokens",
                        b.label
                    ),
                    ("dlock", d),
                    ("raw", raw),
                    Target::None,
                ));
            }
            let name = format!(
                "{}: server commands per acquire + release, dlock default / raw with fencing",
                b.label
            );
            match (
                commands_per_cycle(server, &mut **f),
                commands_per_cycle(server, &mut **r),
            ) {
                (Ok(d), Ok(raw)) => {
                    report.add(Row::info(S1, &name, format!("{d} / {raw}")));
                }
                (Err(e), _) | (_, Err(e)) => report.add(b.not_measured(S1, &name, &e, "—")),
            }
        }
        let names = extra_names.iter().chain(peer_names.iter());
        for (i, name) in names.enumerate() {
            let row_name = format!("{}: {name} / dlock", b.label);
            match (&med[first_extra + i], &med[1]) {
                (Ok(p), Ok(d)) => report.add(Row::ratio(
                    S7,
                    &row_name,
                    (name, p),
                    (dlock_label, d),
                    Target::AtLeast(1.0),
                )),
                (Err(e), _) | (_, Err(e)) => {
                    report.add(b.not_measured(S7, &row_name, e, "≥ 1.00×"))
                }
            }
        }
        let skipped = peers.borrow().skipped();
        for (name, why) in not_measured {
            report.add(
                b.not_measured(S7, &format!("{}: {name} / dlock", b.label), &why, "≥ 1.00×")
                    .excused_if(b.missing() || skipped),
            );
        }
    }
}

/// Takes a Redis lock and bumps its fencing counter in one script, as dlock's default does:
/// `KEYS[1]` lock, `KEYS[2]` counter; `ARGV[1]` token, `ARGV[2]` lease in ms.
const RAW_FENCED_ACQUIRE_LUA: &str = "\
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return false";

/// Redis with fencing tokens, straight on the driver: the script above through `EVALSHA`,
/// then the Lua compare-and-delete.
async fn raw_redis_fenced(
    conn: &mut redis::aio::ConnectionManager,
    acquire: &redis::Script,
    release: &redis::Script,
) -> Result<(), String> {
    let (key, token) = ("bench:raw-fenced", "token-0123456789");
    let fencing: Option<i64> = acquire
        .key(key)
        .key("bench:raw-fenced:fence")
        .arg(token)
        .arg(30_000)
        .invoke_async(conn)
        .await
        .map_err(|e| e.to_string())?;
    fencing.ok_or("the key was not free")?;
    let deleted: i64 = release
        .key(key)
        .arg(token)
        .invoke_async(conn)
        .await
        .map_err(|e| e.to_string())?;
    if deleted != 1 {
        return Err("the release deleted nothing".to_owned());
    }
    Ok(())
}

/// The commands a batch's acquire + release runs on the server (commands that scripts run
/// included), per cycle, from `INFO commandstats` around 50 cycles: "evalsha 2, set 1, ...".
fn commands_per_cycle(server: &RedisServer, batch: &mut Batch<'_>) -> Result<String, String> {
    const CYCLES: u64 = 50;
    let before = server.command_calls();
    batch(CYCLES)?;
    let after = server.command_calls();
    let mut counts: Vec<(String, u64)> = after
        .into_iter()
        .filter(|(name, _)| name != "info")
        .map(|(name, n)| {
            let was = before.get(&name).copied().unwrap_or(0);
            (name, n.saturating_sub(was))
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    if counts.is_empty() {
        return Err("the server counted no commands".to_owned());
    }
    counts.sort();
    Ok(counts
        .iter()
        .map(|(name, n)| {
            let per = *n as f64 / CYCLES as f64;
            if per.fract() == 0.0 {
                format!("{name} {per:.0}")
            } else {
                format!("{name} {per:.2}")
            }
        })
        .collect::<Vec<_>>()
        .join(", "))
}

/// Section 2: per backend, 16 waiters (4 per provider) each taking the key 4 times; the time
/// from one holder starting its release to the next holder having the lock.
pub fn handover_all(rt: &Runtime, servers: &Servers, report: &mut Report) {
    for b in &servers.backends {
        let name = format!("{}: release → next holder, median / p99", b.label);
        if let Err(e) = &b.store {
            report.add(b.not_measured(S2, &name, e, "—"));
            continue;
        }
        match rt.block_on(handover(&b.dlock_url(""), "bench:handover")) {
            Ok(samples) if samples.is_empty() => {
                report.add(b.not_measured(S2, &name, "no handover seen", "—"))
            }
            Ok(samples) => {
                let text = format!(
                    "{} / {} ({} handovers)",
                    time(median(&samples)),
                    time(quantile(&samples, 0.99)),
                    samples.len()
                );
                let p99 = quantile(&samples, 0.99);
                report.add(if matches!(b.store, Ok(Store::Redis(_))) {
                    // Waiters woken by releases: the p99 is held to 2 ms.
                    Row::text_figure(S2, &name, text, p99, "ns", Target::AtMost(2e6))
                } else {
                    Row::info(S2, &name, text)
                })
            }
            Err(e) => report.add(b.not_measured(S2, &name, &e, "—")),
        }
    }
}

/// Tasks over providers on `url` take `key` in turn; the time from one holder starting its
/// release to the next holder having the lock, per handover, in nanoseconds.
pub async fn handover(url: &str, key: &str) -> Result<Vec<f64>, String> {
    let (n_providers, n_tasks, turns, rounds) =
        (sized(4, 2), sized(16, 4), sized(4, 2), sized(3, 1));
    let mut providers = Vec::new();
    for _ in 0..n_providers {
        providers.push(
            LockProvider::connect(url)
                .await
                .map_err(|e| e.to_string())?,
        );
    }
    let mut samples = Vec::new();
    for _round in 0..rounds {
        // (acquired, release started) per critical section.
        let log = Arc::new(Mutex::new(Vec::new()));
        let tasks: Vec<_> = (0..n_tasks)
            .map(|i| {
                let (p, log, key) = (
                    providers[i % n_providers].clone(),
                    log.clone(),
                    key.to_owned(),
                );
                tokio::spawn(async move {
                    for _ in 0..turns {
                        let g = p
                            .acquire(&key, Duration::from_secs(60))
                            .await
                            .map_err(|e| e.to_string())?;
                        let acquired = Instant::now();
                        let releasing = Instant::now();
                        log.lock().expect("log").push((acquired, releasing));
                        g.release().await.map_err(|e| e.to_string())?;
                    }
                    Ok::<(), String>(())
                })
            })
            .collect();
        for t in tasks {
            t.await.map_err(|e| e.to_string())??;
        }
        let mut log = log.lock().expect("log").clone();
        log.sort_by_key(|(acquired, _)| *acquired);
        for pair in log.windows(2) {
            samples.push((pair[1].0 - pair[0].1).as_nanos() as f64);
        }
    }
    Ok(samples)
}

/// A way to count the statements or commands a server ran, less the counting itself.
enum Counter {
    Postgres(sqlx::PgPool),
    My(sqlx::MySqlPool),
    Redis,
}

impl Counter {
    async fn new(b: &Backend) -> Result<Counter, String> {
        match b.store.as_ref().map_err(Clone::clone)? {
            Store::Sqlite(_) => Err("no server: nothing to count".to_owned()),
            Store::Postgres(_) => b.pool().await.map(Counter::Postgres),
            Store::My(_) => b.pool().await.map(Counter::My),
            Store::Redis(_) => Ok(Counter::Redis),
        }
    }

    /// Checks that the count sees other sessions' statements: 20 statements on another
    /// connection must add at least 20. (PostgreSQL's statistics reach the count up to a
    /// second late, so it is not checked this way.)
    async fn check(&self, b: &Backend) -> Result<(), String> {
        let (before, _) = self.queries(b).await?;
        match self {
            Counter::Postgres(_) => return Ok(()),
            Counter::My(_) => {
                let pool = sqlx::MySqlPool::connect(&b.driver_url())
                    .await
                    .map_err(|e| e.to_string())?;
                for _ in 0..20 {
                    sqlx::raw_sql("SELECT 1")
                        .execute(&pool)
                        .await
                        .map_err(|e| e.to_string())?;
                }
            }
            Counter::Redis => {
                if let Ok(Store::Redis(server)) = &b.store {
                    for _ in 0..20 {
                        server.raw(&["PING"]).ok_or("PING failed")?;
                    }
                }
            }
        }
        let (after, _) = self.queries(b).await?;
        if after < before + 20 {
            return Err(format!(
                "the server's counter saw {} of 20 test statements",
                after.saturating_sub(before)
            ));
        }
        Ok(())
    }

    /// The server's count, and how many of it each call to this adds.
    async fn queries(&self, b: &Backend) -> Result<(u64, u64), String> {
        match (self, b.store.as_ref().map_err(Clone::clone)?) {
            // Every statement outside a transaction is one; each count adds its own.
            (Counter::Postgres(pool), _) => sqlx::query_scalar::<_, i64>(
                "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database \
                 WHERE datname = current_database()",
            )
            .fetch_one(pool)
            .await
            .map(|n| (n as u64, 1))
            .map_err(|e| e.to_string()),
            (Counter::My(pool), _) => {
                use sqlx::Row as _;
                let row = sqlx::raw_sql("SHOW GLOBAL STATUS LIKE 'Questions'")
                    .fetch_one(pool)
                    .await
                    .map_err(|e| e.to_string())?;
                let value: String = row.try_get(1).map_err(|e| e.to_string())?;
                value
                    .parse()
                    .map(|n| (n, 1))
                    .map_err(|e: std::num::ParseIntError| e.to_string())
            }
            (Counter::Redis, Store::Redis(server)) => Ok((
                server
                    .command_calls()
                    .into_iter()
                    .filter(|(name, _)| name != "info")
                    .map(|(_, calls)| calls)
                    .sum(),
                0,
            )),
            _ => Err("no counter".to_owned()),
        }
    }
}

/// Section 3: 10 providers with 10 waiters each wait for a key an 11th holds; the server's
/// statements (or commands) per second over 3 s (Redis and Valkey: 20 s), after 0.5 s to
/// settle.
pub fn herd_all(rt: &Runtime, servers: &Servers, report: &mut Report) {
    for b in &servers.backends {
        let name = format!("{}: queries/s", b.label);
        if matches!(b.store, Ok(Store::Sqlite(_))) {
            continue;
        }
        // Redis and Valkey waiters are woken by releases, and poll only as a fallback.
        let (target, shown) = if matches!(b.store, Ok(Store::Redis(_))) {
            (5.0, "≤ 5 /s")
        } else {
            (200.0, "≤ 200 /s")
        };
        match rt.block_on(herd(b)) {
            Ok(rate) => report.add(Row::figure(S3, &name, rate, "/s", Target::AtMost(target))),
            Err(e) => report.add(b.not_measured(S3, &name, &e, shown)),
        }
    }
}

async fn herd(b: &Backend) -> Result<f64, String> {
    let counter = Counter::new(b).await?;
    let url = b.dlock_url("");
    let key = "bench:herd";
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
    counter.check(b).await?;
    let (before, per_count) = counter.queries(b).await?;
    let started = Instant::now();
    // Redis and Valkey waiters poll once per fallback poll (15 s, less jitter) or per lease
    // left: counted over 20 s, so that the count covers their polls, not only the quiet
    // between them.
    let window = if matches!(b.store, Ok(Store::Redis(_))) {
        Duration::from_secs(20)
    } else {
        Duration::from_secs(3)
    };
    tokio::time::sleep(sized(window, Duration::from_millis(500))).await;
    let (after, _) = counter.queries(b).await?;
    let elapsed = started.elapsed().as_secs_f64();
    // Every waiter must still be waiting: one that gave up would make the server quiet.
    let ended = waiters.iter().filter(|w| w.is_finished()).count();
    for w in &waiters {
        w.abort();
    }
    if ended > 0 {
        return Err(format!(
            "{ended} of {n_waiters} waiters stopped waiting early"
        ));
    }
    for w in waiters {
        let _ = w.await;
    }
    guard.release().await.map_err(|e| e.to_string())?;
    Ok(after.saturating_sub(before).saturating_sub(per_count) as f64 / elapsed)
}

/// Section 4: one provider takes many keys at once; the connections it opened for them.
pub fn locks_per_connection_all(rt: &Runtime, servers: &Servers, report: &mut Report) {
    for b in &servers.backends {
        let n = match &b.store {
            Ok(Store::Sqlite(_)) => continue,
            Ok(Store::Postgres(_)) => sized(10_000, 64),
            _ => sized(1_000, 64),
        };
        let name = format!("{}: {n} locks held by one provider", b.label);
        if let Err(e) = &b.store {
            report.add(b.not_measured(S4, &name, e, "—"));
            continue;
        }
        match rt.block_on(locks_per_connection(b, n)) {
            Ok(conns) => report.add(Row::info(
                S4,
                &name,
                format!(
                    "{conns} connection(s): {:.0} locks per connection",
                    n as f64 / conns.max(1) as f64
                ),
            )),
            Err(e) => report.add(b.not_measured(S4, &name, &e, "—")),
        }
    }
}

/// Counts a server's client connections: PostgreSQL's client backends in `pg_stat_activity`,
/// MySQL's and MariaDB's `SHOW PROCESSLIST`, Redis's `connected_clients`; through a counting
/// connection of its own where the server needs one (PostgreSQL leaves it out of its count).
pub(crate) struct Connections {
    pg: Option<sqlx::PgPool>,
    my: Option<sqlx::mysql::MySqlPool>,
}

impl Connections {
    /// Opens the counting connection `b` needs.
    pub(crate) async fn new(b: &Backend) -> Result<Connections, String> {
        match b.store.as_ref().map_err(Clone::clone)? {
            Store::Postgres(_) => Ok(Connections {
                pg: Some(b.pool().await?),
                my: None,
            }),
            Store::My(_) => Ok(Connections {
                pg: None,
                my: Some(b.pool().await?),
            }),
            Store::Redis(_) => Ok(Connections { pg: None, my: None }),
            Store::Sqlite(_) => Err("no server".to_owned()),
        }
    }

    /// The server's client connections now.
    pub(crate) async fn count(&self, b: &Backend) -> Result<u64, String> {
        match b.store.as_ref().map_err(Clone::clone)? {
            Store::Postgres(_) => sqlx::query_scalar::<_, i64>(
                "SELECT count(*)::bigint FROM pg_stat_activity \
                 WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
            )
            .fetch_one(self.pg.as_ref().ok_or("no counting connection")?)
            .await
            .map(|n| n as u64)
            .map_err(|e| e.to_string()),
            Store::My(_) => sqlx::raw_sql("SHOW PROCESSLIST")
                .fetch_all(self.my.as_ref().ok_or("no counting connection")?)
                .await
                .map(|rows| rows.len() as u64)
                .map_err(|e| e.to_string()),
            Store::Redis(server) => redis_clients(server),
            Store::Sqlite(_) => Err("no server".to_owned()),
        }
    }
}

/// Redis's `connected_clients` (`INFO clients`).
pub(crate) fn redis_clients(server: &RedisServer) -> Result<u64, String> {
    server
        .info("clients")
        .get("connected_clients")
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| "no connected_clients".to_owned())
}

async fn locks_per_connection(b: &Backend, n: usize) -> Result<u64, String> {
    let counter = Connections::new(b).await?;
    let before = counter.count(b).await?;
    let locks = LockProvider::connect(&b.dlock_url(""))
        .await
        .map_err(|e| e.to_string())?;
    let guards: Vec<_> = futures::stream::iter(0..n)
        .map(|i| {
            let locks = &locks;
            async move { locks.try_acquire(&format!("bench:many:{i}")).await }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    let guards: Vec<_> = guards
        .into_iter()
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let during = counter.count(b).await?;
    if let Some(pool) = &counter.pg {
        let held: i64 = sqlx::query_scalar(
            "SELECT count(*)::bigint FROM pg_locks WHERE locktype = 'advisory' AND granted",
        )
        .fetch_one(pool)
        .await
        .map_err(|e| e.to_string())?;
        if (held as usize) < n {
            return Err(format!("only {held} advisory locks granted of {n}"));
        }
    }
    futures::stream::iter(guards)
        .for_each_concurrent(32, |g| async move {
            let _ = g.release().await;
        })
        .await;
    Ok(during.saturating_sub(before))
}
