"""resil-run: start a resilient training job.

\b
Local (embedded cluster on this machine, no Slurm needed):
  resil-run --local --nodes 3 --spares 1 --nproc-per-node 2 -- python examples/train.py --steps 300
\b
Slurm (inside sbatch/salloc; the last --spares nodes of the allocation are hot spares):
  #SBATCH -N 5
  resil-run --spares 1 --nproc-per-node 8 -- python train.py
\b
Inject faults (KIND:NODE@STEP[+DELAY_S]; kinds kill, exception, hang, nodeloss, xidN):
  resil-run --local --nodes 4 --spares 2 --inject kill:node0@40 --inject xid79:node1@120 -- python train.py

Add hot spares to a running job (its --run-dir holds the job secret; no command: the job's):
  sbatch -N1 --wrap "resil-run --join RUN_DIR"      # a cold spare from the queue
  resil-run --local --join RUN_DIR --nodes 1        # a simulated one

--nodes counts every node, spares included (like `srun -N`): 3 nodes with
1 spare train on 2 nodes and keep 1 warm. Node names are local-node0 ...;
fault specs may say node0 for local-node0.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import sys
import tempfile
from pathlib import Path

import click

from resild.controller.etcd_target import EtcdTarget
from resild.controller.faults import Fault, FaultSpecError, parse_fault
from resild.wire.own_dir import NotOwnError, private_dir
from resild.wire.settings import AUTO_COPIES, DEFAULT_SNAPSHOT_BUDGET, JobSettings, SettingsError


def _nan(param: click.Parameter) -> float:
    raise click.BadParameter("must be a finite number", param=param)


def _resolve_faults(specs: tuple[str, ...], nodes: list[str]) -> list[Fault]:
    out = []
    for spec in specs:
        f = parse_fault(spec)
        name = f.node if f.node in nodes else f"local-{f.node}"
        if name not in nodes:
            raise FaultSpecError(f"fault {spec!r} names node {f.node!r}; nodes are {', '.join(nodes)}")
        out.append(dataclasses.replace(f, node=name))
    return out


def _whole_or_auto(v: str | int, auto: int, lo: int, hi: int | None) -> int:
    """A flag's whole number in [lo, hi], or `auto` for the word 'auto'."""
    if isinstance(v, int):
        return v
    if str(v).strip().lower() == "auto":
        return auto
    try:
        n = int(v)
    except ValueError:
        raise click.BadParameter(f"{v!r} is neither a whole number nor 'auto'") from None
    if n < lo or (hi is not None and n > hi):
        where = f"in {lo}..{hi}" if hi is not None else f"a whole number >= {lo}"
        raise click.BadParameter(f"{n} is not {where} (or 'auto')")
    return n


def _every(v: str | int) -> int:
    return _whole_or_auto(v, 0, 1, None)


def _copies(v: str | int) -> int:
    return _whole_or_auto(v, AUTO_COPIES, 0, 8)


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100}, help=__doc__)
@click.option("--local", "local", is_flag=True, help="Run an embedded cluster of simulated nodes on this machine.")
@click.option(
    "--nodes",
    "-N",
    type=click.IntRange(min=1),
    default=None,
    help="Nodes in all, spares included (default: the Slurm allocation, or 3 with --local).",
)
@click.option(
    "--spares",
    type=click.IntRange(min=0),
    default=1,
    show_default=True,
    help="Hot spare nodes kept warm (their workers import torch and build the model, then wait).",
)
@click.option(
    "--nproc-per-node",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Worker processes (ranks) per node.",
)
@click.option(
    "--inject", multiple=True, metavar="KIND:NODE@STEP", help="Inject a fault when the job reaches STEP (repeatable)."
)
@click.option(
    "--events",
    type=click.Path(dir_okay=False, writable=True, path_type=Path),
    help="Write one JSON line per event to this file.",
)
@click.option(
    "--hang-timeout",
    "hang_timeout_s",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    help="Seconds without any committed step before the rank holding everyone up is declared hung.",
)
@click.option(
    "--heartbeat-timeout",
    "heartbeat_timeout_s",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    help="Seconds of node silence before the node is declared lost.",
)
@click.option(
    "--start-timeout",
    "start_timeout_s",
    type=click.FloatRange(min=1.0, max=86400.0),
    default=300.0,
    show_default=True,
    callback=lambda ctx, param, v: v if v == v else _nan(param),  # NaN passes FloatRange
    help="Seconds for every active node's workers to start and register before the job fails.",
)
@click.option(
    "--controller-timeout",
    "controller_timeout_s",
    type=click.FloatRange(min=0.5, max=3600.0),
    default=5.0,
    show_default=True,
    callback=lambda ctx, param, v: v if v == v else _nan(param),
    help="Seconds without a word from the controller after which node processes stop their workers "
    "and exit (code 75): a dead or frozen controller leaves nothing behind.",
)
@click.option(
    "--controllers",
    type=click.IntRange(min=1, max=7),
    default=1,
    show_default=True,
    help="Controller replicas. 1: one controller inside resil-run. 3 (or 5): a replica set on etcd "
    "(separate processes; under Slurm on the allocation's first nodes, the batch host included); "
    "the job survives the loss of any minority of them, the leader's and the batch host's included.",
)
@click.option(
    "--consensus",
    type=click.Choice(["auto", "etcd", "raft"]),
    default="auto",
    show_default=True,
    help="With --controllers N: etcd elects the leader and keeps the journal (the job's own N-member "
    "cluster: with --local on this machine, under Slurm on the replicas' nodes; or a site's with --etcd). "
    "auto: etcd. raft (pysyncobj) was removed.",
)
@click.option(
    "--etcd",
    "etcd_urls",
    metavar="URL[,URL...]",
    help="A site etcd (its client URLs) for --controllers N instead of the job's own cluster; "
    "with --etcd-ca/--etcd-cert/--etcd-key for TLS client certificates.",
)
@click.option("--etcd-ca", type=click.Path(dir_okay=False, exists=True), help="The site etcd's CA (PEM).")
@click.option("--etcd-cert", type=click.Path(dir_okay=False, exists=True), help="A client certificate (PEM).")
@click.option("--etcd-key", type=click.Path(dir_okay=False, exists=True), help="Its private key (PEM).")
@click.option(
    "--etcd-prefix",
    metavar="/PATH",
    help="Where in the site etcd this job's keys go (default: /resild/<Slurm job id or a random id>).",
)
@click.option(
    "--snapshot-copies",
    default="auto",
    show_default=True,
    metavar="K|auto",
    callback=lambda ctx, param, v: _copies(v),
    help="Copies of each rank's state kept in other nodes' memory after a commit, for ranks no replica "
    "covers (plain FSDP2, tensor parallel): a lost node's ranks roll back to the newest complete snapshot. "
    "auto: 1 without replicas, 0 with them (DP, DDP, HSDP replay from a replica). K survives K nodes lost at once.",
)
@click.option(
    "--snapshot-every",
    default="1",
    show_default=True,
    metavar="N|auto",
    callback=lambda ctx, param, v: _every(v),
    help="Snapshot every N committed steps: a rollback redoes at most about N steps. auto: as often as "
    "keeps their measured cost (capture, and what the exchange takes from training) under --snapshot-budget "
    "of a step, every rank on the same steps (agreed in the commit vote): 1 to 1024 steps apart.",
)
@click.option(
    "--snapshot-budget",
    type=float,
    default=DEFAULT_SNAPSHOT_BUDGET,
    show_default=True,
    metavar="SHARE",
    help="With --snapshot-every auto: the share of a step snapshots may cost (0.02: 2%).",
)
@click.option(
    "--fingerprint-every",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    metavar="M",
    help="Every M commits, ranks that should hold identical state (replicas) compare fingerprints of "
    "it: a rank outvoted by its replicas (a GPU computing wrong numbers) is replaced like a failed node and "
    "every rank returns to the last compare that agreed (the steps since are redone); two replicas that "
    "disagree are arbitrated by a spare recomputing those steps. 0: never.",
)
@click.option(
    "--verify-every",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    metavar="K",
    help="Every K steps each rank computes its step twice (the same data and RNG: job.steps() yields the "
    "step again) and compares its gradients before they are averaged: a rank whose two results differ (a GPU "
    "computing wrong numbers, which replicas' fingerprints cannot see) is replaced like a failed node and the "
    "step is not committed. Needs a step that reproduces: data from the step number or a loader passed as "
    "extra=, deterministic kernels; gradients resild averages (a plain model, not DDP or FSDP2). 0: never.",
)
@click.option(
    "--stragglers",
    type=click.Choice(["replace", "report", "off"]),
    default="replace",
    show_default=True,
    help="A node persistently slower than the others (each rank's own compute per step, from the commit "
    "reports): replace it with a spare when the time it costs the rest of the run exceeds what a recovery costs "
    "this job (its own recoveries' median; 5 s before the first), else report it (a `straggler` event, the live "
    "line, resild report); or only report; or do not watch.",
)
@click.option(
    "--straggler-threshold",
    type=float,
    default=0.25,
    show_default=True,
    metavar="SHARE",
    help="A node is a straggler when its median pace is more than this share above the other nodes' "
    "(0.25: 25% slower), in (0, 10].",
)
@click.option(
    "--straggler-window",
    type=click.IntRange(min=2),
    default=50,
    show_default=True,
    metavar="STEPS",
    help="Over its latest this many steps (the first steps after the start and after every recovery are not "
    "judged): one slow step moves no median.",
)
@click.option(
    "--checkpoint-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="resild writes asynchronous torch.distributed.checkpoint checkpoints of the attached state here "
    "(no training-loop change); when every in-memory copy of some state is lost the job reloads the newest "
    "in-process, and a requeued or resubmitted job resumes from it. Under Slurm: a shared file system.",
)
@click.option(
    "--checkpoint-every",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    metavar="M",
    help="With --checkpoint-dir: a checkpoint every M committed steps.",
)
@click.option(
    "--run-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Keys, journal and NVML stand-in state go here (default: a fresh temporary directory).",
)
@click.option(
    "--resume",
    "resume_dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    metavar="RUN_DIR",
    help="--local --controllers N: continue the job of RUN_DIR (its resil-run gone) on its own etcd: "
    "the members restart on their data and the new leader restores the journal (roles, fenced "
    "nodes, epoch, fired faults); training state comes from --checkpoint-dir.",
)
@click.option(
    "--spare-target",
    type=click.IntRange(min=0, max=1024),
    default=0,
    show_default=True,
    metavar="S",
    help="Slurm: while fewer than S hot spares are in the pool, submit one-node cold-spare jobs "
    "(sbatch, with this job's account, partition, QOS and constraints) that join it (--join); "
    "those still queued or running are cancelled when the job ends. 0: never.",
)
@click.option(
    "--min-replicas",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    metavar="R",
    help="Data-parallel jobs (plain or DDP): with no spare left, drop the failed node's ranks and train on "
    "while at least R replicas (ranks) remain, renumbered; a spare that arrives later (--join, --readmit, "
    "--spare-target) grows the job back to its full width. The loop sees it in job.world_size and "
    "job.on_resize(); the per-rank batch is kept (the global batch shrinks) unless the loop uses "
    "job.data_shards() to keep it. 0: never shrink (stop or requeue, as without a spare).",
)
@click.option(
    "--readmit",
    is_flag=True,
    help="A node fenced without evidence against its hardware (a worker's exception, a hang) comes back "
    "as a spare (under Slurm: a new step on it, which first kills what is left of its old processes) once "
    "its old incarnation is silent and it qualifies (resild check --qualify); "
    "a second failure within an hour drains it. Nodes fenced with evidence (Xid, ECC, lost) never come back.",
)
@click.option(
    "--join",
    "join_dir",
    type=click.Path(file_okay=False, path_type=Path),
    metavar="RUN_DIR",
    help="Join the running job of RUN_DIR with new hot spares instead of starting a job: under Slurm every "
    "node of this allocation (a cold-spare job: sbatch -N1 --wrap 'resil-run --join RUN_DIR'), with --local "
    "--nodes simulated ones (default 1). They authenticate with the job's secret (RUN_DIR/keys/join), get "
    "their own keys from its controller, qualify (resild check --qualify), warm up and wait.",
)
@click.option(
    "--requeue-on-exhaustion",
    is_flag=True,
    help="Slurm: when no spare is left, requeue the job (reason in its comment) instead of failing.",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the end-of-run summary as JSON (stdout; status stays on stderr)."
)
@click.option(
    "-q",
    "--quiet",
    is_flag=True,
    help="No live status line (step, steps/s, epoch, spares left, last failure and its recovery time) on stderr.",
)
@click.option("-v", "--verbose", is_flag=True, help="Log controller decisions as they happen.")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
def main(
    local: bool,
    nodes: int | None,
    spares: int,
    nproc_per_node: int,
    inject: tuple[str, ...],
    events: Path | None,
    hang_timeout_s: float,
    heartbeat_timeout_s: float,
    start_timeout_s: float,
    controller_timeout_s: float,
    controllers: int,
    consensus: str,
    etcd_urls: str | None,
    etcd_ca: str | None,
    etcd_cert: str | None,
    etcd_key: str | None,
    etcd_prefix: str | None,
    snapshot_copies: int,
    snapshot_every: int,
    snapshot_budget: float,
    fingerprint_every: int,
    verify_every: int,
    stragglers: str,
    straggler_threshold: float,
    straggler_window: int,
    checkpoint_dir: Path | None,
    checkpoint_every: int,
    run_dir: Path | None,
    resume_dir: Path | None,
    join_dir: Path | None,
    readmit: bool,
    min_replicas: int,
    spare_target: int,
    requeue_on_exhaustion: bool,
    as_json: bool,
    quiet: bool,
    verbose: bool,
    cmd: tuple[str, ...],
) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="resil-run: %(message)s")
    if join_dir is not None:
        _join(join_dir, local, nodes, cmd, inject, resume_dir, run_dir)
    if not cmd:
        raise click.UsageError("missing the training command: resil-run [OPTIONS] -- python train.py ...")
    if spare_target and controllers > 1:
        raise click.UsageError("--spare-target runs with one controller for now (not with --controllers N)")
    if readmit and controllers > 1:
        raise click.UsageError("--readmit runs with one controller for now (not with --controllers N)")
    if events is not None:
        try:
            events.open("a").close()
        except OSError as e:
            raise click.UsageError(f"cannot write --events {events}: {e.strerror}") from None
    if consensus == "raft":
        raise click.UsageError(
            "--consensus raft was removed (pysyncobj's frames are pickles; one consensus engine, held to one "
            "standard): --controllers N runs on etcd, the job's own cluster or a site's (--etcd)"
        )
    if controllers == 2:
        raise click.UsageError("--controllers 2 survives no loss (etcd needs a majority): use 3")
    if controllers > 1 and importlib.util.find_spec("etcd3gw") is None:
        raise click.UsageError(f"--controllers {controllers} needs the standby extra: pip install 'resild[standby]'")
    etcd = _site_etcd(etcd_urls, etcd_ca, etcd_cert, etcd_key, etcd_prefix) if controllers > 1 else None
    if resume_dir is not None:
        if not local or controllers < 2 or etcd is not None:
            raise click.UsageError("--resume needs --local --controllers N on the job's own etcd")
        if run_dir is not None and run_dir.resolve() != resume_dir.resolve():
            raise click.UsageError("--resume RUN_DIR is the run directory: no other --run-dir")
        if not (resume_dir / "etcd" / "cluster.json").exists():
            raise click.UsageError(f"--resume {resume_dir}: no etcd of a job there (etcd/cluster.json)")
        run_dir = resume_dir
    if checkpoint_dir is not None:
        checkpoint_dir = checkpoint_dir.expanduser().resolve()  # workers may start elsewhere
        try:  # made 0700; one found must be ours and writable by no one else (its metadata is a pickle)
            private_dir(checkpoint_dir, "--checkpoint-dir", others_may_read=True)
            (checkpoint_dir / ".resild-write-test").touch()
            (checkpoint_dir / ".resild-write-test").unlink()
        except NotOwnError as e:
            raise click.UsageError(str(e)) from None
        except OSError as e:
            raise click.UsageError(f"cannot write --checkpoint-dir {checkpoint_dir}: {e.strerror}") from None
    try:  # the one place the job's timeouts are built; every process gets this object
        settings = JobSettings(
            heartbeat_timeout_s=heartbeat_timeout_s,
            hang_timeout_s=hang_timeout_s,
            start_timeout_s=start_timeout_s,
            controller_timeout_s=controller_timeout_s,
            snapshot_copies=snapshot_copies,
            snapshot_every=snapshot_every,
            snapshot_budget=snapshot_budget,
            fingerprint_every=fingerprint_every,
            checkpoint_dir=str(checkpoint_dir or ""),
            checkpoint_every=checkpoint_every if checkpoint_dir is not None else 0,
            min_replicas=min_replicas,
            verify_every=verify_every,
            stragglers=stragglers,
            straggler_threshold=straggler_threshold,
            straggler_window=straggler_window,
        )
    except SettingsError as e:
        raise click.UsageError(str(e)) from None
    if not local:
        from launcher.run.slurm_mode import run_slurm  # imported lazily: local mode needs no Slurm

        sys.exit(
            run_slurm(
                nodes=nodes,
                spares=spares,
                nproc_per_node=nproc_per_node,
                inject=inject,
                events=events,
                settings=settings,
                run_dir=run_dir,
                as_json=as_json,
                cmd=list(cmd),
                requeue_on_exhaustion=requeue_on_exhaustion,
                status=not quiet,
                controllers=controllers,
                etcd=etcd,
                spare_target=spare_target,
                readmit=readmit,
            )
        )
    if spare_target:
        raise click.UsageError("--spare-target submits cold spares to Slurm: with --local, add them with --join")
    n = nodes or 3
    if spares >= n:
        raise click.UsageError(f"--spares {spares} leaves no active node out of --nodes {n}")
    if snapshot_copies > 0 and snapshot_copies >= n - spares:
        raise click.UsageError(
            f"--snapshot-copies {snapshot_copies} needs at least {snapshot_copies + 1} active nodes "
            f"(each copy on another node); --nodes {n} --spares {spares} leaves {n - spares}"
        )
    if min_replicas > (n - spares) * nproc_per_node:
        raise click.UsageError(
            f"--min-replicas {min_replicas} is more than the job has: {n - spares} active node(s) x "
            f"{nproc_per_node} rank(s) = {(n - spares) * nproc_per_node} replicas"
        )
    names = [f"local-node{i}" for i in range(n)]
    try:
        faults = _resolve_faults(inject, names)
    except FaultSpecError as e:
        raise click.UsageError(str(e)) from None
    from launcher.run.job import JobSpec, run_job  # torch import happens here, after argument checks

    rd = run_dir or Path(tempfile.mkdtemp(prefix="resild-run-"))
    spec = JobSpec(
        active=names[: n - spares],
        spares=names[n - spares :],
        nproc_per_node=nproc_per_node,
        cmd=list(cmd),
        faults=faults,
        events_path=events,
        run_dir=rd,
        settings=settings,
        readmit=readmit,
    )
    if controllers > 1:
        from launcher.run.standby import run_replicated

        sys.exit(
            run_replicated(
                spec,
                controllers,
                as_json=as_json,
                status=not quiet,
                etcd=etcd,
                resume=resume_dir is not None,
            )
        )
    code = run_job(spec, as_json=as_json, status=not quiet)
    sys.exit(code)


def _join(
    join_dir: Path,
    local: bool,
    nodes: int | None,
    cmd: tuple[str, ...],
    inject: tuple[str, ...],
    resume_dir: Path | None,
    run_dir: Path | None,
) -> None:
    """resil-run --join: exits with the joined nodes' code, or 2 and one line when refused."""
    if cmd:
        raise click.UsageError("--join takes no command: joined nodes run the job's (from RUN_DIR/join.json)")
    if inject or resume_dir is not None or run_dir is not None:
        raise click.UsageError("--join takes no --inject, --resume or --run-dir: it joins the job of RUN_DIR")
    from launcher.run.join import JOIN_EXIT, JoinError, run_join, run_join_slurm

    if not local and nodes is not None:
        raise click.UsageError("--join under Slurm joins every node of this allocation: no --nodes (sbatch -N)")
    try:
        sys.exit(run_join(join_dir, nodes or 1) if local else run_join_slurm(join_dir))
    except JoinError as e:
        print(f"resil-run: cannot join {join_dir}: {e}", file=sys.stderr)
        sys.exit(JOIN_EXIT)


def _site_etcd(
    urls: str | None, ca: str | None, cert: str | None, key: str | None, prefix: str | None
) -> EtcdTarget | None:
    """--etcd and its TLS files as the replicas' target (None: the job's own cluster)."""
    if urls is None:
        if any((ca, cert, key, prefix)):
            raise click.UsageError("--etcd-ca/--etcd-cert/--etcd-key/--etcd-prefix need --etcd")
        return None
    if (cert is None) != (key is None):
        raise click.UsageError("--etcd-cert and --etcd-key go together")
    job = os.environ.get("SLURM_JOB_ID") or os.urandom(6).hex()

    def abspath(p: str | None) -> str | None:  # replicas may start elsewhere
        return str(Path(p).resolve()) if p else None

    try:
        target = EtcdTarget.from_dict(
            {
                "endpoints": [u.strip() for u in urls.split(",") if u.strip()],
                "prefix": prefix or f"/resild/{job}",
                "ca": abspath(ca),
                "cert": abspath(cert),
                "key": abspath(key),
            }
        )
    except (ValueError, KeyError) as e:
        raise click.UsageError(f"--etcd: {e}") from None
    plain = [u for u in target.endpoints if u.startswith("http://")]
    if plain:  # the journal decides who leads and what was committed: anyone on the path may rewrite it
        click.echo(
            f"resild: warning: --etcd {','.join(plain)} is plain HTTP: the job's journal and leader election "
            "go unencrypted and unauthenticated; use https:// with --etcd-ca/--etcd-cert/--etcd-key",
            err=True,
        )
    return target


if __name__ == "__main__":
    main()
