"""python -m examples.decoder: stream a greedy continuation as text, token by token.

    python -m examples.decoder [--prompt "some text ids"] [--tokens 48] [--depth 2] [--check]

--check also runs the torch reference (the `models` extra) and compares the ids.
"""

from __future__ import annotations

import argparse
import sys
import time

import anyio
import numpy as np

from examples.decoder import Decoder, DecoderConfig
from examples.decoder.vocab import Detokenizer, ToyVocab


async def stream(dec: Decoder, vocab: ToyVocab, prompt: list[int], n: int) -> list[int]:
    detok = Detokenizer(vocab)
    print(f"prompt: {vocab.decode(prompt)!r}\n---")
    out = []
    t0 = time.perf_counter()
    async with dec:
        async for token in dec.astream(prompt, n):
            sys.stdout.write(detok.push(token))
            sys.stdout.flush()
            out.append(token)
        stats = dec.stats()
    elapsed = time.perf_counter() - t0
    print(f"\n---\n{n} tokens in {elapsed:.2f} s ({n / elapsed:.0f} tokens/s, depth {dec.depth}); "
          f"orchestration p50 {stats.orchestration.p50 * 1e3:.2f} ms, device p50 {stats.device.p50 * 1e3:.2f} ms")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.decoder", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", default=None, help="space-separated token ids (default: 8 ids from --seed)")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="compare with the torch reference")
    args = ap.parse_args(argv)
    cfg = DecoderConfig()
    if args.prompt is None:
        prompt = np.random.default_rng(args.seed).integers(0, cfg.vocab, 8).tolist()
    else:
        prompt = [int(t) for t in args.prompt.split()]
    dec = Decoder(cfg, seed=args.seed, depth=args.depth)
    try:
        tokens = anyio.run(stream, dec, ToyVocab(cfg.vocab, args.seed), prompt, args.tokens)
    except ValueError as e:  # a request the cache or the vocabulary cannot take (the decoder is closed)
        ap.error(str(e))
    if args.check:
        from examples.decoder.reference import ReferenceDecoder

        expected = ReferenceDecoder(cfg, dec.weights).generate(prompt, args.tokens)
        if tokens != expected:
            print("MISMATCH: the torch reference chose different tokens")
            return 1
        print("OK: identical to the torch reference")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
