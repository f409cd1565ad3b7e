"""A toy vocabulary: a deterministic text piece per token id, so generated ids can be shown as text.

Pieces look like a subword vocabulary's: pronounceable fragments, some
starting a new word (a leading space), a few punctuation marks. The model is
random, so the text is gibberish; what matters is that turning ids into text
is the same kind of host work a real detokeniser does while tokens stream.
"""

from __future__ import annotations

from typing import Iterable

import numpy as np

__all__ = ["ToyVocab", "Detokenizer"]

_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiouy"
_PUNCT = (".", ",", "!", "?", ";", ":", "\n")


class ToyVocab:
    """`size` distinct pieces drawn from `seed`."""

    def __init__(self, size: int, seed: int = 0) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"vocabulary size must be a positive int, got {size!r}")
        rng = np.random.default_rng(seed)
        pieces: list[str] = list(_PUNCT[:size])
        seen = set(pieces)
        while len(pieces) < size:  # draws in batches; duplicates are skipped
            batch = 2 * (size - len(pieces)) + 16
            n_syl = rng.integers(1, 4, batch)
            cons = rng.integers(0, len(_CONSONANTS), (batch, 3))
            vows = rng.integers(0, len(_VOWELS), (batch, 3))
            space = rng.random(batch) < 0.5
            for i in range(batch):
                piece = (" " if space[i] else "") + "".join(
                    _CONSONANTS[cons[i, j]] + _VOWELS[vows[i, j]] for j in range(n_syl[i]))
                if piece not in seen and len(pieces) < size:
                    seen.add(piece)
                    pieces.append(piece)
        self.pieces: tuple[str, ...] = tuple(pieces)

    def __len__(self) -> int:
        return len(self.pieces)

    def piece(self, token: int) -> str:
        return self.pieces[token]

    def decode(self, ids: Iterable[int]) -> str:
        return "".join(self.pieces[i] for i in ids).lstrip(" ")


class Detokenizer:
    """Incremental detokenising: push one id, get the text it adds to what was shown so far."""

    def __init__(self, vocab: ToyVocab) -> None:
        self.vocab = vocab
        self.text = ""

    def push(self, token: int) -> str:
        piece = self.vocab.piece(token)
        if not self.text:  # the first word of a stream has no leading space
            piece = piece.lstrip(" ")
        self.text += piece
        return piece
