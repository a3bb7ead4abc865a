"""Where checkpoint bytes live: the local filesystem for now."""
