//! A session forked at a turn boundary.

use super::*;

/// The text an inherited call without a result gets in a fork.
pub const INTERRUPTED_BY_FORK: &str = "Error: interrupted by fork: this call had not finished when the session was forked, and its result is not part of this session.";

/// Forks `parent` into `child` at a turn boundary: everything before turn
/// `turn + 1` starts (all of it when `turn` is `None`). Calls without a
/// final result get an explicit "interrupted by fork" result, and the child
/// runs in a new sandbox.
pub(super) fn fork(
    dir: &Path,
    parent: &str,
    child: &str,
    turn: Option<u64>,
    clock: crate::session::Clock,
) -> Result<(), SessionError> {
    let mut upto = 0;
    let mut state = crate::agent::State::new();
    for rec in SessionLog::<Record>::records(dir, parent)? {
        let (seq, rec) = rec?;
        if let (Some(n), Record::Turn { turn: t }) = (turn, &rec)
            && *t > n
        {
            break;
        }
        state.apply(&rec);
        upto = seq;
    }
    if let Some(n) = turn
        && state.last_turn < n
    {
        return Err(SessionError::NoSuchTurn {
            id: parent.to_string(),
            turn: n,
            last: state.last_turn,
        });
    }
    let mut then = vec![Record::Forked {
        parent: parent.to_string(),
        sandbox_id: SandboxId::random(),
    }];
    let mut open: Vec<(&String, &crate::agent::state::CallState)> =
        state.unanswered_calls().collect();
    open.sort_by_key(|(id, _)| (*id).clone());
    for (call_id, call) in open {
        for op in &call.ops {
            if state.ops.get(op).is_some_and(|o| o.end.is_none()) {
                then.push(Record::Operation {
                    snapshot: crate::agent::record::OpSnapshot {
                        id: op.clone(),
                        status: crate::ops::OpStatus::Canceled,
                        result: None,
                        failure: Some("interrupted by fork".into()),
                        lost: false,
                    },
                });
            }
        }
        then.push(Record::Result {
            call_id: call_id.clone(),
            output: crate::tools::text(INTERRUPTED_BY_FORK),
            running: false,
        });
    }
    // A request in flight at the fork point is sent again when the child
    // resumes (its Resume record says so).
    then.push(Record::Resume {
        at_unix_ms: clock.now(),
        max_turns: None,
        model: None,
        endpoint: None,
        tool_choice: None,
        context_window_tokens: None,
        max_output_tokens: None,
        reasoning_effort: None,
    });
    SessionLog::<Record>::fork_clocked(dir, parent, child, upto, &then, clock)?;
    Ok(())
}
