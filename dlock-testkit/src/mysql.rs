//! Throwaway MariaDB and MySQL servers on free loopback ports (or where a [`Placement`] says)
//! in temp dirs.
//!
//! MariaDB runs from the installed Debian package (`mariadb-install-db`, `mariadbd`). Oracle
//! MySQL runs from a Debian sid chroot that `.ci/mysql-chroot.sh` installs (default
//! `/var/cache/dlock-ci/sid`, or `DLOCK_MYSQL_CHROOT`): `mysqld` runs inside it via
//! `chroot`, with its data dir in the chroot's `/tmp`. Both trust `root` from loopback without
//! a password. A server is stopped and its directory removed when its [`DbServer`] is dropped,
//! and, for the shared servers held in statics, by a reaper process when the test binary exits.
//!
//! Without the binaries a test fails, saying it was not run and why ([`crate::not_run`]),
//! whether `CI` is set or not.
//!
//! [`DbServer::set_tls`] chooses the server's TLS from the next start on: its own default
//! (MariaDB 10.11 has none; MySQL 9 makes a self-signed certificate at `--initialize`), none at
//! all, or a given certificate (`--ssl-cert`, `--ssl-key`, `--ssl-ca`), optionally with
//! `--require-secure-transport=ON`, which refuses every client that does not use TLS.

use std::net::{IpAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use crate::{Placement, ServerTls};

/// A server's TLS.
#[derive(Debug, Clone)]
pub enum Tls {
    /// What the server does without options.
    Default,
    /// No TLS at all (`--tls-version=` on MySQL; MariaDB's default).
    Off,
    /// This certificate (copies in the server's dir); `only` refuses clients without TLS.
    On {
        /// The certificate, its key and its CA.
        files: ServerTls,
        /// Whether clients without TLS are refused (`--require-secure-transport=ON`).
        only: bool,
    },
}

/// Which server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// MariaDB, from the installed Debian package.
    MariaDb,
    /// Oracle MySQL 9, from the chroot that `.ci/mysql-chroot.sh` installs.
    MySql,
}

impl Flavor {
    /// The server's name in messages: `MariaDB` or `MySQL 9`.
    pub fn name(self) -> &'static str {
        match self {
            Flavor::MariaDb => "MariaDB",
            Flavor::MySql => "MySQL 9",
        }
    }

    /// The server's label in messages, and its URL scheme: `mariadb` or `mysql`.
    pub fn label(self) -> &'static str {
        match self {
            Flavor::MariaDb => "mariadb",
            Flavor::MySql => "mysql",
        }
    }
}

fn chroot_dir() -> PathBuf {
    std::env::var_os("DLOCK_MYSQL_CHROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/dlock-ci/sid"))
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/bin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Why `flavor` cannot run here, if it cannot.
fn missing(flavor: Flavor) -> Option<String> {
    match flavor {
        Flavor::MariaDb => {
            if find_on_path("mariadbd").is_some() && find_on_path("mariadb-install-db").is_some() {
                None
            } else {
                Some("mariadbd / mariadb-install-db are not installed (apt-get install mariadb-server; bash .ci/run does)".into())
            }
        }
        Flavor::MySql => {
            let dir = chroot_dir();
            if dir.join("usr/sbin/mysqld").is_file() && dir.join(".dlock-ready").is_file() {
                None
            } else {
                Some(format!(
                    "no MySQL chroot at {} (bash .ci/mysql-chroot.sh installs it; bash .ci/run does)",
                    dir.display()
                ))
            }
        }
    }
}

/// Whether `flavor` can run: always true, as without it the test fails, saying it was not run
/// and why ([`crate::not_run`]), whether `CI` is set or not.
#[track_caller]
pub fn available(flavor: Flavor) -> bool {
    match missing(flavor) {
        None => true,
        Some(why) => crate::not_run(&format!("no {} server here", flavor.name()), &why),
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A running (or stopped) throwaway server.
#[derive(Debug)]
pub struct DbServer {
    /// Which server it is.
    pub flavor: Flavor,
    /// The server's directory as this process sees it.
    dir: PathBuf,
    /// The same directory as the server sees it (inside the chroot for MySQL).
    server_dir: PathBuf,
    port: u16,
    child: Option<Child>,
    placement: Placement,
    tls: Tls,
    /// Whether the server runs `performance_schema` with its metadata lock instrument on
    /// (off by default, to save the server's memory).
    performance_schema: bool,
    _reaper: ChildStdin,
}

impl DbServer {
    /// Creates a data dir and starts a server on loopback. Never `None`: without the binaries
    /// the test fails ([`available`]); the `Option` is kept for the callers written when a
    /// missing server was skipped.
    pub fn start(flavor: Flavor) -> Option<DbServer> {
        DbServer::start_with(flavor, Placement::default())
    }

    /// [`start`](DbServer::start) where `placement` says, with `root` trusted from its clients.
    pub fn start_with(flavor: Flavor, placement: Placement) -> Option<DbServer> {
        if !available(flavor) {
            return None;
        }
        let base = match flavor {
            Flavor::MariaDb => std::env::temp_dir(),
            Flavor::MySql => chroot_dir().join("tmp"),
        };
        let dir = tempfile::Builder::new()
            .prefix("dlock-my-")
            .tempdir_in(&base)
            .expect("temp dir")
            .keep();
        let server_dir = match flavor {
            Flavor::MariaDb => dir.clone(),
            Flavor::MySql => PathBuf::from("/tmp").join(dir.file_name().expect("dir name")),
        };
        let script = format!(
            "cat >/dev/null; pid=$(cat '{dir}/server.pid' 2>/dev/null); \
             if [ -n \"$pid\" ] && kill -KILL \"$pid\" 2>/dev/null; then i=0; \
             while [ $i -lt 100 ] && kill -0 \"$pid\" 2>/dev/null; do sleep 0.05; i=$((i+1)); done; \
             fi; rm -rf '{dir}'",
            dir = dir.display()
        );
        let reaper_stdin = crate::reaper(&script);

        let out = match flavor {
            Flavor::MariaDb => Command::new(find_on_path("mariadb-install-db").expect("installer"))
                .args([
                    "--no-defaults",
                    "--user=root",
                    "--auth-root-authentication-method=normal",
                    "--skip-test-db",
                    "--skip-name-resolve",
                    "--innodb-flush-method=nosync",
                    "--innodb-doublewrite=0",
                    "--innodb-log-file-size=8M",
                ])
                .arg(format!("--datadir={}", dir.join("data").display()))
                // Its own temp dir: installs running side by side in the shared /tmp were
                // seen to fail deleting their temp tables ("Error on delete of
                // '/tmp/#sql-temptable-…'"). The same for MySQL's, in the chroot's /tmp.
                .arg(format!("--tmpdir={}", dir.display()))
                .output()
                .expect("run mariadb-install-db"),
            Flavor::MySql => Command::new("chroot")
                .arg(chroot_dir())
                .args([
                    "/usr/sbin/mysqld",
                    "--no-defaults",
                    "--initialize-insecure",
                    "--user=root",
                    "--innodb-flush-method=nosync",
                    "--innodb-doublewrite=0",
                    "--skip-log-bin",
                ])
                .arg(format!("--datadir={}", server_dir.join("data").display()))
                .arg(format!("--tmpdir={}", server_dir.display()))
                .output()
                .expect("run mysqld --initialize-insecure"),
        };
        assert!(
            out.status.success(),
            "initializing the {} data dir failed: {}{}",
            flavor.label(),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let mut server = DbServer {
            flavor,
            dir,
            server_dir,
            port: free_port(),
            child: None,
            placement,
            tls: Tls::Default,
            performance_schema: false,
            _reaper: reaper_stdin,
        };
        server.resume();
        Some(server)
    }

    /// A server of its own, as [`start`](DbServer::start) makes, with `performance_schema`
    /// and its metadata lock instrument on (for store inspection, which reads
    /// `performance_schema.metadata_locks`).
    pub fn start_with_performance_schema(flavor: Flavor) -> Option<DbServer> {
        let mut server = DbServer::start(flavor)?;
        server.stop();
        server.performance_schema = true;
        server.resume();
        Some(server)
    }

    /// The TLS of the next [`resume`](DbServer::resume) (see [`Tls`]); certificate files are
    /// copied into the server's dir, where the server (in its chroot, for MySQL) reads them.
    pub fn set_tls(&mut self, tls: Tls) {
        self.tls = match tls {
            Tls::On { files, only } => Tls::On {
                files: files.copy_into(&self.dir),
                only,
            },
            other => other,
        };
    }

    /// The one server of `flavor` shared by the tests of this binary.
    pub fn shared(flavor: Flavor) -> Option<&'static DbServer> {
        static MARIADB: OnceLock<Option<DbServer>> = OnceLock::new();
        static MYSQL: OnceLock<Option<DbServer>> = OnceLock::new();
        static STARTING: Mutex<()> = Mutex::new(());
        let _once = STARTING.lock().unwrap_or_else(|e| e.into_inner());
        let cell = match flavor {
            Flavor::MariaDb => &MARIADB,
            Flavor::MySql => &MYSQL,
        };
        cell.get_or_init(|| DbServer::start(flavor)).as_ref()
    }

    /// The server's TCP port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// A URL for root on database `dlock_test` with extra query options (`a=b&c=d`).
    pub fn url(&self, options: &str) -> String {
        self.url_at(self.placement.host(), options)
    }

    /// [`url`](DbServer::url) through another of the server's listen addresses.
    pub fn url_at(&self, host: IpAddr, options: &str) -> String {
        let scheme = self.flavor.label();
        let host = Placement::url_host(host);
        let mut url = format!("{scheme}://root@{host}:{}/dlock_test", self.port);
        if !options.is_empty() {
            url.push('?');
            url.push_str(options);
        }
        url
    }

    /// A URL for root without a database.
    pub fn url_without_database(&self) -> String {
        format!(
            "{}://root@{}:{}",
            self.flavor.label(),
            Placement::url_host(self.placement.host()),
            self.port
        )
    }

    /// Starts the server again after [`stop`](DbServer::stop), on the same port.
    pub fn resume(&mut self) {
        assert!(self.child.is_none(), "the server is running");
        let log = std::fs::File::create(self.dir.join("server.log")).expect("log file");
        let data = self.server_dir.join("data");
        let listen: Vec<String> = self
            .placement
            .listen()
            .iter()
            .map(IpAddr::to_string)
            .collect();
        let common = [
            "--no-defaults".to_owned(),
            "--user=root".to_owned(),
            format!("--datadir={}", data.display()),
            format!("--socket={}", self.server_dir.join("s.sock").display()),
            format!(
                "--pid-file={}",
                self.server_dir.join("server.pid").display()
            ),
            format!("--port={}", self.port),
            format!("--bind-address={}", listen.join(",")),
            "--skip-name-resolve".to_owned(),
            "--skip-log-bin".to_owned(),
            "--innodb-flush-log-at-trx-commit=0".to_owned(),
            "--innodb-flush-method=nosync".to_owned(),
            "--innodb-doublewrite=0".to_owned(),
            "--max-connections=500".to_owned(),
            format!("--init-file={}", self.server_dir.join("init.sql").display()),
            // Its own temp dir, as at install, not the /tmp that every server shares.
            format!("--tmpdir={}", self.server_dir.display()),
        ];
        // The certificate files as the server sees them (inside the chroot for MySQL).
        let seen = |path: &std::path::Path| {
            self.server_dir
                .join(path.file_name().expect("a file name"))
                .display()
                .to_string()
        };
        let tls: Vec<String> = match &self.tls {
            Tls::Default => Vec::new(),
            Tls::Off => match self.flavor {
                Flavor::MySql => vec!["--tls-version=".to_owned()],
                Flavor::MariaDb => Vec::new(),
            },
            Tls::On { files, only } => vec![
                format!("--ssl-cert={}", seen(&files.cert)),
                format!("--ssl-key={}", seen(&files.key)),
                format!("--ssl-ca={}", seen(&files.ca)),
                format!(
                    "--require-secure-transport={}",
                    if *only { "ON" } else { "OFF" }
                ),
            ],
        };
        // Run at every start: the test database and root from loopback (and the placement's
        // clients) by address.
        let mut init = "CREATE DATABASE IF NOT EXISTS dlock_test;\n".to_owned();
        let loopback = IpAddr::from([127, 0, 0, 1]);
        for host in std::iter::once(&loopback).chain(&self.placement.clients) {
            init.push_str(&format!(
                "CREATE USER IF NOT EXISTS 'root'@'{host}';\n\
                 GRANT ALL PRIVILEGES ON *.* TO 'root'@'{host}' WITH GRANT OPTION;\n"
            ));
        }
        std::fs::write(self.dir.join("init.sql"), init).expect("write init.sql");
        let mut cmd = match self.flavor {
            Flavor::MariaDb => {
                let mut cmd = self
                    .placement
                    .command(find_on_path("mariadbd").expect("mariadbd"));
                cmd.args(&common).args(&tls);
                cmd.arg("--innodb-log-file-size=8M");
                if self.performance_schema {
                    cmd.args([
                        "--performance-schema=ON",
                        "--performance-schema-instrument=wait/lock/metadata/sql/mdl=ON",
                    ]);
                }
                cmd
            }
            Flavor::MySql => {
                let mut cmd = self.placement.command("chroot");
                cmd.arg(chroot_dir())
                    .arg("/usr/sbin/mysqld")
                    .args(&common)
                    .args(&tls);
                cmd.args(["--mysqlx=OFF", "--secure-file-priv=NULL"]);
                cmd.arg(if self.performance_schema {
                    "--performance-schema=ON"
                } else {
                    "--performance-schema=OFF"
                });
                cmd
            }
        };
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start the server");
        let child = self.child.insert(child);
        Placement::wait_until_ready(
            child,
            &self.dir.join("server.log"),
            "ready for connections",
            self.flavor.label(),
            Duration::from_secs(120),
        );
    }

    /// Stops the server hard (SIGKILL) and waits for it to be gone: every session dies as
    /// in a crash.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for DbServer {
    fn drop(&mut self) {
        self.stop();
        // The reaper removes the directory when its stdin closes (now).
    }
}
