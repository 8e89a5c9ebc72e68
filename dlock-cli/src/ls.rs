//! `dlock ls`: the locks held in the store.

use std::time::Duration;

use dlock::StoreLock;

use crate::Store;
use crate::cli::LsArgs;

pub(crate) async fn ls(store: &Store, args: LsArgs) -> u8 {
    let locks = match store.connect().await {
        Ok(locks) => locks,
        Err(code) => return code,
    };
    if let (Some(key), Some(max_count)) = (&args.semaphore, args.permits) {
        let holders = match locks.semaphore_holders(key, max_count).await {
            Ok(holders) => holders,
            Err(err) => return store.fail(&err),
        };
        if args.json {
            println!(
                "{}",
                serde_json::json!({
                    "semaphore": key,
                    "max_count": max_count,
                    "holders": holders,
                })
            );
        } else {
            let key = key.escape_debug().to_string();
            let width = "SEMAPHORE".len().max(key.chars().count());
            println!("{:<width$}  HOLDERS  MAX", "SEMAPHORE");
            println!("{key:<width$}  {holders:<7}  {max_count}");
        }
        return 0;
    }
    let held = match locks.store_locks().await {
        Ok(held) => held,
        Err(err) => return store.fail(&err),
    };
    let rows: Vec<Row> = held
        .iter()
        .map(Row::of)
        .filter(|row| {
            args.prefix
                .as_deref()
                .is_none_or(|prefix| row.key.starts_with(prefix))
        })
        .collect();
    if args.json {
        for row in &rows {
            println!("{}", row.json());
        }
    } else {
        print_table(&rows);
    }
    0
}

/// One lock as `ls` shows it.
struct Row {
    /// The key, or what the store calls the lock when it does not keep keys.
    key: String,
    resource: String,
    owner: Option<String>,
    since: Option<std::time::SystemTime>,
    lease_left: Option<Duration>,
    fencing_token: Option<u64>,
    readers: u32,
}

impl Row {
    fn of(lock: &StoreLock) -> Row {
        Row {
            key: lock.key.clone().unwrap_or_else(|| lock.resource.clone()),
            resource: lock.resource.clone(),
            owner: lock.owner().map(str::to_owned),
            since: lock.since(),
            lease_left: lock.remaining_lease,
            fencing_token: lock.fencing_token,
            readers: lock.readers,
        }
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "key": self.key,
            "resource": self.resource,
            "owner": self.owner,
            "since": self.since.map(|since| humantime::format_rfc3339_seconds(since).to_string()),
            "lease_left_ms": self.lease_left.map(|left| u64::try_from(left.as_millis()).unwrap_or(u64::MAX)),
            "fencing_token": self.fencing_token,
            "readers": self.readers,
        })
    }

    fn cells(&self) -> [String; 6] {
        let or_dash = |value: Option<String>| value.unwrap_or_else(|| "-".to_owned());
        [
            self.key.escape_debug().to_string(),
            or_dash(
                self.owner
                    .as_ref()
                    .map(|owner| owner.escape_debug().to_string()),
            ),
            or_dash(
                self.since
                    .map(|since| humantime::format_rfc3339_seconds(since).to_string()),
            ),
            or_dash(self.lease_left.map(|left| {
                // Whole milliseconds: the store's reckoning is no finer.
                let left = Duration::from_millis(u64::try_from(left.as_millis()).unwrap_or(0));
                humantime::format_duration(left).to_string()
            })),
            or_dash(self.fencing_token.map(|token| token.to_string())),
            self.readers.to_string(),
        ]
    }
}

fn print_table(rows: &[Row]) {
    const HEADER: [&str; 6] = ["KEY", "OWNER", "SINCE", "LEASE LEFT", "TOKEN", "READERS"];
    let cells: Vec<[String; 6]> = rows.iter().map(Row::cells).collect();
    let mut widths = HEADER.map(str::len);
    for row in &cells {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |row: &[&str]| {
        let mut text = String::new();
        for (i, (cell, width)) in row.iter().zip(widths).enumerate() {
            if i + 1 == row.len() {
                text.push_str(cell);
            } else {
                text.push_str(&format!("{cell:<width$}  "));
            }
        }
        println!("{}", text.trim_end());
    };
    line(&HEADER);
    for row in &cells {
        line(&row.iter().map(String::as_str).collect::<Vec<_>>());
    }
}
