//! Redis Cluster: the connection that sends each command to the master of its key's slot, and
//! the `redis+cluster://` URL.

use std::fmt;
use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster::{ClusterClient, ClusterConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, ErrorKind, Pipeline, RedisError, RedisFuture, Value};

use crate::LockError;
use crate::options::shown;

use super::hosts::{HostListUrl, Hosts};

/// The port a node listens on when the URL names none.
pub(crate) const DEFAULT_PORT: u16 = 6379;

/// The connection a backend sends its commands on: one server's connection manager (a single
/// server, or the master behind Sentinel), or a cluster connection, which routes each command
/// by its first key and follows `MOVED` and `ASK` redirections by itself.
#[derive(Clone)]
pub(crate) enum Link {
    /// One server.
    Single(ConnectionManager),
    /// A Redis Cluster.
    Cluster(ClusterConnection),
}

impl From<ConnectionManager> for Link {
    fn from(manager: ConnectionManager) -> Link {
        Link::Single(manager)
    }
}

impl ConnectionLike for Link {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Link::Single(manager) => manager.req_packed_command(cmd),
            Link::Cluster(cluster) => cluster.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Link::Single(manager) => manager.req_packed_commands(cmd, offset, count),
            Link::Cluster(cluster) => cluster.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Link::Single(manager) => manager.get_db(),
            Link::Cluster(cluster) => cluster.get_db(),
        }
    }
}

impl Link {
    /// On a cluster, `cmd` sent to the node at `addr` (not routed by key); on one server, sent
    /// there.
    pub(crate) async fn query_at(
        &mut self,
        addr: &(String, u16),
        cmd: &Cmd,
    ) -> Result<Value, RedisError> {
        match self {
            Link::Single(manager) => cmd.query_async(manager).await,
            Link::Cluster(cluster) => {
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                    host: addr.0.clone(),
                    port: addr.1,
                });
                cluster.route_command(cmd.clone(), routing).await
            }
        }
    }
}

/// How a backend on a cluster connects, and connects again.
#[derive(Clone)]
pub(crate) struct Cluster {
    pub(crate) client: ClusterClient,
    pub(crate) config: ClusterConfig,
}

impl fmt::Debug for Cluster {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cluster").finish_non_exhaustive()
    }
}

impl Cluster {
    /// A cluster connection that connects on the current runtime when first used.
    pub(crate) fn lazy(&self) -> ClusterConnection {
        self.client
            .get_pending_async_connection_with_config(self.config.clone())
    }

    /// A connected cluster connection.
    pub(crate) async fn connect(&self) -> Result<ClusterConnection, RedisError> {
        self.client
            .get_async_connection_with_config(self.config.clone())
            .await
    }
}

/// The configuration of a backend's cluster connections.
pub(crate) fn cluster_config(timeout: Duration) -> ClusterConfig {
    ClusterConfig::new()
        .set_connection_timeout(timeout)
        .set_response_timeout(timeout)
}

/// A node's host and port.
pub(crate) type NodeAddr = (String, u16);

/// The masters of the cluster and their addresses, from `CLUSTER NODES` (flags `master`,
/// neither `fail` nor `handshake`, with slots).
pub(crate) fn masters(nodes: &str) -> Vec<(String, u16)> {
    masters_and_slots(nodes)
        .into_iter()
        .map(|(addr, _)| addr)
        .collect()
}

/// The masters of the cluster, as [`masters`] finds them, each with the slot ranges it serves
/// (first and last slot, both included). Slots in migration (`[slot->-node]`,
/// `[slot-<-node]`) are left out: they stay with the ranges that list them.
pub(crate) fn masters_and_slots(nodes: &str) -> Vec<(NodeAddr, Vec<(u16, u16)>)> {
    let mut found = Vec::new();
    for line in nodes.lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < 9 {
            continue;
        }
        let flags = fields[2];
        if !flags.split(',').any(|f| f == "master")
            || flags
                .split(',')
                .any(|f| f == "fail" || f == "handshake" || f == "noaddr")
        {
            continue;
        }
        // `ip:port@cport[,hostname]`
        let addr = fields[1].split(['@', ',']).next().unwrap_or_default();
        if let Some((host, port)) = addr.rsplit_once(':')
            && let Ok(port) = port.parse::<u16>()
        {
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let ranges = fields[8..]
                .iter()
                .filter_map(|range| {
                    let (first, last) = range.split_once('-').unwrap_or((range, range));
                    Some((first.parse().ok()?, last.parse().ok()?))
                })
                .filter(|&(first, last): &(u16, u16)| first <= last && last < SLOTS)
                .collect();
            found.push(((host.to_owned(), port), ranges));
        }
    }
    found
}

/// How many hash slots a Redis Cluster has.
pub(crate) const SLOTS: u16 = 16_384;

/// The hash slot of `key`: CRC16 (XMODEM) of its hash tag, the part between its first `{` and
/// the first `}` after it when that part is not empty, or else of the whole key.
pub(crate) fn slot(key: &[u8]) -> u16 {
    let tag = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    crc16::State::<crc16::XMODEM>::calculate(tag.unwrap_or(key)) % SLOTS
}

/// How soon a waiter tries again after a cluster refused its acquisition while a slot moves.
pub(crate) const IN_MOTION_RETRY: Duration = Duration::from_millis(20);

/// Whether an error code is a cluster's refusal of a command it did not run because the
/// key's slot is moving or the cluster is reconfiguring (`TRYAGAIN`: a script's keys are split
/// between the two masters of a migration; `MOVED`, `ASK`: redirections the driver could not
/// follow in its retries; `CLUSTERDOWN`: no master for the slot yet; `READONLY`: a master
/// became a replica, see `Conn::forget_on_failure`; `LOADING`: a node still loading).
pub(crate) fn is_in_motion(code: &str) -> bool {
    matches!(
        code,
        "TRYAGAIN" | "MOVED" | "ASK" | "CLUSTERDOWN" | "READONLY" | "LOADING" | "MASTERDOWN"
    )
}

/// Whether `err` is a server's refusal of a command it did not run because the key's master
/// moved or is moving ([`is_in_motion`]).
pub(crate) fn refused_in_motion(err: &LockError) -> bool {
    err.db_code().is_some_and(is_in_motion)
}

/// Whether `err` is the server's answer that the keys of one command are in different slots.
pub(crate) fn is_cross_slot(err: &RedisError) -> bool {
    err.kind() == ErrorKind::Server(redis::ServerErrorKind::CrossSlot)
        || err.code() == Some("CROSSSLOT")
}

/// What a `redis+cluster://` URL says apart from its options.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct ClusterUrl {
    pub(crate) hosts: Hosts,
    /// `rediss+cluster://`: every node is reached over TLS.
    pub(crate) tls: bool,
    /// The query, without `?`.
    pub(crate) query: String,
}

/// How a `redis+cluster://` URL is written.
const URL: HostListUrl = HostListUrl {
    scheme: "redis+cluster",
    tls_scheme: "rediss+cluster",
    leads_to: "Redis Cluster",
    noun: "node",
    default_port: DEFAULT_PORT,
    example: "redis+cluster://[user:password@]host:6379,host:6379[?lease=30s]",
};

/// Takes a `redis+cluster://` URL apart. Errors never repeat the password.
pub(crate) fn split_url(url: &str) -> Result<ClusterUrl, LockError> {
    let split = URL.split(url)?;
    if !split.path.is_empty() && split.path != "0" {
        return Err(URL.error(format_args!(
            "has the path `/{}`: a cluster has only the database 0",
            shown(split.path)
        )));
    }
    Ok(ClusterUrl {
        hosts: URL.hosts(&split)?,
        tls: split.tls,
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
    fn cluster_urls() {
        // The host list without credentials: `hosts::tests::host_lists`.
        let url = split_url("REDIS+CLUSTER://u%40x:hunter%32@h:7000/?lease=2s").unwrap();
        assert_eq!(url.hosts.user.as_deref(), Some("u@x"));
        assert_eq!(url.hosts.password.as_deref(), Some("hunter2"));
        assert_eq!(url.query, "lease=2s");
        assert_eq!(
            split_url("redis+cluster://h/0").unwrap().hosts.nodes.len(),
            1
        );
    }

    #[test]
    fn cluster_url_mistakes_are_config_errors() {
        assert!(config_error("redis://h").contains("starts with redis+cluster://"));
        assert!(config_error("redis+cluster://").contains("lists no node"));
        assert!(config_error("redis+cluster://u:hunter2@").contains("lists no node"));
        assert!(config_error("redis+cluster://a:1,,b:2").contains("one of them is empty"));
        assert!(config_error("redis+cluster://a:1,a:1").contains("twice"));
        assert!(config_error("redis+cluster://a:1/3").contains("only the database 0"));
        for port in ["a:x", "a:0", "a:65536", "a:", "[::1]x"] {
            let text = config_error(&format!("redis+cluster://u:hunter2@{port}"));
            assert!(
                text.contains("port") || text.contains("`]`"),
                "{port}: {text}"
            );
        }
        assert!(config_error("redis+cluster://:1").contains("without a host"));
    }

    #[test]
    fn slots_of_keys() {
        // As a Redis 7 node in cluster mode answers `CLUSTER KEYSLOT`.
        for (key, expected) in [
            (&b"123456789"[..], 12739),
            (b"foo", 12182),
            (b"user1000", 3443),
            (b"foo{user1000}", 3443),
            (b"foo{}{bar}", 8363),
            (b"foo{{bar}}zap", 4015),
            (b"{bar", 4015),
            (b"foo{bar}{zap}", 5061),
            (b"bar", 5061),
            (b"{", 4092),
            (b"", 0),
            (b"dlock:{k}", 7629),
            (b"k", 7629),
        ] {
            assert_eq!(slot(key), expected, "{}", String::from_utf8_lossy(key));
        }
    }

    #[test]
    fn masters_from_cluster_nodes() {
        let nodes = "\
07c37dfeb235213a872192d90877d0cd55635b91 127.0.0.1:30004@31004 slave e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 0 1426238317239 4 connected
67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1 127.0.0.1:30002@31002 master - 0 1426238316232 2 connected 5461-10922
292f8b365bb7edb5e285caf0b7e6ddc7265d2f4f 127.0.0.1:30003@31003 master - 0 1426238318243 3 connected 10923-16383
e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 127.0.0.1:30001@31001,host myself,master - 0 0 1 connected 0-5460
aaaa 127.0.0.1:30005@31005 master,fail - 0 0 5 disconnected 1-2
";
        assert_eq!(
            masters(nodes),
            [
                ("127.0.0.1".to_owned(), 30002),
                ("127.0.0.1".to_owned(), 30003),
                ("127.0.0.1".to_owned(), 30001)
            ]
        );
        let migrating = "\
a 127.0.0.1:7000@17000 myself,master - 0 0 1 connected 0-5460 [5461->-b] 16383
b 127.0.0.1:7001@17001 master - 0 0 2 connected 5461-10922 [5461-<-a] 9-x 20000
";
        assert_eq!(
            masters_and_slots(migrating),
            [
                (
                    ("127.0.0.1".to_owned(), 7000),
                    vec![(0, 5460), (16383, 16383)]
                ),
                (("127.0.0.1".to_owned(), 7001), vec![(5461, 10922)])
            ]
        );
    }
}
