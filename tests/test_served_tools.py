"""A served checkpoint takes the openai SDK's `tools=` and answers `tool_calls` in the format it was
trained in: both engines render a request with tools as training does (`ToolFormat.render`: for
SmolLM2's tokenizer, whose template ignores tools, the hermes default) and parse the reply's
`<tool_call>` blocks. The tiny random model cannot be relied on to call, so its reply is fixed: on
the HF server its sampling is replaced by the call's tokens (the server's HTTP, rendering and
parsing are real); on vLLM its own sampling is constrained to the call's text (structured outputs,
a regex: that test is in test_serving_hostile.py, on the vLLM server its module starts once)."""

from __future__ import annotations

import json
from concurrent.futures import Future

import pytest

CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
MESSAGES = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2 + 3?"}]


def follow_up(call_id: str) -> list[dict]:
    """The conversation after the call, as training renders it (arguments as an object, as both servers read them)."""
    call = {"id": call_id, "type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    return MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": call_id, "content": "5"}]


def check_call(response) -> None:
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "add" and call.id.startswith(("call_", "chatcmpl-tool-"))
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert not choice.message.content  # nothing before the call


@pytest.fixture(scope="module")
def hf_served():
    """The HF server on the tiny model, whose sampling answers every prompt with CALL (the prompts are kept)."""
    from opentinker.backend.rollout import Completion
    from opentinker.inference.engine_hf import HFEngine
    from opentinker.inference.server import create_app, serve_in_thread
    from opentinker.model.loading import load_base

    model, tokenizer = load_base("tiny-random")
    engine = HFEngine(model, tokenizer)
    prompts: list[list[int]] = []
    reply = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def generate(batch, budgets, params, seed=None, adapter=None, images=None, **_):
        prompts.extend(batch)
        done: Future = Future()
        done.set_result([Completion(token_ids=list(reply), logprobs=[0.0] * len(reply), finish_reason="stop") for _ in batch])
        return done

    engine.generate = generate
    running = serve_in_thread(create_app(engine, "policy", api_key="k"), "127.0.0.1", 0, model="policy", close=engine.close)
    yield running, engine, prompts
    running.stop()


def test_the_hf_server_answers_tool_calls_in_the_trained_format(hf_served):
    from openai import BadRequestError, OpenAI

    running, engine, prompts = hf_served
    client, tools = OpenAI(base_url=f"{running.url}/v1", api_key="k"), engine.chat.tools
    assert tools.name == "hermes"
    response = client.chat.completions.create(model="policy", messages=MESSAGES, tools=[ADD], temperature=0, max_tokens=64)
    check_call(response)
    expected = tools.render(MESSAGES, [ADD], add_generation_prompt=True)
    assert "<tools>\n" + json.dumps(ADD) + "\n</tools>" in expected
    assert prompts[-1] == engine.chat.encode(expected)  # the prompt the model read: training's rendering, token for token

    call = response.choices[0].message.tool_calls[0]
    again = client.chat.completions.create(model="policy", tools=[ADD], max_tokens=64, messages=MESSAGES + [
        response.choices[0].message, {"role": "tool", "tool_call_id": call.id, "content": "5"}])
    check_call(again)
    rendered = tools.render(follow_up(call.id), [ADD], add_generation_prompt=True)
    assert prompts[-1] == engine.chat.encode(rendered) and rendered.endswith(f"{CALL}<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n"
                                                                             "</tool_response><|im_end|>\n<|im_start|>assistant\n")

    stream = client.chat.completions.create(model="policy", messages=MESSAGES, tools=[ADD], max_tokens=64, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    streamed = [d for c in chunks for d in c.delta.tool_calls or []]
    assert [(d.index, d.function.name, json.loads(d.function.arguments)) for d in streamed] == [(0, "add", {"a": 2, "b": 3})]
    assert chunks[-1].finish_reason == "tool_calls"

    plain = client.chat.completions.create(model="policy", messages=MESSAGES, tools=[ADD], tool_choice="none", max_tokens=64)
    assert plain.choices[0].message.content == CALL and not plain.choices[0].message.tool_calls  # not parsed
    assert plain.choices[0].finish_reason == "stop" and prompts[-1] == engine.chat.encode(expected)  # the tools still shown
    without = client.chat.completions.create(model="policy", messages=MESSAGES, max_tokens=64)
    assert without.choices[0].message.content == CALL and prompts[-1] == engine.chat.prompt_ids(MESSAGES)
    for choice in ("required", {"type": "function", "function": {"name": "add"}}):
        with pytest.raises(BadRequestError, match="tool_choice .* is not supported by this server: use 'auto' or 'none'"):
            client.chat.completions.create(model="policy", messages=MESSAGES, tools=[ADD], tool_choice=choice)
    with pytest.raises(BadRequestError, match=r"tools\[0\]: must be"):
        client.chat.completions.create(model="policy", messages=MESSAGES, tools=[{"type": "function", "function": {}}])
