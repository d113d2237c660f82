#!/usr/bin/env bash
# LocalAI entrypoint of the moss-tts-realtime backend. LocalAI runs it with "--addr HOST:PORT" appended;
# every argument is passed on to `mossrt localai`.
#
# Uses ./venv (made by install.sh) when it exists, else the `mossrt` found on PATH.
# MOSSRT_LOCALAI_FLAGS adds flags, e.g. MOSSRT_LOCALAI_FLAGS="--bundle /models/moss-bundle --max-streams 8".
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
venv=${MOSSRT_LOCALAI_VENV:-$here/venv}

if [[ -x "$venv/bin/mossrt" ]]; then
    # what `source venv/bin/activate` does, computed from where the venv is now (it may have been moved)
    export VIRTUAL_ENV="$venv"
    export PATH="$venv/bin:$PATH"
    unset PYTHONHOME
    # onnxruntime-gpu does not search the nvidia-* wheels (CUDA/cuDNN) by itself: show them to the loader
    nvidia_libs=$(find "$venv"/lib/python3*/site-packages/nvidia -mindepth 2 -maxdepth 2 -type d -name lib \
        2>/dev/null | sort | paste -sd: - || true)
    if [[ -n "$nvidia_libs" ]]; then
        export LD_LIBRARY_PATH="$nvidia_libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
fi

if ! command -v mossrt >/dev/null 2>&1; then
    echo "moss-tts-realtime: 'mossrt' not found: run $here/install.sh (or pip install mossrt)" >&2
    exit 1
fi

# shellcheck disable=SC2086  # MOSSRT_LOCALAI_FLAGS is a list of flags: split on spaces on purpose
exec mossrt localai ${MOSSRT_LOCALAI_FLAGS:-} "$@"
