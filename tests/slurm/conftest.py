from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.slurmlab.fixture import SlurmLab, slurm_cluster

LAB_NODES = 4


@pytest.fixture(scope="session")
def slurm_lab() -> Iterator[SlurmLab]:
    """A real 4-node Slurm 22.05 cluster on this machine, shared by the session."""
    with slurm_cluster(LAB_NODES) as lab:
        yield lab
