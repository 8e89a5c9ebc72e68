//! A fixture whose server binary is missing fails the test, with `CI` set and without it: a test
//! that could not run never counts as passed. Each case runs a starter in a child process of
//! this test binary (the `starter` test, ignored unless named) with the fixture's variable
//! pointing at no file, or with an empty PATH, and checks that the child failed with the
//! fixture's "not run" message.

use std::process::Command;

/// The variable that tells the `starter` test which fixture to start.
const CASE: &str = "DLOCK_TESTKIT_NOT_RUN_CASE";

/// Starts the fixture `DLOCK_TESTKIT_NOT_RUN_CASE` names; run only as the child of the cases
/// below, which set up its environment so that the fixture's binary is missing.
#[test]
#[ignore = "the child process of the not-run cases of this file, which run it by name"]
fn starter() {
    let case = std::env::var(CASE).expect("run by a case of this file");
    match case.as_str() {
        #[cfg(feature = "redis")]
        "redis8" => drop(dlock_testkit::redis::RedisServer::start(
            dlock_testkit::redis::Flavor::Redis8,
        )),
        #[cfg(feature = "redis")]
        "redis7" => drop(dlock_testkit::redis::RedisServer::start(
            dlock_testkit::redis::Flavor::Redis7,
        )),
        #[cfg(feature = "redis")]
        "cluster" => drop(dlock_testkit::redis::RedisCluster::start()),
        #[cfg(feature = "etcd")]
        "etcd" => drop(dlock_testkit::etcd::EtcdCluster::start(1)),
        #[cfg(feature = "postgres")]
        "postgres" => drop(dlock_testkit::postgres::PgServer::start()),
        #[cfg(feature = "mysql")]
        "mysql" => drop(dlock_testkit::mysql::DbServer::start(
            dlock_testkit::mysql::Flavor::MySql,
        )),
        other => panic!("no case {other} in this build"),
    }
    panic!("the {case} fixture returned: its missing binary did not fail the test");
}

/// Runs the `starter` test for `case` in a child with `env` set (and `CI` as `ci` says), and
/// checks that it failed with `message`.
fn fails_as_not_run(case: &str, env: &[(&str, &str)], message: &str) {
    for ci in [false, true] {
        let mut child = Command::new(std::env::current_exe().expect("this test binary"));
        child
            .args(["starter", "--exact", "--ignored", "--nocapture"])
            .env(CASE, case);
        for variable in [
            "DLOCK_REDIS7_SERVER",
            "DLOCK_REDIS8_SERVER",
            "DLOCK_ETCD_SERVER",
            "DLOCK_POSTGRES_SERVER",
            "DLOCK_MYSQL_CHROOT",
        ] {
            child.env_remove(variable);
        }
        child.envs(env.iter().copied());
        if ci {
            child.env("CI", "true");
        } else {
            child.env_remove("CI");
        }
        let out = child.output().expect("run the starter");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            !out.status.success(),
            "{case} (CI {ci}): a missing binary passed: {text}"
        );
        assert!(
            text.contains(message),
            "{case} (CI {ci}): the failure does not say `{message}`: {text}"
        );
        assert!(
            text.contains("1 failed") && !text.contains("1 passed"),
            "{case} (CI {ci}): {text}"
        );
    }
}

/// An empty directory for PATH: no server binary (nor `redis-cli`) is found there.
fn empty_dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("a temp dir")
}

#[cfg(feature = "redis")]
#[test]
fn a_redis_binary_named_but_missing_fails() {
    fails_as_not_run(
        "redis8",
        &[("DLOCK_REDIS8_SERVER", "/nonexistent/redis8-server")],
        "not run: no Redis 8 server binary here (DLOCK_REDIS8_SERVER=/nonexistent/redis8-server \
         is not a file: point it at the binary, or unset it and run `bash .ci/run`, which \
         installs the servers)",
    );
}

#[cfg(feature = "redis")]
#[test]
fn a_redis_binary_not_installed_fails() {
    let dir = empty_dir();
    let path = dir.path().to_str().expect("a UTF-8 temp dir");
    fails_as_not_run(
        "redis7",
        &[("PATH", path)],
        "not run: no Redis 7 server binary here (set DLOCK_REDIS7_SERVER or run `bash .ci/run`, \
         which installs the servers)",
    );
}

#[cfg(feature = "redis")]
#[test]
fn a_cluster_without_redis_cli_fails() {
    let dir = empty_dir();
    let path = dir.path().to_str().expect("a UTF-8 temp dir");
    fails_as_not_run(
        "cluster",
        &[("PATH", path)],
        "not run: no redis-cli on PATH here (run `bash .ci/run`, which installs the servers)",
    );
}

#[cfg(feature = "etcd")]
#[test]
fn an_etcd_binary_named_but_missing_fails() {
    fails_as_not_run(
        "etcd",
        &[("DLOCK_ETCD_SERVER", "/nonexistent/etcd")],
        "not run: no etcd server binary here (DLOCK_ETCD_SERVER=/nonexistent/etcd is not a file",
    );
}

#[cfg(feature = "postgres")]
#[test]
fn a_postgres_binary_named_but_missing_fails() {
    fails_as_not_run(
        "postgres",
        &[("DLOCK_POSTGRES_SERVER", "/nonexistent/postgres")],
        "not run: no PostgreSQL server binary here (DLOCK_POSTGRES_SERVER=/nonexistent/postgres \
         is not a file",
    );
}

#[cfg(feature = "mysql")]
#[test]
fn a_missing_mysql_chroot_fails() {
    fails_as_not_run(
        "mysql",
        &[("DLOCK_MYSQL_CHROOT", "/nonexistent/sid")],
        "not run: no MySQL 9 server here (no MySQL chroot at /nonexistent/sid",
    );
}
