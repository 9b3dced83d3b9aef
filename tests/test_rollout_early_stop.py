"""A finished completion leaves the decode batch at once, and nothing else changes: the same
tokens, stop reasons and random draws as `model.generate` holding every row to the longest
(today's engine before this change), logprobs within float noise, the prefix cache and images
as before. The tiny random models are built from config; a large set of stop tokens makes
completions end at different lengths."""

from __future__ import annotations

import pytest
import torch

from opentinker.agent import EpisodeLimits, chat_format, run_episodes
from opentinker.backend import Completion, HFRolloutEngine, SamplingParams
from tests.games import PictureGame, ScriptedTurns

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


def _generate(engine, prompts, params, budgets):
    """What the engine gave before this change: `model.generate` over the whole batch."""
    from transformers import GenerationConfig

    input_ids, attention = engine._left_padded(prompts)
    cache = engine._shared_prefill(prompts, input_ids, attention)
    config = GenerationConfig(max_new_tokens=max(1, min(params.max_new_tokens, max(budgets))), do_sample=not params.greedy,
                              temperature=None if params.greedy else params.temperature, top_k=None if params.greedy else params.top_k or 0,
                              top_p=None if params.greedy or params.top_p >= 1.0 else params.top_p,
                              eos_token_id=engine.stop_ids, pad_token_id=engine.pad_id, return_dict_in_generate=True, output_logits=True,
                              output_scores=True)
    engine.model.eval()
    gen = engine.model.generate(input_ids=input_ids, attention_mask=attention, generation_config=config, past_key_values=cache)
    new = gen.sequences[:, input_ids.shape[1]:]
    # the distribution each token was drawn from: greedy, the raw logits; sampling, the processed scores (temperature, top-k, top-p)
    logprobs = torch.log_softmax(torch.stack(gen.logits if params.greedy else gen.scores, 1).float(), -1)
    logprobs = logprobs.gather(-1, new[..., None]).squeeze(-1)
    out = []
    for row, budget in enumerate(budgets):
        ids = new[row].tolist()
        stop_at = next((k for k, t in enumerate(ids) if t in engine.stop_ids), None)
        n, reason = (stop_at + 1, "stop") if stop_at is not None and stop_at < budget else (min(len(ids), budget), "length")
        out.append((ids[:n], logprobs[row, :n].tolist(), reason))
    return out, new.shape[1]


class RowCounter:
    """Counts the forward passes of a model and the batch rows they ran."""

    def __init__(self, model):
        self.forwards = self.rows = 0
        model.get_input_embeddings().register_forward_hook(self)

    def __call__(self, module, args, output):
        self.forwards += 1
        self.rows += args[0].shape[0]


def _same(a, b, tolerance=1e-5) -> None:
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.finish_reason for c in a] == [c.finish_reason for c in b]
    assert max(abs(x - y) for c, d in zip(a, b) for x, y in zip(c.logprobs, d.logprobs)) <= tolerance


@pytest.mark.parametrize("params", PARAMS, ids=["t0.9", "top_p", "top_k", "greedy"])
def test_finished_rows_leave_the_batch_and_the_samples_stay_those_of_generate(tiny, params):
    model, tok = tiny
    counter = RowCounter(model)
    engine = HFRolloutEngine(model, tok, prefix_cache_tokens=0)
    prompts, budgets = _prompts(tok), [BUDGETS[i % 4] for i in range(16)]
    engine.stop_ids = _greedy_stops(engine, prompts) if params.greedy else _stops(tok, 9)
    runs = {}
    for label in ("generate", "held", "early"):
        torch.manual_seed(5)
        before = (counter.forwards, counter.rows, engine.decode_forwards, engine.decode_positions, engine.useful_positions)
        if label == "generate":
            ref, steps = _generate(engine, prompts, params, budgets)
            out = [Completion(*c) for c in ref]
        else:
            engine.early_stop = label == "early"
            out = engine.generate(prompts, params, budgets)
        after = (counter.forwards, counter.rows, engine.decode_forwards, engine.decode_positions, engine.useful_positions)
        runs[label] = out, [b - a for a, b in zip(before, after)], torch.rand(3)  # the random stream after the call
    (generated, _, rng), (held, held_counts, held_rng), (early, early_counts, early_rng) = runs["generate"], runs["held"], runs["early"]
    lengths = [len(c.token_ids) for c in early]
    assert len(set(lengths)) > 2 and {c.finish_reason for c in early} == {"stop", "length"}
    _same(held, generated, 0.0)  # rows held to the end: exactly `generate`'s computation
    _same(early, generated)  # compacted: the same tokens; logprobs differ only by the batch's float noise
    assert torch.equal(rng, held_rng) and torch.equal(rng, early_rng)
    useful = sum(lengths)
    # held: every row runs every step (the prefill's forward is the first); early: a row runs until its last kept token
    assert held_counts[2:] == [steps, 16 * steps, useful] and held_counts[3] > useful
    assert early_counts[2:] == [max(lengths), useful, useful]
    # what the model really ran: the counts above plus the prompts' shared prefill (4 distinct prompts, one pass)
    assert held_counts[:2] == [steps + 1, 16 * steps + 4] and early_counts[:2] == [max(lengths) + 1, useful + 4]


def test_multi_turn_episodes_reuse_the_same_prefix_states(tiny):
    """A row leaving early takes its key/values with it: later turns hit the prefix cache and
    the records equal those of the held batch."""
    model, tok = tiny
    params, limits = SamplingParams(max_new_tokens=8, temperature=0.9), EpisodeLimits(max_turns=3, max_total_tokens=512)
    runs = {}
    for early in (True, False):
        engine = HFRolloutEngine(model, tok, early_stop=early)
        engine.stop_ids = _stops(tok, 7)
        torch.manual_seed(3)
        runs[early] = engine, run_episodes(engine, chat_format(tok), [ScriptedTurns(turns=3) for _ in range(8)], [{"id": i} for i in range(8)],
                                           params, limits, [i // 4 for i in range(8)])
    (early_engine, early), (held_engine, held) = runs[True], runs[False]
    assert [t.token_ids for t in early] == [t.token_ids for t in held]
    assert max(abs(x - y) for a, b in zip(early, held) for x, y in zip(a.sampling_logprobs, b.sampling_logprobs)) < 1e-5
    assert early_engine.prefix_cache.hit_tokens == held_engine.prefix_cache.hit_tokens > 0
    assert early_engine.useful_positions == held_engine.useful_positions == early_engine.decode_positions < held_engine.decode_positions


def test_image_batches_leave_early_too():
    from opentinker.model import load_model

    model, tok = load_model("tiny-vlm-random")
    tasks = [{"colour": c, "words": w} for c, w in [("red", 1), ("green", 4), ("blue", 2), ("yellow", 7)]]
    runs = {}
    for early in (True, False):
        engine = HFRolloutEngine(model, tok, early_stop=early)
        engine.stop_ids = _stops(tok, 7)
        torch.manual_seed(2)
        runs[early] = engine, run_episodes(engine, chat_format(tok), [PictureGame() for _ in tasks], tasks, SamplingParams(max_new_tokens=6),
                                           EpisodeLimits(max_turns=3, max_total_tokens=400), [i // 2 for i in range(len(tasks))])
    (early_engine, early), (held_engine, held) = runs[True], runs[False]
    assert all(not t.failed for t in early) and [t.token_ids for t in early] == [t.token_ids for t in held]
    assert max(abs(x - y) for a, b in zip(early, held) for x, y in zip(a.sampling_logprobs, b.sampling_logprobs)) < 1e-5
    assert early_engine.decode_positions == early_engine.useful_positions < held_engine.decode_positions


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
    torch.manual_seed(0)
    drawn = engine.generate([prompt] * 512, SamplingParams(max_new_tokens=1))
    tokens = torch.tensor([c.token_ids[0] for c in drawn])
    assert max(abs(c.logprobs[0] - float(full[c.token_ids[0]])) for c in drawn) < 1e-4
    top50 = set(full.topk(50).indices.tolist())
    outside = sum(t not in top50 for t in tokens.tolist()) / len(drawn)
    expected = 1.0 - float(full.topk(50).values.exp().sum())
    assert abs(outside - expected) < 4 * (expected * (1 - expected) / len(drawn)) ** 0.5 + 0.02, (outside, expected)

    drawn = engine.generate([prompt] * 64, SamplingParams(max_new_tokens=1, top_k=5))
    top5 = full.topk(5)
    renormalised = dict(zip(top5.indices.tolist(), torch.log_softmax(top5.values, -1).tolist()))
    assert {c.token_ids[0] for c in drawn} <= set(renormalised)
    assert max(abs(c.logprobs[0] - renormalised[c.token_ids[0]]) for c in drawn) < 1e-4


def test_rows_with_their_own_generator_draw_the_same_whoever_shares_their_batch(tiny):
    """A request's own generator (a hosted job's, a seeded request's): its rows draw the same tokens
    alone and in a batch with other rows (of another generator, of torch's global one) finishing at
    other steps, and leave the generator in the same state; a generator seeded s draws what
    `torch.manual_seed(s)` did. Only rows without a generator draw from torch's global one."""
    model, tok = tiny
    engine = HFRolloutEngine(model, tok, prefix_cache_tokens=0)
    engine.stop_ids = _stops(tok, 9)
    prompts, params = _prompts(tok), SamplingParams(max_new_tokens=12, temperature=0.9)
    mine, others = prompts[::2], prompts[1::2]
    budgets = [BUDGETS[i % 4] for i in range(8)]

    alone_rng = torch.Generator().manual_seed(11)
    alone = engine.generate(mine, params, budgets, generators=[alone_rng] * 8)
    shared_rng, theirs = torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)
    torch.manual_seed(5)
    global_before = torch.get_rng_state()
    batch = [p for pair in zip(mine, others) for p in pair]
    draws = [g for _ in range(8) for g in (shared_rng, theirs)]
    draws[3::4] = [None] * 4  # some of the others draw from torch's global generator
    mixed = engine.generate(batch, params, [b for b in budgets for _ in (0, 1)], generators=draws)
    assert len({len(c.token_ids) for c in alone}) > 2  # rows of mine leave the batch at different steps
    _same(mixed[::2], alone)
    assert torch.equal(shared_rng.get_state(), alone_rng.get_state())
    assert not torch.equal(torch.get_rng_state(), global_before)  # the None rows did draw from it

    torch.manual_seed(7)
    before = engine.generate(mine, params, budgets)  # an HFEngine seeded request, before generators
    after = engine.generate(mine, params, budgets, generators=[torch.Generator().manual_seed(7)] * 8)
    _same(after, before, 0.0)
