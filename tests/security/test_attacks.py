"""Attacks on the trust boundary, each attempted as a tenant through the gateway of a real stack.

Every test asserts the refusal and that nothing ran or was read: a marker file the attack would
create does not exist, and a secret file's content appears in no response, no stack log and no
MLflow record (checked once more at the end of the module).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import secrets
import subprocess

import httpx
import pytest

from tests.conftest import tiny_spec

pytestmark = pytest.mark.timeout(900)
SECRET = f"top-secret-{secrets.token_hex(8)}"


@pytest.fixture(scope="module")
def world(stack_env, tmp_path_factory):
    """The stack, an attacker tenant (mallory), a victim tenant with a registered model, a secret
    file outside every tenant's storage, and the marker path attacks would create."""
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.control.submit import deploy

    settings, env = stack_env
    deploy(settings)
    store = TenantStore(settings.state_dir / "tenants.json")
    keys = {name: store.create(name, rotate=True) for name in ("mallory", "victim")}
    home = tmp_path_factory.mktemp("attacks")
    secret_file = home / "secret.jsonl"
    secret_file.write_text(json.dumps({"question": SECRET, "answer": 1}) + "\n")
    victim_model = _register_victim_model(settings, home)
    responses: list[str] = []
    yield {"settings": settings, "keys": keys, "home": home, "secret_file": secret_file, "marker": home / "pwned",
           "victim_model": victim_model, "responses": responses}
    # nothing any attack did read the secret into a response, a log or MLflow
    assert not any(SECRET in r for r in responses)
    found = subprocess.run(["grep", "-rlaF", SECRET, str(settings.state_dir)], capture_output=True, text=True)
    assert found.stdout == "", found.stdout


def _register_victim_model(settings, home) -> str:
    from opentinker.core.seeding import seed_everything
    from opentinker.env import environment_from_spec
    from opentinker.rl import Policy
    from opentinker.storage.registry import register_job_checkpoint

    spec = tiny_spec(home / "victim", job_id="victim-model-job",
                     checkpoint={"base_url": f"{settings.storage_url}/tenants/victim"})
    seed_everything(0)
    url = Policy(spec, job_id=spec.job_id).save(0, environment_from_spec(spec).state()).url
    register_job_checkpoint(checkpoint_url=url, model_name="victim-private", job_id=spec.job_id, kind="rl",
                            spec_data=spec.model_dump(mode="json"), base_model="tiny-random", environment="envs.toy:UppercaseGame",
                            flow_run_id=None, mlflow_run_id=None, tracking_uri=settings.mlflow_url, tenant="victim")
    return "victim-private"


def _gateway(world, tenant="mallory") -> httpx.Client:
    return httpx.Client(base_url=world["settings"].gateway_url, headers={"Authorization": f"Bearer {world['keys'][tenant]}"},
                        timeout=60, trust_env=False)


def _submit(world, config, expect=422):
    with _gateway(world) as gateway:
        response = gateway.post("/v1/jobs", json={"config": config})
    world["responses"].append(response.text)
    assert response.status_code == expect, response.text
    return response


def _spec(tmp_path, **overrides) -> dict:
    data = tiny_spec(tmp_path, **overrides).model_dump(mode="json")
    data.pop("job_id", None)
    return data


# --- 1. workers run only the operator's code ----------------------------------------------------

@pytest.mark.parametrize("game", ["os:system", "subprocess:Popen", "builtins:exec", "shutil:rmtree", "posix:system",
                                  "tests.conftest:tiny_spec", "envs.math.game:parse_answer", "envs.math:no_such_thing"])
def test_env_game_outside_the_allowlist_or_not_a_game_is_refused_at_submission(world, tmp_path, game):
    marker = world["marker"]
    config = _spec(tmp_path, env={"game": game, "config": {"command": f"touch {marker}", "args": [f"touch {marker}"]}})
    detail = _submit(world, config).json()["detail"]
    assert detail.startswith("env.game: ")
    assert not marker.exists()


def test_the_same_games_are_refused_when_fit_gives_them(world, tmp_path):
    marker = world["marker"]
    config = _spec(tmp_path)
    config.pop("env")
    with _gateway(world) as gateway:
        job_id = gateway.post("/v1/jobs", json={"config": config}).json()["job_id"]
        for game in ("os:system", "subprocess:Popen", "importlib:import_module"):
            response = gateway.post(f"/v1/jobs/{job_id}/start", json={"env": {"game": game, "config": {"command": f"touch {marker}"}}})
            world["responses"].append(response.text)
            assert response.status_code == 422 and response.json()["detail"].startswith("env.game: ")
        gateway.post(f"/v1/jobs/{job_id}/cancel")
    assert not marker.exists()


def test_scheduled_evaluation_obeys_the_same_allowlist(world):
    """A version whose recorded environment names a hostile game: planning its evaluation (what the
    nightly sweep and the completion trigger run) refuses it before importing anything."""
    from opentinker.eval.promotion import Pair, evaluation_job_spec
    from opentinker.env import environment_from_spec

    marker = world["marker"]
    for game in ("os:system", "subprocess:Popen"):
        pair = Pair("m", "2", "1", "u", "u", {"env": {"game": game, "config": {"command": f"touch {marker}"}}, "seed": 0}, "tiny-random")
        with pytest.raises(ValueError, match="env.game: .* is not among the environments"):
            environment_from_spec(evaluation_job_spec(pair))
    assert not marker.exists()


# --- 2. no code from data ---------------------------------------------------------------------------

class _Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _evil_checkpoint(base_url: str, job_id: str, marker, spec) -> str:
    """A committed checkpoint whose optimizer.pt carries a pickle payload (as a tenant with write
    access to its own bucket prefix could leave there)."""
    import fsspec
    import torch

    from opentinker.env import environment_from_spec
    from opentinker.rl import Policy

    url = Policy(spec, job_id=job_id).save(1, environment_from_spec(spec).state()).url
    fs, path = fsspec.core.url_to_fs(url)
    buffer = io.BytesIO()
    torch.save({"state": {}, "param_groups": [], "evil": _Payload(marker)}, buffer)
    fs.pipe_file(f"{path}/optimizer.pt", buffer.getvalue())
    manifest = json.loads(fs.cat_file(f"{path}/COMMIT.json"))
    manifest["files"]["optimizer.pt"] = len(buffer.getvalue())
    manifest["sha256"]["optimizer.pt"] = hashlib.sha256(buffer.getvalue()).hexdigest()
    fs.pipe_file(f"{path}/COMMIT.json", json.dumps(manifest).encode())
    return url


def test_a_crafted_checkpoint_in_the_tenants_own_storage_is_refused_on_resume(world, tmp_path):
    """Re-hashed over the payload, its COMMIT.json no longer matches its signature: resume skips it
    (saying so) and the job trains from the start; nothing in it is ever unpickled."""
    from opentinker.client import SchedulerClient

    settings, marker = world["settings"], world["marker"]
    spec = tiny_spec(tmp_path, job_id="mallory-evil", optimization={"steps": 2},
                     checkpoint={"base_url": f"{settings.storage_url}/tenants/mallory"})
    url = _evil_checkpoint(spec.checkpoint.base_url, "mallory-evil", marker, spec)
    config = _spec(tmp_path, optimization={"steps": 2}) | {"job_id": "evil"}
    client = SchedulerClient(url=settings.gateway_url, api_key=world["keys"]["mallory"])
    final = client.wait(client.submit_job(config=config)["job_id"], timeout=600, poll=1)
    world["responses"].append(json.dumps(final))
    assert final["state"] == "COMPLETED", final
    assert final["skipped_checkpoints"] == [f"{url}: refused: its COMMIT.json does not match its signature "
                                            "(changed after the commit, or written by another stack)"]
    assert not marker.exists()


@pytest.mark.parametrize("init_from", ["file:///etc", "/tmp", "../victim/victim-model-job", "file:///{home}/evil",
                                       "s3://another-bucket/ckpt", "models:/victim-private@champion", "models:/victim-private/1"])
def test_init_from_outside_the_tenant_is_refused(world, tmp_path, init_from):
    config = _spec(tmp_path, model={"name": "tiny-random", "init_from": init_from.format(home=world["home"])})
    detail = _submit(world, config).json()["detail"]
    assert detail.startswith("model.init_from: ")
    assert "champion" not in detail.replace(init_from, "") and "challenger" not in detail  # no other tenant's aliases


# --- 3. every location a tenant names is its own -----------------------------------------------------

@pytest.mark.parametrize("field", ["data_path", "val_data_path"])
@pytest.mark.parametrize("where", ["{secret}", "file://{secret}", "../../../{secret_rel}", "/etc/passwd"])
def test_dataset_paths_outside_the_tenant_are_refused(world, tmp_path, field, where):
    secret = world["secret_file"]
    path = where.format(secret=secret, secret_rel=str(secret).lstrip("/"))
    config = _spec(tmp_path, env={"game": "envs.math:MathGame", "config": {field: path}})
    assert _submit(world, config).json()["detail"].startswith(f"env.config.{field}: ")


@pytest.mark.parametrize("name", ["/etc", str(os.path.expanduser("~")), "../../..", "tiny-random/../../etc", "no-such-model"])
def test_local_model_folders_come_only_from_the_operators_model_directory(world, tmp_path, name):
    config = _spec(tmp_path)
    config["model"]["name"] = name
    assert _submit(world, config).json()["detail"].startswith("model.name: ")


@pytest.mark.parametrize("path", ["{secret}", "file://{secret}", "../victim/x.jsonl"])
def test_sft_data_outside_the_tenant_is_refused(world, path):
    config = {"model": {"name": "tiny-random"}, "data": {"path": path.format(secret=world["secret_file"])}}
    assert _submit(world, config).json()["detail"].startswith("data.path: ")


@pytest.mark.parametrize("model_path", ["/etc", "file:///tmp", "../victim/victim-model-job", "models:/victim-private@champion",
                                        "models:/victim-private/1"])
def test_inference_serves_only_the_tenants_own_checkpoints(world, model_path):
    with _gateway(world) as gateway:
        response = gateway.post("/v1/inference", json={"model_path": model_path})
    world["responses"].append(response.text)
    assert response.status_code == 422
    detail = response.json()["detail"]
    assert detail.startswith("model_path: ") and "aliases" not in detail
    if model_path.startswith("models:/"):  # another tenant's model reads exactly like a missing one
        assert "no registered model 'victim-private'" in detail


def test_another_tenants_model_reads_like_a_missing_one_for_the_operator_too(world):
    from opentinker.storage.registry import ModelNotFoundError, resolve_model_uri

    settings = world["settings"]
    with pytest.raises(ModelNotFoundError, match="^no registered model 'victim-private'$"):
        resolve_model_uri("models:/victim-private@champion", settings.mlflow_url, tenant="mallory")
    assert resolve_model_uri("models:/victim-private@champion", settings.mlflow_url, tenant="victim")


@pytest.mark.parametrize("name", ["victim-private", "victim-other"])
def test_a_tenants_registry_names_are_its_own(world, tmp_path, name):
    """Whatever name a tenant asks for, its jobs register under its own prefix, never into another's model."""
    from opentinker.storage.registry import model_name_for

    response = _submit(world, _spec(tmp_path, registry={"model_name": name}), expect=201)
    with _gateway(world) as gateway:
        gateway.post(f"/v1/jobs/{response.json()['job_id']}/cancel")
    assert model_name_for({"registry": {"model_name": name}}, "mallory", "mallory") == f"mallory-{name}"


def test_writing_into_a_model_another_tenant_owns_is_refused(world, tmp_path):
    """Ownership is the tag the gateway's jobs set: even a complete checkpoint registered under the
    victim's exact name by a mallory job is refused, and the victim's aliases do not move."""
    from opentinker.env import environment_from_spec
    from opentinker.rl import Policy
    from opentinker.storage.registry import RegistryError, register_job_checkpoint, registry_client

    settings = world["settings"]
    spec = tiny_spec(tmp_path, checkpoint={"base_url": f"{settings.storage_url}/tenants/mallory"})
    url = Policy(spec, job_id="mallory-squat").save(0, environment_from_spec(spec).state()).url
    before = registry_client(settings.mlflow_url).get_registered_model("victim-private").aliases
    with pytest.raises(RegistryError, match="'victim-private' is not yours"):
        register_job_checkpoint(checkpoint_url=url, model_name="victim-private", job_id="mallory-squat", kind="rl",
                                spec_data=spec.model_dump(mode="json"), base_model="tiny-random", environment=None,
                                flow_run_id=None, mlflow_run_id=None, tracking_uri=settings.mlflow_url, tenant="mallory")
    assert registry_client(settings.mlflow_url).get_registered_model("victim-private").aliases == before


@pytest.mark.parametrize("name", ["acme-corp", "a-b", "default", "admin", "opentinker", "Root", "x"])
def test_tenant_names_that_could_collide_or_are_reserved_are_refused(tmp_path, name):
    from opentinker.control.gateway.tenants import TenantStore

    with pytest.raises(ValueError, match="tenant name"):
        TenantStore(tmp_path / "tenants.json").create(name)


def test_env_url_may_not_point_at_the_stacks_own_servers(world, tmp_path):
    settings = world["settings"]
    for port in (settings.mlflow_port, settings.prefect_port, settings.gateway_port, settings.ray_port, settings.ray_client_port):
        config = _spec(tmp_path, env={"game": None, "url": f"http://127.0.0.1:{port}"})
        assert _submit(world, config).json()["detail"].startswith("env.url: ")


def test_a_tenant_cannot_point_a_job_at_a_rollout_server(world, tmp_path):
    """The job would send its adapter folders and its key there, and trust what it samples."""
    settings = world["settings"]
    for url in (f"http://127.0.0.1:{settings.mlflow_port}", "http://10.0.0.5:8000"):
        config = _spec(tmp_path, rollout={"engine": "server", "server_url": url})
        assert _submit(world, config).json()["detail"].startswith("rollout.server_url: ")
