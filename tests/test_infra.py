"""infra/ validates in CI, offline, and each validator is shown to reject a broken copy.

What is checked (nothing here builds an image or starts a container; CI cannot pull images):
- every Kubernetes manifest against the Kubernetes JSON schemas (kubernetes-validate, strict, so a
  misspelled field fails), and the KubeRay RayCluster, a CRD those schemas lack, against
  infra/schemas/raycluster.schema.json, whose pod templates point back at the Kubernetes schema;
- both compose files against the Compose Specification schema shipped in infra/schemas/;
- the exposure policy: the gateway is the one public door (compose: the only service with ports;
  Kubernetes: the only Service not ClusterIP), Prefect/MLflow/Ray/Postgres stay private, secrets
  come from env files or Secret references and never stand inline, a GPU worker stores jobs on S3;
- the glue between files and code: settings names, the gateway factory, pools, Ray version;
- the Dockerfiles' structure (FROM, the project installed, a CMD, COPY sources that exist).
"""

from __future__ import annotations

import copy
import importlib
import importlib.resources
import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from referencing import Registry, Resource

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
COMPOSE = INFRA / "compose"
K8S = INFRA / "k8s"
SCHEMAS = INFRA / "schemas"
K8S_VERSION = "1.30"

SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY|CONNECTION_URL|STORE_URI")
URL_WITH_PASSWORD = re.compile(r"://[^/@\s:]+:[^/@\s]+@")


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """CI has no network: any validator that tried to fetch a schema would fail here, not there."""
    def refuse(*args, **kwargs):
        raise OSError("tests/test_infra.py: no network in CI")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


# --- loading ------------------------------------------------------------------------------------


def k8s_documents(folder: Path = K8S) -> list[tuple[Path, dict]]:
    """Every manifest under infra/k8s (templates included), one entry per YAML document."""
    docs = []
    for path in sorted(folder.rglob("*.yaml")):
        docs += [(path, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def compose_files() -> dict[str, dict]:
    return {path.name: yaml.safe_load(path.read_text()) for path in sorted(COMPOSE.glob("*.yaml"))}


def read_env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def service_env(service: dict, folder: Path = COMPOSE) -> dict[str, str]:
    """What a compose service's process sees: its env files (secrets through their committed
    .example templates), then its `environment`, which wins as in compose."""
    env: dict[str, str] = {}
    for name in service.get("env_file", []):
        path = folder / name
        env |= read_env_file(path if path.exists() else path.with_name(path.name + ".example"))
    environment = service.get("environment", {})
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return env | {key: str(value) for key, value in environment.items()}


def command_text(service: dict) -> str:
    command = service.get("command", "")
    return command if isinstance(command, str) else " ".join(map(str, command))


# --- validators -----------------------------------------------------------------------------------


def kubernetes_definitions() -> Resource:
    """The Kubernetes definitions kubernetes-validate ships for K8S_VERSION (strict: no extra fields)."""
    folder = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema" / f"v{K8S_VERSION}.0-local-strict"
    return Resource.from_contents(json.loads((folder / "_definitions.json").read_text()))


def validate_raycluster(doc: dict) -> None:
    """Against infra/schemas/raycluster.schema.json, pod templates against the Kubernetes schema."""
    schema = json.loads((SCHEMAS / "raycluster.schema.json").read_text())
    registry = Registry().with_resource("https://kubernetes.io/api/_definitions.json", kubernetes_definitions())
    jsonschema.Draft202012Validator(schema, registry=registry).validate(doc)


def validate_manifest(doc: dict) -> None:
    if doc["kind"] == "RayCluster":
        validate_raycluster(doc)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def check_compose(*paths: Path) -> subprocess.CompletedProcess:
    """check-jsonschema against the shipped Compose Specification schema, as an operator runs it."""
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--schemafile", str(SCHEMAS / "compose-spec.json"), *map(str, paths)],
        capture_output=True, text=True, timeout=60,
        env={"PATH": "/usr/bin:/bin", "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"},
    )


# --- policies (lists of violations, so a test can show each one firing) -----------------------------


def compose_policy_violations(files: dict[str, dict], folder: Path = COMPOSE) -> list[str]:
    found = []
    for file, data in files.items():
        services = data["services"]
        one_shot = {name for svc in services.values() for name, dep in (svc.get("depends_on") or {}).items()
                    if isinstance(dep, dict) and dep.get("condition") == "service_completed_successfully"}
        for name, svc in services.items():
            where = f"{file}: {name}"
            if svc.get("ports") and name != "gateway":
                found.append(f"{where} publishes ports (only the gateway may)")
            mode, networks = svc.get("network_mode", ""), svc.get("networks", [])
            if not (mode.startswith("service:") or "private" in networks):
                found.append(f"{where} is not on the private network")
            if "edge" in networks and name != "gateway":
                found.append(f"{where} is on the edge network")
            if not svc.get("restart"):
                found.append(f"{where} has no restart policy")
            if name not in one_shot and "healthcheck" not in svc:
                found.append(f"{where} has no healthcheck")
            environment = svc.get("environment", {})
            for key, value in (environment.items() if isinstance(environment, dict) else []):
                if SECRET_NAME.search(key) or URL_WITH_PASSWORD.search(str(value)):
                    found.append(f"{where} sets {key} inline (secrets go in env files)")
            if URL_WITH_PASSWORD.search(command_text(svc)):
                found.append(f"{where} has a credential in its command")
            for env_file in svc.get("env_file", []):
                path = folder / env_file
                if env_file.startswith("secrets/"):
                    if not path.with_name(path.name + ".example").exists():
                        found.append(f"{where}: {env_file} has no committed .example template")
                elif any(SECRET_NAME.search(key) for key in read_env_file(path)):
                    found.append(f"{where}: {env_file} holds secrets outside secrets/")
        for name, net in data.get("networks", {}).items():
            if name == "private" and not (net.get("external") and net.get("name") == "opentinker-private"):
                found.append(f"{file}: the private network must be the external opentinker-private")
    gpu = files.get("gpu-worker.yaml", {}).get("services", {})
    for name, svc in gpu.items():
        storage = service_env(svc, folder).get("OPENTINKER_STORAGE_URL", "")
        if not storage.startswith("s3://"):
            found.append(f"gpu-worker.yaml: {name} stores jobs at {storage or 'the local default'} (must be s3://)")
    return found


def mappings(obj) -> list[dict]:
    """Every mapping nested anywhere in a parsed YAML document."""
    if isinstance(obj, dict):
        return [obj] + [m for value in obj.values() for m in mappings(value)]
    if isinstance(obj, list):
        return [m for item in obj for m in mappings(item)]
    return []


def pod_specs(doc: dict) -> list[dict]:
    spec = doc.get("spec", {})
    if doc["kind"] == "RayCluster":
        groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
        return [group["template"]["spec"] for group in groups]
    if doc["kind"] in ("Deployment", "StatefulSet", "Job"):
        return [spec["template"]["spec"]]
    return []


def k8s_policy_violations(docs: list[tuple[Path, dict]]) -> list[str]:
    found = []
    for path, doc in docs:
        where = f"{path.relative_to(K8S)}: {doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] == "Service" and doc["spec"].get("type", "ClusterIP") != "ClusterIP" and doc["metadata"]["name"] != "gateway":
            found.append(f"{where} is exposed as {doc['spec']['type']} (only the gateway may be)")
        if doc["kind"] == "Ingress":
            backends = {m["service"]["name"] for m in mappings(doc["spec"]) if "service" in m}
            if backends - {"gateway"}:
                found.append(f"{where} routes to {sorted(backends - {'gateway'})}")
        if doc["kind"] == "RayCluster":
            head = doc["spec"]["headGroupSpec"]
            if head.get("serviceType", "ClusterIP") != "ClusterIP" or head.get("enableIngress"):
                found.append(f"{where} exposes the Ray head")
        if doc["kind"] == "Secret" and path.parent == K8S:
            found.append(f"{where}: Secrets are not applied from infra/k8s (templates live in secrets/)")
        if doc["kind"] == "Secret" and any(v != "opentinker" and "CHANGE_ME" not in v for v in doc.get("stringData", {}).values()):
            found.append(f"{where} holds a value that is not a placeholder")
        if doc["kind"] == "ConfigMap" and any(SECRET_NAME.search(k) for k in doc.get("data", {})):
            found.append(f"{where} holds a secret")
        for pod in pod_specs(doc):
            if pod.get("hostNetwork"):
                found.append(f"{where} uses the host network")
            for container in pod["containers"]:
                if any("hostPort" in port for port in container.get("ports", [])):
                    found.append(f"{where} binds a host port")
                for env in container.get("env", []):
                    inline = "value" in env and (SECRET_NAME.search(env["name"]) or URL_WITH_PASSWORD.search(env["value"]))
                    if inline:
                        found.append(f"{where} sets {env['name']} inline (use secretKeyRef)")
                if URL_WITH_PASSWORD.search(" ".join(container.get("command", []) + container.get("args", []))):
                    found.append(f"{where} has a credential in its command")
    return found


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs: comments dropped, continuation lines joined."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in text.splitlines() if line.strip()]


def dockerfile_problems(path: Path) -> list[str]:
    steps = dockerfile_instructions(path)
    kinds = [kind for kind, _ in steps]
    found = []
    known = {"FROM", "ARG", "ENV", "RUN", "COPY", "WORKDIR", "USER", "EXPOSE", "CMD", "ENTRYPOINT", "LABEL", "HEALTHCHECK", "SHELL"}
    found += [f"unknown instruction {kind}" for kind in kinds if kind not in known]
    if not kinds or kinds[next(i for i, k in enumerate(kinds) if k != "ARG")] != "FROM":
        found.append("the first instruction (after ARGs) is not FROM")
    for kind, args in steps:
        if kind == "FROM" and not re.fullmatch(r"[\w./:${}-]+(@sha256:[0-9a-f]{64})?( AS \w+)?", args, re.I):
            found.append(f"FROM {args!r} does not parse")
        if kind == "COPY":
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            if len(words) < 2:
                found.append(f"COPY {args!r} needs a source and a destination")
            elif not args.startswith("--from"):
                found += [f"COPY source {src} is not in the build context" for src in words[:-1] if not (ROOT / src).exists()]
    runs = " ".join(args for kind, args in steps if kind == "RUN")
    if not re.search(r"pip install (-e )?['\"]?\.(\[[\w,]+\])?['\"]?(\s|$)", runs):
        found.append("the project is not installed (pip install [-e] .)")
    if not re.search(r"\btorch==\d+\.\d+\.\d+\b", runs):
        found.append("torch is not pinned (torch==X.Y.Z)")
    if not {"CMD", "ENTRYPOINT"} & set(kinds):
        found.append("no CMD or ENTRYPOINT")
    users = [args for kind, args in steps if kind == "USER"]
    if not users or users[-1] in ("root", "0"):
        found.append("runs as root")
    return found


# --- schema validation ------------------------------------------------------------------------------


@pytest.mark.parametrize("path_doc", k8s_documents(), ids=lambda pd: f"{pd[0].relative_to(K8S)}:{pd[1]['kind']}/{pd[1]['metadata']['name']}")
def test_kubernetes_manifest_validates(path_doc):
    validate_manifest(path_doc[1])


def test_kubernetes_folder_has_every_piece():
    kinds = {(doc["kind"], doc["metadata"]["name"]) for _, doc in k8s_documents()}
    for needed in [("Namespace", "opentinker"), ("ConfigMap", "opentinker-config"), ("Secret", "opentinker-secrets"),
                   ("RayCluster", "opentinker-ray"), ("Deployment", "prefect-server"), ("Service", "prefect-server"),
                   ("StatefulSet", "postgres"), ("Deployment", "mlflow"), ("Service", "mlflow"),
                   ("Deployment", "prefect-worker-cpu"), ("Deployment", "prefect-worker-gpu"),
                   ("Deployment", "gateway"), ("Service", "gateway")]:
        assert needed in kinds, needed


def test_compose_files_validate():
    result = check_compose(COMPOSE / "control-plane.yaml", COMPOSE / "gpu-worker.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_schema_is_the_spec():
    """The shipped schema is the Compose Specification's (from check-jsonschema's vendored copy)."""
    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    assert schema["title"] == "Compose Specification"
    assert {"services", "networks", "volumes", "secrets"} <= set(schema["properties"])


# --- policy ------------------------------------------------------------------------------------------


def test_compose_policy():
    assert compose_policy_violations(compose_files()) == []


def test_real_secret_files_are_ignored_by_git():
    for path in ["infra/compose/secrets/postgres.env", "infra/compose/secrets/s3.env", "infra/compose/secrets/ray.env"]:
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, f"{path} would be committed"
    assert subprocess.run(["git", "check-ignore", "-q", "infra/compose/secrets/s3.env.example"], cwd=ROOT).returncode == 1


def test_compose_services_do_what_the_design_says():
    control = compose_files()["control-plane.yaml"]["services"]
    gpu = compose_files()["gpu-worker.yaml"]["services"]
    assert service_env(control["prefect-server"])["PREFECT_API_DATABASE_CONNECTION_URL"].startswith("postgresql+asyncpg://")
    assert service_env(control["mlflow"])["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql://")
    assert "--artifacts-destination=s3://" in command_text(control["mlflow"])
    assert service_env(control["mlflow"])["MLFLOW_S3_ENDPOINT_URL"]
    assert "uvicorn --factory opentinker.control.gateway.app:create_app" in command_text(control["gateway"])
    assert "ray start --head --block" in command_text(control["ray-head"])
    assert "--pool gpu" in command_text(gpu["prefect-worker"])
    node = command_text(gpu["ray-node"])
    assert "ray start --block --address=" in node and "--num-gpus=" in node
    devices = gpu["ray-node"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]


def test_kubernetes_policy():
    docs = k8s_documents()
    assert k8s_policy_violations(docs) == []
    services = {doc["metadata"]["name"]: doc for _, doc in docs if doc["kind"] == "Service"}
    assert services["gateway"]["spec"]["type"] in ("LoadBalancer", "NodePort")


def test_kubernetes_secret_references_exist_in_the_template():
    docs = k8s_documents()
    template = next(doc for path, doc in docs if doc["kind"] == "Secret")
    refs = [m["secretKeyRef"] for _, doc in docs for m in mappings(doc) if "secretKeyRef" in m]
    assert refs and {ref["name"] for ref in refs} == {template["metadata"]["name"]}
    keys = {ref["key"] for ref in refs}
    assert keys <= set(template["stringData"]), keys - set(template["stringData"])


def test_kubernetes_gpu_group():
    ray = next(doc for _, doc in k8s_documents() if doc["kind"] == "RayCluster")
    group = next(g for g in ray["spec"]["workerGroupSpecs"] if g["groupName"] == "gpu")
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) >= 1
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]


def test_files_agree_with_the_code():
    """Names the infra files rely on exist in the code: settings, the gateway factory, the pools,
    the Ray version, the head Service KubeRay makes, the one host serving Prefect and MLflow; and
    they carry the client settings the code gives workers and MLflow clients."""
    from opentinker.control.scheduler import POOLS
    from opentinker.control.services import WORKER_PREFECT_ENV
    from opentinker.core.settings import Settings, mlflow_env

    fields = {f"OPENTINKER_{name.upper()}" for name in Settings.model_fields}
    config = next(doc for _, doc in k8s_documents() if doc["kind"] == "ConfigMap" and doc["metadata"]["name"] == "opentinker-config")["data"]
    compose_env = read_env_file(COMPOSE / "opentinker.env")
    for env in (config, compose_env):
        assert {k for k in env if k.startswith("OPENTINKER_")} <= fields
        assert env["OPENTINKER_STORAGE_URL"].startswith("s3://")
        assert env["PREFECT_API_URL"] == f"http://{env['OPENTINKER_HOST']}:{env['OPENTINKER_PREFECT_PORT']}/api"
        assert env["MLFLOW_TRACKING_URI"] == f"http://{env['OPENTINKER_HOST']}:{env['OPENTINKER_MLFLOW_PORT']}"
        # what the embedded stack gives its workers and MLflow clients, the deployed ones get too
        assert WORKER_PREFECT_ENV.items() <= env.items()
        # the env.url allowlist is stated, parses, and stays off the cluster's own networks
        hosts = Settings(env_url_allow=env["OPENTINKER_ENV_URL_ALLOW"]).env_hosts
        assert hosts.refusal("http://127.0.0.1:9000") is None
        assert hosts.refusal("http://10.0.0.5:9000") and hosts.refusal("http://169.254.169.254/latest")
        assert {k: v for k, v in mlflow_env(Settings()).items() if k != "MLFLOW_TRACKING_URI"}.items() <= env.items()
    assert callable(importlib.import_module("opentinker.control.gateway.app").create_app)

    docs = [doc for _, doc in k8s_documents()]
    pools = {re.search(r"--pool (\w+)", " ".join(d["spec"]["template"]["spec"]["containers"][0]["command"])).group(1)
             for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].startswith("prefect-worker-")}
    assert pools == set(POOLS)
    ray = next(d for d in docs if d["kind"] == "RayCluster")
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"ray[default]=={ray['spec']['rayVersion']}" in pins
    assert config["OPENTINKER_RAY_ADDRESS"] == f"ray://{ray['metadata']['name']}-head-svc:10001"
    control = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] == config["OPENTINKER_HOST"])
    assert {p["port"] for p in control["spec"]["ports"]} == {int(config["OPENTINKER_PREFECT_PORT"]), int(config["OPENTINKER_MLFLOW_PORT"])}


@pytest.mark.parametrize("name", ["Dockerfile.control", "Dockerfile.worker"])
def test_dockerfile_structure(name):
    assert dockerfile_problems(INFRA / "docker" / name) == []


def test_dockerfiles_share_one_python():
    """Ray refuses nodes and drivers whose Python differs (to the patch level) from the head's."""
    versions = {name: re.search(r"^ARG PYTHON_VERSION=(\S+)$", (INFRA / "docker" / name).read_text(), re.M).group(1)
                for name in ("Dockerfile.control", "Dockerfile.worker")}
    assert len(set(versions.values())) == 1, versions
    assert "FROM python:${PYTHON_VERSION}-slim" in (INFRA / "docker" / "Dockerfile.control").read_text()
    assert re.search(r"^FROM nvidia/cuda:", (INFRA / "docker" / "Dockerfile.worker").read_text(), re.M)


# --- every validator can fail ---------------------------------------------------------------------


def manifest(name: str, kind: str) -> dict:
    return copy.deepcopy(next(doc for _, doc in k8s_documents() if doc["kind"] == kind and doc["metadata"]["name"] == name))


def test_kubernetes_validation_rejects_a_broken_deployment():
    broken = manifest("prefect-server", "Deployment")
    broken["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError, match="replicas"):
        validate_manifest(broken)
    typo = manifest("gateway", "Deployment")
    typo["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError, match="imagePullPolicyy"):
        validate_manifest(typo)


def test_raycluster_validation_rejects_broken_copies():
    numeric = manifest("opentinker-ray", "RayCluster")
    numeric["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] = 0   # KubeRay wants "0"
    with pytest.raises(jsonschema.ValidationError):
        validate_manifest(numeric)
    unknown = manifest("opentinker-ray", "RayCluster")
    unknown["spec"]["workerGroupSpecs"][0]["replica"] = 2
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        validate_manifest(unknown)
    pod = manifest("opentinker-ray", "RayCluster")   # the pod template goes through the Kubernetes schema
    pod["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]["limit"] = {}
    with pytest.raises(jsonschema.ValidationError, match="limit"):
        validate_manifest(pod)


def test_compose_validation_rejects_broken_copies(tmp_path):
    data = yaml.safe_load((COMPOSE / "control-plane.yaml").read_text())
    data["services"]["gateway"]["imagee"] = "typo"
    unknown_key = tmp_path / "unknown-key.yaml"
    unknown_key.write_text(yaml.safe_dump(data))
    data = yaml.safe_load((COMPOSE / "gpu-worker.yaml").read_text())
    data["services"]["ray-node"]["healthcheck"]["retries"] = ["ten"]
    bad_type = tmp_path / "bad-type.yaml"
    bad_type.write_text(yaml.safe_dump(data))
    for path, word in [(unknown_key, "imagee"), (bad_type, "retries")]:
        result = check_compose(path)
        assert result.returncode == 1 and word in result.stdout, result.stdout + result.stderr


def test_policies_catch_violations(tmp_path):
    files = compose_files()
    files["control-plane.yaml"]["services"]["prefect-server"]["ports"] = ["4200:4200"]
    files["control-plane.yaml"]["services"]["mlflow"]["environment"]["MLFLOW_BACKEND_STORE_URI"] = "postgresql://u:p@postgres/mlflow"
    folder = shutil.copytree(COMPOSE, tmp_path / "compose")
    (folder / "opentinker.env").write_text("OPENTINKER_STORAGE_URL=file:///data\nAWS_SECRET_ACCESS_KEY=x\n")
    found = compose_policy_violations(files, folder=folder)
    assert any("prefect-server publishes ports" in f for f in found)
    assert any("mlflow sets MLFLOW_BACKEND_STORE_URI inline" in f for f in found)
    assert any("ray-node stores jobs at file:///data" in f for f in found)
    assert any("opentinker.env holds secrets outside secrets/" in f for f in found)

    docs = k8s_documents()
    exposed = manifest("mlflow", "Service")
    exposed["spec"]["type"] = "LoadBalancer"
    ray = manifest("opentinker-ray", "RayCluster")
    ray["spec"]["headGroupSpec"]["serviceType"] = "NodePort"
    leaky = manifest("prefect-server", "Deployment")
    leaky["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "POSTGRES_PASSWORD", "value": "hunter2"})
    leaky["spec"]["template"]["spec"]["containers"][0]["ports"][0]["hostPort"] = 4200
    ingress = {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {"name": "ui", "namespace": "opentinker"},
               "spec": {"rules": [{"http": {"paths": [{"path": "/", "pathType": "Prefix", "backend": {
                   "service": {"name": "prefect-server", "port": {"number": 4200}}}}]}}]}}
    for doc in (exposed, ray, leaky, ingress):   # valid manifests: the policy, not the schema, must catch them
        validate_manifest(doc)
    broken = [(K8S / "x.yaml", exposed), (K8S / "y.yaml", ray), (K8S / "z.yaml", leaky), (K8S / "w.yaml", ingress)]
    found = k8s_policy_violations(docs + broken)
    assert any("Service/mlflow is exposed as LoadBalancer" in f for f in found)
    assert any("RayCluster/opentinker-ray exposes the Ray head" in f for f in found)
    assert any("sets POSTGRES_PASSWORD inline" in f for f in found)
    assert any("Deployment/prefect-server binds a host port" in f for f in found)
    assert any("Ingress/ui routes to ['prefect-server']" in f for f in found)

    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM python:3.11-slim\nCOPY missing-folder /app\nRUN pip install requests\n")
    found = dockerfile_problems(dockerfile)
    assert "COPY source missing-folder is not in the build context" in found
    assert "the project is not installed (pip install [-e] .)" in found
    assert "no CMD or ENTRYPOINT" in found and "runs as root" in found
