"""The house's order, read from the imports (ast): each package of `opentinker` imports only from
itself and the packages below it, no modules import each other in a loop, the runtime knows no
Prefect or Ray, the client reaches no torch, and no private name crosses a module.

Imports inside functions count too: a lazy import that reaches up a layer is still a tie.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "opentinker"

# Bottom to top: a package may import from those before it, never from those after it.
LAYERS = ["core", "algo", "env", "environment", "tools", "tracking", "storage", "model", "backend", "agent", "rl", "sft", "eval",
          "inference", "tinker", "control", "orchestration", "client", "cli"]
# The runtime: what a job needs to train in one process. No workflow engine, no cluster.
RUNTIME = ["core", "algo", "env", "environment", "tools", "tracking", "storage", "model", "backend", "agent", "rl", "sft", "eval", "inference", "tinker"]
CONTROL_PLANE = ("prefect", "prefect_ray", "ray")
HEAVY = ("torch", "transformers", "peft", "trl", "ray", "prefect", "prefect_ray", "mlflow")
MAX_LINES = 420


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(source: str, name: str, is_package: bool) -> list[tuple[str, list[str]]]:
    """(module, names taken) for every import in `source`, relative ones resolved."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            out.append((base, [alias.name for alias in node.names]))
    return out


def project_modules() -> dict[str, tuple[Path, list[tuple[str, list[str]]]]]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        found[name] = (path, imports(path.read_text(), name, path.name == "__init__.py"))
    return found


def layer(module: str) -> str | None:
    """The package of `opentinker.<package>.…`; None for the top-level `opentinker` package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "opentinker" else None


def targets(module: str, names: list[str], known: set[str]) -> list[str]:
    """The project modules an import reaches: `from pkg import mod` names a module too."""
    reached = [f"{module}.{n}" for n in names if f"{module}.{n}" in known]
    return reached or ([module] if module in known else [])


def upward_imports(modules) -> list[str]:
    problems, known = [], set(modules)
    for name, (_, found) in modules.items():
        own = layer(name)
        if own is None:
            continue
        for module, names in found:
            for target in targets(module, names, known):
                other = layer(target)
                if other is not None and other != own and LAYERS.index(other) > LAYERS.index(own):
                    problems.append(f"{name} imports {target}: {own} is below {other}")
    return problems


def cycles(modules) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    known = set(modules)
    graph = {name: {t for module, names in found for t in targets(module, names, known) if t != name}
             for name, (_, found) in modules.items()}
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_every_package_has_a_layer():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert packages == set(LAYERS), f"packages without a layer: {packages - set(LAYERS)}; layers without a package: {set(LAYERS) - packages}"
    assert not [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"], "every module lives in a layer's folder"


def test_no_module_imports_a_layer_above_its_own():
    assert upward_imports(project_modules()) == []


def test_the_check_fails_on_an_upward_import():
    """The rule can fail: the runtime's policy importing the control plane is caught."""
    modules = project_modules()
    path, found = modules["opentinker.rl.policy"]
    modules["opentinker.rl.policy"] = (path, found + imports("from opentinker.control.stack import Stack", "opentinker.rl.policy", False))
    assert upward_imports(modules) == ["opentinker.rl.policy imports opentinker.control.stack: rl is below control"]


def test_no_import_cycles():
    assert cycles(project_modules()) == []
    modules = project_modules()
    path, found = modules["opentinker.core.spec"]
    modules["opentinker.core.spec"] = (path, found + [("opentinker.rl.job", [])])
    assert cycles(modules), "a loop through core.spec is found"


def test_the_runtime_knows_no_prefect_or_ray():
    problems = [f"{name} imports {module}" for name, (_, found) in project_modules().items() if layer(name) in RUNTIME
                for module, _ in found if module.split(".")[0] in CONTROL_PLANE]
    assert problems == []


def test_the_client_reaches_no_torch_and_no_server_libraries():
    modules = project_modules()
    known, seen, todo = set(modules), set(), ["opentinker.client"]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for module, names in modules[name][1]:
            todo += targets(module, names, known)
    heavy = [f"{name} imports {module}" for name in sorted(seen) for module, _ in modules[name][1] if module.split(".")[0] in HEAVY]
    assert heavy == []
    loaded = subprocess.run([sys.executable, "-c", "import sys, opentinker.client; print(' '.join(sorted(sys.modules)))"],
                            capture_output=True, text=True, check=True, cwd=ROOT).stdout.split()
    assert not set(loaded) & set(HEAVY)


def test_no_private_name_crosses_a_module():
    crossing = [f"{name} takes {n} from {module}" for name, (_, found) in project_modules().items()
                for module, names in found if module.startswith("opentinker") and module != name
                for n in names if n.startswith("_")]
    assert crossing == []


def test_modules_stay_small():
    big = {module_name(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert big == {}, f"modules over {MAX_LINES} lines: {big}"


@pytest.mark.parametrize("path", ["opentinker.env", "opentinker.environment.base_game", "opentinker.client"])
def test_documented_import_paths_work(path):
    __import__(path)
    import opentinker

    assert callable(opentinker.run_inference)
