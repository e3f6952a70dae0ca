"""Planner decisions over budgets x real model metadata, and estimate accuracy against llama.cpp."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rich.console import Console

from edgespec.errors import EdgespecError, flag_worded
from edgespec.gguf_info import GGUFInfo, read_gguf_info
from edgespec.memory import MemoryBudget, budget_override
from edgespec.units import parse_size
from edgespec.fetch import resolve_model
from edgespec.plan_table import format_plan_table
from edgespec.planner import (
    compute_bytes,
    kv_bytes_per_layer,
    model_memory,
    plan,
    plan_models,
)
from tinygguf import write_model_family

MiB = 1024**2

# Header of qwen2.5-coder-1.5b-instruct-q4_k_m.gguf (1,117,320,768 bytes, the
# catalog's qwen2.5-coder-1.5b-instruct), read with edgespec.gguf_info on the
# development machine.  The file is not available in CI, so its numbers live
# here; test_qwen_numbers_match_the_file checks them wherever the file is.
QWEN = GGUFInfo(
    path=Path("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
    architecture="qwen2",
    name="Qwen2.5 Coder 1.5B Instruct GGUF",
    parameter_count=1777088000,
    file_type=15,
    quantization="Q4_K_M",
    n_layer=28,
    n_embd=1536,
    n_head=12,
    n_head_kv=2,
    head_dim=128,
    context_length=32768,
    vocab_size=151936,
    tokenizer_model="gpt2",
    bos_id=151643,
    eos_id=151645,
    chat_template=None,
    file_size=1117320768,
    tensor_bytes=1111370240,
    # Q4_K_M keeps some layers' tensors in Q6_K, hence two block sizes.
    layer_tensor_bytes=(
        29990912, 29990912, 26341376, 26341376, 26341376, 29990912, 29990912,
        29990912, 29990912, 29990912, 29990912, 26341376, 26341376, 29990912,
        26341376, 26341376, 29990912, 26341376, 26341376, 29990912, 26341376,
        29990912, 26341376, 26341376, 29990912, 26341376, 26341376, 29990912,
    ),
    other_tensor_bytes=322718208,
    metadata={"qwen2.feed_forward_length": 8960},
)


def _local_model(name: str) -> Path:
    try:
        return resolve_model(name, pull=False)
    except EdgespecError as error:
        pytest.skip(f"{name} is not downloaded here: {error}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, GGUFInfo]:
    paths = write_model_family(tmp_path_factory.mktemp("tiny"))
    return {role: read_gguf_info(paths[role]) for role in ("target", "draft")}


@pytest.fixture(scope="module")
def smol_path() -> Path:
    return _local_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def smol(smol_path) -> GGUFInfo:
    return read_gguf_info(smol_path)


def _models(name: str, tiny, request) -> tuple[GGUFInfo, GGUFInfo | None]:
    """Target and draft metadata by case name.  Pairs need not share a vocabulary: only sizes matter here."""
    if name == "qwen+smol":
        return QWEN, request.getfixturevalue("smol")
    if name == "qwen":
        return QWEN, None
    if name == "smol+tiny":
        return request.getfixturevalue("smol"), tiny["draft"]
    if name == "tiny+tiny":
        return tiny["target"], tiny["draft"]
    raise AssertionError(name)


def _gpu(size: str) -> MemoryBudget:
    return budget_override(parse_size(size), gpu_offload=True)


def _ram(size: str) -> MemoryBudget:
    return MemoryBudget("cpu", parse_size(size), parse_size(size), "test RAM")


# (case id, models, n_ctx, offload?, budget, mode, target layers, draft layers)
# Sizes at n_ctx 4096, f16 KV: Qwen on a GPU needs 1.20 GiB (all 28 blocks
# 752 MiB + output head 308 MiB + KV 112 MiB + compute 82 MiB); SmolLM2 needs
# 206 MiB.  In RAM each adds its tokenizer: Qwen 1.27 GiB, SmolLM2 222 MiB.
# The tiny target needs 2.30 MiB on a GPU at n_ctx 512, its draft 1.89 MiB.
DECISIONS = [
    # 1 + 3: the whole target fits, and the draft next to it
    ("gpu-both-fit", "qwen+smol", 4096, True, "6GiB", "draft-model", 29, 31),
    ("gpu-both-fit-small", "smol+tiny", 4096, True, "300MiB", "draft-model", 31, 3),
    ("gpu-tiny-both-fit", "tiny+tiny", 512, True, "8MiB", "draft-model", 5, 3),
    # 1 + 4: the target fits but the draft does not
    ("gpu-no-room-for-draft", "qwen+smol", 4096, True, "1.3GiB", "ngram", 29, 0),
    ("gpu-tiny-no-room-for-draft", "tiny+tiny", 512, True, "3MiB", "ngram", 5, 0),
    # 2: partial offload, no draft.  At 1 GiB all 28 blocks fit but not the
    # output head; at 512 MiB the last 15 blocks (and their KV) do.
    ("gpu-partial-all-blocks", "qwen+smol", 4096, True, "1GiB", "ngram", 28, 0),
    ("gpu-partial-half", "qwen+smol", 4096, True, "512MiB", "ngram", 15, 0),
    ("gpu-partial-tiny", "tiny+tiny", 512, True, "1.8MiB", "ngram", 1, 0),
    ("gpu-nothing-fits", "qwen", 4096, True, "64MiB", "ngram", 0, 0),
    # no draft model given: n-gram drafting
    ("gpu-no-draft", "qwen", 4096, True, "6GiB", "ngram", 29, 0),
    # CPU only: the same choice, in RAM
    ("cpu-both-fit", "qwen+smol", 4096, False, "2GiB", "draft-model", 0, 0),
    ("cpu-no-room-for-draft", "qwen+smol", 4096, False, "1.3GiB", "ngram", 0, 0),
    ("cpu-tiny-both-fit", "tiny+tiny", 512, False, "8MiB", "draft-model", 0, 0),
    ("cpu-tiny-no-room-for-draft", "tiny+tiny", 512, False, "4MiB", "ngram", 0, 0),
]


@pytest.mark.parametrize(
    "models,n_ctx,offload,size,mode,target_layers,draft_layers",
    [case[1:] for case in DECISIONS],
    ids=[case[0] for case in DECISIONS],
)
def test_decisions(models, n_ctx, offload, size, mode, target_layers, draft_layers, tiny, request):
    target, draft = _models(models, tiny, request)
    budget = _gpu(size) if offload else _ram(size)
    chosen = plan(target, draft, n_ctx=n_ctx, budget=budget, gpu_offload=offload)
    assert (chosen.mode, chosen.target_gpu_layers, chosen.draft_gpu_layers) == (mode, target_layers, draft_layers)
    assert chosen.fits and chosen.total_bytes <= budget.available_bytes
    assert chosen.warnings == ()
    assert chosen.device == ("cuda" if offload else "cpu")
    assert [part.role for part in chosen.parts] == (["target", "draft"] if mode == "draft-model" else ["target"])
    assert chosen.total_bytes == sum(part.budget_bytes for part in chosen.parts)
    assert "\n" not in chosen.reason and len(chosen.reason) > 20
    if offload and target_layers <= target.n_layer:
        # partial offload takes as many layers as fit, and not one more
        one_more = model_memory(target, "target", gpu_layers=target_layers + 1, on_gpu=True, n_ctx=n_ctx)
        assert one_more.budget_bytes > budget.available_bytes
        assert "offloaded" in chosen.reason
    if draft is not None and mode == "ngram":
        assert "n-gram" in chosen.reason


def test_cpu_plan_drops_the_draft_even_when_the_target_alone_does_not_fit():
    chosen = plan(QWEN, QWEN, n_ctx=4096, budget=_ram("1GiB"), gpu_offload=False)
    assert chosen.mode == "ngram" and not chosen.fits
    assert chosen.reason.startswith("CPU only")
    assert len(chosen.warnings) == 1 and "target alone" in chosen.warnings[0]


def test_a_plan_over_a_budget_given_says_the_budget_not_the_memory_free():
    # "100.0 MiB of RAM is available" read as the machine's, with 22 GiB free
    chosen = plan(QWEN, None, n_ctx=4096, budget=budget_override(parse_size("100MiB"), gpu_offload=False),
                  gpu_offload=False)
    assert not chosen.fits and flag_worded(chosen.warnings[0]).endswith("over the 100.0 MiB budget of --memory-budget")


def test_gpu_build_without_detected_gpu_memory_plans_for_ram(tiny):
    ram = MemoryBudget("cpu", 8 * MiB, 8 * MiB, "RAM, no GPU memory found")
    chosen = plan(tiny["target"], tiny["draft"], n_ctx=512, budget=ram, gpu_offload=True)
    assert chosen.device == "cpu" and chosen.target_gpu_layers == 0
    assert "no GPU memory found" in chosen.reason


def test_forced_modes_are_kept(tiny):
    for mode in ("ngram", "none"):
        chosen = plan(tiny["target"], tiny["draft"], n_ctx=512, budget=_gpu("8MiB"), gpu_offload=True,
                      force_mode=mode)
        assert chosen.mode == mode and len(chosen.parts) == 1 and chosen.fits
        assert "as asked" in chosen.reason


def test_forced_draft_takes_the_layers_that_are_left(smol):
    chosen = plan(QWEN, smol, n_ctx=4096, budget=_gpu("1.3GiB"), gpu_offload=True, force_mode="draft-model")
    assert chosen.mode == "draft-model" and chosen.target_gpu_layers == 29
    assert 0 < chosen.draft_gpu_layers < smol.n_layer
    assert chosen.fits and chosen.warnings == ()


def test_forced_layers_that_do_not_fit_warn(smol):
    chosen = plan(QWEN, smol, n_ctx=4096, budget=_gpu("512MiB"), gpu_offload=True, force_gpu_layers=-1)
    assert chosen.target_gpu_layers == 29 and chosen.mode == "ngram" and not chosen.fits
    assert len(chosen.warnings) == 1 and "forced plan" in flag_worded(chosen.warnings[0])

    chosen = plan(QWEN, smol, n_ctx=4096, budget=_gpu("1.3GiB"), gpu_offload=True, force_draft_gpu_layers=-1)
    assert (chosen.mode, chosen.target_gpu_layers, chosen.draft_gpu_layers) == ("draft-model", 29, 31)
    assert not chosen.fits and "forced plan" in flag_worded(chosen.warnings[0])


def test_forced_target_layers_leave_room_for_the_draft(smol):
    chosen = plan(QWEN, smol, n_ctx=4096, budget=_gpu("6GiB"), gpu_offload=True, force_gpu_layers=10)
    assert (chosen.mode, chosen.target_gpu_layers, chosen.draft_gpu_layers) == ("draft-model", 10, 31)
    assert chosen.fits


def test_layer_flags_are_ignored_without_offload(tiny):
    chosen = plan(tiny["target"], tiny["draft"], n_ctx=512, budget=_ram("8MiB"), gpu_offload=False,
                  force_gpu_layers=3)
    assert chosen.target_gpu_layers == 0 and "ignored" in chosen.warnings[0]


def test_bad_choices_are_refused(tiny):
    with pytest.raises(ValueError):
        plan(tiny["target"], None, n_ctx=512, budget=_gpu("8MiB"), gpu_offload=True, force_mode="draft-model")
    with pytest.raises(ValueError):
        plan(tiny["target"], None, n_ctx=512, budget=_gpu("8MiB"), gpu_offload=True, force_mode="fast")
    with pytest.raises(ValueError):
        plan(tiny["target"], None, n_ctx=512, budget=_gpu("8MiB"), gpu_offload=True, kv_type="f12")


def test_kv_cache_size_follows_the_formula_and_type():
    # n_layer x n_ctx x n_head_kv x head_dim x 2 (K and V) x bytes per element
    f16 = kv_bytes_per_layer(QWEN, 4096)
    assert f16 * QWEN.n_layer == 28 * 4096 * 2 * 128 * 2 * 2 == 112 * MiB
    # q8_0 is 34 bytes and q4_0 18 bytes per 32 elements, f16 64; without flash attention V stays f16
    assert kv_bytes_per_layer(QWEN, 4096, "q8_0") * 128 == f16 * (34 + 64)
    assert kv_bytes_per_layer(QWEN, 4096, "q4_0") * 128 == f16 * (18 + 64)
    assert kv_bytes_per_layer(QWEN, 4096, "q8_0", flash_attn=True) * 64 == f16 * 34
    assert kv_bytes_per_layer(QWEN, 4096, "q4_0", flash_attn=True) * 64 == f16 * 18
    smaller = plan(QWEN, None, n_ctx=4096, budget=_gpu("6GiB"), gpu_offload=True, kv_type="q8_0")
    assert smaller.parts[0].kv_bytes < 112 * MiB and smaller.kv_type == "q8_0"


def test_the_draft_gets_its_own_kv_type_and_the_table_shows_both(tiny):
    chosen = plan(tiny["target"], tiny["draft"], n_ctx=512, budget=_gpu("8MiB"), gpu_offload=True,
                  kv_type="q8_0", draft_kv_type="q4_0", flash_attn=True)
    target, draft = chosen.parts
    assert target.kv_bytes == kv_bytes_per_layer(tiny["target"], 512, "q8_0", True) * target.n_layer
    assert draft.kv_bytes == kv_bytes_per_layer(tiny["draft"], 512, "q4_0", True) * draft.n_layer
    assert chosen.to_dict()["kv_cache_types"] == {"target": "K q8_0, V q8_0", "draft": "K q4_0, V q4_0"}
    console = Console(width=140, record=True)
    console.print(format_plan_table(chosen))
    text = console.export_text()
    assert "K q8_0, V q8_0" in text and "K q4_0, V q4_0" in text
    same = plan(tiny["target"], tiny["draft"], n_ctx=512, budget=_gpu("8MiB"), gpu_offload=True, kv_type="q8_0")
    assert same.draft_kv_type == "q8_0" and same.cache_types("draft") == "K q8_0, V f16"


@pytest.mark.parametrize("kv_type, flash_attn", [("f16", False), ("q8_0", False), ("q4_0", False),
                                                 ("q8_0", True), ("q4_0", True)])
def test_the_kv_cache_estimate_is_what_llama_cpp_allocates(smol_path, smol, kv_type, flash_attn):
    from edgespec.backend import LlamaModel

    model = LlamaModel(smol_path, n_ctx=1024, n_threads=1, kv_type=kv_type, flash_attn=flash_attn)
    try:
        reported = model.kv_buffer_bytes  # from llama.cpp's log line "CPU KV buffer size = X MiB"
    finally:
        model.close()
    estimate = plan(smol, None, n_ctx=1024, budget=_ram("4GiB"), gpu_offload=False, kv_type=kv_type,
                    flash_attn=flash_attn).parts[0].kv_bytes
    assert reported is not None and abs(estimate - reported) <= 0.005 * MiB  # llama.cpp logs 2 decimals of MiB


def test_sequences_decoded_together_each_get_a_target_kv_cache_as_llama_cpp_allocates(smol_path, smol, tiny):
    from edgespec.backend import LlamaModel

    model = LlamaModel(smol_path, n_ctx=1024, n_threads=1, kv_type="q8_0")
    try:
        model.reserve_sequences(4)
        reported = model.kv_buffer_bytes
    finally:
        model.close()
    estimate = plan(smol, None, n_ctx=1024, budget=_ram("4GiB"), gpu_offload=False, kv_type="q8_0", parallel=4)
    assert reported is not None and abs(estimate.parts[0].kv_bytes - reported) <= 0.005 * MiB
    one = plan(smol, None, n_ctx=1024, budget=_ram("4GiB"), gpu_offload=False, kv_type="q8_0")
    assert estimate.parts[0].kv_bytes == 4 * one.parts[0].kv_bytes
    both = plan(tiny["target"], tiny["draft"], n_ctx=512, budget=_ram("4GiB"), gpu_offload=False, parallel=3)
    alone = plan(tiny["target"], tiny["draft"], n_ctx=512, budget=_ram("4GiB"), gpu_offload=False)
    assert both.parts[0].kv_bytes == 3 * alone.parts[0].kv_bytes
    assert both.parts[1].kv_bytes == alone.parts[1].kv_bytes  # the draft model drafts one sequence at a time
    console = Console(width=140, record=True)
    console.print(format_plan_table(both))
    assert "512 tokens x 3" in console.export_text()


def test_zero_context_means_the_trained_context(tiny):
    chosen = plan(QWEN, None, n_ctx=0, budget=_gpu("6GiB"), gpu_offload=True)
    assert chosen.n_ctx == 32768


def test_plan_models_reads_files_and_the_budget(tiny, tmp_path):
    paths = write_model_family(tmp_path)
    chosen = plan_models(paths["target"], paths["draft"], n_ctx=512, gpu_offload=True, memory_budget="3MiB")
    assert (chosen.mode, chosen.target_gpu_layers, chosen.budget_source) == ("ngram", 5, "memory_budget")
    assert chosen.budget_bytes == 3 * MiB


def test_json_and_table_show_the_plan(tiny):
    chosen = plan(tiny["target"], tiny["draft"], n_ctx=512, budget=_gpu("8MiB"), gpu_offload=True)
    data = json.loads(json.dumps(chosen.to_dict()))
    assert data["mode"] == "draft-model" and data["fits"] is True
    assert [p["gpu_layers"] for p in data["parts"]] == [5, 3]
    assert data["total_bytes"] == sum(p["total_bytes"] for p in data["parts"])

    console = Console(width=140, record=True)
    console.print(format_plan_table(chosen))
    text = console.export_text()
    for expected in ("draft-model", "target.gguf", "draft.gguf", "all 4 + output", "8.0 MiB", "--memory-budget",
                     "whole target on the GPU"):
        assert expected in text


def test_qwen_numbers_match_the_file():
    info = read_gguf_info(_local_model("qwen2.5-coder-1.5b-instruct"))
    for field in ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "context_length", "vocab_size",
                  "file_size", "tensor_bytes", "layer_tensor_bytes", "other_tensor_bytes"):
        assert getattr(info, field) == getattr(QWEN, field), field
    assert info.metadata["qwen2.feed_forward_length"] == 8960


# Loads the model the way edgespec does, runs one short batch so the weights
# and buffers are touched, and reports llama.cpp's tensor size and RSS growth.
_MEASURE = textwrap.dedent("""
    import json, sys
    import llama_cpp
    from edgespec.backend import LlamaModel

    def rss():
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024

    before = rss()
    model = LlamaModel(sys.argv[1], n_ctx=int(sys.argv[2]), n_gpu_layers=0, n_threads=2)
    model.decode(model.tokenize("The quick brown fox jumps over the lazy dog.", add_special=True), n_logits=4)
    print(json.dumps({"rss_growth": rss() - before, "model_size": llama_cpp.llama_model_size(model.weights.handle)}))
""")


def measure_load(path: Path, n_ctx: int) -> dict:
    completed = subprocess.run([sys.executable, "-c", _MEASURE, str(path), str(n_ctx)],
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr[-2000:]
    return json.loads(completed.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="RSS is read from /proc")
def test_smollm2_estimate_matches_llama_cpp(smol_path, smol):
    n_ctx = 4096
    chosen = plan(smol, None, n_ctx=n_ctx, budget=_ram("4GiB"), gpu_offload=False)
    estimate = chosen.parts[0]
    measured = measure_load(smol_path, n_ctx)
    assert abs(estimate.weights_bytes - measured["model_size"]) <= 0.10 * measured["model_size"]
    assert abs(chosen.total_bytes - measured["rss_growth"]) <= 0.25 * measured["rss_growth"], (
        f"estimate {chosen.total_bytes / MiB:.1f} MiB, RSS growth {measured['rss_growth'] / MiB:.1f} MiB"
    )


def test_compute_allowance_grows_with_context_and_batch(smol):
    assert compute_bytes(smol, 8192) > compute_bytes(smol, 512)
    assert compute_bytes(smol, 4096, n_batch=512) > compute_bytes(smol, 4096, n_batch=128)
    # what llama.cpp 0.3.36 reported for SmolLM2 at n_ctx 4096, n_ubatch 128, 64 output rows: 21.60 MiB
    assert 21.6 * MiB <= compute_bytes(smol, 4096) <= 1.5 * 21.6 * MiB


def test_the_planner_imports_without_starting_llama_cpp():
    # `edgespec plan` is GGUF arithmetic: it must not load llama.cpp (the backend calls llama_backend_init at import)
    check = "import sys; import edgespec.planner; assert 'llama_cpp' not in sys.modules, sorted(sys.modules)"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
