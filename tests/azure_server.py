"""A real Azure Blob server for the tests: Azurite (the Azure Storage emulator, from npm:
``make install`` puts it in ``.azurite/``), in memory, on a free loopback port.

Containers are made and dropped with the emulator's well-known account key; shardsafe
never creates containers (a missing one is an error)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import os
import re
import shutil
import subprocess
import time
import uuid
from email.utils import formatdate
from pathlib import Path

ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / ".azurite" / "node_modules" / ".bin" / "azurite-blob"


def missing() -> str | None:
    """Why Azurite cannot run here (None: it can)."""
    if shutil.which("node") is None:
        return "Node.js is not installed (Azurite, the Azure Blob emulator, runs on Node)"
    if not BIN.exists():
        return f"Azurite is not installed ({BIN} is missing): run make install"
    return None


class Azurite:
    """Azurite's blob service in a child process (in-memory storage) on 127.0.0.1."""

    def __init__(self, timeout: float = 90.0) -> None:
        self.proc = subprocess.Popen(
            [str(BIN), "--blobHost", "127.0.0.1", "--blobPort", "0", "--inMemoryPersistence", "--loose",
             "--skipApiVersionCheck", "--disableTelemetry"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT / ".azurite")
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        lines = []
        self.port = 0
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"listens on http://127\.0\.0\.1:(\d+)", line)
            if m:
                self.port = int(m.group(1))
                break
        if not self.port:
            self.stop()
            raise RuntimeError("Azurite did not start:\n" + "".join(lines))
        self.endpoint = f"http://127.0.0.1:{self.port}/{ACCOUNT}"
        self.options = {"account_name": ACCOUNT, "account_key": KEY, "endpoint": self.endpoint}

    def env(self) -> dict[str, str]:
        """The environment variables a client finds the emulator by."""
        return {"AZURE_STORAGE_USE_EMULATOR": "true", "AZURITE_BLOB_STORAGE_URL": f"http://127.0.0.1:{self.port}",
                "AZURE_STORAGE_ACCOUNT_NAME": ACCOUNT, "AZURE_STORAGE_ACCOUNT_KEY": KEY}

    def _request(self, method: str, container: str, query: str) -> int:
        date = formatdate(usegmt=True)
        version = "2021-08-06"
        params = "".join(f"\n{k}:{v}" for k, v in sorted(p.split("=") for p in query.split("&")))
        to_sign = (f"{method}\n\n\n\n\n\n\n\n\n\n\n\nx-ms-date:{date}\nx-ms-version:{version}\n"
                   f"/{ACCOUNT}/{ACCOUNT}/{container}{params}")
        sig = base64.b64encode(hmac.new(base64.b64decode(KEY), to_sign.encode(), hashlib.sha256).digest()).decode()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, f"/{ACCOUNT}/{container}?{query}", headers={
                "x-ms-date": date, "x-ms-version": version, "Authorization": f"SharedKey {ACCOUNT}:{sig}",
                "Content-Length": "0"})
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()

    def new_container(self) -> str:
        """A fresh, empty container."""
        name = f"c-{uuid.uuid4().hex[:16]}"
        status = self._request("PUT", name, "restype=container")
        assert status == 201, f"cannot create container {name}: HTTP {status}"
        return name

    def drop_container(self, name: str) -> None:
        """Delete a container and its blobs."""
        self._request("DELETE", name, "restype=container")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def environ_without_azure() -> dict[str, str]:
    """This process's environment without Azure settings (tests pass their own)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("AZURE_", "AZURITE_"))}
