"""The figures of one generation, as the engine reports them after every step and at the end.

`Stats` is a frozen record: the engine counts while it decodes and hands out
a snapshot (`Stats.from_counts`), which computes the ratios once.
`as_dict()` is the JSON form that `edgespec run --json`, batch records, the
server's usage and saved chats carry; its keys are the field names, in order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else 0.0


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
    prompt_tokens_evaluated: int = 0
    """Prompt tokens the target had to evaluate: prompt_tokens - prompt_tokens_reused."""
    tokens_generated: int = 0
    """Tokens emitted so far, an end-of-generation token not counted."""
    draft_tokens_proposed: int = 0
    """Tokens the drafter proposed, over all steps."""
    draft_tokens_accepted: int = 0
    """Proposed tokens the verifier accepted."""
    acceptance_rate: float = 0.0
    """draft_tokens_accepted / draft_tokens_proposed (0.0 before any proposal)."""
    target_forward_passes: int = 0
    """Target model passes during decoding (one per step; prefill not counted)."""
    draft_forward_passes: int = 0
    """Draft model passes during decoding (0 for n-gram and plain decoding)."""
    target_passes_per_token: float = 0.0
    """target_forward_passes / tokens_generated: below 1 is what speculation buys."""
    steps: int = 0
    """Draft-verify steps taken."""
    k0_steps: int = 0
    """Steps that drafted nothing (plain decoding steps)."""
    mean_draft_tokens: float = 0.0
    """draft_tokens_proposed / steps."""
    prefill_seconds: float = 0.0
    """Time spent evaluating the prompt."""
    decode_seconds: float = 0.0
    """Time from the end of prefill to the latest step."""
    decode_tokens_per_second: float = 0.0
    """tokens_generated / decode_seconds."""
    finish_reason: str | None = None
    """None while generating; then "stop", "length", "context" or "cancelled"."""
    bit_exact: bool = False
    """Verification kept to passes llama.cpp computes bit-identically to one token at a time."""
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

    @classmethod
    def from_counts(cls, *, mode: str, plan_reason: str | None, prompt_tokens: int, prompt_tokens_reused: int,
                    tokens_generated: int, draft_tokens_proposed: int, draft_tokens_accepted: int,
                    target_forward_passes: int, draft_forward_passes: int, steps: int, k0_steps: int,
                    prefill_seconds: float, decode_seconds: float, finish_reason: str | None,
                    bit_exact: bool = False, widest_pass: int = 0, accepted_by_drafter: dict | None = None,
                    pass_widths: dict | None = None, drafted_by_position: dict | None = None,
                    accepted_by_position: dict | None = None) -> Stats:
        """The snapshot of the engine's running counts, with every ratio computed from them."""
        return cls(
            mode=mode, plan_reason=plan_reason, prompt_tokens=prompt_tokens,
            prompt_tokens_reused=prompt_tokens_reused,
            prompt_tokens_evaluated=prompt_tokens - prompt_tokens_reused,
            tokens_generated=tokens_generated, draft_tokens_proposed=draft_tokens_proposed,
            draft_tokens_accepted=draft_tokens_accepted,
            acceptance_rate=_ratio(draft_tokens_accepted, draft_tokens_proposed),
            target_forward_passes=target_forward_passes, draft_forward_passes=draft_forward_passes,
            target_passes_per_token=_ratio(target_forward_passes, tokens_generated),
            steps=steps, k0_steps=k0_steps, mean_draft_tokens=_ratio(draft_tokens_proposed, steps),
            prefill_seconds=prefill_seconds, decode_seconds=decode_seconds,
            decode_tokens_per_second=_ratio(tokens_generated, decode_seconds), finish_reason=finish_reason,
            bit_exact=bit_exact, widest_pass=widest_pass, accepted_by_drafter=dict(accepted_by_drafter or {}),
            pass_widths=dict(sorted((pass_widths or {}).items())),
            drafted_by_position={name: list(c) for name, c in (drafted_by_position or {}).items()},
            accepted_by_position={name: list(c) for name, c in (accepted_by_position or {}).items()},
        )

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
