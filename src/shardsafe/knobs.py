"""Every tunable size and concurrency limit of shardsafe, in one place.

Each knob has a default, a one-line reason, and an environment override
``SHARDSAFE_<NAME>`` read once, when shardsafe is imported: a plain integer (sizes may
carry a ``K``, ``M`` or ``G`` suffix for KiB, MiB, GiB; ``STALE_AFTER_S`` takes seconds).
A value that is not such a number, or is below the knob's minimum, is a
:class:`~shardsafe.errors.CheckpointError` naming the variable. The knobs marked
*planning* decide how a save is laid out: every rank must see the same value (set them
for the whole job, not per rank). Format limits (what a reader accepts) are not knobs:
they are part of the on-disk contract and live in ``format/``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import CheckpointError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_SUFFIX = {"K": KiB, "M": MiB, "G": GiB}


@dataclass(frozen=True)
class Knob:
    """One tunable: its name, default, the value in force, and why it exists."""

    name: str
    default: int
    value: int
    minimum: int
    why: str

    @property
    def env(self) -> str:
        return f"SHARDSAFE_{self.name}"


KNOBS: dict[str, Knob] = {}


def parse_value(text: str, env: str, minimum: int) -> int:
    """``text`` as an integer (a K/M/G suffix multiplies by 2^10/2^20/2^30), refused
    below ``minimum`` with a CheckpointError naming ``env``."""
    raw = text.strip()
    scale = _SUFFIX.get(raw[-1:].upper(), 1) if raw else 1
    digits = raw[:-1] if scale != 1 else raw
    try:
        value = int(digits.replace("_", "")) * scale
    except ValueError:
        raise CheckpointError(f"{env}={text!r}: not an integer (a K, M or G suffix is allowed)") from None
    if value < minimum:
        raise CheckpointError(f"{env}={text!r}: must be at least {minimum}")
    return value


def _knob(name: str, default: int, why: str, minimum: int = 1) -> int:
    env = f"SHARDSAFE_{name}"
    text = os.environ.get(env)
    value = default if text is None or text == "" else parse_value(text, env, minimum)
    KNOBS[name] = Knob(name, default, value, minimum, why)
    return value


# ---- saving
CHECKSUM_BLOCK = _knob("CHECKSUM_BLOCK", 1 * MiB, "bytes per checksum block of a data file (recorded in the manifest)",
                       minimum=4 * KiB)
SLOT_BYTES = _knob("SLOT_BYTES", 64 * MiB, "bytes per staging slot of the writer (leased from the memory budget)",
                   minimum=1 * MiB)
SYNC_STAGING = _knob("SYNC_STAGING", 128 * MiB, "at most this much host memory stages a sync save's "
                     "GPU / non-dense tensors", minimum=1 * MiB)
BORROW_STRETCH = _knob("BORROW_STRETCH", 8 * MiB, "bytes per stretch of borrowed (zero-copy) source memory "
                       "that writer threads take at a time")
COPY_THREADS = _knob("COPY_THREADS", 4, "threads (the caller included) that copy into one staging slot")
DENSE_PIECE = _knob("DENSE_PIECE", 1 * MiB, "a non-dense CPU source is made dense this many bytes at a time")
PARALLEL_MIN = _knob("PARALLEL_MIN", 8 * MiB, "states smaller than this are staged by the caller alone", minimum=0)
HASH_PIECE = _knob("HASH_PIECE", 64 * MiB, "accelerator tensors are copied to host this many bytes at a time "
                   "to be hashed (incremental saves)")
FLUSH_BYTES = _knob("FLUSH_BYTES", 8 * MiB, "export writes gather up to this many bytes of tensors per write")

# ---- planning (every rank must see the same value)
SPLIT_FRACTION = _knob("SPLIT_FRACTION", 8, "planning: replicated tensors above mean/SPLIT_FRACTION bytes "
                       "per rank are split into row blocks")
MIN_SPLIT_BYTES = _knob("MIN_SPLIT_BYTES", 1 * MiB, "planning: replicated tensors below this are never split")
SMALL_BYTES = _knob("SMALL_BYTES", 64 * KiB, "planning: replicated values below this are packed onto the "
                    "lowest holders", minimum=0)
SMALL_PACK = _knob("SMALL_PACK", 16 * MiB, "planning: bytes of small replicated values packed per holder")
SHARE_SLACK = _knob("SHARE_SLACK", 16 * MiB, "planning: a broadcast load balances readers within this many bytes",
                    minimum=0)

# ---- loading
MAX_BUFFER = _knob("MAX_BUFFER", 64 * MiB, "bytes of bounce buffer a load uses at most (non-CPU or strided "
                   "destinations)", minimum=1 * MiB)
READ_BATCH = _knob("READ_BATCH", 8 * MiB, "direct reads into destinations are batched up to this many bytes")
VERIFY_WINDOW = _knob("VERIFY_WINDOW", 2 * MiB, "bytes read at once to be verified, local files")
REMOTE_VERIFY_WINDOW = _knob("REMOTE_VERIFY_WINDOW", 8 * MiB, "bytes read at once to be verified, remote "
                             "files (one request each)")
SHARE_PACK = _knob("SHARE_PACK", 4 * MiB, "a broadcast load sends replicated pieces smaller than this packed "
                   "together, up to this many bytes per message")
LOAD_RETRIES = _knob("LOAD_RETRIES", 3, "a load that sees its checkpoint replaced mid-way starts again this often",
                     minimum=0)

# ---- storage
INDEX_THREADS = _knob("INDEX_THREADS", 16, "file indexes fetched at once from a remote backend")
FETCH_THREADS = _knob("FETCH_THREADS", 8, "ranged reads in flight at once from a remote backend (at least "
                      "the read threads)")
STREAM_PIECE = _knob("STREAM_PIECE", 4 * MiB, "a ranged GET is copied into its destination in pieces of this size")
SPILL_MERGE_GAP = _knob("SPILL_MERGE_GAP", 1 * MiB, "remote ranges closer than this are fetched as one request "
                        "(the gap is read too)", minimum=0)
SPILL_REQUEST_BYTES = _knob("SPILL_REQUEST_BYTES", 32 * MiB, "one remote request fetches at most this much "
                            "(parallelism within a file; raise it for a server that copies the whole "
                            "object for every ranged GET, such as moto)", minimum=64 * KiB)
SPILL_PIECE = _knob("SPILL_PIECE", 2 * MiB, "bytes held in memory per remote request while they are written to "
                    "the spill", minimum=4 * KiB)
SPILL_MEMORY = _knob("SPILL_MEMORY", 0, "with no memory budget, a remote load keeps at most this many bytes of "
                     "the ranges it fetched in memory (the rest go to a local spill file); with a budget: its free "
                     "room", minimum=0)
SPILL_HEADROOM = _knob("SPILL_HEADROOM", 8 * MiB, "of a memory budget's free room, this much is left to the "
                       "reader's own buffers when a remote load keeps some of the ranges it fetched in memory "
                       "(not all fit)", minimum=0)
STALE_AFTER_S = _knob("STALE_AFTER_S", 6 * 3600, "seconds after which a leftover temp folder counts as abandoned "
                      "where the filesystem has no locks")

# ---- tools
EXPORT_BATCH = _knob("EXPORT_BATCH", 16 * MiB, "export reads tensors in batches of about this many bytes")
COPY_WINDOW = _knob("COPY_WINDOW", 8 * MiB, "shardsafe copy moves a file this many bytes at a time")
DIFF_SLICE = _knob("DIFF_SLICE", 4 * MiB, "diff compares tensors this many bytes at a time")
ZIP_MIN_GAIN = _knob("ZIP_MIN_GAIN", 1030, "a block is stored compressed only when raw/compressed >= this/1000 "
                     "(else raw)", minimum=1000)
ZSTD_LEVEL = _knob("ZSTD_LEVEL", 1, "zstd level of compression=\"zstd\" (1: fastest; higher: slower, a little smaller)")
ZIP_CACHE = _knob("ZIP_CACHE", 256 * MiB, "a load keeps up to this many bytes of decompressed, verified blocks "
                  "(within the memory budget's free room), so landing does not decompress them again", minimum=0)
ZIP_AHEAD = _knob("ZIP_AHEAD", 8 * MiB, "compressed chunks: a load reads up to this many bytes ahead of the "
                  "blocks it decompresses, a save compresses up to this many ahead of its writes (per thread, "
                  "within the memory budget)", minimum=0)
ZIP_PROBE = _knob("ZIP_PROBE", 4 * MiB, "compression=\"auto\": bytes of a save's first blocks compressed once per "
                  "process to measure the codec's throughput")
