"""Continuous batching (opentinker/backend/stream.py): a sequence joins the running batch at the
next decode step and leaves the moment it ends, and what it gets does not depend on who else ran:
greedy tokens identical to `model.generate`'s and to its own run alone, sampled tokens identical
alone and joined (its own generator), logprobs within float noise; no forward runs a row that
already ended; the prefix cache, images and an in-flight weight update as stated. The tiny random
models are built from config; a large set of stop tokens makes completions end at different lengths."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from opentinker.agent import EpisodeLimits, chat_format, run_episodes
from opentinker.backend import HFRolloutEngine, SamplingParams
from tests.games import PictureGame, ScriptedTurns
from tests.rounding import logprob_gap, same_logprobs

PARAMS = [SamplingParams(max_new_tokens=12, temperature=0.9), SamplingParams(max_new_tokens=12, top_p=0.8),
          SamplingParams(max_new_tokens=12, top_k=20), SamplingParams(max_new_tokens=12, greedy=True)]
BUDGETS = [12, 9, 5, 12]


def _stops(tok, every: int) -> list[int]:
    return [i for i in range(tok.vocab_size) if i % every == 0]


def _greedy_stops(engine, prompts) -> list[int]:
    """Tokens greedy decoding reaches after its first ones (a random model repeats itself), so
    that greedy completions stop at different steps."""
    engine.stop_ids = []
    out = engine.generate(prompts, SamplingParams(max_new_tokens=12, greedy=True))
    return sorted({t for c in out for t in c.token_ids[2:]} - {c.token_ids[0] for c in out})


def _prompts(tok) -> list[list[int]]:
    """Groups of four samples of a prompt (shared prefill), prompts of different lengths (padding)."""
    return sorted((tok(f"question {i // 4} " + "x " * (i // 4 % 3))["input_ids"] for i in range(16)), key=len)


def _same(a, b) -> None:
    """The same completions, their logprobs from batches of other rows: other orders (tests/rounding.py)."""
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
    assert same_logprobs([x for c in a for x in c.logprobs], [y for d in b for y in d.logprobs])


def _own(n: int, seed: int = 0) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


@pytest.fixture(params=[False, True], ids=["dynamic", "slots"])
def slots(request) -> bool:
    """Both ways the running rows' key/values are held: a cache that grows and shrinks, or fixed
    slots (opentinker/backend/slots.py: CUDA graphs on a GPU; run eagerly here)."""
    return request.param


def test_greedy_completions_are_generates_and_rows_leave_when_they_end(tiny, slots):
    """Greedy tokens equal `model.generate`'s on the same left-padded batch (positions, padding and
    the shared prefill are right), and every row a forward runs yields a token that is kept."""
    from transformers import GenerationConfig

    model, tok = tiny
    engine = HFRolloutEngine(model, tok, prefix_cache_tokens=0, slots=slots)
    prompts = _prompts(tok)
    stops = _greedy_stops(engine, prompts)
    engine.stop_ids = stops
    budgets = [BUDGETS[i % 4] for i in range(16)]
    before = (engine.decode_positions, engine.useful_positions)
    out = engine.generate(prompts, PARAMS[3], budgets)
    # every row a forward ran kept its token, and the 16 rows' prefill ran their 4 distinct prompts once each
    assert engine.decode_positions - before[0] == engine.useful_positions - before[1] - 12
    lengths = [len(c.token_ids) for c in out]
    assert len(set(lengths)) > 2 and {c.finish_reason for c in out} == {"stop", "length"}
    for prompt, budget, comp in zip(prompts, budgets, out):
        config = GenerationConfig(max_new_tokens=budget, do_sample=False, eos_token_id=stops, pad_token_id=engine.pad_id,
                                  return_dict_in_generate=True, output_logits=True)
        gen = model.generate(input_ids=torch.tensor([prompt]), generation_config=config)
        new = gen.sequences[0, len(prompt):].tolist()
        n = next((k + 1 for k, t in enumerate(new) if t in stops), len(new))
        assert comp.token_ids == new[:n]
        logprobs = torch.log_softmax(torch.stack(gen.logits, 1)[0].float(), -1).gather(-1, torch.tensor(new)[:, None]).squeeze(-1)
        assert same_logprobs(comp.logprobs, logprobs[:n])  # a batch's decode against generate's: other orders


@pytest.mark.parametrize("params", PARAMS, ids=["t0.9", "top_p", "top_k", "greedy"])
def test_a_sequence_gets_the_same_alone_or_joining_a_running_batch(tiny, params, slots):
    """Each prompt run alone, then all of them submitted at staggered moments while long sequences
    of other requests run: the same tokens and stop reasons (its own generator), logprobs within
    float32's bound for the pass (tests/rounding.py)."""
    model, tok = tiny
    engine = HFRolloutEngine(model, tok, prefix_cache_tokens=0, slots=slots)
    prompts, budgets = _prompts(tok), [BUDGETS[i % 4] for i in range(16)]
    engine.stop_ids = _greedy_stops(engine, prompts) if params.greedy else _stops(tok, 9)
    alone = [engine.generate([p], params, [b], generators=_own(1, 100 + i))[0] for i, (p, b) in enumerate(zip(prompts, budgets))]
    background = engine.stream.submit([tok("a long unrelated story")["input_ids"]] * 3, SamplingParams(max_new_tokens=40), seed=1)
    results: dict[int, object] = {}

    def late(i: int) -> None:
        time.sleep(0.01 * (i % 5))
        results[i] = engine.generate([prompts[i]], params, [budgets[i]], generators=_own(1, 100 + i))[0]

    threads = [threading.Thread(target=late, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for f in background:
        f.result()
    _same([results[i] for i in range(16)], alone)
    assert engine.stream.mixed_forwards == 0 and engine.decode_forwards > 0


def test_rows_of_one_request_draw_together_and_alone_from_their_generator(tiny):
    """A request's rows share its generator (a seeded server request, a Tinker sample of n): they
    draw on the shape of all of them, so they get the same beside another request as alone, and a
    generator seeded s draws what `torch.multinomial` does after `torch.manual_seed(s)`; the global generator is untouched."""
    model, tok = tiny
    engine = HFRolloutEngine(model, tok, prefix_cache_tokens=0)
    engine.stop_ids = _stops(tok, 9)
    prompts, params = _prompts(tok), SamplingParams(max_new_tokens=12, temperature=0.9)
    mine, others = prompts[::2], prompts[1::2]
    budgets = [BUDGETS[i % 4] for i in range(8)]
    alone_rng = torch.Generator().manual_seed(11)
    alone = engine.generate(mine, params, budgets, generators=[alone_rng] * 8)
    assert len({len(c.token_ids) for c in alone}) > 2  # its rows end at different steps
    shared_rng = torch.Generator().manual_seed(11)
    torch.manual_seed(5)
    global_before = torch.get_rng_state()
    theirs = engine.stream.submit(others, params, budgets, generator=torch.Generator().manual_seed(12))
    mixed = engine.generate(mine, params, budgets, generators=[shared_rng] * 8)
    [f.result() for f in theirs]
    _same(mixed, alone)
    assert torch.equal(shared_rng.get_state(), alone_rng.get_state())
    assert torch.equal(torch.get_rng_state(), global_before)
    engine.stop_ids = []
    (one,) = engine.generate([mine[0]], SamplingParams(max_new_tokens=1, temperature=0.9), generators=[torch.Generator().manual_seed(3)])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([mine[0]])).logits[0, -1].float() / 0.9
    torch.manual_seed(3)
    assert one.token_ids[0] == int(torch.multinomial(torch.softmax(logits, -1)[None], 1, generator=None)[0, 0])


def test_multi_turn_episodes_reuse_their_prefix_states(tiny, slots):
    """A row leaving takes its key/values with it: later turns hit the prefix cache, and the
    records equal those played without it."""
    model, tok = tiny
    params, limits = SamplingParams(max_new_tokens=8, temperature=0.9), EpisodeLimits(max_turns=3, max_total_tokens=512)
    runs = {}
    for cache in (65536, 0):
        engine = HFRolloutEngine(model, tok, prefix_cache_tokens=cache, slots=slots)
        engine.stop_ids = _stops(tok, 7)
        runs[cache] = engine, run_episodes(engine, chat_format(tok), [ScriptedTurns(turns=3) for _ in range(8)], [{"id": i} for i in range(8)],
                                           params, limits, [i // 4 for i in range(8)], generators=_own(8, 3))
    (cached_engine, cached), (plain_engine, plain) = runs[65536], runs[0]
    assert [t.token_ids for t in cached] == [t.token_ids for t in plain]
    assert same_logprobs([x for a in cached for x in a.sampling_logprobs], [y for b in plain for y in b.sampling_logprobs])
    assert cached_engine.prefix_cache.hit_tokens > 0 and plain_engine.prefix_cache.hit_tokens == 0


def test_image_records_join_and_leave_too():
    from opentinker.model import load_model

    model, tok = load_model("tiny-vlm-random")
    tasks = [{"colour": c, "words": w} for c, w in [("red", 1), ("green", 4), ("blue", 2), ("yellow", 7)]]
    engine = HFRolloutEngine(model, tok)
    engine.stop_ids = _stops(tok, 7)
    trajs = run_episodes(engine, chat_format(tok), [PictureGame() for _ in tasks], tasks, SamplingParams(max_new_tokens=6),
                         EpisodeLimits(max_turns=3, max_total_tokens=400), [i // 2 for i in range(len(tasks))], generators=_own(4))
    assert all(not t.failed and t.images for t in trajs)
    again = run_episodes(engine, chat_format(tok), [PictureGame() for _ in tasks], tasks, SamplingParams(max_new_tokens=6),
                         EpisodeLimits(max_turns=3, max_total_tokens=400), [i // 2 for i in range(len(tasks))], generators=_own(4))
    assert [t.token_ids for t in trajs] == [t.token_ids for t in again]


def test_sampling_draws_from_the_distribution_whose_logprobs_it_records(tiny):
    """No implicit truncation: by default tokens come from the full softmax (as often outside the
    50 likeliest as its mass says) and their recorded logprobs are that softmax's; with an
    explicit top-k every token is among the k likeliest and its logprob is the renormalised one."""
    model, tok = tiny
    engine = HFRolloutEngine(model, tok, max_batch_size=512, prefix_cache_tokens=0)
    engine.stop_ids = []
    prompt = tok("The capital of France is")["input_ids"]
    with torch.no_grad():
        full = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0, -1].float(), -1)
    drawn = engine.generate([prompt] * 512, SamplingParams(max_new_tokens=1), generators=_own(512))
    tokens = torch.tensor([c.token_ids[0] for c in drawn])
    assert same_logprobs([c.logprobs[0] for c in drawn], [float(full[c.token_ids[0]]) for c in drawn])
    top50 = set(full.topk(50).indices.tolist())
    outside = sum(t not in top50 for t in tokens.tolist()) / len(drawn)
    expected = 1.0 - float(full.topk(50).values.exp().sum())
    assert abs(outside - expected) < 4 * (expected * (1 - expected) / len(drawn)) ** 0.5 + 0.02, (outside, expected)

    drawn = engine.generate([prompt] * 64, SamplingParams(max_new_tokens=1, top_k=5), generators=_own(64))
    top5 = full.topk(5)
    renormalised = dict(zip(top5.indices.tolist(), torch.log_softmax(top5.values, -1).tolist()))
    assert {c.token_ids[0] for c in drawn} <= set(renormalised)
    assert same_logprobs([c.logprobs[0] for c in drawn], [renormalised[c.token_ids[0]] for c in drawn])


def test_a_weight_update_between_steps_is_recorded_per_token(tiny, slots):
    """Weights published while a sequence decodes (between two steps, as a producer does) take
    effect at its next token: every token records the version that drew it. The tokens drawn before
    the update have the old weights' logprobs; those after, drawn by the new weights over the key/
    values the old ones wrote (an in-flight update), differ from what the old weights give."""
    model, tok = tiny
    model = copy.deepcopy(model)
    engine = HFRolloutEngine(model, tok, prefix_cache_tokens=0, slots=slots)
    engine.stop_ids = []
    prompt = tok("The capital of France is")["input_ids"]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    steps = []
    original = engine.stream._decode

    def decode_then_update():
        original()
        steps.append(1)
        if len(steps) == 4:  # after the fifth token (the prefill drew the first): version 1
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.05)
            engine.policy_version = 1
            engine.stream.changed = True  # what between_steps says (this runs inside a step, holding its lock)

    engine.stream._decode = decode_then_update
    (comp,) = engine.generate([prompt], SamplingParams(max_new_tokens=10, greedy=True))
    assert comp.versions == [0] * 5 + [1] * 5
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(before[n])
        logits = model(input_ids=torch.tensor([prompt + comp.token_ids])).logits[0, len(prompt) - 1 : -1].float()
    old = torch.log_softmax(logits, -1).gather(-1, torch.tensor(comp.token_ids)[:, None]).squeeze(-1).tolist()
    assert same_logprobs(comp.logprobs[:5], old[:5])
    assert min(abs(a - b) for a, b in zip(comp.logprobs[5:], old[5:])) > logprob_gap(old[5:])  # more than rounding


def test_slots_make_room_as_rows_come_and_go(tiny, monkeypatch):
    """Over slots, when the shared column reaches the capacity the columns no running row uses are
    dropped, or the capacity doubles; a row joining with a longer prompt than the batch is wide
    moves the others right. Through all of it every sequence gets what it gets in a growing cache."""
    from opentinker.backend import slots as slot_module

    monkeypatch.setattr(slot_module, "MIN_CAPACITY", 16)
    model, tok = tiny
    runs = []
    for slots in (False, True):
        engine = HFRolloutEngine(model, tok, max_batch_size=4, prefix_cache_tokens=0, slots=slots)
        engine.stop_ids = _stops(tok, 9)
        params = SamplingParams(max_new_tokens=30, temperature=0.9)
        prompts = [tok("a " * (2 + 7 * (i % 3)))["input_ids"] for i in range(10)]
        futures = []
        for i, prompt in enumerate(prompts):  # more requests than slots, arriving while others run
            futures += engine.stream.submit([prompt], params, seed=i)
            time.sleep(0.02)
        runs.append([f.result() for f in futures])
        if slots:
            decoder = engine.stream.slots
            assert decoder.capacity > 16 and decoder.eager_steps > 0
    _same(runs[1], runs[0])
