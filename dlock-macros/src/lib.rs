//! The `#[distributed_lock]` attribute of [dlock](https://docs.rs/dlock). Use it through
//! `dlock::distributed_lock` (cargo feature `macros`, on by default), not from this crate.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

use proc_macro::TokenStream;

mod attr;
mod expand;

/// Takes a distributed lock around an `async fn`, or names the lock of a command struct.
#[proc_macro_attribute]
pub fn distributed_lock(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::distributed_lock(args.into(), item.into()).into()
}
