"""Measuring a model's passes: how far wide passes part from one-token ones, and what a pass costs
over one sequence or several."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..limits import MAX_OUTPUT_ROWS
from .context import Context
from .model import LlamaModel

# How deep in the cache the widths are checked. llama.cpp's CPU flash attention splits a one-token query's
# keys across threads once the cache spans 512 cells (ggml-cpu ops.cpp, `nek1 >= 512`; cells are counted in
# steps of 256), and takes a wider pass's queries whole: past 256 cached tokens even a 2-token pass rounds
# differently from one-token steps. Near the start of the cache it does not: with flash attention every
# SmolLM2-135M width is bit-identical 8 tokens deep and 0.7-1.3 logits apart 300 deep, and Qwen2.5-Coder-1.5B's
# widths 2 and 3 are exact 8 deep and 0.46 apart 300 deep. Probed 8 deep, SmolLM2's drift in a real reply was
# called a bug in edgespec by the bench's exactness check.
PROBE_DEPTH = 264


@dataclass(frozen=True)
class PassProbe:
    """What probe_pass_widths found."""

    exact_width: int  # every pass up to this many tokens gives one-token passes' logits bit for bit
    drift: dict[int, float]  # per checked width: the largest |logit difference| from one-token passes


def probe_pass_widths(
    model: LlamaModel, probe: Sequence[int], limit: int, drift_widths: Sequence[int] = (),
    budget_seconds: float | None = None,
) -> PassProbe:
    """How far passes up to limit tokens wide part from one-token passes, bit for bit and in logits.

    llama.cpp's CPU kernels change arithmetic with the number of tokens in
    a pass, so a token verified in a wider pass can get slightly different
    logits from the same token decoded alone.  Widths are checked
    narrowest first, each by a pass of its own, until the first one that
    is not bit-identical; after that only drift_widths are checked, for
    the size of the difference.  The passes are PROBE_DEPTH tokens deep, or
    as deep as probe and the context allow (at least 8 tokens).  With
    budget_seconds the one-token passes get a quarter of it and the checks
    the rest, each check skipped once it would end past the budget (width 2
    is always checked), so every figure comes from a width that was
    checked.  probe needs PROBE_DEPTH + limit tokens; the cache is left as
    it was, and the passes are not counted.
    """
    n_keep, passes = len(model.cached), model.forward_passes
    depth = max(8, min(PROBE_DEPTH, len(probe) - limit, model.n_ctx - n_keep - limit))
    prefix, tokens = list(probe[:depth]), list(probe[depth : depth + limit])
    model.decode(prefix, n_logits=0)
    started = time.perf_counter()
    singles = []
    for token in tokens:
        if budget_seconds is not None and len(singles) >= 2 and _since(started) > budget_seconds / 4:
            break
        singles.append(model.decode([token], 1)[0])
    exact_width, drift, last_check = 1, {}, 0.0
    for w in range(2, len(singles) + 1):
        if exact_width < w - 1 and w not in drift_widths:
            continue
        if budget_seconds is not None and w > 2 and _since(started) + last_check * w / (w - 1) > budget_seconds:
            break
        check_started = time.perf_counter()
        model.rewind(n_keep + len(prefix))
        rows = model.decode(tokens[:w], w)
        last_check = _since(check_started)
        drift[w] = float(np.max(np.abs(rows - np.stack(singles[:w]))))
        if drift[w] == 0.0 and exact_width == w - 1:
            exact_width = w
    model.context.forward_passes = passes
    model.rewind(n_keep)
    return PassProbe(exact_width, drift)


def probe_tokens(model: LlamaModel) -> list[int]:
    """A prompt of ordinary text and code for the width probe and the cost curve's passes."""
    text = "The quick brown fox jumps over the lazy dog; def area(w, h): return w * h. " * 20
    return model.tokenize(text, add_special=True)


def plain_logits(model: LlamaModel, ids: list[int]) -> np.ndarray:
    """model's logits after ids as plain decoding computes them: the last token in a pass of its own.
    Sequence 0's cache is left empty."""
    model.rewind(0)
    model.decode(ids[:-1], n_logits=0)
    logits = model.decode(ids[-1:], n_logits=1)[0]
    model.rewind(0)
    return logits


def time_forward(model: LlamaModel, n_tokens: int, filler: int) -> float:
    """Seconds for one forward pass over n_tokens, returning n_tokens logits rows.

    Used to calibrate draft lengths; the cache is left as it was, and the pass is not counted.
    """
    n_keep = len(model.cached)
    start = time.perf_counter()
    model.decode([filler] * n_tokens, n_logits=min(n_tokens, MAX_OUTPUT_ROWS))
    elapsed = time.perf_counter() - start
    model.context.forward_passes -= 1
    model.rewind(n_keep)
    return elapsed


def time_sequence_passes(model: LlamaModel, grid: Sequence[tuple[int, int]], depth: int, filler: int,
                         budget_seconds: float, turns: int = 2) -> list[tuple[int, int, float]]:
    """What a pass over several sequences costs against one sequence's pass over as many rows.

    For each (n, rows) of grid, fewest rows each first, then fewest sequences
    (so every n is measured at one row, what the number decoded together is
    chosen on, before any is at more): a pass adding `rows` rows
    (logits for each) to each of n sequences, every one `depth` tokens deep
    in cells of its own, timed in turns with a pass adding n x rows rows to
    one of them (so both meet the same load); (n, rows, the ratio of their
    fastest times).  A point is skipped once the time spent would pass
    budget_seconds (the first is always measured).  The passes run in a small
    context of their own, freed afterwards: the model's caches are untouched.
    """
    most, widest = max(n for n, _ in grid), max(n * rows for n, rows in grid)
    context = Context(model.weights, model.n_vocab, n_ctx=depth + widest, n_batch=max(depth, widest), n_seq=most,
                      n_threads=model.n_threads, type_k=model.type_k, type_v=model.type_v,
                      flash_attn=model.flash_attn)
    try:
        prompt = [filler] * depth
        context.decode(prompt, n_logits=0)  # one prefill; its cells are copied into the other sequences
        state = context.state_bytes(0)
        for seq in range(1, most):
            context.load_state(state, prompt, seq)
        _timed_pass(context, [(0, [filler], 1)], depth)  # the first pass of a context allocates its buffers
        points, spent = [], 0.0
        for n, rows in sorted(grid, key=lambda point: (point[1], point[0])):
            if points and spent > budget_seconds:
                break
            shared, alone = [], []
            for _ in range(turns):
                shared.append(_timed_pass(context, [(seq, [filler] * rows, rows) for seq in range(n)], depth))
                alone.append(_timed_pass(context, [(0, [filler] * (n * rows), n * rows)], depth))
            spent += sum(shared) + sum(alone)
            points.append((n, rows, min(shared) / min(alone)))
        return points
    finally:
        context.free()


def _timed_pass(context: Context, parts: list[tuple[int, list[int], int]], depth: int) -> float:
    started = time.perf_counter()
    context.decode_sequences(parts)
    elapsed = time.perf_counter() - started
    for seq, _, _ in parts:
        context.rewind(depth, seq)
    return elapsed


def _since(start: float) -> float:
    return time.perf_counter() - start
