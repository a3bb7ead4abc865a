"""The protocols, phase by phase, over plain data: ``save`` (describe -> plan -> stage ->
write -> commit), ``load`` (open -> manifest -> match -> plan -> verify -> land -> apply)
and ``incremental`` (references to an earlier checkpoint's chunks). The Checkpointer owns
the resources these phases use and wires them to the engine."""
