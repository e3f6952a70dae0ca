"""At temperature 0 every edgespec mode must reproduce plain decoding token for token; at T > 0 whether a run
wrote what plain decoding wrote with the same seed is reported."""

from __future__ import annotations

from ...errors import EdgespecError


class ExactnessError(EdgespecError):
    """At temperature 0 a speculative mode produced tokens different from plain decoding."""

    exit_code = 1



def check_exactness(prompt_runs: list[dict], plain_logits=None, drift_bound: float = 0.0) -> list[dict]:
    """Every temperature-0 run of an edgespec mode must equal the first baseline run, token for token.

    A llama.cpp peer's run is compared by text and only reported (matches_baseline).

    llama.cpp's CPU kernels do not give a token bit-identical logits in a pass
    of one token and in a wider verification pass on every model; the engine
    measures how far they drift (Engine.drift_bound: twice the largest drift
    seen, 0 where every width is bit-identical).  A mismatch of a run that was
    not bit-exact, where plain_logits(ids) shows the target's two tokens closer
    than that bound, is such a near-tie and is returned, so the report can
    count it; every other mismatch raises ExactnessError.
    """
    reference = next(r for r in prompt_runs if r["config"] == "baseline")
    near_ties = []
    for run in prompt_runs:
        if run["token_ids"] is None:  # a llama.cpp peer: reported, not enforced
            run["matches_baseline"] = same_text_as_baseline(run, reference)
            continue
        position = _first_difference(reference["token_ids"], run["token_ids"])
        run["matches_baseline"] = position is None
        if position is None:
            continue
        gap = _logit_gap(plain_logits, reference, run, position)
        bound = 0.0 if run.get("bit_exact") else drift_bound
        if gap is not None and gap < bound:
            near_ties.append({"config": run["config"], "prompt_id": run["prompt_id"], "repeat": run["repeat"],
                              "position": position, "logit_gap": gap, "drift_bound": bound})
            continue
        raise ExactnessError(
            f"exactness check FAILED: {run['config']} on {run['prompt_id']} (T=0, repeat {run['repeat']}) "
            f"differs from baseline at generated token {position} "
            f"({_token_at(run['token_ids'], position)} vs baseline {_token_at(reference['token_ids'], position)}"
            + (f", {gap:.2f} logits apart" if gap is not None else "")
            + "); speculative decoding must reproduce plain greedy decoding, so this is a bug in edgespec"
        )
    return near_ties


def mark_same_seed_matches(prompt_runs: list[dict]) -> None:
    """At T > 0, set each edgespec run's matches_baseline: whether it wrote the baseline run of its own repeat
    (the same seed) token for token.

    Reported, not enforced: n-gram and heads drafts draw as plain decoding
    draws (verify.py), so they write its text but where a wider pass moves a
    draw across the line between two tokens; a draft model's runs draw
    otherwise and write other text of the same law.  A llama.cpp peer samples
    with its own generator, so its text is not compared.
    """
    baselines = {run["repeat"]: run for run in prompt_runs if run["config"] == "baseline"}
    for run in prompt_runs:
        reference = baselines.get(run["repeat"])
        if run["token_ids"] is not None and reference is not None:
            run["matches_baseline"] = run["token_ids"] == reference["token_ids"]


def same_text_as_baseline(peer_run: dict, reference: dict) -> bool:
    """Whether a peer wrote the baseline's text.

    llama-speculative-simple stops only once it has more than -n tokens, so
    after a baseline cut at max tokens the peer's text need only start with it.
    """
    if reference["finish_reason"] == "length":
        return peer_run["text"].startswith(reference["text"])
    return peer_run["text"] == reference["text"]


def _logit_gap(plain_logits, reference: dict, run: dict, position: int) -> float | None:
    """How far apart the target puts the two differing tokens, or None when it cannot be told.

    A run that ended there chose an end-of-generation token, which token_ids
    leave out; the target's own best token stands in for it.
    """
    if plain_logits is None:
        return None
    logits = plain_logits(reference["prompt_ids"] + reference["token_ids"][:position])

    def logit_of(ids):
        return logits[ids[position]] if position < len(ids) else logits.max()

    return float(abs(logit_of(reference["token_ids"]) - logit_of(run["token_ids"])))


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _token_at(ids: list[int], i: int) -> str:
    return f"token {ids[i]}" if i < len(ids) else "end of output"
