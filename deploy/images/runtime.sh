#!/usr/bin/env bash
# Builds the images that run Corral itself, locally and with no registry
# (FROM scratch, static binaries only):
#   corral-worker:latest  corral-worker and corral-init in /usr/local/bin;
#                         entrypoint corral-worker
#   corral:latest         the corral command line; entrypoint corral
# Usage: deploy/images/runtime.sh [--no-build]
#   --no-build  use the static binaries already in the Cargo target directory
# Needs: docker, cargo (unless --no-build), binutils' strip (optional).
set -euo pipefail
cd "$(dirname "$0")/../.."

build=1
for arg in "$@"; do
    case $arg in
        --no-build) build=0 ;;
        -h | --help)
            sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "$0"
            exit 0
            ;;
        *)
            echo "runtime.sh: unknown argument $arg (see --help)" >&2
            exit 2
            ;;
    esac
done

triple=x86_64-unknown-linux-gnu
if [ "$build" = 1 ]; then
    RUSTFLAGS="-C target-feature=+crt-static" \
        cargo build --locked --release --target "$triple" \
        -p corral-worker -p corral-init -p corral-control
fi
target_dir=${CARGO_TARGET_DIR:-$PWD/target}
bin_dir=$target_dir/$triple/release

# A static binary: ldd says so (glibc's ldd prints "not a dynamic executable"
# or, for a static PIE, "statically linked").
check_static() {
    local bin=$1 out
    if [ ! -x "$bin" ]; then
        echo "runtime.sh: $bin is missing; build it (run without --no-build)" >&2
        exit 1
    fi
    out=$(LC_ALL=C ldd "$bin" 2>&1 || true)
    case $out in
        *"not a dynamic executable"* | *"statically linked"*) ;;
        *)
            echo "runtime.sh: $bin is not static, so it cannot run in a FROM scratch image." >&2
            echo "  ldd: $(echo "$out" | head -n 3 | tr '\n' ' ')" >&2
            if command -v file >/dev/null; then
                echo "  file: $(file -b "$bin")" >&2
            fi
            echo "  Build it with RUSTFLAGS=\"-C target-feature=+crt-static\" and --target $triple." >&2
            exit 1
            ;;
    esac
}

ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT

# build_image TAG DOCKERFILE BINARY...: a context whose rootfs/ is copied to /.
build_image() {
    local tag=$1 dockerfile=$2 bin
    shift 2
    rm -rf "${ctx:?}"/*
    mkdir -p "$ctx/rootfs/usr/local/bin" "$ctx/rootfs/tmp"
    chmod 0755 "$ctx/rootfs" "$ctx/rootfs/usr" "$ctx/rootfs/usr/local" "$ctx/rootfs/usr/local/bin"
    chmod 1777 "$ctx/rootfs/tmp"
    for bin in "$@"; do
        check_static "$bin_dir/$bin"
        # Without their line tables (about 4/5 of their size); panics still
        # name functions.
        if command -v strip >/dev/null; then
            strip --strip-debug -o "$ctx/rootfs/usr/local/bin/$bin" "$bin_dir/$bin"
            chmod 0755 "$ctx/rootfs/usr/local/bin/$bin"
        else
            install -m 0755 "$bin_dir/$bin" "$ctx/rootfs/usr/local/bin/$bin"
        fi
    done
    cp "$dockerfile" "$ctx/Dockerfile"
    if ! out=$(docker build -q -t "$tag" "$ctx" 2>&1); then
        printf 'runtime.sh: docker build of %s failed:\n%s\n' "$tag" "$out" >&2
        exit 1
    fi
    echo "built $tag ($(docker image inspect -f '{{.Size}}' "$tag" | awk '{printf "%.1f MB", $1/1e6}'))"
}

build_image corral-worker:latest deploy/images/worker.Dockerfile corral-worker corral-init
build_image corral:latest deploy/images/corral.Dockerfile corral
# Each runs where nothing else is (no registry, no C library).
for image in corral-worker:latest corral:latest; do
    if ! out=$(docker run --rm --network none "$image" --version 2>&1); then
        printf 'runtime.sh: %s does not run:\n%s\n' "$image" "$out" >&2
        exit 1
    fi
    echo "$image runs: $out"
done
