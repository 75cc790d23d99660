//! The signals that stop a command: SIGINT, SIGTERM and SIGHUP.

/// How close together two deliveries of one signal are taken for one:
/// `timeout(1)` sends its signal to the command and then to the command's
/// whole process group, so the command gets it twice within microseconds;
/// a person pressing Ctrl-C twice is far slower.
pub const ONE_SIGNAL: std::time::Duration = std::time::Duration::from_millis(100);

/// The numbers of the SIGINT, SIGTERM and SIGHUP this process gets, as
/// they come; a signal again within [`ONE_SIGNAL`] of itself is the same
/// one delivered twice, and comes once.
pub fn stop_signals() -> impl futures_util::Stream<Item = i32> + Send + 'static {
    use tokio::signal::unix::{SignalKind, signal};
    let handlers = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    );
    let last: Option<(i32, tokio::time::Instant)> = None;
    futures_util::stream::unfold((handlers, last), |(mut h, mut last)| async move {
        loop {
            let sig = match &mut h {
                (Ok(int), Ok(term), Ok(hup)) => tokio::select! {
                    _ = int.recv() => 2,
                    _ = term.recv() => 15,
                    _ = hup.recv() => 1,
                },
                // No handlers (not expected on Unix): Ctrl-C alone.
                _ => {
                    tokio::signal::ctrl_c().await.ok()?;
                    2
                }
            };
            let now = tokio::time::Instant::now();
            let again = last.is_some_and(|(s, at)| s == sig && now - at < ONE_SIGNAL);
            last = Some((sig, now));
            if !again {
                return Some((sig, (h, last)));
            }
        }
    })
}

/// Resolves with the first of [`stop_signals`]. The handlers are in place
/// when this returns (not when the future is first polled), so a signal
/// that comes at once is not the default death. A second stop signal,
/// whatever this process is waiting for then (a worker that waits for its
/// Docker engine, say), ends it at once with 128 + its number, the
/// terminal's modes given back first.
pub fn stop_signal() -> impl std::future::Future<Output = i32> + Send + 'static {
    use futures_util::StreamExt;
    let signals = stop_signals();
    async move {
        let mut signals = Box::pin(signals);
        let first = signals.next().await.unwrap_or(2);
        tokio::spawn(async move {
            if let Some(second) = signals.next().await {
                leave_now(second);
            }
        });
        first
    }
}

/// Ends this process at once, as a second stop signal asks.
#[allow(clippy::print_stderr)]
fn leave_now(sig: i32) -> ! {
    crate::terminal::restore();
    eprintln!("corral: a second signal: leaving without waiting for the worker");
    std::process::exit(128 + sig)
}
