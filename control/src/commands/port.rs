//! `corral port`: a sandbox's ports reached from outside, through its
//! worker's port listener (`corral-worker --ports-listen`).

use std::io::Write;
use std::time::Duration;

use corral_proto::SandboxId;
use corral_proto::pb::{PortAccess, PortExposure};

use crate::cli::{ConnArgs, PortAccessArg, PortCommand};
use crate::connect::ConnectError;

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error(transparent)]
    Client(#[from] corral_harness::client::ClientError),
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    Refused(String),
    #[error("writing output: {0}")]
    Io(#[from] std::io::Error),
}

pub async fn main(conn: &ConnArgs, cmd: PortCommand) -> u8 {
    match port_command(conn, cmd).await {
        Ok(code) => code,
        Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::BrokenPipe => 141,
        Err(e) => {
            super::report(&e);
            match e {
                Error::Connect(ConnectError::Usage(_)) | Error::Invalid(_) => super::EXIT_USAGE,
                _ => super::EXIT_CORRAL_ERROR,
            }
        }
    }
}

fn sandbox_id(s: &str) -> Result<SandboxId, Error> {
    SandboxId::new(s).map_err(|e| Error::Invalid(e.to_string()))
}

fn access_name(a: PortAccess) -> &'static str {
    match a {
        PortAccess::Unspecified | PortAccess::Private => "private",
        PortAccess::Signed => "signed",
        PortAccess::Public => "public",
    }
}

fn to_json(e: &PortExposure) -> serde_json::Value {
    let mut v = serde_json::json!({
        "sandbox_id": e.sandbox_id,
        "port": e.port,
        "access": access_name(e.access()),
        "url": e.url,
        "expires_at_unix_ms": (e.expires_at_unix_ms > 0).then_some(e.expires_at_unix_ms),
        "wake_on_request": e.wake_on_request,
    });
    if !e.token.is_empty() {
        v["token"] = e.token.clone().into();
    }
    v
}

async fn port_command(conn: &ConnArgs, cmd: PortCommand) -> Result<u8, Error> {
    let mut stdout = std::io::stdout().lock();
    match cmd {
        PortCommand::Expose {
            id,
            port,
            access,
            ttl,
            wake_on_request,
            json,
        } => {
            let id = sandbox_id(&id)?;
            let access = match access {
                PortAccessArg::Private => PortAccess::Private,
                PortAccessArg::Signed => PortAccess::Signed,
                PortAccessArg::Public => PortAccess::Public,
            };
            let c = crate::connect::connect_for(conn, &id).await?;
            let e = c
                .expose_port_waking(&id, port, access, ttl, wake_on_request)
                .await?;
            if json {
                writeln!(stdout, "{}", to_json(&e))?;
            } else if e.token.is_empty() {
                writeln!(stdout, "{}", e.url)?;
            } else {
                // A URL a browser opens as it is: the token comes once in
                // it, then as a cookie.
                writeln!(stdout, "{}?token={}", e.url, e.token)?;
            }
        }
        PortCommand::Ls { id, json } => {
            let id = sandbox_id(&id)?;
            let c = crate::connect::connect_for(conn, &id).await?;
            let all = c.list_exposures(&id).await?;
            for e in &all {
                if json {
                    writeln!(stdout, "{}", to_json(e))?;
                } else {
                    let until = if e.expires_at_unix_ms > 0 {
                        let now = std::time::SystemTime::now()
                            .duration_since(std::time::UNIX_EPOCH)
                            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
                        let left = (e.expires_at_unix_ms - now).max(0);
                        format!(
                            "{} left",
                            humantime::format_duration(Duration::from_secs(
                                u64::try_from(left / 1000).unwrap_or(0)
                            ))
                        )
                    } else {
                        "until revoked".into()
                    };
                    let wakes = if e.wake_on_request {
                        "\twakes the sandbox"
                    } else {
                        ""
                    };
                    writeln!(
                        stdout,
                        "{}\t{}\t{}\t{until}{wakes}",
                        e.port,
                        access_name(e.access()),
                        e.url
                    )?;
                }
            }
        }
        PortCommand::Forward {
            id,
            port,
            local,
            ttl,
        } => {
            drop(stdout);
            return forward(conn, &sandbox_id(&id)?, port, local, ttl).await;
        }
        PortCommand::Revoke { id, port } => {
            let id = sandbox_id(&id)?;
            let c = crate::connect::connect_for(conn, &id).await?;
            if !c.revoke_access(&id, port).await? {
                super::warn(&format!("port {port} of {id} was not exposed"));
                return Ok(1);
            }
        }
    }
    Ok(0)
}

/// Where a forward's tunnels go: the port listener's address (host:port),
/// and the credential they present.
struct Way {
    listener: String,
    bearer: Option<String>,
}

/// The port listener's address in an exposure's URL (`http://HOST:PORT/...`).
fn listener_of(url: &str) -> Result<String, Error> {
    match url.split_once("://") {
        Some(("http", _)) => crate::serve::ports::address_of(url)
            .ok_or_else(|| Error::Invalid(format!("{url}: names no host"))),
        Some((scheme, _)) => Err(Error::Invalid(format!(
            "{url}: the port listener is reached over {scheme}; `corral port forward` speaks plain http to it only (reach it on the worker's own address, or tunnel it with a client of your own)"
        ))),
        None => Err(Error::Invalid(format!("{url}: not a URL"))),
    }
}

/// `corral port forward`: a local listener whose every connection is a
/// tunnel (`CONNECT {id}:{port}`) to `port` of the sandbox through its
/// worker's port listener.
async fn forward(
    conn: &ConnArgs,
    id: &SandboxId,
    port: u16,
    local: Option<std::net::SocketAddr>,
    ttl: Duration,
) -> Result<u8, Error> {
    let c = crate::connect::connect_for(conn, id).await?;
    let token = std::env::var("CORRAL_PORT_TOKEN")
        .ok()
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty());
    let exposed = c
        .list_exposures(id)
        .await?
        .into_iter()
        .find(|e| e.port == u32::from(port));
    // A port not exposed is exposed for this forward alone, and revoked
    // when it ends.
    let (exposure, made) = match exposed {
        Some(e) => (e, false),
        None => (
            c.expose_port(id, port, PortAccess::Signed, Some(ttl))
                .await?,
            true,
        ),
    };
    // A URL by Host ({port}-{id}.{domain}) names the listener by a
    // wildcard DNS name; the worker says its listener's own address too.
    let listener = if exposure.url.contains("/p/") {
        listener_of(&exposure.url)?
    } else {
        match c.worker_info().await.ok().and_then(|i| i.ports_url) {
            Some(base) => listener_of(&crate::serve::front::reachable(&base, c.url()))?,
            None => listener_of(&exposure.url)?,
        }
    };
    let bearer = match exposure.access() {
        PortAccess::Public => None,
        PortAccess::Signed if made => Some(exposure.token.clone()),
        PortAccess::Signed => Some(token.ok_or_else(|| {
            Error::Invalid(format!(
                "port {port} of {id} is exposed with signed access: give its token in CORRAL_PORT_TOKEN (or revoke it, and forward again)"
            ))
        })?),
        PortAccess::Private | PortAccess::Unspecified => {
            crate::connect::port_credential(conn, &format!("http://{listener}")).await?
        }
    };
    let way = std::sync::Arc::new(Way { listener, bearer });
    let result = serve_forward(id, port, local, way).await;
    if made {
        // Whatever ended the forward, its exposure goes with it.
        if let Err(e) = c.revoke_access(id, port).await {
            super::warn(&format!(
                "revoking the exposure of port {port} made for this forward: {e}"
            ));
        }
    }
    result
}

async fn serve_forward(
    id: &SandboxId,
    port: u16,
    local: Option<std::net::SocketAddr>,
    way: std::sync::Arc<Way>,
) -> Result<u8, Error> {
    let local = local.unwrap_or_else(|| std::net::SocketAddr::from(([127, 0, 0, 1], port)));
    let bound = tokio::net::TcpListener::bind(local)
        .await
        .map_err(|e| Error::Invalid(format!("listening on {local}: {e}")))?;
    let addr = bound.local_addr()?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on {addr} (port {port} of {id})")?;
        out.flush()?;
    }
    let stop = crate::signals::stop_signal();
    tokio::pin!(stop);
    let tunnels = tokio_util::task::TaskTracker::new();
    loop {
        let (client, peer) = tokio::select! {
            _ = &mut stop => break,
            a = bound.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    super::warn(&format!("accepting on {addr}: {e}"));
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = client.set_nodelay(true);
        let way = way.clone();
        let target = format!("{id}:{port}");
        tunnels.spawn(async move {
            if let Err(e) = tunnel(client, &way, &target).await {
                super::warn(&format!("a connection from {peer}: {e}"));
            }
        });
    }
    tunnels.close();
    Ok(0)
}

/// Most bytes of the listener's answer to a `CONNECT` (its head, and a
/// refusal's JSON body).
const MAX_ANSWER: usize = 64 << 10;

/// One tunnel: `CONNECT`, its answer, then bytes both ways.
async fn tunnel(mut client: tokio::net::TcpStream, way: &Way, target: &str) -> Result<(), Error> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut server = tokio::net::TcpStream::connect(&way.listener)
        .await
        .map_err(|e| Error::Refused(format!("the port listener at {}: {e}", way.listener)))?;
    let _ = server.set_nodelay(true);
    let mut head = format!("CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n");
    if let Some(b) = &way.bearer {
        head.push_str(&format!("Proxy-Authorization: Bearer {b}\r\n"));
    }
    head.push_str("\r\n");
    server.write_all(head.as_bytes()).await?;
    // The answer's head, a byte at a time: what follows it is the
    // sandbox's server's.
    let mut answer = Vec::new();
    let mut b = [0u8; 1];
    while !answer.ends_with(b"\r\n\r\n") {
        if answer.len() >= MAX_ANSWER || server.read(&mut b).await? == 0 {
            return Err(Error::Refused(format!(
                "the port listener at {} ended its answer early",
                way.listener
            )));
        }
        answer.push(b[0]);
    }
    let text = String::from_utf8_lossy(&answer);
    let status = text.split(' ').nth(1).unwrap_or_default();
    if status != "200" {
        // A refusal: its JSON body says why (the connection stays open
        // after it: read as much as it says it has).
        let len = text
            .lines()
            .find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.trim()
                    .eq_ignore_ascii_case("content-length")
                    .then(|| v.trim().parse::<usize>().ok())?
            })
            .unwrap_or(0)
            .min(MAX_ANSWER);
        let mut body = vec![0u8; len];
        let _ = server.read_exact(&mut body).await;
        let why = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| {
                Some(format!(
                    "{} ({})",
                    v["error"]["message"].as_str()?,
                    v["error"]["reason"].as_str()?
                ))
            })
            .unwrap_or_else(|| format!("answered {status}"));
        return Err(Error::Refused(why));
    }
    tokio::io::copy_bidirectional(&mut client, &mut server).await?;
    Ok(())
}
