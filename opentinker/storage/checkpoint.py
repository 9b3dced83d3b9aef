"""Checkpoints through fsspec, committed by a manifest written last.

A checkpoint is a folder `<base_url>/<job_id>/step-00000012/` holding the trainable weights
(safetensors), the optimizer state (tensors and numbers, loaded with torch's weights-only
unpickler; a sharded trainer's as every rank's share in safetensors, shards.py), RNG states and a state (step, policy version, data position) as JSON: nothing in it
is unpickled, so a checkpoint someone crafted cannot run code when it is loaded. It counts
only once `COMMIT.json` exists and every file it lists has the listed size: a write killed at any
point leaves a folder that resume ignores. This works on stores without atomic rename (S3).
COMMIT.json also records each file's sha256, so a file changed after the commit (same size, other
bytes) makes loading fail with the URL and the file named instead of restoring garbage; and it
names the job, tenant and step, signed with the stack's secret (signing.py), so a folder copied
from another job or re-hashed over other bytes is refused. Resume takes the newest checkpoint that
passes all of it and names each newer folder it skipped (`newest_intact`).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import logging
import pickle
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from opentinker.core.ids import check_folder_name
from opentinker.storage.committed import (COMMIT, CheckpointWriteError, committed_manifest, is_complete, join_url, read_manifest,  # noqa: F401 - re-exported
                                          remove_committed, url_to_fs, why_incomplete, write_committed)
from opentinker.storage import signing
from opentinker.storage.shards import Shards
from opentinker.storage.signing import CheckpointRef, Owner, checked, folder_problem, problem, signed, stack_secret  # noqa: F401 - re-exported

log = logging.getLogger("opentinker.checkpoint")
OPTIMIZER = "optimizer.pt"  # one process's optimizer state (torch's format, tensors and numbers only)
OPTIMIZER_SHARDS = "optimizer"  # a sharded trainer's: every rank's share, written by DCP (shards.py)


class CheckpointError(FileNotFoundError):
    """No usable checkpoint at a URL: none there, uncommitted (no COMMIT.json, a size differs) or
    corrupt (bytes differ from the recorded sha256, or do not parse). A FileNotFoundError, so
    callers asking "is there a checkpoint here" treat all of them alike; the message says which."""


def job_url(base_url: str, job_id: str) -> str:
    """`<base_url>/<job_id>`; a job id that is not one folder name (`..`, a `/`, a control
    character) is refused here too, whichever entry point let it through (see core/ids.py)."""
    return join_url(base_url, check_folder_name(job_id, "job id"))


def rng_state(own: dict[str, torch.Generator] | None = None) -> dict[str, Any]:
    """Torch's, Python's and numpy's generator states as plain JSON (no pickle in a checkpoint).
    `own`: a job's own generators instead, by name, for a job hosted beside others (a shared base),
    whose process-wide generators are every job's: only their states are recorded."""
    encode = lambda t: base64.b64encode(t.numpy().tobytes()).decode()  # noqa: E731
    if own is not None:
        return {name: encode(gen.get_state()) for name, gen in own.items()}
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": encode(torch.get_rng_state()), "python": [version, list(internal), gauss],
             "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]}
    if torch.cuda.is_available():  # a GPU job resumes with the same CUDA streams of random numbers
        state["cuda"] = [encode(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any], own: dict[str, torch.Generator] | None = None) -> None:
    """Put back what rng_state recorded: into `own` (a hosted job's generators, by name; the
    process's stay as they are), else into the process's generators. A state of the other kind,
    or a generator the checkpoint does not name, is left out (a job that moved onto or off a shared
    base keeps drawing from where it is)."""
    decode = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)  # noqa: E731
    if own is not None:
        for name, gen in own.items():
            if isinstance(state.get(name), str):
                gen.set_state(decode(state[name]))
        return
    if "torch" not in state:  # a hosted job's state (or a shared session's {}): nothing of the process's
        return
    torch.set_rng_state(decode(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([decode(s) for s in state["cuda"]][: torch.cuda.device_count()])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def step_url(base_url: str, job_id: str, step: int) -> str:
    """The folder of the job's checkpoint at `step`."""
    return join_url(job_url(base_url, job_id), f"step-{step:08d}")


def save_checkpoint(
    base_url: str,
    job_id: str,
    step: int,
    weights: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any] | None,
    state: dict[str, Any],
    extra_files: dict[str, bytes] | None = None,
    keep_last: int | None = None,
    tenant: str | None = None,
    rng: dict[str, torch.Generator] | None = None,
    written: dict[str, tuple[int, str]] | None = None,
) -> CheckpointRef:
    """Write one checkpoint and commit it, signed as `tenant`'s job `job_id` at `step`; then prune
    the job's older checkpoints beyond `keep_last`. `rng`: a hosted job's own generators, by name,
    recorded instead of the process's (see rng_state). `optimizer_state` None: a sharded trainer's
    ranks already wrote theirs (shards.write_share) into the folder, the files `written` names."""
    url = step_url(base_url, job_id, step)
    owner = Owner(job_id, tenant)
    optimizer = {}
    if optimizer_state is not None:
        opt_buf = io.BytesIO()
        torch.save(optimizer_state, opt_buf)
        optimizer = {OPTIMIZER: opt_buf.getvalue()}
    files = {
        "weights.safetensors": save_safetensors({k: v.detach().cpu().contiguous() for k, v in weights.items()}),
        **optimizer,
        "rng.json": json.dumps(rng_state(rng)).encode(),
        "state.json": json.dumps({"step": step, **state}, default=_json_default).encode(),
        **(extra_files or {}),
    }
    secret = stack_secret()
    write_committed(url, files, owner.header(step), sign=lambda manifest: signed(manifest, secret), written=written)
    if keep_last:
        prune(base_url, job_id, keep_last, owner)
    return CheckpointRef(url=url, step=step)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (np.integer,)):
        return int(obj)
    raise TypeError(f"cannot store {type(obj).__name__} in checkpoint state")


def _verified(fs, path: str, url: str, manifest: dict[str, Any], name: str) -> bytes:
    data = fs.cat_file(join_url(path, name))
    expected = manifest.get("sha256", {}).get(name)  # absent in checkpoints written before hashes
    if expected is not None and hashlib.sha256(data).hexdigest() != expected:
        raise CheckpointError(f"{url} is not a complete checkpoint: {name} differs from the sha256 in {COMMIT} "
                              "(corrupt, or changed after the commit)")
    return data


def trusted_manifest(url: str, owner: Owner | None = None) -> dict[str, Any]:
    """COMMIT.json of the folder, else CheckpointError with the one-line reason: incomplete, or
    (signing.problem) not signed by this stack, or with `owner` not that job's checkpoint."""
    manifest, reason = checked(url, owner)
    if reason:
        raise CheckpointError(reason)
    return manifest


def read_file(url: str, name: str, missing_ok: bool = False, owner: Owner | None = None) -> bytes | None:
    """One file of a complete checkpoint, verified against COMMIT.json; None when the checkpoint
    has no such file and `missing_ok` (e.g. policy.json in checkpoints older than it)."""
    fs, path = url_to_fs(url)
    manifest = trusted_manifest(url, owner)
    if name not in manifest["files"]:
        if missing_ok:
            return None
        raise CheckpointError(f"{url} is not a complete checkpoint: it has no {name}")
    return _verified(fs, path, url, manifest, name)


def step_folders(base_url: str, job_id: str) -> list[CheckpointRef]:
    """Every `step-N` folder of a job, committed or not, oldest first."""
    return signing.step_folders(job_url(base_url, job_id))


def list_checkpoints(base_url: str, job_id: str, owner: Owner | None = None) -> list[CheckpointRef]:
    """Complete checkpoints of a job, oldest first; with `owner`, only those whose COMMIT.json is
    that job's, signed (the files' bytes are checked when one is loaded)."""
    out = []
    for ref in step_folders(base_url, job_id):
        fs, path = url_to_fs(ref.url)
        if (is_complete(fs, path) if owner is None else folder_problem(ref.url, owner) is None):
            out.append(ref)
    return out


def latest_checkpoint(base_url: str, job_id: str, owner: Owner | None = None) -> CheckpointRef | None:
    found = list_checkpoints(base_url, job_id, owner)
    return found[-1] if found else None


def prune(base_url: str, job_id: str, keep_last: int, owner: Owner | None = None) -> None:
    """Remove the job's checkpoints older than its `keep_last` newest (with `owner`, counting and
    removing only its own: a foreign folder never pushes out a real checkpoint)."""
    complete = list_checkpoints(base_url, job_id, owner)
    for ref in complete[:-keep_last]:
        remove_committed(ref.url)


@dataclass
class Intact:
    """The newest checkpoint that verified and loaded (None: none did), what loading returned, and
    one line per newer folder skipped (each names the folder and why)."""

    ref: CheckpointRef | None = None
    loaded: Any = None
    skipped: list[str] = field(default_factory=list)


def newest_intact(base_url: str, job_id: str, owner: Owner, load: Callable[[str, Owner], Any] | None = None) -> Intact:
    """Walk the job's step folders newest first and take the first that `load` (default
    `load_checkpoint`) accepts: a corrupt, foreign or unsigned latest costs its steps, not the job."""
    found = Intact()
    for ref in reversed(step_folders(base_url, job_id)):
        try:
            found.loaded = (load or load_checkpoint)(ref.url, owner)
        except CheckpointError as err:
            found.skipped.append(str(err))
            log.warning("resume skips %s", err)
            continue
        found.ref = ref
        break
    return found


@dataclass
class LoadedCheckpoint:
    step: int
    weights: dict[str, torch.Tensor]
    optimizer_state: Any  # a dict (one process's), or Shards (a sharded trainer's, read at any width)
    rng: dict[str, Any]
    state: dict[str, Any]


def _tensors_only(data: bytes) -> Any:
    """An optimizer state saved by torch.save, loaded without running code: torch's weights-only
    unpickler accepts tensors, numbers, strings and containers and refuses anything else."""
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")  # the optimizer moves it to its parameters' device


def load_checkpoint(url: str, owner: Owner | None = None) -> LoadedCheckpoint:
    """Read a complete checkpoint (with `owner`: only that job's, see trusted_manifest);
    CheckpointError names the URL and the file when it is not usable."""
    fs, path = url_to_fs(url)
    manifest = trusted_manifest(url, owner)

    def parsed(name: str, parse):
        data = _verified(fs, path, url, manifest, name)
        try:
            return parse(data)
        except pickle.UnpicklingError as err:
            raise CheckpointError(f"{url}: refused: {name} holds more than tensors and numbers (a pickle payload, which "
                                  "could run code, is never loaded)") from err
        except Exception as err:  # noqa: BLE001 - any parse failure means a corrupt file
            reason = (str(err).splitlines() or [""])[0]
            raise CheckpointError(f"{url} is not a complete checkpoint: {name} is corrupt ({type(err).__name__}: {reason})") from err

    weights = parsed("weights.safetensors", load_safetensors)
    shard_files = sorted(n for n in manifest["files"] if n.startswith(f"{OPTIMIZER_SHARDS}/"))
    if shard_files:
        optimizer_state = Shards()
        for name in shard_files:
            optimizer_state.add(name, _verified(fs, path, url, manifest, name))
    else:
        optimizer_state = parsed(OPTIMIZER, _tensors_only)
    rng = parsed("rng.json", json.loads)
    state = parsed("state.json", json.loads)
    return LoadedCheckpoint(step=int(state["step"]), weights=weights, optimizer_state=optimizer_state, rng=rng, state=state)
