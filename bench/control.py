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

DEFAULT_BASELINE = "ae41dc0"  # the last commit before the control plane
PROTOCOL_VERSION = "2025-11-25"
TIMEOUT = 120.0  # for any one request, and for a server to come up
STOP_TIMEOUT = 30.0  # seconds a server gets to exit before SIGKILL
WARMUP = 10  # uncounted calls per side before each round-trip comparison

CELL = "1+1"
TARGET_NAME = "bench-target"
FORWARDED_CELL = f"%%loommux --kernel {TARGET_NAME}\n{CELL}"
DIRECT_RESULT = re.compile(r"In \[(\d+)\] · [^\n]*:\nOut\[\1\]: 2")
# The target's own execution number heads the relayed lines, and its Out[] carries the same number.
FORWARDED_RESULT = re.compile(rf"\[forwarded to kernel {TARGET_NAME} · execution (\d+)\]\nOut\[\1\]: 2")
LISTENING = re.compile(r"loommux: listening on http://127\.0\.0\.1:(\d+)/mcp")

TARGET_SLOWDOWN = 1.05  # after / before, for start and round trip


class BenchError(RuntimeError):
    pass


def p95(values: list[float]) -> float:
    """Nearest-rank 95th percentile."""
    ordered = sorted(values)
    return ordered[-(-len(ordered) * 95 // 100) - 1]


def timed(fn, *args):
    start = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - start, value


def tool_text(result: dict) -> tuple[str, bool]:
    """(text, isError) of a tools/call result."""
    return "".join(item.get("text", "") for item in result["content"]), bool(result.get("isError"))


def check_result(text: str, is_error: bool, pattern: re.Pattern, what: str) -> None:
    if is_error or not pattern.search(text):
        raise BenchError(f"unexpected {what} result: {text[:400]!r}")


def server_env(spares: int | None = None) -> dict[str, str]:
    env = dict(os.environ)
    if TIKTOKEN_DIR.is_dir():
        env.setdefault("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_DIR))
    if spares is not None:
        env["LOOMMUX_SPARE_KERNELS"] = str(spares)
    return env


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
        left = sorted(pid for pid in self.descendants if pid_alive(pid))
        if left:
            problems.append(f"server {self.proc.pid} left processes running: {left}")


class StdioServer(Child):
    """``python loommux.py`` (a given copy of it), spoken to with newline-delimited JSON-RPC."""

    def __init__(self, server: Path, workspace: str) -> None:
        super().__init__(subprocess.Popen(
            [sys.executable, str(server)], cwd=workspace, env=server_env(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
        ))
        self._fd = self.proc.stdout.fileno()
        self._buf = bytearray()
        self._next_id = 0

    def _send(self, message: dict) -> None:
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
        self._send({"jsonrpc": "2.0", "id": self._next_id, "method": method, "params": params})
        deadline = time.monotonic() + TIMEOUT
        while True:
            message = json.loads(self._read_line(deadline))
            if message.get("id") != self._next_id:
                continue
            if "error" in message:
                raise BenchError(f"{method}: {message['error']}")
            return message["result"]

    def initialize(self) -> None:
        self.request("initialize", {
            "protocolVersion": PROTOCOL_VERSION, "capabilities": {},
            "clientInfo": {"name": "loommux-bench-control", "version": "0"},
        })
        self._send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    def run_cell(self, code: str) -> tuple[str, bool]:
        return tool_text(self.request("tools/call", {"name": "run_cell", "arguments": {"code": code}}))


class HttpServer(Child):
    """``python loommux.py --server --port 0`` with one MCP session on one keep-alive connection."""

    def __init__(self, workspace: str) -> None:
        super().__init__(subprocess.Popen(
            [sys.executable, str(SERVER), "--server", "--host", "127.0.0.1", "--port", "0"],
            cwd=workspace, env=server_env(spares=1),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        ))
        self.stderr: list[str] = []
        self._port = threading.Event()
        self.port = 0
        # Drained on a thread so the pipe never fills, whatever the server logs.
        self._drain = threading.Thread(target=self._read_stderr, daemon=True)
        self._drain.start()
        self.conn: http.client.HTTPConnection | None = None
        self.session_id: str | None = None
        self._next_id = 0

    def _read_stderr(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            self.stderr.append(line)
            match = LISTENING.search(line)
            if match and not self._port.is_set():
                self.port = int(match.group(1))
                self._port.set()
        self._port.set()  # the server exited: wake the waiter, which sees no port

    def connect(self) -> None:
        if not self._port.wait(TIMEOUT) or not self.port:
            raise BenchError(f"HTTP server did not print its listening line: {self.stderr[-5:]}")
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT)

    def post(self, message: dict) -> tuple[int, dict | None]:
        headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
        if self.session_id:
            headers["Mcp-Session-Id"] = self.session_id
            headers["MCP-Protocol-Version"] = PROTOCOL_VERSION
        self.conn.request("POST", "/mcp", json.dumps(message).encode(), headers)
        response = self.conn.getresponse()
        body = response.read()
        if response.getheader("Mcp-Session-Id"):
            self.session_id = response.getheader("Mcp-Session-Id")
        if response.getheader("Content-Type", "").startswith("text/event-stream"):
            events = [json.loads(line[5:]) for line in body.decode().splitlines() if line.startswith("data:")]
            return response.status, next((e for e in events if e.get("id") == message.get("id")), None)
        return response.status, json.loads(body) if body else None

    def request(self, method: str, params: dict) -> dict:
        self._next_id += 1
        status, reply = self.post({"jsonrpc": "2.0", "id": self._next_id, "method": method, "params": params})
        if status != 200 or reply is None or "error" in reply:
            raise BenchError(f"{method}: HTTP {status}: {reply}")
        return reply["result"]

    def initialize(self) -> None:
        self.request("initialize", {
            "protocolVersion": PROTOCOL_VERSION, "capabilities": {},
            "clientInfo": {"name": "loommux-bench-control", "version": "0"},
        })
        if not self.session_id:
            raise BenchError("initialize: no Mcp-Session-Id header in the response")
        status, _ = self.post({"jsonrpc": "2.0", "method": "notifications/initialized"})
        if status != 202:
            raise BenchError(f"notifications/initialized: HTTP {status}, expected 202")

    def run_cell(self, code: str) -> tuple[str, bool]:
        return tool_text(self.request("tools/call", {"name": "run_cell", "arguments": {"code": code}}))

    def stop(self, problems: list[str]) -> None:
        if self.conn is not None:
            self.conn.close()
        super().stop(problems)
        self._drain.join(timeout=STOP_TIMEOUT)


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


class Bench:
    def __init__(self, args: argparse.Namespace, scratch: str) -> None:
        self.args = args
        self.scratch = scratch
        self.workspace = tempfile.mkdtemp(prefix="workspace-", dir=scratch)
        self.figures: dict = {}
        self.problems: list[str] = []
        self.alive: list[Child] = []

    def stop_all(self) -> None:
        while self.alive:
            self.alive.pop().stop(self.problems)

    def start_stdio(self, server: Path) -> tuple[float, StdioServer]:
        """Process spawn -> initialize answered -> first run_cell result. The server stays alive."""
        start = time.perf_counter()
        child = StdioServer(server, self.workspace)
        self.alive.append(child)
        child.initialize()
        text, is_error = child.run_cell(CELL)
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
        trips_old, trips_new = self.interleave(old.run_cell, CELL, DIRECT_RESULT, new.run_cell, CELL, DIRECT_RESULT)
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
        server = HttpServer(self.workspace)
        self.alive.append(server)
        server.connect()
        server.initialize()
        text, is_error = server.run_cell(FORWARDED_CELL)  # opens the target kernel
        check_result(text, is_error, FORWARDED_RESULT, "first forwarded run_cell")
        direct, forwarded = self.interleave(
            server.run_cell, CELL, DIRECT_RESULT, server.run_cell, FORWARDED_CELL, FORWARDED_RESULT
        )
        self.figures["fw_median"] = statistics.median(forwarded), statistics.median(direct)
        self.figures["fw_p95"] = p95(forwarded), p95(direct)
        self.stop_all()

    def run(self) -> None:
        try:
            self.before_after()
            self.forwarding()
        finally:
            self.stop_all()


def fmt_time(seconds: float) -> str:
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def report(figures: dict, args: argparse.Namespace) -> list[tuple[str, ...]]:
    def compared(label: str, key: str, target: float | None) -> tuple[str, ...]:
        ours, theirs = figures[key]
        ratio = ours / theirs
        goal, mark = ("", "") if target is None else (f"≤ {target:g}×", "ok" if ratio <= target else "over")
        return label, fmt_time(ours), fmt_time(theirs), f"{ratio:.2f}×", goal, mark

    return [
        ("stdio, control plane", "after", f"before ({args.baseline})", "ratio", "target", ""),
        compared(f"start to first result, median of {args.starts}", "start", TARGET_SLOWDOWN),
        compared(f"round trip 1+1, median of {args.repeat}", "rt_median", TARGET_SLOWDOWN),
        compared(f"round trip 1+1, p95 of {args.repeat}", "rt_p95", None),
        ("", "", "", "", "", ""),
        ("HTTP, one session", "forwarded", "direct", "ratio", "", ""),
        compared(f"round trip 1+1, median of {args.repeat}", "fw_median", None),
        compared(f"round trip 1+1, p95 of {args.repeat}", "fw_p95", None),
    ]


def print_table(rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        print("  ".join(cells).rstrip())


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

    with tempfile.TemporaryDirectory(prefix="loommux-bench-control-") as scratch:
        bench = Bench(args, scratch)
        try:
            bench.run()
        except BenchError as exc:
            print(f"benchmark failed: {exc}", file=sys.stderr)
            for problem in bench.problems:
                print(f"CHECK FAILED: {problem}", file=sys.stderr)
            return 1
    print(
        f"loommux control-plane bench · Python {platform.python_version()} · {os.cpu_count()} CPUs · "
        f"warm round trips alternate call by call"
    )
    print_table(report(bench.figures, args))
    for problem in bench.problems:
        print(f"CHECK FAILED: {problem}")
    return 1 if bench.problems else 0


if __name__ == "__main__":
    sys.exit(main())
