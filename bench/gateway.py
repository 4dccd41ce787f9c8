"""Kernels on a Jupyter Kernel Gateway against local kernels, side by side in one run.

Three sides, each on a fresh kernel:

* loommux over stdio with a local kernel (its usual ipc sockets);
* loommux over stdio with ``LOOMMUX_GATEWAY_URL``: the kernel runs on a real Jupyter Kernel Gateway
  started here on 127.0.0.1 (IOPub rate limit off, as the README tells operators);
* jupyter_server's own gateway client (``GatewayKernelManager`` / ``GatewayKernelClient``) against
  the same gateway, with no MCP server in between: the floor for the gateway's own cost.

Measured: a ``1+1`` round trip (calls alternate between the sides) and the ingest of a 200,000-line
cell, from the request to the end of its output. The gateway runs without a token here because
jupyter_server's gateway client opens its channels WebSocket without the token header.

    .venv/bin/python bench/gateway.py [--repeat 200] [--floods 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import statistics
import sys
import tempfile
from pathlib import Path

from benchlib import Gateway, StdioServer, fmt_time, p95, print_table, server_env, timed

TIMEOUT = 600.0
CLIENT_NAME = "loommux-bench"
WARMUP = 10

# 200,000 numbered lines of 80 characters, newline included, written at once (as bench/roundtrip.py).
FLOOD_CODE = r"""import sys
_ = sys.stdout.write("".join(f"{i:06d} {'x' * 72}\n" for i in range(200_000)))
"""
LINES = 200_000
FLOOD_BYTES = LINES * 80


class JupyterGatewayClient:
    """jupyter_server's own gateway client, driven on an event loop of its own."""

    def __init__(self, url: str) -> None:
        from jupyter_server.gateway.gateway_client import GatewayClient
        from jupyter_server.gateway.managers import GatewayKernelManager

        GatewayClient.instance(url=url)
        self.loop = asyncio.new_event_loop()
        self.km = GatewayKernelManager(kernel_name="python3")
        self.loop.run_until_complete(self.km.start_kernel())
        self.kc = self.km.client()
        self.loop.run_until_complete(self.kc.start_channels())
        self.loop.run_until_complete(self.kc.wait_for_ready(timeout=TIMEOUT))

    async def _execute(self, code: str) -> int:
        msg_id = self.kc.execute(code)
        size = 0
        while True:
            msg = await self.kc.get_iopub_msg(timeout=TIMEOUT)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                size += len(msg["content"]["text"])
            elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        while (await self.kc.get_shell_msg(timeout=TIMEOUT))["parent_header"].get("msg_id") != msg_id:
            pass
        return size

    def execute(self, code: str) -> int:
        """Run code; the characters of stream output it printed, once both its reply and idle arrived."""
        return self.loop.run_until_complete(self._execute(code))

    def close(self) -> None:
        self.kc.stop_channels()
        self.loop.run_until_complete(self.km.shutdown_kernel())
        self.loop.close()


def time_floods(count: int, servers: dict[str, StdioServer], client: JupyterGatewayClient | None,
                problems: list[str]) -> dict[str, list[float]]:
    """Each side's times to run FLOOD_CODE, `count` times in turn; what went wrong is added to problems."""
    floods: dict[str, list[float]] = {name: [] for name in [*servers, *(["jupyter"] if client else [])]}
    for _ in range(count):
        for name, server in servers.items():
            elapsed, text = timed(server.run_to_end, {"code": FLOOD_CODE})
            floods[name].append(elapsed)
            if not re.match(r"In \[\d+\] · [^:·]+:", text):
                problems.append(f"{name}: the flood cell did not complete cleanly: {text[:120]!r}")
        if client is not None:
            elapsed, size = timed(client.execute, FLOOD_CODE)
            floods["jupyter"].append(elapsed)
            if size != FLOOD_BYTES:
                problems.append(f"jupyter gateway client received {size:,} characters, "
                                f"not {FLOOD_BYTES:,}")
    return floods


def measure(args: argparse.Namespace, workspace: str, gateway: Gateway) -> tuple[dict, list[str], bool]:
    problems: list[str] = []
    local = StdioServer(workspace, server_env(drop_loommux=True), timeout=TIMEOUT)
    remote = StdioServer(workspace, server_env({"LOOMMUX_GATEWAY_URL": gateway.url}, drop_loommux=True),
                         timeout=TIMEOUT)
    client = None
    try:
        local.initialize(CLIENT_NAME)
        remote.initialize(CLIENT_NAME)
        try:
            client = JupyterGatewayClient(gateway.url)
        except Exception as exc:  # noqa: BLE001 - the comparison is optional: say why it is missing
            problems.append(f"jupyter_server's gateway client is not usable here "
                            f"({type(exc).__name__}: {exc}); compared with local kernels only")
        sides = {"local": lambda code: local.tool("run_cell", {"code": code}),
                 "gateway": lambda code: remote.tool("run_cell", {"code": code})}
        if client is not None:
            sides["jupyter"] = client.execute
        trips: dict[str, list[float]] = {name: [] for name in sides}
        for i in range(WARMUP + args.repeat):
            for name, run in sides.items():
                elapsed, _ = timed(run, "1+1")
                if i >= WARMUP:
                    trips[name].append(elapsed)
        floods = time_floods(args.floods, {"local": local, "gateway": remote}, client, problems)
        status = remote.tool("execution_status", {})
        if f"stdout: {LINES:,} lines" not in status:
            problems.append(f"the gateway side did not keep all {LINES:,} lines: {status[-300:]!r}")
    finally:
        local.close()
        remote.close()
        if client is not None:
            client.close()
    figures = {name: {"rt_median": statistics.median(values), "rt_p95": p95(values),
                      "ingest": statistics.median(floods[name])} for name, values in trips.items()}
    return figures, problems, client is not None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=200, help="1+1 round trips per side")
    parser.add_argument("--floods", type=int, default=3, help="200k-line cells per side")
    args = parser.parse_args()
    print(f"Python {platform.python_version()} · {platform.system()} {platform.machine()} · "
          f"{os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory(prefix="loommux-bench-") as workspace:
        gateway = Gateway(Path(workspace) / "gateway.log")
        try:
            figures, problems, with_client = measure(args, workspace, gateway)
        finally:
            gateway.close()
    names = ["local", "gateway"] + (["jupyter"] if with_client else [])
    titles = {"local": "loommux, local", "gateway": "loommux, gateway", "jupyter": "jupyter gateway client"}
    rows = [("", *(titles[n] for n in names), "gateway / local",
             *(["gateway / jupyter"] if with_client else []))]
    for key, label in (("rt_median", "1+1 round trip, median"), ("rt_p95", "1+1 round trip, p95"),
                       ("ingest", f"{LINES:,}-line ingest, median")):
        values = [figures[n][key] for n in names]
        ratios = [f"{figures['gateway'][key] / figures['local'][key]:.2f}×"]
        if with_client:
            ratios.append(f"{figures['gateway'][key] / figures['jupyter'][key]:.2f}×")
        rows.append((label, *map(fmt_time, values), *ratios))
    print_table(rows)
    print(f"({args.repeat} round trips and {args.floods} floods per side; calls alternate between the sides)")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if any(not p.startswith("jupyter_server's gateway client is not usable")
                    for p in problems) else 0


if __name__ == "__main__":
    sys.exit(main())
