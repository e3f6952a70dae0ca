"""What the prompt cache costs a server: its RSS and the snapshots on disk over many unique long prompts.

Starts `edgespec serve` on 127.0.0.1 (a free port) twice, with the prompt cache and with --no-prompt-cache,
each time in the same private EDGESPEC_CACHE_DIR with an empty prefix-cache/, and sends --requests
completions whose prompts (about --prompt-tokens tokens) share no prefix, then --shared requests that share
one long document and differ in their last line.  It prints the server's RSS (and its anonymous part) before
the first request, every --every requests and at the end, and the snapshots and bytes in prefix-cache/.

What it should show: with the cache, the RSS grows by at most about --prompt-cache-ram (the RAM store's cap)
and then stays flat, as without it; the unique prompts leave no snapshot on disk, and the shared document
leaves one.

Run:  .venv/bin/python benchmarks/prefix_cache_memory.py [--model M] [--requests 450] [--json FILE]
Check it quickly: --requests 3 --shared 2 --every 1 --prompt-tokens 300
See the plateau sooner: --prompt-cache-ram 64MiB --requests 40 --every 5 (SmolLM2: about 7.5 MB a state)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

EDGESPEC = [sys.executable, "-m", "edgespec"]
WORDS = ("river stone lamp orange window quiet engine paper garden silver marble thunder harbor velvet candle "
         "forest mirror copper ladder meadow signal button canyon pepper whistle lantern saddle rocket").split()


def unique_prompt(n: int, n_words: int) -> str:
    """n_words common words (about a token each) that no other prompt starts with."""
    rng = random.Random(n)
    return f"Note {n}: " + " ".join(rng.choice(WORDS) for _ in range(n_words)) + "\nSummary:"


def rss_kib(pid: int) -> dict:
    """The process's resident memory in KiB: total, and its anonymous part where /proc tells it."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
        return {name: int(fields[name].split()[0]) for name in ("VmRSS", "RssAnon", "RssShmem") if name in fields}
    except OSError:
        done = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True)
        return {"VmRSS": int(done.stdout.strip() or 0)}


def disk_use(cache: Path) -> dict:
    snapshots = list((cache / "prefix-cache").glob("*.kvstate"))
    seen = cache / "prefix-cache" / "seen-prefixes"
    return {"snapshots": len(snapshots), "snapshot_bytes": sum(p.stat().st_size for p in snapshots),
            "seen_prefixes_bytes": seen.stat().st_size if seen.exists() else 0}


class Server:
    """`edgespec serve` on a free port of 127.0.0.1, its stderr kept in a file."""

    def __init__(self, args, extra: list[str], log: Path):
        self.log = log
        self.process = subprocess.Popen(
            [*EDGESPEC, "serve", "--model", args.model, "--draft", args.draft, "--host", "127.0.0.1", "--port", "0",
             "--n-ctx", str(args.n_ctx), "--threads", str(args.threads), *extra],
            stdout=subprocess.DEVNULL, stderr=open(log, "w"))
        self.url = self._wait_for_url(args.start_timeout)

    def _wait_for_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = re.search(r"on (http://127\.0\.0\.1:\d+/v1)", self.log.read_text())
            if found:
                return found.group(1)
            if self.process.poll() is not None:
                raise SystemExit(f"edgespec serve exited: {self.log.read_text()[-1000:]}")
            time.sleep(0.2)
        raise SystemExit(f"edgespec serve did not start in {timeout} s: {self.log.read_text()[-1000:]}")

    def complete(self, prompt: str, max_tokens: int) -> dict:
        body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
        request = urllib.request.Request(self.url + "/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as answer:
            return json.load(answer)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()


def measure(args, cache: Path, name: str, extra: list[str]) -> dict:
    shutil.rmtree(cache / "prefix-cache", ignore_errors=True)
    server = Server(args, extra, cache / f"serve-{name}.log")
    try:
        server.complete("Hello", 1)  # the first request loads what loads lazily; RSS is read after it
        samples, prompt_tokens = [{"requests": 0, **rss_kib(server.process.pid)}], []
        for n in range(args.requests):
            answer = server.complete(unique_prompt(n, args.prompt_tokens), args.max_tokens)
            prompt_tokens.append(answer["usage"]["prompt_tokens"])
            if (n + 1) % args.every == 0 or n + 1 == args.requests:
                samples.append({"requests": n + 1, **rss_kib(server.process.pid)})
                print(f"{name}: {samples[-1]}", file=sys.stderr, flush=True)
        unique_disk = disk_use(cache)
        document = unique_prompt(10**6, args.prompt_tokens)
        for n in range(args.shared):
            server.complete(f"{document}\nQuestion {n}: what is the first word?", args.max_tokens)
        return {"rss_kib": samples, "mean_prompt_tokens": sum(prompt_tokens) / max(1, len(prompt_tokens)),
                "after_unique_prompts": unique_disk, "after_shared_document": disk_use(cache)}
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--draft", default="none")
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--requests", type=int, default=450, help="unique long prompts (default: %(default)s)")
    parser.add_argument("--shared", type=int, default=5, help="then prompts sharing one document (default: %(default)s)")
    parser.add_argument("--prompt-tokens", type=int, default=400, help="about this many tokens a prompt")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--every", type=int, default=25, help="read the RSS every N requests")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--prompt-cache-ram", default="512MiB", help="serve's RAM store (default: %(default)s)")
    parser.add_argument("--only", choices=("with-cache", "without-cache"))
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    cache = Path(tempfile.mkdtemp(prefix="edgespec-cache-memory-"))
    os.environ["EDGESPEC_CACHE_DIR"] = str(cache)
    figures = {"model": args.model, "requests": args.requests, "prompt_tokens": args.prompt_tokens,
               "prompt_cache_ram": args.prompt_cache_ram}
    try:
        subprocess.run([*EDGESPEC, "run", "hi", "--model", args.model, "--draft", args.draft, "--max-tokens", "1"],
                       check=True, capture_output=True)  # measure the model's speed once, before either server
        for name, extra in (("with-cache", ["--prompt-cache-ram", args.prompt_cache_ram]),
                            ("without-cache", ["--no-prompt-cache"])):
            if args.only in (None, name):
                figures[name] = measure(args, cache, name, extra)
                print(json.dumps({name: figures[name]}, indent=1), flush=True)
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1) + "\n")
    finally:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
