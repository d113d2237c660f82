#!/usr/bin/env bash
# Container entrypoint (PID 1 is tini, which runs this script; see the Dockerfiles).
#
#   IMAGE                      -> mossrt serve
#   IMAGE --port 9000 ...      -> mossrt serve --port 9000 ...   (arguments that start with "-")
#   IMAGE export|synth|demo|.. -> mossrt export|synth|demo|...   (any mossrt subcommand)
#   IMAGE bash | sh | python | /abs/path ...  -> run that instead (debugging)
#
# First start: when MOSSRT_EXPORT_MODEL is set and $MOSSRT_BUNDLE/manifest.json does not exist, the
# bundle is exported first (hub ids or paths mounted into the container):
#   mossrt export --model "$MOSSRT_EXPORT_MODEL" --codec "$MOSSRT_EXPORT_CODEC" \
#                 --out "$MOSSRT_BUNDLE" --dtype "${MOSSRT_EXPORT_DTYPE:-fp32}" \
#                 --compute-dtype "${MOSSRT_EXPORT_COMPUTE_DTYPE:-fp32}"      (the CUDA image sets both to bf16)
# The manifest is written last, so an interrupted export is simply redone at the next start.
#
# Then `exec mossrt ...`: the server replaces this shell, so tini's SIGTERM (docker stop, Kubernetes)
# reaches it directly and it drains (/ready turns 503, in-flight streams finish) before exiting.
set -euo pipefail

say() { printf '[entrypoint] %s\n' "$*" >&2; }
die() { printf '[entrypoint] ERROR: %s\n' "$*" >&2; exit 64; }

venv=${MOSSRT_VENV:-/opt/venv}
export PATH="$venv/bin:$PATH"

# `-e MOSSRT_BUNDLE=` (empty) means "no bundle": the server then serves its built-in demo bundle.
if [[ -z ${MOSSRT_BUNDLE:-} ]]; then
    unset MOSSRT_BUNDLE
fi

if (($# == 0)); then
    set -- serve
elif [[ $1 == -* ]]; then
    set -- serve "$@"
fi

case "$1" in
    bash | sh | python | python3 | /*) exec "$@" ;;
esac

has_manifest() { [[ -f "$MOSSRT_BUNDLE/manifest.json" ]]; }

export_bundle() {
    [[ -n ${MOSSRT_EXPORT_CODEC:-} ]] \
        || die "MOSSRT_EXPORT_MODEL is set but MOSSRT_EXPORT_CODEC is not (the codec checkpoint: hub id or path)"
    mkdir -p "$MOSSRT_BUNDLE" 2>/dev/null || true
    [[ -w $MOSSRT_BUNDLE ]] \
        || die "$MOSSRT_BUNDLE is not writable by uid $(id -u); for a bind mount: chown -R $(id -u):$(id -g) on the host, or docker run --user"
    # several replicas sharing one volume: one exports, the others wait for it and then find the manifest
    if command -v flock >/dev/null; then
        exec 9>"$MOSSRT_BUNDLE/.export.lock"
        if ! flock -n 9; then
            say "another container is exporting into $MOSSRT_BUNDLE; waiting for it"
            flock 9
        fi
    fi
    if ! has_manifest; then
        say "no bundle in $MOSSRT_BUNDLE: exporting $MOSSRT_EXPORT_MODEL + $MOSSRT_EXPORT_CODEC" \
            "(dtype ${MOSSRT_EXPORT_DTYPE:-fp32}, compute ${MOSSRT_EXPORT_COMPUTE_DTYPE:-fp32}); the real model takes minutes"
        mossrt export --model "$MOSSRT_EXPORT_MODEL" --codec "$MOSSRT_EXPORT_CODEC" \
            --out "$MOSSRT_BUNDLE" --dtype "${MOSSRT_EXPORT_DTYPE:-fp32}" \
            --compute-dtype "${MOSSRT_EXPORT_COMPUTE_DTYPE:-fp32}" \
            || die "mossrt export failed (exit $?); nothing is served"
        say "bundle written to $MOSSRT_BUNDLE"
    fi
    exec 9>&-  # the server must not inherit the lock
}

wants_help() {
    local a
    for a in "$@"; do [[ $a == -h || $a == --help ]] && return 0; done
    return 1
}

case "$1" in
    export) ;;  # an explicit export needs no bundle first
    *)
        if ! wants_help "$@" && [[ -n ${MOSSRT_BUNDLE:-} ]] && ! has_manifest; then
            if [[ -n ${MOSSRT_EXPORT_MODEL:-} ]]; then
                export_bundle
            elif [[ $1 == serve && " $* " != *" --bundle"* ]]; then
                die "no bundle in MOSSRT_BUNDLE=$MOSSRT_BUNDLE ($MOSSRT_BUNDLE/manifest.json is missing). Either
  - mount an exported bundle there (-v /host/bundle:$MOSSRT_BUNDLE:ro), or
  - export it at first start: -e MOSSRT_EXPORT_MODEL=<hub id or path> -e MOSSRT_EXPORT_CODEC=<hub id or path>, or
  - serve the built-in demo bundle (random weights, noise): -e MOSSRT_BUNDLE="
            fi
        fi
        ;;
esac

exec mossrt "$@"
