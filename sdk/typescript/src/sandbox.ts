/**
 * Sandboxes, the commands that run in them, and their files.
 */

import { Client, ConnectOptions, fromBase64, toBase64 } from "./client.js";
import { CorralError, FileError, InvalidArgument, SandboxLost } from "./errors.js";

type Json = Record<string, any>;

/** How a command ended. */
export type EndCause =
  | "exited"
  | "signaled"
  | "timed_out"
  | "out_of_memory"
  | "canceled"
  | "sandbox_lost"
  | "spawn_failed"
  | "file_error";

/** A command's end: an ordinary outcome, never an exception (a non-zero
 * exit, a timeout, a kill). */
export interface Result {
  /** Its exit code (`null` unless it exited). */
  exitCode: number | null;
  /** Whether it exited with 0. */
  ok: boolean;
  endCause: EndCause;
  /** The signal that killed it, when one did. */
  signal: number | null;
  /** Why it could not start, or its sandbox was lost. */
  reason: string | null;
  /** Its output as text (UTF-8), as the worker kept it. */
  stdout: string;
  stderr: string;
  stdoutBytes: Uint8Array;
  stderrBytes: Uint8Array;
  /** Whether the worker kept only the head and tail of its output (the
   * middle was cut: `outputLimitBytes`). */
  truncated: boolean;
  durationMs: number;
}

/** What `run` and `start` take. */
export interface RunOptions {
  /** The working directory (default: /workspace). */
  cwd?: string;
  env?: Record<string, string>;
  /** Seconds before it is killed (its result says `timed_out`). */
  timeout?: number;
  /** Each piece of its output, as it comes. */
  onStdout?: (data: Uint8Array) => void;
  onStderr?: (data: Uint8Array) => void;
  /** Run under bash rather than sh. */
  bash?: boolean;
  /** The most output the worker keeps for the result (head and tail). */
  outputLimitBytes?: number;
  /** Its standard input can be written (`Process.writeStdin`). */
  stdin?: boolean;
  /** Cancels the command (its result says `canceled`). */
  signal?: AbortSignal;
}

/** What a sandbox is made with. */
export interface CreateOptions extends ConnectOptions {
  /** An image the worker allows (default: the worker's). */
  image?: string;
  /** One of the worker's templates. */
  template?: string;
  /** Bytes, or a size as `512m`, `2g`. */
  memory?: number | string;
  cpus?: number;
  env?: Record<string, string>;
  labels?: Record<string, string>;
  /** Seconds it lives, and it may stay idle. */
  ttl?: number;
  idleTimeout?: number;
  /** Hosts it may reach through its worker's proxy (`[]`: none yet, but
   * `setEgress` may open some later). */
  egress?: string[];
  /** Volumes mounted, by path: `{ "/data": "NAME" }`, or
   * `{ "/data": { name: "NAME", readOnly: true } }`. */
  volumes?: Record<string, string | { name: string; readOnly?: boolean }>;
  /** Its id (default: the worker's choice). */
  id?: string;
}

/** A sandbox as its worker describes it. */
export interface SandboxInfo {
  id: string;
  state: string;
  image: string;
  labels: Record<string, string>;
  createdAtUnixMs: number;
  workerId: string;
}

/** An entry of a directory. */
export interface FileEntry {
  name: string;
  path: string;
  type: "file" | "directory" | "symlink" | "other";
  size: number;
  mode: number;
  mtime: number;
}

const UNITS: Record<string, number> = { k: 1 << 10, m: 1 << 20, g: 1 << 30, t: 2 ** 40 };

function parseSize(v: number | string | undefined, what: string): number | undefined {
  if (v === undefined) return undefined;
  if (typeof v === "number") {
    if (!Number.isInteger(v) || v <= 0) throw new InvalidArgument(`${what} ${v}: a whole number of bytes`);
    return v;
  }
  const m = /^(\d+)([kmgt]?)i?b?$/i.exec(v.trim());
  if (!m) throw new InvalidArgument(`${what} ${JSON.stringify(v)}: a size such as 512m or 2g`);
  return Number(m[1]) * (m[2] ? UNITS[m[2].toLowerCase()] : 1);
}

/** A command for `sh -c`: a string as it is, a list quoted word by word. */
function commandLine(command: string | string[]): string {
  if (typeof command === "string") {
    if (!command.trim()) throw new InvalidArgument("command: empty");
    return command;
  }
  if (command.length === 0) throw new InvalidArgument("command: empty");
  return command.map((w) => (/^[A-Za-z0-9_./:=@%+,-]+$/.test(w) ? w : `'${w.replace(/'/g, `'\\''`)}'`)).join(" ");
}

function checkText(what: string, s: string): void {
  if (s.includes("\0")) throw new InvalidArgument(`${what}: contains a NUL byte`);
}

function shellSpec(command: string | string[], opts: RunOptions): Json {
  const line = commandLine(command);
  checkText("command", line);
  const shell: Json = { command: line };
  if (opts.cwd) shell.workdir = opts.cwd;
  if (opts.env) {
    for (const [k, v] of Object.entries(opts.env)) {
      checkText(`env ${k}`, k);
      checkText(`env ${k}`, v);
    }
    shell.env = opts.env;
  }
  if (opts.timeout !== undefined) {
    if (!(opts.timeout > 0)) throw new InvalidArgument(`timeout ${opts.timeout}: seconds, more than 0`);
    shell.timeout_ms = Math.ceil(opts.timeout * 1000);
  }
  if (opts.bash) shell.use_bash = true;
  if (opts.outputLimitBytes !== undefined) shell.output_limit_bytes = opts.outputLimitBytes;
  if (opts.stdin) shell.stdin = true;
  return shell;
}

function captured(c: Json | undefined): { bytes: Uint8Array; truncated: boolean } {
  if (!c) return { bytes: new Uint8Array(0), truncated: false };
  const head = fromBase64(c.head);
  const tail = fromBase64(c.tail);
  const bytes = new Uint8Array(head.length + tail.length);
  bytes.set(head);
  bytes.set(tail, head.length);
  return { bytes, truncated: Boolean(c.truncated) };
}

const decoder = new TextDecoder();

/** An operation's finished result as a `Result`. */
function resultOf(r: Json | undefined): Result {
  const outcome: Json = r?.outcome ?? {};
  const kind = (Object.keys(outcome)[0] ?? "sandbox_lost") as EndCause;
  const body: Json = outcome[kind] ?? {};
  const out = captured(r?.stdout);
  const err = captured(r?.stderr);
  const exitCode = kind === "exited" ? Number(body.code ?? 0) : null;
  return {
    exitCode,
    ok: exitCode === 0,
    endCause: kind,
    signal: kind === "signaled" ? Number(body.signal ?? 0) : null,
    reason: body.reason ?? body.message ?? null,
    stdout: decoder.decode(out.bytes),
    stderr: decoder.decode(err.bytes),
    stdoutBytes: out.bytes,
    stderrBytes: err.bytes,
    truncated: out.truncated || err.truncated,
    durationMs: Number(r?.duration_ms ?? 0),
  };
}

/** A file operation's failure, if its result is one. */
function fileError(r: Json | undefined, path: string): FileError | null {
  const fe = r?.outcome?.file_error;
  if (!fe) return null;
  const kind = String(fe.kind ?? "FILE_ERROR_KIND_OTHER").replace(/^FILE_ERROR_KIND_/, "").toLowerCase();
  const said = String(fe.message ?? "");
  return new FileError(said.startsWith(path) ? said : `${path}: ${said}`, kind);
}

/** How long a stream of events may be away before the sandbox is lost. */
const PATIENCE_MS = 60_000;

/** A command running in a sandbox (`Sandbox.start`). */
export class Process {
  readonly sandbox: Sandbox;
  readonly id: string;
  #result: Promise<Result> | null = null;
  #opts: RunOptions;
  #inputOffset = 0;

  constructor(sandbox: Sandbox, id: string, opts: RunOptions = {}) {
    this.sandbox = sandbox;
    this.id = id;
    this.#opts = opts;
  }

  /** Its end (following its output meanwhile, to `onStdout`/`onStderr`). */
  wait(): Promise<Result> {
    if (!this.#result) this.#result = this.sandbox._follow(this.id, 0, this.#opts);
    return this.#result;
  }

  /** Ends it: its result says `canceled`. */
  async kill(): Promise<void> {
    await this.sandbox._client.call("POST", `${this.sandbox._path}/operations/${enc(this.id)}/cancel`, {});
  }

  /** Sends a signal to its process group (15: SIGTERM). */
  async signal(signal: number): Promise<void> {
    await this.sandbox._client.call("POST", `${this.sandbox._path}/operations/${enc(this.id)}/signal`, { signal });
  }

  /** Writes to its standard input (started with `stdin: true`). */
  async writeStdin(data: string | Uint8Array): Promise<void> {
    const bytes = typeof data === "string" ? new TextEncoder().encode(data) : data;
    await this.sandbox._client.call("POST", `${this.sandbox._path}/operations/${enc(this.id)}/input`, {
      offset: this.#inputOffset,
      data: toBase64(bytes),
    });
    this.#inputOffset += bytes.length;
  }

  /** Ends its standard input. */
  async closeStdin(): Promise<void> {
    await this.sandbox._client.call("POST", `${this.sandbox._path}/operations/${enc(this.id)}/input`, {
      offset: this.#inputOffset,
      eof: true,
    });
  }
}

/** An id as a path segment: checked as the server checks ids (1-64 of
 * `A-Z a-z 0-9 _ . -`, not starting with `.` or `-`), so that no id
 * (`..`, say) changes the path it is put in. */
function enc(s: string): string {
  if (!/^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$/.test(s)) {
    throw new InvalidArgument(`id ${JSON.stringify(s)}: 1-64 of A-Z a-z 0-9 _ . -, not starting with . or -`);
  }
  return s;
}

function randomId(): string {
  return crypto.randomUUID();
}

/** A sandbox's files (paths relative to /workspace, or absolute under it or /tmp). */
export class Files {
  readonly #sb: Sandbox;

  constructor(sb: Sandbox) {
    this.#sb = sb;
  }

  /** The whole file. */
  async read(path: string): Promise<Uint8Array> {
    checkText("path", path);
    const parts: Uint8Array[] = [];
    const r = await this.#sb._op({ read_file: { path, stream: true } }, { onStdout: (d) => parts.push(d) });
    const err = fileError(r, path);
    if (err) throw err;
    return concat(parts);
  }

  /** The whole file as text (UTF-8). */
  async readText(path: string): Promise<string> {
    return decoder.decode(await this.read(path));
  }

  /** Replaces (or makes) the file: the bytes written. At most 8 MiB at once
   * (more: `upload` a tar). */
  async write(path: string, data: string | Uint8Array, mode?: number): Promise<number> {
    checkText("path", path);
    const bytes = typeof data === "string" ? new TextEncoder().encode(data) : data;
    if (bytes.length > 8 << 20) {
      throw new InvalidArgument(`${path}: ${bytes.length} bytes, over 8 MiB for one write (upload a tar)`);
    }
    if (mode !== undefined && !(Number.isInteger(mode) && mode > 0 && mode <= 0o7777)) {
      throw new InvalidArgument(`mode ${mode}: a file mode (0o1 to 0o7777)`);
    }
    const spec: Json = { path, data: toBase64(bytes) };
    if (mode) spec.mode = mode;
    const r = await this.#sb._op({ write_file: spec });
    const err = fileError(r, path);
    if (err) throw err;
    if (resultOf(r).endCause !== "exited") throw new CorralError(`${path}: the write ended ${resultOf(r).endCause}`);
    return bytes.length;
  }

  /** The entries of a directory (not . and ..), by name. */
  async list(path = "."): Promise<FileEntry[]> {
    checkText("path", path);
    const parts: Uint8Array[] = [];
    const r = await this.#sb._op({ list_dir: { path } }, { onStdout: (d) => parts.push(d) });
    const err = fileError(r, path);
    if (err) throw err;
    return parseListing(path, concat(parts));
  }

  /** A tar archive unpacked into the directory `path`. */
  async uploadTar(tar: Uint8Array, path = "/workspace"): Promise<void> {
    const resp = await this.#sb._client.request("PUT", `${this.#sb._path}/archive?path=${encodeURIComponent(path)}`, undefined, {
      raw: tar,
      contentType: "application/x-tar",
    });
    const op = (await resp.json()) as Json;
    const r = resultOf(op.result);
    if (!r.ok) throw new CorralError(`unpacking into ${path}: ${r.stderr.trim() || r.endCause}`, { reason: "transfer_failed" });
  }

  /** `path` (a file or a tree) as a tar archive. */
  async downloadTar(path: string): Promise<Uint8Array> {
    const resp = await this.#sb._client.request("GET", `${this.#sb._path}/archive?path=${encodeURIComponent(path)}`);
    return new Uint8Array(await resp.arrayBuffer());
  }
}

function concat(parts: Uint8Array[]): Uint8Array {
  const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
  let at = 0;
  for (const p of parts) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

/** A listing as the supervisor writes it: a line of mode (hex), size and
 * time, then the name and a NUL, each. Made in the sandbox: taken only in
 * that form, and a name is one component of a path. */
function parseListing(path: string, data: Uint8Array): FileEntry[] {
  const out: FileEntry[] = [];
  const base = path.replace(/\/+$/, "") || "/";
  let at = 0;
  while (at < data.length) {
    let nl = data.indexOf(10, at);
    if (nl < 0) nl = data.length;
    let nul = data.indexOf(0, nl + 1);
    if (nul < 0) nul = data.length;
    const line = decoder.decode(data.subarray(at, nl)).trim().split(/\s+/);
    const name = decoder.decode(data.subarray(nl + 1, nul));
    at = nul + 1;
    if (line.length !== 3) throw new FileError(`${path}: a malformed listing line`, "other");
    const mode = parseInt(line[0], 16);
    if (!name || name === "." || name === ".." || name.includes("/")) {
      throw new FileError(`${path}: the listing names ${JSON.stringify(name)}: a forged listing, refused`, "other");
    }
    const kind = mode & 0o170000;
    out.push({
      name,
      path: base === "." ? name : `${base}/${name}`,
      type: kind === 0o040000 ? "directory" : kind === 0o100000 ? "file" : kind === 0o120000 ? "symlink" : "other",
      size: Number(line[1]),
      mode: mode & 0o7777,
      mtime: Number(line[2]),
    });
  }
  return out.sort((a, b) => (a.name < b.name ? -1 : a.name > b.name ? 1 : 0));
}

function infoOf(s: Json): SandboxInfo {
  return {
    id: s.id,
    state: String(s.state ?? "").replace(/^SANDBOX_STATE_/, "").toLowerCase(),
    image: s.image ?? "",
    labels: s.spec?.labels ?? {},
    createdAtUnixMs: Number(s.created_at_unix_ms ?? 0),
    workerId: s.worker_id ?? "",
  };
}

/** A sandbox: an isolated machine of its own on a worker. */
export class Sandbox {
  readonly id: string;
  readonly files: Files;
  /** @internal */
  readonly _client: Client;
  /** @internal */
  readonly _path: string;

  private constructor(client: Client, id: string) {
    this._client = client;
    this.id = id;
    this._path = `/v1/sandboxes/${enc(id)}`;
    this.files = new Files(this);
  }

  /** Makes a sandbox. */
  static async create(opts: CreateOptions = {}): Promise<Sandbox> {
    const client = await Client.connect(opts);
    const spec: Json = {};
    if (opts.image) spec.image = opts.image;
    if (opts.template) spec.template = opts.template;
    const memory = parseSize(opts.memory, "memory");
    if (memory) spec.memory_bytes = memory;
    if (opts.cpus !== undefined) {
      if (!(opts.cpus > 0)) throw new InvalidArgument(`cpus ${opts.cpus}: more than 0`);
      spec.cpu_millis = Math.round(opts.cpus * 1000);
    }
    if (opts.env) spec.env = opts.env;
    if (opts.labels) spec.labels = opts.labels;
    if (opts.ttl) spec.ttl_ms = Math.ceil(opts.ttl * 1000);
    if (opts.idleTimeout) spec.idle_timeout_ms = Math.ceil(opts.idleTimeout * 1000);
    if (opts.egress) {
      spec.egress = opts.egress;
      spec.egress_proxy = true;
    }
    if (opts.volumes) {
      spec.volumes = Object.entries(opts.volumes).map(([path, v]) => {
        if (!path.startsWith("/")) throw new InvalidArgument(`volume at ${JSON.stringify(path)}: an absolute path`);
        const { name, readOnly } = typeof v === "string" ? { name: v, readOnly: false } : v;
        return { name: checkName("volume", name), path, read_only: Boolean(readOnly) };
      });
    }
    const made = await client.call("POST", "/v1/sandboxes", { id: opts.id ?? randomId(), spec });
    return new Sandbox(client, String(made.id));
  }

  /** A sandbox made before (by its id). */
  static async connect(id: string, opts: ConnectOptions = {}): Promise<Sandbox> {
    const client = await Client.connect(opts);
    const sb = new Sandbox(client, id);
    await sb.info();
    return sb;
  }

  /** The sandboxes the caller may see. */
  static async list(opts: ConnectOptions = {}): Promise<SandboxInfo[]> {
    const client = await Client.connect(opts);
    const got = await client.call<{ sandboxes?: Json[] }>("GET", "/v1/sandboxes");
    return (got.sandboxes ?? []).map(infoOf);
  }

  /** What its worker says of it now. */
  async info(): Promise<SandboxInfo> {
    return infoOf(await this._client.call("GET", this._path));
  }

  /** Copies its files, as they are at one instant, into `count` new
   * sandboxes: the children, which start with no processes (nothing held
   * in memory is copied); it goes on as it was. */
  async fork(count = 1): Promise<Sandbox[]> {
    if (!(Number.isInteger(count) && count >= 1 && count <= 64)) {
      throw new InvalidArgument(`count ${count}: from 1 to 64`);
    }
    const r = await this._client.call<{ children?: Json[] }>("POST", "/v1/corral.v1.Worker/ForkSandbox", {
      id: this.id,
      count,
    });
    return (r.children ?? []).map((c) => new Sandbox(this._client, String(c.id)));
  }

  /** Gives `port` (a server in it listens there) a URL outside it, on a
   * worker that serves ports: signed (its token in `token`) unless
   * `public`; for `ttl` seconds (default: as long as it lives). */
  async exposePort(port: number, opts: { public?: boolean; ttl?: number } = {}): Promise<Exposure> {
    if (!(Number.isInteger(port) && port >= 1 && port <= 65535)) {
      throw new InvalidArgument(`port ${port}: from 1 to 65535`);
    }
    const e = await this._client.call("POST", "/v1/corral.v1.Worker/ExposePort", {
      sandbox_id: this.id,
      port,
      access: opts.public ? "PORT_ACCESS_PUBLIC" : "PORT_ACCESS_SIGNED",
      ttl_ms: opts.ttl ? Math.ceil(opts.ttl * 1000) : 0,
    });
    return {
      port,
      url: String(e.url ?? ""),
      token: e.token ? String(e.token) : null,
      expiresAtUnixMs: Number(e.expires_at_unix_ms ?? 0) || null,
    };
  }

  /** Ends the exposure of `port`: whether there was one. */
  async closePort(port: number): Promise<boolean> {
    const r = await this._client.call<{ revoked?: boolean }>("POST", "/v1/corral.v1.Worker/RevokeAccess", {
      sandbox_id: this.id,
      port,
    });
    return Boolean(r.revoked);
  }

  /** Replaces where it may connect (a sandbox made with `egress`): new
   * connections follow at once, open ones no longer allowed are closed. */
  async setEgress(rules: string[]): Promise<void> {
    if (!Array.isArray(rules) || rules.some((r) => typeof r !== "string")) {
      throw new InvalidArgument("rules: a list of strings such as pypi.org:443");
    }
    await this._client.call("POST", "/v1/corral.v1.Worker/SetSandboxEgress", { id: this.id, rules });
  }

  /** Saves its files as template `name` (its processes not included): each
   * sandbox of it starts with them. */
  async snapshot(name: string): Promise<TemplateInfo> {
    return templateOf(
      await this._client.call("POST", "/v1/corral.v1.Worker/SnapshotSandbox", {
        id: this.id,
        template: checkName("template", name),
      }),
    );
  }

  /** Removes it and everything in it: whether it was there. */
  async remove(): Promise<boolean> {
    const r = await this._client.call<{ existed?: boolean }>("DELETE", this._path);
    return Boolean(r.existed);
  }

  /** Runs a command to its end: its result (a non-zero exit is a result,
   * not an exception). One round trip: the call streams its events. */
  async run(command: string | string[], opts: RunOptions = {}): Promise<Result> {
    return resultOf(await this._op({ shell: shellSpec(command, opts) }, opts));
  }

  /** Starts a command and returns at once: `wait()` for its end. */
  async start(command: string | string[], opts: RunOptions = {}): Promise<Process> {
    const id = randomId();
    const spec = { shell: { ...shellSpec(command, opts), keep_background: true } };
    await this._client.call("POST", `${this._path}/operations`, { operation_id: id, spec });
    return new Process(this, id, opts);
  }

  /** Runs operation `spec`, its output to `opts`: its finished result. */
  /** @internal */
  async _op(spec: Json, opts: RunOptions = {}): Promise<Json | undefined> {
    const id = randomId();
    const events = this._client.stream<Json>(
      "POST",
      `${this._path}/run`,
      { operation_id: id, spec },
      opts.signal,
    );
    let last = 0;
    const cancel = () => {
      void this._client.call("POST", `${this._path}/operations/${enc(id)}/cancel`, {}).catch(() => undefined);
    };
    opts.signal?.addEventListener("abort", cancel, { once: true });
    try {
      try {
        for await (const msg of events) {
          const ev = msg.event as Json | undefined;
          if (!ev) continue;
          last = Number(ev.seq ?? last);
          const done = deliver(ev, opts);
          if (done) return done.result;
        }
      } catch (e) {
        if (!(e instanceof CorralError) || e.code !== "UNAVAILABLE") throw e;
      }
      // The stream ended before the operation did (a worker restarting):
      // its events go on from the last one seen.
      return (await this._follow(id, last, opts, true)).raw;
    } finally {
      opts.signal?.removeEventListener("abort", cancel);
    }
  }

  /** Follows operation `id` from after `after` to its end. */
  /** @internal */
  async _follow(id: string, after: number, opts: RunOptions, raw: true): Promise<Result & { raw: Json | undefined }>;
  async _follow(id: string, after: number, opts: RunOptions): Promise<Result>;
  async _follow(id: string, after: number, opts: RunOptions, _raw = false): Promise<Result & { raw?: Json }> {
    const deadline = Date.now() + PATIENCE_MS;
    let last = after;
    for (;;) {
      try {
        const path = `${this._path}/events?operation_id=${enc(id)}&after_seq=${last}`;
        for await (const ev of this._client.stream<Json>("GET", path, undefined, opts.signal)) {
          last = Number(ev.seq ?? last);
          const done = deliver(ev, opts);
          if (done) return { ...resultOf(done.result), raw: done.result };
        }
      } catch (e) {
        if (!(e instanceof CorralError) || e.code !== "UNAVAILABLE" || Date.now() > deadline) throw e;
      }
      if (Date.now() > deadline) {
        throw new SandboxLost(`sandbox ${this.id}: its events stopped for ${PATIENCE_MS / 1000} s`, {
          code: "UNAVAILABLE",
          reason: "sandbox_lost",
        });
      }
      await new Promise((r) => setTimeout(r, 500));
    }
  }
}

/** A port of a sandbox given a URL. */
export interface Exposure {
  port: number;
  url: string;
  /** What a signed URL takes (as `?token=` or a Bearer); `null` if public. */
  token: string | null;
  expiresAtUnixMs: number | null;
}

/** A template of a worker's (or a front door tenant's). */
export interface TemplateInfo {
  name: string;
  image: string;
  createdAtUnixMs: number;
}

/** A volume: files that outlive sandboxes. */
export interface VolumeInfo {
  name: string;
  sizeBytes: number;
  usedBytes: number;
  createdAtUnixMs: number;
  /** The sandbox that writes it, if one does. */
  writer: string | null;
  readers: string[];
}

/** A template's or a volume's name: 1-64 of a-z 0-9 . _ -, first a letter
 * or a digit. */
function checkName(what: string, name: string): string {
  if (typeof name !== "string" || !/^[a-z0-9][a-z0-9._-]{0,63}$/.test(name)) {
    throw new InvalidArgument(`${what} ${JSON.stringify(name)}: 1-64 of a-z 0-9 . _ -, first a letter or a digit`);
  }
  return name;
}

function templateOf(t: Json): TemplateInfo {
  return { name: String(t.name), image: String(t.image ?? ""), createdAtUnixMs: Number(t.created_at_unix_ms ?? 0) };
}

function volumeOf(v: Json): VolumeInfo {
  return {
    name: String(v.name),
    sizeBytes: Number(v.size_bytes ?? 0),
    usedBytes: Number(v.used_bytes ?? 0),
    createdAtUnixMs: Number(v.created_at_unix_ms ?? 0),
    writer: v.writer ? String(v.writer) : null,
    readers: (v.readers ?? []).map(String),
  };
}

/** What `Templates.build` takes. */
export interface BuildOptions extends ConnectOptions {
  /** The Dockerfile's text. */
  dockerfile: string;
  /** The rest of the build context, by path: text or bytes. */
  files?: Record<string, string | Uint8Array>;
  /** A command a sandbox of it starts with, and when it is ready: a port
   * accepting, a command exiting 0, or an HTTP path (`8000/health`). */
  start?: string;
  readyPort?: number;
  readyCommand?: string;
  readyHttp?: string;
  /** Seconds the build may take (default: the worker's bound). */
  timeout?: number;
  /** The engine's output, a line at a time. */
  onOutput?: (line: string) => void;
}

/** How a build ended: a template, or why not (an ordinary outcome, not an
 * exception: a step that fails is a result). */
export interface BuildResult {
  ok: boolean;
  /** The image built (`corral-build:<digest>`). */
  image: string | null;
  /** The same inputs were built before: nothing was built. */
  cached: boolean;
  template: TemplateInfo | null;
  /** Why not: its kind (`step_failed`, `timed_out`, `invalid`), the step
   * that failed (from 1; 0: before any) and its instruction, and the
   * engine's words. */
  failure: { kind: string; step: number; instruction: string; message: string } | null;
}

/** A tar stream of `files` (ustar: paths of at most 100 bytes, mode 644). */
function tarOf(files: Record<string, string | Uint8Array>): Uint8Array {
  const enc = new TextEncoder();
  const blocks: Uint8Array[] = [];
  for (const [path, content] of Object.entries(files)) {
    const name = enc.encode(path);
    if (!path || name.length > 100 || path.startsWith("/") || path.split("/").includes("..")) {
      throw new InvalidArgument(`file ${JSON.stringify(path)}: a relative path of at most 100 bytes, without ..`);
    }
    const data = typeof content === "string" ? enc.encode(content) : content;
    const h = new Uint8Array(512);
    const put = (at: number, text: string) => h.set(enc.encode(text), at);
    h.set(name, 0);
    put(100, "0000644\0");
    put(108, "0000000\0");
    put(116, "0000000\0");
    put(124, data.length.toString(8).padStart(11, "0") + "\0");
    put(136, "00000000000\0");
    put(148, "        ");
    h[156] = "0".charCodeAt(0);
    put(257, "ustar\0");
    put(263, "00");
    const sum = h.reduce((a, b) => a + b, 0);
    put(148, sum.toString(8).padStart(6, "0") + "\0 ");
    blocks.push(h, data, new Uint8Array((512 - (data.length % 512)) % 512));
  }
  blocks.push(new Uint8Array(1024));
  return concat(blocks);
}

/** The templates there are (built here, with `corral template build`, or
 * saved by `Sandbox.snapshot`). */
export const Templates = {
  /** Builds template `name` on the worker's engine (a worker started with
   * `--allow-build`) from a Dockerfile and its files: the same inputs
   * build nothing. */
  async build(name: string, opts: BuildOptions): Promise<BuildResult> {
    const client = await Client.connect(opts);
    if (typeof opts.dockerfile !== "string" || !opts.dockerfile.trim()) {
      throw new InvalidArgument("dockerfile: its text");
    }
    const files = { ...(opts.files ?? {}), Dockerfile: opts.dockerfile };
    const tar = tarOf(files);
    const first: Json = { dockerfile: "Dockerfile", template: checkName("template", name) };
    if (opts.timeout) first.timeout_ms = Math.ceil(opts.timeout * 1000);
    const readies = [opts.readyPort, opts.readyCommand, opts.readyHttp].filter((r) => r !== undefined);
    if (readies.length > 1) throw new InvalidArgument("one of readyPort, readyCommand, readyHttp");
    if (opts.start || readies.length) {
      if (!opts.start) throw new InvalidArgument("a readiness probe needs start");
      const start: Json = { command: opts.start };
      if (opts.readyPort !== undefined) start.port = opts.readyPort;
      if (opts.readyCommand !== undefined) start.ready_command = opts.readyCommand;
      if (opts.readyHttp !== undefined) start.http = opts.readyHttp;
      first.start = start;
    }
    const messages: Json[] = [first];
    for (let at = 0; at < tar.length; at += 1 << 20) {
      messages.push({ data: toBase64(tar.subarray(at, at + (1 << 20))) });
    }
    messages.push({ eof: true });
    for await (const ev of client.stream<Json>("POST", "/v1/corral.v1.Worker/BuildImage", undefined, undefined, messages)) {
      if (typeof ev.output === "string") {
        for (const line of ev.output.split("\n")) if (line) opts.onOutput?.(line);
      } else if (ev.done) {
        const d = ev.done as Json;
        const f = d.failure as Json | undefined;
        return {
          ok: !f,
          image: d.image ? String(d.image) : null,
          cached: Boolean(d.cached),
          template: d.template ? templateOf(d.template) : null,
          failure: f
            ? {
                kind: String(f.kind ?? "").replace(/^KIND_/, "").toLowerCase(),
                step: Number(f.step ?? 0),
                instruction: String(f.instruction ?? ""),
                message: String(f.message ?? ""),
              }
            : null,
        };
      }
    }
    throw new CorralError(`template ${name}: the build's stream ended without its result`, { code: "UNAVAILABLE" });
  },
  async list(opts: ConnectOptions = {}): Promise<TemplateInfo[]> {
    const client = await Client.connect(opts);
    const r = await client.call<{ templates?: Json[] }>("POST", "/v1/corral.v1.Worker/ListTemplates", {});
    return (r.templates ?? []).map(templateOf);
  },
  /** Forgets template `name` (refused while a sandbox of it runs, unless
   * `force`): whether there was one. */
  async remove(name: string, opts: ConnectOptions & { force?: boolean } = {}): Promise<boolean> {
    const client = await Client.connect(opts);
    const r = await client.call<{ existed?: boolean }>("POST", "/v1/corral.v1.Worker/DeleteTemplate", {
      name: checkName("template", name),
      force: Boolean(opts.force),
    });
    return Boolean(r.existed);
  },
};

/** Volumes: made, listed, removed; mounted by `Sandbox.create({ volumes })`. */
export const Volumes = {
  /** Makes volume `name` of `size` (bytes, or `10g`; default: the worker's). */
  async create(name: string, opts: ConnectOptions & { size?: number | string } = {}): Promise<VolumeInfo> {
    const client = await Client.connect(opts);
    return volumeOf(
      await client.call("POST", "/v1/corral.v1.Worker/CreateVolume", {
        name: checkName("volume", name),
        size_bytes: parseSize(opts.size, "size") ?? 0,
      }),
    );
  },
  async list(opts: ConnectOptions = {}): Promise<VolumeInfo[]> {
    const client = await Client.connect(opts);
    const r = await client.call<{ volumes?: Json[] }>("POST", "/v1/corral.v1.Worker/ListVolumes", {});
    return (r.volumes ?? []).map(volumeOf);
  },
  /** Removes volume `name` and its files (refused while mounted): whether
   * there was one. */
  async remove(name: string, opts: ConnectOptions = {}): Promise<boolean> {
    const client = await Client.connect(opts);
    const r = await client.call<{ existed?: boolean }>("POST", "/v1/corral.v1.Worker/DeleteVolume", {
      name: checkName("volume", name),
    });
    return Boolean(r.existed);
  },
};

/** Hands an event's output to its callback; the finished result, if it ends. */
function deliver(ev: Json, opts: RunOptions): { result: Json | undefined } | null {
  if (ev.output) {
    const data = fromBase64(ev.output.data);
    if (ev.output.stream === "OUTPUT_STREAM_STDERR") opts.onStderr?.(data);
    else opts.onStdout?.(data);
    return null;
  }
  if (ev.finished) return { result: ev.finished.result };
  if (ev.sandbox_lost) {
    throw new SandboxLost(`the sandbox was lost: ${ev.sandbox_lost.reason ?? ""}`, {
      code: "UNAVAILABLE",
      reason: "sandbox_lost",
    });
  }
  return null;
}
