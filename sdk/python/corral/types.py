"""What calls return: results of commands, and what sandboxes and workers say."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from corral._proto import worker_pb2 as pb


class EndCause(str, enum.Enum):
    """How a command ended."""

    EXITED = "exited"
    SIGNALED = "signaled"
    TIMED_OUT = "timed_out"
    OUT_OF_MEMORY = "out_of_memory"
    CANCELED = "canceled"
    SANDBOX_LOST = "sandbox_lost"
    SPAWN_FAILED = "spawn_failed"
    FILE_ERROR = "file_error"


@dataclass(frozen=True)
class Result:
    """A finished command.

    ``exit_code`` is the command's exit status when it exited; a command
    killed by a signal has ``end_cause`` SIGNALED and ``exit_code`` 128 +
    the signal, as a shell says; a timeout, OOM kill or cancel has
    ``exit_code`` None. ``stdout``/``stderr`` are what the worker kept of
    each stream (its first and last bytes, 1 MiB each by default);
    ``omitted_bytes`` counts what was left out between them (every byte
    still reached ``on_stdout``/``on_stderr`` and the process iterators).
    """

    exit_code: int | None
    stdout: str
    stderr: str
    end_cause: EndCause
    duration_s: float
    omitted_bytes: int = 0
    signal: int | None = None
    #: Why it could not start, or why its sandbox was lost.
    reason: str | None = None
    stdout_bytes: bytes = field(default=b"", repr=False)
    stderr_bytes: bytes = field(default=b"", repr=False)

    @property
    def ok(self) -> bool:
        """It exited with status 0."""
        return self.end_cause is EndCause.EXITED and self.exit_code == 0

    @property
    def output(self) -> str:
        """stdout then stderr, as a terminal shows them one after the other."""
        return self.stdout + self.stderr


def _kept(c: pb.CapturedOutput) -> tuple[bytes, int]:
    data = bytes(c.head) + bytes(c.tail)
    return data, max(0, c.total_bytes - len(data))


def result_of(r: pb.OperationResult) -> Result:
    out, out_omitted = _kept(r.stdout)
    err, err_omitted = _kept(r.stderr)
    o = r.outcome
    kind = o.WhichOneof("kind")
    exit_code: int | None = None
    sig: int | None = None
    reason: str | None = None
    if kind == "exited":
        cause = EndCause.EXITED
        exit_code = o.exited.code
    elif kind == "signaled":
        cause = EndCause.SIGNALED
        sig = o.signaled.signal
        exit_code = 128 + sig
    elif kind == "timed_out":
        cause = EndCause.TIMED_OUT
    elif kind == "out_of_memory":
        cause = EndCause.OUT_OF_MEMORY
    elif kind == "canceled":
        cause = EndCause.CANCELED
    elif kind == "sandbox_lost":
        cause = EndCause.SANDBOX_LOST
        reason = o.sandbox_lost.reason
    elif kind == "spawn_failed":
        cause = EndCause.SPAWN_FAILED
        reason = o.spawn_failed.reason
    else:
        cause = EndCause.FILE_ERROR
        reason = o.file_error.message
    return Result(
        exit_code=exit_code,
        stdout=out.decode("utf-8", "replace"),
        stderr=err.decode("utf-8", "replace"),
        end_cause=cause,
        duration_s=r.duration_ms / 1000.0,
        omitted_bytes=out_omitted + err_omitted,
        signal=sig,
        reason=reason,
        stdout_bytes=out,
        stderr_bytes=err,
    )


class SandboxState(str, enum.Enum):
    STARTING = "starting"
    READY = "ready"
    LOST = "lost"
    #: Its processes and memory are saved (gVisor); it runs nothing until
    #: restored.
    CHECKPOINTED = "checkpointed"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class SandboxInfo:
    id: str
    state: SandboxState
    image: str
    worker_id: str
    #: The worker's address this client reached it at.
    worker: str
    container_id: str
    running_operations: int
    created_at_unix_ms: int
    last_used_unix_ms: int
    lost_reason: str | None
    env: dict[str, str]
    labels: dict[str, str]
    #: The limits it runs with: those it was created with, or else the
    #: worker's defaults.
    memory_bytes: int
    cpus: float
    pids: int
    runtime: str | None
    ttl_s: float | None
    idle_timeout_s: float | None
    last_seq: int
    #: The egress rules it follows now (empty: no way out).
    egress: tuple[str, ...] = ()
    #: Whether it has the egress proxy (made with ``egress``, an empty list
    #: too), so that :meth:`~corral.Sandbox.set_egress` can open it.
    egress_proxy: bool = False


class SandboxList(list[SandboxInfo]):
    """The sandboxes listed, oldest first. Of several workers, one that did not
    answer is left out of the list and named in ``unreachable`` (its address,
    and why), as ``corral sandbox ls`` warns of it."""

    def __init__(
        self,
        items: list[SandboxInfo] | None = None,
        unreachable: dict[str, BaseException] | None = None,
    ) -> None:
        super().__init__(items or [])
        #: The workers that did not answer: address, and the error.
        self.unreachable: dict[str, BaseException] = dict(unreachable or {})


def sandbox_info_of(s: pb.Sandbox, worker: str) -> SandboxInfo:
    states = {
        pb.SANDBOX_STATE_STARTING: SandboxState.STARTING,
        pb.SANDBOX_STATE_READY: SandboxState.READY,
        pb.SANDBOX_STATE_LOST: SandboxState.LOST,
        pb.SANDBOX_STATE_CHECKPOINTED: SandboxState.CHECKPOINTED,
    }
    spec = s.spec
    return SandboxInfo(
        id=s.id,
        state=states.get(s.state, SandboxState.UNKNOWN),
        image=s.image,
        worker_id=s.worker_id,
        worker=worker,
        container_id=s.container_id,
        running_operations=s.running_operations,
        created_at_unix_ms=s.created_at_unix_ms,
        last_used_unix_ms=s.last_used_unix_ms,
        lost_reason=s.lost_reason or None,
        env=dict(spec.env),
        labels=dict(spec.labels),
        # A worker that does not say (0) is taken at the spec's word.
        memory_bytes=s.memory_bytes or spec.memory_bytes,
        cpus=(s.cpu_millis or spec.cpu_millis) / 1000.0,
        pids=s.pids_limit or spec.pids_limit,
        runtime=spec.runtime or None,
        ttl_s=spec.ttl_ms / 1000.0 if spec.ttl_ms else None,
        idle_timeout_s=spec.idle_timeout_ms / 1000.0 if spec.idle_timeout_ms else None,
        last_seq=s.last_seq,
        egress=tuple(spec.egress),
        egress_proxy=spec.egress_proxy or bool(spec.egress),
    )


@dataclass(frozen=True)
class SandboxStats:
    memory_bytes: int
    memory_limit_bytes: int
    files_bytes: int
    cpu_percent: float
    cpu_total_s: float
    pids: int
    pids_limit: int


def stats_of(s: pb.SandboxStats) -> SandboxStats:
    return SandboxStats(
        memory_bytes=s.memory_bytes,
        memory_limit_bytes=s.memory_limit_bytes,
        files_bytes=s.files_bytes,
        cpu_percent=s.cpu_percent,
        cpu_total_s=s.cpu_total_ns / 1e9,
        pids=s.pids,
        pids_limit=s.pids_limit,
    )


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    version: str
    max_sandboxes: int
    sandboxes: int
    running_operations: int
    draining: bool
    default_image: str
    default_runtime: str | None
    #: The limits of a sandbox that names none (0: the worker does not say).
    default_memory_bytes: int = 0
    default_cpus: float = 0.0
    default_pids: int = 0


def worker_info_of(w: pb.WorkerInfo) -> WorkerInfo:
    return WorkerInfo(
        worker_id=w.worker_id,
        version=w.version,
        max_sandboxes=w.max_sandboxes,
        sandboxes=w.sandboxes,
        running_operations=w.running_operations,
        draining=w.draining,
        default_image=w.default_image,
        default_runtime=w.default_runtime or None,
        default_memory_bytes=w.default_memory_bytes,
        default_cpus=w.default_cpu_millis / 1000.0,
        default_pids=w.default_pids_limit,
    )


class BuildFailureKind(str, enum.Enum):
    #: A step of the Dockerfile failed (a RUN that exited non-zero, a COPY
    #: of a file the context lacks).
    STEP_FAILED = "step_failed"
    #: The build ran out of its time and was stopped.
    TIMED_OUT = "timed_out"
    #: The Dockerfile cannot be built as written.
    INVALID = "invalid"


@dataclass(frozen=True)
class BuildFailure:
    kind: BuildFailureKind
    #: The step that failed, counted from 1 as the build counts them, of
    #: ``steps`` (0: before any step).
    step: int
    steps: int
    #: That step's instruction as the build showed it (``RUN make``).
    instruction: str
    #: The engine's words.
    message: str

    def __str__(self) -> str:
        where = f"step {self.step}/{self.steps} ({self.instruction}): " if self.step else ""
        return f"{where}{self.message}"


@dataclass(frozen=True)
class Volume:
    """A volume: a filesystem its worker keeps across sandboxes (see
    :func:`corral.create_volume`)."""

    name: str
    #: What its files may take (the filesystem's size).
    size_bytes: int
    #: What they take now (0 while it is not mounted on its worker).
    used_bytes: int
    created_at_unix_ms: int
    #: The sandbox that writes to it now, if any.
    writer: str | None
    #: The sandboxes that read it.
    readers: tuple[str, ...]
    #: The worker that keeps it.
    worker: str


@dataclass(frozen=True)
class TemplateInfo:
    """A template a worker keeps (see :func:`corral.list_templates`)."""

    name: str
    #: The image its sandboxes run.
    image: str
    created_at_unix_ms: int
    #: What its sandboxes start with, if anything.
    start_command: str | None
    #: The worker that keeps it.
    worker: str


@dataclass(frozen=True)
class BuiltImage:
    """How a build ended: ``image`` to create sandboxes from (on ``worker``),
    or a ``failure``."""

    image: str | None
    #: The worker that built it: its sandboxes may name the image.
    worker: str
    #: Built before from the same inputs: nothing was built this time.
    cached: bool
    duration_s: float
    failure: BuildFailure | None
    #: The build's output, as the engine wrote it.
    output: str
    #: The template it is kept as (when one was named).
    template: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None and self.image is not None


class PortAccess(str, enum.Enum):
    """Who may use an exposed port."""

    #: The worker's token (``Authorization: Bearer``).
    PRIVATE = "private"
    #: A token made for this port and time (``token``).
    SIGNED = "signed"
    #: Anyone who reaches the worker's port listener (where it allows it).
    PUBLIC = "public"


@dataclass(frozen=True)
class PortExposure:
    """An exposed port: its ``url``, and for signed access its ``token``
    (send it as ``Authorization: Bearer``, or once as ``?token=``: a browser
    then keeps it as a cookie; :attr:`browser_url` is that URL)."""

    sandbox_id: str
    port: int
    access: PortAccess
    url: str
    token: str | None
    #: Seconds since the epoch; None: until revoked.
    expires_at: float | None
    #: A request to the port while the sandbox is checkpointed restores it.
    wake_on_request: bool = False

    @property
    def browser_url(self) -> str:
        """The URL to open as it is (with its token, if it needs one)."""
        return f"{self.url}?token={self.token}" if self.token else self.url

    @property
    def host(self) -> str:
        """The host (and port) of :attr:`url`."""
        rest = self.url.split("://", 1)[-1]
        return rest.split("/", 1)[0]


def exposure_of(e: pb.PortExposure) -> PortExposure:
    access = {2: PortAccess.SIGNED, 3: PortAccess.PUBLIC}.get(int(e.access), PortAccess.PRIVATE)
    return PortExposure(
        sandbox_id=e.sandbox_id,
        port=int(e.port),
        access=access,
        url=e.url,
        token=e.token or None,
        expires_at=e.expires_at_unix_ms / 1000 if e.expires_at_unix_ms > 0 else None,
        wake_on_request=bool(e.wake_on_request),
    )


class EntryType(str, enum.Enum):
    FILE = "file"
    DIRECTORY = "directory"
    SYMLINK = "symlink"
    OTHER = "other"


@dataclass(frozen=True)
class FileEntry:
    """One entry of a directory listing."""

    name: str
    path: str
    type: EntryType
    mode: int
    size: int
    mtime: float


@dataclass(frozen=True)
class OutputChunk:
    """A piece of a process's output, with the event's place in its
    sandbox's stream: ``Process.attach(sb, id, after=chunk.seq)`` goes on
    right after it."""

    seq: int
    stream: str
    data: bytes
