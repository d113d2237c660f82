"""The pip configuration .ci/image-check.sh hands a container build: this machine's pip settings, as pip
itself merges them, without the paths that exist only on this machine."""

import configparser
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / ".ci" / "pip_build_config.py"


def run(tmp_path, env_extra, files):
    """pip_build_config.py under an isolated pip configuration: (written pip.conf, stdout, stderr)."""
    conf = tmp_path / "global.conf"
    conf.write_text(files)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=str(conf), HOME=str(tmp_path), XDG_CONFIG_DIRS=str(tmp_path / "none"), **env_extra)
    out = tmp_path / "pip.conf"
    p = subprocess.run([sys.executable, str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    written = configparser.ConfigParser(interpolation=None)
    written.read(out)
    return written, p.stdout.strip(), p.stderr


def test_network_settings_kept_host_paths_and_cert_left_out(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("")
    written, bundle, stderr = run(
        tmp_path,
        {"PIP_DEFAULT_TIMEOUT": "90", "PIP_FIND_LINKS": "/opt/wheels"},
        "[global]\n"
        "index-url = https://pypi.mirror.example/simple\n"
        "extra-index-url = file:///opt/pypi/simple https://extra.example/simple\n"
        "trusted-host = pypi.mirror.example\n"
        f"constraint = {constraints}\n"
        f"cert = {ca}\n"
        "[install]\n"
        "proxy = http://proxy.example:3128\n",
    )
    g = written["global"]
    assert g["index-url"] == "https://pypi.mirror.example/simple"
    assert g["extra-index-url"] == "https://extra.example/simple"
    assert g["trusted-host"] == "pypi.mirror.example" and g["default-timeout"] == "90"
    assert written["install"]["proxy"] == "http://proxy.example:3128"
    for gone in ("find-links", "constraint", "cert"):
        assert gone not in g
    assert "file:///opt/pypi/simple" in stderr and "/opt/wheels" in stderr
    assert bundle == str(ca)  # the CA bundle goes in as its own secret
