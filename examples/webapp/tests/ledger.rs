//! The ledger on its own: opening a file that other replicas open at the same moment, and
//! the fencing check that refuses the writes of a stale lock holder.

use std::sync::{Arc, Barrier};

use webapp::Ledger;

#[test]
fn replicas_opening_one_new_ledger_at_the_same_moment_all_succeed() {
    for round in 0..20 {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("ledger.db");
        let openers = 8;
        let barrier = Arc::new(Barrier::new(openers));
        let threads: Vec<_> = (0..openers)
            .map(|_| {
                let (barrier, path) = (Arc::clone(&barrier), path.clone());
                std::thread::spawn(move || {
                    barrier.wait();
                    Ledger::open(&path).map(drop).map_err(|e| e.to_string())
                })
            })
            .collect();
        for thread in threads {
            let result = thread.join().expect("opener thread");
            assert!(result.is_ok(), "round {round}: {result:?}");
        }
    }
}

/// A stale holder: its lock (fencing token `t1`) was lost, another holder took it (`t2 > t1`)
/// and wrote. The stale holder's write comes last and is refused; the newer one stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_write_of_a_stale_lock_holder_is_refused() {
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = Ledger::open(&dir.path().join("ledger.db")).expect("open");
    let url = format!("sqlite://{}", dir.path().join("locks.db").display());
    let (stale, fresh) = (
        dlock::LockProvider::connect(&url).await.expect("locks"),
        dlock::LockProvider::connect(&url).await.expect("locks"),
    );
    ledger.write("alice", 100, 100, None).await.expect("credit");

    // The stale holder takes the lock, then loses it (here: gives it up, as a paused holder
    // whose lease ran out would have, without knowing).
    let first = stale
        .try_acquire("account:alice")
        .await
        .expect("first holder");
    let t1 = first.fencing_token().expect("SQLite issues fencing tokens");
    first.release().await.expect("release");
    let second = fresh
        .try_acquire("account:alice")
        .await
        .expect("second holder");
    let t2 = second.fencing_token().expect("token");
    assert!(t1 < t2);

    ledger
        .write("alice", 70, -30, Some(t2))
        .await
        .expect("newer write");
    // The same holder may write again.
    ledger
        .write("alice", 60, -10, Some(t2))
        .await
        .expect("same holder");
    let refused = ledger.write("alice", 90, -10, Some(t1)).await;
    match refused {
        Err(webapp::ledger::LedgerError::StaleToken { token, seen }) => {
            assert_eq!((token, seen), (t1, t2));
        }
        other => panic!("expected StaleToken, got {other:?}"),
    }
    second.release().await.expect("release");
    assert_eq!(ledger.balance("alice").await.expect("balance"), Some(60));
    let (_, mismatches) = ledger.reconcile().await.expect("reconcile");
    assert!(
        mismatches.is_empty(),
        "the refused write left no journal entry"
    );
    // Fencing is per account: another account starts from nothing.
    ledger.write("bob", 5, 5, Some(t1)).await.expect("bob");
}
