#!/usr/bin/env bash
# CI: the offline GPU-host path, dry-run on CI's own Python and the CPU provider (no GPU needed).
#
#   bash .ci/wheelhouse-check.sh
#
# 1. A "host" like the lent GPU machine: a venv (the GPU host's python3 is itself a venv) holding some of the
#    project's dependencies at versions of its own, and an older onnxruntime CPU build the wheelhouse's
#    onnxruntime must shadow (the GPU host has onnxruntime 1.30.0). Its `pip freeze` is the host list.
# 2. scripts/gpu-wheelhouse build: what the host lacks, for CI's Python, the cpu extra, in parts of 20 MiB.
# 3. With the network cut (a network namespace with only loopback, when the kernel lets us make one) and
#    every pip setting pointing nowhere: scripts/gpu-check --device cpu --smoke --parts, which prints the
#    transfer plan, verifies and joins the parts, installs into a venv layered over the host, and runs every
#    stage from that venv. Any stage that fails, or anything that reaches for an index, fails CI.
# 4. The same install with one wheel taken out must fail, naming that wheel; a part over the limit must be
#    refused by name.
# Knobs: KEEP=1 keeps the work directory.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
say() { printf '[wheelhouse-check] %s\n' "$*" >&2; }
fail() { say "FAIL: $*"; exit 1; }

work=$(mktemp -d /tmp/mossrt-wheelhouse-check.XXXXXX)
if [ "${KEEP:-0}" != 1 ]; then trap 'rm -rf "$work"' EXIT; fi
say "work: $work"

# 1. the host
python3 -m venv "$work/host"
"$work/host/bin/pip" install -q --upgrade pip
"$work/host/bin/pip" install -q "numpy==2.3.5" "onnx" "tokenizers" "safetensors" "ml-dtypes" "prometheus-client" \
    "httpx" "pytest" "tqdm" "onnxruntime==1.30.0"
"$work/host/bin/pip" freeze --exclude-editable > "$work/host-has.txt"
say "host: $(wc -l < "$work/host-has.txt") packages ($(grep -i '^numpy==' "$work/host-has.txt"), $(grep -i '^onnxruntime==' "$work/host-has.txt"))"

# 2. the wheelhouse (onnxruntime replaced: the cpu extra needs 1.32 where the host has 1.30)
# resolved with the host venv's Python: its pip was upgraded above (the build refuses a pip older than 23.3,
# such as the 23.2 this machine's own python3 may carry)
scripts/gpu-wheelhouse build --host-has "$work/host-has.txt" --extras cpu,loadtest --replace onnxruntime \
    --resolver-python "$work/host/bin/python" --part-mib 20 --out "$work/wh" | tee "$work/build.log"
parts=$(find "$work/wh/parts" -name 'mossrt-wheelhouse.tar.xz.*' | wc -l)
[ "$parts" -ge 2 ] || fail "expected the wheelhouse in several 20 MiB parts, got $parts"
for part in "$work"/wh/parts/mossrt-wheelhouse.tar.xz.*; do
    size=$(stat -c %s "$part")
    [ "$size" -le $((20 * 1024 * 1024)) ] || fail "$(basename "$part") is $size bytes, over the 20 MiB limit"
done
if grep -qi '^numpy==' "$work/wh/constraints.txt"; then
    grep -qi "^$(grep -i '^numpy==' "$work/host-has.txt")\$" "$work/wh/constraints.txt" \
        || fail "the constraints do not pin the host's numpy"
fi
ls "$work/wh/wheels" | grep -qi '^numpy-' && fail "the wheelhouse carries numpy although the host has it"

# 3. offline: no network, pip pointed nowhere
offline() {
    local env=(env PIP_NO_INDEX=1 PIP_INDEX_URL=http://127.0.0.1:9/simple PIP_FIND_LINKS= PIP_CONFIG_FILE=/dev/null
               http_proxy=http://127.0.0.1:9 https_proxy=http://127.0.0.1:9 HTTP_PROXY=http://127.0.0.1:9
               HTTPS_PROXY=http://127.0.0.1:9 no_proxy=127.0.0.1,localhost NO_PROXY=127.0.0.1,localhost)
    if unshare -n true 2>/dev/null && command -v ip >/dev/null; then
        unshare -n sh -c 'ip link set lo up && exec "$@"' sh "${env[@]}" "$@"
    else
        say "no network namespace here: offline by pip settings and proxies only"
        "${env[@]}" "$@"
    fi
}
offline python3 -c 'import socket; socket.create_connection(("pypi.org", 443), timeout=5)' 2>/dev/null \
    && say "warning: pypi.org is reachable from the offline shell (no network namespace)"
offline "$work/host/bin/python" scripts/gpu-check --device cpu --smoke --parts "$work/wh/parts" \
    --host-python "$work/host/bin/python" --out "$work/out" --work "$work/gc" | tee "$work/check.log" \
    || fail "gpu-check --parts failed offline (stages in $work/out/summary.json)"
grep -q "transfer plan: $parts part(s)" "$work/check.log" || fail "gpu-check did not print the transfer plan first"
[ "$(head -c 15 "$work/check.log")" = "transfer plan: " ] || fail "the transfer plan is not the first thing printed"
"$work/host/bin/python" - "$work/out/summary.json" <<'EOF' || fail "the offline run's figures are not what they should be"
import json, sys
stages = {s["stage"]: s for s in json.load(open(sys.argv[1]))["stages"]}
install = stages["install"]["figures"]
assert stages["join"]["status"] == "passed", stages["join"]
assert install["onnxruntime"].startswith("1.32."), install["onnxruntime"]          # shadows the host's 1.30
assert "/gc/venv/" in install["onnxruntime_file"], install["onnxruntime_file"]
assert install["host_is_venv"] and install["layered_site_packages"], install
assert "numpy" not in install["installed_from_wheelhouse"], install["installed_from_wheelhouse"]
assert any(p.startswith("numpy==2.3.5") for p in install["host_freeze"]), "the host's numpy was not kept"
bad = {k: s["status"] for k, s in stages.items() if s["status"] not in ("passed", "n/a")}
assert not bad, bad
print(f"offline run: {len(stages)} stages, onnxruntime {install['onnxruntime']} from the venv, host numpy kept")
EOF

# 4. a wheelhouse without one wheel fails by its name; a part over the limit is refused by name
"$work/host/bin/python" scripts/gpu-wheelhouse join --parts "$work/wh/parts" --out "$work/joined" >/dev/null
victim=$(ls "$work/joined/wheels" | grep -i '^soxr-' | head -n 1)
[ -n "$victim" ] || fail "no soxr wheel in the wheelhouse to take out"
rm "$work/joined/wheels/$victim"
if offline "$work/host/bin/python" scripts/gpu-wheelhouse install --wheelhouse "$work/joined" \
        --venv "$work/venv-missing" --python "$work/host/bin/python" > "$work/missing.log" 2>&1; then
    fail "the install succeeded without $victim"
fi
grep -qi "no wheel for soxr" "$work/missing.log" || { cat "$work/missing.log" >&2; fail "the failure does not name soxr"; }
say "without $victim: $(tail -n 1 "$work/missing.log" | cut -c1-160)"
"$work/host/bin/python" - "$work/wh/parts/manifest.json" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
m["part_limit_bytes"] = m["parts"][0]["bytes"] - 1       # as if the first part had been cut too large
json.dump(m, open(sys.argv[1], "w"))
EOF
if "$work/host/bin/python" scripts/gpu-wheelhouse join --parts "$work/wh/parts" --out "$work/joined2" \
        > "$work/limit.log" 2>&1; then
    fail "a part over the limit was joined"
fi
grep -q "mossrt-wheelhouse.tar.xz.001 is over the limit" "$work/limit.log" || { cat "$work/limit.log" >&2; fail "the part over the limit is not named"; }

# 5. the real provider library: onnxruntime-gpu's, stripped to sm_90 (tests/test_wheelhouse.py reads it with
#    pyelftools and cuobjdump; the wheel is the same library for every Python)
"$work/host/bin/pip" download -q --no-deps --only-binary=:all: -d "$work/ort-gpu" "onnxruntime-gpu==1.31.1"
wheel=$(find "$work/ort-gpu" -name 'onnxruntime_gpu-*.whl' -print -quit)
[ -n "$wheel" ] || fail "no onnxruntime-gpu wheel downloaded"
MOSSRT_ORT_GPU_WHEEL="$wheel" "${PYTHON:-.venv/bin/python}" -m pytest -q -p no:cacheprovider \
    tests/test_wheelhouse.py -k real_provider_library -rA | tee "$work/real.log"
grep -q "1 passed" "$work/real.log" || fail "the real provider library's strip test did not pass"
say "PASS"
