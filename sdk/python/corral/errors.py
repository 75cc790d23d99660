"""Corral's errors: one class per kind of failure a program acts on.

A failed call to a worker is turned into one of these from its gRPC status
code and the machine-readable reason the worker sends with it (the
``corral-reason`` metadata entry, and ``corral-flag`` for a refusal by the
worker's policy), never from the message, which is for people. Ordinary
outcomes of a command (a non-zero exit, a signal, a timeout) are results,
not errors: see :class:`corral.Result`.
"""

from __future__ import annotations

from typing import ClassVar

import grpc

REASON_KEY = "corral-reason"
FLAG_KEY = "corral-flag"


class CorralError(Exception):
    """Any failure of Corral itself (not of a command run in a sandbox).

    ``code`` is the gRPC status code's name (``"UNAVAILABLE"``, ...) when the
    failure came from a call, ``reason`` the worker's machine-readable reason
    when it sent one.
    """

    default_code: ClassVar[str] = "UNKNOWN"
    #: The reason of one raised by this client itself, as a worker would say it.
    default_reason: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.reason = reason or self.default_reason


class InvalidArgument(CorralError):
    """The request is malformed or out of bounds (a NUL byte, a bad id, ...)."""

    default_code = "INVALID_ARGUMENT"
    default_reason = "invalid_argument"


class Unauthenticated(CorralError):
    """No token, or the wrong one (see ``CORRAL_TOKEN_FILE``)."""

    default_code = "UNAUTHENTICATED"


class PolicyDenied(CorralError):
    """The worker's policy refuses what was asked.

    ``flag`` is the ``corral-worker`` flag that would allow it (``None`` for
    what no worker grants).
    """

    default_code = "PERMISSION_DENIED"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        reason: str | None = None,
        flag: str | None = None,
    ) -> None:
        super().__init__(message, code=code, reason=reason)
        self.flag = flag


class PermissionDenied(CorralError):
    """The caller's key does not allow what was asked (its scopes: ``read``,
    ``run``, ``admin``), at a front door (``corral serve --tenants``)."""

    default_code = "PERMISSION_DENIED"
    default_reason = "permission_denied"


class SandboxNotFound(CorralError):
    """No such sandbox (never made, or removed: ``reason`` says which)."""

    default_code = "NOT_FOUND"


class ProcessNotFound(CorralError):
    """No such operation in the sandbox (its worker forgot it, or never had it)."""

    default_code = "NOT_FOUND"


class SandboxLost(CorralError):
    """The sandbox's container is gone or broken: what ran there cannot go on."""

    default_code = "FAILED_PRECONDITION"


class SandboxCheckpointed(CorralError):
    """The sandbox is checkpointed (its processes and memory saved; nothing
    runs): restore it first."""

    default_code = "FAILED_PRECONDITION"


class ResourceExhausted(CorralError):
    """A limit was reached: the worker is full (``at_capacity``), too many
    watchers, no free sandbox uid, a message too large."""

    default_code = "RESOURCE_EXHAUSTED"


class QuotaExceeded(ResourceExhausted):
    """The caller's tenant is at a quota of its front door: ``quota`` names
    it (``sandboxes``, ``creates_per_minute``), ``limit`` and ``used`` say
    where it stands."""

    default_reason = "quota_exceeded"

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        reason: str | None = None,
        quota: str | None = None,
        limit: int | None = None,
        used: int | None = None,
    ) -> None:
        super().__init__(message, code=code, reason=reason)
        self.quota = quota
        self.limit = limit
        self.used = used


class WorkerUnavailable(CorralError):
    """The worker cannot serve now: unreachable, draining, shutting down, its
    Docker engine down. Another worker, or a later try, may."""

    default_code = "UNAVAILABLE"


class Conflict(CorralError):
    """A sandbox or operation of that id exists with a different spec."""

    default_code = "ALREADY_EXISTS"


#: A file failure's kind as the status code a call failing so would carry.
_FILE_CODES: dict[str, str] = {
    "not_found": "NOT_FOUND",
    "permission_denied": "PERMISSION_DENIED",
    "outside_sandbox_roots": "PERMISSION_DENIED",
    "is_directory": "FAILED_PRECONDITION",
    "not_regular": "FAILED_PRECONDITION",
    "too_large": "RESOURCE_EXHAUSTED",
}


class FileError(CorralError):
    """A file operation failed in the sandbox; ``kind`` (also ``reason``)
    says how (``not_found``, ``permission_denied``, ``is_directory``,
    ``outside_sandbox_roots``, ``too_large``, ``not_regular``, ``other``),
    ``code`` the status code that goes with it (``NOT_FOUND``, ...,
    ``UNKNOWN`` for ``other``). The call itself succeeded: the failure is
    the file's, and trying again changes nothing."""

    default_code = "UNKNOWN"

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message, code=_FILE_CODES.get(kind, "UNKNOWN"), reason=kind)
        self.kind = kind


class TransferError(CorralError):
    """An upload or download failed: the sandbox's side refused the archive,
    or what came out broke the rules of what is taken (a name outside the
    tree asked for, too many entries, ...)."""

    default_code = "FAILED_PRECONDITION"


class ConfigError(CorralError):
    """This side's configuration is wrong (a bad worker address, a token file
    others can read, no ``corral`` binary for the local worker, ...)."""

    default_code = "INVALID_ARGUMENT"


_BY_REASON: dict[str, type[CorralError]] = {
    "invalid_argument": InvalidArgument,
    "unauthenticated": Unauthenticated,
    "policy_denied": PolicyDenied,
    "permission_denied": PermissionDenied,
    "quota_exceeded": QuotaExceeded,
    "sandbox_not_found": SandboxNotFound,
    "sandbox_removed": SandboxNotFound,
    "operation_not_found": ProcessNotFound,
    "conflict": Conflict,
    "at_capacity": ResourceExhausted,
    "too_many_watchers": ResourceExhausted,
    "no_free_uid": ResourceExhausted,
    "too_large": ResourceExhausted,
    "sandbox_lost": SandboxLost,
    "sandbox_checkpointed": SandboxCheckpointed,
    "no_such_image": InvalidArgument,
    "no_such_runtime": InvalidArgument,
    "no_such_template": InvalidArgument,
    "template_not_ready": InvalidArgument,
    "template_in_use": Conflict,
    "no_such_volume": InvalidArgument,
    "volume_in_use": Conflict,
    "not_applicable": InvalidArgument,
    "input_gap": InvalidArgument,
    "fork_failed": InvalidArgument,
    "docker_refused": InvalidArgument,
    "docker_unavailable": WorkerUnavailable,
    "supervisor_unresponsive": WorkerUnavailable,
    "supervisor_detached": WorkerUnavailable,
    "sandbox_busy": WorkerUnavailable,
    "draining": WorkerUnavailable,
    "shutting_down": WorkerUnavailable,
    "incomplete": WorkerUnavailable,
}

_BY_CODE: dict[grpc.StatusCode, type[CorralError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PolicyDenied,
    grpc.StatusCode.NOT_FOUND: SandboxNotFound,
    grpc.StatusCode.ALREADY_EXISTS: Conflict,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: WorkerUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: WorkerUnavailable,
}


def _metadata(entries: object, key: str) -> str | None:
    if not entries:
        return None
    for entry in entries:  # type: ignore[attr-defined]
        k, v = entry[0], entry[1]
        if k == key:
            return v.decode() if isinstance(v, bytes) else str(v)
    return None


def from_rpc_error(e: grpc.RpcError, where: str | None = None) -> CorralError:
    """The Corral error of a failed call: by the worker's reason when it
    sent one, else by the status code alone."""
    code: grpc.StatusCode = e.code()
    details: str = e.details() or code.name
    trailing = e.trailing_metadata()
    reason = _metadata(trailing, REASON_KEY)
    flag = _metadata(trailing, FLAG_KEY)
    message = f"{where}: {details}" if where else details
    cls = _BY_REASON.get(reason or "") or _BY_CODE.get(code, CorralError)
    if cls is PolicyDenied:
        return PolicyDenied(message, code=code.name, reason=reason, flag=flag)
    if cls is QuotaExceeded:

        def number(key: str) -> int | None:
            v = _metadata(trailing, key)
            return int(v) if v is not None and v.isdigit() else None

        return QuotaExceeded(
            message,
            code=code.name,
            reason=reason,
            quota=_metadata(trailing, "corral-quota"),
            limit=number("corral-quota-limit"),
            used=number("corral-quota-used"),
        )
    if cls is CorralError and code == grpc.StatusCode.UNKNOWN and reason is None:
        # The transport's own failures (a connection reset) are transient.
        return WorkerUnavailable(message, code=code.name)
    return cls(message, code=code.name, reason=reason)


def is_transient(e: CorralError) -> bool:
    """Worth the same call again after a pause (a worker restarting, a
    dropped watch, a blink of the network), with the same ids."""
    if e.reason == "draining" or isinstance(e, (FileError, TransferError)):
        # A file's failure, or an archive's, is the same the next time.
        return False
    return e.code in ("UNAVAILABLE", "UNKNOWN", "ABORTED") or (
        e.code == "INTERNAL" and e.reason is None
    )
