"""The token record is exact: sampled + observation tokens, mask 1 only on sampled, logprobs that
the trainer reproduces; failing environments cost one episode each; episodes are streams of their
own (a slow environment holds only its episode)."""

import threading
import time

import pytest
import torch

from opentinker.agent import ChatFormat, EpisodeLimits, EpisodeState, run_episodes
from opentinker.agent.loop import Episode
from opentinker.backend import HFRolloutEngine, PolicyTrainer, SamplingParams
from opentinker.tracking.metrics import episode_stats
from opentinker.core.spec import AlgorithmSpec, LoraSpec, OptimizationSpec
from tests.games import GarbageGame, HangingGame, NanRewardGame, RaisingGame, ScriptedTurns
from tests.rounding import same_logprobs


class RecordingEngine:
    """Wraps an engine and keeps every prompt it was given and every completion it returned
    (episodes call it from their own threads, one turn each)."""

    def __init__(self, inner):
        self.inner = inner
        self.calls = []
        self.lock = threading.Lock()

    @property
    def policy_version(self):
        return self.inner.policy_version

    def generate(self, prompts, params, budgets=None, **kwargs):
        out = self.inner.generate(prompts, params, budgets, **kwargs)
        with self.lock:
            self.calls.extend(zip([list(p) for p in prompts], out))
        return out

    def turns_of(self, prompt_ids):
        """(prompt, completion) of each turn of the episode that starts with `prompt_ids`, in order."""
        mine = [c for c in self.calls if c[0][: len(prompt_ids)] == prompt_ids]
        return sorted(mine, key=lambda c: len(c[0]))


@pytest.fixture
def setup(tiny):
    model, tok = tiny
    torch.manual_seed(0)
    trainer = PolicyTrainer(model, tok, LoraSpec(r=4), AlgorithmSpec(), OptimizationSpec(), temperature=0.8)
    engine = RecordingEngine(HFRolloutEngine(trainer.model, tok))
    return trainer, engine, ChatFormat(tok), tok


def test_three_turn_record_is_token_exact(setup):
    trainer, engine, chat, tok = setup
    games = [ScriptedTurns(turns=3) for _ in range(3)]
    tasks = [{"id": i} for i in range(3)]
    params = SamplingParams(max_new_tokens=6, temperature=0.8)
    trajs = run_episodes(engine, chat, games, tasks, params, EpisodeLimits(max_turns=5, max_total_tokens=512))
    assert len(engine.calls) == 9  # each episode's turn on its own: three episodes, three turns
    for row, traj in enumerate(trajs):
        assert traj.stop_reason == "done" and len(traj.turns) == 3 and not traj.failed
        # the prompt is the chat template of the initial conversation, tokenized once
        initial = [{"role": "system", "content": "Play along."}, {"role": "user", "content": f"start {row}"}]
        assert traj.prompt_ids == chat.prompt_ids(initial)
        # rebuild the record from what the engine returned and the observation deltas
        expected, mask = list(traj.prompt_ids), [0] * len(traj.prompt_ids)
        for turn, (prompt, comp) in enumerate(engine.turns_of(traj.prompt_ids)):
            assert prompt == expected  # each generation continued the record as it stood: append-only
            expected += comp.token_ids
            mask += [1] * len(comp.token_ids)
            if turn < 2:
                obs = chat.observation_ids(f"observation {turn + 1}", comp.finish_reason == "stop")
                expected += obs
                mask += [0] * len(obs)
        assert traj.token_ids == expected
        assert traj.loss_mask == mask
        # the text of the record is the chat template of the conversation (nothing re-tokenized in between)
        sampled = [tok.decode(traj.token_ids[t.sampled_start : t.sampled_end]) for t in traj.turns]
        assert all(not s.endswith(tok.eos_token) for s in sampled)  # tiny random model: budget-limited turns
        messages = initial + [
            m for k, s in enumerate(sampled) for m in ([{"role": "assistant", "content": s}] + ([{"role": "user", "content": f"observation {k + 1}"}] if k < 2 else []))
        ]
        rendered = tok.apply_chat_template(messages, tokenize=False)
        assert rendered.startswith(tok.decode(traj.token_ids))
        # per-turn rewards kept; the episode reward sits on the last trainable token
        assert [t.reward for t in traj.turns] == pytest.approx([0.1, 0.2, 1.0])
        rewards = traj.token_rewards()
        assert rewards[traj.last_trainable_index()] == pytest.approx(1.3) and sum(rewards) == pytest.approx(1.3)
        assert traj.loss_mask[traj.last_trainable_index() + 1 :] == []

    # recomputed logprobs (fp32, same weights) match the sampling logprobs: decoding's key/value
    # cache against one pass, the same sums in other orders (tests/rounding.py)
    recomputed = trainer.logprobs(trajs)
    for traj, lps in zip(trajs, recomputed):
        sampled = [lp for lp, m in zip(traj.sampling_logprobs, traj.loss_mask) if m]
        assert len(sampled) == len(lps) == traj.num_sampled
        assert same_logprobs(sampled, lps)


def test_observation_after_a_stopped_turn_closes_with_the_template_tail(tiny):
    _, tok = tiny
    chat = ChatFormat(tok)
    stopped = tok.decode(chat.observation_ids("obs", policy_stopped=True))
    cut = tok.decode(chat.observation_ids("obs", policy_stopped=False))
    assert cut == tok.eos_token + stopped
    assert stopped == "\n<|im_start|>user\nobs<|im_end|>\n<|im_start|>assistant\n"


def test_state_machine_path(setup):
    trainer, engine, chat, tok = setup
    ep = Episode(ScriptedTurns(turns=2), {}, 0)
    from opentinker.agent import loop

    limits = EpisodeLimits(max_turns=5, max_total_tokens=512)
    loop._start(ep, chat, limits)
    while ep.state is EpisodeState.GENERATING:
        loop._generate(ep, engine, chat, SamplingParams(max_new_tokens=3), limits)
        loop._interact(ep, chat, limits)
    assert ep.history + [ep.state] == [
        EpisodeState.PENDING, EpisodeState.GENERATING, EpisodeState.INTERACTING,
        EpisodeState.GENERATING, EpisodeState.INTERACTING, EpisodeState.TERMINATED,
    ]


def test_limits_end_episodes_cleanly(setup):
    _, engine, chat, _ = setup
    params = SamplingParams(max_new_tokens=8)
    (by_turns,) = run_episodes(engine, chat, [ScriptedTurns(turns=99)], [{}], params, EpisodeLimits(max_turns=2, max_total_tokens=512))
    assert by_turns.stop_reason == "max_turns" and len(by_turns.turns) == 2 and not by_turns.failed
    prompt_len = len(by_turns.prompt_ids)
    budget = prompt_len + 20
    (by_tokens,) = run_episodes(engine, chat, [ScriptedTurns(turns=99)], [{}], params, EpisodeLimits(max_turns=99, max_total_tokens=budget))
    assert by_tokens.stop_reason == "max_total_tokens" and len(by_tokens) <= budget and not by_tokens.failed


def test_failing_environments_cost_one_episode_each(setup):
    _, engine, chat, _ = setup
    games = [ScriptedTurns(turns=1), RaisingGame(), HangingGame(), GarbageGame(), NanRewardGame(), ScriptedTurns(turns=1)]
    limits = EpisodeLimits(max_turns=3, max_total_tokens=512, step_timeout_s=0.5)
    trajs = run_episodes(engine, chat, games, [{}] * len(games), SamplingParams(max_new_tokens=3), limits)
    assert [t.failed for t in trajs] == [False, True, True, True, True, False]
    assert "RuntimeError: environment bug" in trajs[1].failure
    assert "timed out" in trajs[2].failure
    assert "expected StepResult" in trajs[3].failure
    assert "not finite" in trajs[4].failure
    assert all(t.reward == 0.0 for t in trajs[1:5]) and trajs[0].reward == 1.0
    stats = episode_stats(trajs, "rollout")
    assert stats["rollout/failed_episodes"] == 4.0 and stats["rollout/episodes"] == 6.0


def test_reset_failure_is_counted(setup):
    _, engine, chat, _ = setup

    class BadReset(ScriptedTurns):
        def reset(self, **task):
            raise KeyError("missing field")

    (traj,) = run_episodes(engine, chat, [BadReset()], [{}], SamplingParams(max_new_tokens=3), EpisodeLimits())
    assert traj.failed and traj.failure.startswith("reset: KeyError")


def test_shared_prompt_prefill_changes_nothing_but_speed(tiny):
    """Group members that join together share one prompt prefill; their samples and logprobs are
    what each gets alone (its own generator)."""
    model, tok = tiny
    trainer = PolicyTrainer(model, tok, LoraSpec(r=4), AlgorithmSpec(), OptimizationSpec())
    engine = HFRolloutEngine(trainer.model, tok)
    chat = ChatFormat(tok)
    prompts = [chat.prompt_ids([{"role": "user", "content": f"question {i // 4}"}]) for i in range(8)]
    params = SamplingParams(max_new_tokens=5, temperature=0.9)
    rows = []
    # every embedding call, of the model or of the engine's decode copy (slots.py)
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, out: rows.append(args[0].shape[0]) if isinstance(module, torch.nn.Embedding) else None)
    try:
        shared = engine.generate(prompts, params, generators=[torch.Generator().manual_seed(i) for i in range(8)])
    finally:
        hook.remove()
    assert rows[0] == 2  # the first forward: the two distinct prompts, once each
    alone = [engine.generate([p], params, generators=[torch.Generator().manual_seed(i)])[0] for i, p in enumerate(prompts)]
    assert [c.token_ids for c in shared] == [c.token_ids for c in alone]
    for a, b in zip(shared, alone):  # a batch of 8 against one row: other orders (tests/rounding.py)
        assert same_logprobs(a.logprobs, b.logprobs)


def test_prefix_cache_changes_nothing_but_speed(tiny):
    """Later turns reuse the key/values of the record so far: the same tokens and logprobs as
    prefilling the whole conversation again; a change of weights empties the cache."""
    model, tok = tiny
    trainer = PolicyTrainer(model, tok, LoraSpec(r=4), AlgorithmSpec(), OptimizationSpec(), temperature=0.9)
    chat = ChatFormat(tok)
    params, limits = SamplingParams(max_new_tokens=6, temperature=0.9), EpisodeLimits(max_turns=4, max_total_tokens=512)
    runs = {}
    for cache_tokens in (65536, 0):
        engine = HFRolloutEngine(trainer.model, tok, prefix_cache_tokens=cache_tokens)
        # prompts of different lengths, some turns stopped early: padding in both regions
        games, tasks = [ScriptedTurns(turns=4) for _ in range(6)], [{"id": 37**i} for i in range(6)]
        generators = [torch.Generator().manual_seed(11 + i) for i in range(6)]
        runs[cache_tokens] = engine, run_episodes(engine, chat, games, tasks, params, limits, generators=generators)
    (cached_engine, cached), (plain_engine, plain) = runs[65536], runs[0]
    assert [t.token_ids for t in cached] == [t.token_ids for t in plain]
    for a, b in zip(cached, plain):  # cached keys/values against a prefill: other orders (tests/rounding.py)
        assert same_logprobs(a.sampling_logprobs, b.sampling_logprobs)
    # turns 2..4 of every episode ran only their new tokens; the plain engine kept nothing
    before_last_turn = sum(t.turns[-1].sampled_start - len(t.prompt_ids) for t in cached)
    assert cached_engine.prefix_cache.hit_tokens >= 3 * sum(len(t.prompt_ids) for t in cached) + before_last_turn // 2
    assert plain_engine.prefix_cache.hit_tokens == 0 and len(plain_engine.prefix_cache) == 0
    assert len(cached_engine.prefix_cache) == 6  # one entry per episode, the latest turn's
    assert cached_engine.prefix_cache.lookup([cached[0].token_ids + [tok.eos_token_id]])[0][0] > 0
    with torch.no_grad():  # an optimizer step or a weight sync writes the parameters in place
        next(p for p in trainer.model.parameters() if p.requires_grad).add_(0.01)
    assert cached_engine.prefix_cache.lookup([cached[1].token_ids + [tok.eos_token_id]]) == [(0, None)]
    assert len(cached_engine.prefix_cache) == 0


def test_a_slow_environment_holds_only_its_own_episode(setup):
    """Episodes are streams: while one environment takes three seconds over its first step, the
    others play all their turns (their engine turns and steps on their own) and are done before it
    answers (in lock-step they would wait for it at their second turn)."""
    _, engine, chat, _ = setup
    slow_steps = []

    class Slow(ScriptedTurns):
        def step(self, action):
            if not slow_steps:
                time.sleep(3.0)
            slow_steps.append(1)
            return super().step(action)

    seen = []

    class Fast(ScriptedTurns):
        def step(self, action):
            result = super().step(action)
            if result.done:
                seen.append(len(slow_steps))  # how far the slow episode was when this one ended
            return result

    trajs = run_episodes(engine, chat, [Slow(turns=3), *[Fast(turns=3) for _ in range(3)]], [{"id": i} for i in range(4)],
                         SamplingParams(max_new_tokens=3), EpisodeLimits(max_turns=5, max_total_tokens=512))
    assert all(not t.failed and len(t.turns) == 3 for t in trajs)
    assert seen == [0, 0, 0]  # every fast episode ended before the slow one's first step did
    assert len(engine.calls) == 12 and [len(t.env_seconds) for t in trajs] == [3, 3, 3, 3]
    assert trajs[0].env_seconds[0] >= 3.0 and max(s for t in trajs[1:] for s in t.env_seconds) < 3.0
    # each turn's wait for the engine, apart from the environment's time (rollout/turn_seconds_mean)
    assert [len(t.turn_seconds) for t in trajs] == [3, 3, 3, 3] and max(s for t in trajs for s in t.turn_seconds) < 3.0


def test_a_steps_metrics_say_where_its_time_went(tmp_path, monkeypatch):
    """One group's tool takes 1.5 s, the other three groups' none: the step's 8 episodes waited
    1.5 s x 2 / 8 on tools on average, its last group ended about 1.5 s after its median one, and
    each turn's wait for the engine and the engine's own seconds are there."""
    from opentinker.rl import RLJob
    from tests.conftest import tiny_spec

    monkeypatch.setenv("OPENTINKER_GAME_ALLOWLIST", "envs,tests.games")
    spec = tiny_spec(tmp_path, env={"game": "tests.games:SlowForOneTask", "config": {"dataset": [{"id": i} for i in range(4)]}},
                     rollout={"prompts_per_step": 4, "group_size": 2, "max_new_tokens": 2}, optimization={"steps": 1})
    job = RLJob(spec, job_id="where-time-went")
    try:
        metrics = job.rollout(0)
    finally:
        job.close()
    assert metrics["rollout/episode_tool_seconds"] == pytest.approx(1.5 * 2 / 8, abs=0.1)  # 2 of 8 episodes waited 1.5 s
    assert 1.3 < metrics["rollout/straggler_seconds"] < 3.0
    assert 0 < metrics["rollout/turn_seconds_mean"] and 0 < metrics["rollout/engine_seconds"] <= metrics["rollout/seconds"]
