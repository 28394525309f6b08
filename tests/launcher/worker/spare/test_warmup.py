"""A waiting spare's warm-up (launcher/worker/spare/warmup.py, warmup_recipe.py).

The recipe is validated like any input from the store; the warm-up leaves nothing
behind (no default group, no registered group, the RNG as it was); everything the
script can reach after a warm-up has the structure it has in a cold process (meshes
and their identity over parameters, gradients and optimizer state, groups, placements,
process settings: tests/launcher/structure.py); and the first real step after a
warm-up runs no sharding propagation of its own and ends bitwise where a cold process
ends (real processes: a solo job on a 1 x 1 HSDP, a 1-rank FSDP2 and a 1 x 1 FSDP2 + TP
mesh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from launcher.worker.spare import recipe as wr
from launcher.worker.spare.warmup import SpareWarmup, dim_ranks
from tests.launcher.structure import differences

pytestmark = pytest.mark.timeout(240)  # real processes on 2 loaded cores

SHAPES = [[512, 128], [512], [512, 512], [512], [128, 512], [128]]


def recipe_json(mesh_shape: list[int] | None = None, names: list[str] | None = None, **over: Any) -> str:
    mesh_shape = mesh_shape or [1, 1]
    n = 1
    for s in mesh_shape:
        n *= s
    params = [
        {
            "shape": s,
            "stride": [s[1], 1] if len(s) == 2 else [1],
            "dtype": "float32",
            "placements": [["R", -1], ["S", 0]],
        }
        for s in SHAPES
    ]
    d: dict[str, Any] = {
        "mesh": {
            "ranks": list(range(n)),
            "shape": mesh_shape,
            "names": names or ["replicate", "shard"],
            "device_type": "cpu",
        },
        "optimizer": "AdamW",
        "groups": [
            {
                "hp": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01, "foreach": None},
                "params": list(range(len(SHAPES))),
            }
        ],
        "params": params,
    }
    d.update(over)
    return json.dumps(d)


# ---- the recipe ---------------------------------------------------------------------------
def test_a_recipe_parses_into_layouts() -> None:
    r = wr.parse(recipe_json([2, 2]))
    assert r.mesh_shape == (2, 2) and r.world_size == 4 and r.mesh_names == ("replicate", "shard")
    assert r.optimizer == "AdamW" and r.groups[0][0]["betas"] == (0.9, 0.999)
    assert r.params[0].placements == (("R", -1, 1), ("S", 0, 1))
    assert r.params[0].local_shape(r.mesh_shape) == (256, 128)
    assert wr.ParamSpec((5, 3), (3, 1), "float32", (("S", 0, 1),)).local_shape((2,)) == (3, 3)  # torch.chunk's first


@pytest.mark.parametrize(
    "bad",
    [
        "not json",
        json.dumps({"mesh": {}}),
        recipe_json(params=[{"shape": [4], "stride": [1], "dtype": "float32", "placements": [["P", 0], ["R", -1]]}]),
        recipe_json(params=[{"shape": [4], "stride": [1], "dtype": "os.system", "placements": [["R", -1]] * 2}]),
        recipe_json(params=[{"shape": [4], "stride": [1], "dtype": "float32", "placements": [["S", 3], ["R", -1]]}]),
        recipe_json(groups=[{"hp": {}, "params": [99]}]),
        json.dumps({**json.loads(recipe_json()), "mesh": {"ranks": [0, 0], "shape": [2], "names": ["s"]}}),
    ],
)
def test_a_bad_recipe_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        wr.parse(bad)


def test_only_optimizers_of_torch_optim_are_built() -> None:
    from launcher.worker.spare.warmup import _optimizer_class

    assert _optimizer_class("AdamW") is torch.optim.AdamW
    for name in ("Optimizer", "lr_scheduler", "nonexistent", "__class__"):
        with pytest.raises(ValueError):
            _optimizer_class(name)


def test_dim_ranks_are_rank_0s_groups() -> None:
    r = wr.parse(recipe_json([2, 3]))
    assert dim_ranks(r, 0) == [0, 3] and dim_ranks(r, 1) == [0, 1, 2]


def spare_holding(text: str | None) -> SpareWarmup:
    w = SpareWarmup(store=None, device=torch.device("cpu"))
    w._text = text.encode() if text is not None else None  # as its fetch thread leaves it
    return w


def test_a_spare_holding_the_recipe_knows_the_jobs_mesh_groups_before_the_user_asks() -> None:
    # runtime._recipe_groups forms these with the world group: the labels must be the ones
    # job.mesh() gives the same mesh on the survivors, or the spare would wait for no one.
    from launcher.worker.mesh_layout import MeshLayout

    layout = spare_holding(recipe_json([2, 4])).layout(8)
    assert layout == MeshLayout.build(8, (2, 4), ("replicate", "shard"))
    assert [layout.group(d, 5) for d in (0, 1)] == [("resild-replicate-1", [1, 5]), ("resild-shard-1", [4, 5, 6, 7])]


@pytest.mark.parametrize(
    "text,world",
    [
        (None, 4),  # no recipe (yet): the groups are formed when job.mesh() asks
        (recipe_json([2, 2]), 8),  # another world size: not this job's mesh
        ("not json", 4),
        (
            json.dumps(
                {
                    **json.loads(recipe_json([2, 2])),
                    "mesh": {**json.loads(recipe_json([2, 2]))["mesh"], "ranks": [1, 0, 2, 3]},
                }
            ),
            4,
        ),
    ],
)
def test_a_spare_forms_nothing_early_from_no_recipe_a_bad_one_or_another_mesh(text: str | None, world: int) -> None:
    assert spare_holding(text).layout(world) is None


# ---- the warm-up, in a process of its own (it sets and destroys a default group) -----------
CHILD = r"""
import json, sys, time
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor._sharding_prop import ShardingPropagator
import launcher
from launcher.worker.spare.warmup import SpareWarmup

torch.set_num_threads(1)
mode, recipe_path, out_path, kind = sys.argv[1:5]
out = {}
w = None
if mode != "cold":
    w = SpareWarmup(None, torch.device("cpu"))
    w._text = open(recipe_path).read()
    rng = torch.get_rng_state()
    if mode == "prepare-fails":  # the script's launcher.init(prepare=...) raises after drawing random numbers
        def prepare(mesh):
            out["prepare_mesh"] = [list(mesh.mesh.shape), list(mesh.mesh_dim_names)]
            torch.randn(3)
            torch.set_default_dtype(torch.float64)
            raise ValueError("no such layer")
        w.prepare = prepare
    w.run(lambda: mode == "cancelled")
    out["prepare_error"] = w.prepare_error
    out["default_dtype"] = str(torch.get_default_dtype())
    out["error"] = w.error
    out["rng_kept"] = bool(torch.equal(rng, torch.get_rng_state()))
    out["initialized_after"] = dist.is_initialized()
    from torch.distributed.distributed_c10d import _world
    out["groups_left"] = len(_world.pg_names)
    host = torch.device("cpu")
    kept = [w.landing.take(torch.float32, s, host) for s in ((512, 128), (512, 512), (128, 512)) for _ in (0, 1)]
    out["landing"] = [None if t is None else [list(t.shape), bool(t.eq(0).all())] for t in kept]
    out["landing_left"] = len(w.landing)
job = launcher.init()  # solo: installs its own default group (refused if the warm-up left one)
job._warmup = w
if kind.startswith("tp"):  # examples/train_fsdp_tp.py's model: FSDP2 on "shard", tensor parallel on "tp"
    sys.path.insert(0, "examples")
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from train_fsdp_tp import Model, clip_grad_norm
    mesh = job.mesh((-1, 1), ("shard", "tp"))
    model = Model(0, 0.0)
    for b in model.blocks:
        parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()}, src_data_rank=None)
        fully_shard(b, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    clip = lambda: clip_grad_norm(list(model.parameters()), 1.0)
    if kind == "tp-id":  # the same, clipping per mesh object as a script may (id(), not equality)
        def clip():
            by = {}
            for p in model.parameters():
                by.setdefault(id(p.grad.device_mesh), []).append(p.grad)
            out["clip_groups"] = len(by)
            for grads in by.values():
                torch.nn.utils.clip_grads_with_norm_(grads, 1.0, torch.nn.utils.get_total_norm(grads))
elif kind == "fsdp":  # plain FSDP2 on a 1-D mesh
    mesh = job.mesh((-1,), ("shard",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
else:
    mesh = job.hsdp_mesh(shard_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 512),
                                torch.nn.GELU(), torch.nn.Linear(512, 128))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    clip = lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
out["groups"] = list(mesh._dim_group_names)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
from launcher.worker.spare.recipe import describe
out["recipe"] = describe(opt, mesh)
job.attach(model, opt)
misses = []
orig = ShardingPropagator.propagate_op_sharding_non_cached
def counting(self, op_schema):
    misses.append(str(op_schema.op))
    return orig(self, op_schema)
ShardingPropagator.propagate_op_sharding_non_cached = counting
g = torch.Generator().manual_seed(1)
x, y = torch.randn(16, 128, generator=g), torch.randn(16, 128, generator=g)
for step in job.steps(3):
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    clip()
    if step == 0:
        misses.clear()  # forward/backward run on local tensors; clipping and the step on DTensors
        t0 = time.monotonic()
    job.commit()
    if step == 0:
        out["first_commit_misses"] = list(misses)
out["served"] = w.shardings.served if w is not None and w.shardings is not None else 0
from tests.launcher.structure import structure
out["structure"] = structure(model, opt)
out["params"] = [p.to_local().detach().tolist() for p in model.parameters()]
out["state"] = [v.to_local().detach().tolist() for st in opt.state.values() for k, v in sorted(st.items())
                if k != "step"]
json.dump(out, open(out_path, "w"))
"""


def _child(tmp: Path, mode: str, recipe: str, kind: str = "hsdp") -> dict[str, Any]:
    tmp.mkdir(parents=True, exist_ok=True)
    rp, op = tmp / "recipe.json", tmp / f"{mode}.json"
    rp.write_text(recipe)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RESILD_CONTROLLER", None)
    p = subprocess.run(
        [sys.executable, "-c", CHILD, mode, str(rp), str(op), kind],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        cwd=Path(__file__).resolve().parents[4],
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out: dict[str, Any] = json.loads(op.read_text())
    return out


@pytest.fixture(scope="module")
def cold(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _child(tmp_path_factory.mktemp("cold"), "cold", recipe_json())


def assert_like_cold(warm: dict[str, Any], cold: dict[str, Any]) -> None:
    """Everything the script reaches has the cold process's structure, and the same values."""
    assert not differences(cold["structure"], warm["structure"]), differences(cold["structure"], warm["structure"])
    assert warm["params"] == cold["params"] and warm["state"] == cold["state"]


def test_after_a_warm_up_the_first_step_propagates_nothing_and_ends_bitwise_as_cold(
    tmp_path: Path, cold: dict[str, Any]
) -> None:
    warm = _child(tmp_path, "warm", recipe_json())
    assert warm["error"] is None
    assert warm["rng_kept"] and not warm["initialized_after"] and warm["groups_left"] == 0
    assert warm["groups"] == cold["groups"] == ["resild-replicate-0", "resild-shard-0"]
    assert cold["first_commit_misses"], "a cold process's first optimizer step propagates shardings"
    assert warm["first_commit_misses"] == [], warm["first_commit_misses"]
    assert warm["served"] > 0 and cold["served"] == 0
    assert_like_cold(warm, cold)
    # The warm-up's AdamW step left both moments of each weight (of the job's shard shapes)
    # touched for the replay (launcher/worker/transport/landing_pool.py); the biases' are too small to keep.
    assert warm["landing"] == [[[512, 128], True]] * 2 + [[[512, 512], True]] * 2 + [[[128, 512], True]] * 2
    assert warm["landing_left"] == 0


@pytest.mark.parametrize("kind", ["tp", "tp-id", "fsdp"])
def test_a_warmed_spare_is_a_cold_process_to_the_script(tmp_path: Path, kind: str) -> None:
    """FSDP2 + TP: the FSDP-only parameters live on mesh["shard"], the TP-split ones on the
    whole mesh, and FSDP2 makes one mesh object per TP-split parameter. A cold process's
    gradients hang off those objects; a warmed one's must too (the warm-up once handed its
    own mesh out, and a loop grouping gradients by id(mesh) then issued fewer collectives
    than its peers). "tp-id" is that loop; "fsdp" plain FSDP2 on a 1-D mesh."""
    cold = _child(tmp_path / "cold", "cold", recipe_json(), kind)
    recipe = cold["recipe"]
    assert recipe is not None, "gives a recipe"
    if kind.startswith("tp"):
        assert {tuple(p["dims"]) for p in json.loads(recipe)["params"]} == {(0,), (0, 1)}
        assert len(cold["structure"]["meshes"]) > 2  # torch's own objects, more than the job's mesh and slice
    assert cold["first_commit_misses"]
    warm = _child(tmp_path / "warm", "warm", recipe, kind)
    assert warm["error"] is None and warm["served"] > 0
    assert warm["first_commit_misses"] == [], warm["first_commit_misses"]
    assert warm.get("clip_groups") == cold.get("clip_groups")
    assert_like_cold(warm, cold)


def tp_recipe_2x2() -> str:
    """What describe() gives for examples/train_fsdp_tp.py on a 2 x 2 ("shard", "tp") mesh:
    FSDP2's shard of a dimension TP split is a strided shard."""
    params = [
        {"shape": [512, 128], "stride": [128, 1], "dtype": "float32", "placements": [["T", 0, 2], ["S", 0, 1]]},
        {"shape": [128, 512], "stride": [512, 1], "dtype": "float32", "placements": [["S", 0, 1], ["S", 1, 1]]},
        {"shape": [128], "stride": [1], "dtype": "float32", "placements": [["S", 0, 1], ["R", -1, 1]]},
        {"shape": [128], "stride": [1], "dtype": "float32", "placements": [["S", 0, 1]], "dims": [0]},
    ]
    return recipe_json([2, 2], ["shard", "tp"], params=params, groups=[{"hp": {"lr": 1e-3}, "params": [0, 1, 2, 3]}])


def test_a_tensor_parallel_recipe_parses_with_strided_shards_and_slices() -> None:
    r = wr.parse(tp_recipe_2x2())
    assert r.params[0].placements == (("T", 0, 2), ("S", 0, 1))
    assert r.params[0].local_shape(r.mesh_shape) == (128, 128)
    assert r.params[3].dims == (0,) and r.params[3].local_shape(r.mesh_shape) == (64,)
    bad = json.loads(tp_recipe_2x2())
    bad["params"][3]["dims"] = [2]
    with pytest.raises(ValueError, match="mesh dimensions"):
        wr.parse(json.dumps(bad))


def test_a_tensor_parallel_warm_up_on_a_2x2_mesh_runs_and_leaves_nothing(tmp_path: Path, cold: dict[str, Any]) -> None:
    warm = _child(tmp_path, "warm", tp_recipe_2x2())
    assert warm["error"] is None and warm["served"] == 0  # the job's mesh is 1 x 1
    assert warm["rng_kept"] and not warm["initialized_after"] and warm["groups_left"] == 0
    assert_like_cold(warm, cold)


def test_a_warm_up_for_another_mesh_serves_nothing_and_changes_nothing(tmp_path: Path, cold: dict[str, Any]) -> None:
    # 2 x 2: the warm-up's clipping runs DTensor collectives (on its fake groups)
    warm = _child(tmp_path, "warm", recipe_json([2, 2]))
    assert warm["error"] is None and warm["served"] == 0
    assert warm["first_commit_misses"]  # its records are for a mesh the job does not use
    assert_like_cold(warm, cold)


def test_a_warm_up_stopped_by_ranks_arriving_leaves_a_cold_process(tmp_path: Path, cold: dict[str, Any]) -> None:
    warm = _child(tmp_path, "cancelled", recipe_json())
    assert warm["error"] is None and not warm["initialized_after"] and warm["groups_left"] == 0
    assert warm["landing"] == [None] * 6  # stopped before its optimizer step
    assert_like_cold(warm, cold)


def test_a_preparation_that_raises_is_reported_and_leaves_a_cold_process(tmp_path: Path, cold: dict[str, Any]) -> None:
    warm = _child(tmp_path, "prepare-fails", recipe_json())
    assert warm["error"] is None and warm["prepare_error"] == "ValueError: no such layer"
    assert warm["prepare_mesh"] == [[1, 1], ["replicate", "shard"]]  # the job's mesh, over stand-in groups
    assert warm["rng_kept"] and warm["default_dtype"] == "torch.float32" and warm["groups_left"] == 0
    assert_like_cold(warm, cold)
