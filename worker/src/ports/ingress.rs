//! The worker's end of a sandbox's way in (see `corral_init::ingress`):
//! the socket the sandbox's ingress relay connects to, its control
//! connection, and dials, each answered by a connection to the sandbox's
//! port (its own socket handed over, or carried by the relay) or a
//! refusal.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use corral_init::ingress::{CONTROL, Dial, HEADER_LEN, Refused, SECRET_LEN};
use corral_init::relay::{HANDED, RELAYED};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{oneshot, watch};
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// A connection to a port of a sandbox: its own socket, or the relay's.
pub type PortStream = Either<tokio::net::TcpStream, UnixStream>;

/// Why a dial found no connection.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum DialError {
    /// Nothing listens on the port in the sandbox.
    #[error("nothing listens on port {0} in the sandbox")]
    NotListening(u16),
    /// The relay said another error number.
    #[error("connecting to port {port} in the sandbox failed (errno {errno})")]
    Failed { port: u16, errno: u32 },
    /// The relay did not come, or did not answer in time.
    #[error("the sandbox's ingress relay did not answer within {0:?}")]
    Unanswered(Duration),
    /// The sandbox is gone.
    #[error("the sandbox was removed")]
    Closed,
}

/// How long a dial waits for the relay to connect and answer.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a connection on the socket has to say what it brings.
const HEAD_TIMEOUT: Duration = Duration::from_secs(5);
/// Most dials waiting for an answer at once.
const MAX_PENDING: usize = 1024;
/// Most connections on the socket not yet known for what they bring (a
/// sandbox's processes can connect to it too: past this, new ones are
/// closed at once).
const MAX_UNKNOWN: usize = 64;

type Pending = Mutex<HashMap<u64, oneshot::Sender<Result<PortStream, DialError>>>>;

/// One sandbox's way in, on the worker's side.
pub struct Ingress {
    /// What its relay says first on its control connection.
    secret: [u8; SECRET_LEN],
    /// Writes dials to the relay (`None` until it connects).
    control: tokio::sync::Mutex<Option<tokio::net::unix::OwnedWriteHalf>>,
    /// Whether a relay is connected now.
    connected: watch::Sender<bool>,
    pending: Pending,
    next: AtomicU64,
    closed: CancellationToken,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Ingress {
    /// Binds the socket in the sandbox's socket directory `dir` and serves
    /// it until `closed`.
    pub fn bind(
        dir: &Path,
        closed: CancellationToken,
        tracker: &tokio_util::task::TaskTracker,
    ) -> std::io::Result<std::sync::Arc<Self>> {
        let listener = crate::proxy::bind_named(dir, corral_init::ingress::SOCKET_NAME)?;
        let mut secret = [0u8; SECRET_LEN];
        ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut secret)
            .map_err(|_| std::io::Error::other("no randomness"))?;
        let ingress = std::sync::Arc::new(Self {
            secret,
            control: tokio::sync::Mutex::new(None),
            connected: watch::Sender::new(false),
            pending: Mutex::new(HashMap::new()),
            next: AtomicU64::new(1),
            closed,
        });
        let serving = ingress.clone();
        tracker.spawn(async move { serving.serve(listener).await });
        Ok(ingress)
    }

    async fn serve(self: std::sync::Arc<Self>, listener: tokio::net::UnixListener) {
        let unknown = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_UNKNOWN));
        loop {
            let stream = tokio::select! {
                () = self.closed.cancelled() => break,
                a = listener.accept() => match a {
                    Ok((s, _)) => s,
                    Err(e) => {
                        warn!(error = %e, "the ingress socket failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            let Ok(permit) = unknown.clone().try_acquire_owned() else {
                debug!("too many connections on an ingress socket; closed");
                continue;
            };
            let this = self.clone();
            tokio::spawn(async move {
                tokio::select! {
                    () = this.closed.cancelled() => {}
                    () = this.take(stream, permit) => {}
                }
            });
        }
        // Every waiting dial learns the sandbox is gone.
        for (_, reply) in lock(&self.pending).drain() {
            let _ = reply.send(Err(DialError::Closed));
        }
    }

    /// What a connection on the socket brings: the control connection, or
    /// a dial's socket (handed or carried).
    async fn take(&self, mut stream: UnixStream, permit: tokio::sync::OwnedSemaphorePermit) {
        let head = tokio::time::timeout(HEAD_TIMEOUT, read_head(&stream)).await;
        let Ok(Ok((head, handed))) = head else {
            debug!("a connection on the ingress socket brought nothing usable");
            return;
        };
        if head.first() == Some(&CONTROL) {
            // The relay's secret, or nothing.
            let mut said = [0u8; SECRET_LEN];
            let read = tokio::time::timeout(HEAD_TIMEOUT, stream.read_exact(&mut said)).await;
            if !matches!(read, Ok(Ok(_))) || !ring_eq(&said, &self.secret) {
                warn!("a connection on a sandbox's ingress socket was not its relay's; closed");
                return;
            }
            drop(permit);
            self.control(stream).await;
            return;
        }
        drop(permit);
        let mut id = [0u8; 8];
        id.copy_from_slice(&head[1..HEADER_LEN]);
        let id = u64::from_be_bytes(id);
        let brought = match (head[0], handed) {
            (HANDED, Some(tcp)) => Either::Left(tcp),
            (RELAYED, None) => Either::Right(stream),
            _ => return,
        };
        if let Some(reply) = lock(&self.pending).remove(&id) {
            let _ = reply.send(Ok(brought));
        }
    }

    /// Serves the relay's control connection: its refusals, until it ends.
    async fn control(&self, stream: UnixStream) {
        let (mut read, write) = stream.into_split();
        *self.control.lock().await = Some(write);
        self.connected.send_replace(true);
        let mut b = [0u8; Refused::LEN];
        while read.read_exact(&mut b).await.is_ok() {
            let r = Refused::decode(&b);
            if let Some(reply) = lock(&self.pending).remove(&r.id) {
                let port = 0;
                let _ = reply.send(Err(if r.errno == nix::libc::ECONNREFUSED as u32 {
                    DialError::NotListening(port)
                } else {
                    DialError::Failed {
                        port,
                        errno: r.errno,
                    }
                }));
            }
        }
        self.connected.send_replace(false);
        *self.control.lock().await = None;
    }

    /// Lets the relay go: its control connection is closed from this
    /// side, on which the relay ends (and is started again only when the
    /// worker asks). A checkpoint of a gVisor sandbox needs this: gVisor
    /// cannot save a connection to a host socket. Whether it went within
    /// `within`.
    pub async fn release(&self, within: Duration) -> bool {
        let mut connected = self.connected.subscribe();
        if let Some(mut control) = self.control.lock().await.take() {
            let _ = control.shutdown().await;
        }
        tokio::time::timeout(within, connected.wait_for(|c| !*c))
            .await
            .is_ok()
    }

    /// Whether a relay is connected (else the sandbox's supervisor is to
    /// be asked to start one).
    pub fn relay_connected(&self) -> bool {
        *self.connected.borrow()
    }

    /// What its relay is to say first (given to the sandbox's supervisor).
    pub fn secret(&self) -> Vec<u8> {
        self.secret.to_vec()
    }

    /// A connection to `port` of the sandbox.
    pub async fn dial(&self, port: u16) -> Result<PortStream, DialError> {
        let deadline = tokio::time::Instant::now() + DIAL_TIMEOUT;
        let mut connected = self.connected.subscribe();
        let up = matches!(
            tokio::time::timeout_at(deadline, connected.wait_for(|c| *c))
                .await
                .map(|r| r.map(|_| ())),
            Ok(Ok(()))
        );
        if !up {
            return Err(DialError::Unanswered(DIAL_TIMEOUT));
        }
        // Random: a process of the sandbox cannot answer another's dial.
        let mut random = [0u8; 8];
        let _ = ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut random);
        let id = u64::from_be_bytes(random) ^ self.next.fetch_add(1, Ordering::Relaxed);
        let (reply, answer) = oneshot::channel();
        {
            let mut pending = lock(&self.pending);
            if pending.len() >= MAX_PENDING {
                return Err(DialError::Unanswered(DIAL_TIMEOUT));
            }
            pending.insert(id, reply);
        }
        let sent = tokio::time::timeout_at(deadline, async {
            match self.control.lock().await.as_mut() {
                Some(w) => w.write_all(&Dial { id, port }.encode()).await.is_ok(),
                None => false,
            }
        })
        .await
        .unwrap_or(false);
        let forget = || lock(&self.pending).remove(&id);
        if !sent {
            forget();
            return Err(DialError::Unanswered(DIAL_TIMEOUT));
        }
        match tokio::time::timeout_at(deadline, answer).await {
            Ok(Ok(Ok(stream))) => Ok(stream),
            Ok(Ok(Err(DialError::NotListening(_)))) => Err(DialError::NotListening(port)),
            Ok(Ok(Err(DialError::Failed { errno, .. }))) => Err(DialError::Failed { port, errno }),
            Ok(Ok(Err(e))) => Err(e),
            Ok(Err(_)) => Err(DialError::Closed),
            Err(_) => {
                forget();
                Err(DialError::Unanswered(DIAL_TIMEOUT))
            }
        }
    }
}

/// Whether two secrets are the same (in constant time).
fn ring_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// The head of a connection on the ingress socket: one byte ([`CONTROL`]),
/// or [`HEADER_LEN`] bytes, with the socket handed over when it says
/// [`HANDED`].
async fn read_head(
    stream: &UnixStream,
) -> std::io::Result<(Vec<u8>, Option<tokio::net::TcpStream>)> {
    use std::os::fd::AsRawFd;
    loop {
        stream.readable().await?;
        let mut b = [0u8; 1];
        let peeked = stream.try_io(tokio::io::Interest::READABLE, || {
            nix::sys::socket::recv(
                stream.as_raw_fd(),
                &mut b,
                nix::sys::socket::MsgFlags::MSG_PEEK | nix::sys::socket::MsgFlags::MSG_DONTWAIT,
            )
            .map_err(std::io::Error::from)
        });
        match peeked {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    let mut first = [0u8; 1];
    let _ = nix::sys::socket::recv(
        stream.as_raw_fd(),
        &mut first,
        nix::sys::socket::MsgFlags::MSG_PEEK | nix::sys::socket::MsgFlags::MSG_DONTWAIT,
    );
    match first[0] {
        CONTROL => {
            let mut b = [0u8; 1];
            stream.try_read(&mut b)?;
            Ok((b.to_vec(), None))
        }
        HANDED => {
            let mut head = [0u8; HEADER_LEN];
            let tcp = crate::proxy::receive_socket(stream, &mut head)?;
            Ok((head.to_vec(), Some(tcp)))
        }
        RELAYED => {
            let mut head = [0u8; HEADER_LEN];
            let mut got = 0;
            while got < HEADER_LEN {
                stream.readable().await?;
                match stream.try_read(&mut head[got..]) {
                    Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                    Ok(n) => got += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
            }
            Ok((head.to_vec(), None))
        }
        _ => Err(std::io::ErrorKind::InvalidData.into()),
    }
}
