//! The `dlock` binary, run as a real process against real stores: SQLite files, and throwaway
//! Redis, PostgreSQL and etcd servers.
//!
//! Commands under the lock are small shell scripts that leave marker files behind (started,
//! signalled) and wait for a file the test creates: the tests wait for those files instead of
//! sleeping.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

/// How long any awaited condition may take before the test fails.
const LIMIT: Duration = Duration::from_secs(20);

/// `dlock` with `url` as its store, and nothing inherited that would change what it does.
fn dlock(url: &str) -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_dlock"));
    command
        .env("DLOCK_URL", url)
        .env_remove("DLOCK_KEY")
        .env_remove("DLOCK_FENCING_TOKEN")
        .stdin(Stdio::null());
    command
}

/// Runs `dlock` to the end: its output.
fn output(command: &mut Command) -> Output {
    command.output().expect("dlock runs")
}

fn code(status: ExitStatus) -> i32 {
    status.code().expect("dlock exits by itself")
}

/// Waits for `condition`, failing the test (naming `what`) after [`LIMIT`].
fn until(what: &str, mut condition: impl FnMut() -> bool) {
    let started = Instant::now();
    while !condition() {
        assert!(started.elapsed() < LIMIT, "timed out waiting until {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Waits for `child` to exit, for at most [`LIMIT`].
fn wait(child: &mut Child) -> ExitStatus {
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("wait for dlock") {
            return status;
        }
        if started.elapsed() > LIMIT {
            let _ = child.kill();
            panic!("dlock did not exit within {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Sends `signal` (`"TERM"`, `"INT"`) to the process `pid`.
fn kill(pid: u32, signal: &str) {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill -{signal} {pid}");
}

/// A scratch folder with marker files.
struct Marks {
    dir: tempfile::TempDir,
}

impl Marks {
    fn new() -> Marks {
        Marks {
            dir: tempfile::tempdir().expect("a temp dir"),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn has(&self, name: &str) -> bool {
        self.path(name).exists()
    }

    fn set(&self, name: &str) {
        std::fs::write(self.path(name), b"").expect("write a marker");
    }

    fn read(&self, name: &str) -> String {
        std::fs::read_to_string(self.path(name)).unwrap_or_default()
    }

    /// A script that marks `name`.started (with its environment's lock variables), then
    /// waits for `name`.go and exits with `code`.
    fn holder(&self, name: &str, code: i32) -> Vec<String> {
        let dir = self.dir.path().display();
        script(&format!(
            "echo \"$DLOCK_KEY $DLOCK_FENCING_TOKEN\" > {dir}/{name}.env; touch {dir}/{name}.started; \
             while [ ! -e {dir}/{name}.go ]; do sleep 0.01; done; exit {code}"
        ))
    }
}

fn script(text: &str) -> Vec<String> {
    vec!["sh".to_owned(), "-c".to_owned(), text.to_owned()]
}

fn sqlite_url(dir: &Path) -> String {
    format!("sqlite://{}/locks.db", dir.display())
}

/// Two runs on one key at once: the second exits 75 without running its command, and runs
/// once the first has ended. Returns the fencing tokens the two runs saw.
fn two_runs_on_one_key(url: &str, key: &str) -> (String, String) {
    let marks = Marks::new();
    let mut first = dlock(url)
        .args(["run", "--key", key, "--"])
        .args(marks.holder("first", 0))
        .spawn()
        .unwrap();
    until("the first run's command started", || {
        marks.has("first.started")
    });
    let second = output(
        dlock(url)
            .args(["run", "--key", key, "--"])
            .args(marks.holder("second", 0)),
    );
    assert_eq!(code(second.status), 75, "{second:?}");
    assert!(
        !marks.has("second.started"),
        "the command ran without the lock"
    );
    // Quiet when stderr is not a terminal (cron mails nothing).
    assert!(second.stderr.is_empty(), "{second:?}");

    marks.set("first.go");
    assert_eq!(code(wait(&mut first)), 0);
    marks.set("second.go");
    let third = output(
        dlock(url)
            .args(["run", "--key", key, "--"])
            .args(marks.holder("second", 0)),
    );
    assert_eq!(code(third.status), 0, "{third:?}");
    (marks.read("first.env"), marks.read("second.env"))
}

/// `KEY TOKEN` as the command saw them: the key, and the token (empty when none was issued).
fn token_of(env: &str) -> Option<u64> {
    env.split_whitespace().nth(1).map(|t| t.parse().unwrap())
}

#[test]
fn sqlite_one_run_at_a_time_with_increasing_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let (first, second) = two_runs_on_one_key(&url, "jobs:nightly");
    assert!(first.starts_with("jobs:nightly "), "{first}");
    let (a, b) = (token_of(&first).unwrap(), token_of(&second).unwrap());
    assert!(b > a, "tokens {a} then {b}");
}

#[test]
fn exit_statuses_are_the_commands_or_dlocks_own() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let run = |args: &[&str]| {
        output(dlock(&url).args(["run", "--key", "k", "--"]).args(args))
            .status
            .code()
            .unwrap()
    };
    assert_eq!(run(&["true"]), 0);
    assert_eq!(run(&["sh", "-c", "exit 7"]), 7);
    assert_eq!(run(&["sh", "-c", "exit 255"]), 255);
    // Ended by a signal: 128 + N, as shells report it.
    assert_eq!(run(&["sh", "-c", "kill -TERM $$"]), 143);
    assert_eq!(run(&["sh", "-c", "kill -KILL $$"]), 137);
    assert_eq!(run(&["/nonexistent/command"]), 127);
    assert_eq!(run(&[dir.path().to_str().unwrap()]), 126);
    // Usage errors: no command, a bad duration, no store.
    let usage = output(dlock(&url).args(["run", "--key", "k"]));
    assert_eq!(code(usage.status), 64, "{usage:?}");
    let bad = output(dlock(&url).args(["run", "--key", "k", "--timeout", "soon", "--", "true"]));
    assert_eq!(code(bad.status), 64);
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("`--timeout`"),
        "{bad:?}"
    );
    let nowhere = output(
        dlock(&url)
            .env_remove("DLOCK_URL")
            .args(["run", "--key", "k", "--", "true"]),
    );
    assert_eq!(code(nowhere.status), 64);
    assert!(String::from_utf8_lossy(&nowhere.stderr).contains("DLOCK_URL"));
    let bad_key = output(dlock(&url).args(["run", "--key", "", "--", "true"]));
    assert_eq!(code(bad_key.status), 64, "{bad_key:?}");
    let unknown = output(dlock("ftp://host/x").args(["run", "--key", "k", "--", "true"]));
    assert_eq!(code(unknown.status), 78, "{unknown:?}");
    // The lock is free again after each of them.
    assert_eq!(run(&["true"]), 0);
}

#[test]
fn the_conflict_status_can_be_chosen_and_a_wait_can_succeed() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let marks = Marks::new();
    let mut holder = dlock(&url)
        .args(["run", "--key", "k", "--"])
        .args(marks.holder("holder", 3))
        .spawn()
        .unwrap();
    until("the holder started", || marks.has("holder.started"));
    let skipped = output(
        dlock(&url)
            .args(["run", "--key", "k", "--conflict-exit-code", "0", "--"])
            .args(marks.holder("skipped", 0)),
    );
    assert_eq!(code(skipped.status), 0);
    assert!(!marks.has("skipped.started"));
    let timed_out =
        output(dlock(&url).args(["run", "--key", "k", "--timeout", "100ms", "--", "true"]));
    assert_eq!(code(timed_out.status), 75);

    // A waiting run gets the lock once the holder is done.
    let mut waiter = dlock(&url)
        .args(["run", "--key", "k", "--timeout", "20s", "--"])
        .args(marks.holder("waiter", 0))
        .spawn()
        .unwrap();
    marks.set("holder.go");
    assert_eq!(code(wait(&mut holder)), 3);
    until("the waiter started", || marks.has("waiter.started"));
    marks.set("waiter.go");
    assert_eq!(code(wait(&mut waiter)), 0);
}

#[test]
fn readers_share_and_permits_bound_the_runs() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let marks = Marks::new();
    let mut readers: Vec<Child> = ["r1", "r2"]
        .iter()
        .map(|name| {
            let child = dlock(&url)
                .args(["run", "--key", "k", "--read", "--"])
                .args(marks.holder(name, 0))
                .spawn()
                .unwrap();
            until("a reader started", || marks.has(&format!("{name}.started")));
            child
        })
        .collect();
    let writer = output(dlock(&url).args(["run", "--key", "k", "--", "true"]));
    assert_eq!(code(writer.status), 75);

    let mut permits: Vec<Child> = ["p1", "p2"]
        .iter()
        .map(|name| {
            let child = dlock(&url)
                .args(["run", "--key", "k", "--permits", "2", "--"])
                .args(marks.holder(name, 0))
                .spawn()
                .unwrap();
            until("a permit holder started", || {
                marks.has(&format!("{name}.started"))
            });
            child
        })
        .collect();
    let third = output(dlock(&url).args(["run", "--key", "k", "--permits", "2", "--", "true"]));
    assert_eq!(code(third.status), 75);
    let lease = output(dlock(&url).args([
        "run",
        "--key",
        "k",
        "--permits",
        "2",
        "--lease",
        "5s",
        "--",
        "true",
    ]));
    assert_eq!(code(lease.status), 64, "--lease is refused with --permits");

    for name in ["r1", "r2", "p1", "p2"] {
        marks.set(&format!("{name}.go"));
    }
    for child in readers.iter_mut().chain(permits.iter_mut()) {
        assert_eq!(code(wait(child)), 0);
    }
}

/// Deletes every lock row of a SQLite lock file, as an operator wiping the store would.
fn wipe_sqlite(dir: &Path) {
    let conn = rusqlite::Connection::open(dir.join("locks.db")).unwrap();
    conn.busy_timeout(Duration::from_secs(5)).unwrap();
    let deleted = conn.execute("DELETE FROM __distributed_locks", []).unwrap();
    assert!(deleted > 0, "no lock row to delete");
}

/// A command that outlives its lease while the store is wiped: it is sent SIGTERM, and dlock
/// exits 79. `wipe` wipes the store.
fn lost_while_running(url: &str, wipe: impl FnOnce()) {
    let marks = Marks::new();
    let dir = marks.dir.path().display().to_string();
    let mut run = dlock(url)
        .args(["run", "--key", "k", "--lease", "300ms", "--"])
        .args(script(&format!(
            "trap 'touch {dir}/termed; exit 0' TERM; touch {dir}/started; \
             while :; do sleep 0.02; done"
        )))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    until("the command started", || marks.has("started"));
    wipe();
    let status = wait(&mut run);
    let mut stderr = String::new();
    std::io::Read::read_to_string(run.stderr.as_mut().unwrap(), &mut stderr).unwrap();
    assert_eq!(code(status), 79, "{stderr}");
    assert!(marks.has("termed"), "the command was not sent SIGTERM");
    assert!(stderr.contains("was lost"), "{stderr}");
}

#[test]
fn sqlite_a_lost_lock_ends_the_command() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    lost_while_running(&url, || wipe_sqlite(dir.path()));
}

#[test]
fn a_command_that_ignores_sigterm_is_killed_after_kill_after() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let marks = Marks::new();
    let started = marks.path("started");
    let mut run = dlock(&url)
        .args([
            "run",
            "--key",
            "k",
            "--lease",
            "300ms",
            "--kill-after",
            "200ms",
            "--",
        ])
        .args(script(&format!(
            "trap '' TERM; touch {}; while :; do sleep 0.02; done",
            started.display()
        )))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    until("the command started", || started.exists());
    wipe_sqlite(dir.path());
    assert_eq!(code(wait(&mut run)), 79);
}

/// SIGTERM and SIGINT sent to dlock reach the command, which keeps the lock until it has
/// ended; dlock then exits with the command's status and the lock is free.
#[test]
fn signals_reach_the_command_and_the_lock_is_released_after_it() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    for (signal, code_seen) in [("TERM", 5), ("INT", 6)] {
        let marks = Marks::new();
        let d = marks.dir.path().display().to_string();
        let mut run = dlock(&url)
            .args(["run", "--key", "k", "--"])
            .args(script(&format!(
                "trap 'touch {d}/got; while [ ! -e {d}/go ]; do sleep 0.01; done; exit {code_seen}' {signal}; \
                 touch {d}/started; while :; do sleep 0.02; done"
            )))
            .spawn()
            .unwrap();
        until("the command started", || marks.has("started"));
        kill(run.id(), signal);
        until("the command got the signal", || marks.has("got"));
        // Still held while the command finishes.
        let during = output(dlock(&url).args(["run", "--key", "k", "--", "true"]));
        assert_eq!(code(during.status), 75, "SIG{signal}");
        marks.set("go");
        assert_eq!(code(wait(&mut run)), code_seen, "SIG{signal}");
        let after = output(dlock(&url).args(["run", "--key", "k", "--", "true"]));
        assert_eq!(
            code(after.status),
            0,
            "SIG{signal}: the lock was not released"
        );
    }
}

/// A signal to a waiting run ends the wait, as the signal would have ended a command.
#[test]
fn a_signal_ends_a_wait() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let marks = Marks::new();
    let mut holder = dlock(&url)
        .args(["run", "--key", "k", "--"])
        .args(marks.holder("holder", 0))
        .spawn()
        .unwrap();
    until("the holder started", || marks.has("holder.started"));
    let mut waiter = dlock(&url)
        .args(["run", "--key", "k", "--timeout", "1m", "--"])
        .args(marks.holder("waiter", 0))
        .spawn()
        .unwrap();
    // The waiter is in its wait once it has queued in the lock file.
    until("the waiter queued", || {
        let conn = rusqlite::Connection::open(dir.path().join("locks.db")).unwrap();
        conn.query_row(
            "SELECT count(*) FROM __distributed_lock_waiters",
            [],
            |row| row.get::<_, i64>(0),
        )
        .unwrap_or(0)
            > 0
    });
    kill(waiter.id(), "TERM");
    assert_eq!(code(wait(&mut waiter)), 143);
    assert!(!marks.has("waiter.started"));
    marks.set("holder.go");
    assert_eq!(code(wait(&mut holder)), 0);
}

#[test]
fn ls_lists_the_held_locks_as_a_table_and_json_lines() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let marks = Marks::new();
    let mut holders: Vec<Child> = [("jobs:a", "a"), ("other", "b")]
        .iter()
        .map(|(key, name)| {
            let child = dlock(&url)
                .args(["run", "--key", key, "--lease", "10s", "--"])
                .args(marks.holder(name, 0))
                .spawn()
                .unwrap();
            until("a holder started", || marks.has(&format!("{name}.started")));
            child
        })
        .collect();
    let listed = output(dlock(&url).args(["ls", "--json"]));
    assert_eq!(code(listed.status), 0, "{listed:?}");
    let rows: Vec<serde_json::Value> = String::from_utf8(listed.stdout)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).expect("a JSON line"))
        .collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    let a = rows.iter().find(|row| row["key"] == "jobs:a").unwrap();
    assert_eq!(a["readers"], 0);
    assert_eq!(
        a["fencing_token"].as_u64(),
        token_of(&marks.read("a.env")),
        "{a}"
    );
    let left = a["lease_left_ms"].as_u64().unwrap();
    assert!(left > 0 && left <= 10_000, "{a}");
    // Held by the first `dlock run`, whose owner label is its host and process id.
    let owner = a["owner"].as_str().expect("an owner");
    assert!(owner.ends_with(&format!(":{}", holders[0].id())), "{a}");
    // SQLite records when a lock was taken: an RFC 3339 time, in the last minute.
    let since = a["since"].as_str().expect("since");
    let since = humantime::parse_rfc3339(since).expect("an RFC 3339 time");
    let age = std::time::SystemTime::now()
        .duration_since(since)
        .unwrap_or_default();
    assert!(age < Duration::from_secs(60), "{a}");

    let only = output(dlock(&url).args(["ls", "--json", "--prefix", "jobs:"]));
    let only = String::from_utf8(only.stdout).unwrap();
    assert_eq!(only.lines().count(), 1, "{only}");
    assert!(only.contains("\"jobs:a\""));

    let table = output(dlock(&url).args(["ls"]));
    let table = String::from_utf8(table.stdout).unwrap();
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("KEY"), "{table}");
    assert_eq!(lines.len(), 3, "{table}");

    for name in ["a", "b"] {
        marks.set(&format!("{name}.go"));
    }
    for child in &mut holders {
        assert_eq!(code(wait(child)), 0);
    }
    let empty = output(dlock(&url).args(["ls", "--json"]));
    assert!(empty.stdout.is_empty());
}

#[test]
fn ls_counts_a_semaphores_holders() {
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let marks = Marks::new();
    let count = |permits: &str| {
        let listed = output(dlock(&url).args([
            "ls",
            "--json",
            "--semaphore",
            "exports",
            "--permits",
            permits,
        ]));
        assert_eq!(code(listed.status), 0, "{listed:?}");
        let row: serde_json::Value = serde_json::from_slice(&listed.stdout).expect("one JSON line");
        assert_eq!(row["semaphore"], "exports", "{row}");
        assert_eq!(row["max_count"].as_u64(), permits.parse().ok(), "{row}");
        row["holders"].as_u64().expect("holders")
    };
    assert_eq!(count("3"), 0);
    let mut holders: Vec<Child> = ["a", "b"]
        .iter()
        .map(|name| {
            let child = dlock(&url)
                .args(["run", "--key", "exports", "--permits", "3", "--"])
                .args(marks.holder(name, 0))
                .spawn()
                .unwrap();
            until("a permit holder started", || {
                marks.has(&format!("{name}.started"))
            });
            child
        })
        .collect();
    assert_eq!(count("3"), 2);
    // The store records the count: another one is refused, naming both.
    let other = output(dlock(&url).args(["ls", "--semaphore", "exports", "--permits", "5"]));
    assert_eq!(code(other.status), 78, "{other:?}");
    let said = String::from_utf8_lossy(&other.stderr);
    assert!(
        said.contains("max_count 3") && said.contains("max_count 5"),
        "{said}"
    );
    let table = output(dlock(&url).args(["ls", "--semaphore", "exports", "--permits", "3"]));
    let table = String::from_utf8(table.stdout).unwrap();
    let lines: Vec<&str> = table.lines().collect();
    assert!(lines[0].starts_with("SEMAPHORE"), "{table}");
    assert!(
        lines[1].split_whitespace().eq(["exports", "2", "3"]),
        "{table}"
    );
    let alone = output(dlock(&url).args(["ls", "--semaphore", "exports"]));
    assert_eq!(code(alone.status), 64, "--semaphore needs --permits");
    for name in ["a", "b"] {
        marks.set(&format!("{name}.go"));
    }
    for child in &mut holders {
        assert_eq!(code(wait(child)), 0);
    }
    assert_eq!(count("3"), 0, "released permits are not counted");
}

#[test]
fn ping_answers_and_names_a_dead_store_without_its_password() {
    let dir = tempfile::tempdir().unwrap();
    let ok = output(dlock(&sqlite_url(dir.path())).arg("ping"));
    assert_eq!(code(ok.status), 0, "{ok:?}");
    // Nothing listens on port 1.
    let dead = output(dlock("redis://:hunter2@127.0.0.1:1?timeout=2s").arg("ping"));
    assert_eq!(code(dead.status), 1, "{dead:?}");
    let stderr = String::from_utf8_lossy(&dead.stderr);
    assert!(stderr.contains("redis://:***@127.0.0.1:1"), "{stderr}");
    assert!(!stderr.contains("hunter2"), "{stderr}");
    // The other subcommands name it the same way.
    let run = output(
        dlock("postgres://app:hunter2@127.0.0.1:1/app?connect_timeout=2")
            .args(["run", "--key", "k", "--", "true"]),
    );
    assert_eq!(code(run.status), 69, "{run:?}");
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        stderr.contains("postgres://app:***@127.0.0.1:1/app"),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "{stderr}");
}

#[test]
fn help_has_examples_and_exit_statuses() {
    let help = output(dlock("").arg("--help"));
    assert_eq!(code(help.status), 0);
    let text = String::from_utf8(help.stdout).unwrap();
    assert!(
        text.contains("Examples:") && text.contains("dlock run --key"),
        "{text}"
    );
    let run = output(dlock("").args(["run", "--help"]));
    let text = String::from_utf8(run.stdout).unwrap();
    assert!(text.contains("75") && text.contains("79"), "{text}");
}

#[test]
fn redis_one_run_at_a_time_and_a_flushed_lock_ends_the_command() {
    let Some(server) =
        dlock_testkit::redis::RedisServer::start(dlock_testkit::redis::Flavor::Redis7)
    else {
        return;
    };
    let url = server.url("");
    let (first, second) = two_runs_on_one_key(&url, "jobs:nightly");
    assert!(token_of(&second).unwrap() > token_of(&first).unwrap());
    lost_while_running(&url, || {
        assert_eq!(
            server.raw(&["FLUSHALL"]).as_deref().map(str::trim),
            Some("+OK")
        );
    });
}

#[test]
fn postgres_one_run_at_a_time() {
    let server = dlock_testkit::postgres::PgServer::start();
    let (first, _) = two_runs_on_one_key(&server.url(""), "jobs:nightly");
    // Session locks issue no token unless fencing is turned on, and none left in the
    // environment by an outer run reaches the command.
    assert_eq!(token_of(&first), None, "{first}");
    let seen = output(
        dlock(&server.url(""))
            .env("DLOCK_FENCING_TOKEN", "9")
            .args([
                "run",
                "--key",
                "k",
                "--",
                "sh",
                "-c",
                "echo \"[$DLOCK_FENCING_TOKEN]\"",
            ]),
    );
    assert_eq!(String::from_utf8_lossy(&seen.stdout), "[]\n", "{seen:?}");
    // A session lock cannot be ended alone: refused, saying what to do instead.
    let refused = output(dlock(&server.url("")).args(["release", "--force", "k", "--yes"]));
    assert_eq!(code(refused.status), 78, "{refused:?}");
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("pg_terminate_backend"),
        "{refused:?}"
    );
}

#[test]
fn etcd_one_run_at_a_time() {
    let Some(cluster) = dlock_testkit::etcd::EtcdCluster::single() else {
        return;
    };
    let (first, second) = two_runs_on_one_key(&cluster.url(""), "jobs:nightly");
    assert!(token_of(&second).unwrap() > token_of(&first).unwrap());
}

/// On a terminal, a waiting run says what it waits for, and a run that found the lock held
/// says so (`script(1)` gives it one).
#[test]
fn a_waiting_run_says_so_on_a_terminal() {
    if Command::new("script").arg("--version").output().is_err() {
        dlock_testkit::not_run(
            "no script(1) here",
            "install util-linux; `bash .ci/run` runs where it is",
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let marks = Marks::new();
    let mut holder = dlock(&url)
        .args(["run", "--key", "k", "--"])
        .args(marks.holder("holder", 0))
        .spawn()
        .unwrap();
    until("the holder started", || marks.has("holder.started"));
    let on_terminal = |args: &str| {
        Command::new("script")
            .args([
                "-qec",
                &format!("{} {args}", env!("CARGO_BIN_EXE_dlock")),
                "/dev/null",
            ])
            .env("DLOCK_URL", &url)
            .stdin(Stdio::null())
            .output()
            .expect("script runs")
    };
    let waited = on_terminal("run --key k --timeout 400ms -- true");
    let shown = String::from_utf8_lossy(&waited.stdout);
    assert_eq!(code(waited.status), 75, "{shown}");
    assert!(
        shown.contains("waiting up to 400ms for lock `k`, held elsewhere"),
        "{shown}"
    );
    assert!(shown.contains("stayed held elsewhere for 400ms"), "{shown}");
    let tried = on_terminal("run --key k -- true");
    let shown = String::from_utf8_lossy(&tried.stdout);
    assert!(shown.contains("lock `k` is held elsewhere"), "{shown}");
    assert!(!shown.contains("waiting"), "{shown}");
    marks.set("holder.go");
    assert_eq!(code(wait(&mut holder)), 0);
}

/// `release --force` ends a lock whoever holds it: the holding run finds it lost at its next
/// renewal and ends its command (exit 79); without a lock it exits 1; it asks first, and
/// refuses without a terminal to ask on unless --yes.
fn release_ends_a_held_lock(url: &str) {
    let marks = Marks::new();
    let d = marks.dir.path().display().to_string();
    let mut holder = dlock(url)
        .args(["run", "--key", "jobs:stuck", "--lease", "3s", "--"])
        .args(script(&format!(
            "trap 'touch {d}/termed; exit 0' TERM; touch {d}/started; while :; do sleep 0.02; done"
        )))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    until("the holder started", || marks.has("started"));
    let unconfirmed = output(dlock(url).args(["release", "--force", "jobs:stuck"]));
    assert_eq!(code(unconfirmed.status), 64, "{unconfirmed:?}");
    assert!(String::from_utf8_lossy(&unconfirmed.stderr).contains("--yes"));
    let unforced = output(dlock(url).args(["release", "jobs:stuck", "--yes"]));
    assert_eq!(code(unforced.status), 64, "{unforced:?}");
    assert!(
        holder.try_wait().unwrap().is_none(),
        "still held and running"
    );

    let released = output(dlock(url).args(["release", "--force", "jobs:stuck", "--yes"]));
    assert_eq!(code(released.status), 0, "{released:?}");
    assert!(String::from_utf8_lossy(&released.stdout).contains("ended the lock `jobs:stuck`"));
    let started = Instant::now();
    assert_eq!(code(wait(&mut holder)), 79);
    assert!(marks.has("termed"));
    // At its next renewal (a third of the 3 s lease), not at the lease's end.
    assert!(
        started.elapsed() < Duration::from_millis(2400),
        "{:?}",
        started.elapsed()
    );
    let again = output(dlock(url).args(["release", "--force", "jobs:stuck", "--yes"]));
    assert_eq!(code(again.status), 1, "{again:?}");
}

#[test]
fn sqlite_release_force_ends_a_held_lock() {
    let dir = tempfile::tempdir().unwrap();
    release_ends_a_held_lock(&sqlite_url(dir.path()));
}

/// On a terminal, `release --force` asks, and only a yes ends the lock.
#[test]
fn release_asks_on_a_terminal() {
    if Command::new("script").arg("--version").output().is_err() {
        dlock_testkit::not_run(
            "no script(1) here",
            "install util-linux; `bash .ci/run` runs where it is",
        );
    }
    let dir = tempfile::tempdir().unwrap();
    let url = sqlite_url(dir.path());
    let marks = Marks::new();
    let mut holder = dlock(&url)
        .args(["run", "--key", "k", "--lease", "3s", "--"])
        .args(marks.holder("holder", 0))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    until("the holder started", || marks.has("holder.started"));
    let answer = |text: &str| {
        let mut child = Command::new("script")
            .args([
                "-qec",
                &format!("{} release --force k", env!("CARGO_BIN_EXE_dlock")),
                "/dev/null",
            ])
            .env("DLOCK_URL", &url)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("script runs");
        std::io::Write::write_all(child.stdin.as_mut().unwrap(), text.as_bytes()).unwrap();
        child.wait_with_output().unwrap()
    };
    let declined = answer("n\n");
    let shown = String::from_utf8_lossy(&declined.stdout);
    assert_eq!(code(declined.status), 1, "{shown}");
    assert!(
        shown.contains("End the lock `k`") && shown.contains("[y/N]"),
        "{shown}"
    );
    assert!(
        holder.try_wait().unwrap().is_none(),
        "a declined release ended nothing"
    );
    let confirmed = answer("y\n");
    let shown = String::from_utf8_lossy(&confirmed.stdout);
    assert_eq!(code(confirmed.status), 0, "{shown}");
    assert_eq!(code(wait(&mut holder)), 79);
}
