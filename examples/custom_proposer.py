"""A complete custom proposer, registered by name and used through ``model.generate()``.

``BigramProposer`` drafts by following, from the pending token, the latest successor each token had
earlier in the row (prompt + output): prompt lookup with one token of context. Drafts are point
masses (no probabilities), so the exact verifier keeps the output law the target's.
Run: ``HF_HUB_OFFLINE=1 python examples/custom_proposer.py``
"""

from typing import Literal

from spec_plugins import register_proposer
from spec_plugins.config import ProposerConfig
from spec_plugins.proposers import Draft, ProposeContext, Proposer


@register_proposer("bigram")
class BigramProposer(Proposer):
    class Config(ProposerConfig):  # the proposer's config section: {type: bigram, num_draft_tokens: 4}
        type: Literal["bigram"] = "bigram"

    def __init__(self, config: "BigramProposer.Config", **_: object) -> None:
        self.config = config

    def propose(self, ctx: ProposeContext) -> Draft | None:
        chains = []
        for seq, budget in zip(ctx.sequences, ctx.budgets):  # one row each; budget = max draft length
            successor = dict(zip(seq, seq[1:]))  # latest successor of every token (O(row) per round)
            chain, t = [], seq[-1]
            while len(chain) < budget and t in successor:
                t = successor[t]
                chain.append(t)
            chains.append(chain)
        return Draft.from_chains(chains)  # rows may draft different lengths (or nothing)


if __name__ == "__main__":
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spec_plugins.integrations.transformers import speculative_generate
    from spec_plugins.models import resolve_model

    src = resolve_model("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(src.directory, gguf_file=src.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src.directory, gguf_file=src.gguf_file)
    msgs = [{"role": "user", "content": "Repeat three times: red, green, blue, yellow."}]
    inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**inputs, custom_generate=speculative_generate, max_new_tokens=64,
                         spec_config={"proposer": {"type": "bigram", "num_draft_tokens": 4}})
    plain = model.generate(**inputs, max_new_tokens=64)
    print(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    print("identical to plain greedy generate():", bool((out == plain).all()) and out.shape == plain.shape)
