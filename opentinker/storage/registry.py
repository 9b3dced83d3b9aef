"""The model registry: every completed job's final checkpoint as a version of a registered model.

A version is a pointer, never a copy: its `checkpoint_url` tag names the committed checkpoint
folder the weights live in, and `models:/<name>@<alias>` / `models:/<name>/<version>` resolve to
it (`resolve_model_uri`, used by `opentinker.storage.resolve.resolve_checkpoint` for inference, evaluation
and `model.init_from`). Promotion moves the alias `champion`; nothing is ever copied.

Source: MLflow 3.17's server refuses a local path (`file://…`) as a version's source unless it lies
inside the artifact folder of the run given as `run_id` (mlflow/server/handlers.py,
`_validate_source_run`); with a proxied artifact store (`mlflow server --artifacts-destination`)
no local path does. So the source is always a run URI, `runs:/<run_id>/final` (the exported adapter
or weights `JobTracker.log_checkpoint` logged) or `runs:/<run_id>/checkpoint` (a reference file),
which the server accepts with that `run_id`; the checkpoint itself is named by the tag.

Lineage tags on every version: job_id, kind (rl|sft), spec_hash (sha256 of the spec's canonical
JSON), base_model, environment, environment_version, prefect_flow_run_id, mlflow_run_id,
checkpoint_url, and eval_spec (what an evaluation needs to rebuild the job's validation set).

The first version of a model becomes `champion` as well as `challenger`: with nothing to compare
against, the only trained model is the best one known, and `models:/<name>@champion` then resolves
from the first completed job on (tag `promotion.decision=initial` says so). Later versions are only
`challenger` until an evaluation (opentinker/eval/promotion.py) moves `champion`.

Client-safe: imports no torch.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import tempfile
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from opentinker.tracking.runs import Run, mlflow_client

CHAMPION = "champion"
CHALLENGER = "challenger"
CHECKPOINT_TAG = "checkpoint_url"
TENANT_TAG = "opentinker.tenant"  # who owns a registered model: set by the gateway's jobs ("" for the operator)
EVAL_SPEC_TAG = "eval_spec"
_URI = re.compile(r"models:/(?P<name>[^/@]+)(?:@(?P<alias>[A-Za-z0-9_-]+)|/(?P<version>\d+))")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,199}$")


class ModelNotFoundError(LookupError):
    """A registered model, alias or version that does not exist; the message names which."""


class RegistryError(RuntimeError):
    """Registering a checkpoint failed; the checkpoint itself is saved and untouched."""


def registry_client(tracking_uri: str | None = None):
    """An MlflowClient whose tracking and registry are the stack's server (or `tracking_uri`)."""
    return mlflow_client(tracking_uri, registry=True)


def is_missing(err: Exception) -> bool:
    """Is this MlflowException MLflow's "does not exist"?"""
    return getattr(err, "error_code", "") == "RESOURCE_DOES_NOT_EXIST"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# -- names and lineage -------------------------------------------------------------------------


def default_model_name(spec_data: dict[str, Any], namespace: str) -> str:
    """`<namespace>-<game class in lower case>` (e.g. `default-uppercasegame`), or
    `<namespace>-env` for a served environment: one registered model per task and tenant/project."""
    env = spec_data.get("env") or {}
    task = env["game"].partition(":")[2].lower() if env.get("game") else str(env.get("link") or "env").lower()
    return re.sub(r"[^A-Za-z0-9_.-]", "-", f"{namespace}-{task}")


def model_name_for(spec_data: dict[str, Any], namespace: str, tenant: str | None = None) -> str:
    """The registered model a job's checkpoints go to: `registry.model_name` or the default; a
    tenant's names always start with `<tenant>-` (as its job ids do), so tenants never share one."""
    name = (spec_data.get("registry") or {}).get("model_name") or default_model_name(spec_data, namespace)
    return name if tenant is None or name.startswith(f"{tenant}-") else f"{tenant}-{name}"


def spec_hash(spec_data: dict[str, Any]) -> str:
    """sha256 of the spec's canonical JSON (sorted keys, no spaces): equal specs, equal hashes."""
    canonical = json.dumps(spec_data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def environment_version(game_path: str | None) -> str:
    """A version for an environment (`package.module:Class`), so lineage says which game code
    scored a model: the module's (or its package's) `__version__` when it declares one; otherwise
    the version of the installed distribution that ships it plus a short hash of the class's
    source file (`0.1.0+src.1a2b3c4d5e6f`: an in-repo game changes without a release), or the hash
    alone. A served environment's version is unknown to us: "unknown"."""
    if not game_path or "://" in game_path or ":" not in game_path or game_path.startswith("link:"):
        return "unknown"  # a served or a linked game: its code is not ours to read
    import importlib
    import importlib.metadata

    module_name, _, attr = game_path.partition(":")
    module = importlib.import_module(module_name)
    for name in (module_name, module_name.split(".")[0]):
        version = getattr(importlib.import_module(name), "__version__", None)
        if isinstance(version, str) and version:
            return version
    cls = getattr(module, attr, None)
    source_file = inspect.getsourcefile(cls) if inspect.isclass(cls) else inspect.getsourcefile(module)
    digest = hashlib.sha256(Path(source_file).read_bytes()).hexdigest()[:12] if source_file else "nosource"
    dists = importlib.metadata.packages_distributions().get(module_name.split(".")[0], [])
    if dists:
        try:
            return f"{importlib.metadata.version(dists[0])}+src.{digest}"
        except importlib.metadata.PackageNotFoundError:
            pass
    return f"src.{digest}"


def eval_spec_from(spec_data: dict[str, Any]) -> dict[str, Any] | None:
    """What an evaluation needs to replay the job's environment and validation set: the env
    section, the seed (it fixes the validation split), the episode limits and sampling. None when
    no evaluation could replay it: no environment, or a game that lives in the user's process."""
    if not spec_data.get("env") or spec_data["env"].get("link"):
        return None
    rollout = spec_data.get("rollout") or {}
    keep = ("max_new_tokens", "max_turns", "max_total_tokens", "step_timeout_s", "temperature", "top_p")
    return {"env": spec_data["env"], "seed": spec_data.get("seed", 0),
            "rollout": {k: rollout[k] for k in keep if k in rollout},
            "evaluation": {k: v for k, v in (spec_data.get("evaluation") or {}).items() if k in ("greedy", "n_samples")}}


# -- registration ------------------------------------------------------------------------------


def _source(client, run_id: str, checkpoint_url: str, folder: str = "final") -> str:
    """`runs:/<run>/<folder>` when the run holds the exported model there, else a reference file
    `runs:/<run>/checkpoint<suffix>/checkpoint.json` logged now (see the module docstring); a
    self-play run exports one model per agent (`final-X` -> `checkpoint-X`)."""
    if any(a.path == folder for a in client.list_artifacts(run_id)):
        return f"runs:/{run_id}/{folder}"
    reference = "checkpoint" + folder.removeprefix("final")
    with tempfile.TemporaryDirectory() as tmp:
        ref = Path(tmp) / "checkpoint.json"
        ref.write_text(json.dumps({"checkpoint_url": checkpoint_url}))
        client.log_artifact(run_id, str(ref), reference)
    return f"runs:/{run_id}/{reference}"


def _registration_run(client, model_name: str, job_id: str, tags: dict[str, str]) -> str:
    """A run to anchor a version whose job has no MLflow run of its own (experiment `registry`)."""
    run = Run.start("registry", f"register-{job_id}", {"opentinker.job_id": job_id, "registered_model": model_name, **tags},
                    tracking_uri=client.tracking_uri)
    run.finish()
    return run.run_id


def register_job_checkpoint(*, checkpoint_url: str, model_name: str, job_id: str, kind: str, spec_data: dict,
                            base_model: str, environment: str | None, flow_run_id: str | None,
                            mlflow_run_id: str | None, tracking_uri: str, eval_env: dict | None = None,
                            artifact_folder: str = "final", tenant: str | None = None) -> dict:
    """Register a completed job's final checkpoint as a new version of `model_name` with lineage
    tags and alias `challenger` (and `champion` when the model has none yet). Returns
    {"name", "version", "aliases"}.

    Checks the checkpoint is complete first, so a registered version never points at a partial
    one. Idempotent per job and checkpoint: a re-run of a job that registered already returns the
    existing version (re-setting `challenger` only if no evaluation has judged it yet), so a job
    retried after a registry failure never creates a second version. Raises RegistryError.

    `eval_env` replaces the spec's env section in the evaluation spec (a self-play agent is
    evaluated in its game's single-agent form); `artifact_folder` is where the job's MLflow run
    holds this checkpoint's exported model."""
    from mlflow.exceptions import MlflowException

    from opentinker.storage import checkpoint as ckpt

    if kind not in ("rl", "sft", "tinker"):
        raise ValueError(f"kind must be 'rl', 'sft' or 'tinker', not {kind!r}")
    if not _NAME.match(model_name):
        raise ValueError(f"registered model name {model_name!r}: letters, digits, '_', '.', '-' only")
    fs, path = ckpt.url_to_fs(checkpoint_url)
    if not ckpt.is_complete(fs, path):
        raise RegistryError(f"{checkpoint_url} is not a complete checkpoint: nothing registered")
    tags = {
        "job_id": job_id, "kind": kind, "spec_hash": spec_hash(spec_data), "base_model": base_model,
        "environment": environment or "", "environment_version": environment_version(environment) if environment else "",
        "prefect_flow_run_id": flow_run_id or "", "mlflow_run_id": mlflow_run_id or "", CHECKPOINT_TAG: checkpoint_url,
    }
    eval_spec = eval_spec_from(spec_data if eval_env is None else {**spec_data, "env": eval_env})
    if eval_spec:
        tags[EVAL_SPEC_TAG] = json.dumps(eval_spec, sort_keys=True)
    try:
        client = registry_client(tracking_uri)
        try:
            client.get_registered_model(model_name)
        except MlflowException as err:
            if not is_missing(err):
                raise
            client.create_registered_model(model_name, tags={"opentinker": "true", TENANT_TAG: tenant or ""},
                                           description="OpenTinker policy; aliases: champion (serving), challenger (newest)")
        else:
            owner = client.get_registered_model(model_name).tags.get(TENANT_TAG, "")
            if owner != (tenant or ""):
                raise RegistryError(f"registered model {model_name!r} is not yours: choose another registry.model_name")
        existing = client.search_model_versions(
            f"name = '{model_name}' and tags.job_id = '{job_id}' and tags.{CHECKPOINT_TAG} = '{checkpoint_url}'")
        if existing:
            mv = existing[0]
            if "promotion.decision" not in mv.tags:
                client.set_registered_model_alias(model_name, CHALLENGER, mv.version)
        else:
            run_id = mlflow_run_id or _registration_run(client, model_name, job_id, tags)
            tags["mlflow_run_id"] = run_id
            mv = client.create_model_version(model_name, _source(client, run_id, checkpoint_url, artifact_folder), run_id=run_id,
                                             tags=tags, description=f"{kind} job {job_id}: {checkpoint_url}")
            client.set_registered_model_alias(model_name, CHALLENGER, mv.version)
            if CHAMPION not in client.get_registered_model(model_name).aliases:
                client.set_registered_model_alias(model_name, CHAMPION, mv.version)
                client.set_model_version_tag(model_name, mv.version, "promotion.decision", "initial")
                client.set_model_version_tag(model_name, mv.version, "promotion.time", now_iso())
        aliases = sorted(a for a, v in client.get_registered_model(model_name).aliases.items() if str(v) == str(mv.version))
    except (MlflowException, ConnectionError, OSError) as err:
        raise RegistryError(f"registering {checkpoint_url} as a version of {model_name!r} failed: {err}") from err
    return {"name": model_name, "version": str(mv.version), "aliases": aliases}


def versions_using(checkpoint_url: str, tracking_uri: str | None = None) -> list[dict]:
    """The registered versions whose checkpoint is `checkpoint_url` (their `checkpoint_url` tag), each
    {"name", "version", "aliases"}: what deleting that checkpoint would leave pointing at nothing."""
    client = registry_client(tracking_uri)
    found = sorted(client.search_model_versions(f"tags.{CHECKPOINT_TAG} = '{checkpoint_url}'"), key=lambda mv: (mv.name, int(mv.version)))
    aliases = {name: client.get_registered_model(name).aliases for name in {mv.name for mv in found}}  # a search leaves them out
    return [{"name": mv.name, "version": str(mv.version),
             "aliases": sorted(a for a, v in aliases[mv.name].items() if str(v) == str(mv.version))} for mv in found]


# -- resolution --------------------------------------------------------------------------------


def parse_model_uri(uri: str) -> tuple[str, str | None, str | None]:
    """(name, alias, version) of `models:/<name>@<alias>` or `models:/<name>/<version>`."""
    m = _URI.fullmatch(uri)
    if not m:
        raise ValueError(f"{uri!r}: a registry URI looks like models:/<name>@<alias> or models:/<name>/<version>")
    return m["name"], m["alias"], m["version"]


def get_version(client, name: str, alias: str | None = None, version: str | None = None, tenant: str | None = None):
    """The ModelVersion for an alias or a version; ModelNotFoundError naming what is missing.
    With `tenant`, a model that tenant does not own is reported exactly as a missing one (its
    aliases and versions are not the caller's to learn)."""
    from mlflow.exceptions import MlflowException

    try:
        model = client.get_registered_model(name)
    except MlflowException as err:
        if is_missing(err):
            raise ModelNotFoundError(f"no registered model {name!r}") from None
        raise
    if tenant is not None and model.tags.get(TENANT_TAG) != tenant:
        raise ModelNotFoundError(f"no registered model {name!r}")
    if alias is not None:
        if alias not in model.aliases:
            have = ", ".join(f"{a}→v{v}" for a, v in sorted(model.aliases.items())) or "none"
            raise ModelNotFoundError(f"registered model {name!r} has no alias {alias!r} (aliases: {have})")
        version = str(model.aliases[alias])
    try:
        return client.get_model_version(name, str(version))
    except MlflowException as err:
        if is_missing(err):
            raise ModelNotFoundError(f"registered model {name!r} has no version {version}") from None
        raise


def resolve_model_uri(uri: str, tracking_uri: str | None = None, tenant: str | None = None) -> str:
    """The complete checkpoint step URL that `models:/<name>@<alias>` or `models:/<name>/<version>`
    points at. ModelNotFoundError (a LookupError) names the missing model, alias or version;
    FileNotFoundError when the version's checkpoint is no longer complete. With `tenant`, only
    that tenant's models resolve."""
    from opentinker.storage import checkpoint as ckpt

    name, alias, version = parse_model_uri(uri)
    mv = get_version(registry_client(tracking_uri), name, alias, version, tenant=tenant)
    url = mv.tags.get(CHECKPOINT_TAG)
    if not url:
        raise ModelNotFoundError(f"{uri} (version {mv.version}) has no {CHECKPOINT_TAG} tag: it was not registered by OpenTinker")
    fs, path = ckpt.url_to_fs(url)
    if not ckpt.is_complete(fs, path):
        raise FileNotFoundError(f"{uri} (version {mv.version}) points at {url}, which is not a complete checkpoint any more")
    return url.rstrip("/")
