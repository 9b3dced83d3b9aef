"""How big and how deep a spec may be, checked before anything parses it further or sends it
anywhere: a spec file is measured on disk before it is read, its YAML is parsed once with its
nesting and alias expansion bounded, and plain data (from a file, a client or an HTTP body) is
walked once for its depth, its strings and its size. Every refusal is one `field: reason` line
(`<path of the file>: reason` for the file itself) that names sizes and places, never the value.

One limit holds end to end, `MAX_SPEC_BYTES`: the CLI, the client SDK and the gateway use it, and
it sits below Prefect's own limit on a flow run's parameters (512 KB as JSON, where the spec is
stored), so nothing a check here lets through is refused later by Prefect.
"""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

MAX_SPEC_BYTES = 256 * 1024
"""A whole spec: its file on disk, and it as JSON (inline datasets included). Prefect stores it in
a flow run's parameters, which may hold 512 KB (PREFECT_SERVER_API_MAX_PARAMETER_SIZE); the
validated spec adds its defaults (a few KB) to what was given."""

MAX_DEPTH = 64
"""Nesting levels of a spec (mappings and lists); a real spec has about five."""

MAX_FIELD_CHARS = 2048
"""One string of the spec's own fields (names, paths, URLs); `env.config` is the game's data and
its strings are bounded by the spec's size only."""

MAX_ERROR_LINES = 20

SHARED_PASS_TOKENS = 2048
"""Padded tokens one forward/backward of a job on a shared base holds at most (an RL update's
micro-batches and an SFT job's batches are cut into passes this size, gradients accumulated), so
one tenant's batch size never takes the memory of the base every tenant uses."""
"""Problems listed for one spec; the rest are counted."""

FREE_FORM = (("env", "config"),)
"""Where a spec holds the game's own data: any key, any string a JSON document may hold (a
control character other than tab, newline or CR excepted)."""

_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")
"""Control characters refused anywhere in a spec, `env.config` included."""

_ANY_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
"""Control characters refused in the spec's own fields (names, paths, URLs)."""


class SpecError(ValueError):
    """A job spec that cannot run; the message lists `field.path: reason` per problem."""


def _kb(n: int) -> str:
    if n >= 1024**3:
        return f"{n / 1024**3:.1f} GB"
    return f"{n / 1024**2:.1f} MB" if n >= 1024**2 else f"{n / 1024:.0f} KB"


LIMIT_TEXT = f"the {_kb(MAX_SPEC_BYTES)} a spec may hold"


def field_name(parts: list[Any] | tuple[Any, ...]) -> str:
    """`a.b[0].c` from path parts, each cut to 64 characters and its control characters shown as
    `?` (a key is never echoed whole)."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        text = str(part)
        text = _ANY_CONTROL.sub("?", text if len(text) <= 64 else f"{text[:61]}...")
        out = f"{out}.{text}" if out else text
    return out or "<spec>"


def control_problem(text: str, strict: bool = True) -> str | None:
    """Why `text` may not be a spec's string (a control character, named by its code), or None.
    `strict`: every control character (a name, path or URL); else tab, newline and CR pass."""
    found = (_ANY_CONTROL if strict else _CONTROL).search(text)
    if found:
        return f"contains a control character (U+{ord(found.group()):04X} at position {found.start()})"
    return None


def text_problem(text: str) -> str | None:
    """Why `text` may not be one of the spec's own strings (too long, a control character), or None."""
    if len(text) > MAX_FIELD_CHARS:
        return f"{len(text)} characters, more than the {MAX_FIELD_CHARS} a field may hold"
    return control_problem(text)


def _leaf_size(value: Any) -> int:
    """`value` as JSON, in characters (a string's escapes left out: an estimate for the walks;
    the whole spec's size is then taken exactly)."""
    if isinstance(value, str) and value.isascii():
        return len(value) + 2
    if value is None or isinstance(value, (bool, int)):
        return len(str(value))
    return _json_size(value)


def _json_size(value: Any) -> int:
    try:
        return len(json.dumps(value, default=str))
    except (TypeError, ValueError):
        return len(str(value))


class _TooBig(Exception):
    pass


def _measure(value: Any, cap: int) -> int:
    """`value`'s size, roughly as JSON, counting a shared part once per use; stops past `cap`
    (so a structure that shares itself exponentially costs no more than `cap` to measure)."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            total += 2
            for key, v in item.items():
                total += _leaf_size(key) + 2
                stack.append(v)
        elif isinstance(item, (list, tuple)):
            total += 2 + len(item)
            stack.extend(item)
        else:
            total += _leaf_size(item)
        if total > cap:
            return total
    return total


def _walk(value: Any, path: tuple[Any, ...], free: bool, on_path: set[int], budget: list[int]) -> str | None:
    """The first problem of depth, strings or a cycle under `value`; _TooBig past the budget."""
    if len(path) > MAX_DEPTH:
        return f"{field_name(path[:3])}...: nested more than {MAX_DEPTH} levels deep"
    if isinstance(value, (dict, list, tuple)):
        if id(value) in on_path:  # a structure that contains itself (YAML aliases can build one)
            return f"{field_name(path)}: refers to itself"
        on_path.add(id(value))
        budget[0] -= 2
        for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            child = (*path, key)
            if isinstance(key, str):
                budget[0] -= len(key) + 4
                problem = control_problem(key, strict=not free) or (None if free else text_problem(key))
                if problem:
                    return f"{field_name(path)}: a key {problem}"
            if budget[0] < 0:
                raise _TooBig
            if problem := _walk(item, child, free or child in FREE_FORM, on_path, budget):
                return problem
        on_path.discard(id(value))
        return None
    if isinstance(value, str):
        problem = control_problem(value, strict=False) if free else text_problem(value)
        if problem:
            return f"{field_name(path)}: {problem}"
    budget[0] -= _leaf_size(value)
    if budget[0] < 0:
        raise _TooBig
    return None


def _culprit(data: Any, cap: int) -> tuple[tuple[Any, ...], int, bool]:
    """(path, size, whether it is a single value) of the part that makes `data` too big: down
    from the root while one child holds more than half of its parent."""
    path, node, size = (), data, _measure(data, cap)
    while isinstance(node, (dict, list, tuple)):
        if len(node) > 1000:  # many small parts (an inline dataset): the container is the culprit
            break
        children = list(node.items() if isinstance(node, dict) else enumerate(node))
        sizes = [(_measure(v, cap), k, v) for k, v in children]
        big = [s for s in sizes if s[0] > size // 2]
        if len(big) != 1:
            break
        size, key, node = big[0]
        path = (*path, key)
    return path, size, not isinstance(node, (dict, list, tuple))


def input_problem(data: Any) -> str | None:
    """`field: reason` when `data` (a spec as plain data) may not go further: nested more than
    MAX_DEPTH, containing itself, a control character in a string (outside `env.config`: any, or a
    string longer than a field may be), or more than MAX_SPEC_BYTES (naming what makes it so).
    None when it may. The work is bounded whatever `data` shares or holds."""
    cap = 2 * MAX_SPEC_BYTES
    try:
        if problem := _walk(data, (), False, set(), [MAX_SPEC_BYTES]):
            return problem
        total = _json_size(data)  # exact now: no cycle, bounded depth, no sharing past the budget
        if total <= MAX_SPEC_BYTES:
            return None
    except _TooBig:
        total = _measure(data, cap)
    path, size, single = _culprit(data, cap)

    def shown(n: int) -> str:  # a measure stops past `cap`; a single value's size is exact
        return f"over {_kb(cap)}" if n > cap else _kb(n)

    if not path:
        return f"<spec>: {shown(total)}, more than {LIMIT_TEXT}; give large data by path"
    if size > MAX_SPEC_BYTES:
        return f"{field_name(path)}: {_kb(size) if single else shown(size)}, more than {LIMIT_TEXT}; give large data by path"
    return f"{field_name(path)}: {_kb(size)} of a spec of {shown(total)}, more than {LIMIT_TEXT}; give large data by path"


# --- spec files --------------------------------------------------------------------------------------

class _Refused(Exception):
    pass


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that refuses nesting deeper than MAX_DEPTH while it composes (before Python's
    recursion limit can be met) and notes whether any alias was used."""

    def __init__(self, stream: Any):
        super().__init__(stream)
        self.depth, self.aliases = 0, 0

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:
        # Refused while scanning: the scanner looks up to 1024 characters ahead for a key at each
        # open bracket, so ten thousand of them cost it half a second before the composer sees one.
        if self.flow_level >= MAX_DEPTH:
            raise _Refused(f"nested more than {MAX_DEPTH} levels deep (line {self.line + 1})")
        super().fetch_flow_collection_start(TokenClass)

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            self.aliases += 1
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise _Refused(f"nested more than {MAX_DEPTH} levels deep (line {mark.line + 1})")
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _expanded(node: yaml.Node, sizes: dict[int, int], open_: set[int]) -> int:
    """The size `node` reaches with every alias in it expanded (each use counted), roughly as JSON."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise _Refused(f"a YAML alias refers to the node that holds it (line {node.start_mark.line + 1})")
    if isinstance(node, yaml.ScalarNode):
        size = len(node.value) + 2
    else:
        open_.add(key)
        children = [c for pair in node.value for c in pair] if isinstance(node, yaml.MappingNode) else node.value
        size = 2
        for child in children:
            size += _expanded(child, sizes, open_) + 1
            if size > MAX_SPEC_BYTES:
                break
        open_.discard(key)
    sizes[key] = size
    return size


def _yaml_line(err: yaml.YAMLError) -> str:
    """A YAML error on one line: what is wrong and where."""
    if isinstance(err, yaml.reader.ReaderError):
        char = err.character if isinstance(err.character, int) else ord(err.character) if err.character else 0
        return f"{err.reason} (character U+{char:04X} at position {err.position})"
    if isinstance(err, yaml.MarkedYAMLError):
        mark = err.problem_mark or err.context_mark
        what = " ".join("; ".join(str(x) for x in (err.context, err.problem) if x).split())
        return f"{what} (line {mark.line + 1}, column {mark.column + 1})" if mark else what
    return " ".join(str(err).split())


def parse_spec_text(text: str | bytes, name: str = "<spec>") -> Any:
    """A spec's YAML as plain data (empty: {}), parsed once: nesting deeper than MAX_DEPTH and
    aliases that expand past MAX_SPEC_BYTES are refused before any object is built. SpecError
    (one line naming `name`) for anything that does not parse."""
    loader = None
    try:
        loader = _BoundedLoader(text)  # reads (and checks) the first characters already
        node = loader.get_single_node()
        if node is None:
            return {}
        if loader.aliases and _expanded(node, {}, set()) > MAX_SPEC_BYTES:
            raise _Refused(f"its YAML aliases expand it to more than {LIMIT_TEXT}")
        return loader.construct_document(node)
    except _Refused as err:
        raise SpecError(f"{name}: {err}") from None
    except yaml.YAMLError as err:
        raise SpecError(f"{name}: not valid YAML: {_yaml_line(err)}") from None
    except (ValueError, TypeError, OverflowError) as err:  # a timestamp out of range, an int of 5,000 digits
        raise SpecError(f"{name}: a value YAML cannot build: {' '.join(str(err).split())[:200]}") from None
    finally:
        if loader is not None:
            loader.dispose()


def read_spec_file(path: str | Path) -> Any:
    """A spec file's YAML as plain data: its size is taken from the file system before a byte is
    read (a file over MAX_SPEC_BYTES, sparse or not, is refused at once) and at most
    MAX_SPEC_BYTES + 1 bytes are ever read (a device or pipe that never ends included). SpecError
    (one line naming the file) for a file too big, unreadable or not valid YAML;
    FileNotFoundError when there is none."""
    path = Path(path)
    try:
        info = path.stat()
        if stat.S_ISDIR(info.st_mode):
            raise SpecError(f"{path}: a folder, not a spec file")
        if info.st_size > MAX_SPEC_BYTES:
            raise SpecError(f"{path}: {_kb(info.st_size)}, more than {LIMIT_TEXT}; give large data by path")
        with path.open("rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except (FileNotFoundError, SpecError):
        raise
    except OSError as err:
        raise SpecError(f"{path}: cannot be read ({err.strerror or type(err).__name__})") from None
    if len(raw) > MAX_SPEC_BYTES:
        raise SpecError(f"{path}: more than {LIMIT_TEXT}; give large data by path")
    return parse_spec_text(raw, str(path))


def format_errors(err) -> str:
    """A pydantic ValidationError as one `field.path: reason` line per problem (at most MAX_ERROR_LINES)."""
    lines = []
    for e in err.errors():
        path = field_name([p for p in e["loc"] if not (isinstance(p, str) and p in ("lora", "full"))])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        lines.append(f"{path}: {' '.join(msg.split())}")
    if len(lines) > MAX_ERROR_LINES:
        lines = [*lines[:MAX_ERROR_LINES], f"<spec>: {len(lines) - MAX_ERROR_LINES} more problems"]
    return "\n".join(lines)


if TYPE_CHECKING:
    from pydantic import BaseModel

_M = TypeVar("_M", bound="BaseModel")


def validate_spec(model: type[_M], data: Any) -> _M:
    """Validate a plain dict (e.g. from YAML or a client) into `model` (JobSpec, SFTSpec), or
    raise SpecError with one `field.path: reason` line per problem."""
    from pydantic import ValidationError  # the limits above serve where pydantic is not installed (a GPU bench machine)

    if not isinstance(data, dict):
        raise SpecError(f"<spec>: expected a mapping, got {type(data).__name__}")
    if problem := input_problem(data):
        raise SpecError(problem)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise SpecError(format_errors(err)) from None
