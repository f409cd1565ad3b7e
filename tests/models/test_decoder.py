"""The streaming decoder example (examples/decoder): exact greedy agreement with torch, the
resident KV cache and token sequence, pipelined streaming, and request errors."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")

from examples.decoder import Decoder, DecoderConfig, init_weights  # noqa: E402
from examples.decoder.reference import ReferenceDecoder  # noqa: E402
from examples.decoder.vocab import Detokenizer, ToyVocab  # noqa: E402

CFG = DecoderConfig()  # 4 layers, width 256, 4 heads, vocab 8192, a cache of 128 positions
T = CFG.max_len


def prompt_of(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, CFG.vocab, length).tolist()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def weights() -> dict[str, np.ndarray]:
    return init_weights(CFG, seed=0)


@pytest.fixture(scope="module")
def reference(weights):
    """The torch model, on one thread: the tests run next to the engine's pool on small machines,
    where torch's intra-op threads would fight it for the cores."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield ReferenceDecoder(CFG, weights)
    finally:
        torch.set_num_threads(threads)


# Prompts and lengths checked against torch: two fill the cache to its last position.
CASES = [((1, 1), T - 1), ((40, 2), T - 40), ((7, 3), 25), ((100, 4), 3)]


@pytest.fixture(scope="module")
def expected(reference) -> list[tuple[list[int], int, list[int]]]:
    """(prompt, n, torch's greedy tokens) per case, computed once."""
    out = []
    for (length, seed), n in CASES:
        prompt = prompt_of(length, seed)
        out.append((prompt, n, reference.generate(prompt, n)))
    return out


@pytest.fixture(scope="module")
def decoder(weights):
    """A depth-2 decoder shared by the tests that use it synchronously."""
    with Decoder(CFG, weights, depth=2) as dec:
        yield dec


# -- the model ------------------------------------------------------------------------------
def test_weights_come_from_the_seed():
    a, b, c = init_weights(CFG, seed=0), init_weights(CFG, seed=0), init_weights(CFG, seed=1)
    assert set(a) == set(b) == set(c)
    for name in a:
        assert a[name].dtype == np.float32
        np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(a["wq"], c["wq"])


def test_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="divisible"):
        DecoderConfig(d_model=250, n_heads=4)
    with pytest.raises(ValueError, match="max_len"):
        DecoderConfig(max_len=0)


# -- exactness against torch -------------------------------------------------------------------
@pytest.mark.parametrize("depth, workers", [(1, 1), (2, 1), (3, 2)])
def test_generate_equals_torch_greedy_up_to_the_cache_size(weights, expected, depth, workers):
    """Several prompts and lengths (CASES), two of them filling the cache to its last position.

    More workers and a deeper pipeline give step N+1 every chance to run early; only the
    engine's cross-run dependencies (tokens, KV cache) keep it in order.
    """
    with Decoder(CFG, weights, depth=depth, workers=workers) as dec:
        for prompt, n, want in expected:
            assert dec.generate(prompt, n) == want, f"prompt of {len(prompt)} tokens, {n} new"


def test_generated_tokens_vary(decoder, reference):
    """Guards the test above against a degenerate model that repeats one token."""
    got = decoder.generate(prompt_of(5, 5), 60)
    assert len(set(got)) > 30


def test_resident_state_after_generation_matches_torch(decoder, reference):
    prompt = prompt_of(9, 6)
    got = decoder.generate(prompt, 30)
    seq = prompt + got
    np.testing.assert_array_equal(decoder.tokens.to_numpy()[:len(seq)], seq)
    # The cache holds every position that was run (the last token was chosen, never run).
    kv = decoder.kv_cache.to_numpy()[:, :, :, :len(seq) - 1]
    np.testing.assert_allclose(kv, reference.keys_values(seq[:-1]), rtol=0, atol=1e-5)


# -- running out of cache ----------------------------------------------------------------------
def test_running_out_of_cache_raises_before_anything_runs(decoder, reference):
    """A prompt of all but two positions: one prefill run and one decode step fill the cache; one more
    token is refused before any step is dispatched."""
    prompt = prompt_of(T - 2, 8)
    before = decoder.tokens.to_numpy()
    with pytest.raises(ValueError, match=r"out of KV cache.*126 tokens plus 3 new.*max_len=128.*at most 2 new"):
        decoder.generate(prompt, 3)
    np.testing.assert_array_equal(decoder.tokens.to_numpy(), before)  # nothing was dispatched
    assert decoder.generate(prompt, 2) == reference.generate(prompt, 2)


@pytest.mark.anyio
async def test_astream_out_of_cache_raises_at_the_call_before_dispatching(weights):
    async with Decoder(CFG, weights) as dec:
        with pytest.raises(ValueError, match="out of KV cache"):
            dec.astream([1, 2, 3], T)
        assert dec.stats().dispatched == 0


# -- streaming -----------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_astream_yields_each_token_while_later_steps_are_already_dispatched(weights, reference):
    prompt, n, depth = prompt_of(4, 9), 20, 2
    expected = reference.generate(prompt, n)
    async with Decoder(CFG, weights, depth=depth) as dec:
        got = []
        async for token in dec.astream(prompt, n):
            # When token k reaches us, steps up to k + depth have been dispatched: the host
            # never waited for a token before dispatching the step that consumes it.
            assert dec.stats().dispatched == min(n, len(got) + 1 + depth)
            got.append(token)
        assert got == expected
        stats = dec.stats()
        assert stats.completed == n and stats.failed == 0 and stats.in_flight == 0


@pytest.mark.anyio
async def test_leaving_the_stream_early_cancels_the_rest_and_the_decoder_stays_usable(weights, reference):
    prompt, depth = prompt_of(6, 10), 3
    async with Decoder(CFG, weights, depth=depth) as dec:
        stream = dec.astream(prompt, 50)
        got = []
        async for token in stream:
            got.append(token)
            if len(got) == 3:
                break
        await stream.aclose()
        assert got == reference.generate(prompt, 3)
        assert dec.stats().dispatched == 3 + depth  # the steps in flight at the break; none after
        assert await dec.agenerate(prompt, 12) == reference.generate(prompt, 12)
        stats = dec.stats()
        assert stats.failed == 0 and stats.in_flight == 0
        assert stats.completed + stats.cancelled == stats.dispatched == 3 + depth + 12


@pytest.mark.anyio
async def test_one_generation_at_a_time(weights):
    async with Decoder(CFG, weights) as dec:
        first = dec.astream([1, 2], 5)
        assert isinstance(await first.__anext__(), int)
        with pytest.raises(RuntimeError, match="one sequence at a time"):
            await dec.astream([3, 4], 5).__anext__()
        with pytest.raises(RuntimeError, match="astream"):
            dec.generate([1], 1)
        rest = [t async for t in first]
        assert len(rest) == 4


def test_astream_needs_async_with(decoder):
    with pytest.raises(RuntimeError, match="async with"):
        decoder.astream([1], 1)


# -- request validation ----------------------------------------------------------------------------
@pytest.mark.parametrize("prompt, n, error, match", [
    ([], 3, ValueError, "empty"),
    ([1, CFG.vocab], 3, ValueError, "outside the vocabulary"),
    ([-1], 3, ValueError, "outside the vocabulary"),
    ([1], -1, ValueError, ">= 0"),
    ([1], 2.0, TypeError, "must be an int"),
    ([[1, 2]], 2, TypeError, "1-D"),
    ([1.5], 2, TypeError, "1-D sequence of ints"),
])  # fmt: skip
def test_bad_requests_are_rejected(decoder, prompt, n, error, match):
    with pytest.raises(error, match=match):
        decoder.generate(prompt, n)


def test_zero_new_tokens(decoder):
    assert decoder.generate([1, 2], 0) == []


def test_closed_decoder_rejects_generation(weights):
    dec = Decoder(CFG, weights)
    dec.close()
    dec.close()  # idempotent
    assert dec.closed
    import engine

    with pytest.raises(engine.ClosedError):
        dec.generate([1], 1)


# -- the toy vocabulary ------------------------------------------------------------------------------
def test_toy_vocab_is_deterministic_and_detokenises_incrementally():
    vocab = ToyVocab(CFG.vocab, seed=0)
    assert len(vocab) == len(set(vocab.pieces)) == CFG.vocab
    assert ToyVocab(CFG.vocab, seed=0).pieces == vocab.pieces
    ids = [100, 200, 300, 400]
    detok = Detokenizer(vocab)
    deltas = [detok.push(i) for i in ids]
    assert "".join(deltas) == detok.text == vocab.decode(ids)
    assert not detok.text.startswith(" ")


# -- the benchmark ------------------------------------------------------------------------------------
def test_decode_benchmark_runs_and_reports_its_figures(tmp_path):
    """A tiny run of benchmarks/decode.py: the figures exist and are finite; no speed is asserted."""
    import json
    import math
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "decode.py"
    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, str(script), "--quick", "--tokens", "6", "--reps", "1", "--json", str(out),
                           "--peers", "--rounds", "1"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "OK: depth 1 and depth 2 streamed the same tokens" in proc.stdout
    data = json.loads(out.read_text())
    assert data["benchmark"] == "decode"
    figures = data["figures"]
    assert [d["depth"] for d in figures["depths"]] == [1, 2]
    for d in figures["depths"]:
        assert d["steps"] == 6
        for key in ("t_host_ms", "t_device_ms", "orchestration_ms_p50", "host_step_us_p50"):
            assert math.isfinite(d[key]) and d[key] > 0, key
        assert d["tokens_per_s"]["median"] > 0
    for key in ("speedup_depth2_over_depth1", "overlap_figure", "bound_tokens_per_s"):
        assert math.isfinite(figures[key]) and figures[key] > 0, key
    peers = figures["transformers"]  # in separate processes; the script fails unless the tokens agree
    assert peers["tokens_identical"] and peers["tandem_over_transformers"] > 0
    assert set(peers["tokens_per_s"]) == {"tandem", "transformers"}


def test_transformers_gpt2_with_the_same_weights_generates_the_same_tokens(weights, decoder):
    """The decode benchmark's peer is this model: transformers' own GPT-2 code, cached greedy generate."""
    pytest.importorskip("transformers", reason="needs the models extra: pip install '.[models]'")
    from examples.decoder.transformers_peer import gpt2_from_weights, gpt2_generate

    model = gpt2_from_weights(CFG, weights)
    for (length, seed), n in [((8, 5), 24), ((1, 6), 12), ((60, 7), 10)]:
        prompt = prompt_of(length, seed)
        assert gpt2_generate(model, prompt, n) == decoder.generate(prompt, n)


def test_the_command_line_demo_streams_text_and_checks_torch(capsys):
    from examples.decoder.__main__ import main

    assert main(["--tokens", "5", "--check"]) == 0
    out = capsys.readouterr().out
    assert "5 tokens in" in out and "OK: identical to the torch reference" in out
    with pytest.raises(SystemExit):
        main(["--tokens", str(T)])
    assert "out of KV cache" in capsys.readouterr().err
