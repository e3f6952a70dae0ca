"""llama.cpp's own C++ speculative decoding, as the bench's peers (configurations llamacpp-*).

The peer is `llama-speculative-simple`, built from the llama.cpp sources that
llama-cpp-python vendors, with the same CMake flags as edgespec's wheel
(`benchmarks/build_llama_cpp_peer.sh`, which also makes it flush its log at
exit: its output goes through a logging thread).  Each run is one process: it
loads the model, evaluates the prompt, generates, and reports its own timings
and draft counts on stderr, which is where the figures here come from.  The prompt is
the chat template's rendered text, given raw: llama.cpp tokenizes it with
special tokens parsed, which is what the template's own markers need.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ...errors import EdgespecError

BINARY = "llama-speculative-simple"
# --spec-type values, and whether they need a draft model (-md)
SPEC_TYPES = {"none": False, "ngram-simple": False, "ngram-mod": False, "draft-simple": True}

_ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
_STDOUT_END = "\n\n\n\n"  # what the binary prints to stdout after the reply
_COUNT = re.compile(r"\b(n_drafted|n_accept)\s*=\s*(\d+)")


# llama.cpp's largest ngram-simple lookup length, and its default one
NEVER_MATCHING_NGRAM = 1024
NGRAM_SIMPLE_KEY = 12


def draft_length_args(spec_type: str, draft_max: int) -> list[str]:
    """The flags that hold a speculation type's drafts to draft_max tokens.  --spec-draft-n-max bounds the
    draft model's only: ngram-simple drafts --spec-ngram-simple-size-m tokens after a match of
    --spec-ngram-simple-size-n (12), and never fewer than it matched, so a shorter draft needs a shorter
    match too; ngram-mod drafts up to --spec-ngram-mod-n-max (64)."""
    if spec_type == "ngram-simple":
        key = ["--spec-ngram-simple-size-n", str(draft_max)] if draft_max < NGRAM_SIMPLE_KEY else []
        return ["--spec-ngram-simple-size-m", str(draft_max), *key]
    if spec_type == "ngram-mod":
        return ["--spec-ngram-mod-n-max", str(draft_max)]
    return ["--spec-draft-n-max", str(draft_max)]


class PeerError(EdgespecError):
    """llama.cpp's binary is missing or failed."""

    exit_code = 2


@dataclass(frozen=True)
class PeerRun:
    text: str
    prompt_tokens: int
    tokens_generated: int
    prefill_seconds: float
    decode_seconds: float
    draft_tokens_proposed: int
    draft_tokens_accepted: int


def find_binary(directory: str | Path) -> Path:
    path = Path(directory).expanduser() / BINARY
    if not path.is_file():
        raise PeerError(f"no {BINARY} in {directory} (build it with benchmarks/build_llama_cpp_peer.sh)")
    return path


def parse_report(stderr: str) -> dict:
    """The figures llama-speculative-simple prints at the end of a run."""
    encoded, decoded = _ENCODED.search(stderr), _DECODED.search(stderr)
    if encoded is None or decoded is None:
        raise PeerError(f"{BINARY} printed no timings: {_last_line(stderr)}")
    counts = dict(_COUNT.findall(stderr))
    return {
        "prompt_tokens": int(encoded.group(1)),
        "prefill_seconds": float(encoded.group(2)),
        "tokens_generated": int(decoded.group(1)),
        "decode_seconds": float(decoded.group(2)),
        "draft_tokens_proposed": int(counts.get("n_drafted", 0)),
        "draft_tokens_accepted": int(counts.get("n_accept", 0)),
    }


def generated_text(stdout: str, prompt: str) -> str:
    """What the binary generated: its stdout is two newlines, the prompt echoed, the reply, then two newlines
    after the generation and two more at the end of its report (speculative-simple.cpp).

    The echo is cut off as the longest common prefix with the prompt, so an
    echo that lost the prompt's last newline (a prompt file that llama.cpp read
    without the newline run() adds) still leaves only the reply.
    """
    text = stdout[2:] if stdout.startswith("\n\n") else stdout
    echoed = next((i for i, (a, b) in enumerate(zip(text, prompt)) if a != b), min(len(text), len(prompt)))
    text = text[echoed:]
    return text.removesuffix(_STDOUT_END)


class LlamaCppPeer:
    """Runs llama-speculative-simple on one target (and optional draft) with fixed threads and context."""

    def __init__(self, bin_dir: str | Path, model: Path, *, draft: Path | None, n_ctx: int, n_threads: int,
                 n_gpu_layers: int = 0, timeout_seconds: float = 600.0):
        self.binary = find_binary(bin_dir)
        self.model, self.draft = Path(model), draft
        self.n_ctx, self.n_threads, self.n_gpu_layers = n_ctx, n_threads, n_gpu_layers
        self.timeout_seconds = timeout_seconds

    def command(self, prompt_file: Path, spec_type: str, draft_max: int | None, max_tokens: int,
                temperature: float, seed: int) -> list[str]:
        if spec_type not in SPEC_TYPES:
            raise PeerError(f"unknown llama.cpp speculation type {spec_type!r} (use one of {', '.join(SPEC_TYPES)})")
        args = [str(self.binary), "-m", str(self.model), "-f", str(prompt_file), "-n", str(max_tokens),
                "-c", str(self.n_ctx), "-b", str(self.n_ctx), "-t", str(self.n_threads), "-tb", str(self.n_threads),
                "-ngl", str(self.n_gpu_layers), "--temp", str(temperature), "--seed", str(seed)]
        if spec_type == "none":
            # llama-speculative-simple cannot run without a speculation type, and ignores a draft
            # length of 0.  An ngram-simple lookup of 1024 tokens that may copy only 1 never drafts
            # (it proposes nothing when it may copy fewer tokens than it matched), so each step is
            # one plain target pass: the C++ loop's own baseline.
            args += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NEVER_MATCHING_NGRAM),
                     "--spec-ngram-simple-size-m", "1"]
            return args
        args += ["--spec-type", spec_type]
        if SPEC_TYPES[spec_type]:
            if self.draft is None:
                raise PeerError("llamacpp-draft needs a draft model (pass --draft FILE)")
            args += ["-md", str(self.draft), "-ngld", str(self.n_gpu_layers)]
        if draft_max is not None:
            args += draft_length_args(spec_type, draft_max)
        return args

    def run(self, prompt: str, *, spec_type: str, draft_max: int | None, max_tokens: int,
            temperature: float = 0.0, seed: int = 0) -> PeerRun:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as prompt_file:
            # llama.cpp's -f drops one trailing newline from the file (common/arg.cpp), which would cut Qwen's
            # template's last token, "assistant\n", and leave the peer another prompt (and on some, another
            # reply) than edgespec's: the newline written here is the one it drops.
            prompt_file.write(prompt + "\n")
            prompt_file.flush()
            args = self.command(Path(prompt_file.name), spec_type, draft_max, max_tokens, temperature, seed)
            try:
                done = subprocess.run(args, capture_output=True, text=True, errors="replace",
                                      timeout=self.timeout_seconds, stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                raise PeerError(f"{BINARY} ran past {self.timeout_seconds:.0f} s") from None
        if done.returncode != 0:
            raise PeerError(f"{BINARY} exited with {done.returncode}: {_last_line(done.stderr)}")
        figures = parse_report(done.stderr)
        return PeerRun(text=generated_text(done.stdout, prompt), **figures)


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"
