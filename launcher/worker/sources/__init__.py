"""Where a lost rank's state is restored from, behind one interface (runs in every worker).

A recovery's agreement says which step is the newest committed one; each source
either restores every rank to a step or says why it cannot, and the next one is
tried: `replica` (a live replica's memory), `snapshot` (every rank rolls back to a
peer-memory snapshot), `checkpoint` (every rank loads resild's newest disk
checkpoint). `chain` lists them and tries them in order; a source the job's layout
or flags do not enable is left out of the list.
"""
