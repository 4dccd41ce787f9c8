"""Benchmark loommux against a plain blocking jupyter_client client, side by side in one run.

Each side gets its own fresh kernel. loommux is driven the way an MCP client drives it: a child
process spoken to with newline-delimited JSON-RPC over its stdin and stdout.

    .venv/bin/python bench/roundtrip.py [--repeat 200] [--starts 3] [--floods 5]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

from benchlib import (
    BenchError,
    StdioServer,
    compared,
    fmt_time,
    p95,
    print_table,
    proc_kib,
    timed,
)
from jupyter_client.manager import start_new_kernel

TIMEOUT = 600.0
CLIENT_NAME = "loommux-bench"

# Numbered lines of 80 characters, newline included ("000000 xxx…x"), written at once.
FLOOD_CODE = r"""import sys
_ = sys.stdout.write("".join(f"{{i:06d}} {{'x' * 72}}\n" for i in range({lines})))
"""
LINES = 200_000
BIG_LINES = 1_000_000  # a second, bigger output: only its memory is measured
LINE_WIDTH = 80
FLOOD_BYTES = LINES * LINE_WIDTH
HEADER = "%%loommux --wait 600\n"
SEARCH_REGEX = r"^1234\d\d "  # lines 123400 to 123499: exactly 100 hits
SEARCH_HITS = 100
# A regex that is not line-anchored, over lines that each start like a match ("line 00000010 xxx…x"): re
# tries it at every line; loommux runs it in a thread (linear), beside re in this process (the floor).
REGEX_LINE_CODE = r"""import sys
_ = sys.stdout.write("".join(f"line {{i * 10:08d}} {{'x' * 65}}\n" for i in range({lines})))
"""
REGEX_QUERY = r"line \d{3}00000 "
REGEX_HITS = 20  # i * 10 ends in 00000 for every 10,000th line

TARGETS = {
    "round_trip": 1.05,
    "start": 1.3,
    "ingest": 1.2,
    "header": 1.05,
    "rss": 1.0,
    "tail_ms": 1.0,
    "search_ms": 20.0,
    "regex_ms": 20.0,
}


class RawKernel:
    """The floor: jupyter_client's blocking client on its own kernel, no server in between."""

    def __init__(self, workspace: str) -> None:
        self.km, self.kc = start_new_kernel(
            startup_timeout=TIMEOUT, kernel_name="python3", cwd=workspace, stderr=subprocess.DEVNULL
        )

    def execute(self, code: str) -> list[str]:
        """Run code; return its stream and result text once both the reply and the idle status arrived."""
        msg_id = self.kc.execute(code)
        received: list[str] = []
        while True:
            msg = self.kc.get_iopub_msg(timeout=TIMEOUT)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                received.append(content["text"])
            elif kind == "execute_result":
                received.append(content["data"]["text/plain"])
            elif kind == "status" and content["execution_state"] == "idle":
                break
        while self.kc.get_shell_msg(timeout=TIMEOUT)["parent_header"].get("msg_id") != msg_id:
            pass
        return received

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel()


def start_loommux(workspace: str) -> tuple[float, StdioServer]:
    """Process spawn -> initialize answered -> first run_cell result."""
    start = time.perf_counter()
    server = StdioServer(workspace, timeout=TIMEOUT)
    server.initialize(CLIENT_NAME)
    text = server.tool("run_cell", {"freeform": "1+1"})
    elapsed = time.perf_counter() - start
    if "Out[" not in text:
        server.close()
        raise BenchError(f"unexpected first result: {text!r}")
    return elapsed, server


def start_raw(workspace: str) -> tuple[float, RawKernel]:
    """start_new_kernel (ready) -> first execute finished."""
    start = time.perf_counter()
    raw = RawKernel(workspace)
    raw.execute("1+1")
    return time.perf_counter() - start, raw


def measure(repeat: int, starts: int, floods: int, workspace: str) -> tuple[dict, list[str]]:
    figures: dict = {}
    problems: list[str] = []
    alive: list[StdioServer | RawKernel] = []
    try:
        starts_loommux, starts_raw = [], []
        for _ in range(starts):
            while alive:
                alive.pop().close()
            elapsed, raw = start_raw(workspace)
            alive.append(raw)
            starts_raw.append(elapsed)
            elapsed, server = start_loommux(workspace)
            alive.append(server)
            starts_loommux.append(elapsed)
        figures["start"] = statistics.median(starts_loommux), statistics.median(starts_raw)
        round_trips(server, raw, repeat, figures)
        execution = flood(server, raw, floods, figures, problems)
        reads(server, execution, repeat, figures, problems)
        regex_search(server, repeat, figures, problems)
        figures["rss_big"] = flood_once(server, BIG_LINES, problems)["rss"]
    finally:
        while alive:
            alive.pop().close()
    return figures, problems


def round_trips(server: StdioServer, raw: RawKernel, repeat: int, figures: dict) -> None:
    """Alternate the two sides call by call, so drift on the machine hits both alike."""
    run_1_plus_1 = ("run_cell", {"freeform": "1+1"})
    for _ in range(10):
        server.tool(*run_1_plus_1)
        raw.execute("1+1")
    trips_loommux, trips_raw = [], []
    for _ in range(repeat):
        trips_loommux.append(timed(server.tool, *run_1_plus_1)[0])
        trips_raw.append(timed(raw.execute, "1+1")[0])
    figures["rt_median"] = statistics.median(trips_loommux), statistics.median(trips_raw)
    figures["rt_p95"] = p95(trips_loommux), p95(trips_raw)


def flood_once(server: StdioServer, lines: int, problems: list[str]) -> dict:
    """Run one flood of `lines` lines on loommux: its execution number, ingest time and memory.

    The server's RSS growth is read after a search of that output, so that its line index is counted too.
    """
    rss_before = proc_kib(server.proc.pid)
    # The same code as the raw client runs (no cell header): run_cell, then wait while it runs.
    elapsed, text = timed(server.run_to_end, {"freeform": FLOOD_CODE.format(lines=lines)})
    first_line = text.partition("\n")[0]
    execution = re.match(r"In \[(\d+)\]", first_line)
    if execution is None:
        raise BenchError(f"unexpected run_cell result: {text[:300]!r}")
    if not re.fullmatch(r"In \[\d+\] · [^:·]+:", first_line):
        problems.append(f"flood cell did not complete cleanly: {first_line!r}")
    n = int(execution.group(1))
    server.tool("search_output", {"execution": n, "query": SEARCH_REGEX, "query_mode": "regex"})
    growth = (proc_kib(server.proc.pid) - rss_before) * 1024, (proc_kib(server.proc.pid, "VmHWM") - rss_before) * 1024
    return {"execution": n, "ingest": elapsed, "rss": growth}


def flood(server: StdioServer, raw: RawKernel, floods: int, figures: dict, problems: list[str]) -> int:
    """Ingest the big output on both sides, alternating; RSS is read around each loommux flood.

    Returns the loommux execution number that holds the first flood.
    """
    for mode in ("regex", "literal"):  # one-time costs (worker threads) are paid before memory is measured
        server.tool("search_output", {"query": "2", "query_mode": mode})
    runs, ingest_raw, with_header = [], [], []
    for _ in range(floods):
        runs.append(flood_once(server, LINES, problems))
        # the same cell under a %%loommux header: what the header costs in the kernel
        with_header.append(timed(server.run_to_end, {"freeform": HEADER + FLOOD_CODE.format(lines=LINES)})[0])
        elapsed, received = timed(raw.execute, FLOOD_CODE.format(lines=LINES))
        ingest_raw.append(elapsed)
        size = sum(map(len, received))
        if size != FLOOD_BYTES:
            problems.append(f"raw client received {size:,} characters, not {FLOOD_BYTES:,}")
    figures["ingest"] = statistics.median(run["ingest"] for run in runs), statistics.median(ingest_raw)
    figures["header"] = statistics.median(with_header), figures["ingest"][0]
    # Every flood's output is retained: the median growth is what one more output costs (the first one
    # also pays one-time costs), the peak is read around the first.
    figures["rss"] = statistics.median(run["rss"][0] for run in runs), runs[0]["rss"][1]
    return runs[0]["execution"]


def reads(server: StdioServer, execution: int, repeat: int, figures: dict, problems: list[str]) -> None:
    tail_args = {"execution": execution, "line_range": "-10:"}
    tails = [timed(server.tool, "read_output", tail_args) for _ in range(repeat)]
    figures["tail"] = statistics.median(elapsed for elapsed, _ in tails)
    tail_text = tails[-1][1]
    if f"of {LINES:,}]" not in tail_text.partition("\n")[0] or f"\n{LINES - 1:06d} " not in tail_text:
        problems.append(f"tail read does not show the last of {LINES:,} lines: {tail_text[:200]!r}")

    search_args = {"execution": execution, "query": SEARCH_REGEX, "query_mode": "regex"}
    searches = [timed(server.tool, "search_output", search_args) for _ in range(repeat)]
    figures["search"] = statistics.median(elapsed for elapsed, _ in searches)
    search_head = searches[-1][1].partition("\n")[0]
    if f" {SEARCH_HITS} matching lines" not in search_head:
        problems.append(f"search did not report {SEARCH_HITS} matching lines: {search_head!r}")


def regex_search(server: StdioServer, repeat: int, figures: dict, problems: list[str]) -> None:
    """REGEX_QUERY over LINES lines: search_output and re.finditer over the same text, alternated."""
    text = server.run_to_end({"freeform": REGEX_LINE_CODE.format(lines=LINES)})
    execution = re.match(r"In \[(\d+)\]", text)
    if execution is None:
        raise BenchError(f"unexpected run_cell result: {text[:300]!r}")
    local = "".join(f"line {i * 10:08d} {'x' * 65}\n" for i in range(LINES))
    pattern = re.compile(REGEX_QUERY, re.MULTILINE)

    def floor() -> int:
        return sum(1 for _ in pattern.finditer(local))

    args = {"execution": int(execution.group(1)), "query": REGEX_QUERY, "query_mode": "regex"}
    server.tool("search_output", args)  # the line index is built by the first search
    ours, theirs = [], []
    for _ in range(repeat):
        elapsed, head = timed(server.tool, "search_output", args)
        ours.append(elapsed)
        elapsed, hits = timed(floor)
        theirs.append(elapsed)
    figures["regex"] = statistics.median(ours), statistics.median(theirs)
    head = head.partition("\n")[0]
    if f" {REGEX_HITS} matching lines" not in head or hits != REGEX_HITS:
        problems.append(f"the regex search did not find {REGEX_HITS} lines: {head!r}; re found {hits}")


def fmt_mib(size: float) -> str:
    return f"{size / 2**20:+.1f} MiB"


def report(figures: dict, args: argparse.Namespace) -> list[tuple[str, ...]]:
    def row(label: str, key: str, target: float | None) -> tuple[str, ...]:
        return compared(label, *figures[key], target)

    def absolute(label: str, key: str, target_ms: float) -> tuple[str, ...]:
        ours = figures[key]
        mark = "ok" if ours * 1e3 <= target_ms else "MISS"
        return label, fmt_time(ours), "", "", f"≤ {target_ms:g} ms", mark

    def beside_floor(label: str, key: str, target_ms: float) -> tuple[str, ...]:
        ours, floor = figures[key]
        mark = "ok" if ours * 1e3 <= target_ms else "MISS"
        return label, fmt_time(ours), fmt_time(floor), f"{ours / floor:.2f}×", f"≤ {target_ms:g} ms", mark

    def memory(lines: int, key: str) -> tuple[str, ...]:
        growth, peak = figures[key]
        size = lines * LINE_WIDTH
        ratio = growth / size
        return (f"server RSS growth, {lines:,} lines (peak {fmt_mib(peak)})", fmt_mib(growth),
                f"output {size / 2**20:.1f} MiB", f"{ratio:.2f}×", f"≤ {TARGETS['rss']:g}×",
                "ok" if ratio <= TARGETS["rss"] else "MISS")

    return [
        ("measure", "loommux", "jupyter_client", "ratio", "target", ""),
        row(f"round trip 1+1, median of {args.repeat}", "rt_median", TARGETS["round_trip"]),
        row(f"round trip 1+1, p95 of {args.repeat}", "rt_p95", None),
        row(f"start to first result, median of {args.starts}", "start", TARGETS["start"]),
        row(
            f"ingest {LINES:,} × {LINE_WIDTH} chars, median of {args.floods}", "ingest", TARGETS["ingest"]
        ),
        row(f"the same with a %%loommux header (vs without), median of {args.floods}", "header",
                 TARGETS["header"]),
        memory(LINES, "rss"),
        memory(BIG_LINES, "rss_big"),
        absolute(f'read_output "-10:", median of {args.repeat}', "tail", TARGETS["tail_ms"]),
        absolute(
            f"search_output {SEARCH_HITS} hits, median of {args.repeat}", "search", TARGETS["search_ms"]
        ),
        beside_floor(f'search_output "{REGEX_QUERY}", {LINES:,} lines (vs re here), median of {args.repeat}',
                     "regex", TARGETS["regex_ms"]),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200, help="round trips, tail reads and searches (200)")
    parser.add_argument("--starts", type=int, default=3, help="cold starts per side; the median is shown (3)")
    parser.add_argument(
        "--floods", type=int, default=5, help="big-output cells per side; the median is shown (5)"
    )
    args = parser.parse_args()
    if min(args.repeat, args.starts, args.floods) < 1:
        parser.error("--repeat, --starts and --floods must be at least 1")

    with tempfile.TemporaryDirectory(prefix="loommux-bench-") as workspace:
        try:
            figures, problems = measure(args.repeat, args.starts, args.floods, workspace)
        except BenchError as exc:
            print(f"benchmark failed: {exc}", file=sys.stderr)
            return 1
    print(
        f"loommux bench · Python {platform.python_version()} · {os.cpu_count()} CPUs · "
        f"each side on its own fresh kernel"
    )
    print_table(report(figures, args))
    for problem in problems:
        print(f"CHECK FAILED: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
