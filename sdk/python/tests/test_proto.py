"""The generated messages are those of the repository's proto/."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]


def test_the_stubs_are_current(tmp_path: Path) -> None:
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools is not installed (pip install ./sdk/python[dev])")
    sys.path.insert(0, str(HERE))
    try:
        import generate
    finally:
        sys.path.pop(0)
    generate.generate(tmp_path)
    for name in ("worker_pb2.py", "worker_pb2.pyi"):
        fresh = (tmp_path / name).read_text()
        kept = (HERE / "corral" / "_proto" / name).read_text()
        assert fresh == kept, f"corral/_proto/{name} is stale: run python sdk/python/generate.py"


def test_every_call_the_client_makes_is_one_the_worker_serves() -> None:
    import inspect
    import re

    from corral import _rpc
    from corral._proto import worker_pb2

    service = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
    served = {m.name for m in service.methods}
    source = inspect.getsource(_rpc)
    used = set(re.findall(r'\("([A-Z][A-Za-z]+)", pb\.', source))
    used |= set(re.findall(r'SERVICE \+ "([A-Za-z]+)"', source))
    assert {"CreateSandbox", "WatchSandbox", "Upload", "Download", "WriteInput"} <= used
    assert used <= served, used - served
