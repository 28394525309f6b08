"""The library inside the training process (`launcher.init`, the `Job` facade in `runtime`).

Top level: the step's commit protocol (`commit`, `step_state`), the training state
(`train_state`, `ddp`, `data`), the recovery sequence and its loop (`recovery`,
`recovery_driver`, `replica_map`, `mesh_layout`) over failure-tolerant groups
(`stable_group`, `torch_private`), shrink and grow (`resize`).
Sub-packages by role: `links` (to the controller, the daemon, the node relay, the
store), `transport` (moving state between ranks), `redundancy` (what protects state
beyond replicas, as after-commit hooks), `sources` (where a lost rank's state is
restored from), `spare` (a waiting spare's warm-up). Imports only `resild.wire`,
`resild.membership` and `resild.events.schema` of the rest of resild.
"""
