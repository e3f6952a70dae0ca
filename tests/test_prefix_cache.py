"""The persistent prefix cache: KV snapshots restored bit for bit, across processes, and never trusted blindly."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from dataclasses import replace

import numpy as np
import pytest

from edgespec import ChatSession, SamplingParams
from edgespec.backend import RUNTIME, LlamaModel
from edgespec.loading import load_engine
from edgespec.model_identity import model_identity
from edgespec.prefix_cache import MemoryPrefixCache, SnapshotKey
from edgespec.prefix_files import MAGIC, SUFFIX, DiskPrefixCache

FIXED_COST = (1.0, 1.3, 1.6, 1.9, 2.2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
LONG_TEXT = "the cat sat on the mat and looked at the dog, who sat on the log by the door. " * 24


def snapshot_key(path, runtime=RUNTIME, n_seq=1) -> SnapshotKey:
    return SnapshotKey(model_identity(path), "f16", n_seq, runtime)


# -- llama.cpp's state, round trip -------------------------------------------------------------


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_a_restored_state_gives_the_recomputed_logits_bit_for_bit(which, tiny_models, smollm2_path):
    path = tiny_models["target"] if which == "tiny" else smollm2_path
    model = LlamaModel(path, n_ctx=1024, n_threads=1)
    ids = model.tokenize(LONG_TEXT, add_special=True)[:400]
    model.decode(ids[:-1], n_logits=0)
    state = model.state_bytes()
    recomputed = model.decode(ids[-1:], 1)[0]
    fresh = LlamaModel(path, n_ctx=1024, n_threads=1)
    assert fresh.load_state(state, ids[:-1])
    assert fresh.cached == ids[:-1]
    assert np.array_equal(fresh.decode(ids[-1:], 1)[0], recomputed)
    # a state that is not of the tokens it is said to hold, or cut short, is refused and leaves the cache empty
    assert not fresh.load_state(state, ids[:-2]) and fresh.cached == []
    assert not fresh.load_state(state[:-100], ids[:-1]) and fresh.cached == []
    model.close()
    fresh.close()


def test_a_state_restores_into_any_sequence_of_a_parallel_context(tiny_models):
    model = LlamaModel(tiny_models["target"], n_ctx=1024, n_threads=1)
    ids = model.tokenize(LONG_TEXT, add_special=True)[:300]
    model.decode(ids[:-1], n_logits=0)
    single = model.state_bytes()
    model.reserve_sequences(2)  # a new context for two sequences in one KV buffer, as batch --parallel makes
    # its flash attention (llama.cpp turns it on for every CPU) lays the values out otherwise than a lone
    # context does: a lone context's state is refused whole (the snapshot keys keep them apart anyway)
    assert model.kv_cache_label == "K f16, V f16, flash attention on"
    assert not model.load_state(single, ids[:-1], seq=1) and model.cached_of(1) == []
    model.decode(ids[:-1], n_logits=0, seq=1)
    state = model.state_bytes(1)
    recomputed = model.decode(ids[-1:], 1, seq=1)[0]
    other = LlamaModel(tiny_models["target"], n_ctx=1024, n_threads=1)
    other.reserve_sequences(2)
    assert other.load_state(state, ids[:-1], seq=0) and other.cached == ids[:-1] and other.cached_of(1) == []
    assert np.array_equal(other.decode(ids[-1:], 1)[0], recomputed)
    model.close()
    other.close()


# -- the stores' policy ------------------------------------------------------------------------


def fake_state(n_bytes: int, fill: int = 7):
    return lambda: bytes([fill]) * n_bytes


def save_seen(store, key, tokens, payload) -> bool:
    """Offer tokens to a disk store a second time, as a prompt that came back: the first offer only notes them."""
    assert not store.save(key, tokens, payload)
    return store.save(key, tokens, payload)


def test_the_disk_cache_keeps_its_cap_by_evicting_the_least_recently_used(tmp_path, tiny_models):
    key = snapshot_key(tiny_models["target"])
    store = DiskPrefixCache(tmp_path, max_bytes=30_000, min_tokens=4)
    prompts = [[n] * 1000 + list(range(10)) for n in (1, 2, 3)]  # 4 KB of tokens + 6 KB of state, about 10 KB each
    assert save_seen(store, key, prompts[0], fake_state(6000))
    assert save_seen(store, key, prompts[1], fake_state(6000))
    first, second = (store.longest_prefix(key, p) for p in prompts[:2])
    os.utime(first.handle, ns=(1, 1))  # the first is the older one ...
    os.utime(second.handle, ns=(2, 2))
    assert store.read(key, first) is not None  # ... until it is used again
    assert save_seen(store, key, prompts[2], fake_state(6000))  # three do not fit: one has to go
    assert sum(p.stat().st_size for p in tmp_path.glob("*" + SUFFIX)) <= 30_000
    assert store.longest_prefix(key, prompts[1]) is None  # the least recently used went
    assert store.longest_prefix(key, prompts[0]).n_common == len(prompts[0])
    assert store.longest_prefix(key, prompts[2]).n_common == len(prompts[2])
    assert not store.save(key, [5] * 100, fake_state(40_000))  # larger than the cap: never written ...
    assert not store.save(key, [5] * 100, fake_state(40_000))  # ... nor when it came back
    assert sum(p.stat().st_size for p in tmp_path.glob("*" + SUFFIX)) <= 30_000


def test_only_long_and_new_prefixes_are_kept_and_an_extension_replaces_its_prefix(tmp_path, tiny_models):
    key = snapshot_key(tiny_models["target"])
    store = DiskPrefixCache(tmp_path, max_bytes=1 << 20, min_tokens=100)
    document = list(range(300))
    assert not store.save(key, document[:99], fake_state(10))  # too short to be worth a file
    assert save_seen(store, key, document + [1] * 20, fake_state(10))
    assert not store.save(key, document + [2] * 20, fake_state(10))  # 20 new tokens: prefill them instead
    assert not store.save(key, document, fake_state(10))  # already held by the kept one
    assert store.save(key, document + [1] * 30, fake_state(10))  # extends the kept one, and replaces it
    assert len(list(tmp_path.glob("*" + SUFFIX))) == 1
    found = store.longest_prefix(key, document + [1] * 25 + [9])
    assert found.n_common == 325 and len(found.tokens) == 330


def rewrite_header(data: bytes, **changes) -> bytes:
    """A snapshot file's bytes with fields of its header changed, its length field kept right."""
    start = len(MAGIC) + 4
    (length,) = struct.unpack("<I", data[len(MAGIC):start])
    header = {**json.loads(data[start:start + length]), **changes}
    text = json.dumps(header).encode()
    return MAGIC + struct.pack("<I", len(text)) + text + data[start + length:]


@pytest.mark.parametrize("damage, why", [
    (lambda data: data[:-1], "truncated"),
    (lambda data: data[:-5] + bytes(5), "checksum"),
    (lambda data: b"GGSQ" + data[4:], "not an edgespec KV snapshot"),
    (lambda data: data.replace(b'"n_tokens": 400', b'"n_tokens": 401'), "truncated"),
    # sizes that add up to the file's (the header grew a byte), with a negative payload: refused as such
    (lambda data: rewrite_header(data, n_tokens=1750, payload_bytes=-400), "negative"),
    (lambda data: rewrite_header(data, format=0), "snapshot format 0"),
    (lambda data: rewrite_header(data, key={"model_path": "x"}), "header is damaged"),
])
def test_a_corrupt_snapshot_is_discarded_with_a_notice(tmp_path, tiny_models, damage, why):
    key = snapshot_key(tiny_models["target"])
    notices = []
    store = DiskPrefixCache(tmp_path, max_bytes=1 << 20, min_tokens=10, notice=notices.append)
    tokens = list(range(400))
    assert save_seen(store, key, tokens, fake_state(5000))
    path = next(tmp_path.glob("*" + SUFFIX))
    path.write_bytes(damage(path.read_bytes()))
    found = store.longest_prefix(key, tokens)
    assert found is None or store.read(key, found) is None
    assert len(notices) == 1 and why in notices[0] and "prefilled instead" in notices[0]
    assert not path.exists()


def test_a_snapshot_of_another_build_is_discarded_and_of_another_model_left_alone(tmp_path, tiny_models):
    notices = []
    store = DiskPrefixCache(tmp_path, max_bytes=1 << 20, min_tokens=10, notice=notices.append)
    tokens = list(range(400))
    assert save_seen(store, snapshot_key(tiny_models["target"], runtime="llama-cpp-python 0.0.1"), tokens, fake_state(50))
    assert save_seen(store, snapshot_key(tiny_models["draft"]), tokens, fake_state(50))
    assert store.longest_prefix(snapshot_key(tiny_models["target"]), tokens) is None
    assert len(notices) == 1 and "another llama.cpp build (llama-cpp-python 0.0.1" in notices[0]
    assert store.longest_prefix(snapshot_key(tiny_models["draft"]), tokens).n_common == 400


def test_an_unwritable_cache_dir_costs_one_notice_and_no_error(tmp_path, tiny_models):
    (tmp_path / "file").write_text("not a directory")
    notices = []
    store = DiskPrefixCache(tmp_path / "file" / "cache", min_tokens=10, notice=notices.append)
    key = snapshot_key(tiny_models["target"])
    assert not store.save(key, list(range(100)), fake_state(50))
    assert not store.save(key, list(range(200)), fake_state(50))
    assert len(notices) == 1 and "cannot save a prefix snapshot" in notices[0]


def test_the_memory_cache_holds_its_cap(tiny_models):
    key = snapshot_key(tiny_models["target"])
    store = MemoryPrefixCache(max_bytes=10_000, min_tokens=10)
    for n in range(5):
        assert store.save(key, [n] * 500, fake_state(2000))  # 4 KB of tokens + 2 KB of state
    assert store.longest_prefix(key, [4] * 500).n_common == 500
    assert store.longest_prefix(key, [3] * 500).n_common == 500
    assert store.longest_prefix(key, [2] * 500) is None  # evicted: two fit under the cap
    assert store.held_bytes <= 10_000


# -- the engine, across processes and chats ----------------------------------------------------


def cached_engine(tiny_models, draft="none", store=None):
    engine = load_engine(tiny_models["target"], draft, n_ctx=1024, cost_curve=FIXED_COST, n_threads=1)
    engine.prefix_caches.append(store or DiskPrefixCache(min_tokens=64))
    return engine


@pytest.mark.parametrize("draft", ["none", "draft"])
def test_a_new_engine_restores_the_prompt_and_gives_the_same_output(tiny_models, draft):
    draft = tiny_models["draft"] if draft == "draft" else "none"
    first = cached_engine(tiny_models, draft)
    prompt = first.prompt_tokens(LONG_TEXT, raw=True)[:600]
    cold = [*first.stream_tokens(prompt, GREEDY)][-1].result
    first.forget_cache()
    [*first.stream_tokens(prompt, GREEDY)]  # it came back: now its snapshot is kept
    first.close()
    second = cached_engine(tiny_models, draft)
    warm = [*second.stream_tokens(prompt, GREEDY)][-1].result
    assert cold.stats.prompt_tokens_reused == 0
    assert warm.stats.prompt_tokens_reused == len(prompt) - 1 and warm.stats.prompt_tokens_evaluated == 1
    assert warm.token_ids == cold.token_ids
    if draft != "none":  # the draft model's cache came from its own snapshot
        assert second.draft_model.cached[: len(prompt) - 1] == prompt[:-1]
    second.close()


def test_a_state_llama_cpp_refuses_is_discarded_and_the_prompt_prefilled(tiny_models):
    notices = []
    engine = cached_engine(tiny_models, store=DiskPrefixCache(min_tokens=64, notice=notices.append))
    prompt = engine.prompt_tokens(LONG_TEXT, raw=True)[:400]
    cold = [*engine.stream_tokens(prompt, GREEDY)][-1].result
    engine.forget_cache()
    [*engine.stream_tokens(prompt, GREEDY)]  # it came back: now its snapshot is kept
    engine.forget_cache()
    store = engine.prefix_caches[0]
    snapshot = store.longest_prefix(snapshot_key(tiny_models["target"]), prompt)
    state = store.read(snapshot_key(tiny_models["target"]), snapshot)
    snapshot.handle.unlink()
    # well-formed and checksummed, but not a state of these tokens: only llama.cpp can tell
    assert store.save(snapshot_key(tiny_models["target"]), snapshot.tokens, lambda: state[:-64])
    again = [*engine.stream_tokens(prompt, GREEDY)][-1].result
    assert again.stats.prompt_tokens_reused == 0 and again.token_ids == cold.token_ids
    assert len(notices) == 1 and "llama.cpp refused its state" in notices[0]
    engine.forget_cache()
    third = [*engine.stream_tokens(prompt, GREEDY)][-1].result
    assert third.stats.prompt_tokens_reused == len(prompt) - 1  # the second run saved a good one in its place
    engine.close()


def test_a_prompt_sharing_only_a_document_restores_the_document(tiny_models):
    engine = cached_engine(tiny_models)
    document = engine.prompt_tokens(LONG_TEXT, raw=True)[:500]
    for question in ([5, 6, 7], [8, 9, 10]):  # the second request brings the document back: it is kept
        [*engine.stream_tokens(document + question, GREEDY)]
        engine.forget_cache()  # as in another process
    result = [*engine.stream_tokens(document + [11, 12, 13], GREEDY)][-1].result
    assert result.stats.prompt_tokens_reused == len(document)
    engine.close()


def test_a_reopened_chat_prefills_only_the_new_message(tiny_models):
    engine = cached_engine(tiny_models)
    session = ChatSession(engine, system_prompt=LONG_TEXT[:1500])
    session.send("tell me about the cat", GREEDY)
    session.send("and the dog?", GREEDY)
    saved = json.loads(json.dumps(session.to_dict()))
    engine.close()
    reopened_engine = cached_engine(tiny_models)
    reopened = ChatSession.from_dict(reopened_engine, saved)
    history = len(reopened_engine.chat_tokens(reopened.visible_messages(), add_generation_prompt=False))
    result = reopened.send("what next?", GREEDY)
    new_message = result.stats.prompt_tokens - history
    assert history > 300
    assert result.stats.prompt_tokens_evaluated <= new_message + 8  # the last reply's end-of-turn tokens
    reopened_engine.close()


def test_the_server_memory_cache_keeps_two_alternating_conversations(tiny_models):
    engine = cached_engine(tiny_models, store=MemoryPrefixCache(min_tokens=64))
    text = engine.prompt_tokens(LONG_TEXT, raw=True)
    first, second = text[:400], text[400:800]
    for prompt in (first, second):
        [*engine.stream_tokens(prompt, GREEDY)]
    again = [*engine.stream_tokens(first + [3], GREEDY)][-1].result
    assert again.stats.prompt_tokens_reused == len(first)
    engine.close()


EDGESPEC = [sys.executable, "-m", "edgespec"]


def run_json(tiny_models, prompt, *flags):
    done = subprocess.run([*EDGESPEC, "run", "-", "--raw", "--json", "--model", str(tiny_models["target"]),
                           "--draft", "none", "--temperature", "0", "--max-tokens", "8", "--threads", "1",
                           "--n-ctx", "1024", *flags], input=prompt, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_run_process_reuses_from_disk_a_prompt_that_came_before_unless_told_not_to(tiny_models):
    prompt = LONG_TEXT[:800]
    cold, again, warm = (run_json(tiny_models, prompt) for _ in range(3))
    # the first run only notes the prompt; the second, seeing it come back, keeps its snapshot
    assert cold["stats"]["prompt_tokens_reused"] == again["stats"]["prompt_tokens_reused"] == 0
    assert warm["stats"]["prompt_tokens_reused"] == warm["stats"]["prompt_tokens"] - 1 > 256
    assert warm["token_ids"] == again["token_ids"] == cold["token_ids"]
    off = run_json(tiny_models, prompt, "--no-prompt-cache")
    assert off["stats"]["prompt_tokens_reused"] == 0 and off["token_ids"] == cold["token_ids"]


def test_batch_runs_requests_sharing_a_long_prefix_together_and_keeps_the_rest_in_order():
    from edgespec.commands.batch.requests import CHAT_URL, BatchRequest
    from edgespec.commands.batch.runner import _grouped_by_shared_prefix

    def chat(custom_id, *messages):
        return BatchRequest(custom_id, 1, CHAT_URL, messages=tuple({"role": r, "content": c} for r, c in messages))

    document_a, document_b = "a" * 1200, "b" * 1200
    entries = [chat("short-1", ("user", "hi")), chat("a-1", ("system", document_a), ("user", "one")),
               chat("b-1", ("user", document_b + "?")), chat("short-2", ("user", "hi")),
               chat("a-2", ("system", document_a), ("user", "two")), chat("b-2", ("user", document_b + "!"))]
    order = [entry.custom_id for entry in _grouped_by_shared_prefix(entries)]
    assert order == ["short-1", "a-1", "a-2", "b-1", "b-2", "short-2"]


def test_a_bad_prompt_cache_size_is_refused_in_one_line(tiny_models):
    done = subprocess.run([*EDGESPEC, "run", "hi", "--model", str(tiny_models["target"]), "--prompt-cache-size", "lots"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "--prompt-cache-size" in done.stderr and "not understood" in done.stderr


def test_a_cache_with_a_shifted_turn_is_never_saved_as_a_snapshot(tiny_models):
    # shifted keys and values are close to a prefill's, not equal: a restore must give a prefill's logits
    engine = cached_engine(tiny_models)
    system, dropped, kept = list(range(100, 120)), list(range(120, 200)), list(range(200, 300))  # ids the tiny vocabulary has
    params = SamplingParams(temperature=0.0, max_tokens=4)
    for _ in range(2):  # the second time it came: kept
        [*engine.stream_tokens(system + dropped + kept, params)]
    shifted = [*engine.stream_tokens(system + kept + [7], params, shift_dropped_span=True)][-1].result
    assert shifted.stats.prompt_tokens_reused == len(system + kept)  # the shift happened
    store = engine.prefix_caches[0]
    key = snapshot_key(tiny_models["target"])
    assert store.longest_prefix(key, system + kept).n_common == len(system)  # only the fresh one is kept
    for _ in range(2):  # rewound below the shifted part: fresh again, and kept the second time
        [*engine.stream_tokens(system + [9] * 200, params)]
    assert store.longest_prefix(key, system + [9] * 200).n_common == len(system) + 200
    engine.close()


def runs_one_at_a_time(engine, parallel, jobs):
    """Each of jobs, (key, prompt, cache scope), run alone and in order through the sequences of one context."""
    from edgespec.scheduler import Job

    results = {}
    for key, prompt, scope in jobs:
        waiting = [Job(key, prompt, GREEDY, cache_scope=scope)]
        for _, event in engine.scheduler(parallel).run(lambda wait: waiting.pop() if waiting else None):
            if hasattr(event, "result"):
                results[key] = event.result
    return results


@pytest.mark.parametrize("parallel", [1, 2])
def test_a_server_client_is_given_no_cells_or_snapshots_of_another_client_s_prompts(tiny_models, parallel):
    # bob found alice's prompt cached, one token more for each token of it he guessed right
    engine = cached_engine(tiny_models, store=MemoryPrefixCache(min_tokens=64))
    document = list(range(100, 300))
    runs = runs_one_at_a_time(engine, parallel, [
        ("alice", document + [5, 6], "alice"), ("bob", document + [7, 8], "bob"),
        ("bob again", document + [9, 10], "bob"),  # from his cells
        ("alice again", document + [11, 12], "alice"),  # from her snapshot: bob's cells replaced hers
        ("anyone", document + [13, 14], ""),
    ])
    reused = {key: result.stats.prompt_tokens_reused for key, result in runs.items()}
    assert reused["alice"] == reused["bob"] == reused["anyone"] == 0
    assert reused["bob again"] >= len(document) and reused["alice again"] >= len(document)
    alone = cached_engine(tiny_models)
    assert runs["bob"].token_ids == [*alone.stream_tokens(document + [7, 8], GREEDY)][-1].result.token_ids
    engine.close()
    alone.close()


@pytest.mark.parametrize("scopes", [("", ""), ("alice", "bob")])
def test_conversations_taking_turns_at_parallel_2_each_find_their_history_in_a_sequence(tiny_models, scopes):
    # bob's request emptied alice's sequence while the other one stood empty, and her next turn began again
    from edgespec.prefix_cache import MemoryPrefixCache as NoSnapshots

    engine = cached_engine(tiny_models, store=NoSnapshots(min_tokens=10**6))  # prompts under any snapshot size
    first, second = list(range(100, 160)), list(range(200, 260))
    runs = runs_one_at_a_time(engine, 2, [
        ("a1", first, scopes[0]), ("b1", second, scopes[1]),
        ("a2", first + [7, 8, 9], scopes[0]), ("b2", second + [7, 8, 9], scopes[1]),
    ])
    engine.close()
    assert runs["a2"].stats.prompt_tokens_reused >= len(first) and runs["b2"].stats.prompt_tokens_reused >= len(second)


def test_a_kept_snapshot_serves_its_own_scope_s_prompts_only(tmp_path, tiny_models):
    tokens = list(range(300))
    for store in (MemoryPrefixCache(min_tokens=64), DiskPrefixCache(tmp_path, min_tokens=64, keep_every_prompt=True)):
        alice, bob = (replace(snapshot_key(tiny_models["target"]), scope=scope) for scope in ("alice", "bob"))
        assert store.save(alice, tokens, lambda: bytes(100))
        anyone = snapshot_key(tiny_models["target"])
        assert store.longest_prefix(bob, tokens) is None and store.longest_prefix(anyone, tokens) is None
        assert store.longest_prefix(alice, tokens).n_common == 300


def test_parallel_decoding_saves_and_restores_snapshots_of_its_sequences(tiny_models):
    from edgespec.scheduler import Job

    document = list(range(100, 300))  # ids the tiny vocabulary has
    prompts = [document + [n, n + 1] for n in (5, 7, 9)]

    def run(engine):
        jobs = iter(Job(i, prompt, GREEDY) for i, prompt in enumerate(prompts))
        return {key: event.result for key, event in engine.scheduler(2).run(lambda wait: next(jobs, None))
                if hasattr(event, "result")}

    first = cached_engine(tiny_models)
    cold = run(first)
    first.close()
    warm_engine = cached_engine(tiny_models)  # another process, with the same --parallel
    warm = run(warm_engine)
    warm_engine.close()
    assert cold[0].stats.prompt_tokens_reused == 0
    assert all(warm[i].stats.prompt_tokens_reused >= len(document) for i in range(3))
    assert [warm[i].token_ids for i in range(3)] == [cold[i].token_ids for i in range(3)]


@pytest.mark.parametrize("full_disk", [True, False])
def test_a_snapshot_that_cannot_be_saved_names_the_fix_that_applies(tmp_path, tiny_models, monkeypatch, full_disk):
    # every failure advised freeing disk space, a directory where the cache should be too
    import errno

    from edgespec import prefix_files

    key = snapshot_key(tiny_models["target"])
    notices = []
    if full_disk:
        def no_space(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(prefix_files, "AtomicFile", no_space)
        store = DiskPrefixCache(tmp_path, max_bytes=1 << 20, min_tokens=10, notice=notices.append)
    else:
        (tmp_path / "a-file").write_text("")
        store = DiskPrefixCache(tmp_path / "a-file" / "cache", max_bytes=1 << 20, min_tokens=10, notice=notices.append)
    tokens = list(range(400))
    for _ in range(2):
        assert not store.save(key, tokens, fake_state(50))
    unsaved = [n for n in notices if "cannot save a prefix snapshot" in n]
    assert len(unsaved) == 1
    assert ("free some disk space" in unsaved[0]) == full_disk and "EDGESPEC_CACHE_DIR" in unsaved[0]
