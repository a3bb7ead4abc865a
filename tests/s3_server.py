"""A real S3 server for the tests (moto, on 127.0.0.1) and a TCP proxy in front of it that
fails a chosen share of requests: an HTTP 503 ``SlowDown``, a reset connection before the
request reaches the server, or a reset after the server handled it (the response is lost,
so the client cannot know whether its request took effect).

The proxy handles one request per client connection (it asks the server to close after
each response and passes that on), which keeps it a plain byte relay that needs to parse
only request heads and bodies."""

from __future__ import annotations

import contextlib
import logging
import random
import socket
import struct
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

KEY = "testing"
REGION = "us-east-1"


class Buckets:
    """Bucket chores on any S3 server, through its boto3 ``client``."""

    client: Any

    def new_bucket(self) -> str:
        """A fresh, empty bucket."""
        name = f"b-{uuid.uuid4().hex[:16]}"
        self.client.create_bucket(Bucket=name)
        return name

    def drop_bucket(self, name: str) -> None:
        """Delete every object, unfinished upload and the bucket itself."""
        with contextlib.suppress(Exception):
            for up in self.client.list_multipart_uploads(Bucket=name).get("Uploads", []):
                self.client.abort_multipart_upload(Bucket=name, Key=up["Key"], UploadId=up["UploadId"])
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=name):
                keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
                if keys:
                    self.client.delete_objects(Bucket=name, Delete={"Objects": keys})
            self.client.delete_bucket(Bucket=name)

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every key under ``prefix``."""
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return sorted(out)

    def uploads(self, bucket: str) -> list[str]:
        """Keys of unfinished multipart uploads."""
        return [u["Key"] for u in self.client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]


class MotoS3(Buckets):
    """moto's S3 server in this process, on a free loopback port."""

    name = "moto"

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.port = port
        import boto3

        self.client = boto3.client("s3", endpoint_url=self.endpoint, region_name=REGION, aws_access_key_id=KEY,
                                   aws_secret_access_key=KEY)

    def stop(self) -> None:
        self.server.stop()


SLOWDOWN = (b"<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
            b"<Message>Please reduce your request rate.</Message></Error>")


class FaultProxy:
    """A TCP proxy to ``upstream_port`` that fails requests.

    ``rate``: the share of requests failed at random (seeded); ``modes``: the failures drawn
    from (``"503"``, ``"reset"``: before the server sees the request, ``"lost"``: the
    server handles it, the client gets a reset); ``fail_next(n, mode)`` fails the next
    ``n`` requests. ``only`` (a substring of the request line, e.g. ``"PUT"`` or
    ``"uploadId"``) limits failures to matching requests. ``seen`` / ``failed`` count
    requests (``kinds``: by :func:`request_kind`), ``bytes_up`` / ``bytes_down`` the bytes
    relayed each way. ``strip_range``:
    the Range header is dropped from GETs, so the server answers 200 with the whole object
    (as rclone's ``serve s3`` does for a ranged GET)."""

    def __init__(self, upstream_port: int, rate: float = 0.0, modes: tuple[str, ...] = ("503", "reset"),
                 seed: int = 0, upstream_host: str = "127.0.0.1") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.rate = rate
        self.modes = modes
        self.only: str | None = None
        self.strip_range = False
        self.rng = random.Random(seed)
        self.forced: list[str] = []
        self.seen = 0
        self.bytes_up = 0  # request bytes relayed to the server (heads and bodies)
        self.bytes_down = 0  # response bytes relayed to clients (heads and bodies)
        self.failed: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()  # requests by request_kind
        self.lines: list[str] = []
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self.port = self._sock.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, name="fault-proxy", daemon=True)
        self._acceptor.start()

    # -- control ------------------------------------------------------------------------
    def fail_next(self, n: int, mode: str = "503") -> None:
        """Fail the next ``n`` (matching) requests with ``mode``."""
        with self._lock:
            self.forced += [mode] * n

    def set(self, rate: float, modes: tuple[str, ...] | None = None, only: str | None = None) -> None:
        """Change the failure rate (and modes, and the request filter)."""
        with self._lock:
            self.rate = rate
            self.modes = modes or self.modes
            self.only = only

    def _decide(self, line: str, ranged: bool = False) -> str | None:
        with self._lock:
            self.seen += 1
            self.lines.append(line)
            self.kinds[request_kind(line, ranged)] += 1
            if self.only is not None and self.only not in line:
                return None
            if self.forced:
                mode = self.forced.pop(0)
            elif self.rate and self.rng.random() < self.rate:
                mode = self.rng.choice(self.modes)
            else:
                return None
            self.failed[mode] += 1
            return mode

    # -- relay --------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                if self._stop.is_set():
                    conn.close()
                    return
                self._conns.add(conn)
                t = threading.Thread(target=self._serve, args=(conn,), daemon=True)
                self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            head, body = _read_request(conn)
            if head is None:
                return
            line = head.split(b"\r\n", 1)[0].decode("latin-1")
            mode = self._decide(line, b"\r\nrange:" in head.lower())
            if mode == "503":
                conn.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\n"
                             b"Content-Length: %d\r\n\r\n" % len(SLOWDOWN) + SLOWDOWN)
                return
            if mode == "reset":
                _reset(conn)
                return
            with socket.create_connection(self.upstream, timeout=60) as up:
                if self.strip_range:
                    head = _drop_field(head, b"range")
                request = _close_after(head) + body
                up.sendall(request)
                with self._lock:
                    self.bytes_up += len(request)
                if mode == "lost":
                    _drain(up)
                    _reset(conn)
                    return
                while True:
                    data = up.recv(1 << 20)
                    if not data:
                        break
                    conn.sendall(data)
                    with self._lock:
                        self.bytes_down += len(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        """Stop accepting, close every connection and join the threads."""
        self._stop.set()
        self._sock.close()
        self._acceptor.join(5)
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        for t in threads:
            t.join(5)


def _reset(conn: socket.socket) -> None:
    """Close ``conn`` with a TCP reset (SO_LINGER 0)."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def _drain(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while sock.recv(1 << 20):
            pass


def _drop_field(head: bytes, name: bytes) -> bytes:
    """The request head without header field ``name`` (lower case)."""
    lines = [x for x in head.split(b"\r\n") if not x.lower().startswith(name + b":")]
    return b"\r\n".join(lines)


def _close_after(head: bytes) -> bytes:
    """The request head with ``Connection: close`` (one request per connection)."""
    lines = [x for x in head.split(b"\r\n") if x and not x.lower().startswith(b"connection:")]
    return b"\r\n".join(lines + [b"Connection: close"]) + b"\r\n\r\n"


def _read_request(conn: socket.socket) -> tuple[bytes | None, bytes]:
    """One request: its head (up to the blank line) and its body (Content-Length or chunked)."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            return None, b""
        buf += data
    head, rest = buf.split(b"\r\n\r\n", 1)
    fields = {}
    for raw in head.split(b"\r\n")[1:]:
        k, _, v = raw.partition(b":")
        fields[k.strip().lower()] = v.strip()
    if fields.get(b"transfer-encoding", b"").lower() == b"chunked":
        while not _chunked_done(rest):
            data = conn.recv(1 << 20)
            if not data:
                break
            rest += data
        return head + b"\r\n\r\n", rest
    need = int(fields.get(b"content-length", b"0"))
    parts = [rest]
    got = len(rest)
    while got < need:
        data = conn.recv(min(1 << 20, need - got))
        if not data:
            break
        parts.append(data)
        got += len(data)
    return head + b"\r\n\r\n", b"".join(parts)


def _chunked_done(body: bytes) -> bool:
    pos = 0
    while True:
        end = body.find(b"\r\n", pos)
        if end < 0:
            return False
        size = int(body[pos:end].split(b";")[0] or b"0", 16)
        if size == 0:
            return body.find(b"\r\n\r\n", end) >= 0
        pos = end + 2 + size + 2
        if pos > len(body):
            return False


def request_kind(line: str, ranged: bool = False) -> str:
    """The kind of an S3 request from its request line (``ranged``: it had a Range
    header): PUT part, PUT object, POST create-multipart / complete-multipart /
    delete-objects, GET list / ranged / whole, HEAD, DELETE."""
    method, target = line.split(" ")[:2]
    q = urlsplit(target).query
    if method == "PUT":
        return "PUT part" if "partNumber=" in q else "PUT object"
    if method == "POST":
        if "uploads" in q.split("&"):
            return "POST create-multipart"
        if "uploadId=" in q:
            return "POST complete-multipart"
        if "delete" in q:
            return "POST delete-objects"
        return "POST"
    if method == "GET":
        if "list-type" in q or "prefix=" in q or "delimiter=" in q:
            return "GET list"
        return "GET ranged" if ranged else "GET whole"
    return method


@contextlib.contextmanager
def s3_server() -> Iterator[MotoS3]:
    """A moto S3 server for the duration of the block."""
    server = MotoS3()
    try:
        yield server
    finally:
        server.stop()
