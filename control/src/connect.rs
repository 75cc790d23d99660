//! Which worker a command talks to, and how: `--worker` (a list, each
//! with its scheme), the token and TLS settings, the local worker when none
//! is given, and the placement of a new session.

use corral_harness::client::{ClientError, ClientTls, Credentials, WorkerClient, source_chain};

use crate::cli::ConnArgs;

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Local(#[from] crate::local::LocalError),
    #[error(transparent)]
    Config(#[from] corral_worker::cli::ConfigError),
    /// The flags do not fit together.
    #[error("{0}")]
    Usage(String),
    #[error("{0}")]
    Invalid(String),
    #[error("no worker can take the session: {0}")]
    NoWorker(String),
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
    Ok((ca_pem.is_some() || identity.is_some()).then_some(ClientTls { ca_pem, identity }))
}

/// The workers of `--worker` (a comma-separated list), with a scheme.
pub fn worker_urls(conn: &ConnArgs) -> Vec<String> {
    conn.worker
        .as_deref()
        .unwrap_or_default()
        .split(',')
        .map(str::trim)
        .filter(|u| !u.is_empty())
        .map(|u| {
            if u.contains("://") {
                u.to_string()
            } else {
                format!("http://{u}")
            }
        })
        .collect()
}

/// Whether `url` names this machine (a worker this user may have started).
fn is_loopback(url: &str) -> bool {
    let rest = url.split("://").nth(1).unwrap_or(url);
    let host = rest.split('/').next().unwrap_or("");
    let host = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(h, _)| h),
    };
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The token for the workers of `--worker`: `--token-file`, else, for a
/// worker on this machine, the one a worker run by this user made in its
/// default state directory (never sent anywhere else).
fn credentials(conn: &ConnArgs) -> Result<Credentials, ConnectError> {
    let own = corral_worker::cli::default_state_dir("worker").join("token");
    let local = worker_urls(conn).iter().all(|u| is_loopback(u));
    let token = match conn.token_file.as_deref() {
        Some(path) => Some(corral_worker::cli::read_token(path)?),
        None if local && own.exists() => Some(corral_worker::cli::read_token(&own)?),
        None => None,
    };
    Ok(Credentials {
        token,
        tls: client_tls(conn)?,
    })
}

/// Connects to the one worker of `--worker`, or embeds one.
pub async fn connect(conn: &ConnArgs) -> Result<WorkerClient, ConnectError> {
    let urls = worker_urls(conn);
    if urls.len() > 1 {
        return Err(ConnectError::Usage(
            "several workers are for corral run (it places each session); give this command one --worker".into(),
        ));
    }
    connect_to(conn, urls.first().map(String::as_str)).await
}

/// Connects to `url`, or to the local worker when there is none.
pub async fn connect_to(conn: &ConnArgs, url: Option<&str>) -> Result<WorkerClient, ConnectError> {
    match url {
        Some(url) => {
            let creds = credentials(conn)?;
            Ok(WorkerClient::connect_with(url, &creds).await?)
        }
        None => {
            let state = crate::local::state_dir(conn.state_dir.as_deref());
            let client = crate::local::connect(&state, conn.docker_host.as_deref()).await?;
            Ok(client)
        }
    }
}

/// Picks the worker for a new session: of those that answer within 5 s,
/// the one with the most free sandbox slots (then the fewest running
/// operations, then the first listed).
pub async fn place(conn: &ConnArgs, urls: &[String]) -> Result<String, ConnectError> {
    let creds = credentials(conn)?;
    let probes = urls.iter().map(|url| {
        let creds = creds.clone();
        async move {
            let probe = async {
                let client = WorkerClient::connect_with(url, &creds).await?;
                client.worker_info().await
            };
            let info = tokio::time::timeout(std::time::Duration::from_secs(5), probe)
                .await
                .map_err(|_| "no answer within 5 s".to_string())
                .and_then(|r| r.map_err(|e| source_chain(&e)));
            (url.clone(), info)
        }
    });
    let answers = futures_util::future::join_all(probes).await;
    let mut best: Option<(String, u32, u32)> = None;
    let mut why = Vec::new();
    for (url, info) in answers {
        match info {
            Ok(i) => {
                let free = i.max_sandboxes.saturating_sub(i.sandboxes);
                tracing::debug!(worker = %url, free, running = i.running_operations, "worker answered");
                if free == 0 {
                    why.push(format!("{url}: full ({} sandboxes)", i.sandboxes));
                    continue;
                }
                let better = best
                    .as_ref()
                    .is_none_or(|(_, f, r)| free > *f || (free == *f && i.running_operations < *r));
                if better {
                    best = Some((url, free, i.running_operations));
                }
            }
            Err(e) => why.push(format!("{url}: {e}")),
        }
    }
    best.map(|(url, _, _)| url)
        .ok_or_else(|| ConnectError::NoWorker(why.join("; ")))
}

#[cfg(test)]
mod tests {
    use super::*;

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
