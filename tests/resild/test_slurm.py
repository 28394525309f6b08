from __future__ import annotations

import subprocess

import pytest

from resild import slurm
from resild.slurm import (
    Allocation,
    SlurmEnvError,
    SlurmError,
    allocation_from_env,
    drain_cmd,
    expand_nodelist,
    requeue_cmd,
    sanitize_text,
    split_roles,
    srun_node_launcher_cmd,
)

BATCH_ENV = {  # as seen by a batch script in the lab (trimmed)
    "SLURM_JOB_ID": "42",
    "SLURM_JOB_NODELIST": "node[1-4,7]",
    "SLURM_JOB_NUM_NODES": "5",
    "SLURM_NNODES": "5",
    "SLURMD_NODENAME": "node1",
    "SLURM_SUBMIT_HOST": "login1",
    "SLURM_JOB_PARTITION": "debug",
}


# -- host lists / allocation -------------------------------------------------------------
def test_expand_ranges_keep_order() -> None:
    assert expand_nodelist("node[1-4,7]") == ["node1", "node2", "node3", "node4", "node7"]
    assert expand_nodelist("gpu[08-10],cpu1") == ["gpu08", "gpu09", "gpu10", "cpu1"]
    assert expand_nodelist("b,a") == ["b", "a"]


@pytest.mark.parametrize("bad", ["node[1-", "", "node[1-2],node2"])
def test_expand_rejects_bad_lists(bad: str) -> None:
    with pytest.raises(SlurmEnvError):
        expand_nodelist(bad)


def test_allocation_in_batch_script() -> None:
    a = allocation_from_env(BATCH_ENV)
    assert a == Allocation(
        job_id="42",
        nodes=("node1", "node2", "node3", "node4", "node7"),
        nodelist="node[1-4,7]",
        node="node1",
        step_id=None,
        submit_host="login1",
        partition="debug",
        restart_count=0,
    )
    assert a.num_nodes == 5 and a.batch_host == "node1"


def test_allocation_in_step_has_no_batch_host() -> None:
    # inside a step SLURM_NNODES is the step's node count, not the job's
    env = {
        **BATCH_ENV,
        "SLURMD_NODENAME": "node3",
        "SLURM_STEP_ID": "0",
        "SLURM_NNODES": "1",
        "SLURM_RESTART_COUNT": "2",
    }
    a = allocation_from_env(env)
    assert a is not None
    assert (a.node, a.step_id, a.batch_host, a.restart_count) == ("node3", "0", None, 2)


def test_no_slurm_env_is_none() -> None:
    assert allocation_from_env({"PATH": "/bin"}) is None


@pytest.mark.parametrize(
    "patch, msg",
    [
        ({"SLURM_JOB_ID": None}, "SLURM_JOB_ID is not"),
        ({"SLURM_JOB_NODELIST": None}, "SLURM_JOB_NODELIST is missing"),
        ({"SLURM_JOB_ID": "12a"}, "not a job id"),
        ({"SLURM_JOB_NUM_NODES": "4"}, "has 5 nodes"),
        ({"SLURM_JOB_NUM_NODES": "five"}, "not an integer"),
        ({"SLURMD_NODENAME": "node9"}, "not in SLURM_JOB_NODELIST"),
        ({"SLURM_JOB_NODELIST": "node[1-"}, "bad Slurm node list"),
        ({"SLURM_RESTART_COUNT": "-1"}, "negative"),
    ],
)
def test_inconsistent_env_raises(patch: dict[str, str | None], msg: str) -> None:
    env = {k: v for k, v in {**BATCH_ENV, **patch}.items() if v is not None}
    with pytest.raises(SlurmEnvError, match=msg):
        allocation_from_env(env)


# -- roles -------------------------------------------------------------------------------
def test_split_roles_spares_are_the_tail() -> None:
    nodes = ["node1", "node2", "node3", "node4"]
    assert split_roles(nodes, 1) == (["node1", "node2", "node3"], ["node4"])
    assert split_roles(nodes, 0) == (nodes, [])


@pytest.mark.parametrize(
    "nodes, spares, exc, msg",
    [
        (["a", "b"], 2, ValueError, "at least one node must stay active"),
        (["a", "b"], 3, ValueError, "only 2 node"),
        ([], 0, ValueError, "only 0 node"),
        (["a", "b"], -1, ValueError, ">= 0"),
        (["a", "a", "b"], 1, ValueError, "duplicate"),
        (["a", "b"], 1.0, TypeError, "int"),
        (["a", "b"], True, TypeError, "int"),
        ("node1", 0, TypeError, "not a string"),
    ],
)
def test_split_roles_errors(nodes: list[str], spares: int, exc: type[Exception], msg: str) -> None:
    with pytest.raises(exc, match=msg):
        split_roles(nodes, spares)


# -- srun --------------------------------------------------------------------------------
ALLOC = Allocation(job_id="42", nodes=("node1", "node2", "node3", "node4", "node7"), nodelist="node[1-4,7]")


def test_srun_one_step_over_all_nodes() -> None:
    cmd = srun_node_launcher_cmd(ALLOC, ["node7", "node1", "node2"], ["resil-node", "--port", "5"])
    assert cmd == [
        "srun", "--jobid=42", "--no-kill", "--kill-on-bad-exit=0", "--wait=0", "--overlap", "--whole",
        "-N", "3", "--ntasks-per-node=1", "--nodelist=node[1-2,7]", "--export=ALL",
        "resil-node", "--port", "5",
    ]  # fmt: skip


def test_srun_extra_env_goes_through_env_not_export() -> None:
    # srun --export splits at commas even inside values, so extra env goes via env(1)
    cmd = srun_node_launcher_cmd(ALLOC, ["node1"], ["python", "-m", "x"], {"A": "1,2", "B_2": "x y"})
    assert cmd[cmd.index("--export=ALL") + 1 :] == ["env", "A=1,2", "B_2=x y", "python", "-m", "x"]


@pytest.mark.parametrize(
    "nodes, cmd, env, msg",
    [
        (["node9"], ["x"], None, "not in job 42"),
        ([], ["x"], None, "no nodes"),
        (["node1", "node1"], ["x"], None, "duplicate"),
        (["node1"], [], None, "non-empty argv"),
        (["node1"], "x", None, "non-empty argv"),
        (["node1"], ["x"], {"A-B": "1"}, "invalid environment variable"),
        (["node1"], ["A=1"], {"B": "1"}, "contains '='"),
    ],
)
def test_srun_errors(nodes: list[str], cmd: list[str], env: dict[str, str] | None, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        srun_node_launcher_cmd(ALLOC, nodes, cmd, env)


# -- scontrol ----------------------------------------------------------------------------
def test_drain_cmd_sanitises_reason() -> None:
    assert drain_cmd("node3", 'gpu 2 "xid 79"\n  second\tline') == [
        "scontrol", "update", "NodeName=node3", "State=DRAIN", "Reason=resild: gpu 2 xid 79 second line",
    ]  # fmt: skip


def test_sanitize_limits_and_strips() -> None:
    assert sanitize_text("it's `x`\r\n\x00y") == "its x y"
    long = sanitize_text("a" * 150 + " " + "b" * 150)
    assert len(long) <= 200 and long.startswith("a" * 150)
    assert len(drain_cmd("n1", "z" * 500)[-1]) == len("Reason=resild: ") + 200
    with pytest.raises(ValueError, match="empty"):
        sanitize_text(" \n\"' ")


@pytest.mark.parametrize("node", ["node[1-2]", "node1,node2", "", "node 1", "NodeName=x"])
def test_drain_cmd_rejects_non_single_node(node: str) -> None:
    with pytest.raises(ValueError, match="invalid node name"):
        drain_cmd(node, "x")


def test_requeue_sets_comment_then_requeues() -> None:
    assert requeue_cmd(42, "node2 lost:\n no spare") == [
        ["scontrol", "update", "JobId=42", "Comment=resild: node2 lost: no spare"],
        ["scontrol", "requeue", "42"],
    ]
    with pytest.raises(ValueError, match="invalid job id"):
        requeue_cmd("42 43", "x")


def test_drain_raises_slurm_error_with_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def fake_run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        seen.update(kw, cmd=cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "slurm_update error: Invalid node name specified\n")

    monkeypatch.setattr(slurm.subprocess, "run", fake_run)
    with pytest.raises(SlurmError, match="Invalid node name specified") as ei:
        slurm.drain("nodeX", "test", timeout_s=3)
    assert ei.value.returncode == 1 and ei.value.cmd[:2] == ["scontrol", "update"]
    assert seen["timeout"] == 3


def test_drain_timeout_and_missing_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    def hang(cmd: list[str], **kw: object) -> None:
        raise subprocess.TimeoutExpired(cmd, 1)

    monkeypatch.setattr(slurm.subprocess, "run", hang)
    with pytest.raises(SlurmError, match="timed out"):
        slurm.requeue(1, "x", timeout_s=1)
    monkeypatch.setattr(slurm.subprocess, "run", lambda *a, **k: (_ for _ in ()).throw(FileNotFoundError("scontrol")))
    with pytest.raises(SlurmError, match="could not run"):
        slurm.drain("node1", "x")


# -- the default run directory of resil-run under Slurm (launcher/run/slurm_mode.py) -----------------
SHOW_JOB = (
    "JobId=42 JobName=x\n   SubmitTime=2026-11-30T13:54:43 EligibleTime=2026-11-30T13:56:44\n"
    "   StartTime=2026-11-30T13:56:44 EndTime=Unknown Deadline=N/A\n"
)


def _runner(show_job: str | None = SHOW_JOB, config: str | None = "ClusterName             = fromconfig\n"):
    calls: list[list[str]] = []

    def run(argv: list[str]) -> str | None:
        calls.append(argv)
        return show_job if argv[:3] == ["scontrol", "show", "job"] else config

    return run, calls


def test_run_dir_name_has_cluster_job_restarts_and_start_time() -> None:
    from launcher.run.slurm_mode import default_run_dir_name

    run, calls = _runner()
    env = {**BATCH_ENV, "SLURM_CLUSTER_NAME": "resildlab"}
    assert default_run_dir_name("42", env, run) == "resildlab-job-42-r0-20261130T135644"
    assert calls == [["scontrol", "show", "job", "42"]]  # the cluster name came from the env
    env["SLURM_RESTART_COUNT"] = "3"
    assert default_run_dir_name("42", env, run) == "resildlab-job-42-r3-20261130T135644"


def test_run_dir_name_differs_for_a_reused_job_id_and_a_requeue() -> None:
    from launcher.run.slurm_mode import default_run_dir_name

    env = {**BATCH_ENV, "SLURM_CLUSTER_NAME": "c"}
    first = default_run_dir_name("42", env, _runner()[0])
    later = default_run_dir_name(
        "42", env, _runner(SHOW_JOB.replace("StartTime=2026-11-30T13:56:44", "StartTime=2026-12-01T08:00:00"))[0]
    )
    requeued = default_run_dir_name("42", {**env, "SLURM_RESTART_COUNT": "1"}, _runner()[0])
    other_cluster = default_run_dir_name("42", {**env, "SLURM_CLUSTER_NAME": "d"}, _runner()[0])
    assert len({first, later, requeued, other_cluster}) == 4


def test_run_dir_name_fallbacks() -> None:
    from launcher.run.slurm_mode import default_run_dir_name

    now = 1_700_000_000.0
    stamp = __import__("time").strftime("%Y%m%dT%H%M%S", __import__("time").localtime(now))
    # no SLURM_CLUSTER_NAME: scontrol show config
    run, calls = _runner()
    assert default_run_dir_name("7", BATCH_ENV, run).startswith("fromconfig-job-7-r0-")
    assert ["scontrol", "show", "config"] in calls
    # no scontrol at all: "cluster" and resil-run's own start time
    assert default_run_dir_name("7", BATCH_ENV, lambda argv: None, now=lambda: now) == f"cluster-job-7-r0-{stamp}"
    # newer Slurm gives the start time in the environment: no scontrol call needed
    run, calls = _runner(show_job=None)
    env = {**BATCH_ENV, "SLURM_CLUSTER_NAME": "a/b c", "SLURM_JOB_START_TIME": str(int(now))}
    assert default_run_dir_name("7", env, run) == f"a_b_c-job-7-r0-{stamp}"
    assert calls == []


# -- releasing the allocation when the controller is gone (resild/slurm.py, launcher/node/lease.py) ------
def _err(stderr: str, rc: int | None = 1) -> SlurmError:
    return SlurmError(f"scontrol requeue 42 failed (exit {rc}): {stderr}", ["scontrol", "requeue", "42"], rc, stderr)


@pytest.mark.parametrize(
    "err, decision",
    [
        (None, "requeued"),
        # texts measured on the Slurm 22.05 lab
        (_err("Requested operation is presently disabled for job 42"), "cancel"),
        (_err("Job is pending execution for job 42"), "already_requeued"),  # another node requeued it first
        (_err("slurm_update error: Job has already finished"), "gone"),
        (_err("Invalid job id specified for job 42"), "gone"),
        (SlurmError("scontrol requeue 42 timed out after 10s", ["scontrol"], None), "cancel"),
        (SlurmError("scontrol update ... could not run: [Errno 2] No such file", ["scontrol"], None), "cancel"),
        (_err("Access/permission denied for job 42"), "cancel"),
    ],
)
def test_after_requeue_decision(err: SlurmError | None, decision: str) -> None:
    from resild.slurm import after_requeue

    assert after_requeue(err) == decision


class _FakeSlurm:
    """Stands in for slurm.requeue / slurm.cancel: records calls, raises what it is told."""

    def __init__(self, requeue_err: SlurmError | None = None, cancel_err: SlurmError | None = None) -> None:
        self.calls: list[tuple] = []
        self.requeue_err, self.cancel_err = requeue_err, cancel_err

    def requeue(self, job_id: str, comment: str, timeout_s: float) -> None:
        self.calls.append(("requeue", job_id, comment, timeout_s))
        if self.requeue_err is not None:
            raise self.requeue_err

    def cancel(self, job_id: str, timeout_s: float) -> None:
        self.calls.append(("cancel", job_id, timeout_s))
        if self.cancel_err is not None:
            raise self.cancel_err

    def release(self, mode: str = "requeue") -> str:
        from resild.slurm import release_job

        return release_job(
            "42", "controller lost (x)", mode, requeue_fn=self.requeue, cancel_fn=self.cancel, timeout_s=7
        )


def test_release_requeues_and_does_not_cancel() -> None:
    f = _FakeSlurm()
    assert f.release() == "requeued Slurm job 42"
    assert f.calls == [("requeue", "42", "controller lost (x)", 7)]


def test_release_not_requeueable_cancels_and_says_so() -> None:
    f = _FakeSlurm(_err("Requested operation is presently disabled for job 42"))
    assert f.release() == (
        "could not requeue Slurm job 42 (Requested operation is presently disabled for job 42): cancelled it"
    )
    assert [c[0] for c in f.calls] == ["requeue", "cancel"] and f.calls[1][2] == 7


def test_release_by_the_second_node_is_quiet_and_cancels_nothing() -> None:
    f = _FakeSlurm(_err("Job is pending execution for job 42"))
    assert f.release() == "Slurm job 42 already requeued"
    assert [c[0] for c in f.calls] == ["requeue"]
    f = _FakeSlurm(_err("Invalid job id specified for job 42"))
    assert f.release() == "Slurm job 42 already ended"
    assert [c[0] for c in f.calls] == ["requeue"]


def test_release_modes_and_a_failing_scancel() -> None:
    f = _FakeSlurm()
    assert f.release("cancel") == "cancelled Slurm job 42" and [c[0] for c in f.calls] == ["cancel"]
    f = _FakeSlurm()
    assert f.release("none") == "left Slurm job 42 alone" and f.calls == []
    from launcher.node.lease import release

    assert release("42", "x", "none") == "left Slurm job 42 alone (RESILD_ON_CONTROLLER_LOST=none)"
    f = _FakeSlurm(
        SlurmError("scontrol requeue 42 timed out after 7s", ["scontrol"], None),
        _err("scancel: error: Kill job error on job id 42: Access/permission denied"),
    )
    out = f.release()
    assert out.startswith("could not requeue Slurm job 42 (scontrol requeue 42 timed out after 7s): scancel 42 failed")
    assert "\n" not in out


def test_release_through_scontrol_and_scancel_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real slurm.requeue / slurm.cancel underneath: comment, requeue, then scancel --state=RUNNING
    (a plain scancel would cancel a requeue another node process just made), each with the timeout."""
    from resild.slurm import release_job

    seen: list[tuple[list[str], object]] = []

    def fake_run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        seen.append((cmd, kw["timeout"]))
        if cmd[:2] == ["scontrol", "requeue"]:
            return subprocess.CompletedProcess(cmd, 1, "", "Requested operation is presently disabled for job 42\n")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(slurm.subprocess, "run", fake_run)
    out = release_job(
        "42", "controller lost (no word from tcp://10.0.0.1:5555 for 5.0s; batch host down?)", timeout_s=4
    )
    assert out.endswith("cancelled it")
    assert seen == [
        (["scontrol", "update", "JobId=42",
          "Comment=resild: controller lost (no word from tcp://10.0.0.1:5555 for 5.0s; batch host down?)"], 4),
        (["scontrol", "requeue", "42"], 4),
        (["scancel", "--state=RUNNING", "42"], 4),
    ]  # fmt: skip
    assert slurm.cancel_cmd(7, only_running=False) == ["scancel", "7"]
    with pytest.raises(ValueError, match="invalid job id"):
        slurm.cancel_cmd("7;8")


def test_release_only_in_a_slurm_step_on_its_own_node() -> None:
    from launcher.node.lease import mode_from_env, slurm_job_id

    step = {**BATCH_ENV, "SLURMD_NODENAME": "node3", "SLURM_STEP_ID": "0"}
    assert slurm_job_id(step, "node3") == "42"
    assert slurm_job_id(BATCH_ENV, "node1") is None  # no step: not started by srun
    assert slurm_job_id(step, "local-node0") is None  # resil-run --local inside an srun step
    assert slurm_job_id({"PATH": "/bin"}, "node3") is None
    assert mode_from_env({}) == ("requeue", "")
    assert mode_from_env({"RESILD_ON_CONTROLLER_LOST": " Cancel "}) == ("cancel", "")
    assert mode_from_env({"RESILD_ON_CONTROLLER_LOST": "none"}) == ("none", "")
    mode, note = mode_from_env({"RESILD_ON_CONTROLLER_LOST": "kill"})
    assert mode == "requeue" and "unknown" in note


def test_a_cold_spare_job_takes_the_jobs_account_partition_qos_and_constraints() -> None:
    fields = {
        "JobId": "42",
        "JobName": "train",
        "Account": "ml",
        "Partition": "gpu",
        "QOS": "normal",
        "Features": "h200&ib",
    }
    cmd = slurm.cold_spare_cmd("/shared/run dir", "/opt/py/bin/python", fields, "/shared/run dir/spare-%j.out")
    assert cmd[:3] == ["sbatch", "--parsable", "-N"] and "--no-requeue" in cmd
    assert {"--account=ml", "--partition=gpu", "--qos=normal", "--constraint=h200&ib"} <= set(cmd)
    assert "--job-name=resild-spare-42-train" in cmd
    assert cmd[-1] == "--wrap=/opt/py/bin/python -m launcher.run.cli --join '/shared/run dir'"
    bare = slurm.cold_spare_cmd("/r", "python", {"JobId": "7", "Account": "(null)", "Features": "(null)"}, "/r/o")
    assert not any(a.startswith(("--account", "--constraint", "--partition")) for a in bare)
