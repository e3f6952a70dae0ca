"""The real draft pair, Qwen2.5-Coder-1.5B with Qwen2.5-Coder-0.5B (Q4_K_M), when both files are on this machine.

`make test` never downloads them (`edgespec models pull qwen2.5-coder-1.5b-instruct` and
`edgespec models pull qwen2.5-coder-0.5b-instruct-q4_k_m` do); without them these tests skip.
"""

from __future__ import annotations

import pytest

from edgespec import SamplingParams
from edgespec.loading import load_engine
from edgespec.errors import VocabMismatchError
from edgespec.fetch import resolve_model


def _present(name: str):
    try:
        return resolve_model(name, pull=False)
    except Exception:
        return None


TARGET = _present("qwen2.5-coder-1.5b-instruct")
DRAFT = _present("qwen2.5-coder-0.5b-instruct-q4_k_m")
pytestmark = pytest.mark.skipif(TARGET is None or DRAFT is None, reason="the Qwen2.5-Coder pair is not pulled")

PROMPT = ("Add type hints to this function and keep everything else as it is:\n\n"
          "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n")
# a fixed curve: the draft lengths then do not depend on this machine's speed
COST = (1.0, 1.7, 2.2, 2.2)


def test_draft_model_and_combined_modes_give_plain_greedy_output_bit_exactly(smollm2_path):
    engine = load_engine(TARGET, DRAFT, n_ctx=1024, n_threads=2, cost_curve=COST, bit_exact=True, draft_tokens=2)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=128)
        engine.configure(mode="none")
        plain = engine.generate(PROMPT, params)
        for mode in ("draft-model", "combined"):
            engine.configure(mode=mode)
            result = engine.generate(PROMPT, params)
            assert result.token_ids == plain.token_ids, mode
            assert result.stats.draft_tokens_accepted > 0, mode
    finally:
        engine.close()


def test_a_draft_of_another_family_is_refused_in_one_line(smollm2_path):
    with pytest.raises(VocabMismatchError) as error:
        load_engine(TARGET, smollm2_path, n_ctx=512, n_threads=2, cost_curve=COST)
    message = str(error.value)
    assert "\n" not in message and "cannot draft for target" in message
