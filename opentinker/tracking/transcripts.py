"""Episodes as people read them: plain records for artifacts, and a small HTML page. Images in
messages become OpenAI-style `image_url` parts with data URLs (shown inline on the page)."""

from __future__ import annotations

import html
import json
from typing import Any

from opentinker.core.trajectory import Trajectory
from opentinker.env.observation import data_url


def readable(message: dict[str, Any]) -> dict[str, Any]:
    """A message with JSON-able content: PIL images as image_url parts (data: URLs)."""
    content = message.get("content")
    if isinstance(content, str) or content is None:
        return message
    parts = [{"type": "image_url", "image_url": {"url": data_url(p["image"])}} if p.get("type") == "image" else p for p in content]
    return {**message, "content": parts}


def _content_html(content: Any) -> str:
    if isinstance(content, str):
        return f"<pre>{html.escape(content)}</pre>"
    out = []
    for part in content or []:
        if part.get("type") == "image_url":
            url = str(part["image_url"]["url"])
            if url.startswith("data:image/"):
                out.append(f"<img src='{html.escape(url, quote=True)}' style='max-width:20em;display:block'>")
        else:
            out.append(f"<pre>{html.escape(str(part.get('text', '')))}</pre>")
    return "".join(out)


def token_spans(tokenizer: Any, token_ids: list[int], loss_mask: list[int]) -> list[dict[str, Any]]:
    """The record's tokens as runs of one loss mask, each decoded: [{"text", "trained"}], so a
    reader sees exactly which tokens the update trains (1) and which it masks (0)."""
    spans: list[dict[str, Any]] = []
    start = 0
    for i in range(1, len(token_ids) + 1):
        if i == len(token_ids) or bool(loss_mask[i]) != bool(loss_mask[start]):
            spans.append({"text": tokenizer.decode(token_ids[start:i], skip_special_tokens=False), "trained": bool(loss_mask[start])})
            start = i
    return spans


def transcripts(trajs: list[Trajectory], tokenizer: Any = None) -> list[dict[str, Any]]:
    """Readable episodes (messages, reward, info) for artifacts and eyeballing; given the policy's
    tokenizer, also each record's tokens by loss mask (`token_spans`)."""
    decode = getattr(tokenizer, "decode", None)
    return [
        {
            **({"tokens": token_spans(tokenizer, t.token_ids, t.loss_mask)} if decode else {}),
            "task": t.task,
            "messages": [readable(m) for m in t.messages],
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
            f"<div class='m {html.escape(m['role'])}'><b>{html.escape(m['role'])}</b>{_content_html(m['content'])}</div>"
            for m in t["messages"]
        )
        status = "failed: " + html.escape(str(t.get("failure"))) if t.get("failed") else f"reward {t['reward']:.3g}"
        blocks.append(f"<section><h3>episode {i} — {status}</h3>{msgs}<p class='info'>{html.escape(json.dumps(t.get('info', {})))}</p></section>")
    style = "body{font-family:sans-serif;max-width:60em;margin:auto}pre{white-space:pre-wrap;margin:0}.m{padding:.3em;margin:.2em 0;border-left:3px solid #ccc}.assistant{border-color:#36c}.user{border-color:#3a3}.info{color:#666}"
    return f"<!doctype html><meta charset='utf-8'><title>step {step}</title><style>{style}</style><h1>Evaluation transcripts, step {step}</h1>{''.join(blocks)}"
