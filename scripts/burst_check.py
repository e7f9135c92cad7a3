"""One request never hurts another, on a real server: a concurrent burst of normal requests and
requests with an extreme sampling value, then one more request.

    python scripts/burst_check.py --config examples/configs/smollm2-server.yaml

Starts ``spec-plugins serve`` on a free loopback port, computes each prompt's solo greedy output
in-process, sends N normal greedy requests and N with ``temperature: 1e-40`` (an underflowing
temperature is greedy) and N with ``repetition_penalty: 1e-40`` (refused: 422) all at once, and
reports every status and whether each answer equals its solo output; then one normal request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spec_plugins.server.loadtest import PROMPTS, _start, _wait_healthy  # noqa: E402


async def _burst(url: str, bodies: list[dict]) -> list[tuple[int, dict]]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as c:
        res = await asyncio.gather(*(c.post(url + "/generate", json=b) for b in bodies))
    return [(r.status_code, r.json()) for r in res]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/smollm2-server.yaml")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--logs", default="/tmp")
    a = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    proc, url = _start(a.config, ["--max-batch", "16"], Path(a.logs) / "spec-burst.log")
    try:
        _wait_healthy(url, proc)
        from spec_plugins.config import SpecConfig
        from spec_plugins.decoder import SpeculativeDecoder

        dec = SpeculativeDecoder.from_config(SpecConfig.from_file(a.config)).without_speculation()
        tok = dec.tokenizer
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                 for p in PROMPTS]
        refs = [dec.generate(list(tok(t)["input_ids"]), max_new_tokens=a.max_new_tokens).token_ids for t in texts]
        params = {"max_new_tokens": a.max_new_tokens, "details": True}
        kinds = {"normal": {}, "temperature 1e-40": {"do_sample": True, "temperature": 1e-40},
                 "repetition_penalty 1e-40": {"repetition_penalty": 1e-40}}
        bodies, labels = [], []
        for i in range(a.n):
            for kind, extra in kinds.items():
                bodies.append({"inputs": texts[i % len(texts)], "parameters": {**params, **extra}})
                labels.append((kind, i % len(texts)))
        res = asyncio.run(_burst(url, bodies))
        report: dict = {k: {"statuses": {}, "identical_to_solo": 0} for k in kinds}
        for (kind, p), (status, body) in zip(labels, res):
            r = report[kind]
            r["statuses"][str(status)] = r["statuses"].get(str(status), 0) + 1
            if status == 200 and [t["id"] for t in body["details"]["tokens"]] == refs[p]:
                r["identical_to_solo"] += 1
            elif status != 200:
                r.setdefault("error", body.get("error"))
        after = asyncio.run(_burst(url, [{"inputs": texts[0], "parameters": params}]))[0]
        report["next_request"] = {"status": after[0],
                                  "identical_to_solo": [t["id"] for t in after[1]["details"]["tokens"]] == refs[0]}
        print(json.dumps({"config": a.config, "burst": len(bodies), **report}, indent=1))
        return 0
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    raise SystemExit(main())
