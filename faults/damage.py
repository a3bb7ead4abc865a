"""Damage to the files of a checkpoint: bit flips anywhere, byte-range damage (overwrite,
truncate, append, delete, swap, stale file from another save, junk added), and the
restoration of the working copy from its pristine twin after each trial."""

from __future__ import annotations

import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
CORRUPT = ["CorruptCheckpointError"]
NOT_FOUND = ["CheckpointNotFoundError"]


@dataclass
class Ckpt:
    """A checkpoint under test: ``pristine`` (never touched), ``work`` (damaged, then
    restored), ``alt`` (the same layout saved from other values: a source of stale files)."""

    name: str
    pristine: Path
    work: Path
    alt: Path
    files: list[str] = field(default_factory=list)
    header_bytes: dict[str, int] = field(default_factory=dict)
    regions: dict[str, list[tuple[int, int, str]]] = field(default_factory=dict)

    @staticmethod
    def open(name: str, pristine: Path, work: Path, alt: Path) -> Ckpt:
        """Describe ``pristine`` (from its manifest) and make ``work`` a copy of it."""
        body = json.loads((pristine / MANIFEST).read_bytes())
        ck = Ckpt(name, pristine, work, alt)
        ck.files = [MANIFEST, *(f["name"] for f in body["files"])]
        ck.header_bytes = {f["name"]: f["header_bytes"] for f in body["files"]}
        table = body["chunks"]
        for key, t in body["tensors"].items():
            first, count = t["chunks"]
            for c in range(first, first + count):
                fname = body["files"][table["f"][c]]["name"]
                ck.regions.setdefault(fname, []).append((table["b"][2 * c], table["b"][2 * c + 1], key))
        if work.exists():
            shutil.rmtree(work)
        shutil.copytree(pristine, work)
        return ck

    def region(self, fname: str, pos: int) -> str:
        """What byte ``pos`` of ``fname`` holds (for reports)."""
        if fname == MANIFEST:
            return "manifest"
        if pos < 8:
            return "header length"
        if pos < self.header_bytes[fname]:
            return "header"
        for lo, hi, key in self.regions.get(fname, []):
            if lo <= pos < hi:
                return f"data of {key}"
        return "data (unclaimed)"

    def restore(self, touched: set[str]) -> None:
        """Put the working copy back as the pristine one: entries in ``touched`` are removed
        (whatever they became) and copied again when the pristine checkpoint has them;
        anything else found in the working folder is removed."""
        names = set(os.listdir(self.work)) | touched
        for name in names:
            target = self.work / name
            if name in touched or not (self.pristine / name).exists():
                _remove(target)
                if (self.pristine / name).exists():
                    shutil.copyfile(self.pristine / name, target)


def _remove(p: Path) -> None:
    if p.is_symlink() or (p.exists() and not p.is_dir()):
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)


@dataclass
class Damage:
    """What was done: a short label, the entries touched, details, and the errors that
    count as detection (empty: the checkpoint must still load bitwise-correct)."""

    label: str
    touched: set[str]
    info: dict[str, Any]
    errors: list[str]


def flip(ck: Ckpt, rng: random.Random) -> Damage:
    """Flip one bit of one file (chosen uniformly among the manifest and the data files);
    half the flips land anywhere in the file, half in its structure (the manifest, or a
    data file's length prefix and header)."""
    fname = rng.choice(ck.files)
    path = ck.work / fname
    size = path.stat().st_size
    if fname != MANIFEST and rng.random() < 0.5:
        pos = rng.randrange(ck.header_bytes[fname])
    else:
        pos = rng.randrange(size)
    bit = rng.randrange(8)
    with open(path, "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ (1 << bit)]))
    return Damage("bit flip", {fname}, {"ckpt": ck.name, "file": fname, "pos": pos, "bit": bit,
                                        "region": ck.region(fname, pos)}, CORRUPT)


RANGE_KINDS = ("overwrite random", "overwrite zeros", "truncate", "append", "delete", "swap", "stale file",
               "junk added")


def range_damage(ck: Ckpt, rng: random.Random, kind: str) -> Damage:
    """One byte-range damage of ``kind`` (see RANGE_KINDS) to a random file."""
    fname = rng.choice(ck.files)
    path = ck.work / fname
    size = path.stat().st_size
    info: dict[str, Any] = {"ckpt": ck.name, "file": fname}
    errors = CORRUPT
    if kind.startswith("overwrite"):
        n = min(size, rng.choice([1, 2, 8, 64, 4096, rng.randrange(1, size + 1)]))
        pos = rng.randrange(size - n + 1)
        data = os.urandom(n) if kind == "overwrite random" else bytes(n)
        with open(path, "r+b") as f:
            f.seek(pos)
            old = f.read(n)
            f.seek(pos)
            f.write(data)
        info.update(pos=pos, n=n, region=ck.region(fname, pos), changed=old != data)
        if old == data:
            errors = []  # nothing changed: it must still load
    elif kind == "truncate":
        keep = rng.choice([0, 1, 8, size // 2, size - 1, rng.randrange(size)])
        os.truncate(path, keep)
        info.update(keep=keep, size=size)
    elif kind == "append":
        n = rng.choice([1, 7, 4096])
        with open(path, "ab") as f:
            f.write(os.urandom(n) if rng.random() < 0.5 else b"\0" * n)
        info.update(n=n)
    elif kind == "delete":
        path.unlink()
        errors = NOT_FOUND if fname == MANIFEST else CORRUPT
    elif kind == "swap":
        other = rng.choice([f for f in ck.files if f != fname])
        tmp = ck.work / ".swap"
        os.rename(path, tmp)
        os.rename(ck.work / other, path)
        os.rename(tmp, ck.work / other)
        info.update(other=other)
        return Damage(kind, {fname, other}, info, errors)
    elif kind == "stale file":
        shutil.copyfile(ck.alt / fname, path)  # the same name from another save of this layout
    elif kind == "junk added":
        return _junk(ck, rng, info)
    else:
        raise ValueError(kind)
    return Damage(kind, {fname}, info, errors)


JUNK = ("random file", "unlisted data file", "pickle payload", "subfolder", "symlink", "fifo", "hidden temp")


def _junk(ck: Ckpt, rng: random.Random, info: dict[str, Any]) -> Damage:
    """Add entries a checkpoint does not list: they are ignored, so it must still load."""
    import pickle

    what = rng.choice(JUNK)
    w = ck.work
    if what == "random file":
        name = f"junk-{rng.randrange(10 ** 6)}.bin"
        (w / name).write_bytes(os.urandom(rng.randrange(1, 5000)))
    elif what == "unlisted data file":
        name = "data-r00099-00.safetensors"
        shutil.copyfile(ck.pristine / ck.files[-1], w / name)
    elif what == "pickle payload":
        name = ".metadata"
        (w / name).write_bytes(pickle.dumps({"x": os.system}))
    elif what == "subfolder":
        name = "sub"
        (w / name).mkdir()
        (w / name / MANIFEST).write_bytes(b"{}")
    elif what == "symlink":
        name = "link.safetensors"
        os.symlink("/etc/hostname", w / name)
    elif what == "fifo":
        name = "pipe.safetensors"
        os.mkfifo(w / name)
    else:
        name = ".manifest.json.tmp"
        (w / name).write_bytes(b"{")
    info.update(file=name, junk=what)
    return Damage("junk added", {name}, info, [])
