"""Open a checkpoint and read its tensors one at a time (whole, on the CPU, checksums verified).

Only the tensor being read is held: a fresh tensor of its size, plus a staging buffer of
at most ``max_buffer`` bytes for chunks whose bytes are scattered in it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..api import read_manifest
from ..engine.reader import ReadSession
from ..errors import CheckpointError, CorruptCheckpointError, MissingKeysError
from ..format.manifest import Manifest
from ..plan.load_plan import plan_reads
from ..state.match import Matcher
from .common import PathLike

DEFAULT_BUFFER = 16 << 20


def open_checkpoint(path: PathLike) -> tuple[Path, Manifest]:
    """The checkpoint folder and its verified manifest."""
    root = Path(path)
    return root, read_manifest(root)


def block_size(manifest: Manifest) -> int:
    """The checksum block size the checkpoint was written with."""
    block = manifest.extra.get("checksum_block")
    if not isinstance(block, int) or block <= 0:
        raise CorruptCheckpointError("manifest: missing or bad extra.checksum_block")
    return block


def missing_tensor(manifest: Manifest, key: str) -> MissingKeysError:
    """A MissingKeysError for ``key`` that suggests the nearest tensor keys."""
    import difflib

    near = difflib.get_close_matches(key, list(manifest.tensors), n=3)
    hint = f"; did you mean {', '.join(repr(n) for n in near)}?" if near else "; `shardsafe inspect` lists them"
    return MissingKeysError(f"no tensor {key!r} in the checkpoint{hint}")


class TensorReader:
    """Reads whole tensors of one checkpoint, one per call."""

    def __init__(self, path: PathLike, manifest: Manifest | None = None, *, verify: bool = True,
                 max_buffer: int = DEFAULT_BUFFER, threads: int = 2) -> None:
        self.root = Path(path)
        self.manifest = manifest if manifest is not None else read_manifest(self.root)
        self.verify = verify
        self.max_buffer = max_buffer
        self.block = block_size(self.manifest)
        self.threads = threads

    def read(self, key: str) -> torch.Tensor:
        """The full tensor ``key`` (a manifest tensor key) as a fresh CPU tensor."""
        if key not in self.manifest.tensors:
            raise missing_tensor(self.manifest, key)
        matcher = Matcher(self.manifest)
        tensor = matcher.fresh_tensor(key)
        ops = plan_reads(self.manifest, matcher.result.fills, self.max_buffer)
        try:
            with ReadSession(self.root, self.manifest, ops, verify=self.verify, block=self.block,
                             threads=self.threads) as session:
                session.verify()
                session.read()
        except CheckpointError:
            raise
        except OSError as exc:
            raise CorruptCheckpointError(f"{self.root}: cannot read tensor {key!r}: {exc}") from exc
        return tensor
