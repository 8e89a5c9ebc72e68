//! The report's rows, the printed table, `benches/RESULTS.md` and `benches/results.svg`.

use std::fmt::Write as _;
use std::path::PathBuf;

/// What a figure must be.
#[derive(Debug, Clone, Copy)]
pub enum Target {
    AtMost(f64),
    AtLeast(f64),
    None,
}

impl Target {
    fn met(self, value: f64) -> Option<bool> {
        if !value.is_finite() {
            return None;
        }
        match self {
            Target::AtMost(t) => Some(value <= t),
            Target::AtLeast(t) => Some(value >= t),
            Target::None => None,
        }
    }

    fn show(self, unit: &str) -> String {
        match self {
            Target::AtMost(t) => format!("≤ {}{unit}", trim(t)),
            Target::AtLeast(t) => format!("≥ {}{unit}", trim(t)),
            Target::None => "—".to_owned(),
        }
    }
}

fn trim(v: f64) -> String {
    if v >= 100.0 || v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

/// A duration in nanoseconds, in a readable unit.
pub fn time(ns: f64) -> String {
    if !ns.is_finite() {
        "—".to_owned()
    } else if ns < 1_000.0 {
        format!("{ns:.1} ns")
    } else if ns < 1_000_000.0 {
        format!("{:.1} µs", ns / 1e3)
    } else {
        format!("{:.2} ms", ns / 1e6)
    }
}

/// One line of the report.
pub struct Row {
    section: String,
    name: String,
    figure: String,
    target: String,
    met: Option<bool>,
    /// For the chart: the ratio and its target.
    ratio: Option<(f64, Target)>,
    /// A finite figure was produced.
    measured: bool,
    /// Not measured for a reason that is not a failure (the server's binary is not
    /// installed, or quick mode leaves the part out).
    excused: bool,
}

impl Row {
    /// A measured figure against its target.
    pub fn figure(section: &str, name: &str, value: f64, unit: &str, target: Target) -> Row {
        let figure = match unit {
            "ns" => time(value),
            _ if value.is_finite() => format!("{} {unit}", trim(value)),
            _ => "—".to_owned(),
        };
        let target_text = match (unit, target) {
            ("ns", Target::AtMost(t)) => format!("≤ {}", time(t)),
            ("ns", Target::AtLeast(t)) => format!("≥ {}", time(t)),
            _ => target.show(&format!(" {unit}")),
        };
        Row {
            section: section.to_owned(),
            name: name.to_owned(),
            figure,
            target: target_text,
            met: target.met(value),
            ratio: None,
            measured: value.is_finite(),
            excused: false,
        }
    }

    /// A ratio `a / b` of times per operation against its target: the median of the
    /// ratios of the rounds (each pair measured back to back), beside each side's median.
    pub fn ratio(
        section: &str,
        name: &str,
        (a_name, a): (&str, &[f64]),
        (b_name, b): (&str, &[f64]),
        target: Target,
    ) -> Row {
        let pairs: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
        let r = crate::measure::median(&pairs);
        let (a, b) = (crate::measure::median(a), crate::measure::median(b));
        Row {
            section: section.to_owned(),
            name: name.to_owned(),
            figure: format!("{:.2}× ({a_name} {} / {b_name} {})", r, time(a), time(b)),
            target: target.show("×"),
            met: target.met(r),
            ratio: r.is_finite().then_some((r, target)),
            measured: r.is_finite() && a.is_finite() && b.is_finite(),
            excused: false,
        }
    }

    /// A ratio of two rates (higher is better) against its target.
    pub fn rate_ratio(section: &str, name: &str, text: String, r: f64, target: Target) -> Row {
        Row {
            section: section.to_owned(),
            name: name.to_owned(),
            figure: text,
            target: target.show("×"),
            met: target.met(r),
            ratio: r.is_finite().then_some((r, target)),
            measured: r.is_finite(),
            excused: false,
        }
    }

    /// A figure shown as `text`, whose `value` (in ns when `unit` is "ns") is held to
    /// `target`.
    pub fn text_figure(
        section: &str,
        name: &str,
        text: String,
        value: f64,
        unit: &str,
        target: Target,
    ) -> Row {
        let mut row = Row::figure(section, name, value, unit, target);
        row.figure = text;
        row
    }

    /// A figure without a numeric target.
    pub fn info(section: &str, name: &str, figure: String) -> Row {
        Row {
            section: section.to_owned(),
            name: name.to_owned(),
            figure,
            target: "—".to_owned(),
            met: None,
            ratio: None,
            measured: true,
            excused: false,
        }
    }

    /// A figure shown as `text` (several values, words), checked against its target by
    /// `value` (its one number the target applies to; NaN when not measured).
    pub fn described(
        section: &str,
        name: &str,
        text: String,
        value: f64,
        unit: &str,
        target: Target,
    ) -> Row {
        Row {
            section: section.to_owned(),
            name: name.to_owned(),
            figure: text,
            target: target.show(&format!(" {unit}")),
            met: target.met(value),
            ratio: None,
            measured: value.is_finite(),
            excused: false,
        }
    }

    /// Not measured, and why (one line).
    pub fn not_measured(section: &str, name: &str, why: &str, target: &str) -> Row {
        let why = why.lines().next().unwrap_or("").trim();
        let why: String = why.chars().take(160).collect();
        Row {
            section: section.to_owned(),
            name: name.to_owned(),
            figure: format!("not measured: {why}"),
            target: target.to_owned(),
            met: None,
            ratio: None,
            measured: false,
            excused: false,
        }
    }

    /// Marks a row not measured as no failure when `excused` (see [`Row::excused`]).
    pub fn excused_if(mut self, excused: bool) -> Row {
        self.excused = excused;
        self
    }

    fn status(&self) -> &'static str {
        match self.met {
            Some(true) => "met",
            Some(false) => "missed",
            None if self.figure.starts_with("not measured") => "n/a",
            None => "—",
        }
    }
}

/// Everything the run found.
pub struct Report {
    rows: Vec<Row>,
    env: Vec<(String, String)>,
    notes: Vec<String>,
}

impl Report {
    pub fn new() -> Report {
        let mut report = Report {
            rows: Vec::new(),
            env: Vec::new(),
            notes: Vec::new(),
        };
        let date = std::process::Command::new("date")
            .args(["-u", "+%Y-%m-%d %H:%M UTC"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default();
        report.env("date", date);
        let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
        let model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|t| {
                t.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_owned())
            })
            .unwrap_or_else(|| "unknown".to_owned());
        report.env("CPUs (nproc)", cpus.to_string());
        report.env("CPU model", model);
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_owned())
            .unwrap_or_default();
        report.env("kernel", kernel);
        report
    }

    pub fn env(&mut self, name: &str, value: String) {
        self.env.push((name.to_owned(), value));
    }

    pub fn note(&mut self, note: String) {
        self.notes.push(note);
    }

    pub fn add(&mut self, row: Row) {
        // A partial run keeps only the sections it chose ("7. Peers..." is section 7).
        let number = row.section.split('.').next().and_then(|n| n.parse().ok());
        if number.is_some_and(|n| !crate::measure::section(n)) {
            return;
        }
        eprintln!(
            "  {} | {} | {} | {}",
            row.name,
            row.figure,
            row.target,
            row.status()
        );
        self.rows.push(row);
    }

    /// Prints the table and writes the files `RESULTS.md` and `results.svg` in [`out_dir`].
    pub fn finish(mut self) {
        self.rows.sort_by(|a, b| a.section.cmp(&b.section));
        let markdown = self.markdown();
        println!("{markdown}");
        let dir = out_dir();
        let md = dir.join("RESULTS.md");
        let svg = dir.join("results.svg");
        if let Err(e) = std::fs::write(&md, &markdown) {
            eprintln!("could not write {}: {e}", md.display());
        }
        if let Err(e) = std::fs::write(&svg, self.svg()) {
            eprintln!("could not write {}: {e}", svg.display());
        }
        println!("wrote {} and {}", md.display(), svg.display());
    }

    /// Quick mode's check: every section has rows, and every row has its figure, unless it
    /// is excused (a server not installed, a part quick mode leaves out). Timings and
    /// targets are not checked. The problems, one a line; none when all is well.
    pub fn problems(&self, sections: &[&str]) -> Vec<String> {
        let mut problems = Vec::new();
        for section in sections {
            if !self.rows.iter().any(|r| r.section == *section) {
                problems.push(format!("section \"{section}\" has no rows"));
            }
        }
        for row in &self.rows {
            if !row.measured && !row.excused {
                let what = if row.figure.starts_with("not measured") {
                    row.figure.clone()
                } else {
                    format!("no finite figure ({})", row.figure)
                };
                problems.push(format!("{} | {}: {what}", row.section, row.name));
            }
        }
        problems
    }

    fn markdown(&self) -> String {
        let mut out = String::new();
        out.push_str("# dlock benchmark report\n\n");
        let features = ["postgres", "mysql", "redis", "etcd"]
            .into_iter()
            .zip([
                cfg!(feature = "postgres"),
                cfg!(feature = "mysql"),
                cfg!(feature = "redis"),
                cfg!(feature = "etcd"),
            ])
            .filter_map(|(name, on)| on.then_some(name))
            .collect::<Vec<_>>()
            .join(" ");
        out.push_str(&format!(
            "Generated by `cargo bench --bench report` (root package `dlock-suite`, features \
             `{features}`; the servers are throwaway ones the run spawns on loopback). \
             Compared figures come from interleaved rounds (A, B, A, B, ...) and are medians.\n\n",
        ));
        if crate::measure::quick() {
            out.push_str(
                "**Quick run** (`-- --quick`): every section with tiny sizes, to check that \
                 each figure is produced. Its figures mean nothing.\n\n",
            );
        }
        out.push_str(HOW_TO_READ);
        out.push_str("\n\n");
        out.push_str("![ratios against their targets](results.svg)\n\n");
        out.push_str("## Machine\n\n| | |\n|---|---|\n");
        for (k, v) in &self.env {
            let _ = writeln!(out, "| {k} | {v} |");
        }
        out.push('\n');
        let mut section = "";
        for row in &self.rows {
            if row.section != section {
                section = &row.section;
                let _ = write!(
                    out,
                    "\n## {section}\n\n| measurement | figure | target | |\n|---|---|---|---|\n"
                );
            }
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} |",
                row.name,
                row.figure,
                row.target,
                row.status()
            );
        }
        if !self.notes.is_empty() {
            out.push_str("\n## Notes\n\n");
            for n in &self.notes {
                let _ = writeln!(out, "- {n}");
            }
        }
        out
    }

    /// A horizontal bar per ratio, with its target as a tick; green when met.
    fn svg(&self) -> String {
        let bars: Vec<(&Row, f64, Target)> = self
            .rows
            .iter()
            .filter_map(|r| r.ratio.map(|(v, t)| (r, v, t)))
            .collect();
        let (label_w, bar_w, row_h, top) = (430.0, 420.0, 22.0, 40.0);
        let max = bars
            .iter()
            .flat_map(|(_, v, t)| {
                [
                    *v,
                    match t {
                        Target::AtMost(x) | Target::AtLeast(x) => *x,
                        Target::None => 0.0,
                    },
                ]
            })
            .fold(1.5f64, f64::max)
            .min(4.0)
            * 1.05;
        let x = |v: f64| label_w + (v.min(max) / max) * bar_w;
        let height = top + row_h * bars.len() as f64 + 40.0;
        let width = label_w + bar_w + 90.0;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(
            s,
            r##"<rect width="100%" height="100%" fill="#ffffff"/><text x="10" y="22" font-size="15" font-weight="bold">dlock: ratios against their targets (tick = target; green = met, red = missed, grey = no target)</text>"##
        );
        for (i, (row, v, t)) in bars.iter().enumerate() {
            let y = top + row_h * i as f64;
            let colour = match t.met(*v) {
                Some(true) => "#3a9d3a",
                Some(false) => "#c83737",
                None => "#8a8a8a",
            };
            let label = format!("{}: {}", short(&row.section), row.name);
            let _ = writeln!(
                s,
                r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
                label_w - 8.0,
                y + 15.0,
                escape(&label)
            );
            let _ = writeln!(
                s,
                r#"<rect x="{label_w}" y="{}" width="{:.1}" height="{}" fill="{colour}"/>"#,
                y + 4.0,
                x(*v) - label_w,
                row_h - 8.0
            );
            if let Target::AtMost(t) | Target::AtLeast(t) = t {
                let _ = writeln!(
                    s,
                    r##"<line x1="{0:.1}" x2="{0:.1}" y1="{1}" y2="{2}" stroke="#000" stroke-width="2"/>"##,
                    x(*t),
                    y + 1.0,
                    y + row_h - 1.0
                );
            }
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{}">{:.2}× ({})</text>"#,
                x(*v).max(x(match t {
                    Target::AtMost(t) | Target::AtLeast(t) => *t,
                    Target::None => 0.0,
                })) + 6.0,
                y + 15.0,
                v,
                match t {
                    Target::None => "no target".to_owned(),
                    _ => t.show("×"),
                }
            );
        }
        let axis_y = top + row_h * bars.len() as f64 + 4.0;
        let _ = writeln!(
            s,
            r##"<line x1="{label_w}" x2="{}" y1="{axis_y}" y2="{axis_y}" stroke="#888"/>"##,
            label_w + bar_w
        );
        let mut tick = 0.0;
        while tick <= max {
            let _ = writeln!(
                s,
                r##"<text x="{:.1}" y="{}" text-anchor="middle" fill="#555">{tick:.1}×</text>"##,
                x(tick),
                axis_y + 16.0
            );
            tick += 0.5;
        }
        s.push_str("</svg>\n");
        s
    }
}

/// Where a run writes its files: `benches/`, or in quick mode `dlock-report-quick/` under
/// the target directory and in a run of some sections only (`--only=...`)
/// `dlock-report-partial/`, so that such a run never replaces the published report.
pub fn out_dir() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let sub = if crate::measure::quick() {
        "dlock-report-quick"
    } else if crate::measure::partial() {
        "dlock-report-partial"
    } else {
        return root.join("benches");
    };
    let dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
        .join(sub);
    if let Err(e) = std::fs::create_dir_all(&dir) {
        eprintln!("could not create {}: {e}", dir.display());
    }
    dir
}

/// The report's opening paragraph for a newcomer.
const HOW_TO_READ: &str = "**How to read this.** Each row is one measurement made by this run on \
    the machine below. A ratio `A / B` compares two ways of doing the same work, run in \
    alternating batches (A, B, A, B, ...) so that the machine's load hits both alike: below \
    1.00× A took less time than B, above it more; the times in brackets are each side's median \
    per operation. `dlock / raw` sets dlock beside the same statements or commands sent \
    straight through the driver, so it is what dlock's layer costs; `peer / dlock` above 1.00× \
    means the other crate is slower than dlock. The target column is the project's goal for \
    the figure, and the last column says whether this run met it (`n/a`: not measured, and the \
    figure says why). Absolute times follow the machine and its load: compare ratios between \
    runs rather than times, and quote figures only from a run on a quiet machine. The notes \
    at the end say how each section measures.";

/// "1. Uncontended ..." → "1".
fn short(section: &str) -> &str {
    section.split('.').next().unwrap_or(section)
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}
