"""Measure MCP 2026-07-28 requests against the handshake era, side by side in one run.

The ``run_cell(freeform="1+1")`` round trip, warm, the two eras alternating call by call so that
drift on the machine hits both alike; every result is checked.

1. stdio: ONE ``python loommux.py`` process serves both eras, message by message: an
   ``initialize``d handshake session and stateless requests whose ``params._meta`` carries the
   2026-07-28 envelope. Both eras then use the process's own kernel, so the only difference
   measured is the protocol path (the calls never overlap: each waits for its answer).
2. HTTP: one ``loommux.py --server`` process; a handshake session (``Mcp-Session-Id``, its own
   private kernel) on one keep-alive connection, and 2026-07-28 requests (the routing headers,
   no ``kernel`` argument, so the shared kernel ``default``) on another.

Every server is stopped the way a client stops it (EOF on stdio, SIGTERM over HTTP); a server that
does not exit, exits with an error, or leaves a descendant process running is reported as a failure.

    .venv/bin/python bench/modern.py [--repeat 200]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import re
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVER = REPO / "loommux.py"
TIKTOKEN_DIR = REPO.parent / "shared" / "tiktoken"

HANDSHAKE_VERSION = "2025-11-25"
MODERN_VERSION = "2026-07-28"
CLIENT_INFO = {"name": "loommux-bench-modern", "version": "0"}
ENVELOPE = {
    "io.modelcontextprotocol/protocolVersion": MODERN_VERSION,
    "io.modelcontextprotocol/clientCapabilities": {},
    "io.modelcontextprotocol/clientInfo": CLIENT_INFO,
}
TIMEOUT = 120.0  # for any one request (the first starts a kernel), and for a server to come up
STOP_TIMEOUT = 30.0  # seconds a server gets to exit before SIGKILL
WARMUP = 10  # uncounted calls per side before the counted ones

CELL = "1+1"
RESULT = re.compile(r"In \[(\d+)\] · [^\n]*:\nOut\[\1\]: 2")
LISTENING = re.compile(r"loommux: listening on http://127\.0\.0\.1:(\d+)/mcp")
STATUS_RESOURCE = re.compile(r"^resource: (\S+)", re.MULTILINE)
STATUS_KERNEL = re.compile(r"^kernel: pid (\S+)", re.MULTILINE)
SHARED_KERNEL = "default"  # where a 2026-07-28 HTTP call without ``kernel`` runs


class BenchError(RuntimeError):
    pass


def p95(values: list[float]) -> float:
    """Nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[-(-len(ordered) * 95 // 100) - 1]


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    if TIKTOKEN_DIR.is_dir():
        env.setdefault("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_DIR))
    return env


def tool_params(name: str, arguments: dict) -> dict:
    return {"name": name, "arguments": arguments}


# --------------------------------------------------------------------------- server processes


def process_tree(pid: int) -> set[int]:
    """``pid``'s descendants, read from /proc (kernels are children of the server)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue  # the process went away while we looked
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def pid_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class Child:
    """A loommux child process; remembers its descendants (kernels and their launchers) so that
    it can check that none outlives it."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.descendants: set[int] = set()

    def note_descendants(self) -> None:
        if self.proc.poll() is None:
            self.descendants |= process_tree(self.proc.pid)

    def stop(self, problems: list[str]) -> None:
        """Close stdin (stdio) or send SIGTERM (HTTP), wait; SIGKILL as a last resort."""
        self.note_descendants()
        if self.proc.poll() is None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            else:
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                problems.append(f"server {self.proc.pid} did not exit within {STOP_TIMEOUT:.0f} s; killed")
                self.proc.kill()
                self.proc.wait()
            else:
                if self.proc.returncode != 0:
                    problems.append(f"server {self.proc.pid} exited with code {self.proc.returncode}")
        else:
            problems.append(f"server {self.proc.pid} had exited before it was stopped (code {self.proc.returncode})")
        left = sorted(pid for pid in self.descendants if pid_alive(pid))
        if left:
            problems.append(f"server {self.proc.pid} left processes running: {left}")


class StdioServer(Child):
    """``python loommux.py``, spoken to with newline-delimited JSON-RPC."""

    def __init__(self, workspace: str) -> None:
        super().__init__(subprocess.Popen(
            [sys.executable, str(SERVER)], cwd=workspace, env=server_env(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
        ))
        self._fd = self.proc.stdout.fileno()
        self._buf = bytearray()
        self._next_id = 0

    def send(self, message: dict) -> None:
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")

    def _read_line(self, deadline: float) -> bytes:
        while True:
            end = self._buf.find(b"\n")
            if end >= 0:
                line = bytes(self._buf[:end])
                del self._buf[: end + 1]
                return line
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError("timed out waiting for the stdio server")
            if select.select([self._fd], [], [], remaining)[0]:
                chunk = os.read(self._fd, 1 << 20)
                if not chunk:
                    raise BenchError(f"stdio server closed stdout (exit code {self.proc.wait()})")
                self._buf += chunk

    def request(self, method: str, params: dict) -> dict:
        self._next_id += 1
        self.send({"jsonrpc": "2.0", "id": self._next_id, "method": method, "params": params})
        deadline = time.monotonic() + TIMEOUT
        while True:
            message = json.loads(self._read_line(deadline))
            if message.get("id") != self._next_id:
                continue
            if "error" in message:
                raise BenchError(f"{method}: {message['error']}")
            return message["result"]


class HttpServer(Child):
    """``python loommux.py --server --port 0``; its port is read from its stderr."""

    def __init__(self, workspace: str) -> None:
        super().__init__(subprocess.Popen(
            [sys.executable, str(SERVER), "--server", "--port", "0"], cwd=workspace, env=server_env(),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        ))
        self.stderr: list[str] = []
        self._port = threading.Event()
        self.port = 0
        # Drained on a thread so the pipe never fills, whatever the server logs.
        self._drain = threading.Thread(target=self._read_stderr, daemon=True)
        self._drain.start()

    def _read_stderr(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            self.stderr.append(line)
            match = LISTENING.search(line)
            if match and not self._port.is_set():
                self.port = int(match.group(1))
                self._port.set()
        self._port.set()  # the server exited: wake the waiter, which sees no port

    def wait_listening(self) -> None:
        if not self._port.wait(TIMEOUT) or not self.port:
            raise BenchError(f"HTTP server did not print its listening line: {self.stderr[-5:]}")

    def stop(self, problems: list[str]) -> None:
        super().stop(problems)
        self._drain.join(timeout=STOP_TIMEOUT)


# --------------------------------------------------------------------------- clients, one per era


class Client:
    """What both eras offer on either transport; ``call`` is the one thing each client does its way."""

    modern = False  # only 2026-07-28 results carry ``resultType``

    def call(self, name: str, arguments: dict) -> dict:
        raise NotImplementedError

    def tool_text(self, name: str, arguments: dict) -> str:
        """A tool's text, after checking that it is no error and of this client's era."""
        result = self.call(name, arguments)
        text = "".join(item.get("text", "") for item in result["content"])
        if result.get("isError"):
            raise BenchError(f"{name}: {text[:400]!r}")
        era = result.get("resultType")
        if era != ("complete" if self.modern else None):
            raise BenchError(f"{name} answered in the wrong era (resultType {era!r}): {text[:200]!r}")
        return text

    def run_cell(self, code: str) -> str:
        text = self.tool_text("run_cell", {"freeform": code})
        if not RESULT.search(text):
            raise BenchError(f"unexpected run_cell result: {text[:400]!r}")
        return text

    def kernel(self) -> tuple[str, str]:
        """(resource, kernel pid) as ``status`` shows them: which kernel this client's calls run in."""
        text = self.tool_text("status", {})
        resource, pid = STATUS_RESOURCE.search(text), STATUS_KERNEL.search(text)
        if not resource or not pid:
            raise BenchError(f"status shows no resource or kernel: {text[:400]!r}")
        return resource[1], pid[1]


class StdioHandshake(Client):
    """An ``initialize``d session on a stdio server."""

    def __init__(self, server: StdioServer) -> None:
        self.server = server
        server.request("initialize", {
            "protocolVersion": HANDSHAKE_VERSION, "capabilities": {}, "clientInfo": CLIENT_INFO,
        })
        server.send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def call(self, name: str, arguments: dict) -> dict:
        return self.server.request("tools/call", tool_params(name, arguments))


class StdioModern(Client):
    """Stateless 2026-07-28 requests on a stdio server: the envelope in every ``params._meta``."""

    modern = True

    def __init__(self, server: StdioServer) -> None:
        self.server = server

    def call(self, name: str, arguments: dict) -> dict:
        return self.server.request("tools/call", {**tool_params(name, arguments), "_meta": ENVELOPE})


class HttpClient(Client):
    """One keep-alive connection to an HTTP server; JSON-RPC over POST."""

    def __init__(self, server: HttpServer) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
        self._next_id = 0

    def post(self, message: dict, headers: dict[str, str]) -> tuple[http.client.HTTPResponse, dict | None]:
        """The response (body read) and the JSON-RPC reply to ``message``, from JSON or an SSE stream."""
        self.conn.request("POST", "/mcp", json.dumps(message).encode(), {
            "Accept": "application/json, text/event-stream", "Content-Type": "application/json", **headers,
        })
        response = self.conn.getresponse()
        body = response.read()
        if response.getheader("Content-Type", "").startswith("text/event-stream"):
            events = [json.loads(line[5:]) for line in body.decode().splitlines() if line.startswith("data:")]
            return response, next((e for e in events if e.get("id") == message.get("id")), None)
        return response, json.loads(body) if body else None

    def request(self, method: str, params: dict, headers: dict[str, str]) -> tuple[http.client.HTTPResponse, dict]:
        self._next_id += 1
        message = {"jsonrpc": "2.0", "id": self._next_id, "method": method, "params": params}
        response, reply = self.post(message, headers)
        if response.status != 200 or reply is None or "error" in reply:
            raise BenchError(f"{method}: HTTP {response.status}: {reply}")
        return response, reply["result"]

    def close(self) -> None:
        self.conn.close()


class HttpHandshake(HttpClient):
    """A handshake session: ``initialize``, then ``Mcp-Session-Id`` on every request."""

    def __init__(self, server: HttpServer) -> None:
        super().__init__(server)
        response, _ = self.request("initialize", {
            "protocolVersion": HANDSHAKE_VERSION, "capabilities": {}, "clientInfo": CLIENT_INFO,
        }, {})
        session_id = response.getheader("Mcp-Session-Id")
        if not session_id:
            raise BenchError("initialize: no Mcp-Session-Id header in the response")
        self.headers = {"Mcp-Session-Id": session_id, "MCP-Protocol-Version": HANDSHAKE_VERSION}
        response, _ = self.post({"jsonrpc": "2.0", "method": "notifications/initialized"}, self.headers)
        if response.status != 202:
            raise BenchError(f"notifications/initialized: HTTP {response.status}, expected 202")

    def call(self, name: str, arguments: dict) -> dict:
        return self.request("tools/call", tool_params(name, arguments), self.headers)[1]


class HttpModern(HttpClient):
    """Stateless 2026-07-28 requests: the envelope and the routing headers, no session.

    No call passes ``kernel``, so none sends ``Mcp-Param-Kernel``; the calls run in ``default``."""

    modern = True

    def call(self, name: str, arguments: dict) -> dict:
        headers = {"MCP-Protocol-Version": MODERN_VERSION, "Mcp-Method": "tools/call", "Mcp-Name": name}
        response, result = self.request("tools/call", {**tool_params(name, arguments), "_meta": ENVELOPE}, headers)
        if response.getheader("Mcp-Session-Id"):
            raise BenchError("a 2026-07-28 request was given an Mcp-Session-Id")
        return result


# --------------------------------------------------------------------------- measuring


def interleave(modern: Client, handshake: Client, repeat: int) -> tuple[list[float], list[float]]:
    """Time ``run_cell(CELL)`` on both clients alternately, after WARMUP calls each (the first call
    of a side may start its kernel)."""
    for _ in range(WARMUP):
        modern.run_cell(CELL)
        handshake.run_cell(CELL)
    trips_modern, trips_handshake = [], []
    for _ in range(repeat):
        for client, trips in ((modern, trips_modern), (handshake, trips_handshake)):
            start = time.perf_counter()
            client.run_cell(CELL)
            trips.append(time.perf_counter() - start)
    return trips_modern, trips_handshake


def summarize(trips: tuple[list[float], list[float]]) -> dict[str, tuple[float, float]]:
    modern, handshake = trips
    return {
        "median": (statistics.median(modern), statistics.median(handshake)),
        "p95": (p95(modern), p95(handshake)),
    }


class Bench:
    def __init__(self, repeat: int, workspace: str) -> None:
        self.repeat = repeat
        self.workspace = workspace
        self.figures: dict[str, dict[str, tuple[float, float]]] = {}
        self.problems: list[str] = []
        self.alive: list[Child] = []

    def stop_all(self) -> None:
        while self.alive:
            child = self.alive.pop()
            child.stop(self.problems)
            if not child.descendants:  # the leftover check would have nothing to look at
                self.problems.append(f"server {child.proc.pid}: no kernel process was seen")

    def stdio(self) -> None:
        server = StdioServer(self.workspace)
        self.alive.append(server)
        handshake, modern = StdioHandshake(server), StdioModern(server)
        self.figures["stdio"] = summarize(interleave(modern, handshake, self.repeat))
        kernels = modern.kernel(), handshake.kernel()
        if kernels[0] != kernels[1]:
            self.problems.append(f"stdio: the two eras ran in different kernels: {kernels}")
        self.stop_all()

    def http(self) -> None:
        server = HttpServer(self.workspace)
        self.alive.append(server)
        server.wait_listening()
        handshake, modern = HttpHandshake(server), HttpModern(server)
        try:
            self.figures["http"] = summarize(interleave(modern, handshake, self.repeat))
            placed = modern.kernel()[0], handshake.kernel()[0]
            if placed != (SHARED_KERNEL, "private"):
                self.problems.append(f"HTTP: calls ran in {placed}, not ({SHARED_KERNEL!r}, 'private')")
        finally:
            handshake.close()
            modern.close()
        self.stop_all()

    def run(self) -> None:
        try:
            self.stdio()
            self.http()
        finally:
            self.stop_all()


# --------------------------------------------------------------------------- report


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def report(figures: dict[str, dict[str, tuple[float, float]]], repeat: int) -> list[tuple[str, ...]]:
    def compared(transport: str, statistic: str) -> tuple[str, ...]:
        modern, handshake = figures[transport][statistic]
        return f"round trip 1+1, {statistic} of {repeat}", fmt_time(modern), fmt_time(handshake), f"{modern / handshake:.2f}×"

    return [
        ("stdio, one process, one kernel", MODERN_VERSION, "handshake", "ratio"),
        compared("stdio", "median"),
        compared("stdio", "p95"),
        ("", "", "", ""),
        ("HTTP, keep-alive connections", f"{MODERN_VERSION} ({SHARED_KERNEL})", "session (private)", "ratio"),
        compared("http", "median"),
        compared("http", "p95"),
    ]


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        print("  ".join(cells).rstrip())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200, help="counted round trips per side (200)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")

    with tempfile.TemporaryDirectory(prefix="loommux-bench-modern-") as workspace:
        bench = Bench(args.repeat, workspace)
        try:
            bench.run()
        except BenchError as exc:
            print(f"benchmark failed: {exc}", file=sys.stderr)
            for problem in bench.problems:
                print(f"CHECK FAILED: {problem}", file=sys.stderr)
            return 1
    print(
        f"loommux MCP-era bench · Python {platform.python_version()} · {os.cpu_count()} CPUs · "
        f"ratio = {MODERN_VERSION} / handshake · round trips alternate call by call after {WARMUP} warm-up calls each"
    )
    print_table(report(bench.figures, args.repeat))
    for problem in bench.problems:
        print(f"CHECK FAILED: {problem}")
    return 1 if bench.problems else 0


if __name__ == "__main__":
    sys.exit(main())
