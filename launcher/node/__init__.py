"""The node process (`python -m launcher.node`): one per node of a job, started by
`resil-run` (locally) or by its `srun` step (Slurm).

Owns its node's workers: starts them, watches their liveness and progress, relays
their reports to the controller, follows the node daemon's health, holds the lease.
Never imports the worker library or `resil-run` (contract).
"""
