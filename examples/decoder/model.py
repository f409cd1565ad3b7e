"""A small GPT-style decoder: its configuration, its weights and the engine program of one step.

The model is pre-LayerNorm with learned position embeddings, multi-head
attention with biases, a GELU (erf) MLP and an untied LM head. Weights come
from a fixed seed, so the engine and the torch reference (reference.py) see
the same numbers.

Weights are stored in the layout the engine program consumes (the torch
reference reshapes them to the usual one):
- per-head projections wq [L, H, d, Dh] and wkv [L, 2, H, d, Dh]: a batched
  matmul of the hidden rows [S, d] against them gives head-major q [H, S, Dh]
  and writes k and v straight into the cache positions [2, H, S, Dh];
- wo [L, H, Dh, d], which for one row is simply a [d, d] matrix.
Every tensor is packed into one flat float32 buffer (`ParamLayout`), so the
whole model is a single resident `DeviceTensor` and one program argument.

This module deliberately has no `from __future__ import annotations`: the
step program's parameter annotations (In(...), Out(...)) must be real
objects, built from the configuration in `build_step_program`'s closure.
"""

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np

import engine
from engine import In, InOut, Out, Scalar
from engine import kernels as K

__all__ = ["DecoderConfig", "ParamLayout", "init_weights", "build_step_program"]


@dataclass(frozen=True)
class DecoderConfig:
    """Hyper-parameters. `max_len` is the number of positions: the KV cache size."""

    vocab: int = 8192
    d_model: int = 256
    n_heads: int = 4
    n_layers: int = 4
    d_ff: int = 1024
    max_len: int = 128
    eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "n_heads", "n_layers", "d_ff", "max_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"DecoderConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if not self.eps > 0:
            raise ValueError(f"eps must be positive, got {self.eps}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def param_shapes(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """Every weight tensor by name, in packing order (per-layer tensors stacked on axis 0)."""
    V, d, H, Dh, L, F, T = cfg.vocab, cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.n_layers, cfg.d_ff, cfg.max_len
    return {
        "wte": (V, d), "wpe": (T, d),
        "ln1_g": (L, d), "ln1_b": (L, d),
        "wq": (L, H, d, Dh), "bq": (L, H, 1, Dh),
        "wkv": (L, 2, H, d, Dh), "bkv": (L, 2, H, 1, Dh),
        "wo": (L, H, Dh, d), "bo": (L, d),
        "ln2_g": (L, d), "ln2_b": (L, d),
        "wfc": (L, d, F), "bfc": (L, F),
        "wproj": (L, F, d), "bproj": (L, d),
        "lnf_g": (d,), "lnf_b": (d,),
        "lm_head": (V, d),
    }  # fmt: skip


def init_weights(cfg: DecoderConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights from `seed` (GPT-2-style scales; norms perturbed so their parameters matter)."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    # Residual-branch outputs are scaled down with depth, as in GPT-2, so the
    # residual stream keeps its scale through the layers.
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    for name, shape in param_shapes(cfg).items():
        if name.endswith("_g"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.startswith("b") or name.endswith("_b"):
            w = 0.02 * rng.standard_normal(shape)
        elif name in ("wo", "wproj"):
            w = resid_std * rng.standard_normal(shape)
        elif name in ("wte", "wpe"):
            w = 0.1 * rng.standard_normal(shape)
        else:
            w = 0.02 * rng.standard_normal(shape)
        out[name] = w.astype(np.float32)
    return out


class ParamLayout:
    """Where each weight tensor lives in the flat parameter buffer."""

    def __init__(self, cfg: DecoderConfig) -> None:
        self.cfg = cfg
        self.slots: dict[str, tuple[int, tuple[int, ...]]] = {}
        offset = 0
        for name, shape in param_shapes(cfg).items():
            self.slots[name] = (offset, shape)
            offset += math.prod(shape)
        self.size = offset

    def pack(self, weights: dict[str, np.ndarray]) -> np.ndarray:
        """One flat float32 array holding every tensor of `weights`."""
        flat = np.empty(self.size, np.float32)
        missing = sorted(set(self.slots) - set(weights))
        if missing:
            raise ValueError(f"weights lack {missing}")
        for name, (offset, shape) in self.slots.items():
            w = np.asarray(weights[name])
            if w.shape != shape:
                raise ValueError(f"weight '{name}' has shape {w.shape}, expected {shape}")
            flat[offset:offset + w.size] = w.reshape(-1)
        return flat

    def views(self, params: engine.DeviceTensor) -> "ModelViews":
        return ModelViews(self, params)


class LayerViews:
    """One layer's weights as device views."""

    def __init__(self, get: dict[str, engine.DeviceTensor], layer: int) -> None:
        self.ln1_g, self.ln1_b = get["ln1_g"][layer], get["ln1_b"][layer]
        self.wq, self.bq = get["wq"][layer], get["bq"][layer]
        self.wkv, self.bkv = get["wkv"][layer], get["bkv"][layer]
        self.wo, self.bo = get["wo"][layer], get["bo"][layer]
        d = self.wo.shape[0] * self.wo.shape[1]
        self.wo_flat = self.wo.reshape(d, self.wo.shape[2])  # [H, Dh, d] is [d, d] for one row
        self.ln2_g, self.ln2_b = get["ln2_g"][layer], get["ln2_b"][layer]
        self.wfc, self.bfc = get["wfc"][layer], get["bfc"][layer]
        self.wproj, self.bproj = get["wproj"][layer], get["bproj"][layer]


class ModelViews:
    """Every weight of the model as a view of the resident parameter buffer.

    Built once per buffer and reused by every run: views are immutable and
    each caches its native argument, which keeps per-step orchestration short.
    """

    def __init__(self, layout: ParamLayout, params: engine.DeviceTensor) -> None:
        self.params = params
        get = {name: params[offset:offset + math.prod(shape)].reshape(shape)
               for name, (offset, shape) in layout.slots.items()}
        self.wte, self.wpe, self.lm_head = get["wte"], get["wpe"], get["lm_head"]
        self.lnf_g, self.lnf_b = get["lnf_g"], get["lnf_b"]
        self.layers = [LayerViews(get, layer) for layer in range(layout.cfg.n_layers)]

    def __iter__(self) -> Iterator[LayerViews]:
        return iter(self.layers)


def build_step_program(cfg: DecoderConfig) -> engine.Program:
    """The engine program that runs S new tokens at positions [pos, pos + S) and picks the next one.

    Parameters:
      ids     In((S,), int32)    the tokens to run: the prompt (a host array) for
                                 prefill, or the view tokens[pos:pos+1] for a decode step
      tokens  InOut((T,), int32) resident sequence: ids land at [pos, pos+S), the
                                 chosen next token at pos+S. Step N+1 embeds what
                                 step N's argmax wrote here, on the device: this
                                 is the cross-run dependency that lets the host
                                 dispatch N+1 before N has finished
      params  In((P,))           resident flat weights (ParamLayout)
      kv      InOut((L, 2, H, T, Dh)) resident KV cache; written at [pos, pos+S)
      out     Out((1,), int32)   the chosen next token, copied back to the host
      pos     Scalar(int)        where the new tokens start (the host knows it in advance)
    """
    layout = ParamLayout(cfg)
    V, d, H, Dh, L, F, T = cfg.vocab, cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.n_layers, cfg.d_ff, cfg.max_len
    eps = cfg.eps
    cached: list[ModelViews] = []

    def model_views(params: engine.DeviceTensor) -> ModelViews:
        if not cached or cached[0].params is not params:
            cached[:] = [layout.views(params)]
        return cached[0]

    @engine.program
    def decoder_step(run: engine.Run, ids: In(("S",), "int32"), tokens: InOut((T,), "int32"),
                     params: In((layout.size,)), kv: InOut((L, 2, H, T, Dh)), out: Out((1,), "int32"),
                     pos: Scalar(int)):
        S = run.dims["S"]
        if not 0 <= pos <= T - S:  # the planning pass runs at pos=0, S=T
            raise ValueError(f"positions [{pos}, {pos + S}) do not fit the KV cache of {T} positions")
        w = model_views(params)
        new = tokens[pos:pos + S]
        if not ids.same_view(new):  # prefill: the prompt joins the resident sequence
            run.submit(K.copy, ids, out=new)

        x = run.scratch(("S", d))  # the residual stream
        h = run.scratch(("S", d))
        q = run.scratch((H, "S", Dh))
        att = run.scratch((H, "S", Dh))
        f = run.scratch(("S", F))
        run.submit(K.embedding, new, w.wte, out=x)
        run.submit(K.add, x, w.wpe[pos:pos + S], out=x)
        for layer, lw in enumerate(w):
            k_cache, v_cache = kv[layer, 0], kv[layer, 1]
            kv_new = kv[layer, :, :, pos:pos + S, :]  # [2, H, S, Dh]
            run.submit(K.layernorm, x, lw.ln1_g, lw.ln1_b, out=h, eps=eps)
            run.submit(K.matmul, h, lw.wq, out=q)
            run.submit(K.add, q, lw.bq, out=q)
            run.submit(K.matmul, h, lw.wkv, out=kv_new)
            run.submit(K.add, kv_new, lw.bkv, out=kv_new)
            # Query i (position pos + i) sees keys [0, pos + i]: causal over kv_len = pos + S.
            run.submit(K.attention, q, k_cache, v_cache, out=att, causal=True, kv_len=pos + S)
            # Output projection accumulated into the residual stream (beta=1).
            if S == 1:  # one row: [H, 1, Dh] is the concatenation of the heads
                run.submit(K.matmul, att.reshape(1, d), lw.wo_flat, out=x, beta=1.0)
            else:
                for head in range(H):
                    run.submit(K.matmul, att[head], lw.wo[head], out=x, beta=1.0)
            run.submit(K.add, x, lw.bo, out=x)
            run.submit(K.layernorm, x, lw.ln2_g, lw.ln2_b, out=h, eps=eps)
            run.submit(K.matmul, h, lw.wfc, out=f)
            run.submit(K.add, f, lw.bfc, out=f)
            run.submit(K.gelu, f, out=f)
            run.submit(K.matmul, f, lw.wproj, out=x, beta=1.0)
            run.submit(K.add, x, lw.bproj, out=x)

        # Only the last position's logits choose the next token.
        last = h[S - 1:S]
        logits = run.scratch((1, V))
        run.submit(K.layernorm, x[S - 1:S], w.lnf_g, w.lnf_b, out=last, eps=eps)
        run.submit(K.matmul, last, w.lm_head, out=logits, transpose_b=True)
        run.submit(K.argmax, logits, out=out)
        if pos + S < T:  # the next step reads it from here
            run.submit(K.copy, out, out=tokens[pos + S:pos + S + 1])

    return decoder_step
