/**
 * Corral from TypeScript: sandboxes for AI agents, through Corral's
 * HTTP/JSON API (a worker's or a front door's address), with Node's own
 * `fetch` and streams and nothing else.
 *
 * ```ts
 * import { Sandbox } from "@corral/sdk";
 * const sb = await Sandbox.create({ worker: "http://127.0.0.1:7070", tokenFile: "token" });
 * const r = await sb.run("python3 -c 'print(6*7)'");
 * console.log(r.exitCode, r.stdout); // 0 "42\n"
 * await sb.remove();
 * ```
 */

export { Client, ConnectOptions, fromBase64, toBase64 } from "./client.js";
export {
  Conflict,
  CorralError,
  ErrorBody,
  FileError,
  InvalidArgument,
  PermissionDenied,
  PolicyDenied,
  ProcessNotFound,
  QuotaExceeded,
  ResourceExhausted,
  SandboxCheckpointed,
  SandboxLost,
  SandboxNotFound,
  Unauthenticated,
  WorkerUnavailable,
  errorOf,
} from "./errors.js";
export {
  BuildOptions,
  BuildResult,
  CreateOptions,
  EndCause,
  Exposure,
  FileEntry,
  Files,
  Process,
  Result,
  RunOptions,
  Sandbox,
  SandboxInfo,
  TemplateInfo,
  Templates,
  VolumeInfo,
  Volumes,
} from "./sandbox.js";
