//! How the command line reaches its workers: `--worker` (a list of
//! addresses and DNS names), the token and TLS settings and the local
//! worker, made into the harness's [`Fleet`], which answers which worker
//! (placement, the worker of a sandbox, a session's worker found again).
//! What is the command line's own stays here: where its token is found,
//! and to whom it may be sent.

use std::sync::Arc;

use corral_harness::client::WorkerClient;
use corral_harness::client::{ClientTls, Credentials};
use corral_harness::fleet::{Fleet, FleetError};
use corral_harness::placement::{self, Attempt, Entry};
use corral_proto::SandboxId;

use crate::cli::ConnArgs;

/// How reaching a worker failed (the harness's [`FleetError`]).
pub type ConnectError = FleetError;

pub use corral_harness::fleet::ASK_TIMEOUT;

fn setup(e: impl std::error::Error + Send + Sync + 'static) -> ConnectError {
    FleetError::Setup(Box::new(e))
}

fn read(path: &std::path::Path, what: &str) -> Result<Vec<u8>, ConnectError> {
    std::fs::read(path)
        .map_err(|e| ConnectError::Invalid(format!("{what} {}: {e}", path.display())))
}

fn client_tls(conn: &ConnArgs) -> Result<Option<ClientTls>, ConnectError> {
    let ca_pem = conn
        .tls_ca
        .as_deref()
        .map(|p| read(p, "--tls-ca"))
        .transpose()?;
    let identity = match (&conn.tls_cert, &conn.tls_key) {
        (Some(c), Some(k)) => Some((read(c, "--tls-cert")?, read(k, "--tls-key")?)),
        (None, None) => None,
        _ => {
            return Err(ConnectError::Invalid(
                "--tls-cert and --tls-key go together".into(),
            ));
        }
    };
    Ok(
        (ca_pem.is_some() || identity.is_some()).then_some(ClientTls {
            ca_pem,
            identity,
            domain: None,
        }),
    )
}

/// The entries of `--worker` (a comma-separated list of addresses and
/// `dns:///NAME:PORT` names).
fn entries(conn: &ConnArgs) -> Result<Vec<Entry>, ConnectError> {
    Ok(Entry::parse_list(
        conn.worker.as_deref().unwrap_or_default(),
    )?)
}

/// The workers of `--worker` as the harness's [`Fleet`]: DNS names give
/// https addresses when TLS options are given; the local worker when none
/// is named; a session's worker waited for `--worker-lost-after`.
pub fn fleet(conn: &ConnArgs) -> Result<Fleet, ConnectError> {
    let tls = conn.tls_ca.is_some() || conn.tls_cert.is_some();
    let for_creds = conn.clone();
    let for_local = conn.clone();
    Ok(Fleet::new(
        entries(conn)?,
        tls,
        Arc::new(move |urls: &[String]| credentials(&for_creds, urls)),
    )
    .with_local(Arc::new(move || {
        let state = crate::local::state_dir(for_local.state_dir.as_deref());
        let docker_host = for_local.docker_host.clone();
        Box::pin(async move {
            crate::local::connect(&state, docker_host.as_deref())
                .await
                .map_err(setup)
        })
    }))
    .with_patience(conn.worker_lost_after)
    .with_placement_grace(conn.placement_grace))
}

/// The workers of `--worker`, each with a scheme; a DNS name gives one
/// worker per address it resolves to (https when TLS options are given).
pub async fn worker_urls(conn: &ConnArgs) -> Result<Vec<String>, ConnectError> {
    fleet(conn)?.urls().await
}

use corral_harness::client::{host_port, is_loopback};

/// A token goes to a worker on this machine only if the socket that
/// listens there belongs to this user, to root, or to the owner of the
/// token file: a port left free by a stopped worker may have been taken by
/// another local user, who would get the token. Said at once here; every
/// connection is checked again when it is made (the harness's
/// [`corral_harness::client::connect_checked`]). (Nothing listening: the
/// connection fails anyway.)
fn check_listener(url: &str, token_owner: Option<u32>) -> Result<(), ConnectError> {
    let Some((host, port)) = host_port(url) else {
        return Ok(());
    };
    match corral_harness::client::stranger_listening(&host, port, token_owner) {
        None => Ok(()),
        Some(uid) => Err(ConnectError::Invalid(format!(
            "{url}: the socket listening there belongs to uid {uid}, not to you, root or the token's owner: the token is not sent (is the worker running?)"
        ))),
    }
}

/// The `token` file beside the socket of workers all on one Unix socket
/// directory (`unix:///DIR/worker.sock`), if there is one.
fn token_beside(urls: &[String]) -> Option<std::path::PathBuf> {
    let mut dirs = urls.iter().map(|u| {
        u.strip_prefix("unix://")
            .and_then(|p| std::path::Path::new(p).parent())
    });
    let first = dirs.next()??;
    if !dirs.all(|d| d == Some(first)) {
        return None;
    }
    let token = first.join("token");
    token.exists().then_some(token)
}

/// The token for the workers of `--worker`: `--token-file`, else, for
/// workers all on this machine, the one a worker run by this user made in
/// its default state directory (never sent anywhere else). A token goes to
/// a worker on this machine only through a socket its user owns (see
/// [`check_listener`]), and to workers found through a DNS name only over
/// TLS, unless every address the name gave is this machine's. Those
/// workers are checked against the name in their certificates.
fn credentials(conn: &ConnArgs, urls: &[String]) -> Result<Credentials, ConnectError> {
    use std::os::unix::fs::MetadataExt;
    let own = corral_worker::process::default_state_dir("worker").join("token");
    let entries = entries(conn)?;
    let local =
        entries.iter().all(|e| matches!(e, Entry::Url(_))) && urls.iter().all(|u| is_loopback(u));
    let (token, token_owner) = match conn.token_file.as_deref() {
        None if conn.api_key.is_some() => (conn.api_key.clone().map(|k| k.0), None),
        Some(path) => (
            Some(corral_worker::process::read_token(path).map_err(setup)?),
            std::fs::metadata(path).ok().map(|m| m.uid()),
        ),
        None if local && own.exists() => (
            Some(corral_worker::process::read_token(&own).map_err(setup)?),
            None,
        ),
        // A worker on a Unix socket keeps its token beside it (the local
        // worker's state directory), as the SDK finds it too.
        None => match token_beside(urls) {
            Some(path) => (
                Some(corral_worker::process::read_token(&path).map_err(setup)?),
                None,
            ),
            None => (None, None),
        },
    };
    if token.is_some() {
        for url in urls.iter().filter(|u| is_loopback(u)) {
            check_listener(url, token_owner)?;
        }
        let by_name = entries.iter().any(|e| !matches!(e, Entry::Url(_)));
        if by_name
            && client_tls(conn)?.is_none()
            && let Some(far) = urls
                .iter()
                .find(|u| u.starts_with("http://") && !is_loopback(u))
        {
            return Err(ConnectError::Usage(format!(
                "{far}: a worker found by DNS name gets the token over TLS only (give --tls-ca, or name the worker by its address)"
            )));
        }
    }
    // The name workers' certificates carry: --tls-server-name, else the
    // DNS name they were found by (when they all were, by one name).
    let tls = client_tls(conn)?.map(|mut tls| {
        tls.domain = conn
            .tls_server_name
            .clone()
            .or_else(|| placement::tls_name(&entries));
        tls
    });
    Ok(Credentials {
        token,
        tls,
        token_owner,
    })
}

/// The credential a client presents to a worker's port listener at
/// `listener` for a private port: the one it presents to the workers, and
/// only where that may go (a loopback listener's socket must be this
/// user's, root's or the token file's owner's, as for the API).
pub async fn port_credential(
    conn: &ConnArgs,
    listener: &str,
) -> Result<Option<String>, ConnectError> {
    let urls = worker_urls(conn).await?;
    let c = credentials(conn, &urls)?;
    if c.token.is_some() && is_loopback(listener) {
        check_listener(listener, c.token_owner)?;
    }
    Ok(c.token)
}

/// Connects to the one worker of `--worker`, or the local one.
pub async fn connect(conn: &ConnArgs) -> Result<WorkerClient, ConnectError> {
    fleet(conn)?.connect_one().await
}

/// Connects to `url`, or to the local worker when there is none.
pub async fn connect_to(conn: &ConnArgs, url: Option<&str>) -> Result<WorkerClient, ConnectError> {
    fleet(conn)?.connect(url).await
}

/// Places something new, made as `spec` asks, on one of `urls` (see
/// [`Fleet::place`]).
pub async fn place<T, E, F, Fut>(
    conn: &ConnArgs,
    urls: &[String],
    spec: &corral_proto::SandboxSpec,
    create: F,
) -> Result<T, E>
where
    E: std::fmt::Display + From<ConnectError>,
    F: FnMut(String, WorkerClient) -> Fut,
    Fut: std::future::Future<Output = Result<T, Attempt<E>>>,
{
    fleet(conn)?.place(urls, spec, create).await
}

/// A client to the worker of `--worker` that has `sandbox` (see
/// [`Fleet::find`]).
pub async fn connect_for(
    conn: &ConnArgs,
    sandbox: &SandboxId,
) -> Result<WorkerClient, ConnectError> {
    fleet(conn)?.find(sandbox).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_are_found_with_their_owners() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let url = format!("http://127.0.0.1:{port}");
        assert!(check_listener(&url, None).is_ok());
        assert_eq!(host_port("https://[::1]:7070"), Some(("::1".into(), 7070)));
    }

    #[test]
    fn a_unix_sockets_token_is_the_one_beside_it() {
        let dir = tempfile::tempdir().unwrap();
        let sock = |d: &std::path::Path| format!("unix://{}", d.join("worker.sock").display());
        let url = sock(dir.path());
        assert_eq!(token_beside(std::slice::from_ref(&url)), None);
        std::fs::write(dir.path().join("token"), "t").unwrap();
        assert_eq!(
            token_beside(std::slice::from_ref(&url)),
            Some(dir.path().join("token"))
        );
        // Several sockets of one directory share it; any other address,
        // or another directory, gets none from here.
        assert!(token_beside(&[url.clone(), url.clone()]).is_some());
        let other = tempfile::tempdir().unwrap();
        assert_eq!(token_beside(&[url.clone(), sock(other.path())]), None);
        assert_eq!(token_beside(&[url, "http://127.0.0.1:7070".into()]), None);
        assert_eq!(token_beside(&[]), None);
    }

    #[test]
    fn the_own_token_goes_only_to_workers_on_this_machine() {
        for url in [
            "http://127.0.0.1:7070",
            "http://localhost:1",
            "https://[::1]:7070",
            "127.0.0.2:9",
        ] {
            assert!(is_loopback(url), "{url}");
        }
        for url in [
            "http://10.0.0.1:7070",
            "https://example.com",
            "http://127.0.0.1.evil.org:1",
        ] {
            assert!(!is_loopback(url), "{url}");
        }
    }
}
