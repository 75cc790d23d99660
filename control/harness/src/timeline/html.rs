//! A [`Timeline`] as one self-contained HTML page: the same rows as the
//! terminal view (model requests, lanes of tool calls, moments) drawn on a
//! time axis, every step listed below, and the detail of any step shown
//! when it is clicked. The data travels inside the page; its script and
//! style are inline and its content security policy allows nothing else,
//! so opening it fetches nothing from anywhere.

use super::Timeline;
use super::text::{Axis, headline};

/// Columns the axis is computed in (the page scales them).
const AXIS_COLUMNS: usize = 200;

/// The page for `t`.
pub fn render(t: &Timeline) -> String {
    let axis = Axis::new(t.end_ms, &t.gaps, AXIS_COLUMNS);
    let pieces: Vec<serde_json::Value> = axis
        .pieces()
        .iter()
        .map(|&(t0, t1, x0, w, gap)| {
            serde_json::json!([
                t0,
                t1,
                x0 / AXIS_COLUMNS as f64,
                w / AXIS_COLUMNS as f64,
                gap
            ])
        })
        .collect();
    let data = serde_json::json!({ "timeline": t, "axis": pieces });
    // Inside <script>, nothing may close the element or open a comment.
    let data = data
        .to_string()
        .replace('<', "\\u003c")
        .replace('>', "\\u003e")
        .replace('&', "\\u0026");
    let title = crate::context::xml_escape(&headline(t));
    PAGE.replace("{{TITLE}}", &title)
        .replace("{{SESSION}}", &crate::context::xml_escape(&t.session_id))
        .replace("{{DATA}}", &data)
}

const PAGE: &str = r##"<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Timeline of session {{SESSION}}</title>
<style>
body { font: 13px/1.4 system-ui, sans-serif; margin: 16px; color: #1d232b; background: #fbfbfc; }
h1 { font-size: 15px; font-weight: 600; margin: 0 0 12px; }
#chart { position: relative; border: 1px solid #d5d9e0; background: #fff; padding: 4px 0; }
.row { position: relative; height: 22px; border-bottom: 1px solid #f0f2f5; }
.row:last-child { border-bottom: 0; }
.label { position: absolute; left: 6px; top: 3px; width: 84px; color: #56606d; font-size: 12px; white-space: nowrap; overflow: hidden; }
.track { position: absolute; left: 96px; right: 12px; top: 0; bottom: 0; }
.axis { height: 20px; }
.tick { position: absolute; top: 2px; font-size: 11px; color: #7a8491; border-left: 1px solid #c8ced6; padding-left: 3px; height: 16px; }
.item { position: absolute; top: 4px; height: 14px; min-width: 3px; border-radius: 3px; cursor: pointer; box-sizing: border-box; }
.item:hover, .item.selected { outline: 2px solid #1d232b; z-index: 2; }
.req { background: #6d8fd8; }
.req.failed { background: #d86d6d; }
.req.superseded { background: #b7c3dd; }
.req.unfinished { background: repeating-linear-gradient(45deg, #6d8fd8, #6d8fd8 4px, #9fb4e6 4px, #9fb4e6 8px); }
.call { background: #5dad7a; }
.call.bad { background: #d86d6d; }
.call .queued { position: absolute; top: 0; bottom: 0; left: 0; background: #d7dde6; border-radius: 3px 0 0 3px; }
.pin { position: absolute; top: -3px; width: 2px; height: 20px; }
.pin.placeholder { background: #e0a030; }
.pin.late { background: #8e44ad; }
.mark { position: absolute; top: 3px; width: 12px; height: 16px; margin-left: -6px; text-align: center; font: 600 11px/16px ui-monospace, monospace; border-radius: 3px; cursor: pointer; color: #fff; background: #56606d; }
.mark.steer { background: #e0a030; } .mark.input { background: #3a7bd5; } .mark.heartbeat { background: #9aa3ae; }
.mark.stop, .mark.sandbox_lost, .mark.egress_blocked { background: #c0392b; } .mark.fork, .mark.sandbox_replaced { background: #8e44ad; }
.mark.end { background: #1d232b; }
.gap { position: absolute; top: 0; bottom: 0; background: repeating-linear-gradient(135deg, #eceff3, #eceff3 3px, #fff 3px, #fff 6px); }
#detail { margin-top: 12px; padding: 8px 10px; border: 1px solid #d5d9e0; background: #fff; min-height: 40px; white-space: pre-wrap; font: 12px/1.45 ui-monospace, monospace; }
#steps { margin-top: 12px; border-collapse: collapse; width: 100%; }
#steps td { padding: 2px 8px; border-bottom: 1px solid #eef0f3; vertical-align: top; font-size: 12px; }
#steps tr { cursor: pointer; } #steps tr:hover { background: #f3f6fb; }
#steps td.t { font-family: ui-monospace, monospace; text-align: right; white-space: nowrap; color: #56606d; }
.legend { margin: 8px 0; color: #56606d; font-size: 12px; }
</style>
</head>
<body>
<h1>{{TITLE}}</h1>
<div class="legend">Click any bar, mark or step for its detail. Model requests, then one lane per overlapping tool call (grey: queued; orange pin: placeholder shown to the model; purple pin: late result), then moments; hatched: suspended.</div>
<div id="chart"></div>
<div id="detail">Nothing selected.</div>
<table id="steps"></table>
<script type="application/json" id="data">{{DATA}}</script>
<script>
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("data").textContent);
  const t = data.timeline, pieces = data.axis;
  const chart = document.getElementById("chart"), detail = document.getElementById("detail");
  function frac(ms) {
    for (const [t0, t1, x0, w, gap] of pieces) {
      if (ms < t1 || (ms === t1 && !gap)) {
        if (gap) return x0 + w / 2;
        if (t1 === t0) return x0;
        return x0 + Math.max(0, ms - t0) / (t1 - t0) * w;
      }
    }
    return 1;
  }
  function pct(x) { return (Math.min(1, Math.max(0, x)) * 100).toFixed(3) + "%"; }
  function dur(ms) {
    ms = Math.max(0, ms);
    if (ms >= 3600000) return Math.floor(ms / 3600000) + "h" + String(Math.floor(ms / 60000) % 60).padStart(2, "0") + "m" + String(Math.floor(ms / 1000) % 60).padStart(2, "0") + "s";
    if (ms >= 60000) return Math.floor(ms / 60000) + "m" + String(Math.floor(ms / 1000) % 60).padStart(2, "0") + "s";
    return (ms / 1000).toFixed(3) + "s";
  }
  let selected = null;
  function show(el, title, fields) {
    if (selected) selected.classList.remove("selected");
    selected = el; if (el) el.classList.add("selected");
    const lines = [title];
    for (const [k, v] of Object.entries(fields)) {
      if (v === undefined || v === null || v === "" || (Array.isArray(v) && v.length === 0)) continue;
      lines.push(k + ": " + (typeof v === "string" ? v : JSON.stringify(v)));
    }
    detail.textContent = lines.join("\n");
  }
  function row(label, kind) {
    const r = document.createElement("div");
    r.className = "row" + (kind ? " " + kind : "");
    r.dataset.row = label;
    const l = document.createElement("div"); l.className = "label"; l.textContent = label; r.appendChild(l);
    const tr = document.createElement("div"); tr.className = "track"; r.appendChild(tr);
    for (const g of t.gaps) {
      const a = frac(g.from_ms), b = frac(g.to_ms);
      const d = document.createElement("div"); d.className = "gap";
      d.style.left = pct(a); d.style.width = pct(Math.max(b - a, 0.002));
      d.title = "suspended for " + dur(g.to_ms - g.from_ms);
      tr.appendChild(d);
    }
    chart.appendChild(r);
    return tr;
  }
  function bar(track, cls, from, to, title, onclick) {
    const d = document.createElement("div");
    d.className = "item " + cls;
    const a = frac(from), b = frac(to);
    d.style.left = pct(a); d.style.width = pct(Math.max(b - a, 0));
    d.title = title;
    d.addEventListener("click", function (e) { e.stopPropagation(); onclick(d); });
    track.appendChild(d);
    return d;
  }
  // The axis.
  const axis = row("", "axis");
  for (let i = 0; i <= 10; i++) {
    const x = i / 10;
    let ms = null;
    for (const [t0, t1, x0, w, gap] of pieces) {
      if (x <= x0 + w + 1e-9) { if (!gap) ms = t0 + (w > 0 ? (x - x0) / w * (t1 - t0) : 0); break; }
    }
    if (ms === null || i === 10) continue;
    const k = document.createElement("div"); k.className = "tick"; k.style.left = pct(x); k.textContent = dur(ms);
    axis.appendChild(k);
  }
  const steps = [];
  // Model requests.
  const model = row("model");
  for (const r of t.requests) {
    const end = r.ended_ms === undefined ? t.end_ms : r.ended_ms;
    const title = "request " + r.turn + ": " + r.outcome;
    const fields = { sent: "+" + dur(r.sent_ms), took: r.ended_ms === undefined ? undefined : dur(end - r.sent_ms),
      input_tokens: r.input_tokens, cached_input_tokens: r.cached_input_tokens, output_tokens: r.output_tokens, calls: r.calls, text: r.text };
    const el = bar(model, "req " + r.outcome, r.sent_ms, end, title, function (d) { show(d, title, fields); });
    el.dataset.turn = r.turn;
    steps.push([r.sent_ms, r.seq, "request " + r.turn, r.outcome + (r.ended_ms === undefined ? "" : " after " + dur(end - r.sent_ms)) + (r.outcome === "answered" ? " · " + r.input_tokens + " in / " + r.output_tokens + " out tokens" : ""), el, title, fields]);
  }
  // Tool calls, lane by lane.
  const lanes = [];
  for (let i = 0; i < t.lanes; i++) lanes.push(row(t.lanes === 1 ? "calls" : "calls " + (i + 1)));
  for (const c of t.calls) {
    const end = c.ended_ms === undefined ? t.end_ms : c.ended_ms;
    const ok = c.status === "answered" || (c.status === "exited" && c.exit_code === 0);
    const title = "call " + c.call_id + " (" + c.tool + "): " + (c.detail || c.status);
    const fields = { tool: c.tool, turn: c.turn, lane: c.lane + 1, status: c.status, exit_code: c.exit_code, queued: "+" + dur(c.queued_ms),
      started: c.started_ms === undefined ? undefined : "+" + dur(c.started_ms), ended: c.ended_ms === undefined ? undefined : "+" + dur(c.ended_ms),
      placeholder_shown: c.placeholder_ms === undefined ? undefined : "+" + dur(c.placeholder_ms),
      result_given: c.result_ms === undefined ? undefined : "+" + dur(c.result_ms) + (c.late ? " (late)" : ""),
      inherited_from_parent: c.inherited ? "yes" : undefined, detail: c.detail, arguments: c.arguments, output: c.output };
    const click = function (d) { show(d, title, fields); };
    const el = bar(lanes[c.lane], "call" + (ok ? "" : " bad"), c.queued_ms, end, title, click);
    el.dataset.call = c.call_id;
    if (c.started_ms !== undefined && end > c.queued_ms) {
      const q = document.createElement("div"); q.className = "queued";
      q.style.width = ((c.started_ms - c.queued_ms) / (end - c.queued_ms) * 100).toFixed(3) + "%";
      el.appendChild(q);
    }
    const span = Math.max(frac(end) - frac(c.queued_ms), 1e-9);
    for (const [ms, cls] of [[c.placeholder_ms, "placeholder"], [c.late ? c.result_ms : undefined, "late"]]) {
      if (ms === undefined) continue;
      const p = document.createElement("div"); p.className = "pin " + cls;
      p.style.left = pct((frac(ms) - frac(c.queued_ms)) / span);
      el.appendChild(p);
    }
    steps.push([c.queued_ms, c.seq, "call " + c.call_id, c.tool + " · " + (c.detail || c.status) + (c.late ? " · late result" : ""), el, title, fields]);
  }
  // Moments.
  const moments = row("moments");
  const letters = { input: "i", steer: "s", heartbeat: "h", stop: "x", fork: "f", resume: "r", sandbox_lost: "!", sandbox_replaced: "R", egress_blocked: "e", context_shrunk: "c", end: "#" };
  // Moments that fall together are set side by side.
  let lastX = -1, beside = 0;
  for (const m of t.marks) {
    const fields = { at: "+" + dur(m.at_ms), text: m.text };
    // Ending once idle interrupts nothing: a step, not a mark.
    const what = m.kind.replace(/_/g, " ");
    if (!letters[m.kind]) { steps.push([m.at_ms, m.seq, what, m.text, null, what, fields]); continue; }
    const d = document.createElement("div");
    d.className = "mark " + m.kind; d.dataset.kind = m.kind;
    const x = frac(m.at_ms);
    beside = x - lastX < 0.012 ? beside + 1 : 0;
    lastX = x;
    d.style.left = pct(x);
    if (beside) d.style.marginLeft = (beside * 13 - 6) + "px"; d.textContent = letters[m.kind] || "?"; d.title = m.kind + ": " + m.text;
    d.addEventListener("click", function (e) { e.stopPropagation(); show(d, m.kind, fields); });
    moments.appendChild(d);
    steps.push([m.at_ms, m.seq, what, m.text, d, what, fields]);
  }
  for (const g of t.gaps) { const what = g.kind.replace(/_/g, " "); steps.push([g.from_ms, 0, what, "for " + dur(g.to_ms - g.from_ms), null, what, { from: "+" + dur(g.from_ms), to: "+" + dur(g.to_ms) }]); }
  steps.sort(function (a, b) { return a[0] - b[0] || a[1] - b[1]; });
  const table = document.getElementById("steps");
  for (const [ms, , what, text, el, title, fields] of steps) {
    const tr = document.createElement("tr");
    for (const [cls, v] of [["t", "+" + dur(ms)], ["", what], ["", text]]) {
      const td = document.createElement("td"); td.className = cls; td.textContent = v; tr.appendChild(td);
    }
    tr.addEventListener("click", function () { show(el, title, fields); if (el) el.scrollIntoView({ block: "nearest" }); });
    table.appendChild(tr);
  }
  document.body.dataset.rendered = String(chart.querySelectorAll(".row").length);
})();
</script>
</body>
</html>
"##;

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn what_a_session_holds_cannot_leave_the_pages_data() {
        let t = crate::timeline::build(
            "s",
            0,
            None,
            &[(
                1,
                Some(5),
                crate::agent::Record::Input {
                    input_id: "i".into(),
                    text: "</script><img src=x onerror=alert(1)><!-- & \u{2028}".into(),
                },
            )],
        );
        let page = render(&t);
        let start = page
            .find(r#"<script type="application/json" id="data">"#)
            .unwrap();
        let data = &page[start..];
        let data = &data[data.find('>').unwrap() + 1..data.find("</script>").unwrap()];
        assert!(!data.contains('<') && !data.contains('>') && !data.contains('&'));
        // And it reads back as it was.
        let v: serde_json::Value = serde_json::from_str(data).unwrap();
        assert!(
            v["timeline"]["marks"][0]["text"]
                .as_str()
                .unwrap()
                .starts_with("</script><img")
        );
    }
}
