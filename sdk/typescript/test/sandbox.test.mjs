// The TypeScript SDK against a real worker (its HTTP/JSON API on the
// worker's own address): sandboxes made, listed and removed; commands whose
// results are results (a failure, a timeout, a kill), their output streamed
// as it comes; a background process; files written, read, listed, moved as
// tar; errors by reason; bad input refused before it is sent.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdtempSync, writeFileSync, mkdirSync, readFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import {
  Sandbox,
  SandboxNotFound,
  Unauthenticated,
  InvalidArgument,
  FileError,
  PolicyDenied,
  CorralError,
} from "../dist/index.js";
import { startCorral } from "./worker.mjs";

let w;
let sb;
const conn = () => ({ worker: w.url, tokenFile: w.tokenFile });

before(async () => {
  w = await startCorral();
  sb = await Sandbox.create({ ...conn(), memory: "512m", labels: { suite: "typescript" } });
});

after(async () => {
  if (sb) await sb.remove().catch(() => undefined);
  if (w) await w.stop();
});

test("a command's result, and its output as it comes", async () => {
  const r = await sb.run("python3 -c 'print(6*7)'");
  assert.equal(r.exitCode, 0);
  assert.equal(r.ok, true);
  assert.equal(r.endCause, "exited");
  assert.equal(r.stdout, "42\n");

  const pieces = [];
  const streamed = await sb.run(["sh", "-c", "for i in 1 2 3; do echo line $i; sleep 0.2; done; echo oops >&2"], {
    onStdout: (d) => pieces.push(new TextDecoder().decode(d)),
  });
  assert.equal(streamed.stdout, "line 1\nline 2\nline 3\n");
  assert.equal(streamed.stderr, "oops\n");
  assert.ok(pieces.length >= 2, `output came in one piece: ${JSON.stringify(pieces)}`);
  assert.equal(pieces.join(""), streamed.stdout);

  // cwd, env, a word with a quote in it.
  const r2 = await sb.run(["sh", "-c", 'echo "$GREETING" "$1" && pwd', "sh", "it's"], {
    cwd: "/tmp",
    env: { GREETING: "héllo" },
  });
  assert.equal(r2.stdout, "héllo it's\n/tmp\n");
});

test("a failure, a timeout and a cancel are results, and the sandbox goes on", async () => {
  const failed = await sb.run("exit 3");
  assert.equal(failed.exitCode, 3);
  assert.equal(failed.ok, false);

  const slow = await sb.run("sleep 30", { timeout: 1 });
  assert.equal(slow.endCause, "timed_out");
  assert.equal(slow.exitCode, null);

  const ctl = new AbortController();
  setTimeout(() => ctl.abort(), 500);
  await assert.rejects(sb.run("sleep 30", { signal: ctl.signal }), (e) => e.name === "AbortError");

  const after = await sb.run("echo still here");
  assert.equal(after.stdout, "still here\n");
});

test("a background process: waited for, fed, killed", async () => {
  const p = await sb.start("sleep 0.5; echo done");
  const r = await p.wait();
  assert.equal(r.stdout, "done\n");

  const cat = await sb.start("cat", { stdin: true });
  await cat.writeStdin("fed ");
  await cat.writeStdin(new TextEncoder().encode("twice"));
  await cat.closeStdin();
  assert.equal((await cat.wait()).stdout, "fed twice");

  const long = await sb.start("sleep 600");
  await long.kill();
  assert.equal((await long.wait()).endCause, "canceled");
});

test("files: written, read, listed; a tar in and out", async () => {
  assert.equal(await sb.files.write("notes/a.txt", "first\n"), 6);
  await sb.files.write("bin.dat", new Uint8Array([0, 1, 2, 255]), 0o600);
  assert.equal(await sb.files.readText("notes/a.txt"), "first\n");
  assert.deepEqual([...(await sb.files.read("bin.dat"))], [0, 1, 2, 255]);
  const listed = await sb.files.list(".");
  const bin = listed.find((e) => e.name === "bin.dat");
  assert.equal(bin.type, "file");
  assert.equal(bin.size, 4);
  assert.equal(bin.mode, 0o600);
  assert.equal(listed.find((e) => e.name === "notes").type, "directory");
  await assert.rejects(sb.files.read("nothing.txt"), (e) => e instanceof FileError && e.kind === "not_found");

  const dir = mkdtempSync(join(tmpdir(), "corral-ts-tar-"));
  mkdirSync(join(dir, "tree"));
  writeFileSync(join(dir, "tree", "x.txt"), "from a tar\n");
  const tar = execFileSync("tar", ["-C", dir, "-cf", "-", "tree"]);
  await sb.files.uploadTar(new Uint8Array(tar), "/workspace");
  assert.equal(await sb.files.readText("tree/x.txt"), "from a tar\n");
  const back = await sb.files.downloadTar("/workspace/tree");
  const listing = execFileSync("tar", ["-tf", "-"], { input: back }).toString();
  assert.match(listing, /tree\/x\.txt/);
});

test("errors by reason, and bad input refused before it is sent", async () => {
  await assert.rejects(
    Sandbox.connect("no-such-sandbox", conn()),
    (e) => e instanceof SandboxNotFound && e.reason === "sandbox_not_found" && e.status === 404,
  );
  await assert.rejects(
    Sandbox.list({ worker: w.url, token: "wrong" }),
    (e) => e instanceof Unauthenticated && e.status === 401,
  );
  await assert.rejects(
    Sandbox.create({ ...conn(), egress: ["example.invalid"] }),
    (e) => e instanceof PolicyDenied && e.flag === "--allow-egress",
  );
  await assert.rejects(Sandbox.create({ worker: "ftp://x" }), InvalidArgument);
  await assert.rejects(Sandbox.create({ ...conn(), memory: "lots" }), InvalidArgument);
  await assert.rejects(sb.run("echo a\0b"), InvalidArgument);
  await assert.rejects(sb.run(""), InvalidArgument);
  await assert.rejects(sb.files.write("x", "y", 0), InvalidArgument);
  assert.ok(new SandboxNotFound("x") instanceof CorralError);
  // An id that would change the path it is put in is refused here.
  await assert.rejects(Sandbox.connect("..", conn()), InvalidArgument);
  await assert.rejects(Sandbox.connect("a/b", conn()), InvalidArgument);
});

test("sandboxes listed, connected to by id, removed", async () => {
  const other = await Sandbox.create(conn());
  const listed = await Sandbox.list(conn());
  assert.ok(listed.some((s) => s.id === sb.id && s.labels.suite === "typescript"));
  assert.ok(listed.some((s) => s.id === other.id));
  const again = await Sandbox.connect(other.id, conn());
  assert.equal((await again.run("echo hi")).stdout, "hi\n");
  assert.equal(await other.remove(), true);
  assert.equal(await other.remove(), false);
  assert.ok(!(await Sandbox.list(conn())).some((s) => s.id === other.id));
  // A client given only CORRAL_URL and CORRAL_API_KEY (a front door's
  // pair, as the CLI and the Python SDK take it) finds it too.
  const saved = { ...process.env };
  try {
    for (const k of ["CORRAL_WORKER", "CORRAL_TOKEN_FILE"]) delete process.env[k];
    process.env.CORRAL_URL = w.url;
    process.env.CORRAL_API_KEY = readFileSync(w.tokenFile, "utf8").trim();
    assert.ok((await Sandbox.list()).some((s) => s.id === sb.id));
  } finally {
    for (const k of ["CORRAL_URL", "CORRAL_API_KEY", "CORRAL_WORKER", "CORRAL_TOKEN_FILE"]) delete process.env[k];
    Object.assign(process.env, saved);
  }
});
