//! `corral mcp`: an MCP server over stdio (JSON-RPC 2.0, one message a
//! line) whose tools make and use sandboxes on the worker (or front door)
//! `corral` reaches. A session binds one sandbox (`--sandbox ID`, or the
//! first one a tool needs, made then and removed at the end unless
//! `--keep`), so a model need not pass ids. A tool that fails is a tool
//! result marked `isError` that the model reads; only a malformed request
//! is a protocol error.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use corral_harness::client::WorkerClient;
use corral_proto::{
    Event, EventKind, OperationId, OperationResult, OperationSpec, Outcome, SandboxId, SandboxSpec,
    ShellSpec,
};
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::cli::{ConnArgs, McpArgs, McpClient, McpCommand};

/// The revisions of the `initialize` handshake this server speaks.
const PROTOCOL_VERSIONS: [&str; 4] = ["2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"];
/// Most bytes of a command's stdout (and of its stderr) a result carries.
const MAX_OUTPUT: usize = 16 << 10;
/// Most bytes of a file `read_file` returns.
const MAX_READ: u64 = 256 << 10;
/// The largest file upload_file and download_file move (base64 in a
/// message).
const MAX_TRANSFER: u64 = 4 << 20;
/// Most children one fork_sandbox call makes.
const MAX_FORK: u64 = 8;
/// A command's time when the call names none, and the most it may name.
const DEFAULT_TIMEOUT_S: u64 = 120;
const MAX_TIMEOUT_S: u64 = 3600;
/// Where background processes' output goes in their sandbox.
const PROCESS_LOGS: &str = "/tmp/.corral-mcp";
/// Most tool calls running at once (more wait for one to end).
const MAX_CALLS: usize = 16;

pub async fn main(conn: &ConnArgs, args: McpArgs) -> u8 {
    if let Some(McpCommand::Config { client }) = args.command {
        return match config(conn, &args, client) {
            Ok(text) => {
                let _ = std::io::Write::write_all(&mut std::io::stdout(), text.as_bytes());
                0
            }
            Err(e) => {
                super::report(&e);
                super::EXIT_USAGE
            }
        };
    }
    match serve(conn, args).await {
        Ok(()) => 0,
        Err(e) => {
            super::report(&e);
            super::EXIT_CORRAL_ERROR
        }
    }
}

#[derive(Debug, thiserror::Error)]
enum Error {
    #[error(transparent)]
    Connect(#[from] crate::connect::ConnectError),
    #[error(transparent)]
    Client(#[from] corral_harness::client::ClientError),
    #[error("stdin or stdout: {0}")]
    Io(#[from] std::io::Error),
}

/// A tool call running: how it is canceled, and where its progress goes
/// (the client's progress token and the session's way out), if asked for.
struct Call {
    cancel: CancellationToken,
    progress: Option<(Value, tokio::sync::mpsc::Sender<Value>)>,
}

impl std::ops::Deref for Call {
    type Target = CancellationToken;
    fn deref(&self) -> &CancellationToken {
        &self.cancel
    }
}

/// The least time between two progress notifications of a call.
const PROGRESS_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

/// What a client hears of a command's progress: the output so far (bytes)
/// and its last line.
fn progress_note(token: &Value, bytes: u64, last: &[u8]) -> Value {
    let text = String::from_utf8_lossy(last);
    let line = text.trim_end().rsplit('\n').next().unwrap_or_default();
    let line: String = line.chars().take(200).collect();
    json!({
        "jsonrpc": "2.0",
        "method": "notifications/progress",
        "params": {"progressToken": token, "progress": bytes, "message": line},
    })
}

/// What the server holds for its session.
pub(crate) struct Server {
    client: WorkerClient,
    image: Option<String>,
    keep: bool,
    /// The idle timeout of the sandboxes the session makes (so that a
    /// server killed outright leaves none for long).
    idle_timeout_ms: Option<u64>,
    /// The session's sandbox.
    bound: tokio::sync::Mutex<Option<SandboxId>>,
    /// The sandboxes this session made (removed at its end, unless kept).
    made: Mutex<Vec<SandboxId>>,
    /// Calls running, by their request id, to be canceled.
    running: Mutex<HashMap<String, CancellationToken>>,
    slots: tokio::sync::Semaphore,
    /// Only the read-only tools are offered (a key that may only read).
    read_only: bool,
}

impl Server {
    pub(crate) fn new(
        client: WorkerClient,
        image: Option<String>,
        keep: bool,
        idle_timeout_ms: Option<u64>,
        bound: Option<SandboxId>,
        read_only: bool,
    ) -> Self {
        Self {
            read_only,
            client,
            image,
            keep,
            idle_timeout_ms,
            bound: tokio::sync::Mutex::new(bound),
            made: Mutex::new(Vec::new()),
            running: Mutex::new(HashMap::new()),
            slots: tokio::sync::Semaphore::new(MAX_CALLS),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn serve(conn: &ConnArgs, args: McpArgs) -> Result<(), Error> {
    let client = crate::connect::connect(conn).await?;
    // Its credentials checked before anything is served: a client with the
    // wrong token hears it now, not from every tool.
    client.worker_info().await?;
    let bound =
        match &args.sandbox {
            Some(id) => Some(SandboxId::new(id.clone()).map_err(|e| {
                crate::connect::ConnectError::Usage(format!("--sandbox {id:?}: {e}"))
            })?),
            None => None,
        };
    let server = Arc::new(Server::new(
        client,
        args.image.clone(),
        args.keep,
        Some(args.idle_timeout.as_millis() as u64).filter(|t| *t > 0),
        bound,
        false,
    ));
    // One writer: every message goes out whole, one a line.
    let (out, mut outgoing) = tokio::sync::mpsc::channel::<Value>(64);
    let writer = tokio::spawn(async move {
        let mut stdout = tokio::io::stdout();
        while let Some(msg) = outgoing.recv().await {
            let mut line = msg.to_string();
            line.push('\n');
            if stdout.write_all(line.as_bytes()).await.is_err() || stdout.flush().await.is_err() {
                break;
            }
        }
    });
    let tasks = tokio_util::task::TaskTracker::new();
    let mut input = tokio::io::BufReader::new(tokio::io::stdin());
    // A client that stops its server with SIGTERM (or a Ctrl-C) ends the
    // session as one that closes its stdin does.
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    loop {
        let line = tokio::select! {
            line = read_line(&mut input) => line?,
            _ = term.recv() => Line::End,
            _ = tokio::signal::ctrl_c() => Line::End,
        };
        let line = match line {
            Line::End => break,
            Line::TooLong => {
                let _ = out
                    .send(error(
                        Value::Null,
                        -32600,
                        &format!("a message over {MAX_LINE} bytes, left unread"),
                    ))
                    .await;
                continue;
            }
            Line::Text(line) => line,
        };
        if line.trim().is_empty() {
            continue;
        }
        let msg: Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(e) => {
                let _ = out
                    .send(error(Value::Null, -32700, &format!("not JSON: {e}")))
                    .await;
                continue;
            }
        };
        if msg.is_array() {
            let _ = out
                .send(error(
                    Value::Null,
                    -32600,
                    "batches are not taken: one message a line",
                ))
                .await;
            continue;
        }
        handle(&server, msg, &out, &tasks).await;
    }
    // The client is gone: its calls end, and the sandbox this server made
    // goes with the session.
    end(&server, &tasks).await;
    drop(out);
    let _ = writer.await;
    Ok(())
}

/// Answers one message of a client (never a batch), its replies to `out`;
/// a tool call runs as a task of `tasks`, so that the next message is read
/// while it runs.
pub(crate) async fn handle(
    server: &Arc<Server>,
    msg: Value,
    out: &tokio::sync::mpsc::Sender<Value>,
    tasks: &tokio_util::task::TaskTracker,
) {
    // A client's answer to a request of ours (this server sends none).
    if msg.get("method").is_none() && (msg.get("result").is_some() || msg.get("error").is_some()) {
        return;
    }
    let id = msg.get("id").cloned();
    let method = msg
        .get("method")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let params = msg.get("params").cloned().unwrap_or(Value::Null);
    match (method, id) {
        ("notifications/cancelled", _) => {
            let key = params.get("requestId").map(Value::to_string);
            if let Some(token) = key.and_then(|k| lock(&server.running).remove(&k)) {
                token.cancel();
            }
        }
        (_, None) => {} // other notifications: nothing to answer
        ("initialize", Some(id)) => {
            let asked = params
                .get("protocolVersion")
                .and_then(Value::as_str)
                .unwrap_or_default();
            let version = PROTOCOL_VERSIONS
                .iter()
                .find(|v| **v == asked)
                .unwrap_or(&PROTOCOL_VERSIONS[PROTOCOL_VERSIONS.len() - 1]);
            let _ = out
                .send(reply(
                    id,
                    json!({
                        "protocolVersion": version,
                        "capabilities": {"tools": {"listChanged": false}},
                        "serverInfo": {"name": "corral", "version": env!("CARGO_PKG_VERSION")},
                        "instructions": "Tools that run commands and read and write files in a Corral sandbox: an isolated Linux machine of its own, with no network unless its worker allows one. The session has one sandbox, made at the first tool that needs it; pass sandbox_id to use another.",
                    }),
                ))
                .await;
        }
        ("ping", Some(id)) => {
            let _ = out.send(reply(id, json!({}))).await;
        }
        ("tools/list", Some(id)) => {
            // One page holds them all: no cursor of ours to continue from.
            if params
                .get("cursor")
                .is_some_and(|c| !c.is_null() && c != "")
            {
                let _ = out
                    .send(error(
                        id,
                        -32602,
                        "no such cursor: the tools come in one page",
                    ))
                    .await;
                return;
            }
            let _ = out
                .send(reply(id, json!({"tools": tools_for(server)})))
                .await;
        }
        ("tools/call", Some(id)) => {
            let name = params
                .get("name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string();
            if !tools_for(server).iter().any(|t| t["name"] == name.as_str()) {
                let _ = out
                    .send(error(id, -32602, &format!("no tool {name:?}")))
                    .await;
                return;
            }
            let arguments = params.get("arguments").cloned().unwrap_or(json!({}));
            let token = CancellationToken::new();
            // An id is one call's while it runs (its cancellation is
            // found by it): a second call with it is refused.
            let taken = {
                let mut running = lock(&server.running);
                let free = !running.contains_key(&id.to_string());
                if free {
                    running.insert(id.to_string(), token.clone());
                }
                !free
            };
            if taken {
                let _ = out
                    .send(error(
                        id,
                        -32600,
                        "a call with this id is still running: give each request an id of its own",
                    ))
                    .await;
                return;
            }
            // Progress, when the client asked for it with a token.
            let progress = params
                .pointer("/_meta/progressToken")
                .filter(|t| t.is_string() || t.is_i64() || t.is_u64())
                .map(|t| (t.clone(), out.clone()));
            let (server, out) = (server.clone(), out.clone());
            tasks.spawn(async move {
                let Ok(_slot) = server.slots.acquire().await else {
                    return;
                };
                // The call sees the cancellation itself (a command is
                // canceled in its sandbox, not left running).
                let call_of = Call {
                    cancel: token.clone(),
                    progress,
                };
                let result = call(&server, &name, &arguments, &call_of).await;
                lock(&server.running).remove(&id.to_string());
                // A canceled call is not answered (the client gave up on it).
                if !token.is_cancelled() {
                    let _ = out.send(reply(id, result)).await;
                }
            });
        }
        (other, Some(id)) => {
            let _ = out
                .send(error(id, -32601, &format!("no method {other:?}")))
                .await;
        }
    }
}

/// Ends a session: its calls are canceled and waited for, and the
/// sandboxes it made are removed (unless kept).
pub(crate) async fn end(server: &Server, tasks: &tokio_util::task::TaskTracker) {
    for token in lock(&server.running).values() {
        token.cancel();
    }
    tasks.close();
    tasks.wait().await;
    let made = std::mem::take(&mut *lock(&server.made));
    for id in made.iter().filter(|_| !server.keep) {
        if let Err(e) = server.client.destroy_sandbox(id).await {
            tracing::warn!(sandbox = %id, error = %e, "a sandbox of the session was not removed");
        }
    }
}

/// What `client` needs to start this server as this command would: the
/// `corral` binary by its absolute path, and the worker, token file and
/// image given here.
fn config(conn: &ConnArgs, args: &McpArgs, client: McpClient) -> Result<String, std::io::Error> {
    let corral = std::env::current_exe()?;
    let mut argv: Vec<String> = Vec::new();
    if let Some(w) = &conn.worker {
        argv.extend(["--worker".into(), w.clone()]);
    }
    if let Some(t) = &conn.token_file {
        let t = std::path::absolute(t)?;
        argv.extend(["--token-file".into(), t.display().to_string()]);
    }
    argv.push("mcp".into());
    if let Some(i) = &args.image {
        argv.extend(["--image".into(), i.clone()]);
    }
    let command = corral.display().to_string();
    Ok(match client {
        McpClient::Claude => {
            let quoted: Vec<String> = std::iter::once(command.as_str())
                .chain(argv.iter().map(String::as_str))
                .map(shell_quote)
                .collect();
            format!("claude mcp add corral -- {}\n", quoted.join(" "))
        }
        McpClient::Codex => {
            let args: Vec<String> = argv
                .iter()
                .map(|a| Value::from(a.as_str()).to_string())
                .collect();
            format!(
                "[mcp_servers.corral]\ncommand = {}\nargs = [{}]\n",
                Value::from(command.as_str()),
                args.join(", ")
            )
        }
        McpClient::Cursor => {
            let v = json!({"mcpServers": {"corral": {"command": command, "args": argv}}});
            format!(
                "{}\n",
                serde_json::to_string_pretty(&v).unwrap_or_else(|_| v.to_string())
            )
        }
    })
}

/// `s` as one word for a POSIX shell.
fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"/._-:=@,+".contains(&b))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Most bytes of one message.
const MAX_LINE: usize = 16 << 20;

/// One line of the client's.
enum Line {
    Text(String),
    /// Past [`MAX_LINE`]: the rest of it was read and dropped.
    TooLong,
    End,
}

async fn read_line<R: tokio::io::AsyncBufRead + Unpin>(r: &mut R) -> std::io::Result<Line> {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    let n = (&mut *r)
        .take(MAX_LINE as u64 + 1)
        .read_until(b'\n', &mut buf)
        .await?;
    if n == 0 {
        return Ok(Line::End);
    }
    if buf.last() != Some(&b'\n') && buf.len() > MAX_LINE {
        loop {
            let chunk = r.fill_buf().await?;
            if chunk.is_empty() {
                break;
            }
            if let Some(i) = chunk.iter().position(|b| *b == b'\n') {
                r.consume(i + 1);
                break;
            }
            let all = chunk.len();
            r.consume(all);
        }
        return Ok(Line::TooLong);
    }
    Ok(Line::Text(String::from_utf8_lossy(&buf).into_owned()))
}

fn reply(id: Value, result: Value) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "result": result})
}

fn error(id: Value, code: i64, message: &str) -> Value {
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}})
}

/// A tool's result: text for the model, and the same as structured content.
fn result(text: String, structured: Value, is_error: bool) -> Value {
    json!({
        "content": [{"type": "text", "text": text}],
        "structuredContent": structured,
        "isError": is_error,
    })
}

fn failed(text: impl Into<String>) -> Value {
    let text = text.into();
    result(text.clone(), json!({"error": text}), true)
}

fn sandbox_id_schema() -> Value {
    json!({"type": "string", "description": "A sandbox other than the session's (its id)."})
}

/// The tools a key that may only read can use: what looks at sandboxes
/// without running anything in them (reading a file runs in the sandbox,
/// which such a key may not).
const READ_SCOPE_TOOLS: [&str; 2] = ["list_sandboxes", "inspect_sandbox"];

/// The tools `server`'s caller may use: those of [`READ_SCOPE_TOOLS`] alone
/// for a key that may only read.
fn tools_for(server: &Server) -> Vec<Value> {
    tools()
        .into_iter()
        .filter(|t| !server.read_only || READ_SCOPE_TOOLS.iter().any(|n| t["name"] == *n))
        .collect()
}

/// The tools, with their input schemas and hints.
fn tools() -> Vec<Value> {
    vec![
        json!({
            "name": "run_command",
            "description": "Run a shell command (sh -c) in the sandbox and wait for it: its exit code, stdout and stderr (each cut to 16 KiB, saying how much was cut). A command still running at its timeout is killed.",
            "inputSchema": {
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "The command line, run by sh -c."},
                    "timeout_seconds": {"type": "integer", "minimum": 1, "maximum": MAX_TIMEOUT_S, "description": "Default 120."},
                    "cwd": {"type": "string", "description": "Where it runs (default: the sandbox's workspace)."},
                    "env": {"type": "object", "additionalProperties": {"type": "string"}, "description": "Environment variables for it (names to values)."},
                    "sandbox_id": sandbox_id_schema(),
                },
                "required": ["command"],
                "additionalProperties": false,
            },
            "annotations": {"readOnlyHint": false, "destructiveHint": true, "idempotentHint": false, "openWorldHint": false},
        }),
        json!({
            "name": "read_file",
            "description": "Read a text file of the sandbox (at most 256 KiB; a relative path is under /workspace).",
            "inputSchema": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "sandbox_id": sandbox_id_schema()},
                "required": ["path"],
                "additionalProperties": false,
            },
            "annotations": {"readOnlyHint": true, "destructiveHint": false, "idempotentHint": true, "openWorldHint": false},
        }),
        json!({
            "name": "write_file",
            "description": "Write a file of the sandbox (replacing it; its directories made; a relative path is under /workspace).",
            "inputSchema": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}, "sandbox_id": sandbox_id_schema()},
                "required": ["path", "content"],
                "additionalProperties": false,
            },
            "annotations": {"readOnlyHint": false, "destructiveHint": true, "idempotentHint": true, "openWorldHint": false},
        }),
        json!({
            "name": "upload_file",
            "description": "Put a file of any bytes into the sandbox, given as base64 (at most 4 MiB decoded; replacing it; its directories made; a relative path is under /workspace).",
            "inputSchema": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "content_base64": {"type": "string", "contentEncoding": "base64"},
                    "executable": {"type": "boolean", "description": "Mode 755 instead of 644."},
                    "sandbox_id": sandbox_id_schema(),
                },
                "required": ["path", "content_base64"],
                "additionalProperties": false,
            },
            "annotations": {"readOnlyHint": false, "destructiveHint": true, "idempotentHint": true, "openWorldHint": false},
        }),
        json!({
            "name": "download_file",
            "description": "Get a file of any bytes out of the sandbox (at most 4 MiB): as an embedded resource (base64 blob), and its size.",
            "inputSchema": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "sandbox_id": sandbox_id_schema()},
                "required": ["path"],
                "additionalProperties": false,
            },
            "annotations": {"readOnlyHint": true, "destructiveHint": false, "idempotentHint": true, "openWorldHint": false},
        }),
        json!({
            "name": "start_process",
            "description": "Start a command (sh -c) in the background and return at once with its process_id: a server, a build, a watcher. Its output goes to a log read_process reads; it runs until it ends or stop_process.",
            "inputSchema": {
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "The command line, run by sh -c."},
                    "cwd": {"type": "string", "description": "Where it runs (default: the sandbox's workspace)."},
                    "env": {"type": "object", "additionalProperties": {"type": "string"}, "description": "Environment variables for it (names to values)."},
                    "sandbox_id": sandbox_id_schema(),
                },
                "required": ["command"],
                "additionalProperties": false,
            },
            "annotations": {"readOnlyHint": false, "destructiveHint": true, "idempotentHint": false, "openWorldHint": false},
        }),
        json!({
            "name": "read_process",
            "description": "A background process's state (running, or how it ended) and the last 16 KiB of its output (stdout and stderr together).",
            "inputSchema": {
                "type": "object",
                "properties": {"process_id": {"type": "string"}, "sandbox_id": sandbox_id_schema()},
                "required": ["process_id"],
                "additionalProperties": false,
            },
            "annotations": {"readOnlyHint": true, "destructiveHint": false, "idempotentHint": true, "openWorldHint": false},
        }),
        json!({
            "name": "stop_process",
            "description": "Stop a background process (and what it started).",
            "inputSchema": {
                "type": "object",
                "properties": {"process_id": {"type": "string"}, "sandbox_id": sandbox_id_schema()},
                "required": ["process_id"],
                "additionalProperties": false,
            },
            "annotations": {"readOnlyHint": false, "destructiveHint": true, "idempotentHint": true, "openWorldHint": false},
        }),
        json!({
            "name": "list_files",
            "description": "The entries of a directory of the sandbox: name, type, size (a relative path is under /workspace).",
            "inputSchema": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "Default: the workspace."}, "sandbox_id": sandbox_id_schema()},
                "additionalProperties": false,
            },
            "annotations": {"readOnlyHint": true, "destructiveHint": false, "idempotentHint": true, "openWorldHint": false},
        }),
        json!({
            "name": "expose_port",
            "description": "Give a port a server of the sandbox listens on a URL outside it (on a worker that serves ports): signed (a token in the URL or as a Bearer) unless public is true.",
            "inputSchema": {
                "type": "object",
                "properties": {
                    "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                    "public": {"type": "boolean", "description": "Anyone with the URL, no token (default false)."},
                    "sandbox_id": sandbox_id_schema(),
                },
                "required": ["port"],
                "additionalProperties": false,
            },
            "annotations": {"readOnlyHint": false, "destructiveHint": false, "idempotentHint": true, "openWorldHint": true},
        }),
        json!({
            "name": "create_sandbox",
            "description": "Make a new sandbox and make it the session's (one made before stays, and goes when the session ends). Returns its id.",
            "inputSchema": {
                "type": "object",
                "properties": {
                    "image": {"type": "string", "description": "An image its worker allows (default: the worker's)."},
                    "template": {"type": "string", "description": "A template of the worker's (corral template ls)."},
                    "egress": {"type": "array", "items": {"type": "string"}, "description": "Where it may connect (rules as set_egress takes; [] for nowhere yet, changed later by set_egress). Left out: no network at all."},
                },
                "additionalProperties": false,
            },
            "annotations": {"readOnlyHint": false, "destructiveHint": false, "idempotentHint": false, "openWorldHint": false},
        }),
        json!({
            "name": "fork_sandbox",
            "description": "Copy a sandbox's files, as they are at one instant, into new sandboxes, e.g. to try several approaches from one state. The children start with no processes (nothing held in memory is copied); they are the session's (removed at its end, unless kept), and the session's sandbox stays the one it was. Returns their ids.",
            "inputSchema": {
                "type": "object",
                "properties": {
                    "count": {"type": "integer", "minimum": 1, "maximum": MAX_FORK, "description": "Children to make (default 1)."},
                    "sandbox_id": sandbox_id_schema(),
                },
                "additionalProperties": false,
            },
            "annotations": {"readOnlyHint": false, "destructiveHint": false, "idempotentHint": false, "openWorldHint": false},
        }),
        json!({
            "name": "set_egress",
            "description": "Replace where a sandbox made with egress (create_sandbox with egress) may connect: rules such as \"pypi.org:443\", \"*.github.com:443\" or \"10.0.0.0/8:5432\", within what its worker allows; an empty list blocks everything. Open connections it no longer allows are closed.",
            "inputSchema": {
                "type": "object",
                "properties": {
                    "rules": {"type": "array", "items": {"type": "string"}},
                    "sandbox_id": sandbox_id_schema(),
                },
                "required": ["rules"],
                "additionalProperties": false,
            },
            "annotations": {"readOnlyHint": false, "destructiveHint": true, "idempotentHint": true, "openWorldHint": true},
        }),
        json!({
            "name": "list_sandboxes",
            "description": "The sandboxes this key may see (the session's, and others made with the same credentials): id, image, state.",
            "inputSchema": {"type": "object", "properties": {}, "additionalProperties": false},
            "annotations": {"readOnlyHint": true, "destructiveHint": false, "idempotentHint": true, "openWorldHint": false},
        }),
        json!({
            "name": "inspect_sandbox",
            "description": "A sandbox's state, image, limits and egress, and its last 20 operations (what ran, how it ended), without running anything in it.",
            "inputSchema": {
                "type": "object",
                "properties": {"sandbox_id": {"type": "string", "description": "Default: the session's."}},
                "additionalProperties": false,
            },
            "annotations": {"readOnlyHint": true, "destructiveHint": false, "idempotentHint": true, "openWorldHint": false},
        }),
        json!({
            "name": "remove_sandbox",
            "description": "Remove a sandbox and everything in it.",
            "inputSchema": {
                "type": "object",
                "properties": {"sandbox_id": {"type": "string"}},
                "required": ["sandbox_id"],
                "additionalProperties": false,
            },
            "annotations": {"readOnlyHint": false, "destructiveHint": true, "idempotentHint": true, "openWorldHint": false},
        }),
    ]
}

fn text_arg<'a>(args: &'a Value, name: &str) -> Result<&'a str, Value> {
    args.get(name)
        .and_then(Value::as_str)
        .ok_or_else(|| failed(format!("{name} is required, a string")))
}

/// The sandbox a call names, or the session's (made now if there is none).
async fn sandbox_for(server: &Server, args: &Value) -> Result<SandboxId, Value> {
    if let Some(id) = args.get("sandbox_id").and_then(Value::as_str) {
        return SandboxId::new(id.to_string()).map_err(|e| failed(format!("sandbox_id: {e}")));
    }
    let mut bound = server.bound.lock().await;
    if let Some(id) = &*bound {
        return Ok(id.clone());
    }
    if server.read_only {
        return Err(failed(
            "sandbox_id is required: a key that may only read makes no sandbox (list_sandboxes names them)",
        ));
    }
    let made = make(server, server.image.clone(), None, None).await?;
    *bound = Some(made.id.clone());
    Ok(made.id)
}

/// The egress rules a call gives in `name` (`None`: none given).
fn rules_arg(args: &Value, name: &str) -> Result<Option<Vec<corral_proto::egress::Rule>>, Value> {
    let Some(v) = args.get(name).filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let raw: Vec<&str> = v
        .as_array()
        .and_then(|a| a.iter().map(Value::as_str).collect())
        .ok_or_else(|| failed(format!("{name}: a list of rules (strings)")))?;
    corral_proto::egress::parse_rules(&raw, false)
        .map(Some)
        .map_err(|e| failed(format!("{name}: {e}")))
}

/// A new sandbox of the session's (removed at its end, unless kept).
async fn make(
    server: &Server,
    image: Option<String>,
    template: Option<String>,
    egress: Option<Vec<corral_proto::egress::Rule>>,
) -> Result<corral_proto::SandboxInfo, Value> {
    let spec = SandboxSpec {
        image,
        template,
        idle_timeout_ms: server.idle_timeout_ms,
        egress_proxy: egress.is_some(),
        egress: egress.unwrap_or_default(),
        ..SandboxSpec::default()
    };
    let made = server
        .client
        .create_sandbox(None, spec)
        .await
        .map_err(|e| failed(format!("no sandbox was made: {e}")))?;
    lock(&server.made).push(made.id.clone());
    Ok(made)
}

/// The first `limit` bytes of file `path` of `sandbox` (its size in the
/// result), or why not.
async fn read(
    server: &Server,
    sandbox: &SandboxId,
    path: &str,
    limit: u64,
    token: &Call,
) -> Result<OperationResult, Value> {
    let spec = OperationSpec::ReadFile(corral_proto::ReadFileSpec {
        path: path.to_string(),
        offset: 0,
        limit,
        stream: false,
    });
    let r = run(server, sandbox, spec, token).await?;
    if let Outcome::FileError { message, .. } = &r.outcome {
        return Err(failed(format!("{path}: {message}")));
    }
    Ok(r)
}

/// Writes `data` to `path` of `sandbox` (its directories made first, as an
/// editor would make them), executable or not.
async fn write(
    server: &Server,
    sandbox: &SandboxId,
    path: &str,
    data: bytes::Bytes,
    executable: bool,
    token: &Call,
) -> Result<(), Value> {
    if let Some((dir, _)) = path.rsplit_once('/')
        && !dir.is_empty()
    {
        let mut mk = ShellSpec::new(r#"mkdir -p -- "$D""#.to_string());
        mk.env.insert("D".into(), dir.to_string());
        run(server, sandbox, OperationSpec::Shell(mk), token).await?;
    }
    let spec = OperationSpec::WriteFile(corral_proto::WriteFileSpec {
        path: path.to_string(),
        data,
        mode: if executable { 0o755 } else { 0o644 },
        append: false,
        stream: false,
    });
    let r = run(server, sandbox, spec, token).await?;
    if let Outcome::FileError { message, .. } = &r.outcome {
        return Err(failed(format!("{path}: {message}")));
    }
    Ok(())
}

/// Runs `spec` in `sandbox` to its end (or cancels it when `token` is).
async fn run(
    server: &Server,
    sandbox: &SandboxId,
    spec: OperationSpec,
    token: &Call,
) -> Result<OperationResult, Value> {
    let op = OperationId::random();
    let (_, mut events) = server
        .client
        .run(sandbox, &op, spec, None)
        .await
        .map_err(|e| failed(e.to_string()))?;
    let finished = async {
        let mut output = 0u64;
        let mut said = std::time::Instant::now() - PROGRESS_EVERY;
        while let Some(e) = events.next().await {
            match e.map_err(|e| failed(e.to_string()))? {
                Event {
                    kind: EventKind::Finished(r),
                    ..
                } => return Ok(*r),
                Event {
                    kind: EventKind::Output { data, .. },
                    ..
                } => {
                    output += data.len() as u64;
                    if let Some((t, out)) = &token.progress
                        && said.elapsed() >= PROGRESS_EVERY
                    {
                        said = std::time::Instant::now();
                        // Never held up by a client that does not read.
                        let _ = out.try_send(progress_note(t, output, &data));
                    }
                }
                Event {
                    kind: EventKind::SandboxLost { reason },
                    ..
                } => return Err(failed(format!("the sandbox was lost: {reason}"))),
                _ => {}
            }
        }
        Err(failed(
            "the worker stopped answering before the command ended",
        ))
    };
    tokio::select! {
        r = finished => r,
        () = token.cancelled() => {
            let _ = server.client.cancel(sandbox, &op).await;
            Err(failed("canceled"))
        }
    }
}

/// Captured output as text: its start and its end (each at most half of
/// [`MAX_OUTPUT`]), and how much was cut between them.
fn shown(c: &corral_proto::result::Captured) -> String {
    let half = MAX_OUTPUT / 2;
    let head = &c.head[..c.head.len().min(half)];
    let tail = &c.tail[c.tail.len().saturating_sub(half)..];
    let kept = (head.len() + tail.len()) as u64;
    let mut text = String::from_utf8_lossy(head).into_owned();
    if c.total_bytes > kept {
        text.push_str(&format!(
            "\n[... {} bytes cut; {} in all ...]\n",
            c.total_bytes - kept,
            c.total_bytes
        ));
    }
    text.push_str(&String::from_utf8_lossy(tail));
    text
}

async fn call(server: &Server, name: &str, args: &Value, token: &Call) -> Value {
    if let Err(v) = known_arguments(name, args) {
        return v;
    }
    match call_inner(server, name, args, token).await {
        Ok(v) | Err(v) => v,
    }
}

/// Refuses arguments a tool's schema does not name (`additionalProperties:
/// false`): a misspelled `timeout` must not quietly mean the default.
fn known_arguments(name: &str, args: &Value) -> Result<(), Value> {
    let Some(given) = args.as_object() else {
        return Err(failed("the arguments are an object"));
    };
    let tools = tools();
    let Some(schema) = tools.iter().find(|t| t["name"] == name) else {
        return Ok(());
    };
    let known = schema["inputSchema"]["properties"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    match given.keys().find(|k| !known.contains_key(*k)) {
        None => Ok(()),
        Some(k) => {
            let mut names: Vec<&String> = known.keys().collect();
            names.sort();
            Err(failed(format!(
                "{name} takes no argument {k:?} (it takes: {})",
                names
                    .iter()
                    .map(|n| n.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )))
        }
    }
}

async fn call_inner(
    server: &Server,
    name: &str,
    args: &Value,
    token: &Call,
) -> Result<Value, Value> {
    match name {
        "run_command" => {
            let command = text_arg(args, "command")?;
            let timeout = match args.get("timeout_seconds") {
                None | Some(Value::Null) => DEFAULT_TIMEOUT_S,
                Some(v) => v
                    .as_u64()
                    .filter(|t| (1..=MAX_TIMEOUT_S).contains(t))
                    .ok_or_else(|| {
                        failed(format!(
                            "timeout_seconds: a whole number of seconds from 1 to {MAX_TIMEOUT_S}, not {v}"
                        ))
                    })?,
            };
            let mut spec = ShellSpec::new(command.to_string());
            spec.timeout_ms = Some(timeout * 1000);
            spec.output_limit_bytes = Some((4 * MAX_OUTPUT) as u64);
            if let Some(cwd) = args.get("cwd").and_then(Value::as_str) {
                spec.workdir = Some(cwd.to_string());
            }
            if let Some(env) = args.get("env").and_then(Value::as_object) {
                for (k, v) in env {
                    let v = v
                        .as_str()
                        .ok_or_else(|| failed(format!("env {k}: a string")))?;
                    spec.env.insert(k.clone(), v.to_string());
                }
            }
            let sandbox = sandbox_for(server, args).await?;
            let r = run(server, &sandbox, OperationSpec::Shell(spec), token).await?;
            let (stdout, stderr) = (shown(&r.stdout), shown(&r.stderr));
            let (code, why) = match &r.outcome {
                Outcome::Exited { code } => (Some(*code), None),
                Outcome::TimedOut => (
                    None,
                    Some(format!("timed out after {timeout} s and was killed")),
                ),
                other => (None, Some(other.to_string())),
            };
            let mut text = String::new();
            match (&code, &why) {
                (Some(c), _) => text.push_str(&format!("exit code {c}\n")),
                (None, Some(w)) => text.push_str(&format!("the command {w}\n")),
                (None, None) => {}
            }
            if !stdout.is_empty() {
                text.push_str(&format!("stdout:\n{stdout}"));
                if !stdout.ends_with('\n') {
                    text.push('\n');
                }
            }
            if !stderr.is_empty() {
                text.push_str(&format!("stderr:\n{stderr}"));
            }
            let structured = json!({
                "sandbox_id": sandbox.to_string(),
                "exit_code": code,
                "ended": why,
                "stdout": stdout,
                "stderr": stderr,
            });
            Ok(result(text, structured, code != Some(0)))
        }
        "read_file" => {
            let path = text_arg(args, "path")?;
            let sandbox = sandbox_for(server, args).await?;
            let r = read(server, &sandbox, path, MAX_READ, token).await?;
            let text = String::from_utf8_lossy(&r.file_data).into_owned();
            let more = r.file_size > r.file_data.len() as u64;
            let shown = if more {
                format!(
                    "{text}\n[... the file is {} bytes; the first {} shown ...]",
                    r.file_size,
                    r.file_data.len()
                )
            } else {
                text.clone()
            };
            Ok(result(
                shown,
                json!({"path": path, "content": text, "size": r.file_size, "complete": !more}),
                false,
            ))
        }
        "write_file" | "upload_file" => {
            let path = text_arg(args, "path")?;
            let data = if name == "write_file" {
                text_arg(args, "content")?.as_bytes().to_vec()
            } else {
                use base64::Engine as _;
                base64::engine::general_purpose::STANDARD
                    .decode(text_arg(args, "content_base64")?)
                    .map_err(|e| failed(format!("content_base64: not base64 ({e})")))?
            };
            if data.len() as u64 > MAX_TRANSFER {
                return Err(failed(format!(
                    "{path}: {} bytes; at most {MAX_TRANSFER} come through a tool (move larger files with corral cp)",
                    data.len()
                )));
            }
            let executable = args
                .get("executable")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let sandbox = sandbox_for(server, args).await?;
            let n = data.len();
            write(server, &sandbox, path, data.into(), executable, token).await?;
            let did = if name == "write_file" {
                "wrote"
            } else {
                "uploaded"
            };
            Ok(result(
                format!("{did} {n} bytes to {path}"),
                json!({"path": path, "bytes": n}),
                false,
            ))
        }
        "download_file" => {
            use base64::Engine as _;
            let path = text_arg(args, "path")?;
            let sandbox = sandbox_for(server, args).await?;
            let r = read(server, &sandbox, path, MAX_TRANSFER + 1, token).await?;
            if r.file_size > MAX_TRANSFER {
                return Err(failed(format!(
                    "{path}: {} bytes; at most {MAX_TRANSFER} come through a tool (move larger files with corral cp)",
                    r.file_size
                )));
            }
            let blob = base64::engine::general_purpose::STANDARD.encode(&r.file_data);
            let absolute = if path.starts_with('/') {
                path.to_string()
            } else {
                format!("/workspace/{path}")
            };
            Ok(json!({
                "content": [
                    {"type": "text", "text": format!("{path}: {} bytes", r.file_size)},
                    {"type": "resource", "resource": {
                        "uri": format!("corral://{sandbox}{absolute}"),
                        "mimeType": "application/octet-stream",
                        "blob": blob,
                    }},
                ],
                "structuredContent": {"path": path, "size": r.file_size, "sandbox_id": sandbox.to_string()},
                "isError": false,
            }))
        }
        "fork_sandbox" => {
            let count = match args.get("count") {
                None | Some(Value::Null) => 1,
                Some(v) => v
                    .as_u64()
                    .filter(|n| (1..=MAX_FORK).contains(n))
                    .ok_or_else(|| failed(format!("count: from 1 to {MAX_FORK}, not {v}")))?,
            };
            let sandbox = sandbox_for(server, args).await?;
            let forked = server
                .client
                .fork_sandbox(&sandbox, &[], count as u32)
                .await
                .map_err(|e| failed(format!("sandbox {sandbox} was not forked: {e}")))?;
            let ids: Vec<String> = forked.children.iter().map(|c| c.id.to_string()).collect();
            lock(&server.made).extend(forked.children.iter().map(|c| c.id.clone()));
            Ok(result(
                format!(
                    "sandbox {sandbox} forked into {} ({} ms frozen): pass sandbox_id to use one",
                    ids.join(", "),
                    forked.frozen.as_millis()
                ),
                json!({"sandbox_id": sandbox.to_string(), "children": ids, "frozen_ms": forked.frozen.as_millis() as u64}),
                false,
            ))
        }
        "set_egress" => {
            let rules = rules_arg(args, "rules")?
                .ok_or_else(|| failed("rules is required, a list of rules"))?;
            let sandbox = sandbox_for(server, args).await?;
            let was = server
                .client
                .get_sandbox(&sandbox)
                .await
                .map_err(|e| failed(format!("sandbox {sandbox}: {e}")))?;
            if !was.spec.has_egress_proxy() {
                return Err(failed(format!(
                    "sandbox {sandbox} was made without egress (no network at all): make one with create_sandbox and egress (a list of rules, or [])"
                )));
            }
            let info = server
                .client
                .set_sandbox_egress(&sandbox, &rules)
                .await
                .map_err(|e| failed(format!("egress of sandbox {sandbox} not changed: {e}")))?;
            let now: Vec<String> = info.spec.egress.iter().map(ToString::to_string).collect();
            Ok(result(
                if now.is_empty() {
                    format!("sandbox {sandbox} may connect nowhere")
                } else {
                    format!("sandbox {sandbox} may connect to {}", now.join(", "))
                },
                json!({"sandbox_id": sandbox.to_string(), "rules": now}),
                false,
            ))
        }
        "create_sandbox" => {
            let image = args
                .get("image")
                .and_then(Value::as_str)
                .map(str::to_string)
                .or_else(|| server.image.clone());
            let template = args
                .get("template")
                .and_then(Value::as_str)
                .map(str::to_string);
            let egress = rules_arg(args, "egress")?;
            let made = make(server, image, template, egress).await?;
            // The session's now; one it made before stays until its end.
            *server.bound.lock().await = Some(made.id.clone());
            Ok(result(
                format!("sandbox {} ({}) is the session's now", made.id, made.image),
                json!({"sandbox_id": made.id.to_string(), "image": made.image}),
                false,
            ))
        }
        "start_process" => {
            let command = text_arg(args, "command")?;
            let sandbox = sandbox_for(server, args).await?;
            let op = OperationId::random();
            // Its output to a log of its own, which outlives the process.
            let mut spec = ShellSpec::new(format!(
                "mkdir -p {PROCESS_LOGS} && exec >{PROCESS_LOGS}/{op}.log 2>&1\n{command}"
            ));
            spec.keep_background = true;
            if let Some(cwd) = args.get("cwd").and_then(Value::as_str) {
                spec.workdir = Some(cwd.to_string());
            }
            if let Some(env) = args.get("env").and_then(Value::as_object) {
                for (k, v) in env {
                    let v = v
                        .as_str()
                        .ok_or_else(|| failed(format!("env {k}: a string")))?;
                    spec.env.insert(k.clone(), v.to_string());
                }
            }
            server
                .client
                .submit(&sandbox, &op, OperationSpec::Shell(spec))
                .await
                .map_err(|e| failed(format!("not started: {e}")))?;
            Ok(result(
                format!("started process {op} in sandbox {sandbox}"),
                json!({"process_id": op.to_string(), "sandbox_id": sandbox.to_string()}),
                false,
            ))
        }
        "read_process" => {
            let id = OperationId::new(text_arg(args, "process_id")?.to_string())
                .map_err(|e| failed(format!("process_id: {e}")))?;
            let sandbox = sandbox_for(server, args).await?;
            let record = server
                .client
                .operation(&sandbox, &id)
                .await
                .map_err(|e| failed(format!("process {id}: {e}")))?;
            let mut tail = ShellSpec::new(format!(
                "tail -c {MAX_OUTPUT} {PROCESS_LOGS}/{id}.log 2>/dev/null; true"
            ));
            tail.output_limit_bytes = Some(2 * MAX_OUTPUT as u64);
            let r = run(server, &sandbox, OperationSpec::Shell(tail), token).await?;
            let output = String::from_utf8_lossy(&r.stdout.head).into_owned();
            let (state, exit_code) = match &record.result {
                None => ("running".to_string(), None),
                Some(done) => (
                    done.outcome.to_string(),
                    match done.outcome {
                        Outcome::Exited { code } => Some(code),
                        _ => None,
                    },
                ),
            };
            Ok(result(
                format!("process {id}: {state}\n{output}"),
                json!({"process_id": id.to_string(), "running": record.result.is_none(), "state": state, "exit_code": exit_code, "output": output}),
                false,
            ))
        }
        "stop_process" => {
            let id = OperationId::new(text_arg(args, "process_id")?.to_string())
                .map_err(|e| failed(format!("process_id: {e}")))?;
            let sandbox = sandbox_for(server, args).await?;
            server
                .client
                .cancel(&sandbox, &id)
                .await
                .map_err(|e| failed(format!("process {id}: {e}")))?;
            Ok(result(
                format!("process {id} stopped"),
                json!({"process_id": id.to_string(), "stopped": true}),
                false,
            ))
        }
        "list_files" => {
            let path = args.get("path").and_then(Value::as_str).unwrap_or(".");
            let sandbox = sandbox_for(server, args).await?;
            let mut ls = ShellSpec::new(
                r#"cd -- "$P" && find . -mindepth 1 -maxdepth 1 -printf '%y %s %P\n' | sort -k3 | head -n 1000"#
                    .to_string(),
            );
            ls.env.insert("P".into(), path.to_string());
            let r = run(server, &sandbox, OperationSpec::Shell(ls), token).await?;
            if !r.outcome.is_success() {
                return Err(failed(format!(
                    "{path}: {}",
                    String::from_utf8_lossy(&r.stderr.head).trim()
                )));
            }
            let text = String::from_utf8_lossy(&r.stdout.head).into_owned();
            let entries: Vec<Value> = text
                .lines()
                .filter_map(|l| {
                    let mut it = l.splitn(3, ' ');
                    let (kind, size, name) = (it.next()?, it.next()?, it.next()?);
                    let kind = match kind {
                        "d" => "directory",
                        "f" => "file",
                        "l" => "symlink",
                        _ => "other",
                    };
                    Some(json!({"name": name, "type": kind, "size": size.parse::<u64>().unwrap_or(0)}))
                })
                .collect();
            Ok(result(
                if text.is_empty() {
                    format!("{path}: empty")
                } else {
                    text
                },
                json!({"path": path, "entries": entries}),
                false,
            ))
        }
        "expose_port" => {
            let port = args
                .get("port")
                .and_then(Value::as_u64)
                .and_then(|p| u16::try_from(p).ok())
                .filter(|p| *p > 0)
                .ok_or_else(|| failed("port: a port number from 1 to 65535"))?;
            let public = args.get("public").and_then(Value::as_bool).unwrap_or(false);
            let sandbox = sandbox_for(server, args).await?;
            let access = if public {
                corral_proto::pb::PortAccess::Public
            } else {
                corral_proto::pb::PortAccess::Signed
            };
            let e = server
                .client
                .expose_port(&sandbox, port, access, None)
                .await
                .map_err(|e| failed(format!("port {port} not exposed: {e}")))?;
            let how = if e.token.is_empty() {
                String::new()
            } else {
                format!(
                    " (send token {} as ?token= or as Authorization: Bearer)",
                    e.token
                )
            };
            Ok(result(
                format!("port {port} of sandbox {sandbox}: {}{how}", e.url),
                json!({"port": port, "url": e.url, "token": (!e.token.is_empty()).then_some(&e.token)}),
                false,
            ))
        }
        "list_sandboxes" => {
            let all = server
                .client
                .list_sandboxes()
                .await
                .map_err(|e| failed(e.to_string()))?;
            let bound = server.bound.lock().await.clone();
            let rows: Vec<Value> = all
                .iter()
                .map(|s| {
                    json!({
                        "sandbox_id": s.id.to_string(),
                        "image": s.image,
                        "state": format!("{:?}", s.state).to_lowercase(),
                        "session": Some(&s.id) == bound.as_ref(),
                    })
                })
                .collect();
            let text = if rows.is_empty() {
                "no sandboxes".to_string()
            } else {
                rows.iter()
                    .map(|r| {
                        format!(
                            "{} {} {}{}",
                            r["sandbox_id"].as_str().unwrap_or_default(),
                            r["image"].as_str().unwrap_or_default(),
                            r["state"].as_str().unwrap_or_default(),
                            if r["session"] == true {
                                " (the session's)"
                            } else {
                                ""
                            }
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            };
            Ok(result(text, json!({"sandboxes": rows}), false))
        }
        "inspect_sandbox" => {
            let sandbox = sandbox_for(server, args).await?;
            let info = server
                .client
                .get_sandbox(&sandbox)
                .await
                .map_err(|e| failed(format!("sandbox {sandbox}: {e}")))?;
            let ops = server
                .client
                .list_operations(&sandbox)
                .await
                .map_err(|e| failed(format!("sandbox {sandbox}: {e}")))?;
            let last: Vec<Value> = ops
                .iter()
                .rev()
                .take(20)
                .rev()
                .map(|o| {
                    let what = match &o.spec {
                        OperationSpec::Shell(sh) => sh.command.chars().take(200).collect(),
                        OperationSpec::ReadFile(r) => r.path.clone(),
                        OperationSpec::WriteFile(w) => w.path.clone(),
                        OperationSpec::PutArchive(a)
                        | OperationSpec::GetArchive(a)
                        | OperationSpec::ListDir(a) => a.path.clone(),
                    };
                    json!({
                        "operation_id": o.id.to_string(),
                        "kind": o.spec.kind(),
                        "what": what,
                        "outcome": o.result.as_ref().map_or_else(|| "running".to_string(), |r| r.outcome.to_string()),
                    })
                })
                .collect();
            let state = format!("{:?}", info.state).to_lowercase();
            let egress: Option<Vec<String>> = info
                .spec
                .has_egress_proxy()
                .then(|| info.spec.egress.iter().map(ToString::to_string).collect());
            let mut text = format!(
                "sandbox {sandbox}: {state}, image {}, {} operations ({} running)",
                info.image,
                ops.len(),
                info.running_operations
            );
            for o in &last {
                text.push_str(&format!(
                    "\n  {} {} {:?}: {}",
                    o["operation_id"].as_str().unwrap_or_default(),
                    o["kind"].as_str().unwrap_or_default(),
                    o["what"].as_str().unwrap_or_default(),
                    o["outcome"].as_str().unwrap_or_default()
                ));
            }
            Ok(result(
                text,
                json!({
                    "sandbox_id": sandbox.to_string(),
                    "state": state,
                    "image": info.image,
                    "memory_bytes": info.limits.memory_bytes,
                    "cpu_millis": info.limits.cpu_millis,
                    "egress": egress,
                    "operations": ops.len(),
                    "last_operations": last,
                }),
                false,
            ))
        }
        "remove_sandbox" => {
            let id = SandboxId::new(text_arg(args, "sandbox_id")?.to_string())
                .map_err(|e| failed(format!("sandbox_id: {e}")))?;
            let existed = server
                .client
                .destroy_sandbox(&id)
                .await
                .map_err(|e| failed(e.to_string()))?;
            let mut bound = server.bound.lock().await;
            if bound.as_ref() == Some(&id) {
                *bound = None;
            }
            lock(&server.made).retain(|m| *m != id);
            Ok(result(
                if existed {
                    format!("sandbox {id} removed")
                } else {
                    format!("no sandbox {id}")
                },
                json!({"sandbox_id": id.to_string(), "existed": existed}),
                !existed,
            ))
        }
        other => Err(failed(format!("no tool {other:?}"))),
    }
}
