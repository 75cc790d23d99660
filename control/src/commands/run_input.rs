//! What `corral run` is asked and what it answers, here or through a
//! service (`--control`): the request (a prompt, `--request`, the flags
//! over it), the model's key, stdin's lines as inputs, and exit codes.

use std::io::{IsTerminal, Read, Write};
use std::path::Path;

use corral_harness::agent::Ending;
use corral_harness::agent::events::{Event, to_json_line};
use corral_harness::sessions::{SessionRequest, parse_request};

use crate::cli::RunArgs;

pub const EXIT_DONE: u8 = 0;
pub const EXIT_FAILED: u8 = 1;
pub const EXIT_INTERRUPTED: u8 = 130;

/// Whether `corral run` speaks JSON lines: asked for, or not on a terminal.
pub(super) fn is_json(args: &RunArgs) -> bool {
    args.json || !std::io::stdout().is_terminal()
}

/// Says why the run failed: on stderr, and to a JSON reader in its own
/// stream too.
pub(super) fn failed(e: &dyn std::error::Error, json: bool) {
    super::report(e);
    if json {
        let line = to_json_line(&Event::Error {
            message: corral_harness::client::source_chain(e),
        });
        let mut stdout = std::io::stdout().lock();
        let _ = stdout
            .write_all(line.as_bytes())
            .and_then(|()| stdout.flush());
    }
}

/// `--request` (a file, or `-` for stdin), with the flags over it.
pub(super) fn load_request(args: &RunArgs) -> Result<SessionRequest, String> {
    let usage = |m: String| m;
    let mut req = match args.request.as_deref() {
        None => SessionRequest::default(),
        Some("-") => {
            if args.inputs_from_stdin {
                return Err(usage(
                    "--request - and --inputs-from-stdin both want stdin".into(),
                ));
            }
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .map_err(|e| usage(format!("--request -: {e}")))?;
            parse_request(&s).map_err(|e| usage(format!("--request: {e}")))?
        }
        Some(path) => {
            let s = std::fs::read_to_string(path)
                .map_err(|e| usage(format!("--request {path}: {e}")))?;
            parse_request(&s).map_err(|e| usage(format!("--request: {e}")))?
        }
    };
    if let Some(p) = &args.prompt {
        if req.prompt.is_some() {
            return Err(usage(
                "give the prompt either as an argument or in --request, not both".into(),
            ));
        }
        req.prompt = Some(p.clone());
    }
    if let Some(p) = &req.prompt
        && p.trim().is_empty()
    {
        return Err(usage("the prompt is empty".into()));
    }
    // Flags first, then the request.
    if args.model.is_some() {
        req.model = args.model.clone();
    }
    if args.system_prompt.is_some() {
        req.system_prompt = args.system_prompt.clone();
    }
    if args.tool_choice.is_some() {
        req.tool_choice = args.tool_choice.clone();
    }
    if args.keep_tool_choice {
        req.keep_tool_choice = true;
    }
    if args.max_turns.is_some() {
        req.limits.max_turns = args.max_turns;
    }
    if args.context_window.is_some() {
        req.limits.context_window_tokens = args.context_window;
    }
    if args.max_output_tokens.is_some() {
        req.limits.max_output_tokens = args.max_output_tokens;
    }
    Ok(req)
}

/// The API key in `file` (`--api-key-file`), else in OPENAI_API_KEY.
pub fn key_from(file: Option<&Path>) -> Result<Option<String>, String> {
    if let Some(path) = file {
        let key = std::fs::read_to_string(path)
            .map_err(|e| format!("--api-key-file {}: {e}", path.display()))?;
        let key = key.trim().to_string();
        if key.is_empty() {
            return Err(format!(
                "--api-key-file {}: the file is empty",
                path.display()
            ));
        }
        return Ok(Some(key));
    }
    Ok(std::env::var("OPENAI_API_KEY")
        .ok()
        .filter(|k| !k.trim().is_empty()))
}

/// The exit code of a run that ended so.
pub fn exit_code_of(ending: Ending) -> u8 {
    match ending {
        Ending::Done => EXIT_DONE,
        Ending::Failed => EXIT_FAILED,
        Ending::Interrupted => EXIT_INTERRUPTED,
    }
}

pub(super) type StdinLines = tokio::io::Lines<tokio::io::BufReader<tokio::io::Stdin>>;

/// The next line of stdin, when it is read for inputs.
pub(super) async fn next_input(lines: &mut Option<StdinLines>) -> std::io::Result<Option<String>> {
    match lines {
        Some(l) => l.next_line().await,
        None => std::future::pending().await,
    }
}

/// What a line read from stdin is to a run.
pub(super) enum Line {
    Input(String),
    Blank,
    /// No more inputs from stdin (its end, or it cannot be read: said).
    End,
}

pub(super) fn input_of(line: std::io::Result<Option<String>>) -> Line {
    match line {
        Ok(Some(text)) if !text.trim().is_empty() => Line::Input(text),
        Ok(Some(_)) => Line::Blank,
        Ok(None) => Line::End,
        Err(e) => {
            tracing::warn!(error = %e, "stdin cannot be read; no more inputs from it");
            Line::End
        }
    }
}
