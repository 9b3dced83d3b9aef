"""The opening prompts of a reasoning-gym `env.config`, for the check before submission that they
fit `rollout.max_total_tokens` (opentinker.control.gateway.confine.prompts_fit).

A config sizes its own items (chain_sum with a million terms makes 7 MB questions, with a billion
it never finishes), so the tasks are drawn in a child process that is killed past DRAW_LIMIT_S or
DRAW_MEMORY_BYTES, and what comes back is cut at a number of characters the caller chooses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from opentinker.core.env_sources import ENVIRONMENT_KEYS, POOL_SIZE

DRAWS = 3
"""Tasks drawn, from a pool of CHECK_POOL items of the config (like env_sources.check_config)."""
CHECK_POOL = 8
DRAW_LIMIT_S = 20.0
DRAW_MEMORY_BYTES = 2 * 1024**3
_CHILD = "from envs.reasoning_gym.prompts import _child; _child()"


def opening_prompts(config: dict[str, Any], seed: int, chars: int) -> list[dict[str, Any]]:
    """DRAWS prompts as episodes open them (system prompt, few-shot exchanges, the question):
    `{"messages": [...], "chars": n}` with the messages' texts cut at `chars` characters in all and
    n the whole prompt's characters. ValueError in one line when drawing fails or passes its bounds."""
    request = json.dumps({"config": config, "seed": seed, "chars": chars})
    threads = {name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(DRAW_MEMORY_BYTES)], input=request, capture_output=True,
                              text=True, timeout=DRAW_LIMIT_S, env=os.environ | threads)
    except subprocess.TimeoutExpired:
        raise ValueError(f"drawing {DRAWS} of its tasks took over {DRAW_LIMIT_S:.0f} s: its items are too large to play") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"the drawing process ended with status {done.returncode}"]
        raise ValueError(f"drawing its tasks failed: {lines[-1]}")
    return json.loads(done.stdout)


def _draw(config: dict[str, Any], seed: int, chars: int) -> list[dict[str, Any]]:
    """What `opening_prompts` returns, drawn here (in the child) the way a job draws and opens them."""
    import numpy as np

    from envs.reasoning_gym.game import ReasoningGymGame
    from opentinker.env.hosting import start_episode
    from opentinker.env.messages import initial_messages

    generator = {k: v for k, v in config.items() if k not in ENVIRONMENT_KEYS}
    generator["size"] = min(int(generator.get("size", POOL_SIZE)), CHECK_POOL)
    rng, out = np.random.default_rng(seed), []
    for _ in range(DRAWS):
        game = ReasoningGymGame(**(config.get("game_kwargs") or {}))
        messages = initial_messages(game, start_episode(game, ReasoningGymGame.generate_task(rng, **generator)))
        left, cut = chars, []
        for message in messages:
            cut.append({**message, "content": message["content"][:max(left, 0)]})
            left -= len(message["content"])
        out.append({"messages": cut, "chars": sum(len(m["content"]) for m in messages)})
    return out


def _child() -> None:
    """The child process (its memory bound in argv): a request on stdin, the prompts on stdout,
    one line on stderr if it fails."""
    import resource

    memory = int(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    try:
        print(json.dumps(_draw(**json.load(sys.stdin))))
    except MemoryError:
        sys.exit(f"its items need more than {memory / 1024**2:,.0f} MiB of memory")
    except Exception as err:  # noqa: BLE001 - reasoning-gym's own words, one line
        sys.exit(f"{type(err).__name__}: {err}"[:500].replace("\n", " "))
