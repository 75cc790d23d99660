//! Upstream servers for the egress tests and benchmark, on loopback only:
//! an HTTP and an HTTPS server (a certificate of a test CA) that serve a
//! greeting, N bytes, an endless stream (and say when it was cut), and the
//! files of a directory (a git repository over git's dumb HTTP, say).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType, IsCa, KeyPair,
};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;

/// A test CA and one server certificate it signed.
pub struct Pki {
    pub ca_pem: String,
    pub cert_pem: String,
    pub key_pem: String,
}

/// A CA, and a certificate for `names` signed by it.
pub fn pki(names: &[&str]) -> Result<Pki> {
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    // Names of their own: a leaf whose issuer reads as its subject is
    // taken for self-signed by OpenSSL.
    ca.distinguished_name = DistinguishedName::new();
    ca.distinguished_name
        .push(DnType::CommonName, "Corral egress test CA");
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate()?)?;
    let key = KeyPair::generate()?;
    let mut leaf = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())?;
    leaf.distinguished_name = DistinguishedName::new();
    leaf.distinguished_name.push(
        DnType::CommonName,
        names.first().copied().unwrap_or("upstream"),
    );
    let cert = leaf.signed_by(&key, &ca)?;
    Ok(Pki {
        ca_pem: ca.pem(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

/// An HTTP and an HTTPS server on one address.
pub struct Upstream {
    pub http: SocketAddr,
    pub https: SocketAddr,
    /// When a `/stream` response was cut by the other side.
    pub cuts: mpsc::Receiver<Instant>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Upstream {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl Upstream {
    /// Serves on `ip` (one of 127/8), files from `root`.
    pub async fn start(ip: &str, root: &Path, pki: &Pki) -> Result<Self> {
        let _ = tokio_rustls::rustls::crypto::ring::default_provider().install_default();
        use tokio_rustls::rustls::pki_types::pem::PemObject;
        use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
        let certs =
            vec![CertificateDer::from_pem_slice(pki.cert_pem.as_bytes()).context("certificate")?];
        let key = PrivateKeyDer::from_pem_slice(pki.key_pem.as_bytes()).context("key")?;
        let config = tokio_rustls::rustls::ServerConfig::builder()
            .with_no_client_auth()
            .with_single_cert(certs, key)?;
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let plain = tokio::net::TcpListener::bind((ip, 0)).await?;
        let tls = tokio::net::TcpListener::bind((ip, 0)).await?;
        let (http, https) = (plain.local_addr()?, tls.local_addr()?);
        let (cut_tx, cuts) = mpsc::channel(64);
        let root = root.to_path_buf();
        let (r1, c1) = (root.clone(), cut_tx.clone());
        let t1 = tokio::spawn(async move {
            while let Ok((s, _)) = plain.accept().await {
                let (r, c) = (r1.clone(), c1.clone());
                tokio::spawn(async move { serve(s, &r, &c).await });
            }
        });
        let t2 = tokio::spawn(async move {
            while let Ok((s, _)) = tls.accept().await {
                let (r, c, a) = (root.clone(), cut_tx.clone(), acceptor.clone());
                tokio::spawn(async move {
                    if let Ok(s) = a.accept(s).await {
                        serve(s, &r, &c).await;
                    }
                });
            }
        });
        Ok(Self {
            http,
            https,
            cuts,
            tasks: vec![t1, t2],
        })
    }
}

async fn serve<S: AsyncRead + AsyncWrite + Unpin>(
    mut s: S,
    root: &Path,
    cuts: &mpsc::Sender<Instant>,
) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        match s.read(&mut chunk).await {
            Ok(n) if n > 0 && buf.len() < 65536 => buf.extend_from_slice(&chunk[..n]),
            _ => return,
        }
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let path = head
        .split(' ')
        .nth(1)
        .unwrap_or("/")
        .split('?')
        .next()
        .unwrap_or("/")
        .to_string();
    let reply = |status: &str, body_len: usize| {
        format!("HTTP/1.1 {status}\r\nContent-Length: {body_len}\r\nConnection: close\r\n\r\n")
    };
    if path == "/hello" {
        let body = b"hello from upstream\n";
        let _ = s.write_all(reply("200 OK", body.len()).as_bytes()).await;
        let _ = s.write_all(body).await;
    } else if let Some(n) = path
        .strip_prefix("/bytes/")
        .and_then(|n| n.parse::<usize>().ok())
    {
        let _ = s.write_all(reply("200 OK", n).as_bytes()).await;
        let block = vec![b'x'; 256 * 1024];
        let mut left = n;
        while left > 0 {
            let k = left.min(block.len());
            if s.write_all(&block[..k]).await.is_err() {
                return;
            }
            left -= k;
        }
    } else if path == "/stream" {
        let _ = s
            .write_all(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n")
            .await;
        let block = vec![b'y'; 16 * 1024];
        loop {
            if s.write_all(&block).await.is_err() || s.flush().await.is_err() {
                let _ = cuts.send(Instant::now()).await;
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    } else {
        let rel = path.trim_start_matches('/');
        let file: PathBuf = root.join(rel);
        let inside = !rel.split('/').any(|p| p == ".." || p.is_empty());
        match std::fs::read(&file) {
            Ok(body) if inside && file.is_file() => {
                let _ = s.write_all(reply("200 OK", body.len()).as_bytes()).await;
                let _ = s.write_all(&body).await;
            }
            _ => {
                let _ = s.write_all(reply("404 Not Found", 0).as_bytes()).await;
            }
        }
    }
    let _ = s.shutdown().await;
}
