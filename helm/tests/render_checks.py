#!/usr/bin/env python3
"""Checks on the manifests `helm template` renders from helm/mossrt.

Usage: render_checks.py --chart helm/mossrt --rendered DIR

DIR holds one multi-document YAML file per values set: `default.yaml` (the chart's values.yaml
alone) and `<name>.yaml` for each `<chart>/ci/<name>.yaml`. The expectations are derived from the
same values helm used (values.yaml deep-merged with the ci file, the way helm coalesces them), so
the checks follow the values files; a table at the end pins what each ci file must exercise.

Prints one line per file checked; exits 1 with a message at the first failed check.
Needs PyYAML (the only dependency beyond the standard library).
"""
from __future__ import annotations

import argparse
import base64
import copy
import json
import re
import sys
from pathlib import Path

try:
    import yaml
except ImportError:  # pragma: no cover - reported, not tested
    sys.exit("render_checks.py needs PyYAML (pip install pyyaml)")


class CheckFailed(Exception):
    pass


class Checker:
    def __init__(self) -> None:
        self.count = 0

    def ok(self, cond: object, message: str) -> None:
        self.count += 1
        if not cond:
            raise CheckFailed(message)

    def eq(self, got: object, want: object, what: str) -> None:
        self.ok(got == want, f"{what}: got {got!r}, want {want!r}")


# ------------------------------------------------------------------ values (helm coalescing)

def coalesce(base: dict, override: dict) -> dict:
    """Helm's merge of user values over chart defaults: maps merge, other values replace, null deletes."""
    out = copy.deepcopy(base)
    for key, val in (override or {}).items():
        if val is None:
            out.pop(key, None)
        elif isinstance(val, dict) and isinstance(out.get(key), dict):
            out[key] = coalesce(out[key], val)
        else:
            out[key] = copy.deepcopy(val)
    return out


def get(values: dict, dotted: str, default=None):
    cur = values
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return default
        cur = cur[part]
    return cur


# ------------------------------------------------------------------ manifest helpers

def load_docs(path: Path) -> list[dict]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d.get("kind") == kind]


def env_map(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env") or []}


def env_value(container: dict, name: str):
    e = env_map(container).get(name)
    return None if e is None else e.get("value")


def resolve_port(container: dict, port) -> int | None:
    if isinstance(port, int):
        return port
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return p.get("containerPort")
    return None


def is_gpu_resource(name: str) -> bool:
    return name.startswith("nvidia.com/") or name.startswith("amd.com/") or "gpu" in name.lower()


def adapter_rule() -> dict:
    """The prometheus-adapter rule helm/README.md gives for the HPA's Pods metric (its yaml block that starts
    with ``# prometheus-adapter values``): the adapter is not part of the chart, so the README is its source."""
    readme = Path(__file__).resolve().parents[1] / "README.md"
    m = re.search(r"```yaml\n(# prometheus-adapter values\n.*?)```", readme.read_text(), re.S)
    if m is None:
        raise CheckFailed(f"no prometheus-adapter values block in {readme}")
    rules = yaml.safe_load(m.group(1))["rules"]["custom"]
    if len(rules) != 1:
        raise CheckFailed(f"{readme}: one prometheus-adapter rule expected, got {len(rules)}")
    return rules[0]


# ------------------------------------------------------------------ the checks

def check_manifests(c: Checker, docs: list[dict], v: dict, chart: dict) -> list[str]:
    fullname = "mossrt"  # release "mossrt" contains the chart name (see .ci/helm-check.sh)
    kinds = sorted({d["kind"] for d in docs})

    for d in docs:
        meta = d.get("metadata") or {}
        what = f"{d.get('kind')}/{meta.get('name')}"
        c.ok(d.get("apiVersion") and d.get("kind") and meta.get("name"), f"{what}: apiVersion/kind/name missing")
        labels = meta.get("labels") or {}
        c.eq(labels.get("app.kubernetes.io/name"), "mossrt", f"{what} label app.kubernetes.io/name")
        c.eq(labels.get("app.kubernetes.io/instance"), "mossrt", f"{what} label app.kubernetes.io/instance")

    # ---- Deployment
    deps = by_kind(docs, "Deployment")
    c.eq(len(deps), 1, "number of Deployments")
    dep = deps[0]
    c.eq(dep["apiVersion"], "apps/v1", "Deployment apiVersion")
    c.eq(dep["metadata"]["name"], fullname, "Deployment name")
    spec = dep["spec"]
    pod = spec["template"]["spec"]
    pod_labels = spec["template"]["metadata"]["labels"]
    sel = spec["selector"]["matchLabels"]
    c.ok(sel and all(pod_labels.get(k) == val for k, val in sel.items()),
         f"Deployment selector {sel} does not match the pod labels {pod_labels}")

    if v["autoscaling"]["enabled"]:
        c.ok("replicas" not in spec, "Deployment sets replicas although an autoscaler owns them")
    else:
        c.eq(spec.get("replicas"), v["replicaCount"], "Deployment replicas")
    strategy = spec.get("strategy") or {}
    c.eq(strategy.get("type"), "RollingUpdate", "Deployment strategy type")
    c.eq(strategy.get("rollingUpdate", {}).get("maxUnavailable"), 0, "rollingUpdate.maxUnavailable")
    c.eq(strategy.get("rollingUpdate", {}).get("maxSurge"), 1, "rollingUpdate.maxSurge")

    containers = {x["name"]: x for x in pod["containers"]}
    inits = {x["name"]: x for x in pod.get("initContainers") or []}
    c.ok("mossrt" in containers, f"no container named mossrt (got {sorted(containers)})")
    main = containers["mossrt"]

    # image
    tag = str(v["image"].get("tag") or chart["appVersion"])
    if v["gpu"]["enabled"]:
        g = v["gpu"]["image"]
        want_image = f"{g.get('repository') or v['image']['repository']}:{g.get('tag') or tag + '-cuda'}"
    else:
        want_image = f"{v['image']['repository']}:{tag}"
    c.eq(main["image"], want_image, "server image")

    argv = [*(main.get("command") or []), *(main.get("args") or [])]
    c.ok("serve" in argv, f"the server container does not run `serve`: {argv}")

    # ports + env
    port = v["server"]["port"]
    c.eq(port, 8000, "server.port in the values (the contract's port)")
    ports = main.get("ports") or []
    c.ok(any(p.get("name") == "http" and p.get("containerPort") == port for p in ports),
         f"container port {port} named http missing: {ports}")
    env = env_map(main)
    c.eq(env_value(main, "MOSSRT_PORT"), str(port), "env MOSSRT_PORT")
    c.eq(env_value(main, "MOSSRT_HOST"), "0.0.0.0", "env MOSSRT_HOST")
    c.eq(env_value(main, "MOSSRT_BUNDLE"), v["bundlePath"], "env MOSSRT_BUNDLE")
    c.eq(env_value(main, "MOSSRT_VOICES_DIR"), v["voicesPath"], "env MOSSRT_VOICES_DIR")
    c.eq(env_value(main, "MOSSRT_LOG_FORMAT"), v["server"]["logFormat"], "env MOSSRT_LOG_FORMAT")
    if v["server"].get("maxStreams"):
        c.eq(env_value(main, "MOSSRT_MAX_STREAMS"), str(v["server"]["maxStreams"]), "env MOSSRT_MAX_STREAMS")
    if v["server"].get("threads"):
        c.eq(env_value(main, "MOSSRT_THREADS"), str(v["server"]["threads"]), "env MOSSRT_THREADS")
    for key, name in (("cudaGraphs", "MOSSRT_CUDA_GRAPHS"), ("warmBuckets", "MOSSRT_WARM_BUCKETS"),
                      ("engineProcess", "MOSSRT_ENGINE_PROCESS")):
        # unset: absent, so the server's own default (decided by the bundle's placement) applies
        want = v["server"].get(key) or None
        c.eq(env_value(main, name), want, f"env {name}")
    for key, name in (("parkedContextBytes", "MOSSRT_PARKED_CONTEXT_BYTES"),
                      ("wsMaxSessions", "MOSSRT_WS_MAX_SESSIONS"), ("apiWorkers", "MOSSRT_API_WORKERS")):
        # null: absent (the server's default); set: the integer as the server parses it, never a float's
        # rendering (helm reads numbers as float64: 2147483648 would print as 2.147483648e+09)
        want = v["server"].get(key)
        c.eq(env_value(main, name), None if want is None else str(int(want)), f"env {name}")
    for e in env.values():
        c.ok(e["name"] != "MOSSRT_EXPORT_MODEL", "the server container must not export at start (init container does)")

    # Wyoming (Home Assistant): its own container port, MOSSRT_WYOMING_URI, a Service port; all absent when off
    wyoming = v["wyoming"]
    want_port = [{"name": "wyoming", "containerPort": wyoming["port"], "protocol": "TCP"}] if wyoming["enabled"] else []
    c.eq([p for p in ports if p.get("name") == "wyoming"], want_port, "container port wyoming")
    c.eq(env_value(main, "MOSSRT_WYOMING_URI"),
         f"tcp://{v['server']['host']}:{wyoming['port']}" if wyoming["enabled"] else None, "env MOSSRT_WYOMING_URI")
    # its trust (docs/wyoming.md): each variable only with Wyoming on and its value set, else the server's default
    on = wyoming["enabled"]
    c.eq(env_value(main, "MOSSRT_WYOMING_ALLOW_KEYLESS_REMOTE"), "on" if on and wyoming.get("allowKeylessRemote")
         else None, "env MOSSRT_WYOMING_ALLOW_KEYLESS_REMOTE")
    c.eq(env_value(main, "MOSSRT_WYOMING_MAX_SESSIONS"), str(int(wyoming["maxSessions"]))
         if on and wyoming.get("maxSessions") is not None else None, "env MOSSRT_WYOMING_MAX_SESSIONS")
    c.eq(env_value(main, "MOSSRT_WYOMING_VOICES"), (wyoming.get("voices") or None) if on else None,
         "env MOSSRT_WYOMING_VOICES")
    keyed = bool(v.get("apiKeys") or v.get("existingSecret"))
    c.ok(not (on and keyed and v["server"]["host"] not in ("127.0.0.1", "localhost", "::1"))
         or wyoming.get("allowKeylessRemote"), "a keyed pod serves Wyoming off loopback without allowKeylessRemote")
    (svc,) = [d for d in by_kind(docs, "Service") if d["metadata"]["name"] == fullname]
    want_svc = [{"name": "wyoming", "port": wyoming["port"], "targetPort": "wyoming", "protocol": "TCP"}] \
        if wyoming["enabled"] else []
    c.eq([p for p in svc["spec"]["ports"] if p.get("name") == "wyoming"], want_svc, "Service port wyoming")

    # probes
    def probe(kind: str, path: str) -> dict:
        p = main.get(kind)
        c.ok(p and p.get("httpGet"), f"{kind} missing or not an httpGet probe")
        c.eq(p["httpGet"].get("path"), path, f"{kind} path")
        c.eq(resolve_port(main, p["httpGet"].get("port")), port, f"{kind} port")
        return p

    sp = probe("startupProbe", "/ready")
    c.ok(sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3) >= 300,
         f"startupProbe allows only {sp.get('periodSeconds', 10) * sp.get('failureThreshold', 3)} s for model load")
    probe("livenessProbe", "/health")
    probe("readinessProbe", "/ready")

    # draining
    tgp = pod.get("terminationGracePeriodSeconds")
    c.eq(tgp, v["terminationGracePeriodSeconds"], "terminationGracePeriodSeconds")
    c.ok(isinstance(tgp, int) and tgp >= 60, f"terminationGracePeriodSeconds {tgp} too short for streams to drain")
    pre = (main.get("lifecycle") or {}).get("preStop") or {}
    c.ok(pre.get("exec", {}).get("command") or pre.get("sleep"), "preStop hook missing on the server container")
    drain, delay = v["server"]["drainTimeout"], v["server"]["shutdownDelay"]
    c.eq(env_value(main, "MOSSRT_DRAIN_TIMEOUT"), str(drain), "env MOSSRT_DRAIN_TIMEOUT")
    c.eq(env_value(main, "MOSSRT_SHUTDOWN_DELAY"), str(delay), "env MOSSRT_SHUTDOWN_DELAY")
    c.ok(isinstance(tgp, int) and tgp >= v["preStopSleepSeconds"] + max(drain, delay) + 3,
         f"terminationGracePeriodSeconds {tgp} shorter than preStop + max(drain timeout, shutdown delay) + 3 s flush")

    # security
    psc = pod.get("securityContext") or {}
    c.eq(psc.get("runAsNonRoot"), True, "pod securityContext.runAsNonRoot")
    c.eq(psc.get("runAsUser"), 10001, "pod securityContext.runAsUser")
    for x in [*containers.values(), *inits.values()]:
        sc = x.get("securityContext") or {}
        c.eq(sc.get("readOnlyRootFilesystem"), True, f"{x['name']} readOnlyRootFilesystem")
        c.eq(sc.get("allowPrivilegeEscalation"), False, f"{x['name']} allowPrivilegeEscalation")
    volumes = {vol["name"]: vol for vol in pod.get("volumes") or []}
    mounts = {m["mountPath"]: m for m in main.get("volumeMounts") or []}
    c.ok("/tmp" in mounts and "emptyDir" in volumes.get(mounts["/tmp"]["name"], {}),
         "/tmp is not an emptyDir mount (needed with readOnlyRootFilesystem)")

    # data volume, bundle + voices on it
    data_path = v["dataPath"]
    c.ok(data_path in mounts, f"nothing mounted at {data_path}: {sorted(mounts)}")
    data_vol = volumes.get(mounts[data_path]["name"], {})
    pvcs = by_kind(docs, "PersistentVolumeClaim")
    if v["persistence"]["enabled"]:
        claim = (data_vol.get("persistentVolumeClaim") or {}).get("claimName")
        c.ok(claim, f"{data_path} is not backed by a PersistentVolumeClaim: {data_vol}")
        if v["persistence"].get("existingClaim"):
            c.eq(claim, v["persistence"]["existingClaim"], "claimName (existingClaim)")
            c.eq(len(pvcs), 0, "PVCs rendered although existingClaim is set")
        else:
            c.eq([p["metadata"]["name"] for p in pvcs], [claim], "rendered PVC vs the mounted claim")
            ps = pvcs[0]["spec"]
            c.eq(ps["resources"]["requests"]["storage"], v["persistence"]["size"], "PVC size")
            c.eq(ps["accessModes"], v["persistence"]["accessModes"], "PVC accessModes")
            sc_name = v["persistence"].get("storageClass")
            if sc_name:
                c.eq(ps.get("storageClassName"), "" if sc_name == "-" else sc_name, "PVC storageClassName")
            else:
                c.ok("storageClassName" not in ps, "PVC sets a storageClassName although none is configured")
    else:
        c.ok("emptyDir" in data_vol, f"{data_path} should be an emptyDir without persistence: {data_vol}")
        c.eq(len(pvcs), 0, "PVCs rendered although persistence is off")
    c.ok(v["voicesPath"].startswith(data_path.rstrip("/") + "/"), "voices dir not on the data volume")
    c.ok(env_value(main, "MOSSRT_VOICES_DIR").startswith(data_path.rstrip("/") + "/"),
         "MOSSRT_VOICES_DIR does not point into the data volume")

    # bundle provisioning
    if v["export"]["enabled"]:
        c.ok(env_value(main, "MOSSRT_BUNDLE").startswith(data_path.rstrip("/") + "/"),
             "MOSSRT_BUNDLE does not point into the data volume")
        c.ok("export-bundle" in inits, f"export init container missing (init containers: {sorted(inits)})")
        ex = inits["export-bundle"]
        c.eq(ex["image"], main["image"], "export init container image (same image as the server)")
        script = " ".join(ex.get("command") or []) + " " + " ".join(ex.get("args") or [])
        for word in ("mossrt export", "--model", "--codec", "--out", "--dtype", "--compute-dtype", "manifest.json"):
            c.ok(word in script, f"export init container script lacks {word!r}")
        c.eq(env_value(ex, "MOSSRT_BUNDLE"), v["bundlePath"], "export env MOSSRT_BUNDLE")
        c.eq(env_value(ex, "MOSSRT_EXPORT_MODEL"), v["export"]["model"], "export env MOSSRT_EXPORT_MODEL")
        c.eq(env_value(ex, "MOSSRT_EXPORT_CODEC"), v["export"]["codec"], "export env MOSSRT_EXPORT_CODEC")
        c.eq(env_value(ex, "MOSSRT_EXPORT_DTYPE"), v["export"]["dtype"], "export env MOSSRT_EXPORT_DTYPE")
        c.eq(env_value(ex, "MOSSRT_EXPORT_COMPUTE_DTYPE"), v["export"]["computeDtype"],
             "export env MOSSRT_EXPORT_COMPUTE_DTYPE")
        c.ok(any(m["mountPath"] == data_path and m["name"] == mounts[data_path]["name"]
                 for m in ex.get("volumeMounts") or []), "export init container does not mount the data volume")
        c.ok(not any(is_gpu_resource(k) for k in (ex.get("resources") or {}).get("limits", {}) or {}),
             "export init container requests a GPU")
        tok = get(v, "export.hfToken.secretName")
        hf = env_map(ex).get("HF_TOKEN")
        if tok:
            ref = (hf or {}).get("valueFrom", {}).get("secretKeyRef", {})
            c.eq((ref.get("name"), ref.get("key")), (tok, get(v, "export.hfToken.secretKey")), "HF_TOKEN secretKeyRef")
        else:
            c.ok(hf is None, "HF_TOKEN set without export.hfToken.secretName")
    else:
        c.ok("export-bundle" not in inits, "export init container present although export.enabled is false")
    if v["bundleImage"]["enabled"]:
        c.ok("copy-bundle" in inits, "bundleImage copy init container missing")
        cp = inits["copy-bundle"]
        c.eq(cp["image"], f"{v['bundleImage']['repository']}:{v['bundleImage']['tag']}", "bundle image")
        bmount = mounts.get(v["bundlePath"])
        c.ok(bmount and "emptyDir" in volumes.get(bmount["name"], {}),
             "bundleImage: the bundle emptyDir is not mounted at bundlePath in the server")
        assert bmount is not None                      # c.ok raised otherwise
        c.ok(any(m["mountPath"] == v["bundlePath"] and m["name"] == bmount["name"]
                 for m in cp.get("volumeMounts") or []), "copy-bundle does not write into the bundle volume")
    else:
        c.ok("copy-bundle" not in inits, "copy-bundle present although bundleImage.enabled is false")

    # GPU vs CPU
    limits = (main.get("resources") or {}).get("limits") or {}
    requests = (main.get("resources") or {}).get("requests") or {}
    tolerations = pod.get("tolerations") or []
    gpu_tol = [t for t in tolerations if t.get("key") == "nvidia.com/gpu"]
    if v["gpu"]["enabled"]:
        res = v["gpu"]["resourceName"]
        c.eq(limits.get(res), v["gpu"]["count"], f"GPU limit {res}")
        c.eq(env_value(main, "MOSSRT_DEVICE"), v["server"].get("device") or "cuda", "env MOSSRT_DEVICE with a GPU")
        ns = pod.get("nodeSelector") or {}
        for k, val in (v["gpu"].get("nodeSelector") or {}).items():
            c.eq(ns.get(k), val, f"GPU nodeSelector {k}")
        c.ok(any(t.get("effect") == "NoSchedule" for t in gpu_tol),
             f"no nvidia.com/gpu NoSchedule toleration: {tolerations}")
        if v["gpu"].get("runtimeClassName"):
            c.eq(pod.get("runtimeClassName"), v["gpu"]["runtimeClassName"], "runtimeClassName")
    else:
        for x in [*containers.values(), *inits.values()]:
            r = x.get("resources") or {}
            for k in [*(r.get("limits") or {}), *(r.get("requests") or {})]:
                c.ok(not is_gpu_resource(k), f"{x['name']} asks for {k} without gpu.enabled")
        c.eq(env_value(main, "MOSSRT_DEVICE"), v["server"].get("device") or "cpu", "env MOSSRT_DEVICE on CPU")
        c.ok(not gpu_tol, "nvidia.com/gpu toleration without gpu.enabled")
        c.ok("runtimeClassName" not in pod, "runtimeClassName without gpu.enabled")
    for k, val in (v.get("resources") or {}).get("requests", {}).items():
        c.eq(requests.get(k), val, f"resources.requests.{k}")

    # API keys
    secrets = by_kind(docs, "Secret")
    keys_env = env_map(main).get("MOSSRT_API_KEYS")
    if v.get("existingSecret") or v.get("apiKeys"):
        ref = (keys_env or {}).get("valueFrom", {}).get("secretKeyRef")
        c.ok(ref, "MOSSRT_API_KEYS is not taken from a Secret")
        c.eq(ref["key"], v["existingSecretKey"], "MOSSRT_API_KEYS secret key")
        if v.get("existingSecret"):
            c.eq(ref["name"], v["existingSecret"], "MOSSRT_API_KEYS secret name (existingSecret)")
            c.eq(len(secrets), 0, "a Secret rendered although existingSecret is set")
        else:
            match = [s for s in secrets if s["metadata"]["name"] == ref["name"]]
            c.eq(len(match), 1, f"Secret {ref['name']} referenced by MOSSRT_API_KEYS rendered")
            raw = (match[0].get("data") or {}).get(ref["key"])
            c.ok(raw, f"Secret {ref['name']} has no key {ref['key']}")
            assert raw is not None                     # c.ok raised otherwise
            c.eq(base64.b64decode(raw).decode(), ",".join(v["apiKeys"]), "API keys in the Secret")
    else:
        c.ok(keys_env is None, "MOSSRT_API_KEYS set without apiKeys/existingSecret")
        c.eq(len(secrets), 0, "a Secret rendered without apiKeys")

    # ServiceAccount
    if v["serviceAccount"]["create"]:
        sas = by_kind(docs, "ServiceAccount")
        c.eq([s["metadata"]["name"] for s in sas], [pod.get("serviceAccountName")], "ServiceAccount vs pod")

    # ---- Service
    svcs = by_kind(docs, "Service")
    c.eq(len(svcs), 1, "number of Services")
    svc = svcs[0]
    c.eq(svc["spec"].get("type"), "ClusterIP", "Service type")
    sports = svc["spec"]["ports"]
    c.ok(any(p.get("name") == "http" and p.get("port") == 8000 and p.get("targetPort") in ("http", port)
             for p in sports), f"Service port 8000 named http missing: {sports}")
    ssel = svc["spec"]["selector"]
    c.ok(ssel and all(pod_labels.get(k) == val for k, val in ssel.items()), "Service selector misses the pods")
    svc_name = svc["metadata"]["name"]

    # ---- Ingress
    ings = by_kind(docs, "Ingress")
    if v["ingress"]["enabled"]:
        c.eq(len(ings), 1, "number of Ingresses")
        ing = ings[0]
        ann = ing["metadata"].get("annotations") or {}
        if v["ingress"].get("nginx"):
            want = {
                "nginx.ingress.kubernetes.io/proxy-read-timeout": "3600",
                "nginx.ingress.kubernetes.io/proxy-send-timeout": "3600",
                "nginx.ingress.kubernetes.io/proxy-buffering": "off",
            }
            for k, val in want.items():
                c.eq(ann.get(k), str(val), f"Ingress annotation {k}")
            aff = v["ingress"]["affinity"]
            if aff == "header":
                hdr = "$http_" + v["ingress"]["sessionHeader"].lower().replace("-", "_")
                c.eq(ann.get("nginx.ingress.kubernetes.io/upstream-hash-by"), hdr, "Ingress upstream-hash-by")
            elif aff == "cookie":
                c.eq(ann.get("nginx.ingress.kubernetes.io/affinity"), "cookie", "Ingress cookie affinity")
        backends = [p["backend"]["service"] for r in ing["spec"]["rules"] for p in r["http"]["paths"]]
        c.ok(backends, "Ingress has no backends")
        for b in backends:
            c.eq(b["name"], svc_name, "Ingress backend service")
            c.ok(b["port"].get("name") == "http" or b["port"].get("number") == 8000,
                 f"Ingress backend port {b['port']}")
    else:
        c.eq(len(ings), 0, "Ingresses rendered although ingress.enabled is false")
        for d in docs:
            annotations = d["metadata"].get("annotations") or {}
            c.ok(not any(k.startswith("nginx.ingress.kubernetes.io/") for k in annotations),
                 f"{d['kind']} carries ingress-nginx annotations without an Ingress")

    # ---- HTTPRoute
    routes = by_kind(docs, "HTTPRoute")
    if v["httpRoute"]["enabled"]:
        c.eq(len(routes), 1, "number of HTTPRoutes")
        r = routes[0]
        c.eq(r["apiVersion"], "gateway.networking.k8s.io/v1", "HTTPRoute apiVersion")
        c.eq(r["spec"]["parentRefs"], v["httpRoute"]["parentRefs"], "HTTPRoute parentRefs")
        rule = r["spec"]["rules"][0]
        c.eq([(b["name"], b["port"]) for b in rule["backendRefs"]], [(svc_name, 8000)], "HTTPRoute backendRefs")
        if v["httpRoute"].get("timeouts"):
            c.eq(rule.get("timeouts"), v["httpRoute"]["timeouts"], "HTTPRoute timeouts")
    else:
        c.eq(len(routes), 0, "HTTPRoutes rendered although httpRoute.enabled is false")

    # ---- autoscaling
    a = v["autoscaling"]
    sos = by_kind(docs, "ScaledObject")
    hpas = by_kind(docs, "HorizontalPodAutoscaler")

    def check_behavior(behavior: dict, what: str) -> None:
        win = (behavior or {}).get("scaleDown", {}).get("stabilizationWindowSeconds")
        c.ok(isinstance(win, int) and win >= 300, f"{what} scaleDown stabilizationWindowSeconds {win} < 300 s")

    if a["enabled"] and a["kind"] == "keda":
        c.eq(len(sos), 1, "number of KEDA ScaledObjects")
        c.eq(len(hpas), 0, "HPAs rendered next to a ScaledObject (KEDA creates its own)")
        so = sos[0]["spec"]
        c.eq(so["scaleTargetRef"]["name"], dep["metadata"]["name"], "ScaledObject scaleTargetRef")
        c.eq((so["minReplicaCount"], so["maxReplicaCount"]), (a["minReplicas"], a["maxReplicas"]),
             "ScaledObject min/max")
        trig = so["triggers"]
        c.eq([t["type"] for t in trig], ["prometheus"], "ScaledObject trigger types")
        md = trig[0]["metadata"]
        c.ok("mossrt_generating_streams" in md["query"] and "mossrt_queued_streams" in md["query"]
             and "mossrt_active_streams" not in md["query"],
             f"KEDA query is not on generating turns + waiting streams: {md['query']}")
        c.ok("mossrt_capacity_streams" in md["query"], f"KEDA query lacks mossrt_capacity_streams: {md['query']}")
        c.eq(md["serverAddress"], a["keda"]["serverAddress"], "KEDA serverAddress")
        c.eq(float(md["threshold"]), float(a["targetUtilization"]), "KEDA threshold")
        check_behavior(so.get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior"), "ScaledObject")
        if a["keda"].get("fallback"):
            c.eq(so.get("fallback"), a["keda"]["fallback"], "ScaledObject fallback")
    else:
        c.eq(len(sos), 0, "ScaledObjects rendered without autoscaling.kind keda")
    if a["enabled"] and a["kind"] == "hpa":
        c.eq(len(hpas), 1, "number of HPAs")
        h = hpas[0]
        c.eq(h["apiVersion"], "autoscaling/v2", "HPA apiVersion")
        hs = h["spec"]
        c.eq(hs["scaleTargetRef"]["name"], dep["metadata"]["name"], "HPA scaleTargetRef")
        pods_metrics = [m["pods"] for m in hs["metrics"] if m["type"] == "Pods"]
        c.eq([m["metric"]["name"] for m in pods_metrics], [a["hpa"]["metricName"]], "HPA Pods metric")
        # the metric is the README's prometheus-adapter rule: per pod, generating turns + waiting streams (the
        # KEDA query's load), never open sockets (an idle conversation gives its slot up to a waiter)
        rule = adapter_rule()
        c.eq(rule["name"]["as"], a["hpa"]["metricName"], "HPA Pods metric vs the README's prometheus-adapter rule")
        c.eq(rule["resources"]["overrides"], {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}},
             "prometheus-adapter rule resources")
        q = rule["metricsQuery"]
        c.ok("mossrt_generating_streams" in q and "mossrt_queued_streams" in q and "mossrt_active_streams" not in q,
             f"prometheus-adapter query is not on generating turns + waiting streams: {q}")
        c.ok(q.startswith("sum by (<<.GroupBy>>) (") and "<<.LabelMatchers>>" in q,
             f"prometheus-adapter query is not one sum per pod over the matched series: {q}")
        c.eq(pods_metrics[0]["target"], {"type": "AverageValue", "averageValue": str(a["hpa"]["targetAverageValue"])},
             "HPA Pods metric target")
        if a["hpa"].get("cpuAverageUtilization") is not None:
            cpu = [m["resource"] for m in hs["metrics"] if m["type"] == "Resource"]
            c.eq([(m["name"], m["target"].get("averageUtilization")) for m in cpu],
                 [("cpu", a["hpa"]["cpuAverageUtilization"])], "HPA CPU fallback metric")
        check_behavior(hs.get("behavior"), "HPA")
    else:
        c.eq(len(hpas), 0, "HPAs rendered without autoscaling.kind hpa")

    # ---- PDB
    pdbs = by_kind(docs, "PodDisruptionBudget")
    if v["podDisruptionBudget"]["enabled"]:
        c.eq(len(pdbs), 1, "number of PodDisruptionBudgets")
        ps = pdbs[0]["spec"]
        c.eq(pdbs[0]["apiVersion"], "policy/v1", "PDB apiVersion")
        c.ok(all(pod_labels.get(k) == val for k, val in ps["selector"]["matchLabels"].items()), "PDB selector")
        pv = v["podDisruptionBudget"]
        if pv.get("minAvailable") is not None:
            c.eq(ps.get("minAvailable"), pv["minAvailable"], "PDB minAvailable")
        else:
            c.eq(ps.get("maxUnavailable"), pv["maxUnavailable"], "PDB maxUnavailable")
    else:
        c.eq(len(pdbs), 0, "PDBs rendered although podDisruptionBudget.enabled is false")

    # ---- ServiceMonitor
    sms = by_kind(docs, "ServiceMonitor")
    if v["serviceMonitor"]["enabled"]:
        c.eq(len(sms), 1, "number of ServiceMonitors")
        ep = sms[0]["spec"]["endpoints"][0]
        c.eq((ep["port"], ep["path"], ep["interval"]), ("http", "/metrics", v["serviceMonitor"]["interval"]),
             "ServiceMonitor endpoint")
        c.ok(all(svc["metadata"]["labels"].get(k) == val
                 for k, val in sms[0]["spec"]["selector"]["matchLabels"].items()),
             "ServiceMonitor selector misses the Service")
    else:
        c.eq(len(sms), 0, "ServiceMonitors rendered although serviceMonitor.enabled is false")

    # ---- PrometheusRule: the rules file as it is, under the operator's CRD
    rules = by_kind(docs, "PrometheusRule")
    if v["prometheusRule"]["enabled"]:
        c.eq(len(rules), 1, "number of PrometheusRules")
        c.eq(rules[0]["apiVersion"], "monitoring.coreos.com/v1", "PrometheusRule apiVersion")
        want = yaml.safe_load((Path(__file__).resolve().parents[1] / "mossrt" / "files" / "prometheus-rules.yaml")
                              .read_text())
        c.eq(rules[0]["spec"], want, "PrometheusRule spec differs from files/prometheus-rules.yaml")
        for key, val in v["prometheusRule"]["additionalLabels"].items():
            c.eq(rules[0]["metadata"]["labels"].get(key), val, f"PrometheusRule label {key}")
    else:
        c.eq(len(rules), 0, "PrometheusRules rendered although prometheusRule.enabled is false")

    # ---- Grafana dashboard ConfigMap: the JSON as it is, under the sidecar's label
    maps = [d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-dashboard")]
    if v["dashboard"]["enabled"]:
        c.eq(len(maps), 1, "number of dashboard ConfigMaps")
        c.eq(maps[0]["metadata"]["labels"].get(v["dashboard"]["label"]), str(v["dashboard"]["labelValue"]),
             "dashboard ConfigMap's sidecar label")
        want = json.loads((Path(__file__).resolve().parents[1] / "mossrt" / "files" / "grafana-dashboard.json")
                          .read_text())
        c.eq(json.loads(maps[0]["data"]["mossrt.json"]), want, "dashboard ConfigMap differs from the JSON")
    else:
        c.eq(len(maps), 0, "dashboard ConfigMap rendered although dashboard.enabled is false")

    # ---- scrape annotations (Prometheus without the operator): the container's port and the metrics path
    ann = spec["template"]["metadata"].get("annotations") or {}
    if v["scrapeAnnotations"]:
        c.eq((ann.get("prometheus.io/scrape"), ann.get("prometheus.io/port"), ann.get("prometheus.io/path")),
             ("true", str(v["server"]["port"]), v["serviceMonitor"]["path"]), "pod scrape annotations")
    else:
        c.ok(not any(k.startswith("prometheus.io/") for k in ann), "scrape annotations although disabled")

    return kinds


# What each ci values file is there to exercise: keeps the files from drifting away from their purpose.
PURPOSE: dict[str, dict[str, object]] = {
    "default": {"gpu.enabled": False, "ingress.enabled": False, "httpRoute.enabled": False,
                "autoscaling.enabled": False, "export.enabled": True, "wyoming.enabled": False},
    "cpu-values": {"gpu.enabled": False, "server.device": "", "wyoming.enabled": True,
                   "wyoming.allowKeylessRemote": True, "wyoming.maxSessions": 16,
                   "server.parkedContextBytes": 2147483648, "server.wsMaxSessions": 200,
                   "server.engineProcess": "on", "server.apiWorkers": 2},
    "gpu-values": {"gpu.enabled": True},
    "ingress-values": {"ingress.enabled": True, "ingress.nginx": True},
    "noingress-values": {"ingress.enabled": False, "httpRoute.enabled": False},
    "httproute-values": {"httpRoute.enabled": True},
    "autoscaling-keda-values": {"autoscaling.enabled": True, "autoscaling.kind": "keda",
                                "podDisruptionBudget.enabled": True},
    "autoscaling-hpa-values": {"autoscaling.enabled": True, "autoscaling.kind": "hpa"},
}
REQUIRED = ["default", *[k for k in PURPOSE if k != "default"]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--chart", default="helm/mossrt", type=Path)
    ap.add_argument("--rendered", required=True, type=Path, help="directory of rendered <name>.yaml files")
    args = ap.parse_args()

    chart = yaml.safe_load((args.chart / "Chart.yaml").read_text())
    defaults = yaml.safe_load((args.chart / "values.yaml").read_text())
    files = sorted(args.rendered.glob("*.yaml"))
    names = [f.stem for f in files]
    missing = [n for n in REQUIRED if n not in names]
    if missing:
        print(f"FAIL: rendered manifests missing for {missing} in {args.rendered}", file=sys.stderr)
        return 1

    total = 0
    for f in files:
        name = f.stem
        c = Checker()
        try:
            if name == "default":
                values = defaults
            else:
                vf = args.chart / "ci" / f"{name}.yaml"
                c.ok(vf.is_file(), f"no values file {vf} for {f.name}")
                values = coalesce(defaults, yaml.safe_load(vf.read_text()) or {})
            for key, want in PURPOSE.get(name, {}).items():
                c.eq(get(values, key), want, f"values {key} (what {name} is meant to exercise)")
            docs = load_docs(f)
            c.ok(docs, "nothing rendered")
            kinds = check_manifests(c, docs, values, chart)
        except CheckFailed as e:
            print(f"FAIL {f.name}: {e}", file=sys.stderr)
            return 1
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            print(f"FAIL {f.name}: malformed manifest ({type(e).__name__}: {e})", file=sys.stderr)
            return 1
        total += c.count
        print(f"ok   {f.name:32s} {c.count:4d} checks  [{', '.join(kinds)}]")
    print(f"render checks passed: {len(files)} files, {total} checks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
