// A real corral-worker for the tests: a process on a loopback port of its
// own with a state directory and a token, against the local Docker engine
// (the binaries of `cargo build --workspace --bins`; another build
// directory with CORRAL_BIN_DIR), stopped with `stop()`.
import { spawn } from "node:child_process";
import { mkdtempSync, writeFileSync, openSync, readFileSync, rmSync } from "node:fs";
import { createServer, connect } from "node:net";
import { tmpdir } from "node:os";
import { join, resolve } from "node:path";
import { randomBytes } from "node:crypto";

const repo = resolve(new URL("../../..", import.meta.url).pathname);
const binDir = process.env.CORRAL_BIN_DIR ?? join(repo, "target", "debug");
const initBinary = join(repo, "target", "x86_64-unknown-linux-gnu", "release", "corral-init");

function freePort() {
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
  const deadline = Date.now() + 30_000;
  while (!(await listening(port))) {
    if (proc.exitCode !== null || Date.now() > deadline) {
      throw new Error(`corral-worker did not start: ${readFileSync(join(root, "worker.log"), "utf8")}`);
    }
    await new Promise((r) => setTimeout(r, 50));
  }
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
