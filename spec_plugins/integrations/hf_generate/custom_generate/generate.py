"""``model.generate(..., custom_generate=spec_plugins.integrations.transformers.CUSTOM_GENERATE,
trust_remote_code=True)``: transformers hands a custom generate directory every argument of
``generate()``; this passes ``streamer``, ``assistant_model`` and ``tokenizer`` on to the
speculative loop under the names a callable ``custom_generate`` receives (``spec_streamer``,
``draft_model``, ``spec_tokenizer``), and heals the prompts first where ``token_healing`` asks
(the callable's heal step would lack the tokenizer: ``hf_guards.heal_prompts``).
``cache_implementation="paged"`` is refused: passed on, it makes ``generate()`` switch to
continuous batching before it looks at ``custom_generate``, so nothing would be speculative."""

from spec_plugins.integrations.hf_guards import heal_prompts
from spec_plugins.integrations.transformers import speculative_generate


def generate(model, streamer=None, assistant_model=None, tokenizer=None, **kwargs):
    if kwargs.get("cache_implementation") == "paged":
        if streamer is not None:  # a thread reading it stops, as after every refusal
            streamer.end()
        raise ValueError("speculative_generate does not support cache_implementation='paged': transformers then "
                         "decodes with continuous batching (generate_batch) and never runs the speculative loop; "
                         "drop cache_implementation (the plugin keeps its own KV cache)")
    kwargs = heal_prompts(model, tokenizer, kwargs)
    return model.generate(custom_generate=speculative_generate, spec_streamer=streamer, draft_model=assistant_model,
                          spec_tokenizer=tokenizer, **kwargs)
