"""One table from the fast-path benchmark's pieces: our side-by-side bench reports (``eaglectl bench``) and
the peers' JSON (``infra/bench/vllm_bench.py``, ``llamacpp_bench.py``) on the same token-id prompts.

    python infra/bench/combine.py --ours SET/LABEL=PATH ... --peer ENGINE/SET=PATH ... --out summary.json

Every ratio is tokens/s over tokens/s of runs on the same prompts and the same machine, one after another.
Writes ``summary.json`` and ``summary.md`` beside it.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _rate(block: dict, method: str) -> float | None:
    entry = block.get("methods", {}).get(method)
    return None if entry is None else entry.get("tokens_per_second")


def combine(ours: dict[str, dict], peers: dict[str, dict]) -> dict:
    """``ours``: ``SET/LABEL`` -> bench report; ``peers``: ``ENGINE/SET`` -> peer result. A row per report,
    joined with the peers that ran the same prompt set."""
    rows = []
    for name, report in ours.items():
        prompt_set = name.split("/", 1)[0]
        aggregate, config = report["aggregate"], report["config"]
        row = {
            "run": name, "prompts": aggregate["prompts"], "temperature": config["sampling"]["temperature"],
            "tree": (config.get("tree") or {}).get("type"), "tau": aggregate.get("tau_mean"),
            "match_plain": aggregate.get("outputs_match_plain_rate"),
            **{f"{m}_tok_s": _rate(aggregate, m) for m in ("plain", "eagle", "hf", "prompt-lookup")},
        }
        plain, eagle, hf = row["plain_tok_s"], row["eagle_tok_s"], row["hf_tok_s"]
        row["plain_vs_hf"] = plain / hf if plain and hf else None
        row["eagle_vs_plain"] = eagle / plain if eagle and plain else None
        row["eagle_vs_hf"] = eagle / hf if eagle and hf else None
        for peer_name, result in peers.items():
            engine, _, peer_set = peer_name.partition("/")
            if peer_set != prompt_set:
                continue
            rate = result["concurrency"].get("1", {}).get("tokens_per_second")
            row[f"{engine}_tok_s"] = rate
            row[f"plain_vs_{engine}"] = plain / rate if plain and rate else None
            row[f"eagle_vs_{engine}"] = eagle / rate if eagle and rate else None
        rows.append(row)
    return {"rows": rows, "peers": {k: {key: v for key, v in r.items() if key != "outputs"} for k, r in peers.items()}}


def _fmt(value) -> str:
    if value is None:
        return "–"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def markdown(summary: dict) -> str:
    rows = summary["rows"]
    if not rows:
        return "(no runs)\n"
    columns = [c for c in rows[0] if any(r.get(c) is not None for r in rows)]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ours", nargs="+", default=[], metavar="NAME=PATH")
    parser.add_argument("--peer", nargs="*", default=[], metavar="NAME=PATH")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    load = lambda items: {k: json.loads(Path(v).read_text()) for k, v in (item.split("=", 1) for item in items)}  # noqa: E731
    summary = combine(load(args.ours), load(args.peer))
    out = Path(args.out)
    out.write_text(json.dumps(summary, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(summary))
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
