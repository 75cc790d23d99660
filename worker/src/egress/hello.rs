//! The server name of a TLS ClientHello (SNI), read from the first bytes
//! of a connection and nothing else.

use super::*;

/// What the first bytes of a tunnel say of its TLS server name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hello {
    /// Not whole yet: read more (the record is under [`MAX_HELLO_BYTES`]).
    More,
    /// A ClientHello naming this server (lower-case, no trailing dot).
    Sni(String),
    /// A ClientHello with no server name.
    NoSni,
    /// Not a TLS ClientHello at all.
    NotTls,
}

/// The server name of the TLS ClientHello at the start of `buf`. Only the
/// first record is read (a ClientHello split over records is taken for one
/// without a name, and refused by the caller).
pub fn client_hello_sni(buf: &[u8]) -> Hello {
    // Record: type 22 (handshake), version 3.x, length.
    if buf.is_empty() {
        return Hello::More;
    }
    if buf[0] != 22 {
        return Hello::NotTls;
    }
    if buf.len() < 5 {
        return Hello::More;
    }
    if buf[1] != 3 {
        return Hello::NotTls;
    }
    let rec_len = u16::from_be_bytes([buf[3], buf[4]]) as usize;
    if rec_len == 0 || rec_len + 5 > MAX_HELLO_BYTES {
        return Hello::NotTls;
    }
    if buf.len() < 5 + rec_len {
        return Hello::More;
    }
    let mut r = Reader(&buf[5..5 + rec_len]);
    parse_hello(&mut r).unwrap_or(Hello::NoSni)
}

pub(crate) struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<usize> {
        self.take(2)
            .map(|b| u16::from_be_bytes([b[0], b[1]]) as usize)
    }
    fn u24(&mut self) -> Option<usize> {
        self.take(3)
            .map(|b| (b[0] as usize) << 16 | (b[1] as usize) << 8 | b[2] as usize)
    }
    fn vec8(&mut self) -> Option<Reader<'a>> {
        let n = self.u8()? as usize;
        self.take(n).map(Reader)
    }
    fn vec16(&mut self) -> Option<Reader<'a>> {
        let n = self.u16()?;
        self.take(n).map(Reader)
    }
}

pub(crate) fn parse_hello(r: &mut Reader<'_>) -> Option<Hello> {
    if r.u8()? != 1 {
        return Some(Hello::NotTls); // not a ClientHello
    }
    let len = r.u24()?;
    let mut body = Reader(r.take(len)?);
    body.take(2)?; // legacy version
    body.take(32)?; // random
    body.vec8()?; // session id
    body.vec16()?; // cipher suites
    body.vec8()?; // compression methods
    if body.0.is_empty() {
        return Some(Hello::NoSni);
    }
    let mut exts = body.vec16()?;
    let mut found: Option<String> = None;
    while !exts.0.is_empty() {
        let kind = exts.u16()?;
        let mut data = exts.vec16()?;
        if kind != 0 {
            continue;
        }
        if found.is_some() {
            return Some(Hello::NoSni); // two server_name extensions: refused
        }
        let mut list = data.vec16()?;
        while !list.0.is_empty() {
            let name_type = list.u8()?;
            let name = list.vec16()?;
            if name_type != 0 {
                continue;
            }
            if found.is_some() {
                return Some(Hello::NoSni); // two host names: refused
            }
            let text = std::str::from_utf8(name.0).ok()?;
            found = Some(normalize_name(text).ok()?);
        }
    }
    Some(found.map_or(Hello::NoSni, Hello::Sni))
}
