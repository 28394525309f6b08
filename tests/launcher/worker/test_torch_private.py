"""A canary for torch upgrades: the private torch APIs that launcher/worker/torch_private.py
wraps still exist in the installed torch. A failure names what to re-check there."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from launcher.worker import torch_private as tp

pytestmark = pytest.mark.timeout(60)


def test_c10d_internals_resild_relies_on_exist() -> None:
    from torch._C._distributed_c10d import _register_process_group
    from torch.distributed.distributed_c10d import _world

    assert callable(_register_process_group)
    for table in ("pg_map", "pg_names", "pg_group_ranks", "pg_backend_config"):
        assert isinstance(getattr(_world, table), dict), table
    assert tp.PyWork is dist.Work
    gopts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    gopts._timeout = timedelta(seconds=1)
    gopts._devices = [dist.ProcessGroupGloo.create_default_device()]
    for name in ("_set_default_backend", "_register_backend"):
        assert hasattr(dist.ProcessGroup, name), name


def test_a_one_rank_backend_group_runs_a_collective_through_the_python_group() -> None:
    from launcher.worker.stable_group import Interrupts, StableGroup

    store = tp.PrefixStore("t/", tp.hash_store())
    g = StableGroup("canary", [0], 0, Interrupts())
    g.allow = True
    g.set_backend(tp.backend_group("gloo", store, 0, 1, timedelta(seconds=10), None))
    t = torch.ones(3)
    g.allreduce([t]).wait()  # the Python method, as c10d and the trampoline call it
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_ddp_and_grad_scaler_internals_exist() -> None:
    ddp = torch.nn.parallel.DistributedDataParallel
    for name in ("_get_ddp_logging_data", "_build_params_for_reducer", "_build_debug_param_to_name_mapping"):
        assert hasattr(ddp, name), name
    assert hasattr(ddp, "_ddp_init_helper")
    assert callable(dist._compute_bucket_assignment_by_size)  # type: ignore[attr-defined]
    assert hasattr(dist.Reducer, "_set_static_graph") and hasattr(dist.Logger, "_set_static_graph")
    from torch.amp.grad_scaler import OptState, _refresh_per_optimizer_state

    rec = _refresh_per_optimizer_state()
    assert rec["stage"] is OptState.READY and "found_inf_per_device" in rec
