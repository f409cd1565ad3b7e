"""all-MiniLM-L6-v2 on the engine against sentence-transformers' encode of the same bundled model."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="needs the models extra: pip install '.[models]'")

from engine import kernels as K  # noqa: E402
from examples.minilm.model import MiniLMEncoder, build_program, column_ranges, row_chunks  # noqa: E402
from examples.minilm.weights import load_config, load_weights, pack_weights  # noqa: E402

from .conftest import MAX_ABS_DIFF, MIN_COSINE, cosine  # noqa: E402


SHORT = [
    "", " ", "\t\n", "a", "?", "🙂", "…", "Hello, world!", "naïve café déjà vu", "中文句子的嵌入向量",
    "Ελληνικά και русский текст", "I ❤️ emojis 🎉🚀 and symbols ∑∫√", "ÅÄÖ åäö ß ø æ",
    "[CLS] [SEP] [PAD] literal special tokens", "UPPER lower MiXeD", "1234567890 3.14159 -42",
    "https://example.com/path?q=1&x=2", "   leading and trailing spaces   ",
    "The quick brown fox jumps over the lazy dog.",
    "A pipelined engine overlaps host orchestration with device execution.",
]
_WORDS = "the cat sat on a mat and then it ran to see my dog in his big red house by our old tree".split()


def words(n_tokens: int, shift: int = 0) -> str:
    """A text of exactly n_tokens tokens with [CLS] and [SEP] (every word here is one token)."""
    return " ".join(_WORDS[(i + shift) % len(_WORDS)] for i in range(n_tokens - 2))


def varied_batches() -> list[list[str]]:
    """1 to 32 sentences per batch, 2 to 128 tokens (plus one past the 256-token truncation).

    Small batches run with matmuls split by columns, larger ones by row chunks (see model.py).
    """
    long = [words(n, shift=n) for n in (3, 9, 17, 33, 64, 100, 127, 128)]
    batch32 = (SHORT + long + [words(n) for n in (5, 50, 90, 120)])[:32]
    return [
        ["Hello, world!"],
        [words(128)],
        ["", "🙂", words(40)],
        [words(128, shift=5), SHORT[10], words(90)],  # two row chunks, the boundary inside sentence 1
        [SHORT[8], words(77), SHORT[11], words(128, shift=3), SHORT[0], SHORT[9], words(2), "x" * 200],
        batch32,
        [words(300), "short one"],  # truncated to 256 tokens, as sentence-transformers does
    ]


def test_config_is_all_minilm_l6_v2(minilm_encoder):
    cfg = load_config(minilm_encoder.model_dir)
    assert (cfg.hidden, cfg.heads, cfg.layers, cfg.intermediate) == (384, 12, 6, 1536)
    assert (cfg.max_positions, cfg.vocab, cfg.type_vocab) == (512, 30522, 2)
    assert cfg.eps == 1e-12 and cfg.max_seq_length == 256
    assert minilm_encoder.dim == 384


def test_token_counts_of_the_varied_set(minilm_encoder):
    assert [len(t) for t in minilm_encoder.tokenize([words(n) for n in (2, 3, 64, 128)])] == [2, 3, 64, 128]
    assert len(minilm_encoder.tokenize([words(300)])[0]) == 256
    assert len(minilm_encoder.tokenize([words(300)], truncate=False)[0]) == 300
    assert len(minilm_encoder.tokenize([""])[0]) == 2  # [CLS] [SEP]


def test_packed_weights_round_trip():
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": rng.standard_normal(7).astype(np.float32)}
    packed = pack_weights(tensors)
    assert packed.layout.entries["b"][0] % 16 == 0  # each tensor starts on a 64-byte line
    for name, t in packed.layout.unpack(packed.flat).items():
        np.testing.assert_array_equal(t, tensors[name])


@pytest.mark.parametrize("batch,seq,parts", [(1, 7, 2), (3, 5, 2), (8, 128, 2), (5, 3, 4), (2, 9, 1), (1, 1, 3)])
def test_row_chunks_cover_every_token_row_once(batch, seq, parts):
    chunks = row_chunks(batch, seq, parts)
    assert chunks[0][0] == 0 and chunks[-1][1] == batch * seq
    for (r0, r1, pieces), nxt in zip(chunks, chunks[1:] + [(batch * seq, None, None)]):
        assert r0 < r1 == nxt[0]
        rows = [b * seq + s for b0, b1, s0, s1 in pieces for b in range(b0, b1) for s in range(s0, s1)]
        assert rows == list(range(r0, r1))
        for b0, b1, s0, s1 in pieces:  # several sequences go together only whole
            assert b1 == b0 + 1 or (s0, s1) == (0, seq)


@pytest.mark.parametrize("n,parts", [(1152, 2), (384, 2), (1536, 3), (20, 4), (16, 2), (384, 1)])
def test_column_ranges_tile_the_columns_on_64_byte_lines(n, parts):
    ranges = column_ranges(n, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == n and 1 <= len(ranges) <= parts
    assert all(c0 < c1 and c0 % 16 == 0 for c0, c1 in ranges)
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert column_ranges(1152, 2) == [(0, 576), (576, 1152)]


def test_matches_sentence_transformers_on_a_varied_set(minilm_encoder, st_minilm):
    batches = varied_batches()
    texts = [t for b in batches for t in b]
    reference = st_minilm.encode(texts, batch_size=32, convert_to_numpy=True)
    got = np.concatenate([minilm_encoder.encode(b) for b in batches])
    assert got.shape == (len(texts), 384) and got.dtype == np.float32
    cos = cosine(got, reference)
    worst = int(np.argmin(cos))
    assert cos.min() >= MIN_COSINE, f"cosine {cos[worst]:.9f} for text {texts[worst]!r}"
    assert np.abs(got - reference).max() <= MAX_ABS_DIFF
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_padding_does_not_change_an_embedding(minilm_encoder):
    alone = minilm_encoder.encode(["Hello, world!"])
    # Padded to 128 tokens next to a long sentence, in either row chunk.
    for batch in (["Hello, world!", words(128)], [words(128), words(100), "Hello, world!"]):
        padded = minilm_encoder.encode(batch)[batch.index("Hello, world!")]
        assert cosine(padded, alone[0]) >= MIN_COSINE


def test_runs_pad_to_a_multiple_of_seq_multiple_and_the_positions_added_change_nothing(minilm_encoder, request):
    enc = minilm_encoder
    assert enc.seq_multiple == 1 and enc.padded_length(13) == 13  # the default: exactly the longest
    enc.seq_multiple = 8
    request.addfinalizer(lambda: setattr(enc, "seq_multiple", 1))
    assert [enc.padded_length(n) for n in (1, 8, 9, 15, 16, 17, 250, 255, 256)] == [8, 8, 16, 16, 16, 24, 256, 256, 256]
    toks = enc.tokenize(["Is the station far?", "and a somewhat longer sentence about the old harbour and its boats"])
    longest = max(len(t) for t in toks)
    assert longest % 8  # so padding adds positions
    ids, mask = enc.pad(toks)
    assert ids.shape == mask.shape == (2, enc.padded_length(longest)) and mask.sum() == sum(len(t) for t in toks)
    exact_ids, exact_mask = ids[:, :longest].copy(), mask[:, :longest].copy()
    np.testing.assert_allclose(enc.runtime(ids, mask, enc.params), enc.runtime(exact_ids, exact_mask, enc.params),
                               rtol=0, atol=MAX_ABS_DIFF)
    with pytest.raises(ValueError, match="seq_multiple"):
        MiniLMEncoder(seq_multiple=0)


def test_encode_keeps_input_order_across_several_runs(minilm_encoder):
    texts = [words(2 + (7 * i) % 120, shift=i) for i in range(45)]  # 2 runs of at most 32, sorted by length
    got = minilm_encoder.encode(texts)
    one_by_one = np.concatenate([minilm_encoder.encode([t]) for t in texts[:5]])
    assert got.shape == (45, 384)
    assert cosine(got[:5], one_by_one).min() >= MIN_COSINE


def test_encode_checks_its_argument(minilm_encoder):
    assert minilm_encoder.encode([]).shape == (0, 384)
    with pytest.raises(TypeError, match="list of strings"):
        minilm_encoder.encode("a single string")
    with pytest.raises(TypeError, match="text 1 is a int"):
        minilm_encoder.encode(["fine", 3])


@pytest.mark.anyio
async def test_aencode_from_concurrent_tasks(minilm_encoder):
    texts = [[SHORT[i], words(10 + 9 * i, shift=i)] for i in range(6)]
    expected = [minilm_encoder.encode(t) for t in texts]
    results: dict[int, np.ndarray] = {}

    async def one(i: int) -> None:
        results[i] = await minilm_encoder.aencode(texts[i])

    async with minilm_encoder.open_async():
        with pytest.raises(RuntimeError, match="aencode"):
            minilm_encoder.encode(["not while the async runtime drives the engine"])
        async with anyio.create_task_group() as tg:
            for i in range(len(texts)):
                tg.start_soon(one, i)
    for i, exp in enumerate(expected):
        assert cosine(results[i], exp).min() >= MIN_COSINE
    with pytest.raises(RuntimeError, match="open_async"):
        await minilm_encoder.aencode(["closed again"])


def _kernels_of_one_run(enc, texts: list[str]) -> set[str]:
    ids, mask = enc.pad(enc.tokenize(texts))
    return _kernels_of_one_run_on(enc.runtime, ids, mask, enc.params)


def _kernels_of_one_run_on(rt, ids: np.ndarray, mask: np.ndarray, params) -> set[str]:
    rt.set_tracing(True)
    try:
        rt(ids, mask, params)
        _, events = rt.drain_trace()
    finally:
        rt.set_tracing(False)
    return {e[5] for e in events}


def test_matmuls_read_the_panel_packed_weights_where_that_kernel_outruns_sgemm(minilm_encoder):
    # 2 x 6 tokens: every matmul task has 12 rows, the packed kernel's case on every CPU (the varied set
    # above checks the embeddings against sentence-transformers).
    few = _kernels_of_one_run(minilm_encoder, ["Hello, world!", "a b c d"])
    assert "matmul_packed" in few and not few & {"matmul", "gelu"}  # bias and GELU: the packed matmul's epilogue
    many = _kernels_of_one_run(minilm_encoder, [words(128, shift=i) for i in range(4)])
    if K.packed_max_rows() is None:  # AVX-512: the packed kernel at any row count
        assert "matmul_packed" in many and not many & {"matmul", "gelu"}
    else:
        assert {"matmul", "gelu"} <= many and "matmul_packed" not in many


def test_the_sgemm_path_computes_what_the_packed_path_does(minilm_encoder):
    """The program with packed_max_rows=0 (sgemm, separate bias and GELU tasks) against the default one,
    so the path a CPU without AVX-512 takes at many rows stays checked on one that has it."""
    enc = minilm_encoder
    ids, mask = enc.pad(enc.tokenize([words(40, shift=i) for i in range(3)] + ["short"]))
    expected = enc.runtime(ids, mask, enc.params)
    weights = load_weights(enc.model_dir, enc.config)
    program = build_program(enc.config, weights.layout, packed_max_rows=0)
    with program.prepare(bounds={"B": enc.max_batch, "S": enc.max_seq_length}) as rt:
        params = rt.alloc_tensor((weights.layout.size,), "float32", init=weights.flat)
        assert "matmul" in _kernels_of_one_run_on(rt, ids, mask, params)
        got = rt(ids, mask, params)
    assert cosine(got, expected).min() >= MIN_COSINE
    assert np.abs(got - expected).max() <= MAX_ABS_DIFF
