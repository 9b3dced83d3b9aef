"""Episodes as people read them: plain records for artifacts, and a small HTML page."""

from __future__ import annotations

import html
import json
from typing import Any

from opentinker.core.trajectory import Trajectory


def transcripts(trajs: list[Trajectory]) -> list[dict[str, Any]]:
    """Readable episodes (messages, reward, info) for artifacts and eyeballing."""
    return [
        {
            "task": t.task,
            "messages": t.messages,
            "reward": t.reward,
            "failed": t.failed,
            "failure": t.failure,
            "stop_reason": t.stop_reason,
            "info": t.info,
            "policy_version": t.policy_version,
        }
        for t in trajs
    ]


def transcripts_html(step: int, transcripts: list[dict[str, Any]]) -> str:
    """A small self-contained page: one block per episode, messages in order, reward and info."""
    blocks = []
    for i, t in enumerate(transcripts):
        msgs = "".join(
            f"<div class='m {html.escape(m['role'])}'><b>{html.escape(m['role'])}</b><pre>{html.escape(m['content'])}</pre></div>"
            for m in t["messages"]
        )
        status = "failed: " + html.escape(str(t.get("failure"))) if t.get("failed") else f"reward {t['reward']:.3g}"
        blocks.append(f"<section><h3>episode {i} — {status}</h3>{msgs}<p class='info'>{html.escape(json.dumps(t.get('info', {})))}</p></section>")
    style = "body{font-family:sans-serif;max-width:60em;margin:auto}pre{white-space:pre-wrap;margin:0}.m{padding:.3em;margin:.2em 0;border-left:3px solid #ccc}.assistant{border-color:#36c}.user{border-color:#3a3}.info{color:#666}"
    return f"<!doctype html><meta charset='utf-8'><title>step {step}</title><style>{style}</style><h1>Evaluation transcripts, step {step}</h1>{''.join(blocks)}"
