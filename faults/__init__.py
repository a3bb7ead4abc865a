"""The fault campaign: damaged checkpoints, hostile manifests, SIGKILLed saves, injected
storage failures and concurrent saves and loads, each trial classified (see
:mod:`faults.common`). Run ``python -m faults.campaign --help``; not part of ``make test``
(``tests/test_faults_quick.py`` runs a few trials of each kind)."""
