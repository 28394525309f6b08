"""The job's event schema (`schema`, a leaf every process may import) and the
append-only event log (`log`) that `resil-run` writes and `resild report` reads.
"""
