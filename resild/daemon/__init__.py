"""The resild node daemon (systemd `resild-agent.service`, `resild agent`), one per node.

Owns the node's health view: runs the `resild.health` probes, serves `resild status`
and the training processes' subscriptions over a local socket, exports metrics.
Never imports the controller (independent by contract).
"""
