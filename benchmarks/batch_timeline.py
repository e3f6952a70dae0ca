"""Every target pass of a batch decoded together: when it ran, how long it took, and whose rows it carried.

Runs a batch file's requests through the engine's scheduler (`--parallel` sequences at a time, T = 0, each
request's own max_tokens) and prints one line per pass: its start and length, the sequences in it, its rows
and logits rows, then each sequence's part as seq:tokens/logits rows (a part with 0 logits rows is a chunk
of a prompt being fed).  A summary per number of sequences follows.  What it shows is the schedule (how
many sequences decode in a typical pass, how prompts are fed), which does not depend on the machine's
speed; the milliseconds do, so run it on an idle machine if they matter.

Run:
    .venv/bin/python benchmarks/batch_timeline.py benchmarks/batch-30.jsonl --parallel 16 --draft none
Smoke test (tiny): .venv/bin/python benchmarks/batch_timeline.py benchmarks/batch-heldout.jsonl \
    --model smollm2-135m-instruct --parallel 2 --max-tokens 8
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from edgespec.commands.batch.requests import BatchRequest, for_the_engine, read_requests  # noqa: E402
from edgespec.commands.batch.runner import chat_session  # noqa: E402
from edgespec.generation import Done  # noqa: E402
from edgespec.loading import load_engine  # noqa: E402
from edgespec.sampling import SamplingParams  # noqa: E402
from edgespec.scheduler import Job  # noqa: E402


def batch_jobs(engine, path: Path, max_tokens: int | None) -> list[Job]:
    """The batch file's chat requests as scheduler jobs, in file order, read and templated as `edgespec batch`
    reads them (requests it would refuse are left out)."""
    jobs = []
    requests = [r for r in map(for_the_engine, read_requests(path)) if isinstance(r, BatchRequest) and r.messages]
    for number, request in enumerate(requests):
        limit = max_tokens or dict(request.overrides).get("max_tokens", 128)
        params = SamplingParams(temperature=0.0, max_tokens=limit)
        jobs.append(Job(number, chat_session(engine, request.messages).reply_prompt(params), params))
    return jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("batch", type=Path, help="a batch input file (OpenAI Batch format, chat requests)")
    parser.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="none", choices=("none", "ngram"))
    parser.add_argument("--parallel", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, help="instead of each request's own")
    args = parser.parse_args()
    engine = load_engine(args.model, args.draft, notice=lambda *_: None)
    passes = []
    decode_sequences = engine.target.decode_sequences

    def logged(parts):
        started = time.perf_counter()
        rows = decode_sequences(parts)
        passes.append((started, time.perf_counter() - started, [(seq, len(tokens), n) for seq, tokens, n in parts]))
        return rows

    engine.target.decode_sequences = logged  # the instance's attribute: the class is left as it is
    jobs = iter(batch_jobs(engine, args.batch, args.max_tokens))
    began, tokens = time.perf_counter(), 0
    for _, event in engine.scheduler(args.parallel).run(lambda wait: next(jobs, None)):
        if isinstance(event, Done):
            tokens += len(event.result.token_ids)
    wall = time.perf_counter() - began
    engine.close()
    by_width = defaultdict(lambda: [0, 0.0, 0])
    for started, seconds, parts in passes:
        rows, logits = sum(part[1] for part in parts), sum(part[2] for part in parts)
        print(f"{started - began:7.2f} s {seconds * 1e3:7.1f} ms  sequences {len(parts):2d}  rows {rows:3d}  "
              f"logits {logits:3d}  " + " ".join(f"{seq}:{n}/{k}" for seq, n, k in parts))
        entry = by_width[len(parts)]
        entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + seconds, entry[2] + rows
    print(f"{tokens} tokens in {wall:.2f} s, {len(passes)} passes")
    for n, (count, seconds, rows) in sorted(by_width.items()):
        print(f"{n:2d} sequences: {count:4d} passes, {seconds:7.2f} s, {rows / count:5.1f} rows a pass")


if __name__ == "__main__":
    main()
