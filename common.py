"""Shared plumbing for every model: errors, RMSNorm, RoPE, the LM wrapper, width solving.

Each architecture file (tango.py, baselines.py, ...) defines only its residual *body*;
the token embedding, tied head, loss, cached generation and parameter counting live here
(SPEC.md section 1).
"""

class UsageError(ValueError):
    """Bad user input (a flag, a file, a checkpoint). train.py prints str(e) on one line and exits 2."""
