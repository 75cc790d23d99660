//! A stub resolver for egress (`--egress-resolver HOST:PORT`): one A and
//! one AAAA question over UDP to the operator's resolver, answers read
//! without trust (bounded, the question and id checked, only A and AAAA
//! records of the answer section taken).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

/// Largest answer read.
const MAX_ANSWER: usize = 4096;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DnsError {
    #[error("{0:?} is no name a query can carry")]
    BadName(String),
    #[error("no answer from {0} in time")]
    Timeout(SocketAddr),
    #[error("resolver {0}: {1}")]
    Io(SocketAddr, String),
    #[error("resolver {0} answered with code {1}")]
    Rcode(SocketAddr, u8),
    #[error("resolver {0}: a malformed answer")]
    Malformed(SocketAddr),
    #[error("resolver {0}: the answer was cut (truncated over UDP)")]
    Truncated(SocketAddr),
}

/// The question of a query for `name`, `qtype` (1: A, 28: AAAA).
fn query(id: u16, name: &str, qtype: u16) -> Result<Vec<u8>, DnsError> {
    let mut q = Vec::with_capacity(18 + name.len());
    q.extend_from_slice(&id.to_be_bytes());
    q.extend_from_slice(&[0x01, 0x00]); // recursion desired
    q.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, 0]); // one question
    for label in name.trim_end_matches('.').split('.') {
        if label.is_empty() || label.len() > 63 {
            return Err(DnsError::BadName(name.into()));
        }
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.push(0);
    q.extend_from_slice(&qtype.to_be_bytes());
    q.extend_from_slice(&[0, 1]); // IN
    Ok(q)
}

/// Skips a (possibly compressed) name at `at`; where it ends.
fn skip_name(msg: &[u8], mut at: usize) -> Option<usize> {
    for _ in 0..128 {
        let len = *msg.get(at)? as usize;
        match len {
            0 => return Some(at + 1),
            l if l & 0xc0 == 0xc0 => {
                msg.get(at + 1)?;
                return Some(at + 2);
            }
            l if l < 64 => at += 1 + l,
            _ => return None,
        }
    }
    None
}

/// The addresses of an answer to `sent`.
fn answers(msg: &[u8], sent: &[u8], from: SocketAddr) -> Result<Vec<IpAddr>, DnsError> {
    let bad = || DnsError::Malformed(from);
    if msg.len() < 12 || msg[..2] != sent[..2] {
        return Err(bad());
    }
    if msg[2] & 0x80 == 0 {
        return Err(bad()); // not a response
    }
    if msg[2] & 0x02 != 0 {
        return Err(DnsError::Truncated(from));
    }
    let rcode = msg[3] & 0x0f;
    if rcode != 0 {
        return Err(DnsError::Rcode(from, rcode));
    }
    let qd = u16::from_be_bytes([msg[4], msg[5]]);
    let an = u16::from_be_bytes([msg[6], msg[7]]);
    if qd != 1 {
        return Err(bad());
    }
    // The question must be the one sent.
    let question = &sent[12..];
    if msg.get(12..12 + question.len()) != Some(question) {
        return Err(bad());
    }
    let mut at = 12 + question.len();
    let mut out = Vec::new();
    for _ in 0..an {
        at = skip_name(msg, at).ok_or_else(bad)?;
        let fixed = msg.get(at..at + 10).ok_or_else(bad)?;
        let rtype = u16::from_be_bytes([fixed[0], fixed[1]]);
        let class = u16::from_be_bytes([fixed[2], fixed[3]]);
        let rdlen = u16::from_be_bytes([fixed[8], fixed[9]]) as usize;
        at += 10;
        let data = msg.get(at..at + rdlen).ok_or_else(bad)?;
        at += rdlen;
        match (rtype, class, rdlen) {
            (1, 1, 4) => out.push(IpAddr::V4(Ipv4Addr::new(
                data[0], data[1], data[2], data[3],
            ))),
            (28, 1, 16) => {
                let mut b = [0u8; 16];
                b.copy_from_slice(data);
                out.push(IpAddr::V6(Ipv6Addr::from(b)));
            }
            (1 | 28, _, _) => return Err(bad()),
            _ => {} // a CNAME on the way, say
        }
    }
    Ok(out)
}

/// The A and AAAA addresses of `name` from `resolver`.
pub async fn resolve(
    resolver: SocketAddr,
    name: &str,
    timeout: Duration,
) -> Result<Vec<IpAddr>, DnsError> {
    let io = |e: std::io::Error| DnsError::Io(resolver, e.to_string());
    let bind: SocketAddr = if resolver.is_ipv4() {
        "0.0.0.0:0"
            .parse()
            .map_err(|_| DnsError::BadName(name.into()))?
    } else {
        "[::]:0"
            .parse()
            .map_err(|_| DnsError::BadName(name.into()))?
    };
    let sock = tokio::net::UdpSocket::bind(bind).await.map_err(io)?;
    sock.connect(resolver).await.map_err(io)?;
    // Both questions at once, as the system's resolver asks them: the
    // answers come back in one round trip, in whatever order.
    let id = uuid::Uuid::new_v4();
    let id = id.as_bytes();
    let a_id = u16::from_be_bytes([id[0], id[1]]);
    // Two ids that differ, so each answer finds its question.
    let aaaa_id = u16::from_be_bytes([id[2], id[3]]) | 1;
    let a_id = if a_id == aaaa_id { a_id ^ 1 } else { a_id };
    let questions = [query(a_id, name, 1)?, query(aaaa_id, name, 28)?];
    for q in &questions {
        sock.send(q).await.map_err(io)?;
    }
    let mut found: [Option<Vec<IpAddr>>; 2] = [None, None];
    let mut buf = vec![0u8; MAX_ANSWER];
    let deadline = tokio::time::Instant::now() + timeout;
    while found.iter().any(Option::is_none) {
        let n = tokio::time::timeout_at(deadline, sock.recv(&mut buf))
            .await
            .map_err(|_| DnsError::Timeout(resolver))?
            .map_err(io)?;
        // Datagrams that answer neither open question (another id, noise)
        // are dropped until the deadline.
        let Some(i) =
            (0..2).find(|&i| found[i].is_none() && n >= 2 && buf[..2] == questions[i][..2])
        else {
            continue;
        };
        found[i] = Some(answers(&buf[..n], &questions[i], resolver)?);
    }
    Ok(found.into_iter().flatten().flatten().collect())
}

/// A DNS server of a test's own on loopback, for the tests of egress (this
/// crate's and the end-to-end suite's): answers each name with what its
/// table gives. Not for anything but tests: it answers A and AAAA only.
pub mod testing {
    use std::net::{IpAddr, SocketAddr};

    /// Serves on a fresh loopback port: each name is answered with the
    /// addresses `answer` gives (called again for every query, so a test
    /// can change its answers between two lookups).
    pub async fn serve(
        answer: impl Fn(&str, u16) -> Vec<IpAddr> + Send + 'static,
    ) -> std::io::Result<(SocketAddr, tokio::task::JoinHandle<()>)> {
        let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await?;
        let addr = sock.local_addr()?;
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; 512];
            loop {
                let Ok((n, from)) = sock.recv_from(&mut buf).await else {
                    return;
                };
                if let Some(r) = reply(&buf[..n], &answer) {
                    let _ = sock.send_to(&r, from).await;
                }
            }
        });
        Ok((addr, task))
    }

    fn reply(q: &[u8], answer: &impl Fn(&str, u16) -> Vec<IpAddr>) -> Option<Vec<u8>> {
        let mut at = 12;
        let mut labels = Vec::new();
        while *q.get(at)? != 0 {
            let l = *q.get(at)? as usize;
            labels.push(String::from_utf8_lossy(q.get(at + 1..at + 1 + l)?).into_owned());
            at += 1 + l;
        }
        let qtype = u16::from_be_bytes([*q.get(at + 1)?, *q.get(at + 2)?]);
        let question = q.get(12..at + 5)?;
        let ips: Vec<IpAddr> = answer(&labels.join("."), qtype)
            .into_iter()
            .filter(|ip| (qtype == 1) == ip.is_ipv4())
            .collect();
        let mut r = q.get(..2)?.to_vec();
        r.extend_from_slice(&[0x81, 0x80, 0, 1]);
        r.extend_from_slice(&(ips.len() as u16).to_be_bytes());
        r.extend_from_slice(&[0, 0, 0, 0]);
        r.extend_from_slice(question);
        for ip in ips {
            r.extend_from_slice(&[0xc0, 12]);
            r.extend_from_slice(&qtype.to_be_bytes());
            r.extend_from_slice(&[0, 1, 0, 0, 0, 30]);
            match ip {
                IpAddr::V4(a) => {
                    r.extend_from_slice(&[0, 4]);
                    r.extend_from_slice(&a.octets());
                }
                IpAddr::V6(a) => {
                    r.extend_from_slice(&[0, 16]);
                    r.extend_from_slice(&a.octets());
                }
            }
        }
        Some(r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn serve(
        answer: impl Fn(&str, u16) -> Vec<IpAddr> + Send + 'static,
    ) -> (SocketAddr, tokio::task::JoinHandle<()>) {
        testing::serve(answer).await.unwrap()
    }

    #[tokio::test]
    async fn names_are_resolved_by_the_resolver_given() {
        let (addr, task) = serve(|name, _| match name {
            "pypi.test" => vec!["127.0.0.7".parse().unwrap(), "::1".parse().unwrap()],
            _ => vec![],
        })
        .await;
        let t = Duration::from_secs(5);
        let got = resolve(addr, "pypi.test", t).await.unwrap();
        assert_eq!(
            got,
            vec![
                "127.0.0.7".parse::<IpAddr>().unwrap(),
                "::1".parse().unwrap()
            ]
        );
        assert!(resolve(addr, "nothing.test", t).await.unwrap().is_empty());
        assert!(matches!(
            resolve(addr, "bad..name", t).await,
            Err(DnsError::BadName(_))
        ));
        task.abort();
        // Nobody answers: a timeout, not a hang.
        let silent = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let quiet = silent.local_addr().unwrap();
        assert_eq!(
            resolve(quiet, "pypi.test", Duration::from_millis(200)).await,
            Err(DnsError::Timeout(quiet))
        );
    }

    /// A resolver that answers nothing until it has both questions, then
    /// noise, then the AAAA answer before the A one.
    #[tokio::test]
    async fn both_questions_go_at_once_and_answers_find_theirs_in_any_order() {
        let server = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = server.local_addr().unwrap();
        let task = tokio::spawn(async move {
            let mut asked = Vec::new();
            let mut buf = [0u8; 512];
            let mut from = None;
            while asked.len() < 2 {
                let (n, f) = server.recv_from(&mut buf).await.unwrap();
                asked.push(buf[..n].to_vec());
                from = Some(f);
            }
            let from = from.unwrap();
            let answer = |q: &[u8]| {
                let mut a = q.to_vec();
                a[2] = 0x81;
                a[3] = 0x80;
                a[7] = 1;
                let qtype = u16::from_be_bytes([q[q.len() - 4], q[q.len() - 3]]);
                a.extend_from_slice(&[0xc0, 12]);
                a.extend_from_slice(&qtype.to_be_bytes());
                a.extend_from_slice(&[0, 1, 0, 0, 0, 30]);
                if qtype == 1 {
                    a.extend_from_slice(&[0, 4, 1, 2, 3, 4]);
                } else {
                    a.extend_from_slice(&[0, 16]);
                    a.extend_from_slice(&"::2".parse::<Ipv6Addr>().unwrap().octets());
                }
                a
            };
            // An answer with an id neither question has.
            let mut noise = answer(&asked[0]);
            let ids: Vec<&[u8]> = asked.iter().map(|q| &q[..2]).collect();
            let other = (0u16..3)
                .map(u16::to_be_bytes)
                .find(|id| !ids.contains(&&id[..]))
                .unwrap();
            noise[..2].copy_from_slice(&other);
            server.send_to(&noise, from).await.unwrap();
            asked.sort_by_key(|q| std::cmp::Reverse(q[q.len() - 3]));
            for q in &asked {
                server.send_to(&answer(q), from).await.unwrap();
            }
        });
        let got = resolve(addr, "both.test", Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(
            got,
            vec!["1.2.3.4".parse::<IpAddr>().unwrap(), "::2".parse().unwrap()]
        );
        task.await.unwrap();
    }

    #[test]
    fn hostile_answers_are_refused_never_a_panic() {
        let from: SocketAddr = "127.0.0.1:53".parse().unwrap();
        let q = query(0x1234, "a.test", 1).unwrap();
        let mut good = q.clone();
        good[2] = 0x81;
        good[3] = 0x80;
        good[7] = 1; // one answer
        good.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 30, 0, 4, 1, 2, 3, 4]);
        assert_eq!(
            answers(&good, &q, from).unwrap(),
            vec!["1.2.3.4".parse::<IpAddr>().unwrap()]
        );
        let mut other_id = good.clone();
        other_id[0] = 0;
        assert!(answers(&other_id, &q, from).is_err());
        let mut truncated = good.clone();
        truncated[2] |= 0x02;
        assert_eq!(
            answers(&truncated, &q, from),
            Err(DnsError::Truncated(from))
        );
        let mut wrong_len = good.clone();
        let n = wrong_len.len();
        wrong_len[n - 5] = 5;
        assert!(answers(&wrong_len, &q, from).is_err());
        for i in 0..good.len() {
            let _ = answers(&good[..i], &q, from);
            let mut bent = good.clone();
            bent[i] ^= 0xff;
            let _ = answers(&bent, &q, from);
        }
    }
}
