//! The one way the harness waits for operations: a sandbox's events
//! followed from a cursor, across broken streams, restarted workers and
//! network blinks, with nothing lost or repeated. The operation managers
//! follow a whole sandbox; `corral exec` follows one operation.

use std::future::Future;
use std::time::Duration;

use corral_proto::{Event, OperationId, SandboxId};
use futures_util::StreamExt;
use tokio::time::Instant;

use crate::worker_api::{ApiError, Events, WorkerApi};

/// How long a worker may stay unreachable before a waiter gives up on it
/// (`--worker-lost-after`): its sandbox is then taken for lost.
pub const DEFAULT_PATIENCE: Duration = Duration::from_secs(60);
/// First pause between attempts; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Why following stopped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FollowError {
    /// The worker stayed unreachable for the whole patience.
    #[error("sandbox lost: {worker} unreachable for {}s ({last})", .patience.as_secs())]
    GaveUp {
        worker: String,
        patience: Duration,
        last: String,
    },
    /// The worker refused (an unknown sandbox, say).
    #[error("{0}")]
    Refused(ApiError),
}

/// Runs `call` until it succeeds, retrying transient failures with
/// backoff for up to `patience`.
pub async fn retry<T, F, Fut>(
    worker: &impl WorkerApi,
    patience: Duration,
    mut call: F,
) -> Result<T, FollowError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, ApiError>>,
{
    let mut deadline: Option<Instant> = None;
    let mut delay = FIRST_BACKOFF;
    loop {
        // A call may take long by design (input waiting for a slow
        // reader): only failures count against the deadline, from the
        // first one on.
        match call().await {
            Ok(v) => return Ok(v),
            Err(ApiError::Transient(e)) => {
                let deadline = *deadline.get_or_insert_with(|| Instant::now() + patience);
                if Instant::now() >= deadline {
                    return Err(FollowError::GaveUp {
                        worker: worker.name(),
                        patience,
                        last: e,
                    });
                }
                tracing::debug!(error = %e, "transient failure; retrying");
                // The last attempt is made at the deadline.
                tokio::time::sleep_until((Instant::now() + delay).min(deadline)).await;
                delay = (delay * 2).min(MAX_BACKOFF);
            }
            Err(e) => return Err(FollowError::Refused(e)),
        }
    }
}

/// A sandbox's events from a cursor on. [`Follower::next`] is
/// cancel-safe: it can sit in a `select!` beside other work.
pub struct Follower<W: WorkerApi> {
    worker: W,
    sandbox: SandboxId,
    only: Option<OperationId>,
    cursor: u64,
    stream: Option<Events>,
    patience: Duration,
    /// Since when the worker has been unreachable.
    lost_since: Option<Instant>,
    delay: Duration,
    /// When the next attempt may be made: kept across calls, so a `next`
    /// cancelled in the middle of a pause does not skip the backoff.
    retry_at: Option<Instant>,
}

impl<W: WorkerApi> Follower<W> {
    /// Follows events after `after_seq` (of one operation, with `only`).
    pub fn new(worker: W, sandbox: SandboxId, after_seq: u64, only: Option<OperationId>) -> Self {
        Self {
            worker,
            sandbox,
            only,
            cursor: after_seq,
            stream: None,
            patience: DEFAULT_PATIENCE,
            lost_since: None,
            delay: FIRST_BACKOFF,
            retry_at: None,
        }
    }

    /// Follows what happens from now on: the cursor is the sandbox's
    /// current seq, and the stream is open (its watcher registered) when
    /// this returns, so nothing submitted afterwards can outrun it.
    pub async fn from_now(
        worker: W,
        sandbox: SandboxId,
        only: Option<OperationId>,
        patience: Duration,
    ) -> Result<Self, FollowError> {
        let last = retry(&worker, patience, || worker.get_sandbox(&sandbox)).await?;
        let mut f = Self::new(worker, sandbox, last.last_seq, only).with_patience(patience);
        f.open().await?;
        Ok(f)
    }

    /// Follows operation `id` on a stream already open (a `run`'s), from
    /// its first event: a break reopens it after the last event handed
    /// out (before any, after `after_seq`).
    pub fn on_stream(
        worker: W,
        sandbox: SandboxId,
        id: OperationId,
        after_seq: u64,
        stream: Events,
    ) -> Self {
        let mut f = Self::new(worker, sandbox, after_seq, Some(id));
        f.stream = Some(stream);
        f
    }

    pub fn with_patience(mut self, patience: Duration) -> Self {
        self.patience = patience;
        self
    }

    /// The seq of the last event handed out.
    pub fn cursor(&self) -> u64 {
        self.cursor
    }

    pub fn worker(&self) -> &W {
        &self.worker
    }

    /// How long the worker has been unreachable, while it is.
    pub fn unreachable_for(&self) -> Option<Duration> {
        self.lost_since.map(|since| since.elapsed())
    }

    /// Opens the stream from the cursor if it is not open, retrying
    /// transient failures within the patience.
    pub async fn open(&mut self) -> Result<(), FollowError> {
        while self.stream.is_none() {
            if let Some(at) = self.retry_at {
                tokio::time::sleep_until(at).await;
                self.retry_at = None;
            }
            // While the worker is unreachable, no attempt outlives the
            // deadline, and none starts after it: the deadline holds even
            // when attempts are cut short (a `next` cancelled in a
            // `select!`, a connect that hangs on dropped packets).
            let deadline = self.lost_since.map(|since| since + self.patience);
            let late = || Err(ApiError::Transient("no answer before the deadline".into()));
            let answered = match deadline {
                Some(at) if Instant::now() >= at => late(),
                Some(at) => {
                    let attempt = self
                        .worker
                        .watch(&self.sandbox, self.cursor, self.only.as_ref());
                    tokio::time::timeout_at(at, attempt)
                        .await
                        .unwrap_or_else(|_| late())
                }
                None => {
                    self.worker
                        .watch(&self.sandbox, self.cursor, self.only.as_ref())
                        .await
                }
            };
            match answered {
                Ok(s) => {
                    // Reachable again: a later break starts a new patience.
                    self.lost_since = None;
                    self.stream = Some(s);
                }
                Err(ApiError::Transient(e)) => self.pause(e).await?,
                Err(e) => return Err(FollowError::Refused(e)),
            }
        }
        Ok(())
    }

    /// The next event. A broken stream is reopened from the cursor; the
    /// error says the worker stayed unreachable for the whole patience (a
    /// later call starts a new patience) or refused.
    pub async fn next(&mut self) -> Result<Event, FollowError> {
        loop {
            self.open().await?;
            let Some(stream) = self.stream.as_mut() else {
                continue;
            };
            match stream.next().await {
                Some(Ok(event)) => {
                    self.lost_since = None;
                    self.delay = FIRST_BACKOFF;
                    self.cursor = self.cursor.max(event.seq);
                    return Ok(event);
                }
                Some(Err(e)) if !e.is_transient() => {
                    self.stream = None;
                    return Err(FollowError::Refused(e));
                }
                // The stream broke, or the worker closed it (a restart):
                // resume from the cursor.
                Some(Err(e)) => {
                    self.stream = None;
                    self.pause(e.to_string()).await?;
                }
                None => {
                    self.stream = None;
                    self.pause("the event stream ended".into()).await?;
                }
            }
        }
    }

    /// Waits before the next attempt, or gives up once the worker has been
    /// unreachable for the whole patience.
    async fn pause(&mut self, last: String) -> Result<(), FollowError> {
        let now = Instant::now();
        // The first failure after the worker was reachable starts the
        // patience, and is always retried.
        let since = *self.lost_since.get_or_insert(now);
        let deadline = since + self.patience;
        if now > since && now >= deadline {
            self.lost_since = None;
            self.delay = FIRST_BACKOFF;
            self.retry_at = None;
            crate::metrics::control().workers_lost.inc();
            return Err(FollowError::GaveUp {
                worker: self.worker.name(),
                patience: self.patience,
                last,
            });
        }
        tracing::debug!(error = %last, cursor = self.cursor, "following again from the cursor");
        // The last attempt is made at the deadline.
        let at = (now + self.delay).min(deadline);
        self.retry_at = Some(at);
        self.delay = (self.delay * 2).min(MAX_BACKOFF);
        tokio::time::sleep_until(at).await;
        self.retry_at = None;
        Ok(())
    }
}
