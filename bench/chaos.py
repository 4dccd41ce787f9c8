"""Kill a loommux instance with SIGKILL at random moments while clients run cells, and count what it forgot.

Several clients (2026-07-28 requests, each on a named kernel of its own) run cells on a real Jupyter Kernel
Gateway through one instance started with ``--state-dir``: short cells, and cells that print for a while
(shown while they run, then waited for). The instance is killed with SIGKILL at random moments and started
again on the same port, at least 100 times; clients go on through every restart. Then the last instance
answers for everything the clients were shown:

* kernels left on the gateway that no state knows (a kernel started, then forgotten): 0;
* execution numbers given to two different cells of one kernel: 0;
* lines a client was shown (in a run_cell or wait result) that read_output cannot give back: 0;

and what the restarts cost: from the start to listening, and to the first result in a kept kernel. Every
instance stops with SIGTERM at the end; the gateway must then hold none of its kernels.

    .venv/bin/python bench/chaos.py [--restarts 100] [--clients 3] [--seed 1]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchlib import (
    Bench,
    BenchError,
    Gateway,
    HttpServer,
    StatelessClient,
    fmt_time,
    free_port,
    p95,
    run_and_report,
    server_env,
)

SHORT_CELL = "print('{token} a')\nprint('{token} b')"
# Prints for about half a second: shown while it runs (run_cell answers after 0.2 s), then waited for.
LONG_CELL = ("%%loommux --wait 0.2\nimport time\nfor i in range(25):\n"
             "    print(f'{token} {{i}}', flush=True)\n    time.sleep(0.02)")
HEAD = re.compile(r"In \[(\d+)\]")
PROBE = "probe"  # the kept kernel whose first result after each restart is timed
RETRY_PAUSE = 0.05  # a client whose request failed (the instance is down) tries again after this


class Shown:
    """What the clients were shown, by (kernel, execution number): the cell's token and its lines."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cells: dict[tuple[str, int], tuple[str, set[str]]] = {}
        self.twice: list[str] = []

    def note(self, kernel: str, token: str, text: str) -> int | None:
        """Record a result's number and the lines of its cell it shows; the number (None: none shown)."""
        head = HEAD.match(text)
        if head is None:
            return None
        number = int(head[1])
        lines = {line for line in text.split("\n")[1:] if line.startswith(f"{token} ")}
        with self.lock:
            known = self.cells.setdefault((kernel, number), (token, set()))
            if known[0] != token:
                self.twice.append(f"{kernel} In [{number}]: {known[0]} and {token}")
            else:
                known[1].update(lines)
        return number


class ChaosBench(Bench):
    def __init__(self, args: argparse.Namespace, workspace: str) -> None:
        super().__init__(workspace)
        self.args = args
        self.random = random.Random(args.seed)
        self.state = Path(workspace) / "state"
        self.port = free_port()
        self.shown = Shown()
        self.stopping = threading.Event()
        self.requests = 0
        self.failed_requests = 0
        self.gateway: Gateway | None = None
        self.server: HttpServer | None = None

    def steps(self) -> list:
        return [self.start_gateway, self.churn, self.check]

    def start_gateway(self) -> None:
        self.gateway = Gateway(Path(self.workspace) / "gateway.log")
        self.alive.append(self.gateway)

    def start_server(self) -> HttpServer:
        env = server_env({"LOOMMUX_GATEWAY_URL": self.gateway.url, "LOOMMUX_SPARE_KERNELS": "0"})
        server = HttpServer(self.workspace, env, args=("--state-dir", str(self.state), "--instance", "chaos",
                                                       "--port", str(self.port)))
        server.wait_listening()
        return server

    def client(self, kernel: str) -> None:
        """Run cells until told to stop, through every restart; record every result shown."""
        seq, conn = 0, None
        while not self.stopping.is_set():
            seq += 1
            token = f"{kernel}-{seq}"
            code = (LONG_CELL if seq % 4 == 0 else SHORT_CELL).format(token=token)
            try:
                conn = conn or StatelessClient(self.server)
                text, is_error = self.call(conn, "run_cell", {"freeform": code, "kernel": kernel})
                number = None if is_error else self.shown.note(kernel, token, text)
                while number is not None and " · running" in text.partition("\n")[0]:
                    text, is_error = self.call(conn, "wait", {"execution": number, "kernel": kernel})
                    if is_error:
                        break
                    self.shown.note(kernel, token, text)
            except (OSError, http.client.HTTPException, BenchError, ValueError) as exc:
                if os.environ.get("CHAOS_DEBUG"):
                    print("client:", type(exc).__name__, str(exc)[:200])
                self.failed_requests += 1
                conn = None
                time.sleep(RETRY_PAUSE)

    def call(self, conn: StatelessClient, name: str, arguments: dict) -> tuple[str, bool]:
        self.requests += 1
        return conn.call_tool(name, arguments)

    def churn(self) -> None:
        """Start the instance, then kill it at random moments and start it again, timing each restart."""
        self.server = self.start_server()
        StatelessClient(self.server).call("run_cell", {"freeform": "1", "kernel": PROBE})
        clients = [threading.Thread(target=self.client, args=(f"c{i}",), daemon=True)
                   for i in range(self.args.clients)]
        for thread in clients:
            thread.start()
        listening, first_result = [], []
        for _ in range(self.args.restarts):
            time.sleep(self.random.uniform(0.05, 1.0))
            self.server.proc.send_signal(signal.SIGKILL)
            self.server.proc.wait()
            if os.environ.get("CHAOS_DEBUG"):
                print("\n".join("server: " + line for line in self.server.stderr))
            started = time.perf_counter()
            self.server = self.start_server()
            listening.append(time.perf_counter() - started)
            probe = StatelessClient(self.server)
            probe.call("run_cell", {"freeform": "1", "kernel": PROBE})
            first_result.append(time.perf_counter() - started)
            probe.close()
        time.sleep(1.0)
        self.stopping.set()
        for thread in clients:
            thread.join(timeout=60)
        self.alive.append(self.server)
        self.figures["listening"], self.figures["first_result"] = listening, first_result

    def check(self) -> None:
        """Count what the last instance cannot answer for, then stop it and look at the gateway."""
        reader = StatelessClient(self.server)
        unreadable, cells = 0, 0
        for (kernel, number), (token, lines) in sorted(self.shown.cells.items()):
            text, is_error = reader.call_tool("read_output", {"execution": number, "kernel": kernel,
                                                              "line_range": "1:"})
            kept = set() if is_error else set(text.split("\n")[1:])
            unreadable += len(lines - kept)
            cells += 1
        recorded = {k["remote_id"] for k in json.loads((self.state / "state.json").read_text())["kernels"]}
        running = self.gateway.kernels()
        reader.close()
        if os.environ.get("CHAOS_DEBUG"):
            print("gateway:", running, "state:", recorded)
            print((self.state / "state.json").read_text()[:3000])
        shown_lines = sum(len(lines) for _, lines in self.shown.cells.values())
        self.figures.update(cells=cells, lines=shown_lines, unreadable=unreadable,
                            twice=len(self.shown.twice), unknown=len(running - recorded))
        self.alive.remove(self.server)
        self.server.stop(self.problems, check_exit=True)
        self.figures["left"] = len(self.gateway.kernels())
        self.problems += [f"a number given twice: {pair}" for pair in self.shown.twice[:5]]


def report(bench: ChaosBench) -> list[tuple[str, ...]]:
    figures, args = bench.figures, bench.args
    listening, first = figures["listening"], figures["first_result"]

    def count(label: str, value: int) -> tuple[str, ...]:
        return label, f"{value:,}", "0", "ok" if value == 0 else "MISS"

    return [
        ("measure", "value", "target", ""),
        (f"SIGKILL restarts · {args.clients} clients · {bench.requests:,} requests",
         f"{len(listening)}", f"≥ {args.restarts}",
         "ok" if len(listening) >= args.restarts else "MISS"),
        (f"  requests cut by a kill (answered on the next instance or retried): {bench.failed_requests:,}",
         "", "", ""),
        (f"results checked: {figures['cells']:,} executions, {figures['lines']:,} lines shown", "", "", ""),
        count("kernels on the gateway that no state knows", figures["unknown"]),
        count("execution numbers given to two cells", figures["twice"]),
        count("lines shown to a client, unreadable after the restarts", figures["unreadable"]),
        count("kernels left on the gateway after SIGTERM", figures["left"]),
        ("restart: start to listening, median (p95)",
         f"{fmt_time(statistics.median(listening))} ({fmt_time(p95(listening))})", "", ""),
        ("restart: start to the first result in a kept kernel, median (p95)",
         f"{fmt_time(statistics.median(first))} ({fmt_time(p95(first))})", "", ""),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=100, help="SIGKILL restarts (100)")
    parser.add_argument("--clients", type=int, default=3, help="clients, each on a kernel of its own (3)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the random kill moments (1)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as workspace:
        bench = ChaosBench(args, os.path.realpath(workspace))
        return run_and_report(bench.run, bench.problems, "loommux under SIGKILL: what a restart forgets",
                              lambda: report(bench))


if __name__ == "__main__":
    raise SystemExit(main())
