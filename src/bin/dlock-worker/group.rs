//! A group of worker processes started together: each connects, says `ready` on stdout and
//! waits for `go` on stdin, so that every one of them starts its timed run at the same moment
//! (the fairness and throughput runs).

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdout, Command, Stdio};

/// Worker processes that have all said `ready`.
pub(crate) struct Group {
    children: Vec<(Child, BufReader<ChildStdout>)>,
}

impl Group {
    /// Starts `processes` copies of this binary, the `i`-th with the arguments `args(i)`, and
    /// waits until each has said `ready`.
    pub(crate) fn spawn(
        processes: usize,
        args: impl Fn(usize) -> Vec<String>,
    ) -> Result<Group, String> {
        let me = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
        let mut children = (0..processes)
            .map(|i| {
                Command::new(&me)
                    .args(args(i))
                    .stdin(Stdio::piped())
                    .stdout(Stdio::piped())
                    .stderr(Stdio::piped())
                    .spawn()
                    .map_err(|e| format!("spawning a worker: {e}"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let mut outputs = Vec::new();
        for child in &mut children {
            let mut out = BufReader::new(child.stdout.take().ok_or("a worker without stdout")?);
            let mut line = String::new();
            out.read_line(&mut line)
                .map_err(|e| format!("reading a worker: {e}"))?;
            if line.trim() != "ready" {
                let _ = child.kill();
                let mut why = String::new();
                if let Some(mut err) = child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut err, &mut why);
                }
                return Err(format!(
                    "a worker said {line:?} instead of ready: {}",
                    why.trim()
                ));
            }
            outputs.push(out);
        }
        Ok(Group {
            children: children.into_iter().zip(outputs).collect(),
        })
    }

    /// Tells every worker `go`.
    pub(crate) fn go(&mut self) -> Result<(), String> {
        for (child, _) in &mut self.children {
            let stdin = child.stdin.as_mut().ok_or("a worker without stdin")?;
            stdin
                .write_all(b"go\n")
                .and_then(|()| stdin.flush())
                .map_err(|e| format!("starting a worker: {e}"))?;
        }
        Ok(())
    }

    /// Reads what each worker prints, line by line (`line(i, text)` for the `i`-th), until it
    /// exits; fails with the first worker that failed.
    pub(crate) fn finish(
        self,
        mut line: impl FnMut(usize, &str) -> Result<(), String>,
    ) -> Result<(), String> {
        for (i, (child, out)) in self.children.into_iter().enumerate() {
            for text in out.lines() {
                line(i, &text.map_err(|e| format!("reading a worker: {e}"))?)?;
            }
            let out = child
                .wait_with_output()
                .map_err(|e| format!("waiting for a worker: {e}"))?;
            if !out.status.success() {
                return Err(format!(
                    "a worker failed: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
        }
        Ok(())
    }
}

/// A worker's side: says `ready` and waits for `go` on stdin.
pub(crate) fn ready_then_go() -> Result<(), String> {
    println!("ready");
    std::io::stdout().flush().map_err(|e| e.to_string())?;
    let mut go = String::new();
    std::io::stdin()
        .read_line(&mut go)
        .map_err(|e| format!("waiting for go: {e}"))?;
    if go.trim() != "go" {
        // The run was called off (its parent is gone).
        return Err("the run was called off before it began".to_owned());
    }
    Ok(())
}

/// A worker's numeric argument `value`, named `what` in the error.
pub(crate) fn number(what: &str, value: &str) -> Result<u64, String> {
    value.parse::<u64>().map_err(|e| format!("{what}: {e}"))
}
