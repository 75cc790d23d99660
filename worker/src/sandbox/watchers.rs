//! A sandbox's watchers: each follows the journal from its cursor, kept
//! within the window of output the sandbox may hold back.

use super::*;

/// One watcher's events. When they end, [`Watch::was_dropped`] tells a
/// watcher the worker dropped (it held the sandbox back) from one whose
/// sandbox or client went away.
pub struct Watch {
    pub events: mpsc::Receiver<Event>,
    pub(super) dropped: CancellationToken,
}

impl Watch {
    pub fn was_dropped(&self) -> bool {
        self.dropped.is_cancelled()
    }
}

pub(super) async fn run_watcher(
    shared: &Shared,
    watcher: u64,
    mut cursor: u64,
    only: Option<OperationId>,
    tx: &mpsc::Sender<Event>,
) -> &'static str {
    let mut seq_rx = shared.last_seq.subscribe();
    loop {
        let batch = lock(&shared.journal).read_after(cursor, 256);
        if batch.is_empty() {
            tokio::select! {
                changed = seq_rx.changed() => if changed.is_err() { return "sandbox gone" },
                () = tx.closed() => return "client left",
                () = shared.closed.cancelled() => return "sandbox closed",
            }
            continue;
        }
        for event in batch {
            cursor = event.seq;
            let wanted = match (&only, &event.operation_id) {
                (None, _) => true,
                (Some(want), Some(got)) => want == got,
                (Some(_), None) => matches!(
                    event.kind,
                    EventKind::Gap { .. } | EventKind::SandboxLost { .. }
                ),
            };
            if wanted {
                tokio::select! {
                    sent = tx.send(event) => if sent.is_err() { return "client left" },
                    () = shared.closed.cancelled() => return "sandbox closed",
                }
            }
        }
        if let Some(w) = lock(&shared.watchers).get_mut(&watcher) {
            w.cursor = cursor;
        }
        shared.progress.notify_one();
    }
}

/// What is wrong with a live event from the supervisor, if anything. The
/// supervisor runs in the sandbox, so its frames are checked like any other
/// input: live events come one seq after another, for operations the worker
/// handed it, and an operation finishes once.
pub(super) fn violation(ops: &OpTable, last_seq: u64, event: &Event) -> Option<String> {
    if event.seq != last_seq + 1 {
        return Some(format!("event {} after event {last_seq}", event.seq));
    }
    if matches!(event.kind, EventKind::Egress(_) | EventKind::Port(_))
        && event.operation_id.is_some()
    {
        return Some("an egress or port event of an operation".into());
    }
    let id = event.operation_id.as_ref()?;
    let Some(op) = ops.ops.get(id) else {
        return Some(format!(
            "an event for operation {id}, which it was never given"
        ));
    };
    if op.result.is_some() && !matches!(event.kind, EventKind::Gap { .. }) {
        return Some(format!("an event for operation {id}, which had finished"));
    }
    None
}
