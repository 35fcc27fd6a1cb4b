"""Greedy decoding of token-id prompts in vLLM's CPU build, plain and with each given speculative config, one
engine after another in this process: the outputs and vLLM's speculative-decoding counters of each run, as
JSON. Runs in the vLLM venv (``infra/bench/peers.sh vllm-run infra/bench/vllm_head_check.py SPEC OUT``;
tests/test_formats.py loads exported heads with it). No import from this project.

SPEC is a JSON file: ``{"target": DIR, "prompts": [[ids]], "max_tokens": N, "runs": {NAME: speculative_config
or null}}``. The target is loaded without a tokenizer (``skip_tokenizer_init``: prompts and outputs are ids)
in float32, eager, with a small KV cache, so an engine starts in seconds. OUT gets ``{NAME: {"outputs":
[[ids]], "spec_decode": {...}}}``, or ``{NAME: {"error": TEXT}}`` for a run whose engine did not start.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
import traceback
from pathlib import Path

from vllm_bench import spec_decode_totals

logger = logging.getLogger("vllm_head_check")
KV_CACHE_BYTES = 64 << 20
# the engine and its worker in this process: each process vLLM spawns imports torch and vLLM again (~30 s on two
# busy cores), per engine
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# peers.sh's VLLM_CPU_KVCACHE_SPACE (whole GiB) would override kv_cache_memory_bytes below
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


def decode(spec: dict, speculative: dict | None) -> dict:
    """One engine: greedy outputs of every prompt (one batch) and its spec-decode counters."""
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=spec["target"], skip_tokenizer_init=True, dtype="float32", enforce_eager=True, seed=0,
        max_model_len=spec.get("max_model_len", 256), kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_num_seqs=len(spec["prompts"]), speculative_config=speculative, distributed_executor_backend="uni",
        disable_log_stats=False,  # the spec-decode counters need the stats loop
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, detokenize=False)
        results = llm.generate([{"prompt_token_ids": ids} for ids in spec["prompts"]], params, use_tqdm=False)
        return {"outputs": [list(r.outputs[0].token_ids) for r in results], "spec_decode": spec_decode_totals(llm)}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = json.loads(Path(sys.argv[1]).read_text())
    report = {}
    for name, speculative in spec["runs"].items():
        try:
            report[name] = decode(spec, speculative)
        except Exception:  # a head vLLM refuses: said in the report, the other runs go on
            logger.exception("run %s failed", name)
            report[name] = {"error": traceback.format_exc()[-4000:]}
        Path(sys.argv[2]).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
