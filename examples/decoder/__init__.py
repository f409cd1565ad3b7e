"""A small decoder-only transformer streamed token by token through the engine.

    from examples.decoder import Decoder
    async with Decoder() as dec:
        async for token in dec.astream(prompt_ids, 32):
            ...

model.py holds the configuration, the weights (from a fixed seed) and the
step program; decoder.py the pipelined generation loop; reference.py the same
model in torch (needs the `models` extra); vocab.py a toy vocabulary to turn
ids into text.
"""

from examples.decoder.decoder import Decoder
from examples.decoder.model import DecoderConfig, ParamLayout, build_step_program, init_weights

__all__ = ["Decoder", "DecoderConfig", "ParamLayout", "build_step_program", "init_weights"]
