//! Interleaved timed rounds: each contender runs a batch in turn (A, B, C, A, B, C, ...), the
//! order rotating every round, and the per-operation times of its batches are kept.

use std::sync::OnceLock;
use std::time::Duration;

static QUICK: OnceLock<bool> = OnceLock::new();

/// Quick mode (`-- --quick`, or `DLOCK_REPORT_QUICK=1`): every section with tiny sizes, to
/// check that each figure is still produced; timings mean nothing then.
pub fn quick() -> bool {
    *QUICK.get_or_init(|| {
        std::env::args().any(|a| a == "--quick")
            || std::env::var("DLOCK_REPORT_QUICK").is_ok_and(|v| !v.is_empty() && v != "0")
    })
}

static ONLY: OnceLock<Option<(Vec<String>, Vec<String>)>> = OnceLock::new();

/// A partial run's choice (`-- --only 1,8 --backend mysql,redis`, or `DLOCK_REPORT_ONLY` and
/// `DLOCK_REPORT_BACKENDS`): the sections (numbers, or the start of a cost curve's name:
/// `curves`, `curves-held`, `curves-keys`, `curves-waiters`, `curves-providers`, `curves-hot`)
/// and the backends (lowercase parts of their labels) it measures; `None` for a full run. An
/// empty list chooses all of its kind.
fn only() -> &'static Option<(Vec<String>, Vec<String>)> {
    ONLY.get_or_init(|| {
        let args: Vec<String> = std::env::args().collect();
        let value = |flag: &str, var: &str| -> Option<String> {
            let eq = format!("{flag}=");
            args.iter()
                .enumerate()
                .find_map(|(i, a)| {
                    a.strip_prefix(&eq)
                        .map(str::to_owned)
                        .or_else(|| (a == flag).then(|| args.get(i + 1).cloned()).flatten())
                })
                .or_else(|| std::env::var(var).ok().filter(|v| !v.is_empty()))
        };
        let list = |v: &Option<String>| -> Vec<String> {
            v.iter()
                .flat_map(|v| v.split(','))
                .map(|s| s.trim().to_lowercase())
                .filter(|s| !s.is_empty())
                .collect()
        };
        let sections = value("--only", "DLOCK_REPORT_ONLY");
        let backends = value("--backend", "DLOCK_REPORT_BACKENDS");
        if sections.is_none() && backends.is_none() {
            return None;
        }
        Some((list(&sections), list(&backends)))
    })
}

/// Whether this run measures only some sections or backends: its table then goes under the
/// target directory, never over the report.
pub fn partial() -> bool {
    only().is_some()
}

/// Whether this run measures section `n`.
pub fn section(n: u32) -> bool {
    only()
        .as_ref()
        .is_none_or(|(sections, _)| sections.is_empty() || sections.contains(&n.to_string()))
}

/// Whether this run measures the cost curve named `name` (`curves-held`, ...): chosen by any
/// start of its name (`curves` chooses all five). The group `curves` is measured when any of
/// its curves is chosen (`curves-held` alone runs the group for that one curve).
pub fn section_named(name: &str) -> bool {
    only().as_ref().is_none_or(|(sections, _)| {
        sections.is_empty()
            || sections
                .iter()
                .any(|s| name.starts_with(s.as_str()) || s.starts_with(&format!("{name}-")))
    })
}

/// Whether this run measures the backend labelled `label` ("MySQL 9", "Redis 7", ...).
pub fn backend(label: &str) -> bool {
    let label = label.to_lowercase();
    only().as_ref().is_none_or(|(_, backends)| {
        backends.is_empty() || backends.iter().any(|b| label.contains(b.as_str()))
    })
}

/// `full` in a normal run, `tiny` in quick mode.
pub fn sized<T>(full: T, tiny: T) -> T {
    if quick() { tiny } else { full }
}

/// Runs `n` operations and says how long they took, or why it could not.
pub type Batch<'a> = dyn FnMut(u64) -> Result<Duration, String> + 'a;

/// One side of a comparison.
pub struct Contender<'a, 'b> {
    pub name: &'static str,
    pub batch: &'b mut Batch<'a>,
}

impl<'a, 'b> Contender<'a, 'b> {
    pub fn new(name: &'static str, batch: &'b mut Batch<'a>) -> Self {
        Contender { name, batch }
    }
}

/// Warms each contender up, sizes its batches to about `batch_time`, then runs `rounds`
/// interleaved rounds. Per contender: the nanoseconds per operation of each round, or the
/// error that stopped it (it then sits out the remaining rounds).
pub fn interleave(
    contenders: &mut [Contender<'_, '_>],
    rounds: usize,
    batch_time: Duration,
) -> Vec<Result<Vec<f64>, String>> {
    let mut sizes = Vec::new();
    let mut results: Vec<Result<Vec<f64>, String>> = Vec::new();
    for c in contenders.iter_mut() {
        // Warm-up: a few operations, then enough for ~batch_time / 4 to size the batches.
        let size = (c.batch)(5).and_then(|d| {
            let per_op = (d.as_secs_f64() / 5.0).max(1e-9);
            let n = ((batch_time.as_secs_f64() / 4.0) / per_op).clamp(1.0, 1e8) as u64;
            let d = (c.batch)(n)?;
            let per_op = (d.as_secs_f64() / n as f64).max(1e-9);
            Ok(((batch_time.as_secs_f64() / per_op) as u64).clamp(3, 100_000_000))
        });
        match size {
            Ok(n) => {
                sizes.push(n);
                results.push(Ok(Vec::with_capacity(rounds)));
            }
            Err(e) => {
                eprintln!("  {}: {e}", c.name);
                sizes.push(0);
                results.push(Err(e));
            }
        }
    }
    let k = contenders.len();
    for round in 0..rounds {
        for i in 0..k {
            let idx = (i + round) % k;
            let Ok(samples) = &mut results[idx] else {
                continue;
            };
            let n = sizes[idx];
            match (contenders[idx].batch)(n) {
                Ok(d) => samples.push(d.as_nanos() as f64 / n as f64),
                Err(e) => {
                    eprintln!("  {}: {e}", contenders[idx].name);
                    results[idx] = Err(e);
                }
            }
        }
    }
    results
}

/// The median (NaN for no samples).
pub fn median(samples: &[f64]) -> f64 {
    quantile(samples, 0.5)
}

/// The `q` quantile by nearest rank (NaN for no samples).
pub fn quantile(samples: &[f64], q: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    let mut v = samples.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}
