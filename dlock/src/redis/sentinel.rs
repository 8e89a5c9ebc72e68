//! Redis Sentinel: finding the master of a service through its sentinels, and the
//! `redis+sentinel://` URL.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{ErrorKind, RedisConnectionInfo};
use redis::{RedisError, ServerErrorKind, Value};

use crate::LockError;
use crate::options::{percent_decode, shown};

use super::hosts::{HostListUrl, Hosts};
use super::{HostTls, host_client};

/// The port a sentinel listens on when the URL names none.
pub(crate) const DEFAULT_SENTINEL_PORT: u16 = 26379;

/// Where the sentinels are and what they are asked for.
#[derive(Clone)]
pub(crate) struct Sentinels {
    /// The sentinels, asked in this order.
    pub(crate) nodes: Vec<(String, u16)>,
    /// The name of the master the sentinels monitor (`sentinel monitor NAME ...`).
    pub(crate) service: String,
    /// The sentinels' own user name and password, if they ask for one.
    pub(crate) auth: RedisConnectionInfo,
    /// The master's database, user name, password and protocol.
    pub(crate) master: RedisConnectionInfo,
    /// TLS to the sentinels and the master (`rediss+sentinel://`); `None`: in clear.
    pub(crate) tls: Option<HostTls>,
    /// Limit for connecting to each sentinel or master candidate, and for each answer.
    pub(crate) timeout: Duration,
    /// How often the sentinels are asked where the master is, besides after failures.
    pub(crate) check_every: Duration,
    /// The sentinel that answered last: asked first next time, so that a sentinel that is
    /// down slows one discovery, not every one.
    pub(crate) first: Arc<AtomicUsize>,
    /// Connections to the sentinels, by their place in `nodes`, kept open between asks: the
    /// periodic check is then one round trip, without a new connection (over TLS, a
    /// handshake) each time. Made anew for each backend.
    pub(crate) links: Arc<Mutex<Vec<Option<MultiplexedConnection>>>>,
}

impl fmt::Debug for Sentinels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sentinels")
            .field("nodes", &self.nodes)
            .field("service", &self.service)
            .finish_non_exhaustive()
    }
}

/// A master found through the sentinels: its address and a client for it (`None`: the
/// master in use, named again).
pub(crate) struct Found {
    pub(crate) addr: (String, u16),
    pub(crate) client: Option<redis::Client>,
}

impl Sentinels {
    /// Asks each sentinel in turn for the address of the service's master
    /// (`SENTINEL get-master-addr-by-name`), and takes the first answer whose node itself
    /// reports `ROLE` master: a sentinel that has not yet heard of a failover names the old
    /// master, which answers that it is a replica now (or does not answer), and the next
    /// sentinel is asked. Fails, saying what each sentinel answered, when none leads to a
    /// master.
    ///
    /// With `known` (the master in use, on a periodic check), a sentinel that names it again
    /// is taken at its word, without asking the node its role.
    ///
    /// Cancel safe: every connection it opens is closed when the future is dropped.
    pub(crate) async fn discover(
        &self,
        known: Option<&(String, u16)>,
    ) -> Result<Found, RedisError> {
        let mut answers = Vec::with_capacity(self.nodes.len());
        // A refused certificate of every sentinel is a mistake in the configuration: the first
        // such refusal is the answer (see `refused_certificate`).
        let mut refused = (None, 0);
        let first = self.first.load(Ordering::Relaxed) % self.nodes.len().max(1);
        for i in (first..self.nodes.len()).chain(0..first) {
            let (host, port) = &self.nodes[i];
            // A discovery dropped while this sentinel is silent starts from the next one.
            self.first
                .store((i + 1) % self.nodes.len(), Ordering::Relaxed);
            let answer = match self.ask(i).await {
                Err(err) if refused_certificate(&err) => {
                    let text = format!("could not be asked ({})", describe(&err));
                    refused.1 += 1;
                    refused.0.get_or_insert(err);
                    text
                }
                Ok(Some(addr)) if Some(&addr) == known => {
                    self.first.store(i, Ordering::Relaxed);
                    return Ok(Found { addr, client: None });
                }
                Ok(Some(addr)) => match self.check_master(&addr).await {
                    Ok(client) => {
                        self.first.store(i, Ordering::Relaxed);
                        return Ok(Found {
                            addr,
                            client: Some(client),
                        });
                    }
                    Err(why) => format!("names {}:{}, which {why}", addr.0, addr.1),
                },
                Ok(None) => format!("does not know the service `{}`", self.service),
                Err(err) => format!("could not be asked ({})", describe(&err)),
            };
            answers.push(format!("the sentinel {host}:{port} {answer}"));
        }
        // Start from the top again next time.
        self.first.store(0, Ordering::Relaxed);
        if let (Some(err), n) = refused
            && n == self.nodes.len()
        {
            return Err(err);
        }
        Err(RedisError::from((
            ErrorKind::Io,
            "no master",
            format!(
                "no sentinel named a master that reports itself master: {}",
                answers.join("; ")
            ),
        )))
    }

    /// The master's address as sentinel `i` sees it; `None` when it does not monitor the
    /// service.
    async fn ask(&self, i: usize) -> Result<Option<(String, u16)>, RedisError> {
        let mut cmd = redis::cmd("SENTINEL");
        cmd.arg("get-master-addr-by-name").arg(&self.service);
        let reply = self.on_sentinel(i, &cmd).await?;
        match reply {
            Value::Nil => Ok(None),
            Value::Array(items) if items.len() == 2 => {
                let host: String = redis::from_redis_value(items[0].clone())?;
                let port: u16 = redis::from_redis_value(items[1].clone())?;
                Ok(Some((host, port)))
            }
            other => Err(RedisError::from((
                ErrorKind::UnexpectedReturnType,
                "unexpected reply",
                format!("SENTINEL get-master-addr-by-name answered {other:?}"),
            ))),
        }
    }

    /// `cmd` to sentinel `i`, on the connection kept for it. A kept connection that fails
    /// (the sentinel restarted, the runtime that drove it ended) is closed, and unless it
    /// timed out, `cmd` goes out once more on a new connection; a new connection that answers
    /// is kept. A server's error reply keeps the connection: it works.
    async fn on_sentinel(&self, i: usize, cmd: &redis::Cmd) -> Result<Value, RedisError> {
        if let Some(mut conn) = self.kept(i) {
            match self.bounded(cmd.query_async::<Value>(&mut conn)).await {
                Err(err) if err.is_io_error() => {
                    self.keep(i, None);
                    if err.is_timeout() {
                        return Err(err);
                    }
                }
                outcome => return outcome,
            }
        }
        let (host, port) = &self.nodes[i];
        let client = host_client(self.tls.as_ref(), host, *port, self.auth.clone())?;
        let (conn, reply) = self.bounded(self.connect_and_ask(&client, cmd)).await?;
        self.keep(i, Some(conn));
        Ok(reply)
    }

    /// Opens a connection with `client` (each step bounded by `timeout`) and sends `cmd` on
    /// it: the connection and the answer.
    async fn connect_and_ask(
        &self,
        client: &redis::Client,
        cmd: &redis::Cmd,
    ) -> Result<(MultiplexedConnection, Value), RedisError> {
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.timeout))
            .set_response_timeout(Some(self.timeout));
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        let reply = cmd.query_async::<Value>(&mut conn).await?;
        Ok((conn, reply))
    }

    /// The connection kept for sentinel `i`, if any.
    fn kept(&self, i: usize) -> Option<MultiplexedConnection> {
        let links = self.links.lock().unwrap_or_else(PoisonError::into_inner);
        links.get(i).cloned().flatten()
    }

    /// Keeps `link` (`None`: no connection) for sentinel `i`.
    fn keep(&self, i: usize, link: Option<MultiplexedConnection>) {
        let mut links = self.links.lock().unwrap_or_else(PoisonError::into_inner);
        if links.len() <= i {
            links.resize(i + 1, None);
        }
        links[i] = link;
    }

    /// A client for `addr` if the node there reports `ROLE` master; why not otherwise.
    async fn check_master(&self, addr: &(String, u16)) -> Result<redis::Client, String> {
        let client = host_client(self.tls.as_ref(), &addr.0, addr.1, self.master.clone())
            .map_err(|err| describe(&err))?;
        let reply = self
            .one_command(&client, &redis::cmd("ROLE"))
            .await
            .map_err(|err| format!("could not be asked its ROLE ({})", describe(&err)))?;
        let role = match &reply {
            Value::Array(items) => items.first().and_then(|first| match first {
                Value::BulkString(bytes) => Some(String::from_utf8_lossy(bytes).into_owned()),
                Value::SimpleString(text) => Some(text.clone()),
                _ => None,
            }),
            _ => None,
        };
        match role.as_deref() {
            Some("master") => Ok(client),
            Some(other) => Err(format!("reports ROLE {other}")),
            None => Err(format!("answered ROLE with {reply:?}")),
        }
    }

    /// One command on a connection of its own, opened for it and closed after.
    async fn one_command(
        &self,
        client: &redis::Client,
        cmd: &redis::Cmd,
    ) -> Result<Value, RedisError> {
        let (_, reply) = self.bounded(self.connect_and_ask(client, cmd)).await?;
        Ok(reply)
    }

    /// `work`, given up after `timeout`.
    async fn bounded<T>(
        &self,
        work: impl Future<Output = Result<T, RedisError>>,
    ) -> Result<T, RedisError> {
        match tokio::time::timeout(self.timeout, work).await {
            Ok(outcome) => outcome,
            Err(_) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer within {:?}", self.timeout),
            ))),
        }
    }
}

/// Whether `err` is a TLS refusal of the server's certificate.
fn refused_certificate(err: &RedisError) -> bool {
    crate::tls::describe(err, "ca").is_some_and(|failure| failure.certificate)
}

/// An error in a few words, never quoting a URL or password; a TLS failure as what failed
/// and what to do.
fn describe(err: &RedisError) -> String {
    if let Some(failure) = crate::tls::describe(err, "ca") {
        return failure.message;
    }
    match err.detail() {
        Some(detail) => format!("{}: {detail}", err.code().unwrap_or("error")),
        None => err.to_string(),
    }
}

/// An answer that says the connection does not lead to a writable master any more: the
/// node was demoted to a replica (`READONLY`, also from inside a script), lost its master
/// (`MASTERDOWN`), or is loading its data after a restart (`LOADING`).
pub(crate) fn points_elsewhere(err: &RedisError) -> bool {
    match err.kind() {
        ErrorKind::Server(
            ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown | ServerErrorKind::BusyLoading,
        ) => true,
        ErrorKind::Server(_) | ErrorKind::Extension => err.detail().is_some_and(|d| {
            d.contains("READONLY") || d.contains("read only replica") || d.contains("MASTERDOWN")
        }),
        _ => false,
    }
}

/// What a `redis+sentinel://` URL says apart from its options.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct SentinelUrl {
    pub(crate) hosts: Hosts,
    /// `rediss+sentinel://`: the sentinels and the master are reached over TLS.
    pub(crate) tls: bool,
    pub(crate) service: String,
    pub(crate) db: i64,
    /// The query, without `?`.
    pub(crate) query: String,
}

/// How a `redis+sentinel://` URL is written.
const URL: HostListUrl = HostListUrl {
    scheme: "redis+sentinel",
    tls_scheme: "rediss+sentinel",
    leads_to: "Redis Sentinel",
    noun: "sentinel",
    default_port: DEFAULT_SENTINEL_PORT,
    example: "redis+sentinel://[user:password@]host:26379,host:26379/SERVICE[/db][?lease=30s]",
};

/// Takes a `redis+sentinel://` URL apart. Errors never repeat the password.
pub(crate) fn split_url(url: &str) -> Result<SentinelUrl, LockError> {
    let split = URL.split(url)?;
    let hosts = URL.hosts(&split)?;
    let (service, db) = match split.path.split_once('/') {
        Some((service, db)) => (service, Some(db)),
        None => (split.path, None),
    };
    let service = percent_decode(service)
        .ok_or_else(|| URL.error("has a service name that is not percent-encoded UTF-8"))?;
    if service.is_empty() {
        return Err(
            URL.error("names no service: the path is the name the sentinels monitor the master by")
        );
    }
    let db = match db {
        None | Some("") => 0,
        Some(db) => db.parse::<i64>().ok().filter(|n| *n >= 0).ok_or_else(|| {
            URL.error(format_args!(
                "has `{}` after the service where a database number goes",
                shown(db)
            ))
        })?,
    };
    Ok(SentinelUrl {
        hosts,
        tls: split.tls,
        service,
        db,
        query: split.query.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config_error(url: &str) -> String {
        super::super::hosts::config_error(url, split_url)
    }

    #[test]
    fn sentinel_urls() {
        // The host list without credentials: `hosts::tests::host_lists`.
        let url = split_url("redis+sentinel://a:1,b,[::1]:3/mymaster").unwrap();
        assert_eq!((url.service.as_str(), url.db), ("mymaster", 0));
        let url =
            split_url("REDIS+SENTINEL://u%40x:hunter%32@h:26379/my%20master/3?lease=2s").unwrap();
        assert_eq!(url.service, "my master");
        assert_eq!(url.db, 3);
        assert_eq!(url.hosts.user.as_deref(), Some("u@x"));
        assert_eq!(url.hosts.password.as_deref(), Some("hunter2"));
        assert_eq!(url.query, "lease=2s");
        let url = split_url("redis+sentinel://:pw@h/s/").unwrap();
        assert_eq!(
            (url.hosts.user, url.hosts.password.as_deref(), url.db),
            (None, Some("pw"), 0)
        );
    }

    #[test]
    fn sentinel_url_mistakes_are_config_errors() {
        assert!(config_error("redis://h/s").contains("starts with redis+sentinel://"));
        assert!(config_error("redis+sentinel:///mymaster").contains("lists no sentinel"));
        assert!(config_error("redis+sentinel://u:hunter2@/mymaster").contains("lists no sentinel"));
        assert!(config_error("redis+sentinel://a:1,,b:2/m").contains("one of them is empty"));
        assert!(config_error("redis+sentinel://a:1,a:1/m").contains("twice"));
        assert!(config_error("redis+sentinel://a:1,b:2").contains("names no service"));
        assert!(config_error("redis+sentinel://a:1/").contains("names no service"));
        assert!(config_error("redis+sentinel://a:1//0").contains("names no service"));
        for port in ["a:x", "a:0", "a:65536", "a:", "[::1]x", "a:-1"] {
            let text = config_error(&format!("redis+sentinel://u:hunter2@{port}/m"));
            assert!(
                text.contains("port") || text.contains("`]`"),
                "{port}: {text}"
            );
        }
        assert!(config_error("redis+sentinel://[::1/m").contains("unclosed"));
        assert!(config_error("redis+sentinel://:1/m").contains("without a host"));
        assert!(config_error("redis+sentinel://a/m/x").contains("database number"));
        assert!(config_error("redis+sentinel://a/m/-1").contains("database number"));
        assert!(config_error("redis+sentinel://a/%ff").contains("service name"));
    }

    #[test]
    fn answers_that_point_elsewhere() {
        let err = |kind, code: &'static str, detail: &str| {
            RedisError::from((ErrorKind::Server(kind), code, detail.to_owned()))
        };
        assert!(points_elsewhere(&err(
            ServerErrorKind::ReadOnly,
            "READONLY",
            "You can't write against a read only replica."
        )));
        assert!(points_elsewhere(&err(
            ServerErrorKind::ResponseError,
            "ERR",
            "Error running script: READONLY You can't write against a read only replica."
        )));
        assert!(points_elsewhere(&err(
            ServerErrorKind::MasterDown,
            "MASTERDOWN",
            "x"
        )));
        assert!(!points_elsewhere(&err(
            ServerErrorKind::NoPerm,
            "NOPERM",
            "no"
        )));
        assert!(!points_elsewhere(&err(
            ServerErrorKind::ResponseError,
            "ERR",
            "syntax error"
        )));
    }
}
