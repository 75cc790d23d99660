#!/usr/bin/env bash
# Every call of corral.v1.Worker, made with curl through the HTTP/JSON
# gateway of a worker: its resource paths where it has them, else POST
# /v1/corral.v1.Worker/<Method>. Usage: every_call.sh URL TOKEN_FILE OUT.
# Each answer is kept in OUT (NAME.request: method and path template;
# NAME.status, NAME.type, NAME.body) for the test to check against the
# OpenAPI document; what each must say is checked here as it comes.
set -euo pipefail
trap 'echo "every_call.sh: line $LINENO failed (answers in $out)" >&2' ERR
url=$1
token=$(cat "$2")
out=$3
mkdir -p "$out"
n=0

# call NAME METHOD TEMPLATE PATH [curl args...]: the answer in $out/NAME.*
call() {
    local name=$1 method=$2 template=$3 path=$4
    shift 4
    n=$((n + 1))
    printf '%s %s\n' "$method" "$template" > "$out/$name.request"
    curl -sS -X "$method" -H "Authorization: Bearer $token" \
        -o "$out/$name.body" -w '%{http_code} %{content_type}' "$@" "$url$path" \
        > "$out/$name.meta"
    cut -d' ' -f1 "$out/$name.meta" > "$out/$name.status"
    cut -d' ' -f2- "$out/$name.meta" | cut -d';' -f1 > "$out/$name.type"
}
# rpc NAME METHOD [curl args...]: the generic path of a method.
rpc() {
    local name=$1 method=$2
    shift 2
    call "$name" POST "/v1/corral.v1.Worker/$method" "/v1/corral.v1.Worker/$method" \
        -H 'Content-Type: application/json' "$@"
}
want() { # NAME STATUS
    local got
    got=$(cat "$out/$1.status")
    if [ "$got" != "$2" ]; then
        echo "$1: HTTP $got, wanted $2: $(head -c 2000 "$out/$1.body")" >&2
        exit 1
    fi
}
field() { jq -r "$2" "$out/$1.body"; }
has() { # NAME TEXT
    grep -q -- "$2" "$out/$1.body" || { echo "$1: no '$2' in $(head -c 2000 "$out/$1.body")" >&2; exit 1; }
}

# What the worker is.
call info GET /v1/info /v1/info
want info 200
[ "$(field info .policy.allow_build)" = true ]

# No token, a wrong one: refused as gRPC refuses them.
curl -sS -o "$out/no-token.body" -w '%{http_code}' "$url/v1/sandboxes" > "$out/no-token.status"
printf 'GET /v1/sandboxes\n' > "$out/no-token.request"
echo application/json > "$out/no-token.type"
want no-token 401
[ "$(field no-token .error.reason)" = unauthenticated ]

# A sandbox, listed, read; a bad request refused with its reason.
call create POST /v1/sandboxes /v1/sandboxes -H 'Content-Type: application/json' \
    -d '{"spec": {"memory_bytes": 268435456, "labels": {"made-by": "curl"}}}'
want create 200
id=$(field create .id)
[ "$(field create .state)" = SANDBOX_STATE_READY ]
call create-bad POST /v1/sandboxes /v1/sandboxes -d '{"spec": {"nonsense": 1}}'
want create-bad 400
[ "$(field create-bad .error.code)" = INVALID_ARGUMENT ]
call list GET /v1/sandboxes /v1/sandboxes
want list 200
[ "$(jq --arg id "$id" '[.sandboxes[] | select(.id == $id)] | length' "$out/list.body")" = 1 ]
call get GET "/v1/sandboxes/{id}" "/v1/sandboxes/$id"
want get 200
call missing GET "/v1/sandboxes/{id}" /v1/sandboxes/no-such-sandbox
want missing 404
[ "$(field missing .error.reason)" = sandbox_not_found ]

# A command, one round trip: its events to its end, as NDJSON.
call run POST "/v1/sandboxes/{sandbox_id}/run" "/v1/sandboxes/$id/run" \
    -d '{"operation_id": "op-run", "spec": {"shell": {"command": "python3 -c \"print(6*7)\""}}}'
want run 200
[ "$(cat "$out/run.type")" = application/x-ndjson ]
[ "$(jq -rs 'map(.event.output.data // empty) | add' "$out/run.body" | base64 -d)" = 42 ]
[ "$(jq -s 'last.event.finished.result.outcome.exited.code // 0' "$out/run.body")" = 0 ]
# The same events as Server-Sent Events.
call events GET "/v1/sandboxes/{sandbox_id}/events" \
    "/v1/sandboxes/$id/events?operation_id=op-run&after_seq=0" \
    -H 'Accept: text/event-stream' --max-time 5 || true
want events 200
[ "$(cat "$out/events.type")" = text/event-stream ]
has events '"finished"'
# Submitted, then read; listed.
call submit POST "/v1/sandboxes/{sandbox_id}/operations" "/v1/sandboxes/$id/operations" \
    -d '{"operation_id": "op-sleep", "spec": {"shell": {"command": "sleep 600"}}}'
want submit 200
call op GET "/v1/sandboxes/{sandbox_id}/operations/{operation_id}" \
    "/v1/sandboxes/$id/operations/op-run"
want op 200
[ "$(field op .status)" = OPERATION_STATUS_FINISHED ]
call ops GET "/v1/sandboxes/{sandbox_id}/operations" "/v1/sandboxes/$id/operations"
want ops 200
has ops op-sleep
call signal POST "/v1/sandboxes/{sandbox_id}/operations/{operation_id}/signal" \
    "/v1/sandboxes/$id/operations/op-sleep/signal" -d '{"signal": 15}'
want signal 200
call cancel POST "/v1/sandboxes/{sandbox_id}/operations/{operation_id}/cancel" \
    "/v1/sandboxes/$id/operations/op-sleep/cancel"
want cancel 200
# Input to a command that reads it.
call cat POST "/v1/sandboxes/{sandbox_id}/operations" "/v1/sandboxes/$id/operations" \
    -d '{"operation_id": "op-cat", "spec": {"shell": {"command": "cat > /workspace/in.txt", "stdin": true}}}'
want cat 200
call input POST "/v1/sandboxes/{sandbox_id}/operations/{operation_id}/input" \
    "/v1/sandboxes/$id/operations/op-cat/input" \
    -d "{\"offset\": 0, \"data\": \"$(printf 'fed by curl' | base64)\", \"eof\": true}"
want input 200
# A terminal, resized.
call tty POST "/v1/sandboxes/{sandbox_id}/operations" "/v1/sandboxes/$id/operations" \
    -d '{"operation_id": "op-tty", "spec": {"shell": {"command": "sleep 30", "terminal": {"rows": 24, "cols": 80}}}}'
want tty 200
rpc resize ResizeTerminal -d "{\"sandbox_id\": \"$id\", \"operation_id\": \"op-tty\", \"size\": {\"rows\": 40, \"cols\": 120}}"
want resize 200

# Files: a tar in, the same out.
mkdir -p "$out/tree/d"
printf 'hello over http\n' > "$out/tree/d/hello.txt"
tar -C "$out/tree" -cf "$out/in.tar" d
call upload PUT "/v1/sandboxes/{sandbox_id}/archive" \
    "/v1/sandboxes/$id/archive?path=/workspace" --data-binary @"$out/in.tar" \
    -H 'Content-Type: application/x-tar'
want upload 200
[ "$(field upload .status)" = OPERATION_STATUS_FINISHED ]
call download GET "/v1/sandboxes/{sandbox_id}/archive" \
    "/v1/sandboxes/$id/archive?path=/workspace/d"
want download 200
[ "$(cat "$out/download.type")" = application/x-tar ]
[ "$(tar -xOf "$out/download.body" d/hello.txt)" = "hello over http" ]
call download-missing GET "/v1/sandboxes/{sandbox_id}/archive" \
    "/v1/sandboxes/$id/archive?path=/workspace/nothing"
want download-missing 404
call check POST "/v1/sandboxes/{sandbox_id}/run" "/v1/sandboxes/$id/run" \
    -d '{"spec": {"shell": {"command": "cat /workspace/in.txt /workspace/d/hello.txt"}}}'
want check 200
[ "$(jq -rs 'map(.event.output.data // empty) | add' "$out/check.body" | base64 -d)" = "fed by curlhello over http" ]

# What it uses; its egress; reset; a fork; ports.
call stats GET "/v1/sandboxes/{sandbox_id}/stats" "/v1/sandboxes/$id/stats"
want stats 200
rpc egress SetSandboxEgress -d "{\"id\": \"$id\", \"rules\": [\"example.invalid\"]}"
want egress 403
[ "$(field egress .error.flag)" = --allow-egress ]
rpc reset ResetSandbox -d "{\"id\": \"$id\"}"
want reset 200
rpc fork ForkSandbox -d "{\"id\": \"$id\", \"count\": 1}"
want fork 200
child=$(field fork '.children[0].id')
rpc checkpoint CheckpointSandbox -d "{\"id\": \"$id\"}"
want checkpoint 400
[ "$(field checkpoint .error.reason)" = not_applicable ]
rpc restore RestoreSandbox -d "{\"id\": \"$id\"}"
want restore 200
rpc expose ExposePort -d "{\"sandbox_id\": \"$id\", \"port\": 8000, \"access\": \"PORT_ACCESS_SIGNED\"}"
want expose 200
has expose '"token"'
rpc exposures ListExposures -d "{\"sandbox_id\": \"$id\"}"
want exposures 200
rpc revoke RevokeAccess -d "{\"sandbox_id\": \"$id\", \"port\": 8000}"
want revoke 200

# An image built as a template from a context sent as NDJSON, the
# sandbox saved as another; both listed and removed.
mkdir -p "$out/ctx"
printf 'FROM corral-debian:latest\nENV MADE_BY=curl\n' > "$out/ctx/Dockerfile"
tar -C "$out/ctx" -cf "$out/ctx.tar" Dockerfile
{
    echo '{"dockerfile": "Dockerfile", "template": "from-curl"}'
    printf '{"data": "%s"}\n' "$(base64 -w0 "$out/ctx.tar")"
    echo '{"eof": true}'
} > "$out/build.ndjson"
rpc build BuildImage -H 'Content-Type: application/x-ndjson' --data-binary @"$out/build.ndjson"
want build 200
has build '"done"'
[ "$(jq -s 'last.done.template.name' "$out/build.body")" = '"from-curl"' ]
rpc snapshot SnapshotSandbox -d "{\"id\": \"$id\", \"template\": \"snap-from-curl\"}"
want snapshot 200
rpc templates ListTemplates -d '{}'
want templates 200
has templates from-curl
has templates snap-from-curl
rpc untemplate DeleteTemplate -d '{"name": "from-curl"}'
want untemplate 200
[ "$(field untemplate .existed)" = true ]
rpc untemplate-snap DeleteTemplate -d '{"name": "snap-from-curl"}'
want untemplate-snap 200

# A volume.
rpc volume CreateVolume -d '{"name": "curl-vol", "size_bytes": 16777216}'
want volume 200
rpc volumes ListVolumes -d '{}'
want volumes 200
has volumes curl-vol
rpc unvolume DeleteVolume -d '{"name": "curl-vol"}'
want unvolume 200

# The generic path of a resource call answers the same.
rpc get-generic GetSandbox -d "{\"id\": \"$id\"}"
want get-generic 200
[ "$(field get-generic .id)" = "$id" ]
rpc info-generic GetWorkerInfo -d '{}'
want info-generic 200
rpc ops-generic ListOperations -d "{\"sandbox_id\": \"$id\"}"
want ops-generic 200
rpc op-generic GetOperation -d "{\"sandbox_id\": \"$id\", \"operation_id\": \"op-run\"}"
want op-generic 200
# The generic paths are the gRPC calls as they are: ids are the client's.
rpc submit-generic SubmitOperation -d "{\"sandbox_id\": \"$id\", \"operation_id\": \"op-g1\", \"spec\": {\"shell\": {\"command\": \"true\"}}}"
want submit-generic 200
rpc run-generic RunOperation -d "{\"sandbox_id\": \"$id\", \"operation_id\": \"op-g2\", \"spec\": {\"shell\": {\"command\": \"true\"}}}"
want run-generic 200
rpc watch-generic WatchSandbox -d "{\"sandbox_id\": \"$id\", \"operation_id\": \"op-run\"}" --max-time 3 || true
want watch-generic 200
rpc cancel-generic CancelOperation -d "{\"sandbox_id\": \"$id\", \"operation_id\": \"op-tty\"}"
want cancel-generic 200
rpc signal-generic SignalOperation -d "{\"sandbox_id\": \"$id\", \"operation_id\": \"op-tty\", \"signal\": 9}"
want signal-generic 200
rpc stats-generic GetSandboxStats -d "{\"sandbox_id\": \"$id\"}"
want stats-generic 200
rpc input-generic WriteInput -d "{\"sandbox_id\": \"$id\", \"operation_id\": \"op-cat\", \"offset\": 11, \"eof\": true}"
want input-generic 200
rpc list-generic ListSandboxes -d '{}'
want list-generic 200
rpc download-generic Download -d "{\"sandbox_id\": \"$id\", \"operation_id\": \"op-down\", \"archive\": {\"path\": \"/workspace/d\"}}"
want download-generic 200
has download-generic '"data"'
printf '{"sandbox_id": "%s", "operation_id": "op-up", "path": "/workspace"}\n{"data": "%s"}\n{"eof": true}\n' \
    "$id" "$(base64 -w0 "$out/in.tar")" > "$out/upload.ndjson"
rpc upload-generic Upload -H 'Content-Type: application/x-ndjson' --data-binary @"$out/upload.ndjson"
want upload-generic 200
rpc create-generic CreateSandbox -d '{"spec": {}}'
want create-generic 200
other=$(field create-generic .id)
rpc destroy-generic DestroySandbox -d "{\"id\": \"$other\"}"
want destroy-generic 200

# Gone: the fork's child, the sandbox; the worker drained and back.
call destroy-child DELETE "/v1/sandboxes/{id}" "/v1/sandboxes/$child"
want destroy-child 200
call destroy DELETE "/v1/sandboxes/{id}" "/v1/sandboxes/$id"
want destroy 200
[ "$(field destroy .existed)" = true ]
rpc drain Drain -d '{"drain": true}'
want drain 200
[ -n "$(field drain '.draining // empty')" ]
rpc undrain Drain -d '{"drain": false}'
want undrain 200
echo "$n calls made"
