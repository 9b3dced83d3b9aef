"""SFT jobs: bad input fails before work starts (naming the field or the line); TRL's SFTTrainer
lowers the loss on generated chats; the checkpoint is an ordinary policy that load_policy rebuilds
and that starts an RL job (`model.init_from`); the flow tracks it in MLflow and registers it."""

from __future__ import annotations

import json

import pytest
import torch

from opentinker.model.policy import load_model, load_policy, read_policy_info
from opentinker.sft.data import load_chats
from opentinker.sft.job import SFTJob
from opentinker.sft.spec import SFT_SPEC_FILE, SFTDataError, parse_sft_spec
from opentinker.sft.template import training_chat_template
from opentinker.sft.game_chats import math_chats, write_jsonl
from opentinker.core.spec import SpecError, parse_spec
from tests.rounding import same_logprobs

IDS = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
LR = {"lora": 2e-2, "full": 2e-3}


def _sft(tmp_path, data: str, adapter: str = "lora", **sections) -> dict:
    spec = {
        "model": {"name": "tiny-random"},
        "adapter": {"kind": "lora", "r": 8, "alpha": 16} if adapter == "lora" else {"kind": "full"},
        "data": {"path": data, "eval_fraction": 0.25},
        "training": {"epochs": 2, "lr": LR[adapter], "batch_size": 6, "max_length": 256, "seed": 0},
        "storage": {"base_url": f"file://{tmp_path}/runs"},
    }
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value}
    return spec


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("sft-data") / "math.jsonl"
    write_jsonl(math_chats(16, seed=0, few_shot=0), str(path))  # no example turn: half the tokens, a faster test
    return str(path)


# full fine-tuning is the slow variant (same code path past the adapter); `make test-slow` runs it
@pytest.fixture(scope="module", params=["lora", pytest.param("full", marks=pytest.mark.slow)])
def trained(request, data, tmp_path_factory):
    """One SFT run per adapter kind, shared by the tests that inspect its result and checkpoint."""
    tmp = tmp_path_factory.mktemp(f"sft-{request.param}")
    job = SFTJob(parse_sft_spec(_sft(tmp, data, request.param)), job_id=f"sft-{request.param}")
    points: list[tuple[int, dict]] = []
    result = job.run(on_log=lambda step, metrics: points.append((step, metrics)))
    return request.param, job, result, points, tmp


# -- bad input ----------------------------------------------------------------------------------
def _spec_error(data: dict) -> str:
    with pytest.raises(SpecError) as info:
        parse_sft_spec(data)
    return str(info.value)


def test_bad_specs_name_the_field(tmp_path):
    base = _sft(tmp_path, "data.jsonl")
    assert "training.epoch: unknown key" in _spec_error({**base, "training": {"epoch": 1}})
    assert _spec_error({**base, "training": {"lr": -1}}).startswith("training.lr: Input should be greater than 0")
    assert "data.eval_fraction: Input should be less than 1" in _spec_error({**base, "data": {"path": "x", "eval_fraction": 1}})
    assert "adapter.rank: unknown key" in _spec_error({**base, "adapter": {"kind": "lora", "rank": 8}})
    assert "data: Field required" in _spec_error({k: v for k, v in base.items() if k != "data"})
    assert _spec_error({**base, "model": {"name": "no-such-model"}}).startswith("model.name: unknown model")
    assert "model.dtype: float16 autocast trains on a GPU" in _spec_error({**base, "model": {"name": "tiny-random", "dtype": "float16"}})
    assert "credentials do not belong in a URL" in _spec_error({**base, "data": {"path": "s3://key:secret@bucket/d.jsonl"}})


def test_tool_chats_train_on_the_text_rl_renders(tmp_path):
    """A chat with tools, calls and results becomes the hermes text the agent loop renders for the same conversation."""
    from transformers import AutoTokenizer

    from envs.code_interpreter import CodeInterpreterMathGame
    from envs.code_interpreter.game import EXAMPLE
    from opentinker.model.loading import tokenizer_path
    from opentinker.tools.formats import ToolFormat

    tools = [t.schema() for t in CodeInterpreterMathGame().get_tools()]
    messages = [{"role": "system", "content": "Solve it."}, *EXAMPLE]
    path = tmp_path / "tools.jsonl"
    path.write_text(json.dumps({"messages": messages, "tools": tools}) + "\n")
    ((_, plain),) = load_chats(str(path))
    assert {m["role"] for m in plain} == {"system", "user", "assistant"} and all(isinstance(m["content"], str) for m in plain)
    tok = AutoTokenizer.from_pretrained(tokenizer_path())
    assert tok.apply_chat_template(plain, tokenize=False) == ToolFormat(tok).render(messages, tools, add_generation_prompt=False)


def test_bad_jsonl_lines_are_named_before_the_model_loads(tmp_path):
    good = json.dumps(math_chats(1)[0])
    lines = [
        good,
        "{not json",
        "",
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"messages": [{"role": "bot", "content": "hi"}, {"role": "assistant", "content": "x"}]}),
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "s"}, {"role": "assistant", "content": "b"}]}),
        json.dumps({"text": "plain"}),
        json.dumps({"messages": [{"role": "assistant", "content": 3}]}),
        json.dumps({"messages": [{"role": "user", "content": "a", "tool_calls": []}, {"role": "assistant", "content": "b"}]}),
        json.dumps({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}]}),
        json.dumps({"messages": [{"role": "assistant", "content": "b"}], "tools": [{"name": "f"}]}),
    ]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(SFTDataError) as info:
        SFTJob(parse_sft_spec(_sft(tmp_path, str(path))))
    assert str(info.value).splitlines() == [
        "data.path: line 2: not valid JSON (Expecting property name enclosed in double quotes, column 2)",
        "data.path: line 4: no assistant message: nothing to train on",
        "data.path: line 5: messages[0].role: must be one of system, user, assistant, tool (got 'bot')",
        "data.path: line 6: messages[1]: a system message may only come first",
        'data.path: line 7: expected an object with a "messages" list',
        "data.path: line 8: messages[0].content: must be a string",
        "data.path: line 9: messages[0].tool_calls: a list, on an assistant message only",
        'data.path: line 10: messages[0].tool_calls[0]: expected {"function": {"name": "...", "arguments": {...}}}',
        'data.path: line 11: tools: expected a list of {"type": "function", "function": {"name": ..., "parameters": ...}}',
    ]
    with pytest.raises(SFTDataError, match=r"^data.path: file://.*/missing.jsonl does not exist$"):
        load_chats(f"file://{tmp_path}/missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SFTDataError, match="holds no examples"):
        load_chats(str(tmp_path / "empty.jsonl"))


def test_an_example_over_max_length_is_refused_with_its_line(tmp_path, data):
    rows = math_chats(3)
    rows[1]["messages"][-1]["content"] = "Answer: 1 " * 200
    path = tmp_path / "long.jsonl"
    write_jsonl(rows, str(path))
    with pytest.raises(SFTDataError, match=r"^data.path: line 2: \d+ tokens, more than training.max_length=256$"):
        SFTJob(parse_sft_spec(_sft(tmp_path, str(path))))


# -- what is trained ------------------------------------------------------------------------------
def test_loss_covers_each_assistant_reply_and_its_end_of_turn_token(tiny):
    _, tokenizer = tiny
    marked = training_chat_template(tokenizer)
    messages = math_chats(1)[0]["messages"]
    assert tokenizer.apply_chat_template(messages, tokenize=False, chat_template=marked) == tokenizer.apply_chat_template(messages, tokenize=False)
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, chat_template=marked)
    trained = tokenizer.decode([t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m])
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert trained == "".join(r + "<|im_end|>" for r in replies)  # the few-shot reply and the answer


def test_generated_chats_earn_the_math_reward_and_avoid_the_rl_validation_set():
    from envs.math import MathGame
    from opentinker.env import GameEnvironment

    rows = math_chats(32, seed=0)
    config = {"low": 1, "high": 20, "operations": ["+"], "val_size": 64, "game_kwargs": {"few_shot": 1}, "seed": 0}
    validation = {t["question"] for t in GameEnvironment(MathGame, config).validation_tasks()}
    questions = [r["messages"][-2]["content"] for r in rows]
    assert len(set(questions)) == 32 and not set(questions) & validation
    for row in rows:
        game = MathGame(few_shot=1)
        a, b = (int(x) for x in row["messages"][-2]["content"].removeprefix("What is ").removesuffix("?").split(" + "))
        game.reset(question=row["messages"][-2]["content"], answer=a + b)
        assert game.step(row["messages"][-1]["content"]).reward == 1.0


# -- training and the checkpoint --------------------------------------------------------------------
def test_sft_lowers_the_loss_and_logs_every_step(trained):
    adapter, job, result, points, _ = trained
    for key in ("eval/loss", "train_set/loss"):
        assert result["after"][key] < result["before"][key] - 0.05, (adapter, key, result["before"], result["after"])
    assert result["train_examples"] == 12 and result["eval_examples"] == 4
    assert result["steps"] == job.max_steps == 4  # 12 examples / batch 6 * 2 epochs, as transformers counted
    step_points = [(s, m) for s, m in points if "sft/loss" in m]
    assert [s for s, _ in step_points] == [1, 2, 3, 4]
    assert points[0][0] == 0 and points[0][1]["sft/max_steps"] == 4 and "eval/loss" in points[0][1]
    assert points[-1] == (4, points[-1][1]) and points[-1][1]["eval/loss"] == result["after"]["eval/loss"]


def test_the_checkpoint_is_the_trained_policy(trained):
    adapter, job, result, _, _ = trained
    url = result["checkpoint"]
    assert url.endswith(f"sft-{adapter}/step-00000004")
    info = read_policy_info(url)
    assert info == {"base_model": "tiny-random", "dtype": job.spec.model.dtype, "adapter": job.spec.adapter.model_dump(mode="json"), "init_from": None}
    model, _, _ = load_policy(url)
    trained_logits = _logits(job.model)
    assert same_logprobs(_logits(model), trained_logits)  # merged against beside: other orders (tests/rounding.py)
    assert not same_logprobs(_logits(load_model("tiny-random")[0]), trained_logits)
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    assert fs.exists(f"{path}/{SFT_SPEC_FILE}") and fs.exists(f"{path}/adapter/adapter_config.json") == (adapter == "lora")


def test_an_rl_job_starts_from_the_sft_checkpoint(trained):
    from opentinker.rl import RLJob

    adapter, _, result, _, tmp = trained
    spec = parse_spec({
        "model": {"name": "tiny-random", "init_from": result["checkpoint"]},
        "adapter": {"kind": adapter},
        "env": {"game": "envs.math:MathGame", "config": {"val_size": 4, "game_kwargs": {"few_shot": 1}}},
        "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
        "optimization": {"steps": 1, "lr": 1e-3},
        "evaluation": {"every": 0, "n_samples": 2},
        "storage": {"base_url": f"file://{tmp}/runs"},
    })
    rl = RLJob(spec, job_id=f"rl-from-sft-{adapter}")
    sft_policy, _, _ = load_policy(result["checkpoint"])
    assert same_logprobs(_logits(rl.policy.model), _logits(sft_policy))  # step 0 = SFT policy (tests/rounding.py)
    done = rl.run()
    assert done.steps_done == 1 and done.checkpoint is not None
    assert read_policy_info(done.checkpoint.url)["init_from"] == result["checkpoint"]


def test_a_job_id_is_reused_only_with_the_same_spec(trained, data):
    adapter, job, result, _, tmp = trained
    if adapter != "lora":
        pytest.skip("one adapter kind is enough")
    again = SFTJob(job.spec, job_id=job.job_id)  # a retried flow: no second training
    assert again.reused and again.run()["checkpoint"] == result["checkpoint"]
    other = parse_sft_spec(_sft(tmp, data, training={"epochs": 3}))
    with pytest.raises(SpecError, match=r"job_id: 'sft-lora' already has a checkpoint from another spec"):
        SFTJob(other, job_id=job.job_id)


# -- the flow on the real stack ----------------------------------------------------------------------
def test_sft_flow_tracks_in_mlflow_checkpoints_and_registers(stack_env, tmp_path, data):
    from mlflow.tracking import MlflowClient

    from flows.sft import sft
    from opentinker.control.scheduler import flow_for

    settings, _ = stack_env
    spec_data = _sft(tmp_path, data, registry={"model_name": "test-sft-math"})
    assert flow_for(spec_data) == "sft"
    result = sft(parse_sft_spec(spec_data), job_id="sft-flow")
    assert result["checkpoint"].endswith("sft-flow/step-00000004")
    assert load_policy(result["checkpoint"])[2]["adapter"]["kind"] == "lora"

    client = MlflowClient(tracking_uri=settings.mlflow_url)
    exp = client.get_experiment_by_name(settings.project)
    (run,) = client.search_runs([exp.experiment_id], filter_string="tags.`opentinker.job_id` = 'sft-flow'")
    assert run.info.status == "FINISHED" and run.info.run_id == result["mlflow_run_id"]
    assert run.data.params["training.lr"] == str(LR["lora"]) and run.data.params["data.path"] == f"file://{data}"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "sft/loss")) == [1, 2, 3, 4]
    eval_loss = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/loss")}
    assert set(eval_loss) == {0, 4} and eval_loss[4] < eval_loss[0]
    assert "final/adapter_config.json" in {a.path for a in client.list_artifacts(run.info.run_id, "final")}
    assert run.data.tags["opentinker.checkpoint"] == result["checkpoint"]

    registered = result["registered_model"]
    version = client.get_model_version("test-sft-math", registered["version"])
    assert version.tags["kind"] == "sft" and version.tags["job_id"] == "sft-flow"
    assert version.tags["checkpoint_url"] == result["checkpoint"] and "challenger" in registered["aliases"]
    assert run.data.tags["opentinker.registered_version"] == str(registered["version"])


@pytest.mark.slow  # an SFT job submitted through the gateway (63 s); test_sft_flow_tracks_in_mlflow_checkpoints_and_registers runs the same flow in the default run
def test_an_sft_job_runs_through_the_gateway_in_the_tenants_namespace(stack_env, tmp_path, data):
    """SchedulerClient.submit_job with an SFT spec: the data path is read from the tenant's own
    storage, the job runs as the sft flow and its checkpoint lands in the tenant's folder. It asks to
    share its base: it trains as an adapter of the pool's base-model worker (opentinker.sft.shared)."""
    import fsspec

    from opentinker.client import SchedulerClient
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.control.submit import deploy

    settings, _ = stack_env
    deploy(settings)
    key = TenantStore(settings.state_dir / "tenants.json").create("sftco", rotate=True)
    with fsspec.open(f"{settings.storage_url}/tenants/sftco/data/chats.jsonl", "wb", auto_mkdir=True) as f:
        f.write(open(data, "rb").read())
    config = _sft(tmp_path, data, resources={"share_base": True})
    config["data"]["path"] = "data/chats.jsonl"  # relative to the tenant's storage
    client = SchedulerClient(url=settings.gateway_url, api_key=key)
    job = client.submit_job(config=config)
    final = client.wait(job["job_id"], timeout=600, poll=1)
    assert final["state"] == "COMPLETED", final.get("reason")
    assert final["checkpoint"].startswith(f"{settings.storage_url}/tenants/sftco/{job['job_id']}/step-00000004")
    with fsspec.open(f"{final['checkpoint']}/state.json") as f:
        result = json.load(f)["result"]
    assert result["shared_base"] and result["after"]["eval/loss"] < result["before"]["eval/loss"]


def test_a_bfloat16_sft_keeps_the_trainers_precision_rule(tmp_path, data):
    """`model.dtype: bfloat16` (what `auto` is on a CPU with AMX): the frozen base in bfloat16, the
    adapter and its AdamW state float32, the passes under bfloat16 autocast (TRL's bf16), and it learns."""
    job = SFTJob(parse_sft_spec(_sft(tmp_path, data, model={"dtype": "bfloat16"}, training={"epochs": 1})), job_id="sft-bf16")
    frozen = {p.dtype for p in job.model.parameters() if not p.requires_grad}
    trained = {p.dtype for p in job.model.parameters() if p.requires_grad}
    assert frozen == {torch.bfloat16} and trained == {torch.float32}
    result = job.run()
    assert result["after"]["train_set/loss"] < result["before"]["train_set/loss"] - 0.05, result
    from opentinker.storage.checkpoint import load_checkpoint

    loaded = load_checkpoint(result["checkpoint"])
    assert loaded.weights and {w.dtype for w in loaded.weights.values()} == {torch.float32}
