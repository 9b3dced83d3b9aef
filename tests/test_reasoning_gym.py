"""reasoning-gym's datasets train here unmodified, against the real package: tasks are drawn by the
job's seed (validation fixed), the answer is read the way reasoning-gym documents it and scored by
the dataset's own `score_answer`; a spec names a dataset (or a weighted mix) and is refused in one
line before submission when it names something that cannot run; what fails costs one episode."""

from __future__ import annotations

import inspect
import re
import time

import pytest
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import SYSTEM_PROMPTS

from envs.reasoning_gym import ReasoningGymGame
from opentinker.core import env_sources
from opentinker.core.spec import SpecError, parse_spec
from opentinker.env import GameEnvironment
from tests.conftest import tiny_spec

DATASETS_USED = ["basic_arithmetic", "leg_counting", "chain_sum"]


def spec_for(dataset, config=None, seed=0, **env):
    data = {"model": {"name": "tiny-random"}, "env": {"source": "reasoning_gym", "dataset": dataset, "config": config or {}, **env},
            "seed": seed}
    return parse_spec(data)


def environment(dataset, config=None, seed=0) -> GameEnvironment:
    return GameEnvironment(game_class=ReasoningGymGame, config=spec_for(dataset, {"val_size": 16, **(config or {})}, seed))


def played(task, text, **game_kwargs):
    game = ReasoningGymGame(**game_kwargs)
    question = game.reset(**task)
    return game, question, game.step(text)


# --- tasks and scores ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", DATASETS_USED)
def test_tasks_follow_the_jobs_seed_and_validation_stays_fixed(name):
    first, again, other = environment(name, seed=0), environment(name, seed=0), environment(name, seed=1)
    assert first.validation_tasks() == again.validation_tasks() and len(first.validation_tasks()) == 16
    train = first.train_tasks(12)
    assert train == again.train_tasks(12)  # the same seed draws the same stream
    assert train != other.train_tasks(12) and first.validation_tasks() != other.validation_tasks()
    assert not {t["index"] for t in first.train_tasks(200)} & {t["index"] for t in first.validation_tasks()}
    questions = [ReasoningGymGame().reset(**t) for t in train]
    assert len(set(questions)) > 6 and all(isinstance(q, str) and q for q in questions)


@pytest.mark.parametrize("name", DATASETS_USED)
def test_the_datasets_own_score_answer_gives_the_reward(name):
    env = environment(name)
    for task in env.validation_tasks(4):
        game = ReasoningGymGame()
        game.reset(**task)
        entry = game.pool[task["index"]]  # the package's own entry, regenerated from the index
        assert game.entry == entry
        right = game.step(f"Let me think: the sum.\n<answer>{entry['answer']}</answer>")
        assert right.done and right.reward == 1.0 and right.info["correct"] and right.info["format_ok"]
        wrong = game.step("<answer>no idea</answer>")
        assert wrong.reward == 0.0 and not wrong.info["correct"] and wrong.info["format_ok"]
        for malformed in ("", "the answer is " + entry["answer"], "<answer>" + entry["answer"], "\x00<answer></answer"):
            result = game.step(malformed)
            assert result.reward == 0.0 and not result.info["format_ok"]
        partial = game.step(f"<answer>{entry['answer']}0</answer>")  # whatever the dataset says, not ours
        assert partial.reward == game.pool.score_answer(f"{entry['answer']}0", entry)


def test_a_weighted_mix_draws_both_by_weight_and_scores_each_with_its_own_verifier():
    env = environment({"chain_sum": 3, "leg_counting": {"weight": 1, "config": {"max_animals": 4}}}, {"val_size": 64})
    seen = {}
    for task in env.validation_tasks():
        game, _, result = played(task, "<answer>x</answer>")
        seen[result.info["source_dataset"]] = seen.get(result.info["source_dataset"], 0) + 1
        assert result.reward == 0.0
        right = game.step(f"<answer>{game.entry['answer']}</answer>")
        assert right.reward == 1.0
        if result.info["source_dataset"] == "leg_counting":
            assert game.entry["metadata"]["num_animals"] <= 4  # the mix's own config reached its dataset
    assert set(seen) == {"chain_sum", "leg_counting"} and seen["chain_sum"] > seen["leg_counting"]


def test_the_system_prompt_and_the_answer_tag_are_reasoning_gyms_and_can_be_changed():
    task = environment("chain_sum").validation_tasks(1)[0]
    assert ReasoningGymGame().get_system_prompt() == SYSTEM_PROMPTS["default"]
    assert "<answer>" in ReasoningGymGame().get_system_prompt()
    assert ReasoningGymGame(system_prompt="direct").get_system_prompt() == SYSTEM_PROMPTS["direct"]
    assert ReasoningGymGame(system_prompt="Reply as <final>n</final>.").get_system_prompt() == "Reply as <final>n</final>."
    game, _, _ = played(task, "", answer_tag="final")
    assert game.step(f"<final>{game.entry['answer']}</final>").reward == 1.0
    assert game.step(f"<answer>{game.entry['answer']}</answer>").reward == 0.0
    with pytest.raises(ValueError, match="answer_tag"):
        ReasoningGymGame(answer_tag="a>b")
    spec = spec_for("chain_sum", {"game_kwargs": {"system_prompt": "simple", "answer_tag": "final"}})
    made = GameEnvironment(game_class=ReasoningGymGame, config=spec).make_game()
    assert made.get_system_prompt() == SYSTEM_PROMPTS["simple"] and made.answer_tag == "final"


# --- the spec -----------------------------------------------------------------------------------

def test_the_source_resolves_to_the_shipped_adapter_and_round_trips():
    spec = spec_for("leg_counting", {"min_animals": 2, "val_size": 8})
    assert spec.env.game == "envs.reasoning_gym:ReasoningGymGame"
    assert spec.env.config == {"min_animals": 2, "val_size": 8, "rg_dataset": "leg_counting"}
    assert parse_spec(spec.model_dump(mode="json")) == spec
    direct = parse_spec({"model": {"name": "tiny-random"},
                         "env": {"game": spec.env.game, "config": {"rg_dataset": "leg_counting", "min_animals": 2, "val_size": 8}}})
    assert GameEnvironment(ReasoningGymGame, config=direct).validation_tasks() == GameEnvironment(ReasoningGymGame, config=spec).validation_tasks()


@pytest.mark.parametrize("env,line", [
    ({"dataset": "leg_countin"}, "env.dataset: unknown reasoning-gym dataset 'leg_countin' (some: count_bits, count_primes, leg_counting; "),
    ({"dataset": None}, "env.dataset: name a reasoning-gym dataset (e.g. chain_sum) or a weighted mix"),
    ({"dataset": "n_queens"}, "env.dataset: reasoning-gym dataset 'n_queens' is refused here: its score_answer runs eval() on the model's text"),
    ({"dataset": "puzzle24"}, "env.dataset: reasoning-gym dataset 'puzzle24' is refused here: its score_answer runs sympy's parse_expr"),
    ({"dataset": {"chain_sum": -1}}, "env.dataset: chain_sum: the weight must be a positive number, got -1"),
    ({"dataset": "leg_counting", "config": {"legs": 3}},
     "env.config: reasoning-gym leg_counting: LegCountingConfig.__init__() got an unexpected keyword argument 'legs'"),
    ({"dataset": "leg_counting", "config": {"min_animals": 0}}, "env.config: reasoning-gym leg_counting: min_animals must be positive"),
    ({"dataset": {"chain_sum": 1, "leg_counting": 1}, "config": {"min_terms": 3}},
     "env.config: reasoning-gym chain_sum/leg_counting: min_terms: a mix takes each dataset's config in env.dataset.<name>.config"),
    ({"dataset": "spell_backward", "config": {"data_file": "/etc/passwd"}},
     "env.config: reasoning-gym spell_backward: data_file: refused here, it names a file on the worker"),
    ({"dataset": "chain_sum", "config": {"data_path": "tasks.jsonl"}}, "env.config: data_path: a reasoning-gym environment draws its own tasks"),
    ({"dataset": "chain_sum", "config": {"size": 10**9}}, "env.config: size: a whole number between 1 and 1,000,000"),
    ({"dataset": "chain_sum", "config": {"game_kwargs": {"prompt": "x"}}}, "env.config: game_kwargs: the reasoning-gym game takes system_prompt and answer_tag (text) and few_shot"),
    ({"dataset": "chain_sum", "url": "http://127.0.0.1:8300"}, "env.source: names the environment itself: give it without env.game, env.url or env.link"),
    ({"dataset": "chain_sum", "game": "envs.math:MathGame"}, "env.source: names the environment itself"),
    ({"source": "textarenas", "dataset": "chain_sum"}, "env.source: Input should be 'reasoning_gym'"),
])
def test_a_spec_that_cannot_run_is_refused_in_one_line_naming_the_field(env, line):
    with pytest.raises(SpecError) as err:
        parse_spec({"model": {"name": "tiny-random"}, "env": {"source": "reasoning_gym", **env}})
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


def test_a_dataset_without_a_source_is_refused():
    with pytest.raises(SpecError, match=r"^env.dataset: give it with env.source"):
        parse_spec({"model": {"name": "tiny-random"}, "env": {"game": "envs.math:MathGame", "dataset": "chain_sum"}})


def test_the_worker_refuses_what_the_spec_refuses():
    """The adapter checks again where it runs: `env.game` given directly, or a task that travelled."""
    import numpy as np

    with pytest.raises(ValueError, match="refused here"):
        ReasoningGymGame.generate_task(np.random.default_rng(0), rg_dataset="binary_matrix")
    with pytest.raises(ValueError, match="data_file: refused"):
        ReasoningGymGame().reset(dataset="spell_backward", config={"data_file": "/etc/passwd", "size": 10}, index=0)


EVALUATES_ITS_OWN = {  # reviewed for 0.1.25: what these modules evaluate is what they generated
    "basic_arithmetic": "its generated expression", "bitwise_arithmetic": "its generated problem (from the entry it regenerates)",
    "number_sorting": "its own answer",
    "propositional_logic": "parse_expr is its own parser, no eval"}


def test_every_dataset_whose_verifier_evaluates_the_models_text_is_refused():
    """A guard for the pinned version and the next: the model's text is the tenant's, so a dataset
    whose score_answer runs eval() or sympy's parse_expr on it is refused. Every module that calls
    either is refused or reviewed (EVALUATES_ITS_OWN); a new one fails here until someone reads it."""
    calls = re.compile(r"(?<![\w.])(?:eval|parse_expr)\(|sympy\.parse_expr\(|sp\.parse_expr\(")
    evaluating, of_the_answer = set(), set()
    for name, (cls, _) in DATASETS.items():
        if calls.search(inspect.getsource(inspect.getmodule(cls))):
            evaluating.add(name)
        verifier = inspect.getsource(cls.score_answer) if "score_answer" in vars(cls) else ""
        if re.search(r"(?:eval|parse_expr)\(\s*answer\b", verifier):
            of_the_answer.add(name)
    refused = set(env_sources.REFUSED) - {"composite"}
    assert of_the_answer == refused
    assert evaluating - refused == set(EVALUATES_ITS_OWN)
    assert len(env_sources.registered()) == len(DATASETS) - len(env_sources.REFUSED) > 90


def test_the_environment_keys_are_game_environments_own():
    from opentinker.env import environment as environment_module

    assert env_sources.ENVIRONMENT_KEYS == environment_module._OWN_KEYS


def test_the_gateway_resolves_the_source_and_the_operators_allowlist_decides(tmp_path):
    """What a submission goes through (no stack needed): the job is not left waiting for fit(),
    and an allowlist without the adapter refuses it at once."""
    from opentinker.control.gateway.jobs import TenantJobs
    from opentinker.core.settings import Settings

    config = {"model": {"name": "tiny-random"}, "env": {"source": "reasoning_gym", "dataset": "chain_sum"}}
    spec, awaiting_env = TenantJobs(Settings(state_dir=tmp_path), "alice")._normalise(config, None)
    assert not awaiting_env and spec.env.game == "envs.reasoning_gym:ReasoningGymGame" and spec.env.config["rg_dataset"] == "chain_sum"
    with pytest.raises(SpecError, match=r"^env.game: 'envs.reasoning_gym' is not among the environments this service runs \(envs.math.\*\)"):
        TenantJobs(Settings(state_dir=tmp_path, game_allowlist="envs.math"), "alice")._normalise(config, None)


# --- prompts that cannot fit rollout.max_total_tokens ----------------------------------------------

HUGE = {"min_terms": 100_000, "max_terms": 100_000}  # chain_sum questions of 400,000 to 700,000 characters


def rg_spec(config, max_total_tokens=1024):
    return parse_spec({"model": {"name": "tiny-random"}, "rollout": {"max_total_tokens": max_total_tokens},
                       "env": {"source": "reasoning_gym", "dataset": "chain_sum", "config": config}, "seed": 5})


def test_a_prompt_without_room_for_an_answer_is_refused_with_its_tokens_counted_as_a_job_counts_them():
    """The check draws the job's first tasks from a small pool and counts their prompts with the
    model's tokenizer and chat template: the numbers are those of the prompts a job would play."""
    import numpy as np

    from opentinker.control.gateway.confine import _chat_format, prompts_fit
    from opentinker.env.messages import initial_messages

    config = {"min_terms": 60, "max_terms": 60, "max_digits": 1, "game_kwargs": {"few_shot": 1}}
    rng, counts = np.random.default_rng(5), []
    for _ in range(3):
        task = ReasoningGymGame.generate_task(rng, rg_dataset="chain_sum", size=8, **{k: v for k, v in config.items() if k != "game_kwargs"})
        game = ReasoningGymGame(few_shot=1)
        counts.append(len(_chat_format("tiny-random").prompt_ids(initial_messages(game, game.reset(**task)))))
    most = max(counts)
    with pytest.raises(SpecError) as refused:
        prompts_fit(rg_spec(config, most))
    shown = "|".join(f"{c:,}" for c in counts)
    assert re.fullmatch(rf"env\.config: a prompt of reasoning-gym chain_sum is ({shown}) tokens \([\d,]+ characters\) and "
                        rf"rollout\.max_total_tokens is {most:,}: no room is left for an answer; make its items smaller or "
                        r"rollout\.max_total_tokens larger", str(refused.value)), str(refused.value)
    prompts_fit(rg_spec(config, most + 1))  # room for one token of answer: accepted


def test_a_huge_question_is_refused_without_being_tokenized_whole(monkeypatch):
    from opentinker.agent.chat import ChatFormat
    from opentinker.control.gateway.confine import prompts_fit

    tokenized = []
    real = ChatFormat.prompt_ids
    monkeypatch.setattr(ChatFormat, "prompt_ids", lambda self, messages: tokenized.append(sum(len(m["content"]) for m in messages))
                        or real(self, messages))
    with pytest.raises(SpecError, match=r"^env\.config: a prompt of reasoning-gym chain_sum is at least [\d,]+ tokens "
                                        r"\([1-7]00,4\d\d characters\) and rollout\.max_total_tokens is 1,024: no room"):
        prompts_fit(rg_spec(HUGE))
    assert tokenized and max(tokenized) <= 1025 * 81  # (max_total_tokens + 1) x the longest token of SmolLM2's vocabulary


def test_drawing_is_bounded_in_time_and_memory(monkeypatch):
    """A config whose items never finish (a billion terms) or fill the memory is stopped, in one line."""
    from envs.reasoning_gym import prompts
    from opentinker.control.gateway.confine import prompts_fit

    monkeypatch.setattr(prompts, "DRAW_LIMIT_S", 3.0)
    started = time.monotonic()
    with pytest.raises(SpecError, match=r"^env\.config: reasoning-gym chain_sum: drawing 3 of its tasks took over 3 s: its items are too large to play$"):
        prompts_fit(rg_spec({"min_terms": 10**9, "max_terms": 10**9}))
    assert time.monotonic() - started < 60
    monkeypatch.setattr(prompts, "DRAW_LIMIT_S", 60.0)
    monkeypatch.setattr(prompts, "DRAW_MEMORY_BYTES", 300 * 1024**2)
    with pytest.raises(SpecError, match=r"^env\.config: reasoning-gym chain_sum: drawing its tasks failed: its items need more than 300 MiB of memory$"):
        prompts_fit(rg_spec({"min_terms": 10**6, "max_terms": 10**6}))


def test_the_gateway_answers_422_for_prompts_that_cannot_fit(tmp_path):
    """The real gateway app over HTTP (no Prefect behind it: the refusal comes before the scheduler)."""
    import httpx

    from opentinker.control.gateway.app import create_app
    from opentinker.control.gateway.tenants import TenantStore
    from opentinker.core.settings import Settings
    from opentinker.inference.server import serve_in_thread

    settings = Settings(state_dir=tmp_path / "state", host="127.0.0.1")
    key = TenantStore(settings.state_dir / "tenants.json").create("alice")
    server = serve_in_thread(create_app(settings), "127.0.0.1", 0)
    try:
        spec = {"model": {"name": "tiny-random"}, "env": {"source": "reasoning_gym", "dataset": "chain_sum", "config": HUGE}}
        response = httpx.post(f"{server.url}/v1/jobs", json={"config": spec}, headers={"Authorization": f"Bearer {key}"},
                              timeout=120, trust_env=False)
        assert response.status_code == 422, response.text
        detail = response.json()["detail"]
        assert detail.startswith("env.config: a prompt of reasoning-gym chain_sum is at least ") and "\n" not in detail
        assert detail.endswith("and rollout.max_total_tokens is 1,024: no room is left for an answer; make its items smaller or "
                               "rollout.max_total_tokens larger")
    finally:
        server.stop()


# --- episodes and jobs (the tiny model) -----------------------------------------------------------

class SlowReasoningGym(ReasoningGymGame):
    """The real adapter whose environment hangs at one task in eight (past any step timeout)."""

    def step(self, action):
        if self.index % 8 == 2:
            time.sleep(5)
        return super().step(action)

    def reset(self, dataset, config, index, **_):
        self.index = int(index)
        return super().reset(dataset, config, index)


class FlakyReasoningGym(SlowReasoningGym):
    """... and whose game raises at another one in eight (a task pointing past a precomputed pool)."""

    def reset(self, dataset, config, index, **_):
        if int(index) % 8 == 1:
            index = 10**9  # list_functions precomputes its pool: this entry does not exist
            dataset, config = "list_functions", {"size": 8}
        return super().reset(dataset, config, index)


def test_a_malformed_action_a_raising_game_and_a_hanging_one_cost_one_episode_each(tiny):
    from opentinker.agent import ChatFormat, EpisodeLimits, run_episodes
    from opentinker.backend import HFRolloutEngine, SamplingParams
    from opentinker.tracking.metrics import episode_stats

    model, tok = tiny
    good = environment("chain_sum").validation_tasks(1)[0]
    broken = {**good, "dataset": "list_functions", "config": {"size": 8}, "index": 10**9}
    games = [ReasoningGymGame(), ReasoningGymGame(), SlowReasoningGym(), ReasoningGymGame()]
    tasks = [good, broken, {**good, "index": 2}, good]
    trajs = run_episodes(HFRolloutEngine(model, tok), ChatFormat(tok), games, tasks, SamplingParams(max_new_tokens=4),
                         EpisodeLimits(max_turns=1, max_total_tokens=1024, step_timeout_s=0.5))
    assert [t.failed for t in trajs] == [False, True, True, False]
    assert trajs[1].failure.startswith("reset: IndexError") and "timed out" in trajs[2].failure
    assert trajs[0].reward == 0.0 and trajs[0].info["format_ok"] is False  # a random model's text: scored, not lost
    stats = episode_stats(trajs, "rollout")
    assert stats["rollout/failed_episodes"] == 2.0 and stats["rollout/episodes"] == 4.0


def test_an_rl_job_trains_on_a_reasoning_gym_dataset(tmp_path):
    from opentinker.rl import RLJob

    spec = tiny_spec(tmp_path, env={"game": None, "source": "reasoning_gym", "dataset": {"chain_sum": 1, "leg_counting": 1},
                                    "config": {"val_size": 8}}, optimization={"steps": 2}, evaluation={"every": 0, "n_samples": 8})
    seen = []
    result = RLJob(spec, job_id="rg-job").run(on_step=seen.append)
    assert result.steps_done == 2 and [r.step for r in seen] == [1, 2]
    for report in seen:
        m = report.metrics
        assert m["rollout/episodes"] == 16 and m["rollout/failed_episodes"] == 0
        assert 0.0 <= m["rollout/reward_mean"] <= 1.0 and "rollout/format_ok" in m and "rollout/accuracy" in m
    assert result.evaluations and all(e.metrics["eval/episodes"] == 8 and "eval/format_ok" in e.metrics for e in result.evaluations)


def test_the_job_lives_on_when_episodes_fail(tmp_path, monkeypatch):
    from opentinker.rl import RLJob

    monkeypatch.setenv("OPENTINKER_GAME_ALLOWLIST", "envs,tests.test_reasoning_gym")
    spec = tiny_spec(tmp_path, env={"game": "tests.test_reasoning_gym:FlakyReasoningGym", "config": {"rg_dataset": "chain_sum", "val_size": 8}},
                     optimization={"steps": 2}, rollout={"prompts_per_step": 8, "group_size": 2, "step_timeout_s": 0.5},
                     evaluation={"every": 0, "n_samples": 8})
    seen = []
    result = RLJob(spec, job_id="rg-flaky").run(on_step=seen.append)
    assert result.steps_done == 2 and result.not_registrable is None
    failed = sum(r.metrics["rollout/failed_episodes"] for r in seen)
    assert 0 < failed < 32 and all(r.metrics["rollout/episodes"] == 16 for r in seen)


def test_few_shot_shows_the_pools_own_items_answered_in_the_tag():
    """few_shot exchanges come before the question: the pool's last items with their answers in the
    answer tag, which the game's own scoring then accepts; out of range is refused in one line."""
    import numpy as np

    task = ReasoningGymGame.generate_task(np.random.default_rng(0), rg_dataset="chain_sum", size=50)
    game = ReasoningGymGame(few_shot=2, answer_tag="final")
    assert game.get_example_turns() == []  # no pool before reset
    game.reset(**task)
    turns = game.get_example_turns()
    pool = game.pool
    assert [t["role"] for t in turns] == ["user", "assistant", "user", "assistant"]
    assert turns[0]["content"] == pool[49]["question"] and turns[1]["content"] == f"<final>{pool[49]['answer']}</final>"
    assert turns[2]["content"] == pool[48]["question"]
    assert pool.score_answer(pool[49]["answer"], pool[49]) == 1.0
    with pytest.raises(ValueError, match=r"few_shot: 0 to 8"):
        ReasoningGymGame(few_shot=9)
    spec_for("chain_sum", {"game_kwargs": {"few_shot": 2}})  # accepted before submission
    with pytest.raises(Exception, match=r"few_shot \(0 to 8\)"):
        spec_for("chain_sum", {"game_kwargs": {"few_shot": "2"}})
