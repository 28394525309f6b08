"""Redundancy beyond live replicas, in every worker: peer-memory snapshots
(`snapshot_store`, `snapshot_exchange`, `snapshot_cadence`, `device_stager`,
`rollback`), resild's disk checkpoints (`disk_checkpoint`, `checkpoint_cadence`,
`checkpoint_faults`) and replicas' fingerprints (`fingerprint`). Each registers
with the commit protocol as an after-commit hook (`hooks`); `coordinator` builds
them from the job's settings and runs their recovery-time duties.
"""
