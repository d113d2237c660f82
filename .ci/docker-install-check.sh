#!/usr/bin/env bash
# CI check of the Docker install path without Docker: install the project with docker/install.sh (the
# script the images run) into a fresh temporary venv, then start the INSTALLED service once and check
# its lifecycle:
#   GET /health -> 200, then GET /ready -> 200 (demo bundle: MOSSRT_BUNDLE unset), then SIGTERM ->
#   the process exits with status 0 within STOP_TIMEOUT seconds (graceful drain).
# Run from the repository root:  bash .ci/docker-install-check.sh
#
# Environment knobs: HEALTH_TIMEOUT (180), READY_TIMEOUT (180), STOP_TIMEOUT (30) seconds;
# MOSSRT_SERVE_CMD: a command line run instead of `$VENV/bin/mossrt serve --host 127.0.0.1 --port $PORT`
# (for dry runs against a stand-in; it can use $VENV and $PORT).
set -euo pipefail
cd "$(dirname "$0")/.."

HEALTH_TIMEOUT=${HEALTH_TIMEOUT:-180}
READY_TIMEOUT=${READY_TIMEOUT:-180}
STOP_TIMEOUT=${STOP_TIMEOUT:-30}
serve_cmd=${MOSSRT_SERVE_CMD:-}

say() { printf '[docker-install-check] %s\n' "$*" >&2; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/mossrt-docker-check.XXXXXX")
log=$tmp/server.log
server_pid=

server_alive() { [[ -n $server_pid ]] && kill -0 "$server_pid" 2>/dev/null; }

print_log() {
    if [[ -s $log ]]; then
        say "server log ($log):"
        sed 's/^/  | /' "$log" >&2
    else
        say "the server wrote no log"
    fi
}

fail() {
    say "FAIL: $*"
    print_log
    exit 1
}

cleanup() {
    local rc=$?
    if server_alive; then
        say "stopping the server (pid $server_pid)"
        pkill -TERM -P "$server_pid" 2>/dev/null || true
        kill -TERM "$server_pid" 2>/dev/null || true
        for _ in $(seq 50); do server_alive || break; sleep 0.1; done
        if server_alive; then
            pkill -KILL -P "$server_pid" 2>/dev/null || true
            kill -KILL "$server_pid" 2>/dev/null || true
        fi
        wait "$server_pid" 2>/dev/null || true
    fi
    rm -rf "$tmp"
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# GET URL -> prints "STATUS BODY" ("000 <error>" when nothing answers). No proxies: CI may set http_proxy.
http_get() {
    python3 - "$1" <<'EOF'
import sys, urllib.error, urllib.request
opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
try:
    with opener.open(sys.argv[1], timeout=5) as r:
        status, body = r.status, r.read(400)
except urllib.error.HTTPError as e:
    status, body = e.code, e.read(400)
except Exception as e:
    status, body = "000", f"{type(e).__name__}: {e}".encode()
print(status, body.decode("utf-8", "replace").replace("\n", " "))
EOF
}

wait_for() {  # PATH TIMEOUT: poll until GET PATH answers 200
    local path=$1 timeout=$2 out
    local deadline=$((SECONDS + timeout))
    while :; do
        out=$(http_get "http://127.0.0.1:$PORT$path")
        if [[ ${out%% *} == 200 ]]; then
            say "GET $path -> $out ($((SECONDS - started)) s after start)"
            return 0
        fi
        if ! server_alive; then
            local rc=0
            wait "$server_pid" || rc=$?
            server_pid=
            fail "the server exited (status $rc) before GET $path answered 200 (last answer: $out)"
        fi
        ((SECONDS < deadline)) || fail "GET $path did not answer 200 within $timeout s (last answer: $out)"
        sleep 1
    done
}

# ------------------------------------------------------------------------------------------- install
VENV=$tmp/venv
say "docker/install.sh $VENV $PWD cpu"
t0=$SECONDS
bash docker/install.sh "$VENV" "$PWD" cpu
say "docker/install.sh took $((SECONDS - t0)) s"

# ------------------------------------------------------------------------------------------- serve
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
# a clean environment for the server: no MOSSRT_* from the caller (MOSSRT_BUNDLE unset -> demo bundle),
# and nothing written to the home directory
while IFS= read -r name; do unset "$name"; done < <(compgen -e | grep '^MOSSRT_' || true)
export MOSSRT_DEMO_DIR=$tmp/demo-bundle MOSSRT_VOICES_DIR=$tmp/voices HF_HOME=$tmp/hf
export VENV PORT

cd "$tmp"  # not the source tree: the server must run from the venv
started=$SECONDS
if [[ -n $serve_cmd ]]; then
    say "starting (MOSSRT_SERVE_CMD): $serve_cmd"
    (eval "exec $serve_cmd") >"$log" 2>&1 &
else
    say "starting: $VENV/bin/mossrt serve --host 127.0.0.1 --port $PORT"
    "$VENV/bin/mossrt" serve --host 127.0.0.1 --port "$PORT" >"$log" 2>&1 &
fi
server_pid=$!

wait_for /health "$HEALTH_TIMEOUT"
wait_for /ready "$READY_TIMEOUT"

# ------------------------------------------------------------------------------------------- SIGTERM
say "sending SIGTERM to pid $server_pid"
kill -TERM "$server_pid"
stop_deadline=$((SECONDS + STOP_TIMEOUT))
stopping=$SECONDS
while server_alive; do
    ((SECONDS < stop_deadline)) || fail "the server still runs $STOP_TIMEOUT s after SIGTERM"
    sleep 0.2
done
rc=0
wait "$server_pid" || rc=$?
server_pid=
((rc == 0)) || fail "the server exited with status $rc after SIGTERM (expected 0)"
say "the server exited with status 0, $((SECONDS - stopping)) s after SIGTERM"
say "last lines of the server log:"
tail -n 15 "$log" | sed 's/^/  | /' >&2
say "PASS: installed with docker/install.sh; /health 200, /ready 200, graceful exit on SIGTERM"
