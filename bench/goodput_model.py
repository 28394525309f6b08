"""Goodput at scale, projected: resild vs checkpoint-restart for a job of 1,024 to 100,000 GPUs.

THIS IS A SIMULATION, not a measurement. An event-driven Monte-Carlo run of a job of
--days wall time: failures arrive as a Poisson process at the job's published failure
rate; each costs resild its measured recovery components (detection, fence, controller
announcement, re-form, replay, the step in flight) and spends a hot spare. Where the spare
comes back from is the row's pool:

  fixed           never (today under Slurm: a fenced node never returns, nothing joins)
  refill          a cold spare from the queue joins --cold-spare-wait-s + --join-s later
                  (resil-run --join; the qualification is in --join-s)
  refill + shrink as refill, and with no spare left a job with replicas drops one replica
                  group (--shrink-group-nodes) and trains on, slower, until a spare arrives
                  and it grows back (a recovery)
  repair          a failed node returns after --repair-h (the model's first assumption)

With no spare left (and nothing to shrink), resild's job stops (`no spare left`, requeued
with --requeue-on-exhaustion) and restarts from the user's fallback disk checkpoint like
checkpoint-restart does, with a full spare pool again.
Checkpoint-restart writes a blocking checkpoint every interval (Young/Daly's optimum
sqrt(2 x write x MTTF) unless --ckpt-interval-s is given), and on a failure detects it,
restarts and redoes the work since its last checkpoint. A failure during a recovery, a
restart or a checkpoint write is simulated too (the recovery starts over; the write is lost).

Goodput = net productive training time / wall time. "GPU-time goodput" also charges the
hot spares' idle GPUs (they are allocated and paid for all along).

Every input, its value and its source are printed with the table (and in --json).

    python bench/goodput_model.py                  # the table: 1k, 4k, 16k, 100k GPUs
    python bench/goodput_model.py --json           # inputs + rows as JSON
    python bench/goodput_model.py --plot goodput.png
    python bench/goodput_model.py --mttf-source llama3 --restart-s 300 --gpus 16384
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

GPUS_PER_NODE = 8

# Published failure rates: (GPUs, mean time to failure in hours) for one job of that size.
MTTF_SOURCES = {
    # Kokolis et al. 2024, "Revisiting Reliability in Large-Scale ML Research Clusters" (Meta RSC):
    # MTTF of 7.9 h for 1,024-GPU jobs and 1.8 h for 16,384-GPU jobs.
    "kokolis": ((1024, 7.9), (16384, 1.8)),
    # Dubey et al. 2024, "The Llama 3 Herd of Models": 419 unexpected interruptions in 54 days
    # on 16,384 GPUs = one every 3.09 h. One point: scaled with the Kokolis exponent.
    "llama3": ((16384, 54 * 24 / 419),),
}


@dataclass
class Inputs:
    """Every number the model uses. `SOURCES` says where each comes from."""

    mttf_source: str = "kokolis"
    mttf_scaling: str = "fit"  # fit: power law through the published points; linear: per-GPU rate constant
    days: float = 30.0
    runs: int = 100
    seed: int = 1
    step_s: float = 2.0
    # resild recovery components
    detect_s: float = 0.55
    hang_fraction: float = 0.05
    hang_timeout_s: float = 10.0
    fence_s: float = 0.02
    announce_s_16k: float = 0.05
    announce_exponent: float = 1.0
    reform_s: float = 0.005
    store_barrier_s_16k: float = 0.5
    state_gb_per_gpu: float = 16.0
    replay_gb_s: float = 25.0
    repair_h: float = 24.0
    spare_quantile: float = 0.99
    spares: int | None = None  # spare nodes; None: from --spare-quantile
    fallback_ckpt_interval_h: float = 6.0
    # the pool refilling (issue 35)
    cold_spare_wait_s: float = 600.0
    join_s: float = 15.0
    shrink_group_nodes: int = 1
    # checkpoint-restart
    ckpt_detect_s: float = 11.0
    ckpt_write_s: float = 30.0
    ckpt_interval_s: float | None = None  # None: Young/Daly optimum per job size
    restart_s: float = 600.0


SOURCES = {
    "mttf_source": "kokolis: Kokolis et al. 2024 (Meta RSC): MTTF 7.9 h at 1,024 GPUs, 1.8 h at 16,384 GPUs; "
    "llama3: Dubey et al. 2024: 419 unexpected interruptions in 54 days on 16,384 GPUs (3.09 h)",
    "mttf_scaling": "fit: MTTF = 7.9 h x (G/1024)^-0.533, the power law through Kokolis' two points "
    "(per-GPU reliability improves with job size there); linear: constant per-GPU rate "
    "(pessimistic above 16k)",
    "days": "job length simulated (assumption)",
    "runs": "Monte-Carlo repetitions per row",
    "step_s": "training step time (assumption); a fault loses on average half a step in flight",
    "detect_s": "measured: bench/slurm_recovery.py, node crash under real Slurm, liveness probe 0.53-0.55 s "
    "(process exit 0.03 s and NVML Xid 0.014 s are faster; docs/benchmarks.md)",
    "hang_fraction": "assumption: share of failures that are hangs, caught only after --hang-timeout",
    "hang_timeout_s": "resil-run --hang-timeout default",
    "fence_s": "measured: bench/recovery.py, failure_detected -> node_fenced < 0.02 s",
    "announce_s_16k": "issue 8's target for the controller's announcement at 16,000 ranks (bench/controller_scale.py "
    "not run yet); measured before issue 8: 70 s at 16,000 ranks, quadratic (--announce-s-16k 70 "
    "--announce-exponent 2)",
    "announce_exponent": "announce cost grows as (ranks/16000)^exponent",
    "reform_s": "measured: bench/recovery.py, new gloo group at 4 ranks 0.004-0.005 s",
    "store_barrier_s_16k": "NVRx reports a TCPStore barrier of ~0.5 s at 16k ranks (design notes); scaled linearly",
    "state_gb_per_gpu": "assumption: model + optimizer state per GPU sent to each replacement GPU",
    "replay_gb_s": "assumption: one 200 Gb/s NIC per GPU (measured here only on loopback: 22 MB in 0.034-0.05 s)",
    "repair_h": "assumption: a failed node is back in the spare pool after this long",
    "spare_quantile": "spare nodes = the smallest S with P(failures during one repair time <= S) >= this",
    "spares": "fixed spare-node count (overrides --spare-quantile)",
    "cold_spare_wait_s": "assumption: a queued cold-spare job (sbatch --array) gets a node this long after it is "
    "needed (site-dependent: idle nodes start it at once, a full cluster waits)",
    "join_s": "measured on the 2-core CPU lab (tests/launcher/run/test_join.py): admission -> the spare's workers "
    "warm, qualification included, 9-15 s under load; a GPU node adds CUDA init and the self-test",
    "shrink_group_nodes": "what the code does (resil-run --min-replicas): a shrink drops one node, which holds "
    "whole replica groups (DP, DDP, HSDP with its shard groups inside a node); the job runs at (nodes - dropped) "
    "/ nodes of its samples per step (the per-rank batch kept), at the same step time (bench/shrink.py)",
    "fallback_ckpt_interval_h": "resild users' fallback disk checkpoint interval (assumption); "
    "used when the spare pool is exhausted",
    "ckpt_detect_s": "measured: bench/slurm_recovery.py, plain srun job, crash -> srun returns 10.4-11.6 s "
    "(SlurmdTimeout=5 s; the default 300 s would be slower)",
    "ckpt_write_s": "assumption: blocking checkpoint write to a parallel file system (also charged to "
    "resild's fallback checkpoints)",
    "ckpt_interval_s": "Young/Daly optimum sqrt(2 x write x MTTF) per job size unless given",
    "restart_s": "assumption: requeue + process start + NCCL init + checkpoint load at scale "
    "(measured here at 4 ranks: torchrun 3.9-7.4 s, plain srun 12.3-13.5 s)",
}


def mttf_h(gpus: int, inp: Inputs) -> float:
    """The job's mean time to failure in hours at this size, from the published points."""
    pts = MTTF_SOURCES[inp.mttf_source]
    k_fit = math.log(7.9 / 1.8) / math.log(16384 / 1024)  # Kokolis' exponent, 0.533
    g0, m0 = pts[-1]
    if inp.mttf_scaling == "linear":
        return m0 * g0 / gpus
    if len(pts) >= 2:
        (g1, m1), (g2, m2) = pts[0], pts[-1]
        k = math.log(m1 / m2) / math.log(g2 / g1)
        return float(m1 * (gpus / g1) ** -k)
    return float(m0 * (gpus / g0) ** -k_fit)


@dataclass
class ResildCost:
    detect_s: float
    fence_s: float
    announce_s: float
    reform_s: float
    replay_s: float
    inflight_s: float

    @property
    def total_s(self) -> float:
        return self.detect_s + self.fence_s + self.announce_s + self.reform_s + self.replay_s + self.inflight_s


def resild_cost(gpus: int, inp: Inputs) -> ResildCost:
    ranks = gpus
    detect = (1 - inp.hang_fraction) * inp.detect_s + inp.hang_fraction * inp.hang_timeout_s
    return ResildCost(
        detect_s=detect,
        fence_s=inp.fence_s,
        announce_s=inp.announce_s_16k * (ranks / 16000) ** inp.announce_exponent,
        reform_s=inp.reform_s + inp.store_barrier_s_16k * ranks / 16384,
        replay_s=inp.state_gb_per_gpu / inp.replay_gb_s,
        inflight_s=inp.step_s / 2,
    )


def poisson_quantile(mean: float, q: float) -> int:
    k, term = 0, math.exp(-mean)
    cdf = term
    while cdf < q:
        k += 1
        term *= mean / k
        cdf += term
    return k


def spare_nodes(gpus: int, inp: Inputs) -> int:
    if inp.spares is not None:
        return inp.spares
    fails_per_repair = inp.repair_h / mttf_h(gpus, inp)
    return max(1, poisson_quantile(fails_per_repair, inp.spare_quantile))


# ---- the simulation ------------------------------------------------------------------------
@dataclass
class RunResult:
    goodput: float
    failures: int
    exhaustions: int
    checkpoints: int


POOLS = ("fixed", "refill", "shrink", "repair")
POOL_LABELS = {
    "fixed": "resild, fixed pool (today)",
    "refill": "resild, refill",
    "shrink": "resild, refill + shrink",
    "repair": "resild, repaired nodes return",
}


def simulate(gpus: int, inp: Inputs, rng: random.Random, *, resild: bool, pool: str = "repair") -> RunResult:
    """One job of inp.days wall time. Returns net productive time / wall time. `pool`: where
    a spent spare comes back from (POOLS; the module's docstring)."""
    assert pool in POOLS, pool
    back_s = {
        "fixed": math.inf,
        "refill": inp.cold_spare_wait_s + inp.join_s,
        "shrink": inp.cold_spare_wait_s + inp.join_s,
        "repair": inp.repair_h * 3600.0,
    }[pool]
    groups = max(1, gpus // GPUS_PER_NODE // max(1, inp.shrink_group_nodes))
    shrunk = 0  # replica groups dropped (pool "shrink"): the job runs at (groups - shrunk) / groups
    T = inp.days * 86400.0
    mttf_s = mttf_h(gpus, inp) * 3600.0
    rate = 1.0 / mttf_s  # failures/s among the job's active GPUs
    node_rate = rate / (gpus / GPUS_PER_NODE)  # per node, the same per-GPU reliability for spares
    s_max = spare_nodes(gpus, inp) if resild else 0
    cost = resild_cost(gpus, inp).total_s
    restart = inp.ckpt_detect_s + inp.restart_s
    if resild:
        interval = inp.fallback_ckpt_interval_h * 3600.0
    else:
        interval = inp.ckpt_interval_s or math.sqrt(2 * inp.ckpt_write_s * mttf_s)
    t = work = since_ckpt = 0.0
    spares = s_max
    repairs: list[float] = []  # when failed nodes come back to the pool
    busy_until = 0.0  # recovering / restarting / writing a checkpoint until then
    writing = False
    failures = exhaustions = ckpts = 0
    while t < T:
        while repairs and repairs[0] <= t:
            heapq.heappop(repairs)
            if shrunk:  # the arriving spare grows the job back: a recovery (replay to it)
                shrunk -= 1
                busy_until = max(busy_until, t + cost)
            else:
                spares = min(s_max, spares + 1)
        nxt_fail = t + rng.expovariate(rate)
        nxt_spare_fail = t + rng.expovariate(node_rate * spares) if spares else math.inf
        nxt_repair = repairs[0] if repairs else math.inf
        ckpt_due = busy_until <= t
        if ckpt_due:  # running: the next checkpoint is due when `interval` of work has accrued
            nxt_done = t + max(0.0, interval - since_ckpt)
        else:
            nxt_done = busy_until
        t_next = min(nxt_fail, nxt_spare_fail, nxt_repair, nxt_done, T)
        if busy_until <= t:  # training: the elapsed time is work (at the shrunk job's rate)
            rate_now = (groups - shrunk) / groups
            work += (t_next - t) * rate_now
            since_ckpt += (t_next - t) * rate_now
        t = t_next
        if t >= T:
            break
        if t == nxt_fail:
            failures += 1
            writing = False  # a checkpoint being written is lost
            if resild and spares > 0:
                spares -= 1
                if back_s < math.inf:
                    heapq.heappush(repairs, t + back_s)
                busy_until = t + cost
            elif resild and pool == "shrink" and shrunk < groups - 1:
                shrunk += 1  # one replica group fewer; a cold spare is on its way
                heapq.heappush(repairs, t + back_s)
                busy_until = t + cost
            else:
                if resild:
                    exhaustions += 1
                    spares, repairs, shrunk = s_max, [], 0  # requeued on a fresh allocation
                work -= since_ckpt  # redone after the restart
                since_ckpt = 0.0
                busy_until = t + restart
        elif t == nxt_spare_fail:
            spares -= 1
            if back_s < math.inf:
                heapq.heappush(repairs, t + back_s)
        elif t == nxt_repair:
            continue  # handled at the top of the loop
        elif t == nxt_done:
            if writing:
                writing = False
                since_ckpt = 0.0
                ckpts += 1
            elif ckpt_due:  # (decided before the clock moved: no float comparison of work totals)
                writing = True
                busy_until = t + inp.ckpt_write_s
            elif since_ckpt >= interval:  # a recovery ended with a checkpoint overdue
                writing = True
                busy_until = t + inp.ckpt_write_s
    return RunResult(goodput=max(0.0, work) / T, failures=failures, exhaustions=exhaustions, checkpoints=ckpts)


@dataclass
class Row:
    gpus: int
    system: str
    mttf_h: float
    failures_per_day: float
    goodput: float
    goodput_p5: float
    goodput_p95: float
    gpu_time_goodput: float
    spare_nodes: int
    exhaustions_per_run: float
    per_failure_s: float
    ckpt_interval_s: float | None
    parts: dict[str, float] = field(default_factory=dict)


def project(gpus: int, inp: Inputs, resild: bool, label: str | None = None, pool: str = "repair") -> Row:
    rng = random.Random(f"{inp.seed}-{gpus}-{resild}-{label}")
    runs = [simulate(gpus, inp, rng, resild=resild, pool=pool) for _ in range(inp.runs)]
    gp = sorted(r.goodput for r in runs)
    m = mttf_h(gpus, inp)
    s = spare_nodes(gpus, inp) if resild else 0
    mean = statistics.fmean(gp)
    c = resild_cost(gpus, inp)
    return Row(
        gpus=gpus,
        system=label or ("resild" if resild else "checkpoint-restart"),
        mttf_h=m,
        failures_per_day=24 / m,
        goodput=mean,
        goodput_p5=gp[int(0.05 * (len(gp) - 1))],
        goodput_p95=gp[int(0.95 * (len(gp) - 1))],
        gpu_time_goodput=mean * gpus / (gpus + s * GPUS_PER_NODE),
        spare_nodes=s,
        exhaustions_per_run=statistics.fmean(r.exhaustions for r in runs),
        per_failure_s=c.total_s if resild else inp.ckpt_detect_s + inp.restart_s,
        ckpt_interval_s=None if resild else (inp.ckpt_interval_s or math.sqrt(2 * inp.ckpt_write_s * m * 3600)),
        parts=asdict(c) if resild else {"detect_s": inp.ckpt_detect_s, "restart_s": inp.restart_s},
    )


def projections(
    gpus_list: list[int], inp: Inputs, before_fix: bool = True, pools: tuple[str, ...] = ("repair",)
) -> list[Row]:
    rows = []
    for g in gpus_list:
        for pool in pools:
            label = None if pools == ("repair",) else POOL_LABELS[pool]
            rows.append(project(g, inp, resild=True, label=label, pool=pool))
        if before_fix:  # the controller as measured before issue 8's fix
            rows.append(
                project(
                    g,
                    replace(inp, announce_s_16k=70.0, announce_exponent=2.0),
                    resild=True,
                    label="resild, controller before issue 8",
                )
            )
        rows.append(project(g, inp, resild=False))
    return rows


# ---- output ----------------------------------------------------------------------------------
def format_inputs(inp: Inputs) -> str:
    lines = ["Inputs (flag = value: source):"]
    for k, v in asdict(inp).items():
        lines.append(f"  --{k.replace('_', '-')} = {v}: {SOURCES.get(k, '')}")
    return "\n".join(lines)


def format_table(rows: list[Row]) -> str:
    hdr = (
        f"{'GPUs':>7}  {'system':<35}{'MTTF':>7}{'fail/day':>9}{'goodput':>9}{'p5-p95':>15}"
        f"{'GPU-time':>9}{'spares':>7}{'exhaust':>8}{'per failure':>12}{'ckpt every':>11}"
    )
    out = [hdr]
    for r in rows:
        ck = "-" if r.ckpt_interval_s is None else f"{r.ckpt_interval_s / 60:.1f} min"
        out.append(
            f"{r.gpus:>7}  {r.system:<35}{r.mttf_h:>6.2f}h{r.failures_per_day:>9.1f}"
            f"{r.goodput * 100:>8.2f}%{f'{r.goodput_p5 * 100:.2f}-{r.goodput_p95 * 100:.2f}%':>15}"
            f"{r.gpu_time_goodput * 100:>8.2f}%{r.spare_nodes:>7}{r.exhaustions_per_run:>8.2f}"
            f"{r.per_failure_s:>11.2f}s{ck:>11}"
        )
    out.append(
        "goodput: net productive time / wall (mean over runs); GPU-time: also charging the idle hot spares' "
        "GPUs; spares: hot spare nodes (8 GPUs each); exhaust: spare pool empty at a failure, per run "
        "(job restarts from its fallback checkpoint); per failure: resild's recovery components / "
        "checkpoint-restart's detection + restart (plus redone work, simulated)."
    )
    return "\n".join(out)


def plot(rows: list[Row], path: Path, inp: Inputs) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 5.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    systems = list(dict.fromkeys(r.system for r in rows))  # in the table's order
    styles = ["o-", "s--", "d-", "v:", "x-", "^-"]
    for i, system in enumerate(systems):
        style = "^-" if system == "checkpoint-restart" else styles[i % (len(styles) - 1)]
        pts = [(r.gpus, r.goodput * 100, r.goodput_p5 * 100, r.goodput_p95 * 100) for r in rows if r.system == system]
        if not pts:
            continue
        g, y, lo, hi = zip(*pts)
        ax.plot(g, y, style, label=system)
        ax.fill_between(g, lo, hi, alpha=0.15)
        below = i % 2 == 1  # keep the labels of close lines apart
        for gi, yi in zip(g, y):
            ax.annotate(
                f"{yi:.1f}%",
                (gi, yi),
                textcoords="offset points",
                xytext=(0, -13 if below else 6),
                ha="center",
                fontsize=8,
            )
    ax.axhline(98, color="#888888", ls=":", lw=1)
    ax.text(25000, 96.6, "98% target at 16,384 GPUs", fontsize=8, color="#555555")
    ax.set_xscale("log")
    ax.set_xlabel("GPUs in the job")
    ax.set_ylabel("goodput, % of wall time (simulated)")
    ax.set_title(
        f"Projected goodput (SIMULATION; MTTF source: {inp.mttf_source}, {inp.mttf_scaling}; "
        f"restart {inp.restart_s:.0f} s, ckpt write {inp.ckpt_write_s:.0f} s)",
        fontsize=9,
    )
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    path.write_bytes(_png(fig)) if path.suffix.lower() == ".png" else fig.savefig(path)


def _png(fig: Any) -> bytes:  # a matplotlib Figure
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, Inputs]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--gpus",
        type=int,
        nargs="+",
        default=[1024, 4096, 16384, 100000],
        help="job sizes in GPUs (default: 1024 4096 16384 100000)",
    )
    p.add_argument("--json", action="store_true", help="print the inputs and rows as one JSON object")
    p.add_argument("--plot", type=Path, metavar="FILE", help="draw goodput vs GPUs to FILE (.png)")
    p.add_argument(
        "--pools",
        default="repair",
        help=f"comma-separated spare pools to compare, of {', '.join(POOLS)} (the docstring says what each "
        "means); e.g. fixed,refill,shrink: today's fixed pool, refill, refill + shrink [default: repair]",
    )
    p.add_argument(
        "--no-before-fix",
        action="store_true",
        help="leave out the row with the controller's announcement cost as measured before issue 8",
    )
    defaults = Inputs()
    for k, v in asdict(defaults).items():
        flag = "--" + k.replace("_", "-")
        if k == "mttf_source":
            p.add_argument(flag, choices=sorted(MTTF_SOURCES), default=v, help=SOURCES[k])
        elif k == "mttf_scaling":
            p.add_argument(flag, choices=["fit", "linear"], default=v, help=SOURCES[k])
        else:
            typ = int if k in ("runs", "seed", "spares", "shrink_group_nodes") else float
            p.add_argument(flag, type=typ, default=v, help=f"{SOURCES.get(k, '')} [default: {v}]")
    a = p.parse_args(argv)
    inp = Inputs(**{k: getattr(a, k) for k in asdict(defaults)})
    if any(g < GPUS_PER_NODE for g in a.gpus):
        p.error(f"--gpus: at least {GPUS_PER_NODE} (one node)")
    if inp.runs < 1 or inp.days <= 0:
        p.error("--runs must be >= 1 and --days > 0")
    a.pools = tuple(x.strip() for x in a.pools.split(",") if x.strip())
    if not a.pools or any(x not in POOLS for x in a.pools):
        p.error(f"--pools: a comma-separated list of {', '.join(POOLS)}")
    if a.plot is not None and a.plot.suffix.lower() not in (".png", ".svg", ".pdf"):
        p.error("--plot FILE must end in .png (or .svg/.pdf)")
    return a, inp


def main(argv: list[str] | None = None) -> int:
    a, inp = parse_args(argv)
    rows = projections(a.gpus, inp, before_fix=not a.no_before_fix, pools=a.pools)
    if a.json:
        print(
            json.dumps(
                {"simulation": True, "inputs": asdict(inp), "sources": SOURCES, "rows": [asdict(r) for r in rows]},
                indent=1,
            )
        )
    else:
        print("SIMULATION (bench/goodput_model.py), not a measurement.\n")
        print(format_table(rows))
        print()
        print(format_inputs(inp))
    if a.plot is not None:
        try:
            plot(rows, a.plot, inp)
        except OSError as e:
            print(f"goodput_model: cannot write --plot {a.plot}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(f"plot written to {a.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
