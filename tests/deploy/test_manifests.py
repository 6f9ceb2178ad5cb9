"""deploy/k8s: every overlay renders, every object validates against the Kubernetes schema, and the pieces fit
together (probes on /health, Service ports on container ports, the router on the engines' headless Service,
Prometheus on /metrics, only flags `g4serve` accepts).

The overlays are rendered by a small renderer of the kustomize subset they use (resources, components,
strategic-merge patches), so CI needs no kubectl; where `kubectl` is on PATH, its `kubectl kustomize` output
must equal the renderer's."""

from __future__ import annotations

import argparse
import copy
import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
# The oldest Kubernetes the manifests claim (the preStop `sleep` action is on by default from 1.30) and the
# newest whose schemas the pinned kubernetes-validate bundles.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
CLUSTER_DOMAIN = "cluster.local"
# Flags of work in progress (issue 24): an overlay using one is checked once `g4serve` has it, skipped before.
PENDING_FLAGS = {"serve": {"--tensor-parallel-size"}}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet"}

# (overlay, components added on top of it): every overlay alone, and the optional components on a GPU one.
RENDERS = {
    "cpu-tiny": ("overlays/cpu-tiny", ()),
    "gpu-e4b": ("overlays/gpu-e4b", ()),
    "gpu-31b-tp2": ("overlays/gpu-31b-tp2", ()),
    "gpu-e4b+servicemonitor+assistant": (
        "overlays/gpu-e4b",
        ("components/servicemonitor", "components/assistant"),
    ),
}

# --- a renderer of the kustomize subset deploy/k8s uses ----------------------------------------------------

# Strategic merge: lists of these fields merge item by item on the key (kubernetes' patchMergeKey); the
# rest of the lists are replaced whole, as kustomize does.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}


def strategic_merge(base: object, patch: object, field: str = "") -> object:
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = strategic_merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return out
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        patched = {item[key]: item for item in patch}
        # kustomize puts the patch's new items first, then the base's (merged with their patch items).
        new = [copy.deepcopy(item) for item in patch if item[key] not in {b[key] for b in base}]
        return new + [strategic_merge(b, patched[b[key]], "") if b[key] in patched else b for b in base]
    return copy.deepcopy(patch)


def _identity(doc: dict) -> tuple[str, str, str]:
    return doc["kind"], doc["metadata"].get("namespace", ""), doc["metadata"]["name"]


def _load_yaml(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _apply(kustomization_dir: Path, docs: list[dict], expected_kind: str) -> list[dict]:
    spec = _load_yaml(kustomization_dir / "kustomization.yaml")[0]
    assert spec["kind"] == expected_kind, kustomization_dir
    unsupported = set(spec) - {"apiVersion", "kind", "resources", "components", "patches"}
    assert not unsupported, f"{kustomization_dir}: the test's renderer does not implement {unsupported}"
    for entry in spec.get("resources", []):
        path = kustomization_dir / entry
        docs += render(path) if path.is_dir() else _load_yaml(path)
    for entry in spec.get("components", []):
        docs = _apply(kustomization_dir / entry, docs, "Component")
    for entry in spec.get("patches", []):
        assert set(entry) == {"path"}, f"{kustomization_dir}: only file patches are implemented: {entry}"
        for patch in _load_yaml(kustomization_dir / entry["path"]):
            targets = [i for i, doc in enumerate(docs) if _identity(doc) == _identity(patch)]
            assert len(targets) == 1, f"{kustomization_dir}: patch {_identity(patch)} matches {len(targets)}"
            docs[targets[0]] = strategic_merge(docs[targets[0]], patch)
    return docs


def render(path: Path) -> list[dict]:
    return _apply(path, [], "Kustomization")


def render_case(case: str) -> list[dict]:
    overlay, components = RENDERS[case]
    docs = render(K8S / overlay)
    for component in components:
        docs = _apply(K8S / component, docs, "Component")
    return docs


@pytest.fixture(scope="module", params=sorted(RENDERS))
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render_case(request.param)


# --- helpers over the rendered objects ---------------------------------------------------------------------


def _by_kind(docs: list[dict], *kinds: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] in kinds]


def _containers(workload: dict) -> list[dict]:
    return workload["spec"]["template"]["spec"]["containers"]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _pods_selected(docs: list[dict], namespace: str, selector: dict) -> list[dict]:
    return [
        w
        for w in _by_kind(docs, *WORKLOADS)
        if w["metadata"]["namespace"] == namespace
        and _selects(selector, w["spec"]["template"]["metadata"]["labels"])
    ]


def _container_port(container: dict, port: int | str) -> int | None:
    for p in container.get("ports", []):
        if port in (p.get("name"), p["containerPort"]):
            return p["containerPort"]
    return None


def _arg_values(args: list[str]) -> dict[str, str]:
    """``--flag=value`` and ``--flag value`` pairs (bare flags map to '')."""
    values: dict[str, str] = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            flag, eq, value = arg.partition("=")
            if not eq and i + 1 < len(args) and not args[i + 1].startswith("-"):
                value = args[i + 1]
            values[flag] = value
    return values


def _engine_and_router(docs: list[dict]) -> tuple[dict, dict]:
    by_component = {
        w["metadata"]["labels"]["app.kubernetes.io/component"]: w for w in _by_kind(docs, *WORKLOADS)
    }
    return by_component["engine"], by_component["router"]


# --- the tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schema(rendered, version):
    _, docs = rendered
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no bundled schema (test_servicemonitors_scrape_the_services' ports checks it)
        error = None
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            error = exc  # reported outside the handler: the chained traceback prints the whole schema
        if error is not None:
            where = "/".join(str(part) for part in error.absolute_path)
            pytest.fail(f"{_identity(doc)} against Kubernetes {version}, at {where}: {error.message[:300]}")


def test_kubectl_kustomize_renders_what_the_test_renders(rendered, tmp_path):
    case, docs = rendered
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not on PATH: the overlays were rendered by the test's own renderer only")
    overlay, components = RENDERS[case]
    rel = os.path.relpath(K8S, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        yaml.safe_dump(
            {
                "apiVersion": "kustomize.config.k8s.io/v1beta1",
                "kind": "Kustomization",
                "resources": [f"{rel}/{overlay}"],
                "components": [f"{rel}/{c}" for c in components],
            }
        )
    )
    out = subprocess.run([kubectl, "kustomize", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    theirs = {_identity(doc): doc for doc in yaml.safe_load_all(out.stdout) if doc}
    ours = {_identity(doc): doc for doc in docs}
    assert sorted(theirs) == sorted(ours)
    for identity, doc in ours.items():
        assert doc == theirs[identity], identity


def test_names_are_unique_and_everything_is_in_one_namespace(rendered):
    _, docs = rendered
    identities = [_identity(doc) for doc in docs]
    assert len(identities) == len(set(identities))
    namespaces = {doc["metadata"].get("namespace") for doc in docs if doc["kind"] != "Namespace"}
    assert namespaces == {doc["metadata"]["name"] for doc in _by_kind(docs, "Namespace")}


def test_every_probe_asks_health_on_a_declared_port(rendered):
    _, docs = rendered
    for workload in _by_kind(docs, *WORKLOADS):
        for c in _containers(workload):
            assert "readinessProbe" in c and "livenessProbe" in c, (workload["metadata"]["name"], c["name"])
            assert c["readinessProbe"]["httpGet"]["path"] == "/health", c["name"]
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if kind not in c:
                    continue
                if "tcpSocket" in c[kind]:
                    # The router's /health is 503 while no engine is healthy: no reason to restart it.
                    assert (c["name"], kind) == ("router", "livenessProbe"), (c["name"], kind)
                    assert _container_port(c, c[kind]["tcpSocket"]["port"]) is not None
                    continue
                assert c[kind]["httpGet"]["path"] == "/health", (c["name"], kind)
                assert _container_port(c, c[kind]["httpGet"]["port"]) is not None, (c["name"], kind)


def test_services_select_pods_and_target_their_ports(rendered):
    _, docs = rendered
    for svc in _by_kind(docs, "Service"):
        pods = _pods_selected(docs, svc["metadata"]["namespace"], svc["spec"]["selector"])
        assert pods, f"Service {svc['metadata']['name']} selects no pods"
        for port in svc["spec"]["ports"]:
            for workload in pods:
                found = [_container_port(c, port["targetPort"]) for c in _containers(workload)]
                assert any(found), (svc["metadata"]["name"], port, workload["metadata"]["name"])


def test_router_discovers_the_engines_through_their_headless_service(rendered):
    _, docs = rendered
    engine, router = _engine_and_router(docs)
    engine_labels = engine["spec"]["template"]["metadata"]["labels"]
    headless = [
        s
        for s in _by_kind(docs, "Service")
        if s["spec"].get("clusterIP") == "None" and _selects(s["spec"]["selector"], engine_labels)
    ]
    assert len(headless) == 1
    svc = headless[0]
    (port,) = svc["spec"]["ports"]
    expected = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.{CLUSTER_DOMAIN}:{port['port']}"
    (router_container,) = _containers(router)
    assert _arg_values(router_container["args"])["--discover-dns"] == expected
    # ... and the engine listens where the Service sends it.
    (engine_container,) = _containers(engine)
    engine_args = _arg_values(engine_container["args"])
    assert int(engine_args["--port"]) == _container_port(engine_container, port["targetPort"])
    assert engine_args["--host"] == "0.0.0.0"


def test_prometheus_scrapes_metrics_on_a_declared_port(rendered):
    _, docs = rendered
    for workload in _by_kind(docs, *WORKLOADS):
        annotations = workload["spec"]["template"]["metadata"].get("annotations", {})
        assert annotations.get("prometheus.io/scrape") == "true", workload["metadata"]["name"]
        assert annotations["prometheus.io/path"] == "/metrics"
        ports = [_container_port(c, int(annotations["prometheus.io/port"])) for c in _containers(workload)]
        assert any(ports), workload["metadata"]["name"]
        for c in _containers(workload):
            if c["command"] == ["g4serve"] and c["args"][0] in ("serve", "assistant"):
                # With an API key /metrics needs it too unless it is public (`g4serve serve --help`).
                assert "--metrics-public" in c["args"], c["name"]


def test_servicemonitors_scrape_the_services_ports(rendered):
    _, docs = rendered
    for monitor in _by_kind(docs, "ServiceMonitor"):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        services = [
            s
            for s in _by_kind(docs, "Service")
            if s["metadata"]["namespace"] == monitor["metadata"]["namespace"]
            and _selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        assert len(services) == 1, monitor["metadata"]["name"]
        names = {p["name"] for p in services[0]["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in names and endpoint["path"] == "/metrics"


def test_disruption_budgets_cover_the_workloads(rendered):
    _, docs = rendered
    covered = set()
    for pdb in _by_kind(docs, "PodDisruptionBudget"):
        pods = _pods_selected(docs, pdb["metadata"]["namespace"], pdb["spec"]["selector"]["matchLabels"])
        assert pods, pdb["metadata"]["name"]
        covered |= {w["metadata"]["name"] for w in pods}
    for workload in _by_kind(docs, *WORKLOADS):
        if workload["spec"].get("replicas", 1) > 1:
            assert workload["metadata"]["name"] in covered


def test_pods_run_unprivileged_on_a_read_only_root(rendered):
    _, docs = rendered
    for workload in _by_kind(docs, *WORKLOADS):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["automountServiceAccountToken"] is False
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in _containers(workload):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and "memory" in c["resources"][
                "limits"
            ]
            for mount in c.get("volumeMounts", []):
                assert mount["name"] in volumes, (c["name"], mount)
        claims = {
            v["persistentVolumeClaim"]["claimName"] for v in volumes.values() if "persistentVolumeClaim" in v
        }
        assert claims <= {doc["metadata"]["name"] for doc in _by_kind(docs, "PersistentVolumeClaim")}


def test_shutdown_outlasts_the_drain(rendered):
    _, docs = rendered
    for workload in _by_kind(docs, *WORKLOADS):
        pod = workload["spec"]["template"]["spec"]
        for c in _containers(workload):
            drain = float(_arg_values(c["args"]).get("--drain-timeout", 0))
            pause = c.get("lifecycle", {}).get("preStop", {}).get("sleep", {}).get("seconds", 0)
            assert pod["terminationGracePeriodSeconds"] > drain + pause, c["name"]


def test_gpu_overlays_ask_for_the_gpus_their_engine_uses(rendered):
    case, docs = rendered
    engine, _ = _engine_and_router(docs)
    (c,) = _containers(engine)
    args = _arg_values(c["args"])
    gpus = int(c["resources"]["limits"].get("nvidia.com/gpu", 0))
    if case.startswith("gpu-"):
        assert args["--device"] == "cuda"
        assert gpus == int(args.get("--tensor-parallel-size", 1))
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts["/models"]["readOnly"] is True and "/dev/shm" in mounts
        assert c["args"][1].startswith("/models/")  # the checkpoint, from the model volume
    else:
        assert gpus == 0 and args["--device"] == "cpu"


# --- the commands against g4serve's own argument parser ----------------------------------------------------


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from g4serve.cli import build_parser

    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def _commands() -> list[tuple[str, str, list[str]]]:
    commands = []
    for case in sorted(RENDERS):
        for workload in _by_kind(render_case(case), *WORKLOADS):
            for c in _containers(workload):
                assert c["command"] == ["g4serve"], c["command"]
                commands.append((case, f"{workload['metadata']['name']}/{c['name']}", c["args"]))
    # One check per distinct command line.
    unique = {(name, tuple(args)): case for case, name, args in commands}
    return [(case, name, list(args)) for (name, args), case in sorted(unique.items())]


@pytest.mark.parametrize("case, container, args", _commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_commands_use_only_flags_g4serve_accepts(case, container, args):
    subparsers = _subparsers()
    command = args[0]
    if command not in subparsers:
        pytest.skip(f"`g4serve {command}` is not a registered subcommand yet (issue 24 work in progress)")
    sub = subparsers[command]
    flags = [re.match(r"--[^=]+", a).group(0) for a in args[1:] if a.startswith("--")]
    unknown = [f for f in flags if f not in sub._option_string_actions]
    pending = [f for f in unknown if f in PENDING_FLAGS.get(command, ())]
    assert unknown == pending, f"{container} ({case}): `g4serve {command}` has no {unknown}"
    if pending:
        pytest.skip(
            f"{container} ({case}): `g4serve {command}` has no {pending} yet (issue 24 work in progress)"
        )
    try:
        sub.parse_args(args[1:])
    except SystemExit:
        pytest.fail(f"{container} ({case}): `g4serve {' '.join(args)}` does not parse (see stderr)")
    if command == "router":
        # A pod's port must be reachable from the Service: the router may not default to the loopback.
        host = _arg_values(args).get("--host") or sub.get_default("host")
        assert host in (None, "0.0.0.0", "::"), f"the router would listen on {host}: add --host=0.0.0.0"
