//! Network namespaces for partition tests (Linux, root, `ip` and `nft`).
//!
//! A [`Netns`] is a fresh network namespace named `dlock-{pid}-{block}` with `lo` up and two veth
//! links to this process's namespace, each a private /30 out of `10.213.0.0/16`:
//!
//! | link | server end (in the namespace) | client end (here) |
//! |---|---|---|
//! | [`cut_link`](Netns::cut_link) | `10.213.x.(8b+1)` | `10.213.x.(8b+2)` |
//! | [`side_link`](Netns::side_link) | `10.213.x.(8b+5)` | `10.213.x.(8b+6)` |
//!
//! The /29 block `b` is claimed with an advisory file lock in `/run/dlock-netns`, held until
//! the `Netns` is dropped (or its process dies), so concurrent tests and test binaries never
//! share addresses or interface names. Servers run inside the namespace behind the prefix of
//! [`placement`](Netns::placement). [`cut`](Netns::cut) installs an nftables table in the
//! namespace that drops every packet from and to the cut link's client address: established
//! TCP connections over that link stall silently (no RST, no FIN), like a real partition, while
//! the side link keeps working. [`heal`](Netns::heal) removes the table.
//!
//! Dropping a `Netns` kills what still runs inside it and deletes it (which removes its veth
//! pairs). Namespaces and veth ends left behind by test processes that died are removed by the
//! next `new`.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr};
use std::process::{Command, Stdio};

use crate::Placement;

const LOCK_DIR: &str = "/run/dlock-netns";
/// /29 blocks in 10.213.0.0/16.
const BLOCKS: u32 = 8192;
const TABLE: &str = "dlock_cut";

/// One veth link: the server's address in the namespace and the client's address here.
#[derive(Debug, Clone, Copy)]
pub struct Link {
    /// The namespace's end, where servers listen.
    pub server: Ipv4Addr,
    /// This namespace's end, where clients connect from.
    pub client: Ipv4Addr,
}

/// A network namespace with two links to this one; see the [module docs](self).
#[derive(Debug)]
pub struct Netns {
    name: String,
    block: u32,
    links: [Link; 2],
    // Holds the claim on the block (an advisory lock, released when closed).
    _claim: File,
}

fn on_path(name: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([
            std::path::PathBuf::from("/usr/sbin"),
            std::path::PathBuf::from("/sbin"),
        ])
        .any(|d| d.join(name).is_file())
}

/// Runs `program args`, panicking with its output when it fails.
fn run(program: &str, args: &[&str]) {
    let out = Command::new(program)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    assert!(
        out.status.success(),
        "`{program} {}` failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs `program args`, ignoring failure (clean-up of what may not exist).
fn run_quietly(program: &str, args: &[&str]) {
    let _ = Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// The process ids in namespace `name`.
fn pids_in(name: &str) -> Vec<String> {
    Command::new("ip")
        .args(["netns", "pids", name])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// Kills what runs in namespace `name` and deletes it. The cut goes first: sockets that
/// outlive their processes (closing, orphaned) then end at once instead of retransmitting
/// into the drop rules for minutes, keeping the namespace and its veth pairs alive.
fn remove_namespace(name: &str) {
    run_quietly(
        "ip",
        &[
            "netns", "exec", name, "nft", "delete", "table", "inet", TABLE,
        ],
    );
    for pid in pids_in(name) {
        run_quietly("kill", &["-KILL", &pid]);
    }
    run_quietly("ip", &["netns", "del", name]);
}

/// Removes the namespaces of test processes that are gone.
fn remove_stale_namespaces() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(pid) = name
            .strip_prefix("dlock-")
            .and_then(|rest| rest.split('-').next())
        else {
            continue;
        };
        if pid.parse::<u32>().is_ok() && !std::path::Path::new("/proc").join(pid).exists() {
            remove_namespace(name);
        }
    }
}

/// The lock file of `block`, locked, unless another process holds it.
fn try_claim(block: u32) -> Option<File> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(format!("{LOCK_DIR}/{block}"))
        .expect("open a netns lock file");
    file.try_lock().is_ok().then_some(file)
}

/// Removes veth ends left here by namespaces whose block nobody holds (their namespace can
/// outlive its name for a while).
fn remove_stale_links() {
    let Ok(out) = Command::new("ip").args(["-o", "link", "show"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        // "70: dlk1375r0@if2: <...> ..."
        let Some(name) = line
            .split_whitespace()
            .nth(1)
            .and_then(|n| n.trim_end_matches(':').split('@').next())
        else {
            continue;
        };
        let Some(block) = name
            .strip_prefix("dlk")
            .and_then(|rest| rest.split_once('r'))
            .and_then(|(block, _)| block.parse::<u32>().ok())
        else {
            continue;
        };
        if block < BLOCKS && try_claim(block).is_some() {
            run_quietly("ip", &["link", "del", name]);
        }
    }
}

/// Claims a free /29 block: its lock file, locked.
fn claim_block() -> (u32, File) {
    let start = std::process::id().wrapping_mul(7919) % BLOCKS;
    for i in 0..BLOCKS {
        let block = (start + i) % BLOCKS;
        if let Some(file) = try_claim(block) {
            return (block, file);
        }
    }
    panic!("every address block in 10.213.0.0/16 is in use");
}

impl Netns {
    /// Whether namespaces can be made here: always true, as without them the test fails,
    /// saying it was not run and why ([`crate::not_run`]), whether `CI` is set or not (CI runs
    /// as root).
    pub fn available() -> bool {
        let why = if !cfg!(target_os = "linux") {
            Some("network namespaces need Linux")
        } else if !Placement::running_as_root() {
            Some("network namespaces need root")
        } else if !on_path("ip") {
            Some("`ip` (iproute2) is not installed")
        } else if !on_path("nft") {
            Some("`nft` is not installed (apt-get install nftables; bash .ci/run does)")
        } else {
            None
        };
        match why {
            None => true,
            Some(why) => crate::not_run(
                &format!("no network namespaces here: {why}"),
                "run the network fault tests as root on Linux, as `bash .ci/run` does",
            ),
        }
    }

    /// Creates a namespace with its two links up. Never `None`: where namespaces cannot be
    /// made the test fails ([`available`](Netns::available)).
    pub fn new() -> Option<Netns> {
        if !Netns::available() {
            return None;
        }
        std::fs::create_dir_all(LOCK_DIR).expect("create the netns lock dir");
        remove_stale_namespaces();
        remove_stale_links();
        let (block, claim) = claim_block();
        let base = block * 8;
        let addr =
            |last: u32| Ipv4Addr::new(10, 213, (base >> 8) as u8, (base & 0xff) as u8 + last as u8);
        let netns = Netns {
            name: format!("dlock-{}-{block}", std::process::id()),
            block,
            links: [
                Link {
                    server: addr(1),
                    client: addr(2),
                },
                Link {
                    server: addr(5),
                    client: addr(6),
                },
            ],
            _claim: claim,
        };
        // Leftovers of an earlier holder of the block that died.
        for i in 0..2 {
            run_quietly("ip", &["link", "del", &netns.root_if(i)]);
        }
        let name = netns.name.as_str();
        run("ip", &["netns", "add", name]);
        run("ip", &["-n", name, "link", "set", "lo", "up"]);
        for (i, link) in netns.links.iter().enumerate() {
            let (root_if, ns_if) = (netns.root_if(i), netns.ns_if(i));
            run(
                "ip",
                &[
                    "link", "add", &root_if, "type", "veth", "peer", "name", &ns_if, "netns", name,
                ],
            );
            run(
                "ip",
                &[
                    "addr",
                    "add",
                    &format!("{}/30", link.client),
                    "dev",
                    &root_if,
                ],
            );
            run("ip", &["link", "set", &root_if, "up"]);
            run(
                "ip",
                &[
                    "-n",
                    name,
                    "addr",
                    "add",
                    &format!("{}/30", link.server),
                    "dev",
                    &ns_if,
                ],
            );
            run("ip", &["-n", name, "link", "set", &ns_if, "up"]);
        }
        Some(netns)
    }

    fn root_if(&self, link: usize) -> String {
        format!("dlk{}r{link}", self.block)
    }

    fn ns_if(&self, link: usize) -> String {
        format!("dlk{}n{link}", self.block)
    }

    /// The namespace's name (`dlock-{pid}-{block}`), for `ip netns exec`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The link that [`cut`](Netns::cut) cuts.
    pub fn cut_link(&self) -> Link {
        self.links[0]
    }

    /// The link that stays up.
    pub fn side_link(&self) -> Link {
        self.links[1]
    }

    /// Servers inside the namespace, listening on both links' server ends and trusting both
    /// client addresses.
    pub fn placement(&self) -> Placement {
        Placement {
            listen: self.links.iter().map(|l| IpAddr::V4(l.server)).collect(),
            clients: self.links.iter().map(|l| IpAddr::V4(l.client)).collect(),
            prefix: vec![
                "ip".to_owned(),
                "netns".to_owned(),
                "exec".to_owned(),
                self.name.clone(),
            ],
        }
    }

    /// Sets the namespace's TCP give-up times: keepalive probes start after `idle_secs` of
    /// silence, one per second, and the first unanswered one ends the connection; unacknowledged
    /// data is retransmitted `retries` times. Servers inside that enable keepalive without
    /// their own timings (PostgreSQL, MariaDB) then drop a silent peer after about
    /// `idle_secs + 1` s, or `0.2 * (2^(retries + 1) - 1)` s with data in flight.
    pub fn tcp_give_up(&self, idle_secs: u32, retries: u32) {
        // These sysctls belong to the namespace of the process that writes them.
        let script = format!(
            "cd /proc/sys/net/ipv4 && echo {idle_secs} > tcp_keepalive_time && \
             echo 1 > tcp_keepalive_intvl && echo 1 > tcp_keepalive_probes && \
             echo {retries} > tcp_retries2"
        );
        run("ip", &["netns", "exec", &self.name, "sh", "-c", &script]);
    }

    /// Drops every packet from and to the cut link's client address, in both directions,
    /// silently.
    pub fn cut(&self) {
        let client = self.cut_link().client;
        let rules = format!(
            "table inet {TABLE} {{\n\
             \x20 chain input {{ type filter hook input priority filter; policy accept; ip saddr {client} drop; }}\n\
             \x20 chain output {{ type filter hook output priority filter; policy accept; ip daddr {client} drop; }}\n\
             }}\n"
        );
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.name, "nft", "-f", "/dev/stdin"])
            .stdin(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run nft");
        child
            .stdin
            .take()
            .expect("nft stdin")
            .write_all(rules.as_bytes())
            .expect("write the nft rules");
        let out = child.wait_with_output().expect("wait for nft");
        assert!(
            out.status.success(),
            "nft refused the cut: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Removes the cut.
    pub fn heal(&self) {
        run(
            "ip",
            &[
                "netns", "exec", &self.name, "nft", "delete", "table", "inet", TABLE,
            ],
        );
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        remove_namespace(&self.name);
        for i in 0..2 {
            run_quietly("ip", &["link", "del", &self.root_if(i)]);
        }
    }
}
