"""``model.generate(..., custom_generate=spec_plugins.integrations.transformers.CUSTOM_GENERATE,
trust_remote_code=True)``: transformers hands a custom generate directory every argument of
``generate()``; this passes ``streamer``, ``assistant_model`` and ``tokenizer`` on to the
speculative loop under the names a callable ``custom_generate`` receives (``spec_streamer``,
``draft_model``, ``spec_tokenizer``), and heals the prompts first where ``token_healing`` asks
(the callable's heal step would lack the tokenizer: ``hf_guards.heal_prompts``)."""

from spec_plugins.integrations.hf_guards import heal_prompts
from spec_plugins.integrations.transformers import speculative_generate


def generate(model, streamer=None, assistant_model=None, tokenizer=None, **kwargs):
    kwargs = heal_prompts(model, tokenizer, kwargs)
    return model.generate(custom_generate=speculative_generate, spec_streamer=streamer, draft_model=assistant_model,
                          spec_tokenizer=tokenizer, **kwargs)
