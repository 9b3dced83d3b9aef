"""Model registry against the test stack's real MLflow server: lineage, aliases, resolution, bad input."""

from __future__ import annotations

import hashlib
import json

import pytest

from tests.conftest import tiny_spec

GAME = "envs.toy:UppercaseGame"


def toy_spec(tmp_path, job_id: str, model_name: str, steps: int = 1, **overrides):
    """The tiny model on the uppercase game with a 32-problem validation split (seed 3)."""
    return tiny_spec(tmp_path, job_id=job_id, optimization={"steps": steps, "lr": 1e-2},
                     evaluation={"every": 0, "n_samples": 32}, checkpoint={"every": 0},
                     env={"game": GAME, "config": {"val_size": 32}}, registry={"model_name": model_name}, **overrides)


def make_checkpoint(spec, trained: bool) -> str:
    """A real committed checkpoint: after `optimization.steps` RL steps, or of the untrained policy
    (a fresh LoRA adapter is the identity: the base model itself)."""
    from opentinker.rl import RLJob
    from opentinker.core.seeding import seed_everything
    from opentinker.rl import Policy

    if trained:
        return RLJob(spec, job_id=spec.job_id).run().checkpoint.url
    seed_everything(spec.seed)
    from opentinker.env import environment_from_spec

    return Policy(spec, job_id=spec.job_id).save(0, environment_from_spec(spec).state()).url


def register(settings, spec, url: str, with_run: bool = True) -> dict:
    """What a job does when it completes: its MLflow run logs the checkpoint, then it registers."""
    from opentinker.storage.registry import register_job_checkpoint
    from opentinker.tracking.runs import JobTracker

    run_id = None
    if with_run:
        tracker = JobTracker(settings.mlflow_url, "registry-tests", spec.job_id, spec)
        tracker.log_checkpoint(url)
        tracker.finish()
        run_id = tracker.run_id
    return register_job_checkpoint(
        checkpoint_url=url, model_name=spec.registry.model_name, job_id=spec.job_id, kind="rl",
        spec_data=spec.model_dump(mode="json"), base_model=spec.model.name, environment=spec.env.game,
        flow_run_id="flow-run-of-" + spec.job_id, mlflow_run_id=run_id, tracking_uri=settings.mlflow_url)


def snapshot(client, name: str):
    """Everything a failed call must leave as it was: aliases, versions and their tags."""
    model = client.get_registered_model(name)
    versions = sorted((v.version, sorted(v.tags.items())) for v in client.search_model_versions(f"name = '{name}'"))
    return dict(model.aliases), versions


@pytest.fixture(scope="module")
def registered(stack_env, tmp_path_factory):
    """Two versions of one model: v1 untrained, v2 from a second job."""
    from mlflow.tracking import MlflowClient

    settings, _ = stack_env
    tmp = tmp_path_factory.mktemp("registry")
    name = "reg-test-uppercase"
    s1, s2 = toy_spec(tmp, "reg-job-1", name), toy_spec(tmp, "reg-job-2", name, seed=4)
    u1 = make_checkpoint(s1, trained=False)
    r1 = register(settings, s1, u1)
    u2 = make_checkpoint(s2, trained=False)
    r2 = register(settings, s2, u2)
    return {"settings": settings, "client": MlflowClient(tracking_uri=settings.mlflow_url), "name": name,
            "specs": (s1, s2), "urls": (u1, u2), "results": (r1, r2)}


def test_registration_records_lineage_and_sets_aliases(registered):
    from opentinker.storage.registry import environment_version

    client, name = registered["client"], registered["name"]
    (r1, r2), (s1, s2), (_, u2) = registered["results"], registered["specs"], registered["urls"]
    # the first version is champion too (nothing to compare with); later ones are challengers only
    assert r1 == {"name": name, "version": "1", "aliases": ["challenger", "champion"]}
    assert r2 == {"name": name, "version": "2", "aliases": ["challenger"]}
    assert client.get_registered_model(name).aliases == {"champion": "1", "challenger": "2"}

    mv = client.get_model_version(name, "2")
    data = s2.model_dump(mode="json")
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    assert mv.tags["spec_hash"] == hashlib.sha256(canonical.encode()).hexdigest()
    assert {k: mv.tags[k] for k in ("job_id", "kind", "base_model", "environment", "prefect_flow_run_id", "checkpoint_url")} == {
        "job_id": "reg-job-2", "kind": "rl", "base_model": "tiny-random", "environment": GAME,
        "prefect_flow_run_id": "flow-run-of-reg-job-2", "checkpoint_url": u2}
    assert mv.tags["environment_version"] == environment_version(GAME) and "+src." in mv.tags["environment_version"]
    assert mv.tags["mlflow_run_id"] == mv.run_id
    # the source is the run's exported adapter (MLflow refuses a bare local path, see below)
    assert mv.source == f"runs:/{mv.run_id}/final"
    assert json.loads(mv.tags["eval_spec"])["env"] == data["env"] and json.loads(mv.tags["eval_spec"])["seed"] == 4
    assert s1.model_dump(mode="json") != data and client.get_model_version(name, "1").tags["spec_hash"] != mv.tags["spec_hash"]


def test_registry_uris_resolve_to_checkpoints_that_load(registered):
    import torch

    from opentinker.storage import checkpoint as ckpt
    from opentinker.model.policy import load_policy
    from opentinker.storage.resolve import resolve_checkpoint
    from opentinker.storage.registry import resolve_model_uri

    name, (u1, u2) = registered["name"], registered["urls"]
    assert resolve_model_uri(f"models:/{name}@champion") == u1
    assert resolve_model_uri(f"models:/{name}@challenger") == resolve_model_uri(f"models:/{name}/2") == u2
    assert resolve_checkpoint(f"models:/{name}@champion") == u1  # the path inference and init_from take
    model, _, info = load_policy(resolve_checkpoint(f"models:/{name}/2"))
    saved = ckpt.load_checkpoint(u2).weights
    lora_b = next(k for k in saved if "lora_B" in k)
    assert info["base_model"] == "tiny-random" and torch.count_nonzero(saved[lora_b]) == 0  # untrained adapter
    assert sum(p.numel() for p in model.parameters()) > 0


def test_registering_again_is_idempotent(registered):
    spec, url = registered["specs"][1], registered["urls"][1]
    again = register(registered["settings"], spec, url)
    assert again["version"] == "2"
    assert len(registered["client"].search_model_versions(f"name = '{registered['name']}'")) == 2


def test_a_job_without_an_mlflow_run_gets_a_registration_run(stack_env, tmp_path):
    from mlflow.tracking import MlflowClient

    settings, _ = stack_env
    spec = toy_spec(tmp_path, "reg-no-run", "reg-test-no-run")
    reg = register(settings, spec, make_checkpoint(spec, trained=False), with_run=False)
    mv = MlflowClient(tracking_uri=settings.mlflow_url).get_model_version(reg["name"], reg["version"])
    assert mv.source == f"runs:/{mv.run_id}/checkpoint" and mv.tags["mlflow_run_id"] == mv.run_id


def test_mlflow_refuses_a_local_checkpoint_path_as_source(registered):
    """Why versions point at run artifacts and carry the checkpoint in a tag (measured, MLflow 3.17.2)."""
    from mlflow.exceptions import MlflowException

    client, name = registered["client"], registered["name"]
    run_id = client.get_model_version(name, "1").run_id
    with pytest.raises(MlflowException, match="Invalid model version source"):
        client.create_model_version(name, registered["urls"][0], run_id=run_id)


def test_missing_alias_version_or_model_fail_clearly_and_change_nothing(registered, tmp_path):
    from opentinker.storage.registry import ModelNotFoundError, RegistryError, resolve_model_uri

    client, name, settings = registered["client"], registered["name"], registered["settings"]
    before = snapshot(client, name)
    with pytest.raises(ModelNotFoundError, match=rf"'{name}' has no alias 'production' \(aliases: challenger→v2, champion→v1\)"):
        resolve_model_uri(f"models:/{name}@production")
    with pytest.raises(ModelNotFoundError, match=rf"'{name}' has no version 99"):
        resolve_model_uri(f"models:/{name}/99")
    with pytest.raises(ModelNotFoundError, match="no registered model 'no-such-model'"):
        resolve_model_uri("models:/no-such-model@champion")
    assert isinstance(ModelNotFoundError("x"), LookupError)
    with pytest.raises(ValueError, match="models:/<name>@<alias>"):
        resolve_model_uri(f"models:/{name}")
    # a partial checkpoint (no commit manifest) is never registered
    spec = toy_spec(tmp_path, "reg-partial", name)
    url = make_checkpoint(spec, trained=False)
    (tmp_path / "runs" / "reg-partial" / "step-00000000" / "COMMIT.json").unlink()
    with pytest.raises(RegistryError, match="not a complete checkpoint: nothing registered"):
        register(settings, spec, url)
    assert snapshot(client, name) == before


def test_a_job_starting_from_a_missing_alias_fails_before_training(registered, tmp_path):
    from opentinker.storage.registry import ModelNotFoundError
    from opentinker.rl import RLJob

    spec = tiny_spec(tmp_path, model={"name": "tiny-random", "init_from": f"models:/{registered['name']}@nope"})
    with pytest.raises(ModelNotFoundError, match="has no alias 'nope'"):
        RLJob(spec, job_id="reg-init-missing")
    assert not (tmp_path / "runs" / "reg-init-missing").exists()
