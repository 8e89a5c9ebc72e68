//! The fairness run: how evenly processes contending for one key are served.
//!
//! `dlock-worker fairness URL KEY [--processes P] [--tasks T] [--seconds S] [--hold-us H]
//! [--permits N]` starts P worker processes (`fair URL KEY T S H N`) of T tasks each. Every
//! task takes KEY (the lock, or with `--permits N` a permit of the semaphore KEY of N),
//! holds it for H µs, gives it back and asks again, for S seconds from a common start (each
//! worker connects, says `ready`, and starts when told `go` on stdin), so the key is always
//! wanted by every process. Each worker prints `waits W,W,...` (µs per acquisition; a wait
//! still going at the end counts up to the end, as a lower bound) and `count N` (sections
//! entered within the S seconds).
//!
//! The run prints one line: `ok processes=P counts=N,N,.. spread=X p50_ms=.. p99_ms=..
//! max_ms=.. p99_over_p50=..`, where `spread` is the largest distance of a process's count
//! from an equal share, as a fraction of that share (0.25 = within 25 %), and the
//! percentiles are over every wait of every process.

use std::time::{Duration, Instant};

use crate::group::{Group, number, ready_then_go};

/// What one run measured.
struct Fairness {
    counts: Vec<usize>,
    waits: Vec<u64>,
}

pub(crate) fn run(url: &str, key: &str, rest: &[&str]) -> Result<(), String> {
    let (mut processes, mut tasks, mut seconds, mut hold_us) = (2usize, 8usize, 5u64, 1000u64);
    let mut permits = 0u32;
    let mut rest = rest.iter();
    while let Some(flag) = rest.next() {
        let value = rest
            .next()
            .ok_or_else(|| format!("{flag} needs a value"))?
            .parse::<u64>()
            .map_err(|e| format!("{flag}: {e}"))?;
        match *flag {
            "--processes" => processes = usize::try_from(value).map_err(|e| e.to_string())?,
            "--tasks" => tasks = usize::try_from(value).map_err(|e| e.to_string())?,
            "--seconds" => seconds = value,
            "--hold-us" => hold_us = value,
            "--permits" => permits = u32::try_from(value).map_err(|e| e.to_string())?,
            other => return Err(format!("unknown option {other}")),
        }
    }
    if processes == 0 || tasks == 0 || seconds == 0 {
        return Err("processes, tasks and seconds must be at least 1".to_owned());
    }
    let mut group = Group::spawn(processes, |_| {
        ["fair", url, key]
            .map(str::to_owned)
            .into_iter()
            .chain([tasks as u64, seconds, hold_us, u64::from(permits)].map(|n| n.to_string()))
            .collect()
    })?;
    group.go()?;
    let mut waits = Vec::new();
    let mut counts = vec![None; processes];
    group.finish(|i, line| {
        if let Some(list) = line.strip_prefix("waits ") {
            for wait in list.split(',').filter(|w| !w.is_empty()) {
                waits.push(wait.parse().map_err(|e| format!("wait {wait:?}: {e}"))?);
            }
        } else if let Some(n) = line.strip_prefix("count ") {
            counts[i] = Some(n.parse().map_err(|e| format!("count {n:?}: {e}"))?);
        }
        Ok(())
    })?;
    let measured = Fairness {
        counts: counts
            .into_iter()
            .map(|c| c.ok_or("a worker printed no count"))
            .collect::<Result<_, _>>()?,
        waits,
    };
    println!("{}", measured.summary(processes));
    Ok(())
}

impl Fairness {
    fn summary(mut self, processes: usize) -> String {
        let total: usize = self.counts.iter().sum();
        let share = total as f64 / processes as f64;
        let spread = self
            .counts
            .iter()
            .map(|&n| (n as f64 - share).abs() / share.max(1.0))
            .fold(0.0, f64::max);
        self.waits.sort_unstable();
        let at = |q: f64| {
            let i = ((self.waits.len() as f64 * q).ceil() as usize).saturating_sub(1);
            self.waits.get(i).copied().unwrap_or(0) as f64 / 1000.0
        };
        let (p50, p99, max) = (at(0.5), at(0.99), at(1.0));
        let counts: Vec<String> = self.counts.iter().map(usize::to_string).collect();
        format!(
            "ok processes={processes} counts={} spread={spread:.3} p50_ms={p50:.2} p99_ms={p99:.2} max_ms={max:.2} p99_over_p50={:.2}",
            counts.join(","),
            p99 / p50.max(1e-3),
        )
    }
}

/// One worker process of the fairness run (see the module docs): permits 0 takes the lock.
pub(crate) async fn worker(
    url: &str,
    key: &str,
    tasks: &str,
    seconds: &str,
    hold_us: &str,
    permits: &str,
) -> Result<(), String> {
    let (tasks, seconds, hold, permits) = (
        number("tasks", tasks)?,
        number("seconds", seconds)?,
        Duration::from_micros(number("hold-us", hold_us)?),
        u32::try_from(number("permits", permits)?).map_err(|e| format!("permits: {e}"))?,
    );
    let locks = dlock::LockProvider::connect(url)
        .await
        .map_err(|e| e.to_string())?;
    ready_then_go()?;
    let end = Instant::now() + Duration::from_secs(seconds);
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..tasks {
        let (locks, key) = (locks.clone(), key.to_owned());
        set.spawn(async move {
            let (mut waits, mut count) = (Vec::new(), 0usize);
            while Instant::now() < end {
                let asked = Instant::now();
                let timeout = end.saturating_duration_since(asked) + Duration::from_secs(30);
                let guard = if permits == 0 {
                    locks.acquire(&key, timeout).await
                } else {
                    locks.acquire_semaphore(&key, permits, timeout).await
                }
                .map_err(|e| format!("acquiring {key}: {e}"))?;
                let got = Instant::now();
                waits.push(got.min(end).saturating_duration_since(asked).as_micros() as u64);
                if got < end {
                    count += 1;
                }
                let until = Instant::now() + hold;
                while Instant::now() < until {
                    tokio::task::yield_now().await;
                }
                guard
                    .release()
                    .await
                    .map_err(|e| format!("releasing {key}: {e}"))?;
            }
            Ok::<_, String>((waits, count))
        });
    }
    let (mut waits, mut count) = (Vec::new(), 0);
    while let Some(done) = set.join_next().await {
        let (w, n) = done.map_err(|e| format!("a task failed: {e}"))??;
        waits.extend(w);
        count += n;
    }
    let waits: Vec<String> = waits.iter().map(u64::to_string).collect();
    println!("waits {}", waits.join(","));
    println!("count {count}");
    Ok(())
}
