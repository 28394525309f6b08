"""Runs an NvmlProbe scenario in a fresh process (pynvml loads libnvidia-ml once
per process, so each test gets its own) and prints the outcome as JSON.

Usage: LD_LIBRARY_PATH=<fake lib dir> FAKE_NVML_CONTROL=<file> python probe_scenario.py '<steps json>'
Steps: {"op": "start", "kwargs": {...}} | {"op": "poll"} | {"op": "append", "lines": [...]}
       | {"op": "wait_events", "count": n, "kind": k, "timeout_s": s} | {"op": "sleep", "s": s}
       | {"op": "kmsg", "line": "..."} | {"op": "stop"}
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

from resild.health import NvmlProbe, NvmlUnavailable, node_verdict, parse_xid_line


def main(steps: list[dict]) -> dict:
    events: list[dict] = []
    cond = threading.Condition()

    def on_event(ev) -> None:
        with cond:
            events.append(ev.to_dict())
            cond.notify_all()

    control = os.environ["FAKE_NVML_CONTROL"]
    probe: NvmlProbe | None = None
    results: list[dict] = []
    for step in steps:
        op = step["op"]
        t0 = time.monotonic()
        res: dict = {"op": op}
        if op == "start":
            kwargs = step.get("kwargs", {})
            if "xid_overrides" in kwargs:
                kwargs["xid_overrides"] = {int(k): v for k, v in kwargs["xid_overrides"].items()}
            probe = NvmlProbe(on_event=on_event, **kwargs)
            try:
                probe.start()
                res["gpu_count"] = probe.gpu_count
                res["events_enabled"] = probe.events_enabled
            except NvmlUnavailable as e:
                res["error"] = type(e).__name__
                res["message"] = str(e)
                probe = None
        elif op == "poll":
            statuses = probe.poll()
            res["statuses"] = [s.to_dict() for s in statuses]
            verdict, reasons = node_verdict(statuses)
            res["node"] = {"verdict": verdict.value, "reasons": reasons}
        elif op == "append":
            res["t_wall"] = time.time()
            with open(control, "a") as f:
                f.write("".join(line + "\n" for line in step["lines"]))
        elif op == "wait_events":
            kind = step.get("kind")
            deadline = time.monotonic() + step.get("timeout_s", 5.0)
            with cond:
                while len([e for e in events if kind is None or e["kind"] == kind]) < step["count"]:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    cond.wait(left)
        elif op == "sleep":
            time.sleep(step["s"])
        elif op == "kmsg":
            xid = parse_xid_line(step["line"])
            ev = probe.ingest_kmsg_xid(xid)
            res["event"] = ev.to_dict() if ev else None
        elif op == "stop":
            probe.stop()
        else:
            raise ValueError(f"unknown op {op!r}")
        res["elapsed_s"] = time.monotonic() - t0
        results.append(res)
    if probe is not None:
        probe.stop()
    with cond:
        return {"results": results, "events": list(events)}


if __name__ == "__main__":
    out = main(json.loads(sys.argv[1]))
    sys.stdout.write(json.dumps(out) + "\n")
    sys.stdout.flush()
    # A deliberately hung NVML call may still be sleeping in a daemon thread.
    os._exit(0)
