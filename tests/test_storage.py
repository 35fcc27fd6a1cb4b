"""jobs/storage.py: a local folder and an S3-compatible endpoint (moto_server on 127.0.0.1) behave the same;
the feature job writes to and reads from ``s3://``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from eagle_platform.ports import free_port
from env_helpers import temporary_env
from jobs import layout
from jobs.storage import Storage, StorageError, pack_records, unpack_records


def sample_records(seed: int = 0, count: int = 4) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    records = []
    for _ in range(count):
        n = int(torch.randint(1, 20, (1,), generator=generator))
        records.append({
            "input_ids": torch.randint(0, 1000, (n,), generator=generator, dtype=torch.int32),
            "loss_mask": (torch.rand(n, generator=generator) > 0.5).to(torch.uint8),
            "features": torch.randn(n, 8, generator=generator).to(torch.bfloat16),
        })
    return records


def assert_round_trip(storage: Storage) -> None:
    """What every job relies on, whatever the backend."""
    assert not storage.exists("a/b.json") and storage.list("a") == []
    storage.write_json("a/b.json", {"x": [1, 2], "y": "z"})
    assert storage.exists("a/b.json") and storage.read_json("a/b.json") == {"x": [1, 2], "y": "z"}
    storage.write_bytes("a/c.bin", b"\x00\x01")
    storage.write_bytes("a/c.bin", b"\x02")  # overwrite is whole-object
    assert storage.read_bytes("a/c.bin") == b"\x02"
    assert storage.list("a") == ["b.json", "c.bin"]

    records = sample_records()
    packed = pack_records(records)
    assert packed["offsets"].tolist()[-1] == sum(len(r["input_ids"]) for r in records)
    storage.write_tensors("shards/shard-00000.safetensors", packed, metadata={"ids": json.dumps(["r0", "r1", "r2", "r3"])})
    assert storage.read_tensor_metadata("shards/shard-00000.safetensors") == {"ids": '["r0", "r1", "r2", "r3"]'}
    back = unpack_records(storage.read_tensors("shards/shard-00000.safetensors"))
    assert len(back) == len(records)
    for got, want in zip(back, records):
        assert set(got) == set(want)
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key])

    child = storage.child("shards")
    assert child.list() == ["shard-00000.safetensors"] and child.url().endswith("/shards")
    storage.check_writable()
    assert storage.list() == ["a", "shards"]  # the probe is gone
    with pytest.raises(StorageError, match="does not exist"):
        storage.read_bytes("a/missing.json")


# ---- local -------------------------------------------------------------------------------------------------


def test_local_round_trip(tmp_path):
    storage = Storage(str(tmp_path / "root"))
    assert_round_trip(storage)
    assert Storage(f"file://{tmp_path}/root").read_json("a/b.json") == {"x": [1, 2], "y": "z"}
    assert storage.url("a", "b.json") == str(tmp_path / "root" / "a" / "b.json")
    # atomic writes leave no temporary files behind
    assert not [p for p in (tmp_path / "root").rglob("*") if ".tmp-" in p.name]


def test_local_write_is_atomic(tmp_path, monkeypatch):
    storage = Storage(str(tmp_path))
    storage.write_bytes("x.bin", b"old")

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)  # the job dies between writing the bytes and publishing them
    with pytest.raises(StorageError, match="disk full"):
        storage.write_bytes("x.bin", b"new-but-never-complete")
    with pytest.raises(StorageError, match="disk full"):
        storage.write_bytes("y.bin", b"partial")
    monkeypatch.undo()
    assert storage.read_bytes("x.bin") == b"old"  # a reader never sees a half-written object
    assert not storage.exists("y.bin")  # so a rerun does not mistake it for a complete shard
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]  # and the failed writes left no temporary file


def test_local_writes_are_fsynced_before_they_are_published(tmp_path, monkeypatch):
    """The file's bytes are fsynced before the rename, and its folder after it (issue 13): a manifest written
    after its shards never names a shard the disk lost in a crash."""
    calls: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync:" + ("dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "file")), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b))[1])
    Storage(str(tmp_path)).write_json("features/manifest.json", {"shards": 2})
    assert calls == ["fsync:file", "replace", "fsync:dir"]


def test_unwritable_root_is_one_line_storage_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    storage = Storage(str(blocker / "storage"))
    with pytest.raises(StorageError) as info:
        storage.check_writable()
    message = str(info.value)
    assert "cannot write" in message and "\n" not in message


def test_unsupported_uri_is_a_storage_error():
    with pytest.raises(StorageError, match="unsupported storage URI"):
        Storage("ftp://example.com/x")
    with pytest.raises(StorageError):
        Storage("")


def test_invalid_json_is_a_storage_error(tmp_path):
    storage = Storage(str(tmp_path))
    storage.write_bytes("bad.json", b"{not json")
    with pytest.raises(StorageError, match="not valid JSON"):
        storage.read_json("bad.json")


# ---- S3 through moto_server --------------------------------------------------------------------------------


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing"}


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """A moto S3 server on a free local port, EAGLE_S3_ENDPOINT_URL and dummy credentials set; one bucket."""
    executable = shutil.which("moto_server") or str(Path(sys.executable).with_name("moto_server"))
    if not Path(executable).exists():
        pytest.skip("moto[server] is not installed (pip install -c constraints.txt 'moto[server]')")
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with log.open("wb") as handle:
        process = subprocess.Popen([executable, "-H", "127.0.0.1", "-p", str(port)], stdout=handle, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start: {log.read_text()[-2000:]}")
                time.sleep(0.2)
        with temporary_env({**S3_ENV, "EAGLE_S3_ENDPOINT_URL": url}):
            import s3fs

            bucket = f"eagle-{uuid.uuid4().hex[:8]}"
            s3fs.S3FileSystem(client_kwargs={"endpoint_url": url}, skip_instance_cache=True).mkdir(bucket)
            yield {"url": url, "bucket": bucket}
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_s3_round_trip(s3_endpoint):
    storage = Storage(f"s3://{s3_endpoint['bucket']}/prefix-{uuid.uuid4().hex[:6]}")
    assert storage.protocol == "s3" and storage.url().startswith("s3://")
    assert_round_trip(storage)


def test_s3_missing_bucket_is_a_storage_error(s3_endpoint):
    storage = Storage(f"s3://no-such-bucket-{uuid.uuid4().hex[:6]}/x")
    with pytest.raises(StorageError) as info:
        storage.check_writable()
    assert "\n" not in str(info.value)


@pytest.mark.e2e
@pytest.mark.nightly
def test_featurize_reads_and_writes_s3(s3_endpoint, tmp_path_factory):
    """Data shards on s3:// -> 1 ZeRO-3 worker -> feature shards + manifest on s3://, read back and equal to
    the plain model's features."""
    from jobs.featurize import featurize
    from tests.test_featurize import DATASET, make_tiny_target_dir, reference_features, tiny_preset, write_data

    tiny_dir = make_tiny_target_dir(tmp_path_factory.mktemp("targets"))
    uri = f"s3://{s3_endpoint['bucket']}/storage"
    data = write_data(uri, tiny_dir, shards={"train": [3, 2], "eval": [2]})
    manifest = featurize(tiny_preset(workers=1, aux_layers=False), uri, target_spec=str(tiny_dir), progress=False)

    dataset = Storage(uri).child(tiny_dir.name, DATASET)
    assert layout.read_manifest(dataset, layout.FEATURES) == manifest
    assert dataset.list(layout.FEATURES, "train") == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert manifest["splits"]["train"]["records"] == 5 and manifest["splits"]["eval"]["records"] == 2
    records = layout.load_records(dataset, layout.FEATURES, "train")
    source = [r for (s, _), recs in sorted(data.items()) if s == "train" for r in recs]
    for got, (features, _) in zip(records, reference_features(tiny_dir, source, [0])):
        assert "aux_features" not in got
        torch.testing.assert_close(got["features"], features, atol=1e-4, rtol=1e-4)
