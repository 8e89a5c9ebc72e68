//! The `dlock` command: run a command under a distributed lock, list the locks in a store,
//! check a store. Built on the public API of the `dlock` library only.
//!
//! This library is the command's implementation, kept apart from `main.rs` so that its tests
//! can read the command line's definition ([`cli::command`]); it is not meant for other uses.
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations)]

use std::io::IsTerminal;

use clap::Parser;

pub mod cli;
pub mod exit;
mod ls;
mod redact;
mod release;
mod run;

pub use redact::redact;

/// Runs the command line of this process; returns its exit status.
pub fn main() -> u8 {
    let cli = match cli::Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) => {
            // `--help` and `--version` print to stdout and succeed; mistakes are usage errors.
            let code = if err.use_stderr() { exit::USAGE } else { 0 };
            let _ = err.print();
            return code;
        }
    };
    let Some(url) = cli.url.clone() else {
        eprintln!(
            "dlock: no lock store: pass --url URL or set DLOCK_URL (for example sqlite:///var/lib/app/locks.db or redis://host:6379)"
        );
        return exit::USAGE;
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("dlock: cannot start: {err}");
            return exit::UNAVAILABLE;
        }
    };
    let store = Store { url };
    runtime.block_on(async move {
        match cli.command {
            cli::Command::Run(args) => run::run(&store, args).await,
            cli::Command::Ls(args) => ls::ls(&store, args).await,
            cli::Command::Release(args) => release::release(&store, args).await,
            cli::Command::Ping => ping(&store).await,
        }
    })
}

/// The lock store named on the command line.
#[derive(Debug)]
struct Store {
    url: String,
}

impl Store {
    /// Connects, or says why not (naming the URL without its password) and gives the exit
    /// status.
    async fn connect(&self) -> Result<dlock::LockProvider, u8> {
        dlock::LockProvider::connect(&self.url)
            .await
            .map_err(|err| self.fail(&err))
    }

    /// Prints `err` about this store; returns its exit status.
    fn fail(&self, err: &dlock::LockError) -> u8 {
        self.say(format_args!("{err}"));
        exit::of(err)
    }

    /// Prints a message about this store to stderr.
    fn say(&self, message: std::fmt::Arguments<'_>) {
        eprintln!("dlock: {}: {message}", redact(&self.url));
    }
}

/// Whether progress messages are shown: only on a terminal, so that cron mails nothing.
fn chatty() -> bool {
    std::io::stderr().is_terminal()
}

async fn ping(store: &Store) -> u8 {
    let locks = match dlock::LockProvider::connect(&store.url).await {
        Ok(locks) => locks,
        Err(err) => {
            store.say(format_args!("{err}"));
            return exit::FAILURE;
        }
    };
    match locks.ping().await {
        Ok(()) => {
            println!("{}: ok ({})", redact(&store.url), locks.backend_name());
            0
        }
        Err(err) => {
            store.say(format_args!("{err}"));
            exit::FAILURE
        }
    }
}
