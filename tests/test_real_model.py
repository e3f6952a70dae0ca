"""The engine on a real model: SmolLM2-135M-Instruct Q4_1 (pulled from PyPI by `make test`)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from edgespec import ChatSession, SamplingParams
from edgespec.backend import LlamaModel, probe_pass_widths, probe_tokens
from edgespec.loading import load_engine

CODE = '''def mean(values):
    total = 0
    for value in values:
        total = total + value
    return total / len(values)
'''


# Widths 1..5 for draft_tokens=4: a given curve times nothing, and the exact-width probe then
# checks only the widths the tests draft (all of SmolLM2's are exact, 100 s on a busy 2-core CPU).
SMOLLM_COST = (1.0, 1.2, 1.4, 1.6, 1.8)


@pytest.fixture(scope="module")
def smollm(smollm2_path):
    engine = load_engine(smollm2_path, "ngram", n_ctx=2048, draft_tokens=4, n_threads=2, cost_curve=SMOLLM_COST)
    assert engine.max_draft_tokens == 4
    yield engine
    engine.close()


def test_greedy_ngram_equals_greedy_plain(smollm):
    params = SamplingParams(temperature=0.0, max_tokens=128)
    prompt = f"Rewrite this function with type hints and a docstring. Then explain, line by line, what it does and when it fails:\n\n{CODE}"
    smollm.configure(mode="none")
    plain = smollm.generate(prompt, params)
    smollm.configure(mode="ngram")
    spec = smollm.generate(prompt, params)
    assert len(plain.token_ids) >= 64
    assert spec.token_ids == plain.token_ids and spec.text == plain.text

    stats = spec.stats
    assert stats.mode == "ngram" and plain.stats.mode == "none"
    assert 0 < stats.draft_tokens_accepted <= stats.draft_tokens_proposed
    assert stats.acceptance_rate == stats.draft_tokens_accepted / stats.draft_tokens_proposed
    # one target pass per step; each step emits its accepted drafts plus one target token
    assert stats.target_forward_passes == stats.steps
    emitted = stats.tokens_generated + (stats.finish_reason == "stop")
    assert emitted == stats.steps + stats.draft_tokens_accepted
    assert stats.target_passes_per_token < plain.stats.target_passes_per_token
    assert plain.stats.target_forward_passes == plain.stats.steps


def test_a_reply_the_model_ends_hands_out_the_text_held_for_a_stop_that_never_came(smollm):
    """The model's end token, sampled alone in a step (every step of plain decoding), once dropped what was
    held back for a stop string from the stream, though the answer kept it: streamed replies ended short."""
    params = SamplingParams(temperature=0.0, max_tokens=400)
    prompt = "Reply with one short friendly sentence."
    smollm.configure(mode="none")
    try:
        free = smollm.generate(prompt, params)
        never = free.text[-3:] + next(c for c in "~@#\u2603" if c not in free.text)
        events = list(smollm.stream(prompt, SamplingParams(temperature=0.0, max_tokens=400, stop=(never,))))
    finally:
        smollm.configure(mode="ngram")
    assert "".join(event.text for event in events) == events[-1].result.text == free.text


def test_the_widths_the_probe_calls_exact_are_exact_at_a_replys_depth(smollm2_path):
    # The probe once checked the widths 8 tokens deep. Past 256 cached tokens llama.cpp's flash attention
    # splits a one-token step's keys across threads (backend/probing.py), so widths called exact there
    # were not in a reply, and the bench called the drift a bug in edgespec. Whatever this CPU's kernels
    # do, a width called exact must give one-token steps' logits bit for bit 300 tokens into another text.
    model = LlamaModel(smollm2_path, n_ctx=1024, n_threads=2, flash_attn=True)
    try:
        width = probe_pass_widths(model, probe_tokens(model), 9).exact_width
        text, depth = model.tokenize(CODE * 12, add_special=True), 300
        model.decode(text[:depth], n_logits=0)
        steps = np.stack([model.decode([token], 1)[0] for token in text[depth : depth + width]])
        model.rewind(depth)
        assert np.array_equal(model.decode(text[depth : depth + width], width), steps)
    finally:
        model.close()


def test_sampled_ngram_writes_what_sampled_plain_writes_for_the_same_seed(smollm):
    # point proposals spend one uniform per emitted token, as plain decoding does (verify.py), so at T > 0
    # the same seed gives the same tokens wherever the passes give the same logits, which bit_exact keeps
    prompt = f"Copy this function, then add type hints to it:\n\n{CODE}"
    proposed = accepted = 0
    try:
        for seed in (1, 2, 3):
            params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, max_tokens=96, seed=seed)
            smollm.configure(mode="none", bit_exact=True)
            plain = smollm.generate(prompt, params)
            smollm.configure(mode="ngram")
            spec = smollm.generate(prompt, params)
            assert spec.token_ids == plain.token_ids, seed
            proposed += spec.stats.draft_tokens_proposed
            accepted += spec.stats.draft_tokens_accepted
    finally:
        smollm.configure(bit_exact=False)
    assert proposed > accepted > 0  # drafts were taken and drafts were refused, and neither moved a token


def test_two_turn_chat_with_reuse_equals_a_fresh_session(smollm):
    smollm.configure(mode="ngram")
    params = SamplingParams(temperature=0.0, max_tokens=80)
    code_only = SamplingParams(temperature=0.0, max_tokens=80, stop=("\n```\n",))
    session = ChatSession(smollm)
    first = session.send(f"Here is a function:\n\n```python\n{CODE}```\n\nWhat does it do?", params)
    second = session.send("Repeat the function exactly as I wrote it, in a code block.", code_only)
    # What the model writes, and so how much of it the n-gram drafter can copy, differs between CPUs
    # (AVX2 and AVX-512 kernels round differently): only counts and exactness are checked here.
    assert second.stats.prompt_tokens_reused > second.stats.prompt_tokens_evaluated  # the first turn's cache
    for stats in (first.stats, second.stats):
        assert stats.draft_tokens_accepted <= stats.draft_tokens_proposed
        assert stats.target_forward_passes == stats.steps

    smollm.forget_cache()  # nothing cached: a truly fresh session
    smollm.configure(mode="none")
    fresh = ChatSession(smollm)
    fresh.messages = session.messages[:3]
    reference = list(fresh.stream_reply(code_only))[-1].result
    assert reference.token_ids == second.token_ids


LOAD_AND_MEASURE = textwrap.dedent('''
    import json, sys
    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    from edgespec.backend import LlamaModel
    before = rss()
    model = LlamaModel(sys.argv[1], n_ctx=32768, n_threads=2)
    ids = model.tokenize("Hello there, how are you today?", add_special=True)
    model.decode(ids, n_logits=len(ids))
    print(json.dumps({"growth": rss() - before, "n_vocab": model.n_vocab, "n_ctx": model.n_ctx}))
''')


def test_a_32k_context_allocates_no_full_logits_buffer(smollm2_path):
    out = subprocess.run([sys.executable, "-c", LOAD_AND_MEASURE, str(smollm2_path)],
                         capture_output=True, text=True, check=True, timeout=300)
    measured = json.loads(out.stdout)
    full_logits = measured["n_ctx"] * measured["n_vocab"] * 4  # what logits_all=True would allocate
    assert measured["n_ctx"] == 32768
    # weights (~92 MiB) + a 32k KV cache (~720 MiB) + buffers; the logits buffer alone would be 6 GiB
    assert measured["growth"] < full_logits / 4, measured
