"""What differs between S3 servers, named where it matters: a server that answers a ranged
GET with the whole object (HTTP 200, as rclone's ``serve s3`` does) fails a load with a
RangeNotSupportedError naming the object and the range, not a local-disk error.

The servers are real (moto over HTTP on 127.0.0.1, and tests/s3_server.py's proxy in front
of it, which can drop the Range header so that moto answers 200 with the whole object)."""

from __future__ import annotations

import re

import pytest
import torch

import shardsafe

pytest.importorskip("obstore")

MiB = 1 << 20


def test_whole_object_answer_to_a_ranged_get_names_the_cause(s3):
    from s3_server import FaultProxy
    from shardsafe.storage.s3 import RangeNotSupportedError

    server, bucket, opts = s3
    sd = {"a": torch.arange(MiB, dtype=torch.float32), "b": torch.ones(100, 7)}
    shardsafe.save(sd, f"s3://{bucket}/ck", storage_options=opts)
    proxy = FaultProxy(server.port)
    proxy.strip_range = True
    try:
        dest = {"a": torch.zeros(MiB), "b": torch.zeros(100, 7)}
        with pytest.raises(RangeNotSupportedError) as info:
            shardsafe.load(dest, f"s3://{bucket}/ck", storage_options=dict(opts, endpoint=proxy.endpoint))
    finally:
        proxy.close()
    msg = str(info.value)
    print(msg)
    assert isinstance(info.value, shardsafe.StorageError)
    assert re.search(rf"bytes \d+-\d+ of s3://{bucket}/ck/data-\S+\.safetensors", msg), msg
    assert "HTTP 200 instead of 206" in msg and "spill" not in msg, msg
    assert info.value.filename.startswith(f"s3://{bucket}/ck/data-"), info.value.filename
    assert torch.count_nonzero(dest["a"]) == 0  # nothing landed


@pytest.mark.parametrize("size", [100, 12 * MiB])
def test_create_refuses_an_existing_object_without_a_head(s3_any, size):
    """S3Folder.create makes no request; completing the object is conditional
    (If-None-Match: *, a single PUT or the multipart completion): over an existing object
    it raises StorageError EEXIST and leaves that object as it was, on both servers; a new
    object costs its upload's requests only."""
    import errno

    from s3_server import FaultProxy
    from shardsafe.storage.s3 import S3Backend

    server, bucket, opts = s3_any
    server.client.put_object(Bucket=bucket, Key="f/x.bin", Body=b"theirs")
    proxy = FaultProxy(server.port)
    try:
        folder = S3Backend(dict(opts, endpoint=proxy.endpoint, part_size=5 * MiB)).open(f"s3://{bucket}/f")
        proxy.kinds.clear()
        h = folder.create("x.bin")
        assert sum(proxy.kinds.values()) == 0, proxy.kinds
        h.write([memoryview(bytes(size))], 0)
        with pytest.raises(shardsafe.StorageError) as info:
            h.finish()
        assert info.value.errno == errno.EEXIST and "x.bin: it exists" in str(info.value), info.value
        proxy.kinds.clear()
        h2 = folder.create("y.bin")
        h2.write([memoryview(bytes(size))], 0)
        h2.finish()
        kinds = dict(proxy.kinds)
    finally:
        proxy.close()
    assert "HEAD" not in kinds and "GET list" not in kinds, kinds  # the new object: only its upload
    assert server.client.get_object(Bucket=bucket, Key="f/x.bin")["Body"].read() == b"theirs"
    assert server.client.head_object(Bucket=bucket, Key="f/y.bin")["ContentLength"] == size
    assert server.uploads(bucket) == []
