"""What every resild process shares on the wire: versioned messages (`protocol`),
ZeroMQ channels with CURVE keys (`channel`, `keys`), the node-local socket, the
controller-backed store, settings and environment variables with one owner each.
Imports nothing of ours but the event schema's names (contract in pyproject.toml).
"""
