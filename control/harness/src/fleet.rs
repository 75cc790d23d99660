//! Which worker: a caller's workers (the entries it names, addresses and
//! `dns:///NAME:PORT` names resolved when asked), the credentials it shows
//! them, and its local worker when it names none. Every question of where
//! something runs goes through here, the same for every caller (the
//! command line, a service, a test): placing something new
//! ([`Fleet::place`]), finding the worker that has a sandbox
//! ([`Fleet::find`]), and finding a session's worker again after its
//! address changed ([`Fleet::connect_recorded`], with patience
//! [`Workers::reach`]).
//!
//! What is the caller's own stays the caller's: how it finds its token and
//! checks who listens on a loopback port (a function from the resolved
//! addresses to [`Credentials`]), and how it starts its local worker (a
//! function that connects to it).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use corral_proto::{SandboxId, SandboxSpec};

use crate::client::{ClientError, Credentials, WorkerClient, source_chain};
use crate::placement::{self, Attempt, DiscoveryError, Entry, PlaceError, Placer};
use crate::worker_api::WorkerApi;

/// An error of the caller's own making, kept whole (its credentials, its
/// local worker).
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Discovery(#[from] DiscoveryError),
    /// The caller's setup failed: its credentials, its local worker.
    #[error(transparent)]
    Setup(BoxError),
    /// What was asked does not fit the workers named (the caller's usage).
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Invalid(String),
    #[error("no worker can take it: {0}")]
    NoWorker(String),
    #[error("no worker is named, and this caller has no local worker")]
    NoLocal,
}

impl FleetError {
    /// Nobody answered (worth waiting for, or going elsewhere).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, Self::Client(c) if c.is_transient())
    }
}

/// The credentials for the workers at the addresses given.
pub type CredentialsFor = dyn Fn(&[String]) -> Result<Credentials, FleetError> + Send + Sync;

/// A connection to the caller's local worker (started if need be).
pub type LocalWorker = dyn Fn() -> Pin<Box<dyn Future<Output = Result<WorkerClient, FleetError>> + Send>>
    + Send
    + Sync;

/// How long a worker asked about a sandbox or its id may take.
pub const ASK_TIMEOUT: Duration = Duration::from_secs(5);

/// Where a session's runs go (see [`crate::runner`]): the workers named,
/// a new sandbox placed among them, a session's worker found again. A
/// [`Fleet`] over gRPC in every product; a test's scripted workers with
/// paused time.
pub trait Workers: Clone + Send + Sync + 'static {
    /// A connection to one worker.
    type Api: WorkerApi;

    /// The workers' addresses (see [`Fleet::urls`]).
    fn urls(&self) -> impl Future<Output = Result<Vec<String>, FleetError>> + Send;

    /// The worker at `url`, or the local one (see [`Fleet::connect`]).
    fn connect(
        &self,
        url: Option<&str>,
    ) -> impl Future<Output = Result<Self::Api, FleetError>> + Send;

    /// Places something new on one of `urls` (see [`Fleet::place`]).
    fn place<T, E, F, Fut>(
        &self,
        urls: &[String],
        spec: &SandboxSpec,
        create: F,
    ) -> impl Future<Output = Result<T, E>> + Send
    where
        T: Send,
        E: std::fmt::Display + From<FleetError> + Send,
        F: FnMut(String, Self::Api) -> Fut + Send,
        Fut: Future<Output = Result<T, Attempt<E>>> + Send;

    /// The worker something was placed on, found again (see
    /// [`Fleet::connect_recorded`]).
    fn connect_recorded(
        &self,
        urls: &[String],
        url: Option<&str>,
        worker_id: Option<&str>,
    ) -> impl Future<Output = Result<Self::Api, FleetError>> + Send;

    /// How long [`Self::reach`] waits for a worker that does not answer.
    fn patience(&self) -> Duration;

    /// [`Self::connect_recorded`], tried again while the worker does not
    /// answer, for up to [`Self::patience`]: pauses from 200 ms, doubling
    /// to 5 s, none begun that would end past the deadline.
    fn reach(
        &self,
        urls: &[String],
        url: Option<&str>,
        worker_id: Option<&str>,
    ) -> impl Future<Output = Result<Self::Api, FleetError>> + Send {
        async move {
            let deadline = tokio::time::Instant::now() + self.patience();
            let mut pause = Duration::from_millis(200);
            loop {
                match self.connect_recorded(urls, url, worker_id).await {
                    Err(e)
                        if e.is_unreachable() && tokio::time::Instant::now() + pause < deadline =>
                    {
                        tracing::info!(error = %e, "the worker does not answer; trying again");
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_secs(5));
                    }
                    other => return other,
                }
            }
        }
    }
}

/// A caller's workers. Cheap to clone.
#[derive(Clone)]
pub struct Fleet {
    entries: Vec<Entry>,
    /// Names resolve to `https://` addresses.
    tls: bool,
    credentials: Arc<CredentialsFor>,
    local: Option<Arc<LocalWorker>>,
    /// How long a session's worker that does not answer is waited for.
    patience: Duration,
    /// Connections kept across calls, when the caller keeps them.
    cache: Option<crate::client::ClientCache>,
    probe_timeout: Option<Duration>,
    grace: Duration,
}

impl Fleet {
    /// The workers of `entries` (none: the local worker), reached with what
    /// `credentials` gives for their addresses.
    pub fn new(entries: Vec<Entry>, tls: bool, credentials: Arc<CredentialsFor>) -> Self {
        Self {
            entries,
            tls,
            credentials,
            local: None,
            patience: Duration::from_secs(60),
            cache: None,
            probe_timeout: None,
            grace: crate::placement::STRAGGLER_GRACE,
        }
    }

    /// Keeps one connection per worker across calls (see
    /// [`crate::client::ClientCache`]): for a caller that lives long and
    /// places many sessions.
    pub fn keeping_connections(mut self) -> Self {
        self.cache = Some(crate::client::ClientCache::default());
        self
    }

    /// How long a worker asked how full it is may take to answer before
    /// placement goes on without it (default
    /// [`crate::placement::PROBE_TIMEOUT`]).
    pub fn with_probe_timeout(mut self, timeout: Duration) -> Self {
        self.probe_timeout = Some(timeout);
        self
    }

    /// Least time placement waits for the other workers' answers once one
    /// could take the sandbox (default
    /// [`crate::placement::STRAGGLER_GRACE`]).
    pub fn with_placement_grace(mut self, grace: Duration) -> Self {
        self.grace = grace;
        self
    }

    /// The worker used when no entry is given.
    pub fn with_local(mut self, local: Arc<LocalWorker>) -> Self {
        self.local = Some(local);
        self
    }

    /// How long [`Self::reach`] waits for a worker that does not answer.
    pub fn with_patience(mut self, patience: Duration) -> Self {
        self.patience = patience;
        self
    }

    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The workers' addresses, each with a scheme; a DNS name gives one
    /// worker per address it resolves to.
    pub async fn urls(&self) -> Result<Vec<String>, FleetError> {
        Ok(placement::resolve(&self.entries, self.tls).await?)
    }

    /// The credentials for `urls` (see [`CredentialsFor`]).
    pub fn credentials(&self, urls: &[String]) -> Result<Credentials, FleetError> {
        (self.credentials)(urls)
    }

    /// Connects to the worker at `url`, or to the local worker when there
    /// is none.
    pub async fn connect(&self, url: Option<&str>) -> Result<WorkerClient, FleetError> {
        match url {
            // A kept connection is handed out as it is: the credentials
            // (a token file read, the port's listener looked up) are for
            // making one.
            Some(url) => match &self.cache {
                Some(cache) => {
                    cache
                        .connect_lazily(url, || self.credentials(&[url.to_string()]))
                        .await
                }
                None => {
                    let creds = self.credentials(&[url.to_string()])?;
                    Ok(crate::client::WorkerClient::connect_with(url, &creds).await?)
                }
            },
            None => match &self.local {
                Some(local) => local().await,
                None => Err(FleetError::NoLocal),
            },
        }
    }

    /// Connects to the one worker named (or the local one): for what
    /// concerns one worker only.
    pub async fn connect_one(&self) -> Result<WorkerClient, FleetError> {
        let urls = self.urls().await?;
        if urls.len() > 1 {
            return Err(FleetError::Usage(
                "several workers are for corral run, exec and sandbox create (they place what they make); give this command one --worker".into(),
            ));
        }
        self.connect(urls.first().map(String::as_str)).await
    }

    /// Places something new, a sandbox made as `spec` asks, on one of
    /// `urls` and makes it there with `create` (see [`crate::placement`]).
    /// A worker with a warm member ready that the create would take is
    /// preferred.
    pub async fn place<T, E, F, Fut>(
        &self,
        urls: &[String],
        spec: &SandboxSpec,
        create: F,
    ) -> Result<T, E>
    where
        E: std::fmt::Display + From<FleetError>,
        F: FnMut(String, WorkerClient) -> Fut,
        Fut: Future<Output = Result<T, Attempt<E>>>,
    {
        let mut placer = Placer::new(self.credentials(urls)?).preferring_warm(spec);
        placer.cache = self.cache.clone();
        placer.grace = self.grace;
        if let Some(t) = self.probe_timeout {
            placer.probe_timeout = t;
        }
        match placer.place(urls, create).await {
            Ok(placed) => {
                tracing::debug!(worker = %placed.url, probes = placed.probes, attempts = placed.attempts, "placed");
                Ok(placed.value)
            }
            Err(PlaceError::NoWorker(why)) => Err(FleetError::NoWorker(why).into()),
            Err(PlaceError::Failed(e)) => Err(e),
        }
    }

    /// The worker something was placed on: at its recorded address `url`
    /// if the worker there is still the one it was (`worker_id`), else the
    /// worker of `urls` with that id (a restarted pod has a new address);
    /// the local worker when no address was recorded.
    pub async fn connect_recorded(
        &self,
        urls: &[String],
        url: Option<&str>,
        worker_id: Option<&str>,
    ) -> Result<WorkerClient, FleetError> {
        let (Some(url), Some(id)) = (url, worker_id) else {
            return self.connect(url).await;
        };
        let there = async {
            let client = self.connect(Some(url)).await.ok()?;
            let info = client.worker_info().await.ok()?;
            (info.worker_id == id).then_some(client)
        };
        if let Ok(Some(client)) = tokio::time::timeout(ASK_TIMEOUT, there).await {
            return Ok(client);
        }
        let creds = self.credentials(urls)?;
        let asked = urls.iter().filter(|u| u.as_str() != url).map(|u| {
            let creds = creds.clone();
            let asked = async move {
                let client = crate::client::connect_via(self.cache.as_ref(), u, &creds)
                    .await
                    .ok()?;
                let info = client.worker_info().await.ok()?;
                (info.worker_id == id).then_some((u.clone(), client))
            };
            async move {
                tokio::time::timeout(ASK_TIMEOUT, asked)
                    .await
                    .ok()
                    .flatten()
            }
        });
        let found = futures_util::future::join_all(asked).await;
        if let Some((now, client)) = found.into_iter().flatten().next() {
            tracing::info!(worker = id, was = url, now = %now, "the worker has a new address");
            return Ok(client);
        }
        self.connect(Some(url)).await
    }

    /// A client to the worker that has `sandbox` (each is asked when there
    /// are several), or the one worker, or the local one.
    pub async fn find(&self, sandbox: &SandboxId) -> Result<WorkerClient, FleetError> {
        let urls = self.urls().await?;
        if urls.len() <= 1 {
            return self.connect(urls.first().map(String::as_str)).await;
        }
        let creds = self.credentials(&urls)?;
        let asked = urls.iter().map(|url| {
            let creds = creds.clone();
            let asked = async move {
                let client = crate::client::connect_via(self.cache.as_ref(), url, &creds).await?;
                client.get_sandbox(sandbox).await.map(|_| client)
            };
            async move { tokio::time::timeout(ASK_TIMEOUT, asked).await }
        });
        let answers = futures_util::future::join_all(asked).await;
        let mut why = Vec::new();
        for (url, answer) in urls.iter().zip(answers) {
            match answer {
                Ok(Ok(client)) => return Ok(client),
                Ok(Err(ClientError::Status(s))) if s.code() == tonic::Code::NotFound => {}
                Ok(Err(e)) => why.push(format!("{url}: {}", source_chain(&e))),
                Err(_) => why.push(format!(
                    "{url}: no answer within {} s",
                    ASK_TIMEOUT.as_secs()
                )),
            }
        }
        let mut msg = format!("no worker of --worker has sandbox {sandbox}");
        if !why.is_empty() {
            msg.push_str(&format!(" (not asked: {})", why.join("; ")));
        }
        Err(FleetError::Invalid(msg))
    }
}

impl Workers for Fleet {
    type Api = WorkerClient;

    async fn urls(&self) -> Result<Vec<String>, FleetError> {
        Fleet::urls(self).await
    }

    async fn connect(&self, url: Option<&str>) -> Result<WorkerClient, FleetError> {
        Fleet::connect(self, url).await
    }

    fn place<T, E, F, Fut>(
        &self,
        urls: &[String],
        spec: &SandboxSpec,
        create: F,
    ) -> impl Future<Output = Result<T, E>> + Send
    where
        T: Send,
        E: std::fmt::Display + From<FleetError> + Send,
        F: FnMut(String, WorkerClient) -> Fut + Send,
        Fut: Future<Output = Result<T, Attempt<E>>> + Send,
    {
        Fleet::place(self, urls, spec, create)
    }

    async fn connect_recorded(
        &self,
        urls: &[String],
        url: Option<&str>,
        worker_id: Option<&str>,
    ) -> Result<WorkerClient, FleetError> {
        Fleet::connect_recorded(self, urls, url, worker_id).await
    }

    fn patience(&self) -> Duration {
        self.patience
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_token() -> Arc<CredentialsFor> {
        Arc::new(|_: &[String]| Ok(Credentials::default()))
    }

    #[tokio::test]
    async fn with_no_worker_named_the_local_one_is_used_or_said_missing() {
        let fleet = Fleet::new(Vec::new(), false, no_token());
        assert!(fleet.urls().await.unwrap().is_empty());
        assert!(matches!(
            fleet.connect(None).await,
            Err(FleetError::NoLocal)
        ));
        let asked = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = Arc::clone(&asked);
        let local: Arc<LocalWorker> = Arc::new(move || {
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Box::pin(async { Err(FleetError::Invalid("the test's local worker".into())) })
        });
        let fleet = fleet.with_local(local);
        let Err(e) = fleet.connect_one().await else {
            panic!("connected")
        };
        assert_eq!(e.to_string(), "the test's local worker");
        assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn several_workers_are_no_answer_for_a_one_worker_question() {
        let entries = Entry::parse_list("127.0.0.1:1,127.0.0.1:2").unwrap();
        let fleet = Fleet::new(entries, false, no_token());
        assert!(matches!(
            fleet.connect_one().await,
            Err(FleetError::Usage(_))
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_worker_that_never_answers_is_waited_for_its_patience_then_given_up() {
        // A port nobody listens on: refused at once, every time.
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let url = format!("http://127.0.0.1:{port}");
        let fleet =
            Fleet::new(Vec::new(), false, no_token()).with_patience(Duration::from_secs(20));
        let started = tokio::time::Instant::now();
        let Err(e) = fleet
            .reach(std::slice::from_ref(&url), Some(&url), None)
            .await
        else {
            panic!("reached")
        };
        assert!(e.is_unreachable(), "{e}");
        // Given up once the next pause would pass the deadline (pauses
        // grow to 5 s; a try may take up to its 5 s connect timeout).
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_secs(15) && waited <= Duration::from_secs(25),
            "{waited:?}"
        );
    }
}
