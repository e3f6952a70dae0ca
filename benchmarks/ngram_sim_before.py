"""The n-gram simulator (ngram_sim.py) with main's controller and drafter from before issue 27 (commit 12598c1),
for before/after figures on the same recorded replies.

Run: .venv/bin/python benchmarks/ngram_sim_before.py REPLIES.jsonl [--split tune|check] [--per-prompt] [--curve issue]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ngram_sim  # noqa: E402

BEFORE = "12598c1"


def old_modules(directory: Path):
    """main's controller.py and drafters.py at BEFORE, importable from directory."""
    root = Path(__file__).resolve().parent.parent
    for name in ("controller", "drafters"):
        source = subprocess.run(["git", "-C", str(root), "show", f"{BEFORE}:edgespec/{name}.py"],
                                check=True, capture_output=True, text=True).stdout
        for package in ("costs", "backend", "errors", "limits", "sampling"):
            source = source.replace(f"from .{package} import", f"from edgespec.{package} import")
        (directory / f"old_{name}.py").write_text(source)
    sys.path.insert(0, str(directory))
    import old_controller
    import old_drafters
    return old_controller, old_drafters


class OldNgramController:
    """main's n-gram controller driven as its engine drove it: settle and foresee before choosing, no update."""

    def __init__(self, module, cost, k_max):
        self.k_max = k_max
        self.controller = module.DraftLengthController(cost, k_max, None, hindsight=True, decay=module.HINDSIGHT_DECAY,
                                                       prior_by_bucket=module.NGRAM_PRIOR_BY_BUCKET)

    def watch(self, context, signal, proposal, copy=None):
        self.controller.settle(context)
        self.controller.foresee(context, proposal(), signal)

    def choose(self, signal, cap):
        return self.controller.choose(signal, cap)

    def update(self, proposed, accepted, signal, seconds=None):
        pass  # the old controller learned in hindsight only, and knew nothing of pass times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("replies", type=Path, nargs="+")
    parser.add_argument("--split", choices=("all", "tune", "check"), default="all")
    parser.add_argument("--per-prompt", action="store_true")
    parser.add_argument("--curve", default="bench", help="as ngram_sim.py's --curve")
    args = parser.parse_args()
    rows = [json.loads(line) for path in args.replies for line in path.read_text().splitlines() if line.strip()]
    if args.split != "all":
        rows = [row for row in rows if (int(row["id"].rsplit("-", 1)[1]) <= 2) == (args.split == "tune")]
    cost = ngram_sim.CostModel(ngram_sim.curve_named(args.curve))
    with tempfile.TemporaryDirectory() as directory:
        controller_module, drafters_module = old_modules(Path(directory))
        results = {row["id"]: ngram_sim.replay(row["prompt_ids"], ngram_sim.decoded(row), cost,
                                               OldNgramController(controller_module, cost, len(cost.forward_seconds) - 1),
                                               drafters_module.NgramDrafter(), 200)
                   for row in rows}
    ngram_sim.report(rows, results, args.per_prompt)
    return 0


if __name__ == "__main__":
    sys.exit(main())
