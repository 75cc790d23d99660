"""Corral from Python: hardened sandboxes on Corral workers.

>>> import corral
>>> with corral.Sandbox.create() as sb:
...     r = sb.run("echo hello")
...     r.stdout
'hello\\n'

Every call has an async twin (:class:`AsyncSandbox`, :class:`AsyncProcess`),
over the same core. A worker is found as the ``corral`` CLI finds it:
``worker=`` or ``CORRAL_WORKER`` (addresses, ``dns:///NAME:PORT``),
``CORRAL_TOKEN_FILE`` and the TLS settings, else the local worker that
``corral`` starts.
"""

from corral._build import build_image as abuild_image
from corral._core import AsyncFiles, AsyncPorts, AsyncProcess, AsyncSandbox
from corral._core import list_sandboxes as alist_sandboxes
from corral._sync import (
    Files,
    Ports,
    Process,
    Sandbox,
    build_image,
    create_volume,
    delete_template,
    delete_volume,
    list_sandboxes,
    list_templates,
    list_volumes,
)
from corral._tar import Moved
from corral._templates import delete_template as adelete_template
from corral._templates import list_templates as alist_templates
from corral._volumes import create_volume as acreate_volume
from corral._volumes import delete_volume as adelete_volume
from corral._volumes import list_volumes as alist_volumes
from corral.errors import (
    ConfigError,
    Conflict,
    CorralError,
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
    TransferError,
    Unauthenticated,
    WorkerUnavailable,
)
from corral.template import Template
from corral.types import (
    BuildFailure,
    BuildFailureKind,
    BuiltImage,
    EndCause,
    EntryType,
    FileEntry,
    OutputChunk,
    PortAccess,
    PortExposure,
    Result,
    SandboxInfo,
    SandboxList,
    SandboxState,
    SandboxStats,
    TemplateInfo,
    Volume,
    WorkerInfo,
)

__all__ = [
    "AsyncFiles",
    "AsyncPorts",
    "AsyncProcess",
    "AsyncSandbox",
    "BuildFailure",
    "BuildFailureKind",
    "BuiltImage",
    "ConfigError",
    "Conflict",
    "CorralError",
    "EndCause",
    "EntryType",
    "FileEntry",
    "FileError",
    "Files",
    "InvalidArgument",
    "Moved",
    "OutputChunk",
    "PermissionDenied",
    "PolicyDenied",
    "PortAccess",
    "PortExposure",
    "Ports",
    "Process",
    "ProcessNotFound",
    "QuotaExceeded",
    "ResourceExhausted",
    "Result",
    "Sandbox",
    "SandboxCheckpointed",
    "SandboxInfo",
    "SandboxList",
    "SandboxLost",
    "SandboxNotFound",
    "SandboxState",
    "SandboxStats",
    "Template",
    "TemplateInfo",
    "TransferError",
    "Unauthenticated",
    "Volume",
    "WorkerInfo",
    "WorkerUnavailable",
    "abuild_image",
    "acreate_volume",
    "adelete_template",
    "adelete_volume",
    "alist_sandboxes",
    "alist_templates",
    "alist_volumes",
    "build_image",
    "create_volume",
    "delete_template",
    "delete_volume",
    "list_sandboxes",
    "list_templates",
    "list_volumes",
]
