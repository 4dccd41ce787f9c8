"""Measure what the control plane costs, side by side in one run.

1. Kernel start and the ``1+1`` round trip over stdio, before and after the control plane: "before"
   is loommux.py at a git revision (``--baseline``, the commit before the control plane landed),
   "after" is this working tree's loommux.py. Both are driven the way an MCP client drives them:
   a child process spoken to with newline-delimited JSON-RPC. Cold starts alternate the two sides
   and the warm round trips alternate call by call, so drift on the machine hits both alike.
2. A forwarded ``1+1`` (``%%loommux --kernel NAME`` through the HTTP control plane) against a
   direct one, on one ``loommux --server`` child and one MCP session, interleaved call by call.

    .venv/bin/python bench/control.py [--starts 5] [--repeat 200] [--baseline ae41dc0]
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
from functools import partial
from pathlib import Path

from benchlib import (
    SERVER,
    Bench,
    BenchError,
    HttpServer,
    HttpSession,
    StdioServer,
    compared,
    extract_baseline,
    p95,
    run_and_report,
    server_env,
    timed,
    tool_text,
)

DEFAULT_BASELINE = "ae41dc0"  # the last commit before the control plane
CLIENT_NAME = "loommux-bench-control"
WARMUP = 10  # uncounted calls per side before each round-trip comparison

CELL = "1+1"
TARGET_NAME = "bench-target"
FORWARDED_CELL = f"%%loommux --kernel {TARGET_NAME}\n{CELL}"
DIRECT_RESULT = re.compile(r"In \[(\d+)\] · [^\n]*:\nOut\[\1\]: 2")
# The target's own execution number heads the relayed lines, and its Out[] carries the same number.
FORWARDED_RESULT = re.compile(rf"\[forwarded to kernel {TARGET_NAME} · execution (\d+)\]\nOut\[\1\]: 2")

TARGET_SLOWDOWN = 1.05  # after / before, for start and round trip


def check_result(text: str, is_error: bool, pattern: re.Pattern, what: str) -> None:
    if is_error or not pattern.search(text):
        raise BenchError(f"unexpected {what} result: {text[:400]!r}")


def run_cell(client: StdioServer | HttpSession, code: str) -> tuple[str, bool]:
    return tool_text(client.call("run_cell", {"code": code}))


class ControlBench(Bench):
    def __init__(self, args: argparse.Namespace, scratch: str) -> None:
        super().__init__(tempfile.mkdtemp(prefix="workspace-", dir=scratch))
        self.args = args
        self.scratch = scratch

    def start_stdio(self, server: Path) -> tuple[float, StdioServer]:
        """Process spawn -> initialize answered -> first run_cell result. The server stays alive."""
        start = time.perf_counter()
        child = StdioServer(self.workspace, server=server)
        self.alive.append(child)
        child.initialize(CLIENT_NAME)
        text, is_error = run_cell(child, CELL)
        elapsed = time.perf_counter() - start
        check_result(text, is_error, DIRECT_RESULT, "first run_cell")
        return elapsed, child

    def before_after(self) -> None:
        """Cold starts of both sides, alternating; then warm round trips on the last pair."""
        sides = {
            "before": extract_baseline(self.args.baseline, tempfile.mkdtemp(prefix="baseline-", dir=self.scratch)),
            "after": SERVER,
        }
        starts: dict[str, list[float]] = {"before": [], "after": []}
        servers: dict[str, StdioServer] = {}
        for round_number in range(self.args.starts):
            self.stop_all()
            # Which side starts first flips every round: the second start shares the machine with
            # the first side's fresh server, and that should not always be the same side.
            order = ("before", "after") if round_number % 2 == 0 else ("after", "before")
            for side in order:
                elapsed, servers[side] = self.start_stdio(sides[side])
                starts[side].append(elapsed)
        self.figures["start"] = statistics.median(starts["after"]), statistics.median(starts["before"])
        old, new = servers["before"], servers["after"]
        trips_old, trips_new = self.interleave(
            partial(run_cell, old), CELL, DIRECT_RESULT, partial(run_cell, new), CELL, DIRECT_RESULT
        )
        self.figures["rt_median"] = statistics.median(trips_new), statistics.median(trips_old)
        self.figures["rt_p95"] = p95(trips_new), p95(trips_old)
        self.stop_all()

    def interleave(self, run_a, code_a: str, check_a: re.Pattern, run_b, code_b: str, check_b: re.Pattern):
        """Time ``run_a(code_a)`` and ``run_b(code_b)`` alternately; every result is checked."""
        def once(run, code: str, check: re.Pattern) -> float:
            elapsed, (text, is_error) = timed(run, code)
            check_result(text, is_error, check, "run_cell")
            return elapsed

        for _ in range(WARMUP):
            once(run_a, code_a, check_a)
            once(run_b, code_b, check_b)
        trips_a, trips_b = [], []
        for _ in range(self.args.repeat):
            trips_a.append(once(run_a, code_a, check_a))
            trips_b.append(once(run_b, code_b, check_b))
        return trips_a, trips_b

    def forwarding(self) -> None:
        """A direct 1+1 against one forwarded to a named kernel, on one HTTP session."""
        server = HttpServer(self.workspace, server_env({"LOOMMUX_SPARE_KERNELS": "1"}))
        self.alive.append(server)
        server.wait_listening()
        session = HttpSession(server, CLIENT_NAME)
        try:
            text, is_error = run_cell(session, FORWARDED_CELL)  # opens the target kernel
            check_result(text, is_error, FORWARDED_RESULT, "first forwarded run_cell")
            run = partial(run_cell, session)
            direct, forwarded = self.interleave(run, CELL, DIRECT_RESULT, run, FORWARDED_CELL, FORWARDED_RESULT)
        finally:
            session.close()
        self.figures["fw_median"] = statistics.median(forwarded), statistics.median(direct)
        self.figures["fw_p95"] = p95(forwarded), p95(direct)
        self.stop_all()

    def steps(self) -> list:
        return [self.before_after, self.forwarding]


def report(figures: dict, args: argparse.Namespace) -> list[tuple[str, ...]]:
    def row(label: str, key: str, target: float | None) -> tuple[str, ...]:
        return compared(label, *figures[key], target, miss="over")

    return [
        ("stdio, control plane", "after", f"before ({args.baseline})", "ratio", "target", ""),
        row(f"start to first result, median of {args.starts}", "start", TARGET_SLOWDOWN),
        row(f"round trip 1+1, median of {args.repeat}", "rt_median", TARGET_SLOWDOWN),
        row(f"round trip 1+1, p95 of {args.repeat}", "rt_p95", None),
        ("", "", "", "", "", ""),
        ("HTTP, one session", "forwarded", "direct", "ratio", "", ""),
        row(f"round trip 1+1, median of {args.repeat}", "fw_median", None),
        row(f"round trip 1+1, p95 of {args.repeat}", "fw_p95", None),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=5, help="cold starts per side; the median is shown (5)")
    parser.add_argument("--repeat", type=int, default=200, help="round trips per side (200)")
    parser.add_argument(
        "--baseline", default=DEFAULT_BASELINE,
        help=f"git revision whose loommux.py is the 'before' side ({DEFAULT_BASELINE}, before the control plane)",
    )
    args = parser.parse_args()
    if min(args.starts, args.repeat) < 1:
        parser.error("--starts and --repeat must be at least 1")

    title = (
        f"loommux control-plane bench · Python {platform.python_version()} · {os.cpu_count()} CPUs · "
        f"warm round trips alternate call by call"
    )
    with tempfile.TemporaryDirectory(prefix="loommux-bench-control-") as scratch:
        bench = ControlBench(args, scratch)
        return run_and_report(bench.run, bench.problems, title, lambda: report(bench.figures, args))


if __name__ == "__main__":
    sys.exit(main())
