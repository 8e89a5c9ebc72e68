//! Where the service's metrics go (dlock's `distributed_lock.*` instruments among them).
//!
//! - With `OTEL_EXPORTER_OTLP_ENDPOINT` set (for example `http://collector:4318`), metrics are
//!   pushed over OTLP/HTTP (protobuf) to `{endpoint}/v1/metrics`; the exporter also honours
//!   the other standard `OTEL_EXPORTER_OTLP_*` variables.
//! - Otherwise each metric is logged at `info` as one line per data point.
//!
//! Either way they are collected every `OTEL_METRIC_EXPORT_INTERVAL` milliseconds (default
//! 60,000) and once more at shutdown.

use std::fmt::Write as _;
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::exporter::PushMetricExporter;
use opentelemetry_sdk::metrics::{PeriodicReader, SdkMeterProvider, Temporality};

/// The installed meter provider; dropping it flushes and shuts it down.
#[derive(Debug)]
pub struct Telemetry {
    provider: SdkMeterProvider,
    /// Where the metrics go, for the start-up log line.
    pub destination: String,
}

impl Telemetry {
    /// Installs the global meter provider. Call it before the lock provider is built, so that
    /// dlock's instruments are made on this provider.
    pub fn init() -> Result<Telemetry, String> {
        let endpoint = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT")
            .ok()
            .filter(|e| !e.trim().is_empty());
        let (provider, destination) = match endpoint {
            Some(endpoint) => {
                let exporter = opentelemetry_otlp::MetricExporter::builder()
                    .with_http()
                    .build()
                    .map_err(|e| format!("OTEL_EXPORTER_OTLP_ENDPOINT {endpoint:?}: {e}"))?;
                let provider = SdkMeterProvider::builder()
                    .with_periodic_exporter(exporter)
                    .build();
                (provider, format!("OTLP/HTTP at {endpoint}"))
            }
            None => {
                let reader = PeriodicReader::builder(LogExporter).build();
                let provider = SdkMeterProvider::builder().with_reader(reader).build();
                (provider, "the log".to_owned())
            }
        };
        opentelemetry::global::set_meter_provider(provider.clone());
        Ok(Telemetry {
            provider,
            destination,
        })
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        // Exports what was recorded since the last interval.
        if let Err(err) = self.provider.shutdown() {
            tracing::warn!(error = %err, "flushing metrics at shutdown failed");
        }
    }
}

/// Logs every data point at `info`.
#[derive(Debug)]
struct LogExporter;

fn attributes<'a>(attributes: impl Iterator<Item = &'a KeyValue>) -> String {
    let mut out = String::new();
    for kv in attributes {
        let _ = write!(
            out,
            "{}{}={}",
            if out.is_empty() { "" } else { "," },
            kv.key,
            kv.value
        );
    }
    out
}

fn log_data<T: std::fmt::Display + Copy>(name: &str, unit: &str, data: &MetricData<T>) {
    // (attributes, value) of each data point.
    let points: Vec<(String, String)> = match data {
        MetricData::Sum(sum) => sum
            .data_points()
            .map(|p| (attributes(p.attributes()), format!("{} {unit}", p.value())))
            .collect(),
        MetricData::Gauge(gauge) => gauge
            .data_points()
            .map(|p| (attributes(p.attributes()), format!("{} {unit}", p.value())))
            .collect(),
        MetricData::Histogram(histogram) => histogram
            .data_points()
            .map(|p| {
                let value = format!("count {} sum {} {unit}", p.count(), p.sum());
                (attributes(p.attributes()), value)
            })
            .collect(),
        MetricData::ExponentialHistogram(histogram) => histogram
            .data_points()
            .map(|p| {
                let value = format!("count {} sum {} {unit}", p.count(), p.sum());
                (attributes(p.attributes()), value)
            })
            .collect(),
    };
    for (attributes, value) in points {
        tracing::info!(metric = name, attributes = %attributes, "{value}");
    }
}

impl PushMetricExporter for LogExporter {
    async fn export(&self, metrics: &ResourceMetrics) -> OTelSdkResult {
        for scope in metrics.scope_metrics() {
            for metric in scope.metrics() {
                let (name, unit) = (metric.name(), metric.unit());
                match metric.data() {
                    AggregatedMetrics::F64(data) => log_data(name, unit, data),
                    AggregatedMetrics::U64(data) => log_data(name, unit, data),
                    AggregatedMetrics::I64(data) => log_data(name, unit, data),
                }
            }
        }
        Ok(())
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }

    fn temporality(&self) -> Temporality {
        Temporality::Cumulative
    }
}
