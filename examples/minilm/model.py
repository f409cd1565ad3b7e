"""The all-MiniLM-L6-v2 sentence encoder as a Tandem program, and MiniLMEncoder around it.

One run encodes one padded batch: ids and a 0/1 attention mask [B, S] (B and S
symbolic, S the longest sentence of the batch) go in, L2-normalised sentence
embeddings [B, hidden] come out. The weights are one resident DeviceTensor.

How the work is cut. The token rows of the batch (T = B * S, every activation
is a [T, features] matrix) are split into one contiguous chunk per pool
worker. Row-wise work (bias adds, GELU, layernorms, and the matmuls when the
chunks are large) is submitted per chunk, so each worker gets one large BLAS
product per stage and a chunk moves on to its next stage as soon as its own
rows are ready: the engine tracks dependencies by the bytes a view covers, and
chunks are disjoint. When chunks are small (fewer than MIN_CHUNK_ROWS rows), every worker
would stream whole weight matrices from memory for a few rows, so the matmuls
are split by output columns instead. Attention is submitted per (chunk piece,
head): a piece is the part of a chunk inside a run of whole sequences (or a
slice of one sequence's queries), and a head is a column slice of the fused
QKV matrix, which the attention kernel reads as a strided view (views can be
sliced but not permuted, so a [B, H, S, D] view of it cannot be had). Heads of
one piece write different columns of the same rows of the context matrix: the
engine sees those as disjoint, so heads, like the column slices of a matmul,
run in parallel.
"""

import weakref
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, AsyncIterator, Sequence

import numpy as np

import engine
from engine import In, Out
from engine import kernels as K
from engine.kernels.packing import PANEL
from examples.minilm.weights import (BertConfig, Layout, default_model_dir, load_config, load_tokenizer,
                                     load_weights)

if TYPE_CHECKING:
    from scheduler import AsyncRuntime, RunFuture

__all__ = ["MIN_CHUNK_ROWS", "PACKED_MAX_ROWS", "MiniLMEncoder", "build_program", "column_ranges", "row_chunks"]

# Padding keys get this subtracted from their scores: exp() of it is exactly 0,
# while 0 - 0 stays exactly 0 for real tokens (unlike adding a large number to them).
_MASK_PENALTY = 1e9

# Token rows per worker below which matmuls are split by output columns rather than rows.
MIN_CHUNK_ROWS = 128
# Rows per matmul task up to which the panel-packed weights are read (matmul_packed: each weight
# streamed once, bias and GELU in its epilogue) instead of sgemm packing the weight matrix on every
# call: the kernel's own answer for this CPU, None (always) where it has AVX-512 (benchmarks/README.md).
PACKED_MAX_ROWS: int | None = K.packed_max_rows()
_LINE = 16  # float32 columns per 64-byte line
assert _LINE % PANEL == 0  # so a column range on lines is a range of whole panels

Piece = tuple[int, int, int, int]  # batch rows [b0, b1), query positions [s0, s1)


def row_chunks(batch: int, seq: int, parts: int) -> list[tuple[int, int, list[Piece]]]:
    """Splits the T = batch * seq token rows into `parts` near-equal contiguous chunks.

    Each chunk (r0, r1, pieces) lists the pieces attention works on: whole
    sequences merged into one piece, and the partial sequences at either end.
    """
    total = batch * seq
    parts = max(1, min(parts, total))
    out = []
    for i in range(parts):
        r0, r1 = total * i // parts, total * (i + 1) // parts
        b0, s0 = divmod(r0, seq)
        b1, s1 = divmod(r1, seq)
        pieces: list[Piece] = []
        if b0 == b1:
            pieces.append((b0, b0 + 1, s0, s1))
        else:
            if s0:
                pieces.append((b0, b0 + 1, s0, seq))
                b0 += 1
            if b1 > b0:
                pieces.append((b0, b1, 0, seq))
            if s1:
                pieces.append((b1, b1 + 1, 0, s1))
        out.append((r0, r1, pieces))
    return out


class _WeightViews:
    """Named device views into the packed weight tensor, built once per tensor (views are immutable)."""

    def __init__(self, layout: Layout) -> None:
        self._layout = layout
        self._cache: "weakref.WeakKeyDictionary[engine.DeviceTensor, dict[str, engine.DeviceTensor]]" = (
            weakref.WeakKeyDictionary())

    def __call__(self, params: engine.DeviceTensor) -> dict[str, engine.DeviceTensor]:
        views = self._cache.get(params)
        if views is None:
            views = {}
            for name, (off, shape) in self._layout.entries.items():
                n = int(np.prod(shape))
                views[name] = params[off:off + n].reshape(shape)
            self._cache[params] = views
        return views


def column_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """[0, n) in `parts` near-equal ranges whose bounds fall on 16-column (64-byte) lines."""
    lines = -(-n // _LINE)
    parts = max(1, min(parts, lines))
    bounds = [min(n, _LINE * (lines * i // parts)) for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def build_program(cfg: BertConfig, layout: Layout, *, min_chunk_rows: int = MIN_CHUNK_ROWS,
                  packed_max_rows: int | None = PACKED_MAX_ROWS) -> engine.Program:
    """The encoder program for one model shape: (ids, mask, params) -> embeddings.

    min_chunk_rows: below this many token rows per worker, matmuls split by columns.
    packed_max_rows: up to this many rows per matmul task, the panel-packed weights are used (None: always).
    """
    hidden, heads, dh = cfg.hidden, cfg.heads, cfg.head_dim
    views = _WeightViews(layout)
    eps = cfg.eps

    # No `from __future__ import annotations` in this module: the engine evaluates these
    # annotations, and they close over this function's locals.
    @engine.program
    def minilm(run: engine.Run, ids: In(("B", "S"), "int32"), mask: In(("B", "S")),  # type: ignore[valid-type]
               params: In((layout.size,)), out: Out(("B", hidden))) -> None:  # type: ignore[valid-type]
        w = views(params)
        batch, seq = ids.shape
        tokens = batch * seq
        x = run.scratch((tokens, hidden))  # the hidden state, updated in place layer after layer
        qkv = run.scratch((tokens, 3 * hidden))
        ctx = run.scratch((tokens, hidden))
        ff = run.scratch((tokens, cfg.intermediate))
        bias = run.scratch((batch, 1, seq))  # additive attention mask, broadcast over queries
        minus_one = run.scratch((1,))
        x3, qkv3, ctx3 = x.reshape(batch, seq, hidden), qkv.reshape(batch, seq, 3 * hidden), ctx.reshape(
            batch, seq, hidden)
        flat_ids = ids.reshape(tokens)
        chunks = row_chunks(batch, seq, run.workers)

        # bias = (mask - 1) * penalty: 0 for tokens, -penalty for padding.
        bias2 = bias.reshape(batch, seq)
        run.submit(K.fill, out=minus_one, value=-1.0)
        run.submit(K.add, mask, minus_one, out=bias2)
        run.submit(K.scale, bias2, out=bias2, alpha=_MASK_PENALTY)

        # Embeddings: word + (position + token type 0), then layernorm.
        for r0, r1, pieces in chunks:
            run.submit(K.embedding, flat_ids[r0:r1], w["word"], out=x[r0:r1])
            for b0, b1, s0, s1 in pieces:
                xp = x3[b0:b1, s0:s1]
                run.submit(K.add, xp, w["pos_type"][s0:s1], out=xp)
            run.submit(K.layernorm, x[r0:r1], w["emb_ln_g"], w["emb_ln_b"], out=x[r0:r1], eps=eps)

        # Few rows per chunk: splitting the rows would make every worker stream whole weight
        # matrices for little work, so each matmul is split by output columns instead.
        by_columns = len(chunks) > 1 and tokens < min_chunk_rows * len(chunks)

        task_rows = tokens if by_columns else max(r1 - r0 for r0, r1, _ in chunks)
        packed = packed_max_rows is None or task_rows <= packed_max_rows

        def dense(a: engine.DeviceTensor, name: str, dst: engine.DeviceTensor, beta: float = 0.0,
                  gelu: bool = False) -> None:
            """dst = [gelu](a @ W + beta * dst + b) for the weight `name`_w and bias `name`_b, cut into one
            task per worker (by rows or by columns). Packed: the bias and GELU are the matmul's epilogue."""
            wt, bv = w[name + "_w"], w[name + "_b"]
            if packed:
                wp, act = w[name + "_w_p"], "gelu" if gelu else "none"
                if by_columns:  # column ranges fall on 16-column lines, which are whole panels
                    for c0, c1 in column_ranges(wt.shape[1], len(chunks)):
                        run.submit(K.matmul_packed, a, wp[c0 // PANEL:-(-c1 // PANEL)], bias=bv[c0:c1],
                                   out=dst[:, c0:c1], beta=beta, activation=act)
                else:
                    for r0, r1, _ in chunks:
                        run.submit(K.matmul_packed, a[r0:r1], wp, bias=bv, out=dst[r0:r1], beta=beta, activation=act)
                return
            if by_columns:
                for c0, c1 in column_ranges(wt.shape[1], len(chunks)):
                    run.submit(K.matmul, a, wt[:, c0:c1], out=dst[:, c0:c1], beta=beta)
            else:
                for r0, r1, _ in chunks:
                    run.submit(K.matmul, a[r0:r1], wt, out=dst[r0:r1], beta=beta)
            rows(K.add, dst, bv)
            if gelu:
                rows(K.gelu, dst)

        def rows(kernel: engine.kernels.Kernel, t: engine.DeviceTensor, *more: engine.DeviceTensor,
                 **scalars: float) -> None:
            """t = kernel(t, *more) in place, one task per row chunk."""
            for r0, r1, _ in chunks:
                run.submit(kernel, t[r0:r1], *more, out=t[r0:r1], **scalars)

        for layer in range(cfg.layers):
            p = f"{layer}."
            dense(x, p + "qkv", qkv)
            for _, _, pieces in chunks:
                for b0, b1, s0, s1 in pieces:
                    for h in range(heads):
                        c = h * dh
                        run.submit(K.attention, qkv3[b0:b1, s0:s1, c:c + dh],
                                   qkv3[b0:b1, :, hidden + c:hidden + c + dh],
                                   qkv3[b0:b1, :, 2 * hidden + c:2 * hidden + c + dh],
                                   mask=bias[b0:b1], out=ctx3[b0:b1, s0:s1, c:c + dh])
            # x = layernorm(x + ctx @ Wo + bo): the residual is matmul's beta=1 accumulator.
            dense(ctx, p + "o", x, beta=1.0)
            rows(K.layernorm, x, w[p + "ln1_g"], w[p + "ln1_b"], eps=eps)
            # x = layernorm(x + gelu(x @ W1 + b1) @ W2 + b2)
            dense(x, p + "ff1", ff, gelu=True)
            dense(ff, p + "ff2", x, beta=1.0)
            rows(K.layernorm, x, w[p + "ln2_g"], w[p + "ln2_b"], eps=eps)

        # Masked mean over real tokens, then unit length (sentence-transformers' Pooling + Normalize).
        run.submit(K.mean_pool, x3, mask, out=out)
        run.submit(K.l2_normalize, out, out=out)

    return minilm


class MiniLMEncoder:
    """all-MiniLM-L6-v2 on the engine: prepared once, weights resident, any number of encode() calls.

        with MiniLMEncoder() as enc:
            vectors = enc.encode(["a sentence", "another one"])      # [2, 384] float32, unit rows

        async with enc.open_async():                                   # inside an event loop
            vectors = await enc.aencode(texts)

    max_batch and max_seq_length bound the symbolic dims B and S (they size each
    pipeline slot's buffers). Longer texts are truncated to max_seq_length tokens,
    as sentence-transformers does; the default is the model's own (256).
    capture: record the orchestration once per (B, S) and replay it natively
    after (engine.capture); capture_limit recordings are kept.
    seq_multiple: a run's S is its longest text rounded up to a multiple of
    this (at most max_seq_length); 1, the default, pads to the longest text
    exactly. Recordings are per (B, S): a service that sees texts of every
    length replays more of its runs with S on a grid, for the price of the
    positions added (masked out: the embeddings do not change). The example
    service uses 8 (benchmarks/README.md has what it measured).
    """

    def __init__(self, model_dir: str | Path | None = None, *, max_batch: int = 32,
                 max_seq_length: int | None = None, workers: int | None = None, depth: int = 2,
                 capture: bool = True, capture_limit: int = 64, seq_multiple: int = 1) -> None:
        self.model_dir = Path(model_dir) if model_dir is not None else default_model_dir()
        self.config = load_config(self.model_dir)
        if max_seq_length is None:
            max_seq_length = self.config.max_seq_length
        if not 2 <= max_seq_length <= self.config.max_positions:
            raise ValueError(f"max_seq_length must be in [2, {self.config.max_positions}], got {max_seq_length}")
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        if isinstance(seq_multiple, bool) or not isinstance(seq_multiple, int) or seq_multiple < 1:
            raise ValueError(f"seq_multiple must be a positive int, got {seq_multiple!r}")
        self.max_batch = max_batch
        self.seq_multiple = seq_multiple
        self.max_seq_length = max_seq_length
        self.tokenizer = load_tokenizer(self.model_dir, max_seq_length)
        self._untruncated = load_tokenizer(self.model_dir, None)
        packed = load_weights(self.model_dir, self.config)
        self.layout = packed.layout
        self.program = build_program(self.config, packed.layout)
        self.runtime = self.program.prepare(workers=workers, depth=depth,
                                            bounds={"B": max_batch, "S": max_seq_length}, capture=capture,
                                            capture_limit=capture_limit)
        try:
            self.params = self.runtime.alloc_tensor((packed.layout.size,), "float32", init=packed.flat)
        except BaseException:
            self.runtime.close()
            raise
        self._art: "AsyncRuntime | None" = None

    @property
    def dim(self) -> int:
        return self.config.hidden

    # -- tokens -------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str], *, truncate: bool = True) -> list[np.ndarray]:
        """Token ids of each text ([CLS] ... [SEP]), unpadded; truncated to max_seq_length unless told not to
        (callers that reject long texts rather than cut them, like the service, check the lengths)."""
        texts = _check_texts(texts)
        tok = self.tokenizer if truncate else self._untruncated
        return [np.asarray(e.ids, np.int32) for e in tok.encode_batch(texts)]

    def padded_length(self, longest: int) -> int:
        """The S of a run whose longest text has `longest` tokens: rounded up to a multiple of seq_multiple,
        within max_seq_length."""
        m = self.seq_multiple
        return max(longest, min(-(-longest // m) * m, self.max_seq_length))

    def pad(self, token_lists: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """ids [B, S] int32 (0 = [PAD]) and mask [B, S] float32, S = padded_length(the longest sequence)."""
        seq = self.padded_length(max(len(t) for t in token_lists))
        ids = np.zeros((len(token_lists), seq), np.int32)
        mask = np.zeros((len(token_lists), seq), np.float32)
        for i, t in enumerate(token_lists):
            ids[i, :len(t)] = t
            mask[i, :len(t)] = 1.0
        return ids, mask

    def _batches(self, token_lists: list[np.ndarray], batch_size: int | None) -> list[list[int]]:
        size = self.max_batch if batch_size is None else batch_size
        if not 1 <= size <= self.max_batch:
            raise ValueError(f"batch_size must be in [1, {self.max_batch}] (max_batch), got {batch_size}")
        # Longest first, as sentence-transformers does: similar lengths share a batch, so little padding.
        order = sorted(range(len(token_lists)), key=lambda i: -len(token_lists[i]))
        return [order[i:i + size] for i in range(0, len(order), size)]

    # -- synchronous -----------------------------------------------------------------------
    def encode(self, texts: Sequence[str], batch_size: int | None = None) -> np.ndarray:
        """Embeddings [len(texts), dim] in input order; runs of batch_size (default max_batch) texts
        go out pipelined, `depth` of them in flight."""
        if self._art is not None:
            raise RuntimeError("encode() while open_async() drives the runtime: use await aencode()")
        toks = self.tokenize(texts)
        out = np.empty((len(toks), self.dim), np.float32)
        handles = []
        for idx in self._batches(toks, batch_size):
            ids, mask = self.pad([toks[i] for i in idx])
            handles.append((idx, self.runtime.submit(ids, mask, self.params)))  # blocks only at `depth` in flight
        for idx, h in handles:
            out[idx] = h.result()
        return out

    # -- asynchronous ----------------------------------------------------------------------
    @asynccontextmanager
    async def open_async(self) -> AsyncIterator["MiniLMEncoder"]:
        """Drives the runtime from the current event loop (asyncio or trio) for aencode()/dispatch()."""
        from scheduler import AsyncRuntime

        if self._art is not None:
            raise RuntimeError("open_async() is already open")
        async with AsyncRuntime(self.runtime) as art:
            self._art = art
            try:
                yield self
            finally:
                self._art = None

    @property
    def async_runtime(self) -> "AsyncRuntime":
        """The AsyncRuntime open_async() drives (for its stats, metrics and traces); RuntimeError outside it."""
        if self._art is None:
            raise RuntimeError("aencode()/dispatch()/async_runtime need `async with encoder.open_async():` first")
        return self._art

    async def dispatch(self, token_lists: Sequence[np.ndarray]) -> "RunFuture":
        """Starts one run over at most max_batch tokenized texts; await the future for [n, dim]."""
        if not 1 <= len(token_lists) <= self.max_batch:
            raise ValueError(f"a run takes 1 to {self.max_batch} texts, got {len(token_lists)}")
        ids, mask = self.pad(token_lists)
        return await self.async_runtime.dispatch(ids, mask, self.params)

    async def aencode(self, texts: Sequence[str], batch_size: int | None = None) -> np.ndarray:
        """encode() from async code: every batch is dispatched before the first is awaited."""
        art = self.async_runtime
        toks = self.tokenize(texts)
        out = np.empty((len(toks), self.dim), np.float32)
        futures = []
        for idx in self._batches(toks, batch_size):
            ids, mask = self.pad([toks[i] for i in idx])
            futures.append((idx, await art.dispatch(ids, mask, self.params)))
        for idx, fut in futures:
            out[idx] = await fut
        return out

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        self.runtime.close()

    def __enter__(self) -> "MiniLMEncoder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str):
        raise TypeError("pass a list of strings, not a single string")
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"text {i} is a {type(t).__name__}, not a str")
    return texts
