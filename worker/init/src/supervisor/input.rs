//! Input to operations that take it, and files streamed in and out:
//! placed by offset, acknowledged, written as the pipes take it.

use super::*;

impl Supervisor {
    /// Takes input for an operation, placed by offset: what was taken
    /// already is skipped, a gap or an overfull buffer is refused.
    pub(super) fn on_input(&mut self, id: OperationId, offset: u64, data: Bytes, eof: bool) {
        let Some(op) = self.ops.get_mut(&id) else {
            self.reject(
                Some(id),
                RejectKind::UnknownOperation,
                "input for an unknown operation".into(),
            );
            return;
        };
        let takes = op.spec.takes_input();
        let Some(input) = op.input_mut() else {
            if takes {
                // Finished, or never started: nothing more is taken.
                self.send(InitMessage::InputAck {
                    operation_id: id,
                    received: 0,
                    consumed: 0,
                    closed: true,
                });
            } else {
                self.reject(
                    Some(id),
                    RejectKind::TakesNoInput,
                    "the operation takes no input".into(),
                );
            }
            return;
        };
        input.ack_due = true;
        if input.closed || input.eof {
            return;
        }
        if offset > input.received {
            let reason = format!(
                "input at offset {offset}, but only {} bytes were taken",
                input.received
            );
            self.reject(Some(id), RejectKind::InputGap, reason);
            return;
        }
        let skip = usize::try_from(input.received - offset).unwrap_or(usize::MAX);
        let data = if skip >= data.len() {
            Bytes::new()
        } else {
            data.slice(skip..)
        };
        if input.pending_bytes + data.len() > MAX_INPUT_BUFFER {
            let reason = format!("input buffer full ({} bytes waiting)", input.pending_bytes);
            self.reject(Some(id), RejectKind::InputFull, reason);
            return;
        }
        input.received += data.len() as u64;
        input.pending_bytes += data.len();
        if !data.is_empty() {
            input.pending.push_back(data);
        }
        if eof {
            input.eof = true;
        }
    }

    /// Writes waiting input: on stdin pipes and terminals as far as they
    /// take it without blocking, into files a chunk at a time.
    pub(super) fn pump_inputs(&mut self) {
        let mut finished = Vec::new();
        for (id, op) in &mut self.ops {
            if let Some(run) = op.running.as_mut() {
                let (Some(input), Some(fd)) = (run.input.as_mut(), run.stdin.as_ref()) else {
                    continue;
                };
                if input.closed {
                    continue;
                }
                if input.eof && run.terminal.is_some() && !input.eof_sent {
                    // A terminal gets its end-of-file character (written
                    // like any input); it stays open for the output.
                    input.eof_sent = true;
                    input.pending.push_back(Bytes::from_static(&[TERMINAL_EOF]));
                    input.pending_bytes += 1;
                }
                input.pump(fd);
                if input.eof && input.pending.is_empty() && !input.closed {
                    input.closed = true;
                    input.ack_due = true;
                    if run.terminal.is_none() {
                        run.stdin = None;
                    }
                }
                if input.closed && run.terminal.is_none() {
                    run.stdin = None;
                }
            } else if let Some(FileTask::Write { writer, input, .. }) = op.file.as_mut() {
                let mut budget = WRITE_CHUNK;
                while budget > 0
                    && let Some(chunk) = input.pending.front_mut()
                {
                    let n = chunk.len().min(budget);
                    if let Err(refusal) = writer.write(&chunk[..n]) {
                        finished.push((id.clone(), Some(refusal)));
                        break;
                    }
                    let _ = chunk.split_to(n);
                    if chunk.is_empty() {
                        input.pending.pop_front();
                    }
                    input.pending_bytes -= n;
                    input.consumed += n as u64;
                    input.ack_due = true;
                    budget -= n;
                }
                if input.eof && input.pending.is_empty() {
                    finished.push((id.clone(), None));
                }
            }
        }
        for (id, refusal) in finished {
            let Some(op) = self.ops.get_mut(&id) else {
                continue;
            };
            let Some(FileTask::Write {
                writer,
                mut input,
                started,
            }) = op.file.take()
            else {
                continue;
            };
            input.close();
            let mut result = match refusal {
                Some(refusal) => {
                    writer.abort();
                    refusal.into()
                }
                None => writer.finish(),
            };
            result.duration_ms = started.elapsed().as_millis() as u64;
            self.send_ack(&id, &input);
            self.complete(&id, result);
        }
    }

    /// Sends streamed file reads on, a chunk per read within the credit.
    pub(super) fn stream_files(&mut self, buf: &mut [u8]) {
        let ids: Vec<OperationId> = self
            .ops
            .iter()
            .filter(|(_, op)| matches!(op.file, Some(FileTask::Read { .. })))
            .map(|(id, _)| id.clone())
            .collect();
        for id in ids {
            if self.credit == 0 {
                return;
            }
            let credit = usize::try_from(self.credit).unwrap_or(usize::MAX);
            let Some(Some(FileTask::Read {
                file, left, sent, ..
            })) = self.ops.get_mut(&id).map(|op| op.file.as_mut())
            else {
                continue;
            };
            let want = buf
                .len()
                .min(credit)
                .min(left.map_or(usize::MAX, |l| usize::try_from(l).unwrap_or(usize::MAX)));
            let read = if want == 0 {
                Ok(0)
            } else {
                file.read(&mut buf[..want])
            };
            match read {
                Ok(0) => {
                    let Some(Some(FileTask::Read {
                        sent,
                        size,
                        started,
                        ..
                    })) = self.ops.get_mut(&id).map(|op| op.file.take())
                    else {
                        continue;
                    };
                    let mut result = OperationResult::with_outcome(Outcome::Exited { code: 0 });
                    result.file_size = size;
                    result.bytes_written = sent;
                    result.duration_ms = started.elapsed().as_millis() as u64;
                    self.complete(&id, result);
                }
                Ok(n) => {
                    *sent += n as u64;
                    if let Some(l) = left {
                        *l -= n as u64;
                    }
                    self.credit -= n as u64;
                    let data = Bytes::copy_from_slice(&buf[..n]);
                    self.emit(
                        &id,
                        EventKind::Output {
                            stream: OutputStream::Stdout,
                            data,
                        },
                    );
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => {
                    if let Some(op) = self.ops.get_mut(&id) {
                        op.file = None;
                    }
                    let result = OperationResult::with_outcome(Outcome::FileError {
                        kind: corral_proto::FileErrorKind::Other,
                        message: format!("reading: {e}"),
                    });
                    self.complete(&id, result);
                }
            }
        }
    }

    pub(super) fn send_ack(&mut self, id: &OperationId, input: &Input) {
        self.send(InitMessage::InputAck {
            operation_id: id.clone(),
            received: input.received,
            consumed: input.consumed,
            closed: input.closed,
        });
    }

    /// Tells the worker how far each input got, once per turn of the loop.
    pub(super) fn send_acks(&mut self) {
        let mut acks = Vec::new();
        for (id, op) in &mut self.ops {
            if let Some(input) = op.input_mut()
                && std::mem::take(&mut input.ack_due)
            {
                acks.push(InitMessage::InputAck {
                    operation_id: id.clone(),
                    received: input.received,
                    consumed: input.consumed,
                    closed: input.closed,
                });
            }
        }
        for ack in acks {
            self.send(ack);
        }
    }
}
