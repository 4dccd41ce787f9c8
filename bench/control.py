"""Measure what the control plane costs, side by side in one run.

1. Kernel start and the ``1+1`` round trip over stdio, before and after the control plane: "before"
   is loommux.py at a git revision (``--baseline``, the commit before the control plane landed),
   "after" is this working tree's loommux.py. Both are driven the way an MCP client drives them:
   a child process spoken to with newline-delimited JSON-RPC, started both ways an MCP host starts
   it: the installed ``loommux`` command (bytecode cached) and ``python loommux.py`` (compiled on
   every start). Cold starts rotate the four sides and the warm round trips alternate call by call,
   so drift on the machine hits all alike.
2. A forwarded ``1+1`` (``%%loommux --kernel NAME`` through the HTTP control plane) against a
   direct one, on one ``loommux --server`` child (started each way) and one MCP session,
   interleaved call by call.

    .venv/bin/python bench/control.py [--starts 8] [--repeat 200] [--baseline ae41dc0] [--forwarding-only]
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
    LAUNCHES,
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

    def start_stdio(self, server: Path, launch: str) -> tuple[float, StdioServer]:
        """Process spawn -> initialize answered -> first run_cell result. The server stays alive."""
        start = time.perf_counter()
        child = StdioServer(self.workspace, server=server, launch=launch)
        self.alive.append(child)
        child.initialize(CLIENT_NAME)
        text, is_error = run_cell(child, CELL)
        elapsed = time.perf_counter() - start
        check_result(text, is_error, DIRECT_RESULT, "first run_cell")
        return elapsed, child

    def before_after(self) -> None:
        """Cold starts of the four sides (before and after, each started both ways), rotating; then warm
        round trips, before against after, on the last servers started each way."""
        paths = {
            "before": extract_baseline(self.args.baseline,
                                       tempfile.mkdtemp(prefix="baseline-", dir=self.scratch)),
            "after": SERVER,
        }
        sides = [(version, launch) for launch in LAUNCHES for version in paths]
        starts: dict[tuple[str, str], list[float]] = {side: [] for side in sides}
        servers: dict[tuple[str, str], StdioServer] = {}
        for round_number in range(self.args.starts):
            self.stop_all()
            # Where each side starts rotates every round: a later start shares the machine with the
            # earlier sides' fresh servers, and that should not always be the same side.
            shift = round_number % len(sides)
            for version, launch in sides[shift:] + sides[:shift]:
                elapsed, servers[version, launch] = self.start_stdio(paths[version], launch)
                starts[version, launch].append(elapsed)
        for launch in LAUNCHES:
            self.figures["start", launch] = (statistics.median(starts["after", launch]),
                                             statistics.median(starts["before", launch]))
            old, new = servers["before", launch], servers["after", launch]
            trips_old, trips_new = self.interleave(
                partial(run_cell, old), CELL, DIRECT_RESULT, partial(run_cell, new), CELL, DIRECT_RESULT
            )
            self.figures["rt_median", launch] = statistics.median(trips_new), statistics.median(trips_old)
            self.figures["rt_p95", launch] = p95(trips_new), p95(trips_old)
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
        """A direct 1+1 against one forwarded to a named kernel, on one HTTP session, on a server started
        each way."""
        for launch in LAUNCHES:
            server = HttpServer(self.workspace, server_env({"LOOMMUX_SPARE_KERNELS": "1"}), launch=launch)
            self.alive.append(server)
            server.wait_listening()
            session = HttpSession(server, CLIENT_NAME)
            try:
                text, is_error = run_cell(session, FORWARDED_CELL)  # opens the target kernel
                check_result(text, is_error, FORWARDED_RESULT, "first forwarded run_cell")
                run = partial(run_cell, session)
                direct, forwarded = self.interleave(run, CELL, DIRECT_RESULT,
                                                    run, FORWARDED_CELL, FORWARDED_RESULT)
            finally:
                session.close()
            self.figures["fw_median", launch] = statistics.median(forwarded), statistics.median(direct)
            self.figures["fw_p95", launch] = p95(forwarded), p95(direct)
            self.stop_all()

    def steps(self) -> list:
        return [self.forwarding] if self.args.forwarding_only else [self.before_after, self.forwarding]


def report(figures: dict, args: argparse.Namespace) -> list[tuple[str, ...]]:
    def rows(label: str, key: str, target: float | None) -> list[tuple[str, ...]]:
        return [compared(f"{label} · {name}", *figures[key, launch], target, miss="over")
                for launch, name in LAUNCHES.items()]

    def compile_cost(version: int) -> str:
        installed, script = (figures["start", launch][version] for launch in LAUNCHES)
        return f"{(script - installed) * 1e3:+.0f} ms"

    forwarding = [
        ("HTTP, one session", "forwarded", "direct", "ratio", "", ""),
        *rows(f"round trip 1+1, median of {args.repeat}", "fw_median", None),
        *rows(f"round trip 1+1, p95 of {args.repeat}", "fw_p95", None),
    ]
    if args.forwarding_only:
        return forwarding
    return [
        ("stdio, control plane", "after", f"before ({args.baseline})", "ratio", "target", ""),
        *rows(f"start to first result, median of {args.starts}", "start", TARGET_SLOWDOWN),
        (f"  {LAUNCHES['script']} − {LAUNCHES['installed']}, start (compiling loommux.py)", compile_cost(0),
         compile_cost(1), "", "", ""),
        *rows(f"round trip 1+1, median of {args.repeat}", "rt_median", TARGET_SLOWDOWN),
        *rows(f"round trip 1+1, p95 of {args.repeat}", "rt_p95", None),
        ("", "", "", "", "", ""),
        *forwarding,
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=8, help="cold starts per side; the median is shown (8)")
    parser.add_argument("--repeat", type=int, default=200, help="round trips per side (200)")
    parser.add_argument(
        "--baseline", default=DEFAULT_BASELINE,
        help=f"git revision whose loommux.py is the 'before' side ({DEFAULT_BASELINE}, before the control "
             "plane)",
    )
    parser.add_argument("--forwarding-only", action="store_true",
                        help="only the forwarded-against-direct comparison (part 2)")
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
