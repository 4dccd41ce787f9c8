"""Load loommux over MCP Streamable HTTP, side by side with a single stdio session, in one run.

Phases 1-4 run on one ``loommux --server`` child (phase 3 also on a stdio child); phase 5 starts
one more server per setting. MCP sessions speak through benchlib's raw HTTP/1.1 keep-alive client on
asyncio streams, one connection per session; the stdio side is newline-delimited JSON-RPC.

1. N sessions, each in its own private resource (kernel), running small cells at the same time.
2. N sessions sharing one named resource, taking turns: a ``busy:`` answer is retried after a nap.
3. One HTTP session and one stdio session running the same cells, alternating call by call.
4. Server RSS (the server process only, not its kernels) before and after phases 1-3.
5. ``initialize`` to the first cell's result on a server with a warm spare kernel and one without.

    .venv/bin/python bench/http_load.py [--sessions 16] [--cells 50] [--stdio-cells 200] [--starts 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

from benchlib import (
    AsyncChild,
    AsyncHttpSession,
    AsyncStdioSession,
    BenchError,
    fmt_time,
    p95,
    pid_alive,
    print_table,
    proc_cpu_seconds,
    start_async_server,
    timed_async,
)

CLIENT_NAME = "loommux-http-load"
SHARED_RESOURCE = "shared1"
CELL = "1+1"
CELL_RESULT = re.compile(r"In \[(\d+)\] · [^\n]*:\nOut\[\1\]: 2")
MAX_STDERR_SHOWN = 40  # lines per child process

BUSY_NAP = 0.01  # seconds between retries of a cell on a busy shared resource
WARMUP = 10  # uncounted cells per side before the HTTP-vs-stdio comparison

TARGET_P50_RATIO = 1.5
TARGET_RSS_MIB = 100.0


def count_all_kernels() -> int:
    """Every ipykernel on the machine (other sessions' too), as ``pgrep -fc`` counts them."""
    result = subprocess.run(["pgrep", "-fc", "ipykernel_launcher"], capture_output=True, text=True,
                            check=False)
    return int(result.stdout.strip() or 0)


class Bench:
    def __init__(self, args: argparse.Namespace, workspace: str) -> None:
        self.args = args
        self.workspace = workspace
        self.figures: dict = {}
        self.problems: list[str] = []
        self.children: list[AsyncChild] = []
        self.phase = "starting"
        self.busy_retries = 0
        self.turn_waits: list[float] = []  # shared: from a cell's first try to its accepted call's answer

    def check(self, text: str, is_error: bool, where: str) -> None:
        if is_error or not CELL_RESULT.fullmatch(text.strip()):
            self.problems.append(f"{where}: unexpected run_cell result {text[:200]!r}")

    async def timed_cell(self, session: AsyncHttpSession | AsyncStdioSession, where: str) -> float:
        elapsed, (text, is_error) = await timed_async(session.run_cell(CELL))
        self.check(text, is_error, where)
        return elapsed

    async def open_sessions(self, port: int, resource: str | None = None) -> list[AsyncHttpSession]:
        sessions = [AsyncHttpSession(port, CLIENT_NAME, resource) for _ in range(self.args.sessions)]
        await asyncio.gather(*(s.initialize() for s in sessions))
        return sessions

    async def close_sessions(self, sessions: list[AsyncHttpSession]) -> None:
        await asyncio.gather(*(s.delete() for s in sessions))
        if any(s.connects != 1 for s in sessions):
            self.problems.append("a keep-alive connection was closed by the server and had to be reopened")

    # -- phases 1 to 4, on one server

    async def load(self) -> None:
        self.phase = "load server start"
        server, port = await start_async_server("load server", self.workspace)
        self.children.append(server)
        self.figures["rss_before"] = server.rss_mib()

        self.phase = f"{self.args.sessions} private sessions"
        self.figures["private_boot"], private = await timed_async(self.open_private_sessions(port))
        server.note_kernels()
        self.figures["private"] = await self.run_concurrently(server, private, self.private_cells)
        self.figures["rss_loaded"] = server.rss_mib()
        await self.close_sessions(private)

        self.phase = f"{self.args.sessions} sessions on a shared resource"
        shared = await self.open_sessions(port, SHARED_RESOURCE)
        await self.timed_cell(shared[0], "shared warm-up")
        self.figures["shared"] = await self.run_concurrently(server, shared, self.shared_cells)
        self.figures["shared_retries"] = self.busy_retries
        self.figures["shared_turn"] = self.turn_waits
        server.note_kernels()
        await self.close_sessions(shared)

        self.phase = "one HTTP session vs one stdio session"
        await self.versus_stdio(port)
        self.figures["rss_after"] = server.rss_mib()
        self.figures["rss_peak"] = server.rss_mib("VmHWM")

    async def open_private_sessions(self, port: int) -> list[AsyncHttpSession]:
        """Sessions in private resources, each with its first cell's result (its kernel is up)."""
        private = await self.open_sessions(port)
        await asyncio.gather(*(self.timed_cell(s, "private warm-up") for s in private))
        return private

    async def run_concurrently(self, server: AsyncChild, sessions: list[AsyncHttpSession], cells):
        """(cells per second, latencies, server CPU share) of every session running its cells at once."""
        cpu = proc_cpu_seconds(server.proc.pid)
        wall, per_session = await timed_async(asyncio.gather(*(cells(s) for s in sessions)))
        cpu = proc_cpu_seconds(server.proc.pid) - cpu
        latencies = [t for times in per_session for t in times]
        return len(latencies) / wall, latencies, cpu / wall

    async def private_cells(self, session: AsyncHttpSession) -> list[float]:
        return [await self.timed_cell(session, "private") for _ in range(self.args.cells)]

    async def shared_cells(self, session: AsyncHttpSession) -> list[float]:
        """Each cell is retried while the shared resource is busy; only the accepted call is timed."""
        latencies = []
        for _ in range(self.args.cells):
            first_try = time.perf_counter()
            while True:
                start = time.perf_counter()
                text, is_error = await session.run_cell(CELL)
                done = time.perf_counter()
                if is_error and text.startswith("busy:"):
                    self.busy_retries += 1
                    await asyncio.sleep(BUSY_NAP)
                    continue
                self.check(text, is_error, "shared")
                latencies.append(done - start)
                self.turn_waits.append(done - first_try)
                break
        return latencies

    async def versus_stdio(self, port: int) -> None:
        """One HTTP session and one stdio session, alternating call by call so drift hits both alike."""
        stdio = AsyncStdioSession(CLIENT_NAME)
        self.children.append(stdio.child)
        await stdio.start(self.workspace)
        http = AsyncHttpSession(port, CLIENT_NAME)
        await http.initialize()
        for _ in range(WARMUP):
            await self.timed_cell(http, "http warm-up")
            await self.timed_cell(stdio, "stdio warm-up")
        http_times, stdio_times = [], []
        for _ in range(self.args.stdio_cells):
            http_times.append(await self.timed_cell(http, "http single"))
            stdio_times.append(await self.timed_cell(stdio, "stdio"))
        self.figures["http_single"] = http_times
        self.figures["stdio"] = stdio_times
        await self.close_sessions([http])
        stdio.child.note_kernels()
        await stdio.child.stop()

    # -- phase 5, one server per setting

    async def first_results(self, spares: int) -> tuple[list[float], list[float]]:
        """Per start: (initialize answered, first cell's result), both timed from sending initialize."""
        label = f"server with {spares} spare kernel{'s' if spares != 1 else ''}"
        self.phase = f"first results, {label}"
        server, port = await start_async_server(label, self.workspace, spares)
        self.children.append(server)
        inits, firsts = [], []
        for _ in range(self.args.starts):
            if spares:
                await asyncio.sleep(self.args.settle)  # the spare handed out last time is replaced by now
            session = AsyncHttpSession(port, CLIENT_NAME)
            start = time.perf_counter()  # both figures count from sending initialize
            await session.initialize()
            inits.append(time.perf_counter() - start)
            text, is_error = await session.run_cell(CELL)
            firsts.append(time.perf_counter() - start)
            self.check(text, is_error, f"first cell, {spares} spares")
            server.note_kernels()
            await session.delete()
        await server.stop()
        return inits, firsts

    async def run(self) -> None:
        try:
            await self.load()
            self.figures["spare"] = await self.first_results(1)
            self.figures["no_spare"] = await self.first_results(0)
        finally:
            for child in self.children:
                code = await child.stop()
                if code not in (0, None):
                    self.problems.append(f"{child.label} exited with code {code}")
        await asyncio.sleep(0.5)
        left = sorted(pid for child in self.children for pid in child.kernels if pid_alive(pid))
        self.figures["kernels_seen"] = sum(len(child.kernels) for child in self.children)
        self.figures["kernels_left"] = left
        if left:
            self.problems.append(f"kernel processes left behind: {left}")


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISS"


def report(figures: dict, args: argparse.Namespace) -> None:
    n, cells = args.sessions, args.cells
    stdio_p50 = statistics.median(figures["stdio"])
    private_rate, private, private_cpu = figures["private"]
    shared_rate, shared, shared_cpu = figures["shared"]

    def latency_row(label: str, values: list[float], rate: float | None = None,
                    note: str = "") -> tuple[str, ...]:
        p50 = statistics.median(values)
        throughput = f"{rate:.0f}" if rate is not None else ""
        return label, throughput, fmt_time(p50), fmt_time(p95(values)), f"{p50 / stdio_p50:.2f}×", note

    print("run_cell latency and throughput")
    print_table([
        ("scenario", "cells/s", "p50", "p95", "p50/stdio", "note"),
        latency_row(f"{n} private resources, concurrent", private, private_rate,
                    f"{n}×{cells} cells · server CPU {private_cpu:.0%}"),
        latency_row(f"{n} sessions on '{SHARED_RESOURCE}', accepted call", shared, shared_rate,
                    f"{figures['shared_retries']} busy retries · server CPU {shared_cpu:.0%}"),
        latency_row("   same, incl. waiting for a turn", figures["shared_turn"]),
        latency_row("1 HTTP session, sequential", figures["http_single"], note=f"{args.stdio_cells} cells"),
        latency_row("1 stdio session, sequential", figures["stdio"], note="alternating with the above"),
    ])
    print()
    single_ratio = statistics.median(figures["http_single"]) / stdio_p50
    loaded_ratio = statistics.median(private) / stdio_p50
    spare_init, spare_first = figures["spare"]
    cold_init, cold_first = figures["no_spare"]
    starts = args.starts
    print("figures against targets")
    print_table([
        ("measure", "value", "target", ""),
        ("HTTP p50 / stdio p50, one session each", f"{single_ratio:.2f}×", f"≤ {TARGET_P50_RATIO:g}×",
         verdict(single_ratio <= TARGET_P50_RATIO)),
        (f"HTTP p50 under {n} concurrent sessions / stdio p50", f"{loaded_ratio:.2f}×", "see below", ""),
        ("server RSS before the load", f"{figures['rss_before']:.1f} MiB", "", ""),
        (f"server RSS with {n} private sessions open", f"{figures['rss_loaded']:.1f} MiB", "", ""),
        ("server RSS after the load (peak)",
         f"{figures['rss_after']:.1f} MiB ({figures['rss_peak']:.1f})", f"< {TARGET_RSS_MIB:g} MiB",
         verdict(figures["rss_after"] < TARGET_RSS_MIB)),
        (f"{n} sessions: initialize → every first cell", fmt_time(figures["private_boot"]), "", ""),
        (f"initialize answered, spare kernel (median of {starts})",
         fmt_time(statistics.median(spare_init)), "", ""),
        (f"initialize → first result, spare kernel (median of {starts})",
         fmt_time(statistics.median(spare_first)), "", ""),
        (f"initialize answered, no spare (median of {starts})",
         fmt_time(statistics.median(cold_init)), "", ""),
        (f"initialize → first result, no spare (median of {starts})",
         fmt_time(statistics.median(cold_first)), "", ""),
        ("kernel processes left by the servers",
         f"{len(figures['kernels_left'])} of {figures['kernels_seen']}", "0",
         verdict(not figures["kernels_left"])),
        ("ipykernel processes on the machine, before → after",
         f"{figures['pgrep_before']} → {figures['pgrep_after']}", "", ""),
    ])
    queue = n / private_rate
    print(f"Under load the p50 is the queue, not the transport: {n} cells in flight / "
          f"{private_rate:.0f} cells/s = {fmt_time(queue)} (Little's law) on {os.cpu_count()} CPUs "
          f"shared by {n} kernels and the server.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16, help="concurrent HTTP sessions per phase (16)")
    parser.add_argument("--cells", type=int, default=50, help="cells per HTTP session under load (50)")
    parser.add_argument("--stdio-cells", type=int, default=200,
                        help="cells per side, one HTTP vs one stdio (200)")
    parser.add_argument("--starts", type=int, default=3, help="first-result timings per spare setting (3)")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds for a spare kernel to boot (5)")
    args = parser.parse_args()
    if min(args.sessions, args.cells, args.stdio_cells, args.starts) < 1:
        parser.error("--sessions, --cells, --stdio-cells and --starts must be at least 1")

    pgrep_before = count_all_kernels()
    with tempfile.TemporaryDirectory(prefix="loommux-http-load-") as workspace:
        bench = Bench(args, workspace)
        try:
            asyncio.run(bench.run())
        except (BenchError, OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as exc:
            print(f"benchmark failed in phase {bench.phase!r}: {type(exc).__name__}: {exc}", file=sys.stderr)
            for child in bench.children:
                for line in child.unexpected_stderr()[-20:]:
                    print(f"  [{child.label}] {line}", file=sys.stderr)
            return 1
    bench.figures["pgrep_before"], bench.figures["pgrep_after"] = pgrep_before, count_all_kernels()

    print(f"loommux HTTP load · Python {platform.python_version()} · {os.cpu_count()} CPUs · "
          f"{args.sessions} sessions × {args.cells} cells of {CELL!r}")
    report(bench.figures, args)
    for child in bench.children:
        lines = child.unexpected_stderr()
        routine = len(child.stderr) - len(lines)
        print(f"{child.label} stderr: {routine} routine lines (listening, resource retired), "
              f"{len(lines)} other")
        for line in lines[:MAX_STDERR_SHOWN]:
            print(f"  | {line}")
        if len(lines) > MAX_STDERR_SHOWN:
            print(f"  | … {len(lines) - MAX_STDERR_SHOWN} more")
    for problem in dict.fromkeys(bench.problems):
        print(f"CHECK FAILED: {problem}")
    return 1 if bench.problems else 0


if __name__ == "__main__":
    sys.exit(main())
