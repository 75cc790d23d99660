//! Length-delimited frames: a 4-byte big-endian length, then that many bytes
//! of one encoded protobuf message. Used on the worker <-> corral-init link.
//!
//! The decoder never trusts a length: a frame above [`MAX_FRAME_BYTES`] is
//! reported and its bytes skipped without being buffered, so a peer cannot
//! make the reader allocate what it announces.

use bytes::{Buf, BytesMut};

use crate::ProtocolError;
use crate::limits::MAX_FRAME_BYTES;

/// Encodes `msg` as one frame.
pub fn encode(msg: &impl prost::Message) -> Vec<u8> {
    let len = msg.encoded_len();
    let mut buf = Vec::with_capacity(4 + len);
    buf.extend_from_slice(&(len as u32).to_be_bytes());
    // Encoding into a Vec cannot run out of space.
    let _ = msg.encode(&mut buf);
    buf
}

/// Incremental frame decoder: feed bytes with [`extend`](Self::extend), then
/// drain frames with [`next_frame`](Self::next_frame).
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: BytesMut,
    /// Bytes still to discard of an oversized frame.
    skipping: u64,
    max: usize,
}

impl FrameDecoder {
    pub fn new() -> Self {
        Self::with_max(MAX_FRAME_BYTES)
    }

    pub fn with_max(max: usize) -> Self {
        Self {
            buf: BytesMut::new(),
            skipping: 0,
            max,
        }
    }

    pub fn extend(&mut self, mut data: &[u8]) {
        if self.skipping > 0 {
            let n = (self.skipping as usize).min(data.len());
            self.skipping -= n as u64;
            data = &data[n..];
        }
        self.buf.extend_from_slice(data);
    }

    /// Bytes buffered and not yet returned as a frame.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next whole frame's payload, `Ok(None)` when more bytes are needed,
    /// or an error for an oversized frame (whose bytes are then skipped).
    pub fn next_frame(&mut self) -> Result<Option<bytes::Bytes>, ProtocolError> {
        if self.buf.len() < 4 {
            return Ok(None);
        }
        let len = u32::from_be_bytes([self.buf[0], self.buf[1], self.buf[2], self.buf[3]]) as usize;
        if len > self.max {
            self.buf.advance(4);
            let have = self.buf.len().min(len);
            self.buf.advance(have);
            self.skipping = (len - have) as u64;
            return Err(ProtocolError::FrameTooLarge {
                len: len as u64,
                max: self.max as u64,
            });
        }
        if self.buf.len() < 4 + len {
            self.buf.reserve(4 + len - self.buf.len());
            return Ok(None);
        }
        self.buf.advance(4);
        Ok(Some(self.buf.split_to(len).freeze()))
    }

    /// Decodes the next frame as `M`. A frame that does not decode is
    /// consumed and reported, so the stream stays in step.
    pub fn next_message<M: prost::Message + Default>(
        &mut self,
    ) -> Result<Option<M>, ProtocolError> {
        match self.next_frame()? {
            Some(payload) => Ok(Some(M::decode(payload)?)),
            None => Ok(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb;

    #[test]
    fn frames_survive_any_split() {
        let msg = pb::InitRequest {
            kind: Some(pb::init_request::Kind::Credit(pb::init_request::Credit {
                bytes: 77,
            })),
        };
        let mut wire = encode(&msg);
        wire.extend(encode(&msg));
        for split in 0..wire.len() {
            let mut d = FrameDecoder::new();
            d.extend(&wire[..split]);
            let mut got = Vec::new();
            while let Some(m) = d.next_message::<pb::InitRequest>().unwrap() {
                got.push(m);
            }
            d.extend(&wire[split..]);
            while let Some(m) = d.next_message::<pb::InitRequest>().unwrap() {
                got.push(m);
            }
            assert_eq!(got, vec![msg.clone(), msg.clone()], "split at {split}");
        }
    }

    #[test]
    fn oversized_frame_is_rejected_and_skipped() {
        let mut d = FrameDecoder::with_max(8);
        let mut wire = 100u32.to_be_bytes().to_vec();
        wire.extend(vec![7u8; 40]);
        d.extend(&wire);
        assert_eq!(
            d.next_frame(),
            Err(ProtocolError::FrameTooLarge { len: 100, max: 8 })
        );
        d.extend(&[7u8; 60]);
        d.extend(&encode(&pb::init_request::Credit { bytes: 1 }));
        let m: pb::init_request::Credit = d.next_message().unwrap().unwrap();
        assert_eq!(m.bytes, 1);
    }

    /// A small deterministic PRNG (xorshift), so the test needs no crate.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    #[test]
    fn random_garbage_between_valid_frames_never_panics_or_desyncs() {
        let valid = pb::InitRequest {
            kind: Some(pb::init_request::Kind::Credit(pb::init_request::Credit {
                bytes: 4242,
            })),
        };
        for seed in 1..300u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let mut wire = Vec::new();
            let mut expected_valid = 0;
            for _ in 0..20 {
                if rng.below(2) == 0 {
                    wire.extend(encode(&valid));
                    expected_valid += 1;
                } else {
                    // A frame whose declared length is right but whose
                    // payload is random: decodes to an error or to junk.
                    let len = rng.below(64) as usize;
                    wire.extend((len as u32).to_be_bytes());
                    wire.extend((0..len).map(|_| rng.next() as u8));
                }
            }
            let mut d = FrameDecoder::with_max(1024);
            let mut got_valid = 0;
            let mut pos = 0;
            while pos < wire.len() {
                let step = 1 + rng.below(17) as usize;
                let end = (pos + step).min(wire.len());
                d.extend(&wire[pos..end]);
                pos = end;
                loop {
                    match d.next_message::<pb::InitRequest>() {
                        Ok(Some(m)) if m == valid => got_valid += 1,
                        Ok(Some(_)) | Err(_) => {}
                        Ok(None) => break,
                    }
                }
            }
            assert!(
                got_valid >= expected_valid,
                "seed {seed}: lost valid frames"
            );
            assert_eq!(d.buffered(), 0, "seed {seed}: bytes left over");
        }
    }

    #[test]
    fn garbage_frame_is_an_error_not_a_panic() {
        let mut d = FrameDecoder::new();
        d.extend(&[0, 0, 0, 3, 0xff, 0xff, 0xff]);
        assert!(matches!(
            d.next_message::<pb::InitRequest>(),
            Err(ProtocolError::Decode(_))
        ));
        assert_eq!(d.next_message::<pb::InitRequest>(), Ok(None));
    }
}
