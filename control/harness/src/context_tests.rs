use super::*;
use crate::llm::StopReason;

fn builder() -> ContextBuilder {
    ContextBuilder::new(&[], Budget::default())
}

fn user(text: &str) -> Item {
    Item::Message {
        role: Role::User,
        text: text.into(),
        provider_id: None,
    }
}

fn assistant(text: &str) -> Item {
    Item::Message {
        role: Role::Assistant,
        text: text.into(),
        provider_id: Some("msg_1".into()),
    }
}

fn call(id: &str) -> Item {
    Item::ToolCall {
        call_id: id.into(),
        name: "Bash".into(),
        arguments: "{}".into(),
        provider_id: None,
    }
}

fn response(output: Vec<Item>) -> Response {
    Response {
        id: None,
        stop: StopReason::Complete,
        output,
        usage: Default::default(),
    }
}

fn text(t: &str) -> Vec<ToolOutput> {
    vec![ToolOutput::Text { text: t.into() }]
}

fn result(id: &str, t: &str) -> Item {
    Item::ToolResult {
        call_id: id.into(),
        output: text(t),
    }
}

/// The conversation after the system message.
fn conversation(b: &ContextBuilder) -> Vec<Item> {
    b.build().request.input[1..].to_vec()
}

#[test]
fn adds_external_input_as_a_user_message() {
    let mut b = builder();
    b.add_user_input("hello");
    assert_eq!(conversation(&b), vec![user("hello")]);
}

#[test]
fn builds_the_request_from_added_values() {
    let mut b = builder();
    b.set_model("m1");
    b.set_max_output_tokens(Some(500));
    b.add_tool(Tool {
        name: "Bash".into(),
        description: "d".into(),
        parameters: serde_json::json!({"type": "object"}),
    });
    b.set_system_prompt("Be brief.");
    let built = b.build();
    assert_eq!(built.request.model, "m1");
    assert_eq!(built.request.max_output_tokens, Some(500));
    assert_eq!(built.request.tools.len(), 1);
    assert!(built.report.changes.is_empty());
    let Item::Message { role, text, .. } = &built.request.input[0] else {
        panic!("no system message")
    };
    assert_eq!(*role, Role::System);
    assert!(text.starts_with("You are working in a sandbox"));
    assert!(text.ends_with("\n\nBe brief."));
}

#[test]
fn the_system_prompt_changes_without_touching_the_conversation() {
    let mut b = builder();
    b.add_user_input("a");
    b.set_system_prompt("one");
    b.commit();
    b.set_system_prompt("two");
    assert!(b.system_message().ends_with("two"));
    assert_eq!(conversation(&b), vec![user("a")]);
    b.set_system_prompt("");
    assert_eq!(b.system_message(), PREAMBLE.trim());
}

#[test]
fn skills_are_listed_in_the_preamble_escaped() {
    let skills = vec![SkillInfo {
        name: "pdf<fill>".into(),
        description: "Fill \"forms\" & 'such'".into(),
        location: "/workspace/.skills/pdf/SKILL.md".into(),
    }];
    let b = ContextBuilder::new(&skills, Budget::default());
    let expected = format!(
        "{}\n\n{}\n\n<available_skills><skill><name>pdf&lt;fill&gt;</name><description>Fill &#34;forms&#34; &amp; &#39;such&#39;</description><location>/workspace/.skills/pdf/SKILL.md</location></skill></available_skills>",
        PREAMBLE.trim_end(),
        SKILLS_PREAMBLE.trim_end()
    );
    assert_eq!(b.system_message(), expected);
}

#[test]
fn a_response_goes_before_inputs_that_arrived_while_it_ran() {
    let mut b = builder();
    b.add_user_input("first");
    b.commit();
    let sent = b.build();
    b.add_user_input("while you were thinking");
    b.add_model_response(&response(vec![assistant("answer"), call("c1")]));
    assert_eq!(
        conversation(&b),
        vec![
            user("first"),
            assistant("answer"),
            call("c1"),
            user("while you were thinking")
        ]
    );
    // Commit is idempotent, and an earlier build is a snapshot.
    b.commit();
    b.commit();
    assert_eq!(sent.request.input.len(), 2);
    // An empty response is fine.
    b.add_model_response(&response(vec![]));
    assert_eq!(conversation(&b).len(), 4);
}

#[test]
fn a_running_result_is_replaced_in_place_while_staged() {
    let mut b = builder();
    b.add_model_response(&response(vec![call("c1"), call("c2")]));
    b.add_tool_result("c1", vec![], true);
    b.add_tool_result("c2", text("two"), false);
    b.add_tool_result("c1", text("one"), false);
    assert_eq!(
        conversation(&b)[2..],
        [result("c1", "one"), result("c2", "two")]
    );
}

#[test]
fn a_sent_placeholder_stays_and_the_result_follows_as_a_user_message() {
    let mut b = builder();
    b.add_model_response(&response(vec![call("c1")]));
    b.add_tool_result("c1", vec![], true);
    b.commit();
    b.add_tool_result("c1", text("done"), false);
    assert_eq!(
        conversation(&b),
        vec![
            call("c1"),
            result("c1", RUNNING_PLACEHOLDER),
            Item::UserContent {
                parts: vec![
                    ToolOutput::Text {
                        text:
                            "[The tool call c1, which was still running, has finished. Its result:]"
                                .into()
                    },
                    ToolOutput::Text {
                        text: "done".into()
                    }
                ]
            }
        ],
        "one output per call: a second one is refused by some providers"
    );
}

#[test]
fn a_completed_result_that_reads_like_the_placeholder_is_not_one() {
    let mut b = builder();
    b.add_tool_result("c1", text(RUNNING_PLACEHOLDER), false);
    b.add_tool_result("c1", text("final"), false);
    assert_eq!(
        conversation(&b),
        vec![result("c1", RUNNING_PLACEHOLDER), result("c1", "final")]
    );
}

#[test]
fn tool_result_payloads_are_kept_as_given() {
    let mut b = builder();
    let output = vec![
        ToolOutput::Text {
            text: "caf\u{e9} \u{fffd}".into(),
        },
        ToolOutput::Image {
            data_url: "data:image/png;base64,AAAA".into(),
        },
        ToolOutput::Text {
            text: "after".into(),
        },
    ];
    b.add_tool_result("c1", output.clone(), false);
    let built = b.build();
    assert_eq!(
        built.request.input[1],
        Item::ToolResult {
            call_id: "c1".into(),
            output
        }
    );
    assert!(built.report.changes.is_empty());
}

#[test]
fn effort_changes_only_later_requests() {
    let mut b = builder();
    let before = b.build();
    b.set_reasoning_effort(Some("high".into()));
    assert_eq!(before.request.reasoning_effort, None);
    assert_eq!(b.build().request.reasoning_effort.as_deref(), Some("high"));
}

#[test]
fn a_heartbeat_is_one_user_message() {
    let mut b = builder();
    b.add_heartbeat("Heartbeat: waited 600 seconds.");
    assert_eq!(
        conversation(&b),
        vec![user("Heartbeat: waited 600 seconds.")]
    );
}

#[test]
fn a_tool_result_is_never_cut_here() {
    // Tools bound their own output where it is made; a second cut would
    // give the model a wrong count of what was left out.
    let mut b = ContextBuilder::new(
        &[],
        Budget {
            max_tool_result_chars: 10,
            ..Budget::default()
        },
    );
    b.add_tool_result("c9", text("0123456789abcdefghij"), false);
    let built = b.build();
    assert_eq!(built.request.input[1], result("c9", "0123456789abcdefghij"));
    assert!(built.report.changes.is_empty());
}

#[test]
fn a_late_result_keeps_its_images() {
    let mut b = builder();
    b.add_model_response(&response(vec![call("c1")]));
    b.add_tool_result("c1", vec![], true);
    b.commit();
    let image = ToolOutput::Image {
        data_url: "data:image/png;base64,AAAA".into(),
    };
    b.add_tool_result("c1", vec![image.clone()], false);
    let Some(Item::UserContent { parts }) = conversation(&b).last().cloned() else {
        panic!("a late result is a user message")
    };
    assert_eq!(parts.last(), Some(&image));
}

#[test]
fn the_answer_reserve_follows_the_window_and_the_output_limit() {
    // The default 16,000 held for the answer at every window once left
    // nothing of an 8k or 16k window for the request.
    for (window, max_output, reserve) in [
        (4_096, None, 1_024),
        (8_192, None, 2_048),
        (16_384, None, 4_096),
        (200_000, None, 16_000),
        (8_192, Some(512), 512),
        (200_000, Some(32_000), 32_000),
    ] {
        let budget = Budget {
            context_window_tokens: window,
            reserve_output_tokens: max_output.unwrap_or(Budget::default().reserve_output_tokens),
            ..Budget::default()
        };
        assert_eq!(budget.reserve(), reserve, "window {window}, {max_output:?}");
        // A short result is kept whole in a short conversation.
        let mut b = ContextBuilder::new(&[], budget);
        b.add_user_input("list the files");
        b.commit();
        b.add_model_response(&response(vec![call("c1")]));
        b.add_tool_result("c1", text("a.txt"), false);
        b.commit();
        let built = b.build();
        assert!(
            built.report.changes.is_empty(),
            "window {window}: {:?}",
            built.report.changes
        );
        let kept = built.request.input.iter().any(|i| match i {
            Item::ToolResult { output, .. } => output
                .iter()
                .any(|o| matches!(o, ToolOutput::Text { text } if &**text == "a.txt")),
            _ => false,
        });
        assert!(kept, "window {window}: the result was not kept whole");
    }
}

#[test]
fn over_the_window_the_oldest_tool_outputs_go_first() {
    let budget = Budget {
        context_window_tokens: 2_500,
        reserve_output_tokens: 500,
        max_tool_result_chars: 100_000,
    };
    let mut b = ContextBuilder::new(&[], budget);
    b.add_user_input("do things");
    b.commit();
    for i in 0..4 {
        b.add_model_response(&response(vec![call(&format!("c{i}"))]));
        b.add_tool_result(&format!("c{i}"), text(&"x".repeat(4000)), false);
        b.commit();
    }
    let built = b.build();
    assert!(
        built.estimated_tokens <= 2_000,
        "{}",
        built.estimated_tokens
    );
    let elided: Vec<String> = built
        .report
        .changes
        .iter()
        .map(|c| c.source.clone())
        .collect();
    assert_eq!(
        elided,
        vec!["tool result c0", "tool result c1", "tool result c2"]
    );
    assert!(
        built
            .report
            .changes
            .iter()
            .all(|c| c.kind == ChangeKind::Omitted)
    );
    let conv = &built.request.input[1..];
    assert_eq!(
        conv[0],
        user("do things"),
        "user messages are never touched"
    );
    assert_eq!(
        conv[2],
        result(
            "c0",
            "[output elided to fit the context window: 4000 characters]"
        )
    );
    assert_eq!(
        conv[8],
        result("c3", &"x".repeat(4000)),
        "the latest result is kept"
    );
    // The builder itself still has everything.
    b.set_budget(Budget::default());
    assert!(b.build().report.changes.is_empty());
}

#[test]
fn a_forced_tool_choice_is_auto_once_the_tool_was_called_until_the_next_user_message() {
    let mut b = builder();
    b.set_tool_choice(Some(ToolChoice::Tool("Bash".into())));
    b.add_user_input("go");
    b.commit();
    assert_eq!(
        b.build().request.tool_choice,
        Some(ToolChoice::Tool("Bash".into()))
    );
    b.add_model_response(&response(vec![call("c1")]));
    b.add_tool_result("c1", text("done"), false);
    b.commit();
    // Called: the model may now answer in text.
    assert_eq!(b.build().request.tool_choice, Some(ToolChoice::Auto));
    // A new user message forces it again.
    b.add_user_input("again");
    b.commit();
    assert_eq!(
        b.build().request.tool_choice,
        Some(ToolChoice::Tool("Bash".into()))
    );
    // Kept when asked to be.
    b.add_model_response(&response(vec![call("c2")]));
    b.set_keep_tool_choice(true);
    assert_eq!(
        b.build().request.tool_choice,
        Some(ToolChoice::Tool("Bash".into()))
    );
    // `required` is reset by any call; another tool's call does not reset
    // a named one.
    let mut b = builder();
    b.set_tool_choice(Some(ToolChoice::Required));
    b.add_user_input("go");
    b.commit();
    b.add_model_response(&response(vec![call("c1")]));
    assert_eq!(b.build().request.tool_choice, Some(ToolChoice::Auto));
    let mut b = builder();
    b.set_tool_choice(Some(ToolChoice::Tool("ReadFile".into())));
    b.add_user_input("go");
    b.commit();
    b.add_model_response(&response(vec![call("c1")]));
    assert_eq!(
        b.build().request.tool_choice,
        Some(ToolChoice::Tool("ReadFile".into()))
    );
}

#[test]
fn every_request_bounds_its_answer() {
    let mut b = builder();
    b.add_user_input("go");
    // What the budget keeps free for the answer, unless the session says.
    assert_eq!(b.build().request.max_output_tokens, Some(16_000));
    b.set_budget(Budget {
        context_window_tokens: 8192,
        ..Budget::default()
    });
    assert_eq!(b.build().request.max_output_tokens, Some(2048));
    b.set_max_output_tokens(Some(300));
    assert_eq!(b.build().request.max_output_tokens, Some(300));
}
