"""The endpoint that trains the user's own agent (issue 72, first part): the HF server with a call
recorder, driven by the unmodified openai SDK pointed at `base_url`, a key and the episode's header.
Every call is recorded as the tokens the server rendered and sampled, and the episode's calls join
into token-exact records (opentinker.agent.call_join); a call past a bound fails its episode with a
clear error, never the server.

Two engines: the tiny random model's own sampling (what it says is noise, so the checks are what must
hold whatever it samples), and one whose sampling is fixed to a tool call (as test_served_tools.py
does: HTTP, rendering, parsing and recording real) so a tool loop's join is checked exactly."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from opentinker.agent.call_join import join_calls
from opentinker.inference.call_recorder import EPISODE_HEADER, CallRecorder, RecordingRefused, RecordLimits, template_hash
from tests.test_served_tools import ADD, CALL, MESSAGES


@pytest.fixture(scope="module")
def endpoint():
    """(url, engine, recorder, scripted): the tiny model served with a recorder; `scripted[0]`, when
    set, is the reply every call gets instead of the model's sampling."""
    from opentinker.backend.rollout import Completion
    from opentinker.inference.engine_hf import HFEngine
    from opentinker.inference.server import create_app, serve_in_thread
    from opentinker.model.loading import load_base

    model, tokenizer = load_base("tiny-random")
    engine = HFEngine(model, tokenizer)
    recorder = CallRecorder(template_hash(tokenizer, engine.chat.tools.name), RecordLimits(calls_per_episode=4, tokens_per_call=2048))
    scripted: list[list[int] | None] = [None]
    sample = engine.generate

    def generate(batch, budgets, params, seed=None, adapter=None, images=None, **kw):
        if scripted[0] is None:
            return sample(batch, budgets, params, seed, adapter, images, **kw)
        done: Future = Future()
        done.set_result([Completion(token_ids=list(scripted[0]), logprobs=[-0.5] * len(scripted[0]), finish_reason="stop",
                                    versions=[3] * len(scripted[0])) for _ in batch])
        return done

    engine.generate = generate
    running = serve_in_thread(create_app(engine, "policy", api_key="k", recorder=recorder), "127.0.0.1", 0, model="policy", close=engine.close)
    yield running.url, engine, recorder, scripted
    running.stop()


def _client(url: str, episode: str | None):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, default_headers={EPISODE_HEADER: episode} if episode else None)


def test_a_plain_openai_loop_is_recorded_as_the_tokens_it_sampled(endpoint):
    url, engine, recorder, scripted = endpoint
    scripted[0] = None
    episode = recorder.open()
    client, messages, texts = _client(url, episode), list(MESSAGES), []
    for turn in range(3):  # the user's loop, as written for any OpenAI endpoint; its second call streams
        if turn == 1:
            stream = client.chat.completions.create(model="policy", messages=messages, tools=[ADD], max_tokens=6, seed=turn, stream=True)
            text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        else:
            text = client.chat.completions.create(model="policy", messages=messages, tools=[ADD], max_tokens=6, seed=turn).choices[0].message.content or ""
        texts.append(text)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
    calls = recorder.close(episode)
    assert calls.failure is None and len(calls.calls) == 3
    assert [c.text for c in calls.calls] == texts  # streamed or not, the text recorded is what the harness read
    first = engine.chat.encode(engine.chat.tools.render(MESSAGES, [ADD], add_generation_prompt=True))
    assert calls.calls[0].prompt_ids == first  # what the model read, token for token
    assert all(len(c.sampled_ids) == len(c.logprobs) > 0 and all(lp <= 0 for lp in c.logprobs) for c in calls.calls)

    joined = join_calls(calls.calls)
    # whatever the noise sampled: a call joins exactly when its prompt extends the last call's prompt and sample
    # (its text re-tokenised the same), and every call that does not is drift (the history is the same)
    joins = sum(c.prompt_ids[:len(p.prompt_ids) + len(p.sampled_ids)] == p.prompt_ids + p.sampled_ids
                for p, c in zip(calls.calls, calls.calls[1:]))
    assert len(joined.records) == 3 - joins and joined.drifted == 2 - joins
    trained = [(t, lp) for r in joined.records for t, lp, m in zip(r.token_ids, r.sampling_logprobs, r.loss_mask) if m]
    assert trained == [(t, lp) for c in calls.calls for t, lp in zip(c.sampled_ids, c.logprobs)]  # every sampled token once, no other


def test_a_tool_loop_joins_into_one_record_its_tool_results_masked(endpoint):
    url, engine, recorder, scripted = endpoint
    scripted[0] = engine.chat.encode(CALL) + [engine.tokenizer.eos_token_id]
    episode = recorder.open()
    client, messages = _client(url, episode), list(MESSAGES)
    for _ in range(2):
        message = client.chat.completions.create(model="policy", messages=messages, tools=[ADD], max_tokens=64).choices[0].message
        assert message.tool_calls and message.tool_calls[0].function.name == "add"
        messages += [message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "5"}]
    calls = recorder.close(episode)
    joined = join_calls(calls.calls)
    assert joined.drifted == 0 and len(joined.records) == 1
    record, (one, two) = joined.records[0], calls.calls
    assert record.token_ids == two.prompt_ids + two.sampled_ids
    assert record.loss_mask == [0] * len(one.prompt_ids) + [1] * len(one.sampled_ids) + \
        [0] * (len(two.prompt_ids) - len(one.prompt_ids) - len(one.sampled_ids)) + [1] * len(two.sampled_ids)
    assert "<tool_response>\n5\n</tool_response>" in engine.decode(record.token_ids[len(one.prompt_ids) + len(one.sampled_ids):len(two.prompt_ids)])
    assert record.sampled_versions == [3] * (2 * len(scripted[0])) and set(record.sampling_logprobs) == {0.0, -0.5}


def test_calls_past_their_bounds_fail_their_episode_with_a_clear_error(endpoint):
    from openai import BadRequestError, NotFoundError

    url, engine, recorder, scripted = endpoint
    scripted[0] = engine.chat.encode("ok") + [engine.tokenizer.eos_token_id]
    with pytest.raises(BadRequestError, match=f"{EPISODE_HEADER}: this endpoint records episodes"):
        _client(url, None).chat.completions.create(model="policy", messages=MESSAGES)
    with pytest.raises(NotFoundError, match="no such episode is open"):
        _client(url, "made-up").chat.completions.create(model="policy", messages=MESSAGES)

    episode = recorder.open()
    client = _client(url, episode)
    for _ in range(4):
        client.chat.completions.create(model="policy", messages=MESSAGES)
    with pytest.raises(BadRequestError, match="the episode failed: more than 4 calls in the episode"):
        client.chat.completions.create(model="policy", messages=MESSAGES)
    calls = recorder.close(episode)
    assert calls.failure == "more than 4 calls in the episode" and len(calls.calls) == 4
    with pytest.raises(NotFoundError):  # a closed episode is gone
        client.chat.completions.create(model="policy", messages=MESSAGES)

    episode = recorder.open()  # a long prompt: refused before it is sampled, and its episode is lost
    with pytest.raises(BadRequestError, match="over 2048 tokens a call"):
        _client(url, episode).chat.completions.create(model="policy", messages=[{"role": "user", "content": "x " * 3000}], max_tokens=8)
    with pytest.raises(BadRequestError, match="the episode failed"):
        _client(url, episode).chat.completions.create(model="policy", messages=MESSAGES)
    assert recorder.close(episode).calls == []


def test_no_more_episodes_open_at_once_than_the_bound():
    recorder = CallRecorder("t", RecordLimits(episodes_in_flight=2))
    first, _ = recorder.open(), recorder.open()
    with pytest.raises(RecordingRefused, match="at most 2 episodes in flight"):
        recorder.open()
    recorder.close(first)
    recorder.open()  # a closed one frees its place
