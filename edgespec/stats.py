"""The figures of one generation, as the engine reports them after every step and at the end.

`Stats` is a frozen record: the decoder counts in a `Counters` while it
decodes and hands out a snapshot (`Stats.from_counts`), which computes the
ratios once.  The field list is written once, here in Stats: Counters has
the fields that are counted, not computed.
`as_dict()` is the JSON form that `edgespec run --json`, batch records, the
server's usage and saved chats carry; its keys are the field names, in order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


# Marks the Stats fields computed from the others (see _ratios); every other field is counted.
RATIO = {"ratio": True}


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


def _ratios(counts: dict) -> dict:
    """The ratio fields of Stats, from the counted ones."""
    plain_decode = counts["tokens_generated"] * counts.get("plain_step_seconds", 0.0)  # plain decoding's estimated time
    return {
        "prompt_tokens_evaluated": counts["prompt_tokens"] - counts["prompt_tokens_reused"],
        "acceptance_rate": _ratio(counts["draft_tokens_accepted"], counts["draft_tokens_proposed"]),
        "target_passes_per_token": _ratio(counts["target_forward_passes"], counts["tokens_generated"]),
        "mean_draft_tokens": _ratio(counts["draft_tokens_proposed"], counts["steps"]),
        "decode_tokens_per_second": _ratio(counts["tokens_generated"], counts["decode_seconds"]),
        "decode_speedup": _ratio(plain_decode, counts["decode_seconds"]),
        "end_to_end_speedup": end_to_end_speedup(counts["prefill_seconds"], counts["decode_seconds"], plain_decode),
    }


def end_to_end_speedup(prefill_seconds: float, decode_seconds: float, plain_decode_seconds: float) -> float:
    """(prefill + plain decode) / (prefill + decode): a reply's real speedup, as prefill is not sped up;
    0.0 when plain decoding's time is unknown."""
    if plain_decode_seconds <= 0.0:
        return 0.0
    return _ratio(prefill_seconds + plain_decode_seconds, prefill_seconds + decode_seconds)


# A speedup is told for a reply of at least this many tokens: fewer say more about the machine's mood
# than about the model.
MIN_REPLY_TOKENS = 16
# A step costs at least one target pass, so a reply cannot beat plain decoding by more than its tokens
# per target pass; a claim past that (with slack for noise) means the plain-speed estimate is off.
SPEEDUP_SLACK = 1.25


def plausible_speedup(stats: Stats, plain_speed: float) -> float | None:
    """stats' decode speed over plain_speed (plain decoding's tok/s), or None when that is more than the
    reply's target passes allow."""
    passes_per_token = stats.target_passes_per_token
    if not passes_per_token > 0 or not plain_speed > 0:
        return None
    ratio = stats.decode_tokens_per_second / plain_speed
    return ratio if ratio <= SPEEDUP_SLACK / passes_per_token else None


@dataclass(frozen=True)
class Stats:
    mode: str
    """The drafting mode that produced the tokens: "combined", "draft-model", "ngram" or "none"."""
    plan_reason: str | None = None
    """Why the memory plan chose the loaded drafter (None when the engine was built without a plan)."""
    prompt_tokens: int = 0
    """Tokens of the prompt (for a chat: the whole rendered conversation)."""
    prompt_tokens_reused: int = 0
    """Prompt tokens the target did not evaluate: in its KV cache from the previous generation, or restored
    from a prefix snapshot (the prompt cache)."""
    prompt_tokens_evaluated: int = field(default=0, metadata=RATIO)
    """Prompt tokens the target had to evaluate: prompt_tokens - prompt_tokens_reused."""
    tokens_generated: int = 0
    """Tokens emitted so far, an end-of-generation token not counted."""
    draft_tokens_proposed: int = 0
    """Tokens the drafter proposed, over all steps."""
    draft_tokens_accepted: int = 0
    """Proposed tokens the verifier accepted."""
    acceptance_rate: float = field(default=0.0, metadata=RATIO)
    """draft_tokens_accepted / draft_tokens_proposed (0.0 before any proposal)."""
    target_forward_passes: int = 0
    """Target model passes during decoding (one per step; prefill not counted)."""
    draft_forward_passes: int = 0
    """Draft model passes during decoding (0 for n-gram and plain decoding)."""
    target_passes_per_token: float = field(default=0.0, metadata=RATIO)
    """target_forward_passes / tokens_generated: below 1 is what speculation buys."""
    steps: int = 0
    """Draft-verify steps taken."""
    k0_steps: int = 0
    """Steps that drafted nothing (plain decoding steps)."""
    mean_draft_tokens: float = field(default=0.0, metadata=RATIO)
    """draft_tokens_proposed / steps."""
    prefill_seconds: float = 0.0
    """Time spent evaluating the prompt."""
    decode_seconds: float = 0.0
    """Time from the end of prefill to the latest step."""
    decode_tokens_per_second: float = field(default=0.0, metadata=RATIO)
    """tokens_generated / decode_seconds."""
    finish_reason: str | None = None
    """None while generating; then "stop", "length", "context" or "cancelled"."""
    bit_exact: bool = False
    """Verification kept to passes llama.cpp computes bit-identically to one token at a time."""
    flash_attn: bool = False
    """The target was loaded with flash attention (the commands' default unless bit_exact; a context of
    several sequences runs it wherever llama.cpp does, whatever this says)."""
    widest_pass: int = 0
    """The most tokens one verification pass covered (k + 1 for the longest draft)."""
    accepted_by_drafter: dict[str, int] = dataclasses.field(default_factory=dict)
    """Accepted draft tokens per drafter ("ngram", "draft-model"): who proposed what the target kept."""
    pass_widths: dict[int, int] = dataclasses.field(default_factory=dict)
    """Verification passes per width (k + 1 tokens): how much of the cost curve the controller used."""
    drafted_by_position: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Per drafter, the tokens it proposed at draft position 1, 2, ... (for heads: head 1, 2, ...)."""
    accepted_by_position: dict[str, list[int]] = dataclasses.field(default_factory=dict)
    """Per drafter, how many of those the verifier accepted (see acceptance_by_position)."""
    accepted_prediction_tokens: int = 0
    """The request's predicted output's tokens that appeared in the completion, as OpenAI counts them
    (prediction.prediction_usage); known when the generation ends."""
    rejected_prediction_tokens: int = 0
    """The predicted output's tokens that did not appear in the completion; known when the generation ends."""
    plain_step_seconds: float = 0.0
    """Plain decoding's pace: its seconds per token told, by what a step over one token costs in this generation
    (generation.PlainPace, from its own steps, pass and all), with the step plain decoding would have made for
    an end-of-generation token; the calibrated one-token pass until a step is timed (steps whose pass serves
    several sequences are not), 0.0 with a given cost curve."""
    decode_speedup: float = field(default=0.0, metadata=RATIO)
    """Plain decoding's estimated time for these tokens (tokens_generated x plain_step_seconds) over
    decode_seconds; 0.0 when unknown (a given cost curve, nothing generated)."""
    end_to_end_speedup: float = field(default=0.0, metadata=RATIO)
    """(prefill_seconds + plain decoding's estimated time) / (prefill_seconds + decode_seconds): the wait
    the user saw shrink, prefill included, which speculation cannot speed up; 0.0 when unknown."""

    @classmethod
    def from_counts(cls, **counts) -> Stats:
        """The snapshot of the decoder's running counts (the fields of Counters), with every ratio computed from them."""
        if "pass_widths" in counts:
            counts = {**counts, "pass_widths": dict(sorted(counts["pass_widths"].items()))}
        return cls(**counts, **_ratios(counts))

    @classmethod
    def from_dict(cls, data: dict) -> Stats:
        """Stats from their JSON form (e.g. a saved chat's turn); keys it does not know are ignored."""
        known = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data}
        if isinstance(known.get("pass_widths"), dict):  # JSON keys are strings
            known["pass_widths"] = {int(width): count for width, count in known["pass_widths"].items()}
        return cls(**known)

    def acceptance_by_position(self, drafter: str) -> list[float]:
        """The share of the drafter's tokens at each draft position that the verifier accepted."""
        accepted = self.accepted_by_position.get(drafter, [])
        return [_ratio(accepted[i] if i < len(accepted) else 0, n)
                for i, n in enumerate(self.drafted_by_position.get(drafter, []))]

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _counted(stats_field: dataclasses.Field) -> tuple:
    """A Counters field: a counted Stats field, with its default."""
    if stats_field.default_factory is not dataclasses.MISSING:
        return stats_field.name, stats_field.type, field(default_factory=stats_field.default_factory)
    return stats_field.name, stats_field.type, field(default=stats_field.default)


def _snapshot(counters) -> Stats:
    # Every step streams one: dataclasses.asdict took 0.12 ms of it (0.4% of a 30 ms CPU step, 1.5% of
    # an 8 ms GPU one); copying the containers, so that later counts leave the snapshot as it was, 0.02.
    return Stats.from_counts(**{name: _copied(getattr(counters, name)) for name in _COUNTED})


def _copied(value):
    if isinstance(value, dict):
        return {key: _copied(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_copied(item) for item in value]
    return value


# The running counts of one generation, which the decoder updates in place: the Stats fields that are
# counted, not computed, so a new figure is one new Stats field.  snapshot() is the Stats they make now.
_COUNTED = [f.name for f in dataclasses.fields(Stats) if not f.metadata.get("ratio")]
Counters = dataclasses.make_dataclass(
    "Counters", [_counted(f) for f in dataclasses.fields(Stats) if f.name in _COUNTED],
    namespace={"snapshot": _snapshot, "__doc__": "The running counts of one generation (see Stats)."},
)
