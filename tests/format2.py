"""Format 2.x checkpoints must keep loading, and many corruption tests edit the 2.x chunk
table directly: they save, then rewrite the checkpoint as format 2.0."""

from shardsafe.tools.format2 import write_format2 as as_format2

__all__ = ["as_format2"]
