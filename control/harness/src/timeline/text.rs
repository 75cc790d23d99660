//! A [`Timeline`] for a terminal: a time axis, a row of model requests, a
//! row per lane of tool calls and a row of moments, then every step in
//! order with its detail. Plain characters only (no colour, no cursor
//! movement), so it reads the same in a pipe, a log or a test's golden
//! file. A gap where the session was suspended that would take more than
//! a tenth of the axis is drawn narrow (`//`).

use std::fmt::Write as _;

use super::{Gap, Timeline};

/// Columns taken by a row's label.
const LABEL: usize = 11;
/// Where a step's text begins (after its time and what it is).
const STEP_INDENT: usize = 32;
/// Columns a compressed gap takes.
const GAP_CELLS: usize = 3;

/// What each character of the chart means.
pub const LEGEND: &str = "model: [==] answered, ! failed, ~ superseded or canceled, > unfinished | calls: . queued, = running, + ok, x failed, P placeholder shown, L late result | moments: i input, s steer, h heartbeat, x stop, f fork, r resume, ! sandbox lost, R sandbox replaced, e egress blocked, c context shrunk, # end, /// suspended";

/// The timeline drawn `width` columns wide (at least 40).
pub fn render(t: &Timeline, width: usize) -> String {
    let width = width.max(40);
    let cells = width - LABEL;
    let axis = Axis::new(t.end_ms, &t.gaps, cells);
    let mut out = String::new();
    let _ = writeln!(out, "{}", headline(t));
    if let Some(f) = &t.forked_from {
        let _ = writeln!(
            out,
            "forked from {} after its record {}",
            f.session_id, f.upto_seq
        );
    }
    out.push('\n');
    // The axis: a label at every tenth column or so.
    let mut labels = vec![' '; cells];
    let mut ticks = vec!['-'; cells];
    let mut next_free = 0;
    for c0 in (0..cells).step_by(10) {
        let Some(ms) = axis.time_at(c0) else {
            continue;
        };
        // The round time at or before this column (a 1, 2 or 5 of the time ten
        // columns take here), where it falls.
        let span = axis
            .time_at((c0 + 10).min(cells - 1))
            .map_or(0, |next| next - ms);
        let step = round_step(span);
        let ms = ms / step * step;
        let c = axis.cell(ms);
        if ticks[c] == '|' {
            continue;
        }
        ticks[c] = '|';
        let label = short(ms);
        if c >= next_free && c + label.len() <= cells {
            for (i, ch) in label.chars().enumerate() {
                labels[c + i] = ch;
            }
            next_free = c + label.len() + 1;
        }
    }
    draw_gaps(&mut ticks, &axis, &t.gaps);
    row(&mut out, "", &labels);
    row(&mut out, "", &ticks);
    // Model requests.
    let mut model = vec![' '; cells];
    for r in &t.requests {
        let a = axis.cell(r.sent_ms);
        let (b, end) = match (r.ended_ms, r.outcome) {
            (Some(e), "answered") => (axis.cell(e), ']'),
            (Some(e), "failed") => (axis.cell(e), '!'),
            (Some(e), _) => (axis.cell(e), '~'),
            (None, _) => (cells - 1, '>'),
        };
        fill(&mut model, a, b, '=');
        model[a] = '[';
        model[b] = end;
        if a == b && end == ']' {
            model[a] = '|';
        }
    }
    draw_gaps(&mut model, &axis, &t.gaps);
    row(&mut out, "model", &model);
    // Tool calls, lane by lane.
    for lane in 0..t.lanes {
        let mut cellrow = vec![' '; cells];
        for c in t.calls.iter().filter(|c| c.lane == lane) {
            let q = axis.cell(c.queued_ms);
            let s = c.started_ms.map(|s| axis.cell(s));
            match c.ended_ms {
                Some(e) => {
                    let e = axis.cell(e);
                    fill(&mut cellrow, q, s.unwrap_or(e), '.');
                    if let Some(s) = s {
                        fill(&mut cellrow, s, e, '=');
                    }
                    cellrow[e] = if c.ok() { '+' } else { 'x' };
                }
                None => {
                    fill(&mut cellrow, q, s.unwrap_or(q), '.');
                    fill(&mut cellrow, s.unwrap_or(q), cells - 1, '=');
                    cellrow[cells - 1] = '>';
                }
            }
            if let Some(p) = c.placeholder_ms {
                cellrow[axis.cell(p)] = 'P';
            }
            if let (true, Some(r)) = (c.late, c.result_ms) {
                cellrow[axis.cell(r)] = 'L';
            }
        }
        draw_gaps(&mut cellrow, &axis, &t.gaps);
        let label = if t.lanes == 1 {
            "calls".to_string()
        } else {
            format!("calls {}", lane + 1)
        };
        row(&mut out, &label, &cellrow);
    }
    let mut moments = vec![' '; cells];
    let mut marks: Vec<&super::Mark> = t.marks.iter().collect();
    // The rarer moments are drawn last: where two fall in one column and
    // no neighbour is free, they win.
    marks.sort_by_key(|m| mark_rank(m.kind));
    draw_gaps(&mut moments, &axis, &t.gaps);
    for m in marks.into_iter().filter(|m| drawn(m.kind)) {
        let c = axis.cell(m.at_ms);
        let free = [c, c + 1, c.wrapping_sub(1), c + 2]
            .into_iter()
            .find(|&n| n < cells && moments[n] == ' ');
        moments[free.unwrap_or(c)] = mark_char(m.kind);
    }
    row(&mut out, "moments", &moments);
    out.push('\n');
    for line in wrap(LEGEND, width) {
        let _ = writeln!(out, "{line}");
    }
    out.push('\n');
    for line in steps(t) {
        for part in wrap_indented(&line, width.max(60), STEP_INDENT) {
            let _ = writeln!(out, "{}", part.trim_end());
        }
    }
    out
}

/// The first line: which session, when, how long, what it used.
pub fn headline(t: &Timeline) -> String {
    let usage = if t.totals.input_tokens == 0 && t.totals.output_tokens == 0 {
        // The server said nothing of what it used: not the same as nothing.
        "usage not reported".to_string()
    } else {
        format!(
            "{} in, {} cached, {} out tokens",
            t.totals.input_tokens, t.totals.cached_input_tokens, t.totals.output_tokens
        )
    };
    let mut s = format!(
        "session {} · {} UTC · {} · {} request{} ({usage}) · {} call{}",
        t.session_id,
        utc(t.start_unix_ms),
        long(t.end_ms),
        t.totals.requests,
        plural(t.totals.requests),
        t.totals.calls,
        plural(t.totals.calls),
    );
    match &t.ending {
        Some(e) => s.push_str(&format!(" · ended {e}")),
        None => s.push_str(" · not ended"),
    }
    s
}

fn plural(n: u64) -> &'static str {
    if n == 1 { "" } else { "s" }
}

fn row(out: &mut String, label: &str, cells: &[char]) {
    let line: String = cells.iter().collect();
    let _ = writeln!(out, "{label:<LABEL$}{}", line.trim_end());
}

fn fill(cells: &mut [char], a: usize, b: usize, ch: char) {
    for c in cells.iter_mut().take(b + 1).skip(a) {
        *c = ch;
    }
}

fn draw_gaps(cells: &mut [char], axis: &Axis, gaps: &[Gap]) {
    for g in gaps {
        if let Some((a, b)) = axis.compressed(g) {
            fill(cells, a, b, '/');
        }
    }
}

fn mark_rank(kind: &str) -> u8 {
    match kind {
        "heartbeat" => 0,
        "input" | "steer" | "egress_blocked" | "context_shrunk" => 1,
        _ => 2,
    }
}

/// Whether a moment of `kind` gets a mark on the chart (all are steps).
fn drawn(kind: &str) -> bool {
    kind != "end_when_idle"
}

fn mark_char(kind: &str) -> char {
    match kind {
        "input" => 'i',
        "steer" => 's',
        "heartbeat" => 'h',
        "stop" => 'x',
        "fork" => 'f',
        "resume" => 'r',
        "sandbox_lost" => '!',
        "sandbox_replaced" => 'R',
        "egress_blocked" => 'e',
        "context_shrunk" => 'c',
        "end" => '#',
        _ => '?',
    }
}

/// Every step in order, one line each (a call's arguments on a second).
fn steps(t: &Timeline) -> Vec<String> {
    let mut items: Vec<(i64, u64, Vec<String>)> = Vec::new();
    for r in &t.requests {
        let mut line = format!(
            "{}  {}",
            at(r.sent_ms),
            step_label(&format!("request {}", r.turn))
        );
        match r.ended_ms {
            Some(e) => line.push_str(&format!("{} after {}", r.outcome, long(e - r.sent_ms))),
            None => line.push_str(r.outcome),
        }
        if r.outcome == "answered" {
            if r.input_tokens == 0 && r.output_tokens == 0 {
                line.push_str(" · usage not reported");
            } else {
                line.push_str(&format!(
                    " · {} in ({} cached) / {} out tokens",
                    r.input_tokens, r.cached_input_tokens, r.output_tokens
                ));
            }
        }
        if !r.calls.is_empty() {
            line.push_str(&format!(" · calls {}", one_line(&r.calls.join(", "))));
        }
        let mut lines = vec![line];
        if !r.text.is_empty() {
            lines.push(format!("{:STEP_INDENT$}{}", "", one_line(&r.text)));
        }
        items.push((r.sent_ms, r.seq, lines));
    }
    for c in &t.calls {
        let mut line = format!(
            "{}  {}{} (lane {})",
            at(c.queued_ms),
            step_label(&format!("call {}", one_line(&c.call_id))),
            one_line(&c.tool),
            c.lane + 1
        );
        if c.inherited {
            line.push_str(" · from the parent");
        }
        if let Some(s) = c.started_ms {
            line.push_str(&format!(" · queued {}", long(s - c.queued_ms)));
            if let Some(e) = c.ended_ms {
                line.push_str(&format!(" · ran {}", long(e - s)));
            }
        }
        // A refusal names the model's tool; a failure carries the
        // sandbox's or the worker's words.
        line.push_str(&format!(
            " · {}",
            if c.detail.is_empty() {
                c.status.to_string()
            } else {
                one_line(&c.detail)
            }
        ));
        if let Some(p) = c.placeholder_ms {
            line.push_str(&format!(" · placeholder {}", at(p).trim_start()));
        }
        if let Some(r) = c.result_ms {
            let word = if c.late { "late result" } else { "result" };
            line.push_str(&format!(" · {word} {}", at(r).trim_start()));
        }
        items.push((
            c.queued_ms,
            c.seq,
            vec![
                line,
                format!("{:STEP_INDENT$}{}", "", one_line(&c.arguments)),
            ],
        ));
    }
    for m in &t.marks {
        items.push((
            m.at_ms,
            m.seq,
            vec![format!(
                "{}  {}{}",
                at(m.at_ms),
                step_label(&m.kind.replace('_', " ")),
                one_line(&m.text)
            )],
        ));
    }
    for g in &t.gaps {
        items.push((
            g.from_ms,
            0,
            vec![format!(
                "{}  {}for {}",
                at(g.from_ms),
                step_label(&g.kind.replace('_', " ")),
                long(g.to_ms - g.from_ms)
            )],
        ));
    }
    items.sort_by_key(|(t, seq, _)| (*t, *seq));
    items.into_iter().flat_map(|(_, _, l)| l).collect()
}

/// A step's label, padded to its column, and never run into what follows
/// (a long call id keeps a space before its tool's name).
fn step_label(label: &str) -> String {
    format!("{label:<17} ")
}

/// `s` on one line, with nothing a terminal would act on: control
/// characters (escape sequences among them), line separators and the
/// bidirectional controls that reorder what is shown come out as `\u{..}`.
/// What a model, a command or a sandbox wrote is shown, never obeyed.
fn one_line(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for word in s.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        for c in word.chars() {
            let acts = c.is_control()
                || matches!(c, '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}');
            if acts {
                out.push_str(&c.escape_unicode().to_string());
            } else {
                out.push(c);
            }
        }
    }
    out
}

/// `line` cut into lines of at most `width` columns at spaces (its
/// columns kept), every line after the first indented by `indent`.
fn wrap_indented(line: &str, width: usize, indent: usize) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line.to_string();
    let mut room = width;
    loop {
        let chars: Vec<(usize, char)> = rest.char_indices().collect();
        if chars.len() <= room {
            out.push(rest);
            return out;
        }
        // The last space that leaves a full line, else a hard cut.
        let floor = if out.is_empty() {
            indent.min(room / 2)
        } else {
            0
        };
        let cut = (floor + 1..=room)
            .rev()
            .find(|&i| chars[i].1 == ' ')
            .unwrap_or(room);
        let at = chars[cut].0;
        let (head, tail) = rest.split_at(at);
        out.push(head.trim_end().to_string());
        rest = format!("{:indent$}{}", "", tail.trim_start());
        room = width;
        if width <= indent + 10 {
            // Too narrow to indent: the rest goes as it is.
            out.push(rest);
            return out;
        }
    }
}

fn wrap(text: &str, width: usize) -> Vec<String> {
    let mut lines = Vec::new();
    let mut line = String::new();
    for word in text.split(' ') {
        if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        lines.push(line);
    }
    lines
}

/// `+12.345s` (or `+2m05.300s`, `+1h02m03s`), right-aligned.
fn at(ms: i64) -> String {
    format!("{:>12}", format!("+{}", long(ms)))
}

/// A duration to the millisecond.
pub fn long(ms: i64) -> String {
    let ms = ms.max(0);
    let (h, m, s, frac) = (ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000);
    if h > 0 {
        format!("{h}h{m:02}m{s:02}s")
    } else if m > 0 {
        format!("{m}m{s:02}.{frac:03}s")
    } else {
        format!("{s}.{frac:03}s")
    }
}

/// The round step, 1, 2 or 5 times a power of ten milliseconds, nearest
/// `span` from below (1 ms at least).
fn round_step(span: i64) -> i64 {
    let mut unit = 1;
    while unit * 10 <= span {
        unit *= 10;
    }
    [5, 2, 1]
        .into_iter()
        .map(|m| m * unit)
        .find(|&s| s <= span)
        .unwrap_or(1)
}

/// A duration for an axis label.
fn short(ms: i64) -> String {
    let ms = ms.max(0);
    if ms < 10_000 && ms % 1000 != 0 {
        format!("{:.1}s", ms as f64 / 1000.0)
    } else if ms < 120_000 {
        format!("{}s", ms / 1000)
    } else if ms < 7_200_000 {
        format!("{}m{:02}", ms / 60_000, ms / 1000 % 60)
    } else {
        format!("{}h{:02}", ms / 3_600_000, ms / 60_000 % 60)
    }
}

/// `2026-12-05 18:00:00.000`.
pub fn utc(unix_ms: i64) -> String {
    let secs = unix_ms.div_euclid(1000);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Days to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}.{:03}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60,
        unix_ms.rem_euclid(1000)
    )
}

/// Time to column, with long suspended gaps drawn narrow.
pub(super) struct Axis {
    /// (from ms, to ms, first column, columns, a compressed gap)
    pieces: Vec<(i64, i64, f64, f64, bool)>,
    cells: usize,
}

impl Axis {
    pub(super) fn new(span_ms: i64, gaps: &[Gap], cells: usize) -> Self {
        let span = span_ms.max(1);
        let long: Vec<&Gap> = gaps
            .iter()
            .filter(|g| (g.to_ms - g.from_ms) * 10 > span)
            .collect();
        let squeezed: i64 = long.iter().map(|g| g.to_ms - g.from_ms).sum();
        let active = (span - squeezed).max(1);
        // What follows a gap at the very end (a fork's first records)
        // still gets columns of its own.
        let after = long.last().map_or(span, |g| span - g.to_ms);
        let share = |cells: usize| {
            after as f64 / active as f64 * cells.saturating_sub(GAP_CELLS * long.len()) as f64
        };
        let tail = if share(cells) < GAP_CELLS as f64 {
            GAP_CELLS
        } else {
            0
        };
        let active_cells = cells.saturating_sub(GAP_CELLS * long.len() + tail).max(1) as f64;
        let mut pieces = Vec::new();
        let (mut t, mut x) = (0i64, 0f64);
        for g in long {
            // Whole columns, so a gap never shares one with what is
            // before or after it.
            let w = ((g.from_ms - t) as f64 / active as f64 * active_cells).round();
            pieces.push((t, g.from_ms, x, w, false));
            x += w;
            pieces.push((g.from_ms, g.to_ms, x, GAP_CELLS as f64, true));
            x += GAP_CELLS as f64;
            t = g.to_ms;
        }
        let w = (cells as f64 - x).max(0.0);
        pieces.push((t, span, x, w, false));
        Self { pieces, cells }
    }

    /// (from ms, to ms, first column, columns, a compressed gap)
    pub(super) fn pieces(&self) -> &[(i64, i64, f64, f64, bool)] {
        &self.pieces
    }

    /// The column of time `ms`.
    pub(super) fn cell(&self, ms: i64) -> usize {
        (self.x(ms).floor() as usize).min(self.cells - 1)
    }

    /// The position of time `ms`, in columns.
    pub(super) fn x(&self, ms: i64) -> f64 {
        for &(t0, t1, x0, w, gap) in &self.pieces {
            if ms < t1 || ms == t1 && !gap {
                if gap {
                    return x0 + w / 2.0;
                }
                if t1 == t0 {
                    return x0;
                }
                // A piece's end falls in its own last column, never in
                // the gap after it.
                let x = x0 + (ms - t0).max(0) as f64 / (t1 - t0) as f64 * w;
                return x.min(x0 + w - 1e-6).max(x0);
            }
        }
        self.cells as f64
    }

    /// The time at column `c`, unless it falls in a compressed gap.
    fn time_at(&self, c: usize) -> Option<i64> {
        let x = c as f64;
        for &(t0, t1, x0, w, gap) in &self.pieces {
            if x < x0 + w || w == 0.0 && x <= x0 {
                if gap {
                    return None;
                }
                return Some(t0 + ((x - x0) / w.max(f64::MIN_POSITIVE) * (t1 - t0) as f64) as i64);
            }
        }
        None
    }

    /// The columns of gap `g`, when it is drawn narrow.
    fn compressed(&self, g: &Gap) -> Option<(usize, usize)> {
        self.pieces
            .iter()
            .find(|p| p.4 && p.0 == g.from_ms && p.1 == g.to_ms)
            .map(|p| {
                let a = (p.2.floor() as usize).min(self.cells - 1);
                (a, (a + GAP_CELLS - 1).min(self.cells - 1))
            })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn what_a_session_holds_is_shown_never_obeyed() {
        let hostile = "ok\x1b]0;owned\x07 \x1b[2J\u{202e}txt\r\nnext";
        let shown = one_line(hostile);
        assert!(!shown.chars().any(|c| c.is_control()), "{shown:?}");
        assert!(!shown.contains('\u{202e}'), "{shown:?}");
        assert!(shown.contains("\\u{1b}]0;owned"), "{shown:?}");
    }

    #[test]
    fn axis_steps_are_round_and_labels_never_run_into_what_follows() {
        assert_eq!(round_step(2_100), 2_000);
        assert_eq!(round_step(7_300), 5_000);
        assert_eq!(round_step(1_000), 1_000);
        assert_eq!(round_step(140), 100);
        assert_eq!(round_step(0), 1);
        let long_id = step_label("call call_0123456789abcdef");
        assert!(long_id.ends_with(' '), "{long_id:?}");
        assert_eq!(step_label("input").len(), 18);
    }

    #[test]
    fn times_and_dates_read_as_people_write_them() {
        assert_eq!(utc(1_796_461_200_000), "2026-12-05 09:00:00.000");
        assert_eq!(utc(0), "1970-01-01 00:00:00.000");
        assert_eq!(utc(951_782_400_123), "2000-02-29 00:00:00.123");
        assert_eq!(long(1_234), "1.234s");
        assert_eq!(long(125_000), "2m05.000s");
        assert_eq!(long(3_723_000), "1h02m03s");
    }
}
