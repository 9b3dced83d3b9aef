"""Vision-language policies: images in observations, the record and the trainer's recompute.

The VLM is `tiny-vlm-random` (the tiny random language model under a small random vision
encoder, Idefics3 layout) except where SmolLM2's real language weights are the point."""

from __future__ import annotations

import pytest
import torch

from opentinker.agent import EpisodeLimits, chat_format, run_episodes
from opentinker.backend import HFRolloutEngine, PolicyTrainer, SamplingParams
from opentinker.core.spec import AlgorithmSpec, FullSpec, LoraSpec, OptimizationSpec
from tests.games import HugeImageGame, NotAnImageGame, PictureGame
from tests.rounding import pass_gap, same_logprobs

# tiny-vlm-random: 2 text and 2 vision layers, plus the patch embedding and the connector (one
# more), whose reductions run over up to 768 terms (a 16x16x3 patch, a 2x2 shuffle of width 192)
VLM_PASS = pass_gap(layers=5, width=768)

LIMITS = EpisodeLimits(max_turns=3, max_total_tokens=400)
TASKS = [{"colour": c, "words": w} for c, w in [("red", 1), ("green", 4), ("blue", 2), ("yellow", 7)]]


@pytest.fixture
def vlm():
    """A fresh tiny VLM (trainers wrap the model they are given)."""
    from opentinker.model import load_model

    return load_model("tiny-vlm-random")


def _play(trainer, tok, game=PictureGame, tasks=TASKS, **params):
    engine = HFRolloutEngine(trainer.model, tok)
    trajs = run_episodes(engine, chat_format(tok), [game() for _ in tasks], tasks, SamplingParams(max_new_tokens=5, **params), LIMITS,
                         [i // 2 for i in range(len(tasks))])
    return trajs, engine


def _differ_within_groups(trajs) -> None:
    """Rewards 1, 0 in each group of two, so the update has advantages to follow."""
    for i, t in enumerate(trajs):
        t.turns[-1].reward = float(i % 2 == 0)


def _recomputed_match(trainer, trajs) -> bool:
    """The trainer's recomputed logprobs are the sampled ones: decoding's cache against one pass,
    the same sums in other orders (tests/rounding.py)."""
    recomputed = trainer.logprobs(trajs)
    sampled = [[lp for lp, m in zip(t.sampling_logprobs, t.loss_mask) if m] for t in trajs]
    return same_logprobs([x for s in sampled for x in s], [x for r in recomputed for x in r], rel=VLM_PASS)


def test_image_tokens_enter_the_record_once_with_their_pixels(vlm):
    """The prompt's record is the processor's expansion of the rendered conversation; a later
    turn's images enter as a delta at its position; image tokens are never trained on."""
    model, tok = vlm
    trainer = PolicyTrainer(model, tok, LoraSpec(r=8, alpha=16), AlgorithmSpec(), OptimizationSpec())
    trajs, _ = _play(trainer, tok)
    processor, image_id = tok.processor, model.config.image_token_id
    for t in trajs:
        assert not t.failed and t.stop_reason == "done"
        assert [len(v.images) for v in t.images] == [1, 2] and [tuple(v.pixel_values.shape) for v in t.images] == [(1, 3, 128, 128), (2, 3, 128, 128)]
        first = t.messages[:1]
        text = processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": first[0]["content"][1]["text"]}]}],
                                             tokenize=False, add_generation_prompt=True)
        expected = processor(text=[text], images=[[first[0]["content"][0]["image"]]], add_special_tokens=False)["input_ids"][0]
        assert t.prompt_ids == list(expected)
        image_positions = [i for i, token in enumerate(t.token_ids) if token == image_id]
        assert len(image_positions) == 3 * processor.image_seq_len
        assert all(t.loss_mask[i] == 0 for i in image_positions)
        assert t.images[1].at > t.images[0].at and t.token_ids[t.images[1].at:].count(image_id) == 2 * processor.image_seq_len


def test_recomputed_logprobs_match_sampling_with_images_in_the_prompt_and_a_later_turn(vlm):
    model, tok = vlm
    trainer = PolicyTrainer(model, tok, LoraSpec(r=8, alpha=16), AlgorithmSpec(), OptimizationSpec())
    trajs, engine = _play(trainer, tok)
    assert len({len(t) for t in trajs}) > 1  # left padding in the batch
    assert _recomputed_match(trainer, trajs)
    assert engine.prefix_cache.hit_tokens == 0 and len(engine.prefix_cache) == 0  # records with images prefill whole
    _differ_within_groups(trajs)
    metrics = trainer.update(trajs)
    assert metrics["update/grad_norm"] > 0
    trajs, _ = _play(trainer, tok)  # after an update, with new weights
    assert _recomputed_match(trainer, trajs)


def test_lora_goes_on_the_language_model_and_the_vision_tower_is_frozen_or_trained_by_spec(vlm):
    model, tok = vlm
    frozen = PolicyTrainer(model, tok, LoraSpec(r=8, alpha=16), AlgorithmSpec(), OptimizationSpec())
    named = dict(frozen.model.named_parameters())
    assert not [n for n in named if "lora_" in n and "text_model" not in n]
    assert [n for n in named if "lora_" in n and "text_model" in n]
    assert not any(p.requires_grad for n, p in named.items() if "vision_model" in n or "connector" in n)

    from opentinker.model import load_model

    base, tok = load_model("tiny-vlm-random", "bfloat16")
    trained = PolicyTrainer(base, tok, LoraSpec(r=8, alpha=16, vision_tower="trainable"), AlgorithmSpec(), OptimizationSpec())
    vision = [p for n, p in trained.model.named_parameters() if "vision_model" in n or "connector" in n]
    assert vision and all(p.requires_grad and p.dtype == torch.float32 for p in vision)
    before = [p.detach().clone() for p in vision]
    trajs, _ = _play(trained, tok)
    _differ_within_groups(trajs)
    trained.update(trajs)
    assert any(not torch.equal(a, b) for a, b in zip(before, vision))  # the vision tower moved

    full = PolicyTrainer(load_model("tiny-vlm-random")[0], tok, FullSpec(vision_tower="frozen"), AlgorithmSpec(), OptimizationSpec())
    assert not any(p.requires_grad for n, p in full.model.named_parameters() if "vision_model" in n)

    # the connector alone (LLaVA-style): the projection into the language model trains, the encoder not
    projector = PolicyTrainer(load_model("tiny-vlm-random")[0], tok, LoraSpec(r=8, alpha=16, vision_tower="connector"),
                              AlgorithmSpec(), OptimizationSpec())
    named = dict(projector.model.named_parameters())
    assert [n for n in named if "connector" in n] and all(p.requires_grad for n, p in named.items() if "connector" in n)
    assert not any(p.requires_grad for n, p in named.items() if "vision_model" in n)
    assert {n for n in projector.trainable_state() if "connector" in n}  # and it travels in checkpoints
    assert len(projector.optimizer.param_groups) == 1  # one learning rate unless the spec gives the vision side its own

    # the vision side at its own learning rate: the connector in a group of its own, the LoRA at optimization.lr
    own = PolicyTrainer(load_model("tiny-vlm-random")[0], tok, LoraSpec(r=8, alpha=16, vision_tower="connector", vision_lr=3e-3),
                        AlgorithmSpec(), OptimizationSpec(lr=1e-4))
    names = {id(p): n for n, p in own.model.named_parameters()}
    by_lr = {g["lr"]: {names[id(p)] for p in g["params"]} for g in own.optimizer.param_groups}
    assert set(by_lr) == {1e-4, 3e-3}
    assert by_lr[3e-3] and all("connector" in n for n in by_lr[3e-3])
    assert by_lr[1e-4] and all("lora_" in n for n in by_lr[1e-4])
    assert sum(len(g["params"]) for g in own.optimizer.param_groups) == len(own.params)


def test_smolvlm_keeps_smollm2s_language_weights():
    from opentinker.model import load_model

    vlm, vlm_tok = load_model("smolvlm-135m-tiny-vision")
    lm, lm_tok = load_model("smollm2-135m-instruct")
    text = vlm.model.text_model.state_dict()
    for name, tensor in lm.model.state_dict().items():
        if name == "embed_tokens.weight":  # the image tokens were added at the end
            assert torch.equal(text[name][: tensor.shape[0]], tensor) and text[name].shape[0] == tensor.shape[0] + 3
        else:
            assert torch.equal(text[name], tensor), name
    assert vlm_tok("What is 2 + 3?")["input_ids"] == lm_tok("What is 2 + 3?")["input_ids"]
    assert vlm.lm_head.weight.data_ptr() == vlm.model.text_model.embed_tokens.weight.data_ptr()


@pytest.mark.parametrize("game,reason", [
    (NotAnImageGame, "step: observation.images[0] is str, expected a PIL image"),
    (HugeImageGame, "step: observation.images[0] is 5000x5000 pixels"),
])
def test_bad_images_cost_the_episode_with_a_clear_reason(vlm, game, reason):
    model, tok = vlm
    trainer = PolicyTrainer(model, tok, LoraSpec(r=8, alpha=16), AlgorithmSpec(), OptimizationSpec())
    trajs, _ = _play(trainer, tok, game=game)
    assert all(t.failed and t.failure.startswith(reason) for t in trajs), [t.failure for t in trajs]


def test_a_language_model_given_images_fails_the_episode_not_the_job(tiny):
    model, tok = tiny
    trainer = PolicyTrainer(model, tok, LoraSpec(r=8, alpha=16), AlgorithmSpec(), OptimizationSpec())
    trajs, _ = _play(trainer, tok)
    assert all(t.failed and "takes no images" in t.failure for t in trajs)


def test_images_travel_over_env_serve_and_a_corrupt_payload_costs_the_episode(vlm):
    """A served PictureGame plays like the imported one (same records, same pixels); a server
    that answers with a corrupt or oversized image payload fails that episode with the reason."""
    from fastapi import FastAPI

    from opentinker.env.remote import RemoteGameClass
    from opentinker.env.server import create_app
    from opentinker.inference.server import serve_in_thread

    model, tok = vlm
    trainer = PolicyTrainer(model, tok, LoraSpec(r=8, alpha=16), AlgorithmSpec(), OptimizationSpec())
    served = serve_in_thread(create_app(PictureGame), "127.0.0.1")
    try:
        remote = RemoteGameClass(served.url)
        local, _ = _play(trainer, tok, greedy=True)
        over_http, _ = _play(trainer, tok, game=remote, greedy=True)
        assert [t.token_ids for t in over_http] == [t.token_ids for t in local]
        for a, b in zip(over_http, local):
            assert all(torch.equal(x.pixel_values, y.pixel_values) for x, y in zip(a.images, b.images))
    finally:
        served.stop()

    hostile = FastAPI()

    @hostile.post("/sessions")
    def new() -> dict:
        return {"session_id": "s", "system_prompt": "", "initial_user_message": "", "example_turns": []}

    @hostile.post("/sessions/s/reset")
    def reset(body: dict) -> dict:
        colour = body["task"]["colour"]
        image = {"mime": "image/png", "data": "bm90IGFuIGltYWdl"} if colour == "red" else {"mime": "image/png", "data": "A" * 12_000_000}
        return {"observation": {"text": "look", "images": [image]}, "system_prompt": "", "initial_user_message": "", "example_turns": []}

    @hostile.delete("/sessions/s")
    def close() -> dict:
        return {}

    server = serve_in_thread(hostile, "127.0.0.1")
    try:
        trajs, _ = _play(trainer, tok, game=RemoteGameClass(server.url), tasks=TASKS[:2])
        assert trajs[0].failed and "not a readable image" in trajs[0].failure
        assert trajs[1].failed and "over the limit" in trajs[1].failure
    finally:
        server.stop()
