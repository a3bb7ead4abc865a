"""Minimal reproductions of the defects the fault campaign found (one function each).

Each ``repro_*`` function builds its case in a fresh temp folder and returns
``(reproduced, evidence)``: True while the defect is present. Run them all with
``python -m faults.repro_defects`` (or name some); ``tests/test_faults_quick.py`` runs each
as a strict xfail, so fixing one makes that test say so.
"""

from __future__ import annotations

import errno
import json
import socket
import struct
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import shardsafe
from shardsafe.format.checksum import checksum
from shardsafe.storage.faults import Fault, FaultyBackend

TRAILER = b', "manifest_xxh3_64": "'
MANIFEST = "manifest.json"
DATA = "data-r00000-00.safetensors"

Result = tuple[bool, str]


def _seal(path: Path, body: dict[str, Any] | str) -> None:
    """Write ``body`` (a dict, or JSON text) as the manifest with a valid integrity trailer."""
    text = body if isinstance(body, str) else json.dumps(body, separators=(",", ":"))
    head = text.encode("utf-8", "surrogatepass").rstrip()[:-1]
    (path / MANIFEST).write_bytes(head + TRAILER + checksum(head).encode() + b'"}\n')


def _body(path: Path) -> dict[str, Any]:
    """The manifest's JSON, of the checkpoint rewritten as format 2.0 first (the repros
    edit the 2.x chunk table, which every reader still reads)."""
    from shardsafe.tools.format2 import write_format2

    write_format2(path)
    body = json.loads((path / MANIFEST).read_bytes())
    body.pop("manifest_xxh3_64")
    return body


def _outcome(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - reported
        return f"{type(exc).__name__}: {str(exc)[:160]}"
    return "no error"


def _state() -> dict[str, Any]:
    return {"w": torch.arange(8, dtype=torch.float32), "lr": 0.5, "cfg": {"t": (1, 2), "d": {1: "a"}}, "step": 3}


# ----------------------------------------------------------------------------- 1


def repro_failed_save_deletes_previous(tmp: Path) -> Result:
    """A save whose directory fsync fails *after* the new checkpoint was swapped in raises
    StorageError, and its cleanup then deletes the previous checkpoint (after the exchange
    the temp name holds the old one): the caller sees a failed save, the previous
    checkpoint is gone, the new one sits at the path. docs/format.md / README: "a failed
    save leaves the previous checkpoint intact". Where: checkpoint_folder.publish (the
    ``parent.sync()`` after ``exchange``/``rename``) raising into saving._finish, which calls
    SaveTarget.abort() -> discard(parent, tmp). Same with exchange unavailable: the error
    is raised with the new checkpoint at the path and the old one parked as -old-."""
    path = tmp / "ckpt"
    shardsafe.save({"which": "old", "w": torch.zeros(4)}, path)
    cp = shardsafe.Checkpointer(storage=FaultyBackend(faults=[Fault("sync", errno.EIO, skip=1, times=1)]))
    error = _outcome(lambda: cp.save({"which": "new", "w": torch.ones(4)}, path, overwrite=True))
    cp.close()
    held = shardsafe.load_full(path)["which"]
    return error.startswith("StorageError") and held != "old", f"save raised {error!r}; the path holds {held!r}"


# ----------------------------------------------------------------------------- 2


def repro_typed_json_tags_escape_in_place_load(tmp: Path) -> Result:
    """Malformed typed-JSON tags in the tree (``{"$tuple": 5}``, ``{"$dict": [[1]]}``,
    ``{"$dict": [[[1], "a"]]}``) make ``shardsafe.load`` (in place) raise TypeError /
    ValueError, not a CheckpointError (on a process group every rank raises a plain
    CheckpointError wrapping it), while ``load_full`` refuses the same manifests with
    CorruptCheckpointError. ``{"$dict": [[1, "a"], [1, "b"]]}`` (a duplicate key) loads in
    place as a MissingKeysError. Where: state/match.py walks the saved tree without the
    validation format/values.decode does. Consequence: CheckpointManager.load does not
    skip such a checkpoint (it skips only Corrupt/NotFound/FormatVersion errors)."""
    found = []
    for i, (value, dest) in enumerate([({"$tuple": 5}, (1, 2)), ({"$dict": [[1]]}, {1: "a"}),
                                       ({"$dict": [[[1], "a"]]}, {1: "a"}),
                                       ({"$dict": [[1, "a"], [1, "b"]]}, {1: "a"})]):
        path = tmp / f"c{i}"
        shardsafe.save({"v": dest, "w": torch.zeros(2)}, path)
        body = _body(path)
        body["tree"]["v"] = value
        _seal(path, body)
        in_place = _outcome(lambda p=path, d=dest: shardsafe.load({"v": d, "w": torch.zeros(2)}, p))
        full = _outcome(lambda p=path: shardsafe.load_full(p))
        found.append(f"{json.dumps(value)}: load -> {in_place}; load_full -> {full}")
    bad = [f for f in found if "load -> CorruptCheckpointError" not in f]
    return bool(bad), "\n".join(found)


# ----------------------------------------------------------------------------- 3


def repro_dangling_references_wrong_class(tmp: Path) -> Result:
    """A tree that references a tensor the manifest does not describe (``{"$tensor":
    "nope"}``) or a missing rank-local key (``{"$rank_local": "nope"}``) is an inconsistent
    (corrupt) manifest, but load and load_full raise MissingKeysError ("the destination asks
    for keys the checkpoint does not hold"); ``{"$tensor": 5}`` gives UnexpectedKeysError in
    place. CheckpointManager.load then raises instead of skipping to the previous step."""
    found = []
    for i, value in enumerate([{"$tensor": "nope"}, {"$rank_local": "nope"}, {"$tensor": 5}]):
        path = tmp / "steps" / f"step-0000000{i + 2}"
        shardsafe.save({"w": torch.zeros(2), "step": 1}, tmp / "steps" / "step-00000001", overwrite=True)
        shardsafe.save({"w": torch.zeros(2), "step": i + 2}, path)
        body = _body(path)
        body["tree"]["w"] = value
        _seal(path, body)
        in_place = _outcome(lambda p=path: shardsafe.load({"w": torch.zeros(2)}, p))
        full = _outcome(lambda p=path: shardsafe.load_full(p))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mgr = shardsafe.CheckpointManager(tmp / "steps")
            resumed = _outcome(lambda m=mgr: m.load({"w": torch.zeros(2), "step": 0}))
            mgr.close()
        shardsafe.delete(path)
        found.append(f"{json.dumps(value)}: load -> {in_place}; load_full -> {full}; manager.load -> {resumed}")
    bad = [f for f in found if "CorruptCheckpointError" not in f.split(";")[0] or "manager.load -> no error" not in f]
    return bool(bad), "\n".join(found)


# ----------------------------------------------------------------------------- 4


def repro_unknown_dtype_name_wrong_class(tmp: Path) -> Result:
    """A tensor entry with a dtype name outside format.md's list ("float128", "object", "",
    "torch.float32") passes read_manifest; load_full raises a plain CheckpointError
    ("not supported by this torch") and load raises DtypeMismatchError with the hint "pass
    cast_dtype=True to convert", instead of CorruptCheckpointError."""
    found = []
    for i, name in enumerate(["float128", "object", "", "torch.float32"]):
        path = tmp / f"c{i}"
        shardsafe.save({"w": torch.zeros(2)}, path)
        body = _body(path)
        body["tensors"]["w"]["dtype"] = name
        _seal(path, body)
        found.append(f"{name!r}: read_manifest -> {_outcome(lambda p=path: shardsafe.read_manifest(p))}; "
                     f"load_full -> {_outcome(lambda p=path: shardsafe.load_full(p))}; "
                     f"load -> {_outcome(lambda p=path: shardsafe.load({'w': torch.zeros(2)}, p))}")
    bad = [f for f in found if f.count("CorruptCheckpointError") < 3]
    return bool(bad), "\n".join(found)


# ----------------------------------------------------------------------------- 5


def _two_chunks(path: Path) -> None:
    """Rewrite a saved 8-element float32 tensor ``w`` as two chunks of 4 (as a 2-rank save
    would store it): new safetensors header, chunk table with two rows and digests."""
    data = (path / DATA).read_bytes()
    body = _body(path)
    f = body["files"][0]
    old_hb = f["header_bytes"]
    payload = data[old_hb:]
    header = json.dumps({"__metadata__": {"format": "pt", "producer": "shardsafe"},
                         "w@0": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                         "w@4": {"dtype": "F32", "shape": [4], "data_offsets": [16, 32]}},
                        separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    head = struct.pack("<Q", len(header)) + header
    (path / DATA).write_bytes(head + payload)
    hb = len(head)
    f.update(bytes=hb + len(payload), header_bytes=hb, header_x=checksum(head))
    body["tensors"]["w"]["chunks"] = [0, 2]
    body["chunks"] = {"o": [0, 4], "n": [4, 4], "f": [0, 0], "b": [hb, hb + 16, hb + 16, hb + 32],
                      "x": checksum(payload[:16]) + checksum(payload[16:32])}
    _seal(path, body)


def repro_verify_misses_overlapping_chunks(tmp: Path) -> Result:
    """verify_checkpoint reports OK for a tensor whose chunk boxes overlap (and so leave
    elements uncovered) while every load refuses it ("saved chunks overlap"): tools/verify.py
    _geometry checks coverage by counting elements only. The campaign hits it with the
    4-rank FSDP2 checkpoint (one chunk offset moved by a row, the manifest re-sealed)."""
    from shardsafe.tools import verify_checkpoint

    path = tmp / "ckpt"
    shardsafe.save({"w": torch.arange(8, dtype=torch.float32)}, path)
    _two_chunks(path)
    valid = torch.equal(shardsafe.load_full(path)["w"], torch.arange(8, dtype=torch.float32))
    body = _body(path)
    body["chunks"]["o"] = [0, 3]  # chunk 2 claims elements 3..6; element 7 is covered by nothing
    _seal(path, body)
    report = verify_checkpoint(path)
    load = _outcome(lambda: shardsafe.load_full(path))
    return valid and report.ok and "CorruptCheckpointError" in load, \
        f"two-chunk copy loads: {valid}; after the overlap: verify ok={report.ok}, load_full -> {load}"


# ----------------------------------------------------------------------------- 6


def repro_socket_in_place_of_a_file(tmp: Path) -> Result:
    """A unix socket in place of a data file (or the manifest) raises StorageError
    ("No such device or address", ENXIO from open) instead of the CorruptCheckpointError
    "not a regular file" that FIFOs, folders, devices and symlinks get (storage/local.py
    open_read maps every OSError but ELOOP to StorageError before it can look at the
    type). CheckpointManager.load does not skip such a checkpoint."""
    path = tmp / "ckpt"
    shardsafe.save({"w": torch.zeros(2)}, path)
    (path / DATA).unlink()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(path / DATA))
    finally:
        s.close()
    got = _outcome(lambda: shardsafe.load_full(path))
    return not got.startswith("CorruptCheckpointError"), f"load_full -> {got}"


# ----------------------------------------------------------------------------- 7


def repro_number_literal_overflows_to_inf(tmp: Path) -> Result:
    """A number literal too large for a double (``1e400``) in the tree loads as inf
    (``-1e400``: -inf). format.md: non-finite floats are written only as ``{"$float":
    ...}`` tags, and ``created`` refuses 1e999; tree values accept it silently."""
    path = tmp / "ckpt"
    shardsafe.save(_state(), path)
    text = json.dumps(_body(path), separators=(",", ":")).replace('"lr":0.5', '"lr":1e400')
    _seal(path, text)
    got = _outcome(lambda: shardsafe.load_full(path))
    value = shardsafe.load_full(path)["lr"] if got == "no error" else None
    return got == "no error", f"load_full -> {got}; lr = {value!r}"


# ----------------------------------------------------------------------------- 8


def repro_racing_saves_fail_spuriously(tmp: Path) -> Result:
    """Two overwrite saves to one path: a save's fresh temp folder is unlocked between its
    creation (``open_folder(tmp, create=True)``) and ``lock(tmp)`` in
    checkpoint_folder.begin_save, so a concurrent save's clean_leftovers deletes it and the
    first save fails (StorageError "cannot lock ...: not a folder", or
    CheckpointNotFoundError "no folder at .<name>.shardsafe-tmp-..." from a save). Made
    deterministic here: the second save runs inside the first one's ``lock`` call. The
    campaign saw it with two saver threads (1 of ~70 saves)."""
    path = tmp / "ckpt"
    shardsafe.save({"n": 0}, path)
    fired: list[str] = []

    def on_op(op: str, name: str) -> None:
        if op == "lock" and not fired:
            fired.append(name)
            shardsafe.save({"n": 2}, path, overwrite=True)  # the other saver, at the worst moment

    cp = shardsafe.Checkpointer(storage=FaultyBackend(on_op=on_op))
    got = _outcome(lambda: cp.save({"n": 1}, path, overwrite=True))
    cp.close()
    return got != "no error", f"first save -> {got}; path holds n={shardsafe.load_full(path)['n']}"


# ----------------------------------------------------------------------------- 9


def repro_transient_error_misreported_as_foreign_folder(tmp: Path) -> Result:
    """An overwrite save whose first ``open_folder`` of the existing checkpoint fails (EIO,
    once) is refused with a plain CheckpointError "the folder is not empty and holds no
    shardsafe checkpoint": checkpoint_folder.is_committed swallows the StorageError and
    check_target concludes the checkpoint is a foreign folder. Expected: StorageError (EIO)."""
    path = tmp / "ckpt"
    shardsafe.save({"n": 0}, path)
    cp = shardsafe.Checkpointer(storage=FaultyBackend(faults=[Fault("open_folder", errno.EIO, name="ckpt",
                                                                    times=1)]))
    got = _outcome(lambda: cp.save({"n": 1}, path, overwrite=True))
    cp.close()
    return not got.startswith("StorageError"), f"save -> {got}"


REPROS: dict[str, Callable[[Path], Result]] = {
    name.removeprefix("repro_"): fn for name, fn in sorted(globals().items()) if name.startswith("repro_")}


def main(argv: list[str]) -> int:
    names = argv or list(REPROS)
    present = 0
    for name in names:
        with tempfile.TemporaryDirectory(prefix="shardsafe-repro-") as tmp:
            reproduced, evidence = REPROS[name](Path(tmp))
        present += reproduced
        print(f"{'REPRODUCED' if reproduced else 'fixed     '} {name}\n    " + evidence.replace("\n", "\n    "))
    return 1 if present else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
