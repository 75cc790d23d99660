#!/usr/bin/env bash
# Builds the image the way-in tests run a real Jupyter server in:
# corral-debian with jupyter-server and ipykernel in /opt/jupyter, installed
# offline from wheels downloaded here first (pip download, for
# corral-debian's Python 3.11); the build itself has no network. The wheels
# are cached under ~/.cache/corral/images, keyed by this script; an image
# already built from them and the current corral-debian is kept.
# Usage: build-image.sh (makes corral-jupyter-test:latest).
set -euo pipefail
tag=corral-jupyter-test:latest
pins="jupyter-server==2.21.1 ipykernel==7.4.0"
python=${PYTHON:-python3}
base=$(docker image inspect corral-debian:latest --format '{{.Id}}')
key=$( (cat "$0"; echo "$pins $base") | sha256sum | cut -c1-16)
if [ "$(docker image inspect "$tag" --format '{{index .Config.Labels "corral.key"}}' 2>/dev/null)" = "$key" ]; then
    echo "$tag is current"
    exit 0
fi
cache=${XDG_CACHE_HOME:-$HOME/.cache}/corral/images
wkey=$( (echo "$pins") | sha256sum | cut -c1-16)
wheels=$cache/jupyter-wheels-$wkey
if [ ! -f "$wheels/.complete" ]; then
    rm -rf "$wheels"
    mkdir -p "$wheels"
    # shellcheck disable=SC2086
    "$python" -m pip download --quiet --disable-pip-version-check --dest "$wheels" \
        --python-version 3.11 --only-binary=:all: $pins
    touch "$wheels/.complete"
fi
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
cp -r "$wheels" "$ctx/wheels"
cat > "$ctx/Dockerfile" <<DOCKERFILE
FROM corral-debian:latest
COPY wheels /tmp/wheels
RUN python3 -m venv /opt/jupyter \
 && /opt/jupyter/bin/pip install --quiet --no-index --find-links /tmp/wheels $pins \
 && rm -rf /tmp/wheels
ENV PATH=/opt/jupyter/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
LABEL corral.key=$key
DOCKERFILE
docker build --quiet --network none -t "$tag" "$ctx" >/dev/null
echo "built $tag"
