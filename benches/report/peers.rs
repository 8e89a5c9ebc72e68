//! The other lock crates, run by the `benches/peers` workspace in a child process
//! (`cargo run --release --manifest-path benches/peers/Cargo.toml`), one JSON line per command.

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::Duration;

/// The child, or why there is none.
pub struct Peers {
    child: Option<(Child, ChildStdin, BufReader<ChildStdout>)>,
    stderr: PathBuf,
    dead: Option<String>,
}

impl Peers {
    /// Starts `cargo run` for the peers (building them first if needed).
    pub fn spawn() -> Peers {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let target = std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| root.join("target"));
        let stderr = std::env::temp_dir().join(format!("dlock-peers-{}.log", std::process::id()));
        let log = std::fs::File::create(&stderr);
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let spawned = log.map_err(|e| e.to_string()).and_then(|log| {
            Command::new(cargo)
                .args(["run", "--quiet", "--release", "--manifest-path"])
                .arg(root.join("benches/peers/Cargo.toml"))
                // Its own target dir: this cargo's lock on ours may still be held.
                .env("CARGO_TARGET_DIR", target.join("peers"))
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(log)
                .spawn()
                .map_err(|e| e.to_string())
        });
        match spawned {
            Ok(mut child) => {
                let stdin = child.stdin.take().expect("stdin");
                let stdout = BufReader::new(child.stdout.take().expect("stdout"));
                Peers {
                    child: Some((child, stdin, stdout)),
                    stderr,
                    dead: None,
                }
            }
            Err(e) => Peers {
                child: None,
                stderr,
                dead: Some(format!("could not run cargo: {e}")),
            },
        }
    }

    fn call(&mut self, line: &str) -> Result<String, String> {
        if let Some(why) = &self.dead {
            return Err(why.clone());
        }
        let (_, stdin, stdout) = self.child.as_mut().expect("child");
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
        self.dead = Some(format!("benches/peers did not build or run: {last}"));
        Err(self.dead.clone().expect("set"))
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
        if let Some((mut child, stdin, _)) = self.child.take() {
            drop(stdin);
            let _ = child.wait();
        }
        let _ = std::fs::remove_file(&self.stderr);
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
