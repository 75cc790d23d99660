//! A byte rate shared by several connections (a token bucket): what one
//! sandbox's egress (`--egress-max-bytes-per-second`) or way in
//! (`--ports-max-bytes-per-second`) may move each second, in one
//! direction, across all its connections.

use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Bytes a bucket holds at most: a second's worth, and never less than
/// this, so one move of a splice or a read is never starved.
const MIN_BURST: u64 = 64 * 1024;

/// A bucket of bytes, refilled at `per_second`.
#[derive(Debug)]
pub struct Rate {
    per_second: u64,
    burst: u64,
    state: Mutex<Bucket>,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Rate {
    /// A bucket of `per_second` bytes a second (at least 1), full.
    pub fn new(per_second: u64) -> Self {
        let per_second = per_second.max(1);
        let burst = per_second.max(MIN_BURST);
        Self {
            per_second,
            burst,
            state: Mutex::new(Bucket {
                tokens: burst as f64,
                at: Instant::now(),
            }),
        }
    }

    pub fn per_second(&self) -> u64 {
        self.per_second
    }

    /// Up to `want` bytes (at least one when `want` is), taken from the
    /// bucket; waits while it is empty. What is taken and not moved goes
    /// back with [`Self::give_back`].
    pub async fn take(&self, want: usize) -> usize {
        loop {
            match self.try_take(want) {
                Ok(n) => return n,
                Err(wait) => tokio::time::sleep(wait).await,
            }
        }
    }

    /// Up to `want` bytes now (at least one when `want` is), or how long
    /// to wait before a useful amount is back (a few milliseconds' worth,
    /// not a byte at a time).
    pub fn try_take(&self, want: usize) -> Result<usize, Duration> {
        if want == 0 {
            return Ok(0);
        }
        let mut b = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let now = Instant::now();
        let earned = now.duration_since(b.at).as_secs_f64() * self.per_second as f64;
        b.tokens = (b.tokens + earned).min(self.burst as f64);
        b.at = now;
        if b.tokens >= 1.0 {
            let n = (b.tokens.floor() as u64).min(want as u64);
            b.tokens -= n as f64;
            return Ok(n as usize);
        }
        let enough = (want as u64).min(self.per_second / 100).max(1) as f64;
        Err(
            Duration::from_secs_f64((enough - b.tokens) / self.per_second as f64)
                .max(Duration::from_millis(1)),
        )
    }

    /// Returns bytes taken and not moved.
    pub fn give_back(&self, n: usize) {
        if n == 0 {
            return;
        }
        let mut b = self.state.lock().unwrap_or_else(|p| p.into_inner());
        b.tokens = (b.tokens + n as f64).min(self.burst as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_bucket_gives_its_burst_then_its_rate() {
        let rate = Rate::new(1 << 20);
        let start = Instant::now();
        // A second's worth at once.
        let mut got = 0;
        while got < 1 << 20 {
            got += rate.take(256 * 1024).await;
        }
        assert_eq!(start.elapsed(), Duration::ZERO);
        // Then 3 MiB more take three seconds, give or take a wait.
        let mut more = 0;
        while more < 3 << 20 {
            more += rate.take(256 * 1024).await;
        }
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(2990) && took <= Duration::from_millis(3100),
            "{took:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn what_is_given_back_is_taken_again_at_once() {
        let rate = Rate::new(100_000);
        // Full: a second's worth.
        assert_eq!(rate.take(usize::MAX).await, 100_000);
        rate.give_back(1000);
        let start = Instant::now();
        assert_eq!(rate.take(5000).await, 1000);
        assert_eq!(start.elapsed(), Duration::ZERO);
        // Empty: a small rate still moves, a thousand bytes at a time.
        let n = rate.take(5000).await;
        assert!((1..=5000).contains(&n), "{n}");
        assert!(
            start.elapsed() >= Duration::from_millis(9),
            "{:?}",
            start.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn connections_share_one_rate() {
        let rate = std::sync::Arc::new(Rate::new(MIN_BURST));
        let start = Instant::now();
        let tasks: Vec<_> = (0..4)
            .map(|_| {
                let rate = std::sync::Arc::clone(&rate);
                tokio::spawn(async move {
                    let mut got = 0u64;
                    while got < MIN_BURST {
                        got += rate.take(8192).await as u64;
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        // Four bursts' worth: one at once, three at the rate.
        let took = start.elapsed();
        assert!(took >= Duration::from_millis(2990), "{took:?}");
        assert!(took <= Duration::from_millis(3200), "{took:?}");
    }
}
