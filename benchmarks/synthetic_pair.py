"""Write a target and a draft GGUF of random F32 weights, the draft being the target's first layers.

For pass-cost and exactness checks where a real model cannot go: the device machine takes 64 MiB of files
a call, and Qwen2.5-Coder-1.5B is 1.1 GB.  The weights are random, so the text and every acceptance rate
mean nothing; what a pass over n tokens costs, and whether speculation reproduces plain decoding on that
backend, do.  The writer is the tests' (tests/tinygguf.py), so the models have a byte-level tokenizer and
a chat template.

  .venv/bin/python benchmarks/synthetic_pair.py /tmp/m --n-embd 1536 --n-ff 8960 --layers 12
  edgespec bench --model /tmp/m/target.gguf --cost-curve
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tinygguf import TARGET_SEED, write_tiny_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="where target.gguf and draft.gguf go")
    parser.add_argument("--n-embd", type=int, default=1536, help="width (Qwen2.5-1.5B: 1536)")
    parser.add_argument("--n-ff", type=int, default=8960, help="feed-forward width (Qwen2.5-1.5B: 8960)")
    parser.add_argument("--layers", type=int, default=12, help="target layers (Qwen2.5-1.5B: 28; 12 keeps it at 2.2 GB)")
    parser.add_argument("--draft-layers", type=int, default=2)
    args = parser.parse_args()

    args.directory.mkdir(parents=True, exist_ok=True)
    shape = dict(n_embd=args.n_embd, n_head=16, n_head_kv=4, n_ff=args.n_ff)
    for name, layers in (("target", args.layers), ("draft", args.draft_layers)):
        path = write_tiny_model(args.directory / f"{name}.gguf", seed=TARGET_SEED, n_layer=layers, **shape)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
