//! `corral session timeline`: a session recorded with a fixed clock (the
//! coordinator's core driven step by step, as the event loop drives it)
//! with parallel calls, a slow one whose result comes late after a
//! placeholder, a failing one, a steering input, a heartbeat, an end, a
//! resume an hour later, blocked egress, a lost and replaced sandbox, and
//! a fork of it. Its terminal view is compared with a golden file
//! (`CORRAL_UPDATE_GOLDEN=1` writes it again); its HTML page is opened in
//! headless Chromium, which must render every lane with no console error
//! and send nothing to the network (a proxy of the test's own counts any
//! try); the screenshot is kept under `target/timeline/`.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use anyhow::{Context, Result, bail, ensure};
use bytes::Bytes;
use corral_harness::agent::record::Overrides;
use corral_harness::agent::{Core, Effect, Ending, Record, SessionConfig, StopCause, StopMode};
use corral_harness::llm::{Response, Usage};
use corral_harness::ops::Operation;
use corral_harness::session::{Clock, SessionLog};
use corral_harness::sessions::Sessions;
use corral_harness::timeline;
use corral_proto::event::{Egress, EgressDecision};
use corral_proto::{Captured, OperationResult, Outcome, SandboxId};

/// 2026-12-05 09:00:00 UTC.
const T0: i64 = 1_796_461_200_000;

/// A clock the test moves.
#[derive(Clone)]
struct Fixed(Arc<AtomicI64>);

impl Fixed {
    fn new() -> Self {
        Self(Arc::new(AtomicI64::new(T0)))
    }
    fn clock(&self) -> Clock {
        let at = Arc::clone(&self.0);
        Clock::from_fn(move || at.load(Ordering::SeqCst))
    }
    /// Sets the clock to `ms` after T0.
    fn at(&self, ms: i64) {
        self.0.store(T0 + ms, Ordering::SeqCst);
    }
}

fn config() -> Result<SessionConfig> {
    let mut c = corral_e2e::session_config("m", SandboxId::new("sb-golden")?);
    c.system_prompt = "be brief".into();
    c.max_turns = 20;
    Ok(c)
}

fn usage(input: u64, cached: u64, output: u64) -> Usage {
    Usage {
        input_tokens: input,
        cached_input_tokens: cached,
        output_tokens: output,
        ..Usage::default()
    }
}

fn text(t: &str, u: Usage) -> Response {
    Response {
        usage: u,
        ..corral_e2e::fake_model::text(t)
    }
}

fn calls(list: &[(&str, &str)], u: Usage) -> Response {
    Response {
        usage: u,
        ..corral_e2e::fake_model::bash_calls(list)
    }
}

/// The operations the core hands out now.
fn added(core: &mut Core) -> Vec<Operation> {
    let mut ops = Vec::new();
    for e in core.take_effects() {
        if let Effect::Add(more) = e {
            ops.extend(more);
        }
    }
    ops
}

fn ended(op: &Operation, code: i32, ran_ms: u64, stdout: &str) -> Operation {
    let mut op = op.clone();
    let mut r = OperationResult::with_outcome(Outcome::Exited { code });
    r.duration_ms = ran_ms;
    r.stdout = Captured {
        head: Bytes::copy_from_slice(stdout.as_bytes()),
        tail: Bytes::new(),
        total_bytes: stdout.len() as u64,
        truncated: false,
    };
    op.finish(r);
    op
}

/// Records session "golden" and its fork "golden-fork" in `dir`.
fn record(dir: &Path) -> Result<()> {
    let clock = Fixed::new();
    let sessions = Sessions::new(dir).with_clock(clock.clock());
    {
        let log = SessionLog::<Record>::create_clocked(dir, "golden", clock.clock())?;
        let mut core = Core::create(log, config()?)?;
        core.input("i1", "make the failing test pass")?;
        added(&mut core);
        clock.at(1_200);
        core.model_done(
            1,
            Ok(calls(
                &[
                    ("c1", "ls"),
                    ("c2", "pytest -x tests/"),
                    ("c3", "cat setup.cfg"),
                ],
                usage(1_200, 0, 80),
            )),
        )?;
        let ops = added(&mut core);
        ensure!(ops.len() == 3, "{ops:?}");
        clock.at(1_500);
        core.operation(ended(&ops[0], 0, 250, "src tests"))?;
        clock.at(1_900);
        core.operation(ended(&ops[2], 1, 600, "no such file"))?;
        clock.at(2_200);
        // The grace window closes with the slow call still running: its
        // placeholder goes with turn 2.
        core.grace_over()?;
        clock.at(3_000);
        core.input("i2", "only the unit tests")?;
        clock.at(4_100);
        core.model_done(
            3,
            Ok(text("Waiting for the tests.", usage(1_900, 1_200, 12))),
        )?;
        clock.at(9_000);
        core.heartbeat(T0 + 9_000)?;
        clock.at(9_800);
        core.model_done(4, Ok(text("Still running.", usage(2_300, 1_900, 6))))?;
        clock.at(12_500);
        core.operation(ended(&ops[1], 0, 10_300, "12 passed"))?;
        clock.at(13_300);
        core.model_done(5, Ok(text("All tests pass.", usage(2_600, 2_300, 9))))?;
        core.stop(StopMode::WhenIdle, StopCause::Requested)?;
        ensure!(core.ending() == Some(Ending::Done), "{:?}", core.ending());
        core.finish(Ending::Done)?;
    }
    // An hour later the session goes on.
    clock.at(3_600_000);
    {
        let stored = sessions.open("golden")?;
        let (log, state) = stored.into_parts();
        let mut core = Core::resume(log, state, Overrides::default())?;
        core.input("i3", "also fetch the changelog")?;
        core.kick()?;
        added(&mut core);
        clock.at(3_600_800);
        core.model_done(
            6,
            Ok(calls(
                &[("c4", "curl -sS https://pypi.org/simple/")],
                usage(2_900, 2_600, 30),
            )),
        )?;
        let ops = added(&mut core);
        clock.at(3_601_000);
        core.egress(&Egress {
            host: "pypi.org".into(),
            port: 443,
            decision: EgressDecision::Blocked,
            reason: "not_allowed".into(),
            unreported: 0,
        })?;
        clock.at(3_601_300);
        core.operation(ended(&ops[0], 56, 400, ""))?;
        clock.at(3_601_400);
        core.grace_over()?;
        clock.at(3_602_000);
        core.sandbox_lost("sandbox lost: worker w1 unreachable")?;
        clock.at(3_605_000);
        core.placed_again(
            Some("http://127.0.0.1:7002".into()),
            Some("w2".into()),
            SandboxId::new("sb-golden-1")?,
            1,
            "sandbox lost: worker w1 unreachable",
            false,
        )?;
        core.finish(Ending::Failed)?;
    }
    // A fork of the first hour, at turn 3.
    clock.at(3_700_000);
    sessions.fork("golden", "golden-fork", Some(3))?;
    Ok(())
}

fn golden(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("golden")
        .join(name)
}

fn compare(name: &str, got: &str) -> Result<()> {
    let path = golden(name);
    if std::env::var_os("CORRAL_UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all(golden(""))?;
        std::fs::write(&path, got)?;
        return Ok(());
    }
    let want = std::fs::read_to_string(&path)
        .with_context(|| format!("{} (CORRAL_UPDATE_GOLDEN=1 writes it)", path.display()))?;
    if want != got {
        let out = target_dir().join(name);
        std::fs::write(&out, got)?;
        bail!(
            "the timeline differs from {}; this run's is in {}:\n{got}",
            path.display(),
            out.display()
        );
    }
    Ok(())
}

fn target_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("target")
        .join("timeline");
    let _ = std::fs::create_dir_all(&dir);
    dir
}

#[test]
fn the_terminal_view_shows_each_step_in_its_lane() -> Result<()> {
    let dir = tempfile::tempdir()?;
    record(dir.path())?;
    let store = Sessions::new(dir.path());
    let t = timeline::of_session(&store, "golden")?;
    // What the view is drawn from.
    ensure!(t.lanes == 3, "three calls at once: {}", t.lanes);
    let c2 = t.calls.iter().find(|c| c.call_id == "c2").context("c2")?;
    ensure!(
        c2.late && c2.placeholder_ms == Some(2_200) && c2.result_ms == Some(12_500),
        "{c2:?}"
    );
    ensure!(
        c2.started_ms == Some(2_200) && c2.ended_ms == Some(12_500),
        "{c2:?}"
    );
    let c3 = t.calls.iter().find(|c| c.call_id == "c3").context("c3")?;
    ensure!(c3.exit_code == Some(1) && !c3.ok(), "{c3:?}");
    let superseded: Vec<u64> = t
        .requests
        .iter()
        .filter(|r| r.outcome == "superseded")
        .map(|r| r.turn)
        .collect();
    ensure!(superseded == [2], "steered away: {superseded:?}");
    let canceled: Vec<u64> = t
        .requests
        .iter()
        .filter(|r| r.outcome == "canceled")
        .map(|r| r.turn)
        .collect();
    ensure!(
        canceled == [7],
        "canceled with the lost sandbox: {canceled:?}"
    );
    let kinds: Vec<&str> = t.marks.iter().map(|m| m.kind).collect();
    for k in [
        "input",
        "steer",
        "heartbeat",
        "end_when_idle",
        "end",
        "resume",
        "egress_blocked",
        "sandbox_lost",
        "sandbox_replaced",
    ] {
        ensure!(kinds.contains(&k), "no {k} in {kinds:?}");
    }
    ensure!(
        t.gaps.len() == 1 && t.gaps[0].from_ms == 13_300 && t.gaps[0].to_ms == 3_600_000,
        "{:?}",
        t.gaps
    );
    ensure!(t.totals.input_tokens == 1_200 + 1_900 + 2_300 + 2_600 + 2_900);
    compare("timeline-golden.txt", &timeline::text::render(&t, 100))?;

    let fork = timeline::of_session(&store, "golden-fork")?;
    let from = fork.forked_from.as_ref().context("no fork origin")?;
    ensure!(
        from.session_id == "golden" && from.at_ms.is_some(),
        "{from:?}"
    );
    ensure!(fork.marks.iter().any(|m| m.kind == "fork"));
    ensure!(fork.calls.iter().all(|c| c.inherited), "{:?}", fork.calls);
    compare(
        "timeline-golden-fork.txt",
        &timeline::text::render(&fork, 100),
    )?;
    Ok(())
}

/// The command prints the same view, and its JSON is the timeline's.
#[tokio::test]
async fn the_command_prints_the_view_and_its_json() -> Result<()> {
    let dir = tempfile::tempdir()?;
    record(dir.path())?;
    let run = |args: &[&str]| {
        let mut cmd = std::process::Command::new(corral_e2e::binary("corral")?);
        cmd.args(["session", "timeline", "--sessions-dir"])
            .arg(dir.path())
            .args(args);
        let out = cmd.output()?;
        ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok::<_, anyhow::Error>(String::from_utf8(out.stdout)?)
    };
    let shown = run(&["golden", "--width", "100"])?;
    ensure!(
        shown == std::fs::read_to_string(golden("timeline-golden.txt"))?,
        "{shown}"
    );
    let json: serde_json::Value = serde_json::from_str(&run(&["golden", "--json"])?)?;
    ensure!(
        json["lanes"] == 3 && json["calls"].as_array().map(Vec::len) == Some(4),
        "{json}"
    );
    // An unknown session is a usage error.
    let out = std::process::Command::new(corral_e2e::binary("corral")?)
        .args(["session", "timeline", "--sessions-dir"])
        .arg(dir.path())
        .arg("nope")
        .output()?;
    ensure!(out.status.code() == Some(2), "{out:?}");
    Ok(())
}

/// The page, in headless Chromium: every lane drawn, no console error, no
/// network request.
#[test]
fn the_html_page_renders_every_lane_offline() -> Result<()> {
    let dir = tempfile::tempdir()?;
    record(dir.path())?;
    let out = target_dir();
    let page = out.join("timeline-golden.html");
    let status = std::process::Command::new(corral_e2e::binary("corral")?)
        .args(["session", "timeline", "--sessions-dir"])
        .arg(dir.path())
        .args(["golden", "--html"])
        .arg(&page)
        .status()?;
    ensure!(status.success());
    let html = std::fs::read_to_string(&page)?;
    ensure!(!html.contains("</script><script"), "data escaped");
    // A proxy of the test's own that takes every request Chromium makes
    // and writes down its first line.
    let tripwire = Tripwire::start()?;
    let chromium = corral_e2e::chromium()?;
    let profile = tempfile::tempdir()?;
    let browse = |url: &str, extra: &[String]| -> Result<std::process::Output> {
        let mut cmd = std::process::Command::new(&chromium);
        cmd.args(corral_e2e::CHROMIUM_HEADLESS)
            .arg("--window-size=1400,900")
            .arg(format!("--proxy-server=http://{}", tripwire.addr))
            .arg("--proxy-bypass-list=<-loopback>")
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .args(extra)
            .arg(url);
        let out = cmd.output()?;
        ensure!(
            out.status.success(),
            "chromium failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(out)
    };
    // First, that the tripwire sees what a page asks for: a page of the
    // test's own that loads an image from a name of the test's own.
    let control = out.join("tripwire-control.html");
    std::fs::write(
        &control,
        r#"<html><body><img src="http://corral-tripwire.test/pixel.png"><script>console.error("corral-control")</script></body></html>"#,
    )?;
    let seen = browse(
        &format!("file://{}", control.display()),
        &["--dump-dom".into()],
    )?;
    // And that what a page says to its console reaches the log read below.
    ensure!(
        String::from_utf8_lossy(&seen.stderr).contains("corral-control"),
        "chromium's log has no console messages"
    );
    ensure!(
        tripwire.wait_for("corral-tripwire.test"),
        "the tripwire saw no request of the control page: {:?}",
        tripwire.seen()
    );
    tripwire.clear();

    let url = format!("file://{}", page.display());
    let dumped = browse(&url, &["--dump-dom".into()])?;
    let dom_text = String::from_utf8_lossy(&dumped.stdout);
    let log = String::from_utf8_lossy(&dumped.stderr);
    // Model, three lanes of calls, moments (and the axis).
    ensure!(
        dom_text.contains(r#"data-rendered="6""#),
        "not every row rendered:\n{log}\n{dom_text}"
    );
    for row in ["model", "calls 1", "calls 2", "calls 3", "moments"] {
        ensure!(
            dom_text.contains(&format!(r#"data-row="{row}""#)),
            "no row {row}"
        );
    }
    for call in ["c1", "c2", "c3", "c4"] {
        ensure!(
            dom_text.contains(&format!(r#"data-call="{call}""#)),
            "no call {call}"
        );
    }
    for kind in [
        "steer",
        "heartbeat",
        "resume",
        "egress_blocked",
        "sandbox_replaced",
    ] {
        ensure!(
            dom_text.contains(&format!(r#"data-kind="{kind}""#)),
            "no mark {kind}"
        );
    }
    // A console message of any kind (an exception, a refused fetch: the
    // page's policy allows nothing but itself, and says so in the console
    // when something is refused).
    let console: Vec<&str> = log
        .lines()
        .filter(|l| {
            l.contains("CONSOLE") || l.contains("Uncaught") || l.contains("Content Security Policy")
        })
        .collect();
    ensure!(console.is_empty(), "console messages: {console:#?}");
    let png = out.join("timeline-golden.png");
    let _ = std::fs::remove_file(&png);
    browse(&url, &[format!("--screenshot={}", png.display())])?;
    ensure!(
        std::fs::metadata(&png)?.len() > 10_000,
        "an empty screenshot"
    );
    // Chromium asks its own services (updates, sign-in, time) whatever
    // the page; nothing else may be asked. (A page that reached for one of
    // those domains would be refused by its own policy, and say so in the
    // console, checked above.)
    let asked: Vec<String> = tripwire
        .seen()
        .into_iter()
        .filter(|line| !browser_own(line))
        .collect();
    ensure!(
        asked.is_empty(),
        "the page reached for the network: {asked:?}"
    );
    Ok(())
}

/// Whether a request line names one of the domains Chromium itself asks
/// (updates, sign-in, time, components), with any page or none.
fn browser_own(line: &str) -> bool {
    let target = line.split_whitespace().nth(1).unwrap_or("");
    let host = target
        .trim_start_matches("http://")
        .trim_start_matches("https://")
        .split(['/', ':'])
        .next()
        .unwrap_or("");
    ["google.com", "googleapis.com", "gvt1.com", "gstatic.com"]
        .iter()
        .any(|d| host == *d || host.ends_with(&format!(".{d}")))
}

/// A proxy that answers nothing: it writes down the first line of every
/// request and closes. A connection that sends nothing (Chromium opens
/// some to its proxy ahead of any request, and closes them unused when it
/// exits) asks for nothing, and is not written down.
struct Tripwire {
    addr: std::net::SocketAddr,
    seen: Arc<std::sync::Mutex<Vec<String>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    /// Connections accepted and not read yet.
    open: Arc<std::sync::atomic::AtomicUsize>,
}

impl Tripwire {
    fn start() -> Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let open = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (s, st, o) = (Arc::clone(&seen), Arc::clone(&stop), Arc::clone(&open));
        std::thread::spawn(move || {
            use std::io::Read;
            while !st.load(Ordering::SeqCst) {
                match listener.accept() {
                    // Each read on its own thread: one idle connection
                    // holds no other up.
                    Ok((mut c, _)) => {
                        o.fetch_add(1, Ordering::SeqCst);
                        let (s, o) = (Arc::clone(&s), Arc::clone(&o));
                        std::thread::spawn(move || {
                            let _ = c.set_nonblocking(false);
                            let _ = c.set_read_timeout(Some(std::time::Duration::from_secs(2)));
                            let mut buf = [0u8; 512];
                            let n = c.read(&mut buf).unwrap_or(0);
                            if n > 0 {
                                let text = String::from_utf8_lossy(&buf[..n]);
                                let line = text.lines().next().unwrap_or("").to_string();
                                s.lock().unwrap_or_else(|e| e.into_inner()).push(line);
                            }
                            o.fetch_sub(1, Ordering::SeqCst);
                        });
                    }
                    Err(_) => std::thread::sleep(std::time::Duration::from_millis(10)),
                }
            }
        });
        Ok(Self {
            addr,
            seen,
            stop,
            open,
        })
    }

    /// What was asked, once every connection accepted so far has been
    /// read (3 s at most).
    fn seen(&self) -> Vec<String> {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
        while self.open.load(Ordering::SeqCst) > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        self.recorded()
    }

    /// What was asked so far.
    fn recorded(&self) -> Vec<String> {
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Forgets what was asked, once every connection so far is read (so
    /// none of them is written down after).
    fn clear(&self) {
        let _ = self.seen();
        self.seen.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }

    /// Whether a request naming `host` comes within 5 s.
    fn wait_for(&self, host: &str) -> bool {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::time::Instant::now() < deadline {
            if self.recorded().iter().any(|l| l.contains(host)) {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        false
    }
}

impl Drop for Tripwire {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}
