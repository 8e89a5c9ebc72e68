//! Build-time switches of the test suite.
//!
//! No SQL Server or Oracle server can run on the machines this suite is developed and checked
//! on, so their live tests (`tests/mssql.rs`, `tests/oracle.rs`) run only against a server
//! named by `DLOCK_MSSQL_URL` / `DLOCK_ORACLE_URL`. Whether that variable is set decides, at
//! build time, whether those tests are compiled as ignored (`cargo test` then lists them as
//! `ignored, DLOCK_MSSQL_URL is not set ...` and counts them as ignored, not passed). Cargo
//! rebuilds the tests whenever either variable changes, so
//! `DLOCK_MSSQL_URL=... cargo test --features mssql --test mssql` runs them.

/// Each variable and the `cfg` it sets when it is set and not empty.
const LIVE_SERVERS: &[(&str, &str)] = &[
    ("DLOCK_MSSQL_URL", "dlock_mssql_live"),
    ("DLOCK_ORACLE_URL", "dlock_oracle_live"),
];

fn main() {
    println!("cargo::rerun-if-changed=build.rs");
    for (variable, cfg) in LIVE_SERVERS {
        println!("cargo::rerun-if-env-changed={variable}");
        println!("cargo::rustc-check-cfg=cfg({cfg})");
        if std::env::var_os(variable).is_some_and(|value| !value.is_empty()) {
            println!("cargo::rustc-cfg={cfg}");
        }
    }
}
