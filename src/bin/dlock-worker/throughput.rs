//! The throughput run: acquisitions per second of processes that take locks in a loop.
//!
//! `dlock-worker throughput URL PREFIX [--processes P] [--tasks T] [--seconds S] [--hot]
//! [--raw]` starts P worker processes (`tput URL PREFIX I T S MODE`) of T tasks each. Every
//! task takes a lock, gives it back at once and asks again, for S seconds from a common start
//! (each worker connects, runs one acquisition per task to warm up, says `ready`, and starts
//! when told `go` on stdin); each worker prints `count N`, the acquisitions its tasks completed
//! (taken and given back) within the S seconds.
//!
//! The keys are distinct, `PREFIX:I:TASK` for task TASK of process I, unless `--hot`: then
//! every task of every process takes `PREFIX` itself. Each process takes its locks through one
//! `LockProvider` shared by its tasks, or with `--raw` straight through the driver, on a
//! connection per task: PostgreSQL `pg_advisory_lock` + `pg_advisory_unlock`, MySQL / MariaDB
//! `GET_LOCK(?, 60)` + `RELEASE_LOCK(?)` (both wait natively), Redis `SET NX PX` polled every
//! millisecond + the Lua compare-and-delete (URLs `postgres://`, `mysql://`, `redis://`).
//!
//! Once every worker is told `go`, the run prints `started` (its caller may count what the
//! server holds meanwhile), and at the end one line: `ok processes=P tasks=T seconds=S
//! keys=distinct|hot side=dlock|raw counts=N,N,.. total=N per_s=X`.

use std::time::{Duration, Instant};

use dlock::LockProvider;

use crate::group::{Group, number, ready_then_go};

/// What a run is asked to do.
struct Load {
    processes: usize,
    tasks: usize,
    seconds: u64,
    hot: bool,
    raw: bool,
}

impl Load {
    fn parse(rest: &[&str]) -> Result<Load, String> {
        let mut load = Load {
            processes: 2,
            tasks: 4,
            seconds: 3,
            hot: false,
            raw: false,
        };
        let mut rest = rest.iter();
        while let Some(flag) = rest.next() {
            let mut value = || number(flag, rest.next().ok_or(format!("{flag} needs a value"))?);
            match *flag {
                "--hot" => load.hot = true,
                "--raw" => load.raw = true,
                "--processes" => load.processes = value()? as usize,
                "--tasks" => load.tasks = value()? as usize,
                "--seconds" => load.seconds = value()?,
                other => return Err(format!("unknown option {other}")),
            }
        }
        if load.processes == 0 || load.tasks == 0 || load.seconds == 0 {
            return Err("processes, tasks and seconds must be at least 1".to_owned());
        }
        Ok(load)
    }

    /// The worker's MODE: `distinct`, `hot`, `raw-distinct` or `raw-hot`.
    fn mode(&self) -> String {
        let keys = if self.hot { "hot" } else { "distinct" };
        if self.raw {
            format!("raw-{keys}")
        } else {
            keys.to_owned()
        }
    }
}

/// The run (see the module docs).
pub(crate) fn run(url: &str, prefix: &str, rest: &[&str]) -> Result<(), String> {
    let load = Load::parse(rest)?;
    let mode = load.mode();
    let mut group = Group::spawn(load.processes, |i| {
        vec![
            "tput".to_owned(),
            url.to_owned(),
            prefix.to_owned(),
            i.to_string(),
            load.tasks.to_string(),
            load.seconds.to_string(),
            mode.clone(),
        ]
    })?;
    group.go()?;
    println!("started");
    std::io::Write::flush(&mut std::io::stdout()).map_err(|e| e.to_string())?;
    let mut counts = vec![None; load.processes];
    group.finish(|i, line| {
        if let Some(n) = line.strip_prefix("count ") {
            counts[i] = Some(n.parse::<u64>().map_err(|e| format!("count {n:?}: {e}"))?);
        }
        Ok(())
    })?;
    let counts: Vec<u64> = counts
        .into_iter()
        .map(|c| c.ok_or("a worker printed no count"))
        .collect::<Result<_, _>>()?;
    let total: u64 = counts.iter().sum();
    println!(
        "ok processes={} tasks={} seconds={} keys={} side={} counts={} total={total} per_s={:.1}",
        load.processes,
        load.tasks,
        load.seconds,
        if load.hot { "hot" } else { "distinct" },
        if load.raw { "raw" } else { "dlock" },
        counts
            .iter()
            .map(u64::to_string)
            .collect::<Vec<_>>()
            .join(","),
        total as f64 / load.seconds as f64
    );
    Ok(())
}

/// How long one acquisition may wait (the hot key is wanted by every task at once).
const WAIT: Duration = Duration::from_secs(60);

/// One task's way of taking its lock.
enum Taker {
    Dlock {
        locks: LockProvider,
        key: String,
    },
    #[cfg(feature = "postgres")]
    Postgres {
        conn: sqlx::PgConnection,
        id: i64,
    },
    #[cfg(feature = "mysql")]
    MySql {
        conn: sqlx::MySqlConnection,
        name: String,
    },
    #[cfg(feature = "redis")]
    Redis {
        conn: redis::aio::MultiplexedConnection,
        script: redis::Script,
        key: String,
        token: String,
    },
}

impl Taker {
    /// The raw driver's taker of `key` for the store at `url`, on a connection of its own.
    #[cfg_attr(
        not(any(feature = "postgres", feature = "mysql", feature = "redis")),
        allow(unused_variables)
    )]
    async fn raw(url: &str, key: String) -> Result<Taker, String> {
        let scheme = url.split("://").next().unwrap_or_default();
        match scheme {
            #[cfg(feature = "postgres")]
            "postgres" | "postgresql" => Ok(Taker::Postgres {
                conn: <sqlx::PgConnection as sqlx::Connection>::connect(url)
                    .await
                    .map_err(|e| e.to_string())?,
                id: dlock::lock_id(&key),
            }),
            #[cfg(feature = "mysql")]
            "mysql" => Ok(Taker::MySql {
                conn: <sqlx::MySqlConnection as sqlx::Connection>::connect(url)
                    .await
                    .map_err(|e| e.to_string())?,
                name: dlock::mysql::server_lock_name(&key),
            }),
            #[cfg(feature = "redis")]
            "redis" => Ok(Taker::Redis {
                conn: redis::Client::open(url)
                    .map_err(|e| e.to_string())?
                    .get_multiplexed_async_connection()
                    .await
                    .map_err(|e| e.to_string())?,
                script: redis::Script::new(dlock_suite::raw::REDIS_RELEASE_LUA),
                token: format!("{}:{}", std::process::id(), fastrand::u64(..)),
                key,
            }),
            other => Err(format!(
                "no raw driver for `{other}://` in this build (features postgres, mysql, redis)"
            )),
        }
    }

    /// Takes the lock and gives it back at once.
    async fn cycle(&mut self) -> Result<(), String> {
        match self {
            Taker::Dlock { locks, key } => {
                let guard = locks
                    .acquire(key, WAIT)
                    .await
                    .map_err(|e| format!("acquiring {key}: {e}"))?;
                guard
                    .release()
                    .await
                    .map_err(|e| format!("releasing {key}: {e}"))
            }
            #[cfg(feature = "postgres")]
            Taker::Postgres { conn, id } => dlock_suite::raw::postgres_wait_on(conn, *id).await,
            #[cfg(feature = "mysql")]
            Taker::MySql { conn, name } => {
                dlock_suite::raw::mysql_wait_on(conn, name, WAIT.as_secs()).await
            }
            #[cfg(feature = "redis")]
            Taker::Redis {
                conn,
                script,
                key,
                token,
            } => dlock_suite::raw::redis_wait(conn, script, key, token).await,
        }
    }
}

/// One worker process of the throughput run (see the module docs).
pub(crate) async fn worker(
    url: &str,
    prefix: &str,
    index: &str,
    tasks: &str,
    seconds: &str,
    mode: &str,
) -> Result<(), String> {
    let (tasks, seconds) = (number("tasks", tasks)?, number("seconds", seconds)?);
    let (raw, hot) = match mode {
        "distinct" => (false, false),
        "hot" => (false, true),
        "raw-distinct" => (true, false),
        "raw-hot" => (true, true),
        other => return Err(format!("unknown mode {other}")),
    };
    let locks = if raw {
        None
    } else {
        Some(
            LockProvider::connect(url)
                .await
                .map_err(|e| e.to_string())?,
        )
    };
    let mut takers = Vec::new();
    for task in 0..tasks {
        let key = if hot {
            prefix.to_owned()
        } else {
            format!("{prefix}:{index}:{task}")
        };
        takers.push(match &locks {
            Some(locks) => Taker::Dlock {
                locks: locks.clone(),
                key,
            },
            None => Taker::raw(url, key).await?,
        });
    }
    // One acquisition each before the start: connections open, statements prepared.
    let warm = takers.into_iter().map(|mut t| {
        tokio::spawn(async move {
            t.cycle().await?;
            Ok::<_, String>(t)
        })
    });
    let mut takers = Vec::new();
    for t in warm.collect::<Vec<_>>() {
        takers.push(t.await.map_err(|e| format!("a task failed: {e}"))??);
    }
    ready_then_go()?;
    let end = Instant::now() + Duration::from_secs(seconds);
    let mut set = tokio::task::JoinSet::new();
    for mut taker in takers {
        set.spawn(async move {
            let mut count = 0u64;
            while Instant::now() < end {
                taker.cycle().await?;
                if Instant::now() < end {
                    count += 1;
                }
            }
            Ok::<_, String>(count)
        });
    }
    let mut count = 0;
    while let Some(done) = set.join_next().await {
        count += done.map_err(|e| format!("a task failed: {e}"))??;
    }
    println!("count {count}");
    Ok(())
}
