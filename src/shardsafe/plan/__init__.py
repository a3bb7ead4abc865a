"""Who writes what, and who reads what: plans as plain data."""
