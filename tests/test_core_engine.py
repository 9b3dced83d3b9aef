"""The core engine (spec, trainer, rollout engine, a local run) runs on a machine dressed like a
cluster's GPU node: torch, transformers, peft, accelerate, numpy and pydantic with what they
depend on (pydantic-settings with pydantic: two small wheels), and nothing else — no Prefect, Ray, MLflow, S3 client, web server or CLI toolkit.

The test builds that machine's site-packages as a folder of links to exactly those distributions
(the closure of their requirements, read from their metadata) and runs one training step in a
Python that sees only it and the repository."""

from __future__ import annotations

import importlib.metadata as md
import json
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import torch
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
CORE = ["torch", "transformers", "peft", "accelerate", "numpy", "pydantic", "pydantic-settings"]
CONTROL_PLANE = {"prefect", "ray", "mlflow", "s3fs", "boto3", "fastapi", "uvicorn", "tenacity", "httpx", "trl", "openai"}

RUN = """
import sys, tempfile
from opentinker.core.spec import parse_spec
from opentinker.rl import RLJob

spec = parse_spec({"model": {"name": "tiny-random"}, "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
                   "optimization": {"steps": 1}, "evaluation": {"every": 0, "n_samples": 4},
                   "checkpoint": {"base_url": "file://" + tempfile.mkdtemp()},
                   "env": {"game": "envs.toy:UppercaseGame", "config": {"val_size": 4}}})
result = RLJob(spec, job_id="core-only").run()
loaded = sorted({m.split(".")[0] for m in sys.modules})
print("steps", result.steps_done, "checkpoint", result.checkpoint is not None)
print("modules", " ".join(loaded))
"""


def _closure(names: list[str]) -> list[md.Distribution]:
    seen: dict[str, md.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in seen:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        seen[key] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _site_packages_of(dists: list[md.Distribution], target: Path) -> None:
    """Link every top-level file or folder the distributions installed (and their metadata)."""
    for dist in dists:
        for file in dist.files or []:
            top = file.parts[0]
            if top in ("..", "__pycache__") or top.endswith(".pth"):
                continue
            source, link = Path(dist.locate_file(top)), target / top
            if source.exists() and not link.exists():
                link.symlink_to(source)


def _core_only(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """Run python with `args` seeing only the standard library, the core closure and the repo."""
    dists = _closure(CORE)
    names = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() for d in dists}
    assert not names & CONTROL_PLANE, names & CONTROL_PLANE
    site = tmp_path / "site-packages"
    site.mkdir()
    _site_packages_of(dists, site)
    env = {"PYTHONPATH": f"{REPO}{':'}{site}", "PYTHONNOUSERSITE": "1", "HOME": str(Path.home()),
           "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin"}
    # -S: no site-packages but the folder above (the standard library stays).
    return subprocess.run([sys.executable, "-S", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_one_training_step_with_only_the_core_libraries(tmp_path, tiny_path):
    done = _core_only(tmp_path, "-c", RUN)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "steps 1 checkpoint True" in done.stdout
    loaded = set(done.stdout.split("modules", 1)[1].split())
    assert not loaded & {"prefect", "ray", "mlflow", "s3fs", "fastapi", "httpx", "tenacity"}
    assert sysconfig.get_paths()["purelib"] not in done.stdout


def test_the_gpu_benchmark_runs_with_only_the_core_libraries(tmp_path):
    """bench/gpu_step.py on the CPU with a tiny shape: the same code path a GPU node runs."""
    out = tmp_path / "results"
    done = _core_only(tmp_path, str(REPO / "bench" / "gpu_step.py"), "--shapes", "tiny", "--device", "cpu", "--steps", "2",
                      "--prompts", "2", "--group", "2", "--prompt-len", "16", "--new-tokens", "8", "--micro-batch", "4", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((out / "gpu_step_full.json").read_text())["results"][0]
    assert result["shape"] == "tiny" and result["generated_tokens_per_s"] > 0 and result["update_tokens_per_s"] > 0
    assert result["update_mfu"] is None  # no bf16 peak for a CPU: never a made-up number
    assert "| tiny |" in (out / "gpu_step_full.md").read_text()


def test_the_joint_updates_benchmark_runs_with_only_the_core_libraries(tmp_path):
    """bench/joint_updates.py (hosted jobs' updates in turn and joint, for a GPU node) on the CPU, tiny."""
    out = tmp_path / "results"
    done = _core_only(tmp_path, str(REPO / "bench" / "joint_updates.py"), "--shape", "tiny", "--device", "cpu", "--jobs", "2",
                      "--repeats", "1", "--prompts", "2", "--group", "2", "--prompt-len", "16", "--new-tokens", "8",
                      "--micro-batch", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((out / "joint_updates_cpu.json").read_text())["rows"]
    assert [r["way"] for r in rows] == ["in turn", "joint", "in turn, shared prefix"] and all(r["tokens_per_s"] > 0 for r in rows)
    assert 0 <= rows[1]["joint_share"] <= 1 and rows[1]["ratio"] > 0  # (test_joint_updates checks that passes are shared)
    assert "| joint |" in (out / "joint_updates_cpu.md").read_text()


def test_the_benchmarks_flop_count_uses_the_models_true_size():
    """The decoder parameters in the MFU formula are those transformers builds for the shape."""
    import importlib.util

    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = importlib.util.spec_from_file_location("gpu_step", REPO / "bench" / "gpu_step.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for shape in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
        config = Qwen2Config(**bench.SHAPES[shape])
        with torch.device("meta"):
            model = Qwen2ForCausalLM(config)
        matrices = sum(p.numel() for p in model.model.layers.parameters() if p.dim() == 2)
        d, v, layers = config.hidden_size, config.vocab_size, config.num_hidden_layers
        # one sequence of 10 tokens, 4 sampled, full training: 3 x (2·N·S + 2·V·d·R + 2·L·d·S²)
        assert bench.update_flops(config, [(10, 4)], "full") == 3 * (2 * matrices * 10 + 2 * v * d * 4 + 2 * layers * d * 100)
