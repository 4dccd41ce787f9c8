"""Measure an IOPub flood before and after "nothing lost under a flood", side by side in one run.

A cell sends small display_data messages as fast as the kernel can (its own ``session.send`` on the
IOPub socket, 100,000 by default). "before" is loommux.py at a git revision (``--baseline``, the commit
before the change), "after" is this working tree's; each side is one stdio server with its kernel,
driven the way an MCP client drives it. The floods alternate the sides, the first side flipping every
round. Per flood: the messages kept (result lines in execution_status), the losses the server reports,
the server's CPU time (from /proc) and the time from run_cell to the finished result.

    .venv/bin/python bench/flood.py [--floods 5] [--messages 100000] [--baseline 8e04e96]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchlib import SERVER, Bench, BenchError, StdioServer, compared, extract_baseline, run_and_report

DEFAULT_BASELINE = "8e04e96"  # the last commit before this change
CLIENT_NAME = "loommux-bench-flood"
FLOOD = """%%loommux --wait 600
k = get_ipython().kernel
parent = k.get_parent("shell")
for i in range({messages}):
    k.session.send(k.iopub_socket, "display_data", {{"data": {{"text/plain": f"d{{i}}"}}, "metadata": {{}}}},
                   parent=parent)
"""
EXECUTION = re.compile(r"In \[(\d+)\] · ")
RESULT_LINES = re.compile(r"^  result: ([\d,]+) lines?", re.MULTILINE)
LOST = re.compile(r"^warning: ([\d,]+) kernel messages? never arrived", re.MULTILINE)

TARGET_CPU = 1.0  # after / before: the server's CPU time per flood


def cpu_seconds(pid: int) -> float:
    """User and system time of a process, from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def count(text: str, pattern: re.Pattern) -> int:
    match = pattern.search(text)
    return int(match.group(1).replace(",", "")) if match else 0


class FloodBench(Bench):
    def __init__(self, args: argparse.Namespace, scratch: str) -> None:
        super().__init__(tempfile.mkdtemp(prefix="workspace-", dir=scratch))
        self.args = args
        self.scratch = scratch
        self.runs: dict[str, list[dict]] = {"before": [], "after": []}

    def flood(self, side: str, server: StdioServer) -> None:
        cell = FLOOD.format(messages=self.args.messages)
        cpu, start = cpu_seconds(server.proc.pid), time.perf_counter()
        text = server.run_to_end({"code": cell})
        elapsed, cpu = time.perf_counter() - start, cpu_seconds(server.proc.pid) - cpu
        match = EXECUTION.match(text)
        if not match or " · running:" in text.split("\n", 1)[0]:
            raise BenchError(f"{side}: unexpected flood result: {text[:300]!r}")
        status = server.tool("execution_status", {"execution": int(match.group(1))})
        kept, lost = count(status, RESULT_LINES), count(status, LOST)
        self.runs[side].append({"kept": kept, "lost": lost, "cpu": cpu, "elapsed": elapsed})
        if side == "after" and kept != self.args.messages:
            self.problems.append(f"after: a flood kept {kept:,} of {self.args.messages:,} messages")
        if side == "after" and kept + lost != self.args.messages:
            self.problems.append(f"after: {self.args.messages - kept:,} messages missing, "
                                 f"{lost:,} reported lost")

    def side_by_side(self) -> None:
        servers = {
            "before": extract_baseline(self.args.baseline,
                                       tempfile.mkdtemp(prefix="baseline-", dir=self.scratch)),
            "after": SERVER,
        }
        children = {}
        for side, path in servers.items():
            children[side] = StdioServer(self.workspace, server=path)
            self.alive.append(children[side])
            children[side].initialize(CLIENT_NAME)
        for round_number in range(self.args.floods):
            order = ("before", "after") if round_number % 2 == 0 else ("after", "before")
            for side in order:
                self.flood(side, children[side])
        self.stop_all()

    def steps(self) -> list:
        return [self.side_by_side]


def report(bench: FloodBench, args: argparse.Namespace) -> list[tuple[str, ...]]:
    after, before = bench.runs["after"], bench.runs["before"]

    def median(runs: list[dict], key: str) -> float:
        return statistics.median(run[key] for run in runs)

    def missing(runs: list[dict]) -> str:
        lost = [args.messages - run["kept"] for run in runs]
        return f"{min(lost):,}–{max(lost):,}"

    def reported(runs: list[dict]) -> str:
        return f"{min(run['lost'] for run in runs):,}–{max(run['lost'] for run in runs):,}"

    return [
        (f"{args.messages:,} display_data, {args.floods} floods a side", "after", f"before ({args.baseline})",
         "ratio", "target", ""),
        ("messages missing per flood (min–max)", missing(after), missing(before), "", "", ""),
        ("messages reported lost per flood (min–max)", reported(after), reported(before), "", "", ""),
        compared("server CPU per flood, median", median(after, "cpu"), median(before, "cpu"), TARGET_CPU,
                 miss="over"),
        compared("run_cell to result, median", median(after, "elapsed"), median(before, "elapsed"), None),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--floods", type=int, default=5, help="floods per side (5)")
    parser.add_argument("--messages", type=int, default=100_000,
                        help="display_data messages per flood (100000)")
    parser.add_argument("--baseline", default=DEFAULT_BASELINE,
                        help=f"git revision whose loommux.py is the 'before' side ({DEFAULT_BASELINE})")
    args = parser.parse_args()
    if min(args.floods, args.messages) < 1:
        parser.error("--floods and --messages must be at least 1")
    title = (f"loommux IOPub flood bench · Python {platform.python_version()} · {os.cpu_count()} CPUs · "
             "floods alternate the sides")
    with tempfile.TemporaryDirectory(prefix="loommux-bench-flood-") as scratch:
        bench = FloodBench(args, scratch)
        return run_and_report(bench.run, bench.problems, title, lambda: report(bench, args))


if __name__ == "__main__":
    sys.exit(main())
