//! When to try a model request again, and how long to wait first.

use std::time::Duration;

use super::model::LlmError;

/// Error codes that no retry can fix.
const NEVER_RETRIED: &[&str] = &[
    "context_length_exceeded",
    "insufficient_quota",
    "usage_not_included",
    "usage_limit_reached",
    "credit_balance_exhausted",
    "billing_hard_limit_reached",
    "invalid_prompt",
    "invalid_api_key",
    "invalid_token",
    "authentication_error",
    "permission_error",
    "cyber_policy",
    "bio_policy",
    "misalignment_policy_violation",
];

/// HTTP statuses worth another attempt.
const RETRYABLE_STATUS: &[u16] = &[
    408, 425, 429, 500, 502, 503, 504, 520, 521, 522, 523, 524, 529,
];

/// Codes that ask for a longer pause.
const OVERLOAD_CODES: &[&str] = &["server_is_overloaded", "slow_down", "overloaded_error"];

#[derive(Debug, Clone, PartialEq)]
pub struct RetryPolicy {
    /// Attempts in all, the first included.
    pub max_attempts: u32,
    pub base_delay: Duration,
    pub max_delay: Duration,
    pub overload_base_delay: Duration,
    pub overload_max_delay: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            max_attempts: 5,
            base_delay: Duration::from_secs(2),
            max_delay: Duration::from_secs(30),
            overload_base_delay: Duration::from_secs(10),
            overload_max_delay: Duration::from_secs(60),
        }
    }
}

/// Words of a server error that blame the request, not the server:
/// llama.cpp's servers report a chat template that refuses the
/// conversation as a 500 ("Jinja Exception: Conversation roles must
/// alternate ..."), and sending it again cannot help.
const INVALID_REQUEST_WORDS: &[&str] = &[
    "jinja",
    "chat template",
    "raise_exception",
    "roles must alternate",
    "unexpected role",
    "can only concatenate",
    "invalid_request_error",
];

/// A 5xx whose body says the request itself is invalid.
pub fn is_invalid_request(status: u16, code: Option<&str>, message: &str) -> bool {
    if !(500..600).contains(&status) {
        return false;
    }
    let message = message.to_ascii_lowercase();
    code == Some("invalid_request_error")
        || INVALID_REQUEST_WORDS.iter().any(|w| message.contains(w))
}

pub fn is_retryable(e: &LlmError) -> bool {
    let never = e.code().is_some_and(|c| NEVER_RETRIED.contains(&c));
    match e {
        _ if never => false,
        LlmError::Transport(_) | LlmError::Protocol { .. } => true,
        LlmError::Http {
            status,
            code,
            message,
            ..
        } if is_invalid_request(*status, code.as_deref(), message) => false,
        LlmError::Http { status, .. } => RETRYABLE_STATUS.contains(status),
        // In-band failures are retried unless known to be final.
        LlmError::InBand { .. } => !e.is_context_length_exceeded(),
        // Shrunk and built again by the session, never sent again as is.
        LlmError::EmptyAnswer { .. } => false,
        LlmError::Request(_) | LlmError::Canceled | LlmError::GaveUp { .. } => false,
    }
}

impl RetryPolicy {
    /// The wait before attempt `failures + 1`. `jitter` in `[0, 1)` takes up
    /// to 20 % off the backoff; a server's hint replaces the backoff (capped).
    pub fn delay(&self, failures: u32, e: &LlmError, jitter: f64) -> Duration {
        let overload = e.code().is_some_and(|c| OVERLOAD_CODES.contains(&c))
            || matches!(e, LlmError::Http { status: 529, .. });
        let (base, cap) = if overload {
            (self.overload_base_delay, self.overload_max_delay)
        } else {
            (self.base_delay, self.max_delay)
        };
        if let Some(hint) = hint(e) {
            return hint.min(cap);
        }
        let exp = base.saturating_mul(1u32 << failures.saturating_sub(1).min(16));
        exp.min(cap).mul_f64(1.0 - 0.2 * jitter.clamp(0.0, 1.0))
    }
}

/// `Retry-After`, or "try again in 1.5s" / "in 300ms" in a rate-limit message.
fn hint(e: &LlmError) -> Option<Duration> {
    let (retry_after, message) = match e {
        LlmError::Http {
            retry_after,
            message,
            ..
        } => (*retry_after, message.as_str()),
        LlmError::InBand { message, .. } => (None, message.as_str()),
        _ => return None,
    };
    retry_after.or_else(|| {
        let rest = &message[message.find("try again in ")? + "try again in ".len()..];
        let num: String = rest
            .chars()
            .take_while(|c| c.is_ascii_digit() || *c == '.')
            .collect();
        let n: f64 = num.parse().ok()?;
        let unit = &rest[num.len()..];
        if unit.starts_with("ms") {
            Some(Duration::from_secs_f64(n / 1000.0))
        } else if unit.starts_with('s') {
            Some(Duration::from_secs_f64(n))
        } else {
            None
        }
    })
}

/// Parses a `Retry-After` value: seconds, or an HTTP date.
pub fn parse_retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let when = httpdate::parse_http_date(value).ok()?;
    Some(
        when.duration_since(std::time::SystemTime::now())
            .unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn http(status: u16, code: Option<&str>) -> LlmError {
        LlmError::Http {
            api: "responses",
            status,
            code: code.map(String::from),
            message: "x".into(),
            retry_after: None,
        }
    }

    #[test]
    fn classification() {
        assert!(is_retryable(&http(429, None)));
        assert!(is_retryable(&http(503, None)));
        assert!(!is_retryable(&http(400, None)));
        assert!(!is_retryable(&http(401, None)));
        assert!(!is_retryable(&http(429, Some("insufficient_quota"))));
        assert!(is_retryable(&LlmError::Transport("reset".into())));
        let in_band = |code: &str| LlmError::InBand {
            api: "responses",
            code: Some(code.into()),
            message: "m".into(),
        };
        assert!(is_retryable(&in_band("server_error")));
        assert!(!is_retryable(&in_band("context_length_exceeded")));
        assert!(!is_retryable(&LlmError::Canceled));
    }

    #[test]
    fn a_server_error_that_blames_the_request_is_not_retried() {
        let e = |status: u16, message: &str| LlmError::Http {
            api: "chat completions",
            status,
            code: Some("server_error".into()),
            message: message.into(),
            retry_after: None,
        };
        // llama.cpp's C++ server and its Python server.
        assert!(!is_retryable(&e(
            500,
            "\n------------\nWhile executing CallExpression at line 19, column 27 in source:\nError: Jinja Exception: Conversation roles must alternate user/assistant/user/assistant/..."
        )));
        assert!(!is_retryable(&e(
            500,
            "Conversation roles must alternate user/assistant/user/assistant/..."
        )));
        assert!(is_retryable(&e(500, "upstream connect error")));
        assert!(is_retryable(&e(503, "loading model")));
    }

    #[test]
    fn backoff_doubles_to_the_cap_with_bounded_jitter() {
        let p = RetryPolicy::default();
        let e = http(500, None);
        assert_eq!(p.delay(1, &e, 0.0), Duration::from_secs(2));
        assert_eq!(p.delay(2, &e, 0.0), Duration::from_secs(4));
        assert_eq!(p.delay(9, &e, 0.0), Duration::from_secs(30));
        assert_eq!(p.delay(1, &e, 0.999_999).as_millis(), 1600);
        assert_eq!(p.delay(1, &http(529, None), 0.0), Duration::from_secs(10));
    }

    #[test]
    fn server_hints_win_but_are_capped() {
        let p = RetryPolicy::default();
        let mut e = http(429, None);
        if let LlmError::Http { retry_after, .. } = &mut e {
            *retry_after = Some(Duration::from_secs(7));
        }
        assert_eq!(p.delay(1, &e, 0.5), Duration::from_secs(7));
        let e = LlmError::InBand {
            api: "responses",
            code: Some("rate_limit_exceeded".into()),
            message: "Rate limit reached. Please try again in 1.5s.".into(),
        };
        assert_eq!(p.delay(3, &e, 0.5), Duration::from_millis(1500));
        let e = LlmError::InBand {
            api: "responses",
            code: None,
            message: "try again in 120ms".into(),
        };
        assert_eq!(p.delay(1, &e, 0.0), Duration::from_millis(120));
        let e = LlmError::InBand {
            api: "responses",
            code: None,
            message: "try again in 600s".into(),
        };
        assert_eq!(p.delay(1, &e, 0.0), Duration::from_secs(30));
        assert_eq!(parse_retry_after(" 12 "), Some(Duration::from_secs(12)));
        assert_eq!(
            parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO)
        );
        assert_eq!(parse_retry_after("soon"), None);
    }
}
