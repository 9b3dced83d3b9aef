"""One seed for every random number generator a job uses."""

from __future__ import annotations


def seed_everything(seed: int) -> None:
    """Seed Python's, numpy's and torch's generators (torch and numpy are imported here, not at
    module import, so the client can import the core without them)."""
    import random

    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
