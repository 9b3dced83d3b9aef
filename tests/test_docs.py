"""The documentation cannot drift from the code: the site builds with `mkdocs build --strict`
(a broken link, a missing page or anchor, or a generated reference that no longer matches the
code fails the build), offline; the generated reference covers every spec field, every CLI
command and every benchmark result; the README stays short and its links and commands point at
things that exist; and the docs' examples (Python and shell) run, or say why they are not run."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
NOT_RUN = re.compile(r"<!-- not run: (?P<reason>[^>]+?) -->\s*$")


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built once for this module. Any request to the network fails (proxies that
    refuse), so a plugin that fetches at build time fails the build instead of slowing it."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9",
           "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "NO_PROXY": "", "no_proxy": ""}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
                           "--site-dir", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def _page(site: Path, src: str) -> str:
    return (site / src.removesuffix(".md").removesuffix("index") / "index.html").read_text()


def _nav_pages() -> list[str]:
    import yaml

    def walk(item):
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for v in item.values():
                yield from walk(v)
        elif isinstance(item, list):
            for v in item:
                yield from walk(v)

    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    return list(walk(config["nav"]))


def test_the_site_builds_strict_and_has_every_page(site):
    pages = _nav_pages()
    for title in ("quickstart", "concepts", "environments", "training", "service", "tinker", "inference", "gpus",
                  "deploying", "failures", "benchmarks", "design"):
        assert f"{title}.md" in pages
    for src in pages:
        assert (DOCS / src).exists(), src
        assert _page(site, src), src


def test_the_spec_reference_has_every_field_of_every_section(site):
    hooks = _hooks()
    html = _page(site, "reference/spec.md")
    for root, model in hooks._spec_models().items():
        for path, section in hooks._sections(model, root):
            assert f'id="{hooks._anchor(root, path)}"' in html, (root, path)
            for name, field in section.model_fields.items():
                assert f"<code>{name}</code>" in html, (root, path, name)
    assert "<code>OPENTINKER_STATE_DIR</code>" in _page(site, "reference/settings.md")


def test_the_cli_reference_has_every_command(site):
    import typer.main

    from opentinker.cli.main import app

    html = _page(site, "reference/cli.md")
    cmd = typer.main.get_command(app)
    ctx = cmd.context_class(cmd, info_name="opentinker")

    def walk(c, path, ctx):
        yield path
        if hasattr(c, "list_commands"):
            for name in c.list_commands(ctx):
                sub = c.get_command(ctx, name)
                yield from walk(sub, f"{path} {name}", sub.context_class(sub, parent=ctx, info_name=name))

    for path in walk(cmd, "opentinker", ctx):
        assert f"<code>{path}</code>" in html, path


def test_every_benchmark_result_is_on_the_benchmarks_page_with_its_command(site):
    hooks = _hooks()
    html = _page(site, "benchmarks.md")
    names = hooks._results_names()
    assert "learning_math" in names
    for name in names:
        assert f'id="bench-{name}"' in html, name
        assert hooks.bench_command(name).startswith("python bench/"), name


def test_the_python_api_reference_is_generated(site):
    html = _page(site, "reference/python.md")
    for name in ("SchedulerClient", "ServiceClient", "InferenceSchedulerClient", "AbstractGame", "GameEnvironment",
                 "StepResult", "run_inference", "submit_job", "fit"):
        assert name in html, name


def test_a_marker_the_generator_does_not_know_fails_the_build():
    hooks = _hooks()

    class Page:
        class file:
            src_uri = "x.md"

    from mkdocs.exceptions import PluginError

    for marker in ("<!-- gen:nonsense -->", "<!-- gen:spec JobSpec.no_such_section -->", "<!-- gen:bench no_such_result -->"):
        with pytest.raises(PluginError, match="x.md"):
            hooks.on_page_markdown(f"# t\n\n{marker}\n", Page, None, None)


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move the detail into docs/"


def test_the_readmes_links_into_the_docs_resolve(site):
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\((docs/[^)#\s]+)(?:#([^)\s]+))?\)", text)
    assert links
    pictures = re.findall(r'<img src="([^"]+)"', text)
    assert pictures
    for path in pictures:
        assert path.startswith("docs/img/") and (ROOT / path).is_file(), path
    for path, anchor in links:
        assert (ROOT / path).exists(), path
        if anchor:
            assert f'id="{anchor}"' in _page(site, path.removeprefix("docs/")), f"{path}#{anchor}"


def test_every_picture_is_shown_and_small():
    """docs/img/ holds only pictures a page or the README shows (docs/screenshots.py makes them
    again), each under 400 KB: the repository stays small."""
    texts = [doc.read_text() for doc in _documents()]
    pictures = sorted((DOCS / "img").iterdir())
    assert {p.name for p in pictures} >= {"prefect-run.png", "mlflow-run.png"}
    for picture in pictures:
        assert picture.stat().st_size < 400_000, picture.name
        assert any(f"img/{picture.name}" in text for text in texts), f"{picture.name} is shown nowhere"

def _code_blocks(text: str) -> list[tuple[str, str, str]]:
    """(language, code, the line just before the block) for every fenced block at any indentation."""
    blocks = []
    for m in re.finditer(r"(?P<before>[^\n]*)\n(?:[ ]*\n)?(?P<indent>[ ]*)```(?P<lang>\w*)\n(?P<code>.*?)\n(?P=indent)```", text, re.S):
        code = textwrap.dedent("\n".join(line[len(m["indent"]):] for line in m["code"].splitlines()))
        blocks.append((m["lang"], code, m["before"]))
    return blocks


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]


def _shell_lines(code: str) -> list[list[str]]:
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        if words:
            out.append(words)
    return out


def test_the_commands_in_the_docs_name_real_commands_targets_and_files():
    """What every shell block names exists, in the blocks that are not run too (they need a stack,
    a GPU or minutes): each `opentinker …` sub-command, each `make` target, each examples/ spec
    (which must validate) and each bench/ script."""
    import typer.main

    from opentinker.cli.main import app

    cli = typer.main.get_command(app)
    ctx = cli.context_class(cli, info_name="opentinker")
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    from opentinker.cli.common import load_any_spec

    checked = 0
    for doc in _documents():
        for lang, code, _ in _code_blocks(doc.read_text()):
            if lang not in ("bash", "sh", "console"):
                continue
            for words in _shell_lines(code):
                while words and "=" in words[0] and not words[0].startswith("-"):  # VAR=value cmd
                    words = words[1:]
                if not words:
                    continue
                where = f"{doc.relative_to(ROOT)}: {' '.join(words)}"
                if words[0].endswith("opentinker"):
                    cmd, sub_ctx = cli, ctx
                    for word in words[1:]:
                        if word.startswith("-") or not hasattr(cmd, "list_commands"):
                            break
                        sub = cmd.get_command(sub_ctx, word)
                        assert sub is not None, f"{where}: no command {word!r}"
                        cmd, sub_ctx = sub, sub.context_class(sub, parent=sub_ctx, info_name=word)
                    checked += 1
                elif words[0] == "make":
                    for word in words[1:]:
                        if "=" not in word:
                            assert word in targets, f"{where}: no make target {word!r}"
                    checked += 1
                for word in words:
                    if re.fullmatch(r"examples/[\w.-]+\.ya?ml", word):
                        load_any_spec(ROOT / word)
                    if re.fullmatch(r"bench/[\w.-]+\.(py|sh)", word):
                        assert (ROOT / word).exists(), f"{where}: no {word}"
    assert checked > 20


def test_the_python_examples_run_or_say_why_not(tmp_path):
    """Every ```python block in the README and docs runs (in a fresh interpreter, from the
    repository root), unless the line above it is `<!-- not run: reason -->`."""
    ran, skipped = 0, []
    for doc in _documents():
        for lang, code, before in _code_blocks(doc.read_text()):
            if lang != "python":
                continue
            if m := NOT_RUN.search(before):
                skipped.append((doc.name, m["reason"]))
                continue
            script = tmp_path / f"block{ran}.py"
            script.write_text(code)
            proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, f"{doc.relative_to(ROOT)}:\n{code}\n{proc.stderr[-3000:]}"
            ran += 1
    assert ran >= 1
    assert all(len(reason.strip()) > 5 for _, reason in skipped)


SHELL = ("bash", "sh", "console")


def _runnable(lang: str, code: str) -> str:
    """The commands of a block: a ```console block's `$ ` lines (its other lines are output)."""
    if lang != "console":
        return code
    return "\n".join(line[2:] for line in code.splitlines() if line.startswith("$ "))


def _repository_of_links(tmp_path: Path) -> Path:
    """The repository root as links to its entries, without runs/: a block runs from the root as a
    reader's would, and what it writes there (runs/…) lands in this temporary folder."""
    root = tmp_path / "repo"
    root.mkdir()
    for entry in ROOT.iterdir():
        if entry.name not in ("runs", ".git"):
            (root / entry.name).symlink_to(entry)
    return root


def test_the_shell_examples_run_or_say_why_not(tmp_path):
    """Every ```bash, ```sh and ```console block in the README and docs runs under `bash -e` (the
    project's venv first on PATH), unless the line above it is `<!-- not run: reason -->`. Each
    block gets a fresh state folder and free ports, so it never sees or changes a developer's stack
    or tenants (`opentinker status` reports a stack that is not running). A block that appears in
    two documents runs once."""
    from tests.stack_fixtures import PORTS, free_ports

    root = _repository_of_links(tmp_path)
    ran, skipped = {}, []
    for doc in _documents():
        for lang, code, before in _code_blocks(doc.read_text()):
            if lang not in SHELL:
                continue
            if m := NOT_RUN.search(before):
                skipped.append((doc.name, m["reason"]))
                continue
            code = _runnable(lang, code)
            if code in ran:
                continue
            state = tmp_path / f"state{len(ran)}"
            env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
                   "OPENTINKER_STATE_DIR": str(state),
                   **{f"OPENTINKER_{name.upper()}": str(port) for name, port in zip(PORTS, free_ports(len(PORTS)))}}
            proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], cwd=root, env=env, capture_output=True,
                                  text=True, timeout=120)
            assert proc.returncode == 0, f"{doc.relative_to(ROOT)}:\n{code}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
            if "prints a key that starts with tml-" in code:
                assert re.search(r"^tml-\S+$", proc.stdout, re.M), proc.stdout
            ran[code] = proc.stdout
    assert len(ran) >= 3, list(ran)
    assert all(len(reason.strip()) > 5 for _, reason in skipped)
