"""`resild`: the node agent and its tools.

Exit codes of status / check: 0 healthy, 1 degraded, 2 failed, 3 no answer.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any, NoReturn

import click

from resild.health.config import Config, ConfigError, load_config
from resild.health.model import Verdict
from resild.wire.protocol import MsgType

EXIT_NO_ANSWER = 3


def _fail(msg: str, code: int) -> NoReturn:
    click.echo(f"resild: {msg}", err=True)
    sys.exit(code)


def _config(path: str | None, **overrides: Any) -> Config:
    try:
        return load_config(path, overrides=overrides)
    except ConfigError as e:
        _fail(str(e), 2)


_config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False),
    help="TOML config file [default: /etc/resild/resild.toml if present; env RESILD_CONFIG].",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """resild: GPU/node health agent for checkpointless training on Slurm.

    \b
    Examples:
      resild daemon --config /etc/resild/resild.toml   # the node agent (systemd)
      resild status                                    # what the local agent sees
      resild check --drain                             # Slurm HealthCheckProgram
      resild cluster --controller tcp://head:5555 --keys /etc/resild/keys
      resild keys /etc/resild/keys                     # make CURVE keys
      resild report run.jsonl --plot run.png           # where a job's time went (resil-run --events)
    """


# -- daemon ------------------------------------------------------------------------


@cli.command()
@_config_option
@click.option("--controller", help="Controller endpoint, e.g. tcp://head:5555 (none: standalone).")
@click.option("--keys", "keys_dir", help="CURVE key directory (see `resild keys`).")
@click.option("--node", help="Node name [default: hostname].")
@click.option("--status-socket", help="Local status socket path.")
@click.option("--metrics-port", type=int, help="Prometheus port (0: off).")
@click.option("--kmsg-path", help="Kernel log to follow [default: /dev/kmsg].")
@click.option("--probes", help="Comma-separated probes, e.g. gpu,kmsg,infiniband.")
@click.option("-v", "--verbose", is_flag=True, help="Log at INFO instead of WARNING.")
def daemon(config_path: str | None, probes: str | None, verbose: bool, **overrides: Any) -> None:
    """Run the node agent (foreground; systemd Type=notify).

    \b
    Example:
      resild daemon --config /etc/resild/resild.toml
      resild daemon --probes gpu,kmsg,diskspace --status-socket /tmp/resild.sock
    """
    from resild.daemon.agent import Agent

    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    cfg = _config(config_path, probes=probes.split(",") if probes else None, **overrides)
    try:
        agent = Agent(cfg, probes=None)
    except ConfigError as e:
        _fail(str(e), 2)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stop())
    try:
        agent.start()
    except Exception as e:
        agent.close()
        _fail(f"cannot start: {e}", 1)
    try:
        agent.run()
    finally:
        agent.close()


# -- status ------------------------------------------------------------------------


def _exit_for(verdict: str) -> int:
    try:
        return Verdict(verdict).severity
    except ValueError:
        return 2


@cli.command()
@_config_option
@click.option("--socket", "status_socket", help="Daemon status socket [default: from config].")
@click.option("--timeout", "timeout_s", type=float, help="Seconds to wait for the daemon.")
@click.option("--json", "as_json", is_flag=True, help="Print the daemon's full JSON answer.")
def status(config_path: str | None, status_socket: str | None, timeout_s: float | None, as_json: bool) -> None:
    """Ask the local agent how this node is. Exit 0/1/2 healthy/degraded/failed, 3 no answer.

    \b
    Example:
      resild status            # table: node verdict, GPUs, watched processes
      resild status --json | jq .gpus
    """
    from resild.wire.local_socket import local_request

    cfg = _config(config_path, status_socket=status_socket, status_timeout_s=timeout_s)
    reply = local_request(cfg.status_endpoint, MsgType.STATUS, timeout_s=cfg.status_timeout_s)
    if reply is None:
        _fail(
            f"no resild daemon answered on {cfg.status_endpoint} within "
            f"{cfg.status_timeout_s:g}s (is `resild daemon` running?)",
            EXIT_NO_ANSWER,
        )
    if reply.type is not MsgType.STATUS_REPLY:
        _fail(f"daemon refused: {reply.body.get('detail', reply.body)}", EXIT_NO_ANSWER)
    body = reply.body
    click.echo(json.dumps(body, indent=2) if as_json else format_status(body))
    sys.exit(_exit_for(str(body.get("verdict"))))


def _cell(v: Any) -> str:
    return "-" if v is None or v == [] else str(v)


def format_gpus(gpus: list[dict[str, Any]]) -> list[str]:
    rows = [("GPU", "UUID", "VERDICT", "LAST XID", "ECC UNC", "REMAP", "NVLINK DOWN", "THROTTLE", "TEMP")]
    for g in gpus:
        xid = "-"
        if g.get("last_xid") is not None:
            when = time.strftime("%H:%M:%S", time.localtime(g["last_xid_wall"])) if g.get("last_xid_wall") else "?"
            xid = f"{g['last_xid']} @{when}"
        remap = g.get("remap")
        remap_s = (
            "-"
            if remap is None
            else (
                "FAILED"
                if remap.get("failure")
                else "pending"
                if remap.get("pending")
                else f"ok ({remap.get('uncorrected_rows', 0)} unc)"
            )
        )
        rows.append(
            (
                str(g["index"]),
                _cell(g.get("uuid")),
                str(g.get("verdict")),
                xid,
                _cell(g.get("ecc_uncorrected")),
                remap_s,
                ",".join(map(str, g.get("nvlink_down") or [])) or "-",
                ",".join(g.get("throttle_reasons") or []) or "-",
                "-" if g.get("temperature_c") is None else f"{g['temperature_c']}C",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def format_status(b: dict[str, Any]) -> str:
    lines = [f"node {b.get('node')}: {str(b.get('verdict')).upper()}"]
    lines += [f"  - {r}" for r in b.get("reasons") or []]
    if b.get("gpus"):
        lines += ["", *format_gpus(b["gpus"])]
    probes = b.get("probes") or {}
    if probes:
        lines += [
            "",
            "probes: "
            + ", ".join(f"{n} {p['verdict']} ({p.get('latency_s', 0) * 1000:.0f} ms)" for n, p in probes.items()),
        ]
    procs = b.get("processes") or []
    lines += ["", "watched processes:" if procs else "watched processes: none"]
    for p in procs:
        step = f" step {p['step']}" if p.get("step") is not None else ""
        lines.append(
            f"  pid {p['pid']} {p['name']}: {p['state']}{step}, idle {p.get('idle_s')}s"
            + (f" ({p['reason']})" if p.get("reason") else "")
        )
    if b.get("controller"):
        lines.append(f"controller {b['controller']}, last heartbeat {_cell(b.get('heartbeat_age_s'))}s ago")
    return "\n".join(lines)


# -- check -------------------------------------------------------------------------


@cli.command()
@_config_option
@click.option("--probes", help="Comma-separated probes to run [default: from config].")
@click.option("--drain", is_flag=True, help="Drain this node in Slurm when the check fails.")
@click.option(
    "--drain-on",
    type=click.Choice(["failed", "degraded"]),
    default="failed",
    show_default=True,
    help="Lowest verdict that drains (with --drain).",
)
@click.option(
    "--qualify",
    is_flag=True,
    help="Qualify the node to hold ranks (a spare that joins or comes back): every probe healthy "
    "(degraded is not enough) and a GPU self-test (matmul against a float64 reference, host-device "
    "copy) passes. Exit 0 qualified, 2 not.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the results as JSON.")
def check(
    config_path: str | None, probes: str | None, drain: bool, drain_on: str, qualify: bool, as_json: bool
) -> None:
    """Run every probe once. Exit 0/1/2 healthy/degraded/failed (--qualify: 0/2 qualified/not).

    Usable as Slurm's HealthCheckProgram; with --drain a failing node drains itself:
    scontrol update NodeName=<node> State=DRAIN Reason="resild: GPU 3 Xid 79 ...".

    \b
    Example (slurm.conf):
      HealthCheckProgram=/usr/local/bin/resild-check   # a script: exec resild check --drain
      HealthCheckInterval=300
    """
    from resild.health.probes import (
        ProbeRunner,
        aggregate,
        build_probes,
        fault_summary,
        run_all,
        start_probes,
        stop_probes,
    )

    cfg = _config(config_path, probes=probes.split(",") if probes else None)
    try:
        plist = build_probes(cfg, follow=False)
    except ConfigError as e:
        _fail(str(e), 2)
    try:
        start_probes(plist)
        outcomes = run_all(ProbeRunner(p, cfg.probe_timeout_s) for p in plist)
    finally:
        stop_probes(plist)
    results = {n: o.result for n, o in outcomes.items()}
    verdict, reasons = aggregate(results)
    extra: dict[str, Any] = {}
    qualified = None
    if qualify:
        from resild.health import selftest
        from resild.health.qualify import qualification

        st = selftest.run()
        q = qualification(verdict, reasons, st)
        qualified = q.qualified
        extra = {"qualified": q.qualified, "qualification": list(q.reasons), "selftest": st.to_dict()}
    if as_json:
        click.echo(
            json.dumps(
                {
                    "node": cfg.node,
                    "verdict": verdict.value,
                    "reasons": reasons,
                    "probes": {n: {**o.result.to_dict(), "latency_s": o.latency_s} for n, o in outcomes.items()},
                    **extra,
                },
                indent=2,
            )
        )
    else:
        click.echo(f"node {cfg.node}: {verdict.value.upper()}")
        click.echo("\n".join(f"  - {r}" for r in reasons) or "  all probes healthy")
        gpu = results.get("gpu")
        if gpu is not None and gpu.details.get("gpus"):
            click.echo("\n".join(format_gpus(gpu.details["gpus"])))
        if qualify:
            click.echo(f"qualification: {'QUALIFIED' if qualified else 'NOT QUALIFIED'}")
            click.echo("\n".join(f"  - {r}" for r in extra["qualification"]) or "  self-test passed")
    threshold = Verdict.DEGRADED if drain_on == "degraded" else Verdict.FAILED
    if drain and verdict.severity >= threshold.severity:
        from resild.slurm import SlurmError
        from resild.slurm import drain as slurm_drain

        summary = fault_summary(results)
        try:
            slurm_drain(cfg.node, summary)
            click.echo(f"drained {cfg.node}: resild: {summary}", err=True)
        except (SlurmError, ValueError) as e:
            click.echo(f"resild: could not drain {cfg.node}: {e}", err=True)
    if qualify:
        sys.exit(0 if qualified else 2)
    sys.exit(verdict.severity)


# -- cluster -----------------------------------------------------------------------


def _width_and_pool(b: dict[str, Any]) -> str:
    """', 4 of 6 ranks (shrunk), spares: 1 hot, 1 starting, 2 queued (target 2)' from a STATUS
    reply; '' for a controller that says neither."""
    out = ""
    w, full = b.get("world_size"), b.get("full_world")
    if isinstance(w, int) and isinstance(full, int) and full:
        out += f", {w} of {full} ranks" + (" (shrunk)" if w < full else "")
    pool = b.get("pool")
    if isinstance(pool, dict):
        out += f", spares: {pool.get('hot', 0)} hot, {pool.get('starting', 0)} starting, {pool.get('queued', 0)} queued"
        out += f" (target {pool['target']})" if pool.get("target") else ""
    return out


@cli.command()
@click.option("--controller", required=True, help="Controller endpoint, e.g. tcp://head:5555.")
@click.option(
    "--keys", "keys_dir", type=click.Path(file_okay=False), help="CURVE key directory shared with the controller."
)
@click.option("--timeout", "timeout_s", type=float, default=5.0, show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the controller's JSON answer.")
def cluster(controller: str, keys_dir: str | None, timeout_s: float, as_json: bool) -> None:
    """Ask a controller for every node's role, health and ranks. Exit 3 on no answer.

    \b
    Example:
      resild cluster --controller tcp://head:5555 --keys /etc/resild/keys
    """
    import zmq

    from resild.wire.channel import connect
    from resild.wire.keys import KeyDir

    keys = KeyDir(Path(keys_dir)) if keys_dir else None
    ctx = zmq.Context()
    try:
        ch = connect(ctx, controller, keys, sender=f"cli-{int(time.time() * 1000) % 10**9}")
    except (OSError, ValueError, zmq.ZMQError) as e:
        _fail(f"cannot connect to {controller}: {e}", EXIT_NO_ANSWER)
    try:
        ch.send(MsgType.STATUS, {})
        deadline = time.monotonic() + timeout_s
        reply = None
        while reply is None and (left := deadline - time.monotonic()) > 0:
            got = ch.recv(left)
            if got is not None and got[1].type in (MsgType.STATUS_REPLY, MsgType.ERROR):
                reply = got[1]
    finally:
        ch.close()
        ctx.term()
    if reply is None:
        _fail(
            f"no controller answered on {controller} within {timeout_s:g}s"
            + ("" if keys else " (no --keys: a CURVE controller ignores plain clients)"),
            EXIT_NO_ANSWER,
        )
    if reply.type is MsgType.ERROR:
        _fail(f"controller refused: {reply.body.get('detail')}", EXIT_NO_ANSWER)
    b = reply.body
    if as_json:
        click.echo(json.dumps(b, indent=2))
        return
    click.echo(f"epoch {b.get('epoch')}, committed step {b.get('max_step')}{_width_and_pool(b)}")
    rows = [("NODE", "ROLE", "HEALTH", "RANKS", "HEARTBEAT AGE", "REASON")]
    for n in b.get("nodes", []):
        age = n.get("heartbeat_age_s")
        rows.append(
            (
                str(n.get("node")),
                str(n.get("role")),
                str(n.get("health")),
                ",".join(map(str, n.get("ranks") or [])) or "-",
                "-" if age is None else f"{age:.1f}s",
                n.get("reason") or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    click.echo("\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows))


# -- report ------------------------------------------------------------------------


@cli.command()
@click.argument("events_file", metavar="EVENTS.jsonl", type=click.Path(dir_okay=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the breakdown as JSON (seconds; shares are 0..1).")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Draw the timeline to FILE: a PNG, or an HTML page (PNG, table and JSON) if FILE ends in .html.",
)
@click.option(
    "--job",
    "job_index",
    type=click.IntRange(min=1),
    default=None,
    help="Which job of the file (--events appends; 1 = the first) [default: the last].",
)
def report(events_file: Path, as_json: bool, plot_path: Path | None, job_index: int | None) -> None:
    """Where a job's time went, from its `resil-run --events` file.

    Splits the wall time into productive steps, start-up, each failure's recovery
    (detection, fence, re-form, replay, first step), redone steps, idle time and
    shutdown; these add up to the wall time. Goodput is productive / wall.

    \b
    Examples:
      resil-run --local --events run.jsonl --inject kill:node1@40 -- python train.py
      resild report run.jsonl                       # the table
      resild report run.jsonl --plot run.png        # + timeline: step vs time, faults, phases, spares
      resild report run.jsonl --plot run.html       # one self-contained page to share
      resild report run.jsonl --json | jq .goodput
    """
    from resild.report.goodput import EventFileError, analyze, format_breakdown, load_events

    suffix = plot_path.suffix.lower() if plot_path else ""
    if plot_path is not None and suffix not in (".png", ".html", ".htm"):
        _fail(f"--plot {plot_path}: the name must end in .png or .html", 2)
    try:
        b = analyze(load_events(events_file), job_index)
    except EventFileError as e:
        _fail(str(e), 2)
    if plot_path is not None:
        from resild.report.plot import write_plot

        try:
            write_plot(b, plot_path, title=events_file.name)
        except OSError as e:
            _fail(f"cannot write --plot {plot_path}: {e.strerror or e}", 2)
        except ImportError as e:  # the `report` extra is not installed
            _fail(f"--plot needs matplotlib ({e.name} is missing): pip install 'resild[report]'", 2)
    if as_json:
        click.echo(json.dumps(b.to_dict(), indent=2))
    else:
        click.echo(format_breakdown(b))
    if plot_path is not None:
        click.echo(f"timeline written to {plot_path}", err=True)


# -- keys --------------------------------------------------------------------------


@cli.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--force", is_flag=True, help="Replace keys that are already there.")
def keys(directory: str, force: bool) -> None:
    """Generate CURVE keys (server + client pair, 0600) in DIRECTORY.

    \b
    Example:
      resild keys /etc/resild/keys   # then copy it to every node and the controller host
    """
    from resild.wire.keys import generate_keys

    path = Path(directory)
    if (path / "server.key_secret").exists() and not force:
        _fail(
            f"{path} already holds keys; replacing them locks out every node "
            f"still using them (use --force to do it anyway)",
            2,
        )
    try:
        generate_keys(path)
    except OSError as e:
        _fail(f"cannot write keys in {path}: {e.strerror or e}", 2)
    click.echo(f"keys written to {path} (server.key, client.key, *.key_secret, authorized/)")


def main() -> None:
    cli(prog_name="resild")


if __name__ == "__main__":
    main()
