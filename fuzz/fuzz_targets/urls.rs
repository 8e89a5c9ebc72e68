//! Connection URL parsing for every backend: any text gives a builder or a typed error,
//! never a panic.
#![no_main]

use dlock::mssql::MssqlBackend;
use dlock::mysql::MySqlBackend;
use dlock::postgres::PostgresBackend;
use dlock::redis::RedisBackend;
use dlock::sqlite::SqliteBackend;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|url: &str| {
    let _ = PostgresBackend::builder_from_url(url);
    let _ = MySqlBackend::builder_from_url(url);
    let _ = RedisBackend::builder_from_url(url);
    let _ = SqliteBackend::builder_from_url(url);
    let _ = MssqlBackend::builder_from_url(url);
    // The same text behind each scheme, so the fuzzer reaches the option parsers quickly.
    for scheme in ["postgres://h/db?", "mysql://h/db?", "redis://h/?", "sqlite://f.db?", "sqlserver://h/db?"] {
        let url = format!("{scheme}{url}");
        let _ = PostgresBackend::builder_from_url(&url);
        let _ = MySqlBackend::builder_from_url(&url);
        let _ = RedisBackend::builder_from_url(&url);
        let _ = SqliteBackend::builder_from_url(&url);
        let _ = MssqlBackend::builder_from_url(&url);
    }
});
