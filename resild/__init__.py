"""resild: the node daemon, the controller and the tools around them.

No training process imports this package except `resild.wire`, `resild.membership`
and `resild.events.schema` (the worker's allow-list in pyproject.toml). Sub-packages
by process: `daemon` (the systemd node daemon), `controller` (the job's controller,
inside `resil-run` or a standby), `health` (probes the daemon and the node process
run), `wire` (messages, keys, sockets shared by every process), `events` (the event
schema and log), `report` (`resild report`, offline).
"""
