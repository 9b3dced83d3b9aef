"""The chat template with assistant masks: TRL trains on the tokens inside `{% generation %}`
markers (each assistant reply and its end-of-turn token, the tokens the RL loop trains)."""

from __future__ import annotations

from opentinker.core.spec import SpecError

# -- chat template with assistant masks ---------------------------------------------------------
# SmolLM2's (ChatML) message expression, and the same text with the assistant reply and its
# end-of-turn token inside {% generation %} markers: the tokens TRL's assistant mask keeps.
_CHATML_MESSAGE = "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
_CHATML_MARKED = (
    "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}" + _CHATML_MESSAGE + "{% endif %}"
)


def training_chat_template(tokenizer) -> str:
    """The tokenizer's chat template with `{% generation %}` markers (see the module docstring)."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template["default"]
    if not template:
        raise SpecError("training.assistant_only_loss: the model has no chat template; set it to false")
    if has_generation_markers(template):
        return template
    try:
        patched = get_training_chat_template(tokenizer)
    except ValueError:
        patched = template.replace(_CHATML_MESSAGE, _CHATML_MARKED) if _CHATML_MESSAGE in template else None
    if not patched:
        raise SpecError("training.assistant_only_loss: this model's chat template cannot mark assistant replies; "
                        "set training.assistant_only_loss: false to train on whole conversations")
    return patched



