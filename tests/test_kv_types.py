"""KV cache types through loading and the engine: what they cost, what they trade away, and what they refuse."""

from __future__ import annotations

import pytest

from edgespec.errors import EdgespecError
from edgespec.loading import load_engine
from edgespec.sampling import SamplingParams


def load(path, **choices):
    notices = []
    engine = load_engine(path, "none", n_ctx=512, cost_curve=[1.0, 1.2], notice=notices.append, **choices)
    return engine, notices


def test_a_quantised_kv_type_without_flash_attention_quantises_the_keys_only_and_says_so(smollm2_path):
    engine, notices = load(smollm2_path, kv_type="q8_0", flash_attn="off")
    try:
        assert (engine.target.type_k, engine.target.type_v, engine.target.flash_attn) == ("q8_0", "f16", False)
        # the library names parameters; the command line words the same notice with its flags (test_notices.py)
        assert any("keys only" in notice and "flash_attn='off' keeps off" in notice for notice in notices), notices
        assert engine.plan.kv_type == "q8_0"
        assert engine.generate("Say hello.", SamplingParams(temperature=0.0, max_tokens=8)).token_ids
    finally:
        engine.close()


def test_flash_attention_s_auto_is_on_and_off_under_bit_exact(smollm2_path):
    engine, notices = load(smollm2_path, flash_attn="auto")
    try:
        assert engine.flash_attn and engine.target.kv_cache_label == "K f16, V f16, flash attention on"
        assert notices == []  # the commands' default says nothing
    finally:
        engine.close()
    engine, notices = load(smollm2_path, kv_type="q8_0", bit_exact=True, flash_attn="auto")
    try:
        assert (engine.target.type_k, engine.target.type_v, engine.flash_attn) == ("q8_0", "f16", False)
        assert engine.bit_exact
        assert any("keys only" in notice and "bit_exact=True keeps off" in notice for notice in notices), notices
    finally:
        engine.close()


def test_flash_attention_quantises_the_values_too_and_lifts_the_bit_exact_guarantee(smollm2_path):
    engine, notices = load(smollm2_path, kv_type="q4_0", flash_attn=True)
    try:
        assert (engine.target.type_k, engine.target.type_v) == ("q4_0", "q4_0")
        assert any("apply to keys and values" in notice for notice in notices), notices
        with pytest.raises(EdgespecError, match="flash attention off"):
            engine.configure(bit_exact=True)
        assert not engine.bit_exact
    finally:
        engine.close()
    with pytest.raises(EdgespecError, match="flash_attn='on' and bit_exact=True"):  # the library names parameters
        load(smollm2_path, flash_attn=True, bit_exact=True)
    with pytest.raises(EdgespecError, match="flash_attn must be one of auto, on, off, not 'yes'"):
        load(smollm2_path, flash_attn="yes")


class RecordingCache:
    """A calibration cache that holds a curve for every key and remembers the keys asked for."""

    def __init__(self):
        self.keys = []

    def read(self, key):
        from edgespec.calibration import CachedCalibration

        self.keys.append(key)
        return CachedCalibration(max_width=2, forward_seconds=(1.0, 1.2), stale=False)


def test_each_kv_cache_setup_is_calibrated_on_its_own(smollm2_path):
    cache = RecordingCache()
    for choices in ({}, {"kv_type": "q8_0"}, {"kv_type": "q8_0", "flash_attn": "auto"}, {"flash_attn": True}):
        engine, _ = load(smollm2_path, **choices)
        engine.calibrate(cache)
        engine.close()
    labels = [key.kv_cache for key in cache.keys]
    assert labels == ["", "K q8_0, V f16, flash attention off", "K q8_0, V q8_0, flash attention on",
                      "K f16, V f16, flash attention on"]
    assert len({key.digest() for key in cache.keys}) == 4


def test_the_default_cache_keeps_the_calibration_key_it_had_before_kv_types(smollm2_path):
    # curves measured before --kv-type existed were stored under the digest of the other fields alone
    import dataclasses
    import hashlib
    import json

    from edgespec.calibration import CalibrationKey

    key = CalibrationKey.for_model(smollm2_path, 0, 1, "llama-cpp-python 0.3.36")
    fields = {name: value for name, value in dataclasses.asdict(key).items() if name != "kv_cache"}
    assert key.digest() == hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:24]


def test_sequences_decoded_together_on_a_quantised_key_cache_run_with_flash_attention(smollm2_path):
    """llama.cpp's AUTO choice (backend.context) on keys it must dequantise inside flash attention."""
    from edgespec.generation import Done
    from edgespec.scheduler import Job

    engine, _ = load(smollm2_path, kv_type="q8_0", flash_attn="off")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=12)
        jobs = iter([Job(i, engine.prompt_tokens(p), params) for i, p in enumerate(["Say hello.", "Count to five."])])
        done = {key: event.result for key, event in engine.scheduler(2).run(lambda wait: next(jobs, None))
                if isinstance(event, Done)}
        assert engine.target.kv_cache_label == "K q8_0, V f16, flash attention on"
        assert sorted(done) == [0, 1] and all(len(r.token_ids) == 12 or r.finish_reason == "stop" for r in done.values())
    finally:
        engine.close()
