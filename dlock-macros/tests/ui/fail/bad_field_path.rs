#![allow(unused)]

use dlock::{LockError, LockProvider, distributed_lock};

struct Command {
    id: u64,
}

// `²` is a digit to the template grammar, but no Rust field name holds it.
#[distributed_lock("job:{cmd.id²}", timeout = 10)]
async fn not_a_field_name(locks: &LockProvider, cmd: Command) -> Result<(), LockError> {
    Ok(())
}

#[distributed_lock("job:{cmd.r#self}", timeout = 10)]
async fn not_a_raw_identifier(locks: &LockProvider, cmd: Command) -> Result<(), LockError> {
    Ok(())
}

fn main() {}
