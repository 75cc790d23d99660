//! Notices when this process's runtime falls behind: a task that blocks a
//! runtime thread, or a host too busy to run the process at all. While it
//! lasts, nothing here answers, not even a connection's keepalive pings,
//! so clients may drop their connections; the warning says so, with how
//! long it lasted, where an operator (or a failed test's output) sees it.

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// How often the watch looks.
pub const TICK: Duration = Duration::from_millis(250);
/// A delay past its tick this long is reported.
pub const REPORT_AFTER: Duration = Duration::from_secs(2);

/// How far past `due` a tick woken at `now` came, if far enough to say.
pub fn late_by(due: Instant, now: Instant) -> Option<Duration> {
    let late = now.saturating_duration_since(due);
    (late >= REPORT_AFTER).then_some(late)
}

/// Watches the runtime it runs on until `stop`: one warning per stall.
pub async fn watch(what: &'static str, stop: CancellationToken) {
    loop {
        let due = Instant::now() + TICK;
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep_until(due) => {}
        }
        if let Some(late) = late_by(due, Instant::now()) {
            tracing::warn!(
                process = what,
                stalled_ms = u64::try_from(late.as_millis()).unwrap_or(u64::MAX),
                "the runtime fell behind: for this long nothing in this process ran (a task \
                 blocking a runtime thread, or a host too busy); clients' keepalive pings went \
                 unanswered meanwhile"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_delay_past_the_bound_is_reported() {
        let due = Instant::now();
        assert_eq!(late_by(due, due), None);
        assert_eq!(late_by(due, due + Duration::from_millis(1999)), None);
        assert_eq!(late_by(due, due + REPORT_AFTER), Some(REPORT_AFTER));
        // Early (a clock read before the tick was due) is not late.
        assert_eq!(late_by(due + Duration::from_secs(5), due), None);
    }

    #[tokio::test(start_paused = true)]
    async fn the_watch_ends_when_told() {
        let stop = CancellationToken::new();
        let task = tokio::spawn(watch("test", stop.clone()));
        tokio::time::sleep(TICK * 10).await;
        stop.cancel();
        task.await.unwrap();
    }
}
