"""Write the pip configuration a container build should use: this machine's, as pip itself sees it.

    python .ci/pip_build_config.py OUT_PIP_CONF      (prints the CA bundle pip uses here, if any)

Reads ``pip config list`` (the global, site and user files and the PIP_* variables, merged the way pip
merges them), writes the settings into one pip.conf for the ``pip.conf`` build secret and prints the CA
bundle for the ``ca-bundle`` secret. Paths on this machine (``file://`` indexes, local find-links,
constraint files) mean nothing inside a build and are left out (said on stderr); so is ``cert``, which
the ``ca-bundle`` secret replaces.
"""

from __future__ import annotations

import ast
import configparser
import os
import subprocess
import sys
from pathlib import Path

PATH_VALUED = {"cert", "client-cert", "constraint", "requirement", "find-links", "index-url", "extra-index-url",
               "log", "cache-dir", "src", "target", "prefix", "root"}
DROPPED = {"cert"}  # replaced by the ca-bundle secret


def pip_settings() -> dict[tuple[str, str], str]:
    """(section, name) -> value, later sources overriding earlier ones (``:env:`` is the global section)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], check=True, capture_output=True,
                         text=True, env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")).stdout
    settings: dict[tuple[str, str], str] = {}
    for line in out.splitlines():
        key, sep, raw = line.partition("=")
        if not sep or "." not in key:
            continue
        section, name = key.rsplit(".", 1)
        value = ast.literal_eval(raw) if raw[:1] in "'\"" else raw
        settings[("global" if section == ":env:" else section, name)] = value
    return settings


def is_local(item: str) -> bool:
    return item.startswith(("file:", "/", "./", "../", "~"))


def build_config(settings: dict[tuple[str, str], str]) -> tuple[configparser.ConfigParser, list[str]]:
    conf = configparser.ConfigParser(interpolation=None)
    left_out: list[str] = []
    for (section, name), value in settings.items():
        if name in DROPPED:
            continue
        if name in PATH_VALUED:
            items = value.split()
            kept = [i for i in items if not is_local(i)]
            left_out += [f"{section}.{name}={i}" for i in items if is_local(i)]
            if not kept:
                continue
            value = " ".join(kept)
        if not conf.has_section(section):
            conf.add_section(section)
        conf.set(section, name, value)
    return conf, left_out


def ca_bundle(settings: dict[tuple[str, str], str]) -> str | None:
    """The CA bundle pip uses on this machine: its ``cert`` setting, else the variables requests reads."""
    for candidate in (settings.get(("global", "cert")), settings.get(("install", "cert")),
                      os.environ.get("REQUESTS_CA_BUNDLE"), os.environ.get("SSL_CERT_FILE"),
                      "/etc/ssl/certs/ca-certificates.crt"):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    settings = pip_settings()
    conf, left_out = build_config(settings)
    with open(argv[0], "w", encoding="utf-8") as f:
        conf.write(f)
    for item in left_out:
        print(f"[pip_build_config] left out (a path on this machine): {item}", file=sys.stderr)
    bundle = ca_bundle(settings)
    if bundle:
        print(bundle)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
