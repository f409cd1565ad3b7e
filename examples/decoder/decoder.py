"""Decoder: greedy generation with the step program, pipelined across steps.

Every generated token is one run of the step program (model.py). Prefill is
a run over the whole prompt; each decode step is a run over one token. The
host never waits for step N's token before dispatching step N+1: the token is
chosen on the device (argmax) into the resident `tokens` tensor, and step N+1
embeds it from there. The engine's cross-run dependency tracking orders the
two runs (and the KV cache writes and reads) on the device, while the host
already orchestrates step N+1 and streams token N-1 to its consumer.

    with Decoder() as dec:                      # synchronous use
        ids = dec.generate([1, 2, 3], 20)

    async with Decoder() as dec:                # async use: tokens as they are produced
        async for token in dec.astream([1, 2, 3], 20):
            ...
"""

from __future__ import annotations

from collections import deque
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

import numpy as np

import engine
from examples.decoder.model import DecoderConfig, ParamLayout, build_step_program, init_weights
from scheduler import AsyncRuntime, RunFuture, Stats

__all__ = ["Decoder"]

# One step to dispatch: the ids argument (the prompt, or a view of the resident
# tokens) and the position of its first token.
Step = tuple[Any, int]


class Decoder:
    """A prepared decoder with its weights, KV cache and token sequence resident on the device.

    depth: how many steps may be in flight (2 overlaps step N+1's
    orchestration with step N's device work; 1 does not).
    workers: device worker threads. One step is a chain of dependent kernels,
    so a second worker adds little, and on a small machine its tasks share
    the event loop's core (README, "Choosing `workers`").
    capture: record each step's orchestration once per (position, length) and
    replay it natively after (engine.capture): a decode step then costs the
    host no Python orchestration. Enough recordings are kept for every
    position of one sequence and its prefills.
    """

    def __init__(self, config: DecoderConfig | None = None, weights: dict[str, np.ndarray] | None = None, *,
                 seed: int = 0, depth: int = 2, workers: int | None = 1, capture: bool = True) -> None:
        self.config = cfg = config or DecoderConfig()
        self.weights = weights if weights is not None else init_weights(cfg, seed)
        layout = ParamLayout(cfg)
        packed = layout.pack(self.weights)
        self.program = build_step_program(cfg)
        self.runtime = self.program.prepare(depth=depth, workers=workers, bounds={"S": cfg.max_len},
                                            capture=capture, capture_limit=2 * cfg.max_len + 64)
        try:
            self._params = self.runtime.alloc_tensor((layout.size,), "float32", init=packed)
            kv_shape = (cfg.n_layers, 2, cfg.n_heads, cfg.max_len, cfg.head_dim)
            self._kv = self.runtime.alloc_tensor(kv_shape, "float32", init=np.zeros(kv_shape, np.float32))
            self._tokens = self.runtime.alloc_tensor((cfg.max_len,), "int32",
                                                     init=np.zeros(cfg.max_len, np.int32))
        except BaseException:
            self.runtime.close()
            raise
        # The decode steps' ids argument for each position: views are immutable
        # and cache their native argument, so each is built once.
        self._next_ids = [self._tokens[p:p + 1] for p in range(cfg.max_len)]
        self._art: AsyncRuntime | None = None
        self._busy = False

    # -- lifecycle ------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        return self.runtime.depth

    @property
    def closed(self) -> bool:
        return self.runtime.closed

    def close(self) -> None:
        """Drains steps in flight and frees the device. Idempotent."""
        self.runtime.close()

    def __enter__(self) -> "Decoder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    async def __aenter__(self) -> "Decoder":
        """Drives the runtime from this event loop (for astream); closes the decoder on exit."""
        if self._art is not None:
            raise RuntimeError("this Decoder is already entered with `async with`")
        art = AsyncRuntime(self.runtime)
        await art.__aenter__()
        self._art = art
        return self

    async def __aexit__(self, *exc: Any) -> None:
        art, self._art = self._art, None
        try:
            if art is not None:
                await art.__aexit__(*exc)
        finally:
            self.close()

    @property
    def kv_cache(self) -> engine.DeviceTensor:
        """The resident KV cache [L, 2, H, max_len, Dh]; positions past the sequence hold stale values."""
        return self._kv

    @property
    def tokens(self) -> engine.DeviceTensor:
        """The resident token sequence [max_len]: the prompt, then each chosen token."""
        return self._tokens

    def stats(self) -> Stats:
        """Timings of the steps streamed so far (scheduler.Stats): orchestration, device, overlap."""
        return self._async_runtime().stats()

    # -- generation -------------------------------------------------------------------------
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """The next `max_new_tokens` greedy tokens after `prompt_ids` (blocking; steps still pipelined)."""
        if self._art is not None:
            raise RuntimeError("inside `async with`, use astream() or agenerate(): a blocking generate() "
                               "would stall the event loop that drives the runtime")
        steps = self._plan(prompt_ids, max_new_tokens)
        return list(self._sync_tokens(steps))

    def astream(self, prompt_ids: Sequence[int], max_new_tokens: int) -> AsyncIterator[int]:
        """An async iterator over the greedy continuation, one token id as soon as each step completes.

        A bad request (empty prompt, an id outside the vocabulary, more tokens
        than the KV cache holds) raises ValueError here, before any step is
        dispatched. Leaving the loop early cancels the steps still in flight.
        """
        art = self._async_runtime()
        steps = self._plan(prompt_ids, max_new_tokens)
        return self._async_tokens(art, steps)

    async def agenerate(self, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """astream() collected into a list."""
        return [token async for token in self.astream(prompt_ids, max_new_tokens)]

    # -- internals ----------------------------------------------------------------------------
    def _async_runtime(self) -> AsyncRuntime:
        if self._art is None:
            raise RuntimeError("enter the decoder first: `async with Decoder(...) as dec:`")
        return self._art

    def _plan(self, prompt_ids: Sequence[int], max_new_tokens: int) -> list[Step]:
        """Validates a request and lists its steps: prefill over the prompt, then one step per token."""
        cfg = self.config
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
            raise TypeError(f"max_new_tokens must be an int, not {type(max_new_tokens).__name__}")
        prompt = np.asarray(prompt_ids)
        if prompt.ndim != 1 or not (prompt.size == 0 or np.issubdtype(prompt.dtype, np.integer)):
            raise TypeError(f"prompt_ids must be a 1-D sequence of ints, got {prompt.dtype} of shape {prompt.shape}")
        n, P = int(max_new_tokens), prompt.size
        if P == 0:
            raise ValueError("prompt_ids is empty: the first step needs at least one token")
        if n < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {n}")
        bad = (prompt < 0) | (prompt >= cfg.vocab)
        if bad.any():
            raise ValueError(f"prompt id {int(prompt[bad][0])} is outside the vocabulary [0, {cfg.vocab})")
        if P + n > cfg.max_len:
            raise ValueError(f"out of KV cache: a prompt of {P} tokens plus {n} new tokens is {P + n} positions, "
                             f"the cache holds max_len={cfg.max_len} (at most {cfg.max_len - P} new tokens "
                             "for this prompt)")
        if n == 0:
            return []
        steps: list[Step] = [(prompt.astype(np.int32), 0)]
        # Step i runs the token step i-1 chose, at position P + i - 1.
        steps += [(self._next_ids[P + i - 1], P + i - 1) for i in range(1, n)]
        return steps

    def _args(self, step: Step) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ids, pos = step
        if pos + ids.shape[0] > self.config.max_len:  # _plan rules this out; never dispatch past the cache
            raise ValueError(f"out of KV cache: step at position {pos} needs {ids.shape[0]} of "
                             f"{self.config.max_len - pos} remaining positions")
        return (ids, self._tokens, self._params, self._kv), {"pos": pos}

    def _submit(self, step: Step) -> engine.RunHandle:
        args, kwargs = self._args(step)
        return self.runtime.submit(*args, **kwargs)

    def _claim(self) -> None:
        if self._busy:
            raise RuntimeError("this Decoder is already generating: it has one KV cache, so one sequence at a time")
        self._busy = True

    def _sync_tokens(self, steps: list[Step]) -> Iterator[int]:
        self._claim()
        pending: deque[engine.RunHandle] = deque()
        todo = iter(steps)
        try:
            _top_up(pending, todo, self.depth, self._submit)
            while pending:
                result = pending.popleft().result()
                _top_up(pending, todo, self.depth, self._submit)
                yield _token(result)
        finally:
            for handle in pending:  # an error or an early exit: the remaining steps are moot
                handle.cancel()
            for handle in pending:
                handle.wait()
            self._busy = False

    async def _async_tokens(self, art: AsyncRuntime, steps: list[Step]) -> AsyncIterator[int]:
        self._claim()
        pending: deque[RunFuture] = deque()
        todo = iter(steps)
        try:
            await self._dispatch_up_to_depth(art, pending, todo)
            while pending:
                result = await pending.popleft()
                # Refill before handing the token out: the next step orchestrates
                # and runs while the consumer works on this token.
                await self._dispatch_up_to_depth(art, pending, todo)
                yield _token(result)
        finally:
            for fut in pending:
                fut.cancel()
            self._busy = False

    async def _dispatch_up_to_depth(self, art: AsyncRuntime, pending: deque[RunFuture],
                                    todo: Iterator[Step]) -> None:
        while len(pending) < self.depth:
            step = next(todo, None)
            if step is None:
                return
            args, kwargs = self._args(step)
            pending.append(await art.dispatch(*args, **kwargs))


def _top_up(pending: deque, todo: Iterator[Step], depth: int, submit: Callable[[Step], Any]) -> None:
    while len(pending) < depth:
        step = next(todo, None)
        if step is None:
            return
        pending.append(submit(step))


def _token(result: tuple[Any, ...]) -> int:
    """The chosen token from a step's outputs (tokens, kv, out): out is last."""
    return int(result[-1][0])
