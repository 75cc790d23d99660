//! The control plane's Prometheus metrics: placements (attempts by result,
//! probe latency) and workers lost. One set per process, served by
//! `corral --metrics-listen`.

use std::sync::LazyLock;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Label sets: `(name, value)` pairs.
type Labels = Vec<(&'static str, String)>;

/// Seconds, from 1 ms to about 9 min.
fn latency_histogram() -> Histogram {
    Histogram::new(prometheus_client::metrics::histogram::exponential_buckets(
        0.001, 2.0, 20,
    ))
}

pub struct ControlMetrics {
    registry: Registry,
    /// Placement steps by result: placed, refused, full, draining,
    /// no_answer, failed.
    pub placement_attempts: Family<Labels, Counter>,
    pub probe_seconds: Histogram,
    pub workers_lost: Counter,
}

impl ControlMetrics {
    fn new() -> Self {
        let mut registry = Registry::with_prefix("corral");
        let placement_attempts = Family::<Labels, Counter>::default();
        let probe_seconds = latency_histogram();
        let workers_lost = Counter::default();
        registry.register(
            "placement_attempts",
            "Placement steps by result (placed, refused, full, draining, no_answer, failed)",
            placement_attempts.clone(),
        );
        registry.register(
            "placement_probe_seconds",
            "Time to ask a worker how full it is",
            probe_seconds.clone(),
        );
        registry.register(
            "workers_lost",
            "Times a waiter gave up on its worker after --worker-lost-after (one per session or command waiting)",
            workers_lost.clone(),
        );
        Self {
            registry,
            placement_attempts,
            probe_seconds,
            workers_lost,
        }
    }

    pub fn attempt(&self, result: &str) {
        self.placement_attempts
            .get_or_create(&vec![("result", result.to_string())])
            .inc();
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

static CONTROL: LazyLock<ControlMetrics> = LazyLock::new(ControlMetrics::new);

/// This process's metrics.
pub fn control() -> &'static ControlMetrics {
    &CONTROL
}
