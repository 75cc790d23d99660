//! Server-sent events: an incremental parser for `text/event-stream`.

/// One event: its `event:` name (if any) and its `data:` lines joined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseEvent {
    pub event: Option<String>,
    pub data: String,
}

/// Feed bytes as they arrive; take complete events out.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    event: Option<String>,
    data: Vec<String>,
    max_event_bytes: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("server-sent event larger than {0} bytes")]
pub struct SseTooLarge(pub usize);

impl SseParser {
    pub fn new(max_event_bytes: usize) -> Self {
        Self {
            max_event_bytes,
            ..Self::default()
        }
    }

    /// Adds bytes and returns the events they completed.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Vec<SseEvent>, SseTooLarge> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(nl) = self.buf[start..].iter().position(|b| *b == b'\n') {
            let mut line = &self.buf[start..start + nl];
            start += nl + 1;
            if line.last() == Some(&b'\r') {
                line = &line[..line.len() - 1];
            }
            let line = String::from_utf8_lossy(line).into_owned();
            if let Some(ev) = self.line(&line) {
                out.push(ev);
            }
        }
        self.buf.drain(..start);
        let pending: usize = self.buf.len() + self.data.iter().map(String::len).sum::<usize>();
        if pending > self.max_event_bytes {
            return Err(SseTooLarge(self.max_event_bytes));
        }
        Ok(out)
    }

    /// The event still buffered when the stream ends without a blank line.
    pub fn finish(&mut self) -> Option<SseEvent> {
        if !self.buf.is_empty() {
            let line = String::from_utf8_lossy(&std::mem::take(&mut self.buf)).into_owned();
            if let Some(ev) = self.line(line.trim_end_matches('\r')) {
                return Some(ev);
            }
        }
        self.dispatch()
    }

    fn line(&mut self, line: &str) -> Option<SseEvent> {
        if line.is_empty() {
            return self.dispatch();
        }
        if line.starts_with(':') {
            return None;
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "data" => self.data.push(value.to_string()),
            "event" => self.event = Some(value.to_string()),
            _ => {}
        }
        None
    }

    fn dispatch(&mut self) -> Option<SseEvent> {
        if self.data.is_empty() {
            self.event = None;
            return None;
        }
        Some(SseEvent {
            event: self.event.take(),
            data: std::mem::take(&mut self.data).join("\n"),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_events_split_anywhere() {
        let wire = b"event: a\ndata: {\"x\":1}\n\n: comment\r\ndata: line1\r\ndata: line2\r\n\r\ndata: [DONE]\n\n";
        for split in 0..wire.len() {
            let mut p = SseParser::new(1 << 20);
            let mut got = p.push(&wire[..split]).unwrap();
            got.extend(p.push(&wire[split..]).unwrap());
            assert_eq!(
                got,
                vec![
                    SseEvent {
                        event: Some("a".into()),
                        data: "{\"x\":1}".into()
                    },
                    SseEvent {
                        event: None,
                        data: "line1\nline2".into()
                    },
                    SseEvent {
                        event: None,
                        data: "[DONE]".into()
                    },
                ],
                "split at {split}"
            );
        }
    }

    #[test]
    fn an_unterminated_last_event_is_kept_and_huge_events_refused() {
        let mut p = SseParser::new(1 << 20);
        assert!(p.push(b"data: tail").unwrap().is_empty());
        assert_eq!(p.finish().map(|e| e.data), Some("tail".into()));
        let mut p = SseParser::new(8);
        assert_eq!(p.push(b"data: 0123456789"), Err(SseTooLarge(8)));
    }
}
