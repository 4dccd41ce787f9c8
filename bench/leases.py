"""Server RSS and lease-sweep cost with 200 idle sessions holding leases.

Prints, in one run:
- the HTTP server's RSS (the server process, not its kernels) before and after 200 MCP
  sessions each take a lease (all on one named resource, so one kernel serves them);
- the server's CPU time while those 200 leases sit idle for a while (what the sweeper costs);
- the cost of one sweep pass over 200 leases, timed in-process on loommux's own Registry.

Run: python bench/leases.py
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time

from benchlib import (
    REPO,
    Bench,
    HttpClient,
    HttpServer,
    HttpSession,
    proc_cpu_seconds,
    proc_kib,
    run_and_report,
    server_env,
    timed_async,
)

import loommux  # this checkout's (benchlib puts it first on sys.path)

SESSIONS = 200
IDLE_SECONDS = 10.0
SWEEPS = 200
RESOURCE = "bench"
CLIENT_NAME = "loommux-bench-leases"


async def sweep_times() -> list[float]:
    """Seconds of each Registry.sweep() over SESSIONS live leases (no kernel is started)."""
    registry = loommux.Registry(loommux.KernelPool(REPO, {}), loommux.LeasePolicy(), loommux.DEFAULT_PATH)
    resource = loommux.Resource(registry.pool, RESOURCE)
    resource.id, resource.kind = RESOURCE, "named"
    registry.resources[resource.id] = resource
    for n in range(SESSIONS):
        registry.grant(resource, f"s-{n}", None)
    return [(await timed_async(registry.sweep()))[0] for _ in range(SWEEPS)]


class LeaseBench(Bench):
    def idle_sessions(self) -> None:
        server = HttpServer(self.workspace, server_env({"LOOMMUX_SPARE_KERNELS": "1"}))
        self.alive.append(server)
        server.wait_listening()
        time.sleep(1.0)
        self.figures["rss_before"] = proc_kib(server.proc.pid)
        for _ in range(SESSIONS):  # each keeps its lease: its connection closes, the session stays
            HttpSession(server, CLIENT_NAME, {"X-Loommux-Resource": RESOURCE}).close()
        api = HttpClient(server)
        try:
            resources = api.get_json("/api/resources")["resources"]
        finally:
            api.close()
        self.figures["leases"] = sum(len(r["leases"]) for r in resources)
        server.note_descendants()
        self.figures["rss_after"], cpu_start = proc_kib(server.proc.pid), proc_cpu_seconds(server.proc.pid)
        time.sleep(IDLE_SECONDS)
        self.figures["idle_cpu_ms_per_s"] = ((proc_cpu_seconds(server.proc.pid) - cpu_start) * 1000
                                             / IDLE_SECONDS)
        self.stop_all()

    def sweep(self) -> None:
        self.figures["sweep"] = statistics.median(asyncio.run(sweep_times()))

    def steps(self) -> list:
        return [self.idle_sessions, self.sweep]


def report(figures: dict) -> list[tuple[str, ...]]:
    return [
        ("leases held by idle sessions", f"{figures['leases']}"),
        ("server RSS before sessions", f"{figures['rss_before'] / 1024:.1f} MiB"),
        (f"server RSS with {SESSIONS} sessions", f"{figures['rss_after'] / 1024:.1f} MiB"),
        ("server CPU while idle", f"{figures['idle_cpu_ms_per_s']:.2f} ms per second"),
        (f"one sweep over {SESSIONS} leases (median of {SWEEPS})", f"{figures['sweep'] * 1e6:.0f} µs"),
    ]


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="loommux-bench-leases-") as workspace:
        bench = LeaseBench(workspace)
        return run_and_report(bench.run, bench.problems, "loommux leases bench",
                              lambda: report(bench.figures))


if __name__ == "__main__":
    sys.exit(main())
