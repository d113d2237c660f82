#!/usr/bin/env bash
# CI helper: install the Debian packages three tests drive from the distribution, not from PyPI:
#   chromium   /usr/bin/chromium   tests/test_web_page.py (headless, through Python playwright with
#                                  executable_path=/usr/bin/chromium; no `playwright install`)
#   espeak-ng  /usr/bin/espeak-ng  tests/test_speech_timing.py and scripts/alignment-eval (speech with known
#                                  word times, through libespeak-ng1's C API)
#   prometheus /usr/bin/promtool   tests/test_prometheus_rules.py (check and test the alert rules, lint /metrics)
#
#   bash .ci/install-debian.sh
#
# Idempotent: a package whose file exists is only reported. It never fails the CI run because a package
# cannot be installed (no apt-get, not root and no sudo, mirror unreachable): it prints a loud warning and
# exits 0, and the test that needs it then skips with a loud message.
# Knobs: APT_TIMEOUT (600) seconds for each apt-get step.
set -euo pipefail

APT_TIMEOUT=${APT_TIMEOUT:-600}
PACKAGES=("chromium:/usr/bin/chromium:tests/test_web_page.py" "espeak-ng:/usr/bin/espeak-ng:tests/test_speech_timing.py"
          "prometheus:/usr/bin/promtool:tests/test_prometheus_rules.py")

say() { printf '[install-debian] %s\n' "$*" >&2; }

# warn, then exit 0: a package that cannot be installed never fails the CI run
give_up() {
    printf '\n' >&2
    printf '[install-debian] %s\n' \
        "########################################################################" \
        "WARNING: ${missing[*]} NOT installed: $*" \
        "the tests that need them will SKIP in this run: ${tests[*]}" \
        "########################################################################" >&2
    printf '\n' >&2
    exit 0
}

missing=() tests=()
for entry in "${PACKAGES[@]}"; do
    IFS=: read -r package file test <<<"$entry"
    if [[ -x $file ]]; then
        say "$package already installed: $file"
    else
        missing+=("$package") tests+=("$test")
    fi
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

if ! command -v apt-get >/dev/null 2>&1; then
    give_up "apt-get not found (not a Debian/Ubuntu machine)"
fi

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO=(sudo -n)
    else
        give_up "not root and no password-less sudo"
    fi
fi

# timeout(1) when present, so a hung mirror cannot hang CI
TIMEOUT=()
if command -v timeout >/dev/null 2>&1; then
    TIMEOUT=(timeout "$APT_TIMEOUT")
fi

export DEBIAN_FRONTEND=noninteractive
t0=$SECONDS
say "installing ${missing[*]}: apt-get update"
if ! "${SUDO[@]}" "${TIMEOUT[@]}" apt-get update -q >&2; then
    give_up "apt-get update failed"
fi
say "apt-get install -y --no-install-recommends ${missing[*]}"
if ! "${SUDO[@]}" "${TIMEOUT[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" >&2; then
    give_up "apt-get install failed"
fi
for entry in "${PACKAGES[@]}"; do
    IFS=: read -r package file test <<<"$entry"
    [[ -x $file ]] || { missing=("$package"); tests=("$test"); give_up "installed, but $file is missing"; }
done
say "installed ${missing[*]} in $((SECONDS - t0)) s"
