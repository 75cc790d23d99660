//! `corral.v1.Control` over a [`Host`]: requests checked and turned into
//! the host's calls, its errors into statuses that carry a machine-readable
//! reason (and, for a limit, the flag that sets it).

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;

use corral_proto::Reason;
use corral_proto::pb;
use futures_util::{Stream, StreamExt};
use tokio::sync::mpsc;
use tonic::{Code, Request, Response, Status};

use corral_harness::audit::AuditLog;

use corral_harness::tenants::{Keys, Principal, Scope};

use super::front::{caller, may_name, need, tenant_of};
use super::peers::from_replica;
use corral_harness::host::status::status;
use corral_harness::host::{Host, Settings, request_of};

type Replica = pb::control_client::ControlClient<tonic::transport::Channel>;
type Key = tonic::metadata::MetadataValue<tonic::metadata::Ascii>;

/// Answers a call at the replica where its session lives when that is
/// another (see [`ControlService::elsewhere`]): the call is passed on whole
/// with the caller's key, and its answer (a stream too) given back as it
/// comes.
macro_rules! pass_on {
    ($self:ident, $who:ident, $req:ident, $session:expr, $call:ident) => {
        pass_on!($self, $who, $req, $session, $call, |_, r| r)
    };
    ($self:ident, $who:ident, $req:ident, $session:expr, $call:ident, $map:expr) => {
        let session: Option<String> = $session;
        if let Some((replica, key)) = $self.elsewhere(&$who, &$req, session.as_deref()).await? {
            let msg = $req.into_inner();
            return $self
                .replica(&replica)
                .await?
                .$call($self.front.to_replica(msg, key))
                .await
                .map_err(|e| from_replica(&replica, e))
                .map(|r| r.map(|r| $map(replica.clone(), r)));
        }
    };
}

/// Events queued for one watcher (it reads the journal as fast as it
/// takes them).
const WATCH_QUEUE: usize = 64;
/// Export chunks queued for one caller.
const EXPORT_QUEUE: usize = 8;

pub struct ControlService {
    host: Host,
    audit: Option<AuditLog>,
    /// The tenants' keys and quotas (None: one user, no quotas).
    keys: Option<Keys>,
    /// One start at a time per tenant with a `sessions` quota, so that
    /// concurrent starts never pass it.
    starts: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// The sandbox API, whose quotas a new session's sandbox is counted
    /// against.
    front: Arc<super::front::FrontDoor>,
}

impl ControlService {
    pub fn new(
        host: Host,
        audit: Option<AuditLog>,
        keys: Option<Keys>,
        front: Arc<super::front::FrontDoor>,
    ) -> Self {
        Self {
            host,
            audit,
            keys,
            starts: std::sync::Mutex::new(HashMap::new()),
            front,
        }
    }

    /// Refuses to start (or resume) session `id` for `who`'s tenant when
    /// that would pass its `sessions` quota; else the guard that keeps
    /// its other starts waiting until this one runs.
    async fn session_quota(
        &self,
        who: &Principal,
        id: Option<&str>,
    ) -> Result<Option<tokio::sync::OwnedMutexGuard<()>>, Status> {
        let (Some(keys), Some(tenant)) = (&self.keys, tenant_of(who)) else {
            return Ok(None);
        };
        let Some(limit) = keys.current().quota(tenant).and_then(|q| q.sessions) else {
            return Ok(None);
        };
        let one = self
            .starts
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(tenant.to_string())
            .or_default()
            .clone();
        let guard = one.lock_owned().await;
        let host = self.host.clone();
        let t = tenant.to_string();
        let listed = tokio::task::spawn_blocking(move || host.list(Some(&t)))
            .await
            .map_err(|e| Status::internal(e.to_string()))??;
        // A session that runs already is not started again.
        if id.is_some_and(|id| listed.iter().any(|l| l.running && l.id == id)) {
            return Ok(Some(guard));
        }
        let used = listed.iter().filter(|l| l.running).count() as u64;
        if used >= limit {
            return Err(corral_proto::reason::quota_status(
                "sessions",
                limit,
                used,
                format!(
                    "tenant {tenant} runs {used} sessions, its quota sessions={limit}: stop one first"
                ),
            ));
        }
        Ok(Some(guard))
    }

    /// Where a call of `who` on session `session` is answered, when that
    /// is not here: a tenant's sessions live at its home replica (where
    /// its quotas are checked too); a caller of every tenant's reaches a
    /// session that another replica has there. With the caller's key, to
    /// pass on.
    async fn elsewhere<T>(
        &self,
        who: &Principal,
        req: &Request<T>,
        session: Option<&str>,
    ) -> Result<Option<(String, Key)>, Status> {
        let Some(key) = req.metadata().get("authorization").cloned() else {
            return Ok(None);
        };
        let passed = self.front.passed(req);
        if tenant_of(who).is_some() {
            return Ok(self.front.home_of(who, passed)?.map(|home| (home, key)));
        }
        let (Some(peers), Some(id), false) = (self.front.peers(), session, passed) else {
            return Ok(None);
        };
        // An id this replica does not have: the replica that lists it.
        if !self.host.is_new(id).unwrap_or(false) {
            return Ok(None);
        }
        for peer in peers.others() {
            let listed = self.sessions_of(peer, &key).await?;
            if listed.iter().any(|s| s.session_id == id) {
                return Ok(Some((peer.to_string(), key)));
            }
        }
        // An id no replica has: made at the replica its name hashes to, so
        // that two starts of it through two replicas meet at one.
        let home = peers.home(&format!("session {id}"));
        Ok((home != peers.own()).then(|| (home.to_string(), key)))
    }

    /// The sessions replica `peer` has (asked with `key`, as passed on:
    /// it asks no further).
    async fn sessions_of(&self, peer: &str, key: &Key) -> Result<Vec<pb::SessionInfo>, Status> {
        Ok(self
            .replica(peer)
            .await?
            .list_sessions(
                self.front
                    .to_replica(pb::ListSessionsRequest {}, key.clone()),
            )
            .await
            .map_err(|e| from_replica(peer, e))?
            .into_inner()
            .sessions)
    }

    /// A client of replica `url`.
    async fn replica(&self, url: &str) -> Result<Replica, Status> {
        Ok(Replica::new(self.front.peer_channel(url).await?)
            .max_decoding_message_size(corral_proto::limits::MAX_GRPC_MESSAGE_BYTES))
    }

    /// Writes `call`'s line in the audit log (see [`super::audited`]).
    async fn audited<T>(
        &self,
        who: &Principal,
        call: &str,
        session: Option<&str>,
        r: Result<T, Status>,
    ) -> Result<T, Status> {
        let about = super::About::Session(session.unwrap_or_default());
        super::audited(self.audit.as_ref(), who, call, about, r).await
    }
}

type Events = Pin<Box<dyn Stream<Item = Result<pb::SessionEvent, Status>> + Send>>;
type Chunks = Pin<Box<dyn Stream<Item = Result<pb::ExportChunk, Status>> + Send>>;

#[tonic::async_trait]
impl pb::control_server::Control for ControlService {
    async fn start_session(
        &self,
        req: Request<pb::StartSessionRequest>,
    ) -> Result<Response<pb::StartSessionResponse>, Status> {
        let who = caller(&req)?;
        pass_on!(
            self,
            who,
            req,
            Some(req.get_ref().session_id.clone()).filter(|s| !s.is_empty()),
            start_session
        );
        let req = req.into_inner();
        let asked = req.session_id.clone();
        let r = async {
            need(&who, Scope::Run, "StartSession")?;
            if !req.session_id.is_empty() {
                may_name(&who, &req.session_id, "session")?;
            }
            let request = request_of(&req.request_json)?;
            let id = (!req.session_id.is_empty()).then_some(req.session_id);
            let _one = self.session_quota(&who, id.as_deref()).await?;
            // A new session makes a sandbox: counted against the tenant's
            // sandbox quotas as a create is, until it exists.
            let new = match &id {
                Some(id) => self.host.is_new(id)?,
                None => true,
            };
            let _reserved = if new {
                self.front.reserve_for_session(&who).await?
            } else {
                None
            };
            let settings = Settings::from_pb(req.settings.unwrap_or_default())?;
            let started = self
                .host
                .start(id, request, settings, tenant_of(&who))
                .await?;
            Ok(Response::new(pb::StartSessionResponse {
                session_id: started.id,
                resumed: started.resumed,
                events_before: started.events_before,
            }))
        }
        .await;
        let session = match &r {
            Ok(resp) => resp.get_ref().session_id.clone(),
            Err(_) => asked,
        };
        self.audited(&who, "StartSession", Some(&session), r).await
    }

    async fn send_input(
        &self,
        req: Request<pb::SendInputRequest>,
    ) -> Result<Response<pb::SendInputResponse>, Status> {
        let who = caller(&req)?;
        pass_on!(
            self,
            who,
            req,
            Some(req.get_ref().session_id.clone()),
            send_input
        );
        let req = req.into_inner();
        let input_id = if req.input_id.is_empty() {
            uuid::Uuid::new_v4().to_string()
        } else {
            req.input_id
        };
        let r = async {
            need(&who, Scope::Run, "SendInput")?;
            self.host.owned(&req.session_id, tenant_of(&who))?;
            self.host
                .send(&req.session_id, input_id.clone(), req.text)
                .await?;
            Ok(Response::new(pb::SendInputResponse { input_id }))
        }
        .await;
        self.audited(&who, "SendInput", Some(&req.session_id), r)
            .await
    }

    type WatchSessionStream = Events;

    async fn watch_session(
        &self,
        req: Request<pb::WatchSessionRequest>,
    ) -> Result<Response<Events>, Status> {
        let who = caller(&req)?;
        pass_on!(
            self,
            who,
            req,
            Some(req.get_ref().session_id.clone()),
            watch_session,
            |url: String, s: tonic::Streaming<pb::SessionEvent>| {
                Box::pin(s.map(move |r| r.map_err(|e| from_replica(&url, e)))) as Events
            }
        );
        let req = req.into_inner();
        let watched = need(&who, Scope::Read, "WatchSession").and_then(|()| {
            self.host.owned(&req.session_id, tenant_of(&who))?;
            Ok(self.host.watch(&req.session_id)?)
        });
        let (path, mark) = self
            .audited(&who, "WatchSession", Some(&req.session_id), watched)
            .await?;
        let (tx, rx) = mpsc::channel(WATCH_QUEUE);
        let host = self.host.clone();
        tokio::spawn(async move {
            let sending = tx.clone();
            let reading =
                corral_harness::host::journal::read(&path, req.after, mark, move |seq, json| {
                    let tx = sending.clone();
                    async move { tx.send(Ok(pb::SessionEvent { seq, json })).await.is_ok() }
                });
            tokio::select! {
                // The watcher left: its task ends now, not at the next event.
                () = tx.closed() => {}
                r = reading => {
                    if let Err(corral_harness::host::journal::ReadError::Io { path, source }) = r {
                        let _ = tx
                            .send(Err(status(
                                Code::Internal,
                                Reason::Internal,
                                format!("reading {path}: {source}"),
                            )))
                            .await;
                    }
                }
                // The service stops: the stream ends without a result, and
                // the watcher asks again after its last event.
                () = host.stopping() => {
                    // Not waited for: a watcher that stopped reading does
                    // not hold the service up.
                    let _ = tx.try_send(Err(status(
                        Code::Unavailable,
                        Reason::ShuttingDown,
                        "the service is restarting: watch again after the last event".into(),
                    )));
                }
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn stop_session(
        &self,
        req: Request<pb::StopSessionRequest>,
    ) -> Result<Response<pb::StopSessionResponse>, Status> {
        let who = caller(&req)?;
        pass_on!(
            self,
            who,
            req,
            Some(req.get_ref().session_id.clone()),
            stop_session
        );
        let req = req.into_inner();
        let r = async {
            need(&who, Scope::Run, "StopSession")?;
            self.host.owned(&req.session_id, tenant_of(&who))?;
            self.host.stop(&req.session_id, req.leave).await?;
            Ok(Response::new(pb::StopSessionResponse {}))
        }
        .await;
        self.audited(&who, "StopSession", Some(&req.session_id), r)
            .await
    }

    async fn list_sessions(
        &self,
        req: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        let who = caller(&req)?;
        need(&who, Scope::Read, "ListSessions")?;
        pass_on!(self, who, req, None, list_sessions);
        let tenant = tenant_of(&who).map(str::to_string);
        let host = self.host.clone();
        let listed = tokio::task::spawn_blocking(move || host.list(tenant.as_deref()))
            .await
            .map_err(|e| Status::internal(e.to_string()))??;
        // A caller of every tenant's sees every replica's sessions.
        let mut theirs = Vec::new();
        if let (Some(peers), None, false, Some(key)) = (
            self.front.peers(),
            tenant_of(&who),
            self.front.passed(&req),
            req.metadata().get("authorization"),
        ) {
            for peer in peers.others() {
                theirs.extend(self.sessions_of(peer, key).await?);
            }
        }
        Ok(Response::new(pb::ListSessionsResponse {
            sessions: listed
                .into_iter()
                .map(|l| pb::SessionInfo {
                    session_id: l.id,
                    running: l.running,
                    model: l.model,
                    sandbox_id: l.sandbox_id,
                    worker: l.worker,
                    turns: l.turns,
                    events: l.events,
                    run_events_after: l.run_events_after,
                })
                .chain(theirs)
                .collect(),
        }))
    }

    async fn fork_session(
        &self,
        req: Request<pb::ForkSessionRequest>,
    ) -> Result<Response<pb::ForkSessionResponse>, Status> {
        let who = caller(&req)?;
        pass_on!(
            self,
            who,
            req,
            Some(req.get_ref().session_id.clone()),
            fork_session
        );
        let req = req.into_inner();
        let r = async {
            need(&who, Scope::Run, "ForkSession")?;
            may_name(&who, &req.new_session_id, "session")?;
            self.host.owned(&req.session_id, tenant_of(&who))?;
            // The fork's sandbox is a new one: counted as a create.
            let _reserved = self.front.reserve_for_session(&who).await?;
            self.host
                .fork(&req.session_id, &req.new_session_id, req.turn)
                .await?;
            Ok(Response::new(pb::ForkSessionResponse {
                session_id: req.new_session_id.clone(),
            }))
        }
        .await;
        self.audited(&who, "ForkSession", Some(&req.new_session_id), r)
            .await
    }

    type ExportSessionStream = Chunks;

    async fn export_session(
        &self,
        req: Request<pb::ExportSessionRequest>,
    ) -> Result<Response<Chunks>, Status> {
        let who = caller(&req)?;
        pass_on!(
            self,
            who,
            req,
            Some(req.get_ref().session_id.clone()),
            export_session,
            |url: String, s: tonic::Streaming<pb::ExportChunk>| {
                Box::pin(s.map(move |r| r.map_err(|e| from_replica(&url, e)))) as Chunks
            }
        );
        let id = req.into_inner().session_id;
        // Refused before the stream begins when there is nothing to export
        // (its files: a key that reads only exports nothing).
        let found = need(&who, Scope::Run, "ExportSession").and_then(|()| {
            self.host.owned(&id, tenant_of(&who))?;
            Ok(self.host.watch(&id)?)
        });
        self.audited(&who, "ExportSession", Some(&id), found)
            .await?;
        let (bytes_tx, mut bytes_rx) = mpsc::channel::<bytes::Bytes>(EXPORT_QUEUE);
        let (tx, rx) = mpsc::channel(EXPORT_QUEUE);
        let host = self.host.clone();
        tokio::spawn(async move {
            let exporting = host.export(&id, bytes_tx);
            let sending = tx.clone();
            // Owns the receiver: a caller that leaves drops it, and the
            // export stops (its archive operation canceled) at once.
            let forwarding = async move {
                while let Some(data) = bytes_rx.recv().await {
                    if sending.send(Ok(pb::ExportChunk { data })).await.is_err() {
                        return;
                    }
                }
            };
            let (exported, ()) = tokio::join!(exporting, forwarding);
            // A cut stream never passes for a whole archive.
            if let Err(e) = exported {
                let mut s = Status::from(e);
                if s.code() == Code::Ok {
                    s = Status::internal(s.message().to_string());
                }
                let _ = tx.send(Err(s)).await;
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::ReceiverStream::new(rx),
        )))
    }

    async fn remove_session(
        &self,
        req: Request<pb::RemoveSessionRequest>,
    ) -> Result<Response<pb::RemoveSessionResponse>, Status> {
        let who = caller(&req)?;
        pass_on!(
            self,
            who,
            req,
            Some(req.get_ref().session_id.clone()),
            remove_session
        );
        let req = req.into_inner();
        let r = async {
            need(&who, Scope::Run, "RemoveSession")?;
            self.host.owned(&req.session_id, tenant_of(&who))?;
            self.host.remove(&req.session_id, req.keep_sandbox).await?;
            Ok(Response::new(pb::RemoveSessionResponse {}))
        }
        .await;
        self.audited(&who, "RemoveSession", Some(&req.session_id), r)
            .await
    }
}
