"""The on-disk contract (see docs/format.md)."""
