"""Which worker a client talks to, and how: found as the ``corral`` CLI finds
it (``CORRAL_WORKER``, ``CORRAL_TOKEN_FILE``, TLS settings, ``dns:///`` names,
and with none of them the local worker ``corral`` starts)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from corral.errors import ConfigError, WorkerUnavailable

MIN_TOKEN_CHARS = 16
#: How long a starting local worker may take to answer.
START_PATIENCE_S = 30.0


@dataclass(frozen=True)
class Tls:
    ca_pem: bytes | None = None
    cert_pem: bytes | None = None
    key_pem: bytes | None = None
    server_name: str | None = None


@dataclass(frozen=True)
class Endpoint:
    """One worker: its address as given (``http://h:p``, ``https://h:p``,
    ``unix:///path``) and the credentials it gets."""

    url: str
    token: str | None = field(default=None, repr=False)
    tls: Tls | None = None
    #: Where the token was read (a refused token names it), if from a file.
    token_file: str | None = None
    #: Besides this user and root, whose socket on this machine may get the
    #: token (the token file's owner).
    token_owner: int | None = None

    @property
    def guarded(self) -> bool:
        """Whether its token goes to a TCP socket on this machine, which is
        checked before every connection (see :func:`check_listener`)."""
        return bool(self.token) and not self.url.startswith("unix://") and is_loopback(self.url)

    @property
    def target(self) -> str:
        """The address as gRPC takes it."""
        if self.url.startswith("unix://"):
            return "unix:" + self.url[len("unix://") :]
        return self.url.split("://", 1)[1].rstrip("/")


@dataclass(frozen=True)
class Options:
    """Where workers are and how to reach them; every field defaults from
    the environment as ``corral``'s flags do."""

    worker: str | None = None
    token_file: str | None = None
    # A front door's key (``corral admin key create``), presented instead of
    # a token file: from ``CORRAL_API_KEY``.
    api_key: str | None = field(default=None, repr=False)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None
    state_dir: str | None = None
    docker_host: str | None = None

    @staticmethod
    def from_env(worker: str | None = None, **given: str | None) -> Options:
        env = os.environ

        def pick(name: str, var: str) -> str | None:
            v = given.get(name)
            return v if v else (env.get(var) or None)

        return Options(
            worker=worker or env.get("CORRAL_WORKER") or env.get("CORRAL_URL") or None,
            token_file=pick("token_file", "CORRAL_TOKEN_FILE"),
            api_key=pick("api_key", "CORRAL_API_KEY"),
            tls_ca=pick("tls_ca", "CORRAL_TLS_CA"),
            tls_cert=pick("tls_cert", "CORRAL_TLS_CERT"),
            tls_key=pick("tls_key", "CORRAL_TLS_KEY"),
            tls_server_name=pick("tls_server_name", "CORRAL_TLS_SERVER_NAME"),
            state_dir=pick("state_dir", "CORRAL_STATE_DIR"),
            docker_host=pick("docker_host", "CORRAL_DOCKER_HOST"),
        )


def default_state_dir(name: str) -> Path:
    """As corral-worker's: ``$XDG_STATE_HOME/corral/NAME``, else
    ``~/.local/state/corral/NAME``."""
    base = os.environ.get("XDG_STATE_HOME")
    if base:
        root = Path(base)
    elif os.environ.get("HOME"):
        root = Path(os.environ["HOME"]) / ".local" / "state"
    else:
        root = Path("/var/lib")
    return root / "corral" / name


def read_token(path: Path) -> str:
    """A token file as the worker reads it: the user's own (no access for
    others), one line of at least 16 characters."""
    try:
        st = path.stat()
        text = path.read_text()
    except OSError as e:
        raise ConfigError(f"token file {path}: {e.strerror or e}") from e
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o077:
        raise ConfigError(
            f"token file {path}: other users can read or write it (mode {mode:03o}): "
            f"chmod 600 {path}"
        )
    token = text.strip()
    if not token or any(c.isspace() or not c.isprintable() for c in token):
        raise ConfigError(f"token file {path}: must be one line without spaces")
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"token file {path}: too short ({len(token)} characters; at least {MIN_TOKEN_CHARS})"
        )
    return token


@dataclass(frozen=True)
class _Entry:
    url: str | None = None
    dns: tuple[str, int] | None = None


def _entries(spec: str) -> list[_Entry]:
    out = []
    for raw in spec.split(","):
        e = raw.strip()
        if not e:
            continue
        if e.startswith("dns:"):
            rest = e[4:].lstrip("/")
            host, sep, port = rest.rpartition(":")
            if not sep:
                raise ConfigError(
                    f"invalid worker address {e!r}: a DNS name needs a port: dns:///NAME:PORT"
                )
            if not port.isdigit():
                raise ConfigError(f"invalid worker address {e!r}: the port is not a number")
            if not host or "/" in host:
                raise ConfigError(f"invalid worker address {e!r}: no host name")
            out.append(_Entry(dns=(host, int(port))))
        elif "://" in e:
            scheme = e.split("://", 1)[0]
            if scheme not in ("http", "https", "unix"):
                raise ConfigError(
                    f"invalid worker address {e!r}: scheme {scheme}:// (http, https, unix or dns)"
                )
            out.append(_Entry(url=e))
        else:
            out.append(_Entry(url=f"http://{e}"))
    return out


def _host_port(url: str) -> tuple[str, int] | None:
    rest = url.split("://", 1)[-1]
    authority = rest.split("/", 1)[0]
    if authority.startswith("["):
        host, _, tail = authority[1:].partition("]")
        port = tail.removeprefix(":")
    else:
        host, _, port = authority.rpartition(":")
    if not host or not port.isdigit():
        return None
    return host, int(port)


def is_loopback(url: str) -> bool:
    """Whether ``url`` names this machine (a worker this user may have
    started)."""
    hp = _host_port(url)
    if hp is None:
        return False
    host = hp[0]
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _proc_net_ip(hexaddr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        words = [int(hexaddr[i : i + 8], 16) for i in range(0, len(hexaddr), 8)]
    except ValueError:
        return None
    raw = b"".join(w.to_bytes(4, sys.byteorder) for w in words)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw)
    if len(raw) == 16:
        return ipaddress.IPv6Address(raw)
    return None


_Addr = ipaddress.IPv4Address | ipaddress.IPv6Address

#: NETLINK_SOCK_DIAG, SOCK_DIAG_BY_FAMILY, and the message types that end a dump.
_SOCK_DIAG, _BY_FAMILY, _NLMSG_ERROR, _NLMSG_DONE = 4, 20, 2, 3


def _diag_listeners(port: int) -> list[tuple[_Addr, int]]:
    """The TCP sockets listening on ``port``, (address, uid), asked of the
    kernel over NETLINK_SOCK_DIAG (listening sockets only, as ``ss -l`` asks):
    tens of microseconds, where /proc/net/tcp walks every socket of the machine
    (milliseconds). Raises OSError where netlink is refused or missing (not
    Linux)."""
    return _diag_sockets(port, 1 << 10)


def _diag_sockets(port: int, states: int) -> list[tuple[_Addr, int]]:
    """The TCP sockets of local port ``port`` in ``states`` (a mask of TCP
    states: 1 << 10 listening, 1 << 1 established), (address, uid)."""
    if not hasattr(socket, "AF_NETLINK"):
        raise OSError("no netlink on this system")
    out: list[tuple[_Addr, int]] = []
    for family in (socket.AF_INET, socket.AF_INET6):
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _SOCK_DIAG) as s:
            s.settimeout(2.0)
            # inet_diag_req_v2: family, TCP, no extensions, states = LISTEN;
            # its socket id names the source port (network order), the rest 0.
            req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, states)
            req += struct.pack("!H", port) + bytes(46)
            s.send(struct.pack("=IHHII", 16 + len(req), _BY_FAMILY, 0x301, 1, 0) + req)
            done, seen = False, 0
            while not done:
                data = s.recv(32 * 1024)
                if not data:
                    raise OSError("sock_diag: the dump ended without NLMSG_DONE")
                at = 0
                while at + 16 <= len(data):
                    length, kind, _, seq, _ = struct.unpack_from("=IHHII", data, at)
                    if length < 16 or at + length > len(data) or seq != 1:
                        raise OSError("sock_diag: a malformed reply")
                    if kind == _NLMSG_DONE:
                        done = True
                        break
                    if kind == _NLMSG_ERROR:
                        (code,) = struct.unpack_from("=i", data, at + 16)
                        raise OSError(-code or 1, "sock_diag refused")
                    msg = data[at + 16 : at + length]
                    if kind == _BY_FAMILY and len(msg) >= 68:
                        (sport,) = struct.unpack_from("!H", msg, 4)
                        (uid,) = struct.unpack_from("=I", msg, 64)
                        addr: _Addr
                        if msg[0] == socket.AF_INET:
                            addr = ipaddress.IPv4Address(msg[8:12])
                        else:
                            addr = ipaddress.IPv6Address(msg[8:24])
                        if sport == port:
                            out.append((addr, uid))
                    seen += 1
                    if seen > 100_000:
                        raise OSError("sock_diag: too many messages")
                    at += (length + 3) & ~3
    return out


def _proc_listeners(port: int) -> list[tuple[_Addr, int]]:
    """The TCP sockets listening on ``port``, (address, uid), from
    /proc/net/tcp and tcp6."""
    out: list[tuple[_Addr, int]] = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 8 or f[3] != "0A":
                continue
            addr, _, p = f[1].partition(":")
            try:
                if int(p, 16) != port:
                    continue
            except ValueError:
                continue
            ip = _proc_net_ip(addr)
            if ip is not None and f[7].isdigit():
                out.append((ip, int(f[7])))
    return out


def _at(host: str, found: list[tuple[_Addr, int]]) -> list[int]:
    """The uids of the sockets of ``found`` at ``host`` (an address, or
    ``localhost``), or at every address."""
    wanted: list[_Addr] = []
    if host == "localhost":
        wanted = [ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
    else:
        with contextlib.suppress(ValueError):
            wanted = [ipaddress.ip_address(host)]
    owners = []
    for ip, uid in found:
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        if ip.is_unspecified or ip in wanted or (mapped is not None and mapped in wanted):
            owners.append(uid)
    return owners


def listener_owners(host: str, port: int) -> list[int]:
    """The uids owning sockets that listen on ``port`` at ``host`` (or at every
    address): asked of the kernel over netlink, else read from /proc."""
    try:
        found = _diag_listeners(port)
    except OSError:
        found = _proc_listeners(port)
    return _at(host, found)


def check_connected(url: str, token_owner: int | None) -> None:
    """After a connection to a worker on this machine was made, before a
    token goes over it: every connection accepted on its port (the
    worker's side of ours among them) belongs to this user, root or the
    token file's owner. A listener that was another user's for a moment
    (a port taken between the check of its listener and the connect) is
    found here, on the connection itself."""
    hp = _host_port(url)
    if hp is None:
        return
    host, port = hp
    try:
        found = _diag_sockets(port, 1 << 1)
    except OSError:
        # No netlink (not Linux, a sandbox's seccomp): the listeners, again.
        check_listener(url, token_owner)
        return
    me = os.geteuid()
    for uid in _at(host, found):
        if uid not in (me, 0) and uid != token_owner:
            raise ConfigError(
                f"{url}: the connection made there is to a socket of uid {uid}, not to you, "
                "root or the token's owner: the token is not sent (is the worker running?)"
            )


def check_listener(url: str, token_owner: int | None) -> None:
    """A token goes to a worker on this machine only through a socket owned
    by this user, root, or the token file's owner: a port a stopped worker
    left free may have been taken by another local user."""
    hp = _host_port(url)
    if hp is None:
        return
    me = os.geteuid()
    for uid in listener_owners(*hp):
        if uid not in (me, 0) and uid != token_owner:
            raise ConfigError(
                f"{url}: the socket listening there belongs to uid {uid}, not to you, root or "
                "the token's owner: the token is not sent (is the worker running?)"
            )


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{what} {path}: {e.strerror or e}") from e


def _tls(o: Options, entries: list[_Entry]) -> Tls | None:
    if bool(o.tls_cert) != bool(o.tls_key):
        raise ConfigError("tls_cert and tls_key go together")
    if not (o.tls_ca or o.tls_cert):
        return None
    dns = [e.dns[0] for e in entries if e.dns]
    name = o.tls_server_name or (
        dns[0] if len(dns) == len(entries) and len(set(dns)) == 1 else None
    )
    return Tls(
        ca_pem=_read(o.tls_ca, "tls_ca") if o.tls_ca else None,
        cert_pem=_read(o.tls_cert, "tls_cert") if o.tls_cert else None,
        key_pem=_read(o.tls_key, "tls_key") if o.tls_key else None,
        server_name=name,
    )


async def _resolve(entries: list[_Entry], tls: bool) -> list[str]:
    loop = asyncio.get_running_loop()
    urls: list[str] = []
    for e in entries:
        if e.url:
            urls.append(e.url)
            continue
        assert e.dns
        host, port = e.dns
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as err:
            raise WorkerUnavailable(f"dns:///{host}:{port}: {err}") from err
        scheme = "https" if tls else "http"
        seen = set()
        for info in infos:
            ip = str(info[4][0])
            if ip in seen:
                continue
            seen.add(ip)
            shown = f"[{ip}]" if ":" in ip else ip
            urls.append(f"{scheme}://{shown}:{port}")
    return urls


async def endpoints(o: Options) -> list[Endpoint] | None:
    """The workers of ``o.worker``, each with its credentials; None for the
    local worker (no worker named)."""
    if not o.worker:
        return None
    entries = _entries(o.worker)
    if not entries:
        return None
    tls = _tls(o, entries)
    urls = await _resolve(entries, tls is not None)
    if not urls:
        raise WorkerUnavailable(f"{o.worker}: no worker address")
    token: str | None = None
    token_from: str | None = None
    token_owner: int | None = None
    own = default_state_dir("worker") / "token"
    local = all(e.url for e in entries) and all(is_loopback(u) for u in urls)
    if o.api_key and not o.token_file:
        token = o.api_key.strip()
        token_from = "CORRAL_API_KEY"
    elif o.token_file:
        token = read_token(Path(o.token_file))
        token_from = o.token_file
        try:
            token_owner = Path(o.token_file).stat().st_uid
        except OSError:
            token_owner = None
    elif local and own.exists():
        token = read_token(own)
        token_from = str(own)
    if token is not None:
        for u in urls:
            if is_loopback(u):
                check_listener(u, token_owner)
        by_name = any(e.dns for e in entries)
        if by_name and tls is None:
            far = [u for u in urls if u.startswith("http://") and not is_loopback(u)]
            if far:
                raise ConfigError(
                    f"{far[0]}: a worker found by DNS name gets the token over TLS only "
                    "(give tls_ca, or name the worker by its address)"
                )
    for u in urls:
        if u.startswith("https://") and tls is None:
            tls = Tls()

    def credentials(u: str) -> tuple[str | None, str | None]:
        # A worker on a Unix socket keeps its token beside it (the local
        # worker's state directory), so a sandbox's own ``worker`` address
        # reaches it again; a token file named is for every worker.
        if u.startswith("unix://") and not o.token_file:
            beside = Path(u[len("unix://") :]).parent / "token"
            if beside.exists():
                return read_token(beside), str(beside)
        return token, token_from

    return [
        Endpoint(
            url=u,
            token=t,
            tls=tls if u.startswith("https://") else None,
            token_file=source,
            token_owner=token_owner,
        )
        for u in urls
        for t, source in [credentials(u)]
    ]


def local_state_dir(o: Options) -> Path:
    return Path(o.state_dir) if o.state_dir else default_state_dir("embedded")


def corral_binary() -> str:
    """The ``corral`` that starts the local worker: ``CORRAL_BIN``, else the
    one on PATH."""
    given = os.environ.get("CORRAL_BIN")
    if given:
        return given
    found = shutil.which("corral")
    if not found:
        raise ConfigError(
            "no worker given and no `corral` binary to start the local one: put corral on PATH "
            "(or set CORRAL_BIN), or name a worker (worker=... or CORRAL_WORKER)"
        )
    return found


def local_endpoint(state: Path) -> Endpoint | None:
    """The local worker's endpoint, if its socket and token are there."""
    sock = state / "worker.sock"
    token_path = state / "token"
    if not sock.exists() or not token_path.exists():
        return None
    return Endpoint(url=f"unix://{sock}", token=read_token(token_path), token_file=str(token_path))


class LocalStarter:
    """Starts ``corral local-worker`` for a state directory, as ``corral``
    does: serialized by ``start.lock``, detached (its own process group, its
    log in the state directory), waited for until it answers."""

    def __init__(self, state: Path, docker_host: str | None) -> None:
        self.state = state
        self.docker_host = docker_host

    def lock(self) -> int:
        self.state.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.state, 0o700)
        fd = os.open(self.state / "start.lock", os.O_CREAT | os.O_WRONLY, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def start(self) -> subprocess.Popen[bytes]:
        exe = corral_binary()
        log = open(self.state / "worker.log", "ab")  # noqa: SIM115 - given to the child
        args = [exe, "local-worker", "--state-dir", str(self.state)]
        if self.docker_host:
            args += ["--docker-host", self.docker_host]
        env = {k: v for k, v in os.environ.items() if k != "CORRAL_METRICS_LISTEN"}
        try:
            return subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=False,
                preexec_fn=os.setpgrp,
            )
        except OSError as e:
            raise ConfigError(f"starting {exe} local-worker: {e.strerror or e}") from e
        finally:
            log.close()

    def last_words(self, code: int) -> str:
        try:
            lines = (self.state / "worker.log").read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        for line in reversed(lines):
            if line.strip():
                return line.strip().removeprefix("corral: ")
        return f"local worker: exited with {code}"
