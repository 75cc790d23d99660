//! The egress module's tests: hostile heads and hellos, the gate's
//! decisions, admission and the relay.

use super::*;

fn rules(r: &[&str]) -> Vec<Rule> {
    corral_proto::egress::parse_rules(r, true).unwrap()
}

#[test]
fn connect_and_absolute_requests_are_read_whole_or_not_at_all() {
    let (h, n) = parse_head(b"CONNECT PyPI.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\nrest")
        .unwrap()
        .unwrap();
    assert_eq!(
        h,
        Head::Connect {
            host: "pypi.org".into(),
            port: 443
        }
    );
    // The head, up to its blank line; "rest" is the tunnel's.
    assert_eq!(n, 53);
    let (h, _) = parse_head(b"GET http://example.com/a?b HTTP/1.1\r\nHost: Example.com\r\n\r\n")
        .unwrap()
        .unwrap();
    assert_eq!(
        h,
        Head::Forward {
            method: "GET".into(),
            host: "example.com".into(),
            port: 80,
            path: "/a?b".into(),
            host_header: Some("example.com".into())
        }
    );
    let (h, _) = parse_head(b"CONNECT [2001:db8::1]:8443 HTTP/1.1\r\n\r\n")
        .unwrap()
        .unwrap();
    assert_eq!(
        h,
        Head::Connect {
            host: "2001:db8::1".into(),
            port: 8443
        }
    );
    assert_eq!(
        parse_head(b"CONNECT x.com:443 HTTP/1.1\r\nHost: x").unwrap(),
        None
    );
}

#[test]
fn hostile_heads_are_refused() {
    let big = format!(
        "GET http://x.com/ HTTP/1.1\r\nA: {}\r\n\r\n",
        "a".repeat(MAX_HEAD_BYTES)
    );
    let many: String = (0..=MAX_HEADERS).map(|i| format!("H{i}: v\r\n")).collect();
    let many = format!("GET http://x.com/ HTTP/1.1\r\n{many}\r\n");
    for head in [
        b"CONNECT x.com HTTP/1.1\r\n\r\n".to_vec(),
        b"CONNECT x.com:0 HTTP/1.1\r\n\r\n".to_vec(),
        b"CONNECT x.com:443 HTTP/2\r\n\r\n".to_vec(),
        b"CONNECT  x.com:443 HTTP/1.1\r\n\r\n".to_vec(),
        b"GET https://x.com/ HTTP/1.1\r\n\r\n".to_vec(),
        b"GET /relative HTTP/1.1\r\n\r\n".to_vec(),
        b"GET http://user:pw@x.com/ HTTP/1.1\r\n\r\n".to_vec(),
        b"GET http://x.com/ HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n".to_vec(),
        b"GET http://x.com/ HTTP/1.1\r\nBad Header: v\r\n\r\n".to_vec(),
        b"GET http://x.com/ HTTP/1.1\r\nA: b\x00c\r\n\r\n".to_vec(),
        b"get http://x.com/ HTTP/1.1\r\n\r\n".to_vec(),
        b"CONNECT [::1:443 HTTP/1.1\r\n\r\n".to_vec(),
        b"CONNECT exa mple.com:443 HTTP/1.1\r\n\r\n".to_vec(),
        b"\xff\xfe HTTP/1.1\r\n\r\n".to_vec(),
        big.into_bytes(),
        many.into_bytes(),
    ] {
        assert!(
            parse_head(&head).is_err(),
            "{}",
            String::from_utf8_lossy(&head)
        );
    }
    // A head that never ends is refused once past the bound.
    assert!(parse_head(&vec![b'a'; MAX_HEAD_BYTES + 1]).is_err());
}

/// A ClientHello as a client sends it, with these server names.
fn hello(names: &[&str]) -> Vec<u8> {
    let mut sni = Vec::new();
    for n in names {
        sni.push(0);
        sni.extend_from_slice(&(n.len() as u16).to_be_bytes());
        sni.extend_from_slice(n.as_bytes());
    }
    let mut ext = Vec::new();
    // An unrelated extension first (supported_groups).
    ext.extend_from_slice(&[0, 10, 0, 4, 0, 2, 0, 29]);
    if !names.is_empty() {
        ext.extend_from_slice(&0u16.to_be_bytes());
        ext.extend_from_slice(&((sni.len() + 2) as u16).to_be_bytes());
        ext.extend_from_slice(&(sni.len() as u16).to_be_bytes());
        ext.extend_from_slice(&sni);
    }
    let mut body = vec![3, 3];
    body.extend_from_slice(&[7; 32]);
    body.push(0); // session id
    body.extend_from_slice(&[0, 2, 0x13, 0x01]); // one suite
    body.extend_from_slice(&[1, 0]); // null compression
    body.extend_from_slice(&(ext.len() as u16).to_be_bytes());
    body.extend_from_slice(&ext);
    let mut hs = vec![1];
    hs.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    hs.extend_from_slice(&body);
    let mut rec = vec![22, 3, 1];
    rec.extend_from_slice(&(hs.len() as u16).to_be_bytes());
    rec.extend_from_slice(&hs);
    rec
}

#[test]
fn the_server_name_of_a_client_hello_is_read_and_nothing_else() {
    let h = hello(&["Files.PyPI.org."]);
    assert_eq!(client_hello_sni(&h), Hello::Sni("files.pypi.org".into()));
    for cut in [0, 3, 10, h.len() - 1] {
        assert_eq!(client_hello_sni(&h[..cut]), Hello::More, "cut at {cut}");
    }
    assert_eq!(client_hello_sni(&hello(&[])), Hello::NoSni);
    assert_eq!(client_hello_sni(&hello(&["a.com", "b.com"])), Hello::NoSni);
    assert_eq!(client_hello_sni(&hello(&["bad name"])), Hello::NoSni);
    assert_eq!(client_hello_sni(b"GET / HTTP/1.1\r\n"), Hello::NotTls);
    // Every truncation and every byte flipped: never a panic.
    for i in 5..h.len() {
        let mut bent = h.clone();
        bent[i] ^= 0xff;
        let _ = client_hello_sni(&bent);
        let mut short = h.clone();
        short.truncate(i);
        let _ = client_hello_sni(&short);
    }
}

fn gate(allow: &[&str], own: Vec<SocketAddr>) -> Gate {
    Gate {
        allow_internal: allow.iter().map(|c| c.parse().unwrap()).collect(),
        own,
        own_ips: Vec::new(),
        connect_timeout: Duration::from_secs(5),
        resolver: None,
    }
}

#[test]
fn the_hosts_own_addresses_are_refused_public_or_not() {
    let mut g = gate(&[], vec![]);
    g.own_ips = vec![
        "203.0.113.7".parse().unwrap(),
        "2001:db8::7".parse().unwrap(),
    ];
    for a in [
        "203.0.113.7:22",
        "[2001:db8::7]:443",
        "[::ffff:203.0.113.7]:80",
    ] {
        assert_eq!(
            g.check(a.parse().unwrap()),
            Err(Blocked::InternalAddress),
            "{a}"
        );
    }
    assert_eq!(g.check("203.0.113.8:22".parse().unwrap()), Ok(()));
    // An operator's exemption covers them (never the worker's ports).
    g.allow_internal = vec!["203.0.113.0/24".parse().unwrap()];
    assert_eq!(g.check("203.0.113.7:22".parse().unwrap()), Ok(()));
}

#[tokio::test]
async fn a_name_is_resolved_once_and_connected_to_as_checked() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let server = tokio::net::TcpListener::bind("127.0.0.9:0").await.unwrap();
    let port = server.local_addr().unwrap().port();
    let asked = std::sync::Arc::new(AtomicUsize::new(0));
    let counter = asked.clone();
    // rebind.test answers an exempt address first, then the metadata
    // address; meta.test is the metadata address at once.
    let (dns, task) = crate::dns::testing::serve(move |name, qtype| match (name, qtype) {
        ("rebind.test", 1) => {
            if counter.fetch_add(1, Ordering::SeqCst) == 0 {
                vec!["127.0.0.9".parse().unwrap()]
            } else {
                vec!["169.254.169.254".parse().unwrap()]
            }
        }
        ("meta.test", 1) => vec!["169.254.169.254".parse().unwrap()],
        ("many.test", 1) => vec!["10.0.0.1".parse().unwrap(), "127.0.0.9".parse().unwrap()],
        _ => vec![],
    })
    .await
    .unwrap();
    let mut g = gate(&["127.0.0.9/32"], vec![]);
    g.resolver = Some(dns);
    let policy = rules(&[
        &format!("rebind.test:{port}"),
        &format!("meta.test:{port}"),
        &format!("many.test:{port}"),
        &format!("gone.test:{port}"),
    ]);
    let (_, to) = g
        .connect(&policy, "rebind.test", port)
        .await
        .expect("first answer");
    assert_eq!(to.ip().to_string(), "127.0.0.9");
    // The second lookup answers internal: refused, never connected.
    assert_eq!(
        g.connect(&policy, "rebind.test", port).await.err(),
        Some(Blocked::InternalAddress)
    );
    assert_eq!(
        g.connect(&policy, "meta.test", port).await.err(),
        Some(Blocked::InternalAddress)
    );
    // Of several answers only the allowed ones are tried.
    let (_, to) = g
        .connect(&policy, "many.test", port)
        .await
        .expect("the exempt one");
    assert_eq!(to.ip().to_string(), "127.0.0.9");
    assert_eq!(
        g.connect(&policy, "gone.test", port).await.err(),
        Some(Blocked::ResolveFailed)
    );
    task.abort();
    drop(server);
}

#[tokio::test]
async fn internal_answers_and_the_workers_own_ports_are_never_reached() {
    let server = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = server.local_addr().unwrap().port();
    let worker_port = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let own = worker_port.local_addr().unwrap();
    let policy = rules(&[
        &format!("localhost:{port}"),
        &format!("127.0.0.0/8:{port}"),
        &format!("localhost:{}", own.port()),
    ]);
    // Loopback is internal: refused unless exempted.
    let strict = gate(&[], vec![own]);
    assert_eq!(
        strict.connect(&policy, "localhost", port).await.err(),
        Some(Blocked::InternalAddress)
    );
    assert_eq!(
        strict.connect(&policy, "127.0.0.1", port).await.err(),
        Some(Blocked::InternalAddress)
    );
    let open = gate(&["127.0.0.0/8"], vec![own]);
    let (_, to) = open
        .connect(&policy, "localhost", port)
        .await
        .expect("exempted");
    assert_eq!(to.port(), port);
    // The worker's own port, exempt range or not.
    assert_eq!(
        open.connect(&policy, "localhost", own.port()).await.err(),
        Some(Blocked::InternalAddress)
    );
    // An address by a name rule: not allowed; a name not listed either.
    let by_name = rules(&[&format!("localhost:{port}")]);
    assert_eq!(
        open.connect(&by_name, "127.0.0.1", port).await.err(),
        Some(Blocked::NotAllowed)
    );
    assert_eq!(
        open.connect(&by_name, "other.invalid", port).await.err(),
        Some(Blocked::NotAllowed)
    );
    // Allowed, but nothing there.
    drop(server);
    assert_eq!(
        open.connect(&policy, "127.0.0.1", port).await.err(),
        Some(Blocked::Unreachable)
    );
    // (A name that does not resolve is not tried here: its lookup would
    // leave loopback.)
}

#[test]
fn metadata_and_mapped_addresses_are_internal() {
    let g = gate(&[], vec![]);
    for a in [
        "169.254.169.254:80",
        "[::ffff:169.254.169.254]:80",
        "[::1]:443",
        "10.0.0.1:443",
    ] {
        assert_eq!(
            g.check(a.parse().unwrap()),
            Err(Blocked::InternalAddress),
            "{a}"
        );
    }
    assert_eq!(g.check("93.184.216.34:443".parse().unwrap()), Ok(()));
    let own = gate(&["127.0.0.0/8"], vec!["0.0.0.0:7070".parse().unwrap()]);
    assert_eq!(
        own.check("127.0.0.1:7070".parse().unwrap()),
        Err(Blocked::InternalAddress)
    );
    assert_eq!(own.check("127.0.0.1:7071".parse().unwrap()), Ok(()));
}

type Policy = tokio::sync::watch::Sender<std::sync::Arc<Vec<Rule>>>;

fn policy(
    r: &[&str],
) -> (
    Policy,
    tokio::sync::watch::Receiver<std::sync::Arc<Vec<Rule>>>,
) {
    tokio::sync::watch::channel(std::sync::Arc::new(rules(r)))
}

/// A loopback server that records what it got and answers `reply`.
async fn upstream(reply: &'static [u8]) -> (u16, tokio::sync::mpsc::Receiver<Vec<u8>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut got = vec![0u8; 65536];
                let n = s.read(&mut got).await.unwrap_or(0);
                let _ = tx.send(got[..n].to_vec()).await;
                let _ = s.write_all(reply).await;
                // Held open until the other side goes.
                let _ = s.read(&mut got).await;
            });
        }
    });
    (port, rx)
}

async fn exchange(
    request: &[u8],
    p: tokio::sync::watch::Receiver<std::sync::Arc<Vec<Rule>>>,
) -> (Outcome, Vec<u8>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let g = gate(&["127.0.0.0/8"], vec![]);
    let (sandbox, proxy) = tokio::io::duplex(1 << 16);
    let (mut from, mut to) = tokio::io::split(sandbox);
    let request = request.to_vec();
    // Written while the proxy reads (a big request fills the pipe).
    let writer = tokio::spawn(async move {
        let _ = to.write_all(&request).await;
        let _ = to.shutdown().await;
    });
    let reader = tokio::spawn(async move {
        let mut back = Vec::new();
        let _ = from.read_to_end(&mut back).await;
        back
    });
    let outcome = serve_connection(proxy, p, &g).await;
    writer.abort();
    (outcome, reader.await.unwrap())
}

#[tokio::test]
async fn a_tls_tunnel_goes_through_only_to_the_server_it_names() {
    let (port, mut got) = upstream(b"server hello").await;
    let (_tx, p) = policy(&[&format!("localhost:{port}")]);
    let mut req =
        format!("CONNECT localhost:{port} HTTP/1.1\r\nHost: localhost\r\n\r\n").into_bytes();
    req.extend_from_slice(&hello(&["localhost"]));
    let (o, back) = exchange(&req, p.clone()).await;
    assert_eq!(o.blocked, None, "{o:?}");
    let back = String::from_utf8_lossy(&back);
    assert!(
        back.starts_with("HTTP/1.1 200 Connection established\r\n\r\n"),
        "{back}"
    );
    assert!(back.ends_with("server hello"), "{back}");
    assert_eq!(got.recv().await.unwrap(), hello(&["localhost"]));
    // Another name in the hello: closed after the 200, nothing sent on.
    let mut req = format!("CONNECT localhost:{port} HTTP/1.1\r\n\r\n").into_bytes();
    req.extend_from_slice(&hello(&["other.example"]));
    let (o, back) = exchange(&req, p.clone()).await;
    assert_eq!(o.blocked, Some(Blocked::SniMismatch));
    assert!(!String::from_utf8_lossy(&back).contains("server hello"));
    // Decided before any connection: the server never heard of it.
    assert!(got.try_recv().is_err());
    // No name at all.
    let mut req = format!("CONNECT localhost:{port} HTTP/1.1\r\n\r\n").into_bytes();
    req.extend_from_slice(&hello(&[]));
    assert_eq!(
        exchange(&req, p.clone()).await.0.blocked,
        Some(Blocked::SniMismatch)
    );
    // Not listed: a 403 that says why.
    let (o, back) = exchange(b"CONNECT elsewhere.test:443 HTTP/1.1\r\n\r\n", p).await;
    assert_eq!(o.blocked, Some(Blocked::NotAllowed));
    assert!(
        String::from_utf8_lossy(&back).contains("X-Corral-Egress: blocked; reason=not_allowed")
    );
}

#[tokio::test]
async fn a_tls_tunnel_to_an_allowed_address_needs_no_name_and_takes_none_other() {
    let (port, mut got) = upstream(b"server hello").await;
    let (_tx, p) = policy(&[&format!("127.0.0.1/32:{port}")]);
    let connect = format!("CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n").into_bytes();
    // A client names no address in its hello (RFC 6066).
    let mut req = connect.clone();
    req.extend_from_slice(&hello(&[]));
    let (o, back) = exchange(&req, p.clone()).await;
    assert_eq!(o.blocked, None, "{o:?}");
    assert!(String::from_utf8_lossy(&back).ends_with("server hello"));
    assert_eq!(got.recv().await.unwrap(), hello(&[]));
    // A hello that names a host is refused: the rule is for the address.
    let mut req = connect;
    req.extend_from_slice(&hello(&["pypi.org"]));
    let (o, _) = exchange(&req, p).await;
    assert_eq!(o.blocked, Some(Blocked::SniMismatch));
    assert!(got.try_recv().is_err());
}

#[test]
fn whatever_a_server_could_read_as_http_in_a_tunnel_goes_to_the_guard() {
    for first in [
        &b"GET / HTTP/1.1\r\nHost: evil.test\r\n\r\n"[..],
        b"\r\nGET / HTTP/1.1\r\nHost: evil.test\r\n\r\n",
        b"get / http/1.1\r\nHost: evil.test\r\n\r\n",
        b"GET / HTTP/1.1\nHost: evil.test\nX: \r\n\n",
        b"GET\t/\tHTTP/1.1\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    ] {
        assert_eq!(
            hello_verdict(first, "pkg.test"),
            Verdict::Http,
            "{:?}",
            String::from_utf8_lossy(first)
        );
        // And the guard takes none of the odd ones.
        let mut g = http::Guard::new(http::Mode::Tunnel, "pkg.test", 80);
        let mut out = Vec::new();
        let fed = g.feed(first, &mut out);
        if first.starts_with(b"GET / HTTP/1.1\r\n") {
            assert_eq!(fed, Err(Blocked::HostMismatch));
        } else {
            assert!(fed.is_err() || out.is_empty(), "{fed:?} {out:?}");
        }
    }
    // Text without a line end yet: wait; past the bound: the guard's.
    assert_eq!(hello_verdict(b"GET / HTT", "pkg.test"), Verdict::More);
    let long = vec![b'A'; MAX_HEAD_BYTES + 1];
    assert_eq!(hello_verdict(&long, "pkg.test"), Verdict::Http);
    // Other protocols whose clients speak first go on as they are.
    assert_eq!(
        hello_verdict(b"SSH-2.0-OpenSSH_9.2p1 Debian-2\r\n", "pkg.test"),
        Verdict::Go
    );
    assert_eq!(
        hello_verdict(b"\x00\x00\x00\x08\x04\xd2\x16\x2f", "pkg.test"),
        Verdict::Go
    );
    assert_eq!(hello_verdict(b"EHLO me\r\n", "pkg.test"), Verdict::Go);
}

#[tokio::test]
async fn a_bracketed_address_is_refused_as_internal_not_as_another_host() {
    let (_tx, p) = policy(&["::/0"]);
    for req in [
        "GET http://[::1]/ HTTP/1.1\r\nHost: [::1]\r\n\r\n",
        "GET http://[::1]:443/ HTTP/1.1\r\nHost: [::1]:443\r\n\r\n",
        "GET http://[::169.254.169.254]/ HTTP/1.1\r\nHost: [::169.254.169.254]\r\n\r\n",
        "GET http://[64:ff9b:1::a9fe:a9fe]/ HTTP/1.1\r\n\r\n",
    ] {
        let (o, back) = exchange(req.as_bytes(), p.clone()).await;
        assert_eq!(o.blocked, Some(Blocked::InternalAddress), "{req}: {o:?}");
        assert!(
            String::from_utf8_lossy(&back).contains("reason=internal_address"),
            "{req}"
        );
    }
}

#[tokio::test]
async fn a_plain_request_is_forwarded_in_origin_form_if_its_host_matches() {
    let (port, mut got) = upstream(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok").await;
    let (_tx, p) = policy(&[&format!("localhost:{port}")]);
    let req = format!(
        "GET http://localhost:{port}/simple/pip/?x=1 HTTP/1.1\r\nHost: localhost:{port}\r\nUser-Agent: t\r\n\r\n"
    );
    let (o, back) = exchange(req.as_bytes(), p.clone()).await;
    assert_eq!(o.blocked, None, "{o:?}");
    assert!(String::from_utf8_lossy(&back).ends_with("ok"));
    let sent = String::from_utf8(got.recv().await.unwrap()).unwrap();
    assert!(
        sent.starts_with("GET /simple/pip/?x=1 HTTP/1.1\r\nHost: localhost:"),
        "{sent}"
    );
    assert!(sent.contains("User-Agent: t\r\n"), "{sent}");
    let req = format!("GET http://localhost:{port}/ HTTP/1.1\r\nHost: evil.test\r\n\r\n");
    let (o, back) = exchange(req.as_bytes(), p).await;
    assert_eq!(o.blocked, Some(Blocked::HostMismatch));
    assert!(String::from_utf8_lossy(&back).contains("reason=host_mismatch"));
}

#[tokio::test]
async fn a_policy_replaced_closes_what_it_no_longer_allows() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (port, _got) = upstream(b"").await;
    let (tx, p) = policy(&[&format!("localhost:{port}")]);
    let g = gate(&["127.0.0.0/8"], vec![]);
    let (mut sandbox, proxy) = tokio::io::duplex(1 << 16);
    let serving = tokio::spawn(async move { serve_connection(proxy, p, &g).await });
    sandbox
        .write_all(format!("CONNECT localhost:{port} HTTP/1.1\r\n\r\nSSH-2.0-x\r\n").as_bytes())
        .await
        .unwrap();
    let mut ok = [0u8; 39];
    sandbox.read_exact(&mut ok).await.unwrap();
    // Still allowed: a replaced policy that keeps it changes nothing.
    tx.send(std::sync::Arc::new(rules(&[
        &format!("localhost:{port}"),
        "pypi.org",
    ])))
    .unwrap();
    tokio::task::yield_now().await;
    assert!(!serving.is_finished());
    tx.send(std::sync::Arc::new(rules(&["pypi.org"]))).unwrap();
    let o = tokio::time::timeout(Duration::from_secs(5), serving)
        .await
        .expect("closed")
        .unwrap();
    assert_eq!(o.blocked, Some(Blocked::NotAllowed));
}

#[tokio::test(start_paused = true)]
async fn a_tunnel_idle_past_its_timeout_is_closed() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (port, _got) = upstream(b"").await;
    let (_tx, p) = policy(&[&format!("localhost:{port}")]);
    let g = gate(&["127.0.0.0/8"], vec![]);
    let (mut sandbox, proxy) = tokio::io::duplex(1 << 16);
    let started = tokio::time::Instant::now();
    let serving = tokio::spawn(async move { serve_connection(proxy, p, &g).await });
    sandbox
        .write_all(format!("CONNECT localhost:{port} HTTP/1.1\r\n\r\nSSH-2.0-x\r\n").as_bytes())
        .await
        .unwrap();
    let mut ok = [0u8; 39];
    sandbox.read_exact(&mut ok).await.unwrap();
    // Nothing either way from here: closed at the idle timeout.
    let o = serving.await.unwrap();
    assert_eq!(o.blocked, None);
    assert!(started.elapsed() >= IDLE_TIMEOUT, "{:?}", started.elapsed());
}

/// A connection on a real Unix socket, admitted, relayed by splicing;
/// its client's first bytes after the CONNECT are `first`.
async fn spliced_with(
    port: u16,
    p: tokio::sync::watch::Receiver<std::sync::Arc<Vec<Rule>>>,
    meters: Meters,
    first: &[u8],
) -> (tokio::net::UnixStream, tokio::task::JoinHandle<Outcome>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (mut sandbox, proxy) = tokio::net::UnixStream::pair().unwrap();
    let serving = tokio::spawn(async move {
        let g = gate(&["127.0.0.0/8"], vec![]);
        let mut p = p;
        match admit(proxy, &mut p, &g).await {
            Ok(a) => relay_spliced(a, p, &meters).await,
            Err(r) => r.answer().await,
        }
    });
    let mut hello = format!("CONNECT localhost:{port} HTTP/1.1\r\n\r\n").into_bytes();
    hello.extend_from_slice(first);
    sandbox.write_all(&hello).await.unwrap();
    let mut ok = [0u8; 39];
    sandbox.read_exact(&mut ok).await.unwrap();
    assert_eq!(&ok[..], b"HTTP/1.1 200 Connection established\r\n\r\n");
    (sandbox, serving)
}

/// [`spliced_with`] a client that speaks SSH.
async fn spliced(
    port: u16,
    p: tokio::sync::watch::Receiver<std::sync::Arc<Vec<Rule>>>,
    meters: Meters,
) -> (tokio::net::UnixStream, tokio::task::JoinHandle<Outcome>) {
    spliced_with(port, p, meters, b"SSH-2.0-x\r\n").await
}

#[tokio::test]
async fn a_spliced_relay_carries_both_ways_and_a_policy_cuts_it() {
    use tokio::io::AsyncReadExt;
    let (port, mut got) = upstream(b"server hello").await;
    let (tx, p) = policy(&[&format!("localhost:{port}")]);
    let meters = Meters::default();
    let (mut sandbox, serving) = spliced(port, p, meters.clone()).await;
    let mut back = [0u8; 12];
    sandbox.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"server hello");
    // Counted as it moves, not when the connection ends.
    assert_eq!(meters.inward.bytes.get(), 12);
    assert_eq!(got.recv().await.unwrap(), b"SSH-2.0-x\r\n");
    tx.send(std::sync::Arc::new(rules(&["pypi.org"]))).unwrap();
    let o = tokio::time::timeout(Duration::from_secs(5), serving)
        .await
        .expect("cut")
        .unwrap();
    assert!(o.cut, "{o:?}");
    assert_eq!(o.blocked, Some(Blocked::NotAllowed));
    assert_eq!((o.bytes_out, o.bytes_in), (11, 12));
}

#[tokio::test(start_paused = true)]
async fn a_spliced_relay_idle_past_its_timeout_is_closed() {
    let (port, _got) = upstream(b"").await;
    let (_tx, p) = policy(&[&format!("localhost:{port}")]);
    let started = tokio::time::Instant::now();
    let (_sandbox, serving) = spliced(port, p, Meters::default()).await;
    let o = serving.await.unwrap();
    assert!(!o.cut && o.blocked.is_none(), "{o:?}");
    assert!(started.elapsed() >= IDLE_TIMEOUT, "{:?}", started.elapsed());
}

/// A loopback server that speaks first (as SMTP, FTP and MySQL do),
/// then records each read and answers it.
async fn greeting_upstream() -> (u16, tokio::sync::mpsc::Receiver<Vec<u8>>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            let tx = tx.clone();
            tokio::spawn(async move {
                let _ = s.write_all(b"220 ready\r\n").await;
                let mut got = vec![0u8; 65536];
                while let Ok(n) = s.read(&mut got).await {
                    if n == 0 {
                        break;
                    }
                    let _ = tx.send(got[..n].to_vec()).await;
                    let _ = s.write_all(b"250 ok\r\n").await;
                }
            });
        }
    });
    (port, rx)
}

trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

/// A tunnel to `port` whose client says nothing after its 200: on a
/// real Unix socket, relayed by splicing, or in memory, by copying.
async fn silent_tunnel(
    port: u16,
    p: tokio::sync::watch::Receiver<std::sync::Arc<Vec<Rule>>>,
    spliced: bool,
) -> (Box<dyn Io>, tokio::task::JoinHandle<Outcome>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    if spliced {
        let (sandbox, serving) = spliced_with(port, p, Meters::default(), b"").await;
        return (Box::new(sandbox), serving);
    }
    let (mut sandbox, proxy) = tokio::io::duplex(1 << 16);
    let g = gate(&["127.0.0.0/8"], vec![]);
    let serving = tokio::spawn(async move { serve_connection(proxy, p, &g).await });
    sandbox
        .write_all(format!("CONNECT localhost:{port} HTTP/1.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut ok = [0u8; 39];
    sandbox.read_exact(&mut ok).await.unwrap();
    assert_eq!(&ok[..], b"HTTP/1.1 200 Connection established\r\n\r\n");
    (Box::new(sandbox), serving)
}

#[tokio::test]
async fn a_server_that_speaks_first_is_heard_and_its_client_still_checked() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let within = Duration::from_secs(5);
    for spliced in [true, false] {
        let (port, mut got) = greeting_upstream().await;
        let (_tx, p) = policy(&[&format!("localhost:{port}")]);
        // The client waits for the server's greeting (it used to wait
        // for the client's first bytes, until the head timeout).
        let (mut sandbox, serving) = silent_tunnel(port, p.clone(), spliced).await;
        let mut greeting = [0u8; 11];
        tokio::time::timeout(within, sandbox.read_exact(&mut greeting))
            .await
            .expect("the greeting comes before the client speaks")
            .unwrap();
        assert_eq!(&greeting, b"220 ready\r\n");
        sandbox.write_all(b"EHLO sandbox\r\n").await.unwrap();
        assert_eq!(got.recv().await.unwrap(), b"EHLO sandbox\r\n");
        let mut answer = [0u8; 8];
        sandbox.read_exact(&mut answer).await.unwrap();
        assert_eq!(&answer, b"250 ok\r\n");
        drop(sandbox);
        let o = tokio::time::timeout(within, serving)
            .await
            .unwrap()
            .unwrap();
        assert_eq!((o.blocked, o.cut), (None, false), "{o:?}");
        assert_eq!((o.bytes_out, o.bytes_in), (14, 19), "spliced: {spliced}");
        // A TLS client that spoke only after the server: its hello
        // must still name the host asked for, or none of it goes on.
        let (mut sandbox, serving) = silent_tunnel(port, p.clone(), spliced).await;
        sandbox.read_exact(&mut greeting).await.unwrap();
        sandbox.write_all(&hello(&["other.example"])).await.unwrap();
        let o = tokio::time::timeout(within, serving)
            .await
            .unwrap()
            .unwrap();
        // Blocked, late (not cut by a policy): reported as blocked.
        assert_eq!(
            (o.blocked, o.cut),
            (Some(Blocked::SniMismatch), false),
            "spliced: {spliced}"
        );
        assert!(got.try_recv().is_err(), "the server heard nothing");
        // The name asked for goes through.
        let (mut sandbox, serving) = silent_tunnel(port, p, spliced).await;
        sandbox.read_exact(&mut greeting).await.unwrap();
        sandbox.write_all(&hello(&["localhost"])).await.unwrap();
        assert_eq!(got.recv().await.unwrap(), hello(&["localhost"]));
        drop(sandbox);
        let o = tokio::time::timeout(within, serving)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(o.blocked, None, "{o:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_hello_begun_after_the_server_spoke_has_the_heads_time_to_end() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    for spliced in [true, false] {
        let (port, mut got) = greeting_upstream().await;
        let (_tx, p) = policy(&[&format!("localhost:{port}")]);
        let (mut sandbox, serving) = silent_tunnel(port, p, spliced).await;
        let mut greeting = [0u8; 11];
        sandbox.read_exact(&mut greeting).await.unwrap();
        // A hello begun, never ended.
        let started = tokio::time::Instant::now();
        sandbox
            .write_all(&hello(&["localhost"])[..3])
            .await
            .unwrap();
        let o = serving.await.unwrap();
        assert_eq!((o.blocked, o.cut), (Some(Blocked::BadRequest), false));
        assert!(started.elapsed() >= HEAD_TIMEOUT, "{:?}", started.elapsed());
        assert!(got.try_recv().is_err(), "the server heard nothing");
    }
}

#[tokio::test]
async fn a_policy_replaced_while_a_hello_is_read_decides_what_goes_upstream() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (port, mut got) = upstream(b"server hello").await;
    let (tx, p) = policy(&[&format!("localhost:{port}")]);
    let g = gate(&["127.0.0.0/8"], vec![]);
    let (mut sandbox, proxy) = tokio::io::duplex(1 << 16);
    let serving = tokio::spawn(async move { serve_connection(proxy, p, &g).await });
    sandbox
        .write_all(format!("CONNECT localhost:{port} HTTP/1.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut ok = [0u8; 39];
    sandbox.read_exact(&mut ok).await.unwrap();
    // Allowed when the CONNECT was read; no longer when the hello comes.
    tx.send(std::sync::Arc::new(rules(&["pypi.org"]))).unwrap();
    sandbox.write_all(&hello(&["localhost"])).await.unwrap();
    let o = tokio::time::timeout(Duration::from_secs(5), serving)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(o.blocked, Some(Blocked::NotAllowed), "{o:?}");
    // The server's first read ends with nothing (it used to get the
    // hello, before the relay saw the new policy).
    let first = tokio::time::timeout(Duration::from_secs(5), got.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(first.is_empty(), "{} bytes went upstream", first.len());
}

#[tokio::test(start_paused = true)]
async fn slow_and_bloated_heads_are_refused() {
    use tokio::io::AsyncWriteExt;
    let (_tx, p) = policy(&["pypi.org"]);
    let g = gate(&[], vec![]);
    // A CONNECT line that never ends: given up at the head timeout.
    let (mut sandbox, proxy) = tokio::io::duplex(1 << 16);
    sandbox
        .write_all(b"CONNECT pypi.org:443 HTTP/1.1\r\nX: ")
        .await
        .unwrap();
    let o = serve_connection(proxy, p.clone(), &g).await;
    assert_eq!(o.blocked, Some(Blocked::BadRequest));
    drop(sandbox);
    // 1 MiB of headers: refused at the bound, not read whole.
    let mut big = b"GET http://pypi.org/ HTTP/1.1\r\n".to_vec();
    big.extend(std::iter::repeat_n(b'a', 1 << 20));
    let (o, back) = exchange(&big, p).await;
    assert_eq!(o.blocked, Some(Blocked::BadRequest));
    assert!(String::from_utf8_lossy(&back).contains("reason=bad_request"));
}

#[test]
fn decisions_name_their_reason() {
    let p = rules(&["pypi.org", "*.pythonhosted.org", "192.0.2.0/24:8080"]);
    assert_eq!(decide(&p, "pypi.org", 443), Ok(()));
    assert_eq!(decide(&p, "files.pythonhosted.org", 443), Ok(()));
    assert_eq!(
        decide(&p, "pythonhosted.org", 443),
        Err(Blocked::NotAllowed)
    );
    assert_eq!(decide(&p, "pypi.org", 22), Err(Blocked::Port));
    assert_eq!(decide(&p, "192.0.2.9", 8080), Ok(()));
    assert_eq!(decide(&p, "192.0.2.9", 443), Err(Blocked::Port));
    assert_eq!(decide(&p, "203.0.113.1", 443), Err(Blocked::NotAllowed));
    assert_eq!(decide(&[], "pypi.org", 443), Err(Blocked::NotAllowed));
}
