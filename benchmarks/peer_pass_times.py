"""What llama.cpp's own speculation pays per pass, by width, beside what edgespec's passes cost in the same rounds.

llama-speculative-simple reports one total decode time.  Its debug log, with timestamps, has one line per
verification pass ("accepted a/n draft tokens"), so the time between two such lines is one step of its loop:
drafting, one pass over 1 + n tokens with every row's logits, and sampling.  Each round runs the peer with
ngram-simple on each prompt (the chat template rendered as the bench renders it), then times edgespec's own
passes of 1 and --width tokens with every row's logits at --depth (benchmarks/output_rows_cost.py's timing),
so both programs' figures come from the same minutes of the machine.

Run on an idle machine (about a minute a round):
  .venv/bin/python benchmarks/peer_pass_times.py --llama-cpp-bin "$(benchmarks/build_llama_cpp_peer.sh)" --rounds 3
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from output_rows_cost import TEXT, timed_pass  # noqa: E402

import edgespec  # noqa: E402
from edgespec.backend import LlamaModel  # noqa: E402
from edgespec.backend.runtime import default_threads  # noqa: E402
from edgespec.commands.bench.peers import LlamaCppPeer  # noqa: E402

# "0.04.174.234 D accepted 30/48 draft tokens, ...": minutes, seconds, milliseconds, microseconds
_PASS = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) D accepted (\d+)/(\d+) draft tokens", re.MULTILINE)


def peer_steps(log: str) -> list[tuple[int, int, float]]:
    """(pass width, draft tokens kept, seconds) of each step after the first, from the peer's timestamped log."""
    stamps = [(int(m) * 60 + int(s) + int(ms) / 1e3 + int(us) / 1e6, int(kept), int(drafted) + 1)
              for m, s, ms, us, kept, drafted in _PASS.findall(log)]
    return [(width, kept, now - before) for (before, _, _), (now, kept, width) in zip(stamps, stamps[1:])]


def run_peer(peer: LlamaCppPeer, prompt: str, max_tokens: int, draft_max: int | None) -> list[tuple[int, int, float]]:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as prompt_file:
        prompt_file.write(prompt + "\n")  # the newline llama.cpp's -f drops (as LlamaCppPeer.run writes it)
        prompt_file.flush()
        args = peer.command(Path(prompt_file.name), "ngram-simple", draft_max, max_tokens, 0.0, 0)
        done = subprocess.run(args + ["-lv", "5", "--log-timestamps", "--log-prefix"], capture_output=True,
                              text=True, errors="replace", stdin=subprocess.DEVNULL, check=True)
    return peer_steps(done.stderr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp-bin", required=True, help="the folder build_llama_cpp_peer.sh prints")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--workloads", type=Path, default=Path(__file__).parent / "workloads-code-edit-12")
    parser.add_argument("--prompts", default="code-edit-12,code-edit-02", help="prompt ids, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--width", type=int, default=49, help="edgespec's wide pass (ngram-simple drafts 48)")
    parser.add_argument("--draft-max", type=int, help="the peer's draft length, as the bench's -nN sets it "
                        "(default: its own, 48); e.g. 15 with --width 16 to time the passes of its best setting here")
    parser.add_argument("--depth", type=int, default=300)
    parser.add_argument("--threads", type=int, default=default_threads(), help="for both programs")
    parser.add_argument("--json", type=Path, help="write every step's figures here")
    args = parser.parse_args()

    wanted = args.prompts.split(",")
    rows = {row["id"]: row for path in sorted(args.workloads.glob("*.jsonl")) if not path.name.startswith("replies")
            for row in map(json.loads, path.read_text().splitlines()) if row["id"] in wanted}
    with edgespec.load(args.model, draft="none", notice=lambda text: None) as engine:
        prompts = {pid: engine.render_chat([{"role": "user", "content": rows[pid]["prompt"]}]) for pid in wanted}
        peer = LlamaCppPeer(args.llama_cpp_bin, engine.target_path, draft=None, n_ctx=engine.n_ctx,
                            n_threads=args.threads)
        model_path = engine.target_path
    model = LlamaModel(model_path, n_ctx=args.depth + args.width + 8, n_threads=args.threads)
    text = model.tokenize(TEXT, add_special=False)
    stream = text * (1 + (args.depth + args.width) // len(text))
    model.decode(stream[:args.depth], 1)
    fed = stream[args.depth:args.depth + args.width]

    rounds = []
    for number in range(1, args.rounds + 1):
        figures = {"peer": {pid: run_peer(peer, prompts[pid], args.max_tokens, args.draft_max) for pid in wanted}}
        ours = {width: [timed_pass(model, fed[:width], width) for _ in range(5)] for width in (1, args.width)}
        figures["edgespec"] = {width: statistics.median(seconds) for width, seconds in ours.items()}
        rounds.append(figures)
        print(f"round {number}", file=sys.stderr)
        for pid, steps in figures["peer"].items():
            one = statistics.median(seconds for width, _, seconds in steps if width == 1)
            wide = ", ".join(f"{width}-wide kept {kept}: {seconds * 1e3:.0f} ms ({seconds / one:.1f})"
                             for width, kept, seconds in steps if width > 1)
            print(f"  peer {pid}: one-token step {one * 1e3:.1f} ms; {wide}", file=sys.stderr)
        t1, wide = figures["edgespec"][1], figures["edgespec"][args.width]
        print(f"  edgespec: one-token pass {t1 * 1e3:.1f} ms; {args.width}-wide, every row's logits: "
              f"{wide * 1e3:.0f} ms ({wide / t1:.1f})", file=sys.stderr)
    model.close()
    if args.json:
        args.json.write_text(json.dumps({"model": model_path.name, "depth": args.depth, "rounds": rounds}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
