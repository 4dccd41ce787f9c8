"""What the bench scripts share: loommux child processes and their clients, checks, timing, tables.

Imported as ``benchlib`` by the scripts beside it (``python bench/X.py`` puts ``bench/`` on sys.path).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVER = REPO / "loommux.py"
TIKTOKEN_DIR = REPO.parent / "shared" / "tiktoken"

PROTOCOL_VERSION = "2025-11-25"  # the handshake era of MCP
TIMEOUT = 120.0  # default for any one request, and for a server to come up
STOP_TIMEOUT = 30.0  # seconds a server gets to exit before SIGKILL
LISTENING = re.compile(r"loommux: listening on http://127\.0\.0\.1:(\d+)/mcp")

sys.path.insert(0, str(REPO))
from loommux import process_descendants  # the server's own /proc walk (this checkout's)


class BenchError(RuntimeError):
    pass


# --------------------------------------------------------------------------- timing and the table


def timed(fn, *args):
    """(seconds, value) of ``fn(*args)``."""
    start = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - start, value


def p95(values: list[float]) -> float:
    """Nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[-(-len(ordered) * 95 // 100) - 1]


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def print_table(rows: list[tuple[str, ...]]) -> None:
    """The first column left-aligned, the others right-aligned, two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        print("  ".join(cells).rstrip())


def compared(label: str, ours: float, theirs: float, target: float | None, miss: str = "MISS") -> tuple[str, ...]:
    """A table row of two times and their ratio; with a target, the goal and ``ok`` or ``miss``."""
    ratio = ours / theirs
    goal, mark = ("", "") if target is None else (f"≤ {target:g}×", "ok" if ratio <= target else miss)
    return label, fmt_time(ours), fmt_time(theirs), f"{ratio:.2f}×", goal, mark


def run_and_report(run: Callable[[], None], problems: list[str], title: str,
                   rows: Callable[[], list[tuple[str, ...]]]) -> int:
    """The exit code of a bench: ``run`` it; if it fails, say why and what checks failed so far on
    stderr; else print the title, the table of ``rows()`` and every failed check."""
    try:
        run()
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        for problem in problems:
            print(f"CHECK FAILED: {problem}", file=sys.stderr)
        return 1
    print(title)
    print_table(rows())
    for problem in problems:
        print(f"CHECK FAILED: {problem}")
    return 1 if problems else 0


# --------------------------------------------------------------------------- processes, read from /proc


def server_env(overrides: dict[str, str] | None = None, *, drop_loommux: bool = False) -> dict[str, str]:
    """This process's environment for a loommux child: the shared tiktoken cache if there is one, then
    ``overrides``; ``drop_loommux`` leaves out every inherited ``LOOMMUX_*`` setting first."""
    env = {k: v for k, v in os.environ.items() if not (drop_loommux and k.startswith("LOOMMUX_"))}
    if TIKTOKEN_DIR.is_dir():
        env.setdefault("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_DIR))
    return {**env, **(overrides or {})}


def proc_kib(pid: int, field: str = "VmRSS") -> int:
    """A size field of /proc/PID/status (VmRSS, VmHWM, ...), in KiB."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", status, re.MULTILINE).group(1))


def process_tree(pid: int) -> set[int]:
    """``pid``'s descendants, read from /proc (kernels and their launchers are below the server)."""
    return set(process_descendants(pid))


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


# --------------------------------------------------------------------------- loommux child processes


def extract_baseline(revision: str, into: str) -> Path:
    """loommux.py as it was at ``revision``, written into a directory of its own."""
    result = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{revision}:loommux.py"], capture_output=True, check=False
    )
    if result.returncode != 0:
        raise BenchError(f"git show {revision}:loommux.py: {result.stderr.decode().strip()}")
    path = Path(into) / "loommux.py"
    path.write_bytes(result.stdout)
    return path


class Child:
    """A loommux child process; remembers its descendants (kernels and their launchers) so that
    it can check that none outlives it."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.descendants: set[int] = set()

    def note_descendants(self) -> None:
        if self.proc.poll() is None:
            self.descendants |= process_tree(self.proc.pid)

    def close(self) -> bool:
        """Close stdin (stdio) or send SIGTERM (HTTP), wait; SIGKILL as a last resort.
        False if it had to be killed."""
        if self.proc.poll() is not None:
            return True
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        else:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return False
        return True

    def stop(self, problems: list[str], check_exit: bool = False) -> None:
        """``close``, then add to ``problems`` a kill and any descendant left running; with
        ``check_exit`` also an exit code other than 0, or an exit before this stop."""
        self.note_descendants()
        was_running = self.proc.poll() is None
        if not self.close():
            problems.append(f"server {self.proc.pid} did not exit within {STOP_TIMEOUT:.0f} s; killed")
        elif check_exit and not was_running:
            problems.append(f"server {self.proc.pid} had exited before it was stopped (code {self.proc.returncode})")
        elif check_exit and self.proc.returncode != 0:
            problems.append(f"server {self.proc.pid} exited with code {self.proc.returncode}")
        left = sorted(pid for pid in self.descendants if pid_alive(pid))
        if left:
            problems.append(f"server {self.proc.pid} left processes running: {left}")


class Bench:
    """One bench run: its figures, the problems its checks found and the servers it keeps alive.

    ``strict``: a server that exits early or with a code other than 0, or shows no kernel process
    (the leftover check would have nothing to look at), is a problem too.
    """

    strict = False

    def __init__(self, workspace: str) -> None:
        self.workspace = workspace
        self.figures: dict = {}
        self.problems: list[str] = []
        self.alive: list[Child] = []

    def stop_all(self) -> None:
        while self.alive:
            child = self.alive.pop()
            child.stop(self.problems, check_exit=self.strict)
            if self.strict and not child.descendants:
                self.problems.append(f"server {child.proc.pid}: no kernel process was seen")

    def steps(self) -> list[Callable[[], None]]:
        """The parts of the run, in order."""
        raise NotImplementedError

    def run(self) -> None:
        try:
            for step in self.steps():
                step()
        finally:
            self.stop_all()


def tool_text(result: dict) -> tuple[str, bool]:
    """(text, isError) of a tools/call result."""
    return "".join(item.get("text", "") for item in result["content"]), bool(result.get("isError"))


def tool_params(name: str, arguments: dict) -> dict:
    return {"name": name, "arguments": arguments}


def initialize_params(client_name: str) -> dict:
    return {"protocolVersion": PROTOCOL_VERSION, "capabilities": {},
            "clientInfo": {"name": client_name, "version": "0"}}


class StdioServer(Child):
    """``python loommux.py`` (or another copy of it), spoken to with newline-delimited JSON-RPC."""

    def __init__(self, workspace: str, env: dict[str, str] | None = None, server: Path = SERVER,
                 timeout: float = TIMEOUT) -> None:
        super().__init__(subprocess.Popen(
            [sys.executable, str(server)], cwd=workspace, env=server_env() if env is None else env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
        ))
        self.timeout = timeout
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
        """The result of one request; other lines (notifications, stale answers) are skipped."""
        self._next_id += 1
        self.send({"jsonrpc": "2.0", "id": self._next_id, "method": method, "params": params})
        deadline = time.monotonic() + self.timeout
        while True:
            message = json.loads(self._read_line(deadline))
            if message.get("id") != self._next_id:
                continue
            if "error" in message:
                raise BenchError(f"{method}: {message['error']}")
            return message["result"]

    def initialize(self, client_name: str) -> None:
        self.request("initialize", initialize_params(client_name))
        self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def call(self, name: str, arguments: dict) -> dict:
        return self.request("tools/call", tool_params(name, arguments))

    def tool(self, name: str, arguments: dict | None = None) -> str:
        """A tool's text; an error result raises."""
        text, is_error = tool_text(self.call(name, arguments or {}))
        if is_error:
            raise BenchError(f"{name}: {text}")
        return text

    def run_to_end(self, arguments: dict) -> str:
        """run_cell with ``arguments``, then ``wait`` while the cell still runs."""
        text = self.tool("run_cell", arguments)
        while re.match(r"In \[(\d+)\] · [^:]*· running:", text):
            text = self.tool("wait", {"timeout_seconds": 600})
        return text


class HttpServer(Child):
    """``python loommux.py --server --port 0``; its port is read from its stderr."""

    def __init__(self, workspace: str, env: dict[str, str] | None = None) -> None:
        super().__init__(subprocess.Popen(
            [sys.executable, str(SERVER), "--server", "--host", "127.0.0.1", "--port", "0"],
            cwd=workspace, env=server_env() if env is None else env,
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

    def stop(self, problems: list[str], check_exit: bool = False) -> None:
        super().stop(problems, check_exit)
        self._drain.join(timeout=STOP_TIMEOUT)


class HttpClient:
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


class HttpSession(HttpClient):
    """A handshake session: ``initialize``, then ``Mcp-Session-Id`` on every request."""

    def __init__(self, server: HttpServer, client_name: str) -> None:
        super().__init__(server)
        response, _ = self.request("initialize", initialize_params(client_name), {})
        session_id = response.getheader("Mcp-Session-Id")
        if not session_id:
            raise BenchError("initialize: no Mcp-Session-Id header in the response")
        self.headers = {"Mcp-Session-Id": session_id, "MCP-Protocol-Version": PROTOCOL_VERSION}
        response, _ = self.post({"jsonrpc": "2.0", "method": "notifications/initialized"}, self.headers)
        if response.status != 202:
            raise BenchError(f"notifications/initialized: HTTP {response.status}, expected 202")

    def call(self, name: str, arguments: dict) -> dict:
        return self.request("tools/call", tool_params(name, arguments), self.headers)[1]
