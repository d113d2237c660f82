"""The alert and recording rules (helm/mossrt/files/prometheus-rules.yaml) pass ``promtool check rules``; each
alert fires and stays quiet as helm/tests/prometheus-rules.test.yaml says (``promtool test rules``); and a real
server's /metrics, after traffic over every kind of transport, passes ``promtool check metrics`` with no
warning; and scripts/monitoring-check passes: a live Prometheus, with these rules, scraping a server under load,
has data for every dashboard panel, recording rule and chart query. promtool and prometheus are Debian's
``prometheus`` package (``bash .ci/install-debian.sh``)."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from service_helpers import TEST_DEVICE, TEXT, Server, native_ws_turns

REPO = Path(__file__).resolve().parents[1]
RULES = REPO / "helm" / "mossrt" / "files" / "prometheus-rules.yaml"
RULE_TESTS = REPO / "helm" / "tests" / "prometheus-rules.test.yaml"


def prometheus_package_binary(name: str) -> str:
    """A binary of Debian's prometheus package, or a skip that says how to install it."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not installed: run `bash .ci/install-debian.sh` (apt-get install prometheus)")
    return path


@pytest.fixture(scope="module")
def promtool() -> str:
    return prometheus_package_binary("promtool")


def run(promtool: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], input=stdin, capture_output=True, text=True, timeout=300)


def test_rules_are_valid(promtool):
    proc = run(promtool, "check", "rules", str(RULES))
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


def test_each_alert_fires_and_stays_quiet(promtool):
    proc = run(promtool, "test", "rules", str(RULE_TESTS))
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr
    tested = set(RULE_TESTS.read_text().split("alertname: ")[1:])
    alerts = {line.split("alert: ")[1].strip() for line in RULES.read_text().splitlines() if "- alert: " in line}
    assert alerts <= {t.split()[0] for t in tested}, "an alert without a promtool test"


def test_live_metrics_follow_the_naming_conventions(promtool, full_bundle_dir, tmp_path):
    with Server(full_bundle_dir, tmp_path / "voices", tmp_path / "server.log") as server:
        fresh = httpx.get(server.base + "/metrics", timeout=10).text
        # the series the SLOs divide by exist at 0 before any request (no rate from a counter's first sample)
        for series in ('mossrt_requests_total{endpoint="/v1/audio/speech",status="429"} 0.0',
                       'mossrt_requests_total{endpoint="/v1/text-to-speech/{voice_id}/multi-stream-input",'
                       'status="500"} 0.0',
                       'mossrt_stalled_streams_total{transport="ws"} 0.0'):
            assert series in fresh, series
        r = httpx.post(server.base + "/v1/audio/speech",
                       json={"model": "tts-1", "input": TEXT, "voice": "alloy", "response_format": "pcm"}, timeout=120)
        assert r.status_code == 200
        r = httpx.post(server.base + "/v1/text-to-speech/default/with-timestamps?output_format=pcm_24000",
                       json={"text": TEXT}, timeout=120)
        assert r.status_code == 200
        asyncio.run(native_ws_turns(server, [[TEXT]]))
        httpx.post(server.base + "/v1/audio/speech", json={"input": ""}, timeout=30)    # a 400 too
        exposition = httpx.get(server.base + "/metrics", timeout=10).text
    assert "mossrt_time_to_first_audio_seconds_bucket" in exposition
    proc = run(promtool, "check", "metrics", stdin=exposition)
    assert proc.returncode == 0 and not (proc.stdout + proc.stderr).strip(), proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def prometheus() -> str:
    return prometheus_package_binary("prometheus")


def test_dashboard_rules_and_autoscaling_queries_against_a_live_prometheus(prometheus, full_bundle_dir, tmp_path):
    """scripts/monitoring-check: a real Prometheus scraping a real server under a mixed load with an
    over-capacity burst and a stalled client; every panel query, recording rule and chart query has data,
    every rule evaluates, the shedding alert is pending and no other alert but those of the machine's speed that
    the same run measured past their objective (a slower CPU rightly raises MossrtLateChunks), and the panels
    render."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "monitoring-check"), "--bundle",
                           str(full_bundle_dir), "--device", TEST_DEVICE, "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=1200)
    report = json.loads((tmp_path / "report.json").read_text())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert report["failures"] == [], report["failures"]
    slow = {alert for alert, m in report["measured"].items() if m["expected"]}
    assert report["alerts"]["MossrtShedding"] == "pending" and set(report["alerts"]) == {"MossrtShedding"} | slow, \
        (report["alerts"], report["measured"])
    assert len(report["queries"]) >= 20 and all(q["series"] for q in report["queries"])
    assert {r["type"] for r in report["rules"]} == {"recording", "alerting"}
    assert report["sse_status"] == 200 and report["stalled_streams"] >= 1
    assert (tmp_path / "dashboard.png").stat().st_size > 20_000
