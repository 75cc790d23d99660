//! The sandbox's actor: the only writer of its journal and operation
//! table, and the owner of the link to its supervisor (attach, credit,
//! inputs, resets, egress and port reports).

use super::*;

pub(super) fn short(container: &str) -> &str {
    &container[..container.len().min(12)]
}

pub(super) struct Actor {
    pub(super) id: SandboxId,
    pub(super) container: String,
    pub(super) runtime: Arc<dyn Runtime>,
    pub(super) metrics: Arc<crate::metrics::WorkerMetrics>,
    /// Operations' spans, when exported.
    pub(super) traces: Option<Arc<crate::telemetry::OpTraces>>,
    /// Operations submitted under a trace context, not yet ended, each
    /// with whether its first output was told to `traces` (only theirs
    /// is, once; only their ends are).
    pub(super) traced: HashMap<OperationId, bool>,
    pub(super) shared: Arc<Shared>,
    pub(super) rx: mpsc::Receiver<Command>,
    pub(super) output: Option<Output>,
    pub(super) input: Option<Input>,
    pub(super) decoder: FrameDecoder,
    pub(super) boot_id: Option<String>,
    pub(super) welcomed: bool,
    /// Pages of a Welcome still coming, and their encoded size.
    pub(super) welcome_pages: Option<Welcome>,
    pub(super) welcome_bytes: usize,
    /// Attaches made so far: the current one's number, which its Welcome
    /// echoes.
    pub(super) attaches: u64,
    /// Credit granted to init since the last attach, and output received.
    pub(super) granted: u64,
    pub(super) received: u64,
    /// Events up to this seq are replays, which take no credit.
    pub(super) live_after: u64,
    /// Partial line of init's own log (its stderr).
    pub(super) stderr: Vec<u8>,
    /// A watcher is holding the window back: look again in a while.
    pub(super) stall_check: bool,
    /// When input calls that wait past what init has are looked at again.
    pub(super) gaps_at: Option<tokio::time::Instant>,
    /// Input of operations that take it.
    pub(super) inputs: HashMap<OperationId, InputLink>,
    /// Resets sent to init, answered in order.
    pub(super) resets: VecDeque<oneshot::Sender<Result<u32>>>,
    /// Decisions of the sandbox's egress proxy, for init to journal.
    pub(super) egress_reports: Option<mpsc::Receiver<corral_proto::event::Egress>>,
    /// What the worker saw of the way in to its ports, for init to journal.
    pub(super) port_reports: Option<mpsc::Receiver<corral_proto::event::PortEvent>>,
    /// Those reports not yet sent (no link to init just now), oldest first.
    pub(super) reports_pending: VecDeque<InitRequest>,
}

/// Most reports kept while init cannot be told; past it the oldest go
/// (the metrics count them all).
const MAX_REPORTS_PENDING: usize = 1024;

async fn next_report<T>(rx: &mut Option<mpsc::Receiver<T>>) -> Option<T> {
    match rx {
        Some(rx) => rx.recv().await,
        None => std::future::pending().await,
    }
}

/// The reports a report says went untold before it.
fn unreported(r: &InitRequest) -> u32 {
    match r {
        InitRequest::Egress(e) => e.unreported,
        InitRequest::Port(e) => e.unreported,
        _ => 0,
    }
}

fn add_unreported(r: &mut InitRequest, n: u32) {
    match r {
        InitRequest::Egress(e) => e.unreported = e.unreported.saturating_add(n),
        InitRequest::Port(e) => e.unreported = e.unreported.saturating_add(n),
        _ => {}
    }
}

enum Wake {
    Command(Option<Command>),
    Egress(Option<corral_proto::event::Egress>),
    Port(Option<corral_proto::event::PortEvent>),
    Output(Option<Result<LogOutput, bollard::errors::Error>>),
    Progress,
    Gaps,
    Closed,
}

/// Sleeps until `at` (never, without one).
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

impl Actor {
    pub(super) async fn run(mut self) {
        while !self.shared.closed.is_cancelled() {
            if self.output.is_none() && !self.is_lost() {
                self.connect().await;
            }
            let wake = tokio::select! {
                () = self.shared.closed.cancelled() => Wake::Closed,
                cmd = self.rx.recv() => Wake::Command(cmd),
                item = next_output(&mut self.output) => Wake::Output(item),
                () = self.shared.progress.notified() => Wake::Progress,
                e = next_report(&mut self.egress_reports) => Wake::Egress(e),
                e = next_report(&mut self.port_reports) => Wake::Port(e),
                () = tokio::time::sleep(Duration::from_millis(250)), if self.stall_check => Wake::Progress,
                () = sleep_until_some(self.gaps_at), if self.gaps_at.is_some() => Wake::Gaps,
            };
            match wake {
                Wake::Closed | Wake::Command(None) => break,
                Wake::Command(Some(cmd)) => self.handle(cmd).await,
                Wake::Output(Some(Ok(LogOutput::StdOut { message }))) => {
                    self.on_frames(&message).await;
                }
                Wake::Output(Some(Ok(LogOutput::StdErr { message }))) => self.on_init_log(&message),
                Wake::Output(Some(Ok(_))) => {}
                Wake::Output(Some(Err(e))) => {
                    debug!(error = %e, "attach stream failed");
                    self.detach();
                }
                Wake::Output(None) => {
                    debug!("attach stream ended");
                    self.detach();
                }
                Wake::Progress => self.grant().await,
                Wake::Gaps => {}
                Wake::Egress(None) => self.egress_reports = None,
                Wake::Egress(Some(e)) => self.pending(InitRequest::Egress(e)),
                Wake::Port(None) => self.port_reports = None,
                Wake::Port(Some(e)) => self.pending(InitRequest::Port(e)),
            }
            // Input calls waiting past what init has: given up on after
            // their patience, whatever else woke the actor meanwhile.
            if self
                .gaps_at
                .is_some_and(|at| at <= tokio::time::Instant::now())
            {
                self.gaps_at = None;
                let waiting: Vec<OperationId> = self.inputs.keys().cloned().collect();
                for id in waiting {
                    self.pump_input(&id).await;
                }
            }
            while self.welcomed
                && let Some(e) = self.reports_pending.pop_front()
            {
                if !self.send(e.clone()).await {
                    self.reports_pending.push_front(e);
                    break;
                }
            }
        }
        debug!("sandbox actor stopped");
    }

    /// Keeps a report for init, the oldest dropped past the bound (and
    /// counted in the next one's `unreported`: a gap is said).
    fn pending(&mut self, report: InitRequest) {
        if self.reports_pending.len() >= MAX_REPORTS_PENDING
            && let Some(old) = self.reports_pending.pop_front()
        {
            let lost = 1 + unreported(&old);
            if let Some(next) = self.reports_pending.front_mut() {
                add_unreported(next, lost);
            }
        }
        self.reports_pending.push_back(report);
    }

    fn is_lost(&self) -> bool {
        matches!(*self.shared.state.borrow(), SandboxState::Lost(_))
    }

    fn detach(&mut self) {
        self.output = None;
        self.input = None;
        self.welcomed = false;
        self.welcome_pages = None;
        self.welcome_bytes = 0;
        self.decoder = FrameDecoder::new();
        // Input in flight is sent again after the next attach (init places
        // it by offset, so nothing is taken twice); resets are not.
        for link in self.inputs.values_mut() {
            link.unsend();
        }
        for reply in self.resets.drain(..) {
            let _ = reply.send(Err(WorkerError::Detached(self.id.to_string())));
        }
    }

    /// Attaches (again) to the container, or declares the sandbox lost.
    async fn connect(&mut self) {
        let started = tokio::time::Instant::now();
        let mut warned_after = Duration::from_secs(10);
        let mut delay = Duration::from_millis(50);
        loop {
            match self.runtime.running(&self.container).await {
                Ok(Some(true)) => match self.runtime.attach(&self.container).await {
                    Ok(attached) => {
                        self.output = Some(attached.output);
                        self.input = Some(attached.input);
                        let after_seq = lock(&self.shared.journal).last_seq();
                        self.granted = WINDOW_BYTES;
                        self.received = 0;
                        self.attaches += 1;
                        let attach = InitRequest::Attach {
                            after_seq,
                            window_bytes: WINDOW_BYTES,
                            attach: self.attaches,
                        };
                        if self.send(attach).await {
                            debug!(after_seq, "attached");
                            return;
                        }
                    }
                    Err(e) => debug!(error = %e, "attach failed"),
                },
                Ok(Some(false) | None) => {
                    let reason = self.runtime.exit_reason(&self.container).await;
                    self.lose(reason);
                    return;
                }
                // Docker does not answer: the sandbox may well be running
                // (its supervisor journals what happens meanwhile), so the
                // worker waits for the engine for as long as it takes.
                Err(e) => {
                    if started.elapsed() > warned_after {
                        warn!(error = %e, down_for = ?started.elapsed(), "Docker unreachable; still waiting to re-attach");
                        warned_after += Duration::from_secs(30);
                    }
                    debug!(error = %e, "Docker unreachable; retrying");
                }
            }
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = self.shared.closed.cancelled() => return,
            }
            delay = (delay * 2).min(Duration::from_secs(2));
        }
    }

    /// Writes one frame to init. On failure the link is dropped (and later
    /// re-established); returns whether the frame went out.
    pub(super) async fn send(&mut self, req: InitRequest) -> bool {
        let Some(input) = self.input.as_mut() else {
            return false;
        };
        let bytes = frame::encode(&pb::InitRequest::from(req));
        let written = async {
            input.write_all(&bytes).await?;
            input.flush().await
        }
        .await;
        match written {
            Ok(()) => true,
            Err(e) => {
                debug!(error = %e, "writing to the supervisor failed");
                self.detach();
                false
            }
        }
    }

    async fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit {
                id,
                spec,
                traceparent,
                reply,
            } => {
                let result = self.submit(id, spec, traceparent).await;
                let _ = reply.send(result);
            }
            Command::Cancel { id, reply } => {
                let running = lock(&self.shared.ops)
                    .ops
                    .get(&id)
                    .is_some_and(|r| r.result.is_none());
                if running {
                    self.send(InitRequest::Cancel { operation_id: id }).await;
                }
                let _ = reply.send(running);
            }
            Command::Signal { id, signal, reply } => {
                let known = lock(&self.shared.ops).ops.get(&id).map(|r| {
                    (
                        matches!(r.spec, OperationSpec::Shell(_)),
                        r.result.is_none(),
                    )
                });
                let answer = match known {
                    None => Err(WorkerError::UnknownOperation(id.to_string())),
                    Some((false, _)) => Err(WorkerError::NotApplicable(format!(
                        "operation {id} is no command: it takes no signal"
                    ))),
                    Some((true, false)) => Ok(false),
                    Some((true, true)) => {
                        self.send(InitRequest::Signal {
                            operation_id: id,
                            signal,
                        })
                        .await;
                        Ok(true)
                    }
                };
                let _ = reply.send(answer);
            }
            Command::Input(p) => self.on_input(p).await,
            Command::Resize { id, size, reply } => {
                let terminal = lock(&self.shared.ops).ops.get(&id).map(|r| {
                    (
                        matches!(&r.spec, OperationSpec::Shell(s) if s.terminal.is_some()),
                        r.result.is_none(),
                    )
                });
                let answer = match terminal {
                    None => Err(WorkerError::UnknownOperation(id.to_string())),
                    Some((false, _)) => Err(WorkerError::NotApplicable(format!(
                        "operation {id} has no terminal"
                    ))),
                    Some((true, false)) => Ok(()),
                    Some((true, true)) => {
                        if self
                            .send(InitRequest::Resize {
                                operation_id: id,
                                size,
                            })
                            .await
                        {
                            Ok(())
                        } else {
                            Err(WorkerError::Detached(self.id.to_string()))
                        }
                    }
                };
                let _ = reply.send(answer);
            }
            Command::StartIngress { secret, reply } => {
                let answer =
                    if self.welcomed && self.send(InitRequest::StartIngress { secret }).await {
                        Ok(())
                    } else {
                        Err(WorkerError::Detached(self.id.to_string()))
                    };
                let _ = reply.send(answer);
            }
            Command::Reset { reply } => {
                if let SandboxState::Lost(reason) = &*self.shared.state.borrow() {
                    let _ = reply.send(Err(WorkerError::SandboxLost {
                        id: self.id.to_string(),
                        reason: reason.clone(),
                    }));
                    return;
                }
                if self.welcomed && self.send(InitRequest::Reset).await {
                    self.resets.push_back(reply);
                } else {
                    let _ = reply.send(Err(WorkerError::Detached(self.id.to_string())));
                }
            }
        }
    }

    async fn submit(
        &mut self,
        id: OperationId,
        spec: OperationSpec,
        traceparent: Option<String>,
    ) -> Result<OperationRecord> {
        if let SandboxState::Lost(reason) = &*self.shared.state.borrow() {
            return Err(WorkerError::SandboxLost {
                id: self.id.to_string(),
                reason: reason.clone(),
            });
        }
        let record = {
            let mut ops = lock(&self.shared.ops);
            if let Some(existing) = ops.ops.get(&id) {
                // A record learnt from init after a restart has no bytes of
                // a write (they are never echoed back).
                return if existing.spec == spec || existing.spec == spec.without_data() {
                    Ok(existing.clone())
                } else {
                    Err(WorkerError::Conflict {
                        what: "operation",
                        id: id.to_string(),
                    })
                };
            }
            let record = OperationRecord {
                id: id.clone(),
                spec: spec.clone(),
                result: None,
                first_seq: 0,
                input_bytes: 0,
            };
            ops.ops.insert(id.clone(), record.clone());
            record
        };
        info!(operation = %id, kind = spec.kind(), "operation submitted");
        if let (Some(traces), Some(parent)) = (&self.traces, &traceparent)
            && traces.submitted(&self.id, &id, spec.kind(), parent)
        {
            self.traced.insert(id.clone(), false);
        }
        // Before the supervisor's welcome the run is sent with the others
        // init does not know yet (see `on_welcome`).
        if self.welcomed {
            self.send(InitRequest::Run {
                operation_id: id,
                spec,
            })
            .await;
        }
        Ok(record)
    }

    async fn on_frames(&mut self, data: &Bytes) {
        self.decoder.extend(data);
        loop {
            match self.decoder.next_message::<pb::InitMessage>() {
                Ok(None) => break,
                Ok(Some(msg)) => {
                    let bytes = prost::Message::encoded_len(&msg);
                    match InitMessage::try_from(msg) {
                        Ok(msg) => self.on_message(msg, bytes).await,
                        Err(e) => warn!(error = %e, "invalid message from the supervisor, skipped"),
                    }
                }
                Err(e @ ProtocolError::FrameTooLarge { .. }) => {
                    // The link can no longer be trusted to be in step.
                    warn!(error = %e, "supervisor protocol error");
                    self.detach();
                    break;
                }
                Err(e) => warn!(error = %e, "undecodable frame from the supervisor, skipped"),
            }
        }
    }

    /// A message from the supervisor, `bytes` encoded.
    async fn on_message(&mut self, msg: InitMessage, bytes: usize) {
        match msg {
            InitMessage::Welcome(w) => self.on_welcome(w, bytes).await,
            // Events that reach a fresh attach before the Welcome were
            // written before init saw our Attach, so its replay (which follows
            // the Welcome) carries them too. Taking them now would move the
            // mirror's cursor past the replay and lose everything before them.
            InitMessage::Event(_) if !self.welcomed => {}
            InitMessage::Event(event) => self.on_event(event).await,
            InitMessage::Rejected {
                operation_id,
                kind,
                reason,
            } => {
                warn!(operation = ?operation_id.as_ref().map(ToString::to_string), reason, "supervisor rejected a request");
                // Input it would not take is sent again once there is room.
                if let Some(id) = operation_id
                    && let Some(link) = self.inputs.get_mut(&id)
                    && !link.in_flight.is_empty()
                {
                    let finished = lock(&self.shared.ops)
                        .ops
                        .get(&id)
                        .is_none_or(|r| r.result.is_some());
                    // What followed it was refused too (a gap): all of it
                    // goes again, from what init has.
                    link.unsend();
                    if finished || kind == corral_proto::init::RejectKind::UnknownOperation {
                        // Nothing will take it any more: say so, not wait.
                        link.close_all();
                    }
                }
            }
            InitMessage::InputAck {
                operation_id,
                received,
                consumed,
                closed,
            } => {
                self.on_input_ack(operation_id, received, consumed, closed)
                    .await;
            }
            InitMessage::ResetDone { killed } => {
                info!(killed, "sandbox reset");
                if let Some(reply) = self.resets.pop_front() {
                    let _ = reply.send(Ok(killed));
                }
            }
        }
    }

    /// A page of the supervisor's Welcome (`bytes` encoded). A Welcome
    /// comes in pages, and is acted on once whole; pages of an earlier
    /// attach's Welcome (still in the pipe when this attach began) are
    /// skipped. Pages out of order, disagreeing or past any sane size are a
    /// broken or hostile supervisor: attaching again would only get the same
    /// Welcome, so the sandbox is lost.
    async fn on_welcome(&mut self, mut w: Welcome, bytes: usize) {
        // 0: a supervisor from before attaches were counted.
        if w.attach != 0 && w.attach != self.attaches {
            debug!(
                attach = w.attach,
                current = self.attaches,
                "a Welcome of an earlier attach, skipped"
            );
            return;
        }
        let expected = self.welcome_pages.as_ref().map_or(0, |p| p.page + 1);
        if w.attach != 0 && w.page != expected {
            self.lose(format!(
                "the sandbox's supervisor sent Welcome page {} where {expected} was due",
                w.page
            ));
            return;
        }
        self.welcome_bytes = self.welcome_bytes.saturating_add(bytes);
        if self.welcome_bytes > MAX_WELCOME_BYTES {
            self.lose(format!(
                "the sandbox's supervisor sent a Welcome of over {} MiB",
                MAX_WELCOME_BYTES >> 20
            ));
            return;
        }
        if let Some(mut earlier) = self.welcome_pages.take() {
            if earlier.boot_id != w.boot_id {
                self.lose("the sandbox's supervisor sent Welcome pages that disagree".into());
                return;
            }
            earlier.operations.append(&mut w.operations);
            earlier.last_seq = w.last_seq;
            earlier.more = w.more;
            earlier.page = w.page;
            w = earlier;
        }
        if w.more {
            self.welcome_pages = Some(w);
            return;
        }
        self.welcome_bytes = 0;
        if let Some(known) = &self.boot_id
            && known != &w.boot_id
        {
            self.lose("the sandbox's supervisor restarted".into());
            return;
        }
        info!(
            version = w.version,
            last_seq = w.last_seq,
            operations = w.operations.len(),
            "supervisor attached"
        );
        self.boot_id = Some(w.boot_id);
        self.live_after = w.last_seq;
        let known: std::collections::HashSet<OperationId> =
            w.operations.iter().map(|o| o.id.clone()).collect();
        for rec in w.operations.iter().filter(|r| r.result.is_none()) {
            if let Some(link) = self.inputs.get_mut(&rec.id) {
                link.received = rec.input_bytes;
                link.sent = rec.input_bytes;
                link.consumed = link.consumed.min(rec.input_bytes);
            }
        }
        let unsent: Vec<(OperationId, OperationSpec)> = {
            let mut ops = lock(&self.shared.ops);
            for rec in w.operations {
                ops.merge(rec);
            }
            ops.ops
                .values()
                .filter(|r| r.result.is_none() && !known.contains(&r.id))
                .map(|r| (r.id.clone(), r.spec.clone()))
                .collect()
        };
        self.welcomed = true;
        // A sandbox with egress has its relay before any command: a pool's
        // member, made without one, is given it now (the supervisor keeps
        // the one it has).
        if self.shared.egress.is_some() {
            self.send(InitRequest::StartRelay).await;
        }
        for (operation_id, spec) in unsent {
            self.send(InitRequest::Run { operation_id, spec }).await;
        }
        self.shared.state.send_replace(SandboxState::Ready);
        let waiting: Vec<OperationId> = self.inputs.keys().cloned().collect();
        for id in waiting {
            self.pump_input(&id).await;
        }
    }

    async fn on_event(&mut self, event: Event) {
        let seq = event.seq;
        if seq > self.live_after {
            let last = lock(&self.shared.journal).last_seq();
            let wrong = violation(&lock(&self.shared.ops), last, &event);
            if let Some(what) = wrong {
                self.lose(format!(
                    "its supervisor broke the protocol ({what}): the sandbox is treated as compromised"
                ));
                return;
            }
        }
        if seq > self.live_after {
            self.received += event.output_len() as u64;
        }
        {
            let mut ops = lock(&self.shared.ops);
            if let Some(id) = &event.operation_id {
                match &event.kind {
                    EventKind::Output { .. } => {
                        if let Some(traces) = &self.traces
                            && seq > self.live_after
                            && let Some(told) = self.traced.get_mut(id)
                            && !*told
                        {
                            *told = true;
                            traces.output(id);
                        }
                    }
                    EventKind::Started { .. } => {
                        if let Some(r) = ops.ops.get_mut(id)
                            && r.first_seq == 0
                        {
                            r.first_seq = seq;
                        }
                    }
                    EventKind::Finished(result) => {
                        if let Some(r) = ops.ops.get_mut(id)
                            && r.first_seq == 0
                        {
                            r.first_seq = seq;
                        }
                        info!(operation = %id, outcome = %result.outcome, "operation finished");
                        if seq > self.live_after
                            && let Some(r) = ops.ops.get(id)
                        {
                            self.metrics.operation_finished(
                                r.spec.kind(),
                                crate::metrics::outcome_label(&result.outcome),
                                Duration::from_millis(result.duration_ms),
                            );
                        }
                        ops.finish(id, (**result).clone());
                        // Also for an operation submitted before a restart
                        // (the actor starts with those the worker kept).
                        if let Some(traces) = &self.traces
                            && self.traced.remove(id).is_some()
                        {
                            traces.finished(&self.id, id, result);
                        }
                        if let Some(mut link) = self.inputs.remove(id) {
                            link.close_all();
                        }
                    }
                    _ => {}
                }
            }
        }
        if lock(&self.shared.journal).insert(event) {
            self.shared.last_seq.send_replace(seq);
        }
        self.grant().await;
    }

    async fn grant(&mut self) {
        let mut backlog = self.shared.backlog();
        if self.shared.drop_stalled(self.stall_check, backlog) {
            self.stall_check = true;
        } else if std::mem::take(&mut self.stall_check) {
            // A watcher was dropped or caught up: the backlog changed.
            backlog = self.shared.backlog();
        }
        if !self.welcomed {
            return;
        }
        let in_flight = self.granted.saturating_sub(self.received);
        let used = in_flight + backlog;
        if used < WINDOW_BYTES / 2 {
            let more = WINDOW_BYTES - used;
            if self.send(InitRequest::Credit { bytes: more }).await {
                self.granted += more;
            }
        }
    }

    fn on_init_log(&mut self, data: &[u8]) {
        self.stderr.extend_from_slice(data);
        while let Some(nl) = self.stderr.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.stderr.drain(..=nl).collect();
            info!(line = %String::from_utf8_lossy(&line).trim_end(), "supervisor log");
        }
        if self.stderr.len() > 64 * 1024 {
            self.stderr.clear();
        }
    }

    /// The sandbox is gone: every running operation ends as lost.
    fn lose(&mut self, reason: String) {
        warn!(reason, "sandbox lost");
        self.detach();
        for (_, mut link) in self.inputs.drain() {
            link.fail_all(|| WorkerError::SandboxLost {
                id: self.id.to_string(),
                reason: reason.clone(),
            });
        }
        let running: Vec<OperationId> = lock(&self.shared.ops)
            .ops
            .values()
            .filter(|r| r.result.is_none())
            .map(|r| r.id.clone())
            .collect();
        let mut journal = lock(&self.shared.journal);
        for id in running {
            let result = OperationResult::with_outcome(Outcome::SandboxLost {
                reason: reason.clone(),
            });
            lock(&self.shared.ops).finish(&id, result.clone());
            if let Some(traces) = &self.traces
                && self.traced.remove(&id).is_some()
            {
                traces.finished(&self.id, &id, &result);
            }
            journal.push(Some(id), EventKind::Finished(Box::new(result)));
        }
        journal.push(
            None,
            EventKind::SandboxLost {
                reason: reason.clone(),
            },
        );
        let seq = journal.last_seq();
        drop(journal);
        self.shared.last_seq.send_replace(seq);
        self.shared.state.send_replace(SandboxState::Lost(reason));
    }
}

async fn next_output(
    output: &mut Option<Output>,
) -> Option<Result<LogOutput, bollard::errors::Error>> {
    match output {
        Some(o) => o.next().await,
        None => std::future::pending().await,
    }
}
