"""MkDocs hooks: the reference parts of the docs are generated from the code at build time.

A page asks for generated content with a marker on a line of its own, `<!-- gen:KIND ARGS -->`:

    <!-- gen:spec JobSpec -->              every field of a spec model and of the sections nested in it
    <!-- gen:spec JobSpec.rollout -->      one section only (a field path into the model)
    <!-- gen:settings -->                  the OPENTINKER_* settings (opentinker/core/settings.py)
    <!-- gen:cli -->                       every `opentinker` command, from the typer app
    <!-- gen:bench -->                     every bench/results/*.md, with the command that made it
    <!-- gen:bench NAME -->                one of them (bench/results/NAME.md)
    <!-- gen:plot NAME -->                 a learning curve drawn from bench/results/NAME.json

An unknown marker, a missing results file or a model path that does not exist fails the build,
so `mkdocs build --strict` (tests/test_docs.py) catches a reference that no longer matches.
Nothing generated is committed: the files are made from the models, the typer app and the
results on every build. This module lives under docs/, not in the product package.
"""

from __future__ import annotations

import ast
import html
import json
import re
import shlex
import sys
import types
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MARKER = re.compile(r"^<!-- gen:(\w+)(?: ([^>]*?))? -->$", re.M)

if str(ROOT) not in sys.path:  # the project itself, when mkdocs runs from another interpreter path
    sys.path.insert(0, str(ROOT))


class GenError(Exception):
    """A marker the generator cannot satisfy; fails the build with the page named."""


# ----------------------------------------------------------------------------- the hook


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - MkDocs' signature
    def replace(m: re.Match) -> str:
        kind, args = m.group(1), (m.group(2) or "").split()
        try:
            return GENERATORS[kind](*args)
        except KeyError as err:
            raise GenError(f"{page.file.src_uri}: unknown marker gen:{kind}") from err
        except GenError as err:
            raise GenError(f"{page.file.src_uri}: gen:{kind} {' '.join(args)}: {err}") from err

    from mkdocs.exceptions import PluginError

    try:
        return MARKER.sub(replace, markdown)
    except GenError as err:
        raise PluginError(str(err)) from err


# ----------------------------------------------------------------------------- spec reference


def _spec_models() -> dict[str, type]:
    from opentinker.core.spec import JobSpec
    from opentinker.inference.spec import InferenceSpec
    from opentinker.sft.spec import SFTSpec

    return {"JobSpec": JobSpec, "SFTSpec": SFTSpec, "InferenceSpec": InferenceSpec}


def _is_model(t: Any) -> bool:
    from pydantic import BaseModel

    return isinstance(t, type) and issubclass(t, BaseModel)


def _models_in(annotation: Any) -> list[type]:
    """The pydantic models an annotation names (a section, an optional one, a union of kinds)."""
    if _is_model(annotation):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _kind(model: type) -> str | None:
    """The tag of one kind of a union of sections (`lora` for LoraSpec), None for a plain section."""
    kind = model.model_fields.get("kind")
    return kind.default if kind is not None and typing.get_origin(kind.annotation) is typing.Literal else None


def _anchor(root: str, path: str) -> str:
    return f"{root.lower()}-{path.replace('.', '-').replace('=', '-')}" if path else root.lower()


def _type_name(t: Any, root: str, path: str) -> str:
    """A field type as a reader writes it in YAML: literals as their values, sections linked."""
    origin, args = typing.get_origin(t), typing.get_args(t)
    if t is type(None):
        return "null"
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a, root, path) for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0], root, path)
    if _is_model(t):
        kind = _kind(t)
        return f"[{kind or t.__name__}](#{_anchor(root, f'{path}={kind}' if kind else path)})"
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a, root, path) for a in args)}]"
    if t is Any:
        return "any"
    return getattr(t, "__name__", str(t)).replace("Path", "path")


def _default(field) -> str:
    if field.is_required():
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default
    if _is_model(type(value)):
        return "(section defaults)"
    if hasattr(value, "__fspath__"):
        value = str(value)
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def _bounds(field) -> str:
    out = []
    for m in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤")):
            if getattr(m, attr, None) is not None and type(m).__name__ in ("Gt", "Ge", "Lt", "Le"):
                out.append(f"{sign} {getattr(m, attr):,}".replace(",", " "))
        if type(m).__name__ == "MinLen":
            out.append(f"at least {m.min_length} item(s)" if m.min_length != 1 else "not empty")
        if type(m).__name__ == "MaxLen":
            out.append(f"at most {m.max_length}")
        if getattr(m, "pattern", None):
            out.append(f"matches `{m.pattern}`")
        if type(m).__name__ == "AfterValidator" and getattr(m.func, "__name__", "") == "_finite":
            out.append("finite")
    return ", ".join(out)


def _text(text: str) -> str:
    """Prose from the code as Markdown shows it literally (`<name>` is not a tag, `*` no emphasis)."""
    parts = re.split(r"(`[^`]*`)", " ".join(text.split()))
    return "".join(p if p.startswith("`") else html.escape(p, quote=False).replace("*", "\\*") for p in parts)


def _cell(text: str) -> str:
    return _text(text).replace("|", "\\|")


def _doc(model: type) -> str:
    """A model's own docstring (not one inherited from a base section)."""
    return _text(model.__dict__.get("__doc__") or "")


def _sections(model: type, root: str, path: str = "") -> list[tuple[str, type]]:
    """(path, model) for `model` and every section nested in it, depth first, in field order.
    A union of kinds (adapter: lora | full) gives one section per kind, `adapter=lora`."""
    out = [(path, model)]
    for name, field in model.model_fields.items():
        sub = f"{path}.{name}" if path else name
        for m in _models_in(field.annotation):
            out += _sections(m, root, f"{sub}={_kind(m)}" if _kind(m) else sub)
    return out


def _section_table(model: type, root: str, path: str) -> str:
    rows = ["| field | type | default | bounds | description |", "|---|---|---|---|---|"]
    for name, field in model.model_fields.items():
        sub = f"{path}.{name}" if path else name
        rows.append(f"| `{name}` | {_type_name(field.annotation, root, sub)} | {_default(field)} | "
                    f"{_bounds(field)} | {_cell(field.description or '')} |")
    return "\n".join(rows)


def _rules(sections: list[tuple[str, type]]) -> str:
    """What holds for every field, read from the models' configuration."""
    configs = [m.model_config for _, m in sections]
    rules = []
    if all(c.get("extra") == "forbid" for c in configs):
        rules.append("An unknown key in any section is an error.")
    limits = {c.get("str_max_length") for c in configs}
    if len(limits) == 1 and (limit := limits.pop()):
        rules.append(f"Every string is at most {limit} characters.")
    if all(hasattr(m, "_no_control_characters") for _, m in sections):  # opentinker.core.spec.Section's check
        rules.append("No string holds a control character.")
    return " ".join(rules) or "Unknown keys are errors where the section says so."


def gen_spec(target: str, level: str = "3") -> str:
    root, _, want = target.partition(".")
    models = _spec_models()
    if root not in models:
        raise GenError(f"no spec model {root!r} (known: {', '.join(models)})")
    sections = _sections(models[root], root)
    if want:
        sections = [(p, m) for p, m in sections if p == want or p.startswith(want + "=") or p.startswith(want + ".")]
        if not sections:
            raise GenError(f"{root} has no section {want!r}")
    hashes = "#" * int(level)
    parts = []
    for path, model in sections:
        title = f"`{path.replace('=', ' (kind: ')}{')' if '=' in path else ''}`" if path else f"`{root}` (the whole spec)"
        parts.append(f"{hashes} {title} {{#{_anchor(root, path)}}}")
        if doc := _doc(model):
            parts.append(doc)
        if not path:
            parts.append(_rules(sections))
        parts.append(_section_table(model, root, path))
    return "\n\n".join(parts)


# ----------------------------------------------------------------------------- settings


def _attribute_docs(cls: type) -> dict[str, str]:
    """The docstrings written under a class's attributes (as opentinker/core/settings.py does)."""
    import inspect

    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr) \
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def gen_settings() -> str:
    from opentinker.core.settings import Settings

    prefix = Settings.model_config.get("env_prefix", "")
    docs = _attribute_docs(Settings)
    rows = ["| variable | type | default | bounds | what it sets |", "|---|---|---|---|---|"]
    for name, field in Settings.model_fields.items():
        rows.append(f"| `{prefix}{name.upper()}` | {_type_name(field.annotation, 'settings', name)} | {_default(field)} | "
                    f"{_bounds(field)} | {_cell(docs.get(name, field.description or ''))} |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- CLI reference


def gen_cli() -> str:
    """Typer's own Markdown for the app (what `typer opentinker.cli.main utils docs` prints), its
    headings one level down so that each command is a section of the page."""
    import typer
    import typer.main
    from typer.cli import get_docs_for_click

    from opentinker.cli.main import app

    cmd = typer.main.get_command(app)
    text = get_docs_for_click(obj=cmd, ctx=typer.Context(cmd), name="opentinker")
    lines, fenced = [], False
    for line in text.strip().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and not line.startswith("```"):  # `<storage>` in prose is text, not an HTML tag
            line = "".join(p if p.startswith("`") else p.replace("<", "&lt;") for p in re.split(r"(`[^`]*`)", line))
            line = re.sub(r"^(#+) ", r"#\1 ", line)
        lines.append(line)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- benchmark results


def _makefile_bench_commands() -> list[list[str]]:
    """The `make bench` lines, as argument lists (`python bench/x.py --flag v`)."""
    text = (ROOT / "Makefile").read_text()
    return [["python", *shlex.split(m.group(1))] for m in re.finditer(r"^\t\$\(PY\) (bench/\S+\.py.*)$", text, re.M)]


def _gpu_step_command(data: dict) -> str:
    s = data["setup"]
    return (f"python bench/gpu_step.py --adapter {s['adapter']} --prompts {s['prompts']} --group {s['group']} "
            f"--micro-batch {s['micro_batch']} --steps {s['steps']}{' --compile' if s.get('compile') else ''}"
            "   # on a GPU machine: bash bench/gpu_run.sh")


# Results whose JSON does not record its command and which `make bench` does not run as it is:
# the command each was made with, as the results' own text and the bench's options say.
EXTRA_COMMANDS = {
    "learning_math_sft_rl": "python bench/learning_math.py --sft-first --steps 40",
    "learning_tinker": "python bench/learning_tinker.py --steps 25 --every 5 --recompute-logprobs",
    "learning_gomoku_vs_greedy": "python bench/learning_gomoku.py --steps 16 --every 4 --eval-n 32 --lr 5e-4 --no-selfplay "
                                 "--eval-mode sampled --max-turns 8 --max-total-tokens 1536 --vs-greedy",
}


def _as_recorded(argv: list[str], data: Any) -> list[str]:
    """A `make bench` line with each `--opt VALUE` the results record otherwise (key `opt`) set to
    the recorded value: the results say what ran, the Makefile only what runs next."""
    argv = list(argv)
    for i, arg in enumerate(argv[:-1]):
        key = arg[2:].replace("-", "_") if arg.startswith("--") else None
        if key and isinstance(data, dict) and isinstance(data.get(key), (int, float, str)) and not argv[i + 1].startswith("--"):
            if str(data[key]) != argv[i + 1]:
                argv[i + 1] = str(data[key])
    return argv


def bench_command(name: str) -> str:
    """The command that wrote bench/results/NAME.json: as the JSON records it, else the `make bench`
    line of its script (the variant named by the file's suffix), else the known extras."""
    data = json.loads((RESULTS / f"{name}.json").read_text())
    if isinstance(data, dict) and isinstance(data.get("command"), str):
        return data["command"]
    if name in EXTRA_COMMANDS:
        return EXTRA_COMMANDS[name]
    if name.startswith("gpu_step_"):
        return _gpu_step_command(data)
    for argv in _makefile_bench_commands():
        script = Path(argv[1]).stem
        if name == script or (name.startswith(script + "_") and name[len(script) + 1:] in argv[2:]):
            return shlex.join(_as_recorded(argv, data))
    raise GenError(f"no command known for bench/results/{name}.json (record it as the JSON's 'command')")


def _results_names() -> list[str]:
    return sorted(p.stem for p in RESULTS.glob("*.json") if (RESULTS / f"{p.stem}.md").exists())


def _bench_block(name: str, level: int) -> str:
    md = RESULTS / f"{name}.md"
    if not md.exists():
        raise GenError(f"no bench/results/{name}.md")
    text = md.read_text().strip()
    shift = "#" * (level - 1)
    text = re.sub(r"^(#+) ", lambda m: f"{shift}{m.group(1)} ", text, flags=re.M)
    if not text.startswith("#"):
        text = f"{'#' * level} {name}\n\n{text}"
    first, _, rest = text.partition("\n")
    made = f"Made by `{bench_command(name)}`; data: `bench/results/{name}.json`."
    return f"{first} {{#bench-{name}}}\n\n{made}\n{rest}"


def gen_bench(name: str | None = None, level: str = "3") -> str:
    names = [name] if name else _results_names()
    return "\n\n".join(_bench_block(n, int(level)) for n in names)


# ----------------------------------------------------------------------------- plots


def _curves(name: str) -> tuple[str, list[tuple[str, list[tuple[float, float]]]]]:
    """(y label, [(series label, [(step, value)])]) for a learning-curve results file; a file with a
    `plot` ({"x", "y", "series": {label: [[x, y], ...]}}) gives its own axes (gen_plot reads `x`)."""
    path = RESULTS / f"{name}.json"
    if not path.exists():
        raise GenError(f"no bench/results/{name}.json")
    data = json.loads(path.read_text())
    if "plot" in data:
        plot = data["plot"]
        return plot["y"], [(label, [(float(x), float(y)) for x, y in pts]) for label, pts in plot["series"].items()]

    def points(curve, key):
        return [(row["step"], row[key]) for row in curve if row.get(key) is not None]

    if "runs" in data:  # learning_vlm: one curve per way (with the picture, blank pictures)
        return "greedy held-out accuracy", [(run["way"], points(run["curve"], "greedy_accuracy")) for run in data["runs"]]
    curve = data.get("curve")
    if isinstance(curve, list) and curve:
        key = "greedy_accuracy" if "greedy_accuracy" in curve[0] else "accuracy"
        return "held-out accuracy", [(name.replace("_", " "), points(curve, key))]
    raise GenError(f"bench/results/{name}.json has no learning curve")


def gen_plot(*names: str) -> str:
    """An inline SVG line chart (0-100% against the step) of one or more learning curves."""
    series = []
    for name in names:
        ylabel, curves = _curves(name)
        series += curves if len(curves) > 1 or len(names) == 1 else [(name.replace("_", " "), curves[0][1])]
    w, h, left, bottom, top, right = 560, 260, 48, 36, 12, 150
    xmax = max(x for _, pts in series for x, _ in pts) or 1
    px = lambda x: left + (w - left - right) * x / xmax  # noqa: E731
    py = lambda y: top + (h - top - bottom) * (1 - y)  # noqa: E731
    colours = ["#3f51b5", "#e65100", "#2e7d32", "#6a1b9a"]
    el = [f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" role="img" '
          f'aria-label="{html.escape(ylabel)}: {html.escape(", ".join(names))}" style="font:11px sans-serif">']
    for y in (0, 0.25, 0.5, 0.75, 1.0):
        el.append(f'<line x1="{left}" x2="{w - right}" y1="{py(y):.1f}" y2="{py(y):.1f}" stroke="#ddd"/>'
                  f'<text x="{left - 6}" y="{py(y) + 4:.1f}" text-anchor="end">{y:.0%}</text>')
    xlabel = next((json.loads((RESULTS / f"{n}.json").read_text()).get("plot", {}).get("x") for n in names), None) or "step"
    ticks = sorted({x for _, pts in series for x, _ in pts}) if xlabel == "step" else [round(xmax * i / 5) for i in range(6)]
    for x in ticks:
        el.append(f'<text x="{px(x):.1f}" y="{h - bottom + 16}" text-anchor="middle">{x}</text>')
    el.append(f'<text x="{(left + w - right) / 2:.0f}" y="{h - 4}" text-anchor="middle">{html.escape(xlabel)}</text>')
    for i, (label, pts) in enumerate(series):
        c = colours[i % len(colours)]
        line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        el.append(f'<polyline fill="none" stroke="{c}" stroke-width="2" points="{line}"/>')
        el += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" fill="{c}"><title>{html.escape(label)}, {x:g}: '
               f'{y:.1%}</title></circle>' for x, y in pts]
        el.append(f'<text x="{w - right + 10}" y="{top + 14 + 16 * i}" fill="{c}">{html.escape(label)}</text>')
    el.append("</svg>")
    source = ", ".join(f"`bench/results/{n}.json`" for n in names)
    return "".join(el) + f"\n\n*{ylabel.capitalize()} by {xlabel}, drawn from {source} at build time.*"


GENERATORS = {"spec": gen_spec, "settings": gen_settings, "cli": gen_cli, "bench": gen_bench, "plot": gen_plot}
