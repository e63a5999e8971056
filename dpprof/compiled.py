"""torch.compile around dpprof's models: dynamo runs dpprof's own code as it is, as it runs torch's own.

Compiling a dpprof.DataParallel (or the stand-in ``dpprof run`` gives a script) would otherwise trace into the
recording (the probe, the run's writer, the CPU workers' queues), guard on their ever-changing state and compile
again on most steps: under ``dpprof run``, steps of a compiled MLP took 38 to 300 ms against 0.2 to 0.9 ms without.
dpprof's files are added to the directories dynamo skips (its frames run eagerly, and the user's modules they call
are compiled as their own frames), once ``torch._dynamo`` is imported: importing it costs about a second, which a
script that never compiles does not pay.
"""
from __future__ import annotations

import sys

from dpprof.imports import when_imported

__all__ = ["skip_in_torch_compile", "DYNAMO"]

DYNAMO = "torch._dynamo"


def _skip_dpprof() -> None:
    """Add dpprof's directory to what dynamo skips (torch._dynamo.trace_rules.add: a torch without it skips nothing
    more, and dpprof's code is traced as before)."""
    rules = getattr(sys.modules.get(DYNAMO), "trace_rules", None)
    add = getattr(rules, "add", None)
    if add is None:
        return
    try:
        add("dpprof")
    except Exception:  # noqa: BLE001 - a torch whose rules changed shape: dpprof is traced, as before
        pass


def skip_in_torch_compile() -> None:
    """Have torch.compile skip dpprof's own code from when torch._dynamo is imported (now, if it is)."""
    when_imported(DYNAMO, _skip_dpprof)
