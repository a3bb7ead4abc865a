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
