"""jobs.checkpoints: DeepSpeed checkpoints resume through the restricted unpickler, and a checkpoint file that
would run code when unpickled is refused without running it (issue 13)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from jobs.checkpoints import UntrustedCheckpointError, safe_load


class _Payload:
    """Unpickling this runs ``open(marker, "w")``: what a writer of the results folder could plant."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_checkpoint_that_runs_code_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"x": torch.ones(2)}, "evil": _Payload(str(marker))}, path)
    torch.load(path, weights_only=False).get("evil").close()  # what DeepSpeed's own loader does: the code runs
    assert marker.exists()
    marker.unlink()
    with pytest.raises(UntrustedCheckpointError, match="refusing to load the checkpoint"):
        safe_load(str(path))
    assert not marker.exists()


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_deepspeed_checkpoints_resume_through_the_safe_loader(tmp_path, stage):
    """A real DeepSpeed engine (gloo, one rank, in a subprocess) saves at ZeRO ``stage``, a new engine with
    ``jobs.checkpoints.install`` loads it: the weights, the step counter and the optimizer state come back."""
    script = textwrap.dedent(f"""
        import os, torch, deepspeed, torch.distributed as dist
        from jobs.checkpoints import install
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{29500 + stage * 7 + os.getpid() % 1000}", rank=0, world_size=1)
        def engine():
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
            config = {{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {{"stage": {stage}}}}}
            return deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1), config=config,
                                        dist_init_required=False)[0]
        first = engine()
        for _ in range(3):
            first.backward(first(torch.ones(1, 8)).sum()); first.step()
        first.save_checkpoint({str(tmp_path)!r}, tag="t")
        with deepspeed.zero.GatheredParameters(list(first.module.parameters())):
            saved = [p.detach().clone() for p in first.module.parameters()]
        second = engine()
        install(second)
        second.load_checkpoint({str(tmp_path)!r}, tag="t")
        with deepspeed.zero.GatheredParameters(list(second.module.parameters())):
            loaded = [p.detach().clone() for p in second.module.parameters()]
        assert all(torch.equal(a, b) for a, b in zip(saved, loaded)), "weights differ after resume"
        assert second.global_steps == 3, second.global_steps
        # the optimizer state (AdamW's moments, its step count) came back too: one more identical step on
        # both engines lands on the same weights (fresh moments would take a different step)
        for e in (first, second):
            e.backward(e(torch.full((1, 8), 2.0)).sum()); e.step()
        with deepspeed.zero.GatheredParameters(list(first.module.parameters()) + list(second.module.parameters())):
            after = [(a.detach().clone(), b.detach().clone()) for a, b in zip(first.module.parameters(), second.module.parameters())]
        assert all(torch.equal(a, b) for a, b in after), "optimizer state differs after resume"
        assert not all(torch.equal(a, s) for (a, _), s in zip(after, saved)), "the extra step changed nothing"
        print("RESUMED")
    """)
    env = {**os.environ, "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert "RESUMED" in done.stdout, done.stderr[-3000:]
