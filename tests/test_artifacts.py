"""Compiled graphs that outlive a process (eagle.artifacts): a second process loads what the first compiled,
a head of the same shape with other weights does not load another's graphs, a corrupt entry is rebuilt with
one log line, and each machine kind has its own directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from eagle import artifacts

PROBE = Path(__file__).with_name("compile_probe.py")


def _probe(cache: Path, head_seed: int = 0) -> tuple[dict, str]:
    env = {**os.environ, "EAGLE_CACHE_DIR": str(cache), artifacts.ARTIFACTS_ENV: "on", "OMP_NUM_THREADS": "1"}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    done = subprocess.run([sys.executable, str(PROBE), "--head-seed", str(head_seed)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_a_second_process_loads_the_graphs_the_first_compiled_and_other_weights_compile_their_own(tmp_path, monkeypatch):
    first, _ = _probe(tmp_path)
    assert first["loaded"] and not any(first["loaded"].values()), first["loaded"]
    assert first["tokens"] == first["eager"]  # fp32: the compiled path is the eager one, token for token

    second, _ = _probe(tmp_path)
    assert all(second["loaded"].values()), second["loaded"]  # from the compile counters: nothing compiled
    assert second["tokens"] == first["tokens"]
    monkeypatch.setenv("EAGLE_CACHE_DIR", str(tmp_path))
    entries = sorted(p for p in (artifacts.artifact_dir(torch.device("cpu")) / "fxgraph").glob("*/*/*") if p.is_file())
    assert len(entries) == len(first["loaded"])  # one entry per compiled function

    # a head of the same shape with other weights: the target's graphs load, the head's compile anew
    other, _ = _probe(tmp_path, head_seed=1)
    assert {name: loaded for name, loaded in other["loaded"].items() if "step[" in name} and all(
        loaded for name, loaded in other["loaded"].items() if "step[" in name), other["loaded"]
    assert not any(loaded for name, loaded in other["loaded"].items() if "step[" not in name), other["loaded"]
    assert other["tokens"] == other["eager"]

    # a corrupt entry of the first head's graphs is deleted before anything loads it (one log line), and its
    # graph compiled again
    victim = entries[0]
    victim.write_bytes(victim.read_bytes()[:-7] + b"garbage")
    again, log = _probe(tmp_path)
    assert [line for line in log.splitlines() if "is corrupt" in line] == [line for line in log.splitlines() if victim.name in line]
    assert len([line for line in log.splitlines() if "is corrupt" in line]) == 1
    assert sum(not loaded for loaded in again["loaded"].values()) == 1, again["loaded"]
    assert again["tokens"] == first["tokens"]


def test_each_machine_kind_and_torch_version_has_its_own_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("EAGLE_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    here = artifacts.artifact_dir(cpu)
    assert here.parent == tmp_path / "compiled"
    monkeypatch.setattr(artifacts, "_cpu_flags", lambda: "fpu sse2 avx2")
    other_cpu = artifacts.artifact_dir(cpu)
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    other_torch = artifacts.artifact_dir(cpu)
    assert len({here, other_cpu, other_torch}) == 3


def test_the_weights_digest_follows_every_value(tmp_path):
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    module.register_buffer("scale", torch.tensor(2.0))  # a 0-dim buffer
    twin = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    twin.register_buffer("scale", torch.tensor(2.0))
    twin.load_state_dict(module.state_dict())
    assert artifacts.weights_digest(module) == artifacts.weights_digest(twin)
    changed = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).to(torch.bfloat16)
    changed.register_buffer("scale", torch.tensor(2.0))
    changed.load_state_dict(module.state_dict())
    with torch.no_grad():
        changed[0].weight[1, 2] += 1
    assert artifacts.weights_digest(changed) != artifacts.weights_digest(module)
    assert artifacts.weights_digest(None) == "no-weights"


def test_off_by_default_leaves_inductors_own_cache_and_prepacked_weights(monkeypatch, tmp_path):
    from eagle.compile import _settings

    monkeypatch.setenv("EAGLE_CACHE_DIR", str(tmp_path))
    for value in (None, "off"):
        if value is None:
            monkeypatch.delenv(artifacts.ARTIFACTS_ENV, raising=False)
        else:
            monkeypatch.setenv(artifacts.ARTIFACTS_ENV, value)
        assert artifacts.activate(torch.device("cpu")) is None
        assert "cpp.weight_prepack" not in _settings(torch.device("cpu"), True)[1]
    assert not (tmp_path / "compiled").exists()
    monkeypatch.setenv(artifacts.ARTIFACTS_ENV, "on")
    assert _settings(torch.device("cpu"), True)[1]["cpp.weight_prepack"] is False
