//! Against a real OpenAI-compatible server: llama.cpp's Python server
//! (llama-cpp-python) serving SmolLM2-135M-Instruct, both from PyPI. The
//! model is tiny, so the tests force tool use with `tool_choice` and check
//! the plumbing, not the model's wisdom: a Bash call streamed by the real
//! server (which repeats the call's id and name in every chunk and sends a
//! legacy `function_call` beside `tool_calls`) is parsed, runs in a real
//! sandbox, and its result goes back in a request the server accepts.
//!
//! These tests need the server: `deploy/test-llama.sh` sets it up (a
//! compile of about 10 minutes the first time) and runs them. Without it
//! they fail and say so; `deploy/test.sh` leaves them out.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use corral_e2e::{Harness, binary};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The server, killed when dropped.
struct Llama {
    url: String,
    _child: tokio::process::Child,
}

async fn get_ok(addr: &str, path: &str) -> bool {
    let Ok(mut sock) = tokio::net::TcpStream::connect(addr).await else {
        return false;
    };
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if sock.write_all(req.as_bytes()).await.is_err() {
        return false;
    }
    let mut buf = Vec::new();
    let _ = sock.read_to_end(&mut buf).await;
    buf.starts_with(b"HTTP/1.1 200")
}

async fn start_llama() -> Result<Llama> {
    let python = std::env::var("CORRAL_LLAMA_PYTHON").context(
        "CORRAL_LLAMA_PYTHON is not set: run these tests with deploy/test-llama.sh, which sets up llama.cpp's server",
    )?;
    let model = std::env::var("CORRAL_LLAMA_MODEL")
        .context("CORRAL_LLAMA_MODEL is not set: run deploy/test-llama.sh")?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut child = tokio::process::Command::new(&python)
        .args(["-m", "llama_cpp.server", "--model", &model])
        .args(["--model_alias", "smollm2", "--n_ctx", "8192"])
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting {python} -m llama_cpp.server"))?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while !get_ok(&addr, "/v1/models").await {
        if let Some(status) = child.try_wait()? {
            bail!("llama.cpp's server exited: {status}");
        }
        if tokio::time::Instant::now() > deadline {
            bail!("llama.cpp's server did not answer within 120 s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(Llama {
        url: format!("http://{addr}/v1"),
        _child: child,
    })
}

struct Run {
    code: i32,
    events: Vec<Value>,
    stderr: String,
}

impl Run {
    fn of_type(&self, t: &str) -> Vec<&Value> {
        self.events.iter().filter(|e| e["type"] == t).collect()
    }
}

async fn corral_run(llama: &Llama, worker: &str, request: Value) -> Result<Run> {
    let dir = tempfile::tempdir()?;
    let file = dir.path().join("request.json");
    std::fs::write(&file, request.to_string())?;
    let out = tokio::process::Command::new(binary("corral")?)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .env("HOME", dir.path())
        .env("CORRAL_SESSIONS_DIR", dir.path())
        .env("CORRAL_WORKER", worker)
        .args(["run", "--json", "--api", "chat", "--base-url", &llama.url])
        .args(["--model", "smollm2", "--request"])
        .arg(&file)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(300), out)
        .await
        .context("corral run did not finish")??;
    let events = String::from_utf8(out.stdout)?
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<Vec<Value>, _>>()?;
    Ok(Run {
        code: out.status.code().unwrap_or(-1),
        events,
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

#[tokio::test]
async fn real_llama_server_streams_a_forced_bash_call_and_accepts_its_result() -> Result<()> {
    let llama = start_llama().await?;
    let h = Harness::start().await?;
    // Every turn must call Bash, so the second turn is where the run stops:
    // by then the server has taken the first call's result.
    let run = corral_run(
        &llama,
        &h.url,
        json!({
            "prompt": "Run the command: echo hello",
            "tools": ["Bash"],
            "tool_choice": "Bash",
            "limits": {"max_turns": 2, "max_output_tokens": 128},
        }),
    )
    .await?;
    let context = format!("{}\n{:#?}", run.stderr, run.events);
    assert!(run.of_type("model_failed").is_empty(), "{context}");
    let turns = run.of_type("turn_completed");
    assert_eq!(turns.len(), 2, "both requests were accepted: {context}");
    assert!(turns[0]["tool_calls"].as_u64() >= Some(1), "{context}");
    let call = run.of_type("tool_call")[0];
    assert_eq!(call["tool"], "Bash", "{context}");
    // The real stream repeats the name in every chunk: it is kept once.
    assert!(call["error"].is_null(), "{context}");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap())?;
    assert!(args["command"].is_string(), "{context}");
    assert!(!run.of_type("tool_result").is_empty(), "{context}");
    let result = run.events.last().unwrap();
    assert_eq!(result["type"], "result", "{context}");
    assert_eq!(result["turns"], 2, "{context}");
    assert_eq!(run.code, 1, "the turn limit ends the run: {context}");
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn real_llama_server_answers_text_and_the_run_is_done() -> Result<()> {
    let llama = start_llama().await?;
    let h = Harness::start().await?;
    let run = corral_run(
        &llama,
        &h.url,
        json!({
            "prompt": "Say hello.",
            "tools": [],
            "limits": {"max_turns": 3, "max_output_tokens": 512},
        }),
    )
    .await?;
    let context = format!("{}\n{:#?}", run.stderr, run.events);
    assert_eq!(run.code, 0, "{context}");
    let result = run.events.last().unwrap();
    assert_eq!(result["status"], "done", "{context}");
    assert!(
        !result["final_text"].as_str().unwrap_or("").is_empty(),
        "{context}"
    );
    h.stop().await;
    Ok(())
}
