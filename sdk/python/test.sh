#!/usr/bin/env bash
# The Python SDK's checks and tests, as deploy/test.sh runs them: a venv of
# its own (target/sdk-venv), the package installed from this directory as a
# user installs it, then ruff, mypy --strict and pytest against real workers
# (the debug binaries of `cargo build --workspace --bins` and the static
# corral-init of deploy/test.sh), Harbor's in a Python 3.13 image built
# first (tests/harbor/build-image.sh).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
venv="${CORRAL_SDK_VENV:-$repo/target/sdk-venv}"
python="${PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check "$here[dev]"
cd "$here"
"$venv/bin/ruff" check --no-cache .
"$venv/bin/ruff" format --check --no-cache .
"$venv/bin/mypy"
# The Agents SDK's own sandbox test helpers come in its sdist (the version
# installed): fetched here, not by a test (tests reach loopback only).
agents_version=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("openai-agents"))')
agents_src="$repo/target/pypi/openai_agents-$agents_version"
if [ ! -f "$agents_src/tests/sandbox/integration_tests/_helpers.py" ]; then
    mkdir -p "$repo/target/pypi"
    "$venv/bin/pip" download --quiet --disable-pip-version-check --no-deps --no-binary :all: \
        "openai-agents==$agents_version" -d "$repo/target/pypi"
    tar -xzf "$repo/target/pypi/openai_agents-$agents_version.tar.gz" -C "$repo/target/pypi"
fi
# pytest as wheels for the tasks' Python (corral-debian's 3.11), which the
# Harbor tests' tasks install in their images as real tasks do (offline).
pytest_version=$("$venv/bin/python" -c 'import importlib.metadata as m; print(m.version("pytest"))')
wheels="$repo/target/pypi/pytest-wheels"
if [ ! -f "$wheels/.complete-$pytest_version" ]; then
    rm -rf "$wheels"
    "$venv/bin/pip" download --quiet --disable-pip-version-check --only-binary=:all: \
        --python-version 3.11 "pytest==$pytest_version" -d "$wheels"
    touch "$wheels/.complete-$pytest_version"
fi
# No model price list from the network when litellm is imported.
export LITELLM_LOCAL_MODEL_COST_MAP=True
# Harbor needs Python >= 3.12: its test runs it in an image of its own, for
# the oldest release the adapter supports and the newest one tested.
for harbor in 0.25.0 0.26.0; do
    PYTHON="$venv/bin/python" "$here/tests/harbor/build-image.sh" "$harbor"
done
# The installed package is what the tests import, not this directory's copy.
cd "$here/tests"
"$venv/bin/python" -m pytest -q -p no:cacheprovider --rootdir "$here" -c "$here/pyproject.toml" "$here/tests" "$@"
