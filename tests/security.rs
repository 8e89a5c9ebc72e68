//! Security checks on the library itself: SQL is never built from formatted text, owner tokens
//! are never logged.

mod support;

use std::path::{Path, PathBuf};

/// Every `.rs` file of the library.
fn library_sources() -> Vec<(PathBuf, String)> {
    fn walk(dir: &Path, out: &mut Vec<(PathBuf, String)>) {
        for entry in std::fs::read_dir(dir).expect("read the library's sources") {
            let path = entry.expect("directory entry").path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).expect("read a source file");
                out.push((path, text));
            }
        }
    }
    let mut out = Vec::new();
    walk(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("dlock/src"),
        &mut out,
    );
    assert!(out.len() > 10, "the library's sources were found");
    out
}

/// Words that start or make up a SQL statement (upper case, as the library writes SQL).
const SQL_WORDS: &[&str] = &[
    "SELECT ", "INSERT ", "UPDATE ", "DELETE ", "KILL ", "CREATE ", "DROP ", "ALTER ", "EXEC ",
    "DECLARE ", "BEGIN", "SET ", "GRANT ", "CALL ", "MERGE ", "WITH ", "PRAGMA ", " FROM ",
    " WHERE ",
];

/// Formatted text that mentions SQL and why each is safe, as (file, start of the literal).
const ALLOWED_FORMATS: &[(&str, &str)] = &[
    // The one statement built by formatting: MySQL takes no bound parameter in `KILL`, and its
    // only input is the `u64` connection id the server itself reported.
    ("mysql.rs", "KILL CONNECTION {id}"),
    // An error message that tells the user which GRANT a DBA has to run; never executed.
    ("oracle.rs", "{what}: the user may not call DBMS_LOCK"),
];

/// The string literal that starts at `text` (just after its opening quote), with escapes
/// left as they are.
fn literal_at(text: &str) -> &str {
    let mut escaped = false;
    for (i, c) in text.char_indices() {
        match c {
            '\\' if !escaped => escaped = true,
            '"' if !escaped => return &text[..i],
            _ => escaped = false,
        }
    }
    text
}

/// The first argument of a call whose opening parenthesis precedes `text`: up to the first
/// `,` or `)` outside nested parentheses.
fn first_argument(text: &str) -> String {
    let mut depth = 0usize;
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' if depth > 0 => depth -= 1,
            ',' | ')' if depth == 0 => return text[..i].trim().to_owned(),
            _ => {}
        }
    }
    text.trim().to_owned()
}

/// No `format!` (or `write!`, `concat!`) in the library makes text that looks like SQL, apart
/// from the allow-listed one; so no SQL can carry a key, a URL part or any other user data.
#[test]
fn no_sql_is_built_by_formatting() {
    let mut found = Vec::new();
    for (path, text) in library_sources() {
        let file = path.file_name().and_then(|f| f.to_str()).unwrap_or("");
        for macro_name in [
            "format!(",
            "write!(",
            "writeln!(",
            "concat!(",
            "format_args!(",
        ] {
            for (at, _) in text.match_indices(macro_name) {
                let after = &text[at + macro_name.len()..];
                // The format string: the first literal among the macro's arguments.
                let Some(quote) = after.find('"') else {
                    continue;
                };
                let literal = literal_at(&after[quote + 1..]);
                let sql_like = SQL_WORDS.iter().any(|w| literal.contains(w));
                let allowed = ALLOWED_FORMATS
                    .iter()
                    .any(|(f, l)| *f == file && literal.starts_with(l));
                if sql_like && !allowed {
                    let line = text[..at].lines().count() + 1;
                    found.push(format!(
                        "{}:{line}: {macro_name}\"{literal}\"",
                        path.display()
                    ));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "SQL built by formatting:\n{}",
        found.join("\n")
    );
}

/// The self-check of the scan above: it does see SQL in a formatted string.
#[test]
fn the_scan_sees_formatted_sql() {
    let literal = literal_at(r#"SELECT * FROM t WHERE k = '{key}'", key)"#);
    assert_eq!(literal, "SELECT * FROM t WHERE k = '{key}'");
    assert!(SQL_WORDS.iter().any(|w| literal.contains(w)));
    assert_eq!(literal_at(r#"a \" b" rest"#), r#"a \" b"#);
    assert_eq!(first_argument("f(x), y)"), "f(x)");
    assert_eq!(first_argument(" A_SQL)"), "A_SQL");
}

/// Every statement handed to a driver is a constant, a literal, or one of a few named
/// expressions that are themselves constants; never a value computed from input.
#[test]
fn statements_are_constants() {
    // Calls that take SQL text, and the argument forms allowed besides a SCREAMING_CASE
    // constant or a string literal.
    const CALLS: &[&str] = &[
        "sqlx::query(",
        "sqlx::query_as(",
        "sqlx::query_scalar(",
        "sqlx::query_as::<",
        "sqlx::query_scalar::<",
        ".prepare_cached(",
        ".prepare(",
        ".execute_batch(",
        ".statement(",
    ];
    const NAMED: &[(&str, &str)] = &[
        // A `&'static str` chosen between two constants by server kind.
        ("mysql.rs", "server.session_sql()"),
        // The KILL statement allowed above.
        ("mysql.rs", "&kill"),
        // `Call::sql` is a `&'static str` field set from constants in statements.rs.
        ("oracle.rs", "call.sql"),
    ];
    let mut found = Vec::new();
    for (path, text) in library_sources() {
        let file = path.file_name().and_then(|f| f.to_str()).unwrap_or("");
        for call in CALLS {
            for (at, _) in text.match_indices(call) {
                let mut after = &text[at + call.len()..];
                if call.ends_with("::<") {
                    // Skip the turbofish: `query_as::<_, (i32,)>(`.
                    let Some(open) = after.find(">(") else {
                        continue;
                    };
                    after = &after[open + 2..];
                }
                let argument = first_argument(after);
                let constant = !argument.is_empty()
                    && argument
                        .chars()
                        .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
                let literal = argument.starts_with('"');
                let named = NAMED.iter().any(|(f, a)| *f == file && argument == *a);
                if !(constant || literal || named) {
                    let line = text[..at].lines().count() + 1;
                    found.push(format!("{}:{line}: {call}{argument}", path.display()));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "statements that are not constants:\n{}",
        found.join("\n")
    );
}

/// An owner token never reaches the logs: everything the library logs at every level while a
/// Redis lock is taken, lost (another owner overwrites it) and released is captured, and the
/// token read back from the server appears nowhere in it.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_tokens_are_never_logged() {
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    use dlock::LockProvider;
    use dlock::redis::RedisBackend;
    use support::redis::{Flavor, RedisServer};

    #[derive(Clone, Default)]
    struct Capture(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Capture {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    let Some(server) = RedisServer::start(Flavor::Redis7) else {
        return;
    };
    let capture = Capture::default();
    let writer = capture.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::FULL)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);

    let backend = RedisBackend::connect(&server.url("lease=600ms"))
        .await
        .unwrap();
    let locks = LockProvider::from_backend(backend.clone());
    let key = support::unique_key("secret");
    let storage_key = backend.storage_key(&key);
    let mut conn = server
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let mut tokens = Vec::new();
    // One lock released normally, one lost to another owner.
    for lose in [false, true] {
        let guard = locks.acquire(&key, Duration::from_secs(5)).await.unwrap();
        let value: Vec<u8> = redis::cmd("GET")
            .arg(&storage_key)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert!(!value.is_empty(), "the lock's value is on the server");
        tokens.push(value);
        if lose {
            let _: () = redis::cmd("SET")
                .arg(&storage_key)
                .arg("someone-else")
                .arg("KEEPTTL")
                .query_async(&mut conn)
                .await
                .unwrap();
            tokio::time::timeout(Duration::from_secs(5), guard.lost_token().cancelled())
                .await
                .expect("the loss is noticed");
            assert!(
                guard.release().await.is_err(),
                "a lost lock reports its loss"
            );
        } else {
            guard.release().await.unwrap();
        }
    }
    let logged = String::from_utf8_lossy(&capture.0.lock().unwrap()).into_owned();
    assert!(logged.contains("lost"), "the capture works: {logged}");
    for token in tokens {
        let hex: String = token.iter().map(|b| format!("{b:02x}")).collect();
        assert!(!logged.contains(&hex), "token {hex} logged:\n{logged}");
        if let Ok(text) = std::str::from_utf8(&token) {
            assert!(!logged.contains(text), "token {text} logged:\n{logged}");
        }
    }
}

/// Every key a Lua script touches comes through `KEYS`, never `ARGV` or a built string, so
/// Redis Cluster routes the script and no caller text is ever used as a key name.
#[test]
fn lua_scripts_take_keys_through_keys() {
    let mut calls = 0;
    for (path, text) in library_sources() {
        for (at, _) in text.match_indices("redis.call(") {
            calls += 1;
            let arguments = &text[at + "redis.call(".len()..];
            let key = arguments.split(',').nth(1).unwrap_or("").trim();
            assert!(
                key.starts_with("KEYS["),
                "{}: redis.call with key `{key}`",
                path.display()
            );
        }
    }
    assert!(calls >= 4, "the scripts were found ({calls} calls)");
}
