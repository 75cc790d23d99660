//! Client-chosen identifiers: 1-64 characters of `[A-Za-z0-9_.-]`, not
//! starting with `.` or `-`, so they are safe in container names, labels,
//! file names and log lines.

use std::fmt;

use crate::ProtocolError;

fn validate(field: &'static str, s: &str) -> Result<(), ProtocolError> {
    if s.is_empty() {
        return Err(ProtocolError::Missing(field));
    }
    if s.len() > 64 {
        return Err(ProtocolError::invalid(field, "longer than 64 characters"));
    }
    if s.starts_with(['.', '-']) {
        return Err(ProtocolError::invalid(
            field,
            "must not start with '.' or '-'",
        ));
    }
    if let Some(c) = s
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')))
    {
        return Err(ProtocolError::invalid(
            field,
            format!("character {c:?} is not allowed (use A-Z a-z 0-9 _ . -)"),
        ));
    }
    Ok(())
}

macro_rules! id_type {
    ($name:ident, $field:literal) => {
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        #[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
        #[cfg_attr(feature = "serde", serde(try_from = "String", into = "String"))]
        pub struct $name(String);

        impl $name {
            pub fn new(s: impl Into<String>) -> Result<Self, ProtocolError> {
                let s = s.into();
                validate($field, &s)?;
                Ok(Self(s))
            }

            /// A fresh random id (a UUID v4 without braces).
            pub fn random() -> Self {
                Self(random_uuid())
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl std::str::FromStr for $name {
            type Err = ProtocolError;
            fn from_str(s: &str) -> Result<Self, Self::Err> {
                Self::new(s)
            }
        }

        impl TryFrom<String> for $name {
            type Error = ProtocolError;
            fn try_from(s: String) -> Result<Self, Self::Error> {
                Self::new(s)
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }
    };
}

id_type!(SandboxId, "sandbox_id");
id_type!(OperationId, "operation_id");

/// A random version-4 UUID, read from the kernel's random source. Kept here
/// so the supervisor does not need a UUID crate.
pub fn random_uuid() -> String {
    let mut b = [0u8; 16];
    let filled = std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b));
    if filled.is_err() {
        // No /dev/urandom (a very bare image): fall back to time and pid,
        // unique enough for ids that are also scoped by worker and sandbox.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or_default();
        b[..16].copy_from_slice(&(nanos ^ (u128::from(std::process::id()) << 64)).to_le_bytes());
    }
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_uuids_and_simple_names() {
        assert!(SandboxId::new(random_uuid()).is_ok());
        assert!(OperationId::new("build_1.a-b").is_ok());
    }

    #[test]
    fn rejects_bad_ids_with_the_reason() {
        assert_eq!(
            SandboxId::new(""),
            Err(ProtocolError::Missing("sandbox_id"))
        );
        let e = SandboxId::new("a/b").unwrap_err().to_string();
        assert!(e.contains("'/'"), "{e}");
        assert!(SandboxId::new("a\0b").is_err());
        assert!(SandboxId::new("-x").is_err());
        assert!(SandboxId::new("x".repeat(65)).is_err());
    }
}
