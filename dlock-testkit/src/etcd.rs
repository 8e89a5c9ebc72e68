//! Throwaway etcd servers and clusters on free loopback ports, in temp dirs.
//!
//! The binary is `etcd` on PATH (Debian's `etcd-server`, installed by `.ci/run`), or the one
//! `DLOCK_ETCD_SERVER` names. Without it a test fails, saying it was not run and how to
//! install the servers ([`crate::server_binary`]), whether `CI` is set or not. Members run with a 50 ms heartbeat and a 500 ms election timeout, so a lost
//! leader is replaced within about a second, and with `--pre-vote`, so a member coming back
//! from a partition does not force an election.
//!
//! [`EtcdCluster::start`] starts any number of members (one for a single server); each can be
//! killed ([`kill`](EtcdCluster::kill), `SIGKILL`), paused ([`pause`](EtcdCluster::pause),
//! `SIGSTOP`) and started again on its data ([`restart`](EtcdCluster::restart)). The tests'
//! own questions go to etcd's HTTP gateway (`/health`, `/v3/maintenance/status`), with no
//! client of their own.
//!
//! [`EtcdCluster::start_split`] starts three members with the third in a network namespace
//! ([`Netns`]): its peer traffic runs over the namespace's cut link and its clients come over
//! the side link, so [`Netns::cut`] cuts that member off from the other two while clients can
//! still reach it (a minority partition).

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

use crate::Placement;
use crate::netns::Netns;

const ENV: &str = "DLOCK_ETCD_SERVER";

/// The `etcd` binary, if installed: the file `DLOCK_ETCD_SERVER` names (none when it names no
/// file), or else `etcd` on PATH.
pub fn binary() -> Option<PathBuf> {
    match std::env::var_os(ENV) {
        Some(path) => Some(PathBuf::from(path)).filter(|p| p.is_file()),
        None => installed(),
    }
}

fn installed() -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("etcd"))
            .find(|p| p.is_file())
    })
}

#[derive(Debug)]
struct Member {
    name: String,
    client_port: u16,
    peer_port: u16,
    /// Where the member listens for clients and for its peers, and how it is started.
    client_host: IpAddr,
    peer_host: IpAddr,
    placement: Placement,
    child: Option<Child>,
}

impl Member {
    fn on_loopback(i: usize) -> Member {
        let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
        Member {
            name: format!("m{i}"),
            client_port: free_port(),
            peer_port: free_port(),
            client_host: loopback,
            peer_host: loopback,
            placement: Placement::default(),
            child: None,
        }
    }

    fn client_url(&self) -> String {
        format!(
            "http://{}:{}",
            Placement::url_host(self.client_host),
            self.client_port
        )
    }

    fn peer_url(&self) -> String {
        format!(
            "http://{}:{}",
            Placement::url_host(self.peer_host),
            self.peer_port
        )
    }
}

/// A running throwaway cluster of one or more members.
#[derive(Debug)]
pub struct EtcdCluster {
    binary: PathBuf,
    dir: tempfile::TempDir,
    token: String,
    members: Vec<Member>,
}

impl EtcdCluster {
    /// Starts a cluster of `size` members on loopback and waits until it has a leader;
    /// never `None`: without the binary the test fails ([`crate::server_binary`]; the `Option`
    /// is kept for the callers written when a missing binary was skipped).
    pub fn start(size: usize) -> Option<EtcdCluster> {
        let binary = EtcdCluster::find_binary()?;
        EtcdCluster::start_members(binary, || (0..size).map(Member::on_loopback).collect())
    }

    /// Starts three members, the third inside `netns`: members 0 and 1 listen for peers on the
    /// cut link's client end, member 2 on its server end, so [`Netns::cut`] separates member 2
    /// from the others; member 2 listens for clients on the side link, which stays up.
    /// `None` where the binary is missing (as [`start`](EtcdCluster::start)).
    pub fn start_split(netns: &Netns) -> Option<EtcdCluster> {
        let binary = EtcdCluster::find_binary()?;
        let (cut, side) = (netns.cut_link(), netns.side_link());
        EtcdCluster::start_members(binary, || {
            let mut members: Vec<Member> = (0..3).map(Member::on_loopback).collect();
            members[0].peer_host = IpAddr::V4(cut.client);
            members[1].peer_host = IpAddr::V4(cut.client);
            members[2].peer_host = IpAddr::V4(cut.server);
            members[2].client_host = IpAddr::V4(side.server);
            members[2].placement = netns.placement();
            members
        })
    }

    fn find_binary() -> Option<PathBuf> {
        Some(crate::server_binary("etcd server", ENV, installed))
    }

    fn start_members(binary: PathBuf, members: impl Fn() -> Vec<Member>) -> Option<EtcdCluster> {
        for _ in 0..3 {
            let mut cluster = EtcdCluster {
                binary: binary.clone(),
                dir: tempfile::tempdir().expect("temp dir"),
                token: format!("dlock-{}-{}", std::process::id(), fastrand::u64(..)),
                members: members(),
            };
            for i in 0..cluster.members.len() {
                cluster.spawn(i);
            }
            if cluster.wait_healthy(Duration::from_secs(20)) {
                return Some(cluster);
            }
        }
        panic!("could not start an etcd cluster from {}", binary.display());
    }

    /// A single server.
    pub fn single() -> Option<EtcdCluster> {
        EtcdCluster::start(1)
    }

    fn spawn(&mut self, i: usize) {
        let initial: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}={}", m.name, m.peer_url()))
            .collect();
        let member = &self.members[i];
        let data = self.dir.path().join(&member.name);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("{}.log", member.name)))
            .expect("log file");
        let (client, peer) = (member.client_url(), member.peer_url());
        let child = member
            .placement
            .command(&self.binary)
            .arg("--name")
            .arg(&member.name)
            .arg("--data-dir")
            .arg(&data)
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &initial.join(",")])
            .args(["--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", &self.token])
            .args([
                "--heartbeat-interval",
                "50",
                "--election-timeout",
                "500",
                "--pre-vote",
            ])
            .args(["--logger", "zap", "--log-level", "warn"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn etcd");
        self.members[i].child = Some(child);
    }

    /// Waits until every running member answers `/health` with a leader.
    fn wait_healthy(&mut self, limit: Duration) -> bool {
        let started = Instant::now();
        while started.elapsed() < limit {
            let mut all = true;
            for member in &mut self.members {
                if let Some(child) = member.child.as_mut() {
                    if let Ok(Some(_)) = child.try_wait() {
                        // It exited (a port taken meanwhile, say): start over.
                        return false;
                    }
                    let health = http(member, "GET", "/health", "");
                    all &= health.is_some_and(|body| body.contains("\"health\":\"true\""));
                }
            }
            if all {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// How many members the cluster has.
    pub fn size(&self) -> usize {
        self.members.len()
    }

    /// An `etcd://` URL naming every member, with `options` (`lease=2s&prefix=x/`) appended.
    pub fn url(&self, options: &str) -> String {
        let hosts: Vec<String> = self
            .members
            .iter()
            .map(|m| format!("{}:{}", Placement::url_host(m.client_host), m.client_port))
            .collect();
        let query = if options.is_empty() {
            String::new()
        } else {
            format!("?{options}")
        };
        format!("etcd://{}{query}", hosts.join(","))
    }

    /// The client endpoints (`http://host:port`) of every member.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(Member::client_url).collect()
    }

    /// The member that leads now, by index, as a running member sees it.
    pub fn leader(&self) -> Option<usize> {
        for member in self.members.iter().filter(|m| m.child.is_some()) {
            let Some(status) = http(member, "POST", "/v3/maintenance/status", "{}") else {
                continue;
            };
            let (Some(leader), Some(me)) = (
                json_field(&status, "leader"),
                json_field(&status, "member_id"),
            ) else {
                continue;
            };
            if leader == "0" {
                continue;
            }
            if leader == me {
                return self.members.iter().position(|m| std::ptr::eq(m, member));
            }
            // Ask the others who they are.
            for (i, other) in self.members.iter().enumerate() {
                if other.child.is_none() {
                    continue;
                }
                let id = http(other, "POST", "/v3/maintenance/status", "{}")
                    .and_then(|s| json_field(&s, "member_id"));
                if id.as_deref() == Some(leader.as_str()) {
                    return Some(i);
                }
            }
        }
        None
    }

    /// Moves the leadership to member `i` (etcd's `MoveLeader`, asked of the current leader),
    /// and waits until every running member agrees; false when that did not happen within
    /// `limit`.
    pub fn make_leader(&self, i: usize, limit: Duration) -> bool {
        let started = Instant::now();
        let Some(target) = http(&self.members[i], "POST", "/v3/maintenance/status", "{}")
            .and_then(|s| json_field(&s, "member_id"))
        else {
            return false;
        };
        while started.elapsed() < limit {
            match self.leader() {
                Some(leader) if leader == i => return true,
                Some(leader) => {
                    let body = format!("{{\"targetID\":\"{target}\"}}");
                    let _ = http(
                        &self.members[leader],
                        "POST",
                        "/v3/maintenance/transfer-leadership",
                        &body,
                    );
                }
                None => {}
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }

    /// Kills member `i` (`SIGKILL`), keeping its data for [`restart`](EtcdCluster::restart).
    pub fn kill(&mut self, i: usize) {
        if let Some(mut child) = self.members[i].child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops member `i` (`SIGSTOP`): it holds its connections open and answers nothing.
    pub fn pause(&self, i: usize) {
        assert!(self.signal(i, "STOP"), "kill -STOP etcd member {i}");
    }

    /// Lets a paused member `i` run again (`SIGCONT`).
    pub fn resume(&self, i: usize) {
        assert!(self.signal(i, "CONT"), "kill -CONT etcd member {i}");
    }

    /// Sends `signal` to member `i`'s process; whether it was delivered (a member that is not
    /// running counts as delivered, one whose process has exited as not).
    fn signal(&self, i: usize, signal: &str) -> bool {
        self.members[i]
            .child
            .as_ref()
            .is_none_or(|child| crate::signal(child, signal))
    }

    /// Starts a killed member `i` again on its data, and waits until the cluster is healthy.
    pub fn restart(&mut self, i: usize) {
        self.kill(i);
        self.spawn(i);
        assert!(
            self.wait_healthy(Duration::from_secs(20)),
            "etcd member {i} did not come back"
        );
    }

    /// The log of member `i` (warnings and errors), for a failing test's message.
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(
            self.dir
                .path()
                .join(format!("{}.log", self.members[i].name)),
        )
        .unwrap_or_default()
    }
}

impl Drop for EtcdCluster {
    /// Kills every member. Never panics: a cluster that did not come up is dropped to try
    /// again, and a member of it may have exited already (no process to signal).
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            let _ = self.signal(i, "CONT");
            self.kill(i);
        }
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// One HTTP/1.0 request to a member's client port: the body of a 200 answer.
fn http(member: &Member, method: &str, path: &str, body: &str) -> Option<String> {
    let address = std::net::SocketAddr::new(member.client_host, member.client_port);
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_millis(500)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    let request = format!(
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    let (head, body) = answer.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.0 200")
        .then(|| body.to_owned())
        .or_else(|| head.starts_with("HTTP/1.1 200").then(|| body.to_owned()))
}

/// The string (or number) value of the first `"name":` in a JSON text.
fn json_field(json: &str, name: &str) -> Option<String> {
    let at = json.find(&format!("\"{name}\":"))? + name.len() + 3;
    let rest = json[at..].trim_start();
    let value: String = rest
        .trim_start_matches('"')
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric())
        .collect();
    (!value.is_empty()).then_some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A cluster whose member has exited and been reaped (as `wait_healthy` reaps one that
    /// exits while the cluster starts, a port taken meanwhile, say) is dropped without
    /// panicking: dropping it is how a failed start is tried again.
    #[test]
    fn a_cluster_with_an_exited_member_drops_quietly() {
        let Some(mut cluster) = EtcdCluster::single() else {
            return;
        };
        let child = cluster.members[0].child.as_mut().expect("a running member");
        child.kill().expect("kill the member");
        child.wait().expect("reap the member");
        drop(cluster);
    }
}
