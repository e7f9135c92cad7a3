"""llama.cpp runtime over llama-cpp-python's low-level API (GGUF models, CPU or llama.cpp's GPUs).

KV layout: one *unified* llama.cpp KV cache. Batch row ``b`` owns sequence id ``b`` (its "home");
a forward appends its N nodes to that sequence at positions ``length[b] + depth`` (a node's depth
along its row's own parents), with logits for every node, and ``commit``/``rollback`` remove what
is not kept with ``llama_memory_seq_rm`` (metadata only; the prefix is never re-run).

Trees use llama.cpp's per-token sequence lists: every leaf of the tree gets a sequence id
(the first leaf reuses the row's home id, the others are temporary ids whose prefix is shared
with ``llama_memory_seq_cp``, again metadata only), and each node is tagged with the ids of
every leaf below it. A node then attends to the cells of its leaf's sequence at positions
<= its own, which are exactly the row's prefix plus the node's ancestors. ``commit`` moves the
accepted path onto the home sequence and drops the temporary ids.

Models whose cache cannot be partially removed (recurrent / hybrid state) are refused.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from spec_plugins.backends.base import RuntimeCapabilities, SharedPool, StepOutput, Want
from spec_plugins.backends.llamacpp_config import LlamaCppConfig
from spec_plugins.backends.llamacpp_logs import set_log_verbosity
from spec_plugins.backends.llamacpp_threads import thread_counts
from spec_plugins.models import load_gguf_tokenizer
from spec_plugins.row_trees import LeafPaths
from spec_plugins.tree import TreeLayout

INSTALL_HINT = (
    "install the [llamacpp] extra: pip install -e '.[llamacpp]' (on x86 CPUs without AMX, build it with "
    "CMAKE_ARGS='-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF')"
)

_GGML_TYPES = {"float32": 0, "float16": 1, "bfloat16": 30}  # ggml_type enum values


def _llama_cpp() -> Any:
    """Import llama_cpp only where it is needed, so configs validate without the extra."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise ImportError(f"the llamacpp backend needs llama-cpp-python; {INSTALL_HINT}") from exc
    return llama_cpp


def _decode_error(rc: int, cells: int) -> str:
    """What a nonzero llama_decode return code means (llama.h's list), so a failure names its cause."""
    if rc == 1:
        return (f"llama.cpp KV cache is full ({cells} cells shared by all rows and draft nodes); "
                "raise n_ctx in the llamacpp runtime config")
    if rc == -1:
        return ("llama_decode failed with code -1: llama.cpp rejected the batch as invalid (a token id outside "
                "the vocabulary, a bad sequence id, or a sequence's positions not continuous: a bug in the "
                "runtime's draft layout)")
    if rc == 2:
        return "llama_decode failed with code 2: aborted by llama.cpp's abort callback"
    if rc == -2:
        return ("llama_decode failed with code -2: llama.cpp could not allocate the batch's compute "
                "buffers or cache cells (out of memory?)")
    if rc == -3:
        return "llama_decode failed with code -3: llama.cpp's graph computation failed (a backend error)"
    return f"llama_decode failed with code {rc} (llama.cpp: {'a fatal error' if rc < 0 else 'a warning'})"


class LlamaCppRuntime:
    """A GGUF model in a llama.cpp context; rows and tree leaves are llama.cpp sequences."""

    Config = LlamaCppConfig

    @classmethod
    def from_config(cls, config: "LlamaCppRuntime.Config") -> "LlamaCppRuntime":
        from spec_plugins.models import resolve_model

        src = resolve_model(config.model)
        if src.gguf_path is None:
            raise ValueError(f"the llamacpp backend needs a GGUF model; {config.model!r} is a transformers directory")
        return cls(str(src.gguf_path), config, tokenizer=load_gguf_tokenizer(config.model))

    def __init__(self, gguf_path: str, config: "LlamaCppRuntime.Config | None" = None, tokenizer: Any = None) -> None:
        L = _llama_cpp()
        self._L = L
        cfg = config or self.Config(model=gguf_path)
        self.config = cfg
        self.tokenizer = tokenizer
        set_log_verbosity(L, cfg.verbose)
        L.llama_backend_init()
        if cfg.gpu_layers != 0 and not L.llama_supports_gpu_offload():
            raise ValueError(
                f"gpu_layers={cfg.gpu_layers} asks for GPU offload, but this llama.cpp build has none "
                "(llama_supports_gpu_offload() is False): set gpu_layers: 0 for the CPU, or install a "
                "llama-cpp-python built with a GPU backend (e.g. CMAKE_ARGS='-DGGML_CUDA=on')")
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = cfg.gpu_layers
        if hasattr(mp, "use_extra_bufts"):
            mp.use_extra_bufts = cfg.extra_buffer_types
        self._model = L.llama_model_load_from_file(str(gguf_path).encode(), mp)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {gguf_path}")
        self._ctx = self._mem = self._batch = None
        if L.llama_model_is_recurrent(self._model) or L.llama_model_is_hybrid(self._model):
            self.close()
            raise ValueError(
                f"{Path(gguf_path).name} is a recurrent/hybrid model: llama.cpp cannot remove part of its "
                "state, so rejected draft tokens could not be rolled back. Use a transformer model or another runtime."
            )
        self.threads, self.threads_batch = thread_counts(cfg.threads, cfg.threads_batch)
        cp = L.llama_context_default_params()
        cp.n_ctx = cfg.n_ctx
        cp.n_batch = cfg.n_batch
        cp.n_ubatch = cfg.n_batch
        cp.n_seq_max = cfg.max_sequences
        cp.kv_unified = True  # one cell may belong to several sequences (tree nodes)
        cp.swa_full = cfg.swa_full
        cp.n_threads, cp.n_threads_batch = self.threads, self.threads_batch
        if cfg.dtype is not None:
            cp.type_k = cp.type_v = _GGML_TYPES[cfg.dtype]
        cp.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if cfg.flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self._ctx = L.llama_init_from_model(self._model, cp)
        if not self._ctx:
            self.close()
            raise ValueError(f"llama.cpp could not create a context (n_ctx={cfg.n_ctx}) for {gguf_path}")
        self._mem = L.llama_get_memory(self._ctx)
        self._n_batch = int(L.llama_n_batch(self._ctx))  # llama.cpp caps n_batch at n_ctx: its limit, not the asked one
        self._batch = L.llama_batch_init(self._n_batch, 0, cfg.max_sequences)
        vocab = L.llama_model_get_vocab(self._model)
        self.vocab_size = int(L.llama_vocab_n_tokens(vocab))
        eos = int(L.llama_vocab_eos(vocab))
        self.eos_token_ids = (eos,) if eos >= 0 else ()  # the GGUF's EOS, as the torch runtime's config has
        self.max_context = int(L.llama_n_ctx(self._ctx))
        self.capabilities = RuntimeCapabilities(tree_mask=True, hidden_states=False, name="llamacpp")
        self.pool = SharedPool(self.max_context, cfg.max_sequences)  # what the batch fits rows and drafts in
        self.device = torch.device("cpu")  # logits come back in host memory
        self._seq: list[int] = []  # home sequence id per row
        self._len: list[int] = []  # tokens cached per row (= next position)
        self._pending: dict[str, Any] | None = None  # what the last forward wrote, until commit
        self.decode_time = 0.0  # seconds inside llama_decode (excludes Python batch building)

    # ---- lifetime ------------------------------------------------------------------------
    def close(self) -> None:
        """Free the llama.cpp batch, context and model (also done on garbage collection); calling it
        again does nothing, and the runtime's other methods then raise instead of using freed memory."""
        L = self._L
        self._mem = None
        if self._batch is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            L.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            L.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def _check_open(self) -> None:
        """The context's memory is gone after close(): llama.cpp would crash the process on it."""
        if self._mem is None:
            raise RuntimeError("llama.cpp runtime is closed")

    # ---- llama.cpp calls -----------------------------------------------------------------
    def _decode(self, items: list[tuple[int, int, Sequence[int], bool]]) -> torch.Tensor:
        """Run (token, pos, seq_ids, want_logits) items in n_batch chunks; logits rows in order.
        Token ids are checked first: llama.cpp would reject the chunk holding a bad one, after earlier ones ran."""
        L, batch, V = self._L, self._batch, self.vocab_size
        bad = next((t for t, *_ in items if not 0 <= t < V), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the model's vocabulary (ids 0..{V - 1})")
        outs = []
        for start in range(0, len(items), self._n_batch):
            chunk = items[start : start + self._n_batch]
            n_out = 0
            for i, (tok, pos, seqs, want) in enumerate(chunk):
                batch.token[i] = tok
                batch.pos[i] = pos
                batch.n_seq_id[i] = len(seqs)
                sid = batch.seq_id[i]
                for j, s in enumerate(seqs):
                    sid[j] = s
                batch.logits[i] = 1 if want else 0
                n_out += bool(want)
            batch.n_tokens = len(chunk)
            t0 = time.perf_counter()
            rc = L.llama_decode(self._ctx, batch)
            self.decode_time += time.perf_counter() - t0
            if rc != 0:
                raise RuntimeError(_decode_error(rc, self.max_context))
            if n_out:
                ptr = L.llama_get_logits(self._ctx)
                buf = (ctypes.c_float * (n_out * V)).from_address(ctypes.addressof(ptr.contents))
                outs.append(torch.frombuffer(buf, dtype=torch.float32).view(n_out, V).clone())
        return torch.cat(outs) if len(outs) != 1 else outs[0]

    def _seq_rm(self, seq: int, p0: int, p1: int = -1) -> None:
        if not self._L.llama_memory_seq_rm(self._mem, seq, p0, p1):
            raise RuntimeError(
                f"llama.cpp refused to remove positions [{p0}, {p1}) of sequence {seq}: this model's cache "
                "cannot be partially removed, so speculative decoding cannot roll it back"
            )

    # ---- Runtime contract ----------------------------------------------------------------
    def prefill(self, rows: Sequence[Sequence[int]], want_hidden: Want = False) -> StepOutput:
        self._check_open()
        if want_hidden:
            raise ValueError("the llamacpp runtime does not return hidden states (capabilities.hidden_states=False)")
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("prefill needs at least one token per row")
        if len(rows) > self.config.max_sequences:
            raise ValueError(
                f"batch of {len(rows)} rows exceeds max_sequences={self.config.max_sequences} of the llamacpp runtime"
            )
        total = sum(len(r) for r in rows)
        if total > self.max_context:
            raise ValueError(f"prompts hold {total} tokens; the llama.cpp context holds {self.max_context} (n_ctx)")
        self._seq, self._len, self._pending = [], [], None  # a failed decode leaves no rows over a cleared cache
        self._L.llama_memory_clear(self._mem, False)  # metadata only: cells are overwritten
        items = [(int(t), p, (b,), p == len(r) - 1) for b, r in enumerate(rows) for p, t in enumerate(r)]
        logits = self._decode(items)
        self._seq = list(range(len(rows)))
        self._len = [len(r) for r in rows]
        return StepOutput(logits.view(len(rows), 1, self.vocab_size))

    def forward(self, tokens: torch.Tensor, tree: TreeLayout | None = None, want_hidden: Want = False) -> StepOutput:
        self._check_open()
        if want_hidden:
            raise ValueError("the llamacpp runtime does not return hidden states (capabilities.hidden_states=False)")
        if self._pending is not None:
            self._drop_temporaries(self._pending)
            self._pending = None
        B, N = tokens.shape
        if B != len(self._seq):
            raise ValueError(f"forward got {B} rows; the runtime holds {len(self._seq)}")
        if B == 0 or N == 0:
            raise ValueError(f"forward needs at least one row and one node per row; got tokens of shape {(B, N)}")
        toks = tokens.tolist()
        if tree is None or tree.is_chain:
            if max(self._len) + N > self.max_context:
                raise ValueError(f"position {max(self._len) + N - 1} exceeds the context of {self.max_context}")
            items = [(toks[b][j], self._len[b] + j, (s,), True) for b, s in enumerate(self._seq) for j in range(N)]
            pend: dict[str, Any] = {"before": list(self._len), "tree": None, "rows": None}
            grow = N
        else:
            items, pend = self._tree_items(toks, tree)
            grow = int(tree.depth.max()) + 1
        try:
            logits = self._decode(items)
        except BaseException:  # remove what a partly run decode wrote: the runtime stays as before the call
            self._drop_temporaries(pend)
            for s, n in zip(self._seq, pend["before"]):
                self._seq_rm(s, n)
            raise
        self._pending = {**pend, "n": N}
        self._len = [n + grow for n in self._len]
        return StepOutput(logits.view(B, N, self.vocab_size))

    def _tree_items(
        self, toks: list[list[int]], tree: TreeLayout
    ) -> tuple[list[tuple[int, int, Sequence[int], bool]], dict]:
        """Give each leaf of a row's tree a sequence holding the row's prefix; tag nodes with their
        leaves' ids (rows share one topology, or each has its own: ``TreeLayout.rows``). Returns the
        nodes and the pending state that commit() needs once they are decoded."""
        N = tree.size
        depth = tree.depth.tolist()
        if max(self._len) + max(depth) + 1 > self.max_context:
            raise ValueError(f"tree depth {max(depth) + 1} exceeds the context of {self.max_context}")
        shared = LeafPaths.of(tree, 0) if tree.rows is None else None
        rows = [shared or LeafPaths.of(tree, b) for b in range(len(self._seq))]
        extra = sum(len(r.leaves) - 1 for r in rows)
        free = sorted(set(range(self.config.max_sequences)) - set(self._seq))
        if extra > len(free):
            raise ValueError(
                f"a tree with {max(len(r.leaves) for r in rows)} leaves over {len(self._seq)} rows needs "
                f"{len(self._seq) + extra} llama.cpp sequences; raise max_sequences (now {self.config.max_sequences}) "
                "in the llamacpp runtime config")
        row_ids: list[list[int]] = []
        items = []
        for b, (home, rt) in enumerate(zip(self._seq, rows)):
            ids = [home] + free[:len(rt.leaves) - 1]
            free = free[len(rt.leaves) - 1:]
            for s in ids[1:]:
                self._L.llama_memory_seq_cp(self._mem, home, s, -1, -1)
            row_ids.append(ids)
            base = self._len[b]
            items.extend((toks[b][j], base + rt.depth[j], [ids[k] for k in rt.on_leaf[j]], True) for j in range(N))
        return items, {"before": list(self._len), "tree": tree, "rows": rows, "ids": row_ids}

    def _drop_temporaries(self, pend: dict | None) -> None:
        """Remove the tree leaves' temporary sequence ids (the rows' home ids stay)."""
        if pend is not None and pend.get("ids"):
            for ids in pend["ids"]:
                for s in ids[1:]:
                    self._seq_rm(s, -1, -1)

    def commit(self, keep: Sequence[Sequence[int]]) -> None:
        self._check_open()
        pend = self._pending
        if pend is None:
            raise RuntimeError("commit() without a preceding forward()")
        if not len(keep) == len(self._seq) == len(pend["before"]):
            raise ValueError(f"commit got {len(keep)} rows; the runtime holds {len(self._seq)}, its last forward "
                             f"scored {len(pend['before'])}")
        keep = [self._checked_keep(b, k, pend) for b, k in enumerate(keep)]  # all rows, before any is changed
        self._pending = None
        for b, (k, base) in enumerate(zip(keep, pend["before"])):
            if pend["tree"] is None or not k:
                self._seq_rm(self._seq[b], base + len(k))
            else:
                self._commit_path(b, k, pend)
            self._len[b] = base + len(k)
        self._drop_temporaries(pend)

    @staticmethod
    def _checked_keep(b: int, keep: Sequence[int], pend: dict) -> list[int]:
        """Row ``b``'s keep as a list, refused unless it is a prefix of a chain's nodes or a root-to-node
        path of the row's tree: commit checks every row first, so a bad keep changes nothing."""
        k, n = [int(j) for j in keep], pend["n"]
        if any(not 0 <= j < n for j in k):
            raise ValueError(f"row {b}: kept nodes {k} are not all among the forward's {n} nodes (0..{n - 1})")
        if pend["tree"] is None and k != list(range(len(k))):
            raise ValueError(f"row {b}: a chain keeps a prefix of its nodes, got {k}")
        if pend["tree"] is not None and any(pend["rows"][b].parents[j] != (k[d - 1] if d else -1) for d, j in enumerate(k)):
            raise ValueError(f"row {b}: kept nodes {k} are not a root-to-node path of the tree")
        return k

    def _commit_path(self, b: int, keep: list[int], pend: dict) -> None:
        """Leave exactly prefix + the kept (non-empty, checked) root-to-node path on the row's home sequence."""
        home, base, rt, ids = self._seq[b], pend["before"][b], pend["rows"][b], pend["ids"][b]
        leaf_k = next(k for k, nodes in enumerate(rt.paths) if keep[-1] in nodes)
        if leaf_k == 0:  # the path lies on the home sequence already
            self._seq_rm(home, base + len(keep))
            return
        self._seq_rm(home, base)
        self._L.llama_memory_seq_cp(self._mem, ids[leaf_k], home, base, base + len(keep))

    def rollback(self, lengths: Sequence[int]) -> None:
        self._check_open()
        if len(lengths) != len(self._seq):
            raise ValueError(f"rollback got {len(lengths)} rows; the runtime holds {len(self._seq)}")
        self._drop_temporaries(self._pending)
        self._pending = None
        for b, (s, n) in enumerate(zip(self._seq, lengths)):
            n = min(int(n), self._len[b])
            if n < 0:
                raise ValueError(f"rollback length must be >= 0, got {n}")
            self._seq_rm(s, n)
            self._len[b] = n

    def add_rows(self, rows: Sequence[Sequence[int]], want_hidden: Want = False) -> StepOutput:
        """Continuous batching: prefill ``rows`` on unused sequence ids and append them after
        the running rows (whose cache is untouched). Output as ``prefill``, new rows only."""
        self._check_open()
        if not self._seq:
            return self.prefill(rows, want_hidden)
        if want_hidden:
            raise ValueError("the llamacpp runtime does not return hidden states (capabilities.hidden_states=False)")
        if self._pending is not None:  # commit would then see more rows than the forward scored
            raise RuntimeError("add_rows() between forward() and commit(): commit or roll back the forward first")
        if not rows or any(len(r) == 0 for r in rows):
            raise ValueError("add_rows needs at least one token per row")
        free = sorted(set(range(self.config.max_sequences)) - set(self._seq))
        if len(rows) > len(free):
            raise ValueError(f"{len(self._seq)} running + {len(rows)} new rows exceed max_sequences="
                             f"{self.config.max_sequences} of the llamacpp runtime")
        ids = free[: len(rows)]
        items = [(int(t), p, (s,), p == len(r) - 1) for s, r in zip(ids, rows) for p, t in enumerate(r)]
        try:
            logits = self._decode(items)
        except BaseException:
            for s in ids:  # cells a partial decode wrote: the running rows stay as they were
                self._seq_rm(s, -1, -1)
            raise
        self._seq += ids
        self._len += [len(r) for r in rows]
        return StepOutput(logits.view(len(rows), 1, self.vocab_size))

    def lengths(self) -> list[int]:
        return list(self._len)

    def select_rows(self, rows: Sequence[int]) -> None:
        self._check_open()
        rows = list(rows)
        if any(r < 0 or r >= len(self._seq) for r in rows):
            raise ValueError(f"select_rows: rows {rows} out of range for {len(self._seq)} rows")
        self._drop_temporaries(self._pending)
        self._pending = None
        for b in set(range(len(self._seq))) - set(rows):
            self._seq_rm(self._seq[b], -1, -1)
        self._seq = [self._seq[r] for r in rows]
        self._len = [self._len[r] for r in rows]
