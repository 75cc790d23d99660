/**
 * Errors, chosen by the reason the server gives (`corral-reason`, the same a
 * gRPC client reads), never by the words of its message.
 */

/** What the server said of a call that failed. */
export interface ErrorBody {
  code: string;
  message: string;
  reason?: string;
  flag?: string;
}

/** A call that failed: `code` is the gRPC code's name (`NOT_FOUND`),
 * `reason` why in words a program may match on (`sandbox_not_found`),
 * `flag` the worker flag that would allow what a policy refused, `status`
 * the HTTP status. */
export class CorralError extends Error {
  readonly code: string;
  readonly reason: string | undefined;
  readonly flag: string | undefined;
  readonly status: number;

  constructor(message: string, opts: { code?: string; reason?: string; flag?: string; status?: number } = {}) {
    super(message);
    this.name = new.target.name;
    this.code = opts.code ?? "UNKNOWN";
    this.reason = opts.reason;
    this.flag = opts.flag;
    this.status = opts.status ?? 0;
  }
}

/** The request was wrong (a bad argument, an image or template that is not there). */
export class InvalidArgument extends CorralError {}
/** No credentials, or not these. */
export class Unauthenticated extends CorralError {}
/** The worker's policy refuses it: `flag` names what would allow it. */
export class PolicyDenied extends CorralError {}
/** The key's scope does not allow it. */
export class PermissionDenied extends CorralError {}
/** A tenant's quota is used up. */
export class QuotaExceeded extends CorralError {}
/** No such sandbox (or not one of the caller's). */
export class SandboxNotFound extends CorralError {}
/** No such operation. */
export class ProcessNotFound extends CorralError {}
/** Something of that id exists with another spec, or is in use. */
export class Conflict extends CorralError {}
/** At capacity, too many watchers, too large. */
export class ResourceExhausted extends CorralError {}
/** The sandbox was lost (its container or supervisor went away). */
export class SandboxLost extends CorralError {}
/** The sandbox is checkpointed: restore it first. */
export class SandboxCheckpointed extends CorralError {}
/** The worker cannot answer now (draining, its engine away): try again. */
export class WorkerUnavailable extends CorralError {}
/** A file operation failed in the sandbox; `kind` says how (`not_found`,
 * `permission_denied`, `is_directory`, `outside_sandbox_roots`,
 * `too_large`, `not_regular`, `other`). */
export class FileError extends CorralError {
  readonly kind: string;
  constructor(message: string, kind: string) {
    super(message, { reason: kind });
    this.kind = kind;
  }
}

const BY_REASON: Record<string, new (message: string, opts: object) => CorralError> = {
  invalid_argument: InvalidArgument,
  unauthenticated: Unauthenticated,
  policy_denied: PolicyDenied,
  permission_denied: PermissionDenied,
  quota_exceeded: QuotaExceeded,
  sandbox_not_found: SandboxNotFound,
  sandbox_removed: SandboxNotFound,
  operation_not_found: ProcessNotFound,
  conflict: Conflict,
  at_capacity: ResourceExhausted,
  too_many_watchers: ResourceExhausted,
  no_free_uid: ResourceExhausted,
  too_large: ResourceExhausted,
  sandbox_lost: SandboxLost,
  sandbox_checkpointed: SandboxCheckpointed,
  no_such_image: InvalidArgument,
  no_such_runtime: InvalidArgument,
  no_such_template: InvalidArgument,
  template_not_ready: InvalidArgument,
  template_in_use: Conflict,
  no_such_volume: InvalidArgument,
  volume_in_use: Conflict,
  not_applicable: InvalidArgument,
  input_gap: InvalidArgument,
  fork_failed: InvalidArgument,
  docker_refused: InvalidArgument,
  docker_unavailable: WorkerUnavailable,
  supervisor_unresponsive: WorkerUnavailable,
  supervisor_detached: WorkerUnavailable,
  sandbox_busy: WorkerUnavailable,
  draining: WorkerUnavailable,
  shutting_down: WorkerUnavailable,
  incomplete: WorkerUnavailable,
};

const BY_CODE: Record<string, new (message: string, opts: object) => CorralError> = {
  INVALID_ARGUMENT: InvalidArgument,
  FAILED_PRECONDITION: InvalidArgument,
  UNAUTHENTICATED: Unauthenticated,
  PERMISSION_DENIED: PolicyDenied,
  NOT_FOUND: SandboxNotFound,
  ALREADY_EXISTS: Conflict,
  RESOURCE_EXHAUSTED: ResourceExhausted,
  UNAVAILABLE: WorkerUnavailable,
};

/** The error for what the server answered: by its reason, else its code. */
export function errorOf(body: ErrorBody, status: number): CorralError {
  const cls = (body.reason && BY_REASON[body.reason]) || BY_CODE[body.code] || CorralError;
  return new cls(body.message, { code: body.code, reason: body.reason, flag: body.flag, status });
}
