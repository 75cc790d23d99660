//! An operation's input, on the actor's side: each WriteInput checked
//! against its operation, queued, and sent to the supervisor within its
//! window; the supervisor's acknowledgements.

use super::*;

impl Actor {
    /// Takes a WriteInput: checked against the operation, then queued
    /// behind the others of the same operation.
    pub(super) async fn on_input(&mut self, p: PendingInput) {
        let known = lock(&self.shared.ops)
            .ops
            .get(&p.id)
            .map(|r| (r.spec.takes_input(), r.result.is_some(), r.input_bytes));
        match known {
            None => {
                let _ = p
                    .reply
                    .send(Err(WorkerError::UnknownOperation(p.id.to_string())));
            }
            Some((false, _, _)) => {
                let _ = p.reply.send(Err(WorkerError::NotApplicable(format!(
                    "operation {} takes no input (ask for stdin, a terminal or a streamed write)",
                    p.id
                ))));
            }
            Some((true, true, taken)) => {
                let received = self.inputs.get(&p.id).map_or(taken, |l| l.received);
                let _ = p.reply.send(Ok(InputReply {
                    input_bytes: received,
                    closed: true,
                }));
            }
            Some((true, false, _)) => {
                let link = self.inputs.entry(p.id.clone()).or_default();
                if link.queue.len() >= MAX_QUEUED_INPUTS {
                    let _ = p.reply.send(Err(WorkerError::TooManyWatchers(format!(
                        "{MAX_QUEUED_INPUTS} input calls of operation {} are waiting already",
                        p.id
                    ))));
                    return;
                }
                let sent = link.sent.max(link.received);
                if p.offset > sent + INPUT_AHEAD_BYTES {
                    let _ = p.reply.send(Err(WorkerError::InputGap(format!(
                        "input at offset {} of operation {}, whose input ends at {sent} (at most {INPUT_AHEAD_BYTES} bytes ahead may wait for what comes before)",
                        p.offset, p.id
                    ))));
                    return;
                }
                let id = p.id.clone();
                link.enqueue(p);
                self.pump_input(&id).await;
            }
        }
    }

    /// Sends the waiting input of `id` to init, in order of offset, while
    /// its window has room (several calls may be in flight). A call past
    /// what was sent waits for those before it, up to
    /// [`INPUT_AHEAD_BYTES`] ahead and [`GAP_PATIENCE`] long; further, or
    /// longer, is a gap, refused.
    pub(super) async fn pump_input(&mut self, id: &OperationId) {
        loop {
            if !self.welcomed {
                return;
            }
            let Some(link) = self.inputs.get_mut(id) else {
                return;
            };
            if link.closed {
                link.close_all();
                return;
            }
            let Some(front) = link.queue.front() else {
                return;
            };
            let sent = link.sent.max(link.received);
            if front.offset > sent {
                if front.offset - sent <= INPUT_AHEAD_BYTES && front.since.elapsed() < GAP_PATIENCE
                {
                    self.gaps_at
                        .get_or_insert_with(|| tokio::time::Instant::now() + GAP_CHECK);
                    return;
                }
                let Some(p) = link.queue.pop_front() else {
                    return;
                };
                let _ = p.reply.send(Err(WorkerError::InputGap(format!(
                    "input at offset {} of operation {id}, whose input ends at {}",
                    p.offset, sent
                ))));
                continue;
            }
            let skip = usize::try_from(sent - front.offset).unwrap_or(usize::MAX);
            if skip >= front.data.len() && !front.eof {
                // Already sent (by a call before it): answered when that
                // is taken, or at once when it is.
                if let Some(p) = link.queue.pop_front() {
                    if link.in_flight.is_empty() {
                        let _ = p.reply.send(Ok(link.reply()));
                    } else {
                        link.in_flight
                            .push_back((p.offset + p.data.len() as u64, p));
                    }
                }
                continue;
            }
            if front.eof && !link.in_flight.is_empty() {
                // The end goes alone: an ack that covers the pieces before
                // it must not answer it before the supervisor has it.
                return;
            }
            let len = front.data.len().saturating_sub(skip) as u64;
            let waiting = sent - link.consumed;
            if waiting > 0 && waiting + len > INPUT_WINDOW_BYTES {
                // Init has enough to write on: the next ack makes room.
                return;
            }
            let Some(p) = link.queue.pop_front() else {
                return;
            };
            let data = if skip >= p.data.len() {
                Bytes::new()
            } else {
                p.data.slice(skip..)
            };
            let offset = sent;
            let end = offset + data.len() as u64;
            let req = InitRequest::Input {
                operation_id: id.clone(),
                offset,
                data,
                eof: p.eof,
            };
            link.sent = end;
            link.in_flight.push_back((end, p));
            if !self.send(req).await {
                return;
            }
        }
    }

    /// Init's word on an input: answers the call in flight once covered.
    pub(super) async fn on_input_ack(
        &mut self,
        id: OperationId,
        received: u64,
        consumed: u64,
        closed: bool,
    ) {
        if closed && !self.inputs.contains_key(&id) {
            return;
        }
        let link = self.inputs.entry(id.clone()).or_default();
        link.received = link.received.max(received);
        link.consumed = link.consumed.max(consumed);
        // What GetOperation and ListOperations say it has taken.
        if let Some(rec) = lock(&self.shared.ops).ops.get_mut(&id) {
            rec.input_bytes = rec.input_bytes.max(link.received);
        }
        if closed {
            // Kept (closed) until the operation finishes: later calls are
            // told so, with where the input ended.
            link.close_all();
            return;
        }
        while link
            .in_flight
            .front()
            .is_some_and(|(end, _)| link.received >= *end)
        {
            if let Some((_, p)) = link.in_flight.pop_front() {
                let _ = p.reply.send(Ok(link.reply()));
            }
        }
        self.pump_input(&id).await;
    }
}
