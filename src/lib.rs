//! The test suite's own library (not published): what its benches share. The tests' shared code
//! is in `dlock-testkit`.

pub mod fairness;
pub mod raw;
