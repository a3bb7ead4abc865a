"""Runs plans: writes and reads data files with checksums on parallel threads."""
