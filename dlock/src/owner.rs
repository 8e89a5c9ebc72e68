//! Owner labels (see [`ProviderBuilder::owner_label`](crate::ProviderBuilder::owner_label)):
//! when a lease backend records its label. Each backend keeps its label in a record of its
//! own, written by the first acquisition after the label is set, then again by the first
//! acquisition 12 hours after the last write (stores drop records not written for a day that
//! hold nothing), so an acquisition pays one atomic load for it, and no round trip.
// Used by the backends that keep labels.
#![cfg_attr(not(any(feature = "sqlite", feature = "redis")), allow(dead_code))]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// How long a label record lives without a write (Redis: its time to live; SQLite: how old a
/// record of a backend that holds nothing is before another backend deletes it).
pub(crate) const LABEL_TTL: Duration = Duration::from_secs(24 * 3600);

/// How long after a write an acquisition writes the label again.
pub(crate) const LABEL_REFRESH: Duration = Duration::from_secs(12 * 3600);

/// A backend's owner label, and when an acquisition writes it next.
#[derive(Debug, Default)]
pub(crate) struct OwnerLabel {
    label: Mutex<Option<Arc<str>>>,
    /// When the label is due to be written, in seconds after [`origin`]; `u64::MAX` (the
    /// default) while there is no label.
    due: AtomicU64,
}

/// The instant the schedules of this process count from.
fn origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

fn seconds(at: Instant) -> u64 {
    at.saturating_duration_since(origin()).as_secs()
}

impl OwnerLabel {
    pub(crate) fn new() -> Self {
        OwnerLabel {
            label: Mutex::new(None),
            due: AtomicU64::new(u64::MAX),
        }
    }

    /// A new label: written by the next acquisition.
    pub(crate) fn set(&self, label: &str) {
        *self.label.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::from(label));
        self.due.store(0, Ordering::Release);
    }

    /// The label, when it is due to be written at `now`: the caller writes it (the next write
    /// is planned now, so that acquisitions at the same moment do not write it too). One
    /// atomic load when it is not due.
    pub(crate) fn take_due(&self, now: Instant) -> Option<Arc<str>> {
        let now = seconds(now);
        let due = self.due.load(Ordering::Acquire);
        if due > now {
            return None;
        }
        self.due
            .compare_exchange(
                due,
                now.saturating_add(LABEL_REFRESH.as_secs()),
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .ok()?;
        self.label
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The write failed: the next acquisition tries again.
    pub(crate) fn failed(&self) {
        self.due.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_label_is_due_once_then_every_refresh() {
        let label = OwnerLabel::new();
        let now = Instant::now();
        assert!(label.take_due(now).is_none(), "no label, nothing to write");
        label.set("a");
        assert_eq!(label.take_due(now).as_deref(), Some("a"));
        assert!(label.take_due(now).is_none(), "written once");
        assert!(label.take_due(now + LABEL_REFRESH / 2).is_none());
        assert_eq!(
            label
                .take_due(now + LABEL_REFRESH + Duration::from_secs(1))
                .as_deref(),
            Some("a")
        );
        label.failed();
        assert_eq!(label.take_due(now).as_deref(), Some("a"), "tried again");
        label.set("b");
        assert_eq!(label.take_due(now).as_deref(), Some("b"));
    }
}
