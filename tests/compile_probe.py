"""A process that compiles a tiny (target, head) decoder and reports what it compiled or loaded (tests/test_artifacts.py).

    python tests/compile_probe.py --head-seed N     -> one JSON line: loaded per function, greedy tokens, eager tokens
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from eagle import Decoder, EagleHead, GenerationConfig  # noqa: E402
from eagle.tree import DynamicTree  # noqa: E402
from tiny import tiny_target  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head-seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    target = tiny_target("llama", vocab_size=64, hidden_size=32, layers=2, dtype=torch.float32, seed=3, logit_scale=2.0)
    head = EagleHead.for_target(target, seed=args.head_seed)
    tree = DynamicTree(depth=2, top_k=2, total_tokens=4)
    config = GenerationConfig(max_new_tokens=16, stop_token_ids=[])
    compiled = Decoder(target, head, tree, compile="on", speculate="always")
    compiled.warmup(measure=False)
    functions = [*compiled.runtime._steps.values(), *compiled.head_runtime._expand.values(), *compiled.head_runtime._advance.values()]
    tokens = compiled.generate([1, 2, 3, 4, 5], config).token_ids
    eager = Decoder(target, head, tree, compile="off", speculate="always").generate([1, 2, 3, 4, 5], config).token_ids
    print(json.dumps({"loaded": {f.name: f.loaded for f in functions}, "tokens": tokens, "eager": eager}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
