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

/// A library source's path below `dlock/src/` (`mysql/session.rs`), as the lists below name it.
fn source_name(path: &std::path::Path) -> &str {
    path.to_str()
        .and_then(|p| p.rsplit_once("dlock/src/"))
        .map_or("", |(_, name)| name)
}

/// Formatted text that mentions SQL and why each is safe, as (file, start of the literal).
const ALLOWED_FORMATS: &[(&str, &str)] = &[
    // The one statement built by formatting: MySQL takes no bound parameter in `KILL`, and its
    // only input is the `u64` connection id the server itself reported.
    ("mysql/statements.rs", "KILL CONNECTION {id}"),
    // Error messages, never executed: which GRANT a DBA has to run, or that a Redis
    // connection was ended with CLIENT KILL (a Redis command sent with bound arguments).
    (
        "oracle/session.rs",
        "{what}: the user may not call DBMS_LOCK",
    ),
    // Which grant a MySQL account needs to list the locks (`store_locks`).
    (
        "mysql/session.rs",
        "listing user locks reads performance_schema",
    ),
    (
        "mssql/statements.rs",
        "fencing=true: this user lacks a privilege",
    ),
    (
        "oracle/statements.rs",
        "fencing=true: this user lacks a privilege",
    ),
    ("redis/mod.rs", "the release timed out after"),
    ("redis/mod.rs", "extending a lock timed out after"),
    ("redis/fence.rs", "CLIENT KILL ID {id} failed"),
    ("redis/fence.rs", "CLIENT KILL ID {id} timed out"),
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

/// The length of the string, raw string or char literal at the start of `text`, if one
/// starts there.
fn literal_len(text: &str) -> Option<usize> {
    let bytes = text.as_bytes();
    match bytes.first()? {
        b'"' => Some(literal_at(&text[1..]).len() + 2),
        b'r' if matches!(bytes.get(1), Some(b'"' | b'#')) => {
            let hashes = text[1..].bytes().take_while(|&b| b == b'#').count();
            let open = 1 + hashes;
            (bytes.get(open) == Some(&b'"')).then_some(())?;
            let close = format!("\"{}", "#".repeat(hashes));
            let at = text[open + 1..].find(&close)?;
            Some(open + 1 + at + close.len())
        }
        // A char literal ('(' or '\'') and not a lifetime ('a).
        b'\'' => {
            let body = &text[1..];
            let skip = if body.starts_with('\\') {
                2
            } else {
                body.chars().next()?.len_utf8()
            };
            body.get(skip..)?.starts_with('\'').then_some(skip + 2)
        }
        _ => None,
    }
}

/// The arguments of a call whose opening parenthesis precedes `text`, up to its closing
/// parenthesis: split at commas outside nested brackets and literals, trimmed, each with its
/// offset in `text`.
fn arguments(text: &str) -> Vec<(usize, String)> {
    let mut depth = 0usize;
    let (mut out, mut from, mut i) = (Vec::new(), 0, 0);
    let mut push = |from: usize, to: usize| {
        let raw = &text[from..to];
        let arg = raw.trim();
        if !arg.is_empty() {
            out.push((from + raw.find(arg).unwrap_or(0), arg.to_owned()));
        }
    };
    while i < text.len() {
        if let Some(len) = literal_len(&text[i..]) {
            i += len;
            continue;
        }
        let c = text[i..].chars().next().expect("in bounds");
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' if depth > 0 => depth -= 1,
            ',' | ')' if depth == 0 => {
                push(from, i);
                if c == ')' {
                    return out;
                }
                from = i + 1;
            }
            _ => {}
        }
        i += c.len_utf8();
    }
    push(from, text.len());
    out
}

/// The first argument of a call whose opening parenthesis precedes `text`.
fn first_argument(text: &str) -> String {
    arguments(text)
        .into_iter()
        .next()
        .map(|(_, arg)| arg)
        .unwrap_or_default()
}

/// No `format!` (or `write!`, `format_args!`) in the library makes text that looks like SQL, apart
/// from the allow-listed one; so no SQL can carry a key, a URL part or any other user data.
#[test]
fn no_sql_is_built_by_formatting() {
    let mut found = Vec::new();
    for (path, text) in library_sources() {
        let file = source_name(&path);
        // `concat!` is not among them: it joins literals (and macros that expand to literals)
        // at compile time, so the compiler itself keeps run-time data out of what it makes.
        for macro_name in ["format!(", "write!(", "writeln!(", "format_args!("] {
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
    assert_eq!(
        first_argument(r#""SELECT a, b FROM t", x)"#),
        r#""SELECT a, b FROM t""#
    );
    assert_eq!(first_argument(r##"r#"a ")" b"#, x)"##), r##"r#"a ")" b"#"##);
    assert_eq!(first_argument("params![a, b], c)"), "params![a, b]");
    assert_eq!(first_argument("')', x)"), "')'");
    assert_eq!(first_argument(r"'\'', x)"), r"'\''");
    assert_eq!(first_argument("f::<'a>(y), x)"), "f::<'a>(y)");
}

/// Functions that take SQL text as their first argument: sqlx's, called as `sqlx::query(..)`
/// or, imported, as `query(..)`, and tiberius's `Query::new`.
const SQL_FUNCTIONS: &[&str] = &[
    "Query::new",
    "query",
    "query_as",
    "query_scalar",
    "query_with",
    "query_as_with",
    "query_scalar_with",
    "raw_sql",
];

/// Methods that take SQL text as their first argument in at least one of the drivers the
/// library uses: sqlx (the `Executor` methods), rusqlite (`Connection` and `Transaction`),
/// tiberius (`Client`) and oracle (`Connection`). The same names on other types take an
/// executor, bind values or a Redis command (`Query::execute`, `Statement::execute`,
/// `.fetch_one(&mut conn)`): the scan tells those apart by the argument, and an argument it
/// cannot place fails the test. Called by path (`Executor::execute(conn, sql)`), their second
/// argument is the first one of the method.
const SQL_METHODS: &[&str] = &[
    // sqlx
    "query",
    "execute",
    "execute_many",
    "fetch",
    "fetch_all",
    "fetch_many",
    "fetch_one",
    "fetch_optional",
    "prepare",
    "prepare_with",
    "describe",
    // rusqlite
    "execute_batch",
    "prepare_cached",
    "query_row",
    "query_row_and_then",
    "query_one",
    // tiberius
    "simple_query",
    // oracle
    "execute_named",
    "query_named",
    "query_as_named",
    "query_row_named",
    "query_row_as",
    "query_row_as_named",
    "statement",
    "batch",
];

/// rusqlite's pragma helpers build `PRAGMA name = value` from their arguments: every argument
/// must be a constant or a literal.
const PRAGMA_CALLS: &[&str] = &[
    "pragma",
    "pragma_query",
    "pragma_query_value",
    "pragma_update",
    "pragma_update_and_check",
];

/// Expressions handed to a driver as SQL that are constants though the scan cannot see it from
/// the expression alone: (file, expression, and the file and declaration that show it, which
/// the test checks are there).
const NAMED: &[(&str, &str, &str, &str)] = &[
    // A `&'static str` chosen between two constants by server kind.
    (
        "mysql/session.rs",
        "server.session_sql()",
        "mysql/session.rs",
        "fn session_sql(&self) -> &'static str {",
    ),
    // The KILL statement allowed by `no_sql_is_built_by_formatting`.
    (
        "mysql/session.rs",
        "sqlx::AssertSqlSafe(kill)",
        "mysql/session.rs",
        "let kill = kill_sql(target.id);",
    ),
    // SQL Server's fencing table statement is a `Call`, as below.
    (
        "mssql/session.rs",
        "create.sql",
        "mssql/statements.rs",
        "    pub(crate) sql: &'static str,",
    ),
    // Oracle's two privilege probes of the fencing table, both constants.
    (
        "oracle/session.rs",
        "check",
        "oracle/session.rs",
        "for check in [FENCING_UPDATE_CHECK_SQL, FENCING_INSERT_CHECK_SQL] {",
    ),
    // PostgreSQL's statements of one lock mode: `&'static str` fields of `ModeSql`, set from
    // constants by `mode_sql` (the exclusive statements or their `_shared` forms).
    (
        "postgres/session.rs",
        "sql.try_lock",
        "postgres/statements.rs",
        "    pub(super) try_lock: &'static str,",
    ),
    (
        "postgres/session.rs",
        "sql.try_fenced",
        "postgres/statements.rs",
        "    pub(super) try_fenced: &'static str,",
    ),
    (
        "postgres/session.rs",
        "sql.wait",
        "postgres/statements.rs",
        "    pub(super) wait: &'static str,",
    ),
    (
        "postgres/session.rs",
        "sql.wait_fenced",
        "postgres/statements.rs",
        "    pub(super) wait_fenced: &'static str,",
    ),
    (
        "postgres/session.rs",
        "sql.unlock",
        "postgres/statements.rs",
        "    pub(super) unlock: &'static str,",
    ),
    (
        "postgres/session.rs",
        "sql.try_counted",
        "postgres/statements.rs",
        "    pub(super) try_counted: &'static str,",
    ),
    (
        "postgres/session.rs",
        "sql.wait_counted",
        "postgres/statements.rs",
        "    pub(super) wait_counted: &'static str,",
    ),
    // PostgreSQL's permit statement: one of three constants, by fencing mode.
    (
        "postgres/session.rs",
        "permit_sql",
        "postgres/session.rs",
        "let permit_sql = if self.counted.is_some() {",
    ),
    // SQLite's release statement: one of two constants, by counter mode.
    (
        "sqlite/mod.rs",
        "self.shared.release_sql()",
        "sqlite/mod.rs",
        "fn release_sql(&self) -> &'static str {",
    ),
    (
        "sqlite/mod.rs",
        "self.release_sql()",
        "sqlite/mod.rs",
        "fn release_sql(&self) -> &'static str {",
    ),
    // `Call::sql` is a `&'static str`, set from constants in each backend's statements (and
    // the library leaks no String into a `&'static str`, checked below).
    (
        "oracle/session.rs",
        "call.sql",
        "oracle/statements.rs",
        "    pub(super) sql: &'static str,",
    ),
    (
        "mssql/session.rs",
        "call.sql",
        "mssql/statements.rs",
        "    pub(crate) sql: &'static str,",
    ),
];

/// Arguments of those calls that are not SQL text, by the name they have in one file.
const NOT_SQL: &[(&str, &str)] = &[
    // `returning_one(statement, params: impl rusqlite::Params)` steps a prepared statement.
    ("sqlite/file.rs", "params"),
];

/// What a call's argument is, as far as SQL goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Argument {
    /// SQL text that is a constant, a literal or a named constant expression.
    Constant,
    /// Not SQL at all: an executor, bind values, a Redis command.
    NotSql,
    /// Anything else: possibly SQL built at run time.
    Unknown,
}

/// The length of the bracketed group (`(..)`, `[..]`, `{..}`) at the start of `text`.
fn group_len(text: &str) -> Option<usize> {
    let mut depth = 0usize;
    let mut i = 0;
    while i < text.len() {
        if let Some(len) = literal_len(&text[i..]) {
            i += len;
            continue;
        }
        let c = text[i..].chars().next()?;
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => {
                depth = depth.checked_sub(1)?;
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ if i == 0 => return None,
            _ => {}
        }
        i += c.len_utf8();
    }
    None
}

/// Whether `expr` is, as a whole, `prefix` followed by one bracketed group: `[a, b]`,
/// `params![..]`, `redis::cmd("SET")`; not `[..].concat()`.
fn is_whole(expr: &str, prefix: &str) -> bool {
    expr.strip_prefix(prefix)
        .is_some_and(|rest| group_len(rest) == Some(rest.len()))
}

/// Whether `expr` is a constant's path (`ACQUIRE_SQL`, `statements::KEEPALIVE_SQL`).
fn is_constant(expr: &str) -> bool {
    let last = expr.rsplit("::").next().unwrap_or("");
    !expr.is_empty()
        && expr
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
        && last.starts_with(|c: char| c.is_ascii_uppercase())
        && last
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
}

/// Classifies the argument `arg` of a call at byte `at` of `text` (file `file`), following a
/// plain variable to the `let` that made it (a variable bound otherwise, such as a function's
/// parameter, is unknown unless `NOT_SQL` names it).
fn classify(file: &str, text: &str, at: usize, arg: &str, depth: usize) -> Argument {
    let arg = arg.trim();
    if NAMED.iter().any(|(f, a, _, _)| *f == file && *a == arg) {
        return Argument::Constant;
    }
    if NOT_SQL.iter().any(|(f, a)| *f == file && *a == arg) {
        return Argument::NotSql;
    }
    if arg.starts_with("&mut ") || arg.starts_with("&mut*") {
        return Argument::NotSql;
    }
    let bare = arg.trim_start_matches(['&', '*']).trim();
    let number = bare.starts_with(|c: char| c.is_ascii_digit())
        && bare
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
    if literal_len(bare).is_some_and(|len| len == bare.len()) || is_constant(bare) || number {
        return Argument::Constant;
    }
    // Bind values (an array, a tuple, rusqlite's `params!`) and Redis commands.
    if bare == "None"
        || [
            "",
            "params!",
            "rusqlite::params!",
            "named_params!",
            "rusqlite::named_params!",
            "redis::cmd",
            "redis::Cmd::new",
            "Cmd::new",
            "redis::pipe",
        ]
        .iter()
        .any(|prefix| is_whole(bare, prefix))
    {
        return Argument::NotSql;
    }
    let is_ident = !bare.is_empty()
        && bare.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
        && !bare.starts_with(|c: char| c.is_ascii_digit());
    if !is_ident || depth > 3 {
        return Argument::Unknown;
    }
    // The nearest `let NAME = ...;` (or `let mut NAME: T = ...;`) before the call.
    let before = &text[..at];
    let binding = [format!("let {bare}"), format!("let mut {bare}")]
        .into_iter()
        .filter_map(|pattern| {
            let mut end = before.len();
            while let Some(found) = before[..end].rfind(&pattern) {
                if before[found + pattern.len()..].starts_with([' ', ':', '=']) {
                    return Some((found, pattern.len(), pattern.starts_with("let mut")));
                }
                end = found;
            }
            None
        })
        .max();
    if let Some((found, len, mutable)) = binding {
        let rest = &before[found + len..];
        let Some(eq) = rest.find('=') else {
            return Argument::Unknown;
        };
        let ty = rest[..eq].trim().trim_start_matches(':');
        if ["ToSql", "Params", "Cmd"].iter().any(|t| ty.contains(t)) {
            return Argument::NotSql;
        }
        let value = rest[eq + 1..].split(';').next().unwrap_or("");
        return match classify(file, text, found, value, depth + 1) {
            // Mutable text may have been changed since.
            Argument::Constant if mutable => Argument::Unknown,
            class => class,
        };
    }
    Argument::Unknown
}

/// The argument of a call that may carry SQL text.
#[derive(Debug)]
struct Site {
    /// `path:line`.
    place: String,
    /// The function or method called.
    name: String,
    /// The argument, as written.
    arg: String,
    /// Where the argument starts in its file's text.
    offset: usize,
    class: Argument,
}

/// Every call site in `sources` of a function or method that takes SQL text, with the
/// argument that carries the text and what that argument is.
fn sql_call_sites(sources: &[(PathBuf, String)]) -> Vec<Site> {
    let mut sites = Vec::new();
    for (path, text) in sources {
        let file = source_name(path);
        let mut names: Vec<&str> = SQL_FUNCTIONS
            .iter()
            .chain(SQL_METHODS)
            .chain(PRAGMA_CALLS)
            .copied()
            .collect();
        names.sort_unstable();
        names.dedup();
        for name in names {
            let function = SQL_FUNCTIONS.contains(&name);
            let method = SQL_METHODS.contains(&name) || PRAGMA_CALLS.contains(&name);
            for (at, _) in text.match_indices(name) {
                let before = &text[..at];
                if before.ends_with(|c: char| c.is_ascii_alphanumeric() || c == '_')
                    || before.ends_with("fn ")
                {
                    continue;
                }
                // The argument that carries the text: the first, or for a method called by
                // path (`Executor::execute(conn, sql)`), the one after the receiver. A method
                // name called bare is a local function; one called by path with a single
                // argument, a constructor of another type (`Failure::statement(error)`).
                let skip = if let Some(path) = before.strip_suffix("::") {
                    let segment = path
                        .rsplit(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        .next()
                        .unwrap_or("");
                    if function && (segment == "sqlx" || !method) {
                        0
                    } else {
                        1
                    }
                } else if before.ends_with('.') {
                    if !method {
                        continue;
                    }
                    0
                } else if function {
                    0
                } else {
                    continue;
                };
                let mut after = &text[at + name.len()..];
                if after.starts_with("::<") {
                    // A turbofish: `query_as::<_, (i32,)>(`.
                    let Some(open) = after.find(">(") else {
                        continue;
                    };
                    after = &after[open + 1..];
                }
                let Some(after) = after.strip_prefix('(') else {
                    continue;
                };
                let base = text.len() - after.len();
                let arguments = arguments(after);
                let line = text[..at].matches('\n').count() + 1;
                let place = format!("{}:{line}", path.display());
                let checked = if PRAGMA_CALLS.contains(&name) {
                    arguments.len()
                } else {
                    1
                };
                for (offset, arg) in arguments.into_iter().skip(skip).take(checked) {
                    sites.push(Site {
                        place: place.clone(),
                        name: name.to_owned(),
                        class: classify(file, text, at, &arg, 0),
                        arg,
                        offset: base + offset,
                    });
                }
            }
        }
    }
    sites
}

/// Every statement handed to a driver is a constant, a literal, or one of a few named
/// expressions that are themselves constants; never a value computed from input. Every call
/// site of every function or method that takes SQL text in any of the drivers is examined;
/// an argument that is neither provably constant SQL nor provably not SQL fails the test.
#[test]
fn statements_are_constants() {
    let sources = library_sources();
    let sites = sql_call_sites(&sources);
    let unknown: Vec<String> = sites
        .iter()
        .filter(|site| site.class == Argument::Unknown)
        .map(|site| format!("{}: {}({}", site.place, site.name, site.arg))
        .collect();
    assert!(
        unknown.is_empty(),
        "statements that are not constants:\n{}",
        unknown.join("\n")
    );
    // What makes each named expression a constant is still there.
    for (file, expr, proof_file, proof) in NAMED {
        assert!(
            sources
                .iter()
                .any(|(path, text)| path.ends_with(proof_file) && text.contains(proof)),
            "{file}: `{expr}` is no longer shown constant by `{proof}` in {proof_file}"
        );
    }
    // No String is leaked into a `&'static str` (which would make a formatted statement look
    // like a constant to the named expressions above).
    for (path, text) in &sources {
        assert!(
            !text.contains(".leak()") && !text.contains("Box::leak"),
            "{} leaks a String",
            path.display()
        );
    }
    // The scan sees the SQL of every driver.
    for file in ["sqlite/", "postgres/", "mysql/", "mssql/", "oracle/"] {
        let n = sites
            .iter()
            .filter(|site| {
                site.class == Argument::Constant && site.place.contains(&format!("/{file}"))
            })
            .count();
        assert!(n > 0, "no statement found in {file}");
    }
}

/// A statement made with `format!` is found at every kind of call site: each SQL-taking name,
/// called as a method, as a path and with a turbofish, with the formatted text passed directly,
/// through a variable, or as `as_str()`; and the forms that are not SQL pass.
#[test]
fn the_scan_finds_formatted_sql_at_every_kind_of_call_site() {
    let formatted = r#"&format!("SELECT v FROM t WHERE k = '{key}'")"#;
    let mut planted = 0;
    let calls = SQL_FUNCTIONS.iter().map(|name| (name, true)).chain(
        SQL_METHODS
            .iter()
            .chain(PRAGMA_CALLS)
            .map(|name| (name, false)),
    );
    for (name, function) in calls {
        // The pragma helpers take a schema first; their name and value carry the text.
        let first = if PRAGMA_CALLS.contains(name) {
            "None, "
        } else {
            ""
        };
        let call = |receiver: &str, text: &str, rest: &str| {
            if function {
                format!("{receiver}{name}({text}{rest})")
            } else {
                format!("{receiver}.{name}({first}{text}{rest})")
            }
        };
        let receiver = if function { "sqlx::" } else { "conn" };
        let mut forms = vec![
            ("direct", call(receiver, formatted, ", []")),
            (
                "variable",
                format!(
                    "let sql = format!(\"DELETE FROM t WHERE k = '{{key}}'\");\n    {}",
                    call(receiver, "&sql", ", params![key]")
                ),
            ),
            (
                "as_str",
                format!(
                    "let sql = key.to_owned();\n    {}",
                    call(receiver, "sql.as_str()", ", &p")
                ),
            ),
            (
                "multi-line",
                call(
                    receiver,
                    &format!("\n            {formatted}"),
                    ",\n            &params,\n        ",
                ),
            ),
            (
                "concatenated",
                call(
                    receiver,
                    r#"&["SELECT v FROM t WHERE k = '", key, "'"].concat()"#,
                    "",
                ),
            ),
            (
                "reassigned",
                format!(
                    "let mut sql = ACQUIRE_SQL;\n    let text = format!(\"{{sql}} {{key}}\");\n    sql = &text;\n    {}",
                    call(receiver, "sql", "")
                ),
            ),
        ];
        if function {
            forms.push(("imported", format!("{name}({formatted})")));
            forms.push(("turbofish", format!("sqlx::{name}::<_, i64>({formatted})")));
        } else {
            forms.push((
                "turbofish",
                format!("conn.{name}::<i64>({first}{formatted}, &[])"),
            ));
            forms.push((
                "by path",
                format!("Executor::{name}(&mut conn, {first}{formatted})"),
            ));
        }
        for (form, body) in forms {
            let source = format!("fn planted(key: &str) {{\n    {body};\n}}\n");
            let sites = sql_call_sites(&[(PathBuf::from("dlock/src/planted.rs"), source.clone())]);
            assert!(
                sites
                    .iter()
                    .any(|s| s.name == *name && s.class == Argument::Unknown),
                "{name} ({form}) not caught: {sites:?}\n{source}"
            );
            planted += 1;
        }
    }
    assert_eq!(
        planted,
        (SQL_FUNCTIONS.len() + SQL_METHODS.len() + PRAGMA_CALLS.len()) * 8
    );
    // What is not SQL passes.
    let fine = r#"fn fine(conn: &mut C, stmt: &mut S, key: &str) {
    stmt.query((key, 1));
    sqlx::query(ACQUIRE_SQL).bind(key).execute(&mut *conn);
    stmt.execute(params![key]);
    conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()));
    client.query(statements::KEEPALIVE_SQL, &[]);
    let mut set = redis::cmd("SET");
    self.query(&set);
    conn.pragma_update(None, "synchronous", "NORMAL");
    let values: Vec<&dyn ToSql> = Vec::new();
    statement.execute(&values);
    sqlx::query_scalar::<_, i64>(r"SELECT 1, 2").fetch_one(&mut conn);
}
"#;
    let sites = sql_call_sites(&[(PathBuf::from("dlock/src/fine.rs"), fine.to_owned())]);
    let unknown: Vec<_> = sites
        .iter()
        .filter(|s| s.class == Argument::Unknown)
        .collect();
    assert!(unknown.is_empty(), "{unknown:?}");
    assert_eq!(
        sites
            .iter()
            .filter(|s| s.class == Argument::Constant)
            .count(),
        6,
        "{sites:?}"
    );
}

/// Every statement the library really hands to a driver is watched: replacing the argument of
/// each such call site with a formatted string makes the scan fail there.
#[test]
fn the_scan_catches_formatted_sql_planted_at_each_real_call_site() {
    let sources = library_sources();
    let statements: Vec<Site> = sql_call_sites(&sources)
        .into_iter()
        .filter(|site| site.class == Argument::Constant)
        .collect();
    for site in &statements {
        let mut planted = sources.clone();
        let (_, text) = planted
            .iter_mut()
            .find(|(path, _)| site.place.starts_with(&format!("{}:", path.display())))
            .expect("the site's file");
        assert!(text[site.offset..].starts_with(&site.arg));
        text.replace_range(
            site.offset..site.offset + site.arg.len(),
            r#"&format!("SELECT v FROM t WHERE k = '{}'", key)"#,
        );
        let caught = sql_call_sites(&planted)
            .into_iter()
            .any(|s| s.place == site.place && s.name == site.name && s.class == Argument::Unknown);
        assert!(
            caught,
            "{}: formatted SQL in place of `{}({}` not caught",
            site.place, site.name, site.arg
        );
    }
    assert!(
        statements.len() >= 40,
        "only {} statements found",
        statements.len()
    );
    eprintln!(
        "formatted SQL caught at each of the {} call sites that pass SQL",
        statements.len()
    );
}

/// Owner tokens never leave the library: whatever a lock's life lets out (everything logged at
/// TRACE by any thread, the metrics, every error's text and `Debug`, the `Debug` of providers,
/// backends and guards, and the layer's problem responses) is searched for the tokens the
/// store holds, read back from it, in every form they could take (hex either case, `Debug` of
/// the bytes, escaped bytes, the bytes as text).
mod secrecy {
    use std::time::Duration;

    use dlock_testkit::Captured;

    use dlock::{LockError, LockProvider};
    use opentelemetry::metrics::MeterProvider as _;
    use opentelemetry_sdk::metrics::{InMemoryMetricExporter, PeriodicReader, SdkMeterProvider};

    /// What a test saw leave the library.
    pub struct Exposure {
        texts: Vec<String>,
        meters: SdkMeterProvider,
        exporter: InMemoryMetricExporter,
        logs: Captured,
    }

    impl Exposure {
        pub fn new() -> Exposure {
            let exporter = InMemoryMetricExporter::default();
            let meters = SdkMeterProvider::builder()
                .with_reader(PeriodicReader::builder(exporter.clone()).build())
                .build();
            Exposure {
                texts: Vec::new(),
                meters,
                exporter,
                logs: super::support::logs(tracing::Level::TRACE, true),
            }
        }

        /// A provider on `backend` that records its metrics here.
        pub fn provider(&self, backend: impl dlock::backend::LockBackend) -> LockProvider {
            LockProvider::builder(backend)
                .meter(self.meters.meter("dlock"))
                .metric_key_prefix(true)
                .build()
        }

        pub fn debug(&mut self, value: &dyn std::fmt::Debug) {
            self.texts.push(format!("{value:?} {value:#?}"));
        }

        #[cfg_attr(not(feature = "redis"), allow(dead_code))]
        pub fn text(&mut self, text: String) {
            self.texts.push(text);
        }

        /// The error's text, its `Debug`, and its sources'.
        pub fn error(&mut self, err: &LockError) {
            self.texts.push(format!("{err} {err:?}"));
            let mut source = std::error::Error::source(err);
            while let Some(inner) = source {
                self.texts.push(format!("{inner} {inner:?}"));
                source = inner.source();
            }
        }

        /// Fails if any of `tokens` shows anywhere; `key` must show in the logs (the capture
        /// works).
        pub fn assert_hides(&self, tokens: &[Vec<u8>], key: &str) {
            self.meters.force_flush().unwrap();
            let metrics = format!("{:?}", self.exporter.get_finished_metrics().unwrap());
            assert!(
                metrics.contains("distributed_lock.acquisitions"),
                "the metrics were recorded"
            );
            let logged = self.logs.text();
            assert!(logged.contains(key), "the logs were captured");
            let everything = [logged, metrics, self.texts.join("\n")];
            for token in tokens {
                // 128 random bits: raw bytes (SQLite), or 32 hex characters (Redis).
                let hex = token.len() == 32 && token.iter().all(u8::is_ascii_hexdigit);
                assert!(token.len() == 16 || hex, "a 128-bit token: {token:?}");
                let lower: String = token.iter().map(|b| format!("{b:02x}")).collect();
                let mut forms = vec![
                    lower.clone(),
                    lower.to_uppercase(),
                    format!("{token:?}"),
                    format!("{:?}", token.as_slice()),
                    token.escape_ascii().to_string(),
                ];
                if let Ok(text) = std::str::from_utf8(token) {
                    forms.push(text.to_owned());
                    forms.push(text.to_uppercase());
                }
                for form in forms {
                    for (what, text) in ["logs", "metrics", "errors and Debug"]
                        .iter()
                        .zip(&everything)
                    {
                        assert!(
                            !text.contains(&form),
                            "token {lower} shown in the {what} as {form}"
                        );
                    }
                }
            }
        }
    }

    /// A lock's life on `locks`, with `other` (another provider on the same store) contending:
    /// taken, refused to `other` (held, timed out), released; taken again and taken over behind
    /// the holder's back (`steal`), noticed, released with `Lost`. Every error and `Debug` is
    /// noted. Returns the tokens `token` read from the store while each lock was held.
    pub async fn life_of_a_lock(
        exposure: &mut Exposure,
        locks: &LockProvider,
        other: &LockProvider,
        key: &str,
        token: impl AsyncFn(&str) -> Vec<u8>,
        steal: impl AsyncFn(&str),
    ) -> Vec<Vec<u8>> {
        let mut tokens = Vec::new();
        let guard = locks.acquire(key, Duration::from_secs(5)).await.unwrap();
        tokens.push(token(key).await);
        exposure.debug(&guard);
        exposure.debug(locks);
        for outcome in [
            other.try_acquire(key).await,
            other.acquire(key, Duration::from_millis(100)).await,
        ] {
            exposure.error(&outcome.expect_err("the key is held"));
        }
        guard.release().await.unwrap();

        let guard = locks.acquire(key, Duration::from_secs(5)).await.unwrap();
        tokens.push(token(key).await);
        steal(key).await;
        tokio::time::timeout(Duration::from_secs(5), guard.lost_token().cancelled())
            .await
            .expect("the loss is noticed");
        exposure.debug(&guard);
        exposure.error(
            &guard
                .release()
                .await
                .expect_err("a lost lock reports its loss"),
        );
        tokens
    }
}

/// SQLite: the owner column of the lock's row.
#[cfg(feature = "sqlite")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_owner_tokens_never_leave_the_library() {
    use std::time::Duration;

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("locks.db");
    let open = || async {
        dlock::sqlite::SqliteBackend::builder(&path)
            .lease(Duration::from_millis(600))
            .open()
            .await
            .unwrap()
    };
    let mut exposure = secrecy::Exposure::new();
    let backend = open().await;
    exposure.debug(&backend);
    let locks = exposure.provider(backend);
    let other = exposure.provider(open().await);
    let key = dlock_testkit::unique_key("secret");
    let row = |key: &str| {
        let conn = rusqlite::Connection::open(&path).unwrap();
        (conn, key.as_bytes().to_vec())
    };
    let tokens = secrecy::life_of_a_lock(
        &mut exposure,
        &locks,
        &other,
        &key,
        async |key| {
            let (conn, name) = row(key);
            conn.query_row(
                "SELECT owner FROM __distributed_locks WHERE name = ?1",
                [name],
                |r| r.get::<_, Vec<u8>>(0),
            )
            .unwrap()
        },
        async |key| {
            let (conn, name) = row(key);
            let changed = conn
                .execute(
                    "UPDATE __distributed_locks SET owner = X'00' WHERE name = ?1",
                    [name],
                )
                .unwrap();
            assert_eq!(changed, 1);
        },
    )
    .await;
    exposure.assert_hides(&tokens, &key);
}

/// Redis: the value under the lock's key; also the raw-token API's errors.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_tokens_are_never_logged() {
    use dlock::redis::{OwnerToken, RedisBackend};
    use dlock_testkit::redis::{Flavor, RedisServer};

    let Some(server) = RedisServer::start(Flavor::Redis7) else {
        return;
    };
    let mut exposure = secrecy::Exposure::new();
    let backend = RedisBackend::connect(&server.url("lease=600ms"))
        .await
        .unwrap();
    exposure.debug(&backend);
    let locks = exposure.provider(backend.clone());
    let other = exposure.provider(
        RedisBackend::connect(&server.url("lease=600ms"))
            .await
            .unwrap(),
    );
    let key = dlock_testkit::unique_key("secret");
    let conn = server
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let storage = |key: &str| backend.storage_key(key);
    let tokens = secrecy::life_of_a_lock(
        &mut exposure,
        &locks,
        &other,
        &key,
        async |key| {
            redis::cmd("GET")
                .arg(storage(key))
                .query_async::<Vec<u8>>(&mut conn.clone())
                .await
                .unwrap()
        },
        async |key| {
            let () = redis::cmd("SET")
                .arg(storage(key))
                .arg("someone-else")
                .arg("KEEPTTL")
                .query_async(&mut conn.clone())
                .await
                .unwrap();
        },
    )
    .await;
    // The raw-token API, with a token that is not the holder's: nothing of the holder's shows.
    let key = dlock_testkit::unique_key("secret");
    let guard = locks.try_acquire(&key).await.unwrap();
    let held = redis::cmd("GET")
        .arg(storage(&key))
        .query_async::<Vec<u8>>(&mut conn.clone())
        .await
        .unwrap();
    let stranger = OwnerToken::random().unwrap();
    exposure.debug(&backend.release(&key, &stranger).await);
    exposure.debug(
        &backend
            .reset_expiry(&key, &stranger, std::time::Duration::from_secs(1))
            .await,
    );
    exposure.debug(&backend.verify_still_held(&key, &stranger).await);
    exposure.debug(&guard);
    guard.release().await.unwrap();
    let mut all = tokens;
    all.push(held);
    exposure.assert_hides(&all, &key);
}

/// The layer's problem responses (409 while another holds the key, 500 when the handler's lock
/// is lost) carry no owner token, in body or headers.
#[cfg(all(feature = "sqlite", feature = "redis"))]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn problem_responses_never_show_owner_tokens() {
    use std::time::Duration;

    use axum::Router;
    use axum::routing::post;
    use dlock::redis::RedisBackend;
    use dlock_axum::LockLayer;
    use dlock_testkit::redis::{Flavor, RedisServer};

    let Some(server) = RedisServer::start(Flavor::Redis7) else {
        return;
    };
    let mut exposure = secrecy::Exposure::new();
    let backend = RedisBackend::connect(&server.url("lease=600ms"))
        .await
        .unwrap();
    let locks = exposure.provider(backend.clone());
    let app = Router::new()
        .route(
            "/acct/{id}",
            post(|| async {
                // Works until the layer drops it (the lock is lost).
                tokio::time::sleep(Duration::from_secs(30)).await;
                "done"
            }),
        )
        .route_layer(LockLayer::new(locks.clone(), "acct:{id}").timeout(Duration::ZERO));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    let client = reqwest::Client::new();
    let mut conn = server
        .client()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let id = dlock_testkit::unique_key("acct").replace(':', "-");
    let key = format!("acct:{id}");
    let storage = backend.storage_key(&key);
    let token = |conn: &mut redis::aio::MultiplexedConnection| {
        let (storage, mut conn) = (storage.clone(), conn.clone());
        async move {
            redis::cmd("GET")
                .arg(storage)
                .query_async::<Vec<u8>>(&mut conn)
                .await
                .unwrap()
        }
    };
    let answer = |response: reqwest::Response| async move {
        let status = response.status().as_u16();
        let headers = format!("{:?}", response.headers());
        let body = response.text().await.unwrap();
        (status, format!("{headers}\n{body}"))
    };

    // 409: another provider holds the key.
    let holder = exposure.provider(
        RedisBackend::connect(&server.url("lease=600ms"))
            .await
            .unwrap(),
    );
    let held = holder.try_acquire(&key).await.unwrap();
    let mut tokens = vec![token(&mut conn).await];
    let (status, text) = answer(
        client
            .post(format!("http://{address}/acct/{id}"))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(status, 409, "{text}");
    exposure.text(text);
    held.release().await.unwrap();

    // 500: the handler's lock is taken over while it runs.
    let request = tokio::spawn({
        let (client, url) = (client.clone(), format!("http://{address}/acct/{id}"));
        async move { client.post(url).send().await.unwrap() }
    });
    dlock_testkit::wait_until(
        "the handler holds the lock",
        Duration::from_secs(5),
        async || {
            redis::cmd("EXISTS")
                .arg(&storage)
                .query_async::<i64>(&mut conn.clone())
                .await
                .unwrap()
                == 1
        },
    )
    .await;
    tokens.push(token(&mut conn).await);
    let () = redis::cmd("SET")
        .arg(&storage)
        .arg("someone-else")
        .arg("KEEPTTL")
        .query_async(&mut conn)
        .await
        .unwrap();
    let (status, text) = answer(request.await.unwrap()).await;
    assert_eq!(status, 500, "{text}");
    assert!(text.contains("DistributedLock.Lost"), "{text}");
    exposure.text(text);
    exposure.assert_hides(&tokens, &key);
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
            // The server's clock: no key at all.
            if arguments.starts_with("'TIME')") {
                continue;
            }
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
