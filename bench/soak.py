"""Soak: one stdio session runs 100,000 small cells; what each costs the server, and ``status`` at the end.

The cells are ``i`` and ``print(i)`` in turn (a result shown in two streams, and one stream), each
run_cell answered as soon as its cell ends. Measured on the server process (its kernel is not counted):

- RSS growth per execution: from after the warm-up cells to the end, over the cells between (≤ 1 KiB);
- RSS after the last cell (≤ 150 MiB);
- the status tool's round trip, median of --status calls, after the warm-up and at the end (≤ 5 ms there);

then the first two executions are read back whole (execution_status, read_output, search_output, wait).
With --baseline REV, loommux.py at that git revision runs the same session beside it, the two sides
alternating cell by cell.

    .venv/bin/python bench/soak.py [--cells 100000] [--status 200] [--baseline REV]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time

from benchlib import (
    SERVER,
    Bench,
    BenchError,
    StdioServer,
    compared,
    extract_baseline,
    fmt_time,
    proc_kib,
    run_and_report,
    timed,
)

CLIENT_NAME = "loommux-bench-soak"
WARMUP = 1000  # cells before the first measurement: one-time costs are paid by then
PROGRESS_EVERY = 10_000
TARGET_BYTES_PER_EXECUTION = 1024
TARGET_RSS_MIB = 150
TARGET_STATUS_MS = 5.0


def cell(i: int) -> tuple[str, str]:
    """The i-th cell (from 0) and the last line its result ends with (execution i + 1)."""
    return (f"{i}", f"Out[{i + 1}]: {i}") if i % 2 == 0 else (f"print({i})", f"{i}")


class SoakBench(Bench):
    def __init__(self, args: argparse.Namespace, scratch: str) -> None:
        super().__init__(tempfile.mkdtemp(prefix="workspace-", dir=scratch))
        self.args = args
        self.paths = {"loommux": SERVER}
        if args.baseline:
            into = tempfile.mkdtemp(prefix="baseline-", dir=scratch)
            self.paths["baseline"] = extract_baseline(args.baseline, into)
        self.servers: dict[str, StdioServer] = {}
        self.trips: dict[str, list[float]] = {side: [] for side in self.paths}

    def start(self) -> None:
        for side, path in self.paths.items():
            server = StdioServer(self.workspace, server=path)
            self.alive.append(server)
            server.initialize(CLIENT_NAME)
            self.servers[side] = server

    def run_cells(self, first: int, stop: int) -> None:
        """Cells first..stop-1 on every side, the side that goes first flipping each cell."""
        sides = list(self.servers.items())
        started = time.monotonic()
        for i in range(first, stop):
            code, last_line = cell(i)
            for side, server in sides if i % 2 else sides[::-1]:
                elapsed, text = timed(server.tool, "run_cell", {"freeform": code})
                if not text.endswith("\n" + last_line):
                    raise BenchError(f"{side}: cell {i} ({code!r}) answered {text[:300]!r}")
                self.trips[side].append(elapsed)
            if (i + 1) % PROGRESS_EVERY == 0:
                print(f"  {i + 1:,} cells · {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)

    def measure(self, when: str) -> None:
        """Each side's RSS and status round trip (the sides alternating call by call)."""
        statuses: dict[str, list[float]] = {side: [] for side in self.servers}
        for _ in range(self.args.status):
            for side, server in self.servers.items():
                statuses[side].append(timed(server.tool, "status")[0])
        for side, server in self.servers.items():
            self.figures[side, "rss", when] = proc_kib(server.proc.pid) * 1024
            self.figures[side, "status", when] = statistics.median(statuses[side])

    def soak(self) -> None:
        warmup = min(WARMUP, self.args.cells // 2)
        self.run_cells(0, warmup)
        self.measure("warm")
        self.run_cells(warmup, self.args.cells)
        self.measure("end")
        self.figures["counted"] = self.args.cells - warmup
        for side, trips in self.trips.items():
            self.figures[side, "trip"] = statistics.median(trips)

    def read_back(self) -> None:
        """The oldest executions are whole after all the later ones: status, output, search, wait."""
        for side, server in self.servers.items():
            for i in (0, 1):
                number, (code, last_line) = i + 1, cell(i)
                texts = {
                    "execution_status": server.tool("execution_status", {"execution": number}),
                    "read_output": server.tool("read_output", {"execution": number}),
                    "search_output": server.tool("search_output", {"execution": number, "query": str(i)}),
                    "wait": server.tool("wait", {"execution": number}),
                }
                wanted = {
                    "execution_status": f"[execution {number} · completed]\nsource: {code}\n",
                    "read_output": f"lines 1-1 of 1]\n{last_line}",
                    "search_output": "1 matching line",
                    "wait": f"\n{last_line}",
                }
                for tool, text in texts.items():
                    if wanted[tool] not in text:
                        self.problems.append(f"{side}: {tool} of execution {number} after "
                                             f"{self.args.cells:,} cells lacks {wanted[tool]!r}: "
                                             f"{text[:300]!r}")

    def steps(self) -> list:
        return [self.start, self.soak, self.read_back]


def report(figures: dict, args: argparse.Namespace) -> list[tuple[str, ...]]:
    sides = ["loommux", "baseline"] if args.baseline else ["loommux"]
    counted = figures["counted"]

    def row(label: str, value, shown, target: float, unit: str) -> tuple[str, ...]:
        ours = value("loommux")
        theirs = [shown(value("baseline")), f"{ours / value('baseline'):.2f}×"] if args.baseline else []
        return label, shown(ours), *theirs, f"≤ {target:g} {unit}", "ok" if ours <= target else "MISS"

    def per_execution(side: str) -> float:
        return (figures[side, "rss", "end"] - figures[side, "rss", "warm"]) / counted

    def rss(side: str) -> float:
        return figures[side, "rss", "end"] / 2**20

    def status(when: str):
        return lambda side: figures[side, "status", when] * 1e3

    executions = f"{args.cells:,} executions"
    rows = [
        ("measure", *sides, *(["ratio"] if args.baseline else []), "target", ""),
        row(f"server RSS growth per execution, over {counted:,}", per_execution, lambda b: f"{b:.0f} B",
            TARGET_BYTES_PER_EXECUTION, "B"),
        row(f"server RSS at {executions}", rss, lambda m: f"{m:.1f} MiB", TARGET_RSS_MIB, "MiB"),
        row(f"status, median of {args.status}, at {min(WARMUP, args.cells // 2):,} executions",
            status("warm"), lambda ms: fmt_time(ms / 1e3), TARGET_STATUS_MS, "ms"),
        row(f"status, median of {args.status}, at {executions}", status("end"), lambda ms: fmt_time(ms / 1e3),
            TARGET_STATUS_MS, "ms"),
    ]
    trips = f"run_cell round trip, median of {args.cells:,}"
    if args.baseline:
        rows.append(compared(trips, figures["loommux", "trip"], figures["baseline", "trip"], None))
    else:
        rows.append((trips, fmt_time(figures["loommux", "trip"]), "", ""))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", type=int, default=100_000, help="cells run per side (100000)")
    parser.add_argument("--status", type=int, default=200, help="status calls per measurement (200)")
    parser.add_argument("--baseline", help="a git revision whose loommux.py runs the same session beside")
    args = parser.parse_args()
    if args.cells < 4 or args.status < 1:
        parser.error("--cells must be at least 4 and --status at least 1")
    title = (f"loommux soak · Python {platform.python_version()} · {os.cpu_count()} CPUs · "
             f"{args.cells:,} small cells in one stdio session"
             + (" per side, the sides alternating" if args.baseline else ""))
    with tempfile.TemporaryDirectory(prefix="loommux-bench-soak-") as scratch:
        bench = SoakBench(args, scratch)
        return run_and_report(bench.run, bench.problems, title, lambda: report(bench.figures, args))


if __name__ == "__main__":
    sys.exit(main())
