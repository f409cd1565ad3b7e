"""Sentence embeddings with all-MiniLM-L6-v2 on the engine (needs the `models` extra).

    from examples.minilm import MiniLMEncoder
    with MiniLMEncoder() as enc:
        vectors = enc.encode(["a sentence", "another one"])   # [2, 384], unit rows

weights.py loads the bundled model (safetensors, tokenizer, configs), model.py
builds the encoder program, batching.py + service.py serve it over HTTP
(`python -m examples.minilm`).
"""

from examples.minilm.model import MiniLMEncoder

__all__ = ["MiniLMEncoder"]
