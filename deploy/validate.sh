#!/usr/bin/env bash
# Checks the deployment files without a cluster: every deploy/k8s/*.yaml
# against the API schemas of Kubernetes 1.33 and 1.37 (kubernetes-validate
# --strict: unknown fields fail too), and deploy/compose.yaml with
# `docker compose config -q` (or docker-compose).
# Prints one line per check; exits 1 if any fails. The first run installs
# kubernetes-validate from PyPI into a venv under
# ${XDG_CACHE_HOME:-$HOME/.cache}/corral/venv.
# Usage: deploy/validate.sh [K8S_DIR [COMPOSE_FILE]]
#   (default: deploy/k8s and deploy/compose.yaml)
set -euo pipefail
deploy=$(cd "$(dirname "$0")" && pwd)
k8s_dir=${1:-$deploy/k8s}
compose_file=${2:-$deploy/compose.yaml}
versions=(1.33.0 1.37.0)

venv=${XDG_CACHE_HOME:-$HOME/.cache}/corral/venv
kv=$venv/bin/kubernetes-validate
if [ ! -x "$kv" ]; then
    echo "installing kubernetes-validate into $venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q 'kubernetes-validate==1.37.0'
fi
shipped=$("$venv/bin/python" -c 'from kubernetes_validate.utils import all_versions; print(" ".join(all_versions()))')

failed=0
check() { # check NAME COMMAND...: runs it, prints one line (and its output if it failed)
    local name=$1 out
    shift
    if out=$("$@" 2>&1); then
        echo "ok    $name"
    else
        echo "FAIL  $name"
        printf '%s\n' "$out" | sed 's/^/      /'
        failed=1
    fi
}

shopt -s nullglob
manifests=("$k8s_dir"/*.yaml)
if [ ${#manifests[@]} = 0 ]; then
    echo "validate.sh: no manifests in $k8s_dir" >&2
    exit 1
fi
for v in "${versions[@]}"; do
    if [[ " $shipped " != *" $v "* ]]; then
        echo "FAIL  kubernetes $v: not among the schemas of $kv ($shipped)"
        failed=1
        continue
    fi
    for f in "${manifests[@]}"; do
        check "kubernetes $v  ${f#"$PWD"/}" "$kv" --strict --quiet -k "$v" "$f"
    done
done

if docker compose version >/dev/null 2>&1; then
    compose=(docker compose)
elif command -v docker-compose >/dev/null; then
    compose=(docker-compose)
else
    compose=()
fi
if [ ${#compose[@]} = 0 ]; then
    echo "FAIL  compose: neither docker compose nor docker-compose is installed"
    failed=1
else
    check "compose  ${compose_file#"$PWD"/} (${compose[*]} config -q)" \
        "${compose[@]}" -f "$compose_file" config -q
fi
exit "$failed"
