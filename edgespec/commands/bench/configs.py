"""The bench's configurations: edgespec's drafting modes at a draft length, and llama.cpp's own speculation.

edgespec's: baseline, ngram, draft-model, combined (n-grams or the draft
model, chosen per step), heads (with --draft heads), each optionally -kN (a fixed draft length) or -auto,
and then -exact for --bit-exact verification (e.g. ngram-auto-exact); baseline-again, plain decoding once
more in the rotation, whose ratio to baseline is what identical passes read in the same run.  llama.cpp's (run by its llama-speculative-simple binary,
see peers.py): llamacpp-none, llamacpp-ngram-simple, llamacpp-ngram-mod and
llamacpp-draft, each at llama.cpp's default draft length or -nN (drafts
of at most N tokens: peers.draft_length_args).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .workloads import BenchError

EDGESPEC_DRAFTERS = ("baseline", "ngram", "draft-model", "combined", "heads")
# configuration name -> llama.cpp's --spec-type
PEER_SPEC_TYPES = {"llamacpp-none": "none", "llamacpp-ngram-simple": "ngram-simple",
                   "llamacpp-ngram-mod": "ngram-mod", "llamacpp-draft": "draft-simple"}
# "ngram" and "draft-model" alone mean the engine's default draft length; the
# peers run only with --llama-cpp-bin, and the draft ones only with a draft model.
DEFAULT_CONFIGS = ("baseline", "ngram", "ngram-exact", "ngram-k2", "ngram-k4", "draft-model", "combined", "heads",
                   *PEER_SPEC_TYPES)
NEEDS_DRAFT_MODEL = ("draft-model", "combined", "llamacpp-draft")
EXACT_SUFFIX = "-exact"
# Plain decoding as a configuration of its own: an A/A pair with baseline.  On a machine whose speed wanders
# by several percent between runs, its ratio to baseline is the floor any other ratio of the same run must
# clear before it says something.
PLAIN_AGAIN = "baseline-again"


@dataclass(frozen=True)
class BenchConfig:
    name: str  # as shown in tables: baseline, ngram-k4, ngram-auto, draft-model-k4, llamacpp-ngram-simple-n3
    drafter: str  # one of EDGESPEC_DRAFTERS or PEER_SPEC_TYPES
    draft_tokens: int | str | None  # None for baseline and a peer's default; "auto" where the engine chooses
    bit_exact: bool = False  # edgespec's --bit-exact verification

    @property
    def is_peer(self) -> bool:
        return self.drafter in PEER_SPEC_TYPES


def parse_config(name: str) -> tuple[str, int | str | None]:
    """'ngram-k4' -> ('ngram', 4); 'ngram-auto' -> ('ngram', 'auto'); 'llamacpp-draft-n3' -> ('llamacpp-draft', 3)."""
    if name == PLAIN_AGAIN:
        return "baseline", None
    for drafter in (*EDGESPEC_DRAFTERS, *PEER_SPEC_TYPES):
        if name == drafter:
            return drafter, None
        suffix = name[len(drafter) + 1 :] if name.startswith(drafter + "-") else None
        if suffix is None or drafter in ("baseline", "llamacpp-none"):
            continue
        letter = "n" if drafter in PEER_SPEC_TYPES else "k"
        if suffix == "auto" and letter == "k":
            return drafter, "auto"
        if suffix.startswith(letter) and suffix[1:].isdigit() and int(suffix[1:]) >= 1:
            return drafter, int(suffix[1:])
    raise BenchError(
        f"unknown configuration {name!r} (use baseline, {PLAIN_AGAIN}, ngram or draft-model, optionally with -kN or -auto, "
        f"or {', '.join(PEER_SPEC_TYPES)}, optionally with -nN)"
    )


def is_bit_exact(name: str) -> bool:
    """Whether a configuration's name asks for edgespec's bit-exact verification (llama.cpp's peers have none)."""
    return name.endswith(EXACT_SUFFIX) and not name.startswith("llamacpp-")


def resolve_configs(names: Iterable[str], default_draft_tokens: int | str, has_draft: bool, explicit: bool,
                    has_peer: bool = False, has_heads: bool = False) -> list[BenchConfig]:
    """Configurations with their draft lengths settled; duplicates dropped, keeping the first.

    Without --configs, the draft-model configurations are skipped when no draft
    model is given, and llama.cpp's when no --llama-cpp-bin is; asked for
    explicitly, either is an error.
    """
    configs: dict[str, BenchConfig] = {}
    for name in names:
        bit_exact = is_bit_exact(name)
        drafter, k = parse_config(name[: -len(EXACT_SUFFIX)] if bit_exact else name)
        missing = _missing_for(drafter, has_draft, has_peer, has_heads)
        if missing:
            if explicit:
                raise BenchError(f"configuration {name!r} needs {missing}, or drop {name}")
            continue
        if name == PLAIN_AGAIN:
            config = BenchConfig(PLAIN_AGAIN, "baseline", None)
        elif drafter == "baseline":
            config = BenchConfig("baseline", "baseline", None)
        elif drafter in PEER_SPEC_TYPES:
            config = BenchConfig(drafter if k is None else f"{drafter}-n{k}", drafter, k)
        else:
            k = k if k is not None else default_draft_tokens
            label = (f"{drafter}-auto" if k == "auto" else f"{drafter}-k{k}") + (EXACT_SUFFIX if bit_exact else "")
            config = BenchConfig(label, drafter, k, bit_exact)
        configs.setdefault(config.name, config)  # a name says drafter, draft length and exactness
    if "baseline" not in configs:
        configs["baseline"] = BenchConfig("baseline", "baseline", None)  # speedups need it
    return list(configs.values())


def _missing_for(drafter: str, has_draft: bool, has_peer: bool, has_heads: bool) -> str | None:
    if drafter in PEER_SPEC_TYPES and not has_peer:
        return "llama.cpp's binaries (pass --llama-cpp-bin DIR, built by benchmarks/build_llama_cpp_peer.sh)"
    if drafter in NEEDS_DRAFT_MODEL and not has_draft:
        return "a draft model and none is loaded (pass --draft FILE)"
    if drafter == "heads" and not has_heads:
        return "heads, which --draft heads loads (train them first with `edgespec heads train` if none are)"
    return None


def rotated(configs: list[BenchConfig], by: int) -> list[BenchConfig]:
    shift = by % len(configs)
    return configs[shift:] + configs[:shift]
