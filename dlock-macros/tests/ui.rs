//! Compile-time behaviour of `#[distributed_lock]`: what compiles, and the errors for what
//! does not (each `tests/ui/fail/*.rs` has the expected `.stderr` beside it).
//!
//! The expected output is pinned to the compiler in use; after a toolchain upgrade, review
//! the differences and refresh them with `TRYBUILD=overwrite cargo test -p dlock-macros --test ui`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
