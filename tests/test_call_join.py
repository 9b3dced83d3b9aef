"""Calls joined into token-exact records (opentinker.agent.call_join), against hand-computed records,
and on the real SmolLM2 chat template: one that renders the answer back as it was sampled joins, one
whose re-rendering drops a separator inside the answer (the </think> separator, as in verl #6501) is
caught as drift and never trains tokens nobody sampled."""

from __future__ import annotations

import hashlib

import pytest

from opentinker.agent.call_join import RecordedCall, join_calls


def call(prompt, sampled, logprobs, version=0, template="t"):
    return RecordedCall(prompt_ids=prompt, sampled_ids=sampled, logprobs=logprobs, policy_version=version, template_hash=template)


def test_a_call_that_extends_the_record_joins_it_its_new_context_masked():
    joined = join_calls([call([1, 2, 3], [4, 5], [-0.1, -0.2], version=0),
                         call([1, 2, 3, 4, 5, 6, 7], [8], [-0.3], version=1)])
    assert joined.drifted == 0 and len(joined.records) == 1
    record = joined.records[0]
    assert record.prompt_ids == [1, 2, 3]
    assert record.token_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert record.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert record.sampling_logprobs == [0.0, 0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3]
    assert record.token_versions == [-1, -1, -1, 0, 0, -1, -1, 1]
    assert record.policy_version == 0  # the oldest version that drew a token of it
    assert [(t.sampled_start, t.sampled_end) for t in record.turns] == [(3, 5), (7, 8)]


def test_a_prompt_that_changes_a_sampled_token_is_drift_and_a_record_of_its_own():
    joined = join_calls([call([1, 2, 3], [4, 5], [-0.1, -0.2]),
                         call([1, 2, 3, 4, 9, 6], [8], [-0.3], version=1)])
    assert joined.drifted == 1 and len(joined.records) == 2
    assert "position 4" in joined.drift[0] and "sampled 5, the prompt has 9" in joined.drift[0]
    first, second = joined.records
    assert first.token_ids == [1, 2, 3, 4, 5] and first.loss_mask == [0, 0, 0, 1, 1]
    assert second.token_ids == [1, 2, 3, 4, 9, 6, 8]
    assert second.loss_mask == [0, 0, 0, 0, 0, 0, 1]  # only what this call sampled is trained
    assert second.sampling_logprobs[-1] == -0.3 and second.policy_version == 1
    for record in joined.records:  # every trained token is a sampled one, with its sampling logprob
        assert [lp for lp, m in zip(record.sampling_logprobs, record.loss_mask) if m] in ([-0.1, -0.2], [-0.3])


def test_a_retry_a_new_conversation_or_an_earlier_rewrite_is_its_own_record_without_drift():
    joined = join_calls([call([1, 2, 3], [4, 5], [-0.1, -0.2]),
                         call([1, 2, 3], [6], [-0.4]),  # the same prompt again: a retry
                         call([7, 7], [8], [-0.5]),  # another conversation
                         call([1, 2, 9, 4, 5], [6], [-0.6])])  # a history rewritten before the answer (context, not sampled)
    assert joined.drifted == 0 and len(joined.records) == 4
    assert [r.num_sampled for r in joined.records] == [2, 1, 1, 1]


def test_a_call_joins_the_branch_it_extends_and_templates_never_mix():
    joined = join_calls([call([1, 2, 3], [4, 5], [-0.1, -0.2]),
                         call([1, 2, 3], [6], [-0.4]),
                         call([1, 2, 3, 4, 5, 10], [11], [-0.7]),  # extends the first branch
                         call([1, 2, 3, 6, 10], [12], [-0.8]),  # extends the second
                         call([1, 2, 3, 4, 5, 10, 11], [13], [-0.9], template="other")])  # another template: no join
    assert joined.drifted == 0 and len(joined.records) == 3
    assert joined.records[0].token_ids == [1, 2, 3, 4, 5, 10, 11]
    assert joined.records[1].token_ids == [1, 2, 3, 6, 10, 12]
    assert joined.records[2].loss_mask == [0] * 7 + [1]


def test_a_call_without_a_logprob_for_each_token_is_refused():
    with pytest.raises(ValueError, match="call 0: 2 sampled token"):
        join_calls([call([1], [2, 3], [-0.1])])


@pytest.fixture(scope="module")
def tokenizer(tiny_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_path)


def _episode(tokenizer, template: str) -> list[RecordedCall]:
    """Two calls as an endpoint with `template` answers them: the harness sends the conversation
    again with the first answer's text, as every OpenAI-compatible harness does."""
    hashed = hashlib.sha256(template.encode()).hexdigest()
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def prompt(messages):
        return tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=False)

    messages = [{"role": "user", "content": "What is 2+3?"}]
    answer = "<think>\nadd them\n</think>\n\n5"
    first = tokenizer.encode(prompt(messages), add_special_tokens=False)
    sampled = tokenizer.encode(answer, add_special_tokens=False) + [end]  # as the engine drew it, its stop token included
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Sure?"}]
    second = tokenizer.encode(prompt(messages), add_special_tokens=False)
    return [RecordedCall(first, sampled, [-0.5] * len(sampled), 0, hashed, answer),
            RecordedCall(second, sampled, [-0.25] * len(sampled), 1, hashed, answer)]


def test_the_real_template_joins_and_one_that_drops_a_separator_is_caught(tokenizer):
    faithful = tokenizer.chat_template
    joined = join_calls(_episode(tokenizer, faithful))
    assert joined.drifted == 0 and len(joined.records) == 1
    assert len(joined.records[0].turns) == 2

    dropping = faithful.replace("message['content']", "(message['content'] | replace('</think>\\n\\n', '</think>'))")
    assert dropping != faithful
    joined = join_calls(_episode(tokenizer, dropping))
    assert joined.drifted == 1 and len(joined.records) == 2
    for record in joined.records:  # what is trained is exactly one call's sampled tokens, each record its own
        trained = [t for t, m in zip(record.token_ids, record.loss_mask) if m]
        assert trained == joined.records[0].token_ids[len(joined.records[0].prompt_ids):]
