from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PortAccess(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PORT_ACCESS_UNSPECIFIED: _ClassVar[PortAccess]
    PORT_ACCESS_PRIVATE: _ClassVar[PortAccess]
    PORT_ACCESS_SIGNED: _ClassVar[PortAccess]
    PORT_ACCESS_PUBLIC: _ClassVar[PortAccess]

class NetworkMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NETWORK_MODE_UNSPECIFIED: _ClassVar[NetworkMode]
    NETWORK_MODE_NONE: _ClassVar[NetworkMode]
    NETWORK_MODE_BRIDGE: _ClassVar[NetworkMode]

class SandboxState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SANDBOX_STATE_UNSPECIFIED: _ClassVar[SandboxState]
    SANDBOX_STATE_STARTING: _ClassVar[SandboxState]
    SANDBOX_STATE_READY: _ClassVar[SandboxState]
    SANDBOX_STATE_LOST: _ClassVar[SandboxState]
    SANDBOX_STATE_CHECKPOINTED: _ClassVar[SandboxState]

class OperationStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OPERATION_STATUS_UNSPECIFIED: _ClassVar[OperationStatus]
    OPERATION_STATUS_RUNNING: _ClassVar[OperationStatus]
    OPERATION_STATUS_FINISHED: _ClassVar[OperationStatus]

class FileErrorKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FILE_ERROR_KIND_UNSPECIFIED: _ClassVar[FileErrorKind]
    FILE_ERROR_KIND_NOT_FOUND: _ClassVar[FileErrorKind]
    FILE_ERROR_KIND_PERMISSION_DENIED: _ClassVar[FileErrorKind]
    FILE_ERROR_KIND_IS_DIRECTORY: _ClassVar[FileErrorKind]
    FILE_ERROR_KIND_OUTSIDE_SANDBOX_ROOTS: _ClassVar[FileErrorKind]
    FILE_ERROR_KIND_TOO_LARGE: _ClassVar[FileErrorKind]
    FILE_ERROR_KIND_OTHER: _ClassVar[FileErrorKind]
    FILE_ERROR_KIND_NOT_REGULAR: _ClassVar[FileErrorKind]

class OutputStream(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_STREAM_UNSPECIFIED: _ClassVar[OutputStream]
    OUTPUT_STREAM_STDOUT: _ClassVar[OutputStream]
    OUTPUT_STREAM_STDERR: _ClassVar[OutputStream]
PORT_ACCESS_UNSPECIFIED: PortAccess
PORT_ACCESS_PRIVATE: PortAccess
PORT_ACCESS_SIGNED: PortAccess
PORT_ACCESS_PUBLIC: PortAccess
NETWORK_MODE_UNSPECIFIED: NetworkMode
NETWORK_MODE_NONE: NetworkMode
NETWORK_MODE_BRIDGE: NetworkMode
SANDBOX_STATE_UNSPECIFIED: SandboxState
SANDBOX_STATE_STARTING: SandboxState
SANDBOX_STATE_READY: SandboxState
SANDBOX_STATE_LOST: SandboxState
SANDBOX_STATE_CHECKPOINTED: SandboxState
OPERATION_STATUS_UNSPECIFIED: OperationStatus
OPERATION_STATUS_RUNNING: OperationStatus
OPERATION_STATUS_FINISHED: OperationStatus
FILE_ERROR_KIND_UNSPECIFIED: FileErrorKind
FILE_ERROR_KIND_NOT_FOUND: FileErrorKind
FILE_ERROR_KIND_PERMISSION_DENIED: FileErrorKind
FILE_ERROR_KIND_IS_DIRECTORY: FileErrorKind
FILE_ERROR_KIND_OUTSIDE_SANDBOX_ROOTS: FileErrorKind
FILE_ERROR_KIND_TOO_LARGE: FileErrorKind
FILE_ERROR_KIND_OTHER: FileErrorKind
FILE_ERROR_KIND_NOT_REGULAR: FileErrorKind
OUTPUT_STREAM_UNSPECIFIED: OutputStream
OUTPUT_STREAM_STDOUT: OutputStream
OUTPUT_STREAM_STDERR: OutputStream

class ExposePortRequest(_message.Message):
    __slots__ = ("sandbox_id", "port", "access", "ttl_ms", "wake_on_request")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    ACCESS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    WAKE_ON_REQUEST_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    port: int
    access: PortAccess
    ttl_ms: int
    wake_on_request: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., port: _Optional[int] = ..., access: _Optional[_Union[PortAccess, str]] = ..., ttl_ms: _Optional[int] = ..., wake_on_request: _Optional[bool] = ...) -> None: ...

class PortExposure(_message.Message):
    __slots__ = ("sandbox_id", "port", "access", "url", "token", "expires_at_unix_ms", "created_at_unix_ms", "wake_on_request")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    ACCESS_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    WAKE_ON_REQUEST_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    port: int
    access: PortAccess
    url: str
    token: str
    expires_at_unix_ms: int
    created_at_unix_ms: int
    wake_on_request: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., port: _Optional[int] = ..., access: _Optional[_Union[PortAccess, str]] = ..., url: _Optional[str] = ..., token: _Optional[str] = ..., expires_at_unix_ms: _Optional[int] = ..., created_at_unix_ms: _Optional[int] = ..., wake_on_request: _Optional[bool] = ...) -> None: ...

class RevokeAccessRequest(_message.Message):
    __slots__ = ("sandbox_id", "port")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    port: int
    def __init__(self, sandbox_id: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class RevokeAccessResponse(_message.Message):
    __slots__ = ("revoked",)
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    revoked: bool
    def __init__(self, revoked: _Optional[bool] = ...) -> None: ...

class ListExposuresRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class ListExposuresResponse(_message.Message):
    __slots__ = ("exposures",)
    EXPOSURES_FIELD_NUMBER: _ClassVar[int]
    exposures: _containers.RepeatedCompositeFieldContainer[PortExposure]
    def __init__(self, exposures: _Optional[_Iterable[_Union[PortExposure, _Mapping]]] = ...) -> None: ...

class SandboxSpec(_message.Message):
    __slots__ = ("image", "network", "memory_bytes", "cpu_millis", "pids_limit", "workspace_bytes", "tmp_bytes", "run_as_root", "writable_rootfs", "add_capabilities", "env", "runtime", "idle_timeout_ms", "ttl_ms", "memory_includes_files", "labels", "egress", "egress_proxy", "template", "volumes")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPU_MILLIS_FIELD_NUMBER: _ClassVar[int]
    PIDS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TMP_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUN_AS_ROOT_FIELD_NUMBER: _ClassVar[int]
    WRITABLE_ROOTFS_FIELD_NUMBER: _ClassVar[int]
    ADD_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_INCLUDES_FILES_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    EGRESS_FIELD_NUMBER: _ClassVar[int]
    EGRESS_PROXY_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    VOLUMES_FIELD_NUMBER: _ClassVar[int]
    image: str
    network: NetworkMode
    memory_bytes: int
    cpu_millis: int
    pids_limit: int
    workspace_bytes: int
    tmp_bytes: int
    run_as_root: bool
    writable_rootfs: bool
    add_capabilities: _containers.RepeatedScalarFieldContainer[str]
    env: _containers.ScalarMap[str, str]
    runtime: str
    idle_timeout_ms: int
    ttl_ms: int
    memory_includes_files: bool
    labels: _containers.ScalarMap[str, str]
    egress: _containers.RepeatedScalarFieldContainer[str]
    egress_proxy: bool
    template: str
    volumes: _containers.RepeatedCompositeFieldContainer[VolumeMount]
    def __init__(self, image: _Optional[str] = ..., network: _Optional[_Union[NetworkMode, str]] = ..., memory_bytes: _Optional[int] = ..., cpu_millis: _Optional[int] = ..., pids_limit: _Optional[int] = ..., workspace_bytes: _Optional[int] = ..., tmp_bytes: _Optional[int] = ..., run_as_root: _Optional[bool] = ..., writable_rootfs: _Optional[bool] = ..., add_capabilities: _Optional[_Iterable[str]] = ..., env: _Optional[_Mapping[str, str]] = ..., runtime: _Optional[str] = ..., idle_timeout_ms: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., memory_includes_files: _Optional[bool] = ..., labels: _Optional[_Mapping[str, str]] = ..., egress: _Optional[_Iterable[str]] = ..., egress_proxy: _Optional[bool] = ..., template: _Optional[str] = ..., volumes: _Optional[_Iterable[_Union[VolumeMount, _Mapping]]] = ...) -> None: ...

class VolumeMount(_message.Message):
    __slots__ = ("name", "path", "read_only")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    READ_ONLY_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    read_only: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., read_only: _Optional[bool] = ...) -> None: ...

class Sandbox(_message.Message):
    __slots__ = ("id", "spec", "state", "container_id", "last_seq", "running_operations", "lost_reason", "created_at_unix_ms", "last_used_unix_ms", "worker_id", "image", "memory_bytes", "cpu_millis", "pids_limit")
    ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    RUNNING_OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    LOST_REASON_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    LAST_USED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPU_MILLIS_FIELD_NUMBER: _ClassVar[int]
    PIDS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    id: str
    spec: SandboxSpec
    state: SandboxState
    container_id: str
    last_seq: int
    running_operations: int
    lost_reason: str
    created_at_unix_ms: int
    last_used_unix_ms: int
    worker_id: str
    image: str
    memory_bytes: int
    cpu_millis: int
    pids_limit: int
    def __init__(self, id: _Optional[str] = ..., spec: _Optional[_Union[SandboxSpec, _Mapping]] = ..., state: _Optional[_Union[SandboxState, str]] = ..., container_id: _Optional[str] = ..., last_seq: _Optional[int] = ..., running_operations: _Optional[int] = ..., lost_reason: _Optional[str] = ..., created_at_unix_ms: _Optional[int] = ..., last_used_unix_ms: _Optional[int] = ..., worker_id: _Optional[str] = ..., image: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., cpu_millis: _Optional[int] = ..., pids_limit: _Optional[int] = ...) -> None: ...

class CreateSandboxRequest(_message.Message):
    __slots__ = ("id", "spec")
    ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    id: str
    spec: SandboxSpec
    def __init__(self, id: _Optional[str] = ..., spec: _Optional[_Union[SandboxSpec, _Mapping]] = ...) -> None: ...

class GetSandboxRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class SetSandboxEgressRequest(_message.Message):
    __slots__ = ("id", "rules")
    ID_FIELD_NUMBER: _ClassVar[int]
    RULES_FIELD_NUMBER: _ClassVar[int]
    id: str
    rules: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., rules: _Optional[_Iterable[str]] = ...) -> None: ...

class CheckpointSandboxRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class RestoreSandboxRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ForkSandboxRequest(_message.Message):
    __slots__ = ("id", "child_ids", "count")
    ID_FIELD_NUMBER: _ClassVar[int]
    CHILD_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    id: str
    child_ids: _containers.RepeatedScalarFieldContainer[str]
    count: int
    def __init__(self, id: _Optional[str] = ..., child_ids: _Optional[_Iterable[str]] = ..., count: _Optional[int] = ...) -> None: ...

class ForkSandboxResponse(_message.Message):
    __slots__ = ("children", "frozen_us", "copied_entries", "copied_bytes", "left_out", "notes")
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    FROZEN_US_FIELD_NUMBER: _ClassVar[int]
    COPIED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    COPIED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEFT_OUT_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    children: _containers.RepeatedCompositeFieldContainer[Sandbox]
    frozen_us: int
    copied_entries: int
    copied_bytes: int
    left_out: int
    notes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, children: _Optional[_Iterable[_Union[Sandbox, _Mapping]]] = ..., frozen_us: _Optional[int] = ..., copied_entries: _Optional[int] = ..., copied_bytes: _Optional[int] = ..., left_out: _Optional[int] = ..., notes: _Optional[_Iterable[str]] = ...) -> None: ...

class ListSandboxesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSandboxesResponse(_message.Message):
    __slots__ = ("sandboxes",)
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    sandboxes: _containers.RepeatedCompositeFieldContainer[Sandbox]
    def __init__(self, sandboxes: _Optional[_Iterable[_Union[Sandbox, _Mapping]]] = ...) -> None: ...

class DestroySandboxRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class DestroySandboxResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class TerminalSize(_message.Message):
    __slots__ = ("rows", "cols")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    COLS_FIELD_NUMBER: _ClassVar[int]
    rows: int
    cols: int
    def __init__(self, rows: _Optional[int] = ..., cols: _Optional[int] = ...) -> None: ...

class ShellSpec(_message.Message):
    __slots__ = ("command", "workdir", "env", "timeout_ms", "output_limit_bytes", "use_bash", "keep_background", "stdin", "terminal")
    class EnvEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    ENV_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    USE_BASH_FIELD_NUMBER: _ClassVar[int]
    KEEP_BACKGROUND_FIELD_NUMBER: _ClassVar[int]
    STDIN_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_FIELD_NUMBER: _ClassVar[int]
    command: str
    workdir: str
    env: _containers.ScalarMap[str, str]
    timeout_ms: int
    output_limit_bytes: int
    use_bash: bool
    keep_background: bool
    stdin: bool
    terminal: TerminalSize
    def __init__(self, command: _Optional[str] = ..., workdir: _Optional[str] = ..., env: _Optional[_Mapping[str, str]] = ..., timeout_ms: _Optional[int] = ..., output_limit_bytes: _Optional[int] = ..., use_bash: _Optional[bool] = ..., keep_background: _Optional[bool] = ..., stdin: _Optional[bool] = ..., terminal: _Optional[_Union[TerminalSize, _Mapping]] = ...) -> None: ...

class ReadFileSpec(_message.Message):
    __slots__ = ("path", "offset", "limit", "stream")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    limit: int
    stream: bool
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., limit: _Optional[int] = ..., stream: _Optional[bool] = ...) -> None: ...

class WriteFileSpec(_message.Message):
    __slots__ = ("path", "data", "mode", "append", "stream")
    PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    APPEND_FIELD_NUMBER: _ClassVar[int]
    STREAM_FIELD_NUMBER: _ClassVar[int]
    path: str
    data: bytes
    mode: int
    append: bool
    stream: bool
    def __init__(self, path: _Optional[str] = ..., data: _Optional[bytes] = ..., mode: _Optional[int] = ..., append: _Optional[bool] = ..., stream: _Optional[bool] = ...) -> None: ...

class ArchiveSpec(_message.Message):
    __slots__ = ("path", "contents")
    PATH_FIELD_NUMBER: _ClassVar[int]
    CONTENTS_FIELD_NUMBER: _ClassVar[int]
    path: str
    contents: bool
    def __init__(self, path: _Optional[str] = ..., contents: _Optional[bool] = ...) -> None: ...

class OperationSpec(_message.Message):
    __slots__ = ("shell", "read_file", "write_file", "put_archive", "get_archive", "list_dir")
    SHELL_FIELD_NUMBER: _ClassVar[int]
    READ_FILE_FIELD_NUMBER: _ClassVar[int]
    WRITE_FILE_FIELD_NUMBER: _ClassVar[int]
    PUT_ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    GET_ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    LIST_DIR_FIELD_NUMBER: _ClassVar[int]
    shell: ShellSpec
    read_file: ReadFileSpec
    write_file: WriteFileSpec
    put_archive: ArchiveSpec
    get_archive: ArchiveSpec
    list_dir: ArchiveSpec
    def __init__(self, shell: _Optional[_Union[ShellSpec, _Mapping]] = ..., read_file: _Optional[_Union[ReadFileSpec, _Mapping]] = ..., write_file: _Optional[_Union[WriteFileSpec, _Mapping]] = ..., put_archive: _Optional[_Union[ArchiveSpec, _Mapping]] = ..., get_archive: _Optional[_Union[ArchiveSpec, _Mapping]] = ..., list_dir: _Optional[_Union[ArchiveSpec, _Mapping]] = ...) -> None: ...

class SubmitOperationRequest(_message.Message):
    __slots__ = ("sandbox_id", "operation_id", "spec")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    operation_id: str
    spec: OperationSpec
    def __init__(self, sandbox_id: _Optional[str] = ..., operation_id: _Optional[str] = ..., spec: _Optional[_Union[OperationSpec, _Mapping]] = ...) -> None: ...

class RunOperationResponse(_message.Message):
    __slots__ = ("submitted", "event")
    SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    submitted: Operation
    event: SandboxEvent
    def __init__(self, submitted: _Optional[_Union[Operation, _Mapping]] = ..., event: _Optional[_Union[SandboxEvent, _Mapping]] = ...) -> None: ...

class GetOperationRequest(_message.Message):
    __slots__ = ("sandbox_id", "operation_id")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    operation_id: str
    def __init__(self, sandbox_id: _Optional[str] = ..., operation_id: _Optional[str] = ...) -> None: ...

class UploadRequest(_message.Message):
    __slots__ = ("sandbox_id", "operation_id", "path", "data", "eof")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EOF_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    operation_id: str
    path: str
    data: bytes
    eof: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., operation_id: _Optional[str] = ..., path: _Optional[str] = ..., data: _Optional[bytes] = ..., eof: _Optional[bool] = ...) -> None: ...

class BuildImageRequest(_message.Message):
    __slots__ = ("dockerfile", "timeout_ms", "data", "eof", "template", "start")
    DOCKERFILE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EOF_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    dockerfile: str
    timeout_ms: int
    data: bytes
    eof: bool
    template: str
    start: TemplateStart
    def __init__(self, dockerfile: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., data: _Optional[bytes] = ..., eof: _Optional[bool] = ..., template: _Optional[str] = ..., start: _Optional[_Union[TemplateStart, _Mapping]] = ...) -> None: ...

class TemplateStart(_message.Message):
    __slots__ = ("command", "port", "ready_command", "http", "timeout_ms")
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    READY_COMMAND_FIELD_NUMBER: _ClassVar[int]
    HTTP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    command: str
    port: int
    ready_command: str
    http: str
    timeout_ms: int
    def __init__(self, command: _Optional[str] = ..., port: _Optional[int] = ..., ready_command: _Optional[str] = ..., http: _Optional[str] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class Template(_message.Message):
    __slots__ = ("name", "image", "start", "created_at_unix_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    image: str
    start: TemplateStart
    created_at_unix_ms: int
    def __init__(self, name: _Optional[str] = ..., image: _Optional[str] = ..., start: _Optional[_Union[TemplateStart, _Mapping]] = ..., created_at_unix_ms: _Optional[int] = ...) -> None: ...

class Volume(_message.Message):
    __slots__ = ("name", "size_bytes", "used_bytes", "created_at_unix_ms", "writer", "readers")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    WRITER_FIELD_NUMBER: _ClassVar[int]
    READERS_FIELD_NUMBER: _ClassVar[int]
    name: str
    size_bytes: int
    used_bytes: int
    created_at_unix_ms: int
    writer: str
    readers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., size_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., created_at_unix_ms: _Optional[int] = ..., writer: _Optional[str] = ..., readers: _Optional[_Iterable[str]] = ...) -> None: ...

class CreateVolumeRequest(_message.Message):
    __slots__ = ("name", "size_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    size_bytes: int
    def __init__(self, name: _Optional[str] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class ListVolumesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListVolumesResponse(_message.Message):
    __slots__ = ("volumes",)
    VOLUMES_FIELD_NUMBER: _ClassVar[int]
    volumes: _containers.RepeatedCompositeFieldContainer[Volume]
    def __init__(self, volumes: _Optional[_Iterable[_Union[Volume, _Mapping]]] = ...) -> None: ...

class DeleteVolumeRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class DeleteVolumeResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class SnapshotSandboxRequest(_message.Message):
    __slots__ = ("id", "template")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    id: str
    template: str
    def __init__(self, id: _Optional[str] = ..., template: _Optional[str] = ...) -> None: ...

class ListTemplatesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTemplatesResponse(_message.Message):
    __slots__ = ("templates",)
    TEMPLATES_FIELD_NUMBER: _ClassVar[int]
    templates: _containers.RepeatedCompositeFieldContainer[Template]
    def __init__(self, templates: _Optional[_Iterable[_Union[Template, _Mapping]]] = ...) -> None: ...

class DeleteTemplateRequest(_message.Message):
    __slots__ = ("name", "force")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    force: bool
    def __init__(self, name: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class DeleteTemplateResponse(_message.Message):
    __slots__ = ("existed",)
    EXISTED_FIELD_NUMBER: _ClassVar[int]
    existed: bool
    def __init__(self, existed: _Optional[bool] = ...) -> None: ...

class BuildImageEvent(_message.Message):
    __slots__ = ("output", "done")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    output: str
    done: BuildImageResult
    def __init__(self, output: _Optional[str] = ..., done: _Optional[_Union[BuildImageResult, _Mapping]] = ...) -> None: ...

class BuildImageResult(_message.Message):
    __slots__ = ("image", "cached", "duration_ms", "failure", "template")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    image: str
    cached: bool
    duration_ms: int
    failure: BuildFailure
    template: Template
    def __init__(self, image: _Optional[str] = ..., cached: _Optional[bool] = ..., duration_ms: _Optional[int] = ..., failure: _Optional[_Union[BuildFailure, _Mapping]] = ..., template: _Optional[_Union[Template, _Mapping]] = ...) -> None: ...

class BuildFailure(_message.Message):
    __slots__ = ("kind", "step", "steps", "instruction", "message")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[BuildFailure.Kind]
        KIND_STEP_FAILED: _ClassVar[BuildFailure.Kind]
        KIND_TIMED_OUT: _ClassVar[BuildFailure.Kind]
        KIND_INVALID: _ClassVar[BuildFailure.Kind]
    KIND_UNSPECIFIED: BuildFailure.Kind
    KIND_STEP_FAILED: BuildFailure.Kind
    KIND_TIMED_OUT: BuildFailure.Kind
    KIND_INVALID: BuildFailure.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    kind: BuildFailure.Kind
    step: int
    steps: int
    instruction: str
    message: str
    def __init__(self, kind: _Optional[_Union[BuildFailure.Kind, str]] = ..., step: _Optional[int] = ..., steps: _Optional[int] = ..., instruction: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class DownloadRequest(_message.Message):
    __slots__ = ("sandbox_id", "operation_id", "archive")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    ARCHIVE_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    operation_id: str
    archive: ArchiveSpec
    def __init__(self, sandbox_id: _Optional[str] = ..., operation_id: _Optional[str] = ..., archive: _Optional[_Union[ArchiveSpec, _Mapping]] = ...) -> None: ...

class DownloadResponse(_message.Message):
    __slots__ = ("data", "finished")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    finished: Operation
    def __init__(self, data: _Optional[bytes] = ..., finished: _Optional[_Union[Operation, _Mapping]] = ...) -> None: ...

class ListOperationsRequest(_message.Message):
    __slots__ = ("sandbox_id", "page_token")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    page_token: str
    def __init__(self, sandbox_id: _Optional[str] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListOperationsResponse(_message.Message):
    __slots__ = ("operations", "next_page_token")
    OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    operations: _containers.RepeatedCompositeFieldContainer[Operation]
    next_page_token: str
    def __init__(self, operations: _Optional[_Iterable[_Union[Operation, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class CancelOperationRequest(_message.Message):
    __slots__ = ("sandbox_id", "operation_id")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    operation_id: str
    def __init__(self, sandbox_id: _Optional[str] = ..., operation_id: _Optional[str] = ...) -> None: ...

class SignalOperationRequest(_message.Message):
    __slots__ = ("sandbox_id", "operation_id", "signal")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    operation_id: str
    signal: int
    def __init__(self, sandbox_id: _Optional[str] = ..., operation_id: _Optional[str] = ..., signal: _Optional[int] = ...) -> None: ...

class SignalOperationResponse(_message.Message):
    __slots__ = ("delivered",)
    DELIVERED_FIELD_NUMBER: _ClassVar[int]
    delivered: bool
    def __init__(self, delivered: _Optional[bool] = ...) -> None: ...

class CancelOperationResponse(_message.Message):
    __slots__ = ("canceling",)
    CANCELING_FIELD_NUMBER: _ClassVar[int]
    canceling: bool
    def __init__(self, canceling: _Optional[bool] = ...) -> None: ...

class Operation(_message.Message):
    __slots__ = ("sandbox_id", "operation_id", "spec", "status", "result", "first_seq", "input_bytes")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    FIRST_SEQ_FIELD_NUMBER: _ClassVar[int]
    INPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    operation_id: str
    spec: OperationSpec
    status: OperationStatus
    result: OperationResult
    first_seq: int
    input_bytes: int
    def __init__(self, sandbox_id: _Optional[str] = ..., operation_id: _Optional[str] = ..., spec: _Optional[_Union[OperationSpec, _Mapping]] = ..., status: _Optional[_Union[OperationStatus, str]] = ..., result: _Optional[_Union[OperationResult, _Mapping]] = ..., first_seq: _Optional[int] = ..., input_bytes: _Optional[int] = ...) -> None: ...

class WriteInputRequest(_message.Message):
    __slots__ = ("sandbox_id", "operation_id", "offset", "data", "eof")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    EOF_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    operation_id: str
    offset: int
    data: bytes
    eof: bool
    def __init__(self, sandbox_id: _Optional[str] = ..., operation_id: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., eof: _Optional[bool] = ...) -> None: ...

class WriteInputResponse(_message.Message):
    __slots__ = ("input_bytes", "closed")
    INPUT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    input_bytes: int
    closed: bool
    def __init__(self, input_bytes: _Optional[int] = ..., closed: _Optional[bool] = ...) -> None: ...

class ResizeTerminalRequest(_message.Message):
    __slots__ = ("sandbox_id", "operation_id", "size")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    operation_id: str
    size: TerminalSize
    def __init__(self, sandbox_id: _Optional[str] = ..., operation_id: _Optional[str] = ..., size: _Optional[_Union[TerminalSize, _Mapping]] = ...) -> None: ...

class ResizeTerminalResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetSandboxRequest(_message.Message):
    __slots__ = ("id",)
    ID_FIELD_NUMBER: _ClassVar[int]
    id: str
    def __init__(self, id: _Optional[str] = ...) -> None: ...

class ResetSandboxResponse(_message.Message):
    __slots__ = ("killed",)
    KILLED_FIELD_NUMBER: _ClassVar[int]
    killed: int
    def __init__(self, killed: _Optional[int] = ...) -> None: ...

class CapturedOutput(_message.Message):
    __slots__ = ("head", "tail", "total_bytes", "truncated")
    HEAD_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    head: bytes
    tail: bytes
    total_bytes: int
    truncated: bool
    def __init__(self, head: _Optional[bytes] = ..., tail: _Optional[bytes] = ..., total_bytes: _Optional[int] = ..., truncated: _Optional[bool] = ...) -> None: ...

class Outcome(_message.Message):
    __slots__ = ("exited", "signaled", "timed_out", "out_of_memory", "canceled", "sandbox_lost", "spawn_failed", "file_error")
    class Exited(_message.Message):
        __slots__ = ("code",)
        CODE_FIELD_NUMBER: _ClassVar[int]
        code: int
        def __init__(self, code: _Optional[int] = ...) -> None: ...
    class Signaled(_message.Message):
        __slots__ = ("signal",)
        SIGNAL_FIELD_NUMBER: _ClassVar[int]
        signal: int
        def __init__(self, signal: _Optional[int] = ...) -> None: ...
    class TimedOut(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    class OutOfMemory(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    class Canceled(_message.Message):
        __slots__ = ()
        def __init__(self) -> None: ...
    class SandboxLost(_message.Message):
        __slots__ = ("reason",)
        REASON_FIELD_NUMBER: _ClassVar[int]
        reason: str
        def __init__(self, reason: _Optional[str] = ...) -> None: ...
    class SpawnFailed(_message.Message):
        __slots__ = ("reason",)
        REASON_FIELD_NUMBER: _ClassVar[int]
        reason: str
        def __init__(self, reason: _Optional[str] = ...) -> None: ...
    class FileError(_message.Message):
        __slots__ = ("kind", "message")
        KIND_FIELD_NUMBER: _ClassVar[int]
        MESSAGE_FIELD_NUMBER: _ClassVar[int]
        kind: FileErrorKind
        message: str
        def __init__(self, kind: _Optional[_Union[FileErrorKind, str]] = ..., message: _Optional[str] = ...) -> None: ...
    EXITED_FIELD_NUMBER: _ClassVar[int]
    SIGNALED_FIELD_NUMBER: _ClassVar[int]
    TIMED_OUT_FIELD_NUMBER: _ClassVar[int]
    OUT_OF_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CANCELED_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_LOST_FIELD_NUMBER: _ClassVar[int]
    SPAWN_FAILED_FIELD_NUMBER: _ClassVar[int]
    FILE_ERROR_FIELD_NUMBER: _ClassVar[int]
    exited: Outcome.Exited
    signaled: Outcome.Signaled
    timed_out: Outcome.TimedOut
    out_of_memory: Outcome.OutOfMemory
    canceled: Outcome.Canceled
    sandbox_lost: Outcome.SandboxLost
    spawn_failed: Outcome.SpawnFailed
    file_error: Outcome.FileError
    def __init__(self, exited: _Optional[_Union[Outcome.Exited, _Mapping]] = ..., signaled: _Optional[_Union[Outcome.Signaled, _Mapping]] = ..., timed_out: _Optional[_Union[Outcome.TimedOut, _Mapping]] = ..., out_of_memory: _Optional[_Union[Outcome.OutOfMemory, _Mapping]] = ..., canceled: _Optional[_Union[Outcome.Canceled, _Mapping]] = ..., sandbox_lost: _Optional[_Union[Outcome.SandboxLost, _Mapping]] = ..., spawn_failed: _Optional[_Union[Outcome.SpawnFailed, _Mapping]] = ..., file_error: _Optional[_Union[Outcome.FileError, _Mapping]] = ...) -> None: ...

class OperationResult(_message.Message):
    __slots__ = ("outcome", "stdout", "stderr", "duration_ms", "file_data", "file_size", "bytes_written")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    DURATION_MS_FIELD_NUMBER: _ClassVar[int]
    FILE_DATA_FIELD_NUMBER: _ClassVar[int]
    FILE_SIZE_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    outcome: Outcome
    stdout: CapturedOutput
    stderr: CapturedOutput
    duration_ms: int
    file_data: bytes
    file_size: int
    bytes_written: int
    def __init__(self, outcome: _Optional[_Union[Outcome, _Mapping]] = ..., stdout: _Optional[_Union[CapturedOutput, _Mapping]] = ..., stderr: _Optional[_Union[CapturedOutput, _Mapping]] = ..., duration_ms: _Optional[int] = ..., file_data: _Optional[bytes] = ..., file_size: _Optional[int] = ..., bytes_written: _Optional[int] = ...) -> None: ...

class WatchSandboxRequest(_message.Message):
    __slots__ = ("sandbox_id", "after_seq", "operation_id")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    after_seq: int
    operation_id: str
    def __init__(self, sandbox_id: _Optional[str] = ..., after_seq: _Optional[int] = ..., operation_id: _Optional[str] = ...) -> None: ...

class SandboxEvent(_message.Message):
    __slots__ = ("seq", "operation_id", "started", "output", "finished", "gap", "sandbox_lost", "egress", "port")
    class Started(_message.Message):
        __slots__ = ("pid",)
        PID_FIELD_NUMBER: _ClassVar[int]
        pid: int
        def __init__(self, pid: _Optional[int] = ...) -> None: ...
    class Output(_message.Message):
        __slots__ = ("stream", "data")
        STREAM_FIELD_NUMBER: _ClassVar[int]
        DATA_FIELD_NUMBER: _ClassVar[int]
        stream: OutputStream
        data: bytes
        def __init__(self, stream: _Optional[_Union[OutputStream, str]] = ..., data: _Optional[bytes] = ...) -> None: ...
    class Finished(_message.Message):
        __slots__ = ("result",)
        RESULT_FIELD_NUMBER: _ClassVar[int]
        result: OperationResult
        def __init__(self, result: _Optional[_Union[OperationResult, _Mapping]] = ...) -> None: ...
    class Gap(_message.Message):
        __slots__ = ("from_seq", "to_seq")
        FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
        TO_SEQ_FIELD_NUMBER: _ClassVar[int]
        from_seq: int
        to_seq: int
        def __init__(self, from_seq: _Optional[int] = ..., to_seq: _Optional[int] = ...) -> None: ...
    class SandboxLost(_message.Message):
        __slots__ = ("reason",)
        REASON_FIELD_NUMBER: _ClassVar[int]
        reason: str
        def __init__(self, reason: _Optional[str] = ...) -> None: ...
    class Egress(_message.Message):
        __slots__ = ("host", "port", "decision", "reason", "unreported")
        HOST_FIELD_NUMBER: _ClassVar[int]
        PORT_FIELD_NUMBER: _ClassVar[int]
        DECISION_FIELD_NUMBER: _ClassVar[int]
        REASON_FIELD_NUMBER: _ClassVar[int]
        UNREPORTED_FIELD_NUMBER: _ClassVar[int]
        host: str
        port: int
        decision: str
        reason: str
        unreported: int
        def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., decision: _Optional[str] = ..., reason: _Optional[str] = ..., unreported: _Optional[int] = ...) -> None: ...
    class Port(_message.Message):
        __slots__ = ("port", "what", "detail", "bytes_in", "bytes_out", "unreported")
        PORT_FIELD_NUMBER: _ClassVar[int]
        WHAT_FIELD_NUMBER: _ClassVar[int]
        DETAIL_FIELD_NUMBER: _ClassVar[int]
        BYTES_IN_FIELD_NUMBER: _ClassVar[int]
        BYTES_OUT_FIELD_NUMBER: _ClassVar[int]
        UNREPORTED_FIELD_NUMBER: _ClassVar[int]
        port: int
        what: str
        detail: str
        bytes_in: int
        bytes_out: int
        unreported: int
        def __init__(self, port: _Optional[int] = ..., what: _Optional[str] = ..., detail: _Optional[str] = ..., bytes_in: _Optional[int] = ..., bytes_out: _Optional[int] = ..., unreported: _Optional[int] = ...) -> None: ...
    SEQ_FIELD_NUMBER: _ClassVar[int]
    OPERATION_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_LOST_FIELD_NUMBER: _ClassVar[int]
    EGRESS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    operation_id: str
    started: SandboxEvent.Started
    output: SandboxEvent.Output
    finished: SandboxEvent.Finished
    gap: SandboxEvent.Gap
    sandbox_lost: SandboxEvent.SandboxLost
    egress: SandboxEvent.Egress
    port: SandboxEvent.Port
    def __init__(self, seq: _Optional[int] = ..., operation_id: _Optional[str] = ..., started: _Optional[_Union[SandboxEvent.Started, _Mapping]] = ..., output: _Optional[_Union[SandboxEvent.Output, _Mapping]] = ..., finished: _Optional[_Union[SandboxEvent.Finished, _Mapping]] = ..., gap: _Optional[_Union[SandboxEvent.Gap, _Mapping]] = ..., sandbox_lost: _Optional[_Union[SandboxEvent.SandboxLost, _Mapping]] = ..., egress: _Optional[_Union[SandboxEvent.Egress, _Mapping]] = ..., port: _Optional[_Union[SandboxEvent.Port, _Mapping]] = ...) -> None: ...

class GetWorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSandboxStatsRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class SandboxStats(_message.Message):
    __slots__ = ("sandbox_id", "memory_bytes", "memory_limit_bytes", "files_bytes", "cpu_percent", "cpu_total_ns", "pids", "pids_limit")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_LIMIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    FILES_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPU_PERCENT_FIELD_NUMBER: _ClassVar[int]
    CPU_TOTAL_NS_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    PIDS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    memory_bytes: int
    memory_limit_bytes: int
    files_bytes: int
    cpu_percent: float
    cpu_total_ns: int
    pids: int
    pids_limit: int
    def __init__(self, sandbox_id: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., memory_limit_bytes: _Optional[int] = ..., files_bytes: _Optional[int] = ..., cpu_percent: _Optional[float] = ..., cpu_total_ns: _Optional[int] = ..., pids: _Optional[int] = ..., pids_limit: _Optional[int] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "version", "max_sandboxes", "sandboxes", "running_operations", "docker_version", "policy", "draining", "drain_deadline_ms", "default_image", "default_runtime", "pools", "default_memory_bytes", "default_cpu_millis", "default_pids_limit", "ports_url")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    DOCKER_VERSION_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    DRAIN_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_IMAGE_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_RUNTIME_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_CPU_MILLIS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_PIDS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    PORTS_URL_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    version: str
    max_sandboxes: int
    sandboxes: int
    running_operations: int
    docker_version: str
    policy: SandboxPolicy
    draining: bool
    drain_deadline_ms: int
    default_image: str
    default_runtime: str
    pools: _containers.RepeatedCompositeFieldContainer[PoolInfo]
    default_memory_bytes: int
    default_cpu_millis: int
    default_pids_limit: int
    ports_url: str
    def __init__(self, worker_id: _Optional[str] = ..., version: _Optional[str] = ..., max_sandboxes: _Optional[int] = ..., sandboxes: _Optional[int] = ..., running_operations: _Optional[int] = ..., docker_version: _Optional[str] = ..., policy: _Optional[_Union[SandboxPolicy, _Mapping]] = ..., draining: _Optional[bool] = ..., drain_deadline_ms: _Optional[int] = ..., default_image: _Optional[str] = ..., default_runtime: _Optional[str] = ..., pools: _Optional[_Iterable[_Union[PoolInfo, _Mapping]]] = ..., default_memory_bytes: _Optional[int] = ..., default_cpu_millis: _Optional[int] = ..., default_pids_limit: _Optional[int] = ..., ports_url: _Optional[str] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("template", "image", "size", "ready", "claims", "misses", "last_refill_ms", "memory_bytes", "cpu_millis", "pids_limit", "runtime", "max_size")
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    LAST_REFILL_MS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPU_MILLIS_FIELD_NUMBER: _ClassVar[int]
    PIDS_LIMIT_FIELD_NUMBER: _ClassVar[int]
    RUNTIME_FIELD_NUMBER: _ClassVar[int]
    MAX_SIZE_FIELD_NUMBER: _ClassVar[int]
    template: str
    image: str
    size: int
    ready: int
    claims: int
    misses: int
    last_refill_ms: int
    memory_bytes: int
    cpu_millis: int
    pids_limit: int
    runtime: str
    max_size: int
    def __init__(self, template: _Optional[str] = ..., image: _Optional[str] = ..., size: _Optional[int] = ..., ready: _Optional[int] = ..., claims: _Optional[int] = ..., misses: _Optional[int] = ..., last_refill_ms: _Optional[int] = ..., memory_bytes: _Optional[int] = ..., cpu_millis: _Optional[int] = ..., pids_limit: _Optional[int] = ..., runtime: _Optional[str] = ..., max_size: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("drain",)
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    drain: bool
    def __init__(self, drain: _Optional[bool] = ...) -> None: ...

class SandboxPolicy(_message.Message):
    __slots__ = ("allow_root", "allow_writable_rootfs", "allow_network", "allowed_capabilities", "allowed_images", "allow_any_image", "allowed_runtimes", "max_memory_bytes", "max_cpu_millis", "max_pids", "max_workspace_bytes", "max_tmp_bytes", "allowed_egress", "allow_build")
    ALLOW_ROOT_FIELD_NUMBER: _ClassVar[int]
    ALLOW_WRITABLE_ROOTFS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NETWORK_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_IMAGES_FIELD_NUMBER: _ClassVar[int]
    ALLOW_ANY_IMAGE_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_RUNTIMES_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_CPU_MILLIS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIDS_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKSPACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TMP_BYTES_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_EGRESS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_BUILD_FIELD_NUMBER: _ClassVar[int]
    allow_root: bool
    allow_writable_rootfs: bool
    allow_network: bool
    allowed_capabilities: _containers.RepeatedScalarFieldContainer[str]
    allowed_images: _containers.RepeatedScalarFieldContainer[str]
    allow_any_image: bool
    allowed_runtimes: _containers.RepeatedScalarFieldContainer[str]
    max_memory_bytes: int
    max_cpu_millis: int
    max_pids: int
    max_workspace_bytes: int
    max_tmp_bytes: int
    allowed_egress: _containers.RepeatedScalarFieldContainer[str]
    allow_build: bool
    def __init__(self, allow_root: _Optional[bool] = ..., allow_writable_rootfs: _Optional[bool] = ..., allow_network: _Optional[bool] = ..., allowed_capabilities: _Optional[_Iterable[str]] = ..., allowed_images: _Optional[_Iterable[str]] = ..., allow_any_image: _Optional[bool] = ..., allowed_runtimes: _Optional[_Iterable[str]] = ..., max_memory_bytes: _Optional[int] = ..., max_cpu_millis: _Optional[int] = ..., max_pids: _Optional[int] = ..., max_workspace_bytes: _Optional[int] = ..., max_tmp_bytes: _Optional[int] = ..., allowed_egress: _Optional[_Iterable[str]] = ..., allow_build: _Optional[bool] = ...) -> None: ...
