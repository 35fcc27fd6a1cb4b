"""`eaglectl` end to end through its console script, on the real default target.

The commands run with `--compile off`: each compiled process pays its compile again (minutes on 2 cores, 164 s
for `generate --json` with autotuning), and the compiled path has its own tests on the same target
(test_compiled's SmolLM2 case); that `--compile on` is the default is checked on the parser."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


EAGLECTL = shutil.which("eaglectl", path=str(Path(sys.executable).parent)) or "eaglectl"


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([EAGLECTL, *args], capture_output=True, text=True, env=env, timeout=600)


def test_the_decoding_commands_compile_by_default():
    from eagle.cli import build_parser

    parser = build_parser()
    for command in (["generate", "--prompt", "hi"], ["bench", "--out", "x.json"]):
        assert parser.parse_args(command).compile == "on"


def check_generate_counts(record: dict, max_new_tokens: int) -> None:
    """A ``generate --json`` record's counts agree whatever the head accepted: the completion is the prefill's
    token plus each step's accepted + 1 tokens, only the last step cut short (by the budget or a stop token);
    ``finish_reason`` "length" means the budget was spent; tau is the steps' mean of accepted + 1."""
    accepted = record["accepted_per_step"]
    assert accepted and min(accepted) >= 0, record
    before_last = 1 + sum(a + 1 for a in accepted[:-1])
    assert before_last < record["completion_tokens"] <= before_last + accepted[-1] + 1, record
    assert record["finish_reason"] in ("length", "stop") and record["completion_tokens"] <= max_new_tokens
    if record["finish_reason"] == "length":
        assert record["completion_tokens"] == max_new_tokens, record
    assert record["tau"] == round(sum(a + 1 for a in accepted) / len(accepted), 4)


@pytest.mark.nightly  # eaglectl loads SmolLM2 in its own process
def test_generate_json_reports_text_and_stats():
    """``generate --json`` prints one JSON record: the text, and counts consistent with each other (above)."""
    out = run("generate", "--head", "random", "--chat", "Name three colours.", "--max-new-tokens", "12", "--json", "--tree", "static",
              "--compile", "off")
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    check_generate_counts(record, 12)
    assert record["text"].strip() and record["prompt_tokens"] > 0


@pytest.mark.nightly  # eaglectl loads SmolLM2 in its own process
def test_generate_stream_prints_text():
    out = run("generate", "--prompt", "The capital of France is", "--max-new-tokens", "6", "--stream", "--head", "random", "--compile", "off")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


@pytest.mark.nightly  # eaglectl loads SmolLM2 in its own process
def test_bench_float32_matches_plain_on_a_prompt_file(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Explain what a hash map is."}) + "\n")
    result_path = tmp_path / "result.json"
    out = run(
        "bench", "--prompts", str(prompts), "--head", "random", "--max-new-tokens", "16", "--temperature", "0",
        "--dtype", "float32", "--baselines", "", "--compile", "off", "--out", str(result_path),
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(result_path.read_text())
    assert result["aggregate"]["all_outputs_match_plain"] is True
    assert result_path.with_suffix(".md").is_file() and result_path.with_suffix(".png").is_file()
    assert result["config"]["command"].startswith("eaglectl bench")


def test_bad_head_directory_exits_2_with_one_line(tmp_path):
    out = run("generate", "--head", str(tmp_path), "--prompt", "hi")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("eaglectl generate: error:")
    assert "Traceback" not in out.stderr
