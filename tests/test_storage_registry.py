"""The scheme registry: a backend for a new URL scheme, given by the caller, registered at
run time or declared by an installed package's entry point (group ``shardsafe.storage``),
saves and loads like the built-in ones; an unknown scheme is still refused clearly."""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch

import shardsafe
from bitwise import assert_bitwise
from shardsafe.storage import registry
from shardsafe.storage.base import Backend, Folder
from shardsafe.storage.urls import local_backend


class DiskBackend(Backend):
    """``<scheme>://bucket/key`` kept under a local folder: a stand-in for a third-party backend."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.inner = local_backend()

    def open(self, location: str, create: bool = False) -> Folder:
        return self.inner.open(os.path.join(self.root, location.split("://", 1)[1]), create)


def state() -> dict:
    return {"w": torch.arange(12.0).reshape(3, 4), "n": {"b": torch.ones(5, dtype=torch.bfloat16)}, "step": 7}


def test_caller_backend_for_any_scheme(tmp_path):
    """``storage={'gs': backend}``: gs:// URLs go to it (the registry has no gs)."""
    cp = shardsafe.Checkpointer(storage={"gs": DiskBackend(str(tmp_path))})
    try:
        cp.save(state(), "gs://bucket/run/ck")
        assert (tmp_path / "bucket" / "run" / "ck" / "manifest.json").is_file()
        assert_bitwise(state(), cp.load_full("gs://bucket/run/ck"))
        with pytest.raises(shardsafe.CheckpointExistsError):
            cp.save(state(), "gs://bucket/run/ck")
    finally:
        cp.close()


def test_registered_scheme(tmp_path):
    """A scheme registered at run time serves module-level saves and loads."""
    registry.register("tstmem", lambda options: DiskBackend(str(tmp_path)))
    try:
        shardsafe.save(state(), "tstmem://b/ck")
        assert_bitwise(state(), shardsafe.load_full("tstmem://b/ck"))
        with pytest.raises(ValueError, match="already registered"):
            registry.register("tstmem", lambda options: DiskBackend(str(tmp_path)))
    finally:
        registry.unregister("tstmem")


def test_entry_point_scheme(tmp_path, monkeypatch):
    """An installed package's entry point in group shardsafe.storage adds its scheme."""
    site = tmp_path / "site"
    (site / "tst_epstore-0.1.dist-info").mkdir(parents=True)
    (site / "tst_epstore-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: tst-epstore\n"
                                                                 "Version: 0.1\n")
    (site / "tst_epstore-0.1.dist-info" / "entry_points.txt").write_text(
        "[shardsafe.storage]\ntstep = tst_epstore:make\n")
    (site / "tst_epstore.py").write_text(textwrap.dedent(f"""
        import os
        from shardsafe.storage.base import Backend
        from shardsafe.storage.urls import local_backend

        class EP(Backend):
            def __init__(self, options):
                self.options, self.inner = options, local_backend()
            def open(self, location, create=False):
                return self.inner.open(os.path.join({str(tmp_path / 'data')!r}, location.split('://', 1)[1]), create)

        def make(options):
            return EP(options)
        """))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(registry, "_LOADED", [])
    try:
        assert "tstep" in registry.names()
        shardsafe.save(state(), "tstep://b/ck")
        assert (tmp_path / "data" / "b" / "ck" / "manifest.json").is_file()
        assert_bitwise(state(), shardsafe.load_full("tstep://b/ck"))
    finally:
        registry.unregister("tstep")
        sys.modules.pop("tst_epstore", None)


def test_unknown_scheme_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(shardsafe.CheckpointError, match="unsupported URL scheme 'zz'"):
        shardsafe.save(state(), "zz://bucket/x")
    assert list(tmp_path.iterdir()) == []
