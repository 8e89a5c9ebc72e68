//! The other lock crates, run by the `benches/peers` workspace in a child process, one JSON
//! line per command. The workspace is built first (`cargo build --release`, in
//! `<target>/peers`), in the background while the servers start: once, minutes on a first
//! run, which is said when it happens, with how long it took.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Where the peers are.
enum State {
    /// Being built; the thread answers the executable.
    Building(JoinHandle<Result<PathBuf, String>>),
    Running(Child, ChildStdin, BufReader<ChildStdout>),
    /// Not available, and why.
    Dead(String),
}

/// The child, or why there is none.
pub struct Peers {
    state: State,
    stderr: PathBuf,
    /// Left out on purpose (quick mode): their rows are no failures.
    skipped: bool,
}

impl Peers {
    /// Starts building the peers' workspace in the background (`profile`: a cargo profile,
    /// `release` for the report); the first command waits for it and starts the child.
    pub fn spawn(profile: &'static str) -> Peers {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join("target"))
            // Its own target dir: the cargo that started this run may still hold ours.
            .join("peers");
        let stderr = std::env::temp_dir().join(format!("dlock-peers-{}.log", std::process::id()));
        let log = stderr.clone();
        let build = std::thread::spawn(move || build(&root, &target, profile, &log));
        Peers {
            state: State::Building(build),
            stderr,
            skipped: false,
        }
    }

    /// No peers (quick mode leaves them out): every command answers `why`.
    pub fn skip(why: &str) -> Peers {
        Peers {
            state: State::Dead(why.to_owned()),
            stderr: PathBuf::new(),
            skipped: true,
        }
    }

    /// Whether the peers were left out on purpose.
    pub fn skipped(&self) -> bool {
        self.skipped
    }

    /// Waits for the build (if still running) and starts the child.
    pub fn start(&mut self) {
        let State::Building(_) = &self.state else {
            return;
        };
        let State::Building(build) = std::mem::replace(&mut self.state, State::Dead(String::new()))
        else {
            unreachable!("checked above");
        };
        if !build.is_finished() {
            eprintln!("report: waiting for the peers' build to finish");
        }
        let exe = build
            .join()
            .unwrap_or_else(|_| Err("the peers' build panicked".to_owned()));
        self.state = match exe.and_then(|exe| {
            let log = std::fs::OpenOptions::new()
                .append(true)
                .create(true)
                .open(&self.stderr)
                .map_err(|e| e.to_string())?;
            Command::new(&exe)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(log)
                .spawn()
                .map_err(|e| format!("could not run {}: {e}", exe.display()))
        }) {
            Ok(mut child) => {
                let stdin = child.stdin.take().expect("stdin");
                let stdout = BufReader::new(child.stdout.take().expect("stdout"));
                State::Running(child, stdin, stdout)
            }
            Err(e) => State::Dead(e),
        };
    }

    fn call(&mut self, line: &str) -> Result<String, String> {
        self.start();
        let (stdin, stdout) = match &mut self.state {
            State::Running(_, stdin, stdout) => (stdin, stdout),
            State::Dead(why) => return Err(why.clone()),
            State::Building(_) => unreachable!("started above"),
        };
        let mut reply = String::new();
        let ok = writeln!(stdin, "{line}").is_ok()
            && stdin.flush().is_ok()
            && stdout.read_line(&mut reply).is_ok_and(|n| n > 0);
        if ok {
            return Ok(reply);
        }
        let log = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let last = log
            .lines()
            .rev()
            .find(|l| l.contains("error"))
            .unwrap_or("the peers process exited")
            .trim()
            .to_owned();
        let why = format!("benches/peers did not run: {last}");
        self.state = State::Dead(why.clone());
        Err(why)
    }

    /// Connects `peer` to `url` and warms it up.
    pub fn setup(&mut self, peer: &str, url: &str) -> Result<(), String> {
        let reply = self.call(&format!("setup {peer} {url}"))?;
        match field(&reply, "error") {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// `n` acquire + release pairs of `peer`.
    pub fn run(&mut self, peer: &str, n: u64) -> Result<Duration, String> {
        let reply = self.call(&format!("run {peer} {n}"))?;
        if let Some(e) = field(&reply, "error") {
            return Err(e);
        }
        let ns: f64 = field(&reply, "ns_per_op")
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| format!("unexpected answer {reply}"))?;
        Ok(Duration::from_nanos((ns * n as f64) as u64))
    }
}

impl Drop for Peers {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.state, State::Dead(String::new())) {
            State::Running(mut child, stdin, _) => {
                drop(stdin);
                let _ = child.wait();
            }
            // Not used after all: the build finishes (cargo would leave a lock behind).
            State::Building(build) => drop(build.join()),
            State::Dead(_) => {}
        }
        if !self.skipped {
            let _ = std::fs::remove_file(&self.stderr);
        }
    }
}

/// The value of `"name":` in a one-line JSON object: a string's text or a number's digits.
fn field(json: &str, name: &str) -> Option<String> {
    let at = json.find(&format!("\"{name}\":"))? + name.len() + 3;
    let rest = json[at..].trim_start();
    if let Some(s) = rest.strip_prefix('"') {
        let mut out = String::new();
        let mut chars = s.chars();
        while let Some(c) = chars.next() {
            match c {
                '\\' => out.extend(chars.next()),
                '"' => return Some(out),
                c => out.push(c),
            }
        }
        Some(out)
    } else {
        Some(
            rest.chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect(),
        )
    }
}

/// Builds the peers' workspace with `profile` into `target`; its executable. Says when cargo
/// has work to do (the first run: minutes) and how long it took.
fn build(root: &Path, target: &Path, profile: &str, log: &Path) -> Result<PathBuf, String> {
    let started = Instant::now();
    let log_file = std::fs::File::create(log).map_err(|e| e.to_string())?;
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let manifest = root.join("benches/peers/Cargo.toml");
    let mut child = Command::new(cargo)
        .args([
            "build",
            "--message-format=json-render-diagnostics",
            "--profile",
            profile,
        ])
        .arg("--manifest-path")
        .arg(&manifest)
        .env("CARGO_TARGET_DIR", target)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log_file)
        .spawn()
        .map_err(|e| format!("could not run cargo: {e}"))?;
    let stdout = BufReader::new(child.stdout.take().expect("stdout"));
    let (mut building, mut exe) = (false, None);
    for line in stdout.lines().map_while(Result::ok) {
        if !line.contains("\"reason\":\"compiler-artifact\"") {
            continue;
        }
        if !building && line.contains("\"fresh\":false") {
            building = true;
            eprintln!(
                "report: building the peers' workspace (benches/peers, other lock crates, \
                 profile {profile}, into {}): once, a few minutes on a first run",
                target.display()
            );
        }
        if let Some(path) = field(&line, "executable").filter(|p| !p.is_empty()) {
            exe = Some(PathBuf::from(path));
        }
    }
    let status = child.wait().map_err(|e| e.to_string())?;
    let took = started.elapsed();
    if building || took > Duration::from_secs(5) {
        eprintln!(
            "report: the peers' workspace {} in {:.0} s",
            if status.success() {
                "was built"
            } else {
                "failed to build"
            },
            took.as_secs_f64()
        );
    }
    if !status.success() {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let last = text
            .lines()
            .find(|l| l.starts_with("error"))
            .unwrap_or("cargo build failed")
            .trim()
            .to_owned();
        return Err(format!("benches/peers did not build: {last}"));
    }
    exe.ok_or_else(|| "benches/peers built no executable".to_owned())
}
