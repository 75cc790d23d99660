"""Volumes: filesystems a worker keeps across sandboxes and its restarts,
each of a size its filesystem enforces (a write past it fails with ENOSPC in
the sandbox). ``Sandbox.create(volumes={"/data": "NAME"})`` mounts one
(``"NAME:ro"`` read-only); one sandbox writes to a volume at a time, any
number read it."""

from __future__ import annotations

import asyncio
import random

from corral import _connect, _rpc
from corral._proto import worker_pb2 as pb
from corral._units import parse_size
from corral.errors import InvalidArgument
from corral.types import Volume

#: How long one of several workers has to answer a listing.
ASK_TIMEOUT_S = 5.0


def _volume_of(v: pb.Volume, worker: str) -> Volume:
    return Volume(
        name=v.name,
        size_bytes=v.size_bytes,
        used_bytes=v.used_bytes,
        created_at_unix_ms=v.created_at_unix_ms,
        writer=v.writer or None,
        readers=tuple(v.readers),
        worker=worker,
    )


def mounts(volumes: dict[str, str] | None) -> list[pb.VolumeMount]:
    """``{"/data": "NAME"}`` (``"NAME:ro"``: read-only) as the spec's mounts."""
    out: list[pb.VolumeMount] = []
    for path, name in (volumes or {}).items():
        if not isinstance(path, str) or not isinstance(name, str):
            raise InvalidArgument("volumes: a mapping of paths to volume names")
        ro = name.endswith(":ro")
        name = name.removesuffix(":ro").removesuffix(":rw")
        out.append(pb.VolumeMount(name=name, path=path, read_only=ro))
    return out


async def _listed(ws: list[_rpc.Worker]) -> list[tuple[_rpc.Worker, list[pb.Volume]]]:
    """Each worker's volumes (of several, one that does not answer is left
    out; of one, its error is raised)."""

    async def ask(w: _rpc.Worker) -> pb.ListVolumesResponse:
        timeout = None if len(ws) == 1 else ASK_TIMEOUT_S
        return await w.call("ListVolumes", pb.ListVolumesRequest(), pb.ListVolumesResponse, timeout)

    answers = await asyncio.gather(*(ask(w) for w in ws), return_exceptions=True)
    out: list[tuple[_rpc.Worker, list[pb.Volume]]] = []
    for w, r in zip(ws, answers, strict=True):
        if isinstance(r, BaseException):
            if not isinstance(r, Exception) or len(ws) == 1:
                raise r
            continue
        out.append((w, list(r.volumes)))
    return out


async def having(ws: list[_rpc.Worker], names: set[str]) -> list[_rpc.Worker]:
    """Of several workers, those that keep every volume of ``names`` (a
    volume lives on the worker that made it); all of them if none does, so
    that the create says which is missing."""
    if len(ws) == 1 or not names:
        return ws
    found = [w for w, vols in await _listed(ws) if names <= {v.name for v in vols}]
    return found or ws


async def create_volume(
    name: str,
    *,
    size: int | str | None = None,
    worker: str | None = None,
    token_file: str | None = None,
) -> Volume:
    """Makes volume ``name`` of ``size`` bytes (or a size like ``"10g"``;
    default: the worker's ``--default-volume-size``) on a worker: the one
    named, or of several the one that has it already, else one at random.
    The same name and size again is the same volume; another size raises
    :class:`corral.Conflict`."""
    opts = _connect.Options.from_env(worker, token_file=token_file)
    ws = await _rpc.workers(opts)
    w = ws[0]
    if len(ws) > 1:
        there = [w for w, vols in await _listed(ws) if any(v.name == name for v in vols)]
        w = there[0] if there else random.choice(ws)
    req = pb.CreateVolumeRequest(name=name, size_bytes=parse_size(size, "size"))
    return _volume_of(await w.call("CreateVolume", req, pb.Volume), w.url)


async def list_volumes(
    worker: str | None = None,
    *,
    token_file: str | None = None,
) -> list[Volume]:
    """The volumes of the workers named (or of the local worker), by name."""
    opts = _connect.Options.from_env(worker, token_file=token_file)
    ws = await _rpc.workers(opts)
    out = [_volume_of(v, w.url) for w, vols in await _listed(ws) for v in vols]
    out.sort(key=lambda v: (v.name, v.worker))
    return out


async def delete_volume(
    name: str,
    *,
    worker: str | None = None,
    token_file: str | None = None,
) -> bool:
    """Removes volume ``name`` and everything in it: whether there was one.
    While a sandbox mounts it, :class:`corral.Conflict` (``volume_in_use``)."""
    opts = _connect.Options.from_env(worker, token_file=token_file)
    ws = await _rpc.workers(opts)
    existed = False
    for w, vols in await _listed(ws):
        if len(ws) == 1 or any(v.name == name for v in vols):
            req = pb.DeleteVolumeRequest(name=name)
            r = await w.call("DeleteVolume", req, pb.DeleteVolumeResponse)
            existed |= r.existed
    return existed
