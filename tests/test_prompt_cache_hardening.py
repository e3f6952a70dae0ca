"""The prompt cache under what real machines do: models replaced in place, FIFOs, read-only dirs, a smaller cap,
a server's stream of unique prompts, and the RAM its store may take (issue 25, part 2)."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import threading
import time

import pytest
from rich.console import Console

from edgespec import SamplingParams
from edgespec.backend import RUNTIME, LlamaModel
from edgespec.gguf_info import read_gguf_info
from edgespec.loading import load_engine
from edgespec.memory import MemoryBudget
from edgespec.model_identity import IdentityCache, content_hash, model_identity
from edgespec.plan_table import format_plan_table
from edgespec.planner import plan
from edgespec.prefix_cache import MemoryPrefixCache, SnapshotKey
from edgespec.prefix_files import SIGHTINGS_FILE, SUFFIX, DiskPrefixCache, max_bytes_from_env
from edgespec.units import InvalidSizeError
from edgespec.prefix_sightings import BLOCK_TOKENS, RECORD_BYTES, PrefixSightings
from test_prefix_cache import rewrite_header
from tinygguf import write_tiny_model

FIXED_COST = (1.0, 1.3, 1.6, 1.9, 2.2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
MiB = 1024 * 1024


def key_for(path, n_seq=1) -> SnapshotKey:
    return SnapshotKey(model_identity(path), "f16", n_seq, RUNTIME)


def state(n_bytes: int):
    return lambda: bytes(n_bytes)


def same_size_models(directory):
    """Two tiny models of one size and shape with other weights: fine-tunes of one base at one quant type."""
    first = write_tiny_model(directory / "first.gguf", seed=11, n_layer=2)
    second = write_tiny_model(directory / "second.gguf", seed=12, n_layer=2)
    assert first.stat().st_size == second.stat().st_size
    return first, second


def generate(engine, prompt):
    return [*engine.stream_tokens(prompt, GREEDY)][-1].result


def engine_with_disk_cache(path, cache_dir):
    engine = load_engine(path, "none", n_ctx=1024, cost_curve=FIXED_COST, n_threads=1)
    engine.prefix_caches.append(DiskPrefixCache(cache_dir, min_tokens=64))
    return engine


# -- the model's identity ------------------------------------------------------------------------


def test_a_model_copied_over_another_of_the_same_size_and_mtime_gets_none_of_its_snapshots(tmp_path):
    first, second = same_size_models(tmp_path)
    path, cache = tmp_path / "model.gguf", tmp_path / "prefix-cache"
    shutil.copyfile(first, path)
    engine = engine_with_disk_cache(path, cache)
    prompt = [100 + i % 150 for i in range(300)]  # ids the tiny vocabulary has
    for _ in range(2):  # the second time, the prompt's snapshot is kept
        generate(engine, prompt)
        engine.forget_cache()
    engine.close()
    assert len(list(cache.glob("*" + SUFFIX))) == 1
    before = path.stat()
    shutil.copyfile(second, path)  # in place, as `cp -p` does: same inode ...
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # ... and the old mtime
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    replaced = engine_with_disk_cache(path, cache)
    result = generate(replaced, prompt)
    replaced.close()
    plain = load_engine(second, "none", n_ctx=1024, cost_curve=FIXED_COST, n_threads=1)
    expected = generate(plain, prompt)
    plain.close()
    assert result.stats.prompt_tokens_reused == 0
    assert result.token_ids == expected.token_ids


def test_the_identity_follows_the_content_and_not_the_header_or_the_path(tmp_path):
    first, second = same_size_models(tmp_path)
    copy = tmp_path / "copy.gguf"
    shutil.copyfile(first, copy)
    assert content_hash(first) == content_hash(copy)  # another path, the same model: snapshots are shared
    assert content_hash(first) != content_hash(second)
    # weights changed throughout (as a fine-tune changes them) under a byte-identical header
    data = bytearray(first.read_bytes())
    for start, length in read_gguf_info(first).tensor_spans:
        data[start:start + length] = bytes(b ^ 1 for b in data[start:start + length])
    tuned = tmp_path / "tuned.gguf"
    tuned.write_bytes(data)
    assert content_hash(tuned) != content_hash(first)


def test_an_identity_is_hashed_once_per_file_version(tmp_path):
    first, second = same_size_models(tmp_path)
    path, hashed = tmp_path / "model.gguf", []

    def counting_hash(model_path):
        hashed.append(model_path)
        return content_hash(model_path)

    def cache(clock=time.time_ns):
        return IdentityCache(tmp_path / "model-identity.json", clock=clock, hash_file=counting_hash)

    shutil.copyfile(first, path)
    # a file changed just now may change again within the clock's tick without a new ctime: not kept
    assert cache().identity(path) == cache().identity(path) == content_hash(first)
    assert len(hashed) == 2
    later = lambda: time.time_ns() + 60 * 10**9  # noqa: E731 - the file has not changed for a minute
    assert cache(later).identity(path) == cache(later).identity(path) == content_hash(first)
    assert len(hashed) == 3  # the second start cost nothing
    replacement = tmp_path / "replacement.gguf"
    shutil.copyfile(second, replacement)
    os.utime(replacement, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))
    os.replace(replacement, path)  # as rsync -a does: a new inode with the old mtime
    assert cache(later).identity(path) == content_hash(second)
    assert len(hashed) == 4


# -- small cases ---------------------------------------------------------------------------------


def finishes(work, seconds=60) -> bool:
    """Whether work() returns (a hang is the failure; the limit only stops the test from hanging too)."""
    raised = []

    def run():
        try:
            work()
        except BaseException as error:  # re-raised below, in the test's own thread
            raised.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if raised:
        raise raised[0]
    return not thread.is_alive()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
@pytest.mark.parametrize("where", ["snapshot", "sightings", "identity cache"])
def test_a_fifo_where_a_cache_file_should_be_hangs_nothing(tmp_path, tiny_models, where):
    notices = []
    store = DiskPrefixCache(tmp_path / "prefix-cache", max_bytes=1 << 20, min_tokens=64, notice=notices.append)
    store.directory.mkdir()
    fifo = {"snapshot": store.directory / ("0" * 32 + SUFFIX), "sightings": store.directory / SIGHTINGS_FILE,
            "identity cache": tmp_path / "cache" / "model-identity.json"}[where]
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    tokens = list(range(300))

    def use_the_cache():
        key = key_for(tiny_models["target"])
        store.save(key, tokens, state(100))
        store.save(key, tokens, state(100))
        store.longest_prefix(key, tokens)

    assert finishes(use_the_cache)
    if where == "snapshot":
        assert any("not a regular file" in notice for notice in notices) and not fifo.exists()


def test_snapshots_of_an_older_format_are_discarded_with_one_notice_for_all(tmp_path, tiny_models):
    key, notices = key_for(tiny_models["target"]), []
    store = DiskPrefixCache(tmp_path, max_bytes=1 << 20, min_tokens=64, notice=notices.append)
    for n in range(3):
        store.save(key, [n] * 300, state(100))
        assert store.save(key, [n] * 300, state(100))
    for path in tmp_path.glob("*" + SUFFIX):  # as edgespec wrote them when it keyed them by path and mtime
        path.write_bytes(rewrite_header(path.read_bytes(), format=1))
    assert store.longest_prefix(key, [0] * 300) is None
    assert len(notices) == 1 and "snapshot format 1" in notices[0]
    assert not list(tmp_path.glob("*" + SUFFIX))


def test_a_smaller_cap_evicts_when_the_store_opens(tmp_path, tiny_models):
    key = key_for(tiny_models["target"])
    store = DiskPrefixCache(tmp_path, max_bytes=1 << 20, min_tokens=64)
    prompts = [[n] * 1000 for n in (1, 2, 3)]  # 4 KB of tokens + 6 KB of state, about 10 KB each
    for age, prompt in enumerate(prompts):
        store.save(key, prompt, state(6000))
        assert store.save(key, prompt, state(6000))
        os.utime(store.longest_prefix(key, prompt).handle, ns=(age + 1, age + 1))  # the first is the oldest
    DiskPrefixCache(tmp_path, max_bytes=25_000)  # as `--prompt-cache-size` does, before any prompt
    assert sum(path.stat().st_size for path in tmp_path.glob("*" + SUFFIX)) <= 25_000
    assert store.longest_prefix(key, prompts[0]) is None
    assert store.longest_prefix(key, prompts[2]).n_common == 1000


def saved_then_read_only(tmp_path, tiny_models):
    """A cache dir holding one snapshot of 300 tokens, its key and the tokens."""
    key, tokens = key_for(tiny_models["target"]), list(range(300))
    store = DiskPrefixCache(tmp_path / "ro", max_bytes=1 << 20, min_tokens=64)
    store.save(key, tokens, state(500))
    assert store.save(key, tokens, state(500))
    return key, tokens


def test_a_read_only_cache_dir_still_restores_and_says_why_nothing_is_refreshed(tmp_path, tiny_models, monkeypatch):
    key, tokens = saved_then_read_only(tmp_path, tiny_models)
    notices = []
    store = DiskPrefixCache(tmp_path / "ro", max_bytes=1 << 20, min_tokens=64, notice=notices.append)

    def read_only_utime(*args, **kwargs):  # a read-only mount; root, running the suite, ignores file modes
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "utime", read_only_utime)
    for _ in range(3):
        found = store.longest_prefix(key, tokens)
        assert store.read(key, found) is not None
    assert len(notices) == 1 and "read-only" in notices[0] and "restored" in notices[0]


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes to read-only directories")
def test_a_read_only_cache_dir_says_so_once_and_still_restores(tmp_path, tiny_models):
    key, tokens = saved_then_read_only(tmp_path, tiny_models)
    notices = []
    for path in (tmp_path / "ro").iterdir():
        path.chmod(0o444)
    (tmp_path / "ro").chmod(0o555)
    try:
        store = DiskPrefixCache(tmp_path / "ro", max_bytes=1 << 20, min_tokens=64, notice=notices.append)
        for n in range(3):
            found = store.longest_prefix(key, tokens + [n])
            assert found.n_common == 300 and store.read(key, found) is not None
            store.save(key, tokens + [n] * 100, state(500))
    finally:
        (tmp_path / "ro").chmod(0o755)
    assert len(notices) == 1 and "read-only" in notices[0]


# -- what is kept, and how much room it takes ----------------------------------------------------


def test_on_disk_unique_prompts_leave_no_snapshot_and_a_shared_document_leaves_one(tmp_path, tiny_models):
    key = key_for(tiny_models["target"])
    store = DiskPrefixCache(tmp_path, max_bytes=1 << 30, min_tokens=64)
    for n in range(20):
        assert not store.save(key, [1000 + n] + list(range(500)), state(1000))  # a server's unique prompts
    document = list(range(2000, 2300))
    kept = [store.save(key, document + [n] * 100, state(1000)) for n in range(10)]
    assert kept == [False, True] + [False] * 8  # the second request sharing it keeps it, once
    assert len(list(tmp_path.glob("*" + SUFFIX))) == 1
    assert store.longest_prefix(key, document + [99]).n_common == len(document)


def test_a_chats_next_turn_replaces_its_last_snapshot(tmp_path, tiny_models):
    key = key_for(tiny_models["target"])
    store = DiskPrefixCache(tmp_path, max_bytes=1 << 30, min_tokens=64)
    history = list(range(300))
    assert not store.save(key, history, state(1000))  # a first turn: noted only
    for turn in range(1, 4):
        history = history + [turn] * 50
        assert store.save(key, history, state(1000))  # it starts with the turn before: kept, in its place
        assert len(list(tmp_path.glob("*" + SUFFIX))) == 1


def test_the_chat_apps_store_keeps_a_chat_from_its_first_reply(tmp_path, tiny_models):
    key = key_for(tiny_models["target"])
    store = DiskPrefixCache(tmp_path, max_bytes=1 << 30, min_tokens=64, keep_every_prompt=True)
    assert store.save(key, list(range(300)), state(1000))  # every chat is kept to be reopened
    assert store.save(key, list(range(300)) + [1] * 10, state(1000))  # its next turn, in its place
    assert len(list(tmp_path.glob("*" + SUFFIX))) == 1


def test_the_sightings_file_stays_bounded(tmp_path):
    sightings = PrefixSightings(tmp_path / "seen", max_records=100)
    for n in range(200):
        sightings.seen_then_note("model", [n] * (10 * BLOCK_TOKENS))
        assert (tmp_path / "seen").stat().st_size <= 2 * 100 * RECORD_BYTES
    assert sightings.seen_then_note("model", [199] * (10 * BLOCK_TOKENS)) == 10 * BLOCK_TOKENS
    assert sightings.seen_then_note("another model", [199] * (10 * BLOCK_TOKENS)) == 0
    (tmp_path / "seen").write_bytes(b"torn")  # a record cut short: started afresh, never misread
    assert sightings.seen_then_note("model", [199] * (10 * BLOCK_TOKENS)) == 0
    assert (tmp_path / "seen").stat().st_size % RECORD_BYTES == 0


def test_the_memory_store_holds_the_states_it_is_given_in_maps_of_their_own(tiny_models):
    model = LlamaModel(tiny_models["target"], n_ctx=1024, n_threads=1)
    key, store = key_for(tiny_models["target"]), MemoryPrefixCache(max_bytes=1 << 20, min_tokens=64)
    prompts = [[n] + [100 + i % 150 for i in range(299)] for n in range(20)]  # ids the tiny vocabulary has
    states = []
    for prompt in prompts:
        model.rewind(0)
        model.decode(prompt, n_logits=0)
        states.append(model.state_bytes())
        assert isinstance(states[-1], mmap.mmap)  # not on the heap, where an evicted one leaves a hole
        store.save(key, prompt, lambda: states[-1])
        assert store.held_bytes <= store.max_bytes
    last = store.longest_prefix(key, prompts[-1])
    assert store.read(key, last) is states[-1]  # kept as given: no copy
    kept = [(prompt, data) for prompt, data in zip(prompts, states) if store.longest_prefix(key, prompt) is not None]
    assert len(kept) < len(prompts) and store.held_bytes == sum(4 * len(p) + len(data) for p, data in kept)
    model.close()


def cpu_budget(n_bytes: int) -> MemoryBudget:
    return MemoryBudget("cpu", n_bytes, n_bytes, "test")


def test_the_plan_counts_the_servers_snapshots_in_ram_and_gives_them_only_what_the_models_leave(tiny_models):
    target = read_gguf_info(tiny_models["target"])
    bare = plan(target, None, n_ctx=1024, budget=cpu_budget(1 << 30), gpu_offload=False)
    served = plan(target, None, n_ctx=1024, budget=cpu_budget(1 << 30), gpu_offload=False, prompt_cache_ram=256 * MiB)
    assert served.prompt_cache_ram == 256 * MiB and served.total_bytes == bare.total_bytes + 256 * MiB
    assert served.fits and not served.warnings
    full_context = served.parts[0].kv_bytes
    console = Console(width=200, record=True)
    console.print(format_plan_table(served))
    text = " ".join(console.export_text().split())  # the caption wraps at the table's width
    assert f"up to 256.0 MiB, {256 * MiB // full_context} of a full 1024-token context" in text
    tight = bare.total_bytes + 20 * MiB
    squeezed = plan(target, None, n_ctx=1024, budget=cpu_budget(tight), gpu_offload=False, prompt_cache_ram=256 * MiB)
    assert squeezed.prompt_cache_ram == 10 * MiB and squeezed.fits  # half of what is left: a cache must not swap
    assert squeezed.total_bytes == bare.total_bytes + 10 * MiB
    assert any("prompt snapshots in RAM get 10.0 MiB, not the 256.0 MiB asked" in line for line in squeezed.warnings)
    full = plan(target, None, n_ctx=1024, budget=cpu_budget(bare.total_bytes), gpu_offload=False,
                prompt_cache_ram=256 * MiB)
    assert full.prompt_cache_ram == 0 and full.fits and any("still works" in warning for warning in full.warnings)
    gpu = MemoryBudget("cuda", 1 << 30, 1 << 30, "test")
    on_gpu = plan(target, None, n_ctx=1024, budget=gpu, gpu_offload=True, prompt_cache_ram=256 * MiB)
    bare_gpu = plan(target, None, n_ctx=1024, budget=gpu, gpu_offload=True)
    assert on_gpu.prompt_cache_ram == 256 * MiB and on_gpu.total_bytes == bare_gpu.total_bytes  # RAM, not VRAM


def test_a_bad_cache_size_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("EDGESPEC_PROMPT_CACHE_SIZE", "lots")
    with pytest.raises(InvalidSizeError, match="^EDGESPEC_PROMPT_CACHE_SIZE: memory size 'lots' is not understood"):
        max_bytes_from_env()
    monkeypatch.setenv("EDGESPEC_PROMPT_CACHE_SIZE", "2MiB")
    assert max_bytes_from_env() == 2 * 1024 * 1024
