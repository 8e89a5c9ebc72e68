//! A throwaway Redis Cluster on loopback: masters and replicas started with
//! `redis-server --cluster-enabled yes`, joined by `redis-cli --cluster create`.

use std::collections::HashMap;
use std::process::{ChildStdin, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::{Flavor, RedisServer, free_port, on_path, sync_command};
use crate::Placement;

/// How long the fixture waits for the cluster to settle after a change.
const SETTLE: Duration = Duration::from_secs(30);

/// A Redis Cluster on loopback (Redis 7): `masters` masters, each with `replicas` replicas,
/// every node with its own data directory, a free client port and a free cluster bus port.
/// Every process is killed when it is dropped.
#[derive(Debug)]
pub struct RedisCluster {
    /// The nodes, in the order they were started (which are masters now,
    /// [`masters`](RedisCluster::masters) says).
    pub nodes: Vec<RedisServer>,
    /// With TLS ([`start_tls`](RedisCluster::start_tls)): the CA file clients trust.
    tls_ca: Option<std::path::PathBuf>,
}

impl RedisCluster {
    /// Three masters with one replica each, `cluster-node-timeout` 1 s. Never `None`: when
    /// `redis-server` or `redis-cli` is missing the test fails ([`crate::not_run`]), whether
    /// `CI` is set or not (the `Option` is kept for the callers written when it was skipped).
    pub fn start() -> Option<RedisCluster> {
        RedisCluster::start_with(3, 1, Duration::from_secs(1))
    }

    /// `masters` masters (at least 3) with `replicas` replicas each; a node is considered
    /// failing after `node_timeout` of silence. Returns once every node reports
    /// `cluster_state:ok` and knows every other, and every replica's link is up.
    pub fn start_with(
        masters: usize,
        replicas: usize,
        node_timeout: Duration,
    ) -> Option<RedisCluster> {
        RedisCluster::start_on(Flavor::Redis7, masters, replicas, node_timeout, None)
    }

    /// [`start_with`](RedisCluster::start_with) on servers of `flavor` (joined by Redis 7's
    /// `redis-cli`). Never `None`: the test fails when that server is not installed.
    pub fn start_flavor(
        flavor: Flavor,
        masters: usize,
        replicas: usize,
        node_timeout: Duration,
    ) -> Option<RedisCluster> {
        RedisCluster::start_on(flavor, masters, replicas, node_timeout, None)
    }

    /// [`start_with`](RedisCluster::start_with) where every node also has a TLS port
    /// presenting `tls`'s certificate, and the cluster bus and replication go over TLS
    /// (`tls-cluster yes`, `tls-replication yes`): the nodes then name each other's TLS ports
    /// to clients that reach them over TLS, and their plain ports to the others (the
    /// fixture's own commands). [`url`](RedisCluster::url) gives a `rediss+cluster://` URL
    /// that trusts `tls`'s CA.
    pub fn start_tls(
        masters: usize,
        replicas: usize,
        node_timeout: Duration,
        tls: &crate::ServerTls,
    ) -> Option<RedisCluster> {
        RedisCluster::start_on(Flavor::Redis7, masters, replicas, node_timeout, Some(tls))
    }

    fn start_on(
        flavor: Flavor,
        masters: usize,
        replicas: usize,
        node_timeout: Duration,
        tls: Option<&crate::ServerTls>,
    ) -> Option<RedisCluster> {
        let Some(cli) = on_path("redis-cli") else {
            crate::not_run("no redis-cli on PATH here", crate::INSTALL_HINT)
        };
        let timeout_ms = node_timeout.as_millis().max(100).to_string();
        let mut nodes = Vec::new();
        for _ in 0..masters * (1 + replicas) {
            let bus = free_port().to_string();
            let mut node = RedisServer::start_args(
                flavor,
                Placement::default(),
                &[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    &timeout_ms,
                    "--cluster-port",
                    &bus,
                ],
            )?;
            if let Some(tls) = tls {
                node.set_tls(Some(tls), false);
                node.extra.extend(
                    ["--tls-cluster", "yes", "--tls-replication", "yes"].map(str::to_owned),
                );
                node.restart();
            }
            nodes.push(node);
        }
        let mut create = Command::new(cli);
        create.arg("--cluster").arg("create");
        for node in &nodes {
            create.arg(format!("127.0.0.1:{}", node.port()));
        }
        let out = create
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("run redis-cli --cluster create");
        assert!(
            out.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let cluster = RedisCluster {
            nodes,
            tls_ca: tls.map(|tls| tls.ca.clone()),
        };
        cluster.wait_settled(&[]);
        Some(cluster)
    }

    /// Three masters without replicas, started once and shared by the tests of this binary
    /// that call it (each on keys of its own, for cases that neither stop nor reconfigure a
    /// node): a cluster takes two seconds or more to settle, a case of the conformance suite
    /// less. `None` as [`start`](RedisCluster::start) says. A static is never dropped, so a
    /// reaper process kills the nodes and removes their directories when the test binary
    /// exits. Call it off the runtime's worker threads (`block_in_place`): it blocks.
    pub fn shared() -> Option<&'static RedisCluster> {
        static SHARED: OnceLock<Option<(RedisCluster, ChildStdin)>> = OnceLock::new();
        SHARED
            .get_or_init(|| {
                let cluster = RedisCluster::start_with(3, 0, Duration::from_secs(1))?;
                let reaper = cluster.reaper();
                Some((cluster, reaper))
            })
            .as_ref()
            .map(|(cluster, _)| cluster)
    }

    /// [`shared`](RedisCluster::shared) with TLS ([`start_tls`](RedisCluster::start_tls),
    /// the good certificate of [`Pki::shared`](crate::tls::Pki::shared)): three masters
    /// without replicas, shared by the tests of this binary that call it.
    pub fn shared_tls() -> Option<&'static RedisCluster> {
        static SHARED: OnceLock<Option<(RedisCluster, ChildStdin)>> = OnceLock::new();
        SHARED
            .get_or_init(|| {
                let tls = crate::tls::Pki::shared().server(crate::tls::ServerCert::Good);
                let cluster = RedisCluster::start_tls(3, 0, Duration::from_secs(1), &tls)?;
                let reaper = cluster.reaper();
                Some((cluster, reaper))
            })
            .as_ref()
            .map(|(cluster, _)| cluster)
    }

    /// A [reaper](crate::reaper) that kills every node and removes its directory.
    fn reaper(&self) -> ChildStdin {
        let mut script = String::from("cat >/dev/null;");
        for node in &self.nodes {
            if let Some(pid) = node.pid() {
                script.push_str(&format!(" kill -KILL {pid} 2>/dev/null;"));
            }
        }
        script.push_str(" sleep 0.2;");
        for node in &self.nodes {
            script.push_str(&format!(" rm -rf '{}';", node.dir().display()));
        }
        crate::reaper(&script)
    }

    /// `redis+cluster://127.0.0.1:p1,127.0.0.1:p2,...` (every node), with `options`; on a
    /// cluster with TLS, `rediss+cluster://` with the nodes' TLS ports and `ca=` the CA file.
    pub fn url(&self, options: &str) -> String {
        let hosts: Vec<String> = self
            .nodes
            .iter()
            .map(|n| {
                let port = if self.tls_ca.is_some() {
                    n.tls_port()
                } else {
                    n.port()
                };
                format!("127.0.0.1:{port}")
            })
            .collect();
        super::deployment_url("redis+cluster", &hosts, "", self.tls_ca.as_deref(), options)
    }

    /// The ports of every node.
    pub fn ports(&self) -> Vec<u16> {
        self.nodes.iter().map(RedisServer::port).collect()
    }

    /// The node on `port`.
    pub fn node(&self, port: u16) -> &RedisServer {
        self.nodes
            .iter()
            .find(|n| n.port() == port)
            .expect("a node of the cluster")
    }

    /// One command to the node on `port` (arguments as bytes), its answer as a value.
    pub fn command(&self, port: u16, args: &[&[u8]]) -> redis::RedisResult<redis::Value> {
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
        let mut conn = client.get_connection_with_timeout(Duration::from_secs(5))?;
        conn.set_read_timeout(Some(Duration::from_secs(10)))?;
        let mut cmd = redis::cmd(std::str::from_utf8(args[0]).expect("a command name"));
        for arg in &args[1..] {
            cmd.arg(*arg);
        }
        cmd.query(&mut conn)
    }

    /// `CLUSTER NODES` as the node on `port` sees it: `(id, port, flags, master id, slots)` per
    /// node.
    fn view(port: u16) -> Option<Vec<NodeLine>> {
        let text: String = sync_command(port, &["CLUSTER", "NODES"]).ok()?;
        Some(text.lines().filter_map(NodeLine::parse).collect())
    }

    fn live_view(&self) -> Vec<NodeLine> {
        for port in self.ports() {
            if self.node(port).is_running()
                && let Some(view) = RedisCluster::view(port)
            {
                return view;
            }
        }
        panic!("no node of the cluster answers");
    }

    /// The ports of the masters that serve slots, as the first live node sees them.
    pub fn masters(&self) -> Vec<u16> {
        self.live_view()
            .into_iter()
            .filter(|n| n.master() && !n.failed() && !n.slots.is_empty())
            .map(|n| n.port)
            .collect()
    }

    /// The ports of the replicas of the master on `master`.
    pub fn replicas_of(&self, master: u16) -> Vec<u16> {
        let view = self.live_view();
        let Some(id) = view.iter().find(|n| n.port == master).map(|n| n.id.clone()) else {
            return Vec::new();
        };
        view.into_iter()
            .filter(|n| n.master_id == id && !n.failed())
            .map(|n| n.port)
            .collect()
    }

    /// The node id of the node on `port`.
    pub fn node_id(&self, port: u16) -> String {
        sync_command(port, &["CLUSTER", "MYID"]).expect("CLUSTER MYID")
    }

    /// The slot of `key` (`CLUSTER KEYSLOT`).
    pub fn slot_of(&self, key: &[u8]) -> u16 {
        let port = self.masters()[0];
        match self.command(port, &[b"CLUSTER", b"KEYSLOT", key]) {
            Ok(redis::Value::Int(slot)) => u16::try_from(slot).expect("a slot"),
            other => panic!("CLUSTER KEYSLOT answered {other:?}"),
        }
    }

    /// The port of the master that serves `slot`, as the first live node sees it.
    pub fn owner_of(&self, slot: u16) -> u16 {
        self.live_view()
            .into_iter()
            .find(|n| n.master() && n.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot)))
            .map(|n| n.port)
            .expect("a master serves the slot")
    }

    /// Starts moving `slot` from the master on `from` to the master on `to`: `to` imports it,
    /// `from` migrates it (`CLUSTER SETSLOT ... IMPORTING / MIGRATING`). From now on `from`
    /// answers `ASK` for the slot's keys it no longer has, and new keys go to `to`.
    pub fn begin_migration(&self, slot: u16, from: u16, to: u16) {
        let slot = slot.to_string();
        let (from_id, to_id) = (self.node_id(from), self.node_id(to));
        let _: String = sync_command(to, &["CLUSTER", "SETSLOT", &slot, "IMPORTING", &from_id])
            .expect("SETSLOT IMPORTING");
        let _: String = sync_command(from, &["CLUSTER", "SETSLOT", &slot, "MIGRATING", &to_id])
            .expect("SETSLOT MIGRATING");
    }

    /// Moves up to `batch` keys of `slot` from `from` to `to` (`CLUSTER GETKEYSINSLOT`, then
    /// one `MIGRATE ... KEYS`); returns how many it moved.
    pub fn migrate_keys(&self, slot: u16, from: u16, to: u16, batch: usize) -> usize {
        let keys = match self.command(
            from,
            &[
                b"CLUSTER",
                b"GETKEYSINSLOT",
                slot.to_string().as_bytes(),
                batch.to_string().as_bytes(),
            ],
        ) {
            Ok(redis::Value::Array(keys)) => keys,
            other => panic!("CLUSTER GETKEYSINSLOT answered {other:?}"),
        };
        let keys: Vec<Vec<u8>> = keys
            .into_iter()
            .filter_map(|k| match k {
                redis::Value::BulkString(k) => Some(k),
                _ => None,
            })
            .collect();
        if keys.is_empty() {
            return 0;
        }
        let port = to.to_string();
        let mut args: Vec<&[u8]> = vec![
            b"MIGRATE",
            b"127.0.0.1",
            port.as_bytes(),
            b"",
            b"0",
            b"5000",
            b"KEYS",
        ];
        args.extend(keys.iter().map(Vec::as_slice));
        match self.command(from, &args) {
            Ok(_) => keys.len(),
            // A key that expired or was deleted meanwhile: NOKEY is fine, the rest moved.
            Err(err) if err.code() == Some("NOKEY") => keys.len(),
            Err(err) => panic!("MIGRATE failed: {err}"),
        }
    }

    /// Ends moving `slot` to `to`: every key still on `from` is moved, then every master is
    /// told that `to` serves it (`CLUSTER SETSLOT ... NODE`), `to` and `from` first. Waits
    /// until every node agrees.
    pub fn finish_migration(&self, slot: u16, from: u16, to: u16) {
        while self.migrate_keys(slot, from, to, 100) > 0 {}
        let to_id = self.node_id(to);
        let slot_text = slot.to_string();
        let mut order = vec![to, from];
        order.extend(
            self.masters()
                .into_iter()
                .filter(|p| *p != to && *p != from),
        );
        for port in order {
            let _: String = sync_command(port, &["CLUSTER", "SETSLOT", &slot_text, "NODE", &to_id])
                .expect("SETSLOT NODE");
        }
        let deadline = Instant::now() + SETTLE;
        loop {
            let agreed = self.ports().into_iter().all(|p| {
                !self.node(p).is_running()
                    || RedisCluster::view(p).is_some_and(|view| {
                        view.iter().any(|n| {
                            n.port == to && n.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot))
                        })
                    })
            });
            if agreed {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the nodes did not agree on slot {slot}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Moves `slot` from `from` to `to` at once (begin, every key, finish).
    pub fn migrate_slot(&self, slot: u16, from: u16, to: u16) {
        self.begin_migration(slot, from, to);
        self.finish_migration(slot, from, to);
    }

    /// A manual failover of the master on `master` (`CLUSTER FAILOVER` on its first replica,
    /// which waits until the replica has every write of the master, so nothing is lost; with
    /// `takeover`, `CLUSTER FAILOVER TAKEOVER`: promoted at once, without the master's
    /// agreement or its last writes). Returns the new master's port once every live node
    /// sees it serving the slots and reports `cluster_state:ok`.
    pub fn failover(&self, master: u16, takeover: bool) -> u16 {
        let replica = *self
            .replicas_of(master)
            .first()
            .expect("the master has a replica");
        let mut args = vec!["CLUSTER", "FAILOVER"];
        if takeover {
            args.push("TAKEOVER");
        }
        let _: String = sync_command(replica, &args).expect("CLUSTER FAILOVER");
        self.await_promotion(master, replica);
        replica
    }

    /// Kills the master on `master` (SIGKILL) and waits until one of its replicas has been
    /// promoted (after `cluster-node-timeout` and an election) and the cluster is ok again.
    /// Returns the new master's port.
    pub fn kill_master(&mut self, master: u16) -> u16 {
        let replicas = self.replicas_of(master);
        assert!(!replicas.is_empty(), "the master has no replica");
        self.stop_node(master);
        let deadline = Instant::now() + SETTLE;
        loop {
            if let Some(new) = replicas
                .iter()
                .copied()
                .find(|p| self.role(*p).as_deref() == Some("master"))
            {
                self.await_promotion(master, new);
                return new;
            }
            assert!(
                Instant::now() < deadline,
                "no replica of {master} was promoted"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Kills the node on `port` (SIGKILL), without waiting for anything.
    pub fn stop_node(&mut self, port: u16) {
        self.nodes
            .iter_mut()
            .find(|n| n.port() == port)
            .expect("a node of the cluster")
            .stop();
    }

    /// Starts the node on `port` again (same ports and `nodes.conf`, so the same node id;
    /// its data is gone) and waits until the cluster has settled with it: a master that was
    /// replaced meanwhile comes back as a replica of its replacement.
    pub fn restart_node(&mut self, port: u16) {
        self.nodes
            .iter_mut()
            .find(|n| n.port() == port)
            .expect("a node of the cluster")
            .restart();
        self.wait_settled(&[]);
    }

    /// The role (`master`, `slave`) the node on `port` reports; `None` when it does not
    /// answer.
    pub fn role(&self, port: u16) -> Option<String> {
        let role: Vec<redis::Value> = sync_command(port, &["ROLE"]).ok()?;
        match role.first()? {
            redis::Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
            redis::Value::SimpleString(s) => Some(s.clone()),
            _ => None,
        }
    }

    /// Waits until `new` reports `ROLE` master and every live node sees it as a master with
    /// slots, `old` not serving any, and the cluster settled.
    fn await_promotion(&self, old: u16, new: u16) {
        let deadline = Instant::now() + SETTLE;
        loop {
            let promoted = self.role(new).as_deref() == Some("master")
                && self.ports().into_iter().all(|p| {
                    !self.node(p).is_running()
                        || RedisCluster::view(p).is_some_and(|view| {
                            view.iter()
                                .any(|n| n.port == new && n.master() && !n.slots.is_empty())
                                && !view.iter().any(|n| {
                                    n.port == old
                                        && n.master()
                                        && !n.slots.is_empty()
                                        && !n.failed()
                                })
                        })
                });
            if promoted {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the nodes did not agree that {new} replaced {old}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        self.wait_settled(&[old]);
    }

    /// Waits until every running node (but those in `skip`) reports `cluster_state:ok` and
    /// sees every running node, and every running replica's link to its master is up.
    pub fn wait_settled(&self, skip: &[u16]) {
        let deadline = Instant::now() + SETTLE;
        let running: Vec<u16> = self
            .ports()
            .into_iter()
            .filter(|p| self.node(*p).is_running() && !skip.contains(p))
            .collect();
        loop {
            let ok = running.iter().all(|p| {
                let info: Option<String> = sync_command(*p, &["CLUSTER", "INFO"]).ok();
                info.is_some_and(|text| {
                    let fields: HashMap<&str, &str> = text
                        .lines()
                        .filter_map(|l| l.trim().split_once(':'))
                        .collect();
                    fields.get("cluster_state") == Some(&"ok")
                        && fields
                            .get("cluster_known_nodes")
                            .and_then(|n| n.parse::<usize>().ok())
                            == Some(self.nodes.len())
                }) && RedisCluster::view(*p).is_some_and(|view| {
                    running
                        .iter()
                        .all(|q| view.iter().any(|n| n.port == *q && !n.failed()))
                }) && (self.role(*p).as_deref() != Some("slave")
                    || self
                        .node(*p)
                        .info("replication")
                        .get("master_link_status")
                        .map(String::as_str)
                        == Some("up"))
            });
            if ok {
                return;
            }
            assert!(Instant::now() < deadline, "the cluster did not settle");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// One line of `CLUSTER NODES`.
#[derive(Debug, Clone)]
struct NodeLine {
    id: String,
    port: u16,
    flags: Vec<String>,
    master_id: String,
    slots: Vec<(u16, u16)>,
}

impl NodeLine {
    fn parse(line: &str) -> Option<NodeLine> {
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < 8 {
            return None;
        }
        let addr = fields[1].split(['@', ',']).next()?;
        let port = addr.rsplit_once(':')?.1.parse().ok()?;
        let slots = fields[8..]
            .iter()
            .filter(|s| !s.starts_with('['))
            .filter_map(|s| match s.split_once('-') {
                Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                None => {
                    let one = s.parse().ok()?;
                    Some((one, one))
                }
            })
            .collect();
        Some(NodeLine {
            id: fields[0].to_owned(),
            port,
            flags: fields[2].split(',').map(str::to_owned).collect(),
            master_id: fields[3].to_owned(),
            slots,
        })
    }

    fn master(&self) -> bool {
        self.flags.iter().any(|f| f == "master")
    }

    fn failed(&self) -> bool {
        self.flags.iter().any(|f| f == "fail" || f == "fail?")
    }
}
