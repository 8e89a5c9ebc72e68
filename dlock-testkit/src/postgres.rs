//! Throwaway PostgreSQL servers, spawned from the installed binaries in a temp dir on a free
//! loopback port (or where a [`Placement`] says). As root, the server runs as the `postgres`
//! user (PostgreSQL refuses root). The binaries are the `postgres` that `DLOCK_POSTGRES_SERVER`
//! names and the `initdb` beside it, or else the first pair on PATH, or the newest of
//! `/usr/lib/postgresql/*/bin`; without them a test fails, saying it was not run and how to
//! install the servers ([`crate::server_binary`]), whether `CI` is set or not.
//!
//! Each server trusts every local user except `locker`, who must give a password (for the
//! wrong-password test). A server is stopped when its [`PgServer`] is dropped; the shared
//! server of a test binary is stopped by a small reaper process when the test binary exits.
//!
//! With [`PgServer::set_tls`] (or [`PgServer::start_tls`]) the server runs with `ssl=on` and a
//! given certificate, and optionally accepts TCP clients over TLS only (`hostssl` lines alone in
//! `pg_hba.conf`, so a client without TLS is refused with "no encryption").

use std::io::Write;
use std::net::{IpAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::{Placement, ServerTls};

/// A running (or stopped) throwaway server.
#[derive(Debug)]
pub struct PgServer {
    dir: PathBuf,
    port: u16,
    child: Option<Child>,
    bin: PathBuf,
    placement: Placement,
    /// The certificate files (copies in the server's dir) when TLS is on, and whether TCP
    /// clients must use it; read by the next [`resume`](PgServer::resume).
    tls: Option<(ServerTls, bool)>,
    // Ends the server when this process exits, even if `Drop` never runs (statics).
    _reaper: ChildStdin,
}

/// The directory of `initdb` and `postgres`: that of the `postgres` binary `DLOCK_POSTGRES_SERVER`
/// names, or else the first on PATH, or the newest of `/usr/lib/postgresql/*/bin`; fails the
/// test ([`crate::not_run`]) when there is none, whether `CI` is set or not.
#[track_caller]
fn bin_dir() -> PathBuf {
    const ENV: &str = "DLOCK_POSTGRES_SERVER";
    crate::server_binary("PostgreSQL server", ENV, || {
        installed_bin_dir().map(|dir| dir.join("postgres"))
    })
    .parent()
    .map(Path::to_path_buf)
    .unwrap_or_default()
}

fn installed_bin_dir() -> Option<PathBuf> {
    if let Ok(path) = std::env::var("PATH") {
        for dir in std::env::split_paths(&path) {
            if dir.join("initdb").is_file() && dir.join("postgres").is_file() {
                return Some(dir);
            }
        }
    }
    if let Ok(entries) = std::fs::read_dir("/usr/lib/postgresql") {
        let mut dirs: Vec<PathBuf> = entries
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .filter(|d| d.join("initdb").is_file())
            .collect();
        dirs.sort();
        if let Some(dir) = dirs.pop() {
            return Some(dir);
        }
    }
    None
}

/// A command that runs `program` (behind the placement's prefix) as the `postgres` user when
/// this process is root.
fn as_postgres(placement: &Placement, program: &Path) -> Command {
    if Placement::running_as_root() {
        let mut cmd = placement.command("setpriv");
        cmd.args([
            "--reuid=postgres",
            "--regid=postgres",
            "--init-groups",
            "--reset-env",
        ]);
        cmd.arg(program);
        cmd
    } else {
        placement.command(program)
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

impl PgServer {
    /// Creates a cluster in a new temp dir and starts it on loopback.
    pub fn start() -> PgServer {
        PgServer::start_with(Placement::default())
    }

    /// Creates a cluster in a new temp dir and starts it where `placement` says, trusting its
    /// clients.
    pub fn start_with(placement: Placement) -> PgServer {
        let bin = bin_dir();
        let dir = tempfile::Builder::new()
            .prefix("dlock-pg-")
            .tempdir()
            .expect("temp dir")
            .keep();
        let data = dir.join("data");
        std::fs::create_dir(&data).expect("data dir");
        if Placement::running_as_root() {
            let status = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&dir)
                .status()
                .expect("chown");
            assert!(status.success(), "chown of the server dir failed");
        }
        let out = as_postgres(&Placement::default(), &bin.join("initdb"))
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"])
            .output()
            .expect("run initdb");
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let listen: Vec<String> = placement.listen().iter().map(IpAddr::to_string).collect();
        let mut conf = std::fs::OpenOptions::new()
            .append(true)
            .open(data.join("postgresql.conf"))
            .expect("open postgresql.conf");
        writeln!(
            conf,
            "fsync = off\nsynchronous_commit = off\nfull_page_writes = off\nmax_connections = 300\n\
             max_locks_per_transaction = 256\nshared_buffers = 32MB\nlisten_addresses = '{}'",
            listen.join(",")
        )
        .expect("write postgresql.conf");
        drop(conf);

        // The reaper: when this process exits (its stdin closes), stop the server and remove
        // the directory.
        let script = format!(
            "cat >/dev/null; pid=$(head -n1 '{data}/postmaster.pid' 2>/dev/null); \
             [ -n \"$pid\" ] && kill -QUIT \"$pid\" 2>/dev/null; \
             for i in 1 2 3 4 5 6 7 8 9 10; do [ -e '{data}/postmaster.pid' ] || break; sleep 0.2; done; \
             rm -rf '{dir}'",
            data = data.display(),
            dir = dir.display()
        );
        let reaper_stdin = crate::reaper(&script);

        let mut server = PgServer {
            dir,
            port: free_port(),
            child: None,
            bin,
            placement,
            tls: None,
            _reaper: reaper_stdin,
        };
        server.resume();
        server
    }

    /// [`start`](PgServer::start) with TLS on (`ssl=on`) and `tls`'s certificate; with
    /// `tls_only`, TCP clients without TLS are refused.
    pub fn start_tls(tls: &ServerTls, tls_only: bool) -> PgServer {
        let mut server = PgServer::start();
        server.stop();
        server.set_tls(Some(tls), tls_only);
        server.resume();
        server
    }

    /// The TLS settings of the next [`resume`](PgServer::resume): `None` turns TLS off (`ssl`
    /// stays at its default, off). The files are copied into the server's dir, owned by the
    /// server's user. With `tls_only`, `pg_hba.conf` has `hostssl` lines only for TCP clients.
    pub fn set_tls(&mut self, tls: Option<&ServerTls>, tls_only: bool) {
        self.tls = tls.map(|tls| {
            let copied = tls.copy_into(&self.dir);
            if Placement::running_as_root() {
                let status = Command::new("chown")
                    .arg("postgres:postgres")
                    .args([&copied.cert, &copied.key, &copied.ca])
                    .status()
                    .expect("chown");
                assert!(status.success(), "chown of the certificate files failed");
            }
            (copied, tls_only)
        });
    }

    /// Writes `pg_hba.conf` for the next start: trust for local and loopback clients (and the
    /// placement's), a password for `locker`, `hostssl` instead of `host` when TLS is required.
    fn write_hba(&self) {
        let tls_only = self.tls.as_ref().is_some_and(|(_, only)| *only);
        let host = if tls_only { "hostssl" } else { "host" };
        let mut hba = format!(
            "local all all trust\n\
             {host} all locker 127.0.0.1/32 scram-sha-256\n\
             {host} all all 127.0.0.1/32 trust\n"
        );
        for client in &self.placement.clients {
            let bits = if client.is_ipv4() { 32 } else { 128 };
            hba.push_str(&format!("{host} all all {client}/{bits} trust\n"));
        }
        std::fs::write(self.data().join("pg_hba.conf"), hba).expect("write pg_hba.conf");
    }

    /// The one server shared by the tests of this binary.
    pub fn shared() -> &'static PgServer {
        static SHARED: OnceLock<PgServer> = OnceLock::new();
        static STARTING: Mutex<()> = Mutex::new(());
        let _once = STARTING.lock().unwrap_or_else(|e| e.into_inner());
        SHARED.get_or_init(PgServer::start)
    }

    /// The server's TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A URL for the trusted superuser, with extra query options (`a=b&c=d`).
    pub fn url(&self, options: &str) -> String {
        self.url_at(self.placement.host(), options)
    }

    /// [`url`](PgServer::url) through another of the server's listen addresses.
    pub fn url_at(&self, host: IpAddr, options: &str) -> String {
        let mut url = format!(
            "postgres://postgres@{}:{}/postgres",
            Placement::url_host(host),
            self.port
        );
        if !options.is_empty() {
            url.push('?');
            url.push_str(options);
        }
        url
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// Starts the server again after [`stop`](PgServer::stop), on the same port.
    pub fn resume(&mut self) {
        assert!(self.child.is_none(), "the server is running");
        self.write_hba();
        let log = std::fs::File::create(self.dir.join("server.log")).expect("log file");
        let _ = Command::new("chown")
            .args(["postgres:postgres"])
            .arg(self.dir.join("server.log"))
            .status();
        let mut cmd = as_postgres(&self.placement, &self.bin.join("postgres"));
        cmd.arg("-D")
            .arg(self.data())
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-k")
            .arg(&self.dir);
        if let Some((tls, _)) = &self.tls {
            cmd.args(["-c", "ssl=on", "-c"])
                .arg(format!("ssl_cert_file={}", tls.cert.display()))
                .arg("-c")
                .arg(format!("ssl_key_file={}", tls.key.display()));
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start postgres");
        let child = self.child.insert(child);
        Placement::wait_until_ready(
            child,
            &self.dir.join("server.log"),
            "ready to accept connections",
            "postgres",
            Duration::from_secs(60),
        );
    }

    /// Fast shutdown: every session is terminated, then the server exits.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-INT", &child.id().to_string()])
                .status();
            let _ = child.wait();
        }
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-QUIT", &child.id().to_string()])
                .status();
            let _ = child.wait();
        }
        // The reaper removes the directory when its stdin closes (now).
    }
}
