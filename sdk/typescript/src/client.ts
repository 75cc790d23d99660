/**
 * The HTTP side: a worker's or a front door's address, its credentials as a
 * Bearer, JSON calls, newline-delimited JSON streams, raw bytes.
 */

import { readFile } from "node:fs/promises";
import { CorralError, ErrorBody, InvalidArgument, WorkerUnavailable, errorOf } from "./errors.js";

/** Where to reach Corral and as whom. */
export interface ConnectOptions {
  /** `http://host:port` of a worker or a front door (default:
   * `CORRAL_WORKER`, else a front door's `CORRAL_URL`). */
  worker?: string;
  /** A front door's key or a worker's token (default: `CORRAL_API_KEY`). */
  token?: string;
  /** A file holding the token (default: `CORRAL_TOKEN_FILE`). */
  tokenFile?: string;
}

/** Bytes as base64 (what JSON carries `bytes` fields as). */
export function toBase64(data: Uint8Array): string {
  let s = "";
  for (let i = 0; i < data.length; i += 0x8000) {
    s += String.fromCharCode(...data.subarray(i, i + 0x8000));
  }
  return btoa(s);
}

/** Base64 as bytes. */
export function fromBase64(text: string | undefined): Uint8Array {
  if (!text) return new Uint8Array(0);
  const s = atob(text);
  const out = new Uint8Array(s.length);
  for (let i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
  return out;
}

type Json = Record<string, unknown>;

/** One worker or front door. */
export class Client {
  readonly url: string;
  readonly #auth: string | undefined;

  private constructor(url: string, token: string | undefined) {
    this.url = url;
    this.#auth = token ? `Bearer ${token}` : undefined;
  }

  /** The client `opts` (or the environment) names. */
  static async connect(opts: ConnectOptions = {}): Promise<Client> {
    const url = (opts.worker ?? process.env.CORRAL_WORKER ?? process.env.CORRAL_URL ?? "").replace(/\/+$/, "");
    if (!/^https?:\/\/[^/]+$/.test(url)) {
      throw new InvalidArgument(
        url
          ? `worker ${JSON.stringify(url)}: an http:// or https:// address (host:port), nothing after it`
          : "no worker: give worker (http://host:port) or set CORRAL_WORKER (a front door's: CORRAL_URL)",
        { code: "INVALID_ARGUMENT", reason: "invalid_argument" },
      );
    }
    let token = opts.token ?? process.env.CORRAL_API_KEY;
    const file = opts.tokenFile ?? process.env.CORRAL_TOKEN_FILE;
    if (token === undefined && file) {
      try {
        token = (await readFile(file, "utf8")).trim();
      } catch (e) {
        throw new InvalidArgument(`token file ${file}: ${(e as Error).message}`, {
          code: "INVALID_ARGUMENT",
          reason: "invalid_argument",
        });
      }
    }
    return new Client(url, token);
  }

  #headers(extra: Record<string, string> = {}): Record<string, string> {
    const h: Record<string, string> = { ...extra };
    if (this.#auth) h["Authorization"] = this.#auth;
    return h;
  }

  /** A request; a failure as the error its body names. */
  async request(
    method: string,
    path: string,
    body?: unknown,
    opts: { signal?: AbortSignal; accept?: string; raw?: Uint8Array; contentType?: string } = {},
  ): Promise<Response> {
    const headers = this.#headers(opts.accept ? { Accept: opts.accept } : {});
    let payload: BodyInit | undefined;
    if (opts.raw !== undefined) {
      payload = opts.raw;
      headers["Content-Type"] = opts.contentType ?? "application/octet-stream";
    } else if (body !== undefined) {
      payload = JSON.stringify(body);
      headers["Content-Type"] = "application/json";
    }
    let resp: Response;
    try {
      resp = await fetch(this.url + path, { method, headers, body: payload, signal: opts.signal });
    } catch (e) {
      if ((e as Error).name === "AbortError") throw e;
      throw new WorkerUnavailable(`${this.url}: ${(e as Error).message} (${String((e as Error & { cause?: unknown }).cause ?? "")})`, {
        code: "UNAVAILABLE",
      });
    }
    if (!resp.ok) {
      let err: ErrorBody = { code: "UNKNOWN", message: `HTTP ${resp.status}` };
      try {
        const got = (await resp.json()) as { error?: ErrorBody };
        if (got.error) err = got.error;
      } catch {
        // Not the gateway's answer (a proxy's page): its status says enough.
      }
      throw errorOf(err, resp.status);
    }
    return resp;
  }

  /** A unary call: its answer as JSON. */
  async call<T = Json>(method: string, path: string, body?: unknown, signal?: AbortSignal): Promise<T> {
    const resp = await this.request(method, path, body, { signal });
    return (await resp.json()) as T;
  }

  /** A streaming call: its messages, one a line, as they come; an error
   * line throws. Stops (and closes the answer) when the caller stops.
   * `messages`: the request stream of a call that takes one (sent as
   * newline-delimited JSON, instead of `body`). */
  async *stream<T = Json>(
    method: string,
    path: string,
    body?: unknown,
    signal?: AbortSignal,
    messages?: unknown[],
  ): AsyncGenerator<T> {
    const ctl = new AbortController();
    const onAbort = () => ctl.abort();
    signal?.addEventListener("abort", onAbort, { once: true });
    try {
      // A call that takes a stream: its messages, one JSON line each.
      const raw = messages
        ? new TextEncoder().encode(messages.map((m) => JSON.stringify(m) + "\n").join(""))
        : undefined;
      const resp = await this.request(method, path, body, {
        signal: ctl.signal,
        accept: "application/x-ndjson",
        raw,
        contentType: "application/x-ndjson",
      });
      if (!resp.body) return;
      const reader = resp.body.getReader();
      const decoder = new TextDecoder();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (value) buf += decoder.decode(value, { stream: true });
        let nl: number;
        while ((nl = buf.indexOf("\n")) >= 0) {
          const line = buf.slice(0, nl).trim();
          buf = buf.slice(nl + 1);
          if (!line) continue;
          const msg = JSON.parse(line) as Json;
          if (msg.error && typeof msg.error === "object") {
            throw errorOf(msg.error as ErrorBody, 200);
          }
          yield msg as T;
        }
        if (done) break;
      }
      if (buf.trim()) throw new CorralError(`${this.url}: a stream ended mid-line`, { code: "UNAVAILABLE" });
    } finally {
      signal?.removeEventListener("abort", onAbort);
      ctl.abort();
    }
  }
}
