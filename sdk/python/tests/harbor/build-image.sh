#!/usr/bin/env bash
# Builds the image the Harbor adapter's test runs Harbor in (with the
# Docker CLI and Compose v2, for Harbor's Docker environment): Harbor 0.25
# needs Python >= 3.12, so Debian trixie (Python 3.13), made by mmdebstrap
# from the Debian archive as corral-debian is (no registry), with Harbor and
# the SDK's dependencies installed in /venv from wheels downloaded here
# first (pip download --python-version 3.13 --only-binary=:all:), offline
# inside the image. The root filesystem and the wheels are cached under
# ~/.cache/corral/images, keyed by this script and the version; an image
# already built from them is kept. Usage: build-image.sh [HARBOR_VERSION]
# (default 0.25.0), which makes corral-harbor-test:HARBOR_VERSION.
set -euo pipefail
version=${1:-0.25.0}
tag=corral-harbor-test:$version
suite=trixie
mirror=${CORRAL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
# The Docker CLI and Compose v2: for Harbor's own Docker environment.
packages=python3,python3-venv,ca-certificates,bash,coreutils,findutils,tar,docker-cli,docker-compose
pins="harbor==$version grpcio>=1.85.1 protobuf>=7.35.1,<8"
python=${PYTHON:-python3}

key=$( (cat "$0"; echo "$suite $mirror $packages $pins") | sha256sum | cut -c1-16)
if [ "$(docker image inspect "$tag" --format '{{index .Config.Labels "corral.key"}}' 2>/dev/null)" = "$key" ]; then
    echo "$tag is current"
    exit 0
fi
if ! command -v mmdebstrap >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null
    else
        echo "build-image.sh: needs mmdebstrap (apt-get install mmdebstrap)" >&2
        exit 1
    fi
fi
cache=${XDG_CACHE_HOME:-$HOME/.cache}/corral/images
mkdir -p "$cache"
# The root filesystem does not depend on Harbor's version.
fskey=$( (echo "$suite $mirror $packages") | sha256sum | cut -c1-16)
rootfs=$cache/harbor-$suite-$fskey.tar
if [ ! -s "$rootfs" ]; then
    tmp=$(mktemp "$cache/.harbor.XXXXXX")
    trap 'rm -f "$tmp"' EXIT
    echo "building the Debian $suite root filesystem for Harbor (a few minutes the first time)"
    mmdebstrap --quiet --variant=minbase --format=tar --include="$packages" \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        "$suite" "$tmp" "$mirror"
    mv "$tmp" "$rootfs"
    trap - EXIT
fi
wheels=$cache/harbor-wheels-$key
if [ ! -f "$wheels/.complete" ]; then
    rm -rf "$wheels"
    # shellcheck disable=SC2086
    "$python" -m pip download --quiet --disable-pip-version-check --dest "$wheels" \
        --python-version 3.13 --only-binary=:all: $pins
    touch "$wheels/.complete"
fi
base="corral-harbor-base:$key"
docker import --change 'ENV LANG=C.UTF-8' "$rootfs" "$base" >/dev/null
name="corral-harbor-build-$$"
trap 'docker rm -f "$name" >/dev/null 2>&1 || true' EXIT
docker run --name "$name" --network none -v "$wheels:/wheels:ro" "$base" sh -c \
    'python3 -m venv /venv && /venv/bin/pip install --quiet --no-index --find-links /wheels harbor grpcio protobuf'
docker commit \
    --change 'ENV PATH=/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV HARBOR_TELEMETRY=0' \
    --change "LABEL corral.key=$key" \
    "$name" "$tag" >/dev/null
docker rm -f "$name" >/dev/null
trap - EXIT
docker rmi "$base" >/dev/null
echo "built $tag"
