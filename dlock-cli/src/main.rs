//! `dlock`: see `dlock --help`.

fn main() -> std::process::ExitCode {
    std::process::ExitCode::from(dlock_cli::main())
}
