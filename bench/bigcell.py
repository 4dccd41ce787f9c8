"""One cell that prints 2 GB: the server's memory while it runs and after, and every line readable after.

loommux keeps what cells print in files (README, "Where output lives"), so its memory should stay far below
the output. A stdio server runs one cell that writes 25,000,000 numbered lines of 80 characters (2 GB) in
chunks of 100,000; the server's RSS is sampled every 50 ms while it runs. Then the last lines, a range in
the middle and a line near the start are read, and a literal and a regex search run over the whole output,
each checked against the numbers the lines carry.

    .venv/bin/python bench/bigcell.py [--lines 25000000]
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile
import threading
import time

from benchlib import BenchError, StdioServer, fmt_time, print_table, proc_kib, server_env, timed

LINE_WIDTH = 80
CHUNK = 100_000
CODE = r"""import sys
for start in range(0, {lines}, {chunk}):
    stop = min(start + {chunk}, {lines})
    _ = sys.stdout.write("".join(f"{{i:08d}} {{'x' * 70}}\n" for i in range(start, stop)))
"""
TARGET_MIB = 256.0
SAMPLE_EVERY = 0.05


def sample_rss(pid: int, until: threading.Event, peaks: list[int]) -> None:
    """The highest RSS seen (KiB) until told to stop."""
    while not until.is_set():
        peaks[0] = max(peaks[0], proc_kib(pid))
        time.sleep(SAMPLE_EVERY)


def check_lines(text: str, numbers: list[int], problems: list[str], what: str) -> None:
    # read_output's lines as they are; search_output's as "M <n> | text"
    shown = [int(match[1]) for match in re.finditer(r"^(?:M [\d,]+ \| )?(\d{8}) x{70}$", text, re.MULTILINE)]
    if shown != numbers:
        problems.append(f"{what}: lines {shown[:3]}…{shown[-3:]} instead of {numbers[:3]}…{numbers[-3:]}")


def measure(lines: int, workspace: str, problems: list[str]) -> list[tuple[str, ...]]:
    server = StdioServer(workspace, server_env())
    try:
        server.initialize("loommux-bench-bigcell")
        server.tool("run_cell", {"freeform": "1"})
        before = proc_kib(server.proc.pid)
        peaks, done = [before], threading.Event()
        sampler = threading.Thread(target=sample_rss, args=(server.proc.pid, done, peaks), daemon=True)
        sampler.start()
        code = "%%loommux --wait 3600\n" + CODE.format(lines=lines, chunk=CHUNK)
        ingest, text = timed(server.run_to_end, {"freeform": code})
        done.set()
        sampler.join()
        if not re.match(r"In \[2\] · [^:·]+:", text):
            raise BenchError(f"the cell did not complete: {text[:300]!r}")
        after = proc_kib(server.proc.pid)
        hwm = proc_kib(server.proc.pid, "VmHWM")
        tail_time, tail = timed(server.tool, "read_output", {"execution": 2, "line_range": "-10:"})
        check_lines(tail, list(range(lines - 10, lines)), problems, "the last 10 lines")
        middle = lines // 2
        range_time, part = timed(server.tool, "read_output",
                                 {"execution": 2, "line_range": f"{middle + 1}:{middle + 1000}"})
        check_lines(part, list(range(middle, middle + 1000)), problems, "1,000 lines in the middle")
        wanted = lines - 12_345
        literal_time, found = timed(server.tool, "search_output",
                                    {"execution": 2, "query": f"{wanted:08d} ", "query_mode": "literal"})
        check_lines(found, [wanted], problems, "the literal search")
        regex_time, matched = timed(server.tool, "search_output",
                                    {"execution": 2, "query": r"^0000012\d ", "query_mode": "regex"})
        check_lines(matched, list(range(120, 130)), problems, "the regex search")
        searched = proc_kib(server.proc.pid)
    finally:
        server.close()
    size = lines * LINE_WIDTH
    mib = 1024.0
    peak = max(peaks[0], hwm) / mib
    return [
        ("measure", "value", "target", ""),
        (f"one cell printing {lines:,} lines ({size / 2**30:.2f} GiB): ingest",
         f"{fmt_time(ingest)} ({size / ingest / 2**20:.0f} MiB/s)", "", ""),
        ("server RSS before the cell", f"{before / mib:.1f} MiB", "", ""),
        ("server RSS at its peak while the cell ran (VmHWM)", f"{peak:.1f} MiB", f"< {TARGET_MIB:g} MiB",
         "ok" if peak < TARGET_MIB else "MISS"),
        ("server RSS after the cell", f"{after / mib:.1f} MiB", "", ""),
        ("server RSS after the reads and searches", f"{searched / mib:.1f} MiB", f"< {TARGET_MIB:g} MiB",
         "ok" if searched / mib < TARGET_MIB else "MISS"),
        ('read_output "-10:"', fmt_time(tail_time), "", ""),
        ("read_output 1,000 lines in the middle", fmt_time(range_time), "", ""),
        ("search_output literal, one line of all", fmt_time(literal_time), "", ""),
        (r"search_output regex ^0000012\d , ten lines of all", fmt_time(regex_time), "", ""),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=25_000_000, help="lines of 80 characters (25,000,000)")
    args = parser.parse_args()
    problems: list[str] = []
    with tempfile.TemporaryDirectory() as workspace:
        try:
            rows = measure(args.lines, os.path.realpath(workspace), problems)
        except BenchError as exc:
            print(f"benchmark failed: {exc}")
            return 1
    print("loommux: one cell printing gigabytes, kept in files")
    print_table(rows)
    for problem in problems:
        print(f"CHECK FAILED: {problem}")
    return 1 if problems or any(row[-1] == "MISS" for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
