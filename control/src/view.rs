//! What `corral run` shows: a live view on a terminal (text as it comes,
//! one line per tool call and result, on stderr), or versioned JSON events
//! on stdout, one per line.

use std::io::Write;
use std::time::Instant;

use corral_harness::agent::events::{CallEnd, Event, to_json_line};

/// What the watcher prints.
pub enum View {
    Json(std::io::Stdout),
    Terminal(TerminalView),
    /// Stdout was closed under a JSON view (`corral run | head -1`):
    /// nothing more is shown, and the run stops as on SIGTERM.
    Closed,
}

pub struct TerminalView {
    running: Vec<(String, String, Instant)>,
    mid_line: bool,
    /// A running call's newest line is on stderr, to be replaced.
    progress_line: bool,
    /// That line's tool and text, shown again with the running notice.
    last_progress: Option<(String, String)>,
}

pub use corral_proto::text::printable;

/// Bytes for a terminal, written through [`printable`] a line at a time
/// (a sandbox's patch shown on one: `session export --diff -`). A line
/// longer than [`PrintableWriter::LINE`] goes out in pieces, cut where a
/// character ends.
pub struct PrintableWriter<O: Write> {
    out: O,
    held: Vec<u8>,
}

impl<O: Write> PrintableWriter<O> {
    pub const LINE: usize = 64 * 1024;

    pub fn new(out: O) -> Self {
        Self {
            out,
            held: Vec::new(),
        }
    }

    /// Writes the held bytes up to `upto`, escaped.
    fn emit(&mut self, upto: usize) -> std::io::Result<()> {
        let piece: Vec<u8> = self.held.drain(..upto).collect();
        self.out
            .write_all(printable(&String::from_utf8_lossy(&piece)).as_bytes())
    }

    /// Every whole line held, and a long line's whole characters.
    fn emit_ready(&mut self) -> std::io::Result<()> {
        if let Some(last) = self.held.iter().rposition(|&b| b == b'\n') {
            self.emit(last + 1)?;
        }
        if self.held.len() >= Self::LINE {
            let upto = match std::str::from_utf8(&self.held) {
                Ok(_) => self.held.len(),
                // A character cut at the end waits for its rest; bytes
                // that are no UTF-8 at all go out as replacements.
                Err(e) if e.error_len().is_none() => e.valid_up_to().max(1),
                Err(_) => self.held.len(),
            };
            self.emit(upto)?;
        }
        Ok(())
    }

    /// Everything held, at the end.
    pub fn finish(&mut self) -> std::io::Result<()> {
        self.emit(self.held.len())?;
        self.out.flush()
    }
}

impl<O: Write + Unpin> tokio::io::AsyncWrite for PrintableWriter<O> {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        let me = self.get_mut();
        me.held.extend_from_slice(buf);
        std::task::Poll::Ready(me.emit_ready().map(|()| buf.len()))
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(self.get_mut().out.flush())
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::task::Poll::Ready(self.get_mut().finish())
    }
}

impl<O: Write> Drop for PrintableWriter<O> {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// The progress line of a running call (its newest output line), with the
/// running notice when one is due.
fn progress_text(tool: &str, line: &str, running: Option<&str>) -> String {
    let mut text = format!("  ⋯ {}: {}", printable(tool), one_line(line, 120));
    if let Some(r) = running {
        text.push_str(&format!("  (running: {r})"));
    }
    text
}

pub fn one_line(s: &str, max: usize) -> String {
    let line = s.lines().next().unwrap_or("");
    let mut out: String = printable(line).chars().take(max).collect();
    if line.chars().count() > max || s.lines().nth(1).is_some() {
        out.push('…');
    }
    out
}

/// A call's result as the terminal shows it: marked by how it ended
/// (✓ ok, ✗ failed, lost or refused, ⊘ canceled), with its exit code when
/// it failed and how long it took.
/// A run's tokens as the summary line says them. Every request has input
/// tokens: none at all means the endpoint did not say, not a free run.
fn usage_text(u: &corral_harness::llm::Usage) -> String {
    if u.input_tokens == 0 && u.output_tokens == 0 {
        "usage not reported by the endpoint".into()
    } else {
        format!("{} tokens in, {} out", u.input_tokens, u.output_tokens)
    }
}

fn result_line(
    tool: &str,
    status: CallEnd,
    exit_code: Option<i32>,
    took: Option<std::time::Duration>,
    text: &str,
) -> String {
    let mut how = Vec::new();
    match (status, exit_code) {
        (CallEnd::Ok, _) | (CallEnd::Failed, None) => {}
        (CallEnd::Failed, Some(code)) => how.push(format!("exit {code}")),
        (other, _) => how.push(other.as_str().to_string()),
    }
    if let Some(d) = took {
        how.push(format!("{:.1}s", d.as_secs_f64()));
    }
    let how = if how.is_empty() {
        String::new()
    } else {
        format!(" ({})", how.join(", "))
    };
    let mark = match status {
        CallEnd::Ok => "✓",
        CallEnd::Canceled => "⊘",
        _ => "✗",
    };
    format!("{mark} {}{how}: {}", printable(tool), one_line(text, 160))
}

impl TerminalView {
    fn show(&mut self, e: &Event) -> std::io::Result<()> {
        let mut out = std::io::stdout().lock();
        let mut err = std::io::stderr().lock();
        if let Event::ToolProgress { tool, line, .. } = e {
            // One line, replaced as the command goes on.
            write!(err, "\r\x1b[K{}", progress_text(tool, line, None))?;
            err.flush()?;
            self.progress_line = true;
            self.last_progress = Some((tool.clone(), line.clone()));
            return Ok(());
        }
        if self.progress_line {
            write!(err, "\r\x1b[K")?;
            self.progress_line = false;
            self.last_progress = None;
        }
        if let Event::TextDelta { text, .. } = e {
            out.write_all(printable(text).as_bytes())?;
            out.flush()?;
            self.mid_line = !text.ends_with('\n');
            return Ok(());
        }
        if self.mid_line {
            writeln!(out)?;
            self.mid_line = false;
        }
        match e {
            Event::SessionStarted {
                session_id,
                resumed,
                sandbox_id,
                model,
                worker,
            } => writeln!(
                err,
                "corral: session {session_id}{} · sandbox {sandbox_id} on {} · model {}",
                if *resumed { " (resumed)" } else { "" },
                printable(worker.as_deref().unwrap_or("the embedded worker")),
                printable(model)
            )?,
            Event::SandboxReplaced {
                sandbox_id,
                worker,
                reason,
                ..
            } => writeln!(
                err,
                "corral: {} · the run goes on in sandbox {sandbox_id} on {}",
                printable(reason),
                printable(worker.as_deref().unwrap_or("the embedded worker"))
            )?,
            Event::TurnStarted { turn, changes, .. } => {
                write!(err, "── turn {turn}")?;
                if !changes.is_empty() {
                    write!(
                        err,
                        " ({} context changes to fit the budget)",
                        changes.len()
                    )?;
                }
                writeln!(err)?;
            }
            Event::ModelRetry {
                attempt, reason, ..
            } => writeln!(
                err,
                "   retrying (attempt {attempt}): {}",
                printable(reason)
            )?,
            Event::Steered { turn } => writeln!(err, "   turn {turn} canceled by a new input")?,
            Event::ToolCall {
                call_id,
                tool,
                arguments,
                error,
                replayed,
            } => match error {
                // The tool's name is the model's: an unknown one is shown
                // as it came, escaped.
                Some(e) => writeln!(err, "✗ {}: {}", printable(tool), one_line(e, 160))?,
                None => {
                    let again = if *replayed {
                        " (from the last run)"
                    } else {
                        ""
                    };
                    writeln!(
                        err,
                        "▸ {}{again} {}",
                        printable(tool),
                        one_line(arguments, 160)
                    )?;
                    self.running
                        .push((call_id.clone(), tool.clone(), Instant::now()));
                }
            },
            Event::ToolResult {
                call_id,
                tool,
                text,
                status,
                exit_code,
                ..
            } => {
                let took = self
                    .running
                    .iter()
                    .position(|(c, _, _)| c == call_id)
                    .map(|i| self.running.remove(i).2.elapsed());
                writeln!(
                    err,
                    "{}",
                    result_line(tool, *status, *exit_code, took, text)
                )?;
            }
            Event::Heartbeat { .. } => writeln!(err, "♥ heartbeat sent to the model")?,
            // Refusals are news; what was allowed is in --json.
            Event::Egress {
                host,
                port,
                decision,
                reason,
            } if *decision != corral_proto::event::EgressDecision::Allowed => writeln!(
                err,
                "⛔ egress {}: {}:{port} ({})",
                decision,
                printable(host),
                printable(reason)
            )?,
            Event::Egress { .. } => {}
            Event::ModelFailed { error, .. } => {
                writeln!(err, "model failed: {}", printable(error))?
            }
            Event::TurnCompleted { .. }
            | Event::TextDelta { .. }
            | Event::ToolProgress { .. }
            | Event::Error { .. } => {}
            Event::Result(r) => {
                let usage = usage_text(&r.usage);
                // A resumed session: this run's turns, and the session's.
                let turns = if r.run_turns == r.turns {
                    format!("{} turns", r.turns)
                } else {
                    format!("{} turns ({} in the session)", r.run_turns, r.turns)
                };
                let whose = if r.run_turns == r.turns {
                    ""
                } else {
                    " in the session"
                };
                writeln!(
                    err,
                    "corral: {} · {turns} · {} tool calls{whose} · {usage} · {:.1}s{}",
                    r.status.as_str(),
                    r.tool_calls,
                    r.duration_ms as f64 / 1000.0,
                    r.error
                        .as_ref()
                        .map(|e| format!(" · {}", printable(e)))
                        .unwrap_or_default()
                )?;
            }
        }
        Ok(())
    }

    pub fn tick(&self) -> std::io::Result<()> {
        if self.running.is_empty() || self.mid_line {
            return Ok(());
        }
        let list: Vec<String> = self
            .running
            .iter()
            .map(|(_, tool, t)| format!("{tool} {}s", t.elapsed().as_secs()))
            .collect();
        let running = list.join(", ");
        let mut err = std::io::stderr().lock();
        match (&self.last_progress, self.progress_line) {
            // The progress line stays one line: the notice joins it.
            (Some((tool, line)), true) => {
                write!(err, "\r\x1b[K{}", progress_text(tool, line, Some(&running)))?;
                err.flush()
            }
            _ => writeln!(err, "   … running: {running}"),
        }
    }
}

impl View {
    pub fn show(&mut self, e: &Event) -> std::io::Result<()> {
        match self {
            View::Json(out) => {
                let mut out = out.lock();
                let written = out
                    .write_all(to_json_line(e).as_bytes())
                    .and_then(|()| out.flush());
                match written {
                    Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                        drop(out);
                        *self = View::Closed;
                    }
                    other => other?,
                }
            }
            View::Terminal(t) => t.show(e)?,
            View::Closed => {}
        }
        Ok(())
    }

    /// Whether its reader has gone (see [`View::Closed`]).
    pub fn is_closed(&self) -> bool {
        matches!(self, View::Closed)
    }

    /// Looks, without writing, whether the JSON view's reader has gone (a
    /// pipe with no reader polls as an error): a quiet run (a long
    /// command, nothing to show) learns it without waiting for its next
    /// event.
    pub fn check_reader(&mut self) {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        use std::os::fd::AsFd;
        let View::Json(out) = self else { return };
        let mut fds = [PollFd::new(out.as_fd(), PollFlags::POLLOUT)];
        let gone = poll(&mut fds, PollTimeout::ZERO).is_ok()
            && fds[0]
                .revents()
                .is_some_and(|r| r.intersects(PollFlags::POLLERR | PollFlags::POLLHUP));
        if gone {
            *self = View::Closed;
        }
    }
}

impl View {
    /// JSON events when asked, or when stdout is not a terminal.
    pub fn new(json: bool) -> Self {
        if json {
            View::Json(std::io::stdout())
        } else {
            View::Terminal(TerminalView {
                running: Vec::new(),
                mid_line: false,
                progress_line: false,
                last_progress: None,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn a_patch_for_a_terminal_is_shown_with_its_controls_visible() {
        use tokio::io::AsyncWriteExt;
        let mut shown = Vec::new();
        {
            let mut w = PrintableWriter::new(&mut shown);
            // Pieces cut anywhere, a character split between two writes.
            let patch = "+ok\n+\u{1b}]0;owned\u{7}title\r\n+caf\u{e9} \u{202e}rtl\n+no newline";
            for piece in patch.as_bytes().chunks(3) {
                w.write_all(piece).await.unwrap();
            }
            w.shutdown().await.unwrap();
        }
        let shown = String::from_utf8(shown).unwrap();
        assert_eq!(
            shown,
            "+ok\n+^[]0;owned^Gtitle^M\n+caf\u{e9} \\u{202e}rtl\n+no newline"
        );
        // A line with no end goes out in bounded pieces, whole characters:
        // a character cut at the bound waits for its rest.
        const LINE: usize = PrintableWriter::<Vec<u8>>::LINE;
        let mut shown = Vec::new();
        {
            let mut w = PrintableWriter::new(&mut shown);
            let mut long = "a".repeat(LINE - 1).into_bytes();
            long.push("\u{e9}".as_bytes()[0]);
            w.write_all(&long).await.unwrap();
            assert_eq!(w.held.len(), 1);
            w.write_all(&["\u{e9}".as_bytes()[1], b'\n']).await.unwrap();
            assert!(w.held.is_empty());
        }
        let shown = String::from_utf8(shown).unwrap();
        assert_eq!(shown, format!("{}\u{e9}\n", "a".repeat(LINE - 1)));
    }

    #[test]
    fn control_characters_reach_the_terminal_as_text() {
        // A title change, a clipboard write (OSC 52), a cursor move and a
        // CSI in its one-character C1 form.
        let hostile = "ok\x1b]0;pwned\x07\x1b]52;c;ZWNobyBldmls\x07\x1b[2J\r\u{9b}31mred\u{7f}";
        let shown = printable(hostile);
        assert!(!shown.chars().any(|c| c.is_control()), "{shown:?}");
        assert_eq!(
            shown,
            "ok^[]0;pwned^G^[]52;c;ZWNobyBldmls^G^[[2J^M\\u{9b}31mred^?"
        );
        assert_eq!(printable("a\tb\nc"), "a\tb\nc");
        assert_eq!(printable("x\u{202e}gpj.exe"), "x\\u{202e}gpj.exe");
        assert!(!one_line(hostile, 200).contains('\x1b'));
        let line = result_line("Bash", CallEnd::Ok, Some(0), None, "\x1b[31mred");
        assert_eq!(line, "✓ Bash: ^[[31mred");
        // A tool's name is the model's (an unknown one is refused by it).
        let line = result_line(
            "x\x1b]0;t\x07",
            CallEnd::Refused,
            None,
            None,
            "unknown tool",
        );
        assert_eq!(line, "✗ x^[]0;t^G (refused): unknown tool");
        assert_eq!(progress_text("\x1b[2J", "a", None), "  ⋯ ^[[2J: a");
    }

    #[test]
    fn the_running_notice_joins_the_progress_line_instead_of_breaking_it() {
        let with = progress_text("Bash", "step 3\u{1b}[2J", Some("Bash 4s"));
        assert_eq!(with, "  ⋯ Bash: step 3^[[2J  (running: Bash 4s)");
        assert!(!with.contains('\n'));
        assert_eq!(progress_text("Bash", "a\nb", None), "  ⋯ Bash: a…");
    }

    #[test]
    fn usage_never_reported_is_not_zero_tokens() {
        let none = corral_harness::llm::Usage::default();
        assert_eq!(usage_text(&none), "usage not reported by the endpoint");
        let some = corral_harness::llm::Usage {
            input_tokens: 12,
            output_tokens: 3,
            ..Default::default()
        };
        assert_eq!(usage_text(&some), "12 tokens in, 3 out");
    }

    #[test]
    fn results_are_marked_by_how_they_ended() {
        let secs = Some(Duration::from_millis(1500));
        assert_eq!(
            result_line("Bash", CallEnd::Ok, Some(0), secs, "fine\nmore"),
            "✓ Bash (1.5s): fine…"
        );
        assert_eq!(
            result_line("Bash", CallEnd::Failed, Some(3), secs, "broken"),
            "✗ Bash (exit 3, 1.5s): broken"
        );
        assert_eq!(
            result_line("Bash", CallEnd::Canceled, None, None, "stopped"),
            "⊘ Bash (canceled): stopped"
        );
        assert_eq!(
            result_line("ReadFile", CallEnd::Refused, None, None, "Error: bad"),
            "✗ ReadFile (refused): Error: bad"
        );
        assert_eq!(
            result_line("Bash", CallEnd::Lost, None, None, "gone"),
            "✗ Bash (lost): gone"
        );
    }
}
