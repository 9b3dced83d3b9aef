"""A GPU worker's install resolves: pip's own resolver, asked for what infra/docker/Dockerfile.worker
installs, on Linux x86-64 for each Python the project supports. The worker has two environments:
the project's (its torch pin, then the project) and vLLM's own (`vllm==...`: vLLM pins a fastapi
that Prefect 3.8 cannot share, see engine_vllm). A pin change that breaks either fails here, on a
machine with no GPU.

Nothing is installed: `pip install --dry-run --report` reads the packages' metadata from the index
(the machine needs the package registry, as `make install` does). Platforms: manylinux 2.17 to 2.35,
what the worker image's Ubuntu 22.04 (glibc 2.35) accepts.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "infra" / "docker" / "Dockerfile.worker"
VLLM_INSTALL = ROOT / "infra" / "vllm" / "install.sh"
PYTHONS = ("3.11", "3.12")
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in range(17, 36)] + ["manylinux2014_x86_64", "linux_x86_64", "any"]


def worker_installs(dockerfile: Path | None = None) -> dict[str, list[str]]:
    """{"project": its torch pin, the project's dependencies and extras; "vllm": what vLLM's environment installs}."""
    runs = "\n".join(line for line in (dockerfile or WORKER).read_text().replace("\\\n", " ").splitlines() if line.startswith("RUN "))
    torch_pin = re.search(r"(?<!/)\bpip install (torch==[\w.]+)", runs)
    project = re.search(r"(?<!/)\bpip install (?:-e )?['\"]?\.(?:\[([\w,]+)\])?['\"]?(?:\s|$)", runs)
    script = re.search(r"bash \S*install-vllm\.sh /opt/vllm gpu", runs)  # infra/vllm/install.sh, its gpu flavour
    vllm = script and re.search(r"^\s*gpu\)\s*\n\s*\$PIP ([^\n#]+)", VLLM_INSTALL.read_text(), re.M)
    assert torch_pin and project and vllm, "Dockerfile.worker: no torch pin, no project install or no vLLM environment (/opt/vllm)"
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [torch_pin.group(1), *meta["dependencies"]]
    for extra in filter(None, (project.group(1) or "").split(",")):
        wanted += meta["optional-dependencies"][extra]
    return {"project": wanted, "vllm": vllm.group(1).split()}


def resolve(report: Path, python: str, requirements: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(report),
           "--only-binary=:all:", "--python-version", python, "--implementation", "cp", "--abi", f"cp{python.replace('.', '')}",
           *[arg for p in PLATFORMS for arg in ("--platform", p)], "--target", str(report.with_suffix(".unused")), *requirements]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.mark.slow  # resolves the GPU installs for every Python (85 s): a packaging check, not behaviour
def test_the_gpu_worker_installs_resolve_for_every_supported_python(tmp_path):
    installs = worker_installs()
    # side by side; the project's environment on 3.11 is what `make install` resolves on every run already
    running = {(env, python): resolve(tmp_path / f"{env}-{python}.json", python, installs[env])
               for env in installs for python in PYTHONS if (env, python) != ("project", "3.11")}
    for (env, python), proc in running.items():
        output, _ = proc.communicate(timeout=600)
        errors = [line for line in output.splitlines() if line.startswith("ERROR")]
        assert proc.returncode == 0, f"Python {python}, {env} environment: pip cannot resolve it: {' | '.join(errors) or output[-2000:]}"
        installed = {item["metadata"]["name"].lower().replace("_", "-"): item["metadata"]["version"]
                     for item in json.loads((tmp_path / f"{env}-{python}.json").read_text())["install"]}
        for wanted in map(Requirement, installs[env]):
            name = wanted.name.lower().replace("_", "-")
            assert name in installed, f"Python {python}, {env}: {name} is not in the resolved install"
            assert wanted.specifier.contains(installed[name], prereleases=True), (python, env, name, installed[name])
    assert installs["project"][0] == "torch==2.13.0", "the worker's project environment keeps the CPU default's torch"


@pytest.mark.parametrize("lines", ["RUN pip install -e .", "RUN pip install torch==2.13.0 && pip install -e .",
                                   "RUN pip install torch==2.13.0\nRUN bash /tmp/install-vllm.sh /opt/vllm cpu"])
def test_a_worker_image_missing_an_install_is_named(tmp_path, lines):
    dockerfile = tmp_path / "Dockerfile.worker"
    dockerfile.write_text(f"FROM x\n{lines}\n")
    with pytest.raises(AssertionError, match="no torch pin, no project install or no vLLM environment"):
        worker_installs(dockerfile)


def test_the_worker_image_installs_are_read_as_written():
    installs = worker_installs()
    assert installs["vllm"] == ["vllm==0.33.0"]
    assert installs["project"][1:] == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
