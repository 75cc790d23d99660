//! The client of a control plane service (`corral serve`,
//! `corral.v1.Control`): sessions started, fed, stopped, watched, forked,
//! exported and removed on a service that hosts them; and of its
//! `corral.v1.Admin` (tenants' keys and quotas). Its errors carry the
//! service's machine-readable reason; none is read from message text.

use std::time::Duration;

use corral_proto::Reason;
use corral_proto::limits::MAX_GRPC_MESSAGE_BYTES;
use corral_proto::pb;
use corral_proto::pb::control_client::ControlClient as PbClient;
use futures_util::{Stream, StreamExt};
use tonic::Status;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

use crate::client::{Auth, ClientError, Credentials, channel, source_chain};

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("cannot reach the control plane at {url}: {reason}")]
    Connect { url: String, reason: String },
    /// Said in full by its message.
    #[error("{}", describe(.0))]
    Status(Status),
}

impl From<Status> for ControlError {
    fn from(s: Status) -> Self {
        Self::Status(s)
    }
}

fn describe(s: &Status) -> String {
    let msg = crate::client::status_text(s);
    match s.code() {
        tonic::Code::Unauthenticated => {
            format!(
                "the control plane refused the call: {msg} (pass --control-token-file, or set CORRAL_API_KEY to a key of the front door's)"
            )
        }
        tonic::Code::Unavailable => format!("control plane unavailable: {msg}"),
        _ => msg,
    }
}

impl ControlError {
    /// The reason the service sent with its status.
    pub fn reason(&self) -> Option<Reason> {
        match self {
            Self::Status(s) => corral_proto::reason::of(s),
            Self::Connect { .. } => None,
        }
    }

    /// The service's flag that sets the limit it refused at.
    pub fn flag(&self) -> Option<String> {
        match self {
            Self::Status(s) => corral_proto::reason::flag_of(s),
            Self::Connect { .. } => None,
        }
    }

    /// Asking again later may work: the service did not answer, or is
    /// restarting.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Connect { .. } => true,
            Self::Status(s) => match corral_proto::reason::of(s) {
                Some(r) => r == Reason::ShuttingDown,
                // The transport's own (a dropped connection).
                None => matches!(
                    s.code(),
                    tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled
                ),
            },
        }
    }
}

/// A connection to a control plane service.
/// A channel to the service at `url` and what presents `creds`' token.
async fn connect(url: &str, creds: &Credentials) -> Result<(Channel, Auth), ControlError> {
    let connect = |e: ClientError| ControlError::Connect {
        url: url.to_string(),
        reason: match e {
            ClientError::BadAddress { reason, .. } | ClientError::Connect { reason, .. } => reason,
            other => source_chain(&other),
        },
    };
    let ch = channel(url, creds).await.map_err(connect)?;
    let auth = Auth::bearer(url, creds.token.as_deref()).map_err(connect)?;
    Ok((ch, auth))
}

/// A client of a front door's `corral.v1.Admin`: the tenants' keys and
/// quotas, for an `admin` key.
#[derive(Clone)]
pub struct AdminClient {
    inner: pb::admin_client::AdminClient<InterceptedService<Channel, Auth>>,
}

impl AdminClient {
    pub async fn connect(url: &str, creds: &Credentials) -> Result<Self, ControlError> {
        let (ch, auth) = connect(url, creds).await?;
        Ok(Self {
            inner: pb::admin_client::AdminClient::with_interceptor(ch, auth),
        })
    }

    pub async fn create_key(
        &self,
        req: pb::CreateKeyRequest,
    ) -> Result<pb::CreateKeyResponse, ControlError> {
        Ok(self.inner.clone().create_key(req).await?.into_inner())
    }

    pub async fn list_keys(&self) -> Result<Vec<pb::KeyInfo>, ControlError> {
        Ok(self
            .inner
            .clone()
            .list_keys(pb::ListKeysRequest {})
            .await?
            .into_inner()
            .keys)
    }

    pub async fn revoke_key(&self, id: &str) -> Result<(), ControlError> {
        self.inner
            .clone()
            .revoke_key(pb::RevokeKeyRequest { id: id.to_string() })
            .await?;
        Ok(())
    }

    pub async fn set_quota(
        &self,
        tenant: &str,
        quotas: &[String],
    ) -> Result<pb::TenantQuota, ControlError> {
        Ok(self
            .inner
            .clone()
            .set_quota(pb::SetQuotaRequest {
                tenant: tenant.to_string(),
                quotas: quotas.to_vec(),
            })
            .await?
            .into_inner())
    }

    pub async fn list_quotas(&self) -> Result<Vec<pb::TenantQuota>, ControlError> {
        Ok(self
            .inner
            .clone()
            .list_quotas(pb::ListQuotasRequest {})
            .await?
            .into_inner()
            .quotas)
    }
}

#[derive(Clone)]
pub struct ControlClient {
    url: String,
    inner: PbClient<InterceptedService<Channel, Auth>>,
}

/// A session's events, numbered: `(seq, one JSON event)`.
pub type SessionEvents =
    std::pin::Pin<Box<dyn Stream<Item = Result<(u64, String), ControlError>> + Send>>;

impl ControlClient {
    /// Connects to `url` (http://HOST:PORT, or https:// with the TLS of
    /// `creds`), presenting `creds`' token on every call.
    pub async fn connect(url: &str, creds: &Credentials) -> Result<Self, ControlError> {
        let (ch, auth) = connect(url, creds).await?;
        Ok(Self {
            url: url.to_string(),
            inner: PbClient::with_interceptor(ch, auth)
                .max_decoding_message_size(MAX_GRPC_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_GRPC_MESSAGE_BYTES),
        })
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub async fn start(
        &self,
        req: pb::StartSessionRequest,
    ) -> Result<pb::StartSessionResponse, ControlError> {
        Ok(self.inner.clone().start_session(req).await?.into_inner())
    }

    /// Sends an input; returns its id.
    pub async fn send_input(&self, id: &str, text: &str) -> Result<String, ControlError> {
        let r = self
            .inner
            .clone()
            .send_input(pb::SendInputRequest {
                session_id: id.to_string(),
                text: text.to_string(),
                input_id: String::new(),
            })
            .await?;
        Ok(r.into_inner().input_id)
    }

    /// The session's events after `after`, then live ones until its run
    /// ends.
    pub async fn watch(&self, id: &str, after: u64) -> Result<SessionEvents, ControlError> {
        let stream = self
            .inner
            .clone()
            .watch_session(pb::WatchSessionRequest {
                session_id: id.to_string(),
                after,
            })
            .await?
            .into_inner();
        Ok(Box::pin(stream.map(|r| {
            r.map(|e| (e.seq, e.json)).map_err(ControlError::from)
        })))
    }

    pub async fn stop(&self, id: &str, leave: bool) -> Result<(), ControlError> {
        self.inner
            .clone()
            .stop_session(pb::StopSessionRequest {
                session_id: id.to_string(),
                leave,
            })
            .await?;
        Ok(())
    }

    pub async fn list(&self) -> Result<Vec<pb::SessionInfo>, ControlError> {
        Ok(self
            .inner
            .clone()
            .list_sessions(pb::ListSessionsRequest {})
            .await?
            .into_inner()
            .sessions)
    }

    pub async fn fork(
        &self,
        id: &str,
        new_id: &str,
        turn: Option<u64>,
    ) -> Result<(), ControlError> {
        self.inner
            .clone()
            .fork_session(pb::ForkSessionRequest {
                session_id: id.to_string(),
                new_session_id: new_id.to_string(),
                turn,
            })
            .await?;
        Ok(())
    }

    /// The session's /workspace as a tar stream of its contents (the
    /// sandbox's: unpack it by the rules for hostile archives).
    pub async fn export(
        &self,
        id: &str,
    ) -> Result<impl Stream<Item = Result<bytes::Bytes, ControlError>> + use<>, ControlError> {
        let stream = self
            .inner
            .clone()
            .export_session(pb::ExportSessionRequest {
                session_id: id.to_string(),
            })
            .await?
            .into_inner();
        Ok(stream.map(|r| r.map(|c| c.data).map_err(ControlError::from)))
    }

    pub async fn remove(&self, id: &str, keep_sandbox: bool) -> Result<(), ControlError> {
        self.inner
            .clone()
            .remove_session(pb::RemoveSessionRequest {
                session_id: id.to_string(),
                keep_sandbox,
            })
            .await?;
        Ok(())
    }
}

/// How long a watcher waits for a restarting service before giving up.
pub const DEFAULT_RECONNECT_PATIENCE: Duration = Duration::from_secs(60);
