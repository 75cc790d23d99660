//! Every scenario that once produced a request a real server refuses, run
//! end to end (the `corral` binary, a real worker and sandboxes) on both
//! wire protocols, against the scripted server with every strict profile:
//! OpenAI's rules on both paths, and on Chat Completions also those of
//! mistral_common, the Mistral and Gemma templates, DeepSeek and llama.cpp.
//! Each test also checks that no request was refused.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result};
use corral_e2e::Harness;
use corral_e2e::model::{ModelServer, Received, Reply, chat, responses, sse};
use corral_e2e::run::{Run, command, corral_run};
use corral_e2e::strict::Profile;
use corral_harness::agent::record::{CallOutcome, Record};
use corral_harness::llm::{Item, Response, StopReason, Usage};
use corral_harness::session::SessionLog;
use serde_json::json;
use tokio::io::AsyncWriteExt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Responses,
    Chat,
}

const APIS: [Api; 2] = [Api::Responses, Api::Chat];

impl Api {
    fn flag(self) -> &'static str {
        match self {
            Api::Responses => "responses",
            Api::Chat => "chat",
        }
    }

    fn text(self, t: &str) -> Reply {
        match self {
            Api::Responses => responses::text(t),
            Api::Chat => chat::text(t),
        }
    }

    fn calls(self, list: &[(&str, &str, &str)]) -> Reply {
        match self {
            Api::Responses => responses::calls(list),
            Api::Chat => chat::calls(list),
        }
    }

    /// An answer that is reasoning only: no text, no call.
    fn reasoning_only(self) -> Reply {
        match self {
            Api::Responses => sse(&[responses::completed(
                json!([{"type": "reasoning", "id": "rs_only", "summary": [],
                        "encrypted_content": "gAAAA-opaque"}]),
                "completed",
                json!({}),
            )]),
            Api::Chat => sse(&[
                json!({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "reasoning_content": "hmm"}, "finish_reason": null}]}),
                json!({"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
            ])
            .tap_done(),
        }
    }
}

/// A strict server: OpenAI's rules on both paths, and every other profile
/// on Chat Completions.
async fn server(replies: Vec<Reply>) -> ModelServer {
    ModelServer::strict(replies, &Profile::ALL).await
}

fn bash(cmd: &str) -> String {
    json!({ "command": cmd }).to_string()
}

fn assert_all_accepted(got: &[Received], api: Api) {
    for r in got {
        assert!(
            r.refused.is_none(),
            "{api:?}: a real server refuses this request: {}\n{}",
            r.refused.as_ref().unwrap(),
            serde_json::to_string_pretty(&r.body).unwrap()
        );
    }
}

async fn run(model: &ModelServer, h: &Harness, dir: &Path, api: Api, args: &[&str]) -> Result<Run> {
    let mut all = vec!["--api", api.flag(), "--model", "gpt-5-mini"];
    all.extend_from_slice(args);
    corral_run(model, &h.url, dir, &all).await
}

fn done(run: &Run, api: Api) {
    assert_eq!(run.code, 0, "{api:?}: {}\n{:#?}", run.stderr, run.events);
    assert_eq!(run.result()["status"], "done", "{api:?}");
}

#[tokio::test]
async fn a_heartbeat_before_the_first_placeholder_is_sent() -> Result<()> {
    let h = Harness::start().await?;
    for api in APIS {
        let dir = tempfile::tempdir()?;
        let mut replies = vec![api.calls(&[("c1", "Bash", &bash("sleep 3; echo finished"))])];
        replies.extend((0..6).map(|_| api.text("still waiting")));
        let model = server(replies).await;
        let r = run(
            &model,
            &h,
            dir.path(),
            api,
            &["--heartbeat", "1s", "--", "go"],
        )
        .await?;
        done(&r, api);
        let got = model.received();
        assert_all_accepted(&got, api);
        assert!(!r.of_type("heartbeat").is_empty(), "{api:?}: no heartbeat");
        assert!(
            got.iter().any(|g| g.text().contains("finished")),
            "{api:?}: the result reached the model"
        );
    }
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_heartbeat_after_the_first_placeholder_is_sent() -> Result<()> {
    let h = Harness::start().await?;
    for api in APIS {
        let dir = tempfile::tempdir()?;
        let mut replies = vec![api.calls(&[
            ("c1", "Bash", &bash("sleep 4; echo slow")),
            ("c2", "Bash", &bash("echo fast")),
        ])];
        replies.extend((0..8).map(|_| api.text("waiting")));
        let model = server(replies).await;
        let r = run(
            &model,
            &h,
            dir.path(),
            api,
            &["--heartbeat", "1s", "--", "go"],
        )
        .await?;
        done(&r, api);
        assert_all_accepted(&model.received(), api);
        assert!(!r.of_type("heartbeat").is_empty(), "{api:?}: no heartbeat");
    }
    h.stop().await;
    Ok(())
}

/// Lines typed on stdin: one while a call runs, one while a request is in
/// flight (which steers it).
#[tokio::test]
async fn lines_typed_while_a_call_runs_and_while_a_request_is_in_flight() -> Result<()> {
    let h = Harness::start().await?;
    for api in APIS {
        let dir = tempfile::tempdir()?;
        let model = server(vec![
            api.calls(&[("c1", "Bash", &bash("sleep 3; echo slept"))]),
            api.text("the call runs").after(Duration::from_secs(30)),
            api.text("noted"),
            api.text("all done"),
            api.text("all done"),
        ])
        .await;
        let mut cmd = command(
            &model,
            &h.url,
            dir.path(),
            &[
                "--api",
                api.flag(),
                "--model",
                "gpt-5-mini",
                "--inputs-from-stdin",
                "go",
            ],
        );
        cmd.stdin(Stdio::piped());
        let mut child = cmd.spawn()?;
        let mut stdin = child.stdin.take().context("stdin")?;
        // The call runs (its request came and went): a line while it runs.
        model.wait_for(1, Duration::from_secs(30)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        stdin.write_all(b"typed while the call runs\n").await?;
        // The second request is held by the server: a line steers it.
        model.wait_for(2, Duration::from_secs(30)).await;
        stdin
            .write_all(b"typed while a request is in flight\n")
            .await?;
        drop(stdin);
        let out = tokio::time::timeout(Duration::from_secs(90), child.wait_with_output()).await??;
        assert_eq!(
            out.status.code(),
            Some(0),
            "{api:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got = model.received();
        assert_all_accepted(&got, api);
        let last = got.last().unwrap().text();
        assert!(
            last.contains("typed while the call runs")
                && last.contains("typed while a request is in flight"),
            "{api:?}: {last}"
        );
    }
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_late_result_arrives_while_a_newer_call_runs() -> Result<()> {
    let h = Harness::start().await?;
    for api in APIS {
        let dir = tempfile::tempdir()?;
        // The old call's placeholder goes out with the fast one's result;
        // it finishes while the newer call runs.
        let mut replies = vec![
            api.calls(&[
                ("old", "Bash", &bash("sleep 3; echo old-done")),
                ("fast", "Bash", &bash("echo fast")),
            ]),
            api.calls(&[("new", "Bash", &bash("sleep 4; echo new-done"))]),
        ];
        replies.extend((0..5).map(|_| api.text("ok")));
        let model = server(replies).await;
        let r = run(&model, &h, dir.path(), api, &["go"]).await?;
        done(&r, api);
        let got = model.received();
        assert_all_accepted(&got, api);
        let last = got.last().unwrap().text();
        assert!(
            last.contains("old-done") && last.contains("new-done"),
            "{api:?}: {last}"
        );
    }
    h.stop().await;
    Ok(())
}

const PNG_B64: &str = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==";

#[tokio::test]
async fn view_image_alone_and_beside_another_call() -> Result<()> {
    let h = Harness::start().await?;
    let make = bash(&format!("echo {PNG_B64} | base64 -d > /workspace/dot.png"));
    let view = r#"{"path": "/workspace/dot.png"}"#;
    for api in APIS {
        for beside in [false, true] {
            let dir = tempfile::tempdir()?;
            let mut second = vec![("v", "ViewImage", view)];
            let echo = bash("echo beside");
            if beside {
                second.push(("e", "Bash", &echo));
            }
            let model = server(vec![
                api.calls(&[("m", "Bash", &make)]),
                api.calls(&second),
                api.text("a dot"),
                api.text("a dot"),
            ])
            .await;
            let r = run(&model, &h, dir.path(), api, &["look"]).await?;
            done(&r, api);
            let got = model.received();
            assert_all_accepted(&got, api);
            let third = got[2].text();
            assert!(
                third.contains("data:image/png;base64,"),
                "{api:?}: the image reached the model"
            );
            assert!(!beside || third.contains("beside"), "{api:?}");
        }
    }
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_reasoning_only_answer_then_a_new_prompt() -> Result<()> {
    let h = Harness::start().await?;
    for api in APIS {
        let dir = tempfile::tempdir()?;
        let model = server(vec![api.reasoning_only(), api.text("second answer")]).await;
        let first = run(&model, &h, dir.path(), api, &["--session", "r", "think"]).await?;
        done(&first, api);
        let second = run(
            &model,
            &h,
            dir.path(),
            api,
            &["--session", "r", "now answer"],
        )
        .await?;
        done(&second, api);
        let got = model.received();
        assert_eq!(got.len(), 2, "{api:?}");
        assert_all_accepted(&got, api);
        assert!(got[1].text().contains("now answer"), "{api:?}");
    }
    h.stop().await;
    Ok(())
}

/// A 72-character session id, a small output-token limit, a reasoning
/// effort and a tool choice: each sent as the server wants it.
#[tokio::test]
async fn a_72_character_session_id_and_a_small_output_token_limit() -> Result<()> {
    let h = Harness::start().await?;
    let id = "s".repeat(72);
    for api in APIS {
        let dir = tempfile::tempdir()?;
        let request = dir.path().join("request.json");
        std::fs::write(
            &request,
            json!({"prompt": "hi", "limits": {"max_output_tokens": 10}}).to_string(),
        )?;
        let model = server(vec![api.text("hello")]).await;
        let r = run(
            &model,
            &h,
            dir.path(),
            api,
            &[
                "--session",
                &id,
                "--reasoning-effort",
                "low",
                "--tool-choice",
                "Bash",
                "--request",
                request.to_str().unwrap(),
            ],
        )
        .await?;
        done(&r, api);
        let got = model.received();
        assert_all_accepted(&got, api);
        let body = &got[0].body;
        match api {
            Api::Responses => {
                let key = body["prompt_cache_key"].as_str().unwrap();
                assert!(key.len() <= 64 && !key.contains(&id), "{key}");
                assert_eq!(body["max_output_tokens"], 16, "OpenAI's smallest");
                assert_eq!(body["reasoning"]["effort"], "low");
                assert_eq!(body["include"], json!(["reasoning.encrypted_content"]));
                assert_eq!(
                    body["tool_choice"],
                    json!({"type": "function", "name": "Bash"})
                );
            }
            Api::Chat => {
                assert_eq!(body["max_completion_tokens"], 10);
                assert!(body.get("max_tokens").is_none());
                assert_eq!(body["reasoning_effort"], "low");
                assert_eq!(
                    body["tool_choice"],
                    json!({"type": "function", "function": {"name": "Bash"}})
                );
            }
        }
    }
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_call_id_repeated_by_the_server() -> Result<()> {
    let h = Harness::start().await?;
    for api in APIS {
        let dir = tempfile::tempdir()?;
        let model = server(vec![
            api.calls(&[("call_0", "Bash", &bash("echo one"))]),
            api.calls(&[("call_0", "Bash", &bash("echo two"))]),
            api.text("both"),
        ])
        .await;
        let r = run(&model, &h, dir.path(), api, &["go"]).await?;
        done(&r, api);
        let got = model.received();
        assert_all_accepted(&got, api);
        let last = got[2].text();
        assert!(last.contains("one") && last.contains("two"), "{api:?}");
    }
    h.stop().await;
    Ok(())
}

/// A session written by an older build, whose requests every strict
/// server refuses (a heartbeat between a call and its result), heals:
/// the next request is valid.
#[tokio::test]
async fn a_session_recorded_with_an_invalid_prefix_heals_on_resume() -> Result<()> {
    let h = Harness::start().await?;
    for api in APIS {
        let dir = tempfile::tempdir()?;
        let sandbox = h.sandbox().await?;
        let mut config = corral_e2e::session_config("gpt-5-mini", sandbox);
        // Placed on this test's worker: a session recorded with none
        // resumes on the local one.
        config.worker = Some(h.url.clone());
        let call = Item::ToolCall {
            call_id: "c1".into(),
            name: "Nope".into(),
            arguments: "{}".into(),
            provider_id: None,
        };
        let mut log = SessionLog::<Record>::create(dir.path(), "old")?;
        for rec in [
            Record::Start { config },
            Record::Input {
                input_id: "i1".into(),
                text: "start".into(),
            },
            Record::Turn { turn: 1 },
            Record::Response {
                turn: 1,
                response: Response {
                    id: None,
                    stop: StopReason::Complete,
                    output: vec![call],
                    usage: Usage::default(),
                },
            },
            // An older build staged the heartbeat before the call's result.
            Record::Heartbeat {
                text: "still running".into(),
            },
            Record::Call {
                call_id: "c1".into(),
                tool: "Nope".into(),
                arguments: "{}".into(),
                turn: 1,
                at_unix_ms: 0,
                outcome: CallOutcome::Error {
                    text: "Error: tool \"Nope\" is not available".into(),
                },
                operations: Vec::new(),
            },
            Record::Result {
                call_id: "c1".into(),
                output: corral_harness::tools::text("Error: tool \"Nope\" is not available"),
                running: false,
            },
            Record::Turn { turn: 2 },
            Record::ModelFailure {
                turn: 2,
                error:
                    "400 An assistant message with 'tool_calls' must be followed by tool messages"
                        .into(),
                code: None,
            },
        ] {
            log.append(&rec)?;
        }
        drop(log);
        let model = server(vec![api.text("healed")]).await;
        let r = run(&model, &h, dir.path(), api, &["--session", "old", "go on"]).await?;
        done(&r, api);
        assert_all_accepted(&model.received(), api);
    }
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn max_turns_bounds_each_run_of_a_session() -> Result<()> {
    let h = Harness::start().await?;
    for api in APIS {
        let dir = tempfile::tempdir()?;
        let model = server(vec![
            api.calls(&[("c1", "Bash", &bash("echo one"))]),
            api.calls(&[("c2", "Bash", &bash("echo two"))]),
            api.text("done"),
        ])
        .await;
        let first = run(
            &model,
            &h,
            dir.path(),
            api,
            &["--session", "m", "--max-turns", "1", "go"],
        )
        .await?;
        assert_eq!(first.code, 1, "{api:?}: the first run stops at its limit");
        let second = run(
            &model,
            &h,
            dir.path(),
            api,
            &["--session", "m", "--max-turns", "2", "go on"],
        )
        .await?;
        done(&second, api);
        assert_eq!(second.result()["turns"], 3, "{api:?}");
        assert_all_accepted(&model.received(), api);
    }
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_hundred_thousand_lines_of_output_say_exactly_what_was_left_out() -> Result<()> {
    let h = Harness::start().await?;
    for api in APIS {
        let dir = tempfile::tempdir()?;
        let model = server(vec![
            api.calls(&[("c1", "Bash", &bash("seq 1 100000"))]),
            api.text("counted"),
        ])
        .await;
        let r = run(&model, &h, dir.path(), api, &["count"]).await?;
        done(&r, api);
        let got = model.received();
        assert_all_accepted(&got, api);
        // 588,895 bytes in all; 20,000 of the head and of the tail are kept.
        let marker = "[... 548895 bytes omitted ...]";
        let shown = r.of_type("tool_result")[0]["text"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(shown.contains(marker), "{api:?}");
        assert!(shown.starts_with("1\n2\n3\n") && shown.ends_with("99999\n100000"));
        assert_eq!(shown.matches("omitted").count(), 1, "cut once");
        assert!(got[1].text().contains(marker), "{api:?}");
    }
    h.stop().await;
    Ok(())
}

/// A session resumed without `--base-url` or `--api` goes back to the
/// endpoint it was recorded with.
#[tokio::test]
async fn a_resumed_session_keeps_its_endpoint() -> Result<()> {
    let h = Harness::start().await?;
    let dir = tempfile::tempdir()?;
    let model = server(vec![chat::text("one"), chat::text("two")]).await;
    let first = run(&model, &h, dir.path(), Api::Chat, &["--session", "e", "hi"]).await?;
    done(&first, Api::Chat);
    // No --api this time: the recorded one (chat) is used.
    let second = corral_run(&model, &h.url, dir.path(), &["--session", "e", "again"]).await?;
    done(&second, Api::Chat);
    let got = model.received();
    assert_eq!(got.len(), 2);
    assert!(got.iter().all(|g| g.path.ends_with("/chat/completions")));
    h.stop().await;
    Ok(())
}

/// A thinking model on Chat Completions (DeepSeek, vLLM's reasoning
/// parsers): the reasoning streamed with tool calls goes back with them,
/// which DeepSeek's thinking mode requires.
#[tokio::test]
async fn reasoning_content_goes_back_with_its_tool_calls() -> Result<()> {
    let h = Harness::start().await?;
    let dir = tempfile::tempdir()?;
    let chunk = |delta: serde_json::Value, finish: serde_json::Value| json!({"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
    let thinking = sse(&[
        chunk(
            json!({"role": "assistant", "reasoning_content": "I should "}),
            json!(null),
        ),
        chunk(json!({"reasoning_content": "list the files."}), json!(null)),
        chunk(
            json!({"tool_calls": [{"index": 0, "id": "k1Lm2Nb3Q", "type": "function",
                   "function": {"name": "Bash", "arguments": "{\"command\": \"ls /\"}"}}]}),
            json!(null),
        ),
        chunk(json!({}), json!("tool_calls")),
    ])
    .tap_done();
    let model = server(vec![thinking, chat::text("listed")]).await;
    let r = run(&model, &h, dir.path(), Api::Chat, &["list"]).await?;
    done(&r, Api::Chat);
    let got = model.received();
    assert_all_accepted(&got, Api::Chat);
    let assistant = got[1].body["messages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["role"] == "assistant")
        .cloned()
        .unwrap();
    assert_eq!(assistant["reasoning_content"], "I should list the files.");
    assert_eq!(
        assistant["tool_calls"][0]["id"], "k1Lm2Nb3Q",
        "a strict id is kept"
    );
    h.stop().await;
    Ok(())
}

/// Request histories that open with the assistant (the templates want the
/// user first) or end with it (nothing is left to answer: no request).
#[tokio::test]
async fn request_histories_that_open_or_end_with_the_assistant() -> Result<()> {
    let h = Harness::start().await?;
    for api in APIS {
        let dir = tempfile::tempdir()?;
        let opens = dir.path().join("opens.json");
        std::fs::write(
            &opens,
            json!({"messages": [{"role": "assistant", "content": "How can I help?"},
                                {"role": "user", "content": "say hi"}]})
            .to_string(),
        )?;
        let ends = dir.path().join("ends.json");
        std::fs::write(
            &ends,
            json!({"messages": [{"role": "user", "content": "say hi"},
                                {"role": "assistant", "content": "hi"}]})
            .to_string(),
        )?;
        let model = server(vec![api.text("hi")]).await;
        let r = run(
            &model,
            &h,
            dir.path(),
            api,
            &["--request", opens.to_str().unwrap()],
        )
        .await?;
        done(&r, api);
        let r = run(
            &model,
            &h,
            dir.path(),
            api,
            &["--request", ends.to_str().unwrap()],
        )
        .await?;
        done(&r, api);
        let got = model.received();
        assert_eq!(
            got.len(),
            1,
            "{api:?}: a history that ends answered asks nothing"
        );
        assert_all_accepted(&got, api);
    }
    h.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_tool_choice_naming_no_offered_tool_is_a_usage_error() -> Result<()> {
    let h = Harness::start().await?;
    let dir = tempfile::tempdir()?;
    let model = server(Vec::new()).await;
    let r = run(
        &model,
        &h,
        dir.path(),
        Api::Chat,
        &["--tool-choice", "Bsh", "x"],
    )
    .await?;
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("--tool-choice Bsh"), "{}", r.stderr);
    assert!(model.received().is_empty());
    h.stop().await;
    Ok(())
}

/// A resumed session takes what its run gives of the tool choice, the
/// answer bound and the reasoning effort (recorded with the resume, kept
/// by later runs); the turn limit it fails at is this run's; its summary
/// counts this run's turns beside the session's.
#[tokio::test]
async fn a_resume_applies_the_tool_choice_answer_bound_and_turn_limit_it_is_given() -> Result<()> {
    let h = Harness::start().await?;
    for api in APIS {
        let dir = tempfile::tempdir()?;
        let model = server(vec![
            api.text("first"),
            api.calls(&[("c1", "Bash", &bash("echo one"))]),
            api.text("third"),
        ])
        .await;
        let first = run(&model, &h, dir.path(), api, &["--session", "r", "hi"]).await?;
        done(&first, api);
        let second = run(
            &model,
            &h,
            dir.path(),
            api,
            &[
                "--session",
                "r",
                "--tool-choice",
                "Bash",
                "--max-output-tokens",
                "777",
                "--reasoning-effort",
                "low",
                "--max-turns",
                "1",
                "again",
            ],
        )
        .await?;
        assert_eq!(second.code, 1, "{api:?}: {}", second.stderr);
        let result = second.result();
        assert_eq!(
            result["error"], "the run reached its limit of 1 turns",
            "{api:?}"
        );
        assert_eq!(
            (result["run_turns"].as_u64(), result["turns"].as_u64()),
            (Some(1), Some(2))
        );
        let got = model.received();
        assert_all_accepted(&got, api);
        let (before, after) = (&got[0].body, &got[1].body);
        assert!(before.get("tool_choice").is_none(), "{api:?}: {before}");
        let (bound, choice) = match api {
            Api::Responses => (
                "max_output_tokens",
                json!({"type": "function", "name": "Bash"}),
            ),
            Api::Chat => (
                "max_completion_tokens",
                json!({"type": "function", "function": {"name": "Bash"}}),
            ),
        };
        assert_eq!(after["tool_choice"], choice, "{api:?}");
        assert_eq!(after[bound], 777, "{api:?}");
        // Kept by the next run, which changes nothing.
        let third = run(&model, &h, dir.path(), api, &["--session", "r", "and now?"]).await?;
        done(&third, api);
        let got = model.received();
        assert_eq!(got[2].body["tool_choice"], choice, "{api:?}");
        assert_eq!(got[2].body[bound], 777, "{api:?}");
    }
    h.stop().await;
    Ok(())
}

/// A Chat Completions server that says its window (llama.cpp's own
/// answers `GET /props` with its `n_ctx`) gets requests built for it; a
/// window given on the command line wins, and a server that answers 404
/// (OpenAI, vLLM, Ollama) leaves the default.
#[tokio::test]
async fn a_local_servers_own_window_is_read_from_its_props() -> Result<()> {
    let h = Harness::start().await?;
    let window = |dir: &Path, id: &str| -> Result<u64> {
        Ok(corral_harness::agent::replay(dir, id)?
            .config
            .context("a config")?
            .budget
            .context_window_tokens)
    };
    let dir = tempfile::tempdir()?;
    let model = server(vec![
        Api::Chat.text("a"),
        Api::Chat.text("b"),
        Api::Chat.text("c"),
    ])
    .await;
    let plain = run(
        &model,
        &h,
        dir.path(),
        Api::Chat,
        &["--session", "plain", "hi"],
    )
    .await?;
    done(&plain, Api::Chat);
    let default = corral_harness::context::Budget::default().context_window_tokens;
    assert_eq!(
        window(dir.path(), "plain")?,
        default,
        "a 404 leaves the default"
    );
    model.serve_props(json!({"default_generation_settings": {"n_ctx": 4096}, "total_slots": 1}));
    let local = run(
        &model,
        &h,
        dir.path(),
        Api::Chat,
        &["--session", "local", "hi"],
    )
    .await?;
    done(&local, Api::Chat);
    assert_eq!(window(dir.path(), "local")?, 4096);
    let given = run(
        &model,
        &h,
        dir.path(),
        Api::Chat,
        &["--session", "given", "--context-window", "3000", "hi"],
    )
    .await?;
    done(&given, Api::Chat);
    assert_eq!(window(dir.path(), "given")?, 3000);
    assert_eq!(
        model.received().len(),
        3,
        "the settings are not model calls"
    );
    h.stop().await;
    Ok(())
}

/// A command that runs past its timeout is reported as `timed_out`, not
/// as any failure.
#[tokio::test]
async fn a_timed_out_call_says_so() -> Result<()> {
    let h = Harness::start().await?;
    let dir = tempfile::tempdir()?;
    let slow = json!({"command": "sleep 30", "timeout_seconds": 1}).to_string();
    let model = server(vec![
        Api::Responses.calls(&[("c1", "Bash", &slow)]),
        Api::Responses.text("It was too slow."),
    ])
    .await;
    let r = run(&model, &h, dir.path(), Api::Responses, &["wait"]).await?;
    done(&r, Api::Responses);
    let result = &r.of_type("tool_result")[0];
    assert_eq!(result["status"], "timed_out", "{result}");
    assert_eq!(result["exit_code"], serde_json::Value::Null, "{result}");
    h.stop().await;
    Ok(())
}
