//! ReadFile and WriteFile: file access in the sandbox without a shell,
//! confined to the workspace and /tmp.

use bytes::Bytes;
use corral_proto::limits::MAX_FILE_BYTES;
use corral_proto::{OperationSpec, Outcome, ReadFileSpec, WriteFileSpec};
use serde::Deserialize;

use super::{CallStatus, Translator, parse_args, text};
use crate::llm::{Tool, ToolOutput};
use crate::ops::{OpStatus, OpView};

/// Default bytes a ReadFile returns.
pub const DEFAULT_READ_LIMIT: u64 = 256 * 1024;

/// The call's one operation (checked as the worker checks it by the
/// registry, once: see [`super::Registry::translate`]).
fn check(spec: OperationSpec) -> CallStatus {
    CallStatus::Submit(vec![spec])
}

/// What an unfinished or failed file operation says.
pub(crate) fn not_done(op: &OpView<'_>) -> Option<Vec<ToolOutput>> {
    match op.status {
        OpStatus::Ready | OpStatus::Awaiting | OpStatus::Canceling => Some(text("Still running.")),
        OpStatus::Failed => Some(text(format!(
            "Error: {}",
            op.failure.unwrap_or("the operation failed")
        ))),
        OpStatus::Canceled => Some(text("Canceled.")),
        OpStatus::Completed => match op.result.as_ref().map(|r| &r.outcome) {
            Some(Outcome::FileError { message, .. }) => Some(text(format!("Error: {message}"))),
            Some(_) => None,
            None => Some(text("Error: no result")),
        },
    }
}

pub struct ReadFile;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReadArgs {
    path: String,
    #[serde(default)]
    offset: Option<u64>,
    #[serde(default)]
    limit: Option<u64>,
}

impl Translator for ReadFile {
    fn tool(&self) -> Tool {
        Tool {
            name: "ReadFile".into(),
            description:
                "Read a text file in the sandbox (a path relative to the workspace, or absolute \
under the workspace or /tmp). Long files are read in pieces: pass offset to continue."
                    .into(),
            parameters: serde_json::json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "offset": {"type": "integer", "minimum": 0, "description": "Byte to start at (default 0)."},
                    "limit": {"type": "integer", "minimum": 1, "maximum": MAX_FILE_BYTES,
                              "description": format!("Bytes to read (default {DEFAULT_READ_LIMIT}).")}
                },
                "required": ["path"],
                "additionalProperties": false
            }),
        }
    }

    fn translate(&self, arguments: &str) -> CallStatus {
        let args: ReadArgs = match parse_args("ReadFile", arguments) {
            Ok(a) => a,
            Err(e) => return CallStatus::Error(e),
        };
        if args.limit == Some(0) {
            return CallStatus::Error("Error: limit must be at least 1".into());
        }
        check(OperationSpec::ReadFile(ReadFileSpec {
            offset: args.offset.unwrap_or(0),
            limit: args.limit.unwrap_or(DEFAULT_READ_LIMIT),
            ..ReadFileSpec::new(args.path)
        }))
    }

    fn render(&self, ops: &[OpView<'_>]) -> Vec<ToolOutput> {
        let Some(op) = ops.first() else {
            return text("Error: not started");
        };
        if let Some(t) = not_done(op) {
            return t;
        }
        let (Some(r), OperationSpec::ReadFile(spec)) = (op.result, op.spec) else {
            return text("Error: no result");
        };
        let data: &Bytes = &r.file_data;
        if data.contains(&0) {
            return text(format!("Binary file ({} bytes); not shown.", r.file_size));
        }
        let mut body = String::from_utf8_lossy(data).into_owned();
        let end = spec.offset + data.len() as u64;
        if spec.offset > 0 || end < r.file_size {
            body.push_str(&format!(
                "\n[bytes {}..{} of {}{}]",
                spec.offset,
                end,
                r.file_size,
                if end < r.file_size {
                    format!("; read on with offset {end}")
                } else {
                    String::new()
                }
            ));
        }
        text(body)
    }
}

pub struct WriteFile;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct WriteArgs {
    path: String,
    content: String,
    #[serde(default)]
    mode: Option<String>,
}

impl Translator for WriteFile {
    fn tool(&self) -> Tool {
        Tool {
            name: "WriteFile".into(),
            description:
                "Write a text file in the sandbox, replacing it whole (parent directories are \
created). The path is relative to the workspace, or absolute under the workspace or /tmp."
                    .into(),
            parameters: serde_json::json!({
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "content": {"type": "string"},
                    "mode": {"type": "string", "description": "Octal permissions, e.g. \"755\" (default \"644\")."}
                },
                "required": ["path", "content"],
                "additionalProperties": false
            }),
        }
    }

    fn translate(&self, arguments: &str) -> CallStatus {
        let args: WriteArgs = match parse_args("WriteFile", arguments) {
            Ok(a) => a,
            Err(e) => return CallStatus::Error(e),
        };
        let mode = match args.mode.as_deref() {
            None => 0o644,
            Some(m) => match u32::from_str_radix(m.trim_start_matches("0o"), 8) {
                Ok(v) if v <= 0o7777 => v,
                _ => {
                    return CallStatus::Error(format!(
                        "Error: mode {m:?} is not an octal permission like \"644\""
                    ));
                }
            },
        };
        check(OperationSpec::WriteFile(WriteFileSpec {
            mode,
            ..WriteFileSpec::new(args.path, Bytes::from(args.content))
        }))
    }

    fn render(&self, ops: &[OpView<'_>]) -> Vec<ToolOutput> {
        let Some(op) = ops.first() else {
            return text("Error: not started");
        };
        if let Some(t) = not_done(op) {
            return t;
        }
        match (op.result, op.spec) {
            (Some(r), OperationSpec::WriteFile(spec)) => {
                text(format!("Wrote {} bytes to {}.", r.bytes_written, spec.path))
            }
            _ => text("Error: no result"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::Operation;
    use corral_proto::{FileErrorKind, OperationId, OperationResult};

    fn read_result(spec: &str, data: &'static [u8], size: u64) -> Vec<ToolOutput> {
        let CallStatus::Submit(specs) = ReadFile.translate(spec) else {
            panic!()
        };
        let mut op = Operation::new(OperationId::random(), specs[0].clone());
        let mut r = OperationResult::with_outcome(Outcome::Exited { code: 0 });
        r.file_data = Bytes::from_static(data);
        r.file_size = size;
        op.finish(r);
        ReadFile.render(&[op.view()])
    }

    #[test]
    fn reads_whole_files_and_pieces() {
        assert_eq!(
            read_result(r#"{"path":"a.txt"}"#, b"hello\n", 6),
            text("hello\n")
        );
        assert_eq!(
            read_result(r#"{"path":"a.txt","limit":5}"#, b"hello", 11),
            text("hello\n[bytes 0..5 of 11; read on with offset 5]")
        );
        assert_eq!(
            read_result(r#"{"path":"b"}"#, b"\x7fELF\0\0", 6),
            text("Binary file (6 bytes); not shown.")
        );
        assert!(matches!(
            ReadFile.translate(r#"{"path":"x","limit":0}"#),
            CallStatus::Error(_)
        ));
        assert!(matches!(
            super::super::Registry::standard().translate("ReadFile", r#"{"path":""}"#),
            CallStatus::Error(_)
        ));
    }

    #[test]
    fn writes_with_a_mode_and_reports_errors() {
        let CallStatus::Submit(specs) =
            WriteFile.translate(r#"{"path":"run.sh","content":"echo hi\n","mode":"755"}"#)
        else {
            panic!()
        };
        let OperationSpec::WriteFile(w) = &specs[0] else {
            panic!()
        };
        assert_eq!((w.mode, &w.data[..]), (0o755, &b"echo hi\n"[..]));
        assert!(matches!(
            WriteFile.translate(r#"{"path":"x","content":"","mode":"9"}"#),
            CallStatus::Error(_)
        ));
        let mut op = Operation::new(OperationId::random(), specs[0].clone());
        op.finish(OperationResult::with_outcome(Outcome::FileError {
            kind: FileErrorKind::OutsideSandboxRoots,
            message: "/etc/x: outside the workspace and /tmp".into(),
        }));
        assert_eq!(
            WriteFile.render(&[op.view()]),
            text("Error: /etc/x: outside the workspace and /tmp")
        );
    }
}
