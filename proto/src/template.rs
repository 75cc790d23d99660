//! Templates: an image a worker built, kept under a name with what a
//! sandbox made from it starts with (a command, left running) and when it
//! is ready (a port that accepts, a command that succeeds, an HTTP path
//! that answers).

use std::time::Duration;

use crate::{ProtocolError, pb};

/// The longest a readiness probe is tried, and what one that names no time
/// is given.
pub const MAX_READY_TIMEOUT: Duration = Duration::from_secs(30 * 60);
pub const DEFAULT_READY_TIMEOUT: Duration = Duration::from_secs(60);
/// The operation id of a template's start command in its sandbox.
pub const START_OPERATION: &str = "template-start";
/// The longest start or readiness command a template keeps.
pub const MAX_TEMPLATE_COMMAND_BYTES: usize = 16 << 10;
/// Most templates one tenant (or the operator) keeps on a worker, unless
/// its operator says otherwise (`--max-templates`).
pub const MAX_TEMPLATES: usize = 100;

/// A template's name: 1-64 characters of `[a-z0-9._-]`, first a letter or
/// a digit.
pub fn check_name(name: &str) -> Result<(), ProtocolError> {
    check_kept_name("template", name)
}

/// The name of something a worker keeps by name (a template, a volume):
/// 1-64 characters of `[a-z0-9._-]`, first a letter or a digit (so never
/// `..`, never a `/`).
pub(crate) fn check_kept_name(what: &'static str, name: &str) -> Result<(), ProtocolError> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.as_bytes()[0].is_ascii_alphanumeric()
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ProtocolError::invalid(
            what,
            format!(
                "{:?}: a {what}'s name is 1-64 characters of a-z, 0-9, '.', '_', '-', first a letter or a digit",
                name.chars().take(80).collect::<String>()
            ),
        ))
    }
}

/// When a sandbox of a template is ready.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(rename_all = "snake_case"))]
pub enum Ready {
    /// Something accepts connections on this port of its loopback.
    Port(u16),
    /// This command (`sh -c`) exits 0.
    Command(String),
    /// `GET http://127.0.0.1:{port}{path}` answers 2xx or 3xx.
    Http { port: u16, path: String },
}

/// What a sandbox of a template starts with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct TemplateStart {
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Option::is_none")
    )]
    pub command: Option<String>,
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Option::is_none")
    )]
    pub ready: Option<Ready>,
    /// How long the probe is tried (`None`: [`DEFAULT_READY_TIMEOUT`]).
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Option::is_none")
    )]
    pub timeout_ms: Option<u64>,
}

impl TemplateStart {
    pub fn is_empty(&self) -> bool {
        self.command.is_none() && self.ready.is_none()
    }

    pub fn timeout(&self) -> Duration {
        self.timeout_ms
            .map_or(DEFAULT_READY_TIMEOUT, Duration::from_millis)
            .min(MAX_READY_TIMEOUT)
    }
}

/// An HTTP probe as `PORT/PATH` (the path's slash is the separator: `8000/`
/// and `8000/health` are both fine, `8000` means `8000/`).
pub fn parse_http(s: &str) -> Result<(u16, String), ProtocolError> {
    let (port, path) = match s.split_once('/') {
        Some((p, rest)) => (p, format!("/{rest}")),
        None => (s, "/".to_string()),
    };
    let port = port
        .parse::<u16>()
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| ProtocolError::invalid("ready.http", format!("{s:?}: PORT/PATH")))?;
    if path.len() > 1024 || path.bytes().any(|b| b.is_ascii_control() || b == b' ') {
        return Err(ProtocolError::invalid(
            "ready.http",
            "a path of at most 1 KiB, no spaces",
        ));
    }
    Ok((port, path))
}

fn command(field: &'static str, c: String) -> Result<String, ProtocolError> {
    if c.trim().is_empty() || c.len() > MAX_TEMPLATE_COMMAND_BYTES || c.contains('\0') {
        return Err(ProtocolError::invalid(
            field,
            format!("a command of 1 to {MAX_TEMPLATE_COMMAND_BYTES} bytes, no NUL"),
        ));
    }
    Ok(c)
}

impl TryFrom<pb::TemplateStart> for TemplateStart {
    type Error = ProtocolError;
    fn try_from(p: pb::TemplateStart) -> Result<Self, ProtocolError> {
        use pb::template_start::Ready as R;
        let ready = match p.ready {
            None => None,
            Some(R::Port(n)) => Some(Ready::Port(
                u16::try_from(n)
                    .ok()
                    .filter(|p| *p > 0)
                    .ok_or_else(|| ProtocolError::invalid("ready.port", "1 to 65535"))?,
            )),
            Some(R::ReadyCommand(c)) => Some(Ready::Command(command("ready.command", c)?)),
            Some(R::Http(h)) => {
                let (port, path) = parse_http(&h)?;
                Some(Ready::Http { port, path })
            }
        };
        let timeout_ms = (p.timeout_ms > 0).then_some(p.timeout_ms);
        if timeout_ms.is_some_and(|t| Duration::from_millis(t) > MAX_READY_TIMEOUT) {
            return Err(ProtocolError::invalid(
                "start.timeout_ms",
                format!("at most {} minutes", MAX_READY_TIMEOUT.as_secs() / 60),
            ));
        }
        Ok(Self {
            command: if p.command.is_empty() {
                None
            } else {
                Some(command("start.command", p.command)?)
            },
            ready,
            timeout_ms,
        })
    }
}

impl From<TemplateStart> for pb::TemplateStart {
    fn from(s: TemplateStart) -> Self {
        use pb::template_start::Ready as R;
        Self {
            command: s.command.unwrap_or_default(),
            ready: s.ready.map(|r| match r {
                Ready::Port(p) => R::Port(u32::from(p)),
                Ready::Command(c) => R::ReadyCommand(c),
                Ready::Http { port, path } => R::Http(format!("{port}{path}")),
            }),
            timeout_ms: s.timeout_ms.unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_probes_are_checked() {
        for ok in ["web", "a", "swe-bench.django_1", "0x"] {
            assert!(check_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "Web", "-x", ".x", "a/b", "a b", &"x".repeat(65), "é"] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_http("8000").unwrap(), (8000, "/".into()));
        assert_eq!(
            parse_http("8000/health?x=1").unwrap(),
            (8000, "/health?x=1".into())
        );
        for bad in ["", "0/", "x/", "70000/", "80/a b"] {
            assert!(parse_http(bad).is_err(), "{bad}");
        }
        let back: TemplateStart = pb::TemplateStart::from(TemplateStart {
            command: Some("serve".into()),
            ready: Some(Ready::Http {
                port: 80,
                path: "/h".into(),
            }),
            timeout_ms: Some(5000),
        })
        .try_into()
        .unwrap();
        assert_eq!(
            back.ready,
            Some(Ready::Http {
                port: 80,
                path: "/h".into()
            })
        );
        let none = pb::TemplateStart {
            timeout_ms: 31 * 60 * 1000,
            ..Default::default()
        };
        assert!(TemplateStart::try_from(none).is_err());
    }
}
