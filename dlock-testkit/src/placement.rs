//! Where a throwaway server runs, and the certificate files it presents when it speaks TLS.

use std::ffi::OsStr;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// Where a throwaway server listens, whom it lets in, and how its process is started. The
/// default is loopback in this process's network namespace, trusting loopback clients.
#[derive(Debug, Clone, Default)]
pub struct Placement {
    /// The addresses the server listens on (default `127.0.0.1`); URLs use the first.
    pub listen: Vec<IpAddr>,
    /// Client addresses the server trusts as it trusts loopback.
    pub clients: Vec<IpAddr>,
    /// A prefix to the server's command line, e.g. `ip netns exec NAME`.
    pub prefix: Vec<String>,
}

impl Placement {
    /// The listen addresses, `127.0.0.1` when none are given.
    pub fn listen(&self) -> Vec<IpAddr> {
        if self.listen.is_empty() {
            vec![IpAddr::from([127, 0, 0, 1])]
        } else {
            self.listen.clone()
        }
    }

    /// The address URLs use: the first listen address.
    pub fn host(&self) -> IpAddr {
        self.listen()[0]
    }

    /// `addr` as the host part of a URL (IPv6 in brackets).
    pub fn url_host(addr: IpAddr) -> String {
        match addr {
            IpAddr::V4(a) => a.to_string(),
            IpAddr::V6(a) => format!("[{a}]"),
        }
    }

    /// A command that runs `program` behind the prefix.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        match self.prefix.split_first() {
            None => Command::new(program),
            Some((first, rest)) => {
                let mut cmd = Command::new(first);
                cmd.args(rest).arg(program);
                cmd
            }
        }
    }

    /// Whether this process runs as root (servers that refuse root then run as their own user;
    /// network namespaces need it).
    pub fn running_as_root() -> bool {
        Command::new("id")
            .arg("-u")
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
            .unwrap_or(false)
    }

    /// Waits until the server's `log` says `ready`, failing with the log if `child` exits
    /// first or `limit` passes; `what` names the server in those messages.
    pub fn wait_until_ready(
        child: &mut Child,
        log: &Path,
        ready: &str,
        what: &str,
        limit: Duration,
    ) {
        let deadline = Instant::now() + limit;
        loop {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            if text.contains(ready) {
                return;
            }
            if let Ok(Some(status)) = child.try_wait() {
                panic!("{what} exited with {status}: {text}");
            }
            assert!(
                Instant::now() < deadline,
                "{what} did not start in time: {text}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A server's certificate and key files, and the CA that signed the certificate (for servers
/// that want one configured).
#[derive(Debug, Clone)]
pub struct ServerTls {
    /// The server's certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// The CA that signed it (PEM).
    pub ca: PathBuf,
}

impl ServerTls {
    /// Copies the three files into `dir` (as `server.pem`, `server.key`, `ca.pem`), where a
    /// server process can read them, and returns the copies. The key is made readable by its
    /// owner only (PostgreSQL refuses a key others can read).
    pub fn copy_into(&self, dir: &Path) -> ServerTls {
        use std::os::unix::fs::PermissionsExt;
        let copy = |from: &Path, name: &str| {
            let to = dir.join(name);
            std::fs::copy(from, &to).expect("copy a certificate file");
            to
        };
        let copied = ServerTls {
            cert: copy(&self.cert, "server.pem"),
            key: copy(&self.key, "server.key"),
            ca: copy(&self.ca, "ca.pem"),
        };
        std::fs::set_permissions(&copied.key, std::fs::Permissions::from_mode(0o600))
            .expect("chmod the key");
        copied
    }
}
