"""Compiled graphs that outlive a process: inductor's FX-graph cache in a directory of this project's own, one
per machine kind, keyed by the compiled module's weights as well.

Why this mechanism (docs/benchmarks.md, "Compile cost"): every process used to compile its own graphs
(88-121 s per SmolLM2 width on 2 cores) because inductor's FX-graph cache skipped every graph the decoder
compiles: freezing's CPU weight prepacking turns the linears' weights into mkldnn tensors, and the cache
cannot pickle those (``torch/_inductor/codecache.py``: "mkldnn tensors unpickleable"). Compiled without
that prepacking (``cpp.weight_prepack=False``; freezing, constant folding and the CPP GEMM templates stay)
the same frozen graphs are cached, and a second process loads them instead of compiling. Two gaps of
inductor's key are closed here:

* frozen parameters enter inductor's key by shape and dtype only (their values are read from the live
  module at load time), but constants folded from them at compile time travel inside the entry; so each
  compiled function's key also carries a digest of its module's weights (``weights_digest``, passed as
  the ``uuid`` of a no-op ``CustomGraphPass``, the cache's own hook for extra key material): another head
  of the same shape never loads this one's constants;
* inductor's key does not name the CPU's vector ISA, and generated C++ is specialised for it; entries
  live under a directory per machine kind (``machine_kind``: torch version, device, the ISA inductor
  picks, the CPU's flags or the CUDA device), so a cache on a shared home never hands AVX-512 kernels to
  an AVX2 machine.

Integrity: inductor writes each entry (a pickle) to ``fxgraph/<k>/<key>/<name>``, the name being its own
``codecache.sha256_hash`` of the content; before a process's first compile, ``activate`` deletes every
entry whose content no longer hashes to its name (one log line), so a corrupt or truncated entry is
rebuilt, never loaded. The directory is created with
mode 0700 under ``$EAGLE_CACHE_DIR/compiled``: only this project's processes of this user write it;
nothing a user uploads lands there.

The price, measured (docs/benchmarks.md, "Compile cost"; SmolLM2 fp32 with the quick head, 2-core AVX2
EPYC): a warm process loads each target width in ~25 s instead of compiling it in 60-90 s and a head
function in ~1 s instead of 4-6 s, but the plain step without prepacked weights ran at 18.2-18.7 tok/s
against 37.0 with them (with and without GEMM autotuning). So it is opt-in: ``EAGLE_COMPILED_ARTIFACTS=on``;
off (the default) every process compiles its own graphs with prepacked weights, as before.

Owns: ``enabled``, ``activate``, ``verify``, ``artifact_dir``, ``machine_kind``, ``weights_digest``,
``WeightsKey``. Does not own:
compiling (``eagle.compile``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import threading
import weakref
from pathlib import Path

import torch
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass

from eagle.target import cache_root

logger = logging.getLogger(__name__)

ARTIFACTS_ENV = "EAGLE_COMPILED_ARTIFACTS"
FORMAT = 1  # bump when what this module writes or keys changes

_lock = threading.Lock()
_active: dict[str, Path] = {}  # machine key -> directory, once per process
_digests: "weakref.WeakKeyDictionary[nn.Module, str]" = weakref.WeakKeyDictionary()


def enabled() -> bool:
    """Whether compiled graphs are stored and loaded: opt-in (``EAGLE_COMPILED_ARTIFACTS=on``), since without
    weight prepacking a SmolLM2 fp32 step ran at half the speed on an AVX2 CPU (see the module docstring)."""
    return os.environ.get(ARTIFACTS_ENV, "off").lower() in ("on", "1", "true", "yes")


def _cpu_flags() -> str:
    """The CPU's feature flags (Linux; elsewhere the processor string)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.processor()


def machine_kind(device: torch.device) -> dict:
    """What generated code depends on besides the graph: torch, the device, the ISA and the CPU's flags."""
    kind = {"format": FORMAT, "torch": torch.__version__, "machine": platform.machine(), "device": device.type}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        kind.update(cuda=torch.version.cuda, gpu=props.name, capability=f"{props.major}.{props.minor}")
    else:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        kind.update(isa=str(pick_vec_isa()), cpu_flags=hashlib.sha256(_cpu_flags().encode()).hexdigest()[:16])
    return kind


def artifact_dir(device: torch.device) -> Path:
    """``$EAGLE_CACHE_DIR/compiled/<machine kind key>``; its ``kind.json`` says what the key stands for."""
    kind = machine_kind(device)
    key = hashlib.sha256(json.dumps(kind, sort_keys=True).encode()).hexdigest()[:16]
    return cache_root() / "compiled" / key


def verify(directory: Path) -> int:
    """Delete every FX-graph entry under ``directory`` whose content does not hash to its name; how many."""
    from torch._inductor.codecache import sha256_hash  # the name inductor gives an entry

    removed = 0
    for path in (directory / "fxgraph").glob("*/*/*"):
        if not path.is_file() or "." in path.name:  # another process's write in progress (``write_atomic``'s temp file)
            continue
        if sha256_hash(path.read_bytes()) != path.name:
            logger.warning("compiled artifact %s is corrupt: deleted, its graph is compiled again", path)
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def activate(device: torch.device) -> Path | None:
    """Point inductor's caches at this machine kind's directory (once per process and kind; the first call
    checks every entry). None when ``EAGLE_COMPILED_ARTIFACTS=off``."""
    if not enabled():
        return None
    directory = artifact_dir(device)
    key = str(directory)
    with _lock:
        if key not in _active:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            kind_file = directory / "kind.json"
            if not kind_file.exists():
                kind_file.write_text(json.dumps(machine_kind(device), indent=1, sort_keys=True) + "\n")
            verify(directory)
            _active[key] = directory
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = key
    return directory


def weights_digest(module: nn.Module | None) -> str:
    """A digest of ``module``'s parameters and buffers (names, dtypes, shapes and bytes); computed once per
    module object."""
    if module is None:
        return "no-weights"
    with _lock:
        cached = _digests.get(module)
    if cached is not None:
        return cached
    digest = hashlib.blake2b(digest_size=16)
    with torch.no_grad():
        for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
            digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
            data = tensor.detach().to("cpu").contiguous().reshape(-1)
            if data.numel():
                digest.update(data.view(torch.uint8).numpy())  # the buffer itself, not a copy
    value = digest.hexdigest()
    with _lock:
        _digests[module] = value
    return value


class WeightsKey(CustomGraphPass):
    """A pass that changes nothing; its ``uuid`` (the weights' digest) enters inductor's FX-graph cache key."""

    def __init__(self, digest: str) -> None:
        self.digest = digest

    def __call__(self, graph: torch.fx.graph.Graph) -> None:
        return None

    def uuid(self) -> str:
        return f"eagle-weights:{FORMAT}:{self.digest}"
