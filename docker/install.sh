#!/usr/bin/env bash
# Installs mossrt into a virtual environment. The ONE install path shared by the Docker images
# (docker/Dockerfile.cpu, docker/Dockerfile.cuda) and CI (.ci/docker-install-check.sh).
#
#   docker/install.sh VENV_DIR SRC_DIR [cpu|cuda]        (default: cpu)
#
# - creates VENV_DIR with `python3 -m venv` when it holds no venv yet (PYTHON=... picks another interpreter);
# - upgrades pip; installs SRC_DIR non-editable with the extras <flavour>,hub and no pip cache;
# - the build runs on a scratch copy of SRC_DIR, so SRC_DIR is left untouched (no build/, no
#   *.egg-info: setuptools never cleans build/lib, a stale module there would end up in later wheels);
# - ends with a smoke check: VENV/bin/mossrt --help and `import onnxruntime, engine, app` from the venv.
#
# cuda flavour (onnxruntime-gpu). By default the CUDA/cuDNN runtime libraries come from PyPI as
# onnxruntime-gpu's own extras (onnxruntime-gpu[cuda,cudnn] -> nvidia-* wheels), resolved together
# with onnxruntime-gpu so their major versions always match the build of onnxruntime-gpu:
#   MOSSRT_CUDA_MAJOR=13 (default)  the `cuda` extra's onnxruntime-gpu (1.31.1, the version whose kernel
#                                   table engine/runtime/data holds for the placement check), CUDA 13 + cuDNN 9
#                                   (host driver >= 580)
#   MOSSRT_CUDA_MAJOR=12            onnxruntime-gpu <1.27, CUDA 12 + cuDNN 9 (host driver >= 525): for older
#                                   drivers; the placement check still reads 1.31.1's table (not verified
#                                   against 1.26's kernels)
#   MOSSRT_CUDA_LIBS=system         no nvidia-* wheels: CUDA/cuDNN come from the system (e.g. an
#                                   nvidia/cuda:*-cudnn-runtime base image); onnxruntime-gpu unconstrained
# onnxruntime does not search the nvidia-* wheels by itself: their lib/ folders must be known to the
# dynamic loader (docker/Dockerfile.cuda registers them with ldconfig; for other uses this script
# prints the LD_LIBRARY_PATH line).
set -euo pipefail

prog=install.sh
say() { printf '[%s] %s\n' "$prog" "$*" >&2; }
die() { printf '[%s] ERROR: %s\n' "$prog" "$*" >&2; exit 1; }
usage() {
    echo "usage: docker/install.sh VENV_DIR SRC_DIR [cpu|cuda]   (default: cpu)" >&2
    exit 2
}

[[ $# -ge 2 && $# -le 3 ]] || usage
venv_arg=$1
src_arg=$2
flavour=${3:-cpu}
case "$flavour" in
    cpu | cuda) ;;
    *) die "flavour must be cpu or cuda, got '$flavour'" ;;
esac
[[ -f "$src_arg/pyproject.toml" ]] || die "$src_arg: no pyproject.toml (SRC_DIR must be the mossrt source tree)"
grep -q '^name = "mossrt"' "$src_arg/pyproject.toml" || die "$src_arg/pyproject.toml is not the mossrt project"

src=$(cd "$src_arg" && pwd -P)
mkdir -p "$(dirname "$venv_arg")"
venv=$(cd "$(dirname "$venv_arg")" && pwd -P)/$(basename "$venv_arg")
python=${PYTHON:-python3}

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 PIP_NO_CACHE_DIR=1
pip=("$venv/bin/python" -m pip)
start=$SECONDS

scratch=$(mktemp -d "${TMPDIR:-/tmp}/mossrt-install.XXXXXX")
cleanup() { rm -rf "$scratch"; }
trap cleanup EXIT

# ------------------------------------------------------------------------------------------- the venv
if [[ -x "$venv/bin/python" ]]; then
    say "using the existing virtual environment $venv"
else
    command -v "$python" >/dev/null || die "$python not found (set PYTHON=/path/to/python3.11+)"
    "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "$python is $("$python" -V 2>&1); mossrt needs Python >= 3.11 (set PYTHON=...)"
    say "creating the virtual environment $venv with $("$python" -V 2>&1)"
    "$python" -m venv "$venv" \
        || die "'$python -m venv' failed (on Debian/Ubuntu install the python3-venv package)"
fi
"$venv/bin/python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || die "$venv runs $("$venv/bin/python" -V 2>&1); mossrt needs Python >= 3.11"

say "upgrading pip"
"${pip[@]}" install --quiet --upgrade pip

# ------------------------------------------------------------------------------------------- requirements
extras="$flavour,hub"
reqs=("$scratch/src[$extras]")
if [[ $flavour == cuda ]]; then
    case "${MOSSRT_CUDA_LIBS:-pip}" in
        pip)
            case "${MOSSRT_CUDA_MAJOR:-13}" in
                # the cuda extra pins 1.31.1 (a CUDA 13 build): CUDA 12 takes an older one instead of the extra
                12) reqs=("$scratch/src[hub]" "onnxruntime-gpu[cuda,cudnn]>=1.19,<1.27") ;;
                13) reqs+=("onnxruntime-gpu[cuda,cudnn]") ;;
                *) die "MOSSRT_CUDA_MAJOR must be 12 or 13, got '$MOSSRT_CUDA_MAJOR'" ;;
            esac ;;
        system) ;;
        *) die "MOSSRT_CUDA_LIBS must be pip or system, got '$MOSSRT_CUDA_LIBS'" ;;
    esac
fi

# onnxruntime and onnxruntime-gpu both install the module `onnxruntime`: never leave both in one venv.
# When the other one is there, remove both, so that the install below puts back a whole module.
installed() { "${pip[@]}" show --quiet "$1" >/dev/null 2>&1; }
other=$([[ $flavour == cpu ]] && echo onnxruntime-gpu || echo onnxruntime)
if installed "$other"; then
    say "removing $other (and any onnxruntime package over it): the $flavour flavour uses the other one"
    "${pip[@]}" uninstall --quiet --yes onnxruntime onnxruntime-gpu
fi
# an installed mossrt of the same version would count as "already satisfied": replace it
if installed mossrt; then
    say "replacing the installed mossrt"
    "${pip[@]}" uninstall --quiet --yes mossrt
fi

# ------------------------------------------------------------------------------------------- install
say "copying $src to a scratch build tree"
mkdir -p "$scratch/src"
# ("./x": only at the top of the tree; bare names: at any depth)
tar -C "$src" \
    --exclude=./.venv --exclude=./venv --exclude=./build --exclude=./dist --exclude=./bundles --exclude=./.whl \
    --exclude=.git --exclude='*.egg-info' --exclude=__pycache__ --exclude=.pytest_cache --exclude=node_modules \
    --exclude='*.onnx' --exclude='*.onnx.data' \
    -cf - . | tar -C "$scratch/src" -xf -

say "installing mossrt[$extras] (non-editable) into $venv; this takes a few minutes"
"${pip[@]}" install --progress-bar off "${reqs[@]}"

# ------------------------------------------------------------------------------------------- smoke check
say "smoke check"
nvidia_dirs=
if [[ $flavour == cuda ]]; then
    nvidia_dirs=$(find "$venv"/lib/python3*/site-packages/nvidia -mindepth 2 -maxdepth 2 -type d -name lib \
        2>/dev/null | sort | paste -sd: -)
fi
(
    cd "$scratch"  # not SRC_DIR: the imports must come from the venv, not from a source tree in the cwd
    "$venv/bin/mossrt" --help >/dev/null || die "'$venv/bin/mossrt --help' failed"
    LD_LIBRARY_PATH="${nvidia_dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$venv/bin/python" -I -c '
import sys
import onnxruntime, engine, app, mossrt
for mod in (engine, app, mossrt):
    if not mod.__file__.startswith(sys.prefix):
        sys.exit(f"{mod.__name__} imported from {mod.__file__}, not from the venv {sys.prefix}")
print(f"[install.sh] onnxruntime {onnxruntime.__version__}, providers: {onnxruntime.get_available_providers()}",
      file=sys.stderr)
' || die "the installed package does not import"
)

if [[ $flavour == cuda ]]; then
    if ! "$venv/bin/python" -I -c 'import onnxruntime, sys; sys.exit("CUDAExecutionProvider" not in onnxruntime.get_available_providers())'; then
        die "onnxruntime in $venv has no CUDAExecutionProvider (is the CPU onnxruntime installed as well?)"
    fi
    # every library the CUDA provider links must resolve, except the driver's libcuda.so.1, which the
    # NVIDIA container toolkit mounts from the host at run time
    provider=$(find "$venv"/lib/python3*/site-packages/onnxruntime/capi -name 'libonnxruntime_providers_cuda.so' -print -quit)
    if [[ -n $provider ]] && command -v ldd >/dev/null; then
        missing=$(LD_LIBRARY_PATH="${nvidia_dirs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" ldd "$provider" \
            | awk '/not found/ {print $1}' | grep -v '^libcuda\.so' || true)
        if [[ -n $missing ]]; then
            die "the CUDA provider links libraries that are not installed: $(echo "$missing" | paste -sd' ' -)" \
                "(MOSSRT_CUDA_LIBS=${MOSSRT_CUDA_LIBS:-pip})"
        fi
        say "every CUDA library the provider needs resolves (the driver's libcuda.so.1 comes from the host)"
    fi
    if [[ -n $nvidia_dirs ]]; then
        say "to use the GPU from this venv (the CUDA image registers these with ldconfig instead): export LD_LIBRARY_PATH=$nvidia_dirs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
    fi
fi

say "done in $((SECONDS - start)) s: $venv/bin/mossrt ($flavour flavour)"
