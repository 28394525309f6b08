"""The embedded local cluster's node environment (launcher/run/local.py, node_env)."""

from __future__ import annotations

import resild.wire.env as resild_env
from launcher.run.local import node_env


def test_a_local_node_binds_gloo_to_loopback_and_inherits_no_key_directory() -> None:
    env = node_env({"PATH": "/bin", resild_env.KEYS.name: "/elsewhere/keys"})
    assert env == {"PATH": "/bin", resild_env.GLOO_HOST.name: "127.0.0.1"}


def test_an_address_the_job_chose_for_gloo_is_kept() -> None:
    assert node_env({resild_env.GLOO_HOST.name: "10.0.0.7"})[resild_env.GLOO_HOST.name] == "10.0.0.7"
