//! Throwaway etcd servers and clusters on free loopback ports, in temp dirs.
//!
//! The binary is `etcd` on PATH (Debian's `etcd-server`, installed by `.ci/run`), or the one
//! `DLOCK_ETCD_SERVER` names. Without it a test prints that it is skipped, unless `CI` is set:
//! then it fails. Members run with a 50 ms heartbeat and a 500 ms election timeout, so a lost
//! leader is replaced within about a second.
//!
//! [`EtcdCluster::start`] starts any number of members (one for a single server); each can be
//! killed ([`kill`](EtcdCluster::kill), `SIGKILL`), paused ([`pause`](EtcdCluster::pause),
//! `SIGSTOP`) and started again on its data ([`restart`](EtcdCluster::restart)). The tests'
//! own questions go to etcd's HTTP gateway (`/health`, `/v3/maintenance/status`), with no
//! client of their own.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const ENV: &str = "DLOCK_ETCD_SERVER";

/// The `etcd` binary, if installed.
pub fn binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(ENV) {
        return Some(PathBuf::from(path));
    }
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
    child: Option<Child>,
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
    /// `None` (after saying so) when the binary is missing and `CI` is not set.
    pub fn start(size: usize) -> Option<EtcdCluster> {
        let Some(binary) = binary() else {
            if std::env::var_os("CI").is_some() {
                panic!("no etcd binary (set {ENV} or run .ci/run to install it)");
            }
            eprintln!("skipped: no etcd binary (set {ENV} or run .ci/run)");
            return None;
        };
        for _ in 0..3 {
            let mut cluster = EtcdCluster {
                binary: binary.clone(),
                dir: tempfile::tempdir().expect("temp dir"),
                token: format!("dlock-{}-{}", std::process::id(), fastrand::u64(..)),
                members: (0..size)
                    .map(|i| Member {
                        name: format!("m{i}"),
                        client_port: free_port(),
                        peer_port: free_port(),
                        child: None,
                    })
                    .collect(),
            };
            for i in 0..size {
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
            .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
            .collect();
        let member = &self.members[i];
        let data = self.dir.path().join(&member.name);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(format!("{}.log", member.name)))
            .expect("log file");
        let client = format!("http://127.0.0.1:{}", member.client_port);
        let peer = format!("http://127.0.0.1:{}", member.peer_port);
        let child = Command::new(&self.binary)
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
            .args(["--heartbeat-interval", "50", "--election-timeout", "500"])
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
                    let health = http(member.client_port, "GET", "/health", "");
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
            .map(|m| format!("127.0.0.1:{}", m.client_port))
            .collect();
        let query = if options.is_empty() {
            String::new()
        } else {
            format!("?{options}")
        };
        format!("etcd://{}{query}", hosts.join(","))
    }

    /// The client endpoints (`http://127.0.0.1:port`) of every member.
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .map(|m| format!("http://127.0.0.1:{}", m.client_port))
            .collect()
    }

    /// The member that leads now, by index, as a running member sees it.
    pub fn leader(&self) -> Option<usize> {
        for member in self.members.iter().filter(|m| m.child.is_some()) {
            let Some(status) = http(member.client_port, "POST", "/v3/maintenance/status", "{}")
            else {
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
                let id = http(other.client_port, "POST", "/v3/maintenance/status", "{}")
                    .and_then(|s| json_field(&s, "member_id"));
                if id.as_deref() == Some(leader.as_str()) {
                    return Some(i);
                }
            }
        }
        None
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
        self.signal(i, "STOP");
    }

    /// Lets a paused member `i` run again (`SIGCONT`).
    pub fn resume(&self, i: usize) {
        self.signal(i, "CONT");
    }

    fn signal(&self, i: usize, signal: &str) {
        if let Some(child) = &self.members[i].child {
            let status = Command::new("kill")
                .arg(format!("-{signal}"))
                .arg(child.id().to_string())
                .status()
                .expect("kill");
            assert!(status.success(), "kill -{signal}");
        }
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
    fn drop(&mut self) {
        for i in 0..self.members.len() {
            self.resume(i);
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
fn http(port: u16, method: &str, path: &str, body: &str) -> Option<String> {
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
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
