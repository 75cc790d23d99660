//! What a sandbox's worker tells it to journal as events (egress
//! decisions, the way in to its ports): through a bounded queue to the
//! sandbox's actor, never waiting on a data path. One that finds the queue
//! full (a flood of refused connections) is counted, and the count goes
//! with the next one told: a gap is said, never silent.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use tokio::sync::mpsc;

/// An event that says how many before it went untold.
pub trait Told {
    fn set_unreported(&mut self, n: u32);
}

impl Told for corral_proto::event::Egress {
    fn set_unreported(&mut self, n: u32) {
        self.unreported = n;
    }
}

impl Told for corral_proto::event::PortEvent {
    fn set_unreported(&mut self, n: u32) {
        self.unreported = n;
    }
}

pub struct Reports<T> {
    tx: mpsc::Sender<T>,
    unreported: Arc<AtomicU32>,
}

impl<T> Clone for Reports<T> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            unreported: Arc::clone(&self.unreported),
        }
    }
}

impl<T: Told> Reports<T> {
    pub fn new(tx: mpsc::Sender<T>) -> Self {
        Self {
            tx,
            unreported: Arc::default(),
        }
    }

    fn take_unreported(&self) -> u32 {
        self.unreported.swap(0, Ordering::AcqRel)
    }

    /// Tells `e`, waiting for room.
    pub async fn send(&self, mut e: T) {
        e.set_unreported(self.take_unreported());
        let _ = self.tx.send(e).await;
    }

    /// Tells `e` if there is room now; counts it otherwise.
    pub fn try_send(&self, mut e: T) {
        let before = self.take_unreported();
        e.set_unreported(before);
        if self.tx.try_send(e).is_err() {
            self.unreported
                .fetch_add(before.saturating_add(1), Ordering::AcqRel);
        }
    }

    /// Counts an event not told (one that was not worth telling on its
    /// own: the next one told says it).
    pub fn untold(&self) {
        self.unreported.fetch_add(1, Ordering::AcqRel);
    }

    /// Events not told yet.
    pub fn unreported(&self) -> u32 {
        self.unreported.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use corral_proto::event::{Egress, EgressDecision};

    fn decision(host: &str) -> Egress {
        Egress {
            host: host.into(),
            port: 80,
            decision: EgressDecision::Blocked,
            reason: "not_allowed".into(),
            unreported: 0,
        }
    }

    #[tokio::test]
    async fn decisions_that_find_the_queue_full_are_counted_and_told_with_the_next() {
        let (tx, mut rx) = mpsc::channel(1);
        let reports = Reports::new(tx);
        reports.try_send(decision("a"));
        // Full: these two are counted, not told.
        reports.try_send(decision("b"));
        reports.try_send(decision("c"));
        assert_eq!(reports.unreported(), 2);
        assert_eq!(rx.recv().await.unwrap().unreported, 0);
        // The next one told carries the gap, once.
        reports.send(decision("d")).await;
        let told = rx.recv().await.unwrap();
        assert_eq!((told.host.as_str(), told.unreported), ("d", 2));
        reports.try_send(decision("e"));
        assert_eq!(rx.recv().await.unwrap().unreported, 0);
        assert_eq!(reports.unreported(), 0);
    }
}
