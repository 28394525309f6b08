"""Prometheus metrics of the node agent (prometheus-client, own registry).

Verdicts are exported as numbers (0 healthy, 1 degraded, 2 failed) so that
alerts can say `max by (node) (resild_node_verdict) == 2`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from resild.health.model import HealthEvent, Verdict
from resild.health.probes import Outcome


class Metrics:
    def __init__(self, node: str) -> None:
        self.node = node
        self.registry = CollectorRegistry()
        r = self.registry
        self.node_verdict = Gauge(
            "resild_node_verdict", "Node verdict: 0 healthy, 1 degraded, 2 failed", ["node"], registry=r
        )
        self.gpu_verdict = Gauge(
            "resild_gpu_verdict", "GPU verdict: 0 healthy, 1 degraded, 2 failed", ["node", "gpu", "uuid"], registry=r
        )
        self.gpu_ecc = Gauge(
            "resild_gpu_ecc_uncorrected", "Uncorrected volatile ECC errors", ["node", "gpu"], registry=r
        )
        self.gpu_temp = Gauge("resild_gpu_temperature_celsius", "GPU temperature", ["node", "gpu"], registry=r)
        self.xids = Counter("resild_xid", "Xid events seen, by GPU and code", ["node", "gpu", "code"], registry=r)
        self.probe_latency = Histogram(
            "resild_probe_latency_seconds",
            "Probe check latency",
            ["node", "probe"],
            registry=r,
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30),
        )
        self.probe_errors = Counter(
            "resild_probe_errors", "Probe checks that raised or timed out", ["node", "probe"], registry=r
        )
        self.probe_verdict = Gauge("resild_probe_verdict", "Probe verdict: 0/1/2", ["node", "probe"], registry=r)
        self.heartbeat_age = Gauge(
            "resild_heartbeat_age_seconds",
            "Seconds since the last heartbeat sent to the controller",
            ["node"],
            registry=r,
        )
        self.watched = Gauge(
            "resild_watched_processes", "Watched training processes by state", ["node", "state"], registry=r
        )

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        start_http_server(port, addr=addr, registry=self.registry)

    def on_outcomes(self, outcomes: Mapping[str, Outcome]) -> None:
        for name, o in outcomes.items():
            self.probe_latency.labels(self.node, name).observe(o.latency_s)
            self.probe_verdict.labels(self.node, name).set(o.result.verdict.severity)
            if o.error:
                self.probe_errors.labels(self.node, name).inc()
        gpu = outcomes.get("gpu")
        if gpu is not None:
            self.on_gpus(gpu.result.details.get("gpus", []))

    def on_gpus(self, gpus: list[dict[str, Any]]) -> None:
        for st in gpus:
            idx = str(st["index"])
            self.gpu_verdict.labels(self.node, idx, st.get("uuid") or "").set(Verdict(st["verdict"]).severity)
            if st.get("ecc_uncorrected") is not None:
                self.gpu_ecc.labels(self.node, idx).set(st["ecc_uncorrected"])
            if st.get("temperature_c") is not None:
                self.gpu_temp.labels(self.node, idx).set(st["temperature_c"])

    def on_event(self, ev: HealthEvent) -> None:
        if ev.kind == "xid" and ev.code is not None:
            gpu = "" if ev.gpu_index is None else str(ev.gpu_index)
            self.xids.labels(self.node, gpu, str(ev.code)).inc()

    def on_node(self, verdict: Verdict) -> None:
        self.node_verdict.labels(self.node).set(verdict.severity)
