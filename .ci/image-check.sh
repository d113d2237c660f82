#!/usr/bin/env bash
# CI check of the container images, built and run for real with podman (no Docker daemon needed):
#   1. a stand-in for python:3.11-slim-bookworm (registries are out of reach): a debootstrap minbase
#      bookworm root filesystem from this machine's Debian mirror, `podman import`ed, plus Debian's
#      python3.11 and python3.11-venv (.ci/python-base.Containerfile); cached by its recipe;
#   2. docker/Dockerfile.cpu and docker/Dockerfile.cuda built with --build-arg PYTHON_IMAGE=<stand-in>;
#      pip inside the build reaches the package index the way this machine's pip does: its configuration
#      and CA bundle go in as build secrets (never into the image: checked), over the host network;
#   3. both images inspected: no compiler, no torch, no test files, no pip cache, no build secrets; the
#      CUDA image has onnxruntime-gpu with CUDAExecutionProvider (not run on a GPU);
#   4. the CPU image run as a user would (-p a loopback port, a named volume on /data, no model -> the
#      demo bundle): /health and /ready 200, the HEALTHCHECK passes, POST /v1/audio/speech returns audio
#      that decodes, every process runs as uid 10001, /data is writable by it, and `podman stop` while a
#      stream is in flight drains it and the container exits 0 within the drain timeout (+ a pre-stop
#      window); without a bundle or a model the entrypoint refuses with its message.
# Fails loudly, with the reason, wherever podman cannot build or run: it never passes without having
# built and run the image. Needs root (apt-get installs podman, debootstrap and runc when missing).
#
#   bash .ci/image-check.sh                         (from anywhere; CI: after the other checks)
# Knobs: HOST_PYTHON (.venv/bin/python: soundfile and PyAV decode the audio on the host),
# READY_TIMEOUT (180), DRAIN_TIMEOUT (60, the server's default), SHUTDOWN_DELAY (2), PRESTOP_ALLOWANCE (30:
# the stop may take DRAIN_TIMEOUT + PRESTOP_ALLOWANCE) seconds, IMAGE_CHECK_CUDA (1; 0 skips
# the CUDA image, for local runs only).
set -euo pipefail
cd "$(dirname "$0")/.."

READY_TIMEOUT=${READY_TIMEOUT:-180}
DRAIN_TIMEOUT=${DRAIN_TIMEOUT:-60}
PRESTOP_ALLOWANCE=${PRESTOP_ALLOWANCE:-30}
SHUTDOWN_DELAY=${SHUTDOWN_DELAY:-2}  # MOSSRT_SHUTDOWN_DELAY: /ready 503 before the drain (servers without it ignore it)
HOST_PYTHON=${HOST_PYTHON:-.venv/bin/python}
CHECK_CUDA=${IMAGE_CHECK_CUDA:-1}
UID_IN_IMAGE=10001
REPO=localhost/mossrt-ci
BASE_IMAGE=$REPO/python:3.11-bookworm
DEBIAN_IMAGE=$REPO/debian:bookworm

say() { printf '[image-check] %s\n' "$*" >&2; }
# CI shows the head and the tail of a long log: the reason is said again after the containers' logs
failure=""
fail() { failure="FAIL: $*"; say "$failure"; exit 1; }
# image_probe.py with its stderr passed on, and its reason kept for fail: `probe ARGS || fail "what: $(probe_reason)"`
probe() {
    local rc=0
    "$HOST_PYTHON" .ci/image_probe.py "$@" 2>"$tmp/probe.err" || rc=$?
    cat "$tmp/probe.err" >&2
    return "$rc"
}
probe_reason() { grep '^\[image_probe\] FAIL' "$tmp/probe.err" | tail -n 1 || true; }
# a command that stops the script under set -e names itself (no command here fails silently otherwise)
set -o errtrace
trap 'rc=$?; [[ -n $failure ]] || failure="FAIL: line $LINENO exited $rc: $BASH_COMMAND"' ERR

tmp=$(mktemp -d "${TMPDIR:-/tmp}/mossrt-image-check.XXXXXX")
run_id=mossrt-image-check-$$
containers=()
volumes=()
mounted=()
cleanup() {
    local rc=$?
    local c
    for c in "${containers[@]}"; do
        if ((rc != 0)); then
            say "log of container $c:"
            pm logs "$c" 2>&1 | tail -n 40 | sed 's/^/  | /' >&2 || true
        fi
        pm rm -f -t 0 "$c" >/dev/null 2>&1 || true
    done
    for c in "${mounted[@]}"; do pm image unmount "$c" >/dev/null 2>&1 || true; done
    for c in "${volumes[@]}"; do pm volume rm -f "$c" >/dev/null 2>&1 || true; done
    if ((rc != 0)) && [[ -f $tmp/failed-build.log ]]; then
        say "the failed build's last lines again:"
        tail -n 25 "$tmp/failed-build.log" | sed 's/^/  | /' >&2
    fi
    rm -rf "$tmp"
    if ((rc != 0)); then say "${failure:-FAIL: exit status $rc}"; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# ------------------------------------------------------------------------------------------- tools
check_start=$SECONDS
((EUID == 0)) || fail "needs root (apt-get, debootstrap, rootful podman); running as uid $EUID"
missing=()
for tool in podman debootstrap runc; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
    say "installing ${missing[*]} (Debian packages podman debootstrap runc)"
    apt-get update -q >"$tmp/apt.log" 2>&1 || { cat "$tmp/apt.log" >&2; fail "apt-get update failed"; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q podman debootstrap runc >>"$tmp/apt.log" 2>&1 \
        || { tail -n 30 "$tmp/apt.log" >&2; fail "apt-get install podman debootstrap runc failed"; }
fi
# runc and cgroupfs: the default crun fails on cgroups v1/"hybrid mode" and on raising rlimits without
# CAP_SYS_RESOURCE; events to a file: CI has no journald.
PODMAN=(podman --runtime runc --cgroup-manager cgroupfs --events-backend file)
pm() { "${PODMAN[@]}" "$@"; }
ULIMITS=(--ulimit nofile=4096:4096 --ulimit nproc=4096:4096)
pm info >"$tmp/podman-info.txt" 2>&1 || { cat "$tmp/podman-info.txt" >&2; fail "podman cannot run here (podman info failed; its output is above)"; }
say "$(podman --version), storage driver $(pm info --format '{{.Store.GraphDriverName}}')"
[[ -x $HOST_PYTHON ]] || fail "HOST_PYTHON=$HOST_PYTHON is not an interpreter (.ci/run creates .venv first)"
"$HOST_PYTHON" -c 'import av, soundfile, numpy' 2>/dev/null \
    || fail "$HOST_PYTHON lacks PyAV/soundfile/numpy (pip install -e '.[cpu,test]' into it)"

image_id() { pm image inspect --format '{{.Id}}' "$1" 2>/dev/null || true; }
# An image a rebuild moved its tag away from would stay behind as a dangling image: remove it.
drop_if_untagged() {
    local old=$1
    [[ -n $old ]] || return 0
    if [[ -z $(pm image inspect --format '{{join .RepoTags ","}}' "$old" 2>/dev/null) ]]; then
        pm rmi "$old" >/dev/null 2>&1 || true
    fi
}

# ------------------------------------------------------------------------------------------- stand-in base
# The mirror this machine's apt uses (deb822 .sources or one-line .list), never a hard-coded host.
debian_mirror() {
    local f
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [[ -f $f ]] || continue
        awk '$1 == "deb" && $0 ~ / bookworm / { for (i = 2; i <= NF; i++) if ($i ~ /^https?:/) { print $i; exit } }' "$f"
    done
    for f in /etc/apt/sources.list.d/*.sources; do
        [[ -f $f ]] || continue
        awk 'BEGIN { RS = ""; FS = "\n" }
             /(^|\n)Types:[^\n]*deb([ \n]|$)/ && /(^|\n)Suites:[^\n]*bookworm([ \n]|$)/ && /(^|\n)Components:[^\n]*main/ {
                 for (i = 1; i <= NF; i++) if ($i ~ /^URIs:/) { split($i, u, /[ \t]+/); print u[2]; exit } }' "$f"
    done
}
mirror=$(debian_mirror)
mirror=${mirror%%$'\n'*}  # the first (not `| head`: under pipefail a later awk's SIGPIPE would fail the script)
[[ -n $mirror ]] || fail "no Debian bookworm mirror in /etc/apt/sources.list or /etc/apt/sources.list.d/"
# debootstrap leaves its .deb files and package lists behind: ~125 MB the official image does not carry
debootstrap_cleanup() { rm -rf "$1"/var/cache/apt/archives/*.deb "$1"/var/lib/apt/lists/* "$1"/debootstrap; }
recipe=$( (echo "debootstrap --variant=minbase bookworm $mirror"; declare -f debootstrap_cleanup
           cat .ci/python-base.Containerfile) | sha256sum | cut -c1-16)
t0=$SECONDS
if [[ $(pm image inspect --format '{{index .Labels "mossrt.ci.recipe"}}' "$BASE_IMAGE" 2>/dev/null) == "$recipe" ]]; then
    say "stand-in base $BASE_IMAGE is up to date (recipe $recipe)"
else
    say "building the stand-in base: debootstrap --variant=minbase bookworm from $mirror"
    rootfs=$tmp/rootfs
    debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$tmp/debootstrap.log" 2>&1 \
        || { tail -n 30 "$tmp/debootstrap.log" >&2; fail "debootstrap failed"; }
    debootstrap_cleanup "$rootfs"
    old=$(image_id "$DEBIAN_IMAGE")
    tar -C "$rootfs" -c . | pm import --quiet --change 'CMD ["bash"]' - "$DEBIAN_IMAGE" >/dev/null
    rm -rf "$rootfs"
    drop_if_untagged "$old"
    old=$(image_id "$BASE_IMAGE")
    pm build --format docker --network host "${ULIMITS[@]}" --label "mossrt.ci.recipe=$recipe" \
        --build-arg DEBIAN_IMAGE="$DEBIAN_IMAGE" -f .ci/python-base.Containerfile -t "$BASE_IMAGE" .ci \
        >"$tmp/base-build.log" 2>&1 || { tail -n 30 "$tmp/base-build.log" >&2; fail "building $BASE_IMAGE failed"; }
    drop_if_untagged "$old"
    say "stand-in base built in $((SECONDS - t0)) s"
fi

# ------------------------------------------------------------------------------------------- build
# pip's configuration and CA bundle on this machine, as build secrets (see docker/build-secrets.sh)
secrets=(--secret "id=pip.conf,src=$tmp/pip.conf")
ca=$("$HOST_PYTHON" .ci/pip_build_config.py "$tmp/pip.conf")
[[ -n $ca ]] && secrets+=(--secret "id=ca-bundle,src=$ca")
say "pip in the build: $(tr '\n' ' ' <"$tmp/pip.conf")${ca:+; CA bundle $ca}"

declare -A build_seconds
# free space where podman keeps its layers (a CUDA build needs ~10 GB at its peak: 3.2 GB of venv in the
# builder, its copy in the final image, pip's downloads while it installs)
storage_free() {
    local root
    root=$(pm info --format '{{.Store.GraphRoot}}' 2>/dev/null) || root=/var/lib/containers
    df -h --output=avail "$root" 2>/dev/null | tail -n 1 | tr -d ' ' | sed "s|\$| free in $root|" || true
}
# the lines of a failed build that say why (pip's and buildah's errors, a full disk, a refused download)
build_reason() {
    grep -E -i 'error|no space|denied|timed? ?out|refused|could not|cannot|not found|failed' "$1" \
        | grep -v -i 'WARNING: Location' | tail -n 4 | cut -c1-300 | paste -sd'|' - || true
}
build() {  # FLAVOUR: the builder stage and the final image, both tagged (no dangling stage images)
    local flavour=$1 stage tag old log try t0=$SECONDS
    local -a target
    for stage in builder final; do
        tag=$REPO/mossrt:$flavour target=()
        if [[ $stage == builder ]]; then tag+=-builder target=(--target builder); fi
        old=$(image_id "$tag")
        log=$tmp/build-$flavour-$stage.log
        # a second try only after a first failure, its reason said: a package index that drops a 700 MB
        # download is not the image's fault; a broken Dockerfile fails both
        for try in 1 2; do
            say "podman build ${target[*]} -f docker/Dockerfile.$flavour -t $tag ($(storage_free))"
            if pm build --format docker --network host "${ULIMITS[@]}" "${secrets[@]}" \
                --build-arg PYTHON_IMAGE="$BASE_IMAGE" "${target[@]}" \
                -f "docker/Dockerfile.$flavour" -t "$tag" . >"$log" 2>&1; then
                break
            fi
            tail -n 40 "$log" >&2
            cp "$log" "$tmp/failed-build.log"
            if ((try == 2)); then
                fail "podman build of docker/Dockerfile.$flavour ($stage stage) failed twice: $(build_reason "$log"); $(storage_free)"
            fi
            say "podman build of docker/Dockerfile.$flavour ($stage stage) failed: $(build_reason "$log"); $(storage_free); pruning dangling images and trying once more"
            pm image prune -f >/dev/null 2>&1 || true
        done
        rm -f "$tmp/failed-build.log"
        drop_if_untagged "$old"
    done
    build_seconds[$flavour]=$((SECONDS - t0))
    say "$REPO/mossrt:$flavour built in ${build_seconds[$flavour]} s, $(image_size "$REPO/mossrt:$flavour")"
}
image_size() { pm image inspect --format '{{.Size}}' "$1" | awk '{ printf "%.2f GB", $1 / 1e9 }'; }

# ------------------------------------------------------------------------------------------- inspect
inspect_image() {  # FLAVOUR: what the final image holds, read from its mounted file system
    local image=$REPO/mossrt:$1 mnt found
    mnt=$(pm image mount "$image") || fail "podman image mount $image failed"
    mounted+=("$image")
    found=$(find "$mnt"/usr/bin "$mnt"/usr/local/bin "$mnt"/bin "$mnt"/usr/sbin "$mnt"/opt/venv/bin "$mnt"/usr/lib/gcc \
        \( -name gcc -o -name 'gcc-[0-9]*' -o -name cc -o -name c++ -o -name g++ -o -name 'clang*' -o -name cc1 \
           -o -name as -o -name ld -o -name nvcc -o -name '*-linux-gnu-gcc*' \) 2>/dev/null || true)
    [[ -z $found ]] || fail "$image holds a compiler or assembler: ${found//$mnt/}"
    found=$(find "$mnt"/opt/venv -path '*site-packages/torch' -o -path '*site-packages/torch-*' \
        -o -path '*site-packages/pytest' -o -path '*site-packages/_pytest' 2>/dev/null || true)
    [[ -z $found ]] || fail "$image holds torch or test tooling: ${found//$mnt/}"
    local pkg
    for pkg in app engine export mossrt loadtest; do
        found=$(find "$mnt"/opt/venv/lib/python3*/site-packages/"$pkg" \( -name tests -o -name 'test_*.py' -o -name conftest.py \) 2>/dev/null || true)
        [[ -z $found ]] || fail "$image holds test files: ${found//$mnt/}"
    done
    found=$(cd tests && find . -name 'test_*.py' -printf '%f\n' -quit)
    [[ -z $found || -z $(find "$mnt" -xdev -name "$found" 2>/dev/null) ]] || fail "$image holds the repository's tests ($found)"
    [[ ! -e $mnt/src && ! -e $mnt/root/.cache/pip ]] || fail "$image holds the build's source tree (/src) or a pip cache"
    # the build secrets: no file with their content, no custom CA of this machine in the image's CA store
    local secret size
    for secret in "$tmp/pip.conf" ${ca:+"$ca"}; do
        size=$(stat -c %s "$secret")
        while IFS= read -r -d '' f; do
            ! cmp -s "$f" "$secret" || fail "$image holds a copy of the build secret $secret: ${f#"$mnt"}"
        done < <(find "$mnt" -xdev -type f -size "${size}c" -print0 2>/dev/null)
    done
    for secret in /usr/local/share/ca-certificates/*.crt; do
        [[ -f $secret ]] || continue
        local line
        line=$(grep -v -e '-----' "$secret" | sed -n 2p)
        [[ -z $line ]] || ! grep -rqsF -- "$line" "$mnt"/etc/ssl "$mnt"/usr/local/share/ca-certificates \
            || fail "$image trusts this machine's CA $secret (a build secret leaked into the image)"
    done
    [[ ! -e $mnt/run/secrets || -z $(ls -A "$mnt/run/secrets") ]] || fail "$image has files in /run/secrets"
    local config
    config=$(pm image inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$image")
    ! grep -E -i '^(PIP_|SSL_CERT|REQUESTS_CA|[a-z_]*_proxy=)' <<<"$config" \
        || fail "$image sets pip/proxy/CA variables in its environment"
    [[ -n $(pm image inspect --format '{{.Config.Healthcheck}}' "$image" | grep -o health) ]] \
        || fail "$image has no HEALTHCHECK (built without --format docker?)"
    pm image unmount "$image" >/dev/null
    say "$image: no compiler, no torch, no test files, no source tree, no pip cache, no build secrets; HEALTHCHECK set"
}

# in-image python, not run as a server
in_image() { local image=$1; shift; pm run --rm "${ULIMITS[@]}" --no-healthcheck --network none --entrypoint /opt/venv/bin/python "$image" -I -c "$@"; }

# ------------------------------------------------------------------------------------------- run (CPU)
run_cpu_image() {
    local image=$REPO/mossrt:cpu name=$run_id-cpu volume=$run_id-data port base started secs rc
    port=$("$HOST_PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    base=http://127.0.0.1:$port

    # the documented refusal: no bundle in /data/bundle, no MOSSRT_EXPORT_MODEL
    rc=0
    pm run --rm "${ULIMITS[@]}" --network none "$image" >"$tmp/no-bundle.log" 2>&1 || rc=$?
    ((rc == 64)) && grep -q 'no bundle in MOSSRT_BUNDLE' "$tmp/no-bundle.log" \
        || { cat "$tmp/no-bundle.log" >&2; fail "without a bundle the container exited $rc, expected 64 with the entrypoint's message"; }
    say "no bundle, no model: the entrypoint refuses with its message (exit 64)"

    volumes+=("$volume")
    pm volume create "$volume" >/dev/null
    containers+=("$name")
    started=$SECONDS
    # --no-healthcheck: podman would time the HEALTHCHECK with systemd, which CI lacks; it runs below
    pm run -d --name "$name" "${ULIMITS[@]}" --no-healthcheck -p "127.0.0.1:$port:8000" -v "$volume:/data" \
        -e MOSSRT_BUNDLE= -e MOSSRT_DRAIN_TIMEOUT="$DRAIN_TIMEOUT" -e MOSSRT_SHUTDOWN_DELAY="$SHUTDOWN_DELAY" "$image" >"$tmp/run.log" 2>&1 \
        || { cat "$tmp/run.log" >&2; fail "podman run $image failed"; }
    local -a alive=("${PODMAN[@]}" inspect --format '{{.State.Running}}' "$name")
    secs=$(probe wait "$base" /health "$READY_TIMEOUT" -- "${alive[@]}") || fail "no /health 200 from the container: $(probe_reason)"
    say "GET /health -> 200, $secs s after podman run"
    probe wait "$base" /ready "$READY_TIMEOUT" -- "${alive[@]}" >/dev/null || fail "no /ready 200 from the container: $(probe_reason)"
    ready_seconds=$((SECONDS - started))
    say "GET /ready -> 200: cold start to ready ${ready_seconds} s (demo bundle built in the container)"
    local -a health
    mapfile -t health < <(pm image inspect --format '{{json .Config.Healthcheck.Test}}' "$image" \
        | "$HOST_PYTHON" -c 'import json, sys; t = json.load(sys.stdin); assert t[0] == "CMD", t; print(*t[1:], sep="\n")')
    ((${#health[@]})) || fail "$image has no HEALTHCHECK CMD"
    pm exec "$name" "${health[@]}" || fail "the image's HEALTHCHECK command fails on a serving container"
    say "the image's HEALTHCHECK command passes"

    probe speech "$base" || fail "POST /v1/audio/speech gave no playable audio: $(probe_reason)"

    local uids
    uids=$(pm exec "$name" sh -c 'for s in /proc/[0-9]*/status; do awk "/^Name:/ {n = \$2} /^Uid:/ {print n, \$2}" "$s"; done' 2>/dev/null)
    grep -q '^mossrt ' <<<"$uids" || fail "no mossrt process in the container: $uids"
    local others
    others=$(awk -v uid="$UID_IN_IMAGE" '$2 != uid' <<<"$uids")
    [[ -z $others ]] || fail "processes in the container run as other users than $UID_IN_IMAGE: $(tr '\n' ';' <<<"$uids")"
    say "every process runs as uid $UID_IN_IMAGE: $(awk '{print $1}' <<<"$uids" | sort -u | paste -sd' ' -)"
    pm exec "$name" sh -c 'set -e; for d in /data /data/voices /data/bundle /data/hf; do touch "$d/.w" && rm "$d/.w"; done' \
        || fail "/data (named volume) is not writable by uid $UID_IN_IMAGE"
    say "/data, /data/voices, /data/bundle, /data/hf are writable by uid $UID_IN_IMAGE"

    local stop_limit=$((DRAIN_TIMEOUT + PRESTOP_ALLOWANCE))
    secs=$(probe drain "$base" -- "${PODMAN[@]}" stop -t "$stop_limit" "$name") \
        || fail "podman stop with a stream in flight: $(probe_reason)"
    rc=$(pm inspect --format '{{.State.ExitCode}}' "$name")
    ((rc == 0)) || fail "the container exited $rc after SIGTERM (expected 0; 137 = killed after $stop_limit s)"
    awk -v s="$secs" -v l="$stop_limit" 'BEGIN { exit !(s < l) }' || fail "the stop took $secs s (limit $stop_limit s)"
    stop_seconds=$secs
    # read the log whole before matching: under pipefail, `pm logs | grep -q` fails whenever grep's early
    # exit makes podman die of SIGPIPE on the lines after the match (what failed CI once)
    local logs
    logs=$(pm logs "$name" 2>&1)
    grep -q 'drained' <<<"$logs" || fail "the server did not log its drain"
    say "podman stop -t $stop_limit: drained and exited 0 in $secs s"
    # done with: a later failure's log ends with that failure, not with this container's log
    pm rm -f -t 0 "$name" >/dev/null 2>&1 || true
    local kept=() c
    for c in "${containers[@]}"; do [[ $c == "$name" ]] || kept+=("$c"); done
    containers=("${kept[@]}")
}

# ------------------------------------------------------------------------------------------- main
build cpu
inspect_image cpu
run_cpu_image
if [[ $CHECK_CUDA == 1 ]]; then
    build cuda
    inspect_image cuda
    in_image "$REPO/mossrt:cuda" '
import importlib.metadata as md, sys, onnxruntime as ort
names = {d.metadata["Name"].lower() for d in md.distributions()}
if "onnxruntime" in names: sys.exit("the CPU onnxruntime is installed beside onnxruntime-gpu")
providers = ort.get_available_providers()
if "CUDAExecutionProvider" not in providers: sys.exit(f"no CUDAExecutionProvider: {providers}")
version = md.version("onnxruntime-gpu")
print(f"onnxruntime-gpu {version}, providers {providers}")
' >"$tmp/cuda.txt" 2>&1 || { cat "$tmp/cuda.txt" >&2; fail "the CUDA image's onnxruntime"; }
    say "$REPO/mossrt:cuda: $(cat "$tmp/cuda.txt")"
else
    say "IMAGE_CHECK_CUDA=$CHECK_CUDA: the CUDA image is NOT checked"
fi

say "figures: build cpu ${build_seconds[cpu]} s$([[ $CHECK_CUDA == 1 ]] && echo ", cuda ${build_seconds[cuda]} s");" \
    "size cpu $(image_size "$REPO/mossrt:cpu")$([[ $CHECK_CUDA == 1 ]] && echo ", cuda $(image_size "$REPO/mossrt:cuda")");" \
    "cold start to /ready ${ready_seconds} s; drain+exit ${stop_seconds} s; whole check $((SECONDS - check_start)) s"
say "PASS: images built with podman; the CPU image serves, speaks, runs as uid $UID_IN_IMAGE, drains on SIGTERM"
