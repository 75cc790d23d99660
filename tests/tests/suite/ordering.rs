//! Events arrive in sequence order, and a watch from a cursor replays
//! exactly the events after it.

use corral_e2e::Harness;
use corral_proto::{EventKind, OperationId, OperationSpec, ShellSpec};
use futures_util::StreamExt;

#[tokio::test]
async fn events_are_ordered_and_replay_from_a_cursor_is_exact() -> anyhow::Result<()> {
    let h = Harness::start().await?;
    let sb = h.sandbox().await?;
    let op = OperationId::random();
    let spec = OperationSpec::Shell(ShellSpec::new(
        "for i in $(seq 1 200); do echo line $i; echo err $i >&2; done",
    ));
    h.client.submit(&sb, &op, spec).await?;
    let (events, result) = corral_e2e::collect(&h.client, &sb, &op, 0).await?;
    assert!(result.outcome.is_success());

    // Strictly increasing seqs; started first, finished last.
    assert!(
        events.windows(2).all(|w| w[0].seq < w[1].seq),
        "out of order"
    );
    assert!(matches!(events[0].kind, EventKind::Started { .. }));
    assert!(matches!(
        events.last().map(|e| &e.kind),
        Some(EventKind::Finished(_))
    ));
    let expected: String = (1..=200).map(|i| format!("line {i}\n")).collect();
    assert_eq!(String::from_utf8(corral_e2e::stdout_of(&events))?, expected);

    // From any cursor, the replay is exactly the suffix.
    for cut in [0, 1, events.len() / 3, events.len() - 2] {
        let cursor = events[cut].seq;
        let replay = corral_e2e::collect(&h.client, &sb, &op, cursor).await?.0;
        assert_eq!(
            replay,
            events[cut + 1..].to_vec(),
            "replay after seq {cursor}"
        );
    }

    // An unfiltered watch sees the same events (the sandbox has one op).
    let mut all = h.client.watch(&sb, 0, None).await?;
    let mut seen = Vec::new();
    while seen.len() < events.len() {
        seen.push(all.next().await.expect("stream ended")?);
    }
    assert_eq!(seen, events);
    h.stop().await;
    Ok(())
}
