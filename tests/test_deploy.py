"""deploy/ tested for real where this machine allows (issue 14):

- Prometheus (Debian's package) scrapes a running `kvindex serve` that follows a simulated
  fleet, loads the alert rules, and every expression of the Grafana board, and each of its
  template variables, returns data from it;
- `promtool check rules` and `promtool test rules` (deploy/prometheus/*.test.yml) pass;
- the Kubernetes manifests validate against the API's schemas, offline
  (`kubernetes-validate`), and agree with the config and the container recipe;
- `systemd-analyze verify` accepts the unit.

`.ci/run` installs prometheus (promtool comes with it); elsewhere those tests skip.
The container recipe is checked, not built: no image registry is reachable here.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from clitools import ROOT, Proc, kvindex
from netutil import free_port, wait_until

from kvindex.cli import build_parser
from kvindex.cli.config import read_config

pytestmark = pytest.mark.timeout(120)

DEPLOY = ROOT / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
BOARD = DEPLOY / "grafana" / "kvindex-dashboard.json"
K8S = DEPLOY / "kubernetes"

# Board expressions that have no data yet, and why (strict: remove one when it has data).
PENDING: dict[str, str] = {}


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"{tool} is not installed (apt-get install prometheus; .ci/run does)")
    return path


# -- Prometheus rules ----------------------------------------------------------------------


def test_alert_rules_pass_promtool_check_and_their_unit_tests() -> None:
    promtool = need("promtool")
    check = subprocess.run(
        [promtool, "check", "rules", "kvindex-alerts.yml"],
        cwd=PROMETHEUS_DIR,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert "SUCCESS: 10 rules found" in check.stdout
    tests = subprocess.run(
        [promtool, "test", "rules", "kvindex-alerts.test.yml"],
        cwd=PROMETHEUS_DIR,
        capture_output=True,
        text=True,
    )
    assert tests.returncode == 0 and "SUCCESS" in tests.stdout, tests.stdout + tests.stderr
    config = subprocess.run(
        [promtool, "check", "config", "prometheus.yml"],
        cwd=PROMETHEUS_DIR,
        capture_output=True,
        text=True,
    )
    assert config.returncode == 0, config.stdout + config.stderr


def test_every_alert_has_a_unit_test_that_fires_it() -> None:
    rules = yaml.safe_load((PROMETHEUS_DIR / "kvindex-alerts.yml").read_text())
    alerts = {r["alert"] for group in rules["groups"] for r in group["rules"]}
    tests = yaml.safe_load((PROMETHEUS_DIR / "kvindex-alerts.test.yml").read_text())
    fired = {
        case["alertname"]
        for test in tests["tests"]
        for case in test["alert_rule_test"]
        if case.get("exp_alerts")
    }
    assert fired == alerts


# -- Prometheus against a running serve, and the Grafana board -----------------------------


class Stack:
    """A simulated fleet, `kvindex serve` following it, and Prometheus scraping serve."""

    def __init__(self, tmp: Path) -> None:
        self.procs: list[Proc | subprocess.Popen[bytes]] = []
        sim = kvindex("simulate", "--instances", "2", "--base-port", "0", "--rate", "40")
        self.procs.append(sim)
        sim.wait_for(sim.out, lambda line: line.startswith("  kvindex serve "), timeout=20)
        specs = [line.split()[0] for line in sim.out if line.startswith("  vllm-")]
        self.http_port = free_port()
        flags = [arg for spec in specs for arg in ("--instance", spec)]
        serve = kvindex(
            "serve", *flags, "--store", "memory", "--http", f"127.0.0.1:{self.http_port}"
        )
        self.procs.append(serve)
        serve.listening_url(timeout=20)
        self.prom_port = free_port()
        shutil.copy(PROMETHEUS_DIR / "kvindex-alerts.yml", tmp / "kvindex-alerts.yml")
        config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["scrape_configs"][0]["static_configs"] = [
            {"targets": [f"127.0.0.1:{self.http_port}"]}
        ]
        (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
        prometheus = subprocess.Popen(
            [
                need("prometheus"),
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.prom_port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp / "prometheus.log", "wb"),  # noqa: SIM115 (closed with the process)
        )
        self.procs.append(prometheus)

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        url = f"http://127.0.0.1:{self.prom_port}/api/v1/{path}?{query}"
        with urllib.request.urlopen(url, timeout=10) as r:
            body = json.loads(r.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[Any]:
        result: list[Any] = self.api("query", query=expr)["result"]
        return result

    def serve_json(self, method: str, path: str, body: object | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.http_port}{path}", data=data, method=method
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read())

    def look_up(self) -> None:
        """A lookup that hits (a block an engine holds) and one that misses."""
        held = self.serve_json("GET", "/v1/instances/vllm-0/blocks")["block_hashes"][:1]
        self.serve_json("POST", "/v1/lookup/hashes", {"block_hashes": held})
        self.serve_json("POST", "/v1/lookup", {"token_ids": [7, 7, 7]})

    def close(self) -> None:
        for proc in reversed(self.procs):
            if isinstance(proc, Proc):
                proc.interrupt()
                proc.finish(15)
            else:
                proc.terminate()
                proc.wait(15)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    need("prometheus")
    s = Stack(tmp_path_factory.mktemp("prometheus"))
    try:
        assert wait_until(lambda: _up(s), timeout=30), "Prometheus never scraped serve"
        assert wait_until(lambda: s.serve_json("GET", "/v1/stats")["blocks"] > 0, timeout=20)
        for _ in range(8):  # lookups over several scrapes, so that rates have two points
            s.look_up()
            time.sleep(1.0)
        yield s
    finally:
        s.close()


def _up(s: Stack) -> bool:
    try:
        return any(r["value"][1] == "1" for r in s.query('up{job="kvindex"}'))
    except OSError:
        return False


def board_expressions() -> list[tuple[str, str]]:
    board = json.loads(BOARD.read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def as_queried(expr: str) -> str:
    """What Grafana sends for the board's defaults (All selected), at a test's time scale."""
    for variable, value in (
        ("$__rate_interval", "30s"),
        ("$__range", "5m"),
        ("$job", ".+"),
        ("$engine", ".+"),
    ):
        expr = expr.replace(variable, value)
    return expr


def test_every_board_expression_returns_data_from_prometheus(stack: Stack) -> None:
    empty = []
    for title, expr in board_expressions():
        query = as_queried(expr)
        if not stack.query(query) and query not in PENDING:
            empty.append(f"{title}: {query}")
    assert empty == []
    still_pending = [q for q in PENDING if not stack.query(q)]
    assert still_pending == list(PENDING), "has data now: take it out of PENDING"


def test_board_variables_find_the_job_and_the_engines(stack: Stack) -> None:
    board = json.loads(BOARD.read_text())
    queries = {v["name"]: v.get("definition") for v in board["templating"]["list"]}
    assert queries["job"] == "label_values(kvindex_build_info, job)"
    assert stack.api("label/job/values", **{"match[]": "kvindex_build_info"}) == ["kvindex"]
    engines = stack.api("label/engine/values", **{"match[]": 'kvindex_engine_status{job=~".+"}'})
    assert engines == ["vllm-0", "vllm-1"]


def test_prometheus_loads_the_alert_rules_and_nothing_fires_on_a_healthy_fleet(
    stack: Stack,
) -> None:
    groups = stack.api("rules")["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert len(rules) == 10
    assert all(rule["health"] == "ok" for rule in rules), rules
    assert stack.api("alerts")["alerts"] == []


def test_board_is_well_formed() -> None:
    board = json.loads(BOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"] and panel["description"]
        assert panel["gridPos"]["x"] >= 0 and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
    metrics = {m for _, expr in board_expressions() for m in re.findall(r"kvindex_\w+", expr)}
    doc = (ROOT / "docs" / "operations.md").read_text()
    for metric in metrics:  # only documented metrics (histograms by their base name)
        assert f"`{re.sub(r'_bucket$', '', metric)}`" in doc, metric


# -- Kubernetes, systemd, the container --------------------------------------------------


def manifests() -> dict[str, dict[str, Any]]:
    """Each file's object by its name; a file of several, each as `NAME:KIND`."""
    out: dict[str, dict[str, Any]] = {}
    for path in K8S.glob("*.yaml"):
        docs = [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        if len(docs) == 1:
            out[path.name] = docs[0]
        else:
            out.update({f"{path.name}:{doc['kind']}": doc for doc in docs})
    return out


def test_kubernetes_manifests_validate_against_the_schemas() -> None:
    files = sorted(str(p) for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    run = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", *files],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    documents = sum(len([d for d in yaml.safe_load_all(Path(f).read_text()) if d]) for f in files)
    assert run.stdout.count("passed for resource") == documents
    kustomization = manifests()["kustomization.yaml"]
    listed = set(kustomization["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {
        "kustomization.yaml",
        "secret.example.yaml",  # made with a random token instead (see the file)
        "vllm-deployment.example.yaml",  # the engines are the user's: an example to copy
    }


def test_kubernetes_discovery_reads_pods_and_finds_the_example_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """rbac.yaml grants get/list/watch on pods and nothing more, to the Deployment's
    service account; the ConfigMap's selector matches the example vLLM pods, whose
    annotations say where their KV events are."""
    from kvindex.runtime.finders import k8sfind

    m = manifests()
    role, binding = m["rbac.yaml:Role"], m["rbac.yaml:RoleBinding"]
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    account = m["deployment.yaml"]["spec"]["template"]["spec"]["serviceAccountName"]
    assert m["rbac.yaml:ServiceAccount"]["metadata"]["name"] == account
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    (tmp_path / "token").write_text(m["secret.example.yaml"]["stringData"]["token"])
    toml = m["configmap.yaml"]["data"]["kvindex.toml"].replace("/etc/kvindex/secret", str(tmp_path))
    (tmp_path / "kvindex.toml").write_text(toml)
    settings = read_config(tmp_path / "kvindex.toml")
    (discover,) = settings.discover
    assert settings.min_engines == 1 and settings.instances  # the hand-written fallback
    # `k8s:?...`: the pod's own namespace, as its service account's mount says
    (tmp_path / "namespace").write_text("inference\n")
    monkeypatch.setattr(k8sfind, "SA_NAMESPACE", tmp_path / "namespace")
    target = k8sfind.parse_k8s(discover)
    assert target.namespace == "inference"
    template = m["vllm-deployment.example.yaml"]["spec"]["template"]
    labels = template["metadata"]["labels"]
    key, value = target.selector.split("=")
    assert labels[key] == value
    pod = {
        "metadata": {
            **template["metadata"],
            "name": "vllm-0",
            "namespace": "inference",
            "uid": "u",
        },
        "status": {"phase": "Running", "podIP": "10.1.0.7"},
    }
    spec = k8sfind.engine_of_pod(pod, discover).spec
    assert (spec.endpoint, spec.replay_endpoint) == ("tcp://10.1.0.7:5557", "tcp://10.1.0.7:5558")
    assert spec.http == "http://10.1.0.7:8000" and spec.model == "meta-llama/Llama-3.1-8B-Instruct"
    (container,) = template["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert (ports["kv-events"], ports["kv-replay"], ports["http"]) == (5557, 5558, 8000)
    events = next(a for a in container["args"] if a.startswith("--kv-events-config="))
    config = json.loads(events.split("=", 1)[1])
    assert (config["endpoint"], config["replay_endpoint"]) == ("tcp://*:5557", "tcp://*:5558")


def test_kubernetes_deployment_config_and_secret_agree(tmp_path: Path) -> None:
    m = manifests()
    pod = m["deployment.yaml"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # readiness waits at /healthz's start gate (min_engines); startup and liveness must
    # not restart a replica waiting there: /livez
    assert container["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    for probe in ("startupProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/livez", "port": "http"}
    assert container["ports"] == [{"name": "http", "containerPort": 8080, "protocol": "TCP"}]
    mounts = {v["name"]: v for v in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["token"]["secret"]["secretName"] == m["secret.example.yaml"]["metadata"]["name"]
    assert volumes["config"]["configMap"]["name"] == m["configmap.yaml"]["metadata"]["name"]
    # The config file, as mounted, loads; its token is the Secret's key, as mounted.
    args = build_parser().parse_args(container["args"])
    assert str(args.config) == mounts["config"]["mountPath"]
    toml = m["configmap.yaml"]["data"][mounts["config"]["subPath"]]
    secret_dir = mounts["token"]["mountPath"]
    (tmp_path / "token").write_text(m["secret.example.yaml"]["stringData"]["token"])
    (tmp_path / "kvindex.toml").write_text(toml.replace(secret_dir, str(tmp_path)))
    settings = read_config(tmp_path / "kvindex.toml")
    assert settings.http_options["token"] == m["secret.example.yaml"]["stringData"]["token"]
    assert settings.http.endswith(":8080") and settings.instances
    assert settings.store.startswith("sqlite:///" + mounts["state"]["mountPath"] + "/")
    service = m["service.yaml"]["spec"]
    assert service["selector"] == m["deployment.yaml"]["spec"]["selector"]["matchLabels"]
    assert pod["securityContext"]["runAsUser"] == _containerfile_user()


def _containerfile() -> str:
    return (DEPLOY / "Containerfile").read_text()


def _containerfile_user() -> int:
    (user,) = re.findall(r"^USER (\d+):\d+$", _containerfile(), re.M)
    return int(user)


def test_container_recipe_agrees_with_the_manifests() -> None:
    text = _containerfile()
    assert re.search(r"^EXPOSE 8080$", text, re.M)
    assert re.search(r"^STOPSIGNAL SIGTERM$", text, re.M)
    assert "/healthz" in text.split("HEALTHCHECK", 1)[1].split("\n\n")[0]
    for source in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), path
    (cmd,) = re.findall(r"^CMD (\[.*\])$", text, re.M)
    args = build_parser().parse_args(json.loads(cmd))
    assert args.command == "serve" and args.http == "0.0.0.0:8080"
    assert args.store.startswith("sqlite:////var/lib/kvindex/")
    assert re.search(r"^WORKDIR /var/lib/kvindex$", text, re.M)


def test_systemd_unit_verifies(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    text = (DEPLOY / "systemd" / "kvindex.service").read_text()
    (exec_start,) = re.findall(r"^ExecStart=(.+)$", text, re.M)
    argv = shlex.split(exec_start)
    assert build_parser().parse_args(argv[1:]).config == Path("/etc/kvindex/kvindex.toml")
    # verify wants the executable to exist: this checkout's own.
    here = text.replace(argv[0], str(Path(sys.executable).parent / "kvindex"))
    unit = tmp_path / "kvindex.service"
    unit.write_text(here)
    run = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stderr == "" and run.stdout == "", run.stderr
