"""Torch threads on the threads that run models (eagle.runtime.use_threads / on_own_thread, serve.pair).

OpenMP keeps its thread count per OS thread, and a thread started later begins at ``OMP_NUM_THREADS``
(Ray sets 1 in its workers): a Serve replica's decode thread ran its oneDNN linears on one core. These
tests run in a subprocess started with ``OMP_NUM_THREADS=1``, as a Ray worker is, and read the count
OpenMP itself holds for a thread (libgomp's ``omp_get_max_threads``, the value oneDNN and MKL use), not
torch's own setting, which reports the process-wide number whatever the thread's team will be.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle.runtime import on_own_thread

REPO = Path(__file__).resolve().parents[1]
LIBGOMP = Path(torch.__file__).parent / "lib" / "libgomp.so.1"

PROBE = r"""
import asyncio, ctypes, json, sys, threading
import torch
from eagle.batch import BatchDecoder
from eagle.runtime import on_own_thread, use_threads
from serve.pair import PairServer, PairSpec
from serve_helpers import tiny_chat_target_dir

gomp = ctypes.CDLL(sys.argv[1])
seen = {}

def probe(key):
    seen[key] = gomp.omp_get_max_threads()

def in_thread(fn, *args):
    thread = threading.Thread(target=fn, args=args)
    thread.start()
    thread.join()

torch.set_num_threads(2)
probe("main")
in_thread(probe, "new thread")
in_thread(lambda: (use_threads(2), probe("new thread, use_threads(2)")))
on_own_thread(probe, "on_own_thread", threads=2)

step = BatchDecoder.step
def recording_step(self, **kwargs):
    probe("decode thread")
    return step(self, **kwargs)
BatchDecoder.step = recording_step
server = PairServer(PairSpec(model="m", target=str(tiny_chat_target_dir(__import__("pathlib").Path(sys.argv[2]))),
                             dtype="float32", compile="off", threads=2, max_tokens=4))
async def one():
    return [event async for event in server.stream({"prompt": "hello", "max_tokens": 2, "temperature": 0})]
asyncio.run(one())
server.shutdown()
print(json.dumps(seen))
"""


@pytest.mark.skipif(not LIBGOMP.exists(), reason="this torch build has no bundled libgomp to ask")
def test_model_threads_get_their_openmp_threads_under_omp_num_threads_1(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    done = subprocess.run([sys.executable, "-c", PROBE, str(LIBGOMP), str(tmp_path / "target")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["main"] == 2
    assert seen["new thread"] == 1  # the hazard: a later thread starts at OMP_NUM_THREADS whatever torch says
    assert seen["new thread, use_threads(2)"] == 2
    assert seen["on_own_thread"] == 2
    assert seen["decode thread"] == 2  # the pair's decode loop runs at its configured threads


def test_on_own_thread_returns_the_result_and_raises_the_error_in_the_caller():
    assert on_own_thread(lambda a, b: a + b, 2, 3, threads=1) == 5

    def fail() -> None:
        raise ValueError("from the worker thread")

    with pytest.raises(ValueError, match="from the worker thread"):
        on_own_thread(fail)
