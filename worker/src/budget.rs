//! What requests may hold while they are read: each call's message is
//! bounded by what the call carries (only a Submit carries file data: 8 MiB
//! and room for a command; every other call at most 2 MiB), and all the
//! messages being read at once, across every connection, by one budget
//! (`--max-request-memory`). Both are decided from the gRPC length prefix,
//! before a byte of the message is buffered: a message over its call's
//! limit is refused with `OUT_OF_RANGE`; one that does not fit the budget
//! waits, unread, for room (HTTP/2 flow control holds its client), and
//! takes all it needs at once, so requests that each hold part of the
//! budget never wait on one another.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body as _, Frame};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::Status;

use corral_proto::limits::{MAX_INPUT_CHUNK_BYTES, MAX_REQUEST_BYTES};

/// The default of `--max-request-memory`.
pub const DEFAULT_BYTES: usize = 512 << 20;
/// The calls that carry file data (a write's): a submit, alone or with
/// its watch.
const SUBMIT: &str = "/corral.v1.Worker/SubmitOperation";
const RUN: &str = "/corral.v1.Worker/RunOperation";
/// Largest message of every call but [`SUBMIT`]: a WriteInput's or an
/// Upload's chunk (1 MiB) and room for ids and a path.
pub const MAX_OTHER_REQUEST_BYTES: usize = MAX_INPUT_CHUNK_BYTES + (1 << 20);

/// The largest message a call to `path` may send.
pub fn limit_of(path: &str) -> usize {
    if path == SUBMIT || path == RUN {
        MAX_REQUEST_BYTES
    } else {
        MAX_OTHER_REQUEST_BYTES
    }
}

/// The budget shared by every connection of a server.
#[derive(Clone)]
pub struct Budget {
    bytes: Arc<Semaphore>,
    total: usize,
}

impl Budget {
    /// A budget of `bytes` (at least one largest request).
    pub fn new(bytes: usize) -> Self {
        let total = bytes.max(MAX_REQUEST_BYTES + 5);
        Self {
            bytes: Arc::new(Semaphore::new(total)),
            total,
        }
    }

    /// Bytes of the budget not held now.
    pub fn available(&self) -> usize {
        self.bytes.available_permits()
    }

    pub fn total(&self) -> usize {
        self.total
    }

    /// The request, its body read under the budget and its call's limit.
    /// A request of the HTTP/JSON gateway (`/v1/...`, never a gRPC path)
    /// is left as it is: the gateway bounds its body itself.
    pub fn wrap(&self, req: http::Request<tonic::body::Body>) -> http::Request<tonic::body::Body> {
        let path = req.uri().path();
        if path.starts_with("/v1/") || path == "/openapi.json" {
            return req;
        }
        let limit = limit_of(req.uri().path());
        let budget = self.bytes.clone();
        req.map(|inner| tonic::body::Body::new(Budgeted::new(inner, limit, budget)))
    }
}

/// The layer that reads every request of a server under its budget.
#[derive(Clone)]
pub struct BudgetLayer(pub Budget);

impl<S> tower::Layer<S> for BudgetLayer {
    type Service = BudgetService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        BudgetService {
            inner,
            budget: self.0.clone(),
        }
    }
}

#[derive(Clone)]
pub struct BudgetService<S> {
    inner: S,
    budget: Budget,
}

impl<S> tower::Service<http::Request<tonic::body::Body>> for BudgetService<S>
where
    S: tower::Service<http::Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<tonic::body::Body>) -> Self::Future {
        self.inner.call(self.budget.wrap(req))
    }
}

type Acquire =
    Pin<Box<dyn Future<Output = Result<OwnedSemaphorePermit, tokio::sync::AcquireError>> + Send>>;

/// A request body read message by message: each message's 5-byte prefix
/// is read first, its length checked and paid for, then its bytes pass.
struct Budgeted {
    inner: tonic::body::Body,
    limit: usize,
    budget: Arc<Semaphore>,
    /// Data read from `inner` and not passed on yet.
    pending: VecDeque<Bytes>,
    /// A frame that is not data (trailers), passed on after what precedes it.
    deferred: Option<Frame<Bytes>>,
    ended: bool,
    /// The prefix of the next message, as far as it has been read.
    prefix: Vec<u8>,
    /// Bytes of the current (paid) message still to pass.
    need: usize,
    /// The length of the message being paid for.
    paying: usize,
    acquire: Option<Acquire>,
    /// The current message's share of the budget, held until the next
    /// message's prefix is read or the body is dropped.
    permit: Option<OwnedSemaphorePermit>,
}

impl Budgeted {
    fn new(inner: tonic::body::Body, limit: usize, budget: Arc<Semaphore>) -> Self {
        Self {
            inner,
            limit,
            budget,
            pending: VecDeque::new(),
            deferred: None,
            ended: false,
            prefix: Vec::with_capacity(5),
            need: 0,
            paying: 0,
            acquire: None,
            permit: None,
        }
    }

    /// Reads the next frame of `inner` into `pending` (or `deferred`).
    /// `Ready(Some(err))`: pass the error on.
    fn read(&mut self, cx: &mut Context<'_>) -> Poll<Option<Status>> {
        match Pin::new(&mut self.inner).poll_frame(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(None) => {
                self.ended = true;
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(e)),
            Poll::Ready(Some(Ok(f))) => {
                match f.into_data() {
                    Ok(d) => self.pending.push_back(d),
                    Err(f) => self.deferred = Some(f),
                }
                Poll::Ready(None)
            }
        }
    }
}

impl http_body::Body for Budgeted {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        loop {
            if this.need > 0 {
                if let Some(mut chunk) = this.pending.pop_front() {
                    if chunk.len() > this.need {
                        let rest = chunk.split_off(this.need);
                        this.pending.push_front(rest);
                    }
                    this.need -= chunk.len();
                    return Poll::Ready(Some(Ok(Frame::data(chunk))));
                }
            } else if let Some(acquire) = &mut this.acquire {
                match acquire.as_mut().poll(cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(Err(_)) => {
                        return Poll::Ready(Some(Err(corral_proto::reason::status(
                            tonic::Code::Unavailable,
                            corral_proto::Reason::ShuttingDown,
                            None,
                            "the worker is shutting down",
                        ))));
                    }
                    Poll::Ready(Ok(permit)) => {
                        this.acquire = None;
                        this.permit = Some(permit);
                        this.need = this.paying;
                        let prefix = Bytes::from(std::mem::take(&mut this.prefix));
                        return Poll::Ready(Some(Ok(Frame::data(prefix))));
                    }
                }
            } else if this.prefix.len() < 5 {
                if let Some(mut chunk) = this.pending.pop_front() {
                    let k = (5 - this.prefix.len()).min(chunk.len());
                    this.prefix.extend_from_slice(&chunk.split_to(k));
                    if !chunk.is_empty() {
                        this.pending.push_front(chunk);
                    }
                    continue;
                }
            } else {
                let p = &this.prefix;
                let len = u32::from_be_bytes([p[1], p[2], p[3], p[4]]) as usize;
                if len > this.limit {
                    this.pending.clear();
                    return Poll::Ready(Some(Err(corral_proto::reason::status(
                        tonic::Code::OutOfRange,
                        corral_proto::Reason::TooLarge,
                        None,
                        format!(
                            "a message of {len} bytes is over this call's limit of {} bytes",
                            this.limit
                        ),
                    ))));
                }
                // The previous message is decoded by now: its share goes
                // back before this one asks for its own.
                this.permit = None;
                this.paying = len;
                let n = u32::try_from(len + 5).unwrap_or(u32::MAX);
                this.acquire = Some(Box::pin(this.budget.clone().acquire_many_owned(n)));
                continue;
            }
            // Nothing to pass: what is left of a prefix goes on as it is
            // (the decoder says what is wrong with it), then any trailers.
            if this.ended || this.deferred.is_some() {
                if !this.prefix.is_empty() {
                    let prefix = Bytes::from(std::mem::take(&mut this.prefix));
                    return Poll::Ready(Some(Ok(Frame::data(prefix))));
                }
                if let Some(f) = this.deferred.take() {
                    return Poll::Ready(Some(Ok(f)));
                }
                return Poll::Ready(None);
            }
            match this.read(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(e)) => return Poll::Ready(Some(Err(e))),
                Poll::Ready(None) => {}
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.pending.is_empty() && self.prefix.is_empty() && self.deferred.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn message(len: usize) -> Vec<u8> {
        let mut m = vec![0u8];
        m.extend_from_slice(&(len as u32).to_be_bytes());
        m.extend(std::iter::repeat_n(7u8, len));
        m
    }

    fn request(path: &str, chunks: Vec<Vec<u8>>) -> http::Request<tonic::body::Body> {
        let stream = futures_util::stream::iter(
            chunks
                .into_iter()
                .map(|c| Ok::<_, Status>(Frame::data(Bytes::from(c)))),
        );
        let body = tonic::body::Body::new(http_body_util::StreamBody::new(stream));
        http::Request::builder().uri(path).body(body).unwrap()
    }

    #[tokio::test]
    async fn a_message_passes_whole_split_anywhere_and_pays_while_it_is_read() {
        let budget = Budget::new(0);
        let whole = message(3000);
        let chunks = vec![
            whole[..2].to_vec(),
            whole[2..4].to_vec(),
            whole[4..].to_vec(),
        ];
        let req = budget.wrap(request("/corral.v1.Worker/GetSandbox", chunks));
        let mut body = req.into_body();
        let mut got = Vec::new();
        while let Some(f) = body.frame().await {
            got.extend_from_slice(f.unwrap().data_ref().unwrap());
            assert_eq!(budget.available(), budget.total() - 3005);
        }
        assert_eq!(got, whole);
        drop(body);
        assert_eq!(budget.available(), budget.total());
    }

    #[tokio::test]
    async fn each_message_of_a_stream_is_checked_and_paid_for_in_turn() {
        let budget = Budget::new(0);
        let (a, b) = (message(10), message(MAX_OTHER_REQUEST_BYTES + 1));
        let mut both = a.clone();
        both.extend_from_slice(&b[..7]);
        let req = budget.wrap(request("/corral.v1.Worker/Upload", vec![both]));
        let mut body = req.into_body();
        let mut got = Vec::new();
        let err = loop {
            match body.frame().await.unwrap() {
                Ok(f) => got.extend_from_slice(f.data_ref().unwrap()),
                Err(e) => break e,
            }
        };
        assert_eq!(got, a, "the first message passes whole");
        assert_eq!(err.code(), tonic::Code::OutOfRange, "{err:?}");
        drop(body);
        assert_eq!(budget.available(), budget.total());
        // Two messages in one frame, and one over two: each passes whole,
        // and only the one being read holds the budget.
        let (c, d) = (message(100), message(200));
        let mut joined = c.clone();
        joined.extend_from_slice(&d[..50]);
        let req = budget.wrap(request(
            "/corral.v1.Worker/Upload",
            vec![joined, d[50..].to_vec()],
        ));
        let mut body = req.into_body();
        let mut got = Vec::new();
        while let Some(f) = body.frame().await {
            got.extend_from_slice(f.unwrap().data_ref().unwrap());
            assert!(budget.total() - budget.available() <= 205);
        }
        assert_eq!(got, [c, d].concat());
    }

    #[tokio::test]
    async fn a_message_over_its_calls_limit_is_refused_before_it_is_read() {
        let budget = Budget::new(0);
        let big = message(MAX_OTHER_REQUEST_BYTES + 1);
        let req = budget.wrap(request(
            "/corral.v1.Worker/CreateSandbox",
            vec![big[..5].to_vec()],
        ));
        let err = req.into_body().frame().await.unwrap().unwrap_err();
        assert_eq!(err.code(), tonic::Code::OutOfRange, "{err:?}");
        // The same size is a Submit's to make, and a Run's.
        let req = budget.wrap(request(SUBMIT, vec![big.clone()]));
        assert!(req.into_body().frame().await.unwrap().is_ok());
        let req = budget.wrap(request(RUN, vec![big]));
        assert!(req.into_body().frame().await.unwrap().is_ok());
    }

    #[tokio::test]
    async fn a_message_that_does_not_fit_waits_unread_for_room() {
        use futures_util::FutureExt;
        let budget = Budget::new(0);
        let big = message(MAX_REQUEST_BYTES - 100);
        let first = budget.wrap(request(SUBMIT, vec![big.clone()]));
        let mut first = first.into_body();
        assert!(first.frame().await.unwrap().is_ok());
        let second = budget.wrap(request(SUBMIT, vec![big]));
        let mut second = second.into_body();
        assert!(
            second.frame().now_or_never().is_none(),
            "the second read past the budget"
        );
        drop(first);
        assert!(second.frame().await.unwrap().is_ok());
    }
}
