"""The ``shardsafe`` command: ls, inspect, verify, diff, export, import (also
``python -m shardsafe``).

Exit codes: 0 ok; 1 ``verify`` (or ``inspect``: a data file missing or resized) found
damage or ``diff`` found differences; 2 a usage
error or a checkpoint that cannot be used (printed as one ``shardsafe: error: ...`` line;
with ``--json`` also as ``{"ok": false, "error": ...}`` on stdout); 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from .. import __version__
from ..errors import CheckpointError

EXIT_OK, EXIT_FOUND, EXIT_ERROR = 0, 1, 2

_EPILOG = "exit codes: 0 ok, 1 verify/inspect/diff found problems or differences, 2 usage or checkpoint error"


_KEYS_HELP = ("{} only keys equal to or under the dotted PREFIX; one PREFIX per flag (repeat it: --keys a --keys b; "
              "a comma is part of the key); a PREFIX that selects nothing is an error naming the closest keys")


def _parser() -> argparse.ArgumentParser:
    """The command line: common options, then one sub-parser per command."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON object on stdout (for scripts)")
    common.add_argument("--no-progress", action="store_true", help="never draw the progress line on stderr")
    p = argparse.ArgumentParser(
        prog="shardsafe", description="Inspect, check, compare and convert shardsafe checkpoints.", epilog=_EPILOG)
    p.add_argument("--version", action="version", version=f"shardsafe {__version__}",
                   help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (_add_ls, _add_inspect, _add_verify, _add_diff, _add_export, _add_import, _add_copy):
        add(sub, common)
    return p


def _add_ls(sub: Any, common: argparse.ArgumentParser) -> None:
    """The ``ls`` command's arguments."""
    s = sub.add_parser("ls", parents=[common], help="list the step checkpoints of a folder",
                       description="List the step-<N> checkpoints of a manager folder with step, size, save time, "
                                   "world size and status: valid, invalid (torn or damaged; cheap check of the "
                                   "manifest and file sizes, no data hashing), ambiguous (two folders of one step, "
                                   "step-100 and step-00000100), incomplete (a save's temporary folder), parked, "
                                   "deleting or retired. Any zero padding of N counts.", epilog=_EPILOG)
    s.add_argument("folder", help="a folder of step-<N> checkpoints (or one checkpoint)")


def _add_inspect(sub: Any, common: argparse.ArgumentParser) -> None:
    """The ``inspect`` command's arguments."""
    s = sub.add_parser("inspect", parents=[common], help="show the key tree, or the shard layout of one tensor",
                       description="Show every key with kind (sharded / replicated / rank_local), dtype, global "
                                   "shape, bytes and number of chunks; plain values briefly. With --layout KEY: "
                                   "which saving rank holds which box of that tensor. Also checks that every data "
                                   "file is there with its recorded size (exit 1 if not; `verify` hashes the "
                                   "bytes).", epilog=_EPILOG)
    s.add_argument("checkpoint", help="the checkpoint folder")
    s.add_argument("--layout", metavar="KEY", help="draw the shard layout of tensor KEY as a character grid")
    s.add_argument("--png", metavar="FILE", help="with --layout: also draw it into the PNG FILE")
    s.add_argument("--width", type=int, default=64, help="grid width in characters (default 64)")
    s.add_argument("--height", type=int, default=16, help="grid height in lines (default 16)")


def _add_verify(sub: Any, common: argparse.ArgumentParser) -> None:
    """The ``verify`` command's arguments."""
    s = sub.add_parser("verify", parents=[common], help="check every byte against its checksum",
                       description="Recompute every block checksum of every chunk and every data file header, "
                                   "in parallel; report missing and truncated files and each bad chunk (file, "
                                   "tensor key, byte range). Exit 0 when all match, 1 otherwise.", epilog=_EPILOG)
    s.add_argument("checkpoint", help="the checkpoint folder")
    s.add_argument("--threads", type=int, default=None, help="hashing threads (default: min(8, CPUs))")


def _add_diff(sub: Any, common: argparse.ArgumentParser) -> None:
    """The ``diff`` command's arguments."""
    s = sub.add_parser("diff", parents=[common], help="compare two checkpoints key by key",
                       description="Keys added and removed, dtype and shape changes, and values that differ "
                                   "beyond |a-b| <= atol + rtol*|b| (max abs diff per tensor); plain values too. "
                                   "Reads one tensor of each at a time. Exit 0 when equal, 1 otherwise.",
                       epilog=_EPILOG)
    s.add_argument("a", help="the first checkpoint folder")
    s.add_argument("b", help="the second checkpoint folder (the reference for --rtol)")
    s.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default 0: exact)")
    s.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: exact)")
    s.add_argument("--keys", action="append", metavar="PREFIX", help=_KEYS_HELP.format("compare"))
    s.add_argument("--no-verify", action="store_true", help="do not verify checksums while reading")


def _add_export(sub: Any, common: argparse.ArgumentParser) -> None:
    """The ``export`` command's arguments."""
    s = sub.add_parser("export", parents=[common], help="write torch.save, safetensors, Hugging Face or DCP files",
                       description="Export tensors one at a time (memory: about the largest tensor). torch: one "
                                   "torch.save file of the nested state, tensors and plain values, loadable with "
                                   "torch.load(weights_only=True). safetensors: one file, flat dotted keys. hf: a "
                                   "folder transformers' from_pretrained loads: model-0000i-of-0000n.safetensors "
                                   "shards, model.safetensors.index.json, config.json, generation_config.json, "
                                   "tied weights once. dcp: a torch.distributed.checkpoint folder written by DCP. "
                                   "Rank-local values are skipped unless --rank R. A TrainState saved as 'train' "
                                   "has its model under train.model: --to hf --strip train.model.", epilog=_EPILOG)
    s.add_argument("checkpoint", help="the checkpoint folder to export")
    s.add_argument("out", help="output file (torch, safetensors) or folder (hf, dcp)")
    s.add_argument("--to", required=True, choices=list(_EXPORT_FORMATS), help="output format: " + "; ".join(
        f"{k}: {v}" for k, v in _EXPORT_FORMATS.items()))
    s.add_argument("--keys", action="append", metavar="PREFIX", help=_KEYS_HELP.format("export"))
    s.add_argument("--strip", metavar="PREFIX",
                   help="drop PREFIX. from output names and, without --keys, export only what lies under PREFIX "
                        "(torch/dcp: that subtree); an error when it selects nothing")
    s.add_argument("--rename", action="append", metavar="REGEX=REPLACEMENT",
                   help="rename output names after --strip with re.sub (\\1 for groups), rules applied in order "
                        "(repeatable); a rule matching no name is an error. safetensors, hf; torch/dcp with --flat")
    s.add_argument("--config", metavar="PATH",
                   help="hf: config.json, or a Hugging Face folder (its config.json and generation_config.json); "
                        "default: the config saved in the checkpoint under a key named hf_config")
    s.add_argument("--generation-config", metavar="FILE", help="hf: the generation_config.json to write")
    s.add_argument("--config-key", metavar="KEY",
                   help="hf: the checkpoint key holding the config (when several keys are named hf_config)")
    s.add_argument("--dtype", choices=["float16", "bfloat16", "float32", "float64"],
                   help="convert float16/bfloat16/float32/float64 tensors; others are kept")
    s.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="hf: largest shard, like 5GB, 200MB, 512MiB (default 5GB)")
    s.add_argument("--rank", type=int, metavar="R", help="export saving rank R's copy of rank-local values")
    s.add_argument("--flat", action="store_true",
                   help="torch, dcp: a flat dict of dotted keys instead of the nested tree")
    s.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    s.add_argument("--no-verify", action="store_true", help="do not verify checksums while reading")


def _add_import(sub: Any, common: argparse.ArgumentParser) -> None:
    """The ``import`` command's arguments."""
    s = sub.add_parser("import", parents=[common],
                       help="make a shardsafe checkpoint from torch.save, safetensors, Hugging Face or DCP",
                       description="Read a torch.save file (torch.load(weights_only=True)), a .safetensors file, a "
                                   "Hugging Face folder (safetensors shards and index; tied weights it left out are "
                                   "restored from config.json), or a torch.distributed.checkpoint (DCP) folder, and "
                                   "save it as a shardsafe checkpoint.", epilog=_EPILOG)
    s.add_argument("src", help="the file or folder to import (its kind is detected unless --from says it)")
    s.add_argument("out", help="the shardsafe checkpoint folder to create")
    s.add_argument("--from", dest="source", choices=list(_IMPORT_SOURCES), help="what SRC is (default: detected): "
                   + "; ".join(f"{k}: {v}" for k, v in _IMPORT_SOURCES.items()))
    s.add_argument("--trust-pickle", action="store_true",
                   help="DCP only: allow reading its .metadata, which is a pickle. Loading a pickle runs code "
                        "from the file; only do this for checkpoints you trust.")
    s.add_argument("--prefix", metavar="NAME",
                   help="store the imported state under the key NAME (e.g. model); hf: the configs are stored "
                        "beside it as hf_config and hf_generation_config")
    s.add_argument("--overwrite", action="store_true", help="replace OUT if it is a checkpoint")


def _add_copy(sub: Any, common: argparse.ArgumentParser) -> None:
    """The ``copy`` command's arguments."""
    s = sub.add_parser("copy", parents=[common], help="copy a checkpoint between locations (local, s3://)",
                       description="Copy the checkpoint SRC to DST, streaming: every block's checksum is verified "
                                   "before its bytes are written, and DST is committed last, as a save commits "
                                   "(a failed copy leaves no checkpoint at DST). SRC and DST are paths, file:// or "
                                   "s3:// URLs.", epilog=_EPILOG)
    s.add_argument("src", help="the checkpoint to copy (path or URL)")
    s.add_argument("dst", help="where to create the copy (path or URL)")
    s.add_argument("--overwrite", action="store_true", help="replace a checkpoint at DST")
    s.add_argument("--compression", choices=["zstd", "lz4", "off"], default=None,
                   help="write the data files again compressed with this codec, or raw ('off'); default: copy "
                        "them byte for byte")


_EXPORT_FORMATS = {
    "torch": "one torch.save file",
    "safetensors": "one .safetensors file",
    "hf": "a Hugging Face model folder",
    "dcp": "a torch.distributed.checkpoint folder",
}
_IMPORT_SOURCES = {
    "torch": "a torch.save file",
    "safetensors": "a .safetensors file",
    "hf": "a Hugging Face folder",
    "dcp": "a torch.distributed.checkpoint folder (needs --trust-pickle)",
}


def _emit(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print(text)


def _run(args: argparse.Namespace) -> int:
    """Run one parsed command; each imports only what it needs (``ls`` never imports torch)."""
    progress = False if args.no_progress else None
    if args.command == "ls":
        from .listing import format_listing, list_checkpoints

        entries = list_checkpoints(args.folder)
        _emit(args, {"ok": True, "folder": args.folder, "checkpoints": [e.to_json() for e in entries]},
              format_listing(entries, args.folder))
        return EXIT_OK
    if args.command == "inspect":
        if args.png and not args.layout:
            raise _Usage("--png needs --layout KEY")
        from ..api import read_manifest
        from .inspect import checkpoint_file_problems, inspect_checkpoint, problem_lines
        from .picture import layout_boxes, layout_png, layout_text

        root, manifest = args.checkpoint, read_manifest(args.checkpoint)
        if args.layout:
            text = layout_text(manifest, args.layout, args.width, args.height)
            png = str(layout_png(manifest, args.layout, args.png)) if args.png else None
            boxes = [{"rank": b.rank, "offsets": list(b.offsets), "lengths": list(b.lengths), "file": b.file}
                     for b in layout_boxes(manifest, args.layout)]
            problems = checkpoint_file_problems(root, manifest)
            _emit(args, {"ok": not problems, "key": args.layout, "boxes": boxes, "png": png, "text": text,
                         "problems": problems},
                  "\n".join([text, *([f"wrote {png}"] if png else []), *problem_lines(problems)]))
            return EXIT_FOUND if problems else EXIT_OK
        report = inspect_checkpoint(root, manifest)
        _emit(args, {"ok": report.ok, **report.to_json()}, report.to_text())
        return EXIT_OK if report.ok else EXIT_FOUND
    if args.command == "verify":
        from .verify import verify_checkpoint

        vr = verify_checkpoint(args.checkpoint, threads=args.threads, progress=progress)
        _emit(args, vr.to_json(), vr.to_text())
        return EXIT_OK if vr.ok else EXIT_FOUND
    if args.command == "diff":
        from .diff import diff_checkpoints

        dr = diff_checkpoints(args.a, args.b, atol=args.atol, rtol=args.rtol, keys=args.keys,
                              verify=not args.no_verify, progress=progress)
        _emit(args, {"ok": True, **dr.to_json()}, dr.to_text())
        return EXIT_OK if dr.same else EXIT_FOUND
    if args.command == "export":
        from .export import export_checkpoint

        er = export_checkpoint(args.checkpoint, args.out, args.to, keys=args.keys, dtype=args.dtype, rank=args.rank,
                               max_shard_size=args.max_shard_size, strip=args.strip, rename=args.rename,
                               config=args.config, generation_config=args.generation_config,
                               config_key=args.config_key, flat=args.flat, overwrite=args.overwrite,
                               verify=not args.no_verify, progress=progress)
        _emit(args, {"ok": True, **er.to_json()}, er.to_text())
        return EXIT_OK
    if args.command == "import":
        from .import_ import import_checkpoint

        ir = import_checkpoint(args.src, args.out, source=args.source, trust_pickle=args.trust_pickle,
                               prefix=args.prefix, overwrite=args.overwrite, progress=progress)
        _emit(args, {"ok": True, **ir.to_json()}, ir.to_text())
        return EXIT_OK
    if args.command == "copy":
        from .copy import copy_checkpoint

        cr = copy_checkpoint(args.src, args.dst, overwrite=args.overwrite, compression=args.compression)
        _emit(args, {"ok": True, **cr.to_json()}, cr.to_text())
        return EXIT_OK
    raise _Usage(f"unknown command {args.command!r}")  # pragma: no cover - argparse refuses it first


class _Usage(Exception):
    pass


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``shardsafe`` command with ``argv`` (default: the process arguments); returns the exit code."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (argparse printed it)
        return int(exc.code) if isinstance(exc.code, int) else EXIT_ERROR
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("shardsafe: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (| head): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except (CheckpointError, OSError, _Usage) as exc:
        message = _one_line(exc)
        print(f"shardsafe: error: {message}", file=sys.stderr)
        if getattr(args, "json", False):
            print(json.dumps({"ok": False, "error": message, "exit_code": EXIT_ERROR}))
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
