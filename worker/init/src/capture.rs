//! Head/tail capture: keeps the first and last bytes of a stream up to a
//! limit while counting the whole.

use std::collections::VecDeque;

use bytes::Bytes;
use corral_proto::Captured;

#[derive(Debug)]
pub struct HeadTail {
    head_cap: usize,
    tail_cap: usize,
    head: Vec<u8>,
    tail: VecDeque<u8>,
    total: u64,
}

impl HeadTail {
    /// Keeps at most `limit` bytes: half from the start, half from the end.
    pub fn new(limit: u64) -> Self {
        let limit = usize::try_from(limit).unwrap_or(usize::MAX);
        let head_cap = limit / 2 + limit % 2;
        Self {
            head_cap,
            tail_cap: limit / 2,
            head: Vec::new(),
            tail: VecDeque::new(),
            total: 0,
        }
    }

    pub fn push(&mut self, mut data: &[u8]) {
        self.total += data.len() as u64;
        if self.head.len() < self.head_cap {
            let n = (self.head_cap - self.head.len()).min(data.len());
            self.head.extend_from_slice(&data[..n]);
            data = &data[n..];
        }
        if self.tail_cap == 0 || data.is_empty() {
            return;
        }
        if data.len() >= self.tail_cap {
            self.tail.clear();
            self.tail.extend(&data[data.len() - self.tail_cap..]);
        } else {
            let overflow = (self.tail.len() + data.len()).saturating_sub(self.tail_cap);
            self.tail.drain(..overflow);
            self.tail.extend(data);
        }
    }

    pub fn total(&self) -> u64 {
        self.total
    }

    pub fn finish(self) -> Captured {
        let kept = (self.head.len() + self.tail.len()) as u64;
        Captured {
            head: Bytes::from(self.head),
            tail: Bytes::from(Vec::from(self.tail)),
            total_bytes: self.total,
            truncated: kept < self.total,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_output_is_kept_whole() {
        let mut c = HeadTail::new(100);
        c.push(b"hello ");
        c.push(b"world");
        let got = c.finish();
        assert_eq!(got.to_lossy_string(), "hello world");
        assert!(!got.truncated);
        assert_eq!(got.total_bytes, 11);
    }

    #[test]
    fn large_output_keeps_head_and_tail_and_counts_everything() {
        let mut c = HeadTail::new(10);
        for i in 0..1000u32 {
            c.push(format!("{i:04}").as_bytes());
        }
        let got = c.finish();
        assert_eq!(&got.head[..], b"00000");
        assert_eq!(&got.tail[..], b"80999");
        assert_eq!(got.total_bytes, 4000);
        assert!(got.truncated);
        assert!(got.to_lossy_string().contains("3990 bytes omitted"));
    }

    #[test]
    fn one_huge_chunk() {
        let mut c = HeadTail::new(4);
        c.push(b"abcdefghij");
        let got = c.finish();
        assert_eq!((&got.head[..], &got.tail[..]), (&b"ab"[..], &b"ij"[..]));
    }
}
