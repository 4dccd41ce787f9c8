"""How fast a stdio server goes at SIGINT and SIGTERM, against the 100 ms an MCP host allows.

Claude Code sends a stdio server SIGINT and, 100 ms later, SIGTERM. Each run starts a server (the
installed command, or ``--launch script`` for ``python loommux.py``), runs a cell that leaves a child
process running, then signals the server and times, from the signal, the exit of the server, of its
kernel and of the kernel's launcher, each seen through a pidfd (Linux). The two signals alternate run
by run. After each run nothing may be left: no process the server started, no kernel directory, and
the server must not have exited before its kernel and launcher were gone.

    .venv/bin/python bench/exit.py [--runs 15] [--launch installed|script]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import select
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

from benchlib import LAUNCHES, Bench, BenchError, StdioServer, fmt_time, p95, run_and_report

CLIENT_NAME = "loommux-bench-exit"
SIGNALS = (signal.SIGINT, signal.SIGTERM)
TARGET = 0.100  # seconds from the signal
EXIT_TIMEOUT = 30.0
CHILD_CELL = "import subprocess\nchild = subprocess.Popen(['sleep', '1000'])\nprint(child.pid)"


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def kernel_dir_of(kernel: int) -> Path:
    """The kernel's private directory: where its connection file (``-f FILE``) is."""
    args = Path(f"/proc/{kernel}/cmdline").read_bytes().split(b"\0")
    return Path(os.fsdecode(args[args.index(b"-f") + 1])).parent


def exit_times(pids: dict[str, int], send: Callable[[], None]) -> dict[str, float]:
    """Seconds from ``send()`` to the exit of each process named in ``pids``, each watched through a pidfd."""
    names = {os.pidfd_open(pid): name for name, pid in pids.items()}
    poll = select.poll()
    for fd in names:
        poll.register(fd, select.POLLIN)
    times: dict[str, float] = {}
    try:
        start = time.perf_counter()
        send()
        while len(times) < len(names):
            ready = poll.poll(EXIT_TIMEOUT * 1000)
            now = time.perf_counter()
            if not ready:
                raise BenchError(f"still running {EXIT_TIMEOUT:.0f} s after the signal: "
                                 f"{sorted(set(pids) - set(times))}")
            for fd, _ in ready:
                times[names[fd]] = now - start
                poll.unregister(fd)
    finally:
        for fd in names:
            os.close(fd)
    return times


class ExitBench(Bench):
    def __init__(self, args: argparse.Namespace, workspace: str) -> None:
        super().__init__(workspace)
        self.args = args
        self.runs: dict[int, list[dict[str, float]]] = {sig: [] for sig in SIGNALS}

    def once(self, sig: int) -> None:
        server = StdioServer(self.workspace, launch=self.args.launch)
        self.alive.append(server)
        server.initialize(CLIENT_NAME)
        server.tool("run_cell", {"code": CHILD_CELL})
        kernel = int(re.search(r"kernel: pid (\d+)", server.tool("status"))[1])
        launcher = parent_of(kernel)
        kernel_dir = kernel_dir_of(kernel)
        server.note_descendants()
        times = exit_times({"server": server.proc.pid, "kernel": kernel, "launcher": launcher},
                           partial(server.proc.send_signal, sig))
        server.proc.wait()
        self.alive.remove(server)
        server.stop(self.problems)  # it has exited: this checks that nothing it started is left
        name = signal.Signals(sig).name
        if server.proc.returncode != 0:
            self.problems.append(f"{name}: server exited with code {server.proc.returncode}")
        if kernel_dir.exists():
            self.problems.append(f"{name}: the kernel's directory {kernel_dir} was left")
        if times["server"] < max(times["kernel"], times["launcher"]):
            self.problems.append(f"{name}: the server exited before its kernel and launcher were gone")
        self.runs[sig].append({"server": times["server"], "kernel": max(times["kernel"], times["launcher"])})

    def measure(self) -> None:
        for run in range(self.args.runs * len(SIGNALS)):
            self.once(SIGNALS[run % len(SIGNALS)])

    def steps(self) -> list:
        return [self.measure]


def report(bench: ExitBench) -> list[tuple[str, ...]]:
    rows = [("from the signal to", "median", "p95", "max", "target", "")]
    for sig, runs in bench.runs.items():
        for key, what in (("server", "the server's exit"), ("kernel", "its kernel and launcher gone")):
            times = [run[key] for run in runs]
            median = statistics.median(times)
            rows.append((f"{signal.Signals(sig).name}: {what}, {len(times)} runs", fmt_time(median),
                         fmt_time(p95(times)), fmt_time(max(times)), f"≤ {TARGET * 1e3:.0f} ms",
                         "ok" if median <= TARGET else "MISS"))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15, help="runs per signal; the signals alternate (15)")
    parser.add_argument("--launch", choices=LAUNCHES, default="installed",
                        help="start the server as the installed command or as python loommux.py (installed)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if not hasattr(os, "pidfd_open"):
        parser.error("this bench needs Linux pidfds (os.pidfd_open)")
    title = (f"loommux exit bench · Python {platform.python_version()} · {os.cpu_count()} CPUs · "
             f"{LAUNCHES[args.launch]} · a cell's child process running · signals alternate run by run")
    with tempfile.TemporaryDirectory(prefix="loommux-bench-exit-") as workspace:
        bench = ExitBench(args, workspace)
        return run_and_report(bench.run, bench.problems, title, lambda: report(bench))


if __name__ == "__main__":
    sys.exit(main())
