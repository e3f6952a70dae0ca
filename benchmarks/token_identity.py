"""Record the tokens edgespec generates in many configurations, or compare them with a recording.

A restructuring of the decoding loop must not change what it generates.  This
script runs, on the models it finds, every drafting mode with and without
--bit-exact, at T = 0 and at T = 0.7 with a seed, one sequence at a time
(`generate`, a multi-turn chat, a chat whose oldest turn is shifted out) and
as batches (`edgespec batch` with --parallel 1 and 3), all on a fixed cost
curve so that no draft length depends on the machine's speed or load.

    .venv/bin/python benchmarks/token_identity.py record base.json
    .venv/bin/python benchmarks/token_identity.py compare base.json     # exit 1 on any difference

Models: SmolLM2-135M (none, ngram), the test suite's tiny target/draft pair
(draft-model, combined), and the Qwen2.5-Coder 1.5B/0.5B pair when
`edgespec models path` finds it (with n-grams when the 0.5B draft is
missing; --models to choose).  Identity holds on
one machine and llama.cpp build: record and compare on the same one, with
the same number of threads (llama.cpp's default is the cores the process may
use: `taskset -c 0` for both makes it one, and fast on a busy machine).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from edgespec import loading  # noqa: E402
from edgespec.commands import main as cli_main  # noqa: E402
from edgespec.fetch import resolve_model  # noqa: E402
from edgespec.sampling import SamplingParams  # noqa: E402
from edgespec.session import ChatSession  # noqa: E402

# One pass over n tokens costs 1 + (n - 1) / 3 units: drafting pays, and no draft length depends on timing.
FIXED_CURVE = tuple(1.0 + (n - 1) / 3 for n in range(1, 18))
TEMPERATURES = ((0.0, None), (0.7, 1234))
PROMPTS = (
    "Repeat this list exactly, then add one more item: apple, banana, cherry, date, elderberry, fig.",
    "Explain in two sentences what a hash table is.",
)
CHAT_TURNS = ("Name three sorting algorithms.", "Which of them is stable?")
BATCH_LINES = [
    {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
     "body": {"messages": [{"role": "user", "content": text}], "max_tokens": 24}}
    for i, text in enumerate(PROMPTS + CHAT_TURNS)
] + [{"custom_id": "raw", "method": "POST", "url": "/v1/completions",
      "body": {"prompt": "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "max_tokens": 24}}]
# The catalog's drafts for Qwen2.5-Coder-1.5B, its default (Q4_K_M) first.
QWEN_DRAFTS = ("qwen2.5-coder-0.5b-instruct-q4_k_m", "qwen2.5-coder-0.5b-instruct")
MODES = ("none", "ngram", "draft-model", "combined")
# Batch figures that depend on time, not on the tokens.
TIMED = {"prefill_seconds", "decode_seconds", "decode_tokens_per_second"}


def models(names: list[str]) -> dict[str, tuple[str, str]]:
    """name -> (target path, draft: a path, or "ngram") for every model set found."""
    found = {}
    if "smollm2" in names:
        found["smollm2"] = (str(resolve_model("smollm2-135m-instruct", pull=False)), "ngram")
    if "tiny" in names:
        from tinygguf import write_model_family

        family = write_model_family(Path(tempfile.mkdtemp(prefix="token-identity-")))
        found["tiny"] = (str(family["target"]), str(family["draft"]))
    if "qwen" in names:
        with contextlib.suppress(Exception):
            target = resolve_model("qwen2.5-coder-1.5b-instruct", pull=False)
            draft = "ngram"
            for name in QWEN_DRAFTS:  # the first one present
                with contextlib.suppress(Exception):
                    draft = str(resolve_model(name, pull=False))
                    break
            found["qwen"] = (str(target), draft)
    return found


def params(temperature: float, seed: int | None, max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens)


def single_runs(target: str, draft: str, modes: tuple[str, ...] = MODES, n_ctx: int = 2048) -> dict:
    """Token ids per configuration, one generation at a time on one engine (which learns across them)."""
    out = {}
    engine = loading.load_engine(target, draft, n_ctx=n_ctx, pull=False, cost_curve=FIXED_CURVE,
                                 notice=lambda text: None)
    try:
        for mode in [mode for mode in modes if draft != "ngram" or mode in ("none", "ngram")]:
            for bit_exact in (False, True):
                for temperature, seed in TEMPERATURES:
                    engine.configure(mode=mode, bit_exact=bit_exact)
                    engine.forget_learning()
                    engine.forget_cache()
                    name = f"{mode}/{'bit-exact' if bit_exact else 'default'}/T{temperature}"
                    out[f"generate/{name}"] = [engine.generate(prompt, params(temperature, seed)).token_ids
                                               for prompt in PROMPTS]
                    session = ChatSession(engine, "You are brief.")
                    out[f"chat/{name}"] = [session.send(text, params(temperature, seed)).token_ids
                                           for text in CHAT_TURNS]
    finally:
        engine.close()
    return out


def shifted_chat_runs(target: str, draft: str) -> dict:
    """A chat that outgrows a 256-token context, so its oldest turns are shifted out of the caches."""
    out = {}
    engine = loading.load_engine(target, draft, n_ctx=256, pull=False, cost_curve=FIXED_CURVE,
                                 notice=lambda text: None)
    try:
        for temperature, seed in TEMPERATURES:
            engine.forget_learning()
            engine.forget_cache()
            session = ChatSession(engine)
            turns = [f"Turn {i}: say something about the number {i * 7}, in one sentence. " * 3 for i in range(5)]
            out[f"shifted-chat/{engine.mode}/T{temperature}"] = [
                session.send(text, params(temperature, seed, max_tokens=20)).token_ids for text in turns]
    finally:
        engine.close()
    return out


def batch_runs(target: str, draft: str, modes: tuple[str, ...] = MODES) -> dict:
    """The records of `edgespec batch` (text and token figures) at --parallel 1 and 3, per configuration."""
    out = {}
    original = loading.load_engine

    def fixed_curve_load(*args, **kwargs):
        return original(*args, **{**kwargs, "cost_curve": FIXED_CURVE, "pull": False})

    loading.load_engine = fixed_curve_load
    try:
        with tempfile.TemporaryDirectory() as tmp:
            batch_in = Path(tmp) / "in.jsonl"
            batch_in.write_text("".join(json.dumps(line) + "\n" for line in BATCH_LINES))
            # --draft none, and the given draft: a model (the engine picks per step: "combined") or n-grams
            chosen = {"none": "none", draft: "ngram" if draft == "ngram" else "combined"}
            for drafting in [name for name, mode in chosen.items() if mode in modes]:
                for bit_exact in (False, True):
                    for temperature, seed in TEMPERATURES:
                        for parallel in (1, 3):
                            if bit_exact and parallel > 1:
                                continue  # batch runs one request at a time under --bit-exact
                            name = (f"batch/{Path(drafting).name}/{'bit-exact' if bit_exact else 'default'}"
                                    f"/T{temperature}/parallel{parallel}")
                            out[name] = _batch(batch_in, Path(tmp) / f"{len(out)}.jsonl", target, drafting,
                                               bit_exact, temperature, seed, parallel)
    finally:
        loading.load_engine = original
    return out


def _batch(batch_in, batch_out, target, drafting, bit_exact, temperature, seed, parallel) -> dict:
    argv = ["batch", str(batch_in), "-o", str(batch_out), "--model", target, "--draft", drafting,
            "--no-prompt-cache", "--temperature", str(temperature), "--parallel", str(parallel), "--n-ctx", "1024"]
    argv += ["--seed", str(seed)] if seed is not None else []
    argv += ["--bit-exact"] if bit_exact else []
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code = cli_main(argv)
    if code != 0:
        raise SystemExit(f"batch {' '.join(argv)} failed ({code}):\n{err.getvalue()}")
    records = {}
    for line in batch_out.read_text().splitlines():
        record = json.loads(line)
        body = record["response"]["body"]
        stats = {key: value for key, value in body["stats"].items() if key not in TIMED}
        choice = body["choices"][0]
        records[record["custom_id"]] = {"text": choice.get("message", {}).get("content", choice.get("text")),
                                        "stats": stats}
    return dict(sorted(records.items()))


def record_all(names: list[str], modes: tuple[str, ...] = MODES) -> dict:
    out = {}
    for name, (target, draft) in models(names).items():
        print(f"{name}: one sequence at a time ...", file=sys.stderr)
        out.update({f"{name}/{key}": value for key, value in single_runs(target, draft, modes).items()})
        if "combined" in modes or draft == "ngram" and "ngram" in modes:  # the engine's own mode
            out.update({f"{name}/{key}": value for key, value in shifted_chat_runs(target, draft).items()})
        print(f"{name}: batches ...", file=sys.stderr)
        out.update({f"{name}/{key}": value for key, value in batch_runs(target, draft, modes).items()})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("record", "compare"))
    parser.add_argument("file", type=Path, help="the recording (JSON) to write or compare with")
    parser.add_argument("--models", default="smollm2,tiny,qwen", help="comma-separated: smollm2, tiny, qwen")
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated drafting modes to run (default: all, {','.join(MODES)})")
    args = parser.parse_args()
    now = record_all(args.models.split(","), tuple(args.modes.split(",")))
    if args.action == "record":
        args.file.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(now)} configurations in {args.file}", file=sys.stderr)
        return 0
    recorded = json.loads(args.file.read_text())
    differ = sorted(key for key in recorded.keys() & now.keys() if recorded[key] != now[key])
    missing = sorted(recorded.keys() - now.keys())
    for key in differ:
        print(f"DIFFERS: {key}")
    for key in missing:
        print(f"not run now: {key}")
    print(f"{len(recorded.keys() & now.keys()) - len(differ)} of {len(recorded)} configurations identical",
          file=sys.stderr)
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
