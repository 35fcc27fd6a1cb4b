"""Storage URIs for datasets, feature shards and manifests: a local folder by default, ``s3://`` through s3fs.

One small class over fsspec so every job reads and writes the same way wherever the bytes live. Writes are
whole-object and atomic (a local write goes to a temporary name and is renamed; an S3 PUT is atomic), so a
job killed mid-write never leaves a shard that a rerun would mistake for a complete one.

S3-compatible endpoints other than AWS (MinIO, moto in tests) are chosen with ``EAGLE_S3_ENDPOINT_URL`` or
``AWS_ENDPOINT_URL``; credentials come from the usual AWS variables. No region is passed: with s3fs a region
in ``client_kwargs`` breaks bucket creation on such endpoints (../shared/STACK.md).

Record shards are safetensors files holding variable-length records as flat tensors plus ``offsets``
(record i is rows ``offsets[i]:offsets[i+1]``); safetensors never unpickles, so shards from any bucket are
safe to read.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import uuid
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from eagle.errors import EagleError


class StorageError(EagleError):
    """A storage URI that cannot be read or written; the message is one line for the user."""


def _storage_options(protocol: str) -> dict[str, Any]:
    if protocol != "s3":
        return {}
    endpoint = os.environ.get("EAGLE_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
    return {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}


@dataclass
class Storage:
    """A root URI (``/abs/path``, ``file:///abs/path`` or ``s3://bucket/prefix``); paths are relative to it."""

    uri: str

    def __post_init__(self) -> None:
        if not self.uri:
            raise StorageError("empty storage URI")
        protocol = fsspec.utils.get_protocol(self.uri)
        if protocol not in {"file", "s3", "memory"}:
            raise StorageError(f"unsupported storage URI {self.uri!r}: use a local folder or s3://bucket/prefix")
        self.protocol = protocol
        try:
            self.fs = fsspec.filesystem(protocol, **_storage_options(protocol))
        except ImportError as err:  # pragma: no cover - s3fs is a dependency
            raise StorageError(f"cannot open {self.uri!r}: {err}") from None
        root = self.fs._strip_protocol(self.uri)
        if protocol == "file":
            root = os.path.abspath(os.path.expanduser(root))
        self.root = root.rstrip("/") or "/"

    # ---- paths -------------------------------------------------------------------------------------------

    def path(self, *parts: str) -> str:
        """The filesystem path of ``parts`` under the root (no protocol)."""
        return posixpath.join(self.root, *parts) if parts else self.root

    def url(self, *parts: str) -> str:
        """The full URI of ``parts`` under the root, for logs and manifests."""
        path = self.path(*parts)
        return path if self.protocol == "file" else f"{self.protocol}://{path}"

    def child(self, *parts: str) -> "Storage":
        return Storage(self.url(*parts))

    # ---- queries -----------------------------------------------------------------------------------------

    def exists(self, *parts: str) -> bool:
        return self.fs.exists(self.path(*parts))

    def list(self, *parts: str) -> list[str]:
        """Names (not paths) directly under ``parts``; empty when it does not exist."""
        base = self.path(*parts)
        if not self.fs.exists(base):
            return []
        return sorted(posixpath.basename(p.rstrip("/")) for p in self.fs.ls(base, detail=False))

    # ---- bytes -------------------------------------------------------------------------------------------

    def write_bytes(self, rel: str, data: bytes) -> None:
        target = self.path(rel)
        try:
            if self.protocol == "file":
                _durable_write(target, data)
            else:
                self.fs.pipe_file(target, data)
        except (OSError, PermissionError) as err:
            raise StorageError(f"cannot write {self.url(rel)}: {err.__class__.__name__}: {err}") from None

    def read_bytes(self, rel: str) -> bytes:
        try:
            return self.fs.cat_file(self.path(rel))
        except FileNotFoundError:
            raise StorageError(f"{self.url(rel)} does not exist") from None
        except OSError as err:
            raise StorageError(f"cannot read {self.url(rel)}: {err}") from None

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_bytes(rel, json.dumps(obj, indent=2, sort_keys=True).encode())

    def read_json(self, rel: str) -> Any:
        try:
            return json.loads(self.read_bytes(rel))
        except json.JSONDecodeError as err:
            raise StorageError(f"{self.url(rel)} is not valid JSON: {err}") from None

    def write_tensors(self, rel: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
        """Write a safetensors file (contiguous CPU copies; metadata values must be strings)."""
        flat = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        self.write_bytes(rel, st_save(flat, metadata=metadata))

    def read_tensors(self, rel: str) -> dict[str, torch.Tensor]:
        return st_load(self.read_bytes(rel))

    def read_tensor_metadata(self, rel: str) -> dict[str, str]:
        """The ``__metadata__`` of a safetensors file (reads only its header)."""
        with self.fs.open(self.path(rel), "rb") as handle:
            size = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(size))
        return header.get("__metadata__", {}) or {}

    def check_writable(self) -> None:
        """Fail now, with one line, if the root cannot be written (before any expensive work starts)."""
        probe = f".write-probe-{uuid.uuid4().hex[:8]}"
        self.write_bytes(probe, b"ok")
        try:
            self.fs.rm(self.path(probe))
        except OSError:  # pragma: no cover - best effort
            pass


# ---- variable-length record shards ------------------------------------------------------------------------


def pack_records(records: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate per-record tensors (same keys, first dim = the record's tokens) and add ``offsets``."""
    if not records:
        raise ValueError("no records to pack")
    keys = list(records[0])
    lengths = torch.tensor([int(r[keys[0]].shape[0]) for r in records], dtype=torch.long)
    offsets = torch.zeros(len(records) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    packed = {k: torch.cat([r[k] for r in records]) for k in keys}
    packed["offsets"] = offsets
    return packed


def unpack_records(packed: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The inverse of :func:`pack_records`."""
    offsets = packed["offsets"].tolist()
    keys = [k for k in packed if k != "offsets"]
    return [{k: packed[k][a:b] for k in keys} for a, b in zip(offsets[:-1], offsets[1:])]


def _durable_write(target: str, data: bytes) -> None:
    """Write ``data`` to a local ``target`` so that a crash leaves either the old file or the whole new one:
    a unique temporary name, fsynced, renamed into place, then the folder fsynced (the rename itself is
    durable). Every shard goes through here before its stage's manifest does, so a manifest on disk never
    names a file the disk lost. The temporary file is removed when the write fails (a full disk)."""
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    tmp = f"{target}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
