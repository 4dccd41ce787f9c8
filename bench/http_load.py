"""Load loommux over MCP Streamable HTTP, side by side with a single stdio session, in one run.

Phases 1-4 run on one ``loommux --server`` child (phase 3 also on a stdio child); phase 5 starts
one more server per setting. MCP sessions speak through a raw HTTP/1.1 keep-alive client written
here on asyncio streams, one connection per session; the stdio side is newline-delimited JSON-RPC.

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
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import (
    LISTENING,
    PROTOCOL_VERSION,
    SERVER,
    BenchError,
    initialize_params,
    p95,
    pid_alive,
    print_table,
    proc_kib,
    server_env,
    tool_text,
)

CLIENT_NAME = "loommux-http-load"
HOST = "127.0.0.1"
PATH = "/mcp"
SHARED_RESOURCE = "shared1"
CELL = "1+1"
CELL_RESULT = re.compile(r"In \[(\d+)\] · [^\n]*:\nOut\[\1\]: 2")
ROUTINE_STDERR = re.compile(r"^loommux: (listening on |retired resource )")
MAX_STDERR_SHOWN = 40  # lines per child process

TIMEOUT = 120.0  # for any one request, and for a server to come up
BUSY_NAP = 0.01  # seconds between retries of a cell on a busy shared resource
WARMUP = 10  # uncounted cells per side before the HTTP-vs-stdio comparison

TARGET_P50_RATIO = 1.5
TARGET_RSS_MIB = 100.0


def proc_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of one process (its children not included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def kernel_children(pid: int) -> set[int]:
    """Pids of the ipykernel processes whose parent is ``pid``."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int(re.search(r"^PPid:\s+(\d+)", (entry / "status").read_text(), re.MULTILINE).group(1))
            if ppid == pid and b"ipykernel_launcher" in (entry / "cmdline").read_bytes():
                found.add(int(entry.name))
        except (OSError, AttributeError):
            continue  # the process went away while we looked
    return found


def count_all_kernels() -> int:
    """Every ipykernel on the machine (other sessions' too), as ``pgrep -fc`` counts them."""
    result = subprocess.run(["pgrep", "-fc", "ipykernel_launcher"], capture_output=True, text=True, check=False)
    return int(result.stdout.strip() or 0)


class Child:
    """A loommux child process whose stderr is kept (and drained so the pipe never fills)."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.proc: asyncio.subprocess.Process | None = None
        self.stderr: list[str] = []
        self.kernels: set[int] = set()  # every kernel pid seen as a child of this process
        self._drain: asyncio.Task | None = None
        self._port: asyncio.Future | None = None

    async def spawn(self, args: list[str], workspace: str, spares: int | None, stdio: bool) -> None:
        if not stdio:
            self._port = asyncio.get_running_loop().create_future()
        pipe = asyncio.subprocess.PIPE
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, str(SERVER), *args, cwd=workspace,
            env=server_env(None if spares is None else {"LOOMMUX_SPARE_KERNELS": str(spares)}),
            stdin=pipe if stdio else asyncio.subprocess.DEVNULL, stdout=pipe if stdio else asyncio.subprocess.DEVNULL,
            stderr=pipe, limit=64 << 20,
        )
        self._drain = asyncio.create_task(self._read_stderr())

    async def _read_stderr(self) -> None:
        while line := await self.proc.stderr.readline():
            text = line.decode(errors="replace").rstrip("\n")
            self.stderr.append(text)
            match = LISTENING.search(text)
            if match and self._port is not None and not self._port.done():
                self._port.set_result(int(match.group(1)))
        if self._port is not None and not self._port.done():
            self._port.set_exception(BenchError(f"{self.label} exited before listening: {self.stderr[-5:]}"))

    async def port(self) -> int:
        try:
            return await asyncio.wait_for(asyncio.shield(self._port), TIMEOUT)
        except asyncio.TimeoutError:
            raise BenchError(f"{self.label} did not print its listening line within {TIMEOUT:.0f} s") from None

    def rss_mib(self, field: str = "VmRSS") -> float:
        return proc_kib(self.proc.pid, field) / 1024

    def note_kernels(self) -> set[int]:
        if self.proc is not None and self.proc.returncode is None:
            self.kernels |= kernel_children(self.proc.pid)
        return self.kernels

    async def stop(self) -> int | None:
        """SIGTERM (stdio: close stdin first), wait; SIGKILL as a last resort. Returns the exit code."""
        if self.proc is None:
            return None
        self.note_kernels()
        if self.proc.returncode is None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), 30)
            except asyncio.TimeoutError:
                self.stderr.append("(bench: no exit 30 s after SIGTERM; sent SIGKILL)")
                self.proc.kill()
                await self.proc.wait()
        if self._drain is not None:
            await self._drain
        return self.proc.returncode

    def unexpected_stderr(self) -> list[str]:
        return [line for line in self.stderr if not ROUTINE_STDERR.search(line)]


async def start_server(label: str, workspace: str, spares: int | None = None) -> tuple[Child, int]:
    child = Child(label)
    await child.spawn(["--server", "--host", HOST, "--port", "0"], workspace, spares, stdio=False)
    return child, await child.port()


class HttpSession:
    """One MCP session over one raw HTTP/1.1 keep-alive connection."""

    def __init__(self, port: int, resource: str | None = None) -> None:
        self.port = port
        self.resource = resource
        self.session_id: str | None = None
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.next_id = 0
        self.connects = 0

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(HOST, self.port, limit=64 << 20)
        self.connects += 1

    async def exchange(self, method: str, body: bytes = b"", headers: dict[str, str] | None = None):
        """Send one request; return (status, headers, body). Reconnects only if the server closed."""
        if self.writer is None or self.writer.is_closing():
            await self._connect()
        head = {"Host": f"{HOST}:{self.port}", "Accept": "application/json, text/event-stream"}
        if body:
            head["Content-Type"] = "application/json"
        head["Content-Length"] = str(len(body))
        if self.session_id:
            head["Mcp-Session-Id"] = self.session_id
            head["MCP-Protocol-Version"] = PROTOCOL_VERSION
        head.update(headers or {})
        lines = [f"{method} {PATH} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items())]
        self.writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
        await self.writer.drain()
        status, response_headers, payload = await asyncio.wait_for(self._read_response(), TIMEOUT)
        if response_headers.get("connection", "").lower() == "close":
            self.writer.close()
        return status, response_headers, payload

    async def _read_response(self) -> tuple[int, dict[str, str], bytes]:
        raw = await self.reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = raw.decode("latin-1").split("\r\n")
        headers = {}
        for line in filter(None, header_lines):
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = bytearray()
            while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
                body += await self.reader.readexactly(size)
                await self.reader.readexactly(2)
            await self.reader.readuntil(b"\r\n")  # the end of the (empty) trailer section
        else:
            body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return int(status_line.split(" ")[1]), headers, bytes(body)

    async def post(self, message: dict, headers: dict[str, str] | None = None) -> tuple[int, dict, dict | None]:
        status, response_headers, body = await self.exchange("POST", json.dumps(message).encode(), headers)
        if response_headers.get("content-type", "").startswith("text/event-stream"):
            events = [json.loads(line[5:]) for line in body.decode().splitlines() if line.startswith("data:")]
            reply = next((e for e in events if e.get("id") == message.get("id")), None)
        else:
            reply = json.loads(body) if body else None
        return status, response_headers, reply

    async def request(self, method: str, params: dict, headers: dict[str, str] | None = None) -> tuple[dict, dict]:
        self.next_id += 1
        message = {"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params}
        status, response_headers, reply = await self.post(message, headers)
        if status != 200 or reply is None or "error" in reply:
            raise BenchError(f"{method}: HTTP {status}: {reply}")
        return reply["result"], response_headers

    async def initialize(self) -> None:
        extra = {"X-Loommux-Resource": self.resource} if self.resource else {}
        _, headers = await self.request("initialize", initialize_params(CLIENT_NAME), extra)
        self.session_id = headers.get("mcp-session-id")
        if not self.session_id:
            raise BenchError("initialize: no Mcp-Session-Id header in the response")
        status, _, _ = await self.post({"jsonrpc": "2.0", "method": "notifications/initialized"})
        if status != 202:
            raise BenchError(f"notifications/initialized: HTTP {status}, expected 202")

    async def run_cell(self, code: str) -> tuple[str, bool]:
        """(text, isError) of run_cell."""
        result, _ = await self.request("tools/call", {"name": "run_cell", "arguments": {"freeform": code}})
        return tool_text(result)

    async def delete(self) -> None:
        if self.session_id:
            status, _, _ = await self.exchange("DELETE")
            if status not in (200, 204):
                raise BenchError(f"DELETE: HTTP {status}")
            self.session_id = None
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()


class StdioSession:
    """``python loommux.py`` spoken to with newline-delimited JSON-RPC on stdin/stdout."""

    def __init__(self) -> None:
        self.child = Child("stdio server")
        self.next_id = 0

    async def start(self, workspace: str) -> None:
        await self.child.spawn([], workspace, None, stdio=True)
        await self.request("initialize", initialize_params(CLIENT_NAME))
        await self._send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    async def _send(self, message: dict) -> None:
        self.child.proc.stdin.write(json.dumps(message).encode() + b"\n")
        await self.child.proc.stdin.drain()

    async def request(self, method: str, params: dict) -> dict:
        self.next_id += 1
        await self._send({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params})
        while True:
            line = await asyncio.wait_for(self.child.proc.stdout.readline(), TIMEOUT)
            if not line:
                raise BenchError(f"stdio server closed stdout: {self.child.stderr[-5:]}")
            reply = json.loads(line)
            if reply.get("id") == self.next_id:
                if "error" in reply:
                    raise BenchError(f"stdio {method}: {reply['error']}")
                return reply["result"]

    async def run_cell(self, code: str) -> tuple[str, bool]:
        result = await self.request("tools/call", {"name": "run_cell", "arguments": {"freeform": code}})
        return tool_text(result)


class Bench:
    def __init__(self, args: argparse.Namespace, workspace: str) -> None:
        self.args = args
        self.workspace = workspace
        self.figures: dict = {}
        self.problems: list[str] = []
        self.children: list[Child] = []
        self.phase = "starting"
        self.busy_retries = 0
        self.turn_waits: list[float] = []  # shared: from a cell's first try to its accepted call's answer

    def check(self, text: str, is_error: bool, where: str) -> None:
        if is_error or not CELL_RESULT.fullmatch(text.strip()):
            self.problems.append(f"{where}: unexpected run_cell result {text[:200]!r}")

    async def timed_cell(self, session: HttpSession | StdioSession, where: str) -> float:
        start = time.perf_counter()
        text, is_error = await session.run_cell(CELL)
        elapsed = time.perf_counter() - start
        self.check(text, is_error, where)
        return elapsed

    async def open_sessions(self, port: int, resource: str | None = None) -> list[HttpSession]:
        sessions = [HttpSession(port, resource) for _ in range(self.args.sessions)]
        await asyncio.gather(*(s.initialize() for s in sessions))
        return sessions

    async def close_sessions(self, sessions: list[HttpSession]) -> None:
        await asyncio.gather(*(s.delete() for s in sessions))
        if any(s.connects != 1 for s in sessions):
            self.problems.append("a keep-alive connection was closed by the server and had to be reopened")

    # -- phases 1 to 4, on one server

    async def load(self) -> None:
        self.phase = "load server start"
        server, port = await start_server("load server", self.workspace)
        self.children.append(server)
        self.figures["rss_before"] = server.rss_mib()

        self.phase = f"{self.args.sessions} private sessions"
        start = time.perf_counter()
        private = await self.open_sessions(port)
        await asyncio.gather(*(self.timed_cell(s, "private warm-up") for s in private))
        self.figures["private_boot"] = time.perf_counter() - start
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

    async def run_concurrently(self, server: Child, sessions: list[HttpSession], cells):
        """(cells per second, latencies, server CPU share) of every session running its cells at once."""
        cpu = proc_cpu_seconds(server.proc.pid)
        start = time.perf_counter()
        per_session = await asyncio.gather(*(cells(s) for s in sessions))
        wall = time.perf_counter() - start
        cpu = proc_cpu_seconds(server.proc.pid) - cpu
        latencies = [t for times in per_session for t in times]
        return len(latencies) / wall, latencies, cpu / wall

    async def private_cells(self, session: HttpSession) -> list[float]:
        return [await self.timed_cell(session, "private") for _ in range(self.args.cells)]

    async def shared_cells(self, session: HttpSession) -> list[float]:
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
        stdio = StdioSession()
        self.children.append(stdio.child)
        await stdio.start(self.workspace)
        http = HttpSession(port)
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
        server, port = await start_server(label, self.workspace, spares)
        self.children.append(server)
        inits, firsts = [], []
        for _ in range(self.args.starts):
            if spares:
                await asyncio.sleep(self.args.settle)  # the spare handed out last time is replaced by now
            session = HttpSession(port)
            start = time.perf_counter()
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


def fmt_ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISS"


def report(figures: dict, args: argparse.Namespace) -> None:
    n, cells = args.sessions, args.cells
    stdio_p50 = statistics.median(figures["stdio"])
    private_rate, private, private_cpu = figures["private"]
    shared_rate, shared, shared_cpu = figures["shared"]

    def latency_row(label: str, values: list[float], rate: float | None = None, note: str = "") -> tuple[str, ...]:
        p50 = statistics.median(values)
        throughput = f"{rate:.0f}" if rate is not None else ""
        return label, throughput, fmt_ms(p50), fmt_ms(p95(values)), f"{p50 / stdio_p50:.2f}×", note

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
        (f"{n} sessions: initialize → every first cell", fmt_ms(figures["private_boot"]), "", ""),
        (f"initialize answered, spare kernel (median of {starts})", fmt_ms(statistics.median(spare_init)), "", ""),
        (f"initialize → first result, spare kernel (median of {starts})",
         fmt_ms(statistics.median(spare_first)), "", ""),
        (f"initialize answered, no spare (median of {starts})", fmt_ms(statistics.median(cold_init)), "", ""),
        (f"initialize → first result, no spare (median of {starts})", fmt_ms(statistics.median(cold_first)), "", ""),
        ("kernel processes left by the servers",
         f"{len(figures['kernels_left'])} of {figures['kernels_seen']}", "0", verdict(not figures["kernels_left"])),
        ("ipykernel processes on the machine, before → after",
         f"{figures['pgrep_before']} → {figures['pgrep_after']}", "", ""),
    ])
    queue = n / private_rate
    print(f"Under load the p50 is the queue, not the transport: {n} cells in flight / {private_rate:.0f} cells/s "
          f"= {fmt_ms(queue)} (Little's law) on {os.cpu_count()} CPUs shared by {n} kernels and the server.")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16, help="concurrent HTTP sessions per phase (16)")
    parser.add_argument("--cells", type=int, default=50, help="cells per HTTP session under load (50)")
    parser.add_argument("--stdio-cells", type=int, default=200, help="cells per side, one HTTP vs one stdio (200)")
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
        print(f"{child.label} stderr: {routine} routine lines (listening, resource retired), {len(lines)} other")
        for line in lines[:MAX_STDERR_SHOWN]:
            print(f"  | {line}")
        if len(lines) > MAX_STDERR_SHOWN:
            print(f"  | … {len(lines) - MAX_STDERR_SHOWN} more")
    for problem in dict.fromkeys(bench.problems):
        print(f"CHECK FAILED: {problem}")
    return 1 if bench.problems else 0


if __name__ == "__main__":
    sys.exit(main())
