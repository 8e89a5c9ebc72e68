//! Tracing spans: with a subscriber that takes them, an acquisition runs in its
//! `dlock.acquire` span (and records its outcome there) and a release in its `dlock.release`
//! span; with none, the same calls skip entering the spans and still work.
//!
//! One test in a binary of its own: `tracing` caches which callsites a subscriber wants, and
//! tests on other threads that hit the same callsites meanwhile could leave a stale answer.
#![cfg(feature = "sqlite")]

use dlock::LockProvider;
use dlock_testkit::{Captured, unique_key};
use tracing_subscriber::fmt::format::FmtSpan;

#[test]
fn acquisitions_and_releases_run_in_their_spans() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}/locks.db", dir.path().display());
    let key = unique_key("spans");
    let cycle = |key: String| {
        let url = url.clone();
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(async move {
                let locks = LockProvider::connect(&url).await.unwrap();
                let guard = locks.try_acquire(&key).await.unwrap();
                guard.release().await.unwrap();
            })
    };
    // No subscriber: nothing to see, and nothing fails.
    cycle(key.clone());

    let logs = Captured::default();
    let writer = logs.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_span_events(FmtSpan::ENTER | FmtSpan::CLOSE)
        .with_writer(move || writer.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, || cycle(key.clone()));
    let text = logs.text();
    let entered = |span: &str| {
        text.lines()
            .filter(|l| l.contains(&format!("{span}{{key=\"{key}\"")) && l.ends_with(": enter"))
            .count()
    };
    // The acquisition's span is entered while it runs, and once more for its closing event.
    assert!(entered("dlock.acquire") >= 2, "{text}");
    assert!(entered("dlock.release") >= 1, "{text}");
    assert!(
        text.lines()
            .any(|l| l.contains("dlock.acquire{") && l.contains("outcome=\"acquired\"")),
        "{text}"
    );
}
