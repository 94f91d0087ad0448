"""Files on disk that a run must never corrupt or lose: whole-file writes, claimed outputs, checkpoints,
lineages, run directories.

No MPI here: the callers decide which rank writes.
"""
