"""What a JSON Schema from outside may cost us: a tool's input schema from a tenant's MCP server,
a served game's tools, an OpenEnv server's action schema.

jsonschema's work is not bounded by a schema's size: `anyOf: [{$ref: next}, {$ref: next}]`, 28
`$defs` deep, is 2 KB of JSON whose check of one wrong argument evaluates 2^28 subschemas and
keeps every failure of every branch (a job's process went from 0.7 to 4 GB in 70 s). Two bounds:

- `check_cost(schema)`, once when the schema is listed: its JSON's size and depth, its number of
  `$ref`s, and the subschemas a check may evaluate with every `$ref` expanded and every branch of
  a combinator counted (stopped as it passes the limit, so the check itself is cheap). A `$ref`
  that comes back to where it started without going into the arguments would never end; one that
  goes into them (a tree type) is bounded by the arguments' own depth, and is counted once.
  This is what bounds a check's memory: failures are kept per subschema evaluated.
- `first_error(validator, instance, deadline=)` for each check: at most MAX_STEPS keywords
  evaluated and none after `deadline`, else ArgumentsUnchecked, so even a schema that passed
  (a recursive union, arguments thousands of items long) ends in its call's time, and the thread
  that ran it ends too.

`bounded_validator(schema)` never runs a regular expression of the schema (`pattern`,
`patternProperties`, and what `additionalProperties` or `unevaluatedProperties` would need them
for: a hostile pattern could spin the process in C, out of the step count's reach), and follows
only references inside the schema (nothing is fetched). jsonschema is imported by the callers
that validate: the core engine runs without it.
"""

from __future__ import annotations

import json
import time
from contextvars import ContextVar
from typing import Any
from urllib.parse import unquote

MAX_BYTES = 64 * 1024  # an OpenAI function schema is a few hundred bytes; a large enum fits too
MAX_DEPTH = 64  # JSON levels (a schema of objects 30 deep fits)
MAX_REFS = 256
MAX_SUBSCHEMAS = 10_000  # evaluated for one place of the arguments, $refs expanded, every branch counted
MAX_NESTING = 128  # subschemas inside one another through $refs (jsonschema recurses once per level)
MAX_STEPS = 50_000  # keywords evaluated in one check (about a second; a sane call needs hundreds)
PAST_TIME = "checking them against the schema ran past the call's time"

# The keywords of Draft 2020-12 by which jsonschema applies subschemas: the shape of their value
# (one subschema, a list, a map of them) and whether they apply them to the same value (0) or to a
# part of it, a property or an item (1: they go into the arguments). Its other keywords are leaves.
APPLICATORS = {
    **dict.fromkeys(("not", "if", "then", "else"), ("one", 0)), "allOf": ("list", 0), "anyOf": ("list", 0), "oneOf": ("list", 0),
    "dependentSchemas": ("map", 0), "prefixItems": ("list", 1), "properties": ("map", 1), "patternProperties": ("map", 1),
    **dict.fromkeys(("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "contains", "unevaluatedItems"),
                    ("one", 1)),
}


class SchemaRefused(ValueError):
    """Why a schema is refused, as the end of a sentence about it ("its input schema ..."); the
    caller names the tool and where it came from."""


class ArgumentsUnchecked(ValueError):
    """A check stopped before its end: `kind` is "timeout" (past its deadline) or "bad_arguments"
    (over MAX_STEPS, or nested too deep for the check to recurse)."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def _shape(schema: Any) -> tuple[int, bool]:
    """(its `$ref`s, whether it has patternProperties), refusing a schema too large or too deep to
    walk, or with what this module does not follow. Iterative, and stopped at MAX_BYTES values
    (each is a byte of JSON at least): a 100,000-deep or a 100 MB one is refused, never walked."""
    refs, patterned, seen, stack = 0, False, 0, [(schema, 1, True)]
    while stack:
        node, depth, is_root = stack.pop()
        seen += 1
        if seen > MAX_BYTES:
            raise SchemaRefused(f"is over the limit of {MAX_BYTES:,} bytes of JSON")
        if depth > MAX_DEPTH:
            raise SchemaRefused(f"nests more than {MAX_DEPTH} levels deep")
        if isinstance(node, dict):
            refs += isinstance(node.get("$ref"), str)
            patterned = patterned or isinstance(node.get("patternProperties"), dict)
            if dynamic := next((k for k in ("$dynamicRef", "$recursiveRef") if isinstance(node.get(k), str)), None):
                raise SchemaRefused(f"uses {dynamic}, which is not followed here")
            if not is_root and isinstance(node.get("$id"), str):
                raise SchemaRefused("has an $id inside it, which is not followed here")
            stack += [(v, depth + 1, False) for v in node.values()]
        elif isinstance(node, list):
            stack += [(v, depth + 1, False) for v in node]
    return refs, patterned


class _Expansion:
    """The subschemas one check may evaluate, counted with every `$ref` followed (see the module)."""

    def __init__(self, root: dict[str, Any]):
        self.root, self.spent = root, 0
        self.open: dict[int, int] = {}  # id of a $ref's target being expanded -> the descents when it was entered

    def visit(self, node: Any, nesting: int, descents: int) -> None:
        if nesting > MAX_NESTING:
            raise SchemaRefused(f"nests more than {MAX_NESTING} subschemas deep through $ref")
        self.spend(1)
        if not isinstance(node, dict):
            return  # true, false (anything else is refused by the metaschema)
        before = self.spent
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                self.follow(value, nesting, descents)
            shape, down = APPLICATORS.get(key, (None, 0))
            subschemas = [value] if shape == "one" else value if shape == "list" and isinstance(value, list) else \
                list(value.values()) if shape == "map" and isinstance(value, dict) else []
            for subschema in subschemas:
                self.visit(subschema, nesting + 1, descents + down)
        if "unevaluatedProperties" in node or "unevaluatedItems" in node:
            self.spend(2 * (self.spent - before))

    def spend(self, n: int) -> None:
        self.spent += n
        if self.spent > MAX_SUBSCHEMAS:
            raise SchemaRefused(f"expands to more than {MAX_SUBSCHEMAS:,} subschemas through $ref and its combinators, "
                                "each branch counted")

    def follow(self, ref: str, nesting: int, descents: int) -> None:
        target = self.resolve(ref)
        if id(target) in self.open:
            if self.open[id(target)] == descents:
                raise SchemaRefused(f"comes back to {ref!r} through $ref without going into the arguments "
                                    "(a check would never end)")
            return  # a recursive type: each level is a level of the arguments, which are bounded
        self.open[id(target)] = descents
        self.visit(target, nesting + 1, descents)
        del self.open[id(target)]

    def resolve(self, ref: str) -> Any:
        if not ref.startswith("#"):
            raise SchemaRefused(f"refers to {ref[:100]!r} (only references inside the schema, '#...', are followed)")
        if ref[1:] and not ref.startswith("#/"):
            raise SchemaRefused(f"refers to the anchor {ref[:100]!r} (only JSON pointers, '#/...', are followed)")
        node: Any = self.root
        for part in unquote(ref[1:]).split("/")[1:]:
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            else:
                raise SchemaRefused(f"refers to {ref[:100]!r}, which is not in it")
        return node


def check_cost(schema: Any) -> int:
    """The subschemas a check of `schema` may evaluate at one place of the arguments; SchemaRefused
    when it is over a limit of this module (its size, depth, $refs, or that count)."""
    return _checked(schema)[0]


def schema_text(schema: Any) -> str:
    """The schema as canonical JSON (a key to cache its validator by); SchemaRefused when it is too
    large or too deep to write, or not JSON. Cheap: the expansion is `check_cost`'s."""
    _shape(schema)
    return _text(schema)


def _text(schema: Any) -> str:
    try:
        text = json.dumps(schema, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as err:
        raise SchemaRefused(f"is not JSON ({str(err)[:100]})") from None
    if (size := len(text.encode())) > MAX_BYTES:
        raise SchemaRefused(f"is {size:,} bytes of JSON, over the limit of {MAX_BYTES:,}")
    return text


def _checked(schema: Any) -> tuple[int, bool]:
    if not isinstance(schema, (dict, bool)):
        raise SchemaRefused(f"is {type(schema).__name__}, not a JSON Schema object")
    refs, patterned = _shape(schema)
    _text(schema)
    if refs > MAX_REFS:
        raise SchemaRefused(f"has {refs:,} $refs, over the limit of {MAX_REFS}")
    expansion = _Expansion(schema if isinstance(schema, dict) else {})
    expansion.visit(schema, 0, 0)
    return expansion.spent, patterned


# --- the check of one value ---------------------------------------------------------------------

class _Budget:
    def __init__(self, steps: int, deadline: float | None):
        self.left, self.steps, self.deadline = steps, steps, deadline

    def spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise ArgumentsUnchecked(f"checking them against the schema takes over {self.steps:,} steps (not checked)", "bad_arguments")
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise ArgumentsUnchecked(PAST_TIME, "timeout")


_budget: ContextVar[_Budget | None] = ContextVar("schema_check_budget", default=None)
_classes: dict[bool, Any] = {}


def _counted(keyword: Any) -> Any:
    def counted(validator: Any, value: Any, instance: Any, schema: Any) -> Any:
        budget = _budget.get()
        if budget is not None:
            budget.spend()
        errors = keyword(validator, value, instance, schema)
        if errors is not None:
            yield from errors

    return counted


def _skipped(validator: Any, value: Any, instance: Any, schema: Any) -> None:
    """A keyword not checked (None would do in a subschema, not at the top: jsonschema calls it there)."""


def _validator_class(patterned: bool) -> Any:
    """Draft 2020-12, every keyword counted, no regular expression ever run (see the module)."""
    if patterned not in _classes:
        from jsonschema import Draft202012Validator, validators

        base = Draft202012Validator.VALIDATORS
        additional = base["additionalProperties"]

        def additional_properties(validator: Any, value: Any, instance: Any, schema: dict) -> Any:
            if "patternProperties" not in schema:  # which keys are extra is the patterns' to say: not checked
                yield from additional(validator, value, instance, schema)

        kept = {**base, "additionalProperties": additional_properties}
        off = {"pattern", "patternProperties", "format"} | ({"unevaluatedProperties"} if patterned else set())
        counted = {k: (_skipped if k in off else _counted(fn)) for k, fn in kept.items()}
        _classes[patterned] = validators.extend(Draft202012Validator, counted)
    return _classes[patterned]


def bounded_validator(schema: dict[str, Any]) -> Any:
    """A validator of `schema` (Draft 2020-12) for `first_error`: local references only, no regular
    expressions; SchemaRefused when `check_cost` refuses it or it is not a JSON Schema."""
    from jsonschema.exceptions import SchemaError
    from referencing import Registry

    _, patterned = _checked(schema)
    cls = _validator_class(patterned)
    try:
        cls.check_schema(schema)
    except SchemaError as err:
        raise SchemaRefused(f"is not a JSON Schema: {err.message[:300]}") from None
    except RecursionError:
        raise SchemaRefused("nests too deep to check") from None
    return cls(schema, registry=Registry())


def first_error(validator: Any, instance: Any, deadline: float | None = None, max_steps: int = MAX_STEPS) -> Any:
    """The first ValidationError of `instance`, or None; ArgumentsUnchecked when the check passes
    `max_steps` keywords or `deadline` (time.monotonic()), or recurses too deep."""
    token = _budget.set(_Budget(max_steps, deadline))
    try:
        return next(iter(validator.iter_errors(instance)), None)
    except RecursionError:
        raise ArgumentsUnchecked("they nest too deep to check against the schema", "bad_arguments") from None
    finally:
        _budget.reset(token)
