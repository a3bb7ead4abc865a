"""The protocols, phase by phase, over plain data: ``save`` (describe -> plan -> stage ->
write -> commit), ``load`` (open -> manifest -> match -> fetch indexes -> plan -> verify ->
land -> apply; ``metadata`` holds the open, manifest and fetch-indexes phases every reader
shares, ``reader`` the CheckpointReader of the tools) and ``incremental`` (references to
an earlier checkpoint's chunks). The Checkpointer owns the resources these phases use and
hands them over."""
