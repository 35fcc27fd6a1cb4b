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

pytestmark = pytest.mark.slow

EAGLECTL = shutil.which("eaglectl", path=str(Path(sys.executable).parent)) or "eaglectl"


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([EAGLECTL, *args], capture_output=True, text=True, env=env, timeout=600)


def test_the_decoding_commands_compile_by_default():
    from eagle.cli import build_parser

    parser = build_parser()
    for command in (["generate", "--prompt", "hi"], ["bench", "--out", "x.json"]):
        assert parser.parse_args(command).compile == "on"


def test_generate_json_reports_text_and_stats():
    out = run("generate", "--head", "random", "--chat", "Name three colours.", "--max-new-tokens", "12", "--json", "--tree", "static",
              "--compile", "off")
    assert out.returncode == 0, out.stderr
    record = json.loads(out.stdout)
    assert record["completion_tokens"] == len(record["accepted_per_step"]) + 1 or record["finish_reason"] == "stop"
    assert record["text"].strip() and record["tau"] >= 1.0


def test_generate_stream_prints_text():
    out = run("generate", "--prompt", "The capital of France is", "--max-new-tokens", "6", "--stream", "--head", "random", "--compile", "off")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


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
