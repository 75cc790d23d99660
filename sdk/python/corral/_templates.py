"""Templates a worker keeps (built by :class:`corral.Template` or
:func:`corral.build_image` with ``template=``, or saved by
:meth:`corral.Sandbox.snapshot`): listed and removed by name."""

from __future__ import annotations

import asyncio

from corral import _connect, _rpc
from corral._proto import worker_pb2 as pb
from corral.types import TemplateInfo

#: How long one of several workers has to answer a listing.
ASK_TIMEOUT_S = 5.0


async def _listed(ws: list[_rpc.Worker]) -> list[tuple[_rpc.Worker, list[pb.Template]]]:
    """Each worker's templates (of several, one that does not answer is left
    out; of one, its error is raised)."""

    async def ask(w: _rpc.Worker) -> pb.ListTemplatesResponse:
        timeout = None if len(ws) == 1 else ASK_TIMEOUT_S
        return await w.call(
            "ListTemplates", pb.ListTemplatesRequest(), pb.ListTemplatesResponse, timeout
        )

    answers = await asyncio.gather(*(ask(w) for w in ws), return_exceptions=True)
    out: list[tuple[_rpc.Worker, list[pb.Template]]] = []
    for w, r in zip(ws, answers, strict=True):
        if isinstance(r, BaseException):
            if not isinstance(r, Exception) or len(ws) == 1:
                raise r
            continue
        out.append((w, list(r.templates)))
    return out


async def list_templates(
    worker: str | None = None,
    *,
    token_file: str | None = None,
) -> list[TemplateInfo]:
    """The templates of the workers named (or of the local worker), by name
    (one kept by several workers is listed for each)."""
    opts = _connect.Options.from_env(worker, token_file=token_file)
    ws = await _rpc.workers(opts)
    out = [
        TemplateInfo(
            name=t.name,
            image=t.image,
            created_at_unix_ms=t.created_at_unix_ms,
            start_command=t.start.command or None,
            worker=w.url,
        )
        for w, ts in await _listed(ws)
        for t in ts
    ]
    out.sort(key=lambda t: (t.name, t.worker))
    return out


async def delete_template(
    name: str,
    *,
    force: bool = False,
    worker: str | None = None,
    token_file: str | None = None,
) -> bool:
    """Forgets template ``name`` on every worker named that keeps it: whether
    one did. While sandboxes of it run or a pool of it keeps members,
    :class:`corral.Conflict` (``template_in_use``) unless ``force`` (they
    go on)."""
    opts = _connect.Options.from_env(worker, token_file=token_file)
    ws = await _rpc.workers(opts)
    existed = False
    for w, ts in await _listed(ws):
        if len(ws) == 1 or any(t.name == name for t in ts):
            req = pb.DeleteTemplateRequest(name=name, force=force)
            r = await w.call("DeleteTemplate", req, pb.DeleteTemplateResponse)
            existed |= r.existed
    return existed
