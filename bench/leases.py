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
import http.client
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import loommux

SESSIONS = 200
IDLE_SECONDS = 10.0
HEADERS = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}


def server_env() -> dict[str, str]:
    env = dict(os.environ, LOOMMUX_SPARE_KERNELS="1")
    cache = ROOT.parent / "shared" / "tiktoken"
    if cache.is_dir():
        env["TIKTOKEN_CACHE_DIR"] = str(cache)
    return env


def proc_stat(pid: int) -> tuple[int, float]:
    """RSS in bytes and CPU seconds (user + system) of a process."""
    rss = loommux.process_rss(pid) or 0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return rss, (int(fields[11]) + int(fields[12])) / ticks


def open_session(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port)
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "b", "version": "1"}}}
    conn.request("POST", "/mcp", json.dumps(body), {**HEADERS, "X-Loommux-Resource": "bench"})
    response = conn.getresponse()
    response.read()
    session = response.getheader("Mcp-Session-Id")
    note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
    conn.request("POST", "/mcp", json.dumps(note), {**HEADERS, "Mcp-Session-Id": session,
                                                     "MCP-Protocol-Version": "2025-11-25"})
    conn.getresponse().read()
    conn.close()
    return session


def measure_server() -> dict[str, float]:
    server = subprocess.Popen([sys.executable, str(ROOT / "loommux.py"), "--server", "--port", "0"],
                              stderr=subprocess.PIPE, text=True, env=server_env(), cwd=ROOT)
    try:
        port = int(re.search(r":(\d+)/mcp", server.stderr.readline()).group(1))
        time.sleep(1.0)
        rss_before, _ = proc_stat(server.pid)
        for _ in range(SESSIONS):
            open_session(port)
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.request("GET", "/api/resources")
        leases = sum(len(r["leases"]) for r in json.loads(conn.getresponse().read())["resources"])
        rss_after, cpu_start = proc_stat(server.pid)
        time.sleep(IDLE_SECONDS)
        _, cpu_end = proc_stat(server.pid)
        return {"leases": leases, "rss_before": rss_before, "rss_after": rss_after,
                "idle_cpu_ms_per_s": (cpu_end - cpu_start) * 1000 / IDLE_SECONDS}
    finally:
        server.terminate()
        server.wait(15)


async def measure_sweep() -> float:
    """Median seconds of one Registry.sweep() over SESSIONS live leases (no kernel is started)."""
    registry = loommux.Registry(loommux.KernelPool(ROOT), loommux.LeasePolicy(), loommux.DEFAULT_PATH)
    resource = loommux.Resource(registry.pool, "bench")
    resource.id, resource.kind = "bench", "named"
    registry.resources[resource.id] = resource
    for n in range(SESSIONS):
        registry.grant(resource, f"s-{n}", None)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        await registry.sweep()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    figures = measure_server()
    sweep = asyncio.run(measure_sweep())
    mib = 1 << 20
    print(f"leases held by idle sessions        {figures['leases']}")
    print(f"server RSS before sessions          {figures['rss_before'] / mib:.1f} MiB")
    print(f"server RSS with {SESSIONS} sessions        {figures['rss_after'] / mib:.1f} MiB")
    print(f"server CPU while idle               {figures['idle_cpu_ms_per_s']:.2f} ms per second")
    print(f"one sweep over {SESSIONS} leases (median)   {sweep * 1e6:.0f} µs")


if __name__ == "__main__":
    main()
