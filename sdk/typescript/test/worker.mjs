// A real corral-worker for the tests: a process on a loopback port of its
// own with a state directory and a token, against the local Docker engine
// (the binaries of `cargo build --workspace --bins`; another build
// directory with CORRAL_BIN_DIR), stopped with `stop()`; or that worker
// behind a front door of its own (`startCorral`).
import { execFileSync, spawn } from "node:child_process";
import { mkdtempSync, writeFileSync, openSync, readFileSync, rmSync } from "node:fs";
import { createServer, connect } from "node:net";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { randomBytes } from "node:crypto";

const repo = resolve(new URL("../../..", import.meta.url).pathname);
const binDir = process.env.CORRAL_BIN_DIR ?? join(repo, "target", "debug");
const initBinary = join(repo, "target", "x86_64-unknown-linux-gnu", "release", "corral-init");

export function freePort() {
  return new Promise((ok, fail) => {
    const s = createServer();
    s.once("error", fail);
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => ok(port));
    });
  });
}

function listening(port) {
  return new Promise((ok) => {
    const c = connect(port, "127.0.0.1");
    c.once("connect", () => { c.destroy(); ok(true); });
    c.once("error", () => ok(false));
  });
}

async function waitListening(port, proc, logFile, what) {
  const deadline = Date.now() + 30_000;
  while (!(await listening(port))) {
    if (proc.exitCode !== null || Date.now() > deadline) {
      throw new Error(`${what} did not start: ${readFileSync(logFile, "utf8")}`);
    }
    await new Promise((r) => setTimeout(r, 50));
  }
}

/** What the tests talk to: a worker started with `args`, reached directly,
 * or (CORRAL_TS_THROUGH=front-door) through a front door of its own
 * (`corral serve --tenants`) with a run key of tenant acme's as the token,
 * as a team's client would reach it. `worker` is the worker itself. */
export async function startCorral(...args) {
  const worker = await startWorker(...args);
  if (process.env.CORRAL_TS_THROUGH !== "front-door") return { ...worker, through: "direct", worker };
  const root = mkdtempSync(join(tmpdir(), "corral-ts-door-"));
  const tenants = join(root, "tenants");
  const key = JSON.parse(
    execFileSync(join(binDir, "corral"), ["admin", "--tenants", tenants, "key", "create", "--tenant", "acme", "--scope", "run", "--json"]),
  ).key;
  const keyFile = join(root, "key");
  writeFileSync(keyFile, key + "\n", { mode: 0o600 });
  const port = await freePort();
  const logFile = join(root, "serve.log");
  const log = openSync(logFile, "a");
  const env = { ...process.env };
  for (const k of ["CORRAL_WORKER", "CORRAL_TOKEN_FILE", "CORRAL_URL", "CORRAL_API_KEY"]) delete env[k];
  const proc = spawn(
    join(binDir, "corral"),
    ["--worker", worker.url, "--token-file", worker.tokenFile, "serve", "--listen", `127.0.0.1:${port}`,
     "--serve-state-dir", join(root, "serve-state"), "--sessions-dir", join(root, "sessions"), "--tenants", tenants],
    { stdio: ["ignore", log, log], env },
  );
  await waitListening(port, proc, logFile, "corral serve");
  return {
    url: `http://127.0.0.1:${port}`,
    tokenFile: keyFile,
    root,
    through: "front-door",
    worker,
    async stop() {
      proc.kill("SIGTERM");
      await new Promise((r) => (proc.exitCode !== null ? r() : proc.once("exit", r)));
      rmSync(root, { recursive: true, force: true });
      await worker.stop();
    },
  };
}

export async function startWorker(...args) {
  const root = mkdtempSync(join(tmpdir(), "corral-ts-"));
  const tokenFile = join(root, "token");
  writeFileSync(tokenFile, randomBytes(24).toString("base64url") + "\n", { mode: 0o600 });
  const port = await freePort();
  const log = openSync(join(root, "worker.log"), "a");
  const proc = spawn(
    join(binDir, "corral-worker"),
    ["--listen", `127.0.0.1:${port}`, "--state-dir", join(root, "state"), "--token-file", tokenFile,
     "--init-binary", initBinary, ...args],
    { stdio: ["ignore", log, log] },
  );
  await waitListening(port, proc, join(root, "worker.log"), "corral-worker");
  return {
    url: `http://127.0.0.1:${port}`,
    tokenFile,
    root,
    async stop() {
      proc.kill("SIGTERM");
      await new Promise((r) => (proc.exitCode !== null ? r() : proc.once("exit", r)));
      rmSync(root, { recursive: true, force: true });
    },
  };
}
