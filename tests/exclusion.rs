//! The exclusion checker: N processes × M tasks take a few hot keys again and again on every
//! backend, each critical section logged with its fencing token; the checker fails on any
//! overlap, non-increasing token, or section without a token (every backend here runs with
//! fencing on, so a token that went missing cannot make "strictly increasing" hold
//! vacuously). CI runs 20,000 exclusive acquisitions per backend, and 4,000 each of the other
//! primitives: read and write locks mixed (on backends with read locks), semaphore slots, and
//! two keys at once. For a soak run outside CI, `cargo run --features postgres,mysql,redis
//! --bin dlock-worker -- exclusion URL PREFIX --soak [--mix rw]` takes 1,000,000.

mod support;

use std::process::Command;

use dlock_testkit::unique_key;
use support::{Fencing, run_exclusion, run_mix, worker_bin};

/// Acquisitions per backend in one run.
const ACQUISITIONS: usize = 20_000;
/// Acquisitions per backend in a run of another primitive.
const OTHERS: usize = 4_000;

/// Which primitives besides the exclusive lock a backend is checked with.
#[derive(Clone, Copy)]
struct Primitives {
    read_locks: bool,
}

/// 4 processes × 8 tasks mixing readers and writers on 2 keys; a semaphore of 3 on 4 keys;
/// two of 4 keys at once. Every section is fenced.
fn others(url: &str, primitives: Primitives) {
    let mut mixes = vec![("semaphore:3", 4), ("many", 4)];
    if primitives.read_locks {
        mixes.push(("rw", 2));
    }
    for (mix, keys) in mixes {
        let summary = run_mix(
            url,
            &unique_key(mix),
            4,
            8,
            keys,
            OTHERS,
            Fencing::Every,
            mix,
        );
        assert!(
            summary.starts_with(&format!("ok sections={OTHERS} ")),
            "{mix}: {summary}"
        );
        assert!(
            summary.contains(&format!(" fenced={OTHERS} ")),
            "{mix}: {summary}"
        );
        if mix != "many" {
            assert!(
                !summary.contains(" shared=0 ") && !summary.contains(" shared=1 "),
                "{mix}: holders never shared a key: {summary}"
            );
        }
    }
}

/// 4 processes × 8 tasks on 4 hot keys, on a backend that issues fencing tokens.
fn storm(url: &str) {
    let summary = run_exclusion(
        url,
        &unique_key("storm"),
        4,
        8,
        4,
        ACQUISITIONS,
        Fencing::Every,
    );
    assert!(
        summary.starts_with(&format!("ok sections={ACQUISITIONS} ")),
        "{summary}"
    );
    assert!(
        summary.contains(&format!(" fenced={ACQUISITIONS} ")),
        "every section carries a token: {summary}"
    );
}

#[test]
fn sqlite() {
    let dir = tempfile::tempdir().unwrap();
    storm(&format!("sqlite://{}/storm.db", dir.path().display()));
}

#[test]
fn sqlite_primitives() {
    let dir = tempfile::tempdir().unwrap();
    others(
        &format!("sqlite://{}/others.db", dir.path().display()),
        Primitives { read_locks: true },
    );
}

#[cfg(feature = "postgres")]
#[test]
fn postgres() {
    let server = dlock_testkit::postgres::PgServer::start();
    storm(&server.url("fencing=true"));
}

#[cfg(feature = "postgres")]
#[test]
fn postgres_primitives() {
    let server = dlock_testkit::postgres::PgServer::start();
    others(&server.url("fencing=true"), Primitives { read_locks: true });
}

#[cfg(feature = "mysql")]
#[test]
fn mariadb() {
    let server = dlock_testkit::mysql::DbServer::start(dlock_testkit::mysql::Flavor::MariaDb)
        .expect("MariaDB server");
    storm(&server.url("fencing=true"));
}

#[cfg(feature = "mysql")]
#[test]
fn mariadb_primitives() {
    let server = dlock_testkit::mysql::DbServer::start(dlock_testkit::mysql::Flavor::MariaDb)
        .expect("MariaDB server");
    others(
        &server.url("fencing=true"),
        Primitives { read_locks: false },
    );
}

#[cfg(feature = "mysql")]
#[test]
fn mysql() {
    let Some(server) = dlock_testkit::mysql::DbServer::start(dlock_testkit::mysql::Flavor::MySql)
    else {
        return;
    };
    storm(&server.url("fencing=true"));
}

#[cfg(feature = "mysql")]
#[test]
fn mysql_primitives() {
    let Some(server) = dlock_testkit::mysql::DbServer::start(dlock_testkit::mysql::Flavor::MySql)
    else {
        return;
    };
    others(
        &server.url("fencing=true"),
        Primitives { read_locks: false },
    );
}

#[cfg(feature = "redis")]
#[test]
fn redis7() {
    let Some(server) =
        dlock_testkit::redis::RedisServer::start(dlock_testkit::redis::Flavor::Redis7)
    else {
        return;
    };
    storm(&server.url(""));
}

#[cfg(feature = "redis")]
#[test]
fn redis7_primitives() {
    let Some(server) =
        dlock_testkit::redis::RedisServer::start(dlock_testkit::redis::Flavor::Redis7)
    else {
        return;
    };
    others(&server.url(""), Primitives { read_locks: true });
}

#[cfg(feature = "redis")]
#[test]
fn valkey9() {
    let Some(server) =
        dlock_testkit::redis::RedisServer::start(dlock_testkit::redis::Flavor::Valkey91)
    else {
        return;
    };
    storm(&server.url(""));
}

#[cfg(feature = "redis")]
#[test]
fn valkey9_primitives() {
    let Some(server) =
        dlock_testkit::redis::RedisServer::start(dlock_testkit::redis::Flavor::Valkey91)
    else {
        return;
    };
    others(&server.url(""), Primitives { read_locks: true });
}

/// The checker itself: a clean log passes, and each kind of violation is named.
#[test]
fn checker_finds_violations() {
    let dir = tempfile::tempdir().unwrap();
    let verify_with = |name: &str, log: &str, sections: usize, fencing: &[&str]| {
        let path = dir.path().join(name);
        std::fs::write(&path, log).unwrap();
        let out = Command::new(worker_bin())
            .arg("verify")
            .arg(&path)
            .arg(sections.to_string())
            .args(fencing)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let verify = |name: &str, log: &str, sections: usize| verify_with(name, log, sections, &[]);
    let clean = "enter a 1.0 1\nenter b 2.0 7\nexit a 1.0\nenter a 2.1 2\nexit b 2.0\nexit a 2.1\n";
    let (ok, text) = verify("clean", clean, 3);
    assert!(ok, "{text}");
    assert!(text.contains("ok sections=3 fenced=3"), "{text}");
    // Readers sharing, then a writer; permits of a native semaphore and of the slot scheme
    // (whose tokens are per slot, so may repeat); a set of two keys.
    let mixed = "read a 1.0 1\nread a 2.0 2\nunread a 2.0\nunread a 1.0\nenter a 3.0 3\nexit a 3.0\n\
                 slot s - 1.0 2 2\nslot s - 2.0 1 2\nunslot s - 1.0\nunslot s - 2.0\n\
                 slot t * 1.0 1 2\nslot t * 2.0 1 2\nunslot t * 1.0\nunslot t * 2.0\n\
                 enter-set 1.0 a 4 b 1\nexit-set 1.0 a b\n";
    let (ok, text) = verify_with("mixed", mixed, 8, &["--fencing", "every"]);
    assert!(ok, "{text}");
    assert!(text.contains("ok sections=8 fenced=8"), "{text}");
    let (ok, text) = verify_with("clean-every", clean, 3, &["--fencing", "every"]);
    assert!(ok, "{text}");
    let unfenced = "enter a 1.0 -\nexit a 1.0\nenter a 2.0 -\nexit a 2.0\n";
    let (ok, text) = verify_with("clean-none", unfenced, 2, &["--fencing", "none"]);
    assert!(ok, "{text}");
    assert!(text.contains("ok sections=2 fenced=0"), "{text}");
    // Tokens that all went missing: fine for a backend without them, a violation for one
    // that issues them.
    let (ok, text) = verify_with("all-missing", unfenced, 2, &["--fencing", "every"]);
    assert!(!ok, "all-missing: the checker passed a log without tokens");
    assert!(
        text.contains("line 1: 1.0 entered a without a fencing token"),
        "{text}"
    );
    let (ok, text) = verify_with("unexpected", clean, 3, &["--fencing", "none"]);
    assert!(
        !ok,
        "unexpected: the checker passed tokens from a backend without them"
    );
    assert!(text.contains("with fencing token 1"), "{text}");
    for (name, log, sections, expected) in [
        (
            "overlap",
            "enter a 1.0 1\nenter a 2.0 2\nexit a 2.0\nexit a 1.0\n",
            2,
            "entered a while 1.0 was inside",
        ),
        (
            "token",
            "enter a 1.0 5\nexit a 1.0\nenter a 2.0 5\nexit a 2.0\n",
            2,
            "fencing token 5 on a after 5",
        ),
        ("stray exit", "exit a 1.0\n", 1, "left a without entering"),
        ("open", "enter a 1.0 1\n", 0, "ends with 1.0 inside a"),
        (
            "missing",
            "enter a 1.0 1\nexit a 1.0\n",
            2,
            "1 sections in the log, 2 expected",
        ),
        ("garbage", "enter a\n", 0, "malformed"),
        (
            "writer among readers",
            "read a 1.0 1\nread a 2.0 2\nenter a 3.0 3\nexit a 3.0\nunread a 1.0\nunread a 2.0\n",
            3,
            "writer 3.0 entered a while reader",
        ),
        (
            "reader under a writer",
            "enter a 1.0 1\nread a 2.0 2\nunread a 2.0\nexit a 1.0\n",
            2,
            "reader 2.0 entered a while writer 1.0 was inside",
        ),
        (
            "writer token below a reader's",
            "read a 1.0 7\nunread a 1.0\nenter a 2.0 5\nexit a 2.0\n",
            2,
            "fencing token 5 on a after 7",
        ),
        (
            "reader token below the writer's",
            "enter a 1.0 7\nexit a 1.0\nread a 2.0 6\nunread a 2.0\n",
            2,
            "reader's fencing token 6 on a after writer's 7",
        ),
        (
            "a reader left inside",
            "read a 1.0 1\n",
            0,
            "ends with 1.0 inside a",
        ),
        (
            "semaphore overfull",
            "slot s - 1.0 1 2\nslot s - 2.0 2 2\nslot s - 3.0 3 2\nunslot s - 1.0\nunslot s - 2.0\nunslot s - 3.0\n",
            3,
            "made 3 holders of semaphore s, of at most 2",
        ),
        (
            "slot scheme overfull",
            "slot s * 1.0 1 2\nslot s * 2.0 1 2\nslot s * 3.0 2 2\nunslot s * 1.0\nunslot s * 2.0\nunslot s * 3.0\n",
            3,
            "made 3 holders of semaphore s, of at most 2",
        ),
        (
            "permit token repeated",
            "slot s - 1.0 4 2\nunslot s - 1.0\nslot s - 2.0 4 2\nunslot s - 2.0\n",
            2,
            "fencing token 4 of semaphore s handed out twice",
        ),
        (
            "semaphore of two sizes",
            "slot s - 1.0 1 2\nunslot s - 1.0\nslot s - 2.0 2 3\nunslot s - 2.0\n",
            2,
            "semaphore s used with two sizes",
        ),
        (
            "bad permit kind",
            "slot s s0 1.0 1 2\nunslot s s0 1.0\n",
            1,
            "malformed",
        ),
        (
            "set overlapping a lock",
            "enter b 1.0 1\nenter-set 2.0 a 1 b 2\nexit-set 2.0 a b\nexit b 1.0\n",
            2,
            "2.0 entered b while 1.0 was inside",
        ),
        ("bad token", "enter a 1.0 x1\nexit a 1.0\n", 1, "malformed"),
        (
            "some missing",
            "enter a 1.0 1\nexit a 1.0\nenter a 2.0 -\nexit a 2.0\nenter a 1.0 3\nexit a 1.0\n",
            3,
            "2 of 3 sections carried a fencing token",
        ),
    ] {
        let (ok, text) = verify(name, log, sections);
        assert!(!ok, "{name}: the checker passed a bad log");
        assert!(text.contains(expected), "{name}: {text}");
    }
}
