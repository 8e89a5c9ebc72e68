//! The `sqlite://` URL.

use super::*;

pub(super) const FORM: UrlForm = UrlForm {
    backend: "SQLite",
    schemes: &["sqlite"],
    example: "sqlite://locks.db (relative) or sqlite:///var/lib/app/locks.db (absolute)",
};

url_keys! {
    /// The SQLite URL options.
    pub(super) enum SqliteOption for FORM {
        Lease = "lease",
        BusyTimeout = "busy_timeout",
        RenewEvery = "renew_every",
        FencingCounters = "fencing_counters",
    }
}

pub(super) fn parse_url(url: &str) -> Result<SqliteBuilder, LockError> {
    // The scheme is case-insensitive, as in every URL (`LockProvider::connect` picks the
    // backend that way too).
    let (rest, query) = FORM.split(url)?;
    let path = rest.strip_prefix("//").unwrap_or(rest);
    if path.is_empty() {
        return Err(FORM.error("names no file"));
    }
    if path == ":memory:" || path.contains("mode=memory") {
        return Err(LockError::config(
            "an in-memory SQLite database cannot share locks between processes; name a file, such as `sqlite://locks.db`",
        ));
    }
    let mut builder = SqliteBackend::builder(path);
    read_query(query, |key: SqliteOption, value| {
        let name = key.as_ref();
        match key {
            SqliteOption::Lease => builder.lease = parse_duration(name, &value)?,
            SqliteOption::BusyTimeout => builder.busy_timeout = parse_duration(name, &value)?,
            SqliteOption::RenewEvery => builder.renew_every = Some(parse_duration(name, &value)?),
            SqliteOption::FencingCounters => {
                builder.fencing_counters = Some(crate::counters::parse(name, &value)?);
            }
        }
        Ok(())
    })?;
    builder.check()?;
    Ok(builder)
}

pub(super) fn check_lease(lease: Duration) -> Result<(), LockError> {
    crate::lease::check_lease("the SQLite lease (renewed every third of it)", lease).map(drop)
}
