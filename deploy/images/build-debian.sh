#!/usr/bin/env bash
# Builds the Debian sandbox image (corral-debian:latest), what `corral run`
# uses by default, with no registry: mmdebstrap makes a minimal Debian root
# filesystem from the Debian archive (python3, git, coreutils, procps,
# findutils, a C toolchain; /etc/passwd and /etc/group linked to the ones
# the supervisor writes for each sandbox's own uid, the image's own
# accounts in their place for a `docker build` FROM it, where no supervisor
# runs), and `docker
# import` makes it an image. The root filesystem is cached under
# ~/.cache/corral/images, keyed by this script, so a rebuild is an import.
# Needs: docker, and mmdebstrap (installed with apt-get when missing and
# running as root). Usage: build-debian.sh [TAG]
set -euo pipefail

tag=${1:-corral-debian:latest}
suite=${CORRAL_DEBIAN_SUITE:-bookworm}
mirror=${CORRAL_DEBIAN_MIRROR:-http://deb.debian.org/debian}
packages=python3,python3-venv,python3-pip,git,curl,ca-certificates,procps,findutils,less,gcc,libc6-dev,make,bash

if ! command -v mmdebstrap >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >/dev/null
    else
        echo "build-debian.sh: needs mmdebstrap (apt-get install mmdebstrap)" >&2
        exit 1
    fi
fi

key=$( (cat "$0"; echo "$suite $mirror $packages") | sha256sum | cut -c1-16)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/corral/images
rootfs=$cache/debian-$suite-$key.tar
if [ ! -s "$rootfs" ]; then
    mkdir -p "$cache"
    tmp=$(mktemp "$cache/.debian.XXXXXX")
    trap 'rm -f "$tmp"' EXIT
    echo "building the Debian root filesystem ($suite, from $mirror; a few minutes the first time)"
    mmdebstrap --quiet --variant=minbase --format=tar \
        --include="$packages" \
        --dpkgopt='path-exclude=/usr/share/man/*' \
        --dpkgopt='path-exclude=/usr/share/locale/*' \
        --dpkgopt='path-exclude=/usr/share/doc/*' \
        --dpkgopt='path-include=/usr/share/doc/*/copyright' \
        --customize-hook='for f in passwd group; do mv "$1/etc/$f" "$1/etc/$f.image" && ln -s /run/corral/$f "$1/etc/$f"; done' \
        --customize-hook='mkdir -p "$1/workspace" && chmod 0755 "$1" "$1/workspace"' \
        --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
        "$suite" "$tmp" "$mirror"
    # The image's own accounts where the links point, for a `docker build`
    # FROM it (no supervisor there); in a sandbox a tmpfs covers them.
    # Added to the archive: mmdebstrap empties /run.
    extra=$(mktemp -d)
    mkdir -p "$extra/run/corral"
    for f in passwd group; do
        tar -xOf "$tmp" "./etc/$f.image" > "$extra/run/corral/$f"
    done
    chmod 0644 "$extra"/run/corral/*
    tar --append -f "$tmp" -C "$extra" --owner=0 --group=0 ./run/corral
    rm -rf "$extra"
    mv "$tmp" "$rootfs"
    trap - EXIT
fi

docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'WORKDIR /workspace' \
    --change 'LABEL corral.image=debian' \
    "$rootfs" "$tag" >/dev/null
echo "built $tag"
