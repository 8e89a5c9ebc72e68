//! The raw-driver baselines of the benches: the statements or commands a backend's acquire +
//! release runs, straight on the driver, without dlock, and their waiting forms for a key
//! that others hold (the report's hot-key run, through `dlock-worker throughput --raw`).
//! Shared by the per-backend benches, the report and the worker; each part is there with the
//! feature of its backend.

/// The Lua compare-and-delete a Redis release runs when the server has no native one.
pub const REDIS_RELEASE_LUA: &str =
    "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0";

/// PostgreSQL: `pg_try_advisory_lock($1)` + `pg_advisory_unlock($1)` on one connection taken
/// from `pool` (which, when the connection goes back, pings it in a task of its own: a third
/// round trip, off the caller's path).
#[cfg(feature = "postgres")]
pub async fn postgres(pool: &sqlx::PgPool, id: i64) {
    let mut conn = pool.acquire().await.expect("connection");
    postgres_on(&mut conn, id).await;
}

/// PostgreSQL: `pg_try_advisory_lock($1)` + `pg_advisory_unlock($1)` on `conn`, a connection
/// the caller keeps.
#[cfg(feature = "postgres")]
pub async fn postgres_on(conn: &mut sqlx::PgConnection, id: i64) {
    let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock($1)")
        .bind(id)
        .fetch_one(&mut *conn)
        .await
        .expect("lock");
    assert!(got, "the advisory lock was not free");
    let released: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
        .bind(id)
        .fetch_one(&mut *conn)
        .await
        .expect("unlock");
    assert!(released);
}

/// MySQL / MariaDB: `GET_LOCK(?, 0)` + `RELEASE_LOCK(?)` on one connection taken from `pool`
/// (which, when the connection goes back, pings it in a task of its own: a third round trip,
/// off the caller's path).
#[cfg(feature = "mysql")]
pub async fn mysql(pool: &sqlx::MySqlPool, name: &str) {
    let mut conn = pool.acquire().await.expect("connection");
    mysql_on(&mut conn, name).await;
}

/// MySQL / MariaDB: `GET_LOCK(?, 0)` + `RELEASE_LOCK(?)` on `conn`, a connection the caller
/// keeps.
#[cfg(feature = "mysql")]
pub async fn mysql_on(conn: &mut sqlx::MySqlConnection, name: &str) {
    let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, 0)")
        .bind(name)
        .fetch_one(&mut *conn)
        .await
        .expect("lock");
    assert_eq!(got, Some(1), "the named lock was not free");
    let released: Option<i64> = sqlx::query_scalar("SELECT RELEASE_LOCK(?)")
        .bind(name)
        .fetch_one(&mut *conn)
        .await
        .expect("release");
    assert_eq!(released, Some(1));
}

/// Redis: `SET key token NX PX 30000` + the Lua compare-and-delete through `EVALSHA`.
#[cfg(feature = "redis")]
pub async fn redis<C: redis::aio::ConnectionLike>(conn: &mut C, script: &redis::Script, key: &str) {
    let set: Option<String> = redis::cmd("SET")
        .arg(key)
        .arg("token-0123456789")
        .arg("NX")
        .arg("PX")
        .arg(30_000)
        .query_async(conn)
        .await
        .expect("set");
    assert!(set.is_some(), "the key was not free");
    let deleted: i64 = script
        .key(key)
        .arg("token-0123456789")
        .invoke_async(conn)
        .await
        .expect("delete");
    assert_eq!(deleted, 1);
}

/// SQLite: a hand-written lease lock, as a rusqlite user would write one (and as dlock's own
/// statements were before it answered held keys with a read and kept the tokens of
/// transaction-bound locks in a file of their own): one upsert that takes a free or expired
/// row and returns its fencing counter, one update that frees it; on one connection with
/// dlock's settings (WAL, `synchronous = NORMAL`, a busy timeout), in a table of its own.
#[cfg(feature = "sqlite")]
pub struct Sqlite {
    conn: rusqlite::Connection,
    n: u64,
}

#[cfg(feature = "sqlite")]
const RAW_SQLITE_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS raw_locks (name BLOB NOT NULL PRIMARY KEY, \
    owner BLOB, lease_end INTEGER NOT NULL DEFAULT 0, fencing INTEGER NOT NULL DEFAULT 0) WITHOUT ROWID";

#[cfg(feature = "sqlite")]
const RAW_SQLITE_ACQUIRE: &str = "INSERT INTO raw_locks (name, owner, lease_end, fencing) \
    VALUES (?1, ?2, ?3, 1) \
    ON CONFLICT (name) DO UPDATE SET owner = excluded.owner, lease_end = excluded.lease_end, \
    fencing = raw_locks.fencing + 1 \
    WHERE raw_locks.owner IS NULL OR raw_locks.lease_end <= ?4 \
    RETURNING fencing";

#[cfg(feature = "sqlite")]
const RAW_SQLITE_RELEASE: &str =
    "UPDATE raw_locks SET owner = NULL, lease_end = 0 WHERE name = ?1 AND owner = ?2";

#[cfg(feature = "sqlite")]
impl Sqlite {
    /// Opens `path` and creates the baseline's table. Give it a file of its own: each
    /// connection then checkpoints only its own log (SQLite's automatic checkpoints, inside
    /// the commits that cross 1,000 pages, as a hand-written lock gets by default).
    pub fn open(path: &std::path::Path) -> Sqlite {
        let conn = rusqlite::Connection::open(path).expect("open");
        // dlock's page size for the files it creates (no effect on an existing file).
        conn.execute_batch("PRAGMA page_size = 1024")
            .expect("page size");
        conn.query_row("PRAGMA journal_mode = WAL", [], |_| Ok(()))
            .expect("wal");
        conn.pragma_update(None, "synchronous", "NORMAL")
            .expect("synchronous");
        conn.busy_timeout(std::time::Duration::from_secs(5))
            .expect("busy timeout");
        conn.execute_batch(RAW_SQLITE_SCHEMA).expect("table");
        Sqlite { conn, n: 0 }
    }

    /// One acquire + release of `key` with a new owner.
    pub fn acquire_release(&mut self, key: &[u8]) {
        use rusqlite::{OptionalExtension, params};
        self.n += 1;
        let owner = self.n.to_le_bytes();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis() as i64;
        let token: Option<i64> = self
            .conn
            .prepare_cached(RAW_SQLITE_ACQUIRE)
            .expect("prepare")
            .query_row(params![key, &owner[..], now + 30_000, now], |r| r.get(0))
            .optional()
            .expect("acquire");
        assert!(token.is_some(), "the row was not free");
        self.conn
            .prepare_cached(RAW_SQLITE_RELEASE)
            .expect("prepare")
            .execute(params![key, &owner[..]])
            .expect("release");
    }
}

/// How long a raw Redis acquisition sleeps between its `SET NX PX` polls of a held key.
pub const REDIS_POLL: std::time::Duration = std::time::Duration::from_millis(1);

/// PostgreSQL, waiting: `pg_advisory_lock($1)` (which waits natively while another session
/// holds `id`) + `pg_advisory_unlock($1)` on `conn`, a connection the caller keeps.
#[cfg(feature = "postgres")]
pub async fn postgres_wait_on(conn: &mut sqlx::PgConnection, id: i64) -> Result<(), String> {
    sqlx::query("SELECT pg_advisory_lock($1)")
        .bind(id)
        .execute(&mut *conn)
        .await
        .map_err(|e| format!("pg_advisory_lock: {e}"))?;
    let released: bool = sqlx::query_scalar("SELECT pg_advisory_unlock($1)")
        .bind(id)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| format!("pg_advisory_unlock: {e}"))?;
    released
        .then_some(())
        .ok_or_else(|| "pg_advisory_unlock found the lock not held".to_owned())
}

/// MySQL / MariaDB, waiting: `GET_LOCK(?, timeout)` (which waits natively, up to `timeout`
/// seconds, while another session holds `name`) + `RELEASE_LOCK(?)` on `conn`, a connection
/// the caller keeps.
#[cfg(feature = "mysql")]
pub async fn mysql_wait_on(
    conn: &mut sqlx::MySqlConnection,
    name: &str,
    timeout: u64,
) -> Result<(), String> {
    let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(?, ?)")
        .bind(name)
        .bind(timeout)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| format!("GET_LOCK: {e}"))?;
    if got != Some(1) {
        return Err(format!("GET_LOCK answered {got:?} after up to {timeout} s"));
    }
    let released: Option<i64> = sqlx::query_scalar("SELECT RELEASE_LOCK(?)")
        .bind(name)
        .fetch_one(&mut *conn)
        .await
        .map_err(|e| format!("RELEASE_LOCK: {e}"))?;
    (released == Some(1))
        .then_some(())
        .ok_or_else(|| format!("RELEASE_LOCK answered {released:?}"))
}

/// Redis, waiting: `SET key token NX PX 30000` again every [`REDIS_POLL`] while the key is
/// held, then the Lua compare-and-delete ([`REDIS_RELEASE_LUA`] in `script`) through
/// `EVALSHA`. `token` tells this holder from the others.
#[cfg(feature = "redis")]
pub async fn redis_wait<C: redis::aio::ConnectionLike>(
    conn: &mut C,
    script: &redis::Script,
    key: &str,
    token: &str,
) -> Result<(), String> {
    loop {
        let set: Option<String> = redis::cmd("SET")
            .arg(key)
            .arg(token)
            .arg("NX")
            .arg("PX")
            .arg(30_000)
            .query_async(conn)
            .await
            .map_err(|e| format!("SET NX PX: {e}"))?;
        if set.is_some() {
            break;
        }
        tokio::time::sleep(REDIS_POLL).await;
    }
    let deleted: i64 = script
        .key(key)
        .arg(token)
        .invoke_async(conn)
        .await
        .map_err(|e| format!("compare-and-delete: {e}"))?;
    (deleted == 1)
        .then_some(())
        .ok_or_else(|| "the compare-and-delete found another holder".to_owned())
}
