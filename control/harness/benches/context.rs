//! Context build time against session length, and the time to put the
//! request on the wire: the provider contract's arrangement alone, then the
//! whole body of each protocol (arrangement, ids, JSON).
//!
//! Run: `cargo bench -p corral-harness --bench context`. Target: under 2 ms
//! at 5,000 items, growing linearly at most.

// A report printer: printing is its job.
#![allow(clippy::print_stdout)]

use std::time::{Duration, Instant};

use corral_harness::context::{Budget, ContextBuilder};
use corral_harness::llm::{Item, Response, StopReason, ToolOutput, chat, conform, responses};

/// p50 and p90 of 50 runs of `f`.
fn time<T>(mut f: impl FnMut() -> T) -> (Duration, Duration) {
    let mut samples: Vec<Duration> = (0..50)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(f());
            t.elapsed()
        })
        .collect();
    samples.sort();
    (samples[samples.len() / 2], samples[samples.len() * 9 / 10])
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

fn session(items: usize) -> ContextBuilder {
    let mut b = ContextBuilder::new(&[], Budget::default());
    b.set_system_prompt("Fix the failing test.");
    b.add_user_input("The build is broken; please fix it.");
    b.commit();
    // Each turn: a call and its result (about 600 characters of output).
    for i in 0..items / 2 {
        let id = format!("call_{i}");
        b.add_model_response(&Response {
            id: None,
            stop: StopReason::Complete,
            output: vec![Item::ToolCall {
                call_id: id.clone().into(),
                name: "Bash".into(),
                arguments: format!("{{\"command\":\"grep -rn needle_{i} src/\"}}").into(),
                provider_id: None,
            }],
            usage: Default::default(),
        });
        b.add_tool_result(
            &id,
            vec![ToolOutput::Text {
                text: format!("src/file_{i}.rs:{i}: needle\n").repeat(20).into(),
            }],
            false,
        );
        b.commit();
    }
    b
}

fn main() {
    println!("| items | build p50 | build p90 | per item | report changes |");
    println!("|---|---|---|---|---|");
    for items in [1_000, 5_000, 20_000] {
        let mut b = session(items);
        // Large enough that nothing is elided: this measures the copy.
        b.set_budget(Budget {
            context_window_tokens: u64::MAX / 2,
            ..Budget::default()
        });
        let mut samples: Vec<Duration> = (0..50)
            .map(|_| {
                let t = Instant::now();
                let built = b.build();
                let d = t.elapsed();
                std::hint::black_box(built);
                d
            })
            .collect();
        samples.sort();
        let p50 = samples[samples.len() / 2];
        let p90 = samples[samples.len() * 9 / 10];
        let changes = b.build().report.changes.len();
        println!(
            "| {items} | {:.3} ms | {:.3} ms | {:.0} ns | {changes} |",
            p50.as_secs_f64() * 1e3,
            p90.as_secs_f64() * 1e3,
            p50.as_nanos() as f64 / items as f64
        );
    }
    println!("\n| items | arrange p50 | Chat body p50 | Responses body p50 |");
    println!("|---|---|---|---|");
    for items in [1_000, 5_000, 20_000] {
        let mut b = session(items);
        b.set_budget(Budget {
            context_window_tokens: u64::MAX / 2,
            ..Budget::default()
        });
        let req = b.build().request;
        let (arrange, _) = time(|| conform::arrange(&req.input));
        let (chat, _) = time(|| chat::request_body(&req));
        let (resp, _) = time(|| responses::request_body(&req));
        println!(
            "| {items} | {} | {} | {} |",
            ms(arrange),
            ms(chat),
            ms(resp)
        );
    }
    // With the default 200k-token window most of a 5,000-item session has
    // to be elided: the budgeted path.
    let b = session(5_000);
    let t = Instant::now();
    let built = b.build();
    println!(
        "\n5,000 items fitted to a 200k-token window: {:.3} ms, {} outputs elided, ~{} tokens",
        t.elapsed().as_secs_f64() * 1e3,
        built.report.changes.len(),
        built.estimated_tokens
    );
}
