"""The worker's gRPC calls, typed, over one grpc.aio channel per worker and
event loop; every call carries the bearer token, and a failed one becomes a
:class:`corral.errors.CorralError`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
import grpc.aio

from corral import _connect
from corral._proto import worker_pb2 as pb
from corral.errors import CorralError, Unauthenticated, WorkerUnavailable, from_rpc_error

#: The worker's own limit on a message, with room: a finished result with
#: both streams' head and tail fits.
MAX_MESSAGE = 64 << 20
SERVICE = "/corral.v1.Worker/"
#: How long a call waits for a connection to a worker on this machine to be
#: made (and checked) before it says the worker is unavailable.
CONNECT_WAIT_S = 5.0

Req = TypeVar("Req")
Resp = TypeVar("Resp")
T = TypeVar("T")

_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", MAX_MESSAGE),
    ("grpc.max_send_message_length", MAX_MESSAGE),
    # A dead worker is noticed within about 30 s, as the CLI does.
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Retries are the SDK's own (same ids, a patience), never gRPC's.
    ("grpc.enable_retries", 0),
]


def _channel(ep: _connect.Endpoint) -> grpc.aio.Channel:
    options = list(_OPTIONS)
    if ep.url.startswith("unix://"):
        # gRPC would send the socket's path as the authority, which is no
        # valid one for an HTTP/2 server.
        options.append(("grpc.default_authority", "localhost"))
    if ep.tls is not None:
        creds = grpc.ssl_channel_credentials(
            root_certificates=ep.tls.ca_pem,
            private_key=ep.tls.key_pem,
            certificate_chain=ep.tls.cert_pem,
        )
        if ep.tls.server_name:
            options.append(("grpc.ssl_target_name_override", ep.tls.server_name))
        return grpc.aio.secure_channel(ep.target, creds, options=options)
    return grpc.aio.insecure_channel(ep.target, options=options)


class Worker:
    """One worker, reached over one channel in one event loop."""

    def __init__(self, ep: _connect.Endpoint) -> None:
        self.endpoint = ep
        self.url = ep.url
        #: It has answered a call: a failure now is a blink to wait out,
        #: not a wrong address.
        self.answered = False
        self._metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {ep.token}"),) if ep.token else ()
        )
        self._open()

    def _open(self) -> None:
        """A new channel to the worker, and its calls."""
        ser = _ser
        self.channel = ch = _channel(self.endpoint)
        self._unary: dict[str, grpc.aio.UnaryUnaryMultiCallable[Any, Any]] = {}
        calls: list[tuple[str, Any]] = [
            ("CreateSandbox", pb.Sandbox),
            ("GetSandbox", pb.Sandbox),
            ("ListSandboxes", pb.ListSandboxesResponse),
            ("DestroySandbox", pb.DestroySandboxResponse),
            ("SubmitOperation", pb.Operation),
            ("GetOperation", pb.Operation),
            ("ListOperations", pb.ListOperationsResponse),
            ("CancelOperation", pb.CancelOperationResponse),
            ("SignalOperation", pb.SignalOperationResponse),
            ("GetWorkerInfo", pb.WorkerInfo),
            ("GetSandboxStats", pb.SandboxStats),
            ("WriteInput", pb.WriteInputResponse),
            ("ResizeTerminal", pb.ResizeTerminalResponse),
            ("ResetSandbox", pb.ResetSandboxResponse),
            ("SetSandboxEgress", pb.Sandbox),
            ("CheckpointSandbox", pb.Sandbox),
            ("RestoreSandbox", pb.Sandbox),
            ("ExposePort", pb.PortExposure),
            ("RevokeAccess", pb.RevokeAccessResponse),
            ("ListExposures", pb.ListExposuresResponse),
            ("SnapshotSandbox", pb.Template),
            ("ListTemplates", pb.ListTemplatesResponse),
            ("DeleteTemplate", pb.DeleteTemplateResponse),
            ("CreateVolume", pb.Volume),
            ("ListVolumes", pb.ListVolumesResponse),
            ("DeleteVolume", pb.DeleteVolumeResponse),
        ]
        for name, resp in calls:
            self._unary[name] = ch.unary_unary(
                SERVICE + name, request_serializer=ser, response_deserializer=resp.FromString
            )
        self._watch = ch.unary_stream(
            SERVICE + "WatchSandbox",
            request_serializer=ser,
            response_deserializer=pb.SandboxEvent.FromString,
        )
        self._run = ch.unary_stream(
            SERVICE + "RunOperation",
            request_serializer=ser,
            response_deserializer=pb.RunOperationResponse.FromString,
        )
        self._download = ch.unary_stream(
            SERVICE + "Download",
            request_serializer=ser,
            response_deserializer=pb.DownloadResponse.FromString,
        )
        self._upload = ch.stream_unary(
            SERVICE + "Upload",
            request_serializer=ser,
            response_deserializer=pb.Operation.FromString,
        )
        self._build = ch.stream_stream(
            SERVICE + "BuildImage",
            request_serializer=ser,
            response_deserializer=pb.BuildImageEvent.FromString,
        )

    async def _guard(self) -> None:
        """Before a call that may open a connection: a token goes to a TCP
        socket on this machine only if it belongs to this user, root or the
        token file's owner, on the first connection and on every one after
        (a restarted worker's port may have been taken by another user).
        The listener is checked before the connection is made, and the
        connection itself once it is made, before any call goes over it; a
        refused one is closed, never used. A connection already up was
        checked when it was made."""
        ep = self.endpoint
        if not ep.guarded:
            return
        if self.channel.get_state(try_to_connect=False) == grpc.ChannelConnectivity.READY:
            return
        _connect.check_listener(self.url, ep.token_owner)
        try:
            await asyncio.wait_for(self.channel.channel_ready(), CONNECT_WAIT_S)
        except asyncio.TimeoutError:
            raise WorkerUnavailable(
                f"{self.url}: no connection within {CONNECT_WAIT_S:g} s"
            ) from None
        try:
            _connect.check_connected(self.url, ep.token_owner)
        except CorralError:
            old = self.channel
            self._open()
            await old.close()
            raise

    async def call(
        self, name: str, req: Any, resp: type[Resp], timeout: float | None = None
    ) -> Resp:
        await self._guard()
        try:
            out = await self._unary[name](req, metadata=self._metadata, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        assert isinstance(out, resp)
        self.answered = True
        return out

    def watch(self, req: pb.WatchSandboxRequest) -> AsyncGenerator[pb.SandboxEvent, None]:
        return _stream(lambda: self._watch(req, metadata=self._metadata), self._error, self._guard)

    def run(self, req: pb.SubmitOperationRequest) -> AsyncGenerator[pb.RunOperationResponse, None]:
        return _stream(lambda: self._run(req, metadata=self._metadata), self._error, self._guard)

    def download(self, req: pb.DownloadRequest) -> AsyncGenerator[pb.DownloadResponse, None]:
        return _stream(
            lambda: self._download(req, metadata=self._metadata), self._error, self._guard
        )

    def build(
        self, reqs: AsyncIterator[pb.BuildImageRequest]
    ) -> AsyncGenerator[pb.BuildImageEvent, None]:
        return _stream(lambda: self._build(reqs, metadata=self._metadata), self._error, self._guard)

    async def upload(self, reqs: AsyncIterator[pb.UploadRequest]) -> pb.Operation:
        await self._guard()
        try:
            out = await self._upload(reqs, metadata=self._metadata)
        except grpc.aio.AioRpcError as e:
            raise self._error(e) from None
        assert isinstance(out, pb.Operation)
        return out

    def _error(self, e: grpc.RpcError) -> CorralError:
        """The Corral error of a failed call; a refused token says which
        token was sent, and where it came from."""
        err = from_rpc_error(e, self.url)
        if isinstance(err, Unauthenticated):
            ep = self.endpoint
            if not ep.token:
                hint = "no token was sent (give token_file= or CORRAL_TOKEN_FILE)"
            elif ep.token_file:
                hint = (
                    f"the token sent was read from {ep.token_file}; is it this worker's? "
                    "(give token_file= or CORRAL_TOKEN_FILE)"
                )
            else:
                hint = "the token sent was given directly"
            err = Unauthenticated(f"{err}: {hint}", code=err.code, reason=err.reason)
        return err

    async def close(self) -> None:
        await self.channel.close()


def _ser(m: Any) -> bytes:
    out = m.SerializeToString()
    assert isinstance(out, bytes)
    return out


async def _stream(
    start: Callable[[], Any],
    error: Callable[[grpc.RpcError], CorralError],
    guard: Callable[[], Awaitable[None]],
) -> AsyncGenerator[Any, None]:
    await guard()
    call = start()
    try:
        async for m in call:
            yield m
    except grpc.aio.AioRpcError as e:
        raise error(e) from None
    finally:
        call.cancel()


#: Loops that live as long as the process (the sync face's): no keeper.
PERMANENT_LOOPS: weakref.WeakSet[asyncio.AbstractEventLoop] = weakref.WeakSet()


class _Pool:
    """The workers of one event loop, by address and credentials."""

    def __init__(self) -> None:
        self.workers: dict[_connect.Endpoint, Worker] = {}
        self.local_lock = asyncio.Lock()
        # Closes the loop's channels when the loop ends: asyncio.run cancels
        # every task left before it closes the loop, this one among them.
        # (A channel left open past its loop has gRPC call into a closed
        # loop.)
        loop = asyncio.get_running_loop()
        self.keeper = None if loop in PERMANENT_LOOPS else asyncio.ensure_future(self._keep())

    async def _keep(self) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            workers, self.workers = list(self.workers.values()), {}
            for w in workers:
                with contextlib.suppress(Exception):
                    await w.close()
            # What the closed calls still owe this loop comes in meanwhile.
            with contextlib.suppress(BaseException):
                await asyncio.sleep(0.02)
            raise


_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Pool] = weakref.WeakKeyDictionary()


def _pool() -> _Pool:
    loop = asyncio.get_running_loop()
    p = _pools.get(loop)
    if p is None:
        p = _Pool()
        _pools[loop] = p
    return p


def worker(ep: _connect.Endpoint) -> Worker:
    """The worker of ``ep`` in this event loop (one channel per worker)."""
    p = _pool()
    w = p.workers.get(ep)
    if w is None:
        w = Worker(ep)
        p.workers[ep] = w
    return w


async def answers(w: Worker, timeout: float = 5.0) -> pb.WorkerInfo | None:
    try:
        return await w.call("GetWorkerInfo", pb.GetWorkerInfoRequest(), pb.WorkerInfo, timeout)
    except CorralError:
        return None


async def local_worker(o: _connect.Options) -> Worker:
    """The local worker of ``o``'s state directory, started first if none
    answers (as ``corral`` does)."""
    state = _connect.local_state_dir(o)
    pool = _pool()
    async with pool.local_lock:
        ep = _connect.local_endpoint(state)
        if ep is not None and await answers(worker(ep)):
            return worker(ep)
        starter = _connect.LocalStarter(state, o.docker_host)
        fd = await asyncio.to_thread(starter.lock)
        try:
            ep = _connect.local_endpoint(state)
            if ep is not None and await answers(worker(ep)):
                return worker(ep)
            child = starter.start()
            deadline = time.monotonic() + _connect.START_PATIENCE_S
            while True:
                ep = _connect.local_endpoint(state)
                if ep is not None and await answers(worker(ep), timeout=2.0):
                    return worker(ep)
                code = child.poll()
                if code is not None:
                    raise WorkerUnavailable(starter.last_words(code))
                if time.monotonic() > deadline:
                    raise WorkerUnavailable(
                        f"local worker: it did not answer within "
                        f"{_connect.START_PATIENCE_S:.0f} s of starting "
                        f"(see {state / 'worker.log'})"
                    )
                await asyncio.sleep(0.05)
        finally:
            os.close(fd)


async def workers(o: _connect.Options) -> list[Worker]:
    """Every worker ``o`` names, or the local one."""
    eps = await _connect.endpoints(o)
    if eps is None:
        return [await local_worker(o)]
    return [worker(ep) for ep in eps]


#: How long a worker that never answered is waited for.
FIRST_CONTACT_S = 5.0


async def retrying(
    what: Callable[[], Awaitable[T]],
    patience: float,
    transient: Callable[[CorralError], bool],
    worker: Worker | None = None,
) -> T:
    """``what()`` again after transient failures (same ids: nothing runs
    twice), until ``patience`` seconds have passed (a few, for a worker
    that has never answered: a wrong address says so soon)."""
    loop = asyncio.get_running_loop()
    if worker is not None and not worker.answered:
        patience = min(patience, FIRST_CONTACT_S)
    deadline = loop.time() + patience
    pause = 0.05
    while True:
        try:
            return await what()
        except CorralError as e:
            if not transient(e) or loop.time() + pause > deadline:
                raise
        await asyncio.sleep(pause)
        pause = min(pause * 2, 1.0)
