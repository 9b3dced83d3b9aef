"""A sharded trainer's state written by every rank through torch.distributed.checkpoint (DCP), as
safetensors through fsspec: no rank gathers a tensor it does not hold.

Why not DCP's own fsspec writer: it records the checkpoint's layout as a pickle, and nothing in a
checkpoint is ever unpickled (a crafted one would run code when loaded). DCP's HuggingFace writer
keeps the same layout in each file's safetensors header (JSON: the offsets of every shard it
holds), but writes to a local folder only. So each rank writes its share there and puts its files
into the checkpoint's folder on the job's storage (local or S3); COMMIT.json lists every rank's
files with their sha256 (checkpoint.save_checkpoint). A reader fetches the listed files, each
verified, into a local folder, and DCP reads from them the slices its own ranks hold: the same
width or another, or one process.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any

from opentinker.storage.committed import CheckpointWriteError, cause, join_url, makedirs, url_to_fs

SUFFIX = ".safetensors"


def write_share(url: str, folder: str, state: dict[str, Any]) -> dict[str, tuple[int, str]]:
    """This rank's share of `state` (DTensor shards; a tensor every rank holds alike is written by
    one of them) under `<url>/<folder>/`. Every rank calls it (DCP agrees on who writes what); the
    name (relative to `url`), size and sha256 of each file this rank wrote."""
    import torch.distributed.checkpoint as dcp

    fs, path = url_to_fs(url)
    written, name = {}, folder
    try:
        with tempfile.TemporaryDirectory(prefix="opentinker-shards-") as local:
            dcp.save(state, storage_writer=dcp.HuggingFaceStorageWriter(local, save_distributed=True))
            makedirs(fs, join_url(path, folder))
            for file in sorted(f for f in os.listdir(local) if f.endswith(SUFFIX)):
                name, data = f"{folder}/{file}", Path(local, file).read_bytes()
                with fs.open(join_url(path, name), "wb") as f:
                    f.write(data)
                written[name] = (len(data), hashlib.sha256(data).hexdigest())
    except Exception as err:  # noqa: BLE001 - a full disk, a lost bucket: one line (the commit never happens)
        raise CheckpointWriteError(f"cannot write checkpoint {url} ({name}): {cause(err)}") from err
    return written


class Shards:
    """Verified shard files in a local folder of their own (removed with this object), for DCP to read."""

    def __init__(self):
        self._folder = tempfile.TemporaryDirectory(prefix="opentinker-shards-")

    def add(self, name: str, data: bytes) -> None:
        Path(self._folder.name, name.rsplit("/", 1)[-1]).write_bytes(data)

    def _reader(self):
        import torch.distributed.checkpoint as dcp

        return dcp.HuggingFaceStorageReader(self._folder.name)

    def load_optimizer(self, model, optimizer) -> None:
        """The optimizer's state from these shards, resharded by DCP to how this process holds the
        parameters: DTensor shards at any width (each rank reads only its slices), or whole tensors in
        one process. The parameter groups (lr, betas, weight decay) stay the optimizer's: the spec's,
        which no schedule changes."""
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

        params = dict(model.named_parameters())
        template: dict[str, dict[str, Any]] = {}
        for key, saved in self._reader().read_metadata().state_dict_metadata.items():  # `state.<param>.<entry>`
            name, _, entry = key.removeprefix("state.").rpartition(".")
            if not key.startswith("state.") or name not in params:
                raise ValueError(f"the checkpoint's optimizer state holds {key!r}, which is no trained parameter of this model")
            p = params[name]
            like = tuple(saved.size) == tuple(p.shape)  # a moment shaped (and sharded) as its parameter; else the step count
            template.setdefault(name, {})[entry] = (torch.zeros_like(p, dtype=saved.properties.dtype) if like
                                                    else torch.zeros(saved.size, dtype=saved.properties.dtype))
        state = {"state": template}
        dcp.load(state, storage_reader=self._reader(), no_dist=not dist.is_initialized())  # one process reads it all
        groups = get_optimizer_state_dict(model, optimizer)["param_groups"]
        set_optimizer_state_dict(model, optimizer, {"state": state["state"], "param_groups": groups})
