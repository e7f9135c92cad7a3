"""Generate with n-gram speculation and compare against plain decoding on the same runtime."""

from spec_plugins import SpecConfig, SpeculativeDecoder

decoder = SpeculativeDecoder.from_config(SpecConfig.from_file("examples/configs/smollm2-ngram.yaml"))
messages = [{"role": "user", "content": "Rewrite this list in upper case: apple, banana, cherry, apple, banana."}]

spec = decoder.generate(messages, max_new_tokens=96)
plain = decoder.without_speculation().generate(messages, max_new_tokens=96)

print(spec.text)
print("identical to plain greedy:", spec.token_ids == plain.token_ids)
s = spec.stats
print(f"mean accepted tokens/forward {s.mean_accepted_tokens:.2f}, acceptance {s.acceptance_rate:.1%}, "
      f"by position {[round(a, 2) for a in s.acceptance_by_position]}")
print(f"speculative {s.tokens_per_second:.1f} tok/s vs plain {plain.stats.tokens_per_second:.1f} tok/s")
