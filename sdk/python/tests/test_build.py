"""corral.build_image against a real worker (--allow-build): the context as
``docker build`` would send it (.dockerignore applied), the same bytes for
the same files, a failed step as a result naming it, and a sandbox of the
image starting in its WORKDIR."""

from __future__ import annotations

import io
import os
import tarfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import Worker

import corral
from corral._build import pack_context


def make_context(root: Path, dockerfile: str) -> Path:
    ctx = root / "ctx"
    (ctx / "node_modules" / "pkg").mkdir(parents=True)
    (ctx / "src").mkdir()
    (ctx / "Dockerfile").write_text(dockerfile)
    (ctx / "src" / "main.py").write_text("print('hello from the image')\n")
    (ctx / "secret.txt").write_text("not for the image\n")
    (ctx / "node_modules" / "pkg" / "index.js").write_text("big\n")
    (ctx / "notes.md").write_text("left out\n")
    (ctx / "keep.md").write_text("kept by an exception\n")
    # Of this run only: the engine keeps what earlier runs built.
    (ctx / "nonce").write_text(uuid.uuid4().hex)
    (ctx / ".dockerignore").write_text(
        "# what the image does not need\nsecret.txt\nnode_modules\n*.md\n!keep.md\n"
    )
    return ctx


def test_a_context_packs_to_the_same_bytes_and_leaves_out_what_dockerignore_says(
    tmp_path: Path,
) -> None:
    ctx = make_context(tmp_path, "FROM corral-debian:latest\n")
    first = pack_context(ctx, "Dockerfile").read()
    os.utime(ctx / "src" / "main.py", (1, 1))
    assert pack_context(ctx, "Dockerfile").read() == first, "times change nothing"
    with tarfile.open(fileobj=io.BytesIO(first)) as tar:
        names = tar.getnames()
    assert "src/main.py" in names and "keep.md" in names and ".dockerignore" in names
    for gone in ("secret.txt", "node_modules", "node_modules/pkg/index.js", "notes.md"):
        assert gone not in names, names
    # Over the bound: refused as it is packed, never read whole into memory
    # (a sparse file claims far more than its disk holds).
    with open(ctx / "sparse", "wb") as f:
        f.truncate(3 << 30)
    with pytest.raises(corral.ConfigError, match="over the context's bound"):
        pack_context(ctx, "Dockerfile")
    (ctx / "sparse").unlink()
    with pytest.raises(corral.ConfigError, match="over 4096 bytes"):
        pack_context(ctx, "Dockerfile", max_bytes=4096)
    os.mkfifo(ctx / "fifo")
    with pytest.raises(corral.ConfigError, match="not a file"):
        pack_context(ctx, "Dockerfile")


def test_dockerignore_patterns_match_as_docker_reads_them_and_never_slowly() -> None:
    from corral._build import _Ignore

    ig = _Ignore("**/*.pyc\nbuild\ndocs/**/draft*\n!docs/keep/draft1\n" + "**a" * 30 + "**b\n")
    assert ig.ignored("x/y/z.pyc") and ig.ignored("z.pyc")
    assert ig.ignored("build") and ig.ignored("build/out/a.o")
    assert ig.ignored("docs/a/b/draft2") and not ig.ignored("docs/keep/draft1")
    assert not ig.ignored("src/main.py")
    # A pattern that a regular expression would take exponential time on.
    start = time.monotonic()
    assert not ig.ignored("a" * 60)
    assert time.monotonic() - start < 5, "the matcher backtracks"


def test_an_image_built_on_the_worker_runs_sandboxes_in_its_workdir(
    own_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    w = own_worker("--allow-build")
    ctx = make_context(
        tmp_path,
        "FROM corral-debian:latest\nWORKDIR /srv\nCOPY . .\nRUN python3 src/main.py > made.txt\n",
    )
    seen: list[str] = []
    built = corral.build_image(
        ctx, worker=w.url, token_file=str(w.token_file), on_output=seen.append
    )
    assert built.ok and built.image and not built.cached, built
    assert built.image.startswith("corral-build:")
    assert "Step 4/4" in "".join(seen) and built.output == "".join(seen)
    again = corral.build_image(ctx, worker=w.url, token_file=str(w.token_file))
    assert again.ok and again.cached and again.image == built.image
    with w.create(image=built.image) as sb:
        r = sb.run("pwd; ls -A; cat made.txt")
        assert r.ok, r
        lines = r.stdout.splitlines()
        assert lines[0] == "/srv"
        assert "keep.md" in lines and "secret.txt" not in lines and "node_modules" not in lines
        assert lines[-1] == "hello from the image"


def test_a_failed_step_is_a_result_and_a_worker_without_builds_refuses(
    own_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    w = own_worker("--allow-build")
    ctx = make_context(tmp_path, "FROM corral-debian:latest\nRUN exit 4\n")
    built = corral.build_image(ctx, worker=w.url, token_file=str(w.token_file))
    assert not built.ok and built.image is None
    assert built.failure is not None
    assert built.failure.kind is corral.BuildFailureKind.STEP_FAILED
    assert (built.failure.step, built.failure.steps) == (2, 2)
    assert built.failure.instruction == "RUN exit 4"
    assert "step 2/2 (RUN exit 4)" in str(built.failure)
    # A base the worker does not allow.
    (ctx / "Dockerfile").write_text("FROM alpine:3.20\n")
    with pytest.raises(corral.PolicyDenied) as e:
        corral.build_image(ctx, worker=w.url, token_file=str(w.token_file))
    assert e.value.flag == "--allow-image"
    plain = own_worker()
    with pytest.raises(corral.PolicyDenied) as e:
        corral.build_image(ctx, worker=plain.url, token_file=str(plain.token_file))
    assert e.value.flag == "--allow-build"
    with pytest.raises(corral.ConfigError, match="no such file"):
        corral.build_image(ctx, dockerfile="missing/Dockerfile", worker=plain.url)


def test_a_template_built_step_by_step_hands_out_sandboxes_ready(
    own_worker: Callable[..., Worker], tmp_path: Path
) -> None:
    """corral.Template: a Dockerfile written step by step with a file of the
    context, a start command and a readiness probe; its sandbox's server
    answers as soon as the create returns; a probe that never holds is a
    typed refusal."""
    w = own_worker("--allow-build")
    (tmp_path / "index.html").write_text(f"hello {uuid.uuid4().hex}\n")
    t = (
        corral.Template.from_image("corral-debian:latest")
        .workdir("/srv")
        .copy("index.html", "/srv/index.html")
        .env(GREETING="héllo there", EMPTY="")
        .run("python3 -c 'import http.server'")
        .start("exec python3 -m http.server 8000", ready_http="8000/index.html")
    )
    assert t.dockerfile().startswith("FROM corral-debian:latest\nWORKDIR /srv\n")
    built = t.build("site", context=tmp_path, worker=w.url, token_file=str(w.token_file))
    assert built.ok and built.template == "site", built
    # Steps are values: a variant leaves the first alone.
    assert "RUN false" not in t.dockerfile() and "RUN false" in t.run("false").dockerfile()
    with w.create(template="site") as sb:
        r = sb.run(
            'python3 -c "import urllib.request as u; '
            "print(u.urlopen('http://127.0.0.1:8000/index.html').read().decode(), end='')\"; "
            'echo "$GREETING|$EMPTY|$PWD"'
        )
        assert r.ok, r
        assert r.stdout.startswith("hello ") and r.stdout.endswith("héllo there||/srv\n"), r.stdout
    never = corral.Template.from_image("corral-debian:latest").start(
        ready_command="false", timeout=1.5
    )
    assert never.build("never", worker=w.url, token_file=str(w.token_file)).ok
    with pytest.raises(corral.InvalidArgument) as e:
        w.create(template="never")
    assert e.value.reason == "template_not_ready" and "not ready within" in str(e.value)
    with pytest.raises(corral.InvalidArgument) as e:
        w.create(template="no-such")
    assert e.value.reason == "no_such_template"
    # Listed and forgotten by name; one in use kept unless forced.
    kept = corral.list_templates(w.url, token_file=str(w.token_file))
    assert {t.name for t in kept} == {"site", "never"}, kept
    site = next(t for t in kept if t.name == "site")
    assert site.start_command == "exec python3 -m http.server 8000" and site.worker == w.url
    with w.create(template="site"):
        with pytest.raises(corral.Conflict) as c:
            corral.delete_template("site", worker=w.url, token_file=str(w.token_file))
        assert c.value.reason == "template_in_use"
    assert corral.delete_template("site", worker=w.url, token_file=str(w.token_file))
    assert not corral.delete_template("site", worker=w.url, token_file=str(w.token_file))
    for bad in (
        lambda: corral.Template.from_image("a\nRUN evil"),
        lambda: corral.Template.from_image("x").env({"A B": "1"}),
        lambda: corral.Template.from_image("x").run("a\nb"),
        lambda: corral.build_image(tmp_path, start="x"),
    ):
        with pytest.raises(corral.InvalidArgument):
            bad()
