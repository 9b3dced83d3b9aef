"""A trained policy as the starting point: load_policy rebuilds it from a checkpoint alone
(policy.json), and `model.init_from` makes it the next job's base, pinned for that job's life."""

from __future__ import annotations

import json

import pytest
import torch

from opentinker.storage import checkpoint as ckpt
from opentinker.model.policy import load_model, load_policy, read_policy_info
from opentinker.storage.resolve import resolve_checkpoint
from opentinker.rl import RLJob
from opentinker.core.spec import SpecError, parse_spec
from tests.rounding import same_logprobs

IDS = torch.tensor([[1, 2, 3, 4, 5, 6]])


def _spec(tmp_path, adapter: str = "lora", **model) -> dict:
    return {
        "model": {"name": "tiny-random", **model},
        "adapter": {"kind": adapter},
        "env": {"game": "envs.toy:UppercaseGame"},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "optimization": {"steps": 2, "lr": 1e-2},
        "evaluation": {"every": 0, "n_samples": 2},
        "storage": {"base_url": str(tmp_path)},
    }


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("adapter", ["lora", "full"])
def test_a_checkpoint_alone_rebuilds_the_trained_policy_and_starts_the_next_job(tmp_path, adapter):
    first = RLJob(parse_spec(_spec(tmp_path, adapter)), job_id="first")
    first.run()
    trained = _logits(first.policy.model)
    url = resolve_checkpoint(f"file://{tmp_path}/first")  # a job folder means its latest complete step
    assert url.endswith("first/step-00000002")
    info = read_policy_info(url)
    assert info["base_model"] == "tiny-random" and info["adapter"]["kind"] == adapter and info["init_from"] is None

    model, _, _ = load_policy(url)
    # the adapter merged into the weights against added beside them: other roundings, other orders
    # (logits: the bound of tests/rounding.py)
    assert same_logprobs(_logits(model), trained)
    assert not same_logprobs(_logits(load_model("tiny-random")[0]), trained)  # training changed it

    second = RLJob(parse_spec(_spec(tmp_path, "lora", init_from=f"file://{tmp_path}/first")), job_id="second")
    assert same_logprobs(_logits(second.policy.model), trained)  # fresh LoRA (B = 0) on the trained base
    second.run()
    recorded = read_policy_info(resolve_checkpoint(f"file://{tmp_path}/second"))
    assert recorded["init_from"] == url  # the resolved step, never the job folder or an alias
    assert same_logprobs(_logits(load_policy(resolve_checkpoint(f"file://{tmp_path}/second"))[0]), _logits(second.policy.model))


def test_a_resumed_job_keeps_the_base_it_started_from(tmp_path):
    first = RLJob(parse_spec(_spec(tmp_path)), job_id="first")
    first.run()
    step2 = resolve_checkpoint(f"file://{tmp_path}/first")
    spec = _spec(tmp_path, init_from=f"file://{tmp_path}/first")
    RLJob(parse_spec(spec), job_id="second").run()
    # the source job moves on: its folder now resolves to a later step ...
    spec_more = _spec(tmp_path) | {"optimization": {"steps": 3, "lr": 1e-2}}
    more = RLJob(parse_spec(spec_more), job_id="first")
    more.run()
    assert resolve_checkpoint(f"file://{tmp_path}/first") != step2
    # ... but "second", resumed, rebuilds on the step it recorded when it started
    resumed = RLJob(parse_spec(spec), job_id="second")
    assert resumed.policy.init_from == step2


def test_bad_init_from_fails_clearly(tmp_path):
    with pytest.raises(SpecError, match="model.init_from: a registry URI looks like"):
        parse_spec(_spec(tmp_path, init_from="models:/only-a-name"))
    with pytest.raises(FileNotFoundError, match="neither a complete checkpoint nor a job folder"):
        RLJob(parse_spec(_spec(tmp_path, init_from=str(tmp_path / "nothing-here"))))
    RLJob(parse_spec(_spec(tmp_path)), job_id="tiny").run()
    url = resolve_checkpoint(f"file://{tmp_path}/tiny")
    path = url.removeprefix("file://")
    info = json.loads(open(f"{path}/policy.json").read())
    with open(f"{path}/policy.json", "w") as f:  # same size, another base model
        f.write(json.dumps(info | {"base_model": "tiny-randoX"}))
    with pytest.raises(ValueError, match="base model 'tiny-randoX' is not available here"):
        load_policy(url)  # COMMIT.json's sizes still match: the content is what gives it away
    with open(f"{path}/policy.json", "w") as f:
        f.write("{not json" + " " * (len(json.dumps(info)) - 9))
    with pytest.raises(ValueError, match="corrupt checkpoint: unreadable policy.json"):
        RLJob(parse_spec(_spec(tmp_path, init_from=url)))
    assert ckpt.list_checkpoints(f"file://{tmp_path}", "tiny")[-1].url == url  # nothing was changed or pruned


def test_a_tenants_resumed_job_and_its_own_server_keep_one_base(tmp_path):
    """The job's server (and a sampler of its own) know no tenant; they must still build on the
    base a tenant's resumed job recorded, not on what its source resolves to now: a server on
    another base fails the first weight sync's probe."""
    from opentinker.inference.launch import rollout_server

    RLJob(parse_spec(_spec(tmp_path)), job_id="first").run()
    step2 = resolve_checkpoint(f"file://{tmp_path}/first")
    spec = _spec(tmp_path, init_from=f"file://{tmp_path}/first") | {"rollout": {"prompts_per_step": 2, "group_size": 2,
                                                                             "max_new_tokens": 4, "engine": "server"}}
    first_run = RLJob(parse_spec(spec), job_id="second", tenant="alice", start_server=rollout_server)
    try:
        first_run.run()
    finally:
        first_run.close()
    RLJob(parse_spec(_spec(tmp_path) | {"optimization": {"steps": 3, "lr": 1e-2}}), job_id="first").run()
    assert resolve_checkpoint(f"file://{tmp_path}/first") != step2  # the source moved on
    resumed = RLJob(parse_spec(spec | {"optimization": {"steps": 3, "lr": 1e-2}}), job_id="second", tenant="alice",
                    start_server=rollout_server)
    try:
        assert resumed.policy.init_from == step2 == resumed.spec.model.init_from
        assert resumed.run().steps_done == 3  # its weights synced to a server on that same base
    finally:
        resumed.close()
