"""Train the EAGLE-3-style drafter (and Medusa heads) on a lent GPU: the steps of
``scripts/train_heads_gpu.sh``, which says in which order and where each one runs.

- ``stage`` (here): tokenise ShareGPT with the target's tokenizer and chat template into token
  shards (``spec_plugins.training.tokens``), bundle them with the target's weights and the wheels
  the device image lacks into one ``.tar.xz``, check its sha256, and split it into parts that fit
  one device call each beside the work tree (``--call-mib``), one folder per call:
  ``gpu-stage/callK/`` (git-ignored by the ``.gitignore`` written there). Writes ``CALLS.md``.
- ``receive`` (device, every call): copy this call's part out of the work tree (a carried path
  is gone in the next call, the home folder stays while the machine is warm), check its sha256.
- ``unpack`` (device, last call): join the parts, check the bundle's sha256, extract it.
- ``device`` (device, last call): ``spec_plugins.training.device_run``: features in big prefills,
  the heads trained by the project's trainer, snapshots into ``--out``.

``receive`` and ``unpack`` use the standard library alone: they run before anything is installed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20
# what the device image lacks for the device step (its python 3.12 has torch, transformers, numpy, yaml, tqdm)
WHEELS = ("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions", "gguf")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def fail(msg: str) -> NoReturn:
    sys.exit(f"train_heads_gpu: {msg}")


# ---------------------------------------------------------------------------------------------- stage
def tree_bytes() -> int:
    """What travels with every call: tracked and untracked-not-ignored files of the work tree."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, check=True).stdout.decode()
    return sum((ROOT / p).stat().st_size for p in set(out.split("\0")) if p and (ROOT / p).is_file())


def stage_tokens(args: argparse.Namespace, build: Path) -> dict:
    """Token shards of the train and held-out splits (reused when made with the same settings)."""
    from spec_plugins.models import load_gguf_tokenizer
    from spec_plugins.training.sharegpt import DataFilter, FilterCounts, dataset_file
    from spec_plugins.training.sources import sharegpt_examples
    from spec_plugins.training.tokens import TokenStore, write_token_shards

    dataset_file()  # fails with the install hint when the [train] extra is missing
    tok = None
    summary = {}
    for split, budget, max_seq in (("train", args.max_tokens, args.max_seq),
                                   ("heldout", args.heldout_tokens, args.heldout_max_seq)):
        meta = {"source": "sharegpt", "split": split, "tokenizer": args.target, "max_seq": max_seq,
                "language": args.language, "heldout_share": args.heldout_share, "max_tokens": budget,
                "shard_tokens": args.shard_tokens}
        out = build / "tokens" / split
        try:
            if TokenStore(out).meta == meta:
                summary[split] = TokenStore(out).state
                print(f"stage: {split} tokens reused from {out}")
                continue
        except (FileNotFoundError, ValueError):
            pass
        tok = tok or load_gguf_tokenizer(args.target)
        counts = FilterCounts()
        t0 = time.time()
        examples = sharegpt_examples(tok, split, max_seq, DataFilter(language=args.language), args.heldout_share, counts)
        try:
            st = write_token_shards(examples, out, meta, len(tok), budget, args.shard_tokens)
        except ValueError as exc:  # no conversation kept, or an id past the vocabulary
            fail(f"stage: {split}: {exc}")
        st["filter_counts"], st["seconds"] = counts.as_dict(), round(time.time() - t0, 1)
        (out / "meta.json").write_text(json.dumps(st, indent=1) + "\n")
        summary[split] = st
        print(f"stage: {split}: {st['tokens']:,} tokens, {st['conversations']:,} conversations, "
              f"{len(st['shards'])} shards in {st['seconds']} s")
    return {k: {n: v[n] for n in ("tokens", "trained_tokens", "conversations", "dtype", "exhausted")}
            | {"shards": len(v["shards"]), "meta": v["meta"]} for k, v in summary.items()}


def smoke_model(build: Path, vocab: int) -> dict:
    """A tiny random llama with the tokenizer's vocabulary, as a transformers directory: the CPU
    smoke run exercises every step but the GGUF's size."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    d = build / "model-smoke"
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(d))
    return {"name": "tiny-random-llama", "format": "transformers", "path": "model", "source": d}


def stage_wheels(args: argparse.Namespace, build: Path) -> list[Path]:
    """cp312 manylinux wheels of what the device image lacks (``--wheels DIR``: take them from DIR)."""
    if args.wheels:
        src = Path(args.wheels)
    else:
        src = build / "wheels-download"
        shutil.rmtree(src, ignore_errors=True)
        script = Path(__file__).with_name("gpu_wheels.sh")  # the one place that knows the image's wheels
        subprocess.run(["bash", str(script)], check=True, env={**os.environ, "WHEELS_DIR": str(src.resolve())})
    wheels = sorted(w for w in src.glob("*.whl") if w.name.split("-")[0].lower() in WHEELS)
    found = {w.name.split("-")[0].lower() for w in wheels}
    if found != set(WHEELS):
        fail(f"wheels in {src} lack {sorted(set(WHEELS) - found)}")
    return wheels


def stage(args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out).resolve()
    build = out / "build"
    build.mkdir(parents=True, exist_ok=True)
    (out / ".gitignore").write_text("*\n")  # nothing staged here is committed or travels uncarried
    tokens = stage_tokens(args, build)
    if args.smoke:
        from spec_plugins.models import load_gguf_tokenizer

        model = smoke_model(build, len(load_gguf_tokenizer(args.target)))
        files = [(p, f"model/{p.name}") for p in sorted(model.pop("source").iterdir())]
        wheels = []
    else:
        from spec_plugins.models import resolve_model

        gguf = resolve_model(args.target).gguf_path
        if gguf is None:
            fail(f"{args.target} is not a GGUF; the device step loads the target from one file")
        model = {"name": args.target, "format": "gguf", "path": f"model/{gguf.name}", "sha256": sha256(gguf),
                 "bytes": gguf.stat().st_size}
        files = [(gguf, model["path"])]
        wheels = stage_wheels(args, build)
    files += [(w, f"wheels/{w.name}") for w in wheels]
    files += [(p, f"tokens/{p.parent.name}/{p.name}") for p in sorted((build / "tokens").glob("*/*")) if p.is_file()]
    manifest = {"format": "spec-plugins-gpu-bundle/1", "created": time.strftime("%Y-%m-%d %H:%M:%S"),
                "model": model, "tokens": tokens, "wheels": [w.name for w in wheels], "smoke": args.smoke}
    (build / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    files.insert(0, (build / "manifest.json", "manifest.json"))
    bundle = build / "bundle.tar.xz"
    t0 = time.time()
    with tarfile.open(bundle, "w:xz", preset=args.xz_preset) as tar:
        for path, name in files:
            tar.add(str(path), arcname=name)
    print(f"stage: bundle {bundle.stat().st_size / MIB:.1f} MiB ({sum(p.stat().st_size for p, _ in files) / MIB:.1f} "
          f"MiB before xz) in {time.time() - t0:.0f} s")
    split(bundle, out, args)


def split(bundle: Path, out: Path, args: argparse.Namespace) -> None:
    """The bundle in parts, one folder per device call, each call's work tree + part under --call-mib."""
    size, digest = bundle.stat().st_size, sha256(bundle)
    tree = tree_bytes()
    room = int(args.call_mib * MIB) - tree - int(args.margin_mib * MIB)
    if room <= 0 and not args.parts:
        fail(f"the work tree ({tree / MIB:.1f} MiB) leaves no room in a {args.call_mib} MiB call")
    count = args.parts or math.ceil(size / room)
    part = math.ceil(size / count)  # even parts: the slack is shared
    for old in out.glob("call*"):
        shutil.rmtree(old)
    calls = []
    with open(bundle, "rb") as f:
        for k in range(1, count + 1):
            d = out / f"call{k}"
            d.mkdir()
            data = f.read(part)
            (d / f"bundle.part{k}").write_bytes(data)
            info = {"index": k, "count": count, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                    "bundle_bytes": size, "bundle_sha256": digest}
            (d / f"part{k}.json").write_text(json.dumps(info, indent=1) + "\n")
            calls.append((k, len(data)))
    rel = out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
    lines = [f"# Device calls for this stage ({time.strftime('%Y-%m-%d %H:%M')})", "",
             f"Work tree {tree / MIB:.1f} MiB travels with every call; bundle {size / MIB:.1f} MiB in {count} parts, "
             f"sha256 {digest[:16]}...", "", "| call | carries | MiB (tree + part) | command | timeout_s |",
             "|---|---|---|---|---|"]
    for k, n in calls:
        cmd = f"bash scripts/train_heads_gpu.sh {'train' if k == count else 'receive'} {k}"
        lines.append(f"| {k} | `{rel}/call{k}` | {(tree + n) / MIB:.1f} | `{cmd}` | {540 if k == count else 120} |")
    lines += ["", "Back to back (the machine goes back 30 s after a call), then give_back. The heads come back "
              "under the last call's files: eagle/, medusa/, run.json, log.txt."]
    (out / "CALLS.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


# ---------------------------------------------------------------------------------------------- device side
def receive(args: argparse.Namespace) -> None:
    src, into = Path(args.part), Path(args.into)
    infos = list(src.glob("part*.json"))
    if len(infos) != 1:
        fail(f"{src} holds {len(infos)} part*.json files, expected 1 (was the folder carried?)")
    info = json.loads(infos[0].read_text())
    into.mkdir(parents=True, exist_ok=True)
    part = into / f"bundle.part{info['index']}"
    shutil.copyfile(src / part.name, part)
    if sha256(part) != info["sha256"]:
        part.unlink()
        fail(f"{part.name}: sha256 differs from the staged part (a broken transfer); run this call again")
    shutil.copyfile(infos[0], into / infos[0].name)
    print(f"receive: part {info['index']}/{info['count']} ok ({info['bytes'] / MIB:.1f} MiB) in {into}")


def unpack(args: argparse.Namespace) -> None:
    parts, dest = Path(args.parts), Path(args.dest)
    infos = sorted((json.loads(p.read_text()) for p in parts.glob("part*.json")), key=lambda i: i["index"])
    if not infos:
        fail(f"no parts in {parts}")
    count = infos[0]["count"]
    missing = sorted(set(range(1, count + 1)) - {i["index"] for i in infos})
    if missing:
        fail(f"parts {missing} of {count} are missing from {parts}: the machine was given back between calls "
             "(more than 30 s idle); start again from call 1")
    joined, h = parts / "bundle.tar.xz", hashlib.sha256()
    with open(joined, "wb") as f:
        for i in infos:
            data = (parts / f"bundle.part{i['index']}").read_bytes()
            if hashlib.sha256(data).hexdigest() != i["sha256"]:
                fail(f"bundle.part{i['index']} in {parts} is damaged; start again from call 1")
            h.update(data)
            f.write(data)
    if h.hexdigest() != infos[0]["bundle_sha256"]:
        fail("the joined bundle's sha256 differs from the staged one: parts of two stages were mixed")
    shutil.rmtree(dest, ignore_errors=True)
    with tarfile.open(joined) as tar:  # the "data" filter refuses links and paths out of dest (Python >= 3.10.12)
        tar.extractall(dest, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    joined.unlink()
    man = json.loads((dest / "manifest.json").read_text())
    if "sha256" in man["model"] and sha256(dest / man["model"]["path"]) != man["model"]["sha256"]:
        fail(f"{man['model']['path']}: sha256 differs from the staged weights")
    print(f"unpack: bundle ok ({h.hexdigest()[:16]}...), {count} parts, into {dest}")


def device(args: argparse.Namespace) -> None:
    from spec_plugins.training.device_run import RunOptions, run
    from spec_plugins.training.self_distill import parse_temperatures

    try:
        temperatures = tuple(parse_temperatures(args.temperatures))
    except ValueError as exc:
        fail(str(exc))
    try:  # RunOptions refuses bad options by name before anything loads or is written
        opts = RunOptions(heads=tuple(h for h in args.heads.split(",") if h), block_size=args.block_size,
                          anchors=args.anchors, block_layers=args.block_layers,
                          block_context=args.block_context, distill_s=args.distill_s,
                          temperatures=temperatures, samples=args.samples,
                          gen_rows=args.gen_rows, gen_max_new=args.gen_max_new, gen_max_seq=args.gen_max_seq,
                          device=args.device, dtype=args.dtype, batch_size=args.batch_size, window=args.window,
                          epochs=args.epochs, lr=args.lr, unroll=args.unroll, draft_vocab=args.draft_vocab,
                          max_steps=args.max_steps, prefill_tokens=args.prefill_tokens, medusa=args.medusa,
                          medusa_batch=args.medusa_batch, medusa_min_s=args.medusa_min_s,
                          until=args.until or math.inf, reserve_s=args.reserve_s, snapshot_s=args.snapshot_s,
                          snapshot_steps=args.snapshot_steps, save_every=args.save_every)
    except ValueError as exc:
        fail(f"device: {exc}")
    rep = run(args.bundle, args.out, args.work, opts)
    print(json.dumps({k: rep[k] for k in ("phases", "heads", "device")}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage", help="here: tokens + weights + wheels -> one part per device call")
    s.add_argument("--out", default="gpu-stage", help="inside the repo: the device calls carry its callK folders")
    s.add_argument("--target", default="smollm2-135m-instruct")
    s.add_argument("--max-tokens", type=int, default=24_000_000, help="training tokens (ShareGPT train split)")
    s.add_argument("--max-seq", type=int, default=4096, help="cut each conversation to this many tokens")
    s.add_argument("--heldout-tokens", type=int, default=40_000)
    s.add_argument("--heldout-max-seq", type=int, default=1024, help="as the CPU runs' held-out features")
    s.add_argument("--shard-tokens", type=int, default=1_000_000, help="tokens per shard = per feature chunk")
    s.add_argument("--language", default="en", choices=("en", "any"))
    s.add_argument("--heldout-share", type=float, default=0.02)
    s.add_argument("--wheels", default=None, help="take the wheels from this folder instead of pip download")
    s.add_argument("--call-mib", type=float, default=64.0, help="what one device call may carry in all")
    s.add_argument("--margin-mib", type=float, default=1.5, help="room left for files others add meanwhile")
    s.add_argument("--parts", type=int, default=0, help="split into this many parts (overrides --call-mib)")
    s.add_argument("--xz-preset", type=int, default=6)
    s.add_argument("--smoke", action="store_true", help="a tiny random model instead of the GGUF, no wheels")
    r = sub.add_parser("receive", help="device: keep this call's part outside the work tree")
    r.add_argument("--part", required=True)
    r.add_argument("--into", required=True)
    u = sub.add_parser("unpack", help="device: join, check and extract the bundle")
    u.add_argument("--parts", required=True)
    u.add_argument("--dest", required=True)
    d = sub.add_parser("device", help="device: features and heads in one process")
    d.add_argument("--bundle", required=True)
    d.add_argument("--out", required=True, help="$OUT: heads, reports and snapshots that come back")
    d.add_argument("--work", required=True, help="optimizer checkpoints (too big to come back)")
    d.add_argument("--device", default="auto")
    d.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    d.add_argument("--batch-size", type=int, default=8)
    d.add_argument("--window", type=int, default=512)
    d.add_argument("--epochs", type=float, default=1.0)
    d.add_argument("--lr", type=float, default=1e-3)
    d.add_argument("--unroll", type=int, default=3)
    d.add_argument("--draft-vocab", type=int, default=8192)
    d.add_argument("--max-steps", type=int, default=None)
    d.add_argument("--prefill-tokens", type=int, default=65536)
    d.add_argument("--heads", default="eagle", help="comma-separated, trained in order: eagle, parallel")
    d.add_argument("--block-size", type=int, default=8, help="parallel drafter: draft positions per forward")
    d.add_argument("--anchors", type=int, default=64, help="parallel drafter: blocks per window per step")
    d.add_argument("--block-layers", type=int, default=2, help="parallel drafter: decoder layers over each block")
    d.add_argument("--block-context", action=argparse.BooleanOptionalAction, default=False,
                   help="parallel drafter: the block layers attend to the committed pairs too")
    d.add_argument("--distill-s", type=float, default=0.0,
                   help="seconds of self-distillation (the target answering every turn) before the features")
    d.add_argument("--temperatures", default="0,0.7,1.0", help="self-distillation: 0 = greedy once, others sampled")
    d.add_argument("--samples", type=int, default=1, help="self-distillation: draws per sampled temperature")
    d.add_argument("--gen-rows", type=int, default=128, help="self-distillation: batch rows")
    d.add_argument("--gen-max-new", type=int, default=512, help="self-distillation: longest answer per turn")
    d.add_argument("--gen-max-seq", type=int, default=2048, help="self-distillation: conversations cut here")
    d.add_argument("--medusa", action=argparse.BooleanOptionalAction, default=True)
    d.add_argument("--medusa-batch", type=int, default=8)
    d.add_argument("--medusa-min-s", type=float, default=60.0, help="start Medusa only with this much time left")
    d.add_argument("--until", type=float, default=0.0, help="wall clock (epoch s) by which the heads are written")
    d.add_argument("--reserve-s", type=float, default=30.0)
    d.add_argument("--snapshot-s", type=float, default=60.0)
    d.add_argument("--snapshot-steps", type=int, default=0)
    d.add_argument("--save-every", type=int, default=500)
    args = ap.parse_args()
    for name in ("max_tokens", "heldout_tokens", "shard_tokens", "max_seq", "batch_size", "window", "prefill_tokens"):
        if getattr(args, name, 1) is not None and getattr(args, name, 1) < 1:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    {"stage": stage, "receive": receive, "unpack": unpack, "device": device}[args.cmd](args)


if __name__ == "__main__":
    main()
