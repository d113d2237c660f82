#!/usr/bin/env bash
# Installs the moss-tts-realtime LocalAI backend: a venv in ./venv holding mossrt and the onnxruntime
# build for this machine, chosen from BUILD_TYPE as LocalAI's installRequirements does:
#
#   BUILD_TYPE unset / cpu                      requirements-cpu.txt       (onnxruntime)
#   BUILD_TYPE=cublas CUDA_MAJOR_VERSION=12     requirements-cublas12.txt  (onnxruntime-gpu, CUDA 12)
#   BUILD_TYPE=cublas CUDA_MAJOR_VERSION=13     requirements-cublas13.txt  (onnxruntime-gpu, CUDA 13)
#   BUILD_TYPE=cublas12 / cublas13              the same, named directly
#
# Order (as LocalAI): requirements-install.txt (if any), requirements.txt, requirements-<profile>.txt,
# then mossrt itself from MOSSRT_SOURCE:
#   MOSSRT_SOURCE    a pip requirement: a source tree path (default: this repository, two folders up, when
#                    this folder sits in a mossrt checkout), a wheel file, or "mossrt" / "mossrt==X.Y"
#                    from an index
#   MOSSRT_INDEX_URL an extra package index to find mossrt on (pip --extra-index-url)
# Other knobs: PYTHON (interpreter for the venv, >= 3.11; default python3), USE_PIP=true (pip even when
# uv is installed), ENV_DIR (put the venv elsewhere than this folder; run.sh then needs
# MOSSRT_LOCALAI_VENV=$ENV_DIR/venv).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)
say() { printf '[moss-tts-realtime install] %s\n' "$*" >&2; }
die() { printf '[moss-tts-realtime install] ERROR: %s\n' "$*" >&2; exit 1; }

# ------------------------------------------------------------------------------------ build profile
build_type=${BUILD_TYPE:-}
case "$build_type" in
    "" | cpu) profile=cpu ;;
    cublas | l4t) profile=cublas${CUDA_MAJOR_VERSION:-12} ;;
    *) profile=$build_type ;;
esac
[[ -f "$here/requirements-$profile.txt" ]] \
    || die "no requirements-$profile.txt: BUILD_TYPE=$build_type is not supported (cpu, cublas with CUDA_MAJOR_VERSION 12 or 13)"

# ------------------------------------------------------------------------------------ mossrt source
repo=$(cd "$here/../.." && pwd -P)
if [[ -n "${MOSSRT_SOURCE:-}" ]]; then
    source_spec=$MOSSRT_SOURCE
elif [[ -f "$repo/pyproject.toml" ]] && grep -q '^name = "mossrt"' "$repo/pyproject.toml"; then
    source_spec=$repo
else
    source_spec=mossrt
fi

# ------------------------------------------------------------------------------------ venv
edir=${ENV_DIR:-$here}
venv=$edir/venv
python=${PYTHON:-python3}
use_uv=false
if [[ "${USE_PIP:-false}" != true ]] && command -v uv >/dev/null 2>&1; then
    use_uv=true
fi
if [[ ! -x "$venv/bin/python" ]]; then
    command -v "$python" >/dev/null || die "$python not found (set PYTHON=/path/to/python3.11+)"
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "$python is $("$python" -V 2>&1); mossrt needs Python >= 3.11 (set PYTHON=...)"
    say "creating $venv"
    if $use_uv; then
        uv venv --python "$python" "$venv"
    else
        "$python" -m venv "$venv" || die "'$python -m venv' failed (Debian/Ubuntu: install python3-venv)"
    fi
fi
if $use_uv; then
    pip=(uv pip install --python "$venv/bin/python")
else
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    pip=("$venv/bin/python" -m pip install --progress-bar off)
fi
index=()
if [[ -n "${MOSSRT_INDEX_URL:-}" ]]; then
    index=(--extra-index-url "$MOSSRT_INDEX_URL")
fi

# ------------------------------------------------------------------------------------ install
# onnxruntime and onnxruntime-gpu both install the module `onnxruntime`: never leave both in one venv
other=$([[ $profile == cpu ]] && echo onnxruntime-gpu || echo onnxruntime)
if "$venv/bin/python" -c "import importlib.metadata as m, sys; m.version(sys.argv[1])" "$other" 2>/dev/null; then
    say "removing $other (and onnxruntime over it): the $profile profile uses the other build"
    if $use_uv; then
        uv pip uninstall --python "$venv/bin/python" onnxruntime onnxruntime-gpu
    else
        "$venv/bin/python" -m pip uninstall --quiet --yes onnxruntime onnxruntime-gpu
    fi
fi
reqs=()
for f in requirements-install.txt requirements.txt "requirements-$profile.txt"; do
    [[ -f "$here/$f" ]] && reqs+=(-r "$here/$f")
done
say "installing ${reqs[*]} and mossrt[hub] from $source_spec (profile $profile)"
if [[ -d "$source_spec" ]]; then
    # build from a scratch copy: the source tree gets no build/ or *.egg-info (setuptools never cleans
    # build/lib, so a stale module there would end up in later installs)
    scratch=$(mktemp -d "${TMPDIR:-/tmp}/moss-tts-realtime-install.XXXXXX")
    trap 'rm -rf "$scratch"' EXIT
    tar -C "$source_spec" --exclude=./.venv --exclude=./venv --exclude=./build --exclude=./dist \
        --exclude=./localai/moss-tts-realtime/venv --exclude=.git --exclude='*.egg-info' --exclude=__pycache__ \
        --exclude=.pytest_cache --exclude='*.onnx' --exclude='*.onnx.data' -cf - . | tar -C "$scratch" -xf -
    target="$scratch[hub]"
else
    target=$source_spec
fi
"${pip[@]}" "${index[@]}" "${reqs[@]}" "$target"
for f in "$here"/requirements-*after.txt; do
    [[ -f "$f" ]] && "${pip[@]}" "${index[@]}" -r "$f"
done

# ------------------------------------------------------------------------------------ smoke check
"$venv/bin/mossrt" localai --help >/dev/null || die "'$venv/bin/mossrt localai --help' failed"
"$venv/bin/python" -I -c 'import app.localai, onnxruntime, sys; print("[moss-tts-realtime install] onnxruntime",
    onnxruntime.__version__, "providers:", onnxruntime.get_available_providers(), file=sys.stderr)' \
    || die "the installed backend does not import"
say "done: $here/run.sh --addr HOST:PORT"
