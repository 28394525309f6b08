"""The job's controller: runs inside `resil-run` (or a standby controller process, and
`python -m resild.controller.etcd_cluster` for the etcd members).

Owns the job's membership: which nodes are active, spare, fenced; decides a node failed,
assigns a spare, admits joining nodes, journals every decision (Raft or etcd) so a new
leader resumes it. Policies are pure modules (policy, admission, refill, readmission,
budget, verdict_file); `loop`/`handlers` are the I/O edge.
"""
