#!/usr/bin/env bash
# CI helper: install Debian's `chromium` package for the web page test (tests/test_web_page.py drives it
# headless through Python playwright with executable_path=/usr/bin/chromium; no `playwright install`).
#
#   bash .ci/install-browser.sh
#
# Idempotent: when /usr/bin/chromium exists it only prints its version and exits. It never fails the CI
# run because the browser cannot be installed (no apt-get, not root and no sudo, mirror unreachable):
# it prints a loud warning and exits 0, and the web page test then skips with a loud message.
# Knobs: CHROMIUM (/usr/bin/chromium), APT_TIMEOUT (600) seconds for each apt-get step.
set -euo pipefail

CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
APT_TIMEOUT=${APT_TIMEOUT:-600}

say() { printf '[install-browser] %s\n' "$*" >&2; }

warn() {
    printf '\n' >&2
    printf '[install-browser] %s\n' \
        "########################################################################" \
        "WARNING: chromium was NOT installed: $*" \
        "tests/test_web_page.py will SKIP (the web page is not tested in this run)." \
        "########################################################################" >&2
    printf '\n' >&2
}

# warn, then exit 0: a browser that cannot be installed never fails the CI run
give_up() {
    warn "$@"
    exit 0
}

version() { "$CHROMIUM" --version 2>/dev/null || echo "(version unknown)"; }

if [[ -x $CHROMIUM ]]; then
    say "chromium already installed: $CHROMIUM: $(version)"
    exit 0
fi

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
say "installing chromium: apt-get update"
if ! "${SUDO[@]}" "${TIMEOUT[@]}" apt-get update -q >&2; then
    give_up "apt-get update failed"
fi
say "installing chromium: apt-get install -y --no-install-recommends chromium"
if ! "${SUDO[@]}" "${TIMEOUT[@]}" apt-get install -y -q --no-install-recommends chromium >&2; then
    give_up "apt-get install chromium failed"
fi

if [[ ! -x $CHROMIUM ]]; then
    give_up "the chromium package installed but $CHROMIUM is missing"
fi
say "chromium installed in $((SECONDS - t0)) s: $CHROMIUM: $(version)"
