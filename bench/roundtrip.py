"""Benchmark loommux against a plain blocking jupyter_client client, side by side in one run.

Each side gets its own fresh kernel. loommux is driven the way an MCP client drives it: a child
process spoken to with newline-delimited JSON-RPC over its stdin and stdout, started both ways an
MCP host starts it: the installed ``loommux`` command (its bytecode cached) and ``python loommux.py``
(compiled on every start); what that compile costs is shown too. Starts rotate the three sides,
round trips alternate call by call and floods cell by cell, so drift on the machine hits all alike.

    .venv/bin/python bench/roundtrip.py [--repeat 200] [--starts 6] [--floods 5]
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
    LAUNCHES,
    SERVER,
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
# The same lines, written 100,000 at a time (the kernel never holds the whole output).
BIG_FLOOD_CODE = r"""import sys
for start in range(0, {lines}, 100_000):
    stop = min(start + 100_000, {lines})
    _ = sys.stdout.write("".join(f"{{i:06d}} {{'x' * 72}}\n" for i in range(start, stop)))
"""
LINES = 200_000
BIG_LINES = 5_000_000  # a second, bigger output: only its memory is measured
RANGE = "100001:110000"  # a 10,000-line range of the flood
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

NO_REPLY_SLEEP = "get_ipython().kernel._execute_sleep = 0"

TARGETS = {
    "round_trip": 1.05,
    "start": 1.0,
    "ingest": 1.1,
    "header": 1.1,  # the same cell under a header, against the same floor
    "rss": 0.05,  # server RSS growth over the retained output (kept in files, not in memory)
    "rss_mib": 2.0,  # and at most this with LINES lines
    "tail_ms": 1.0,
    "range_ms": 5.0,
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


def start_loommux(workspace: str, launch: str) -> tuple[float, StdioServer]:
    """Process spawn -> initialize answered -> first run_cell result."""
    start = time.perf_counter()
    server = StdioServer(workspace, timeout=TIMEOUT, launch=launch)
    server.initialize(CLIENT_NAME)
    text = server.tool("run_cell", {"freeform": "1+1"})
    elapsed = time.perf_counter() - start
    if "Out[" not in text:
        server.close()
        raise BenchError(f"unexpected first result: {text!r}")
    return elapsed, server


def start_raw(workspace: str) -> tuple[float, RawKernel]:
    """start_new_kernel (ready) -> first execute finished. Its kernel then replies without ipykernel's sleep
    before execute_reply, as loommux's kernels do (this client, too, ends a cell at the reply and the idle
    status): the round trips compare the clients, not that setting."""
    start = time.perf_counter()
    raw = RawKernel(workspace)
    raw.execute("1+1")
    elapsed = time.perf_counter() - start
    raw.execute(NO_REPLY_SLEEP)
    return elapsed, raw


def compile_time(repeat: int = 5) -> float:
    """What ``python loommux.py`` pays on every start and the installed command does not: compiling the
    file."""
    source = SERVER.read_text(encoding="utf-8")
    return statistics.median(timed(compile, source, str(SERVER), "exec")[0] for _ in range(repeat))


def measure(repeat: int, starts: int, floods: int, workspace: str) -> tuple[dict, list[str]]:
    figures: dict = {"compile": compile_time()}
    problems: list[str] = []
    alive: list[StdioServer | RawKernel] = []
    sides = ("raw", *LAUNCHES)
    try:
        start_times: dict[str, list[float]] = {side: [] for side in sides}
        servers: dict[str, StdioServer] = {}
        for round_number in range(starts):
            while alive:
                alive.pop().close()
            for side in sides[round_number % 3 :] + sides[: round_number % 3]:  # each side in each place
                if side == "raw":
                    elapsed, raw = start_raw(workspace)
                    alive.append(raw)
                else:
                    elapsed, servers[side] = start_loommux(workspace, side)
                    alive.append(servers[side])
                start_times[side].append(elapsed)
        for launch in LAUNCHES:
            figures["start", launch] = (statistics.median(start_times[launch]),
                                        statistics.median(start_times["raw"]))
        round_trips(servers, raw, repeat, figures)
        executions = flood(servers, raw, floods, figures, problems)
        for launch, server in servers.items():
            reads(server, launch, executions[launch], repeat, figures, problems)
            regex_search(server, launch, repeat, figures, problems)
            figures["rss_big", launch] = flood_once(server, BIG_LINES, problems, BIG_FLOOD_CODE)["rss"]
    finally:
        while alive:
            alive.pop().close()
    return figures, problems


def round_trips(servers: dict[str, StdioServer], raw: RawKernel, repeat: int, figures: dict) -> None:
    """Alternate the sides call by call, so drift on the machine hits all alike."""
    run_1_plus_1 = ("run_cell", {"freeform": "1+1"})
    for _ in range(10):
        for server in servers.values():
            server.tool(*run_1_plus_1)
        raw.execute("1+1")
    trips: dict[str, list[float]] = {side: [] for side in ("raw", *servers)}
    for _ in range(repeat):
        for launch, server in servers.items():
            trips[launch].append(timed(server.tool, *run_1_plus_1)[0])
        trips["raw"].append(timed(raw.execute, "1+1")[0])
    for launch in servers:
        figures["rt_median", launch] = statistics.median(trips[launch]), statistics.median(trips["raw"])
        figures["rt_p95", launch] = p95(trips[launch]), p95(trips["raw"])


def flood_once(server: StdioServer, lines: int, problems: list[str], code: str = FLOOD_CODE) -> dict:
    """Run one flood of `lines` lines on loommux: its execution number, ingest time and memory.

    The server's RSS growth is read after a search of that output, so that its line index is counted too.
    """
    rss_before = proc_kib(server.proc.pid)
    # The same code as the raw client runs (no cell header): run_cell, then wait while it runs.
    elapsed, text = timed(server.run_to_end, {"freeform": code.format(lines=lines)})
    first_line = text.partition("\n")[0]
    execution = re.match(r"In \[(\d+)\]", first_line)
    if execution is None:
        raise BenchError(f"unexpected run_cell result: {text[:300]!r}")
    if not re.fullmatch(r"In \[\d+\] · [^:·]+:", first_line):
        problems.append(f"flood cell did not complete cleanly: {first_line!r}")
    n = int(execution.group(1))
    server.tool("search_output", {"execution": n, "query": SEARCH_REGEX, "query_mode": "regex"})
    growth = ((proc_kib(server.proc.pid) - rss_before) * 1024,
              (proc_kib(server.proc.pid, "VmHWM") - rss_before) * 1024)
    return {"execution": n, "ingest": elapsed, "rss": growth}


def flood(servers: dict[str, StdioServer], raw: RawKernel, floods: int, figures: dict,
          problems: list[str]) -> dict[str, int]:
    """Ingest the big output on every side, alternating cell by cell; RSS is read around each loommux flood.

    Returns, for each loommux side, the execution number that holds its first flood.
    """
    for server in servers.values():  # one-time costs (worker threads) are paid before memory is measured
        for mode in ("regex", "literal"):
            server.tool("search_output", {"query": "2", "query_mode": mode})
    runs: dict[str, list[dict]] = {launch: [] for launch in servers}
    with_header: dict[str, list[float]] = {launch: [] for launch in servers}
    ingest_raw = []
    for _ in range(floods):
        for launch, server in servers.items():
            runs[launch].append(flood_once(server, LINES, problems))
            # the same cell under a %%loommux header: what the header costs in the kernel
            with_header[launch].append(timed(server.run_to_end,
                                             {"freeform": HEADER + FLOOD_CODE.format(lines=LINES)})[0])
        elapsed, received = timed(raw.execute, FLOOD_CODE.format(lines=LINES))
        ingest_raw.append(elapsed)
        size = sum(map(len, received))
        if size != FLOOD_BYTES:
            problems.append(f"raw client received {size:,} characters, not {FLOOD_BYTES:,}")
    floor = statistics.median(ingest_raw)
    for launch in servers:
        figures["ingest", launch] = statistics.median(run["ingest"] for run in runs[launch]), floor
        figures["header", launch] = statistics.median(with_header[launch]), floor
        # Every flood's output is retained: the median growth is what one more output costs (the first one
        # also pays one-time costs), the peak is read around the first.
        figures["rss", launch] = (statistics.median(run["rss"][0] for run in runs[launch]),
                                  runs[launch][0]["rss"][1])
    return {launch: launch_runs[0]["execution"] for launch, launch_runs in runs.items()}


def reads(server: StdioServer, launch: str, execution: int, repeat: int, figures: dict,
          problems: list[str]) -> None:
    tail_args = {"execution": execution, "line_range": "-10:"}
    tails = [timed(server.tool, "read_output", tail_args) for _ in range(repeat)]
    figures["tail", launch] = statistics.median(elapsed for elapsed, _ in tails)
    tail_text = tails[-1][1]
    if f"of {LINES:,}]" not in tail_text.partition("\n")[0] or f"\n{LINES - 1:06d} " not in tail_text:
        problems.append(f"tail read does not show the last of {LINES:,} lines: {tail_text[:200]!r}")

    range_args = {"execution": execution, "line_range": RANGE, "max_chars": 100}
    ranges = [timed(server.tool, "read_output", range_args) for _ in range(repeat)]
    figures["range", launch] = statistics.median(elapsed for elapsed, _ in ranges)
    range_head = ranges[-1][1].partition("\n")[0]
    if "lines 100,001-110,000 of" not in range_head and "lines 100001-110000 of" not in range_head:
        problems.append(f"the range read did not return lines {RANGE}: {range_head!r}")

    search_args = {"execution": execution, "query": SEARCH_REGEX, "query_mode": "regex"}
    searches = [timed(server.tool, "search_output", search_args) for _ in range(repeat)]
    figures["search", launch] = statistics.median(elapsed for elapsed, _ in searches)
    search_head = searches[-1][1].partition("\n")[0]
    if f" {SEARCH_HITS} matching lines" not in search_head:
        problems.append(f"search did not report {SEARCH_HITS} matching lines: {search_head!r}")


def regex_search(server: StdioServer, launch: str, repeat: int, figures: dict, problems: list[str]) -> None:
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
    figures["regex", launch] = statistics.median(ours), statistics.median(theirs)
    head = head.partition("\n")[0]
    if f" {REGEX_HITS} matching lines" not in head or hits != REGEX_HITS:
        problems.append(f"the regex search did not find {REGEX_HITS} lines: {head!r}; re found {hits}")


def fmt_mib(size: float) -> str:
    return f"{size / 2**20:+.1f} MiB"


def report(figures: dict, args: argparse.Namespace) -> list[tuple[str, ...]]:
    def row(label: str, key: str, target: float | None) -> list[tuple[str, ...]]:
        return [compared(f"{label} · {name}", *figures[key, launch], target)
                for launch, name in LAUNCHES.items()]

    def absolute(label: str, key: str, target_ms: float) -> list[tuple[str, ...]]:
        rows = []
        for launch, name in LAUNCHES.items():
            ours = figures[key, launch]
            rows.append((f"{label} · {name}", fmt_time(ours), "", "", f"≤ {target_ms:g} ms",
                         "ok" if ours * 1e3 <= target_ms else "MISS"))
        return rows

    def beside_floor(label: str, key: str, target_ms: float) -> list[tuple[str, ...]]:
        rows = []
        for launch, name in LAUNCHES.items():
            ours, floor = figures[key, launch]
            mark = "ok" if ours * 1e3 <= target_ms else "MISS"
            rows.append((f"{label} · {name}", fmt_time(ours), fmt_time(floor), f"{ours / floor:.2f}×",
                         f"≤ {target_ms:g} ms", mark))
        return rows

    def memory(lines: int, key: str, limit_mib: float | None = None) -> list[tuple[str, ...]]:
        rows = []
        for launch, name in LAUNCHES.items():
            growth, peak = figures[key, launch]
            size = lines * LINE_WIDTH
            ratio = growth / size
            target = f"≤ {TARGETS['rss']:g}×" + (f", ≤ {limit_mib:g} MiB" if limit_mib else "")
            met = ratio <= TARGETS["rss"] and (limit_mib is None or growth <= limit_mib * 2**20)
            rows.append((f"server RSS growth, {lines:,} lines (peak {fmt_mib(peak)}) · {name}",
                         fmt_mib(growth), f"output {size / 2**20:.1f} MiB", f"{ratio:.3f}×", target,
                         "ok" if met else "MISS"))
        return rows

    installed, script = (figures["start", launch][0] for launch in LAUNCHES)
    return [
        ("measure", "loommux", "jupyter_client", "ratio", "target", ""),
        *row(f"round trip 1+1, median of {args.repeat}", "rt_median", TARGETS["round_trip"]),
        *row(f"round trip 1+1, p95 of {args.repeat}", "rt_p95", None),
        *row(f"start to first result, median of {args.starts}", "start", TARGETS["start"]),
        (f"  {LAUNCHES['script']} − {LAUNCHES['installed']}, start", f"{(script - installed) * 1e3:+.0f} ms",
         "", "", "", ""),
        ("  compiling loommux.py (what only python loommux.py pays), median of 5",
         fmt_time(figures["compile"]),
         "", "", "", ""),
        *row(f"ingest {LINES:,} × {LINE_WIDTH} chars, median of {args.floods}", "ingest", TARGETS["ingest"]),
        *row(f"the same with a %%loommux header, median of {args.floods}", "header", TARGETS["header"]),
        *memory(LINES, "rss", TARGETS["rss_mib"]),
        *memory(BIG_LINES, "rss_big"),
        *absolute(f'read_output "-10:", median of {args.repeat}', "tail", TARGETS["tail_ms"]),
        *absolute(f'read_output "{RANGE}" (10,000 lines), median of {args.repeat}', "range",
                  TARGETS["range_ms"]),
        *absolute(f"search_output {SEARCH_HITS} hits, median of {args.repeat}", "search",
                  TARGETS["search_ms"]),
        *beside_floor(f'search_output "{REGEX_QUERY}", {LINES:,} lines (vs re here), median of {args.repeat}',
                      "regex", TARGETS["regex_ms"]),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200, help="round trips, tail reads and searches (200)")
    parser.add_argument("--starts", type=int, default=6, help="cold starts per side; the median is shown (6)")
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
        f"each side on its own fresh kernel, none sleeping before execute_reply · loommux started both ways"
    )
    print_table(report(figures, args))
    for problem in problems:
        print(f"CHECK FAILED: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
