"""The same decoder in plain torch, greedy: the ground truth for the engine version.

It shares nothing with the engine program but the weights. It reshapes the
engine's head-major weight layout to the usual [in, out] matrices and
recomputes the whole sequence at every step (no KV cache), so a bug in the
engine's cache handling cannot hide in both.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from examples.decoder.model import DecoderConfig

__all__ = ["ReferenceDecoder"]


class ReferenceDecoder:
    """forward(ids) -> logits [S, V]; generate(prompt, n) -> the n greedy tokens; keys_values(ids)."""

    def __init__(self, cfg: DecoderConfig, weights: dict[str, np.ndarray]) -> None:
        self.cfg = cfg
        d, H, Dh = cfg.d_model, cfg.n_heads, cfg.head_dim

        def t(name: str) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(weights[name], dtype=np.float32))

        def heads_to_matrix(w: torch.Tensor) -> torch.Tensor:  # [H, d, Dh] -> [d, H*Dh]
            return w.permute(1, 0, 2).reshape(d, H * Dh)

        self.wte, self.wpe, self.lm_head = t("wte"), t("wpe"), t("lm_head")
        self.lnf = (t("lnf_g"), t("lnf_b"))
        wq, bq, wkv, bkv = t("wq"), t("bq"), t("wkv"), t("bkv")
        self.layers = []
        for i in range(cfg.n_layers):
            self.layers.append({
                "ln1": (t("ln1_g")[i], t("ln1_b")[i]),
                "wq": heads_to_matrix(wq[i]), "bq": bq[i].reshape(d),
                "wk": heads_to_matrix(wkv[i, 0]), "bk": bkv[i, 0].reshape(d),
                "wv": heads_to_matrix(wkv[i, 1]), "bv": bkv[i, 1].reshape(d),
                "wo": t("wo")[i].reshape(d, d), "bo": t("bo")[i],
                "ln2": (t("ln2_g")[i], t("ln2_b")[i]),
                "wfc": t("wfc")[i], "bfc": t("bfc")[i],
                "wproj": t("wproj")[i], "bproj": t("bproj")[i],
            })  # fmt: skip

    def forward(self, ids: Sequence[int]) -> torch.Tensor:
        """Logits [S, V] for every position of `ids` (causal)."""
        return self._run(ids)[0]

    def next_token(self, ids: Sequence[int]) -> int:
        """The greedy choice after `ids`: the first maximum of the last position's logits."""
        return int(torch.argmax(self._run(ids, last_only=True)[0][-1]))

    def keys_values(self, ids: Sequence[int]) -> np.ndarray:
        """What a KV cache holds after `ids`: [L, 2, H, S, Dh] (keys, values per layer)."""
        return self._run(ids)[1].numpy()

    @torch.inference_mode()
    def _run(self, ids: Sequence[int], last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        S, d, H, Dh = len(ids), cfg.d_model, cfg.n_heads, cfg.head_dim
        if not 1 <= S <= cfg.max_len:
            raise ValueError(f"sequence of {S} tokens does not fit {cfg.max_len} positions")
        x = self.wte[torch.tensor(list(ids), dtype=torch.long)] + self.wpe[:S]
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        kv = []
        for p in self.layers:
            h = F.layer_norm(x, (d,), *p["ln1"], eps=cfg.eps)
            q = (h @ p["wq"] + p["bq"]).view(S, H, Dh).transpose(0, 1)
            k = (h @ p["wk"] + p["bk"]).view(S, H, Dh).transpose(0, 1)
            v = (h @ p["wv"] + p["bv"]).view(S, H, Dh).transpose(0, 1)
            kv.append(torch.stack([k, v]))
            scores = (q @ k.transpose(1, 2)) / np.sqrt(Dh)
            scores = scores.masked_fill(~causal, float("-inf"))
            att = (scores.softmax(dim=-1) @ v).transpose(0, 1).reshape(S, d)
            x = x + (att @ p["wo"] + p["bo"])
            h = F.layer_norm(x, (d,), *p["ln2"], eps=cfg.eps)
            x = x + (F.gelu(h @ p["wfc"] + p["bfc"]) @ p["wproj"] + p["bproj"])
        if last_only:
            x = x[-1:]
        h = F.layer_norm(x, (d,), *self.lnf, eps=cfg.eps)
        return h @ self.lm_head.T, torch.stack(kv)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy: each new token is the argmax of the last position's logits (first maximum on ties)."""
        ids = [int(i) for i in prompt_ids]
        for _ in range(max_new_tokens):
            ids.append(self.next_token(ids))
        return ids[len(prompt_ids):]
