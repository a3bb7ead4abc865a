"""Metadata at scale (format 3.0): simulated ranks, no processes, no data bytes.

    .venv/bin/python benchmarks/bench_scale.py [--quick] [--reps N] [--out FILE]

Drives the real save planner (``plan_global`` over every rank's layout, as gathered),
index writer (``plan_file`` + ``build_index`` for the ranks a measured load reads),
manifest builder (``build_manifest`` from per-rank summaries, ``Manifest.to_bytes``),
manifest and index reader (``Manifest.from_bytes``, ``attach_indexes``) and load planner
(``plan_reads`` + ``block_checks``) for a Llama-3-405B-shaped state (126 layers, dim 16384,
FFN 53248, vocab 128256: 1,137 parameters, fp32; AdamW: exp_avg and exp_avg_sq with the
parameter's layout, and a 0-d ``step`` per parameter, replicated) plus a ~7 KB rank-local
Python RNG state per rank, laid out as
  (a) TP 8 x PP 16 x FSDP d (torchtitan's FSDP2 + TP placements: colwise weights
      [_StridedShard(0, 8), Shard(0)], rowwise [Shard(0), Shard(1)], norms [Shard(0), R]),
  (b) FSDP only over N ranks (Shard(0)),
at 1,024 / 4,096 / 16,384 ranks, and (c) format 2.0 (every chunk a row of the manifest's
chunk table) for the 1,024-rank case of (a), built from the same plan.

Per case: manifest bytes; index bytes (of the measured loading rank); rank 0's commit work
(build + serialize the manifest from the plan and the per-rank summaries); every rank's
planning (``plan_global``; cached across saves of the same layout); one rank's load for the
same layout and resharded to half the ranks (FSDP d -> d/2, or N -> N/2): metadata bytes
read (manifest + the indexes of the files it reads), manifest parse, index read + parse,
and planning (``plan_reads`` + ``block_checks``), measured in a fresh process that holds only
what a loading rank holds. Times are process CPU seconds, median of ``--reps`` (the code is
single-threaded); the GC stays on.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from torch.distributed.tensor import Replicate, Shard  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

from shardsafe.format.chunk_table import Chunk  # noqa: E402
from shardsafe.format.file_index import IndexedChunk, build_index, data_name, index_name  # noqa: E402
from shardsafe.format.manifest import FileEntry, Manifest, TensorEntry  # noqa: E402
from shardsafe.gcpause import gc_paused  # noqa: E402
from shardsafe.layout import Box  # noqa: E402
from shardsafe.ops.commit import build_manifest  # noqa: E402
from shardsafe.ops.save import CHECKSUM_BLOCK  # noqa: E402
from shardsafe.plan.load_plan import Dest, block_checks, plan_reads  # noqa: E402
from shardsafe.plan.save_plan import HeldTensor, plan_file, plan_global  # noqa: E402
from shardsafe.state.sharding import pieces_for  # noqa: E402

LAYERS, DIM, FFN, VOCAB, KV = 126, 16384, 53248, 128256, 1024
BLOCK = CHECKSUM_BLOCK
FILE_ID = ".0123456789ab"
RNG_KEY = "train.rng"
PROCESSES = 3  # fresh processes per load measurement


def params() -> list[tuple[str, tuple[int, ...], str]]:
    """(key, shape, style) of the Llama-3-405B parameters; style: colwise / rowwise / norm."""
    out = [("model.tok_embeddings.weight", (VOCAB, DIM), "colwise")]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [(p + "attention.wq.weight", (DIM, DIM), "colwise"), (p + "attention.wk.weight", (KV, DIM), "colwise"),
                (p + "attention.wv.weight", (KV, DIM), "colwise"), (p + "attention.wo.weight", (DIM, DIM), "rowwise"),
                (p + "feed_forward.w1.weight", (FFN, DIM), "colwise"),
                (p + "feed_forward.w2.weight", (DIM, FFN), "rowwise"),
                (p + "feed_forward.w3.weight", (FFN, DIM), "colwise"),
                (p + "attention_norm.weight", (DIM,), "norm"), (p + "ffn_norm.weight", (DIM,), "norm")]
    out += [("model.norm.weight", (DIM,), "norm"), ("model.output.weight", (VOCAB, DIM), "colwise")]
    return out


PARAMS = params()


def stage_params(pp: int) -> list[list[tuple[str, tuple[int, ...], str]]]:
    """Parameters per pipeline stage: layers split evenly, embeddings first, head last."""
    per = -(-LAYERS // pp)
    stages: list[list] = [[] for _ in range(pp)]
    for key, shape, style in PARAMS:
        if ".layers." in key:
            s = int(key.split(".")[2]) // per
        else:
            s = 0 if "tok_embeddings" in key else pp - 1
        stages[s].append((key, shape, style))
    return stages


class Layout:
    """One parallel layout: pp stages, each a (dp, tp) mesh (tp 1 and pp 1: FSDP only)."""

    def __init__(self, pp: int, dp: int, tp: int) -> None:
        self.pp, self.dp, self.tp = pp, dp, tp
        self.world = pp * dp * tp
        self.stages = stage_params(pp)

    def name(self) -> str:
        return f"TP {self.tp} x PP {self.pp} x FSDP {self.dp}" if self.tp > 1 else f"FSDP {self.dp}"

    def mesh_shape(self) -> tuple[int, ...]:
        return (self.dp, self.tp) if self.tp > 1 else (self.dp,)

    def torch_placements(self, style: str) -> tuple:
        if self.tp == 1:
            return (Shard(0),)
        return {"colwise": (_StridedShard(0, split_factor=self.tp), Shard(0)), "rowwise": (Shard(0), Shard(1)),
                "norm": (Shard(0), Replicate())}[style]

    def rule_placements(self, style: str) -> tuple:
        if self.tp == 1:
            return (("S", 0),)
        return {"colwise": (("SS", 0, self.tp), ("S", 0)), "rowwise": (("S", 0), ("S", 1)),
                "norm": (("S", 0), ("R",))}[style]

    def coord(self, rank: int) -> tuple[int, list[int]]:
        stage, inner = divmod(rank, self.dp * self.tp)
        return stage, ([inner // self.tp, inner % self.tp] if self.tp > 1 else [inner])

    def stage_layouts(self, stage: int, rank: int | None = None) -> list[HeldTensor]:
        """What a rank of ``stage`` describes (its boxes only when ``rank`` is given)."""
        base = stage * self.dp * self.tp
        mesh = (self.mesh_shape(), tuple(range(base, base + self.dp * self.tp)),
                ("dp_shard", "tp") if self.tp > 1 else ("dp_shard",))
        coord = self.coord(rank)[1] if rank is not None else None
        out = []
        for key, shape, style in self.stages[stage]:
            rule = (mesh, self.rule_placements(style))
            boxes = [] if coord is None else [p.box for p in pieces_for(shape, self.mesh_shape(), coord,
                                                                          self.torch_placements(style))]
            for k in (key, f"optimizer.state.{key}.exp_avg", f"optimizer.state.{key}.exp_avg_sq"):
                out.append(HeldTensor(k, "float32", shape, 4, "sharded", boxes, rule))
            out.append(HeldTensor(f"optimizer.state.{key}.step", "float32", (), 4, "replicated",
                                    [Box((), ())]))
        return out

    def dests(self, rank: int) -> list[Dest]:
        """Every box rank ``rank`` loads under this layout."""
        stage, coord = self.coord(rank)
        out = []
        for key, shape, style in self.stages[stage]:
            for p in pieces_for(shape, self.mesh_shape(), coord, self.torch_placements(style)):
                for k in (key, f"optimizer.state.{key}.exp_avg", f"optimizer.state.{key}.exp_avg_sq"):
                    out.append(Dest(k, p.box, True))
            out.append(Dest(f"optimizer.state.{key}.step", Box((), ()), True))
        return out


def tree() -> dict[str, Any]:
    t: dict[str, Any] = {"model": {}, "optimizer": {"state": {}}}
    for key, _, _ in PARAMS:
        t["model"][key] = {"$tensor": key}
        t["optimizer"]["state"][key] = {s: {"$tensor": f"optimizer.state.{key}.{s}"}
                                        for s in ("exp_avg", "exp_avg_sq", "step")}
    t["train"] = {"rng": {"$rank_local": RNG_KEY}, "step": 1000}
    return t


RNG_STATE = [3, [random.Random(0).getrandbits(32) for _ in range(625)], None]  # ~7 KB of JSON, as random.getstate()


def cpu(fn: Any, reps: int) -> tuple[float, Any]:
    """Median process CPU seconds of ``reps`` runs of ``fn`` and its last result."""
    times, out = [], None
    for _ in range(reps):
        t0 = time.process_time()
        out = fn()
        times.append(time.process_time() - t0)
    return statistics.median(times), out


def rank_index(lay: Layout, plan: Any, rank: int) -> tuple[int, bytes]:
    """The real data-file layout and index of ``rank`` (fake block digests): (file bytes, index)."""
    stage = lay.coord(rank)[0]
    layouts = lay.stage_layouts(stage, rank)
    assigned = plan.assignments(rank, layouts, [])
    codes = {tl.key: "F32" for tl in layouts}
    sizes = {tl.key: 4 for tl in layouts}
    fw = plan_file(data_name(rank, FILE_ID), rank, assigned, codes, sizes)
    order = plan.ordinal()
    chunks = [IndexedChunk(order[c.key], c.box.offsets, c.box.lengths, c.start, c.end,
                           [format(rank * 7919 + i, "016x") for i in range(max(1, -(-(c.end - c.start) // BLOCK)))])
              for c in fw.chunks]
    from shardsafe.format.checksum import checksum

    return fw.size, build_index(rank, len(fw.header), checksum(fw.header), chunks, {}, {RNG_KEY: RNG_STATE})


def run_case(lay: Layout, target: Layout, reps: int, v2: bool = False) -> dict[str, Any]:
    world = lay.world
    gc.collect()
    shared = [lay.stage_layouts(s) for s in range(lay.pp)]
    layouts = [shared[lay.coord(r)[0]] for r in range(world)]
    signatures = [f"stage-{lay.coord(r)[0]}" for r in range(world)]
    t_plan, plan = cpu(lambda: plan_global(layouts, signatures), reps)
    rank = world // 2 + lay.tp + 1  # a rank in the middle of the job (not rank 0)
    # Which files the measured loads read: found on a provisional manifest (same plan).
    guess = build_manifest(plan, [[1, 1 << 30, 1, 0]] * world, tree(), world, FILE_ID)
    loads = {"same": lay.dests(rank), "reshard": target.dests(rank % target.world)}
    needed = {0, rank}
    for dests in loads.values():
        for d in dests:
            needed.update(guess.files[f].rank for _, _, f in guess.tensors[d.key].boxes_meeting(d.box.offsets,
                                                                                                d.box.lengths))
    indexes = {r: rank_index(lay, plan, r) for r in sorted(needed)}
    del guess
    from shardsafe.format.checksum import checksum

    rep_stage = {lay.coord(r)[0]: r for r in sorted(indexes)}
    summaries = []
    for r in range(world):
        if r in indexes:
            size, data = indexes[r]
            summaries.append([1, size, len(data), _signed(int(checksum(data), 16))])
        else:
            size, data = indexes[rep_stage.get(lay.coord(r)[0], rank)]
            summaries.append([1, size, len(data), r])  # never read: any digest
    the_tree = tree()
    t_commit, manifest_bytes = cpu(lambda: build_manifest(plan, summaries, the_tree, world, FILE_ID).to_bytes(),
                                   reps)
    out: dict[str, Any] = {
        "case": lay.name(), "world": world, "chunks": None, "plan_s": t_plan, "commit_s": t_commit,
        "manifest_bytes": len(manifest_bytes), "index_bytes": len(indexes[rank][1]),
        "index_bytes_rank0": len(indexes[0][1]),
    }
    by_name = {index_name(data_name(r, FILE_ID)): data for r, (_, data) in indexes.items()}
    for label, dests in loads.items():
        out[label] = measure_load_in_fresh_process(manifest_bytes, dests, by_name, reps)
    out["chunks"] = sum(e.chunk_count for e in Manifest.from_bytes(manifest_bytes).tensors.values())
    if v2:
        out["format2"] = run_format2(lay, plan, summaries, indexes, manifest_bytes, loads["same"], rank, reps)
    return out


def measure_load_in_fresh_process(manifest_bytes: bytes, dests: list[Dest], by_name: dict[str, bytes],
                                  reps: int) -> dict[str, Any]:
    """:func:`measure_load` in a new process holding only what a loading rank holds (the
    planner's structures for 16k ranks in this one would slow it through a bigger heap)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory(prefix="shardsafe-bench-scale-") as tmp:
        d = Path(tmp)
        (d / "manifest.json").write_bytes(manifest_bytes)
        for name, data in by_name.items():
            (d / name).write_bytes(data)
        (d / "dests.json").write_text(json.dumps([[x.key, list(x.box.offsets), list(x.box.lengths)] for x in dests]))
        runs = [json.loads(subprocess.run([sys.executable, __file__, "--measure", tmp, "--reps", str(reps)],
                                          check=True, capture_output=True, text=True).stdout)
                for _ in range(PROCESSES)]
    # CPU time on this VM swings by half from process to process: the median of PROCESSES
    # processes' medians.
    return {k: statistics.median(r[k] for r in runs) if k.endswith("_s") else runs[0][k] for k in runs[0]}


def _measure_main(folder: str, reps: int) -> None:
    d = Path(folder)
    dests = [Dest(k, Box(tuple(o), tuple(n)), True) for k, o, n in json.loads((d / "dests.json").read_text())]
    by_name = {p.name: p.read_bytes() for p in d.glob("*.index.json")}
    print(json.dumps(measure_load((d / "manifest.json").read_bytes(), dests, by_name, reps)))


def measure_load(manifest_bytes: bytes, dests: list[Dest], by_name: dict[str, bytes], reps: int) -> dict[str, Any]:
    """One rank's load metadata work: parse the manifest, read and parse the indexes of the
    files its boxes meet, plan its reads and checks."""
    read: list[int] = []

    def source(items: list[tuple[str, int]]) -> list[bytes]:
        got = [by_name[n] for n, _ in items]
        read.extend(len(g) for g in got)
        return got

    def parse() -> Manifest:
        return Manifest.from_bytes(manifest_bytes)

    def attach(m: Manifest, wanted: set[int]) -> None:  # what ops.metadata.fetch_indexes does
        requests = m.index_requests(wanted)
        m.attach_indexes([(f, data) for (f, _, _), data in zip(requests, source([(n, s) for _, n, s in requests]))])

    t_parse, m = cpu(parse, reps)

    files = {f for d in dests for _, _, f in m.tensors[d.key].boxes_meeting(d.box.offsets, d.box.lengths)}

    def fresh_index_load() -> None:
        fresh = parse()
        read.clear()
        t0 = time.process_time()
        attach(fresh, files)
        return time.process_time() - t0

    t_index = statistics.median(fresh_index_load() for _ in range(reps))
    index_read = sum(read)

    def plan() -> list:
        fresh = parse()  # a fresh manifest (no geometry computed yet), its indexes read
        attach(fresh, files)
        gc.collect(0)  # the parse's young objects (it pauses the GC too): not planning's to pay
        t0 = time.process_time()
        with gc_paused():  # as loading.plan_phase runs them
            checks = block_checks(plan_reads(fresh, dests), BLOCK)
        gc.collect(0)  # what the pause deferred: the young objects it made (counted)
        times.append(time.process_time() - t0)
        return checks

    times: list[float] = []
    checks = [plan() for _ in range(reps)][-1]
    t_plan = statistics.median(times)
    return {"dests": len(dests), "files": len(files), "manifest_parse_s": t_parse, "index_read_parse_s": t_index,
            "plan_s": t_plan, "metadata_read_bytes": len(manifest_bytes) + index_read, "index_read_bytes": index_read,
            "checks": len(checks)}


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def run_format2(lay: Layout, plan: Any, summaries: list, indexes: dict, v3_bytes: bytes, dests: list[Dest],
                rank: int, reps: int) -> dict[str, Any]:
    """The same checkpoint in format 2.0: rank 0 gathers every chunk (offsets, lengths, byte
    range, digests) and writes them all into the manifest; every rank parses all of it."""
    v3 = Manifest.from_bytes(v3_bytes)
    # Every rank's chunks as format 2.0's commit gathers them: boxes from the plan, byte
    # ranges laid out back to back per file, one digest per 1 MiB block.
    per_file: dict[int, int] = {}
    gathered: dict[str, list[Chunk]] = {}
    for key, e in v3.own_tensors().items():
        rows = []
        for o, n, f in e.boxes():
            start = per_file.setdefault(f, 4096)
            nb = 4
            for x in n:
                nb *= x
            rows.append(Chunk(o, n, f, start, start + nb,
                              [format(i, "016x") for i in range(max(1, -(-nb // BLOCK)))], v3.files[f].rank))
            per_file[f] = start + nb
        gathered[key] = rows
    gather_bytes = sum(len(json.dumps(c.to_json())) for rows in gathered.values() for c in rows)

    def commit() -> bytes:
        tensors = {k: TensorEntry(e.dtype, e.shape, e.kind, list(gathered[k]), e.layout)
                   for k, e in v3.own_tensors().items()}
        files = [FileEntry(f.name, per_file.get(i, 4096), f.rank, 4096, "0" * 16) for i, f in enumerate(v3.files)]
        m = Manifest(v3.tree, tensors, files, v3.world_size, {RNG_KEY: [RNG_STATE] * v3.world_size}, v3.created,
                     v3.writer, v3.extra)
        return m.to_bytes()

    t_commit, data = cpu(commit, reps)
    t_parse, m2 = cpu(lambda: Manifest.from_bytes(data), reps)
    t_plan, ops = cpu(lambda: block_checks(plan_reads(m2, dests), BLOCK), reps)
    return {"manifest_bytes": len(data), "commit_s": t_commit, "gather_bytes": gather_bytes,
            "manifest_parse_s": t_parse, "plan_s": t_plan, "metadata_read_bytes": len(data)}


def mb(n: int) -> str:
    return f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def report(results: list[dict[str, Any]]) -> str:
    lines = ["| layout | ranks | chunks | manifest | index (rank / rank 0) | rank 0 commit | planning (every rank) "
             "| load: metadata read | manifest parse | indexes read+parse | load plan | reshard: metadata read "
             "| reshard: indexes | reshard: load plan |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        s, h = r["same"], r["reshard"]
        lines.append(
            f"| {r['case']} | {r['world']:,} | {r['chunks']:,} | {mb(r['manifest_bytes'])} | "
            f"{mb(r['index_bytes'])} / {mb(r['index_bytes_rank0'])} | {r['commit_s'] * 1e3:.0f} ms | "
            f"{r['plan_s'] * 1e3:.0f} ms | {mb(s['metadata_read_bytes'])} ({s['files']} indexes) | "
            f"{s['manifest_parse_s'] * 1e3:.0f} ms | {s['index_read_parse_s'] * 1e3:.0f} ms | "
            f"{s['plan_s'] * 1e3:.0f} ms | {mb(h['metadata_read_bytes'])} ({h['files']} indexes) | "
            f"{h['index_read_parse_s'] * 1e3:.0f} ms | {h['plan_s'] * 1e3:.0f} ms |")
    for r in results:
        f2 = r.get("format2")
        if f2:
            lines += ["", f"format 2.0, same checkpoint ({r['case']}, {r['world']:,} ranks): manifest "
                      f"{mb(f2['manifest_bytes'])} (3.0: {mb(r['manifest_bytes'])}, "
                      f"{f2['manifest_bytes'] / r['manifest_bytes']:.1f}x); rank 0 gathers {mb(f2['gather_bytes'])} "
                      f"of chunk rows (3.0: {r['world'] * 32 / 1e3:.0f} KB of fixed-size summaries); commit "
                      f"{f2['commit_s'] * 1e3:.0f} ms (3.0: {r['commit_s'] * 1e3:.0f} ms); one rank's load: "
                      f"metadata read {mb(f2['metadata_read_bytes'])} (3.0: {mb(r['same']['metadata_read_bytes'])}), "
                      f"parse {f2['manifest_parse_s'] * 1e3:.0f} ms (3.0: manifest "
                      f"{r['same']['manifest_parse_s'] * 1e3:.0f} ms + indexes "
                      f"{r['same']['index_read_parse_s'] * 1e3:.0f} ms), load plan {f2['plan_s'] * 1e3:.0f} ms "
                      f"(3.0: {r['same']['plan_s'] * 1e3:.0f} ms)"]
    by = {}
    for r in results:
        by.setdefault(r["case"].split(" x FSDP")[0] if " x " in r["case"] else "FSDP", []).append(r)
    lines.append("")
    for fam, rs in by.items():
        rs = sorted(rs, key=lambda r: r["world"])
        if len(rs) > 1:
            a, b = rs[0], rs[-1]
            lines.append(f"growth {a['world']:,} -> {b['world']:,} ranks ({fam}): chunks "
                         f"{b['chunks'] / a['chunks']:.1f}x, manifest {b['manifest_bytes'] / a['manifest_bytes']:.2f}x "
                         f"(+{(b['manifest_bytes'] - a['manifest_bytes']) / (b['world'] - a['world']):.0f} B per "
                         f"added rank), rank 0 commit {b['commit_s'] / a['commit_s']:.2f}x, one rank's metadata read "
                         f"{b['same']['metadata_read_bytes'] / a['same']['metadata_read_bytes']:.2f}x, load plan "
                         f"{b['same']['plan_s'] / a['same']['plan_s']:.2f}x")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1,024 and 4,096 ranks only, 1 rep")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="")
    ap.add_argument("--measure", default="", help=argparse.SUPPRESS)  # internal: one load, in a fresh process
    args = ap.parse_args()
    if args.measure:
        _measure_main(args.measure, args.reps)
        return
    reps = 1 if args.quick else args.reps
    worlds = [8, 32] if args.quick else [8, 32, 128]
    results = []
    for dp in worlds:  # (a) TP 8 x PP 16 x FSDP dp; reshard to FSDP dp / 2
        results.append(run_case(Layout(16, dp, 8), Layout(16, dp // 2, 8), reps, v2=(dp == 8)))
        print(f"done {results[-1]['case']}", file=sys.stderr, flush=True)
    for n in [w * 128 for w in worlds]:  # (b) FSDP only over n ranks; reshard to n / 2
        results.append(run_case(Layout(1, n, 1), Layout(1, n // 2, 1), reps))
        print(f"done {results[-1]['case']}", file=sys.stderr, flush=True)
    text = report(results)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
