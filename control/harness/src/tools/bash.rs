//! The Bash tool: one shell command, with an optional timeout and output
//! limit.

use corral_proto::{OperationSpec, Outcome, ShellSpec};
use serde::Deserialize;

use super::{CallStatus, Translator, parse_args, text};
use crate::llm::{Tool, ToolOutput};
use crate::ops::{OpStatus, OpView};

/// Default and largest `max_output_length`, in bytes kept per stream.
pub const DEFAULT_MAX_OUTPUT: u64 = 40_000;
pub const MAX_OUTPUT: u64 = 1_000_000;
/// Default and largest `timeout_seconds`.
pub const DEFAULT_TIMEOUT_SECS: u64 = 600;
pub const MAX_TIMEOUT_SECS: u64 = 24 * 3600;

/// Output is bounded once, here: the supervisor keeps the head and the
/// tail of each stream, up to `max_output_length` bytes in all, and counts
/// what it left out; the result says exactly how many bytes that was.
pub struct Bash {
    /// `max_output_length` when the model gives none.
    pub default_max_output: u64,
    /// The sandbox's egress rules: named in the description, so the model
    /// knows what it can reach (nothing is said when there are none, as
    /// sessions recorded before egress existed were told nothing).
    pub egress: Vec<String>,
}

impl Default for Bash {
    fn default() -> Self {
        Self {
            default_max_output: DEFAULT_MAX_OUTPUT,
            egress: Vec::new(),
        }
    }
}

impl Bash {
    /// A Bash tool whose default output bound is `bytes` per stream.
    pub fn with_default_output(bytes: u64) -> Self {
        Self {
            default_max_output: bytes.clamp(1, MAX_OUTPUT),
            egress: Vec::new(),
        }
    }

    fn description(&self) -> String {
        let mut d = String::from(
            "Run a bash command in the sandbox's workspace, non-interactively (stdin is closed). \
Returns stdout, then stderr, then the exit code if it is not 0. Long output keeps its head and tail. \
The command's child processes are killed when it exits, so `cmd &` does not outlive the call: \
to keep a server running, run it in the foreground as a call of its own (calls run concurrently, \
and you are told what is still running). The command is killed, with everything it started, after timeout_seconds.",
        );
        if !self.egress.is_empty() {
            d.push_str(&format!(
                " Network: only through the HTTP proxy named in HTTP_PROXY and HTTPS_PROXY (pip, git, curl and most tools use it), \
to these destinations only (no port: 80 and 443): {}. Anything else is refused with 403 and an X-Corral-Egress header saying why; \
there is no DNS in the sandbox, so a tool that ignores the proxy reaches nothing.",
                self.egress.join(", ")
            ));
        }
        d
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    command: String,
    #[serde(default)]
    timeout_seconds: Option<u64>,
    #[serde(default)]
    max_output_length: Option<u64>,
}

impl Translator for Bash {
    fn tool(&self) -> Tool {
        Tool {
            name: "Bash".into(),
            description: self.description(),
            parameters: serde_json::json!({
                "type": "object",
                "properties": {
                    "command": {"type": "string", "minLength": 1, "description": "The command, run with bash -c."},
                    "timeout_seconds": {
                        "type": "integer", "minimum": 1, "maximum": MAX_TIMEOUT_SECS,
                        "description": format!("Kill the command after this long (default {DEFAULT_TIMEOUT_SECS}).")
                    },
                    "max_output_length": {
                        "type": "integer", "minimum": 1, "maximum": MAX_OUTPUT,
                        "description": format!("Bytes of stdout and of stderr to return (default {}): of longer output the head and the tail are kept, with the number of bytes left out between them.", self.default_max_output)
                    }
                },
                "required": ["command"],
                "additionalProperties": false
            }),
        }
    }

    fn translate(&self, arguments: &str) -> CallStatus {
        let args: Args = match parse_args("Bash", arguments) {
            Ok(a) => a,
            Err(e) => return CallStatus::Error(e),
        };
        if let Some(t) = args.timeout_seconds
            && !(1..=MAX_TIMEOUT_SECS).contains(&t)
        {
            return CallStatus::Error(format!(
                "Error: timeout_seconds must be 1 to {MAX_TIMEOUT_SECS}"
            ));
        }
        if let Some(m) = args.max_output_length
            && !(1..=MAX_OUTPUT).contains(&m)
        {
            return CallStatus::Error(format!(
                "Error: max_output_length must be 1 to {MAX_OUTPUT}"
            ));
        }
        let mut spec = ShellSpec::new(args.command);
        spec.use_bash = true;
        spec.timeout_ms = Some(args.timeout_seconds.unwrap_or(DEFAULT_TIMEOUT_SECS) * 1000);
        spec.output_limit_bytes = Some(
            args.max_output_length
                .unwrap_or(self.default_max_output)
                .min(corral_proto::limits::MAX_OUTPUT_LIMIT_BYTES),
        );
        // Checked as the worker checks it by the registry, once.
        CallStatus::Submit(vec![OperationSpec::Shell(spec)])
    }

    fn render(&self, ops: &[OpView<'_>]) -> Vec<ToolOutput> {
        let Some(op) = ops.first() else {
            return text("Error: the command was not started");
        };
        match op.status {
            OpStatus::Ready | OpStatus::Awaiting | OpStatus::Canceling => {
                text("Command is still running.")
            }
            OpStatus::Failed => text(format!(
                "Error: {}",
                op.failure.unwrap_or("the command failed")
            )),
            OpStatus::Canceled | OpStatus::Completed => {
                let Some(r) = op.result else {
                    return text("Error: the command was canceled before it started");
                };
                let mut parts = Vec::new();
                let out = r.stdout.to_lossy_string();
                let err = r.stderr.to_lossy_string();
                if !out.is_empty() {
                    parts.push(out.trim_end_matches('\n').to_string());
                }
                if !err.is_empty() {
                    parts.push(format!("Stderr:\n{}", err.trim_end_matches('\n')));
                }
                match &r.outcome {
                    Outcome::Exited { code: 0 } => {}
                    Outcome::Exited { code } => parts.push(format!("Exit code: {code}")),
                    Outcome::Signaled { signal } => {
                        parts.push(format!("Killed by signal {signal} (exit code {})", 128 + signal))
                    }
                    Outcome::TimedOut => parts.push(format!(
                        "Timed out after {:.0} s: the command and everything it started were killed.",
                        r.duration_ms as f64 / 1000.0
                    )),
                    Outcome::OutOfMemory => {
                        parts.push("Killed: the sandbox ran out of memory.".into())
                    }
                    Outcome::Canceled => parts.push("Canceled.".into()),
                    other => parts.push(format!("Error: {other}")),
                }
                if parts.is_empty() {
                    parts.push("(no output)".into());
                }
                text(parts.join("\n"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::Operation;
    use bytes::Bytes;
    use corral_proto::{Captured, OperationId, OperationResult};

    fn finished(stdout: &str, stderr: &str, outcome: Outcome) -> Operation {
        let mut op = Operation::new(
            OperationId::random(),
            OperationSpec::Shell(ShellSpec::new("x")),
        );
        let cap = |s: &str| Captured {
            head: Bytes::from(s.to_string()),
            tail: Bytes::new(),
            total_bytes: s.len() as u64,
            truncated: false,
        };
        op.finish(OperationResult {
            stdout: cap(stdout),
            stderr: cap(stderr),
            duration_ms: 30_000,
            ..OperationResult::with_outcome(outcome)
        });
        op
    }

    fn rendered(op: &Operation) -> String {
        match &Bash::default().render(&[op.view()])[0] {
            ToolOutput::Text { text } => text.to_string(),
            ToolOutput::Image { .. } => panic!("image"),
        }
    }

    #[test]
    fn translates_with_defaults_and_limits() {
        let CallStatus::Submit(specs) = Bash::default()
            .translate(r#"{"command":"ls -la","timeout_seconds":5,"max_output_length":100}"#)
        else {
            panic!()
        };
        let OperationSpec::Shell(s) = &specs[0] else {
            panic!()
        };
        assert_eq!(
            (
                s.command.as_str(),
                s.timeout_ms,
                s.output_limit_bytes,
                s.use_bash
            ),
            ("ls -la", Some(5000), Some(100), true)
        );
        let CallStatus::Submit(specs) = Bash::default().translate(r#"{"command":"true"}"#) else {
            panic!()
        };
        let OperationSpec::Shell(s) = &specs[0] else {
            panic!()
        };
        assert_eq!(s.timeout_ms, Some(600_000));
        assert!(matches!(
            Bash::default().translate(r#"{"command":"x","timeout_seconds":0}"#),
            CallStatus::Error(_)
        ));
        // Checked as the worker checks it, once, by the registry.
        let registry = super::super::Registry::standard();
        assert!(
            matches!(registry.translate("Bash", r#"{"command":""}"#), CallStatus::Error(e) if e == "Error: invalid arguments for Bash: invalid `command`: empty command")
        );
        assert!(
            matches!(registry.translate("Bash", r#"{"command":"a\u0000b"}"#), CallStatus::Error(e) if e.contains("NUL"))
        );
        assert!(matches!(
            Bash::default().translate(r#"{"command":"x","timeout_seconds":"5"}"#),
            CallStatus::Error(_)
        ));
    }

    #[test]
    fn renders_like_a_terminal_would_say_it() {
        assert_eq!(
            rendered(&finished("hi\n", "", Outcome::Exited { code: 0 })),
            "hi"
        );
        assert_eq!(
            rendered(&finished("", "", Outcome::Exited { code: 0 })),
            "(no output)"
        );
        assert_eq!(
            rendered(&finished("out\n", "warn\n", Outcome::Exited { code: 2 })),
            "out\nStderr:\nwarn\nExit code: 2"
        );
        assert_eq!(
            rendered(&finished("partial\n", "", Outcome::TimedOut)),
            "partial\nTimed out after 30 s: the command and everything it started were killed."
        );
        assert_eq!(
            rendered(&finished("", "", Outcome::OutOfMemory)),
            "Killed: the sandbox ran out of memory."
        );
        let running = Operation::new(
            OperationId::random(),
            OperationSpec::Shell(ShellSpec::new("x")),
        );
        assert_eq!(rendered(&running), "Command is still running.");
        let mut lost = running;
        lost.finish(OperationResult::with_outcome(Outcome::SandboxLost {
            reason: "container removed".into(),
        }));
        assert_eq!(rendered(&lost), "Error: sandbox lost: container removed");
    }
}
