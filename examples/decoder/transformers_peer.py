"""The same decoder as Hugging Face transformers' GPT2LMHeadModel: what a user would run instead.

The example's architecture is GPT-2's (pre-LayerNorm blocks, learned positions,
one fused QKV projection, exact erf GELU) with an untied LM head, so
transformers runs it as a GPT2LMHeadModel configured to match and loaded with
the same weights; its `generate` (greedy, with its KV cache) is the peer the
decode benchmark measures Tandem against, and its tokens must be Tandem's.
Needs `transformers` (it comes with the `models` extra's sentence-transformers).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from examples.decoder.model import DecoderConfig

__all__ = ["gpt2_from_weights", "gpt2_generate"]


def gpt2_from_weights(cfg: DecoderConfig, weights: dict[str, np.ndarray]) -> Any:
    """A GPT2LMHeadModel (eval mode, float32) computing what the engine's decoder computes."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    d, H, Dh, L = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.n_layers
    config = GPT2Config(vocab_size=cfg.vocab, n_positions=cfg.max_len, n_embd=d, n_layer=L, n_head=H,
                        n_inner=cfg.d_ff, activation_function="gelu", layer_norm_epsilon=cfg.eps,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = GPT2LMHeadModel(config).eval()

    def heads_to_matrix(w: np.ndarray) -> np.ndarray:  # [H, d, Dh] -> [d, H * Dh]: GPT-2's column order
        return w.transpose(1, 0, 2).reshape(d, H * Dh)

    state: dict[str, np.ndarray] = {"transformer.wte.weight": weights["wte"], "transformer.wpe.weight": weights["wpe"],
                                    "transformer.ln_f.weight": weights["lnf_g"], "transformer.ln_f.bias": weights["lnf_b"],
                                    "lm_head.weight": weights["lm_head"]}
    for i in range(L):
        p = f"transformer.h.{i}."
        wq, wkv = weights["wq"][i], weights["wkv"][i]
        state.update({
            p + "ln_1.weight": weights["ln1_g"][i], p + "ln_1.bias": weights["ln1_b"][i],
            # Conv1D weights are [in, out]: x @ W + b, the engine's layout.
            p + "attn.c_attn.weight": np.concatenate(
                [heads_to_matrix(wq), heads_to_matrix(wkv[0]), heads_to_matrix(wkv[1])], axis=1),
            p + "attn.c_attn.bias": np.concatenate(
                [weights["bq"][i].reshape(d), weights["bkv"][i, 0].reshape(d), weights["bkv"][i, 1].reshape(d)]),
            p + "attn.c_proj.weight": weights["wo"][i].reshape(d, d), p + "attn.c_proj.bias": weights["bo"][i],
            p + "ln_2.weight": weights["ln2_g"][i], p + "ln_2.bias": weights["ln2_b"][i],
            p + "mlp.c_fc.weight": weights["wfc"][i], p + "mlp.c_fc.bias": weights["bfc"][i],
            p + "mlp.c_proj.weight": weights["wproj"][i], p + "mlp.c_proj.bias": weights["bproj"][i],
        })  # fmt: skip
    tensors = {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32)) for k, v in state.items()}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    # Only non-persistent attention buffers (causal masks) may be left to the model's own init.
    left = [k for k in missing if not k.endswith((".attn.bias", ".attn.masked_bias"))]
    if left or unexpected:
        raise RuntimeError(f"GPT-2 weights do not map: missing {left}, unexpected {unexpected}")
    return model


def gpt2_generate(model: Any, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate with its KV cache: the new tokens after the prompt."""
    import torch

    ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens, do_sample=False, num_beams=1, use_cache=True,
                             pad_token_id=0)
    return [int(t) for t in out[0, len(prompt_ids):]]
