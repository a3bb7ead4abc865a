"""Where a verified remote load keeps the bytes it fetched, measured on one process:

    .venv/bin/python benchmarks/bench_s3_paths.py [--server seaweedfs|moto|URL] [--mib 160] [--reps 5]

A verified load checks every block before any destination byte is written, so it either
keeps what it fetched until landing or fetches it twice. Four loads of the same
checkpoint (``--mib`` MiB of float32 tensors, 4 MiB each, one process), interleaved,
``--reps`` each after a warm-up, medians:

- ``memory``: ``Checkpointer(memory_budget=2 x state)``: the ranges fetched into memory
  leased from the budget, blocks hashed as they arrive, landed from memory;
- ``disk``: the default (no budget): the ranges streamed to an unlinked local temporary
  file, verified and landed from there (page cache);
- ``reread``: no spill (the backend treated as local): verification fetches the checked
  blocks, landing fetches them again (twice the bytes over the network);
- ``raw``: one whole-object ``obstore.get`` of the same bytes, copied into the destination
  tensors (no format, no checksums).

Prints seconds, the ratio raw / path, and the bytes fetched / the bytes needed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from _s3_servers import start  # noqa: E402
from bench_s3 import _store, ss_options  # noqa: E402

import shardsafe  # noqa: E402

MiB = 1 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default="seaweedfs")
    ap.add_argument("--mib", type=int, default=160, help="state size in MiB (4 MiB tensors)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    torch.manual_seed(0)
    src = {f"t{i:03d}": torch.randn(MiB) for i in range(args.mib // 4)}
    need = sum(t.numel() * 4 for t in src.values())
    server = start(args.server)
    try:
        opts = ss_options(server.endpoint)
        url = server.url("paths/ck")
        shardsafe.save(src, url, storage_options=opts)
        payload = b"".join(t.numpy().tobytes() for t in src.values())
        import obstore

        store = _store(server.endpoint, server.bucket)
        obstore.put(store, "paths/raw.bin", payload)
        del payload
        cps = {"memory": shardsafe.Checkpointer(storage_options=opts, memory_budget=2 * need),
               "disk": shardsafe.Checkpointer(storage_options=opts),
               "reread": shardsafe.Checkpointer(storage_options=opts)}
        cps["reread"].locate(url)[0].remote = False  # no spill: verify and land each fetch their bytes
        dest = {k: torch.zeros_like(v) for k, v in src.items()}
        times: dict[str, list[float]] = {k: [] for k in [*cps, "raw"]}
        fetched: dict[str, int] = {}
        for rep in range(-1, args.reps):
            for name in times:
                for t in dest.values():
                    t.zero_()
                t0 = time.perf_counter()
                if name == "raw":
                    data = memoryview(obstore.get(store, "paths/raw.bin").bytes())
                    pos = 0
                    for t in dest.values():
                        n = t.numel() * 4
                        t.view(torch.uint8).view(-1)[:] = torch.frombuffer(data[pos: pos + n], dtype=torch.uint8)
                        pos += n
                    del data
                    fetched[name] = pos
                else:
                    info = cps[name].load(dest, url)
                    fetched[name] = info.bytes_fetched or 2 * info.bytes_read  # reread: verify + land
                dt = time.perf_counter() - t0
                assert all(torch.equal(dest[k], src[k]) for k in src), name
                if rep >= 0:
                    times[name].append(dt)
        raw = statistics.median(times["raw"])
        print(f"{server.version}; {args.mib} MiB state, one process, {args.reps} reps, medians")
        for name, ts in times.items():
            med = statistics.median(ts)
            print(f"  {name:7s} {med:.3f} s  raw/this {raw / med:.2f}  fetched/needed {fetched[name] / need:.3f}  "
                  f"(reps: {', '.join(f'{t:.3f}' for t in ts)})")
        for cp in cps.values():
            cp.close()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
