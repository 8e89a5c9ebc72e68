//! `dlock release --force`: end a lock whoever holds it.

use std::io::{BufRead, IsTerminal, Write};

use dlock::LockError;

use crate::cli::ReleaseArgs;
use crate::{Store, exit, redact};

pub(crate) async fn release(store: &Store, args: ReleaseArgs) -> u8 {
    if !args.yes {
        if !(std::io::stdin().is_terminal() && std::io::stderr().is_terminal()) {
            eprintln!(
                "dlock: not ending the lock `{}` without confirmation, and there is no terminal to ask on: pass --yes to confirm",
                args.key.escape_debug()
            );
            return exit::USAGE;
        }
        match confirm(&format!(
            "End the lock `{}` in {}, whoever holds it? Its holder finds it lost at its next renewal. [y/N] ",
            args.key.escape_debug(),
            redact(&store.url)
        )) {
            Ok(true) => {}
            Ok(false) => {
                eprintln!("dlock: not released");
                return exit::FAILURE;
            }
            Err(err) => {
                eprintln!("dlock: cannot read the answer: {err}");
                return exit::FAILURE;
            }
        }
    }
    let locks = match store.connect().await {
        Ok(locks) => locks,
        Err(code) => return code,
    };
    match locks.force_release(&args.key).await {
        Ok(true) => {
            println!("ended the lock `{}`", args.key.escape_debug());
            0
        }
        Ok(false) => {
            eprintln!("dlock: no lock `{}` was held", args.key.escape_debug());
            exit::FAILURE
        }
        Err(err @ LockError::Unsupported { .. }) => {
            store.say(format_args!("{err}"));
            exit::CONFIG
        }
        Err(err) => store.fail(&err),
    }
}

/// Asks `question` on stderr; whether the answer on stdin is yes.
fn confirm(question: &str) -> std::io::Result<bool> {
    let mut stderr = std::io::stderr();
    stderr.write_all(question.as_bytes())?;
    stderr.flush()?;
    let mut answer = String::new();
    std::io::stdin().lock().read_line(&mut answer)?;
    Ok(matches!(
        answer.trim().to_ascii_lowercase().as_str(),
        "y" | "yes"
    ))
}
