//! TLS and mutual TLS between clients and a worker, with certificates made
//! for the test.

use corral_harness::client::{ClientError, ClientTls, Credentials, WorkerClient};
use corral_worker::process::ServerTls;
use corral_worker::server::{ServeOptions, serve_with};
use corral_worker::{Worker, WorkerConfig};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};

struct Pki {
    ca_pem: String,
    server: (String, String),
    client: (String, String),
    other_ca_pem: String,
}

fn pki() -> anyhow::Result<Pki> {
    // Names of their own: OpenSSL (curl) takes a certificate whose issuer
    // is its subject for a self-signed one.
    let ca_params = {
        let mut p = CertificateParams::new(Vec::<String>::new())?;
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name
            .push(rcgen::DnType::CommonName, "corral test CA");
        p
    };
    let ca = CertifiedIssuer::self_signed(ca_params.clone(), KeyPair::generate()?)?;
    let other = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
    let leaf = |names: Vec<String>| -> anyhow::Result<(String, String)> {
        let key = KeyPair::generate()?;
        let mut params = CertificateParams::new(names.clone())?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, names.join(" "));
        let cert = params.signed_by(&key, &ca)?;
        Ok((cert.pem(), key.serialize_pem()))
    };
    Ok(Pki {
        ca_pem: ca.pem(),
        server: leaf(vec!["127.0.0.1".into(), "localhost".into()])?,
        client: leaf(vec!["client".into()])?,
        other_ca_pem: other.pem(),
    })
}

async fn worker(
    tls: ServerTls,
) -> anyhow::Result<(String, tokio::sync::oneshot::Sender<()>, tempfile::TempDir)> {
    let state = tempfile::tempdir()?;
    let mut config = WorkerConfig::new(state.path().to_path_buf());
    config.worker_id = Some(corral_e2e::unique_id("tls"));
    let w = Worker::start(config).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("https://{}", listener.local_addr()?);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let options = ServeOptions {
        token: Some("t0ken".into()),
        tls: Some(tls),
        ..ServeOptions::default()
    };
    tokio::spawn(async move {
        let _ = serve_with(w, listener, options, async {
            let _ = stopped.await;
        })
        .await;
    });
    Ok((url, stop, state))
}

/// Why a client was refused, at connect or at its first call (`None`: it
/// got in). TLS failures can surface at either point.
async fn refusal(client: Result<WorkerClient, ClientError>) -> Option<String> {
    match client {
        Ok(c) => c.list_sandboxes().await.err().map(|e| e.to_string()),
        Err(e) => Some(e.to_string()),
    }
}

fn creds(ca: &str, identity: Option<&(String, String)>) -> Credentials {
    Credentials {
        token: Some("t0ken".into()),
        tls: Some(ClientTls {
            ca_pem: Some(ca.as_bytes().to_vec()),
            identity: identity.map(|(c, k)| (c.as_bytes().to_vec(), k.as_bytes().to_vec())),
            domain: None,
        }),
        ..Credentials::default()
    }
}

#[tokio::test]
async fn tls_with_the_right_ca_works_and_a_stranger_is_refused() -> anyhow::Result<()> {
    let pki = pki()?;
    let tls = ServerTls::from_pem(pki.server.0.as_bytes(), pki.server.1.as_bytes(), None)
        .map_err(anyhow::Error::msg)?;
    let (url, _stop, _state) = worker(tls).await?;
    let client = WorkerClient::connect_with(&url, &creds(&pki.ca_pem, None)).await?;
    assert!(client.list_sandboxes().await?.is_empty());
    // A client that trusts another CA does not get through.
    let stranger = WorkerClient::connect_with(&url, &creds(&pki.other_ca_pem, None)).await;
    let err = refusal(stranger).await.expect("a stranger got in");
    assert!(
        err.contains("certificate") || err.contains("cannot reach"),
        "{err}"
    );
    // Plain HTTP to a TLS worker fails too.
    let plain = url.replace("https://", "http://");
    let err = refusal(WorkerClient::connect(&plain, Some("t0ken")).await).await;
    assert!(err.is_some_and(|e| !e.is_empty()), "plain HTTP got in");
    Ok(())
}

#[tokio::test]
async fn a_worker_reached_by_address_is_checked_against_its_service_name() -> anyhow::Result<()> {
    // As a worker found through a DNS name: reached by IP, its certificate
    // names the Service only.
    let pki = pki()?;
    let ca = CertifiedIssuer::self_signed(
        {
            let mut p = CertificateParams::new(Vec::<String>::new())?;
            p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            p
        },
        KeyPair::generate()?,
    )?;
    let key = KeyPair::generate()?;
    let cert = CertificateParams::new(vec!["corral-worker.corral.svc".to_string()])?
        .signed_by(&key, &ca)?;
    let tls = ServerTls::from_pem(cert.pem().as_bytes(), key.serialize_pem().as_bytes(), None)
        .map_err(anyhow::Error::msg)?;
    let (url, _stop, _state) = worker(tls).await?;
    let mut named = creds(&ca.pem(), None);
    if let Some(t) = named.tls.as_mut() {
        t.domain = Some("corral-worker.corral.svc".into());
    }
    let client = WorkerClient::connect_with(&url, &named).await?;
    assert!(client.list_sandboxes().await?.is_empty());
    // Without the name, the address does not match the certificate.
    let unnamed = WorkerClient::connect_with(&url, &creds(&ca.pem(), None)).await;
    assert!(refusal(unnamed).await.is_some(), "an unchecked name got in");
    drop(pki);
    Ok(())
}

#[tokio::test]
async fn mutual_tls_requires_a_client_certificate() -> anyhow::Result<()> {
    let pki = pki()?;
    let tls = ServerTls::from_pem(
        pki.server.0.as_bytes(),
        pki.server.1.as_bytes(),
        Some(pki.ca_pem.as_bytes()),
    )
    .map_err(anyhow::Error::msg)?;
    let (url, _stop, _state) = worker(tls).await?;
    let with_cert =
        WorkerClient::connect_with(&url, &creds(&pki.ca_pem, Some(&pki.client))).await?;
    assert!(with_cert.list_sandboxes().await?.is_empty());
    let without = WorkerClient::connect_with(&url, &creds(&pki.ca_pem, None)).await;
    assert!(
        refusal(without).await.is_some(),
        "a client without a certificate got in"
    );
    Ok(())
}

/// The HTTP/JSON API over TLS to a client that speaks HTTP/1.1 only (as
/// Node's `fetch` does) and to one that speaks HTTP/2, on the gRPC
/// address: ALPN offers both. A certificate or key that is not one is
/// refused by name.
#[tokio::test]
async fn an_http1_client_reaches_the_json_api_over_tls() -> anyhow::Result<()> {
    let pki = pki()?;
    let dir = tempfile::tempdir()?;
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, &pki.ca_pem)?;
    let tls = ServerTls::from_pem(pki.server.0.as_bytes(), pki.server.1.as_bytes(), None)
        .map_err(anyhow::Error::msg)?;
    let (url, _stop, _state) = worker(tls).await?;
    for (flag, version) in [("--http1.1", "1.1"), ("--http2", "2")] {
        let out = tokio::process::Command::new("curl")
            .args(["-sS", flag, "--cacert"])
            .arg(&ca)
            .args([
                "-H",
                "Authorization: Bearer t0ken",
                "-w",
                "\n%{http_version} %{http_code}",
            ])
            .arg(format!("{url}/v1/sandboxes"))
            .output()
            .await?;
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{flag}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            text.ends_with(&format!("\n{version} 200")) && text.starts_with('{'),
            "{flag}: {text}"
        );
    }
    // gRPC still goes over HTTP/2 on the same listener.
    let client = WorkerClient::connect_with(&url, &creds(&pki.ca_pem, None)).await?;
    assert!(client.list_sandboxes().await?.is_empty());
    let err = ServerTls::from_pem(b"not pem", pki.server.1.as_bytes(), None).err();
    assert!(err.is_some_and(|e| e.contains("certificate")));
    let err = ServerTls::from_pem(pki.server.0.as_bytes(), pki.server.0.as_bytes(), None).err();
    assert!(err.is_some_and(|e| e.contains("key")));
    Ok(())
}

#[test]
fn tls_options_need_an_https_address() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let err = rt
        .block_on(WorkerClient::connect_with(
            "http://127.0.0.1:1",
            &Credentials {
                tls: Some(ClientTls::default()),
                ..Credentials::default()
            },
        ))
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(err.contains("need an https:// address"), "{err}");
}

/// A fresh PKI's server certificate, key and CA, and a token file (0600),
/// written into `dir`: their paths.
fn pki_files(dir: &std::path::Path) -> anyhow::Result<(String, String, String, String)> {
    let pki = pki()?;
    let file = |name: &str, body: &str| -> anyhow::Result<String> {
        let p = dir.join(name);
        std::fs::write(&p, body)?;
        Ok(p.to_string_lossy().to_string())
    };
    let token = file("token", "t0ken-0123456789abcdef")?;
    std::fs::set_permissions(&token, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
    Ok((
        file("server.pem", &pki.server.0)?,
        file("server.key", &pki.server.1)?,
        file("ca.pem", &pki.ca_pem)?,
        token,
    ))
}

#[tokio::test]
async fn both_command_lines_speak_tls() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (cert, key, ca, token) = pki_files(dir.path())?;
    let port = corral_e2e::free_port()?;
    let _worker = corral_e2e::WorkerProcess::spawn(
        &dir.path().join("state"),
        &corral_e2e::unique_id("tlsw"),
        port,
        &[],
        &[
            "--tls-cert",
            &cert,
            "--tls-key",
            &key,
            "--token-file",
            &token,
        ],
    )?;
    let out = tokio::process::Command::new(corral_e2e::binary("corral")?)
        .args([
            "--worker",
            &format!("https://127.0.0.1:{port}"),
            "--tls-ca",
            &ca,
            "--token-file",
            &token,
            "sandbox",
            "ls",
        ])
        .output()
        .await?;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("ID"));
    Ok(())
}

/// `http://` to a TLS worker and `https://` to a plain one say which
/// protocol the worker speaks and what to write instead.
#[tokio::test]
async fn the_wrong_scheme_says_what_the_worker_speaks() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (cert, key, ca, token) = pki_files(dir.path())?;
    let (tls_port, plain_port) = (corral_e2e::free_port()?, corral_e2e::free_port()?);
    let tls_args = [
        "--tls-cert",
        &cert,
        "--tls-key",
        &key,
        "--token-file",
        &token,
    ];
    let _tls = corral_e2e::WorkerProcess::spawn(
        &dir.path().join("tls-state"),
        &corral_e2e::unique_id("tlsw"),
        tls_port,
        &[],
        &tls_args,
    )?;
    let _plain = corral_e2e::WorkerProcess::spawn(
        &dir.path().join("plain-state"),
        &corral_e2e::unique_id("plainw"),
        plain_port,
        &[],
        &["--token-file", &token],
    )?;
    let run = |url: String, extra: Vec<String>| {
        let token = token.clone();
        async move {
            // Bounded: a command that hangs fails here, saying which.
            let out = tokio::time::timeout(
                std::time::Duration::from_secs(60),
                tokio::process::Command::new(corral_e2e::binary("corral")?)
                    .arg("--worker")
                    .arg(&url)
                    .args(extra)
                    .args(["--token-file", &token, "sandbox", "ls"])
                    .kill_on_drop(true)
                    .output(),
            )
            .await
            .map_err(|_| anyhow::anyhow!("corral --worker {url} sandbox ls hung for 60 s"))??;
            anyhow::Ok((
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            ))
        }
    };
    let (code, err) = run(format!("http://127.0.0.1:{tls_port}"), vec![]).await?;
    assert_ne!(code, Some(0));
    assert!(
        err.contains(&format!("it speaks TLS: use https://127.0.0.1:{tls_port}")),
        "{err}"
    );
    let (code, err) = run(
        format!("https://127.0.0.1:{plain_port}"),
        vec!["--tls-ca".into(), ca.clone()],
    )
    .await?;
    assert_ne!(code, Some(0));
    assert!(
        err.contains(&format!(
            "it speaks plain HTTP/2, not TLS: use http://127.0.0.1:{plain_port}"
        )),
        "{err}"
    );
    Ok(())
}
