"""The training process's links (runs in every worker): to the controller
(`controller`, one background thread owns the sockets), to the node daemon
(`agent`), to the node-local relay (`relay`), and the controller-backed c10d store
(`store`).
"""
