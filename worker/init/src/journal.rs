//! A bounded, sequence-numbered event journal.
//!
//! Events get strictly increasing sequence numbers. When the journal exceeds
//! its byte or event budget it drops its oldest events; a replay that starts
//! before the oldest kept event begins with an explicit [`EventKind::Gap`].
//! Results are never only here: owners keep them in their operation records.

use std::collections::VecDeque;

use corral_proto::{Event, EventKind, OperationId};

/// Default memory budget of a journal.
pub const DEFAULT_BUDGET_BYTES: usize = 8 << 20;
/// Default cap on the number of events kept.
pub const DEFAULT_MAX_EVENTS: usize = 65_536;

#[derive(Debug)]
pub struct Journal {
    events: VecDeque<Event>,
    bytes: usize,
    budget_bytes: usize,
    max_events: usize,
    last_seq: u64,
}

impl Default for Journal {
    fn default() -> Self {
        Self::new(DEFAULT_BUDGET_BYTES, DEFAULT_MAX_EVENTS)
    }
}

impl Journal {
    pub fn new(budget_bytes: usize, max_events: usize) -> Self {
        Self {
            events: VecDeque::new(),
            bytes: 0,
            budget_bytes,
            max_events: max_events.max(1),
            last_seq: 0,
        }
    }

    /// Appends an event with the next sequence number and returns it.
    pub fn push(&mut self, operation_id: Option<OperationId>, kind: EventKind) -> Event {
        self.last_seq += 1;
        let event = Event {
            seq: self.last_seq,
            operation_id,
            kind,
        };
        self.append(event.clone());
        event
    }

    /// Appends an event numbered elsewhere (a worker mirroring its sandbox's
    /// init). Events at or below the last seq are duplicates and are ignored;
    /// returns whether the event was new.
    pub fn insert(&mut self, event: Event) -> bool {
        if event.seq <= self.last_seq {
            return false;
        }
        self.last_seq = event.seq;
        self.append(event);
        true
    }

    fn append(&mut self, event: Event) {
        self.bytes += event.weight();
        self.events.push_back(event);
        while self.events.len() > 1
            && (self.bytes > self.budget_bytes || self.events.len() > self.max_events)
        {
            if let Some(old) = self.events.pop_front() {
                self.bytes -= old.weight();
            }
        }
    }

    /// Starts numbering after `seq` (a worker that learns its init's position).
    pub fn skip_to(&mut self, seq: u64) {
        self.last_seq = self.last_seq.max(seq);
    }

    pub fn last_seq(&self) -> u64 {
        self.last_seq
    }

    /// Seq of the oldest event kept, if any.
    pub fn first_seq(&self) -> Option<u64> {
        self.events.front().map(|e| e.seq)
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Output bytes carried by the events after `after`.
    pub fn output_bytes_after(&self, after: u64) -> u64 {
        let start = self.events.partition_point(|e| e.seq <= after);
        self.events
            .range(start..)
            .map(|e| e.output_len() as u64)
            .sum()
    }

    /// Up to `max` events with `seq > after`, preceded by a `Gap` event when
    /// some of them were dropped.
    pub fn read_after(&self, after: u64, max: usize) -> Vec<Event> {
        let mut out = Vec::new();
        let Some(first) = self.first_seq() else {
            if self.last_seq > after {
                out.push(gap(after.saturating_add(1), self.last_seq));
            }
            return out;
        };
        if first > after.saturating_add(1) {
            out.push(gap(after.saturating_add(1), first - 1));
        }
        // Sequence numbers are increasing but may skip (a mirrored journal),
        // so find the start by binary search.
        let start = self.events.partition_point(|e| e.seq <= after);
        out.extend(self.events.range(start..).take(max).cloned());
        out
    }
}

fn gap(from: u64, to: u64) -> Event {
    Event {
        seq: to,
        operation_id: None,
        kind: EventKind::Gap { from, to },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::Bytes;
    use corral_proto::OutputStream;

    fn out(n: usize) -> EventKind {
        EventKind::Output {
            stream: OutputStream::Stdout,
            data: Bytes::from(vec![b'x'; n]),
        }
    }

    #[test]
    fn replays_exactly_the_events_after_a_cursor() {
        let mut j = Journal::default();
        for _ in 0..10 {
            j.push(None, out(1));
        }
        let seqs: Vec<u64> = j.read_after(6, 100).iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![7, 8, 9, 10]);
        assert!(j.read_after(10, 100).is_empty());
        assert!(
            j.read_after(u64::MAX, 100).is_empty(),
            "no overflow on a huge cursor"
        );
        let seqs: Vec<u64> = j.read_after(0, 3).iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![1, 2, 3]);
    }

    #[test]
    fn stays_within_budget_and_reports_the_gap() {
        let mut j = Journal::new(1000, 1000);
        for _ in 0..100 {
            j.push(None, out(100));
        }
        assert!(j.bytes() <= 1000, "{}", j.bytes());
        let replay = j.read_after(0, 1000);
        let EventKind::Gap { from, to } = replay[0].kind else {
            panic!("expected a gap first, got {:?}", replay[0]);
        };
        assert_eq!(from, 1);
        assert_eq!(to + 1, replay[1].seq);
        assert_eq!(replay.last().map(|e| e.seq), Some(100));
    }

    #[test]
    fn small_events_count_what_they_take_so_the_budget_bounds_memory() {
        use corral_proto::{OperationResult, Outcome};
        let budget = 1 << 20;
        let mut j = Journal::new(budget, DEFAULT_MAX_EVENTS);
        // The events of a command that prints nothing, many times over.
        for _ in 0..20_000 {
            let op = Some(OperationId::random());
            j.push(op.clone(), EventKind::Started { pid: 1 });
            j.push(
                op,
                EventKind::Finished(Box::new(OperationResult::with_outcome(Outcome::Exited {
                    code: 0,
                }))),
            );
        }
        // What the kept events take: each stored, its id, a result each
        // second one.
        let per_pair =
            2 * (std::mem::size_of::<Event>() + 36) + std::mem::size_of::<OperationResult>();
        let kept = j.events.len();
        assert!(kept < 40_000, "nothing was evicted");
        assert!(
            kept / 2 * per_pair <= budget,
            "{kept} events kept take about {} bytes, over the budget of {budget}",
            kept / 2 * per_pair
        );
    }

    #[test]
    fn mirrored_inserts_ignore_duplicates() {
        let mut a = Journal::default();
        let mut b = Journal::default();
        let e1 = a.push(None, out(1));
        let e2 = a.push(None, out(1));
        assert!(b.insert(e1.clone()));
        assert!(b.insert(e2));
        assert!(!b.insert(e1));
        assert_eq!(b.last_seq(), 2);
    }
}
