// The TypeScript SDK on what outlives and reaches into a sandbox, against a
// real worker (directly, or through a front door as a tenant): a running
// sandbox forked into children with its files; a server's port given a
// signed URL that Node's fetch opens with the token and not without; a
// volume written by one sandbox and read by the next; a sandbox saved as a
// template that the next starts from; egress rules replaced, within what
// the worker allows; a TLS worker reached by Node's fetch.
import { test, before, after } from "node:test";
import assert from "node:assert/strict";
import { randomBytes } from "node:crypto";
import { execFileSync, spawnSync } from "node:child_process";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

import { Sandbox, Templates, Volumes, InvalidArgument, PolicyDenied, CorralError } from "../dist/index.js";
import { freePort, startCorral, startWorker } from "./worker.mjs";

let w;
const conn = () => ({ worker: w.url, tokenFile: w.tokenFile });
const suffix = () => randomBytes(4).toString("hex");

before(async () => {
  // One name egress may reach (never reached here).
  w = await startCorral(
    "--ports-listen",
    `127.0.0.1:${await freePort()}`,
    "--allow-egress",
    "example.org:443",
    "--allow-build",
  );
});

after(async () => {
  if (w) await w.stop();
});

test("a running sandbox forked: each child has its files and goes on its own", async () => {
  const sb = await Sandbox.create(conn());
  try {
    await sb.files.write("state.txt", "before the fork\n");
    const children = await sb.fork(2);
    assert.equal(children.length, 2);
    for (const c of children) {
      assert.equal(await c.files.readText("state.txt"), "before the fork\n");
      await c.files.write("state.txt", `child ${c.id}\n`);
    }
    assert.equal(await sb.files.readText("state.txt"), "before the fork\n");
    assert.notEqual(children[0].id, children[1].id);
    for (const c of children) assert.equal(await c.remove(), true);
    await assert.rejects(sb.fork(0), InvalidArgument);
  } finally {
    await sb.remove();
  }
});

test("a server's port: a signed URL, opened by fetch with its token and refused without", async () => {
  const sb = await Sandbox.create(conn());
  try {
    await sb.files.write("index.html", "<h1>from the sandbox</h1>");
    const server = await sb.start("exec python3 -m http.server 8000 --bind 127.0.0.1");
    const up = await sb.run(
      "for i in $(seq 100); do python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8000))' 2>/dev/null && exit 0; sleep 0.1; done; exit 1",
    );
    assert.equal(up.exitCode, 0, up.stderr);
    const e = await sb.exposePort(8000, { ttl: 600 });
    assert.ok(e.token, "a signed exposure has a token");
    assert.ok(e.expiresAtUnixMs && e.expiresAtUnixMs > Date.now());
    const ok = await fetch(e.url, { headers: { Authorization: `Bearer ${e.token}` } });
    assert.equal(ok.status, 200);
    assert.match(await ok.text(), /from the sandbox/);
    const refused = await fetch(e.url);
    assert.equal(refused.status, 401);
    await refused.body?.cancel();
    assert.equal(await sb.closePort(8000), true);
    assert.equal(await sb.closePort(8000), false);
    await assert.rejects(sb.exposePort(8000, { public: true }), PolicyDenied);
    await assert.rejects(sb.exposePort(70000), InvalidArgument);
    await server.kill();
  } finally {
    await sb.remove();
  }
});

test("a volume: written by one sandbox, read by the next, removed once free", async () => {
  const name = `tsvol-${suffix()}`;
  const v = await Volumes.create(name, { ...conn(), size: "64m" });
  assert.equal(v.name, name);
  assert.equal(v.sizeBytes, 64 << 20);
  try {
    const writer = await Sandbox.create({ ...conn(), volumes: { "/data": name } });
    const wrote = await writer.run("echo kept > /data/notes.txt && id -u && stat -c %u /data/notes.txt");
    assert.equal(wrote.exitCode, 0, wrote.stderr);
    const [uid, owner] = wrote.stdout.trim().split("\n");
    assert.equal(owner, uid, "the volume's files are the sandbox user's");
    assert.equal((await Volumes.list(conn())).find((x) => x.name === name)?.writer, writer.id);
    await assert.rejects(Volumes.remove(name, conn()), CorralError);
    await writer.remove();
    const reader = await Sandbox.create({ ...conn(), volumes: { "/data": { name, readOnly: true } } });
    assert.equal((await reader.run("cat /data/notes.txt")).stdout, "kept\n");
    const denied = await reader.run("echo more > /data/notes.txt");
    assert.notEqual(denied.exitCode, 0);
    await reader.remove();
    await assert.rejects(Sandbox.create({ ...conn(), volumes: { data: name } }), InvalidArgument);
  } finally {
    assert.equal(await Volumes.remove(name, conn()), true);
  }
  assert.equal((await Volumes.list(conn())).some((x) => x.name === name), false);
});

test("a sandbox saved as a template: the next starts with its files", async () => {
  const name = `ts-snap-${suffix()}`;
  const sb = await Sandbox.create(conn());
  try {
    await sb.files.write("tool/config.json", '{"ready": true}\n');
    const t = await sb.snapshot(name);
    assert.equal(t.name, name);
    assert.ok(t.image);
  } finally {
    await sb.remove();
  }
  try {
    assert.ok((await Templates.list(conn())).some((t) => t.name === name));
    const next = await Sandbox.create({ ...conn(), template: name });
    assert.equal(await next.files.readText("tool/config.json"), '{"ready": true}\n');
    await next.remove();
    await assert.rejects(Sandbox.create({ ...conn(), template: "Not A Name" }), CorralError);
  } finally {
    assert.equal(await Templates.remove(name, conn()), true);
  }
  assert.equal(await Templates.remove(name, conn()), false);
});

test("a template built from a Dockerfile and its files; the same again builds nothing; a failing step is a result", async () => {
  const name = `ts-built-${suffix()}`;
  const dockerfile = "FROM corral-debian:latest\nCOPY app.txt /srv/app.txt\n";
  const files = { "app.txt": `from ts ${name}\n` };
  const lines = [];
  const built = await Templates.build(name, { ...conn(), dockerfile, files, onOutput: (l) => lines.push(l) });
  try {
    assert.equal(built.ok, true, JSON.stringify(built));
    assert.equal(built.template?.name, name);
    assert.match(built.image ?? "", /^corral-build:/);
    assert.ok(lines.some((l) => /Step|COPY/.test(l)), lines.join("\n"));
    const again = await Templates.build(name, { ...conn(), dockerfile, files });
    assert.equal(again.cached, true, JSON.stringify(again));
    const sb = await Sandbox.create({ ...conn(), template: name });
    assert.equal((await sb.run("cat /srv/app.txt")).stdout, `from ts ${name}\n`);
    await sb.remove();
    const bad = await Templates.build(`${name}-bad`, { ...conn(), dockerfile: "FROM corral-debian:latest\nRUN exit 3\n" });
    assert.equal(bad.ok, false);
    assert.equal(bad.failure?.kind, "step_failed", JSON.stringify(bad));
    assert.equal(bad.failure?.step, 2);
    await assert.rejects(
      Templates.build(name, { ...conn(), dockerfile, files: { "../out": "x" } }),
      InvalidArgument,
    );
  } finally {
    assert.equal(await Templates.remove(name, conn()), true);
  }
});

test("egress replaced within what the worker allows", async () => {
  const open = await Sandbox.create({ ...conn(), egress: [] });
  try {
    await open.setEgress(["example.org:443"]);
    await open.setEgress([]);
    await assert.rejects(open.setEgress(["pypi.org:443"]), PolicyDenied);
    await assert.rejects(open.setEgress([42]), InvalidArgument);
  } finally {
    await open.remove();
  }
  const closed = await Sandbox.create(conn());
  try {
    await assert.rejects(closed.setEgress([]), InvalidArgument);
  } finally {
    await closed.remove();
  }
});

test("over TLS: Node's fetch (HTTP/1.1) reaches a worker at https:// whose CA it trusts", { skip: process.env.CORRAL_TS_THROUGH === "front-door" }, async () => {
  const dir = mkdtempSync(join(tmpdir(), "corral-ts-tls-"));
  const at = (f) => join(dir, f);
  const ssl = (...args) => execFileSync("openssl", args, { stdio: ["ignore", "ignore", "pipe"] });
  const ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"];
  ssl("req", "-x509", ...ec, "-keyout", at("ca.key"), "-out", at("ca.pem"), "-days", "1", "-subj", "/CN=corral ts CA");
  ssl("req", ...ec, "-keyout", at("key.pem"), "-out", at("req.csr"), "-subj", "/CN=corral ts worker");
  writeFileSync(at("san.ext"), "subjectAltName=IP:127.0.0.1\n");
  ssl("x509", "-req", "-in", at("req.csr"), "-CA", at("ca.pem"), "-CAkey", at("ca.key"), "-CAcreateserial",
    "-out", at("cert.pem"), "-days", "1", "-extfile", at("san.ext"));
  const tw = await startWorker("--tls-cert", at("cert.pem"), "--tls-key", at("key.pem"));
  try {
    const url = tw.url.replace("http://", "https://");
    // The CA is taken by Node at start: a process of its own.
    const script = `
      import { Sandbox } from ${JSON.stringify(new URL("../dist/index.js", import.meta.url).href)};
      const sb = await Sandbox.create({ worker: ${JSON.stringify(url)}, tokenFile: ${JSON.stringify(tw.tokenFile)} });
      const r = await sb.run("echo over tls");
      await sb.remove();
      console.log(JSON.stringify({ code: r.exitCode, out: r.stdout }));`;
    const run = (env) =>
      spawnSync(process.execPath, ["--input-type=module", "-e", script], { env: { ...process.env, ...env }, encoding: "utf8" });
    const trusted = run({ NODE_EXTRA_CA_CERTS: at("ca.pem") });
    assert.equal(trusted.status, 0, trusted.stderr);
    assert.deepEqual(JSON.parse(trusted.stdout.trim()), { code: 0, out: "over tls\n" });
    // Without the CA: refused, with the reason the SDK gives.
    const stranger = run({});
    assert.notEqual(stranger.status, 0);
    assert.match(stranger.stderr, /WorkerUnavailable|certificate/);
  } finally {
    await tw.stop();
    rmSync(dir, { recursive: true, force: true });
  }
});
