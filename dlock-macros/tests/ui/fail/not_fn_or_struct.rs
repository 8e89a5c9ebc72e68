#![allow(unused)]

use dlock::distributed_lock;

#[distributed_lock("command:{0}")]
enum Command {
    Debit(u64),
}

fn main() {
    let _ = Command::Debit(1);
}
