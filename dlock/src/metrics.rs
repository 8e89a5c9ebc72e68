//! OpenTelemetry instruments of a provider.
//!
//! Instruments come from the meter named `dlock`, by default from the global meter provider
//! (a no-op until the application installs an SDK; install it before creating providers), or
//! from a meter passed to [`ProviderBuilder::meter`](crate::ProviderBuilder::meter).
//!
//! | instrument | kind | unit | attributes |
//! |---|---|---|---|
//! | `distributed_lock.acquisitions` | counter | `{acquisition}` | `lock_type`, `status` (`acquired`, `already_held`, `timeout`, `canceled`, `error`) |
//! | `distributed_lock.wait_duration` | histogram | `ms` | `lock_type`, `status` |
//! | `distributed_lock.hold_duration` | histogram | `ms` | `lock_type` |
//! | `distributed_lock.lost` | counter | `{lock}` | `lock_type` |
//!
//! `lock_type` is the backend's name. Keys are never attributes (their number is unbounded);
//! with [`ProviderBuilder::metric_key_prefix`](crate::ProviderBuilder::metric_key_prefix) an
//! attribute `key_prefix` carries the text before the key's first `:` (empty when there is none).

use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::metrics::{Counter, Histogram, Meter};

use crate::LockError;

/// The instruments one provider records into.
#[derive(Debug, Clone)]
pub(crate) struct Metrics {
    acquisitions: Counter<u64>,
    wait: Histogram<f64>,
    hold: Histogram<f64>,
    lost: Counter<u64>,
    key_prefix: bool,
}

impl Metrics {
    pub(crate) fn new(meter: &Meter, key_prefix: bool) -> Self {
        Metrics {
            acquisitions: meter
                .u64_counter("distributed_lock.acquisitions")
                .with_description("Lock acquisitions, by outcome")
                .with_unit("{acquisition}")
                .build(),
            wait: meter
                .f64_histogram("distributed_lock.wait_duration")
                .with_description("Time from asking for a lock to the answer")
                .with_unit("ms")
                .build(),
            hold: meter
                .f64_histogram("distributed_lock.hold_duration")
                .with_description("Time a lock was held, from acquisition to release or drop")
                .with_unit("ms")
                .build(),
            lost: meter
                .u64_counter("distributed_lock.lost")
                .with_description("Locks lost while held")
                .with_unit("{lock}")
                .build(),
            key_prefix,
        }
    }

    /// Records the outcome of one acquisition.
    pub(crate) fn acquisition<T>(
        &self,
        backend: &'static str,
        key: &str,
        outcome: &Result<T, LockError>,
        waited: Duration,
    ) {
        let status = match outcome {
            Ok(_) => "acquired",
            Err(LockError::AlreadyHeld { .. }) => "already_held",
            Err(LockError::Timeout { .. }) => "timeout",
            Err(LockError::Canceled { .. }) => "canceled",
            // A key that is not a key never reached a store.
            Err(LockError::InvalidKey { .. }) => return,
            Err(_) => "error",
        };
        if self.key_prefix {
            let attributes = [
                KeyValue::new("lock_type", backend),
                KeyValue::new("status", status),
                key_prefix(key),
            ];
            self.acquisitions.add(1, &attributes);
            self.wait.record(millis(waited), &attributes);
        } else {
            let attributes = [
                KeyValue::new("lock_type", backend),
                KeyValue::new("status", status),
            ];
            self.acquisitions.add(1, &attributes);
            self.wait.record(millis(waited), &attributes);
        }
    }

    /// Records the end of a hold: its duration, and the loss if the lock was lost.
    pub(crate) fn released(&self, backend: &'static str, key: &str, held: Duration, lost: bool) {
        if self.key_prefix {
            let attributes = [KeyValue::new("lock_type", backend), key_prefix(key)];
            self.hold.record(millis(held), &attributes);
            if lost {
                self.lost.add(1, &attributes);
            }
        } else {
            let attributes = [KeyValue::new("lock_type", backend)];
            self.hold.record(millis(held), &attributes);
            if lost {
                self.lost.add(1, &attributes);
            }
        }
    }
}

fn key_prefix(key: &str) -> KeyValue {
    // A key without `:` has no prefix: reporting the whole key would make the attribute unbounded.
    let prefix = key.split_once(':').map_or("", |(prefix, _)| prefix);
    KeyValue::new("key_prefix", prefix.to_owned())
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
