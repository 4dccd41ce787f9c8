"""Tests for loommux: its pure parts called directly, and real `python loommux.py` processes with real
kernels, over stdio and Streamable HTTP.

After the helpers and fixtures several sections share, the tests follow loommux.py's sections, in its
order and under its section names. Tests marked `fast` are pure (no kernel, no server process, no
subprocess): `pytest -m fast` runs them in seconds.
Most stdio tests share one session-scoped server (one kernel); a fresh server is spawned only where the
point is the process lifecycle (numbering from 1, restart, kernel death, shutdown, startup). Execution
numbers of the shared server keep growing, so tests read them from `In [N]`. HTTP servers are real
`python loommux.py --server` processes on an ephemeral 127.0.0.1 port: one module-scoped server where a
fresh one is not the point, fresh ones (usually without a spare kernel, so they start at once) for
settings, lease windows and shutdown. Rich results run over stdio (the hand-written client) and through
the official `mcp` client; the console runs in headless Chromium.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import concurrent.futures
import contextlib
import functools
import hashlib
import http.client
import importlib.util
import io
import itertools
import json
import math
import os
import platform
import random
import re
import resource
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import loommux

sys.path.insert(0, str(Path(__file__).resolve().parent / "bench"))
from benchlib import NGINX, nginx_command  # README's nginx configuration, as the bench runs it

ROOT = Path(__file__).resolve().parent
LOOMMUX = ROOT / "loommux.py"
TIKTOKEN_DIR = ROOT.parent / "shared" / "tiktoken"


LATEST = "2025-11-25"


TOOLS = {"run_cell", "wait", "status", "execution_status", "read_output", "search_output", "interrupt",
         "restart", "namespace", "inspect", "reset"}


HEAD_RE = re.compile(r"In \[(\d+)\] · ([^·]+?)(?: · (running|error|interrupted|killed))?:")
READ_HEAD_RE = re.compile(r"\[execution (\d+) · (\w+) · lines? (\d+)(?:-(\d+))? of ([\d,]+)\]")
SLEEP_CHILD = "import subprocess\nchild = subprocess.Popen(['sleep', '1000'])\nprint(child.pid)"
TWENTY_K = "for i in range(1, 20_001):\n    print(f'line {i}')"
needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process checks read /proc")


def server_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LOOMMUX_WORKSPACE_CONFIG"}
    if TIKTOKEN_DIR.is_dir():
        env["TIKTOKEN_CACHE_DIR"] = str(TIKTOKEN_DIR)
    env.update(extra)
    return env


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (zombies have exited; only the reaping is left)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def wait_until(predicate, timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def gone(pid: int, timeout: float = 10.0) -> bool:
    return wait_until(lambda: not pid_alive(pid), timeout)


def all_gone(pids, timeout: float = 10.0) -> list[int]:
    """Wait until none of `pids` is alive; return the survivors."""
    wait_until(lambda: not any(pid_alive(pid) for pid in pids), timeout)
    return [pid for pid in pids if pid_alive(pid)]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (kernels, spare kernels, processes started by cells), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found and pid_alive(child):
                found.add(child)
                todo.append(child)
    return found


def end_server(proc: subprocess.Popen, stop, leftovers: set[int]) -> None:
    """Teardown: stop a server still alive (SIGKILL if it does not stop) and whatever it left behind."""
    if proc.poll() is None:
        try:
            stop()
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    for pid in leftovers:
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


def number(text: str) -> int:
    return int(text.replace(",", ""))


def lines_of(text: str) -> list[str]:
    """Body lines of a tool result (everything after the first line), minus one trailing empty line."""
    lines = text.split("\n")[1:]
    return lines[:-1] if lines and lines[-1] == "" else lines


def clipped(width: int = 20) -> Callable[[object], str | None]:
    """Parametrize ids that keep test ids short: a text or byte string is cut after `width` characters as
    shown (pytest tells equal ids apart); anything else is named as pytest names it."""
    def clip(value: object) -> str | None:
        if not isinstance(value, (str, bytes)):
            return None
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        shown = 0
        for end, char in enumerate(text):
            shown += 1 if " " <= char <= "~" else 2 if char in "\t\n\r" else 4
            if shown > width:
                return text[:end] + "..."
        return None

    return clip


MAX_TEST_ID_CHARS = 100


@pytest.mark.fast
def test_no_test_id_is_over_100_characters(request):
    """Every test of this file as collected (whatever -k or -m selected), parametrize ids included."""
    module = request.node.getparent(pytest.Module)
    pending, too_long = list(module.collect()), []
    while pending:
        node = pending.pop()
        if not isinstance(node, pytest.Item):
            pending.extend(node.collect())
        elif len(test_id := node.nodeid.removeprefix(module.nodeid + "::")) > MAX_TEST_ID_CHARS:
            too_long.append(test_id)
    assert too_long == []


@dataclass
class Cell:
    """A parsed run_cell/wait result."""

    n: int
    state: str
    text: str

    @classmethod
    def parse(cls, text: str) -> Cell:
        head = text.split("\n", 1)[0]
        m = HEAD_RE.fullmatch(head)
        assert m, f"not a run_cell surface: {text[:500]!r}"
        return cls(int(m[1]), m[3] or "completed", text)

    @property
    def body(self) -> list[str]:
        return [line for line in lines_of(self.text) if not line.startswith("Kernel replaced:")]


STATELESS = "2026-07-28"
ENVELOPE = {"io.modelcontextprotocol/protocolVersion": STATELESS,
            "io.modelcontextprotocol/clientCapabilities": {},
            "io.modelcontextprotocol/clientInfo": {"name": "raw-modern", "version": "0"}}


def jsonrpc(method: str, params: dict | None = None, id=None) -> dict:
    """One JSON-RPC 2.0 message: a request with an id, else a notification."""
    message = {"jsonrpc": "2.0", "method": method}
    if id is not None:
        message["id"] = id
    if params is not None:
        message["params"] = params
    return message


def tool_params(tool: str, args: dict | None = None) -> dict:
    return {"name": tool} if args is None else {"name": tool, "arguments": args}


def tool_text(result: dict) -> tuple[str, bool, dict]:
    """A tools/call result as (its text blocks joined, isError, the result)."""
    text = "".join(c["text"] for c in result["content"] if c.get("type") == "text")
    return text, bool(result.get("isError", False)), result


def initialize_params(client: str, version: str = LATEST) -> dict:
    return {"protocolVersion": version, "capabilities": {}, "clientInfo": {"name": client, "version": "0"}}


def stateless_params(params: dict | None = None, **meta) -> dict:
    """params with the 2026-07-28 envelope as their _meta; `meta` adds to it or overrides it."""
    return {**(params or {}), "_meta": {**ENVELOPE, **meta}}


class McpClient:
    """The tests' one MCP client API: request, result and call, alike over stdio (StdioServer), a Streamable
    HTTP session (HttpMcp) and stateless 2026-07-28 HTTP (StatelessHttp), so that run_cell, finish, run, read
    and tool_error work on each. A transport says how one request goes out and its response comes back
    (`exchange`); the message itself, with its id, progress token and envelope, is built here, once.
    """

    stateless = False  # 2026-07-28: every request carries the envelope in its params' _meta

    def __init__(self) -> None:
        self.ids = itertools.count(1)

    def message(self, method: str, params: dict | None = None, progress_token=None, id=None) -> dict:
        """A request with the next id (or `id`); what params' own _meta says wins over the envelope."""
        if progress_token is not None:
            params = {**(params or {}),
                      "_meta": {**(params or {}).get("_meta", {}), "progressToken": progress_token}}
        if self.stateless:
            params = stateless_params(params, **(params or {}).get("_meta", {}))
        return jsonrpc(method, params, next(self.ids) if id is None else id)

    def exchange(self, message: dict, timeout: float) -> dict:
        """Send one request and return its response."""
        raise NotImplementedError

    def request(self, method: str, params: dict | None = None, timeout: float = 90.0,
                progress_token=None) -> dict:
        return self.exchange(self.message(method, params, progress_token), timeout)

    def result(self, method: str, params: dict | None = None, timeout: float = 90.0,
               progress_token=None) -> dict:
        message = self.request(method, params, timeout, progress_token)
        assert "result" in message, message
        return message["result"]

    def call(self, tool: str, args: dict | None = None, timeout: float = 90.0,
             progress_token=None) -> tuple[str, bool, dict]:
        return tool_text(self.result("tools/call", tool_params(tool, args), timeout, progress_token))


class StdioServer(McpClient):
    """A hand-written MCP client driving one `python loommux.py` process over stdio.

    A reader thread parses every stdout line as JSON (anything else is recorded in `garbage`,
    which the fixtures turn into a failure) and routes responses by id, so a test may have
    several requests in flight and check in which order the answers came.
    """

    def __init__(self, workspace: Path, stderr_path: Path, env: dict[str, str]):
        super().__init__()
        self.workspace = workspace
        self.stderr_path = stderr_path
        with open(stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(LOOMMUX)], cwd=workspace, env=env, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=err, start_new_session=True,
            )
        self.messages: list = []      # every parsed message, in arrival order
        self.responses: dict = {}     # id -> response
        self.garbage: list[bytes] = []
        self.duplicates: list = []
        self.eof = False
        self.tracked_pids: set[int] = set()  # kernels and cell children, killed at teardown if left over
        self.init_result: dict | None = None
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                self.garbage.append(line[:300])
                continue
            with self._cond:
                for m in msg if isinstance(msg, list) else [msg]:
                    if not isinstance(m, dict) or m.get("jsonrpc") != "2.0":
                        self.garbage.append(line[:300])
                        continue
                    self.messages.append(m)
                    if "id" in m and ("result" in m or "error" in m):
                        key = m["id"]
                        if key in self.responses and key is not None:
                            self.duplicates.append(key)
                        self.responses[key] = m
                self._cond.notify_all()
        with self._cond:
            self.eof = True
            self._cond.notify_all()

    # -- sending
    def send_raw(self, data: bytes | str) -> None:
        if isinstance(data, str):
            data = data.encode()
        with self._write_lock:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()

    def send(self, obj) -> None:
        self.send_raw(json.dumps(obj, separators=(",", ":")).encode() + b"\n")

    def notify(self, method: str, params: dict | None = None) -> None:
        self.send(jsonrpc(method, params))

    def send_request(self, method: str, params: dict | None = None, id=None, progress_token=None):
        """Send a request without waiting for its response; its id."""
        message = self.message(method, params, progress_token, id)
        self.send(message)
        return message["id"]

    def exchange(self, message: dict, timeout: float) -> dict:
        self.send(message)
        return self.response(message["id"], timeout)

    # -- receiving
    def wait_for(self, predicate, timeout: float = 30.0, since: int = 0) -> dict:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for m in self.messages[since:]:
                    if predicate(m):
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or self.eof:
                    raise AssertionError(f"no matching message within {timeout} s; stderr:\n"
                                         f"{self.stderr_tail()}")
                self._cond.wait(left)

    def response(self, rid, timeout: float = 90.0) -> dict:
        return self.wait_for(lambda m: "id" in m and m["id"] == rid and ("result" in m or "error" in m),
                             timeout)

    def initialize(self, version: str = LATEST, timeout: float = 90.0) -> dict:
        self.init_result = self.result("initialize", initialize_params("test_loommux", version), timeout)
        self.notify("notifications/initialized")
        return self.init_result

    # -- lifecycle
    def kernel_pid(self) -> int:
        text, is_error, _ = self.call("status")
        assert not is_error, text
        pid = int(re.search(r"kernel: pid (\d+)", text)[1])
        self.tracked_pids.add(pid)
        return pid

    def close(self, timeout: float = 15.0) -> int:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        return self.proc.wait(timeout)

    def stderr_tail(self, n: int = 3000) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def cleanup(self) -> None:
        """Teardown: end the server if still alive and SIGKILL whatever it left behind."""
        end_server(self.proc, lambda: self.close(15), self.tracked_pids)

    def assert_pure(self) -> None:
        assert not self.garbage, f"non-JSON-RPC lines on stdout: {self.garbage[:5]}"
        assert not self.duplicates, f"ids answered more than once: {self.duplicates}"


def run_cell(server: McpClient, code: str, timeout: float = 90.0) -> Cell:
    text, is_error, _ = server.call("run_cell", {"freeform": code}, timeout)
    assert not is_error, text
    return Cell.parse(text)


def finish(server: McpClient, cell: Cell, timeout: float = 120.0) -> Cell:
    """Wait (without interrupting) until `cell` is no longer running."""
    deadline = time.monotonic() + timeout
    while cell.state == "running":
        assert time.monotonic() < deadline, f"execution {cell.n} still running after {timeout} s"
        text, is_error, _ = server.call("wait", {"execution": cell.n, "timeout_seconds": 30}, timeout=90)
        assert not is_error, text
        cell = Cell.parse(text)
    return cell


def run(server: McpClient, code: str, timeout: float = 120.0) -> Cell:
    return finish(server, run_cell(server, code), timeout)


def tool_error(server: McpClient, tool: str, args: dict | None, code: str) -> str:
    text, is_error, _ = server.call(tool, args)
    assert is_error, f"{tool}({args}) should fail with {code}, got: {text[:300]}"
    assert text.startswith(f"{code}:"), text
    return text


def read(server: McpClient, timeout: float = 90.0, **args) -> tuple[str, list[str]]:
    """read_output -> (header line, returned lines)."""
    text, is_error, _ = server.call("read_output", args, timeout)
    assert not is_error, text
    header, lines = text.split("\n", 1)[0], text.split("\n")[1:]
    m = READ_HEAD_RE.fullmatch(header)
    if m:
        count = int(m[4] or m[3]) - int(m[3]) + 1
        if len(lines) == count + 1 and lines[-1] == "":
            lines.pop()
    return header, lines


def search(server: McpClient, query: str, **args) -> tuple[str, list[str]]:
    text, is_error, _ = server.call("search_output", {"query": query, **args})
    assert not is_error, text
    return text.split("\n", 1)[0], lines_of(text)


def matched_numbers(lines: list[str]) -> list[int]:
    return [int(line.split()[1]) for line in lines if line.startswith("M ")]


def stream_counts(status_text: str, stream: str) -> tuple[int, int, str]:
    """execution_status per-stream line -> (lines, characters, size text)."""
    m = re.search(rf"^\s*{stream}: ([\d,]+) lines? · ([\d,]+) characters? · (.+)$", status_text, re.MULTILINE)
    assert m, status_text
    return number(m[1]), number(m[2]), m[3]


def settle(server: StdioServer) -> None:
    """Make sure no cell of one test keeps running into the next."""
    text, is_error, _ = server.call("interrupt")
    if not is_error and text.startswith("interrupt_sent"):
        server.call("wait", {"timeout_seconds": 60}, timeout=90)


FAST_TEST_FIXTURES = {"request", "monkeypatch", "capsys", "tmp_path", "tmp_path_factory",
                      "fast_tests_start_nothing"}


@pytest.fixture(autouse=True)
def fast_tests_start_nothing(request, monkeypatch):
    """A test marked fast starts no process, so no kernel and no server (nor asks for a fixture that could
    start one): the fast loop stays fast."""
    if request.node.get_closest_marker("fast") is not None:
        callspec = getattr(request.node, "callspec", None)
        asked = set(request.fixturenames) - FAST_TEST_FIXTURES - set(callspec.params if callspec else ())
        assert not asked, f"a fast test asks for fixtures that may start processes: {sorted(asked)}"

        def refuse(*args, **kwargs):
            raise AssertionError(f"a fast test started a process: {args[:2]!r}")

        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)
        monkeypatch.setattr(os, "fork", refuse)
        monkeypatch.setattr(os, "posix_spawn", refuse)


@pytest.fixture(scope="session")
def session_server(tmp_path_factory):
    base = tmp_path_factory.mktemp("session")
    workspace = base / "workspace"
    workspace.mkdir()
    server = StdioServer(workspace, base / "server.stderr", server_env())
    try:
        server.initialize()
        yield server
        assert server.close() == 0
    finally:
        server.cleanup()
    server.assert_pure()


@pytest.fixture
def srv(session_server):
    yield session_server
    settle(session_server)
    session_server.assert_pure()


@pytest.fixture
def spawn(tmp_path):
    """Factory for fresh servers, each in its own workspace; all are ended at teardown."""
    servers: list[StdioServer] = []

    def _spawn(workspace: Path | None = None, initialize: bool = True, **env: str) -> StdioServer:
        i = len(servers)
        if workspace is None:
            workspace = tmp_path / f"workspace{i}"
            workspace.mkdir()
        server = StdioServer(workspace, tmp_path / f"server{i}.stderr", server_env(**env))
        servers.append(server)
        if initialize:
            server.initialize()
        return server

    yield _spawn
    for server in servers:
        server.cleanup()
    for server in servers:
        server.assert_pure()


@pytest.fixture(scope="session")
def small(session_server) -> Cell:
    return run(session_server, "print('err1 a(b')\nprint('ERR22 x')\nprint('plain')\nprint('err3 err4')")


@pytest.fixture
def anyio_backend():
    return "asyncio"


# The module tested is this checkout's: pytest puts the test file's folder first on sys.path.
assert Path(loommux.__file__).resolve() == LOOMMUX, f"imported {loommux.__file__}, not {LOOMMUX}"


def log_of(*writes: str) -> loommux.Log:
    log = loommux.Log()
    for text in writes:
        log.write(text)
    return log


NOT_A_RANGE = 'is not a line range; use start:stop such as "1:40", "-40:", ":10" or "3:3"'


def settings_of(argv: list[str], **environ: str) -> loommux.Settings:
    return loommux.read_settings(environ, ROOT, loommux.parse_command_line(argv))


# A cell that sends display_data itself, on the kernel's IOPub, as fast as the kernel can.
DISPLAY_FLOOD = """k = get_ipython().kernel
parent = k.get_parent("shell")
for i in range({count}):
    k.session.send(k.iopub_socket, "display_data", {{"data": {{"text/plain": f"d{{i}}"}}, "metadata": {{}}}},
                   parent=parent)
"""
LOST_RE = re.compile(r"^(?:\[|warning: )([\d,]+) kernel messages? never arrived "
                     r"\(lost between the kernel and loommux\): output is missing\]?$", re.MULTILINE)


def lost_counts(text: str) -> list[int]:
    """The counts of the lost-messages lines in a result or an execution_status text."""
    return [number(m[1]) for m in LOST_RE.finditer(text)]


def statuses_until_replaced(server: StdioServer, old_kernel: int, timeout: float = 30.0) -> list[str]:
    """Poll `status` until a kernel other than `old_kernel` is idle; return every status text seen."""
    texts: list[str] = []

    def replaced() -> bool:
        texts.append(server.call("status")[0])
        m = re.search(r"kernel: pid (\d+) · idle", texts[-1])
        return bool(m) and int(m[1]) != old_kernel

    assert wait_until(replaced, timeout, interval=0.3), texts[-3:]
    return texts


def kernel_connection_file(kernel_pid: int) -> Path:
    args = Path(f"/proc/{kernel_pid}/cmdline").read_bytes().split(b"\0")
    return Path(os.fsdecode(args[args.index(b"-f") + 1]))


CLEAN_EXIT = "kernel exited cleanly"
CLEAN_EXIT_CELL = f"import atexit\natexit.register(open, {CLEAN_EXIT!r}, 'w')"  # left only by a clean exit


def kernel_tree(server: StdioServer) -> tuple[int, int, set[int], Path]:
    """The server's kernel, its launcher, every process below the server (what the cells started among them,
    all tracked) and the kernel's directory; a kernel that exits cleanly leaves CLEAN_EXIT in the workspace.
    What the cells start is detached: ipykernel's own shutdown waits for the children in its process group,
    and one it cannot reap (a Popen never waited for) keeps it from exiting cleanly within the grace."""
    kernel = server.kernel_pid()
    launcher = parent_of(kernel)
    children = detached_children(server, kernel)
    run(server, CLEAN_EXIT_CELL)
    below = descendants(server.proc.pid)
    assert {kernel, launcher, *children} <= below and parent_of(launcher) == server.proc.pid
    server.tracked_pids |= below
    return kernel, launcher, below, kernel_connection_file(kernel).parent


def assert_nothing_left(kernel: int, launcher: int, below: set[int], kernel_dir: Path) -> None:
    """Once a server's exit is seen: its kernel and launcher are gone already (not waited for here), and the
    kernel's directory; nothing else it started outlives it."""
    assert not pid_alive(kernel) and not pid_alive(launcher)
    assert not kernel_dir.exists()
    assert all_gone(below, 5) == []


def python_in(cwd: Path, code: str, *flags: str) -> subprocess.CompletedProcess:
    """Run code in a fresh interpreter (no PYTHONPATH) in cwd."""
    env = {k: v for k, v in server_env().items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60, check=False)


LISTENING_RE = re.compile(r"loommux: listening on http://127\.0\.0\.1:(\d+)/mcp")
MCP_ACCEPT = "application/json, text/event-stream"
CAPTION_RE = re.compile(
    r"\[(image/\w+)(?: (\d+)×(\d+))? · (\d+ B|[\d.]+ [KMG]iB) · display (\d+)(?: · not sent: (.+))?\]"
)
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


ARTIFACTS = ROOT / "test-artifacts"

# Prints one tick a second (3 lines in ~3.3 s) and returns at once: the caller waits for it.
TICKS = ("%%loommux --wait 0.1\nimport time\nfor i in range(3):\n    print('tick', i, flush=True)\n"
         "    time.sleep(1)\ntime.sleep(0.3)")


SLEEP_LONG = "%%loommux --wait 0.1\nimport time\ntime.sleep(120)"

# One cell, eight displays: sent images (four formats, three details) and four that are not sent.
IMAGE_CELL = """%%loommux --wait 60
import base64, io
from IPython.display import display
from PIL import Image as PILImage

def encoded(image, fmt, **options):
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return base64.b64encode(buffer.getvalue()).decode()

png = encoded(PILImage.new('RGB', (40, 30), 'red'), 'PNG')
frames = [PILImage.new('RGB', (8, 6), colour) for colour in ('red', 'green', 'blue')]
animated = encoded(frames[0], 'GIF', save_all=True, append_images=frames[1:], duration=50, loop=0)
still_gif = encoded(PILImage.new('RGB', (8, 6), 'blue'), 'GIF')
jpeg = encoded(PILImage.new('RGB', (50, 20), 'green'), 'JPEG')
webp = encoded(PILImage.new('RGB', (24, 12), 'yellow'), 'WEBP')
print('before')
display({'image/png': png, 'text/plain': '<red>'}, metadata={'detail': 'low'}, raw=True)
print('middle')
display({'image/gif': animated}, raw=True)
display({'image/png': png}, metadata={'detail': 'medium'}, raw=True)
display({'image/png': 'not*base64!'}, raw=True)
display({'image/png': base64.b64encode(b'these bytes are no PNG').decode()}, raw=True)
display({'image/jpeg': jpeg}, raw=True)
display({'image/webp': webp, 'image/gif': still_gif}, raw=True)
display({'image/gif': still_gif}, metadata={'detail': 'original'}, raw=True)
print('after')"""
IMAGE_MAGIC = {"image/png": b"\x89PNG", "image/jpeg": b"\xff\xd8", "image/webp": b"RIFF",
               "image/gif": b"GIF8"}


def caption(line: str) -> re.Match:
    m = CAPTION_RE.fullmatch(line)
    assert m, f"not an image caption: {line!r}"
    return m


def check_image_blocks(blocks: list[tuple]) -> None:
    """IMAGE_CELL's result: text, image, text, ... in output order; refused images only as captions."""
    kinds = [block[0] for block in blocks]
    assert kinds == ["text", "image", "text", "image", "text", "image", "text", "image", "text"], kinds
    texts = [block[1] for block in blocks if block[0] == "text"]
    images = [block for block in blocks if block[0] == "image"]
    head, *before = texts[0].split("\n")
    assert HEAD_RE.fullmatch(head) and not HEAD_RE.fullmatch(head)[3], head  # completed
    assert before[0] == "before" and len(before) == 2
    assert caption(before[1]).group(1, 2, 3, 5, 6) == ("image/png", "40", "30", "1", None)
    middle = texts[1].split("\n")
    assert middle[0] == "middle" and len(middle) == 6, middle
    refused = [caption(line) for line in middle[1:5]]
    assert [(m[1], m[5]) for m in refused] == [("image/gif", "2"), ("image/png", "3"), ("image/png", "4"),
                                               ("image/png", "5")]
    assert (refused[0].group(2, 3) == ("8", "6")
            and refused[0][6].startswith("animated images are not supported"))
    assert refused[1][6].startswith('detail "medium" is not low, high or original')
    assert refused[2][6].startswith("corrupt base64 data")
    assert refused[3][6].startswith("corrupt image (not a PNG file)")
    assert caption(middle[5]).group(1, 2, 3, 5, 6) == ("image/jpeg", "50", "20", "6", None)
    assert caption(texts[2]).group(1, 2, 3, 5, 6) == ("image/webp", "24", "12", "7", None)
    assert caption(texts[3]).group(1, 2, 3, 5, 6) == ("image/gif", "8", "6", "8", None)
    assert texts[4] == "after"
    assert [(image[2], image[3]) for image in images] == [
        ("image/png", "low"), ("image/jpeg", "high"), ("image/webp", "high"), ("image/gif", "original")]
    for _, data, mime, _ in images:
        assert base64.b64decode(data).startswith(IMAGE_MAGIC[mime])


def structured_checks(results: list[tuple[str, object]]) -> None:
    """Field values of the structured results of call_every_tool_structured."""
    data = [(name, result.structured_content, result.is_error) for name, result in results]
    (_, first, _), (_, running, _), (_, waited, _), (_, status, _) = data[:4]
    assert first["execution"] == 1 and first["state"] == "completed" and first["output_delivered"] is True
    assert (first["output_omitted_reason"] is None and first["error"] is None
            and first["output_total_lines"] == 3)
    assert first["submitted_at"].endswith("Z") and first["completed_at"].endswith("Z")
    assert isinstance(first["kernel_pid"], int) and first["images"] == 0
    assert running["state"] == "running" and running["output_delivered"] is False
    assert running["output_omitted_reason"] == "running" and running["completed_at"] is None
    assert waited["execution"] == 2 and waited["state"] == "completed" and waited["output_total_lines"] == 1
    assert status["resource"] == "private" and status["executions"] == 2 and status["kernel_state"] == "idle"
    by_name: dict = {}
    for name, content, is_error in data[4:]:
        by_name.setdefault(name, (content, is_error))  # the first call of each
    assert by_name["execution_status"][0]["streams"]["stdout"]["lines"] == 2
    assert by_name["read_output"][0]["lines"] == [{"number": 1, "text": "alpha"},
                                                  {"number": 2, "text": "beta"}]
    assert by_name["search_output"][0]["matching_lines"] == 2
    assert by_name["interrupt"][0] == {"interrupt_sent": False, "execution": None, "state": None,
                                         "evaluations": []}
    listed = {"name": "time", "kind": "module", "type": "module", "size": {}, "value": "time"}
    assert by_name["namespace"][0]["names"] == [listed]
    assert by_name["inspect"][0]["kind"] == "module" and by_name["reset"][0]["removed"] == ["time"]
    failed = data[-3][1]
    assert failed["state"] == "error" and failed["error"]["ename"] == "ZeroDivisionError"
    assert failed["lost_messages"] == 3 and first["lost_messages"] == waited["lost_messages"] == 0
    missing, is_error = data[-2][1:]
    assert is_error and missing["error_code"] == "execution_not_found" and "99" in missing["message"]
    restarted = data[-1][1]
    assert restarted["kernel_pid"] != restarted["previous_kernel_pid"] == first["kernel_pid"]
    assert restarted["next_execution"] == 4


async def call_every_tool_structured(client) -> list[tuple[str, object]]:
    """Call every tool (and one error) through the official client, which validates each result against
    the tool's outputSchema; validate again with jsonschema here."""
    import jsonschema

    tools = {tool.name: tool for tool in (await client.list_tools()).tools}
    assert set(tools) == TOOLS and all(tool.output_schema for tool in tools.values())
    calls = [
        ("run_cell", {"freeform": "print('alpha')\nprint('beta')\n6 * 7"}),
        ("run_cell", {"freeform": "%%loommux --wait 0.1\nimport time\ntime.sleep(1.5)\nprint('slept')"}),
        ("wait", {"timeout_seconds": 30}),
        ("status", {}),
        ("execution_status", {"execution": 1}),
        ("read_output", {"execution": 1, "line_range": "1:2"}),
        ("search_output", {"query": "a$", "execution": 1, "context_after": 1}),
        ("interrupt", {}),
        ("namespace", {}),
        ("inspect", {"name": "time"}),
        ("reset", {"names": ["time"]}),
        ("run_cell", {"freeform": "get_ipython().kernel.session.message_count += 3\n1 / 0"}),  # 3 lost
        ("read_output", {"execution": 99}),
        ("restart", {}),
    ]
    results = []
    for name, args in calls:
        result = await client.call_tool(name, args)
        assert result.structured_content is not None, (name, result)
        jsonschema.validate(result.structured_content, tools[name].output_schema)
        text = "".join(block.text for block in result.content if block.type == "text")
        assert result.is_error == text.startswith("execution_not_found:"), text
        results.append((name, result))
    structured_checks(results)
    return results


@dataclass
class HttpResponse:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self):
        return json.loads(self.body)

    @property
    def messages(self) -> list:
        """The JSON-RPC messages of a JSON or SSE body."""
        if self.headers.get("content-type", "").startswith("text/event-stream"):
            return sse_messages(self.body)
        return [self.json()] if self.body else []


def sse_messages(body: bytes) -> list:
    messages = []
    for event in re.split(rb"\r?\n\r?\n", body):
        data = [line[5:].strip() for line in event.splitlines() if line.startswith(b"data:")]
        if any(data):
            messages.append(json.loads(b"\n".join(data)))
    return messages


class RawHttp:
    """One HTTP/1.1 client connection on a plain socket: requests exactly as written, responses parsed."""

    def __init__(self, port: int, timeout: float = 60.0):
        self.port = port
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def head(self, method: str, path: str, headers: dict | None = None, version: str = "HTTP/1.1",
             length: int | None = None) -> bytes:
        """A request head; a header given as None is left out (Host is sent unless so)."""
        fields = {"Host": f"127.0.0.1:{self.port}"}
        if length:
            fields["Content-Length"] = str(length)
        for name, value in (headers or {}).items():
            for same in [key for key in fields if key.lower() == name.lower()]:
                del fields[same]
            if value is not None:
                fields[name] = value
        lines = [f"{method} {path} {version}", *(f"{k}: {v}" for k, v in fields.items())]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    def request(self, method: str, path: str, headers: dict | None = None, body: bytes = b"",
                version: str = "HTTP/1.1") -> HttpResponse:
        self.send(self.head(method, path, headers, version, len(body)) + body)
        return self.read_response()

    def _fill(self) -> None:
        data = self.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buffer += data

    def readline(self) -> bytes:
        while (end := self.buffer.find(b"\r\n")) < 0:
            self._fill()
        line, self.buffer = self.buffer[:end], self.buffer[end + 2:]
        return line

    def readexactly(self, n: int) -> bytes:
        while len(self.buffer) < n:
            self._fill()
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def read_head(self) -> tuple[int, dict[str, str]]:
        version, status, _ = self.readline().decode("latin-1").split(" ", 2)
        assert version == "HTTP/1.1", version
        headers = {}
        while line := self.readline():
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(status), headers

    def read_response(self) -> HttpResponse:
        status, headers = self.read_head()
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while size := int(self.readline().split(b";")[0], 16):
                body += self.readexactly(size)
                assert self.readexactly(2) == b"\r\n"
            while self.readline():
                pass  # trailers, up to the blank line
        elif "content-length" in headers:
            body = self.readexactly(int(headers["content-length"]))
        else:
            body = b""
        return HttpResponse(status, headers, body)

    def closed_by_server(self, timeout: float = 10.0) -> bool:
        """True when the server closes the connection (EOF or reset) within `timeout`."""
        if self.buffer:
            return False
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        except TimeoutError:
            return False
        except ConnectionError:
            return True


def mcp_message(method: str, params: dict | None = None, id: int | None = 1) -> bytes:
    """A JSON-RPC message as an HTTP body, for requests written by hand on a RawHttp."""
    return json.dumps(jsonrpc(method, params, id)).encode()


INITIALIZE_PARAMS = initialize_params("test_loommux-http")
MCP_HEADERS = {"Accept": MCP_ACCEPT, "Content-Type": "application/json"}


def stateless_headers(message: dict) -> dict[str, str]:
    """The routing headers of a 2026-07-28 request: its version and method, a tool call's tool and kernel, a
    task request's task."""
    fields = {"MCP-Protocol-Version": STATELESS, "Mcp-Method": message["method"]}
    if message["method"].startswith("tasks/") and isinstance(message["params"].get("taskId"), str):
        fields["Mcp-Name"] = message["params"]["taskId"]
    if message["method"] == "resources/read":
        fields["Mcp-Name"] = message["params"]["uri"]
    if message["method"] == "tools/call":
        fields["Mcp-Name"] = message["params"]["name"]
        arguments = message["params"].get("arguments") or {}
        if "kernel" in arguments:
            fields["Mcp-Param-Kernel"] = arguments["kernel"]
    return fields


class LoommuxHttp:
    """A `python loommux.py --server` process on an ephemeral 127.0.0.1 port, with its log in a file."""

    def __init__(self, workspace: Path, log_path: Path, env: dict[str, str], args=()):
        self.workspace, self.log_path = workspace, log_path
        self.api_headers: dict[str, str] = {}  # e.g. the bearer token, for api()
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(LOOMMUX), "--server", "--host", "127.0.0.1", "--port", "0", *args],
                cwd=workspace, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True,
            )
        self.port = 0
        self.seen: set[int] = set()  # processes below the server, killed at cleanup if left over

    def wait_ready(self, timeout: float = 60.0) -> LoommuxHttp:
        def listening() -> bool:
            m = LISTENING_RE.search(self.log())
            if m:
                self.port = int(m[1])
            return bool(m) or self.proc.poll() is not None

        assert wait_until(listening, timeout, 0.05), f"not listening after {timeout} s:\n{self.log()[-3000:]}"
        assert self.port, f"the server exited with {self.proc.returncode}:\n{self.log()[-3000:]}"
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def api(self, method: str, path: str, body=None, headers: dict | None = None) -> HttpResponse:
        """One control-API (or console) request on its own connection."""
        data = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
        conn = RawHttp(self.port)
        try:
            fields = {"Connection": "close", **({"Content-Type": "application/json"} if data else {})}
            return conn.request(method, path, {**fields, **self.api_headers, **(headers or {})}, data)
        finally:
            conn.close()

    def resources(self) -> list[dict]:
        response = self.api("GET", "/api/resources")
        assert response.status == 200, response
        return response.json()["resources"]

    def resource(self, resource_id: str) -> dict | None:
        return next((r for r in self.resources() if r["id"] == resource_id), None)

    def resource_of(self, operator: str) -> dict | None:
        """The resource holding a lease of the session labelled `operator`."""
        return next((r for r in self.resources()
                     if any(lease["operator"] == operator for lease in r["leases"])), None)

    def remember(self) -> set[int]:
        self.seen |= descendants(self.proc.pid)
        return self.seen

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            self.remember()
        end_server(self.proc, lambda: (self.proc.send_signal(signal.SIGTERM), self.proc.wait(20)), self.seen)


def http_env(**extra: str) -> dict[str, str]:
    """server_env without any LOOMMUX_ variable of the outer environment but those given here."""
    return {**{k: v for k, v in server_env().items() if not k.startswith("LOOMMUX_")}, **extra}


class HttpClient(McpClient):
    """MCP over Streamable HTTP, outside any session: one POST per message, on one keep-alive connection
    (or, without keep_alive, a fresh connection each), the answer as JSON or an SSE stream."""

    def __init__(self, server: LoommuxHttp, headers: dict | None = None, keep_alive: bool = True):
        super().__init__()
        self.server, self.keep_alive = server, keep_alive
        self.headers = {**MCP_HEADERS, **(headers or {})}
        self.conn: RawHttp | None = None
        self.last: HttpResponse | None = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def connection(self) -> RawHttp:
        if self.conn is None:
            self.conn = RawHttp(self.server.port)
        return self.conn

    def drop(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def fields(self, message: dict | bytes) -> dict[str, str]:
        """The headers a POST of `message` carries."""
        return self.headers

    def post(self, message: dict | bytes, headers: dict | None = None, timeout: float = 90.0) -> HttpResponse:
        """One POST of `message` (bytes are sent as they are); `headers` add to the client's, or with None
        take one out."""
        body = message if isinstance(message, bytes) else json.dumps(message).encode()
        conn = self.connection()
        conn.sock.settimeout(timeout)
        try:
            response = conn.request("POST", "/mcp", {**self.fields(message), **(headers or {})}, body)
        except OSError:
            self.drop()
            raise
        if not self.keep_alive or response.headers.get("connection", "").lower() == "close":
            self.drop()
        return response

    def post_on(self, conn: RawHttp, message: dict) -> None:
        """Send a POST of `message` on another connection and read nothing: for a request whose connection
        the test drops, or whose answer a cancellation takes away."""
        body = json.dumps(message).encode()
        conn.send(conn.head("POST", "/mcp", self.fields(message), length=len(body)) + body)

    def exchange(self, message: dict, timeout: float) -> dict:
        response = self.last = self.post(message, timeout=timeout)
        assert response.status == 200, (response.status, response.body[:500])
        found = [m for m in response.messages if m.get("id") == message["id"]]
        assert len(found) == 1, response.messages
        return found[0]

    def close(self) -> None:
        self.drop()


class HttpMcp(HttpClient):
    """A hand-written MCP client session over Streamable HTTP (initialize, then Mcp-Session-Id), on one
    keep-alive connection."""

    def __init__(self, server: LoommuxHttp, resource: str | None = None, operator: str | None = None,
                 headers: dict | None = None, initialize: bool = True):
        super().__init__(server, headers)
        if resource is not None:
            self.headers["X-Loommux-Resource"] = resource
        if operator is not None:
            self.headers["X-Loommux-Operator"] = operator
        self.session_id: str | None = None
        if initialize:
            response = self.initialize()
            assert response.status == 200, (response.status, response.body[:500], server.log()[-2000:])

    def session_headers(self) -> dict[str, str]:
        return {"Mcp-Session-Id": self.session_id, "MCP-Protocol-Version": LATEST} if self.session_id else {}

    def fields(self, message: dict | bytes) -> dict[str, str]:
        return {**self.headers, **self.session_headers()}

    def initialize(self, headers: dict | None = None) -> HttpResponse:
        response = self.post(self.message("initialize", INITIALIZE_PARAMS), headers)
        if response.status == 200:
            self.session_id = response.headers["mcp-session-id"]
            assert self.post(jsonrpc("notifications/initialized")).status == 202
        return response

    def open_stream(self) -> RawHttp:
        """The standalone GET stream, on its own connection; close that connection to end it."""
        conn = RawHttp(self.server.port)
        conn.send(conn.head("GET", "/mcp", {"Accept": "text/event-stream", **self.session_headers()}))
        status, headers = conn.read_head()
        assert status == 200 and headers["content-type"].startswith("text/event-stream"), (status, headers)
        return conn

    def delete(self) -> HttpResponse:
        return self.connection().request("DELETE", "/mcp", self.session_headers())

    def close(self) -> None:
        """End the session (DELETE) when the server is still there."""
        if self.session_id and self.server.proc.poll() is None:
            try:
                self.delete()
            except OSError:
                pass
        self.drop()


class StatelessHttp(HttpClient):
    """Stateless 2026-07-28 requests over HTTP: the envelope in each request, its routing headers on each
    POST, a connection of its own for each; every result says it is complete and who answered."""

    stateless = True

    def __init__(self, server: LoommuxHttp, headers: dict | None = None):
        super().__init__(server, headers, keep_alive=False)

    def fields(self, message: dict | bytes) -> dict[str, str]:
        return {**self.headers, **stateless_headers(message)} if isinstance(message, dict) else self.headers

    def send(self, method: str, params: dict | None = None, headers: dict | None = None,
             timeout: float = 90.0) -> HttpResponse:
        """One POST of a request for `method`, its HTTP response as it came."""
        return self.post(self.message(method, params), headers, timeout)

    def result(self, method: str, params: dict | None = None, timeout: float = 90.0,
               progress_token=None) -> dict:
        result = super().result(method, params, timeout, progress_token)
        assert (result["resultType"] == "complete"
                and result["_meta"]["io.modelcontextprotocol/serverInfo"]), result
        return result


def status_kernel(session) -> int:
    return int(re.search(r"kernel: pid (\d+)", session.call("status")[0])[1])


def lease_env(mode: str, **settings: str) -> dict[str, str]:
    """Short lease windows; no spare kernel unless given (the server then listens at once)."""
    return {"LOOMMUX_SPARE_KERNELS": "0", "LOOMMUX_LEASE_MODE": mode, **settings}


@pytest.fixture
def http_spawn(tmp_path):
    """Factory for fresh HTTP servers, each in its own workspace; all are ended at teardown."""
    servers: list[LoommuxHttp] = []

    def _spawn(*args: str, ready: bool = True, **env: str) -> LoommuxHttp:
        i = len(servers)
        workspace = tmp_path / f"http-workspace{i}"
        workspace.mkdir()
        server = LoommuxHttp(workspace, tmp_path / f"http-server{i}.log", http_env(**env), args)
        servers.append(server)
        return server.wait_ready() if ready else server

    yield _spawn
    for server in servers:
        server.cleanup()


@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    """A default server (activity leases with long windows, one spare kernel) shared by the HTTP tests."""
    base = tmp_path_factory.mktemp("http")
    (base / "workspace").mkdir()
    server = LoommuxHttp(base / "workspace", base / "server.log", http_env(LOOMMUX_SPARE_KERNELS="1"))
    try:
        server.wait_ready()
        yield server
        server.remember()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0, server.log()[-3000:]
    finally:
        server.cleanup()


def retired_lines(text: str) -> list[str]:
    return [line for line in text.split("\n") if line.startswith("Kernel retired:")]


def playwright_or_skip():
    """playwright's ``(expect, sync_playwright)``; skips without playwright or chromium (fails on CI)."""
    try:
        from playwright.sync_api import expect, sync_playwright
    except ImportError:
        if os.environ.get("CI"):
            raise
        pytest.skip("playwright is not installed")
    if not CHROMIUM.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{CHROMIUM} is missing: .ci/run installs Debian's chromium")
        pytest.skip(f"{CHROMIUM} is not installed")
    return expect, sync_playwright


@contextlib.contextmanager
def console_page(server: LoommuxHttp):
    """The server's console open in headless Chromium: (playwright's expect, the page)."""
    expect, sync_playwright = playwright_or_skip()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 480})
            page.goto(f"http://127.0.0.1:{server.port}/")
            yield expect, page
        finally:
            browser.close()


def out(session, code: str) -> list[str]:
    """Run a cell that must complete; its output lines."""
    cell = run(session, code)
    assert cell.state == "completed", cell.text
    return cell.body


DEEP = b"[" * 5000 + b"]" * 5000  # past any recursion limit


# A classic daemon: fork, setsid, fork, the middle process exits; the daemon prints its pid and lets
# go of the pipe. The cell waits for the first process only, as `subprocess.run` does.
DAEMON_CELL = """import subprocess, sys
daemonize = '''import os
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        print(os.getpid(), flush=True)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.execvp("sleep", ["sleep", "1000"])
    os._exit(0)
os.wait()
'''
print(subprocess.run([sys.executable, "-c", daemonize], capture_output=True, text=True).stdout.strip())"""
SESSION_CHILD = "import subprocess\nprint(subprocess.Popen(['sleep', '1000'], start_new_session=True).pid)"


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])


def detached_children(server, kernel_pid: int) -> list[int]:
    """A double-forked daemon and a child in its own session, both still below the kernel's launcher."""
    pids = [int(run(server, DAEMON_CELL).body[0]), int(run(server, SESSION_CHILD).body[0])]
    if isinstance(server, StdioServer):
        server.tracked_pids |= set(pids)
    launcher = parent_of(kernel_pid)
    assert all(pid_alive(pid) for pid in pids)
    assert parent_of(pids[0]) == launcher  # adopted by the subreaper, not by init
    return pids


def kernel_dirs(tmp: Path) -> list[Path]:
    """The kernels' private directories in ``tmp`` (not the server's output directory, swept by the next
    start when a SIGKILL left it)."""
    return sorted(p for p in tmp.glob("loommux-*") if not p.name.startswith(loommux.OUTPUT_DIR_PREFIX))


HIDE_MODULES = "import sys\nfor name in {names!r}:\n    sys.modules[name] = None\n"  # a sitecustomize.py


def hiding(tmp_path: Path, *names: str) -> dict[str, str]:
    """An environment whose Python cannot import the named modules (a sitecustomize sets them to None)."""
    folder = tmp_path / ("hide-" + "-".join(names))
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(HIDE_MODULES.format(names=names))
    return server_env(PYTHONPATH=str(folder))


SERVED = ["2026-07-28", "2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05"]


def handle_of(text: str) -> str:
    m = re.match(r'Kernel (~[A-Za-z0-9-]+\.[A-Za-z0-9_-]{22,}): pass kernel="\1" to keep working in this '
                 r'kernel\.', text)
    assert m, text[:300]
    return m[1]


TASKS_EXT = "io.modelcontextprotocol/tasks"
TASK_META = {**ENVELOPE, "io.modelcontextprotocol/clientCapabilities": {"extensions": {TASKS_EXT: {}}}}
TASK_ID_RE = re.compile(r"[A-Za-z0-9-]{1,32}\.[A-Za-z0-9_-]{22,}")  # the instance, then 128+ random bits
ISO_RE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z")


SLEEPER = "%%loommux --wait 0.2\nimport time\ntime.sleep({seconds})\nprint('slept {seconds}')"
ELICIT_CAPS = {"elicitation": {}}


def tasked(params: dict | None = None) -> dict:
    """2026-07-28 params whose client declares the tasks extension."""
    return {**(params or {}), "_meta": TASK_META}


def run_params(code: str, **args) -> dict:
    return {"name": "run_cell", "arguments": {"freeform": code, **args}}


def check_task_shape(task: dict, era: str = "modern") -> None:
    assert TASK_ID_RE.fullmatch(task["taskId"]) and not task["taskId"].isdigit(), task
    assert ISO_RE.fullmatch(task["createdAt"]) and ISO_RE.fullmatch(task["lastUpdatedAt"]), task
    ttl, poll = ("ttlMs", "pollIntervalMs") if era == "modern" else ("ttl", "pollInterval")
    assert task[ttl] is None if task["status"] in ("working", "input_required") else task[ttl] > 0, task
    assert isinstance(task[poll], int) and task[poll] > 0, task
    assert isinstance(task["statusMessage"], str) and task["statusMessage"], task


def stateless_task(server, code: str, **args) -> dict:
    """run_cell over stdio by a client that declares the tasks extension; the CreateTaskResult it must get."""
    result = server.result("tools/call", tasked(run_params(code, **args)))
    assert result["resultType"] == "task", result
    check_task_shape(result)
    return result


def task_get(server, task_id: str) -> dict:
    return server.result("tasks/get", tasked({"taskId": task_id}))


def until_task(server, task_id: str, statuses=("completed", "failed", "cancelled"),
               timeout: float = 60.0) -> dict:
    """Poll tasks/get (at the interval it asks for) until the task is in one of the statuses."""
    deadline = time.monotonic() + timeout
    while (task := task_get(server, task_id))["status"] not in statuses:
        assert time.monotonic() < deadline, task
        time.sleep(task["pollIntervalMs"] / 1000)
    return task


def elicitation_session(spawn, version: str = LATEST, capabilities: dict | None = None) -> StdioServer:
    """A fresh stdio server whose handshake client declared form elicitation."""
    server = spawn(initialize=False)
    server.init_result = server.result("initialize", {"protocolVersion": version,
                                                      "capabilities": ELICIT_CAPS if capabilities is None
                                                      else capabilities,
                                                      "clientInfo": {"name": "asker", "version": "0"}})
    server.notify("notifications/initialized")
    return server


def next_elicitation(server, since: int, timeout: float = 60.0) -> dict:
    return server.wait_for(lambda m: m.get("method") == "elicitation/create", timeout, since)


def answer(server, request: dict, result: dict) -> None:
    server.send({"jsonrpc": "2.0", "id": request["id"], "result": result})


def server_rss(server: StdioServer) -> int:
    status = Path(f"/proc/{server.proc.pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)[1]) * 1024


GATEWAY_TOKEN = "gateway-secret"
GATEWAY_STATUS_RE = re.compile(r"^kernel: gateway (\S+) · id (\S+) · (\w+)$", re.MULTILINE)
TINY_PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGP8z8DAwMDAxMDAwMDAAAANHQEDasKb6Q"
            "AAAABJRU5ErkJggg==")
needs_gateway = pytest.mark.skipif(importlib.util.find_spec("kernel_gateway") is None,
                                   reason="jupyter_kernel_gateway (a test dependency) is not installed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class KernelGateway:
    """A real Jupyter Kernel Gateway on 127.0.0.1 with a token (over https when given a certificate and its
    key); `kernels()` lists what runs on it."""

    def __init__(self, log_path: Path, *options: str, tls: tuple[Path, Path] | None = None):
        self.log_path = log_path
        self.tls = tls
        if tls:
            options = (*options, f"--KernelGatewayApp.certfile={tls[0]}",
                       f"--KernelGatewayApp.keyfile={tls[1]}")
        for _ in range(5):  # the port is picked before the gateway binds it: retry if another process took it
            self.port = free_port()
            with open(log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "kernel_gateway", "--KernelGatewayApp.ip=127.0.0.1",
                     f"--KernelGatewayApp.port={self.port}", "--KernelGatewayApp.port_retries=0",
                     f"--KernelGatewayApp.auth_token={GATEWAY_TOKEN}",
                     "--JupyterWebsocketPersonality.list_kernels=True", *options],
                    env=server_env(), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    start_new_session=True,
                )
            if (wait_until(lambda: self.proc.poll() is not None or self.answers(), 60, 0.1)
                    and self.proc.poll() is None):
                return
        raise AssertionError(f"the gateway did not start:\n{self.log()[-3000:]}")

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def api(self, method: str, path: str) -> HttpResponse:
        if self.tls:
            context = ssl.create_default_context(cafile=str(self.tls[0]))
            conn = http.client.HTTPSConnection("127.0.0.1", self.port, timeout=30, context=context)
        else:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            conn.request(method, path, headers={"Authorization": f"token {GATEWAY_TOKEN}"})
            answer = conn.getresponse()
            return HttpResponse(answer.status, {k.lower(): v for k, v in answer.getheaders()}, answer.read())
        finally:
            conn.close()

    def answers(self) -> bool:
        try:
            return self.api("GET", "/api").status == 200
        except (OSError, http.client.HTTPException):
            return False

    def kernels(self) -> set[str]:
        # the gateway answers 500 while it lists a kernel it has not finished starting (no last_activity yet)
        for _ in range(50):
            response = self.api("GET", "/api/kernels")
            if response.status != 500 or b"last_activity" not in response.body:
                break
            time.sleep(0.1)
        assert response.status == 200, response
        return {k["id"] for k in response.json()}

    def none_left(self, timeout: float = 15.0) -> bool:
        return wait_until(lambda: not self.kernels(), timeout, 0.2)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    """The gateway of this section, with IOPub rate limiting off as the README tells operators to set it."""
    gw = KernelGateway(tmp_path_factory.mktemp("gateway") / "gateway.log",
                       "--ZMQChannelsWebsocketConnection.limit_rate=False")
    try:
        yield gw
    finally:
        gw.stop()


def gateway_kernel(session) -> tuple[str, str, str]:
    """host, kernel id and state from a status result."""
    m = GATEWAY_STATUS_RE.search(session.call("status")[0])
    assert m, session.call("status")[0]
    return m[1], m[2], m[3]


def text_of(value) -> str:
    return "".join(value) if isinstance(value, list) else value


# Kernels a person started (jupyter_client's KernelManager, as `jupyter kernel` and JupyterLab do), joined
# with --existing; cells other Jupyter clients run; kernels of other languages from installed kernelspecs.

BASH_SPEC = {"argv": [sys.executable, "-m", "bash_kernel", "-f", "{connection_file}"], "display_name": "Bash",
             "language": "bash", "env": {"PS1": "$"}}
IR_SPEC = {"argv": ["R", "--slave", "-e", "IRkernel::main()", "--args", "{connection_file}"],
           "display_name": "R",
           "language": "R"}


def write_spec(base: Path, name: str, spec: dict) -> None:
    (base / "kernels" / name).mkdir(parents=True, exist_ok=True)
    (base / "kernels" / name / "kernel.json").write_text(json.dumps(spec))


@pytest.fixture(scope="session")
def jupyter_path(tmp_path_factory) -> Path:
    """A Jupyter path with the kernelspecs the tests start: bash_kernel, IRkernel, one whose argv fails and
    one that never answers."""
    base = tmp_path_factory.mktemp("jupyter")
    write_spec(base, "bash", BASH_SPEC)
    write_spec(base, "ir", IR_SPEC)
    write_spec(base, "broken", {"argv": [str(base / "no-such-kernel"), "{connection_file}"],
                                "language": "none"})
    write_spec(base, "mute", {"argv": [sys.executable, "-c", "import time; time.sleep(600)",
                                       "{connection_file}"],
                              "language": "none"})
    return base


def kernel_env(jupyter_path: Path, **extra: str) -> dict[str, str]:
    return {"JUPYTER_PATH": str(jupyter_path), "JUPYTER_RUNTIME_DIR": str(jupyter_path / "runtime"), **extra}


def finished_execution(number: int, *messages: tuple[str, dict]) -> loommux.Execution:
    """An execution fed IOPub messages as a kernel would send them, then finished."""
    execution = loommux.Execution(number, "source", loommux.CellOptions(), kernel_pid=None)
    for msg_type, content in messages:
        execution.ingest(msg_type, content)
    execution.finish()
    return execution


# ---------------------------------------------------------------- Text & logs


@pytest.mark.fast
@pytest.mark.parametrize("writes, text, committed, open_line", [
    (["a\nb"], "a\nb", 1, "b"),
    (["a\n", "b\n"], "a\nb", 2, ""),
    (["par", "tial", "\n"], "partial", 1, ""),
    (["12345\r67"], "67", 0, "67"),  # a carriage return rewrites the open line
    (["progress 1\rprogress 2\rdone\n"], "done", 1, ""),
    (["abc\rde\n"], "de", 1, ""),  # the whole line, not only its first characters
    (["x\r", "\nY"], "x\nY", 1, "Y"),  # "\r" at a write's end waits to see whether "\n" follows
    (["x\r", "z"], "z", 0, "z"),
    (["a\r\r\nb"], "a\nb", 1, "b"),  # \r+\n is a newline
    (["a\nb\r"], "a\nb", 1, "b"),
    (["\x1b[31mred\x1b[0m\n"], "red", 1, ""),
    (["\x1b[3", "1mred\x1b[0m\n"], "red", 1, ""),  # an escape split across two messages
    (["\x1b]0;title\x07ok\n"], "ok", 1, ""),  # OSC
    (["\x1bP1$r\x1b\\dcs\n"], "dcs", 1, ""),  # DCS
    (["a\x00b\x07c\n"], "abc", 1, ""),
    (["half\x1b["], "half", 0, "half"),  # held until the next write
    (["é€😀\n"], "é€😀", 1, ""),
])
def test_log_writes(writes, text, committed, open_line):
    log = log_of(*writes)
    assert ((log.text(), log.line_count - (1 if log.open_line else 0), log.open_line)
            == (text, committed, open_line))
    stored = text if open_line or not text else text + "\n"  # committed lines keep their newline
    assert (log.chars, log.utf8_bytes) == (len(stored), len(stored.encode()))


@pytest.mark.fast
def test_log_committed_lines_never_change_and_the_open_line_does():
    log = log_of("done\nwork 10%")
    assert log.lines(0, 1) == "done" and log.open_line == "work 10%" and log.line_count == 2
    log.write("\rwork 90%")
    assert log.text() == "done\nwork 90%" and log.line_count == 2
    log.write("\r\x1b[2Kall done\n")
    assert log.text() == "done\nall done" and log.open_line == "" and log.line_count == 2
    log.write("\rnext")  # a carriage return after "\n" starts on the new line
    assert log.text() == "done\nall done\nnext" and log.tail(2) == ["all done", "next"]


@pytest.mark.fast
def test_log_unfinished_escape_is_text_at_flush_and_blocks_end_lines():
    log = log_of("half\x1b[")
    log.flush()
    assert log.text() == "half["  # the lone ESC goes, the rest is kept
    log.write_block("Out[1]: 3")
    assert log.text() == "half[\nOut[1]: 3" and log.line_count == 2 and log.open_line == ""
    log.write_block("tb\n")
    assert log.text() == "half[\nOut[1]: 3\ntb" and log.line_count == 3


@pytest.mark.fast
def test_log_utf8_sizes():
    log = log_of("aé\n", "€", "😀")
    assert (log.chars, log.utf8_bytes) == (5, 1 + 2 + 1 + 3 + 4)
    assert loommux.utf8_len("\ud800") == 3  # a lone surrogate, as JSON may carry it
    assert loommux.utf8_len("x" * 200_000 + "é") == 200_002


@pytest.mark.fast
def test_log_reads_across_pieces_and_line_marks():
    lines = [f"{i}:" + "x" * (i * 7919 % 97) for i in range(1, 60_001)]
    text = "\n".join(lines) + "\n"
    log, at, step = loommux.Log(), 0, 1
    while at < len(text):  # writes of every size, from 1 character to several pieces
        log.write(text[at : at + step])
        at, step = at + step, step * 3 % 200_003 + 1
    assert log.line_count == 60_000 and log.chars == len(text) and log.open_line == ""
    for first, stop in [(0, 1), (31, 33), (32, 64), (999, 1_003), (12_345, 23_456), (59_990, 60_000),
                        (0, 60_000)]:
        assert log.lines(first, stop) == "\n".join(lines[first:stop]), (first, stop)
    assert log.tail(3) == lines[-3:] and log.tail(0) == []
    frozen, copy = log.frozen(), log.copy()
    log.write("later\nopen")
    assert frozen.line_count == copy.line_count == 60_000 and log.line_count == 60_002
    copy.write("own\n")
    assert copy.lines(60_000, 60_001) == "own" and log.lines(60_000, 60_002) == "later\nopen"


@pytest.mark.fast
@pytest.mark.parametrize("spec, resolved", [
    (None, (0, 100)), ("", (0, 100)), (" ", (0, 100)), (":", (0, 100)),
    ("1:40", (0, 40)), ("-40:", (60, 100)), (":10", (0, 10)), ("3:3", (2, 3)), ("3", (2, 3)),
    ("-1", (99, 100)),
    (" 2 : 5 ", (1, 5)), ("+2:+3", (1, 3)), ("-3:-2", (97, 99)), ("3:-5", (2, 96)),
    ("95:200", (94, 100)), ("-200:5", (0, 5)),  # clipped to the lines there are
    ("200:300", (199, 199)), ("-5:3", (95, 95)),  # nothing there: empty
])
def test_line_ranges(spec, resolved):
    assert loommux.parse_line_range(spec, 100) == resolved


@pytest.mark.fast
@pytest.mark.parametrize("spec, message", [
    ("abc", f'"abc" {NOT_A_RANGE}'), ("1:2:3", f'"1:2:3" {NOT_A_RANGE}'), ("x:5", f'"x:5" {NOT_A_RANGE}'),
    ("1.5:3", f'"1.5:3" {NOT_A_RANGE}'), ("1-5", f'"1-5" {NOT_A_RANGE}'),
    ("1" * 19, f'"{"1" * 19}" {NOT_A_RANGE}'),  # at most 18 digits
    ("a" * 100, f'"{"a" * 40}… [+60 chars]" {NOT_A_RANGE}'),
    ("0", "line numbers start at 1 (use -1 for the last line)"),
    ("0:5", "line numbers start at 1 (use -1 for the last line)"),
    ("5:0", "line numbers start at 1 (use -1 for the last line)"),
    ("5:3", "start 5 comes after stop 3"), ("-2:-3", "start -2 comes after stop -3"),
], ids=clipped())
def test_bad_line_ranges(spec, message):
    with pytest.raises(ValueError) as raised:
        loommux.parse_line_range(spec, 100)
    assert str(raised.value) == message


@pytest.mark.fast
@pytest.mark.parametrize("query, mode, ignore_case, used, linear", [
    ("a(b", "auto", False, "literal (auto)", True),
    (r"err\d+", "auto", False, "regex (auto)", True),  # a scan at the end is consumed by the match
    (r"err\d+", "literal", False, "literal", True),
    ("x", "literal", True, "literal", True),  # a short ignore_case string: a few steps per position
    (r"^line 1\d{4}", "regex", False, "regex", True),
    (r"^a[0-9]{1,300}b", "regex", False, "regex", True),  # one scan after an anchor, its class never "\n"
    ("^a+b+", "regex", False, "regex", False),  # two scans
    ("(a+)+b", "regex", False, "regex", False),  # a repeat inside a repeat
    ("^x|y", "regex", False, "regex", True),  # a few steps per attempt
    ("(" * 1000 + "a" + ")" * 1000, "auto", False, "literal (auto)", True),
], ids=["unbalanced-auto", "digits-auto", "digits-literal", "ignore-case", "anchored-scan", "anchored-class",
        "two-scans", "nested-repeat", "alternation", "deep-parens-auto"])
def test_query_modes_and_which_searches_run_in_a_thread(query, mode, ignore_case, used, linear):
    compiled = loommux.compile_query(query, mode, ignore_case)
    assert (compiled.mode, compiled.linear) == (used, linear)


@pytest.mark.fast
@pytest.mark.parametrize("query, mode, message", [
    ("a(b", "regex", "the regex does not compile: missing ), unterminated subpattern at position 1"),
    ("a{99999999999}", "regex", "the regex does not compile: the repetition number is too large"),
    ("(" * 1000 + ")" * 1000, "regex", "the regex does not compile: it is nested too deeply"),
    ("x*", "auto", "the pattern matches the empty string, so it would match every position"),
    ("", "literal", "the pattern matches the empty string, so it would match every position"),
], ids=clipped(16))
def test_queries_that_do_not_compile(query, mode, message):
    with pytest.raises(ValueError) as raised:
        loommux.compile_query(query, mode, False)
    assert str(raised.value) == message


def test_progress_bar_and_escape_codes_end_as_final_state(srv):
    code = r'''
import sys, time
for i in range(0, 101, 10):
    sys.stdout.write(f"\r\x1b[32m{i:3d}%\x1b[0m |{'#' * (i // 10):<10}|")
    sys.stdout.flush()
    time.sleep(0.02)
sys.stdout.write("\n\x1b]0;window title\x07done-line\n")
sys.stdout.flush()
time.sleep(0.3)
sys.stdout.write("\rzz\x1b[3")
sys.stdout.flush()
time.sleep(0.3)
sys.stdout.write("1mred\x1b[0m text\r\n")
sys.stdout.flush()
sys.stderr.write("\r 50%\r100% stderr-bar\n");
'''
    cell = run(srv, code)
    stdout = ["100% |##########|", "done-line", "zzred text"]
    assert cell.body == [*stdout, "100% stderr-bar"]
    assert "\x1b" not in cell.text and "\r" not in cell.text
    assert read(srv, execution=cell.n, stream="stdout")[1] == stdout
    assert read(srv, execution=cell.n, stream="stderr")[1] == ["100% stderr-bar"]


O200K_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"


def test_without_the_tokenizer_counts_are_estimates_said_once(spawn, tmp_path):
    """An o200k_base that cannot be loaded (offline, a host's reduced environment) never fails a call: the
    decision counts every UTF-8 byte as a token, and the first result that used that says so in one line."""
    broken = tmp_path / "broken-tiktoken"
    (broken / hashlib.sha1(O200K_URL.encode()).hexdigest()).mkdir(parents=True)  # unreadable cache entry
    s = spawn(TIKTOKEN_CACHE_DIR=str(broken))
    assert run(s, "print('small')").body == ["small"]  # small outputs never need the tokenizer
    # about 1,100 tokens in 5,500 bytes: over the limit by the estimate, so its output is left out
    text, is_error, _ = s.call("run_cell", {"freeform": "print('word ' * 1100)"})
    assert not is_error and "over the 5,000-token limit" in text.split("\n")[1], text
    notices = [line for line in text.split("\n") if "token counts are estimates" in line]
    assert len(notices) == 1 and "TIKTOKEN_CACHE_DIR" in notices[0] and "env" in notices[0], text
    header, lines = read(s, execution=2)  # the output itself is kept
    assert lines == ["word " * 1100]
    again, is_error, _ = s.call("run_cell", {"freeform": "print('more ' * 1100)"})
    assert not is_error and "token counts are estimates" not in again + header + "\n".join(lines), again


def test_an_escape_sequence_that_never_ends_loses_no_output(srv):
    done = run(srv, r"print('\x1b]0;title'); print('result: 42'); print('\x1bPq'); print('after')")
    assert "result: 42" in done.text and "after" in done.text


# (pattern, ignore_case, whether a search for it takes time linear in the text: run in a thread)
SEARCH_LINEARITY = [
    (r"line \d{3}00000 ", False, True), ("error|warning", False, True), (r"\bfoo\w*", False, True),
    ("Traceback", False, True), ("Traceback", True, True), ("x" * 5000, False, True),  # strings
    (r'^[ \t]*File "', False, True), (r"^.*error", False, True), (r"^line \d{0,256}$", False, True),
    (r"took \d+ ms", False, True), (r"foo\s+bar", False, True), (r'^"[^"]*"', False, True),
    (r"err\d+", False, True), (r"ERROR: .*", False, True), (r"x=\d+.*", False, True), (r"\w+", False, True),
    (r"\b(ERROR|WARN|FATAL)\b", False, True), (r"(?i)traceback", False, True), (r"^a{30}$", False, True),
    (r"\d{1,3}-\d{1,3}", False, True), (r"^(?:foo|bar)\d*$", False, True), (r"(?=\d{3})\d", False, True),
    (r"(?s)foo.*", False, True), (r"key (?i:k)\d+", False, True),
    # exponential: nested repeats, a repeat over alternatives that match the same text
    (r"(a+)+b", False, False), (r"(x+x+)+y", False, False), (r"^(\d+)+$", False, False),
    (r"(a|a)*b", False, False), (r"(a|ab)*c", False, False), (r"(a|a){0,30}b", False, False),
    (r"(?:ab)+c", False, False), (r"(foo.*|bar)baz", False, False),
    # quadratic: adjacent repeats that overlap; a scan that attempts pile into
    (r"\d+\d+", False, False), (r".*.*=", False, False), (r".*=.*", False, False), (r"a.*b\w*", False, False),
    (r"\d+x", False, False), (r"\w+Error", False, False), (r"error.*timeout", False, False),
    (r'\s*File "', False, False), (r'^\s*File "', False, False), (r"(?s)^.*foo", False, False),
    (r"(?i)k\w*\d", False, False), ("a" * 300, True, False),  # ignore_case compares it at every position
    # backreferences, conditional groups, lookarounds holding a repeat
    (r"(\w+)\s\1", False, False), (r"(a)?(?(1)b|c)", False, False), (r"(?=.*a)b", False, False),
    (r"(?=\w+x)", False, False), (r"(?<=a)bc(?!d*e)", False, False),
]


@pytest.mark.fast
@pytest.mark.parametrize(("pattern", "ignore_case", "linear"), SEARCH_LINEARITY, ids=clipped(12))
def test_only_searches_that_may_not_be_linear_are_forked(pattern, ignore_case, linear):
    sys.path.insert(0, str(ROOT))
    import loommux

    assert loommux.compile_query(pattern, "regex", ignore_case).linear is linear


# ---------------------------------------------------------------- Error codes


@pytest.mark.fast
def test_one_table_of_error_codes():
    """Every error code the file raises (tools, /api, the in-kernel client, the domain errors) is in
    ERROR_CODES, which gives each an HTTP status and a meaning; README lists them all."""
    import ast

    import loommux

    def value(node):
        return (node.value if isinstance(node, ast.Constant)
                else getattr(loommux, getattr(node, "id", ""), None))

    raised = set()
    for node in ast.walk(ast.parse(LOOMMUX.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call)
                and getattr(node.func, "id", None) in ("ToolError", "DaemonError", "ApiError")):
            raised.add(value(node.args[1 if node.func.id == "ApiError" else 0]))
        elif (isinstance(node, ast.ClassDef)
              and any(getattr(b, "id", "") == "ResourceError" for b in node.bases)):
            raised.update(value(s.value) for s in node.body if isinstance(s, ast.Assign))
    raised.update(loommux.VALUE_ERROR_CODES.values())
    raised.discard(None)  # a code passed on in a variable
    assert {"busy", "kernel_not_found", "no_control_plane", "invalid_lease_policy", "not_found"} <= raised
    assert raised - set(loommux.ERROR_CODES) == set()
    for status, meaning in loommux.ERROR_CODES.values():
        assert 400 <= status < 600 and meaning
    for kind in (loommux.Busy, loommux.ExecutionNotFound, loommux.KernelUnavailable, loommux.ResourceNotFound,
                 loommux.InvalidResourceName, loommux.KernelNotFound):
        assert kind.code in loommux.ERROR_CODES
    error = loommux.DaemonError(loommux.BUSY, "execution 3 is still running")
    assert (error.code, error.status, str(error)) == ("busy", "busy", "busy: execution 3 is still running")
    assert loommux.ApiError.of(loommux.KernelNotFound("no kernel ~x")).status == 404
    assert loommux.ApiError.of(loommux.ToolError(loommux.INVALID_LINE_RANGE, "bad")).status == 400
    # plain HTTP refusals: named by the table, not by the status's phrase (which Python versions change)
    assert [loommux.name_http_error(status) for status in (401, 413, 418)] == [
        "unauthorized", "payload_too_large", "http_418"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert [code for code in loommux.ERROR_CODES
            if f"| `{code}` | {loommux.status_of_error(code)} |" not in readme] == []


# ---------------------------------------------------------------- Cell input


@pytest.mark.fast
@pytest.mark.parametrize("arguments, wait, full_output, kernel", [
    ("", 10.0, False, None),
    (" --wait 5", 5.0, False, None), (" --wait=0.5", 0.5, False, None), (" --wait .5", 0.5, False, None),
    (" --wait 5.", 5.0, False, None), ("\t--wait\t3", 3.0, False, None),
    ("  --wait   0.2  ", 0.2, False, None),
    (" --full-output", 10.0, True, None),
    (" --kernel lab", 10.0, False, "lab"), (" --kernel=~0123abcd", 10.0, False, "~0123abcd"),
    (" --wait 2 --full-output --kernel a.b-c_d", 2.0, True, "a.b-c_d"),
    (" --full-output --wait=2", 2.0, True, None),
])
def test_header_options(arguments, wait, full_output, kernel):
    options = loommux.parse_header_arguments(arguments)
    assert options == loommux.CellOptions(wait=wait, full_output=full_output, header=True, kernel=kernel)


WAIT_NEEDS = "--wait takes a positive number of seconds, not"
KERNEL_RULE = ("--kernel takes a kernel name (1-64 characters of A-Z, a-z, 0-9, '.', '_' and '-') or a "
               "private id, not")


@pytest.mark.fast
@pytest.mark.parametrize("arguments, message", [
    (" --bogus", 'unknown option "--bogus"'),
    (" stray", 'unknown option "stray"'),
    (" -w 1", 'unknown option "-w"'),
    (" --wait 1 --wait 2", "--wait is given more than once"),
    (" --wait 1 --wait=2", "--wait is given more than once"),
    (" --full-output --full-output", "--full-output is given more than once"),
    (" --kernel a --kernel b", "--kernel is given more than once"),
    (" --full-output=yes", "--full-output takes no value"),
    (" --wait", "--wait needs a value, e.g. --wait 60"),
    (" --kernel", "--kernel needs a value, e.g. --kernel lab"),
    (" --wait=", f'{WAIT_NEEDS} ""'),
    (" --wait --full-output", f'{WAIT_NEEDS} "--full-output"'),
    (" --wait 0", f'{WAIT_NEEDS} "0"'), (" --wait -1", f'{WAIT_NEEDS} "-1"'),
    (" --wait inf", f'{WAIT_NEEDS} "inf"'), (" --wait nan", f'{WAIT_NEEDS} "nan"'),
    (" --wait abc", f'{WAIT_NEEDS} "abc"'), (" --wait 1e3", f'{WAIT_NEEDS} "1e3"'),
    (" --kernel bad!", f'{KERNEL_RULE} "bad!"'), (" --kernel ~xyz", f'{KERNEL_RULE} "~xyz"'),
    (" --kernel " + "a" * 65, f'{KERNEL_RULE} "{"a" * 65}"'),
], ids=clipped())
def test_header_errors(arguments, message):
    with pytest.raises(loommux.CellHeaderError) as raised:
        loommux.parse_header_arguments(arguments)
    assert str(raised.value) == message


@pytest.mark.fast
@pytest.mark.parametrize("first_line, arguments", [
    ("%%loommux", ""), ("%%loommux --wait 1", " --wait 1"), ("%%loommux\t--wait 1", "\t--wait 1"),
    ("%%loommux\r\n", ""), ("%%loommux --wait 1\r", " --wait 1"),
    ("%%loommuxx", None), (" %%loommux", None), ("%%LOOMMUX", None), ("%loommux --wait 1", None),
])
def test_what_is_a_header_line(first_line, arguments):
    assert loommux.extract_header_arguments(first_line) == arguments


@pytest.mark.fast
def test_only_the_first_line_is_the_header():
    assert (loommux.parse_cell_header("%%loommux --wait 3\nprint(1)")
             == loommux.CellOptions(wait=3.0, header=True))
    assert loommux.parse_cell_header("x = 1\n%%loommux --wait 3") == loommux.CellOptions()
    assert loommux.parse_cell_header("print(1)") == loommux.CellOptions()


@pytest.mark.fast
@pytest.mark.parametrize("source, found", [
    ("# loommux: --wait 1\nx = 1", ["--wait 1"]),
    ("\n# a comment first\n#   loommux: --wait=1   --full-output  \nimport time",
     ["--wait=1   --full-output"]),
    ("%%loommux --wait 30\n# loommux: --wait 120\n# loommux: --full-output\n6 * 7",
     ["--wait 120", "--full-output"]),
    ("# an ordinary comment\nprint('plain')", []),
    ("# loommux is great\nprint('plain')", []),
    ("# loommux: notes without options\nprint('plain')", []),
    ("print('plain')\n# loommux: --wait 1", []),  # after the first line of code
    ("x = '''\n# loommux: --wait 1\n'''", []),
], ids=clipped())
def test_legacy_directives(source, found):
    assert loommux.find_legacy_directives(source) == found


@pytest.mark.fast
def test_legacy_directive_notices():
    assert loommux.describe_legacy_directives("print(1)") is None
    assert loommux.describe_legacy_directives("# loommux: --wait 1\n1") == (
        'Notice: "# loommux: --wait 1" is not read; write "%%loommux --wait 1" as the cell\'s first line.')
    assert loommux.describe_legacy_directives("# loommux: --wait 120\n# loommux: --full-output\n1") == (
        'Notice: "# loommux: --wait 120", "# loommux: --full-output" are not read; '
        "write \"%%loommux --wait 120 --full-output\" as the cell's first line.")


def test_header_wait_is_per_cell_and_never_interrupts(srv):
    short = run_cell(srv, "%%loommux --wait 0.2\nimport time\ntime.sleep(1.5)\nprint('slept')")
    assert short.state == "running"
    done = finish(srv, short)
    assert done.state == "completed" and done.body == ["slept"]
    default = run_cell(srv, "import time\ntime.sleep(1.5)\nprint('slept again')")  # default wait is 10 s
    assert default.state == "completed" and default.body == ["slept again"]


@pytest.mark.parametrize("header", [
    "%%loommux --wait=0.2",
    "%%loommux --full-output --wait 0.2",
    "%%loommux --wait=0.2 --full-output",
    "%%loommux   --wait   0.2  ",
])
def test_header_forms(srv, header):
    cell = run_cell(srv, f"{header}\nimport time\ntime.sleep(1)\nprint('ok')")
    assert cell.state == "running", cell.text
    assert finish(srv, cell).body == ["ok"]


@pytest.mark.parametrize("header", ["%%loommux", "%%loommux --full-output", "%%loommux --wait 30"])
def test_header_without_waiting(srv, header):
    assert run_cell(srv, f"{header}\nprint('plain')").body == ["plain"]


BAD_HEADERS = [
    "%%loommux --bogus",
    "%%loommux stray",
    "%%loommux --wait 1 --wait 2",
    "%%loommux --wait 1 --wait=2",
    "%%loommux --full-output --full-output",
    "%%loommux --wait",
    "%%loommux --wait=",
    "%%loommux --wait --full-output",
    "%%loommux --wait 0",
    "%%loommux --wait=0",
    "%%loommux --wait -1",
    "%%loommux --wait inf",
    "%%loommux --wait nan",
    "%%loommux --wait abc",
]


def test_malformed_headers_use_no_execution_number(srv):
    before = run(srv, "header_side_effect = False")
    for header in BAD_HEADERS:
        text, is_error, _ = srv.call("run_cell", {"freeform": f"{header}\nheader_side_effect = True"})
        assert is_error and text.startswith("invalid_cell_header:"), (header, text)
    after = run(srv, "header_side_effect")
    assert after.n == before.n + 1
    assert after.body == [f"Out[{after.n}]: False"]


def test_header_then_another_cell_magic(srv):
    cell = run(srv, "%%loommux --wait 5\n%%bash\necho from-bash")
    assert cell.state == "completed" and cell.body == ["from-bash"]


def test_header_on_a_later_line_is_a_usage_error(srv):
    cell = run(srv, "x_later = 1\n%%loommux --wait 1\nprint('after')")
    assert "UsageError" in cell.text
    assert re.search(r"first line", cell.text, re.IGNORECASE), cell.text


def test_header_kept_in_history(srv):
    run(srv, "%%loommux --wait 5\nhist_marker = 1")
    cell = run(srv, "print(repr(In[-2]))")
    assert "loommux" in cell.text and "--wait 5" in cell.text and "hist_marker" in cell.text


def test_full_output_header_lasts_one_cell(srv):
    full = run(srv, f"%%loommux --full-output\n{TWENTY_K}")
    assert full.body == [f"line {i}" for i in range(1, 20_001)]
    again = run(srv, TWENTY_K)
    assert "output omitted" in again.text


def test_kernel_header_is_checked_before_anything_runs(srv):
    for header in ["%%loommux --kernel", "%%loommux --kernel 'bad name'", "%%loommux --kernel a/b",
                   "%%loommux --kernel a --kernel b",
                   "%%loommux --kernel ..", "%%loommux --kernel ."]:  # names of directories: never a name
        text = tool_error(srv, "run_cell", {"code": f"{header}\nprint(1)"}, "invalid_cell_header")
        assert "--kernel" in text


@pytest.mark.parametrize("directive", ["--wait 1", "--full-output", "--wait=1   --full-output"])
def test_legacy_directive_is_not_read_and_gets_one_notice(srv, directive):
    # "--wait 1", if read, would answer before the cell's 1.5 s: the cell runs as written instead
    cell = run_cell(srv, f"\n# a comment first\n#   loommux: {directive}  \nimport time\ntime.sleep(1.5)\n"
                         "print('ran')")
    assert cell.state == "completed"  # in one call
    notice = (f'Notice: "# loommux: {directive}" is not read; write "%%loommux {directive}" '
              "as the cell's first line.")
    assert cell.text.endswith("\nran\n\n" + notice), cell.text


@pytest.mark.parametrize("code", [
    "# an ordinary comment\nprint('plain')",
    "# loommux is great\nprint('plain')",
    "# loommux: notes without options\nprint('plain')",
    "%%loommux --wait 5\nprint('plain')",
    "print('plain')\n# loommux: --wait 1",  # after the first line of code: not a leading line
    "x_directive = '''\n# loommux: --wait 1\n'''\nprint('plain')",
], ids=clipped())
def test_no_directive_notice(srv, code):
    cell = run(srv, code)
    assert cell.body == ["plain"] and "Notice:" not in cell.text, cell.text


def test_directives_are_named_together_and_in_structured_notices(spawn):
    s = spawn(LOOMMUX_RESULT_MODE="structured")
    result = s.result("tools/call", {"name": "run_cell", "arguments": {
        "freeform": "%%loommux --wait 30\n# loommux: --wait 120\n# loommux: --full-output\n6 * 7"}})
    notice = ('Notice: "# loommux: --wait 120", "# loommux: --full-output" are not read; '
              "write \"%%loommux --wait 120 --full-output\" as the cell's first line.")
    assert result["content"][-1]["text"].endswith("Out[1]: 42\n\n" + notice)
    assert result["structuredContent"]["notices"] == [notice]
    assert result["structuredContent"]["state"] == "completed"


# ---------------------------------------------------------------- Published functions

PUBLISH_CELL = '''\
from typing import Literal
def forecast(city: str, days: int = 2, unit: Literal["C", "F"] = "C") -> dict:
    """The forecast of a city."""
    print("forecasting", city)
    return {"city": city, "highs": [20 + day for day in range(days)], "unit": unit}
def divide(a: float, b: float) -> float:
    return a / b
loommux.publish(forecast), loommux.publish(divide, description="Divide a by b.")
'''



@pytest.mark.fast
def test_published_input_schemas_come_from_annotations_and_defaults():
    namespace: dict = {}
    cell = ("from typing import Literal, Optional\n"
            "def report(city: str, days: int, scale: float = 1.5, /, *, loud: bool = False,\n"
            "           note: None = None, tags: list[str] | None = None, weights: dict[str, float] = {},\n"
            "           unit: Literal['C', 'F'] = 'C', rows: Optional[list[list[int]]] = None,\n"
            "           raw: dict = {}) -> dict: ...")
    exec(cell, namespace)  # noqa: S102 - as in a kernel: the annotations name what the cell imported
    schema, positional = loommux.make_input_schema(namespace["report"], "report")
    assert positional == ["city", "days", "scale"] and schema["required"] == ["city", "days"]
    assert schema["properties"] == {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "scale": {"type": "number", "default": 1.5},
        "loud": {"type": "boolean", "default": False}, "note": {"type": "null", "default": None},
        "tags": {"anyOf": [{"type": "array", "items": {"type": "string"}}, {"type": "null"}],
                 "default": None},
        "weights": {"type": "object", "additionalProperties": {"type": "number"}, "default": {}},
        "unit": {"enum": ["C", "F"], "default": "C"},
        "rows": {"anyOf": [{"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
                           {"type": "null"}], "default": None},
        "raw": {"type": "object", "default": {}}}
    assert loommux.make_input_schema(lambda: 1, "f") == ({"type": "object", "properties": {}}, [])


@pytest.mark.fast
@pytest.mark.parametrize(("source", "said"), [
    ("def f(x): pass", "parameter 'x' of f has no annotation"),
    ("def f(a: int, x: set): pass", "parameter 'x' of f: set is not supported"),
    ("def f(x: dict[int, str]): pass", "parameter 'x' of f: dict[int, str] is not supported"),
    ("def f(x: list[object]): pass", "parameter 'x' of f: list[object] is not supported"),
    ("def f(x: Undefined): pass", "cannot read the signature of f"),  # (the test file's annotations are lazy)
    ("def f(*x: int): pass", "parameter 'x' of f: *args and **kwargs"),
    ("def f(kernel: str): pass", "parameter 'kernel' of f: every loommux tool takes 'kernel'"),
], ids=["no-annotation", "set", "dict-of-int-keys", "list-of-object", "undefined-annotation", "star-args",
        "kernel-parameter"])
def test_publish_refuses_what_a_schema_cannot_say_naming_the_parameter(source, said):
    namespace: dict = {}
    exec(source, namespace)  # noqa: S102 - a cell's definition
    with pytest.raises(loommux.PublishError) as refused:
        loommux.PublishedFunctions().publish(namespace["f"], None, None)
    assert str(refused.value).startswith(said), refused.value


@pytest.mark.fast
def test_publish_names_descriptions_calls_and_withdrawals():
    published = loommux.PublishedFunctions()

    def add(a: int, b: int = 2, /) -> int:
        """Add two integers."""
        return a + b

    for name, said in ((None, None), ("run_cell", "'run_cell' is a loommux tool"),
                       ("has space", "'has space' is not a valid tool name")):
        if said is None:
            assert published.publish(add, name, None) == "add"
            continue
        with pytest.raises(loommux.PublishError, match=said):
            published.publish(add, name, None)
    with pytest.raises(loommux.PublishError, match="'<lambda>' is not a valid tool name"):
        published.publish(lambda: 1, None, None)
    assert published.publish(lambda: [1], "listing", "Lists.") == "listing"
    assert published.tools["add"]["description"] == "Add two integers." and published.version == 2
    assert published.tools["listing"]["description"] == "Lists."
    result = published.call("add", {"a": 40})  # a positional-only parameter, passed by position
    assert result.value == 42 and result._repr_mimebundle_() == {
        loommux.CALL_RESULT_MIME: {"value": 42}, "text/plain": "42"}
    published.publish(lambda: {1, 2}, "odd", None)
    with pytest.raises(TypeError, match="odd returned a set, which is not JSON-compatible"):
        published.call("odd", {})
    with pytest.raises(LookupError, match="no function is published as 'gone'"):
        published.call("gone", {})
    assert published.unpublish("odd") and not published.unpublish("odd")
    assert published.forget("add", object()) == ["add"] and list(published.tools) == ["listing"]
    snapshot = published.snapshot()
    assert snapshot["version"] == 5 and [tool["name"] for tool in snapshot["tools"]] == ["listing"]
    record = loommux.PublishedRecord()
    assert record.take(snapshot) and not record.take(snapshot) and list(record.tools) == ["listing"]
    loommux_own = {"name": "wait", "description": "", "inputSchema": {"type": "object", "properties": {}}}
    assert record.take({"version": 9, "tools": ["junk", loommux_own]}) and record.tools == {}


@pytest.mark.fast
def test_publishing_is_capped_and_its_announcements_coalesced(monkeypatch):
    published, sent = loommux.PublishedFunctions(), []
    monkeypatch.setattr(published, "send", lambda: sent.append(published.version))
    for i in range(loommux.MAX_PUBLISHED_TOOLS):
        published.publish(lambda: 0, f"tool{i}", "A tool.")
    assert sent == [1]  # at once, then the rest waits for the interval or the cell's end
    published.flush()
    assert sent == [1, 100] and (published.flush() or sent == [1, 100])  # nothing pending
    with pytest.raises(loommux.PublishError, match="this kernel publishes 100 tools, the most a kernel may"):
        published.publish(lambda: 0, "one_more", None)
    assert published.publish(lambda: 0, "tool0", "Replaced.") == "tool0"  # a name again: no new tool
    namespace: dict = {}
    exec("from typing import Literal\n"  # noqa: S102 - a cell's definition
         f"def pick(choice: Literal[{', '.join(map(repr, range(1000)))}]): ...", namespace)
    published.unpublish("tool1")
    with pytest.raises(loommux.PublishError, match="the input schema of pick is 4,970 characters of JSON, "
                                                   "over the 4,000 a tool may have"):
        published.publish(namespace["pick"], None, "Pick one.")


@pytest.mark.fast
def test_a_throttle_fires_at_once_then_once_an_interval():
    async def poke_thrice() -> list[float]:
        fired: list[float] = []
        throttle = loommux.Throttle(0.05, lambda: fired.append(time.monotonic()))
        for _ in range(3):
            throttle.poke()
        assert len(fired) == 1
        while len(fired) < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)
        return fired

    assert len(asyncio.run(poke_thrice())) == 2  # the two later pokes were one call


@pytest.mark.fast
def test_loommux_tool_names_known_to_kernels_are_the_tools():
    assert set(loommux.RESERVED_TOOL_NAMES) == set(loommux.TOOLS) | set(loommux.APP_TOOLS)


# ---------------------------------------------------------------- Namespace


class Holder:
    """A user object whose property counts its runs and whose repr sleeps or raises on demand."""

    def __init__(self, repr_sleep: float = 0.0, repr_error: bool = False) -> None:
        self.runs, self.repr_sleep, self.repr_error = 0, repr_sleep, repr_error

    @property
    def shape(self):
        self.runs += 1
        return (1, 2)

    @property
    def broken(self):
        raise RuntimeError("broken")

    def __len__(self) -> int:
        return 3

    def __repr__(self) -> str:
        if self.repr_error:
            raise ValueError("no repr")
        time.sleep(self.repr_sleep)
        return "<holder>"


def namespace_shell(**user) -> Any:
    """A stand-in for an IPython shell: its user namespace, the bindings it hides and its output cache."""
    from types import SimpleNamespace

    hidden = {"In": [], "Out": {}, "exit": object()}
    return SimpleNamespace(user_ns={**hidden, "_": 1, "_i1": "x", "loommux": object(), **user},
                           user_ns_hidden=dict(hidden), history_manager=SimpleNamespace(output_hist={}),
                           displayhook=SimpleNamespace(_=None, __=None, ___=None))


@pytest.mark.fast
def test_namespace_lists_user_names_only_with_kinds_sizes_and_short_values():
    import json as json_module

    holder = Holder()
    shell = namespace_shell(alpha=[1, 2, 3], Beta=Holder, data=b"abc", json=json_module, long="x" * 500,
                            f=lambda x, y=1: x, holder=holder, In=5)  # In rebound: the user's now
    answer = loommux.list_namespace(shell, None, 100)
    rows = {row["name"]: row for row in answer["names"]}
    assert [row["name"] for row in answer["names"]] == ["alpha", "Beta", "data", "f", "holder", "In", "json",
                                                         "long"]
    assert answer["total"] == answer["matched"] == 8
    assert [rows[name]["kind"] for name in ("alpha", "Beta", "f", "json")] == [
        "variable", "class", "function", "module"]
    assert rows["alpha"]["size"] == {"len": 3} and rows["data"]["size"] == {"len": 3, "bytes": 3}
    assert rows["holder"]["size"] == {"len": 3} and holder.runs == 0  # a user's property is never run
    assert rows["f"]["value"] == "<lambda>(x, y=1)" and rows["json"]["value"] == "json"
    assert len(rows["long"]["value"]) <= loommux.NAMESPACE_VALUE_CHARS
    matched = loommux.list_namespace(shell, "A", 1)
    assert matched["matched"] == 3 and [row["name"] for row in matched["names"]] == ["alpha"]
    exact = loommux.list_namespace(shell, "f", 100)
    assert exact["names"][0]["name"] == "f"  # an exact match first


@pytest.mark.fast
def test_inspect_resolves_dotted_paths_and_runs_a_property_only_when_named():
    holder = Holder()
    shell = namespace_shell(holder=holder, text="hello")
    found = loommux.inspect_value(shell, "holder")
    assert found["type"] == "test_loommux.Holder" and found["repr"] == "<holder>" and holder.runs == 0
    assert loommux.inspect_value(shell, "holder.shape")["repr"] == "(1, 2)" and holder.runs == 1
    assert loommux.inspect_value(shell, "text.upper")["signature"] == "upper()"
    assert loommux.inspect_value(shell, "len")["doc"]  # a builtin resolves too
    assert loommux.inspect_value(shell, "nothing") == {"unresolved": "nothing"}
    assert loommux.inspect_value(shell, "text.nope.deeper") == {"unresolved": "text.nope"}
    import numpy

    nans = namespace_shell(some=numpy.array([1.0, numpy.nan, 3.0]), only=numpy.array([numpy.nan]))
    assert loommux.inspect_value(nans, "some")["array"] == {"dtype": "float64", "min": "1.0", "max": "3.0"}
    assert loommux.inspect_value(nans, "only")["array"] == {"dtype": "float64", "min": "nan", "max": "nan"}
    assert loommux.inspect_value(shell, "holder.broken") == {
        "failed": "holder.broken", "message": "reading it raised RuntimeError: broken"}
    said = loommux.inspect_value(namespace_shell(bad=Holder(repr_error=True)), "bad")["repr"]
    assert said == "[repr raised ValueError: no repr]"


class Stubborn:
    def __repr__(self) -> str:
        while True:  # swallows every timeout, on purpose
            try:
                time.sleep(0.01)
            except BaseException:  # noqa: BLE001, S110
                pass


@pytest.mark.fast
def test_a_repr_that_overruns_is_stopped_or_said_to_run_and_interrupt_reaches_it(monkeypatch):
    monkeypatch.setattr(loommux, "EVALUATION_LIMIT", 0.2)  # 2 s in the kernel
    monkeypatch.setattr(loommux, "STOP_PERSISTENCE", 0.5)
    slow = namespace_shell(slow=Holder(repr_sleep=3), stubborn=Stubborn())
    assert loommux.inspect_value(slow, "stubborn")["repr"] == "[repr did not finish within 0.2 s]"
    assert not [thread for thread in threading.enumerate() if thread.name == "loommux-evaluation"]
    answers = []  # from another thread (a subshell's) as from the main one
    worker = threading.Thread(target=lambda: answers.append(loommux.inspect_value(slow, "slow")))
    worker.start()
    worker.join(20)
    assert answers[0]["repr"] == "[repr did not finish within 0.2 s; still running, see interrupt()]"
    again = loommux.inspect_value(slow, "slow")["repr"]  # no second thread behind the same hanging repr
    assert again == "[repr not evaluated: an earlier one still runs, see interrupt()]"
    time.sleep(0.6)  # past its persistence: it is abandoned, and said to be
    [running] = loommux.answer_namespace_request(slow, {"tool": "interrupt"})["evaluations"]
    assert running["what"] == 'repr of "slow"' and running["abandoned"] and not running["stopped"]
    assert running["seconds"] >= 0.2
    # once its sleep ends, nothing holds it (nor the value it was asked of): no interrupt is needed
    assert wait_until(lambda: not loommux._evaluations, 10)
    assert loommux.interrupt_evaluations() == []
    assert sys.gettrace() is None  # the main thread never traced
    monkeypatch.setattr(loommux, "EVALUATION_LIMIT", 0.05)
    monkeypatch.setattr(loommux, "STOP_GRACE", 0.01)
    hanging = namespace_shell(**{f"h{i}": Holder(repr_sleep=3) for i in range(20)})
    notes = [row["value"] for row in loommux.list_namespace(hanging, None, 100)["names"]]
    crowded = f"[repr not evaluated: {loommux.MAX_LIVE_EVALUATIONS} earlier ones still run"
    assert any(note.startswith(crowded) for note in notes)
    assert len(loommux._evaluations) <= loommux.MAX_LIVE_EVALUATIONS  # threads are capped
    assert wait_until(lambda: not loommux._evaluations, 10)


class Proxy:
    """A lazy proxy: reading anything through it (``__class__`` included) builds its target."""

    builds = 0

    def __getattribute__(self, name: str) -> Any:
        Proxy.builds += 1
        return getattr([1, 2, 3], name)

    def __len__(self) -> int:
        raise ValueError("no length")


class Hanging:
    def __len__(self) -> int:
        time.sleep(3)
        return 1

    def __repr__(self) -> str:
        return "<hanging>"


@pytest.mark.fast
def test_namespace_and_inspect_read_types_not_attributes_and_note_a_len_that_fails(monkeypatch):
    monkeypatch.setattr(loommux, "EVALUATION_LIMIT", 0.2)
    shell = namespace_shell(proxy=Proxy(), hanging=Hanging())
    Proxy.builds = 0
    rows = {row["name"]: row for row in loommux.list_namespace(shell, None, 100)["names"]}
    found = loommux.inspect_value(shell, "proxy")
    assert Proxy.builds == 0  # neither __class__ nor any attribute was read through it
    assert rows["proxy"]["kind"] == "variable" and rows["proxy"]["type"] == "Proxy"
    assert found["type"] == "test_loommux.Proxy" and found["module"] == "test_loommux"
    assert rows["proxy"]["size"] == found["size"] == {"len_note": "[len raised ValueError: no length]"}
    assert rows["hanging"]["size"] == {"len_note": "[len did not finish within 0.2 s; still running, see "
                                                   "interrupt()]"}
    Proxy.builds = 0

    class Getter(Proxy):  # a user's descriptor: a variable, never asked for a signature through itself
        def __get__(self, obj, owner=None):
            return 1

    assert loommux.classify(Getter()) == "variable" and loommux.classify(functools.cache(len)) == "function"
    assert loommux.inspect_value(namespace_shell(getter=Getter()), "getter")["kind"] == "variable"
    assert Proxy.builds == 0


@pytest.mark.fast
def test_reset_says_what_it_removed_refused_and_did_not_know():
    frame = {"big": "value"}
    shell = namespace_shell(a=1, b=frame, c=3)
    shell.user_ns["_5"] = shell.history_manager.output_hist[5] = shell.displayhook._ = frame
    answer = loommux.reset_names(shell, ["a", "b", "In", "_", "loommux", "zz"])
    assert answer == {"removed": ["a", "b"], "unknown": ["zz"], "refused": ["In", "_", "loommux"],
                      "refused_reasons": {"In": "IPython's own", "_": "a _ name", "loommux": "loommux's"},
                      "unpublished": []}
    assert "_5" not in shell.user_ns and not shell.history_manager.output_hist and shell.displayhook._ is None
    assert loommux.reset_names(shell, ["a"]) == {"removed": [], "refused": [], "unknown": ["a"],
                                                 "refused_reasons": {}, "unpublished": []}
    twice = loommux.reset_names(namespace_shell(a=1), ["a", "a", "zz", "zz"])  # each name is said once
    assert (twice["removed"], twice["unknown"]) == (["a"], ["zz"])
    assert loommux.reset_names(shell, None)["removed"] == ["c"] and "In" in shell.user_ns


@pytest.mark.fast
def test_a_reset_answer_lists_at_most_so_many_names_and_counts_the_rest():
    answer = {"removed": ["a"], "refused": [f"_{i}" for i in range(150)], "unknown": ["x" * 1000],
              "refused_reasons": {f"_{i}": "a _ name" for i in range(150)}, "unpublished": []}
    cut = loommux.cut_reset_answer(answer)
    assert cut["left_out"] == {"refused": 50} and len(cut["refused"]) == len(cut["refused_reasons"]) == 100
    assert cut["removed"] == ["a"] and cut["unknown"] == ["x" * 80 + "… [+920 chars]"]


@pytest.mark.fast
def test_reset_withdraws_the_tools_published_under_a_name_or_as_its_function(monkeypatch):
    published = loommux.PublishedFunctions()
    monkeypatch.setattr(loommux, "_published", published)

    def area(side: float) -> float:
        return side * side

    published.publish(area, None, None)
    published.publish(area, "square", None)  # the same function under another name
    published.publish(lambda: 0, "kept", None)
    answer = loommux.reset_names(namespace_shell(area=area), ["area"])
    assert answer["unpublished"] == ["area", "square"] and list(published.tools) == ["kept"]
    assert answer["published"] == published.snapshot()


# ---------------------------------------------------------------- Kernel-side extension


@pytest.mark.fast
@pytest.mark.parametrize("ops, valid", [
    (["*** Add File: a"], True),
    (["*** Add File: a", "+x", "+", "*** Delete File: b"], True),
    (["*** Delete File: x"], True),
    (["*** Update File: x", "@@", " a"], True),
    (["*** Update File: x", "*** Move to: y", "@@ def f():", " a", "-b", "+c", "*** End of File"], True),
    (["*** Update File: x", "@@", "-a", "@@ two", "+b"], True),
    ([], False),  # no operation
    (["*** Add File: "], False),  # no path
    (["*** Add File: a", "x"], False),  # an added line without "+"
    (["*** Update File: x"], False),  # no hunk
    (["*** Update File: x", "@@"], False),  # an empty hunk
    (["*** Update File: x", "@@", ""], False),  # a hunk line without its prefix
    (["*** Move to: y"], False),
    (["junk"], False),
])
def test_apply_patch_grammar(ops, valid):
    assert loommux.is_patch_program(ops) is valid


def transformed(cell: str) -> tuple[list[str], dict]:
    """The Apply Patch transformer's lines for a cell, and the namespace running them leaves."""
    lines = loommux.transform_patch_literals(cell.splitlines(keepends=True))
    namespace: dict = {}
    exec("".join(lines), namespace)  # noqa: S102 - the cell as IPython would run it, without a kernel
    return lines, namespace


ADD_PATCH = ('*** Begin Patch\n*** Add File: docs/quote.py\n+def f(x):\n+    """Say {x} \\\\ done."""\n'
             '+    return f"{x}\\n"\n*** End Patch\n')
UPDATE_PATCH = ("*** Begin Patch\n*** Update File: src/a.py\n*** Move to: src/b.py\n@@ def f():\n"
                "-    return 1\n+    return 2\n@@ class C:\n     x = 1\n-    y = 2\n+    y = '''3'''\n"
                "*** End of File\n"
                "*** Delete File: old.txt\n*** End Patch\n")


@pytest.mark.fast
@pytest.mark.parametrize("prefix", ["", "r", "f", "rf", "Fr"])
def test_patch_literals_become_the_exact_program(prefix):
    # ADD_PATCH and UPDATE_PATCH are also the patches of the Apply Patch tests in a kernel
    cell = f'value = {prefix}"""\n{ADD_PATCH}"""\nafter = 1\n'
    lines, namespace = transformed(cell)
    assert namespace["value"] == ADD_PATCH and namespace["after"] == 1
    assert len(lines) == len(cell.splitlines())  # line numbers stay as written
    lines, namespace = transformed(f'pair = ({prefix}"""{UPDATE_PATCH}""", 2)\n')
    assert namespace["pair"] == (UPDATE_PATCH, 2)


@pytest.mark.fast
@pytest.mark.parametrize("body", [
    "*** Begin Patch\n*** Add File: a\n+x\n",  # no End Patch
    "*** Begin Patch\n*** End Patch\n",  # no operation
    "*** Begin Patch\n*** Update File: a\n@@\nno prefix\n*** End Patch\n",
    "*** Begin Patch\n*** Add File: a\n+x\n*** End Patch\nmore\n",  # not the literal's whole content
], ids=clipped())
def test_text_that_is_no_patch_is_left_to_python(body):
    lines = f'q = """\n{body}"""\n'.splitlines(keepends=True)
    assert loommux.transform_patch_literals(lines) == lines
    assert loommux.transform_patch_literals(["x = 1\n"]) == ["x = 1\n"]


def test_kernel_side_sections_stand_together_and_run_alone(tmp_path):
    """What is sent to kernels is one stretch of the file whose sections import what they use: every name
    they load is bound in them, and they run, with a real IPython shell, in a fresh interpreter that has
    no copy of loommux.py."""
    import ast
    import builtins

    import loommux

    text = LOOMMUX.read_text(encoding="utf-8")
    banners = [f"{loommux.SECTION_BANNER} {name}\n" for name in loommux.KERNEL_SIDE_SECTIONS]
    starts = [text.index(banner) for banner in banners]
    following = text.index(loommux.SECTION_BANNER, starts[-1] + len(loommux.SECTION_BANNER))
    source = loommux.read_kernel_side_source()
    assert starts == sorted(starts)
    for start, end in zip(starts, [*starts[1:], following]):  # no other section between them
        assert text.count(loommux.SECTION_BANNER, start, end) == 1
    tree = ast.parse(source)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    loaded = {node.id for node in ast.walk(tree)
              if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    assert loaded - bound == set()
    identity = {"kernel_id": "k1", "name": "lab", "control_url": None, "token": "secret"}
    bootstrap = loommux.KERNEL_BOOTSTRAP.format(source=source, identity=identity, count=None)
    (tmp_path / "bootstrap.py").write_text(bootstrap)
    probe = r"""
import sys
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_cell(open("bootstrap.py").read(), store_history=False).raise_error()  # as a kernel runs it
shell.run_cell("%%loommux --wait 3\nx = 40 + 2", store_history=False).raise_error()
kernel_side = sys.modules["_loommux_kernel"]
print(shell.user_ns["x"], kernel_side.parse_cell_header("%%loommux --wait 3").wait)
try:
    shell.user_ns["loommux"].kernels()
except kernel_side.DaemonError as error:
    print(error.code, error.status == error.code, kernel_side.status_of_error(error.code))
assert not any(name == "loommux" or name.startswith("loommux.") for name in sys.modules)
"""
    done = python_in(tmp_path, probe, "-I")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["42", "3.0", "no_control_plane", "True", "503"]


def test_identity_in_every_kernel_under_stdio(spawn):
    server = spawn(LOOMMUX_TOKEN="server-secret", LOOMMUX_CONTROL_URL="http://outer.example:1")
    code = ("import os, subprocess, sys\n"
            "print(os.environ['LOOMMUX_KERNEL_ID'], os.environ['LOOMMUX_KERNEL_NAME'], "
            "len(os.environ['LOOMMUX_KERNEL_TOKEN']))\n"
            "print('LOOMMUX_TOKEN' in os.environ, 'LOOMMUX_CONTROL_URL' in os.environ)\n"
            "print(subprocess.run([sys.executable, '-c', "
            "'import os; print(os.environ[\"LOOMMUX_KERNEL_ID\"])'], "
            "capture_output=True, text=True).stdout.strip())\n"
            "print(loommux.self.id, loommux.self.name)")
    first = out(server, code)
    kernel_id = first[0].split()[0]
    assert (re.fullmatch(r"~[0-9a-f]{8}", kernel_id) and first[0].split()[1] == kernel_id
            and int(first[0].split()[2]) >= 32)
    assert first[1:] == ["False False", kernel_id, f"{kernel_id} {kernel_id}"]
    server.call("restart")
    assert out(server, code) == first  # the same identity after a restart
    # no control plane under stdio: the object and the header both say so
    text = run(server, "try:\n    loommux.kernels()\nexcept loommux.DaemonError as e:\n    print(e.status)\n"
                       "    print(str(e).startswith('no_control_plane: '))").body
    assert text == ["no_control_plane", "True"]
    forwarded = run(server, "%%loommux --kernel lab\nprint('never')")
    assert forwarded.state == "error" and "never" not in forwarded.text
    assert (forwarded.body[-1].startswith("DaemonError: no_control_plane: ")
            and "--server" in forwarded.body[-1])
    assert "Traceback" not in forwarded.text


@pytest.fixture(scope="module")
def control_server(tmp_path_factory):
    """An HTTP server for the control-plane tests: short orphan grace, long leases, one spare kernel."""
    base = tmp_path_factory.mktemp("control")
    (base / "workspace").mkdir()
    server = LoommuxHttp(base / "workspace", base / "server.log",
                         http_env(LOOMMUX_SPARE_KERNELS="1", LOOMMUX_ORPHAN_GRACE_SECONDS="0.5"))
    try:
        server.wait_ready()
        yield server
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0, server.log()[-3000:]
    finally:
        server.cleanup()


def test_kernels_control_kernels_over_http(control_server):
    server = control_server
    with HttpMcp(server, operator="controller") as a:
        a.call("status")  # a private kernel comes with the first tool call
        me = server.resource_of("controller")["id"]
        env = out(a, "import os\nprint(os.environ['LOOMMUX_KERNEL_ID'], os.environ['LOOMMUX_KERNEL_NAME'])\n"
                     "print(os.environ['LOOMMUX_CONTROL_URL'])\nprint(loommux.self.id)")
        assert env == [f"{me} {me}", f"http://127.0.0.1:{server.port}", me]
        listed = out(a, "ks = loommux.kernels()\nprint(ks)\n"
                        "print([(k.name, k.id) for k in ks if k.id == loommux.self.id])")
        assert listed[0].split() == ["name", "id", "state", "pid", "executions", "leases"]
        assert listed[-1] == f"[('{me}', '{me}')]"
        # a named kernel opened from a kernel: run, wait, read, search
        body = out(a, "lab = loommux['ctl-lab']\n"
                      "job = lab.run('for i in range(5):\\n    print(\"row\", i)\\n6*7', wait=30)\n"
                      "print(job.execution, job.state, job.wait(5))\nprint(job.output(line_range='-2:'))\n"
                      "print(job.search('row [13]', context_after=1))\n"
                      "print(lab.executions, lab.busy, lab.state)")
        assert body == ["1 completed completed", "row 4", "Out[1]: 42", "M 2 | row 1", "C 3 | row 2",
                        "M 4 | row 3", "C 5 | row 4", "1 False idle"]
        lab = server.resource("ctl-lab")
        assert [(lease["holder"], lease["mode"]) for lease in lab["leases"]] == [(me, "holder")]
        # busy: never queued, also for this very kernel
        body = out(a, "slow = lab.run('import time; time.sleep(30)', wait=0)\nprint(slow.state)\n"
                      "for target in (lab, loommux.self):\n    try:\n        target.run('1')\n"
                      "    except loommux.DaemonError as e:\n"
                      "        print(e.status, str(e).startswith('busy: '))\n"
                      "print(slow.interrupt(), slow.wait(10))")
        assert body == ["running", "busy True", "busy True", "True interrupted"]
        # restart keeps numbering; recycle gives a fresh kernel on next use
        body = out(a, "old = lab.pid\nlab.restart()\nprint(lab.pid != old, lab.run('1+1').execution)\n"
                      "lab.recycle()\nprint(loommux['ctl-lab'].executions)")
        assert body == ["True 3", "0"]
        # errors keep the tools' codes
        body = out(a, "for call in (lambda: loommux['no good'], lambda: lab.run('%%loommux --bogus\\n1'),\n"
                      "             lambda: loommux['~00000000'], "
                      "lambda: loommux['ctl-lab'].run('1').output(stream='x')):\n"
                      "    try:\n        call()\n"
                      "    except loommux.DaemonError as e:\n        print(e.status)")
        assert body == ["invalid_resource_name", "invalid_cell_header", "resource_not_found",
                        "invalid_stream"]
        # cells submitted this way are ordinary executions of the target, in the operator's API too
        detail = server.api("GET", "/api/resources/ctl-lab").json()
        assert detail["executions"] == 1 and detail["recent_executions"][0]["first_line"] == "1"


def test_forwarded_cells(control_server):
    server = control_server
    with HttpMcp(server, operator="forwarder") as a, \
            HttpMcp(server, resource="fwd-target", operator="watcher") as b:
        a.call("status")
        me = server.resource_of("forwarder")["id"]
        # relayed while the target still runs; stdout and stderr keep their streams
        cell = run_cell(a, "%%loommux --kernel fwd-target --wait 0.1\nimport sys, time\n"
                           "print('one', flush=True)\n"
                           "print('warn', file=sys.stderr, flush=True)\ntime.sleep(2.5)\nprint('two')")
        assert cell.state == "running"
        assert wait_until(lambda: "one" in read(a, execution=cell.n)[1], 20, 0.1)
        target_n = int(re.search(r"execution (\d+)", read(a, execution=cell.n, line_range="1:1")[1][0])[1])
        assert read(a, execution=cell.n, line_range="1:1")[1] == [
            f"[forwarded to kernel fwd-target · execution {target_n}]"]
        assert "two" not in read(a, execution=cell.n)[1]
        done = finish(a, cell)
        assert done.state == "completed" and done.body == [
            f"[forwarded to kernel fwd-target · execution {target_n}]", "one", "warn", "two"]
        assert read(a, execution=cell.n, stream="stderr")[1] == ["warn"]
        assert out(b, "print('target sees', 1)") and read(b, execution=target_n)[1] == ["one", "warn", "two"]
        # an error there: its traceback, then one line naming where it happened
        failed = run(a, "%%loommux --kernel fwd-target\nraise ValueError('bad value')")
        assert failed.state == "error"
        assert failed.body[-1] == (f"ForwardedCellError: execution {target_n + 2} in kernel fwd-target ended "
                                   "with ValueError: bad value")
        assert any("ValueError: bad value" == line for line in failed.body[:-1])
        assert not any("forward(" in line or "kernel side" in line for line in failed.body)
        # naming this kernel itself runs here
        assert out(a, f"%%loommux --kernel {me}\nimport os\nprint(os.environ['LOOMMUX_KERNEL_ID'])") == [me]
        # --wait and --full-output keep their meaning for this cell
        full = run(a, "%%loommux --kernel fwd-target --full-output --wait 60\nfor i in range(3000):\n"
                      "    print('line', i, 'x' * 40)")
        assert (full.state == "completed" and len(full.body) == 3001
                and full.body[-1] == "line 2999 " + "x" * 40)
        # a busy target refuses; nothing is queued
        slow = run_cell(b, "%%loommux --wait 0.1\nimport time\ntime.sleep(3)")
        refused = run(a, "%%loommux --kernel fwd-target\nprint('queued?')")
        assert refused.state == "error" and refused.body[-1].startswith("DaemonError: busy: ")
        finish(b, slow)
        assert f"last execution: {slow.n} ·" in b.call("status")[0]  # nothing was queued behind it
        # interrupting the forwarding cell interrupts the target's cell too
        cell = run_cell(a, "%%loommux --kernel fwd-target --wait 0.1\nimport time\n"
                           "print('sleeping', flush=True)\ntime.sleep(60)")
        assert wait_until(lambda: "sleeping" in read(a, execution=cell.n)[1], 20, 0.1)
        target = int(re.search(r"execution (\d+)", read(a, execution=cell.n, line_range="1:1")[1][0])[1])
        a.call("interrupt")
        assert finish(a, cell).state == "interrupted"
        text, _, _ = b.call("wait", {"execution": target, "timeout_seconds": 20})
        assert Cell.parse(text).state == "interrupted"
        # every relayed line once, in the target's own order (streams interleaved), and one line of our own
        chatty = run_cell(a, "%%loommux --kernel fwd-target --wait 0.1\nimport sys, time\n"
                             "for i in range(400):\n"
                             "    print('line', i, flush=True)\n    if i % 7 == 0:\n"
                             "        print('warn', i, file=sys.stderr, flush=True)\n    time.sleep(0.01)\n"
                             "time.sleep(60)")
        assert wait_until(lambda: "line 399" in read(a, execution=chatty.n)[1], 30, 0.1)
        target = int(re.search(r"execution (\d+)", read(a, execution=chatty.n, line_range="1:1")[1][0])[1])
        a.call("interrupt")
        lines = finish(a, chatty).body
        assert lines[-1] == (f"KeyboardInterrupt: execution {target} in kernel fwd-target was "
                             "interrupted"), lines[-5:]
        own = read(b, execution=target)[1]
        assert lines[1:-1] == own and len(set(own[:-1])) == len(own[:-1])  # no line twice, none out of order
        assert not any("urllib" in line or "forward(" in line for line in lines)


def test_forwarding_in_one_request_and_an_interrupt_during_it(control_server):
    server = control_server
    with HttpMcp(server, operator="one-shot") as a:
        a.call("status")
        me = server.resource_of("one-shot")["id"]
        # a relayed run holds its target and, once the cell ends within its wait, answers with all it showed
        body = out(a, "run = {'code': 'print(\"hi\")\\n6*7', 'wait': 30, 'relay': True, 'hold': True}\n"
                      "reply = loommux.request('POST', '/api/kernels/fwd-once/run', run, 30)\n"
                      "print(reply['state'], reply['events'], reply['next'], reply['more'])")
        assert body == ["completed [['stdout', 'hi\\n'], ['stdout', 'Out[1]: 42\\n']] 2 False"]
        assert [lease["holder"] for lease in server.resource("fwd-once")["leases"]] == [me]
        refused = out(a, "try:\n    loommux.request('POST', '/api/kernels/fwd-none/run', {'code': '1'})\n"
                         "except loommux.DaemonError as e:\n    print(e.code)")
        assert refused == ["resource_not_found"] and server.resource("fwd-none") is None  # no hold: find only
        # an interrupt that comes while the cell is being submitted is held back, then passed on to the target
        out(a, "import os, signal, time\nreal_request = loommux.request\n"
               "def interrupted_while_submitting(method, path, body=None, wait=0.0):\n"
               "    reply = real_request(method, path, body, wait)\n"
               "    if path.endswith('/run'):\n"
               "        loommux.request = real_request\n"
               "        output = f\"/api/kernels/fwd-once/executions/{reply['execution']}/output\"\n"
               "        while 'started' not in real_request('POST', output, {})['text']:\n"
               "            time.sleep(0.05)\n"
               "        os.kill(os.getpid(), signal.SIGINT)\n"
               "    return reply\n"
               "loommux.request = interrupted_while_submitting")
        cell = run(a, "%%loommux --kernel fwd-once\nimport time\nprint('started', flush=True)\n"
                      "time.sleep(60)")
        assert cell.state == "interrupted", cell.text
        assert cell.body[:2] == ["[forwarded to kernel fwd-once · execution 2]", "started"], cell.text
        assert cell.body[-1] == "KeyboardInterrupt: execution 2 in kernel fwd-once was interrupted", cell.text
        assert "----> 3 time.sleep(60)" in cell.body  # the target's own traceback, relayed
        assert not any("forward(" in line or "submit" in line for line in cell.body)

        def target_state() -> str:
            return server.api("GET", "/api/resources/fwd-once").json()["recent_executions"][0]["state"]

        assert wait_until(lambda: target_state() == "interrupted", 20), target_state()


def test_a_kernel_keeps_its_control_connection(http_spawn):
    """One kept-alive connection for the loommux object's requests; one the server closed is replaced, and a
    forked child opens its own."""
    server = http_spawn(LOOMMUX_MAX_CONNECTIONS="3", LOOMMUX_SPARE_KERNELS="0")
    with HttpMcp(server, operator="keeper") as a:
        kept = out(a, "loommux.kernels()\nfirst = loommux.idle[0]\nport = first.sock.getsockname()\n"
                      "loommux.kernels()\nprint(loommux.idle == [first], first.sock.getsockname() == port)")
        assert kept == ["True True"]
        # at the cap, the server closes the connection idle the longest: the kernel's
        extras = [RawHttp(server.port) for _ in range(2)]
        try:
            for extra in extras:
                assert extra.request("GET", "/api/health").status == 200
            again = out(a, "import selectors\nwith selectors.DefaultSelector() as selector:\n"
                           "    selector.register(first.sock, selectors.EVENT_READ)\n"
                           "    print(bool(selector.select(0)))\n"
                           "print(len(loommux.kernels()), loommux.idle[0] is not first, len(loommux.idle))")
            assert again == ["True", "1 True 1"]
        finally:
            for extra in extras:
                extra.close()
        forked = out(a, "import os\nparent = loommux.idle[0]\npid = os.fork()\nif pid == 0:\n    code = 1\n"
                        "    try:\n"
                        "        code = 0 if loommux.kernels() and parent not in loommux.idle else 2\n"
                        "    finally:\n        os._exit(code)\n"
                        "print(os.waitpid(pid, 0)[1], len(loommux.kernels()), loommux.idle == [parent])")
        assert forked == ["0 1 True"]
        unreachable = out(a, "try:\n    type(loommux)('http://127.0.0.1:1', 'x').kernels()\n"
                             "except loommux.DaemonError as e:\n"
                             "    print(e.code, 'cannot reach' in e.message)")
        assert unreachable == ["no_control_plane True"]


def test_daemon_outside_a_kernel_and_credentials(http_spawn):
    server = http_spawn(LOOMMUX_SPARE_KERNELS="0", LOOMMUX_TOKEN="operator-secret")
    server.api_headers = {"Authorization": "Bearer operator-secret"}
    with HttpMcp(server, resource="outside-lab", headers=server.api_headers) as a:
        out(a, "x = 41")
        token = out(a, "import os\nprint(os.environ['LOOMMUX_KERNEL_TOKEN'])\n"
                       "print('LOOMMUX_TOKEN' in os.environ)")
        assert token[1] == "False" and token[0] != "operator-secret"
        kernel_token = token[0]
        script = ("import sys\nsys.path.insert(0, sys.argv[1])\nimport loommux\n"
                  "d = loommux.Daemon(url=sys.argv[2], token=sys.argv[3] or None)\n"
                  "try:\n    print([k.id for k in d.kernels()])\n    lab = d['outside-lab']\n"
                  "    print(lab.run('x + 1', wait=30).output())\n    d['not-there']\n"
                  "except loommux.DaemonError as e:\n    print(e.status)\n")
        url = f"http://127.0.0.1:{server.port}"

        def daemon(token: str) -> list[str]:
            done = subprocess.run([sys.executable, "-c", script, str(ROOT), url, token], capture_output=True,
                                  text=True, check=False, timeout=60, env=server_env())
            return done.stdout.splitlines()

        assert daemon("operator-secret") == ["['outside-lab']", "Out[3]: 42", "resource_not_found"]
        assert daemon("") == ["unauthorized"]
        # a kernel's credential opens the kernel endpoints only: not MCP, not the console, not the
        # operator API
        bearer = {"Authorization": f"Bearer {kernel_token}"}
        refused = HttpMcp(server, headers=bearer, initialize=False)
        assert refused.initialize().status == 403
        refused.drop()
        assert server.api("GET", "/api/kernels", headers=bearer).status == 200
        assert server.api("GET", "/api/resources", headers=bearer).status == 403
        assert server.api("GET", "/", headers=bearer).status == 401
        assert server.api("POST", "/api/lease-policy", {"mode": "ping"}, headers=bearer).status == 403


@pytest.mark.parametrize("prefix", ["", "r", "f", "rf", "Fr"])
def test_patch_literal_is_the_exact_program(srv, prefix):
    cell = f'value = {prefix}"""\n{ADD_PATCH}""".splitlines()\nprint(repr(value))'
    assert run(srv, cell).body == [repr(ADD_PATCH.splitlines())]
    inline = f'pair = ({prefix}"""{UPDATE_PATCH}""", 2)\nprint(repr(pair[0]), pair[1])'
    assert run(srv, inline).body == [f"{UPDATE_PATCH!r} 2"]


def test_patch_literal_line_numbers_and_history(srv):
    cell = f'p = """\n{ADD_PATCH}"""\n\n1 / 0'
    failed = run(srv, cell)
    assert (failed.state == "error"
            and any(re.search(r"-+> 10 1 / 0", line) for line in failed.body)), failed.text
    assert run(srv, "print(_ih[-2] == In[-2], get_ipython().history_manager.input_hist_raw[-2] == "
                    f"{cell!r})").body[-1].endswith("True")


@pytest.mark.parametrize("broken", [
    ADD_PATCH.replace("*** End Patch\n", ""),  # no End Patch
    # a hunk line without prefix
    UPDATE_PATCH.replace("-    return 1", "    return 1").replace("     x = 1", "x = 1"),
    "*** Begin Patch\n*** End Patch\n",  # no operation
])
def test_text_that_is_no_valid_patch_stays_python(srv, broken):
    cell = f'q = """\n{broken}"""\nprint(repr(q))'
    result = run(srv, cell)
    if '"""' in broken:  # the embedded quotes end the literal early: plain Python fails as it would
        assert result.state == "error" and "SyntaxError" in result.text
    else:
        assert result.body == [repr("\n" + broken)]


def test_public_url_is_what_kernels_are_told(http_spawn):
    server = http_spawn("--public-url", "http://loommux.example:8801/", LOOMMUX_SPARE_KERNELS="0")
    with HttpMcp(server) as a:
        assert out(a, "import os\nprint(os.environ['LOOMMUX_CONTROL_URL'])") == ["http://loommux.example:8801"]


INSPECTORS_FILE = '''import ast

@loommux.inspector
def no_subprocess(source, tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name == "subprocess" for a in node.names):
            raise loommux.Block("subprocess is not allowed here")

@loommux.inspector
def iterrows_hint(source, tree):
    if ".iterrows()" in source:
        return "iterrows is slow; prefer vectorized operations"

@loommux.inspector
def buggy(source, tree):
    if "trigger_bug" in source:
        return 1 / 0
'''


@pytest.mark.fast
def test_the_inspectors_file_is_named_or_found_in_the_config_directory(tmp_path):
    args = loommux.parse_command_line([])
    assert loommux.find_inspectors_file(None, {"XDG_CONFIG_HOME": str(tmp_path)}, tmp_path) is None
    default = tmp_path / "loommux" / "inspectors.py"
    default.parent.mkdir()
    default.write_text("")
    assert loommux.find_inspectors_file(None, {"XDG_CONFIG_HOME": str(tmp_path)}, tmp_path) == default
    assert loommux.find_inspectors_file("loommux/inspectors.py", {}, tmp_path) == default
    with pytest.raises(loommux.StartupError, match="LOOMMUX_INSPECTORS missing.py: no such file"):
        loommux.find_inspectors_file("missing.py", {}, tmp_path)
    assert args.inspectors is None


@pytest.mark.fast
def test_an_inspector_is_a_named_function():
    daemon = loommux.Daemon()
    for unnamed in (functools.partial(print), 42):
        with pytest.raises(TypeError, match="an inspector is a named function"):
            daemon.inspector(unnamed)
    assert daemon.inspector(print) is print and loommux._inspectors[-1] is print
    loommux._inspectors.remove(print)


def test_cell_inspectors_note_block_and_fail_open(spawn, tmp_path):
    inspectors = tmp_path / "inspectors.py"
    inspectors.write_text(INSPECTORS_FILE)
    s = spawn(LOOMMUX_INSPECTORS=str(inspectors))
    assert "Inspector" not in run(s, "x = 1\nx").text
    blocked = run(s, "import subprocess\ny = 2")
    assert blocked.state == "error" and blocked.body == [
        "CellBlocked: blocked by inspector no_subprocess: subprocess is not allowed here"], blocked.text
    assert "error: CellBlocked: blocked by inspector no_subprocess" in s.call(
        "execution_status", {"execution": blocked.n})[0]
    assert "NameError" in run(s, "y").text  # the blocked cell never ran
    noted = run(s, "rows = [(0, 'a')]  # df.iterrows() would be slow\nlen(rows)")
    hint = "Inspector iterrows_hint: iterrows is slow; prefer vectorized operations"
    assert noted.text.split("\n")[1:] == [hint, f"Out[{noted.n}]: 1"], noted.text
    assert read(s, execution=noted.n)[1] == [f"Out[{noted.n}]: 1"]  # a note is never output
    failed = run(s, "trigger_bug = 3\ntrigger_bug")
    warning = ("Warning: inspector buggy failed (ZeroDivisionError: division by zero); the cell ran without "
               "its check.")
    assert failed.state == "completed" and failed.text.split("\n")[1:] == [warning, f"Out[{failed.n}]: 3"]
    # a person's own client is never inspected
    assert join_as_person(s, "import subprocess\nprint(subprocess.__name__)") == ["subprocess"]


def test_an_inspectors_file_that_fails_is_said_and_the_kernel_goes_on(spawn, tmp_path):
    inspectors = tmp_path / "inspectors.py"
    inspectors.write_text("@loommux.inspector\ndef fine(source, tree):\n    return None\n\n1 / 0\n")
    s = spawn(LOOMMUX_INSPECTORS=str(inspectors))
    first = run(s, "import subprocess\n6 * 7")
    assert "Out[1]: 42" in first.text and "CellBlocked" not in first.text
    failure = f"Inspectors file failed: ZeroDivisionError: division by zero\n  File {inspectors}:5"
    assert failure in first.text and "cells run without inspectors." in first.text, first.text
    assert "Inspectors file failed" not in run(s, "1").text  # said once
    log = s.stderr_path.read_text()
    assert log.count(f"the inspectors file {inspectors} failed in kernel") == 1, log



@pytest.mark.parametrize(("loading", "said"), [
    ("import os\nos._exit(3)\n",
     "the kernel pid {pid} exited with code 3 while it ran; a new kernel was started without it"),
    ("import time\ntime.sleep(600)\n", "it did not finish within 10 s and was interrupted"),
    ("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(600)\n",
     ("the kernel pid {pid} hung: it did not finish within 10 s, nor 5 s after an interrupt; a new kernel "
      "was started without it")),
], ids=["exit", "sleep", "deaf"])
def test_an_inspectors_file_that_kills_or_stalls_its_kernel_is_said_at_once(spawn, tmp_path, loading, said):
    """initialize is answered within 30 s (the death is noticed at once, a stall interrupted), and the first
    result says what happened; the startup file still runs."""
    inspectors, startup = tmp_path / "inspectors.py", tmp_path / "startup.py"
    inspectors.write_text("@loommux.inspector\ndef noting(source, tree):\n    return 'seen'\n\n" + loading)
    startup.write_text("ready = 'yes'\n")
    s = spawn(LOOMMUX_INSPECTORS=str(inspectors), LOOMMUX_STARTUP=str(startup))
    first = run(s, "ready")
    log = s.stderr_path.read_text()
    pid = re.search(r"failed in kernel pid (\d+)", log)
    assert pid, log
    expected = f"Inspectors file failed: {said.format(pid=pid[1])}; cells run without inspectors."
    assert expected in first.text, first.text
    assert "Out[1]: 'yes'" in first.text and "Inspectors file failed" not in run(s, "1").text


def test_an_inspector_raising_system_exit_or_keyboard_interrupt_fails_open(spawn, tmp_path):
    inspectors = tmp_path / "inspectors.py"
    inspectors.write_text("import sys, time\n@loommux.inspector\ndef leaving(source, tree):\n"
                          "    if 'leave' in source:\n        sys.exit(2)\n"
                          "    if 'stop' in source:\n        raise KeyboardInterrupt('stop')\n"
                          "    if 'slow' in source:\n        open(__file__ + '.slow', 'w').close()\n"
                          "        time.sleep(60)\n")
    s = spawn(LOOMMUX_INSPECTORS=str(inspectors))
    # the interrupt tool, while an inspector runs, interrupts the cell: it never runs
    running = s.call("run_cell", {"freeform": "%%loommux --wait 0.5\nslow = 1\nprint('ran')"})[0]
    assert "· running:" in running, running
    assert wait_until(Path(f"{inspectors}.slow").exists, 60)  # the inspector runs (a loaded machine is slow)
    s.call("interrupt")
    ended = s.call("wait", {"execution": 1})[0]
    assert "KeyboardInterrupt" in ended and "ran" not in ended and "Warning" not in ended, ended
    for cell, error, value in (("leave = 1\nleave", "SystemExit: 2", 1),
                               ("stop = 2\nstop", "KeyboardInterrupt: stop", 2)):
        result = run(s, cell)
        warning = f"Warning: inspector leaving failed ({error}); the cell ran without its check."
        assert result.state == "completed" and result.text.split("\n")[1:] == [
            warning, f"Out[{result.n}]: {value}"], result.text


# ---------------------------------------------------------------- Kernel process


class RefusingGateway:
    """A gateway that has every kernel but whose channels cannot be reached; it records the requests made."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []

    async def request(self, method: str, path: str, body=None, timeout=None):
        self.requests.append((method, path))
        return 200, {"id": "g2" if method == "POST" else path.rsplit("/", 1)[-1]}

    async def open_websocket(self, path: str):
        raise loommux.GatewayError("the channels cannot be reached")


@pytest.mark.fast
def test_a_kept_kernel_a_join_cannot_reach_stays_on_the_gateway():
    gateway = RefusingGateway()
    kernel = loommux.GatewayKernel(gateway)
    with pytest.raises(loommux.GatewayError):
        asyncio.run(kernel.adopt("g1"))
    assert gateway.requests == [("GET", "/api/kernels/g1")]  # never DELETE: the next call joins it again
    started = loommux.GatewayKernel(gateway)  # a kernel it started itself is deleted when it fails to answer
    gateway.kernel_name, gateway.environ = "python3", {}
    with pytest.raises(loommux.GatewayError):
        asyncio.run(started.start())
    assert gateway.requests[1:] == [("POST", "/api/kernels"), ("DELETE", "/api/kernels/g2")]


def test_interrupt(srv):
    cell = run_cell(srv, "%%loommux --wait 0.3\nwhile True: pass")
    assert cell.state == "running"
    text, is_error, _ = srv.call("interrupt")
    assert not is_error and text.startswith("interrupt_sent:") and f"execution {cell.n}" in text
    done = finish(srv, cell, timeout=30)
    assert done.state == "interrupted" and "KeyboardInterrupt" in done.text
    assert srv.call("execution_status", {"execution": cell.n})[0].startswith(
        f"[execution {cell.n} · interrupted]")
    text, is_error, _ = srv.call("interrupt")
    assert not is_error and text.startswith("idle:")


def test_an_interrupt_before_the_kernel_begins_the_cell_is_not_lost(srv):
    """ipykernel ignores SIGINT until it begins a cell: an interrupt asked for before then (here the kernel
    is slow to begin it) is sent when it does, and the cell ends interrupted, not 60 s later."""
    run(srv, "import time\n_k = get_ipython().kernel\n_hook = _k.pre_handler_hook\n"
             "_k.pre_handler_hook = lambda: (time.sleep(1.5), _hook())")
    try:
        cell = run_cell(srv, "%%loommux --wait 0.1\nimport time\ntime.sleep(60)")
        assert cell.state == "running"
        text, is_error, _ = srv.call("interrupt")
        assert not is_error and text.startswith("interrupt_sent:")
        done = finish(srv, cell, timeout=30)
        assert done.state == "interrupted" and "KeyboardInterrupt" in done.text
    finally:
        run(srv, "_k.pre_handler_hook = _hook\ndel _k, _hook")


def child_pid_of(server: StdioServer, cell: Cell) -> int:
    pid = int(cell.body[0])
    server.tracked_pids.add(pid)
    return pid


def test_numbering_restart_and_leftover_processes(spawn):
    s = spawn()
    for tool, args in [("read_output", {}), ("wait", {}), ("execution_status", {}),
                       ("search_output", {"query": "x"})]:
        tool_error(s, tool, args, "execution_not_found")
    assert "executions: none" in s.call("status")[0]
    assert s.call("interrupt")[0].startswith("idle:")

    assert run(s, "survivor = 1").n == 1
    with_child = run(s, SLEEP_CHILD)
    assert with_child.n == 2
    child = child_pid_of(s, with_child)
    old_kernel = s.kernel_pid()
    running = run_cell(s, "%%loommux --wait 0.2\nimport time\ntime.sleep(100)")
    assert (running.n, running.state) == (3, "running")

    text, is_error, _ = s.call("restart")
    assert (not is_error and text.startswith("restarted:")
            and re.search(r"execution 3\b.*\bkilled", text)), text
    new_kernel = int(re.search(r"new kernel pid (\d+)", text)[1])
    s.tracked_pids.add(new_kernel)
    assert new_kernel != old_kernel and f"was {old_kernel}" in text
    assert gone(old_kernel) and gone(child)
    assert s.kernel_pid() == new_kernel

    assert Cell.parse(s.call("wait", {"execution": 3})[0]).state == "killed"
    assert s.call("execution_status", {"execution": 3})[0].startswith("[execution 3 · killed]")
    after = run(s, "survivor")
    assert (after.n, after.state) == (4, "error") and "NameError" in after.text
    assert "Cell In[4]" in after.text, after.text  # the kernel's count follows loommux's numbers
    assert read(s, execution=2)[1] == [str(child)]  # records survive a restart

    text, is_error, _ = s.call("restart")
    assert not is_error and text.startswith("restarted:") and "killed" not in text
    assert run(s, "1 + 1").body == ["Out[5]: 2"]
    assert run(s, "_5, get_ipython().execution_count - 1").body == ["Out[6]: (2, 6)"]
    assert run(s, " \n").n == 7  # a blank cell: counted by the kernel too
    assert "Cell In[8]" in run(s, "1 / 0").text


def kernel_replaced(text: str) -> list[str]:
    return [line for line in text.split("\n") if line.startswith("Kernel replaced:")]


def test_kernel_death_is_noticed_and_replaced(spawn):
    s = spawn()
    first_kernel = s.kernel_pid()
    run(s, "x_before = 1")
    cell = run_cell(s, "import os\nos._exit(3)")
    assert (cell.n, cell.state) == (2, "killed") and "kernel exited with code 3" in cell.text
    booting = s.call("status")[0]  # answered at once, while the replacement boots
    assert "kernel: pid none · starting" in booting, booting
    texts = [cell.text, booting, *statuses_until_replaced(s, first_kernel)]
    assert sum(len(kernel_replaced(t)) for t in texts) == 1, texts  # said once, in one line
    assert gone(first_kernel)
    second_kernel = s.kernel_pid()
    works = run(s, "1 + 1")
    assert works.body == ["Out[3]: 2"] and not kernel_replaced(works.text)
    status_text = s.call("execution_status", {"execution": 2})[0]
    assert status_text.startswith("[execution 2 · killed]") and "kernel exited with code 3" in status_text

    # a kernel killed from outside while idle is replaced too, and said so once
    os.kill(second_kernel, signal.SIGKILL)
    assert gone(second_kernel)
    texts = statuses_until_replaced(s, second_kernel)
    again = run(s, "x_before")
    assert sum(len(kernel_replaced(t)) for t in [*texts, again.text]) == 1, texts
    assert again.n == 4 and again.state == "error"  # fresh kernel: the variable is gone
    s.kernel_pid()


def test_no_workspace_file_stands_in_for_a_kernel_module_and_cells_may_import_debugpy(spawn, tmp_path):
    workspace = tmp_path / "shadowing"
    workspace.mkdir()
    for name in ("ctypes", "threading", "zmq"):  # what the launcher and the kernel import as they start
        (workspace / f"{name}.py").write_text("raise RuntimeError('a workspace file stood in for it')\n")
    s = spawn(workspace)
    cell = run(s, "import debugpy, zmq\nprint(debugpy.__name__, zmq.__name__)")  # debugpy is left to cells
    assert cell.state == "completed" and cell.body == ["debugpy zmq"], cell.text
    assert s.close() == 0


@needs_proc
def test_kernel_follows_a_sigkilled_server(spawn):
    s = spawn()
    kernels = descendants(s.proc.pid)
    assert s.kernel_pid() in kernels
    s.tracked_pids |= kernels
    s.proc.kill()
    s.proc.wait()
    assert all_gone(kernels, 15) == []


def test_kernel_that_cannot_start_stops_the_server(spawn, tmp_path):
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "ipykernel_launcher.py").write_text("import sys\nprint('no kernel here', file=sys.stderr)\n"
                                                "sys.exit(3)\n")
    s = spawn(initialize=False, PYTHONPATH=str(fake))
    s.send_request("initialize", initialize_params("t"))
    assert s.proc.wait(60) == 1
    assert all("error" in response for response in s.responses.values())  # never a half-working server
    stderr = s.stderr_tail()
    assert "exited with code 3" in stderr and "no kernel here" in stderr, stderr


def test_cancelled_restart_still_stops_the_old_kernel(spawn):
    s = spawn()
    old = s.kernel_pid()
    assert run_cell(s, "%%loommux --wait 0.5\nwhile True: pass").state == "running"
    rid = s.send_request("tools/call", {"name": "restart", "arguments": {}})
    time.sleep(0.3)
    s.notify("notifications/cancelled", {"requestId": rid, "reason": "test"})
    assert gone(old, 15), "the old kernel outlived a cancelled restart"
    assert run(s, "1 + 1").body[-1].endswith("2")


def test_startup_file_in_every_kernel(spawn, tmp_path):
    startup = tmp_path / "startup.py"
    startup.write_text("import math as startup_math\nSTARTUP_VALUE = 41\n"
                       "print('startup output is no execution')\n")
    server = spawn(LOOMMUX_STARTUP=str(startup))
    first = run(server, "print(STARTUP_VALUE + 1, startup_math.tau > 6)")
    assert first.n == 1 and first.body == ["42 True"]
    status = server.call("status")[0]
    assert f"startup: {startup} · ok" in status.split("\n")
    server.call("restart")
    again = run(server, "print(STARTUP_VALUE)")
    assert again.n == 2 and again.body == ["41"]


def test_failing_startup_file_is_one_notice(spawn, tmp_path):
    startup = tmp_path / "bad_startup.py"
    startup.write_text("READY = True\nraise NameError('startup_missing is not defined')\n")
    server = spawn(LOOMMUX_STARTUP=str(startup))
    first = run(server, "print(READY)")
    assert first.state == "completed" and first.n == 1
    notices = [line for line in first.text.split("\n") if line.startswith("Startup file failed:")]
    assert notices == ["Startup file failed: NameError: startup_missing is not defined"], first.text
    assert f"File {startup}:2" in first.text
    assert "Startup file failed" not in run(server, "print(2)").text  # reported once
    status = server.call("status")[0]
    assert f"startup: {startup} · failed: NameError: startup_missing is not defined" in status.split("\n")


def test_initialize_does_not_wait_for_the_startup_file_the_first_call_does(spawn, tmp_path):
    gate, startup = tmp_path / "gate", tmp_path / "startup.py"
    startup.write_text(f"import pathlib, time\nwhile not pathlib.Path({str(gate)!r}).exists():\n"
                       "    time.sleep(0.05)\nREADY = 'after the gate'\n")
    server = spawn(LOOMMUX_STARTUP=str(startup))  # answered while the startup file waits for the gate
    gate.touch()
    assert run(server, "READY").body == ["Out[1]: 'after the gate'"]


def test_a_startup_file_that_kills_its_kernel_is_said_and_left_out_of_a_new_one(spawn, tmp_path):
    """The death is noticed at once (not at the startup file's 300 s); the inspectors still load."""
    startup, inspectors = tmp_path / "startup.py", tmp_path / "inspectors.py"
    startup.write_text("import os\nos._exit(5)\n")
    inspectors.write_text("@loommux.inspector\ndef noting(source, tree):\n    return 'seen'\n")
    server = spawn(LOOMMUX_STARTUP=str(startup), LOOMMUX_INSPECTORS=str(inspectors))
    first = run(server, "6 * 7")
    pid = re.search(r"the startup file \S+ failed in kernel pid (\d+)", server.stderr_path.read_text())
    assert pid, server.stderr_path.read_text()
    failure = (f"the kernel pid {pid[1]} exited with code 5 while it ran; a new kernel was started without "
               "it")
    assert f"Startup file failed: {failure}" in first.text, first.text
    assert "Inspector noting: seen" in first.text and "Out[1]: 42" in first.text, first.text
    assert f"startup: {startup} · failed: {failure}" in server.call("status")[0].split("\n")


def test_startup_file_in_a_spare_kernel_over_http(http_spawn, tmp_path):
    startup = tmp_path / "http_startup.py"
    startup.write_text("import os\nSTARTED_AS = os.environ['LOOMMUX_KERNEL_ID']\n")
    server = http_spawn(LOOMMUX_SPARE_KERNELS="1", LOOMMUX_STARTUP=str(startup))
    with HttpMcp(server, resource="startup-room") as a:
        assert out(a, "print(STARTED_AS)") == ["startup-room"]


@needs_proc
def test_detached_children_end_with_restart_and_shutdown(spawn, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    s = spawn(TMPDIR=str(tmp))
    children = detached_children(s, s.kernel_pid())
    assert s.call("restart")[0].startswith("restarted:")
    assert all_gone(children) == []
    children = detached_children(s, s.kernel_pid())
    assert len(kernel_dirs(tmp)) == 1
    assert s.close(timeout=15) == 0
    assert all_gone(children) == []
    assert kernel_dirs(tmp) == []


@needs_proc
def test_a_launchers_command_line_is_short_and_says_what_it_is(srv):
    """The launcher's source is a file in the kernel's directory, not an argument that floods `ps`; the
    kernel forked from it shows the same short line."""
    kernel = srv.kernel_pid()
    for pid in (kernel, parent_of(kernel)):
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert b"loommux-kernel-launcher" in args and len(b" ".join(args)) < 1024, args
        assert args[args.index(b"-f") + 1] == bytes(kernel_connection_file(kernel))


@needs_proc
def test_detached_children_end_with_a_killed_kernel_or_launcher(spawn):
    s = spawn()
    children = detached_children(s, s.kernel_pid())
    kernel = s.kernel_pid()
    os.kill(kernel, signal.SIGKILL)  # the subreaper's child: the launcher takes the tree down
    assert all_gone(children) == []
    statuses_until_replaced(s, kernel)
    children = detached_children(s, s.kernel_pid())
    launcher = parent_of(s.kernel_pid())
    kernel = s.kernel_pid()
    # the subreaper itself: its orphans go to init, the server finds them by marker
    os.kill(launcher, signal.SIGKILL)
    assert all_gone([kernel, *children]) == []
    statuses_until_replaced(s, kernel)
    assert run(s, "1 + 1").body[-1].endswith("2")


@needs_proc
def test_adopted_orphans_are_reaped_and_exit_statuses_kept(spawn):
    s = spawn()
    orphan = child_pid_of(s, run(s, "import subprocess\n"
                                    "print(subprocess.run(['sh', '-c', 'sleep 0.5 & echo $!'], "
                                    "capture_output=True, text=True).stdout.strip())"))
    assert wait_until(lambda: not Path(f"/proc/{orphan}").exists(), 15), "an adopted orphan was left a zombie"
    waited = run(s, "import os, subprocess, time\nchild = subprocess.Popen(['sh', '-c', 'exit 7'])\n"
                    "time.sleep(1)\npid, status = os.waitpid(child.pid, 0)\n"
                    "print(os.waitstatus_to_exitcode(status))")
    assert waited.body == ["7"]  # the launcher never reaps what the cell's own code waits for


def kill_server_and_check_nothing_is_left(proc: subprocess.Popen, below: set[int], tmp: Path) -> None:
    """SIGKILL a server: every process below it and every kernel directory must go anyway."""
    proc.kill()
    proc.wait()
    assert all_gone(below, 15) == []
    assert wait_until(lambda: kernel_dirs(tmp) == [], 15), kernel_dirs(tmp)


@needs_proc
def test_a_sigkilled_server_leaves_no_process_and_no_directory(spawn, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    s = spawn(TMPDIR=str(tmp))
    child = child_pid_of(s, run(s, SLEEP_CHILD))
    children = [child, *detached_children(s, s.kernel_pid())]
    below = descendants(s.proc.pid)
    s.tracked_pids |= below
    assert set(children) <= below and len(kernel_dirs(tmp)) == 1
    kill_server_and_check_nothing_is_left(s.proc, below, tmp)


@needs_proc
def test_a_sigkilled_http_server_leaves_no_process_and_no_directory(http_spawn, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    server = http_spawn(TMPDIR=str(tmp))
    sessions = [HttpMcp(server, operator=operator) for operator in ("a", "b")]  # kept open: closing one
    children = []                                                               # would retire its kernel
    for session in sessions:
        children += [int(run(session, SLEEP_CHILD).body[0]),
                     *detached_children(session, status_kernel(session))]
    below = server.remember()
    assert set(children) <= below and len(kernel_dirs(tmp)) == 3  # two sessions' kernels and a spare
    kill_server_and_check_nothing_is_left(server.proc, below, tmp)
    for session in sessions:
        session.drop()


def start_time(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19]


@needs_proc
def test_a_starting_server_cleans_up_only_after_dead_servers(spawn, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    finished = subprocess.Popen(["true"])
    finished.wait()
    me = os.getpid()
    owners = {
        "dead": f"{finished.pid} 1 dead-marker",
        "reused": f"{me} {int(start_time(me)) + 1} reused-marker",  # our pid, not our start time: another's
        "live": f"{me} {start_time(me)} live-marker",
        "garbled": "not a pid",
        "unowned": None,  # being created, or not a kernel's
    }
    for name, owner in owners.items():
        (tmp / f"loommux-{name}").mkdir()
        (tmp / f"loommux-{name}" / "kernel.json").write_text("{}")
        if owner is not None:
            (tmp / f"loommux-{name}" / "owner").write_text(owner)
    # what the cells of a SIGKILLed server's SIGKILLed kernels left, and a live server's kernel's cell child
    left = {name: subprocess.Popen(["sleep", "1000"],
                                   env={**os.environ, "LOOMMUX_KERNEL_INSTANCE": f"{name}-marker"})
            for name in ("dead", "reused", "live")}
    try:
        s = spawn(TMPDIR=str(tmp))
        assert wait_until(lambda: not (tmp / "loommux-dead").exists()
                          and not (tmp / "loommux-reused").exists(), 15)
        s.kernel_pid()
        kept = {path.name for path in kernel_dirs(tmp)}
        assert {"loommux-live", "loommux-garbled", "loommux-unowned"} <= kept
        assert len(kept) == 4  # and the server's own kernel's
        assert left["dead"].wait(15) == -signal.SIGKILL and left["reused"].wait(15) == -signal.SIGKILL
        assert left["live"].poll() is None
    finally:
        for proc in left.values():
            proc.kill()
            proc.wait()


@pytest.fixture
def gw_spawn(spawn, gateway):
    """Fresh stdio servers whose kernels run on the gateway; after the test (the servers closed as a client
    closes them), no kernel is left there."""
    assert gateway.none_left(), gateway.kernels()
    servers: list[StdioServer] = []

    def _spawn(**env: str) -> StdioServer:
        servers.append(spawn(**{"LOOMMUX_GATEWAY_URL": gateway.url, "LOOMMUX_GATEWAY_TOKEN": GATEWAY_TOKEN,
                                **env}))
        return servers[-1]

    yield _spawn
    for server in servers:
        assert server.close(20) == 0, server.stderr_tail()
    assert gateway.none_left(), f"left on the gateway: {gateway.kernels()}"


@needs_gateway
def test_gateway_cells_namespace_wait_and_interrupt(gw_spawn, gateway):
    server = gw_spawn()
    assert run(server, "x = 41").state == "completed"
    cell = run(server, "print(x + 1)\nimport os\nos.environ['LOOMMUX_KERNEL_ID'].startswith('~')")
    assert cell.n == 2 and cell.body == ["42", "Out[2]: True"], cell.text
    host, kernel_id, state = gateway_kernel(server)
    assert (host, state) == (gateway.host, "idle") and gateway.kernels() == {kernel_id}
    # a cell outliving its wait, then wait
    slow = run_cell(server, "%%loommux --wait 0.2\nimport time\ntime.sleep(1.5)\nprint('slept')")
    assert slow.state == "running"
    done = finish(server, slow)
    assert (done.n, done.state, done.body) == (slow.n, "completed", ["slept"])
    # interrupt over REST
    sleeping = run_cell(server, "%%loommux --wait 0.2\nimport time\ntime.sleep(60)")
    text, is_error, _ = server.call("interrupt")
    assert not is_error and text.startswith("interrupt_sent"), text
    ended = finish(server, sleeping)
    assert ended.state == "interrupted" and "KeyboardInterrupt" in ended.text
    assert run(server, "print(x)").body == ["41"]


@needs_gateway
def test_gateway_kernel_publishes_functions_as_tools(gw_spawn):
    server = gw_spawn()
    run(server, PUBLISH_CELL)  # announced on IOPub, which the gateway relays over its WebSocket
    assert {"forecast", "divide"} <= {tool["name"] for tool in server.result("tools/list")["tools"]}
    result = server.result("tools/call", {"name": "forecast", "arguments": {"city": "Oslo"}})
    assert json.loads(result["content"][0]["text"]) == {"city": "Oslo", "highs": [20, 21], "unit": "C"}


@needs_gateway
def test_gateway_image_and_cell_header(gw_spawn):
    server = gw_spawn()
    code = (f"from IPython.display import Image, display\n"
            f"display(Image(data=__import__('base64').b64decode('{TINY_PNG}')))")
    result = server.result("tools/call", {"name": "run_cell", "arguments": {"code": code}})
    images = [c for c in result["content"] if c["type"] == "image"]
    assert len(images) == 1 and images[0]["mimeType"] == "image/png", result
    assert base64.b64decode(images[0]["data"]) == base64.b64decode(TINY_PNG)
    cell = run(server, "%%loommux --wait 30 --full-output\nfor i in range(3000):\n    print('row', i)")
    assert cell.state == "completed" and len(cell.body) == 3000 and cell.body[-1] == "row 2999"
    bad = tool_error(server, "run_cell", {"code": "%%loommux --wait never\n1"}, "invalid_cell_header")
    assert "--wait" in bad


@needs_gateway
def test_gateway_million_lines_arrive_whole_and_in_order(gw_spawn):
    server = gw_spawn()
    code = ("import sys\nfor k in range(100):\n"
            "    sys.stdout.write(''.join(f'{i}\\n' for i in range(k * 10_000, (k + 1) * 10_000)))\n"
            "    sys.stdout.flush()")
    cell = run(server, "%%loommux --wait 300\n" + code, timeout=400)
    assert cell.state == "completed", cell.text
    status = server.call("execution_status", {"execution": cell.n})[0]
    assert stream_counts(status, "stdout")[0] == 1_000_000, status
    header, _ = search(server, r"^\d+$", execution=cell.n, max_matches=1)
    assert "1,000,000 matching lines" in header, header
    # line n holds n - 1: nothing lost or moved
    for value in (0, 1, 4_999, 500_000, 777_777, 999_998, 999_999):
        assert search(server, f"^{value}$", execution=cell.n)[1] == [f"M {value + 1} | {value}"]
    assert read(server, execution=cell.n, line_range="123456:123460")[1] == [str(n)
                                                                             for n in range(123455, 123460)]
    assert "output dropped" not in status and lost_counts(status) == []


@needs_gateway
def test_gateway_counts_lost_messages(gw_spawn):
    """Through a gateway, the kernel's numbers are counted the same: its own requests (nudges, kernel_info)
    are not losses, a value that displays itself is not, skipped numbers are."""
    server = gw_spawn()
    for code in ("print('plain')",
                 "class Shows:\n    def _ipython_display_(self):\n        print('shown')\nShows()"):
        cell = run(server, code)
        assert cell.state == "completed" and lost_counts(cell.text) == [], cell.text
    cell = run(server, "k = get_ipython().kernel\nk.session.message_count += 4\nprint('skipped')")
    assert cell.body[0] == "skipped" and lost_counts(cell.text) == [4], cell.text
    assert lost_counts(server.call("execution_status", {"execution": cell.n})[0]) == [4]
    flood = run(server, "%%loommux --wait 120\n" + DISPLAY_FLOOD.format(count=20_000), timeout=300)
    status = server.call("execution_status", {"execution": flood.n})[0]
    assert stream_counts(status, "result")[0] == 20_000 and lost_counts(status) == [], status


@needs_gateway
def test_gateway_kernel_death_restart_and_outside_delete(gw_spawn, gateway):
    server = gw_spawn()
    assert run(server, "x = 1").n == 1
    _, first, _ = gateway_kernel(server)
    died = run(server, "%%loommux --wait 60\nimport os\nos._exit(3)")
    assert (died.n, died.state) == (2, "killed") and "[killed: kernel died" in died.text, died.text
    after = run(server, "print('fresh', 'x' in globals())")
    assert after.n == 3 and after.body == ["fresh False"], after.text
    replaced = kernel_replaced(died.text + "\n" + after.text)
    assert len(replaced) == 1 and replaced[0].startswith(f"Kernel replaced: kernel id {first} died"), replaced
    _, second, _ = gateway_kernel(server)
    assert second != first and wait_until(lambda: gateway.kernels() == {second}, 15), gateway.kernels()
    # restart: a fresh kernel, numbering kept, the old one deleted
    text, is_error, _ = server.call("restart")
    assert not is_error and text.startswith("restarted: new kernel id ") and f"(was {second})" in text, text
    assert "the next cell is execution 4" in text
    _, third, _ = gateway_kernel(server)
    assert gateway.kernels() == {third}
    assert run(server, "print('after restart')").n == 4
    # deleted from outside while a cell runs: the cell ends (interrupted or killed), a fresh kernel serves on
    sleeping = run_cell(server, "%%loommux --wait 0.5\nimport time\ntime.sleep(60)")
    assert gateway.api("DELETE", f"/api/kernels/{third}").status == 204
    ended = finish(server, sleeping)
    assert ended.state in ("interrupted", "killed"), ended.text
    assert run(server, "print('serving')").body == ["serving"]
    _, fourth, _ = gateway_kernel(server)
    assert fourth != third and wait_until(lambda: gateway.kernels() == {fourth}, 15), gateway.kernels()


@needs_gateway
def test_gateway_kernel_deleted_while_idle_is_replaced(gw_spawn, gateway):
    server = gw_spawn()
    assert run(server, "y = 2").n == 1
    _, first, _ = gateway_kernel(server)
    assert gateway.api("DELETE", f"/api/kernels/{first}").status == 204
    assert wait_until(lambda: "Kernel replaced" in server.call("status")[0]
                      or gateway_kernel(server)[1] != first, 15)
    cell = run(server, "print('y' in globals())")
    assert cell.n == 2 and cell.body == ["False"], cell.text


@needs_gateway
def test_gateway_down_or_refusing_is_kernel_unavailable(spawn, gateway):
    down = spawn(LOOMMUX_GATEWAY_URL=f"http://127.0.0.1:{free_port()}")
    text = tool_error(down, "run_cell", {"code": "1"}, "kernel_unavailable")
    assert "cannot reach the gateway at http://127.0.0.1:" in text, text
    status, is_error, _ = down.call("status")
    assert not is_error and "kernel: gateway 127.0.0.1:" in status and "· id none ·" in status, status
    assert "kernel_unavailable" in down.call("run_cell", {"code": "2"})[0]  # tried again, still down
    wrong = spawn(LOOMMUX_GATEWAY_URL=gateway.url, LOOMMUX_GATEWAY_TOKEN="not-the-token")
    text = tool_error(wrong, "run_cell", {"code": "1"}, "kernel_unavailable")
    assert "answered POST /api/kernels (kernelspec python3) with 401 Unauthorized" in text, text
    assert wrong.call("status")[1] is False
    unknown = spawn(LOOMMUX_GATEWAY_URL=gateway.url, LOOMMUX_GATEWAY_TOKEN=GATEWAY_TOKEN,
                    LOOMMUX_GATEWAY_KERNEL_NAME="no-such-kernelspec")
    text = tool_error(unknown, "run_cell", {"code": "1"}, "kernel_unavailable")
    assert "answered POST /api/kernels (kernelspec no-such-kernelspec) with " in text, text
    assert gateway.none_left()


@needs_gateway
def test_gateway_rate_limit_is_said(spawn, tmp_path):
    limited = KernelGateway(tmp_path / "limited-gateway.log",
                            "--ZMQChannelsWebsocketConnection.iopub_data_rate_limit=20000",
                            "--ZMQChannelsWebsocketConnection.rate_limit_window=1")
    try:
        server = spawn(LOOMMUX_GATEWAY_URL=limited.url, LOOMMUX_GATEWAY_TOKEN=GATEWAY_TOKEN)
        cell = run(server, "%%loommux --wait 120\nimport sys\nfor i in range(50):\n"
                           "    sys.stdout.write(''.join(f'{i} {j}\\n' for j in range(2000)))\n"
                           "    sys.stdout.flush()")
        assert cell.state == "completed", cell.text
        assert ("[output dropped by the gateway's IOPub rate limit: lines are missing from this output]"
                in cell.text)
        status = server.call("execution_status", {"execution": cell.n})[0]
        assert "warning: output dropped by the gateway's IOPub rate limit" in status.split("\n"), status
        assert (stream_counts(status, "stdout")[0] < 100_000
                and stream_counts(status, "stderr")[0] == 0), status
        assert "output dropped" not in run(server, "print('small')").text  # said for that execution only
        assert server.close(20) == 0
        assert limited.none_left()
    finally:
        limited.stop()


@needs_gateway
def test_gateway_kernels_answer_input_over_their_stdin_channel(gw_spawn):
    server = gw_spawn()
    created = stateless_task(server, "print('got', input('remote? '))")
    assert created["status"] == "input_required"
    (key, _), = task_get(server, created["taskId"])["inputRequests"].items()
    server.result("tasks/update", tasked({"taskId": created["taskId"], "inputResponses": {
        key: {"action": "accept", "content": {"input": "over the gateway"}}}}))
    done = until_task(server, created["taskId"])
    assert done["result"]["content"][0]["text"].split("\n")[1:] == ["got over the gateway"]
    assert "StdinNotImplementedError" in run(server, "input()").text  # without tasks: at once, as ever


@needs_gateway
def test_gateway_behind_an_http_server(http_spawn, gateway):
    assert gateway.none_left(), gateway.kernels()
    server = http_spawn("--gateway", gateway.url, "--gateway-token", GATEWAY_TOKEN, LOOMMUX_SPARE_KERNELS="1")
    with HttpMcp(server, operator="a") as a, HttpMcp(server, operator="b") as b, \
            HttpMcp(server, resource="team", operator="c") as c, \
            HttpMcp(server, resource="team", operator="d") as d:
        assert out(a, "v = 'a'\nprint(v)") == ["a"]
        assert out(b, "print('v' in globals())") == ["False"]
        assert out(c, "shared = 3") == ["(no output)"]
        assert out(d, "print(shared)") == ["3"]
        ids = {name: gateway_kernel(session)[1] for name, session in (("a", a), ("b", b), ("c", c), ("d", d))}
        assert ids["c"] == ids["d"] and len({ids["a"], ids["b"], ids["c"]}) == 3
        assert wait_until(lambda: len(gateway.kernels()) == 4, 15), gateway.kernels()  # and one warm spare
        assert set(ids.values()) < gateway.kernels()
        summaries = server.resources()
        assert {(r["kernel_location"], r["kernel_pid"], r["kernel_gateway"]) for r in summaries} == {
            ("gateway", None, gateway.host)}
        assert {r["kernel_id"] for r in summaries} == set(ids.values())
        # the in-kernel loommux object reaches this server's control plane from the remote kernel
        body = out(a, "import os\nprint(loommux.self.id == os.environ['LOOMMUX_KERNEL_ID'])\n"
                      "job = loommux['team'].run('print(shared * 2)', wait=30)\n"
                      "print(job.state, job.output())")
        assert body == ["True", "completed 6"], body
        # recycling a resource deletes its remote kernel
        rid = server.resource_of("b")["id"]
        assert server.api("POST", f"/api/resources/{rid}/recycle").status == 200
        assert wait_until(lambda: ids["b"] not in gateway.kernels(), 15), gateway.kernels()
    # a private resource is retired when its session ends, and its remote kernel deleted; a named one stays
    assert wait_until(lambda: gateway.kernels().isdisjoint({ids["a"], ids["b"]}), 15), gateway.kernels()
    assert ids["c"] in gateway.kernels()
    server.remember()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0, server.log()[-3000:]
    assert gateway.none_left(), f"left on the gateway: {gateway.kernels()}"


def self_signed_certificate(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1, its own CA, and its key."""
    cert, key = directory / "gateway-cert.pem", directory / "gateway-key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


@needs_gateway
@pytest.mark.skipif(shutil.which("openssl") is None, reason="the test certificate is made with openssl")
def test_gateway_over_https_checks_the_certificate(spawn, tmp_path):
    cert, key = self_signed_certificate(tmp_path)
    secure = KernelGateway(tmp_path / "tls-gateway.log", tls=(cert, key))
    try:
        env = {"LOOMMUX_GATEWAY_URL": secure.url, "LOOMMUX_GATEWAY_TOKEN": GATEWAY_TOKEN}
        untrusted = spawn(**env)
        text = tool_error(untrusted, "run_cell", {"code": "1"}, "kernel_unavailable")
        assert ("cannot reach the gateway at https://127.0.0.1:" in text
                and "CERTIFICATE_VERIFY_FAILED" in text), text
        trusted = spawn(LOOMMUX_GATEWAY_CA_FILE=str(cert), **env)
        assert run(trusted, "print('over tls')").body == ["over tls"]
        assert gateway_kernel(trusted)[0] == secure.host
        assert untrusted.close(20) == 0 and trusted.close(20) == 0
        assert secure.none_left()
    finally:
        secure.stop()


def ws_frame(fin: bool, opcode: int, payload: bytes) -> bytes:
    """A server frame (unmasked), with the 7-bit, 16-bit or 64-bit length form its size needs."""
    n = len(payload)
    length = bytes([n]) if n < 126 else bytes([126]) + n.to_bytes(2, "big") if n < 65536 else \
        bytes([127]) + n.to_bytes(8, "big")
    return bytes([(0x80 if fin else 0) | opcode]) + length + payload


async def read_client_frame(reader) -> tuple[int, bytes, bool]:
    first, second = await reader.readexactly(2)
    n = second & 0x7F
    if n >= 126:
        n = int.from_bytes(await reader.readexactly(2 if n == 126 else 8), "big")
    key = await reader.readexactly(4) if second & 0x80 else b""
    data = await reader.readexactly(n)
    return first & 0x0F, bytes(b ^ key[i % 4] for i, b in enumerate(data)) if key else data, bool(key)


@pytest.mark.fast
def test_websocket_client_handles_fragments_pings_binary_messages_and_close():
    """The gateway WebSocket client against a scripted server: a ping between the fragments of a
    message over 64 KiB, a message in jupyter_server's binary form, then a close."""
    sys.path.insert(0, str(ROOT))
    import loommux

    message = {"header": {"msg_type": "stream", "msg_id": "m1", "session": "k"}, "parent_header": {},
               "metadata": {}, "content": {"name": "stdout", "text": "x" * 70_000}, "channel": "iopub"}
    text = json.dumps(message).encode()
    body = json.dumps({**message, "content": {"data": {}}}).encode()
    binary = ((2).to_bytes(4, "big") + (12).to_bytes(4, "big") + (12 + len(body)).to_bytes(4, "big")
              + body + b"\0\1")
    seen: dict = {}

    async def serve(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        key = re.search(rb"Sec-WebSocket-Key: (\S+)", head)[1]
        accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
        writer.write(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
        seen["sent"] = await read_client_frame(reader)
        writer.write(ws_frame(False, 0x1, text[:100]) + ws_frame(True, 0x9, b"are you there")
                     + ws_frame(False, 0x0, text[100:70_000]) + ws_frame(True, 0x0, text[70_000:])
                     + ws_frame(True, 0x2, binary) + ws_frame(True, 0x8, (1000).to_bytes(2, "big")))
        seen["pong"] = await read_client_frame(reader)
        seen["close"] = await read_client_frame(reader)
        writer.close()

    async def scenario():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            ws = await loommux.Gateway(f"http://127.0.0.1:{port}").open_websocket("/api/kernels/k/channels")
            await ws.send_text("hello")
            received = [await ws.receive(), await ws.receive(), await ws.receive()]
            await ws.close()
            return received

    first, second, third = asyncio.run(scenario())
    assert json.loads(first) == message and loommux.decode_gateway_frame(first) == message
    assert isinstance(second, bytes) and loommux.decode_gateway_frame(second) == json.loads(body)
    assert third is None
    assert seen["sent"] == (0x1, b"hello", True)  # client frames are masked
    assert seen["pong"] == (0xA, b"are you there", True)
    assert seen["close"] == (0x8, (1000).to_bytes(2, "big"), True)


@pytest.mark.fast
def test_gateway_rest_calls_against_a_scripted_server():
    """REST calls (http.client) and a WebSocket handshake against a scripted server: the URL's base path kept,
    Host without the URL's credentials, the token sent, a chunked answer read whole; a non-HTTP answer,
    silence and a refused handshake each said as such."""
    sys.path.insert(0, str(ROOT))
    import loommux

    refusal = b'{"message": "Kernel does not exist: k1"}'
    answers = iter([
        (b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"
         b"9\r\n{\"id\": \"k\r\n3\r\n1\"}\r\n0\r\n\r\n"),
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
        None,  # no answer at all
        b"HTTP/1.1 404 Not Found\r\nContent-Length: %d\r\n\r\n%s" % (len(refusal), refusal),
    ])
    requests: list[tuple[bytes, bytes]] = []

    async def serve(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"Content-Length: (\d+)", head)
        requests.append((head, await reader.readexactly(int(length[1])) if length else b""))
        answer = next(answers)
        if answer is None:
            await reader.read()  # until the client gives up
        else:
            writer.write(answer)
        writer.close()

    async def scenario():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            gateway = loommux.Gateway(f"http://user:pw@127.0.0.1:{port}/base", token="t0k")
            created = await gateway.request("POST", "/api/kernels", {"name": "python3"})
            errors = []
            for call in (lambda: gateway.request("GET", "/api/kernels/k1"),
                         lambda: gateway.request("GET", "/api/kernels/k1", timeout=1),
                         lambda: gateway.open_websocket("/api/kernels/k1/channels?session_id=s")):
                with pytest.raises(loommux.GatewayError) as caught:
                    await call()
                errors.append(str(caught.value))
            return port, created, errors

    port, created, errors = asyncio.run(scenario())
    assert created == (201, {"id": "k1"})
    (post, body), (get, _), _, (upgrade, _) = requests
    assert post.startswith(b"POST /base/api/kernels HTTP/1.1\r\n") and json.loads(body) == {"name": "python3"}
    assert get.startswith(b"GET /base/api/kernels/k1 HTTP/1.1\r\n")
    assert upgrade.startswith(b"GET /base/api/kernels/k1/channels?session_id=s HTTP/1.1\r\n")
    for head in (post, get, upgrade):
        assert (f"\r\nHost: 127.0.0.1:{port}\r\n".encode() in head
                and b"\r\nAuthorization: token t0k\r\n" in head)
        assert b"user:pw" not in head
    assert errors[0].endswith(": a broken HTTP answer (BadStatusLine('SSH-2.0-OpenSSH_9.6\\r\\n'))"), \
        errors[0]
    assert errors[1].endswith(" did not answer GET /api/kernels/k1 within 1 s"), errors[1]
    assert errors[2].endswith(" answered GET /api/kernels/k1/channels with 404 Not Found: Kernel does not "
                              "exist: k1")


@pytest.fixture
def owned_kernel(jupyter_path):
    """A kernel a person owns: started by jupyter_client's KernelManager with a connection file in the
    runtime directory, and a client of theirs (username alice) on it."""
    from jupyter_client import KernelManager

    (jupyter_path / "runtime").mkdir(exist_ok=True)
    km = KernelManager(
        connection_file=str(jupyter_path / "runtime" / f"kernel-{os.getpid()}-{time.time_ns()}.json"))
    km.start_kernel()
    kc = km.client()
    kc.session.username = "alice"
    kc.start_channels()
    kc.wait_for_ready(60)
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)


def join_as_person(server: StdioServer, code: str) -> list[str]:
    """Join the server's kernel with the command status shows, as a person's client, and run a cell."""
    command = re.search(r"^join: (jupyter console --existing (.+))$", server.call("status")[0], re.MULTILINE)
    assert command and Path(command[2]).is_file(), command
    from jupyter_client import BlockingKernelClient

    kc = BlockingKernelClient(connection_file=command[2])
    kc.load_connection_file()
    kc.start_channels()
    try:
        kc.wait_for_ready(60)
        return person_runs(kc, code)
    finally:
        kc.stop_channels()


def person_runs(kc, code: str) -> list[str]:
    """What the person's own client prints for a cell it runs."""
    out: list[str] = []
    kc.execute_interactive(code, timeout=60, output_hook=lambda m: out.append(
        m["content"].get("text") or m["content"].get("data", {}).get("text/plain", "")))
    return "".join(out).split()


def test_attach_to_a_person_kernel_over_stdio(spawn, owned_kernel, jupyter_path):
    km, kc = owned_kernel
    person_runs(kc, "shared = 41")
    # a glob in the runtime directory, as jupyter console takes it
    name = Path(km.connection_file).name[:12] + "*"
    s = spawn(**kernel_env(jupyter_path, LOOMMUX_EXISTING=name))
    cell = run(s, "shared + 1\nagent = 7")
    assert cell.n == 1 and cell.body == ["(no output)"], cell
    assert run(s, "shared + 1").body == ["Out[2]: 42"]
    assert person_runs(kc, "print(agent)") == ["7"]  # both see the same variables
    # the person's client can see its idle before loommux's own subscriber does
    idle = "kernel: attached (not loommux's: --existing) · idle"
    assert wait_until(lambda: idle in s.call("status")[0], 30)
    status = s.call("status")[0]
    assert (f"join: jupyter console --existing {km.connection_file}" in status
            and "language: python 3" in status)
    text = tool_error(s, "restart", None, "kernel_not_owned")
    assert km.connection_file in text and "Kernel > Restart Kernel" in text
    running = run_cell(s, "%%loommux --wait 1\nimport time\ntime.sleep(60)")
    assert running.state == "running"
    text = s.call("interrupt")[0]
    assert f"execution {running.n} is now interrupted" in text, text
    assert s.close() == 0
    assert km.is_alive() and person_runs(kc, "print(shared)") == ["41"]  # loommux left it running


def test_cells_of_other_clients_are_recorded_and_make_run_cell_busy(spawn, owned_kernel, jupyter_path):
    km, kc = owned_kernel
    s = spawn(**kernel_env(jupyter_path, LOOMMUX_EXISTING=km.connection_file))
    assert run(s, "x = 1").n == 1
    kc.execute("import time\nfor i in range(3): print('person', i)\ntime.sleep(4)\nprint('done')")
    assert wait_until(lambda: "by another client (alice)" in s.call("status")[0], 30)
    text = tool_error(s, "run_cell", {"freeform": "x"}, "busy")
    assert text.startswith("busy: execution 2, by another client (alice), is still running"), text
    assert finish(s, Cell.parse(s.call("wait", {"execution": 2, "timeout_seconds": 30})[0])).body == [
        "person 0", "person 1", "person 2", "done"]
    assert s.call("execution_status", {"execution": 2})[0].startswith(
        "[execution 2 · completed · by another client (alice)]")
    assert matched_numbers(search(s, "person", execution=2)[1]) == [1, 2, 3]
    assert read(s, execution=2, line_range="-1:")[1] == ["done"]
    assert "2  completed" in s.call("status")[0]
    assert run(s, "x + 1").n == 3  # one sequence


def test_a_person_joins_the_agent_kernel_with_the_command_status_shows(spawn):
    s = spawn()
    assert run(s, "from_agent = 6").n == 1
    assert join_as_person(s, "from_person = from_agent * 7\nprint(from_person)") == ["42"]
    assert wait_until(lambda: "[by another client" in s.call("status")[0], 30)
    assert finish(s, Cell.parse(s.call("wait", {"execution": 2})[0])).body == ["42"]
    assert run(s, "from_person").body == ["Out[3]: 42"]


def test_a_person_restarting_or_stopping_the_kernel(spawn, owned_kernel, jupyter_path):
    km, _ = owned_kernel
    s = spawn(**kernel_env(jupyter_path, LOOMMUX_EXISTING=km.connection_file))
    assert run(s, "before = 1").n == 1
    km.restart_kernel(now=True)  # JupyterLab's Restart: the same connection file answers again
    notices: list[str] = []

    def rejoined() -> bool:
        text, is_error, _ = s.call("run_cell", {"freeform": "'before' in globals()"})
        notices.append(text)
        return not is_error

    assert wait_until(rejoined, 60, 0.3), notices[-1]
    said = "\n".join(notices)
    assert f"Kernel lost: the kernel at {km.connection_file} stopped" in said, said
    assert "Kernel reconnected" in said and "Out[" in notices[-1] and "False" in notices[-1]
    km.shutdown_kernel(now=True)  # the owner stops it for good
    assert wait_until(lambda: "lost: " in s.call("status")[0], 30)
    text = tool_error(s, "run_cell", {"freeform": "1"}, "kernel_unavailable")
    assert km.connection_file in text and "joins it again" in text
    assert s.close() == 0


def test_existing_and_kernelspec_settings(jupyter_path, owned_kernel, tmp_path):
    km, _ = owned_kernel
    env = kernel_env(jupyter_path)
    name = Path(km.connection_file).name
    stdio = settings_of(["--existing", name[:10]], **env).existing[None]
    assert (stdio.existing, stdio.runtime_dir) == (name[:10], jupyter_path / "runtime")
    assert loommux.find_connection_file(name[:10], jupyter_path / "runtime") == Path(km.connection_file)
    served = settings_of(["--server"], LOOMMUX_EXISTING=f"lab={km.connection_file},b={tmp_path}/x.json",
                         **env)
    assert sorted(served.existing) == ["b", "lab"]  # a bad file refuses only its resource, over HTTP
    with pytest.raises(loommux.StartupError, match="over HTTP, name the resource"):
        settings_of(["--server", "--existing", km.connection_file], **env)
    with pytest.raises(loommux.StartupError, match=f"{tmp_path}/x.json: no such connection file"):
        settings_of(["--existing", f"{tmp_path}/x.json"], **env)
    specs = settings_of(["--server", "--kernelspec", "bash", "--kernelspec", "r=ir"], **env).kernelspecs
    assert specs[None].name == "bash" and specs["r"].argv[0] == "R" and specs[None].interrupt_mode == "signal"
    assert settings_of([], LOOMMUX_KERNELSPEC="bash", **env).kernelspecs[None].language == "bash"
    gateway = settings_of(["--gateway", "http://gw", "--kernelspec", "ir"], **env)
    assert gateway.gateway.kernel_name == "ir" and gateway.kernelspecs == {}


@pytest.mark.fast
def test_zeromq_addresses_and_who_owns_a_source_s_kernels():
    assert loommux.make_zmq_url({"ip": "127.0.0.1"}, 5555) == "tcp://127.0.0.1:5555"
    assert loommux.make_zmq_url({"transport": "tcp", "ip": "10.0.0.2"}, 1) == "tcp://10.0.0.2:1"
    assert loommux.make_zmq_url({"transport": "ipc", "ip": "/tmp/loommux-x/k"}, 3) == "ipc:///tmp/loommux-x/k-3"
    assert loommux.KernelSource().owned and loommux.KernelSource().kernel_class is loommux.LaunchedKernel
    attached = loommux.KernelSource(existing="kernel-1.json")
    assert not attached.owned and attached.kernel_class is loommux.AttachedKernel


def free_tcp_ports(count: int) -> list[int]:
    return loommux.free_ports(count)


@pytest.mark.parametrize("case", ["missing", "not JSON", "unknown scheme", "wrong key", "nothing listens",
                                  "unreadable"])
def test_bad_connection_files_are_one_line_naming_the_file(spawn, owned_kernel, jupyter_path, tmp_path, case):
    km, _ = owned_kernel
    info = json.loads(Path(km.connection_file).read_text())
    path = tmp_path / "kernel-bad.json"
    if case == "not JSON":
        path.write_text("{not json")
    elif case == "unknown scheme":
        path.write_text(json.dumps({**info, "signature_scheme": "hmac-whirlpool"}))
    elif case == "wrong key":
        path.write_text(json.dumps({**info, "key": "0" * 64}))
    elif case == "nothing listens":
        ports = free_tcp_ports(5)
        path.write_text(json.dumps({**info, **{f"{c}_port": p for c, p in zip(loommux.CHANNELS, ports)}}))
    elif case == "unreadable":
        if os.geteuid() == 0:
            pytest.skip("root reads any file")
        path.write_text(json.dumps(info))
        path.chmod(0)
    s = spawn(initialize=False, **kernel_env(jupyter_path, LOOMMUX_EXISTING=str(path)))
    with contextlib.suppress(AssertionError):
        s.request("initialize", initialize_params("test_loommux"), timeout=30)
    assert s.proc.wait(30) in (1, 2)
    lines = [line for line in s.stderr_tail().splitlines() if line.strip()]
    assert len(lines) == 1 and str(path) in lines[0], lines
    reason = {"missing": "no such connection file", "not JSON": "not JSON",
              "unknown scheme": "unknown signature_scheme", "wrong key": "a wrong key?",
              "nothing listens": "no kernel answers", "unreadable": "cannot read"}[case]
    assert reason in lines[0] and info["key"] not in lines[0], lines
    assert km.is_alive()


def test_attach_over_http_is_the_named_resource_and_the_operator_sees_the_join(http_spawn, owned_kernel,
                                                                              jupyter_path, tmp_path):
    km, kc = owned_kernel
    person_runs(kc, "shared = 41")
    missing = tmp_path / "gone.json"
    server = http_spawn("--existing", f"lab={km.connection_file}", "--existing", f"broken={missing}",
                        **kernel_env(jupyter_path, LOOMMUX_SPARE_KERNELS="0", LOOMMUX_MAX_KERNELS="1"))
    assert f"{missing}: no such connection file" in server.log()
    with HttpMcp(server, resource="lab") as a, HttpMcp(server, resource="broken") as b, HttpMcp(server) as c:
        assert run(a, "shared + 1").body == ["Out[1]: 42"]
        status = a.call("status")[0]
        assert "kernel: attached" in status and "join:" not in status and km.connection_file not in status
        tool_error(a, "restart", None, "kernel_not_owned")
        text = tool_error(b, "run_cell", {"freeform": "1"}, "kernel_unavailable")
        assert f"{missing}: no such connection file" in text
        # the server still serves others; the cap (1) counts only it
        assert run(c, "1 + 1").body == ["Out[1]: 2"]
        lab = server.resource("lab")
        assert lab["kernel_location"] == "attached" and lab["kernel_connection_file"] == km.connection_file
        assert lab["kernel_join_command"] == f"jupyter console --existing {km.connection_file}"
        response = server.api("POST", "/api/resources/lab/restart")
        assert response.status == 409 and response.json()["error_code"] == "kernel_not_owned"
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    assert km.is_alive() and person_runs(kc, "print(shared)") == ["41"]


@functools.cache
def ir_missing() -> bool:
    """Whether R with IRkernel cannot run here: asked when a test first needs it, not on every import (R
    takes seconds to start, and `pytest -m fast` starts no process)."""
    return not shutil.which("R") or subprocess.run(["R", "--slave", "-e", "library(IRkernel)"], check=False,
                                                   capture_output=True).returncode != 0


# A condition string is evaluated only when a test carrying the mark is set up.
needs_r = pytest.mark.skipif("not os.environ.get('CI') and ir_missing()",
                             reason="R with IRkernel is not installed")


def other_language_cells(s: McpClient, language: str) -> None:
    """Numbering, streams, search, the header, interrupt and restart on a kernel that is not IPython."""
    echo, fail, stream, sleep = {  # bash_kernel runs bash on a terminal: its stderr comes as stdout
        "bash": ("echo {}", "echo oops >&2", "stdout", "sleep 60"),
        "R": ('cat("{}\\n")', 'message("oops")', "stderr", "Sys.sleep(60)"),
    }[language]
    first_text, is_error, _ = s.call("run_cell", {"freeform": echo.format("hello")})
    assert not is_error and Cell.parse(first_text).body[0] == "hello", first_text
    assert "this is not an IPython kernel" in first_text and "IPython-only and off here" in first_text
    start = Cell.parse(first_text).n
    for tool, args in (("namespace", {}), ("inspect", {"name": "x"}), ("reset", {})):
        assert f"this kernel is {language}" in tool_error(s, tool, args, "not_ipython")
    many = run(s, "\n".join(echo.format(f"line {i}") for i in range(1, 6)))
    assert many.n == start + 1 and many.body == [f"line {i}" for i in range(1, 6)]
    assert matched_numbers(search(s, "line [24]", execution=many.n)[1]) == [2, 4]
    run(s, fail)
    assert read(s, stream=stream)[1][0] == "oops"
    header = run(s, "%%loommux --wait 30\n" + echo.format("after the header"))
    assert header.body == ["after the header"], header  # the kernel never saw the header line
    if language == "R":  # it was sent blank: line numbers hold
        assert "<text>:2:" in run(s, "%%loommux --wait 30\nx <- (1 2)").text
    assert "forwarding a cell to another kernel is IPython-only" in tool_error(
        s, "run_cell", {"freeform": "%%loommux --kernel lab\n" + echo.format("x")}, "invalid_cell_header")
    running = run_cell(s, f"%%loommux --wait 1\n{sleep}")
    assert running.state == "running"
    assert "is now interrupted" in s.call("interrupt")[0]
    status = s.call("status")[0]
    assert f"language: {language}" in status and "not IPython" in status, status
    text = s.call("restart")[0]
    assert text.startswith("restarted: new kernel"), text
    assert run(s, echo.format("again")).n == running.n + 1


@pytest.mark.parametrize("language", ["bash", pytest.param("R", marks=needs_r)])
def test_other_languages_over_stdio(spawn, jupyter_path, language, tmp_path):
    startup = tmp_path / "startup.py"
    startup.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    s = spawn(**kernel_env(jupyter_path, LOOMMUX_KERNELSPEC={"bash": "bash", "R": "ir"}[language],
                           LOOMMUX_STARTUP=str(startup)))
    other_language_cells(s, language)
    assert not (tmp_path / "ran").exists()  # a Python startup file is for IPython kernels only
    if language == "R":
        plot = run(s, "plot(1:10)")
        assert ("image/png" in plot.text
                and "1 image" in s.call("execution_status")[0].replace("images: 1", "1 image"))
    assert s.close() == 0


@pytest.mark.parametrize("language", ["bash", pytest.param("R", marks=needs_r)])
def test_other_languages_over_http(http_spawn, jupyter_path, language):
    spec = {"bash": "bash", "R": "ir"}[language]
    server = http_spawn("--kernelspec", f"other={spec}",
                        **kernel_env(jupyter_path, LOOMMUX_SPARE_KERNELS="0"))
    with HttpMcp(server, resource="other") as a, HttpMcp(server) as python:
        other_language_cells(a, language)
        assert run(python, "import sys; sys.version_info[0]").body == ["Out[1]: 3"]
        assert server.resource("other")["kernel_language"].startswith(language)


def test_bad_kernelspecs(spawn, http_spawn, jupyter_path):
    s = spawn(initialize=False, **kernel_env(jupyter_path, LOOMMUX_KERNELSPEC="cobol"))
    assert s.proc.wait(30) == 2
    lines = [line for line in s.stderr_tail().splitlines() if line.strip()]
    assert (len(lines) == 1
            and "no kernelspec 'cobol' is installed; installed: bash, broken, ir, mute" in lines[0])
    server = http_spawn("--kernelspec", "broken=broken", "--kernelspec", "mute=mute",
                        **kernel_env(jupyter_path, LOOMMUX_SPARE_KERNELS="0"))
    with HttpMcp(server, resource="broken") as b, HttpMcp(server, resource="mute") as m:
        text = tool_error(b, "run_cell", {"freeform": "1"}, "kernel_unavailable")
        assert "cannot run the kernelspec's argv" in text and "no-such-kernel" in text, text
        text = tool_error(m, "run_cell", {"freeform": "1"}, "kernel_unavailable")
        assert "did not become ready within 30 s" in text, text
    with HttpMcp(server) as p:
        assert run(p, "1 + 1").body == ["Out[1]: 2"]  # the server still serves other resources
        leftovers = [pid for pid in descendants(server.proc.pid)
                     if b"sleep(600)" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert not leftovers  # the kernel that never answered was stopped


# ---------------------------------------------------------------- Output files


def output_file_of(server: McpClient, execution: int) -> Path:
    text, is_error, _ = server.call("execution_status", {"execution": execution})
    assert not is_error, text
    match = re.search(r"^output file: (.+)$", text, re.MULTILINE)
    assert match, text
    return Path(match[1])


@pytest.mark.fast
def test_a_log_in_a_file_reads_like_one_in_memory(tmp_path):
    rng = random.Random(7)
    writes = ["x" * 90, "é€😀\n", "line\n" * 40, "\r50%", "\x1b[31mred\x1b[0m\n", "a\r\n",
              "b" * 70_000 + "\n"]
    path = tmp_path / "1.txt"
    path.touch()
    memory, stored = loommux.Log(), loommux.Log(loommux.LogFile(str(path)))
    for _ in range(600):  # some 6 MB: many 64 KiB pieces, yet quick enough for the fast loop
        text = rng.choice(writes)
        memory.write(text)
        stored.write(text)
        if rng.random() < 0.05:
            assert stored.tail(5) == memory.tail(5)
    total = memory.line_count
    assert (stored.line_count, stored.chars, stored.utf8_bytes) == (total, memory.chars, memory.utf8_bytes)
    assert stored.text() == memory.text()
    assert path.read_text() + stored.open_line == memory.text() + ("\n" if not memory.open_line else "")
    assert all(piece is None for piece in stored._text.pieces)  # every committed piece is in the file alone
    for _ in range(60):
        first = rng.randint(0, total)
        stop = rng.randint(first, total + 2)
        start = rng.randint(0, memory.chars)
        assert stored.lines(first, stop) == memory.lines(first, stop)
        assert stored.span(start, start + 5000) == memory.span(start, start + 5000)
        assert stored.line_at(start) == memory.line_at(start)
    for query in ("line", r"^\d|€", "b{3}x?$"):
        compiled = loommux.compile_query(query, "regex", False)
        assert list(stored.matching_lines(compiled)) == list(memory.matching_lines(compiled))


@pytest.mark.fast
def test_a_log_s_file_is_read_in_runs_through_one_buffer(tmp_path):
    path = tmp_path / "1.txt"
    path.touch()
    log = loommux.Log(loommux.LogFile(str(path)))
    text = "".join(f"line {i:07d} {'é' * 60}\n" for i in range(40_000))  # 5 MB: runs of READ_RUN_BYTES
    log.write(text)
    log.flush()
    spans = list(log._text.iterate())
    assert len(spans) > 3 and "".join(span for span, _ in spans) == text
    starts = [sum(len(span) for span, _ in spans[:k]) for k in range(len(spans))]
    assert [start for _, start in spans] == starts
    fd = os.open(path, os.O_RDONLY)
    try:
        buffer = bytearray(64)
        view = loommux.pread_into(fd, 10, 5, buffer)
        assert view.obj is buffer and bytes(view) == b"0000000 \xc3\xa9"  # read into the buffer, no copy
        view.release()
        assert loommux.pread_into(fd, 100, 5, buffer) == path.read_bytes()[5:105]  # too big for it: bytes
    finally:
        os.close(fd)


@pytest.mark.fast
def test_a_log_whose_file_is_removed_or_full_keeps_the_rest_in_memory(tmp_path):
    told = []
    removed = tmp_path / "removed.txt"
    removed.touch()
    log = loommux.Log(loommux.LogFile(str(removed), told.append))
    log.write("".join(f"early {i}\n" for i in range(10_000)))
    assert log.line_count == 10_000
    removed.unlink()
    log.write("".join(f"late {i}\n" for i in range(10_000)))  # written to the removed file, which is noticed
    assert log.line_count == 20_000
    log.write("".join(f"last {i}\n" for i in range(10_000)))
    log.flush()
    assert log.lines(0, 1) == "early 0" and log.tail(1) == ["last 9999"]  # the file's pieces: through its fd
    assert log.lines(19_999, 20_001) == "late 9999\nlast 0"
    assert len(told) == 1 and "removed" in told[0].problem
    assert log.describe_in_memory().startswith("lines 20,001 on are kept in memory (cannot write ")
    never = loommux.Log(loommux.LogFile(str(tmp_path / "missing" / "1.txt"), told.append))
    never.write("kept\n" * 3)
    assert never.text() == "kept\nkept\nkept" and "No such file" in told[-1].problem
    assert never.describe_in_memory().startswith("lines 1 on are kept in memory")


def test_output_is_written_to_private_files_a_person_can_follow(spawn, tmp_path):
    parent = tmp_path / "made" / "output"
    server = spawn(LOOMMUX_OUTPUT_DIR=str(parent))
    cell = run(server, "import sys\nfor i in range(3000):\n    print(f'out {i}')\nsys.stdout.flush()\n"
                       "print('oops', file=sys.stderr, flush=True)\nprint('after')\n1 + 1")
    path = output_file_of(server, cell.n)
    own = path.parent.parent
    assert own.parent == parent and own.name.startswith("loommux-output-")
    lines = read(server, execution=cell.n, line_range="1:")[1]
    assert path.read_text().splitlines() == lines and lines[-3:] == ["oops", "after", "Out[1]: 2"]
    stdout = path.with_name(f"{cell.n}.stdout.txt").read_text().splitlines()
    assert stdout[0] == "out 0" and stdout[-1] == "after" and len(stdout) == 3001
    assert path.with_name(f"{cell.n}.stderr.txt").read_text() == "oops\n"
    for made in (own, path.parent):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert server.close() == 0
    assert parent.is_dir() and not own.exists()  # the server's own files go at a clean exit; DIR stays


def test_a_person_follows_a_running_cell_in_its_file(spawn, tmp_path):
    parent = tmp_path / "out"
    server = spawn(LOOMMUX_OUTPUT_DIR=str(parent))
    cell = run_cell(server, "%%loommux --wait 0.2\nimport time\ntime.sleep(1)\nprint('first', flush=True)\n"
                            "time.sleep(30)")
    assert cell.state == "running"

    def followed() -> list[str]:  # what tail -f shows, with no client reading meanwhile
        return [path.read_text() for path in parent.glob(f"loommux-output-*/*/{cell.n}.txt")]

    assert wait_until(lambda: followed() == ["first\n"], 15), followed()
    server.call("interrupt")


@pytest.mark.parametrize("kind", ["a file", "under a file", "not writable"])
def test_an_output_dir_that_cannot_be_used_refuses_to_start(tmp_path, kind):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    target = {"a file": blocker, "under a file": blocker / "sub", "not writable": tmp_path / "locked"}[kind]
    if kind == "not writable":
        target.mkdir(mode=0o500)
        if os.access(target, os.W_OK):  # root writes anywhere, but not in /proc
            target = Path("/proc/1")
    done = subprocess.run([sys.executable, str(LOOMMUX), "--output-dir", str(target)], cwd=tmp_path,
                          env=server_env(), stdin=subprocess.DEVNULL, capture_output=True, timeout=60,
                          check=False)
    assert done.returncode != 0 and done.stdout == b""
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1 and str(target) in lines[0] and "refused to start" in lines[0], lines


def test_a_file_size_limit_keeps_output_in_memory_with_a_notice(spawn, tmp_path):
    server = spawn(LOOMMUX_OUTPUT_DIR=str(tmp_path / "out"))
    resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (200_000, 200_000))
    cell = run(server, "for i in range(20_000):\n    print(f'line {i:06d}')")
    text = server.call("wait", {"execution": cell.n})[0]
    assert read(server, execution=cell.n, line_range="1:")[1] == [f"line {i:06d}" for i in range(20_000)]
    assert search(server, "line 019999", execution=cell.n)[0].startswith("[execution")
    status, _, _ = server.call("execution_status", {"execution": cell.n})
    assert re.search(r"^warning: output combined: lines [\d,]+ on are kept in memory \(cannot write .*"
                     r"(File too large|file size)", status, re.MULTILINE | re.IGNORECASE), status
    notices = server.call("status")[0] + cell.text + text
    assert "Output in memory: cannot write" in notices, notices
    notice = re.search(r"^Output in memory: .*?(?=In \[|$)", notices, re.MULTILINE)[0]  # a text block
    assert unvarying(notice) == unvarying(readme_samples()["output-in-memory"])


def test_a_removed_output_directory_loses_no_line_of_a_running_cell(spawn, tmp_path):
    parent = tmp_path / "out"
    server = spawn(LOOMMUX_OUTPUT_DIR=str(parent))
    cell = run_cell(server, "%%loommux --wait 0.5\nimport time\nfor i in range(40):\n"
                            "    print(f'tick {i}', flush=True)\n    time.sleep(0.1)\n"
                            "for i in range(5000):\n    print(f'after {i}')")
    assert cell.state == "running"
    shutil.rmtree(next(parent.glob("loommux-output-*")))  # the ticks so far are in its file
    cell = finish(server, cell)
    lines = read(server, execution=cell.n, line_range="1:")[1]
    assert lines == [f"tick {i}" for i in range(40)] + [f"after {i}" for i in range(5000)]
    notices = cell.text + server.call("status")[0]
    assert "Output in memory: cannot write" in notices and "removed" in notices, notices
    later = run(server, "print('still works')")
    assert read(server, execution=later.n)[1] == ["still works"]


def test_a_cell_after_its_output_dir_was_removed_says_its_output_is_in_memory(spawn, tmp_path):
    parent = tmp_path / "out"
    server = spawn(LOOMMUX_OUTPUT_DIR=str(parent))
    run(server, "print('on file')")
    shutil.rmtree(parent)  # --output-dir itself: no file can be made any more
    for code in ("print('in memory')", "for i in range(20_000):\n    print(f'line {i}')"):  # small, large
        cell = run(server, code)
        status = server.call("execution_status", {"execution": cell.n})[0]
        warnings = [line for line in status.split("\n") if line.startswith("warning: output")]
        assert len(warnings) == 1 and "kept in memory" in warnings[0], status
        assert "No such file or directory" in warnings[0] and "output file:" not in status, status
    assert read(server, execution=cell.n, line_range="-1:")[1] == ["line 19999"]


def test_output_whose_file_was_removed_after_its_cell_is_a_named_error(spawn, tmp_path):
    parent = tmp_path / "out"
    server = spawn(LOOMMUX_OUTPUT_DIR=str(parent))
    cell = run(server, "for i in range(20_000):\n    print(f'line {i}')")
    shutil.rmtree(next(parent.glob("loommux-output-*")))
    args = {"execution": cell.n, "line_range": "10000:10005"}
    text = tool_error(server, "read_output", args, "output_lost")
    assert f"{cell.n}.txt cannot be read (No such file or directory)" in text, text
    tool_error(server, "search_output", {"query": "line 19999", "execution": cell.n}, "output_lost")
    assert read(server, execution=run(server, "print('after')").n)[1] == ["after"]  # the server goes on


def test_the_next_start_sweeps_what_a_killed_server_left(spawn, tmp_path):
    parent = tmp_path / "out"
    killed = spawn(LOOMMUX_OUTPUT_DIR=str(parent))
    path = output_file_of(killed, run(killed, "print('left behind')").n)
    os.kill(killed.proc.pid, signal.SIGKILL)
    killed.proc.wait(10)
    assert path.exists()
    alive = spawn(LOOMMUX_OUTPUT_DIR=str(parent))
    assert wait_until(lambda: not path.parent.parent.exists(), 30)
    own = output_file_of(alive, run(alive, "print('mine')").n).parent.parent
    assert [p for p in parent.iterdir()] == [own]  # a live server's directory is never swept


def start_refused(*args: str, cwd: Path) -> str:
    """Start loommux with these arguments, which it refuses: the one line it says."""
    done = subprocess.run([sys.executable, str(LOOMMUX), *args], cwd=cwd, env=server_env(),
                          stdin=subprocess.DEVNULL, capture_output=True, timeout=60, check=False)
    lines = done.stderr.decode().splitlines()
    assert done.returncode == 2 and done.stdout == b"" and len(lines) == 1, (done.returncode, lines)
    assert "refused to start" in lines[0], lines
    return lines[0]


def test_a_state_dir_whose_output_holds_a_persons_files_refuses_to_start(tmp_path):
    output = tmp_path / "proj" / "output"
    (output / "results").mkdir(parents=True)
    (output / "results" / "r.csv").write_text("a,b\n1,2\n")
    (output / "plots").mkdir()
    line = start_refused("--server", "--state-dir", "proj", cwd=tmp_path)
    assert str(output) in line and "holds files loommux did not make" in line, line
    assert (output / "results" / "r.csv").read_text() == "a,b\n1,2\n" and (output / "plots").is_dir()
    assert sorted(p.name for p in output.iterdir()) == ["plots", "results"]


@pytest.mark.fast
def test_an_output_dir_an_earlier_loommux_kept_unmarked_is_taken_as_its_own(tmp_path):
    output = tmp_path / "proj" / "output"
    (output / "lab").mkdir(parents=True)
    for name in ("1.txt", "1.stdout.txt", "1.displays.jsonl", "executions.jsonl"):
        (output / "lab" / name).write_text("")
    assert loommux.open_kept_output(tmp_path / "proj") == output
    assert loommux.is_marked(str(output)) and loommux.is_marked(str(output / "lab"))
    (output / "lab" / "notes.md").write_text("mine")  # now marked: kept as it is, whatever it holds
    assert loommux.open_kept_output(tmp_path / "proj") == output
    (tmp_path / "other" / "output" / "empty").mkdir(parents=True)  # not one loommux made
    with pytest.raises(loommux.StartupError, match="holds files loommux did not make"):
        loommux.open_kept_output(tmp_path / "other")


@pytest.mark.parametrize("planted", ["state.lock", "state.json", "output"])
def test_a_link_in_a_state_dir_refuses_to_start_and_nothing_is_written_through_it(tmp_path, planted):
    state, victim = tmp_path / "state", tmp_path / "victim"
    state.mkdir(mode=0o700)
    if planted == "output":
        victim.mkdir()
        (victim / "mine.txt").write_text("kept")
    else:
        victim.write_text("kept")
    (state / planted).symlink_to(victim)
    line = start_refused("--server", "--state-dir", str(state), cwd=tmp_path)
    assert f"{state / planted} is a symbolic link" in line, line
    assert (victim / "mine.txt" if planted == "output" else victim).read_text() == "kept"
    if planted == "output":
        assert [p.name for p in victim.iterdir()] == ["mine.txt"]


def make_kept_files(tmp_path: Path, resource_id: str = "lab") -> loommux.OutputFiles:
    """A state directory's output directory, as loommux makes it, and a resource's files in it."""
    state = tmp_path / "state"
    state.mkdir(mode=0o700, exist_ok=True)
    output = loommux.open_output_directory(None, state)
    return output.files_for(resource_id, lambda problem: None)


@pytest.mark.fast
def test_loommux_removes_only_what_it_made_in_its_output_directories(tmp_path):
    files = make_kept_files(tmp_path)
    files.open(1, "combined", also="stdout")
    files.note({"n": 1, "begin": {}})
    directory = Path(files.directory)
    (directory / "notes.md").write_text("a person's")  # put beside loommux's files
    person = directory.parent / "results"  # a person's folder, named as a resource could be
    person.mkdir()
    (person / "1.txt").write_text("a person's")
    output = loommux.OutputDirectory(directory.parent, kept=True)
    output.keep_only(set())
    assert sorted(p.name for p in directory.iterdir()) == ["notes.md"]  # 1.txt, 1.stdout.txt, the journal
    assert (person / "1.txt").read_text() == "a person's"
    (directory / "notes.md").unlink()
    output.keep_only(set())  # the same directory, unmarked since: left alone
    assert directory.is_dir()
    # a server's own directory, once it exits: what it made goes, a person's file in it stays
    (tmp_path / "out").mkdir()
    own = loommux.open_output_directory(tmp_path / "out", None)
    made = own.files_for("lab", lambda problem: None)
    made.open(1, "combined")
    (own.path / "keep.txt").write_text("a person's")
    own.close()
    assert [p.name for p in own.path.iterdir()] == ["keep.txt"]


@pytest.mark.fast
def test_the_sweep_removes_only_directories_loommux_marked(tmp_path):
    where = tmp_path / "out"
    where.mkdir()
    unmarked = where / "loommux-output-mine"  # a person's, with a .lock nobody holds
    unmarked.mkdir()
    (unmarked / ".lock").write_text("")
    (unmarked / "1.txt").write_text("a person's")
    left = loommux.open_output_directory(where, None)  # as a server killed with SIGKILL leaves it
    left.files_for("lab", lambda problem: None).open(3, "combined")
    (left.path / "lab" / "data.csv").write_text("a person's")
    for fd in os.listdir("/proc/self/fd"):  # its lock, as the killed server's death releases it
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}") == str(left.path / ".lock"):
                os.close(int(fd))
    loommux.sweep_output_directories(where, where / "none")
    assert sorted(p.name for p in unmarked.iterdir()) == [".lock", "1.txt"]
    assert [p.relative_to(left.path).as_posix() for p in left.path.rglob("*")] == ["lab", "lab/data.csv"]


@pytest.mark.fast
def test_output_files_are_never_opened_through_a_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("kept")
    said = []
    files = loommux.OutputFiles(tmp_path / "state" / "lab", said.append, kept=True)
    Path(files.directory).mkdir(parents=True)
    for name in ("executions.jsonl", "2.displays.jsonl", "3.txt"):
        Path(files.path_of(name)).symlink_to(victim)
    files.note({"n": 1, "begin": {}})
    assert files.keep_display(2, {"data": {"text/html": "x" * 2000}}) is None
    assert files.open(3, "combined") is None
    assert victim.read_text() == "kept" and len(said) == 1 and "cannot write" in said[0], said
    assert files.read_journal() == [] and files.take_back(3) == {}  # a link is not read back either
    Path(files.path_of("executions.jsonl")).unlink()
    Path(files.path_of("executions.jsonl")).symlink_to("/dev/zero")
    assert files.read_journal() == []


@pytest.mark.fast
@pytest.mark.parametrize("stored, said", [
    ({"path": "/dev/zero", "offset": 0, "size": 2**31}, "not one of its directory's: '/dev/zero'"),
    ({"path": "../other/1.displays.jsonl", "offset": 0, "size": 5}, "not one of its directory's"),
    ({"path": "1.displays.jsonl", "offset": 0, "size": 2**31}, "does not hold 2147483648 bytes at 0"),
    ({"path": "1.displays.jsonl", "offset": -1, "size": 5}, "place is not one: -1, 5"),
    ({"path": "9.displays.jsonl", "offset": 0, "size": 5}, "cannot be read (No such file"),
], ids=clipped(8))
def test_a_journal_names_displays_only_in_its_own_directory_and_within_the_file(tmp_path, stored, said):
    files = make_kept_files(tmp_path)
    kept = files.keep_display(1, {"data": {"text/html": "x" * 2000}})
    assert kept.record() == {"path": "1.displays.jsonl", "offset": 0, "size": kept.size}
    assert files.find_stored(kept.record()) == kept
    assert files.find_stored({**kept.record(), "path": kept.path}) == kept  # a journal of before
    with pytest.raises(ValueError, match=re.escape(said)):
        files.find_stored(stored)
    end = {"state": "completed", "elapsed": 1.0, "rich": [{"stored": stored}]}
    begin = {"source": "1", "submitted_at": 1.0, "kernel_pid": None, "by": None, "options": {}}
    with pytest.raises(ValueError):
        loommux.restore_execution(1, begin, end, files)
    with pytest.raises(ValueError, match="its kernel_pid is 'x'"):
        loommux.restore_execution(1, {**begin, "kernel_pid": "x"}, {**end, "rich": []}, files)
    assert loommux.restore_execution(1, begin, {**end, "rich": [{"stored": kept.record()}]}, files).rich
    display = loommux.MARK_DISPLAY + 5 * loommux.MARK_PAYLOAD  # a display the record does not hold
    with pytest.raises(ValueError, match="a mark points to display 5 of 0"):
        loommux.restore_execution(1, begin, {**end, "rich": [], "marks": [display, 0, 0]}, files)
    for huge in (1e300, math.inf, math.nan, 10**30):  # never a time, size or count of ours
        with pytest.raises(ValueError, match="its submitted_at is"):
            loommux.restore_execution(1, {**begin, "submitted_at": huge}, {**end, "rich": []}, files)
    with open(kept.path, "r+b") as junk:  # a file of displays that holds something else there
        junk.write(b"#" * kept.size)
    with pytest.raises(loommux.OutputUnreadable, match="holds no display"):
        kept.load()


@pytest.mark.fast
def test_a_journal_gives_an_open_line_back_only_to_a_file_that_did_not_grow(tmp_path):
    files = make_kept_files(tmp_path)
    written = loommux.Log(files.open(1, "combined", also="stdout"))
    written.write("whole\nopen")
    written.flush()  # its file holds the whole line alone
    begin = {"source": "1", "submitted_at": 1.0, "kernel_pid": None, "by": None, "options": {}}

    def restored(open_lines: dict) -> str:
        end = {"state": "completed", "elapsed": 1.0, "open": open_lines}
        return loommux.restore_execution(1, begin, end, files).output.settled_text()

    assert restored({"combined": [6, "open"], "stdout": [6, "open"]}) == "whole\nopen"
    assert restored({"combined": [2, "open"]}) == "whole\n"  # the line was ended in the file since
    for bad in ({"combined": [6, "two\nlines"]}, {"other": [6, "open"]}, {"combined": "open"}):
        with pytest.raises(ValueError, match="open line of"):
            restored(bad)


@pytest.mark.fast
def test_a_read_never_takes_more_than_the_file_holds(tmp_path):
    path = tmp_path / "1.txt"
    path.write_bytes(b"12345")
    said = r"cut short under loommux \(it holds 5 bytes of 2,147,483,653\)"  # 2 GiB never asked of the disk
    with pytest.raises(loommux.OutputUnreadable, match=said):
        loommux.LogFile(str(path)).read(5, 2**31)
    os.mkfifo(tmp_path / "2.txt")
    with pytest.raises(loommux.OutputUnreadable, match="not a regular file"):
        loommux.LogFile(str(tmp_path / "2.txt")).read(0, 10)


# ---------------------------------------------------------------- Execution records


def test_a_failing_bash_command_ends_its_cell_in_error(http_spawn, jupyter_path):
    """bash_kernel reports a failing last command as an error without a name, its exit status the value:
    the cell ends in error, its line gives the exit status, and so does a cell forwarded there."""
    server = http_spawn("--kernelspec", "sh=bash", **kernel_env(jupyter_path, LOOMMUX_SPARE_KERNELS="0"))
    with HttpMcp(server, resource="sh") as s, HttpMcp(server) as python:
        assert run(s, "true").state == "completed"
        failed = run(s, "false")
        assert failed.state == "error" and failed.body == ["exit status 1"], failed.text
        missing = run(s, "ls /nonexistent")
        assert missing.state == "error" and missing.body[-1] == "exit status 2", missing.text
        assert "No such file or directory" in missing.body[0], missing.text
        text = s.call("execution_status", {"execution": missing.n})[0]
        assert text.startswith(f"[execution {missing.n} · error]") and "\nerror: exit status 2\n" in text
        assert read(s, execution=failed.n, stream="traceback")[1] == ["exit status 1"]
        assert run(s, "echo fine").state == "completed"
        forwarded = run(python, "%%loommux --kernel sh\nfalse")
        said = f"ForwardedCellError: execution {failed.n + 3} in kernel sh ended with exit status 1"
        assert forwarded.state == "error" and forwarded.body[-1] == said, forwarded.text


def encoded_image(fmt: str, size: tuple[int, int], frames: int = 1, **options) -> bytes:
    """An image as Pillow writes it (several frames: an animation)."""
    image_module = pytest.importorskip("PIL.Image")
    images = [image_module.new("RGBA" if options.pop("alpha", False) else "RGB", size, colour)
              for colour in ("red", "green", "blue")[:frames]]
    buffer = io.BytesIO()
    extra = {"save_all": True, "append_images": images[1:]} if frames > 1 else {}
    images[0].save(buffer, fmt, **extra, **options)
    return buffer.getvalue()


@pytest.mark.fast
@pytest.mark.parametrize("mime, fmt, options, size, dimensions", [
    ("image/png", "PNG", {}, (40, 30), (40, 30, 1)),
    ("image/jpeg", "JPEG", {}, (50, 20), (50, 20, 1)),
    ("image/jpeg", "JPEG", {"progressive": True}, (50, 20), (50, 20, 1)),
    ("image/gif", "GIF", {}, (8, 6), (8, 6, 1)),
    ("image/gif", "GIF", {"frames": 3}, (8, 6), (8, 6, 3)),
    ("image/webp", "WEBP", {}, (24, 12), (24, 12, 1)),  # VP8
    ("image/webp", "WEBP", {"lossless": True}, (24, 12), (24, 12, 1)),  # VP8L
    ("image/webp", "WEBP", {"alpha": True}, (24, 12), (24, 12, 1)),  # VP8X
    ("image/webp", "WEBP", {"frames": 3}, (8, 6), (8, 6, 2)),  # VP8X, animated: "more than one"
])
def test_image_headers(mime, fmt, options, size, dimensions):
    assert loommux.measure_image(mime, encoded_image(fmt, size, **options)) == dimensions


PNG_HEADER = b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR\0\0\0\x28\0\0\0\x1e"  # 40×30
GIF_HEADER = b"GIF89a\x08\x00\x06\x00\x00\x00\x00"  # 8×6, no colour table


@pytest.mark.fast
@pytest.mark.parametrize("mime, raw, message", [
    ("image/png", b"GIF89a" + b"\0" * 20, "not a PNG file"),
    ("image/png", PNG_HEADER.replace(b"IHDR", b"IDAT"), "not a PNG file"),
    ("image/gif", PNG_HEADER, "not a GIF file"),
    ("image/gif", GIF_HEADER + b"\x99", "corrupt GIF block"),
    ("image/gif", GIF_HEADER + b"\x2c" + b"\0" * 9, "truncated GIF"),
    ("image/jpeg", PNG_HEADER, "not a JPEG file"),
    ("image/jpeg", b"\xff\xd8" + b"\0" * 20, "corrupt JPEG segment"),
    ("image/jpeg", b"\xff\xd8\xff\xd9", "no JPEG frame header"),
    ("image/webp", b"RIFF\0\0\0\0WEBX", "not a WebP file"),
    ("image/webp", b"RIFF\0\0\0\0WEBPVP8 " + b"\0" * 20, "unknown WebP layout"),
    ("image/webp", b"RIFF\0\0\0\0WEBPVP8X" + b"\0" * 8, "unknown WebP layout"),  # too short
], ids=clipped())
def test_bad_image_headers(mime, raw, message):
    with pytest.raises(ValueError) as raised:
        loommux.measure_image(mime, raw)
    assert str(raised.value) == message


GIF_FRAME = b"\x2c" + b"\0" * 11  # an image descriptor, its LZW code size and an empty data block


PNG_DATA = base64.b64encode(PNG_HEADER).decode()
NOT_SENT = {
    "base64": "corrupt base64 data; display the image again",
    "corrupt": "corrupt image (not a PNG file); save it to a file and check it",
    "detail": 'detail "medium" is not low, high or original; display it again with one of those',
    "animated": ("animated images are not supported; display one frame as PNG, or save the animation to "
                 "a file"),
    "size": ("over the 10.0 MiB limit per image; display it smaller (lower dpi or size, or JPEG) or save it "
             "to a file"),
}


@pytest.mark.fast
@pytest.mark.parametrize("mime, payload, metadata, facts", [
    ("image/png", PNG_DATA, {}, (40, 30, 24, "high", None)),
    ("image/png", PNG_DATA[:10] + "\n " + PNG_DATA[10:], {"detail": "low"}, (40, 30, 24, "low", None)),
    ("image/png", PNG_DATA, {"image/png": {"detail": "original"}}, (40, 30, 24, "original", None)),
    ("image/png", "not*base64!", {}, (0, 0, 8, "high", NOT_SENT["base64"])),
    ("image/png", base64.b64encode(b"\x89PNG").decode(), {}, (0, 0, 4, "high", NOT_SENT["corrupt"])),
    ("image/png", PNG_DATA, {"detail": "medium"}, (40, 30, 24, "medium", NOT_SENT["detail"])),
    ("image/gif", base64.b64encode(GIF_HEADER + GIF_FRAME * 2 + b"\x3b").decode(), {},
     (8, 6, 38, "high", NOT_SENT["animated"])),
    ("image/png", base64.b64encode(PNG_HEADER + bytes(10 << 20)).decode(), {},
     (40, 30, 24 + (10 << 20), "high", NOT_SENT["size"])),
], ids=clipped())
def test_images_are_checked(mime, payload, metadata, facts):
    image = loommux.make_image(2, mime, payload, metadata)
    assert (image.width, image.height, image.size, image.detail, image.problem) == facts


@pytest.mark.fast
def test_image_captions():
    assert loommux.make_image(2, "image/png", PNG_DATA, {}).caption == "[image/png 40×30 · 24 B · display 2]"
    refused = loommux.make_image(3, "image/png", "not*base64!", {}).caption
    assert refused == f"[image/png · 8 B · display 3 · not sent: {NOT_SENT['base64']}]"


def test_exception_is_an_execution_state(srv):
    cell = run(srv, "def f():\n    return 1 / 0\nf()")
    assert cell.state == "error" and "ZeroDivisionError" in cell.text
    assert "\x1b" not in cell.text
    _, tb = read(srv, execution=cell.n, stream="traceback")
    assert any("ZeroDivisionError" in line for line in tb)
    text, is_error, _ = srv.call("execution_status", {"execution": cell.n})
    assert not is_error and text.startswith(f"[execution {cell.n} · error]") and "ZeroDivisionError" in text
    assert "\nerror: ZeroDivisionError: division by zero\n" in text, text


def test_stderr_stream(srv):
    cell = run(srv, "import sys\nprint('to-err', file=sys.stderr)\nprint('to-out')")
    assert read(srv, execution=cell.n, stream="stderr")[1] == ["to-err"]
    assert read(srv, execution=cell.n, stream="stdout")[1] == ["to-out"]
    assert sorted(read(srv, execution=cell.n)[1]) == ["to-err", "to-out"]


@pytest.mark.timeout(300)
def test_million_lines_arrive_complete_and_in_order(srv):
    cell = run(srv, "for i in range(1_000_000):\n    print(i)", timeout=240)
    assert cell.state == "completed" and "output omitted: 1,000,000 lines" in cell.text
    status, _, _ = srv.call("execution_status", {"execution": cell.n})
    assert stream_counts(status, "stdout")[0] == 1_000_000
    assert stream_counts(status, "combined")[0] == 1_000_000
    header, lines = read(srv, execution=cell.n, stream="stdout", line_range="-1:")
    assert "of 1,000,000]" in header and lines == ["999999"]
    _, lines = read(srv, execution=cell.n, stream="stdout")
    assert lines == [str(i) for i in range(1_000_000)]


@pytest.mark.timeout(300)
def test_display_flood_keeps_every_message(srv):
    cell = run(srv, DISPLAY_FLOOD.format(count=100_000), timeout=240)
    assert cell.state == "completed" and "output omitted: 100,000 lines" in cell.text, cell.text[:500]
    assert lost_counts(cell.text) == [] and "never arrived" not in cell.text
    status, _, _ = srv.call("execution_status", {"execution": cell.n})
    assert stream_counts(status, "result")[0] == 100_000 and "never arrived" not in status, status
    _, lines = read(srv, execution=cell.n, stream="result")
    assert lines == [f"d{i}" for i in range(100_000)]


def test_skipped_message_numbers_are_counted_as_lost(srv):
    """Numbers the kernel's session skips are messages that never arrive: counted per execution, said once in
    the result and in execution_status."""
    code = ("k = get_ipython().kernel\nprint('before')\nk.session.message_count += 7\nprint('between')\n"
            "k.session.message_count += 5\nprint('after')")
    cell = run(srv, code)
    assert cell.body[:3] == ["before", "between", "after"] and lost_counts(cell.text) == [12], cell.text
    status, _, _ = srv.call("execution_status", {"execution": cell.n})
    assert lost_counts(status) == [12], status
    later = run(srv, "print('clean')")
    assert later.body == ["clean"] and lost_counts(later.text) == []
    assert lost_counts(srv.call("execution_status", {"execution": later.n})[0]) == []
    assert lost_counts(srv.call("execution_status", {"execution": cell.n})[0]) == [12]


def test_messages_for_others_are_not_lost(srv):
    """Numbers the kernel uses for messages we never see, rightly: a value that displays itself (the
    displayhook begins an execute_result it never sends), replies to another client's requests on control
    (answered at once) and on shell (queued behind the cell)."""
    shown = run(srv, "class Shows:\n    def _ipython_display_(self):\n        print('shown')\nShows()")
    assert shown.body == ["shown"] and lost_counts(shown.text) == [], shown.text
    code = """from ipykernel.connect import get_connection_file
from jupyter_client import BlockingKernelClient
other = BlockingKernelClient(connection_file=get_connection_file())
other.load_connection_file()
other.start_channels()
for attempt in range(60):  # until its IOPub sees the idle of one of its requests
    request = other.session.msg("kernel_info_request")
    other.control_channel.send(request)
    assert other.control_channel.get_msg(timeout=30)["content"]["status"] == "ok"
    try:
        while True:
            msg = other.get_iopub_msg(timeout=1)
            if msg["parent_header"].get("msg_id") == request["header"]["msg_id"] and \
                    msg["content"].get("execution_state") == "idle":
                break
        break
    except Exception:
        continue
other.kernel_info()  # on shell: answered after this cell
print('asked', attempt + 1)
"""
    asked = run(srv, code)
    assert asked.state == "completed" and asked.body[0].startswith("asked "), asked.text
    assert lost_counts(asked.text) == [], asked.text
    after = run(srv, "other.stop_channels()\nprint('done')")
    assert after.body == ["done"] and lost_counts(after.text) == [], after.text
    for n in (shown.n, asked.n, after.n):
        assert lost_counts(srv.call("execution_status", {"execution": n})[0]) == [], n


def raw_blocks(content: list[dict]) -> list[tuple]:
    """Content blocks of a raw JSON result as (type, text or data, mimeType, detail)."""
    return [(b["type"], b.get("text", b.get("data")), b.get("mimeType"), (b.get("_meta") or {}).get("detail"))
            for b in content]


def test_images_in_output_order_retained_and_captioned(srv):
    result = srv.result("tools/call", {"name": "run_cell", "arguments": {"freeform": IMAGE_CELL}},
                        timeout=120)
    assert not result["isError"] and "structuredContent" not in result
    check_image_blocks(raw_blocks(result["content"]))
    n = Cell.parse(result["content"][0]["text"]).n
    # retained with the execution: a later wait returns the same blocks, images included
    again = srv.result("tools/call", {"name": "wait", "arguments": {"execution": n}})
    assert again["content"] == result["content"]
    # in the text streams each image is one caption line
    header, lines = read(srv, execution=n)
    assert header == f"[execution {n} · combined · lines 1-11 of 11]"
    assert lines[0] == "before" and lines[2] == "middle" and lines[-1] == "after"
    assert [caption(line)[5] for line in lines[1:2] + lines[3:10]] == [str(i) for i in range(1, 9)]
    assert len(read(srv, execution=n, stream="result")[1]) == 8
    found = srv.call("search_output", {"query": "not sent", "execution": n})[0]
    assert found.split("\n")[0] == (f'[execution {n} · combined · regex (auto) "not sent" · 4 matching '
                                    'lines · 4 matches]')
    assert "images: 8" in srv.call("execution_status", {"execution": n})[0].split("\n")


def test_matplotlib_plots_are_image_blocks_between_text(srv):
    code = ("%%loommux --wait 120\nimport matplotlib.pyplot as plt\nprint('plotting')\n"
            "plt.plot([1, 2, 3], [1, 4, 9])\nplt.show()\nprint('shown')")
    content = srv.result("tools/call", {"name": "run_cell", "arguments": {"freeform": code}},
                         timeout=150)["content"]
    assert [block["type"] for block in content] == ["text", "image", "text"], content
    head, plotting, shown_caption = content[0]["text"].split("\n")
    assert Cell.parse(head).state == "completed" and plotting == "plotting"
    assert caption(shown_caption).group(1, 5, 6) == ("image/png", "1", None)
    assert content[1]["mimeType"] == "image/png" and content[1]["_meta"] == {"detail": "high"}
    assert base64.b64decode(content[1]["data"]).startswith(b"\x89PNG")
    assert content[2]["text"] == "shown"

    code = "fig, ax = plt.subplots()\nax.plot([3, 2, 1])\nfig"  # a figure as the last expression
    content = srv.result("tools/call", {"name": "run_cell", "arguments": {"freeform": code}},
                         timeout=120)["content"]
    assert content[0]["type"] == "text" and content[1]["type"] == "image", content
    assert all(block["mimeType"] == "image/png" for block in content if block["type"] == "image")
    assert caption(content[0]["text"].split("\n")[1])[1] == "image/png"


def test_result_size_of_a_1000x1000_png(srv, capsys):
    """The figure the lead asked for: what one 1000×1000 PNG costs in a result (printed)."""
    plot = """%%loommux --wait 120
import base64, io
import numpy as np
from IPython.display import display
from matplotlib.figure import Figure
fig = Figure(figsize=(10, 10), dpi=100)
ax = fig.add_subplot()
x = np.linspace(0, 20, 2000)
ax.plot(x, np.sin(x) * np.exp(-x / 10), label='damped sine')
ax.grid(True)
ax.legend()
buffer = io.BytesIO()
fig.savefig(buffer, format='png', dpi=100)
display({'image/png': base64.b64encode(buffer.getvalue()).decode()}, raw=True)"""
    noise = """%%loommux --wait 120
import base64, io
import numpy as np
from IPython.display import display
from PIL import Image as PILImage
pixels = np.random.default_rng(0).integers(0, 256, (1000, 1000, 3), dtype=np.uint8)
buffer = io.BytesIO()
PILImage.fromarray(pixels).save(buffer, 'PNG')
display({'image/png': base64.b64encode(buffer.getvalue()).decode()}, raw=True)"""
    report = []
    for label, code in [("matplotlib line plot", plot), ("random RGB noise (worst case)", noise)]:
        message = srv.request("tools/call", {"name": "run_cell", "arguments": {"freeform": code}},
                              timeout=150)
        content = message["result"]["content"]
        images = [block for block in content if block["type"] == "image"]
        assert len(images) == 1 and caption(content[0]["text"].split("\n")[1]).group(2, 3) == ("1000", "1000")
        png = len(base64.b64decode(images[0]["data"]))
        result = len(json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode()) + 1  # its line
        report.append(f"1000×1000 PNG, {label}: PNG {png:,} B, JSON-RPC result {result:,} B "
                      f"({result / png:.2f}× the PNG)")
    with capsys.disabled():
        print("\n" + "\n".join(report))


def test_a_traceback_that_is_not_text_still_ends_the_cell(srv):
    done = run(srv, "class Odd(Exception):\n    def _render_traceback_(self):\n        return [1, 2]\n"
                    "raise Odd('x')")
    assert done.state == "error"
    assert run(srv, "'still serving'").body[-1].endswith("'still serving'")


def test_output_printed_after_the_cell_finished_is_kept(srv):
    cell = run(srv, "import threading, time\n"
                    "threading.Thread(target=lambda: (time.sleep(1), print('LATE LINE'))).start()\n"
                    "print('cell done')")
    assert cell.state == "completed"
    assert wait_until(lambda: "LATE LINE" in read(srv, execution=cell.n)[1], 15)
    assert "LATE LINE" in finish(srv, Cell.parse(srv.call("wait", {"execution": cell.n})[0])).text


DIVERGING_CELL = r"""import sys
from IPython.display import display
print("out 1"); sys.stdout.flush()
sys.stdout.write("partial ")
sys.stdout.flush()
sys.stderr.write("err 1\n"); sys.stderr.flush()
print("out 2"); sys.stdout.flush()
display("shown")
print("out 3")
1 / 0
"""


def test_streams_keep_their_own_text_once_combined_diverges(srv):
    """combined starts as stdout's own log; the first other output splits them, losing nothing."""
    cell = run(srv, DIVERGING_CELL)
    streams = {stream: read(srv, execution=cell.n, stream=stream)[1]
               for stream in ("combined", "stdout", "stderr", "result", "traceback")}
    assert streams["stdout"] == ["out 1", "partial out 2", "out 3"]
    assert streams["stderr"] == ["err 1"]
    assert streams["result"] == ["'shown'"]
    assert streams["traceback"][-1].startswith("ZeroDivisionError")
    combined = streams["combined"]
    assert combined[:5] == ["out 1", "partial err 1", "out 2", "'shown'", "out 3"]
    assert combined[5:] == streams["traceback"]
    assert matched_numbers(search(srv, "^out", execution=cell.n)[1]) == [1, 3, 5]
    assert matched_numbers(search(srv, "^out", execution=cell.n, stream="stdout")[1]) == [1, 3]


def test_a_retained_output_is_stored_about_once(spawn):
    """A 16 MB stdout-only output used to cost the server twice its size (stdout and combined)."""
    s = spawn()
    run(s, "1 + 1")
    s.call("search_output", {"query": "2", "query_mode": "regex"})  # one-time costs: worker threads
    before = server_rss(s)
    cell = run(s, "import sys\n"
                  "_ = sys.stdout.write(''.join(f'{i:06d} {\"x\" * 72}\\n' for i in range(200_000)))")
    assert matched_numbers(search(s, r"^1234\d\d ", execution=cell.n)[1]) == list(range(123401, 123501))
    assert server_rss(s) - before < 1.4 * 200_000 * 80


SMALL_CELL = ("%%loommux --wait 30\nimport sys\nprint('out é', flush=True)\n"
              "print('err', file=sys.stderr, flush=True)\n"
              "sys.stdout.write('open line'); sys.stdout.flush()\n42")


def test_an_old_execution_is_whole_after_many_later_ones(srv):
    """A finished cell's record is kept small, and everything the tools say of it stays the same."""
    small = run(srv, SMALL_CELL)
    big = run(srv, "print('\\n'.join(f'big {i}' for i in range(1000)))")  # too big to be kept as one string
    failed = run(srv, "print('before', flush=True)\n1 / 0")
    assert small.body == ["out é", "err", "open line", f"Out[{small.n}]: 42"]

    def answers(cell: Cell) -> dict:
        calls = {f"read {stream}": ("read_output", {"stream": stream}) for stream in
                 ("combined", "stdout", "stderr", "result", "traceback")}
        calls.update(status=("execution_status", {}), wait=("wait", {}),
                     tail=("read_output", {"line_range": "-2:"}),
                     search=("search_output", {"query": "e", "context_after": 1}))
        return {name: srv.call(tool, {**args, "execution": cell.n}) for name, (tool, args) in calls.items()}

    before = {cell.n: answers(cell) for cell in (small, big, failed)}
    for i in range(300):
        run(srv, f"print({i})")
    assert {cell.n: answers(cell) for cell in (small, big, failed)} == before
    assert read(srv, execution=small.n, stream="stdout")[1] == ["out é", "open line"]
    assert read(srv, execution=small.n, stream="stderr")[1] == ["err"]
    assert read(srv, execution=small.n, stream="result")[1] == ["42"]
    assert read(srv, execution=small.n, stream="traceback")[0].endswith("no lines]")
    counts = [stream_counts(before[small.n]["status"][0], stream)[:2] for stream in ("combined", "stdout")]
    assert counts == [(4, sum(len(line) + 1 for line in small.body)), (2, len("out é\nopen line"))]
    assert "options: wait=30 s" in before[small.n]["status"][0]
    assert read(srv, execution=big.n, line_range="-1:")[1] == ["big 999"]
    assert read(srv, execution=failed.n, stream="traceback")[1][-1].startswith("ZeroDivisionError")
    assert matched_numbers(search(srv, "^big 99[89]$", execution=big.n)[1]) == [999, 1000]


def test_output_after_the_end_of_a_small_cell_goes_on_its_streams(srv):
    """A small finished output kept as text alone takes later output (a thread the cell left) as before."""
    cell = run(srv, "import sys, threading, time\n"
                    "def late():\n    time.sleep(0.5)\n    print('late err', file=sys.stderr, flush=True)\n"
                    "    print('late out', flush=True)\n"
                    "threading.Thread(target=late).start()\nprint('early', flush=True)")
    assert cell.body == ["early"]
    assert wait_until(lambda: read(srv, execution=cell.n)[1] == ["early", "late err", "late out"], 15)
    assert read(srv, execution=cell.n, stream="stdout")[1] == ["early", "late out"]
    assert read(srv, execution=cell.n, stream="stderr")[1] == ["late err"]
    # a carriage return at the end still overwrites the line when the next output comes
    cell = run(srv, "import sys, threading, time\n"
                    "threading.Thread(target=lambda: (time.sleep(0.5), print('done', flush=True))).start()\n"
                    "sys.stdout.write(' 50%\\r'); sys.stdout.flush()")
    assert wait_until(lambda: read(srv, execution=cell.n)[1] == ["done"], 15), read(srv, execution=cell.n)


# ---------------------------------------------------------------- Instances


@pytest.mark.fast
def test_minted_ids_carry_their_instance_before_the_first_dot():
    handle, task = loommux.mint_id("eu-1", 16, "~"), loommux.mint_id("eu-1", 24)
    assert re.fullmatch(r"~eu-1\.[A-Za-z0-9_-]{22}", handle)
    assert re.fullmatch(r"eu-1\.[A-Za-z0-9_-]{32}", task)
    assert [loommux.find_minting_instance(v, "~") for v in (handle, "~", "~AAAA", "eu-1.x")] == [
        "eu-1", None, None, None]
    assert [loommux.find_minting_instance(v) for v in (task, "default", "team.a", "~eu-1.x")] == [
        "eu-1", None, "team", None]  # only a handle starts with ~
    stray = loommux.explain_unknown_id("session", "~b.x", "a")
    assert stray == "session ~b.x was not minted by any loommux instance"
    assert re.fullmatch(loommux.INSTANCE_NAME_RE, loommux.make_instance_name())
    other = loommux.explain_unknown_id("session", "b.xyz", "a")
    assert other.startswith("session b.xyz was minted by loommux instance b, and this is instance a")
    assert "restarted without its state" in loommux.explain_unknown_id("task", "a.xyz", "a")
    assert loommux.explain_unknown_id("task", "xyz", "a") == "task xyz was not minted by any loommux instance"
    long = loommux.explain_unknown_id("task", "b." + "x" * 100_000, "a")  # quoted back clipped
    assert len(long) < 300 and "minted by loommux instance b" in long


def test_ids_carry_the_instance_and_another_instances_are_refused_naming_it(http_server):
    instance = http_server.api("GET", "/api/health").json()["instance"]
    assert re.fullmatch(r"[0-9a-f]{6}", instance)  # none was set: a random one
    stateless = StatelessHttp(http_server)
    handle = handle_of(stateless.call("run_cell", {"freeform": "1", "kernel": "~"})[0])
    assert handle.startswith(f"~{instance}.")
    task = stateless.request("tools/call", tasked(run_params(SLEEPER.format(seconds=0.5))))["result"]
    assert task["taskId"].startswith(f"{instance}."), task
    with HttpMcp(http_server) as session:
        assert session.session_id.startswith(f"{instance}.")
    other = "zz-9"
    text, is_error, _ = stateless.call("status", {"kernel": f"~{other}.{'A' * 22}"})
    assert is_error and text.startswith(f"kernel_not_found: kernel ~{other}.{'A' * 22} was minted by loommux "
                                        f"instance {other}, and this is instance {instance}"), text
    error = stateless.send("tasks/get", tasked({"taskId": f"{other}.{'A' * 32}"})).json()["error"]
    assert error["code"] == -32602 and f"minted by loommux instance {other}" in error["message"], error
    stray = HttpMcp(http_server, initialize=False)
    stray.session_id = f"{other}.{'A' * 32}"
    response = stray.post(jsonrpc("tools/list", {}, id=1))
    assert response.status == 404 and f"minted by loommux instance {other}" in response.body.decode()
    stray.drop()


needs_nginx = pytest.mark.skipif(not NGINX.exists() and not os.environ.get("CI"),
                                 reason="Debian's nginx is not installed")


class Nginx:
    """Debian's nginx as this user, serving README's configuration verbatim but for its ports: its own on an
    ephemeral one, and each instance's where that instance listens. It stands in for a server for the test
    clients (port, proc, url)."""

    def __init__(self, base: Path, ports: dict[str, int]):
        base.mkdir(parents=True, exist_ok=True)
        self.base, self.port = base, free_port()
        self.proc = subprocess.Popen(nginx_command(base, self.port, ports), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        assert wait_until(self.answers, 30, 0.05), self.log()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/mcp"

    def log(self) -> str:
        path = self.base / "error.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def answers(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
            return True
        except OSError:
            return self.proc.poll() is not None

    def get(self, path: str) -> HttpResponse:
        conn = RawHttp(self.port)
        try:
            return conn.request("GET", path, {"Connection": "close"})
        finally:
            conn.close()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Fleet:
    """Instances a, b and c behind one nginx."""

    instances: dict[str, LoommuxHttp]
    nginx: Nginx
    base: Path

    def start(self, name: str, *args: str, port: int = 0, **env: str) -> LoommuxHttp:
        """Start (or start again) instance `name`, on `port` when given (the one nginx knows it by)."""
        workspace = self.base / name
        workspace.mkdir(exist_ok=True)
        server = LoommuxHttp(workspace, self.base / f"{name}.log",
                             http_env(LOOMMUX_SPARE_KERNELS="0", **env),
                             ("--instance", name, *(("--port", str(port)) if port else ()), *args))
        self.instances[name] = server.wait_ready()
        return server

    def kill(self, name: str) -> None:
        server = self.instances[name]
        server.remember()
        server.proc.kill()
        server.proc.wait(20)


@contextlib.contextmanager
def fleet_of(base: Path, *args: str, **env: str) -> Iterator[Fleet]:
    fleet = Fleet({}, None, base)  # type: ignore[arg-type]
    try:
        for name in ("a", "b", "c"):
            fleet.start(name, *args, **env)
        fleet.nginx = Nginx(base / "nginx", {name: s.port for name, s in fleet.instances.items()})
        yield fleet
    finally:
        if fleet.nginx is not None:
            fleet.nginx.stop()
        for server in fleet.instances.values():
            server.cleanup()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if not NGINX.exists():
        pytest.skip("Debian's nginx is not installed")
    with fleet_of(tmp_path_factory.mktemp("fleet")) as fleet:
        yield fleet


def instance_of(client, **args) -> str:
    """Which instance's kernel answers a call: the port its control plane is on, as the kernel knows it."""
    text = client.call("run_cell", {"freeform": "import os\nos.environ['LOOMMUX_CONTROL_URL']", **args})[0]
    return re.search(r"http://127\.0\.0\.1:(\d+)", text)[1]


@needs_nginx
def test_nginx_routes_names_by_hash_and_minted_ids_to_their_instance(fleet):
    ports = {str(server.port): name for name, server in fleet.instances.items()}
    stateless = StatelessHttp(fleet.nginx)
    # nginx hashes a name over the instances' addresses, whose ports change from run to run: names are added
    # until each instance owns one (8 names leave one instance without any in about one run of nine)
    owners: dict[str, str] = {}
    for i in range(24):
        owners[f"team-{i}"] = ports[instance_of(stateless, kernel=f"team-{i}")]
        if i >= 7 and len(set(owners.values())) == len(ports):
            break
    names = list(owners)
    assert len(set(owners.values())) > 1, owners  # the names spread over the instances
    assert all(ports[instance_of(stateless, kernel=name)] == owner for name, owner in owners.items())
    for name, owner in owners.items():  # each name lives on the one instance the hash gave it
        holding = {i for i in "abc" if any(r["id"] == name for r in fleet.nginx.get(f"/{i}/api/resources")
                                           .json()["resources"])}
        assert holding == {owner}, (name, holding)
    # a call without a kernel is the name default; an initialize naming a kernel joins its owner
    default = ports[instance_of(stateless, kernel="default")]
    assert ports[instance_of(stateless)] == default
    with HttpMcp(fleet.nginx, resource=names[0]) as joined:
        assert joined.session_id.startswith(f"{owners[names[0]]}.")
        assert ports[instance_of(joined)] == owners[names[0]]
    # handles, sessions and tasks go to the instance that minted them
    for _ in range(3):
        handle = handle_of(stateless.call("run_cell", {"freeform": "mine = 1", "kernel": "~"})[0])
        minter = handle[1]
        assert all(ports[instance_of(stateless, kernel=handle)] == minter for _ in range(2))
        task = stateless.request("tools/call", tasked(run_params(SLEEPER.format(seconds=0.4), kernel=handle)))
        task_id = task["result"]["taskId"]
        assert task_id.startswith(f"{minter}.") and until_task(stateless, task_id)["status"] == "completed"
        wrong = next(server for name, server in fleet.instances.items() if name != minter)
        text, is_error, _ = StatelessHttp(wrong).call("status", {"kernel": handle})
        assert is_error and f"was minted by loommux instance {minter}" in text, text
    with HttpMcp(fleet.nginx) as session:
        minter = session.session_id.split(".")[0]
        assert all(ports[instance_of(session)] == minter for _ in range(2))
        stream = session.open_stream()  # the GET stream goes there too
        stream.close()
        # its calls go to its instance whatever kernel they name: a name that lives there works, and one
        # that does not is never opened there (its hash may put it on another instance)
        here = next(name for name, owner in owners.items() if owner == minter)
        assert ports[instance_of(session, kernel=here)] == minter
        text, is_error, _ = session.call("run_cell", {"freeform": "1", "kernel": "nowhere-yet"})
        said = f"kernel_not_found: kernel nowhere-yet is not on loommux instance {minter}, and this session"
        assert is_error and text.startswith(said), text
    assert not any(r["id"] == "nowhere-yet" for i in "abc" for r in fleet.nginx.get(f"/{i}/api/resources")
                   .json()["resources"])
    # a 2026-07-28 request's Mcp-Session-Id is ignored, by nginx as by loommux: the name still routes it
    for name, owner in list(owners.items())[:3]:
        other = next(i for i in "abc" if i != owner)
        stray = StatelessHttp(fleet.nginx, {"Mcp-Session-Id": f"{other}.{'z' * 32}"})
        assert ports[instance_of(stray, kernel=name)] == owner
    # each instance's /api and console under its name; /b redirects there; other paths say where things are
    assert fleet.nginx.get("/b/api/health").json()["instance"] == "b"
    console = fleet.nginx.get("/c/")
    assert console.status == 200 and b"loommux" in console.body
    redirect = fleet.nginx.get("/b")
    assert (redirect.status, redirect.headers["location"]) == (301, "/b/")
    for path in ("/d/api/health", "/mcp/", "/"):
        missing = fleet.nginx.get(path)
        assert missing.status == 404 and missing.json()["error_code"] == "not_found", (path, missing)


@needs_nginx
@pytest.mark.anyio
async def test_nginx_serves_the_official_client_in_both_eras(fleet):
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    # a handshake session joins the named kernel at initialize, so that nginx takes it to the name's instance
    joining = httpx2.AsyncClient(headers={"X-Loommux-Resource": "official"},
                                 timeout=httpx2.Timeout(30, read=60))
    for mode, server in (("legacy", streamable_http_client(fleet.nginx.url, http_client=joining)),
                         ("auto", fleet.nginx.url)):
        async with Client(server, mode=mode, read_timeout_seconds=60) as client:
            first = await client.call_tool("run_cell", {"freeform": "shared = 41", "kernel": "official"})
            again = await client.call_tool("run_cell", {"freeform": "shared + 1", "kernel": "official"})
            assert not first.is_error and again.content[0].text.endswith("42"), again
    holding = [i for i in "abc" if any(r["id"] == "official" for r in fleet.nginx.get(f"/{i}/api/resources")
                                       .json()["resources"])]
    assert len(holding) == 1, holding


@needs_nginx
def test_nginx_says_an_instance_is_down_and_moves_nothing(fleet):
    """Last of this section's fleet tests: it stops instance b, then starts a new b (without its state)."""
    ports = {str(server.port): name for name, server in fleet.instances.items()}
    stateless = StatelessHttp(fleet.nginx)
    on_b = next(f"down-{i}" for i in range(100) if ports[instance_of(stateless, kernel=f"down-{i}")] == "b")
    elsewhere = next(f"up-{i}" for i in range(100) if ports[instance_of(stateless, kernel=f"up-{i}")] != "b")
    handles: dict[str, str] = {}
    while len(handles) < 2 or "b" not in handles:  # a handle b minted, and another's
        handle = handle_of(stateless.call("run_cell", {"freeform": "1", "kernel": "~"})[0])
        handles.setdefault(handle[1], handle)
    session = HttpMcp(fleet.nginx)
    while not session.session_id.startswith("b."):  # a session b minted
        session.close()
        session = HttpMcp(fleet.nginx)
    b_port = fleet.instances["b"].port
    fleet.kill("b")
    for response in (stateless.send("tools/call", tool_params("run_cell", {"freeform": "1", "kernel": on_b})),
                     stateless.send("tools/call", tool_params("status", {"kernel": handles["b"]})),
                     session.post(session.message("tools/call", tool_params("status", {})))):
        error = response.json()["error"]
        assert response.status == 503 and "loommux instance b is down" in error["message"], response
    # the rest carries on: other kernels, and whatever is nobody's yet
    assert ports[instance_of(stateless, kernel=elsewhere)] != "b"
    other = next(h for i, h in handles.items() if i != "b")
    assert not stateless.call("status", {"kernel": other})[1]
    for _ in range(4):
        assert stateless.call("status", {"kernel": "~"})[0]
        assert stateless.result("tools/list")["tools"]
        with HttpMcp(fleet.nginx) as fresh:
            assert not fresh.session_id.startswith("b.")
    assert not any(r["id"] == on_b for i in "ac" for r in fleet.nginx.get(f"/{i}/api/resources")
                   .json()["resources"])  # never moved
    # b again, without its state: its old ids are refused naming it, and its names start afresh there
    fleet.start("b", port=b_port)
    text, is_error, _ = stateless.call("status", {"kernel": handles["b"]})
    assert is_error and "restarted without its state" in text, text
    assert session.post(session.message("tools/call", tool_params("status", {}))).status == 404
    session.drop()
    assert ports[instance_of(stateless, kernel=on_b)] == "b"


FLEET_KINDS = ("modern-named", "modern-handle", "modern-task", "session-private", "session-named")


@dataclass
class FleetWorker:
    """One of the fleet test's clients: its own kernel (so that no cell of another makes it busy), a variable
    `v` that says whose namespace answers, and `seen`, every step the kernel ran."""

    n: int
    kind: str
    nginx: Nginx
    client: Any = None
    kernel: str | None = None  # a 2026-07-28 client's kernel argument
    instance: str = ""
    done: list[int] = field(default_factory=list)  # the steps that succeeded
    errors: list[tuple[float, str]] = field(default_factory=list)

    def start(self, ports: dict[str, str]) -> None:
        if self.kind.startswith("modern"):
            self.client = StatelessHttp(self.nginx)
            self.kernel = f"fleet-{self.n}"
            if self.kind == "modern-handle":
                self.kernel = handle_of(self.client.call("run_cell", {"freeform": "1", "kernel": "~"})[0])
        else:
            named = f"fleet-{self.n}" if self.kind == "session-named" else None
            self.client = HttpMcp(self.nginx, resource=named)
        assert f"({self.n}, 0)" in self.run(f"v, seen = {self.n}, []\n(v, len(seen))")
        self.instance = ports[instance_of(self.client, **self.args)]

    @property
    def args(self) -> dict:
        return {"kernel": self.kernel} if self.kernel else {}

    def run(self, code: str) -> str:
        if self.kind != "modern-task":
            text, is_error, _ = self.client.call("run_cell", {"freeform": code, **self.args})
            assert not is_error, text
            return text
        created = self.client.request("tools/call", tasked(run_params(
            f"%%loommux --wait 0.05\nimport time\ntime.sleep(0.2)\n{code}", **self.args)))["result"]
        task = created["resultType"] == "task"
        result = until_task(self.client, created["taskId"])["result"] if task else created
        assert not result["isError"], result
        return result["content"][0]["text"]

    def work(self, stop: threading.Event) -> None:
        k = 0
        while not stop.is_set():
            k += 1
            try:
                text = self.run(f"seen.append({k})\n(v, len(seen))")
                assert f"({self.n}, " in text, text
                self.done.append(k)
            except Exception as exc:  # noqa: BLE001 - recorded: only an instance that was down may see one
                self.errors.append((time.monotonic(), f"{type(exc).__name__}: {exc}"[:300]))
                if isinstance(self.client, HttpClient):
                    self.client.drop()
                time.sleep(0.2)
            time.sleep(0.1)


@needs_nginx
@needs_gateway
def test_three_instances_on_one_gateway_and_one_killed_and_restarted_with_its_state(gateway, tmp_path):
    before = gateway.kernels()
    args, env = ("--gateway", gateway.url, "--state-dir", "state"), {"LOOMMUX_GATEWAY_TOKEN": GATEWAY_TOKEN}
    with fleet_of(tmp_path, *args, **env) as fleet:
        ports = {str(server.port): name for name, server in fleet.instances.items()}
        workers = [FleetWorker(n, FLEET_KINDS[n % len(FLEET_KINDS)], fleet.nginx) for n in range(30)]
        with concurrent.futures.ThreadPoolExecutor(3) as starting:  # 30 kernels at once would crowd 2 CPUs
            list(starting.map(lambda w: w.start(ports), workers))
        with concurrent.futures.ThreadPoolExecutor(len(workers)) as pool:
            on_b = [w for w in workers if w.instance == "b"]
            assert on_b and len(on_b) < len(workers), [w.instance for w in workers]
            stop = threading.Event()
            running = [pool.submit(w.work, stop) for w in workers]
            time.sleep(5)
            b_port = fleet.instances["b"].port
            killed = time.monotonic()
            fleet.kill("b")  # SIGKILL, mid-run
            time.sleep(1)
            fleet.start("b", *args, port=b_port, **env)
            back = {w.n: len(w.done) for w in on_b}
            assert wait_until(lambda: all(len(w.done) >= back[w.n] + 3 for w in on_b), 90), [
                (w.n, w.kind, w.errors[-1:]) for w in on_b]
            time.sleep(2)
            stop.set()
            for future in running:
                future.result()
        for w in workers:  # clients of the other instances never saw an error
            assert w.instance == "b" or not w.errors, (w.n, w.kind, w.instance, w.errors[:3])
            assert all(at >= killed for at, _ in w.errors), (w.n, w.errors[:3])
        # every kernel answers with its namespace: v, and every step it ran
        for w in workers:
            text = w.run(f"print(v, sorted(set(seen)) == sorted(seen), set(seen) >= set({w.done!r}))")
            assert f"{w.n} True True" in text, (w.n, w.kind, w.instance, text)
        assert all(w.errors for w in on_b if w.kind.startswith("modern"))  # b was down while they ran
        log = fleet.instances["b"].log()  # b took back each of its kernels
        assert log.count("joined gateway kernel") == len(on_b) and "to take back" in log, log
        # each named kernel on one instance, each kernel once on the gateway
        resources = [r for name in "abc"
                     for r in fleet.nginx.get(f"/{name}/api/resources").json()["resources"]]
        names = [r["name"] for r in resources if r["kind"] == "named"]
        ids = [r["kernel_id"] for r in resources]
        assert len(names) == len(set(names)) and len(ids) == len(set(ids)) and None not in ids, resources
        assert set(ids) == gateway.kernels() - before
    assert gateway.kernels() == before


# ---------------------------------------------------------------- Tasks


@pytest.mark.fast
def test_the_task_board_alone_tells_watchers_and_subscribers_of_a_change():
    board = loommux.TaskBoard("a")
    first, second, third = (loommux.Task(f"a.{n}", None, None, None, 10_000, False) for n in "123")
    heard: list = []
    unwatch = board.watch(first, heard.append)
    board.watch(first, heard.append)  # given twice, told once
    board.watch(second, heard.append)()  # stopped at once

    async def listen() -> list:
        with board.subscribe([first, third]) as queue:
            board.cancel(first, now=True)
        board.cancel(third, now=True)  # after the subscription ended
        return [queue.get_nowait() for _ in range(queue.qsize())]

    assert asyncio.run(listen()) == [first]
    board.cancel(second, now=True)
    unwatch()
    assert heard == [first] and [task.status for task in (first, second, third)] == ["cancelled"] * 3


RUNNING_MESSAGE_RE = re.compile(r"In \[(\d+)\] running · [^·]+ · [\d,]+ lines?( · last: .*)?")


def test_stateless_tasks_only_for_cells_that_outlive_the_wait_of_a_declaring_request(srv):
    quick = {"name": "run_cell", "arguments": {"freeform": "21 * 2"}}
    plain = srv.result("tools/call", stateless_params(quick))
    declared = srv.result("tools/call", tasked(quick))
    assert declared["resultType"] == "complete" and not declared["isError"]
    for result in (plain, declared):  # the same plain result, whether the extension was declared or not
        cell = Cell.parse(result["content"][0]["text"])
        assert cell.body == [f"Out[{cell.n}]: 42"] and set(result) == set(plain)
    # a request that did not declare the extension never gets a task
    running = srv.result("tools/call", stateless_params(run_params(SLEEPER.format(seconds=1.5))))
    assert (running["resultType"] == "complete"
            and Cell.parse(running["content"][0]["text"]).state == "running")
    n = Cell.parse(running["content"][0]["text"]).n
    srv.call("wait", {"execution": n})
    task = stateless_task(srv, SLEEPER.format(seconds=1.5))
    assert task["status"] == "working" and RUNNING_MESSAGE_RE.fullmatch(task["statusMessage"]), task
    n = int(RUNNING_MESSAGE_RE.fullmatch(task["statusMessage"])[1])
    assert task["taskId"] != str(n)
    # one task per execution: a wait that outlives its timeout returns the same task
    again = srv.result("tools/call",
                       tasked({"name": "wait", "arguments": {"execution": n, "timeout_seconds": 0.1}}))
    assert again["resultType"] == "task" and again["taskId"] == task["taskId"]
    assert task_get(srv, task["taskId"])["status"] == "working"
    done = until_task(srv, task["taskId"])
    check_task_shape(done)
    assert done["status"] == "completed" and done["resultType"] == "complete"
    waited = srv.result("tools/call", stateless_params({"name": "wait", "arguments": {"execution": n}}))
    assert done["result"] == waited and waited["content"][0]["text"].endswith("slept 1.5")
    # a cell that raised is completed, showing that state as wait does
    failing = stateless_task(srv, "%%loommux --wait 0.2\nimport time\ntime.sleep(0.5)\n1 / 0")
    failed = until_task(srv, failing["taskId"])
    assert failed["status"] == "completed" and "· error:" in failed["result"]["content"][0]["text"]
    assert "ZeroDivisionError" in failed["result"]["content"][0]["text"] and not failed["result"]["isError"]


def test_stateless_task_results_keep_images_and_structured_data(spawn):
    server = spawn(LOOMMUX_RESULT_MODE="structured")
    code = ("%%loommux --wait 0.2\nimport base64, time\nfrom IPython.display import Image, display\n"
            "time.sleep(0.6)\n"
            f"print('before')\ndisplay(Image(data=base64.b64decode('{TINY_PNG}')))\nprint('after')")
    task = stateless_task(server, code)
    done = until_task(server, task["taskId"])
    n = int(RUNNING_MESSAGE_RE.fullmatch(task["statusMessage"])[1])
    waited = server.result("tools/call", stateless_params({"name": "wait", "arguments": {"execution": n}}))
    assert done["result"] == waited
    assert [block["type"] for block in waited["content"]] == ["text", "image", "text"]
    assert waited["structuredContent"]["state"] == "completed" and waited["structuredContent"]["images"] == 1


def test_stateless_task_cancel_interrupts_the_cell(srv):
    task = stateless_task(srv, SLEEPER.format(seconds=60))
    assert srv.result("tasks/cancel", tasked({"taskId": task["taskId"]})) == {
        "resultType": "complete",
        "_meta": {"io.modelcontextprotocol/serverInfo": srv.init_result["serverInfo"]}}
    cancelled = until_task(srv, task["taskId"])
    assert cancelled["status"] == "cancelled" and "interrupted" in cancelled["statusMessage"], cancelled
    assert "result" not in cancelled and "error" not in cancelled
    n = int(RUNNING_MESSAGE_RE.fullmatch(task["statusMessage"])[1])
    assert Cell.parse(srv.call("wait", {"execution": n})[0]).state == "interrupted"
    # still {}
    assert srv.result("tasks/cancel", tasked({"taskId": task["taskId"]}))["resultType"] == "complete"


def test_stateless_task_requests_with_bad_input(srv):
    task = stateless_task(srv, SLEEPER.format(seconds=0.5))
    task_id = task["taskId"]
    # the extension not declared
    error = srv.request("tasks/get", stateless_params({"taskId": task_id}))["error"]
    assert (error["code"] == -32021
            and error["data"] == {"requiredCapabilities": {"extensions": {TASKS_EXT: {}}}})
    for method in ("tasks/update", "tasks/cancel"):
        params = stateless_params({"taskId": task_id, "inputResponses": {}})
        assert (srv.request(method, params)["error"]["code"]
                == -32021)
    for params in ({"taskId": "A" * 32}, {"taskId": 7}, {}, {"taskId": task_id[:-1]},
                   {"taskId": "../" + task_id}):
        assert srv.request("tasks/get", tasked(params))["error"]["code"] == -32602, params
        assert srv.request("tasks/cancel", tasked(params))["error"]["code"] == -32602, params
    for method in ("tasks/result", "tasks/list", "tasks/frobnicate"):  # not methods of the extension
        assert srv.request(method, tasked({"taskId": task_id}))["error"]["code"] == -32601, method
    assert (srv.request("tasks/update", tasked({"taskId": task_id, "inputResponses": "yes"}))["error"]["code"]
            == -32602)
    assert srv.result("tasks/update", tasked({"taskId": task_id, "inputResponses": {"never-issued": {
        "action": "accept", "content": {"input": "x"}}}}))["resultType"] == "complete"  # ignored
    listen = srv.request("subscriptions/listen", stateless_params({"notifications": {"taskIds": [task_id]}}))
    assert listen["error"]["code"] == -32021 and listen["error"]["data"]["requiredCapabilities"]
    for filter_ in (None, "all", {"taskIds": "x"}, {"taskIds": [1]}):
        params = tasked({} if filter_ is None else {"notifications": filter_})
        assert srv.request("subscriptions/listen", params)["error"]["code"] == -32602, filter_
    assert until_task(srv, task_id)["status"] == "completed"  # and the cell was never disturbed


def without_meta(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "_meta"}


def test_listen_for_task_notifications_over_stdio(srv):
    first = stateless_task(srv, SLEEPER.format(seconds=1))
    mark = len(srv.messages)
    rid = srv.send_request("subscriptions/listen",
                           tasked({"notifications": {"taskIds": [first["taskId"], "A" * 32],
                                                     "toolsListChanged": True}}))
    ack = srv.wait_for(lambda m: m.get("method") == "notifications/subscriptions/acknowledged", 30, mark)
    assert ack["params"] == {"notifications": {"taskIds": [first["taskId"]], "toolsListChanged": True},
                             "_meta": {"io.modelcontextprotocol/subscriptionId": rid}}
    ended = srv.wait_for(lambda m: m.get("method") == "notifications/tasks"
                         and m["params"]["status"] == "completed", 60, mark)
    params = ended["params"]
    assert params["_meta"] == {"io.modelcontextprotocol/subscriptionId": rid}
    assert without_meta(params) == {k: v for k, v in task_get(srv, first["taskId"]).items()
                                    if k not in ("resultType", "_meta")}
    assert params["result"]["content"][0]["text"].endswith("slept 1")
    srv.notify("notifications/cancelled", {"requestId": rid, "reason": "done listening"})
    assert srv.result("ping") == {}
    time.sleep(0.3)
    assert rid not in srv.responses  # a cancelled listen gets no answer


def test_task_routing_header_and_listen_over_http(http_server):
    stateless = StatelessHttp(http_server)
    response = stateless.send("tools/call",
                              tasked(run_params(SLEEPER.format(seconds=1.5), kernel="tasks-http")))
    created = response.json()["result"]
    assert response.status == 200 and created["resultType"] == "task", created
    task_id = created["taskId"]
    conn = RawHttp(http_server.port)  # tasks/* without Mcp-Name, or with another one: -32020
    no_name = conn.request("POST", "/mcp",
                           {**MCP_HEADERS, "MCP-Protocol-Version": STATELESS, "Mcp-Method": "tasks/get"},
                           mcp_message("tasks/get", tasked({"taskId": task_id})))
    conn.close()
    assert no_name.status == 400 and no_name.json()["error"]["code"] == -32020
    for method in ("tasks/get", "tasks/cancel", "tasks/update"):
        other = stateless.send(method, tasked({"taskId": task_id, "inputResponses": {}}),
                               {"Mcp-Name": "other"})
        assert other.status == 400 and other.json()["error"]["code"] == -32020, method
    missing = stateless.send("tasks/get", stateless_params({"taskId": task_id}), {"Mcp-Name": task_id})
    assert missing.status == 400 and missing.json()["error"]["code"] == -32021
    assert stateless.send("tasks/list", tasked(), {"Mcp-Name": task_id}).status == 404
    got = stateless.send("tasks/get", tasked({"taskId": task_id}), {"Mcp-Name": task_id})
    assert got.status == 200 and got.json()["result"]["status"] == "working"
    # subscriptions/listen: its POST's event stream carries the acknowledgement, then the task's end
    listen = RawHttp(http_server.port)
    body = mcp_message("subscriptions/listen", tasked({"notifications": {"taskIds": [task_id]}}), 9)
    listen.send(listen.head("POST", "/mcp", {**MCP_HEADERS, "MCP-Protocol-Version": STATELESS,
                                             "Mcp-Method": "subscriptions/listen"}, length=len(body)) + body)
    status, headers = listen.read_head()
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = b""
    while b'"status":"completed"' not in events:
        size = int(listen.readline().split(b";")[0], 16)
        events += listen.readexactly(size)
        listen.readexactly(2)
    messages = sse_messages(events)
    assert messages[0]["method"] == "notifications/subscriptions/acknowledged"
    assert messages[0]["params"]["notifications"] == {"taskIds": [task_id]}
    final = [m for m in messages if m.get("method") == "notifications/tasks"][-1]["params"]
    assert final["status"] == "completed" and final["result"]["content"][0]["text"].endswith("slept 1.5")
    listen.close()  # the client leaves: the server only stops listening
    got = stateless.send("tasks/get", tasked({"taskId": task_id}), {"Mcp-Name": task_id})
    assert got.json()["result"] == {
        **without_meta(final), "resultType": "complete", "_meta": {"io.modelcontextprotocol/serverInfo":
                                                                   final["result"]["_meta"][
                                                                       "io.modelcontextprotocol/serverInfo"]}}


def test_task_ids_are_never_another_kernels_or_sessions(http_server):
    stateless = StatelessHttp(http_server)
    ids = {}
    for kernel in ("tasks-a", "tasks-b"):
        created = stateless.send("tools/call",
                              tasked(run_params(SLEEPER.format(seconds=0.6), kernel=kernel))).json()
        ids[kernel] = created["result"]["taskId"]
    for kernel, task_id in ids.items():
        got = stateless.send("tasks/get", tasked({"taskId": task_id}), {"Mcp-Name": task_id})
        done = got.json()["result"]
        deadline = time.monotonic() + 60
        while done["status"] == "working" and time.monotonic() < deadline:
            time.sleep(done["pollIntervalMs"] / 1000)
            done = stateless.send("tasks/get", tasked({"taskId": task_id}),
                               {"Mcp-Name": task_id}).json()["result"]
        assert done["status"] == "completed" and done["result"]["content"][0]["text"].endswith("slept 0.6")
        n = Cell.parse(done["result"]["content"][0]["text"]).n
        assert f"[execution {n} · completed]" in stateless.call("execution_status", {"kernel": kernel})[0]
    assert ids["tasks-a"] != ids["tasks-b"]
    with HttpMcp(http_server) as legacy:  # a handshake session sees none of them, nor they its own
        for task_id in ids.values():
            assert legacy.request("tasks/get", {"taskId": task_id})["error"]["code"] == -32602
        mine = legacy.result("tools/call",
                             {"name": "run_cell", "arguments": {"freeform": "1"}, "task": {}})["task"]
        other = stateless.send("tasks/get", tasked({"taskId": mine["taskId"]}), {"Mcp-Name": mine["taskId"]})
        assert other.status == 400 and other.json()["error"]["code"] == -32602
        with HttpMcp(http_server) as stranger:
            assert stranger.request("tasks/get", {"taskId": mine["taskId"]})["error"]["code"] == -32602
            assert stranger.result("tasks/list", {})["tasks"] == []
            assert stranger.request("tasks/cancel", {"taskId": mine["taskId"]})["error"]["code"] == -32602


def test_a_retired_resource_or_a_stopping_server_fails_its_tasks(http_spawn):
    server = http_spawn(LOOMMUX_SPARE_KERNELS="0")
    stateless = StatelessHttp(server)
    doomed = stateless.send("tools/call",
                            tasked(run_params(SLEEPER.format(seconds=60), kernel="doomed"))).json()
    task_id = doomed["result"]["taskId"]
    assert server.api("POST", "/api/resources/doomed/recycle?force=true").status == 200
    deadline = time.monotonic() + 30
    while (got := stateless.send("tasks/get", tasked({"taskId": task_id}),
                              {"Mcp-Name": task_id}).json()["result"])["status"] == "working":
        assert time.monotonic() < deadline, got
        time.sleep(0.1)
    assert (got["status"] == "failed" and got["error"]["code"] == -32603
            and "retired" in got["error"]["message"])
    assert "result" not in got
    # the server stopping: a listen stream hears the task fail, then gets its graceful result
    live = stateless.send("tools/call",
                          tasked(run_params(SLEEPER.format(seconds=60), kernel="stopping"))).json()
    task_id = live["result"]["taskId"]
    listen = RawHttp(server.port)
    body = mcp_message("subscriptions/listen", tasked({"notifications": {"taskIds": [task_id]}}), "L1")
    listen.send(listen.head("POST", "/mcp", {**MCP_HEADERS, "MCP-Protocol-Version": STATELESS,
                                             "Mcp-Method": "subscriptions/listen"}, length=len(body)) + body)
    assert listen.read_head()[0] == 200
    assert listen.readline()  # the acknowledgement's chunk
    server.remember()
    server.proc.send_signal(signal.SIGTERM)
    rest = b""
    with contextlib.suppress(ConnectionError, OSError):
        while True:
            rest += listen.sock.recv(1 << 16) or b""
            if rest.endswith(b"0\r\n\r\n"):
                break
    messages = sse_messages(b"\n".join(line for line in rest.split(b"\r\n")
                                       if not re.fullmatch(rb"[0-9a-f]+", line)))
    failed = [m["params"] for m in messages if m.get("method") == "notifications/tasks"]
    assert failed and failed[-1]["status"] == "failed" and failed[-1]["error"]["code"] == -32603, messages
    assert messages[-1] == {"jsonrpc": "2.0", "id": "L1", "result": {
        "resultType": "complete",
        "_meta": {"io.modelcontextprotocol/subscriptionId": "L1",
                  "io.modelcontextprotocol/serverInfo":
                      messages[-1]["result"]["_meta"]["io.modelcontextprotocol/serverInfo"]}}}
    assert server.proc.wait(30) == 0


@pytest.mark.anyio
@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_official_client_with_the_tasks_extension(http_server, tmp_path, transport):
    """The official SDK 2.3.0's extension seam: a client advertising io.modelcontextprotocol/tasks claims
    resultType "task" and polls tasks/get (Mcp-Name set from taskId); a default client never gets a task."""
    from typing import Any, Literal

    from mcp import Client, StdioServerParameters, types
    from mcp.client.extension import ClientExtension, ResultClaim
    from pydantic import Field

    class CreatedTask(types.Result):
        result_type: Literal["task"] = Field(alias="resultType")
        task_id: str
        status: str
        poll_interval_ms: int | None = None

    class TaskState(types.Result):
        task_id: str
        status: str
        poll_interval_ms: int | None = None
        result: dict | None = None

    class GetTask(types.Request[dict[str, Any], Literal["tasks/get"]]):
        method: Literal["tasks/get"] = "tasks/get"
        params: dict[str, Any]
        name_param = "taskId"

    created: list[CreatedTask] = []

    async def resolve(task: CreatedTask, ctx) -> types.CallToolResult:
        created.append(task)
        while True:
            state = await ctx.session.send_request(GetTask(params={"taskId": task.task_id}), TaskState)
            if state.status == "completed":
                return types.CallToolResult.model_validate(state.result)
            await asyncio.sleep(state.poll_interval_ms / 1000)

    class Tasks(ClientExtension):
        identifier = TASKS_EXT

        def claims(self):
            return [ResultClaim(result_type="task", model=CreatedTask, resolve=resolve)]

    (tmp_path / "ws").mkdir()
    target = (StdioServerParameters(command=sys.executable, args=[str(LOOMMUX)], env=server_env(),
                                    cwd=str(tmp_path / "ws"))
              if transport == "stdio" else http_server.url)
    long_cell = {"freeform": "%%loommux --wait 0.2\nimport time\ntime.sleep(1)\nprint('via a task')",
                 "kernel": "sdk-tasks"}
    async with Client(target, extensions=[Tasks()]) as client:
        assert client.protocol_version == STATELESS
        result = await client.call_tool("run_cell", long_cell)
        assert result.content[0].text.split("\n")[1:] == ["via a task"] and len(created) == 1
        assert TASK_ID_RE.fullmatch(created[0].task_id) and created[0].status == "working"
        quick = await client.call_tool("run_cell", {"freeform": "print('in time')", "kernel": "sdk-tasks"})
        assert quick.content[0].text.split("\n")[1:] == ["in time"] and len(created) == 1
    async with Client(target) as plain:  # no extension: the running notice, as ever
        result = await plain.call_tool("run_cell", long_cell)
        assert Cell.parse(result.content[0].text).state == "running"


def test_handshake_tasks_capability_and_task_support_only_from_2025_11_25(spawn):
    older = spawn(initialize=False)
    assert "tasks" not in older.initialize("2025-06-18")["capabilities"]
    assert all("execution" not in tool for tool in older.result("tools/list")["tools"])
    plain = older.result("tools/call",
                         {"name": "run_cell", "arguments": {"freeform": "6 * 7"}, "task": {"ttl": 1}})
    # ignored before 2025-11-25
    assert "task" not in plain and plain["content"][0]["text"].endswith("Out[1]: 42")
    assert older.request("tasks/get", {"taskId": "x"})["error"]["code"] == -32601
    assert older.request("tasks/list", {})["error"]["code"] == -32601
    latest = spawn()
    assert latest.init_result["capabilities"]["tasks"] == {"list": {}, "cancel": {},
                                                           "requests": {"tools": {"call": {}}}}
    support = {tool["name"]: tool.get("execution") for tool in latest.result("tools/list")["tools"]}
    assert support == {name: {"taskSupport": "optional"} if name in ("run_cell", "wait") else None
                       for name in TOOLS}


def test_handshake_task_lifecycle_over_stdio(srv):
    mark = len(srv.messages)
    created = srv.result("tools/call",
                         {"name": "run_cell", "arguments": {"freeform": SLEEPER.format(seconds=1)},
                          "task": {"ttl": 60000}})
    task = created["task"]
    check_task_shape(task, "handshake")
    assert task["status"] == "working" and set(created) == {"task", "_meta"}
    n = int(RUNNING_MESSAGE_RE.fullmatch(task["statusMessage"])[1])
    immediate = created["_meta"]["io.modelcontextprotocol/model-immediate-response"]
    assert f"Execution {n} " in immediate and task["taskId"] in immediate
    assert srv.result("tasks/get", {"taskId": task["taskId"]})["status"] == "working"
    result = srv.result("tasks/result", {"taskId": task["taskId"]})  # blocks until the end
    assert result["_meta"] == {"io.modelcontextprotocol/related-task": {"taskId": task["taskId"]}}
    plain = srv.result("tools/call", {"name": "wait", "arguments": {"execution": n}})
    assert without_meta(result) == plain and plain["content"][0]["text"].endswith("slept 1")
    got = srv.result("tasks/get", {"taskId": task["taskId"]})
    check_task_shape(got, "handshake")
    assert got["status"] == "completed" and "result" not in got
    status = srv.wait_for(lambda m: m.get("method") == "notifications/tasks/status"
                          and m["params"]["taskId"] == task["taskId"], 10, mark)
    assert status["params"]["status"] == "completed" and "_meta" not in status["params"]
    # a wait as a task, on a finished execution: its task ends at once with wait's result
    waited = srv.result("tools/call", {"name": "wait", "arguments": {"execution": n}, "task": {}})["task"]
    assert without_meta(srv.result("tasks/result", {"taskId": waited["taskId"]})) == plain
    error = srv.request("tasks/cancel", {"taskId": task["taskId"]})["error"]
    assert error["code"] == -32602 and "completed" in error["message"]


def test_handshake_task_cancel_list_and_bad_input(srv):
    task = srv.result("tools/call",
                      {"name": "run_cell", "arguments": {"freeform": SLEEPER.format(seconds=60)},
                       "task": {}})["task"]
    cancelled = srv.result("tasks/cancel", {"taskId": task["taskId"]})
    assert cancelled["taskId"] == task["taskId"] and cancelled["status"] == "cancelled"  # before the answer
    result = srv.result("tasks/result", {"taskId": task["taskId"]})  # the interrupted cell's result
    assert Cell.parse(result["content"][0]["text"]).state == "interrupted"
    assert srv.result("tasks/get", {"taskId": task["taskId"]})["status"] == "cancelled"  # it stays cancelled
    # a call refused before its cell runs is a failed task holding that isError result
    refused = srv.result("tools/call",
                         {"name": "wait", "arguments": {"execution": 10 ** 6}, "task": {}})["task"]
    assert refused["status"] == "failed" and refused["statusMessage"].startswith("execution_not_found:")
    payload = srv.result("tasks/result", {"taskId": refused["taskId"]})
    assert payload["isError"] and payload["content"][0]["text"].startswith("execution_not_found:")
    # tasks/list: newest first, a page at a time
    listed = srv.result("tasks/list", {})
    ids = [t["taskId"] for t in listed["tasks"]]
    assert ids[:2] == [refused["taskId"], task["taskId"]]
    for t in listed["tasks"]:
        check_task_shape(t, "handshake")
    assert srv.request("tasks/list", {"cursor": "no-such-cursor"})["error"]["code"] == -32602
    for params in ({"name": "status", "arguments": {}, "task": {}},
                   {"name": "interrupt", "task": {"ttl": 5}}):
        assert srv.request("tools/call", params)["error"]["code"] == -32601, params  # taskSupport forbidden
    for spec in ("soon", 5, [], {"ttl": -1}, {"ttl": "long"}, {"ttl": True}):
        params = {"name": "run_cell", "arguments": {"freeform": "1"}, "task": spec}
        assert srv.request("tools/call", params)["error"]["code"] == -32602, spec
    for params in ({"taskId": "A" * 32}, {"taskId": None}, {}):
        for method in ("tasks/get", "tasks/result", "tasks/cancel"):
            assert srv.request(method, params)["error"]["code"] == -32602, (method, params)
    assert srv.request("tasks/update", {"taskId": task["taskId"]})["error"]["code"] == -32601


def test_a_cancel_sent_before_the_kernel_began_the_cell_still_interrupts_it(spawn):
    """ipykernel ignores SIGINT between requests: an interrupt asked for right after the cell was sent is held
    until the kernel has begun it."""
    server = spawn()
    for _ in range(20):
        task = server.result("tools/call", {"name": "run_cell", "task": {},
                                            "arguments": {"freeform": "import time\ntime.sleep(60)"}})["task"]
        assert server.result("tasks/cancel", {"taskId": task["taskId"]})["status"] == "cancelled"
        result = server.result("tasks/result", {"taskId": task["taskId"]}, timeout=30)
        assert Cell.parse(result["content"][0]["text"]).state == "interrupted"
    for _ in range(10):  # the interrupt tool, as soon as run_cell has answered
        cell = run_cell(server, "%%loommux --wait 0.001\nimport time\ntime.sleep(60)")
        assert server.call("interrupt")[0].startswith(f"interrupt_sent: execution {cell.n}")
        started = time.monotonic()
        assert finish(server, cell).state == "interrupted" and time.monotonic() - started < 30


def test_handshake_task_list_pages(spawn):
    server = spawn()
    ids = [server.result("tools/call", {"name": "run_cell", "arguments": {"freeform": str(i)},
                                        "task": {}})["task"]["taskId"]
           for i in range(53)]
    first = server.result("tasks/list", {})
    second = server.result("tasks/list", {"cursor": first["nextCursor"]})
    assert [t["taskId"] for t in first["tasks"] + second["tasks"]] == ids[::-1] and "nextCursor" not in second
    assert len(first["tasks"]) == 50


def test_handshake_tasks_over_http_belong_to_their_session_and_report_on_its_stream(http_server):
    with HttpMcp(http_server) as session:
        stream = session.open_stream()
        created = session.result("tools/call",
                                 {"name": "run_cell", "task": {},
                                  "arguments": {"freeform": SLEEPER.format(seconds=0.5)}})["task"]
        events = b""
        stream.sock.settimeout(30)
        while b'"status":"completed"' not in events:
            events += stream.sock.recv(1 << 16)
        statuses = [m["params"] for m in sse_messages(b"\n".join(
            line for line in events.split(b"\r\n") if not re.fullmatch(rb"[0-9a-f]+", line)))
            if m.get("method") == "notifications/tasks/status"]
        assert statuses[-1]["taskId"] == created["taskId"] and statuses[-1]["status"] == "completed"
        stream.close()
        result = session.result("tasks/result", {"taskId": created["taskId"]})
        assert result["content"][0]["text"].endswith("slept 0.5")


def test_stateless_task_input_required_and_tasks_update(srv):
    code = ("%%loommux --wait 5\nprint('first', input('first? '))\nprint('second', input())\n"
            "import time\ntime.sleep(0.3)")
    created = stateless_task(srv, code)  # the question ends the call's wait: its task carries it
    assert created["status"] == "input_required" and "first? " in created["statusMessage"]
    task_id = created["taskId"]
    got = task_get(srv, task_id)
    assert got["status"] == "input_required" and len(got["inputRequests"]) == 1
    (key, request), = got["inputRequests"].items()
    assert request["method"] == "elicitation/create" and request["params"]["mode"] == "form"
    assert request["params"]["message"] == "first? "
    assert list(request["params"]["requestedSchema"]["properties"]) == ["input"]
    bad = srv.request("tasks/update",
                      tasked({"taskId": task_id, "inputResponses": {key: {"action": "maybe"}}}))
    assert bad["error"]["code"] == -32602
    assert task_get(srv, task_id)["inputRequests"] == got["inputRequests"]  # still asked
    srv.result("tasks/update", tasked({"taskId": task_id, "inputResponses": {
        key: {"action": "accept", "content": {"input": "one"}}, "unknown": {"action": "accept"}}}))
    second = until_task(srv, task_id, ("input_required",))
    (key2, _), = second["inputRequests"].items()
    assert key2 != key  # keys are unique over the task's life
    # an answer to a cleared question
    srv.result("tasks/update", tasked({"taskId": task_id, "inputResponses": {
        key: {"action": "accept", "content": {"input": "stale"}}}}))
    assert task_get(srv, task_id)["status"] == "input_required"
    srv.result("tasks/update", tasked({"taskId": task_id, "inputResponses": {key2: {"action": "decline"}}}))
    done = until_task(srv, task_id)
    assert done["status"] == "completed"
    text = done["result"]["content"][0]["text"]
    assert "first one" in text and "EOFError: the person declined to answer this input() prompt" in text, text


def test_handshake_task_result_asks_with_the_related_task(spawn):
    server = elicitation_session(spawn)
    task = server.result("tools/call", {"name": "run_cell", "task": {}, "arguments": {
        "freeform": "import time\ntime.sleep(0.3)\nprint(input('q? '))"}})["task"]
    assert server.wait_for(lambda m: m.get("method") == "notifications/tasks/status"
                           and m["params"]["status"] == "input_required", 30)
    # asked by tasks/result
    assert not [m for m in server.messages if m.get("method") == "elicitation/create"]
    mark = len(server.messages)
    rid = server.send_request("tasks/result", {"taskId": task["taskId"]})
    asked = next_elicitation(server, mark)
    assert asked["params"]["_meta"] == {"io.modelcontextprotocol/related-task": {"taskId": task["taskId"]}}
    answer(server, asked, {"action": "accept", "content": {"input": 42}})
    result = server.response(rid)["result"]
    assert result["content"][0]["text"].split("\n")[1:] == ["42"]


def sse_stream(conn: RawHttp):
    """The JSON-RPC messages of a chunked SSE response, one by one, as they arrive (its head already read)."""
    buffer = b""
    while size := int(conn.readline().split(b";")[0], 16):
        buffer += conn.readexactly(size)
        conn.readexactly(2)
        *events, buffer = re.split(rb"\r?\n\r?\n", buffer)
        yield from sse_messages(b"\n\n".join(events))


def test_handshake_task_result_over_http_asks_on_its_event_stream(http_server):
    asker = HttpMcp(http_server, initialize=False)  # a session whose client declared elicitation
    initialized = asker.post({"jsonrpc": "2.0", "id": 1, "method": "initialize",
                              "params": {**INITIALIZE_PARAMS, "capabilities": ELICIT_CAPS}})
    asker.session_id = initialized.headers["mcp-session-id"]
    try:
        task = asker.result("tools/call", {"name": "run_cell", "task": {}, "arguments": {
            "freeform": "import time\ntime.sleep(0.2)\nprint('typed:', input('over http? '))"}})["task"]
        conn = RawHttp(http_server.port)
        body = mcp_message("tasks/result", {"taskId": task["taskId"]}, 7)
        conn.send(conn.head("POST", "/mcp", {**MCP_HEADERS, **asker.session_headers()},
                            length=len(body)) + body)
        status, headers = conn.read_head()
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        stream = sse_stream(conn)
        asked = next(stream)
        assert asked["method"] == "elicitation/create" and asked["params"]["message"] == "over http? "
        assert asked["params"]["_meta"] == {
            "io.modelcontextprotocol/related-task": {"taskId": task["taskId"]}}
        posted = asker.post({"jsonrpc": "2.0", "id": asked["id"], "result": {"action": "accept",
                                                                              "content": {"input": "yes"}}})
        assert posted.status == 202
        final = next(m for m in stream if m.get("id") == 7)
        assert final["result"]["content"][0]["text"].split("\n")[1:] == ["typed: yes"]
        conn.close()
    finally:
        asker.close()


def churn_at_once(churns: list[Callable[[], None]], count: int) -> None:
    """Call each churn `count` times, each in its own thread, all at once; raise the first failure."""
    failures: list[BaseException] = []

    def rounds(churn: Callable[[], None]) -> None:
        try:
            for _ in range(count):
                churn()
        except BaseException as exc:  # noqa: BLE001 - reported by the test's own thread
            failures.append(exc)

    threads = [threading.Thread(target=rounds, args=(churn,), daemon=True) for churn in churns]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(900)
        assert not thread.is_alive()
    if failures:
        raise failures[0]


@needs_proc
def test_a_thousand_task_churn_costs_little_memory(spawn):
    """1,000 tasks created, polled and cancelled cost at most 5 MiB more server memory than the same 1,000
    executions run, polled and interrupted without tasks (a memory comparison, side by side)."""
    plain, tasks = spawn(), spawn()
    for server in (plain, tasks):
        run(server, "%xmode Minimal")  # short tracebacks for the interrupted cells
    # it prints before it sleeps: an interrupt that reached the kernel before the cell started would be lost
    cell = "%%loommux --wait 0.01\nimport time\nprint('started', flush=True)\ntime.sleep(30)"

    def churn_plain() -> None:
        n = run_cell(plain, cell).n
        while stream_counts(plain.call("execution_status", {"execution": n})[0], "stdout")[0] == 0:
            time.sleep(0.005)
        plain.call("interrupt")
        assert finish(plain, Cell.parse(plain.call("wait", {"execution": n})[0])).state == "interrupted"

    def churn_tasks() -> None:
        task_id = stateless_task(tasks, cell)["taskId"]
        while task_get(tasks, task_id)["statusMessage"].split(" · ")[2] == "0 lines":
            time.sleep(0.005)
        tasks.result("tasks/cancel", tasked({"taskId": task_id}))
        tasks.call("wait", {"timeout_seconds": 30})
        assert task_get(tasks, task_id)["status"] == "cancelled"

    both = [churn_plain, churn_tasks]  # the two servers, each with its own kernel, at the same time
    churn_at_once(both, 30)  # warm up both: caches, arenas, worker threads
    before = {server: server_rss(server) for server in (plain, tasks)}
    churn_at_once(both, 1000)
    grown = {server: server_rss(server) - before[server] for server in (plain, tasks)}
    print(f"server memory grown over 1,000 rounds: {grown[plain] / 2**20:.2f} MiB without tasks, "
          f"{grown[tasks] / 2**20:.2f} MiB with tasks")
    assert grown[tasks] - grown[plain] <= 5 << 20, grown


# ---------------------------------------------------------------- Resources & leases


def test_http_sessions_share_a_named_resource(http_server):
    with HttpMcp(http_server, resource="team.room-1", operator="ann") as a, \
            HttpMcp(http_server, resource="team.room-1", operator="ben") as b:
        assert run(a, "shared = 41").n == 1
        assert run(b, "shared + 1").body == ["Out[2]: 42"]
        third = run(a, "print(shared)")
        assert (third.n, third.body) == (3, ["41"])
        status = b.call("status")[0].split("\n")
        assert "resource: team.room-1 · 2 sessions" in status
        assert status_kernel(a) == status_kernel(b)
        resource = http_server.resource("team.room-1")
        assert resource["kind"] == "named" and resource["name"] == "team.room-1"
        assert sorted(lease["operator"] for lease in resource["leases"]) == ["ann", "ben"]
    with HttpMcp(http_server, resource="team.room-1") as c:  # a named resource outlives its sessions
        status = c.call("status")[0].split("\n")
        assert "resource: team.room-1 · 1 session" in status and "last execution: 3 · completed" in status[6]


TIMESTAMPS = ("%%loommux --wait 0.1\nimport time\nprint('start', repr(time.time()), flush=True)\n"
              "time.sleep(1.5)\nprint('end', repr(time.time()))")


def test_http_resources_execute_at_the_same_time(http_server):
    with HttpMcp(http_server) as a, HttpMcp(http_server, resource="overlap-b") as b:
        cells = [run_cell(a, TIMESTAMPS), run_cell(b, TIMESTAMPS)]
        assert [cell.state for cell in cells] == ["running", "running"]
        # a busy resource rejects only its own second cell
        tool_error(a, "run_cell", {"freeform": "1"}, "busy")
        finished = [finish(a, cells[0]), finish(b, cells[1])]
        (start_a, end_a), (start_b, end_b) = [[float(line.split()[1]) for line in cell.body]
                                              for cell in finished]
        assert max(start_a, start_b) < min(end_a, end_b), finished  # the cells overlapped


def test_activity_leases_renewal_expiry_and_retirement(http_spawn):
    # two warm kernels: neither session's window runs out while the other waits for a kernel boot
    server = http_spawn(**lease_env("activity", LOOMMUX_PRIVATE_IDLE_SECONDS="1.5",
                                    LOOMMUX_SHARED_IDLE_SECONDS="1.5", LOOMMUX_ORPHAN_GRACE_SECONDS="1",
                                    LOOMMUX_SPARE_KERNELS="2"))
    with HttpMcp(server, operator="idle-private") as a, \
            HttpMcp(server, resource="idle-room", operator="idle-b") as b:
        assert run(a, "kept = 'old kernel'").n == 1
        assert run(b, "room = 1").n == 1 and run(b, "room += 1").n == 2
        private = server.resource_of("idle-private")
        rid, kernels = private["id"], {private["kernel_pid"], server.resource("idle-room")["kernel_pid"]}
        assert rid.startswith("~") and private["kind"] == "private"
        (lease,) = private["leases"]
        assert (lease["mode"] == "activity" and lease["standing"] == "live"
                and 0 < lease["expires_in_seconds"] <= 1.5)
        # renewal: any request of the session keeps its lease, for twice the window
        deadline = time.monotonic() + 3.2
        while time.monotonic() < deadline:
            assert a.result("ping") == {} and b.result("tools/list")["tools"]
            time.sleep(0.3)
        for resource in (server.resource(rid), server.resource("idle-room")):
            assert resource and not resource["orphan"] and resource["leases"][0]["standing"] == "live"
        # expiry: silent sessions lapse, their resources become orphans, then are retired
        seen = []
        assert wait_until(lambda: seen.append(server.resource(rid)) or seen[-1] is None, 15, 0.1), seen[-1]
        assert any(r and r["orphan"] and r["leases"] == [] for r in seen)  # an orphan on the way
        assert wait_until(lambda: server.resource("idle-room") is None, 10, 0.1)
        assert all_gone(kernels) == []
        # the next call gets a fresh kernel, and one line saying why
        fresh = run(a, "kept")
        assert (fresh.n, fresh.state) == (1, "error") and "NameError" in fresh.text
        (line,) = retired_lines(fresh.text)
        assert f"({rid})" in line and "no request for 1.5 s (activity lease)" in line
        assert not retired_lines(a.call("status")[0])  # said once
        assert server.resource_of("idle-private")["id"] != rid
        # a named resource re-created by a later session starts a fresh sequence at 1
        with HttpMcp(server, resource="idle-room") as c:
            assert run(c, "room = 10").n == 1
        again = run(b, "room + 1")
        assert again.body[0] == "Out[2]: 11" and len(retired_lines(again.text)) == 1
        assert "resource idle-room was retired" in again.text


def test_orphan_execution_finishes_before_retirement(http_spawn):
    server = http_spawn(**lease_env("activity", LOOMMUX_PRIVATE_IDLE_SECONDS="1",
                                    LOOMMUX_ORPHAN_GRACE_SECONDS="0.5"))
    done = server.workspace / "orphan-finished.txt"
    with HttpMcp(server, operator="orphan-owner") as a:
        cell = run_cell(a, "%%loommux --wait 0.1\nimport pathlib, time\ntime.sleep(4)\n"
                           "pathlib.Path('orphan-finished.txt').write_text('done')")
        assert cell.state == "running"
        rid = server.resource_of("orphan-owner")["id"]
        kernel = server.resource(rid)["kernel_pid"]
        # the session falls silent: its lease lapses, the grace passes, the running cell may finish
        assert wait_until(lambda: (server.resource(rid) or {}).get("orphan_execution") == cell.n, 10, 0.1)
        resource = server.resource(rid)
        assert resource["orphan"] and resource["leases"] == [] and resource["running_execution"] == cell.n
        assert not done.exists() and pid_alive(kernel)
        assert wait_until(lambda: server.resource(rid) is None, 20, 0.1)
        assert done.read_text() == "done"  # it finished, then the resource was retired
        assert gone(kernel)
        assert f"retired resource {rid}: orphaned: no request for 1 s (activity lease)" in server.log()


def test_ping_leases_kept_by_pings_lapse_without(http_spawn):
    server = http_spawn(**lease_env("ping", LOOMMUX_PING_INTERVAL_SECONDS="0.5",
                                    LOOMMUX_PING_TIMEOUT_SECONDS="1.5", LOOMMUX_ORPHAN_GRACE_SECONDS="0.5"))
    with HttpMcp(server, operator="pinger") as a:
        assert run(a, "held = 1").n == 1
        rid = server.resource_of("pinger")["id"]
        kernel = server.resource(rid)["kernel_pid"]
        assert server.resource(rid)["leases"][0]["mode"] == "ping"
        deadline = time.monotonic() + 3.2  # twice the timeout
        while time.monotonic() < deadline:
            assert a.result("ping") == {}
            time.sleep(0.4)
        resource = server.resource(rid)
        assert resource and not resource["orphan"] and resource["leases"][0]["standing"] == "live"
        assert run(a, "held").body == ["Out[2]: 1"]
        assert wait_until(lambda: server.resource(rid) is None, 15, 0.1)  # no ping for 1.5 s
        assert gone(kernel)
        assert f"retired resource {rid}: orphaned: no ping for 1.5 s (ping lease)" in server.log()


def test_connection_leases_streams_alerts_and_lapse(http_spawn):
    server = http_spawn(LOOMMUX_SPARE_KERNELS="1", LOOMMUX_LEASE_MODE="connection",
                        LOOMMUX_CONNECTION_GRACE_SECONDS="1.5", LOOMMUX_PRIVATE_IDLE_SECONDS="2",
                        LOOMMUX_ORPHAN_GRACE_SECONDS="0.5")
    with HttpMcp(server, operator="streaming") as a:
        stream = a.open_stream()
        assert "Lease alert" not in run(a, "held = 'yes'").text
        rid = server.resource_of("streaming")["id"]
        kernel = server.resource(rid)["kernel_pid"]
        (lease,) = server.resource(rid)["leases"]
        assert lease["stream_open"] and lease["expires_in_seconds"] is None and lease["standing"] == "live"
        time.sleep(3)  # idle past the grace and the activity window: the open stream holds the lease
        resource = server.resource(rid)
        assert resource and not resource["orphan"] and resource["leases"][0]["standing"] == "live"
        stream.close()
        assert wait_until(lambda: server.resource(rid) is None, 15, 0.1)  # lapsed after the stream closed
        assert gone(kernel)
        assert (f"retired resource {rid}: orphaned: no open event stream for 1.5 s (connection lease)"
                in server.log())

    with HttpMcp(server, operator="no-stream") as b:
        # tools called without the stream: the lease falls back to the activity window, and says so
        for text in (b.call("status")[0], run(b, "print('hi')").text):
            _, _, alert = text.rpartition("\n\n")
            assert alert.startswith("Lease alert:") and "\n" not in alert, text
            assert "2 s activity window" in alert and "console" in alert and "GET /mcp" in alert
        (lease,) = server.resource_of("no-stream")["leases"]
        assert lease["standing"] == "alert" and lease["alert"] == alert
        stream = b.open_stream()  # the stream ends the alert
        assert "Lease alert" not in b.call("status")[0]
        assert server.resource_of("no-stream")["leases"][0]["standing"] == "live"
        stream.close()
        assert wait_until(lambda: not server.resource_of("no-stream")["leases"][0]["stream_open"], 10, 0.1)
        assert b.call("status")[0].split("\n\n")[-1].startswith("Lease alert:")  # calling on without it


def test_lease_policy_generations_pinning_and_changes(http_spawn):
    server = http_spawn(LOOMMUX_SPARE_KERNELS="0")
    policy = server.api("GET", "/api/lease-policy").json()
    assert policy == {"generation": 1, "mode": "activity", "private_idle_seconds": 4800.0,
                      "shared_idle_seconds": 86400.0, "ping_interval_seconds": 15.0,
                      "ping_timeout_seconds": 60.0, "connection_grace_seconds": 60.0,
                      "orphan_grace_seconds": 30.0}
    with HttpMcp(server, operator="pinned-1", headers={"X-Loommux-Lease-Policy": "1"}) as pinned_1:
        changed = server.api("POST", "/api/lease-policy",
                             {"mode": "ping", "ping_interval_seconds": 5, "ping_timeout_seconds": 20})
        assert changed.status == 200
        current = changed.json()
        assert current == {**policy, "generation": 2, "mode": "ping", "ping_interval_seconds": 5,
                           "ping_timeout_seconds": 20}
        assert server.api("GET", "/api/lease-policy").json() == current
        # a client pinned to the old generation is refused, with the current policy to re-discover
        stale = HttpMcp(server, headers={"X-Loommux-Lease-Policy": "1"}, initialize=False)
        refused = stale.initialize()
        assert refused.status == 409 and "mcp-session-id" not in refused.headers
        assert refused.json()["error_code"] == "stale_lease_policy" and refused.json()["policy"] == current
        stale.drop()
        with HttpMcp(server, operator="pinned-2", headers={"X-Loommux-Lease-Policy": "2"}) as pinned_2:
            # leases are taken at the first tool call, under the policy of initialize
            pinned_1.call("status")
            pinned_2.call("status")
            modes = {lease["operator"]: (lease["mode"], lease["policy_generation"])
                     for r in server.resources() for lease in r["leases"]}
            assert modes == {"pinned-1": ("activity", 1), "pinned-2": ("ping", 2)}  # new leases only
    for body, named in [
        ({"mode": "sometimes"}, "mode"),
        ({"ping_timeout_seconds": 1}, "ping_timeout_seconds"),
        ({"private_idle_seconds": -5}, "private_idle_seconds"),
        ({"orphan_grace_seconds": "soon"}, "orphan_grace_seconds"),
        ({"shared_idle_seconds": True}, "shared_idle_seconds"),
        (b'{"connection_grace_seconds": 1e999}', "connection_grace_seconds"),
        (b'{"orphan_grace_seconds": NaN}', "orphan_grace_seconds"),
        ({"no_such_window": 3}, "no_such_window"),
        (b"not json", ""),
        (b"[1, 2]", ""),
    ]:
        response = server.api("POST", "/api/lease-policy", body)
        assert (response.status == 400
                and response.json()["error_code"] == "invalid_lease_policy"), (body, response)
        assert named in response.json()["message"], response.json()
    assert server.api("GET", "/api/lease-policy").json()["generation"] == 2


def test_a_private_resource_cannot_be_joined_by_its_id(http_server):
    with HttpMcp(http_server, operator="owner") as owner:
        run(owner, "secret = 42")
        private_id = http_server.resource_of("owner")["id"]
        intruder = HttpMcp(http_server, resource=private_id, initialize=False)
        try:
            response = intruder.initialize()
            assert response.status == 400 and b"X-Loommux-Resource" in response.body
        finally:
            intruder.close()


def test_holders_keep_kernels_alive_transitively(http_spawn):
    server = http_spawn(**lease_env("activity", LOOMMUX_PRIVATE_IDLE_SECONDS="2",
                                    LOOMMUX_SHARED_IDLE_SECONDS="600", LOOMMUX_ORPHAN_GRACE_SECONDS="0.3"))
    with HttpMcp(server, operator="root") as a:
        # a chain: this session's kernel holds hop1, which holds hop2; and a cycle c1 <-> c2 held by hop1 only
        in_c1 = "loommux['c2'].run(" + repr("loommux['c1']") + ", wait=30)"
        in_hop1 = "loommux['hop2']\nloommux['c1'].run(" + repr(in_c1) + ", wait=60)"
        assert out(a, f"print(loommux['hop1'].run({in_hop1!r}, wait=90).wait())") == ["completed"]
        names = {r["id"] for r in server.resources()}
        assert {"hop1", "hop2", "c1", "c2"} <= names
        holders = {r["id"]: sorted(lease["holder"] for lease in r["leases"]) for r in server.resources()}
        assert holders["hop2"] == ["hop1"] and holders["c2"] == ["c1"] and holders["c1"] == ["c2", "hop1"]
        # while the session is live, everything it holds stays (well past the private idle window)
        for _ in range(4):
            time.sleep(0.8)
            a.call("status")
        assert {"hop1", "hop2", "c1", "c2"} <= {r["id"] for r in server.resources()}
    # the session ended: its private kernel is retired, then the whole chain and the cycle follow
    assert wait_until(lambda: not {"hop1", "hop2", "c1", "c2"} & {r["id"] for r in server.resources()},
                      30, 0.2), server.resources()
    assert "its holder, kernel hop1, is no longer held" in server.log()


def test_a_cycle_alone_keeps_nothing_alive(http_spawn):
    server = http_spawn(**lease_env("activity", LOOMMUX_SHARED_IDLE_SECONDS="1.5",
                                    LOOMMUX_ORPHAN_GRACE_SECONDS="0.3"))
    with HttpMcp(server, resource="cy1", operator="starter") as a:
        out(a, "loommux['cy2'].run(\"loommux['cy1']\", wait=30)")
        assert {"cy1", "cy2"} <= {r["id"] for r in server.resources()}
        a.drop()
        # the session stops talking: its lease on cy1 lapses, and cy1 <-> cy2 hold only each other
        assert wait_until(lambda: not {"cy1", "cy2"} & {r["id"] for r in server.resources()}, 30, 0.2)
        a.session_id = None


def test_no_kernel_before_the_first_tool_call(http_spawn):
    server = http_spawn(LOOMMUX_SPARE_KERNELS="0")
    with HttpMcp(server, operator="lister") as a:
        assert a.result("tools/list")["tools"] and a.result("ping") == {}
        assert server.resources() == [] and not descendants(server.proc.pid)
        assert "kernel: pid" in a.call("status")[0]
        assert [lease["operator"] for r in server.resources() for lease in r["leases"]] == ["lister"]


def test_kernel_cap_evicts_the_longest_idle_private_kernel(http_spawn):
    server = http_spawn(LOOMMUX_SPARE_KERNELS="0", LOOMMUX_MAX_KERNELS="2", LOOMMUX_EVICT_IDLE_SECONDS="2")
    with HttpMcp(server, resource="cap-room") as named, HttpMcp(server, operator="old") as old, \
            HttpMcp(server, operator="new") as new:
        out(named, "room = 1")
        out(old, "mine = 'old'")
        old_id = server.resource_of("old")["id"]
        time.sleep(2.2)
        # at the cap (the named room and old's kernel): old's kernel, idle the longest, is evicted
        assert out(new, "print('new')") == ["new"]
        assert server.resource(old_id) is None and server.resource("cap-room")
        # old learns why; new's kernel is not idle long enough to go, so old gets none for now
        text, is_error, _ = old.call("run_cell", {"code": "print(1)"})
        assert is_error and text.startswith("kernel_unavailable: ") and "kernel cap" in text, text
        assert re.search(r"Kernel retired: the earlier private kernel \(~\w+\) was retired "
                         r"\(evicted: the server is at its kernel cap\)", text), text
        assert out(named, "print(room)") == ["1"]  # named resources are never evicted
        assert f"retired resource {old_id}: evicted: the server is at its kernel cap" in server.log()


def test_stdio_kernel_counts_toward_the_kernel_cap(spawn):
    """Stdio's own kernel comes from the registry like any other: it counts toward the cap, and a kernel
    opened by name beside it never takes its place."""
    server = spawn(LOOMMUX_MAX_KERNELS="2", LOOMMUX_EVICT_IDLE_SECONDS="3600")
    server.tracked_pids.add(server.kernel_pid())
    text, is_error, _ = server.call("run_cell", {"freeform": "print('beside')", "kernel": "lab"})
    assert not is_error and text.split("\n")[1] == "beside", text
    text, is_error, _ = server.call("run_cell", {"freeform": "1", "kernel": "~"})
    assert is_error and text.startswith("kernel_unavailable: ") and "kernel cap (2 kernels)" in text, text
    text, is_error, _ = server.call("status")
    assert not is_error and "resource: private" in text and "1 session" in text, text


def test_handles_name_private_kernels(http_server):
    stateless = StatelessHttp(http_server)
    first = stateless.call("run_cell", {"freeform": "kept = 'first'", "kernel": "~"})[0]
    handle = handle_of(first)
    assert "In [1]" in first
    assert stateless.call("run_cell",
                       {"freeform": "print(kept)", "kernel": handle})[0].split("\n")[1:] == ["first"]
    restarted = stateless.call("restart", {"kernel": handle})[0]
    assert "next cell is execution 3" in restarted
    after = stateless.call("run_cell", {"freeform": "print('kept' in dir())", "kernel": handle})[0]
    # the same resource, a fresh process
    assert after.startswith("In [3] ·") and after.split("\n")[1] == "False"
    other = handle_of(stateless.call("run_cell", {"freeform": "print('other')", "kernel": "~"})[0])
    assert other != handle
    # the short id the console shows is no handle
    short = next(r["id"] for r in http_server.resources() if any(l["mode"] == "modern" for l in r["leases"])
                 and r["kind"] == "private")
    for ref in (short, "~" + "A" * 22):
        text, is_error, _ = stateless.call("status", {"kernel": ref})
        assert is_error and text.startswith("kernel_not_found: ") and 'kernel="~"' in text
    # hints name the kernel the call named
    running = stateless.call("run_cell", {"freeform": "%%loommux --wait 0.1\nimport time\ntime.sleep(1.5)",
                                       "kernel": handle})[0]
    assert f'wait(execution=4, kernel="{handle}")' in running and f'interrupt(kernel="{handle}")' in running
    busy = stateless.call("run_cell", {"freeform": "1", "kernel": handle})[0]
    assert busy.startswith("busy: ") and f'kernel="{handle}"' in busy
    assert stateless.call("wait", {"execution": 4, "kernel": handle})[0].startswith("In [4]")
    mine = [r for r in http_server.resources() if r["kind"] == "private" and r["running_execution"] is None
            and any(lease["client"] == "raw-modern" for lease in r["leases"])]
    assert len(mine) >= 2 and all(lease["mode"] == "modern" for r in mine for lease in r["leases"])


def test_a_named_kernel_shared_by_both_eras(http_server):
    stateless = StatelessHttp(http_server)
    stateless.call("run_cell", {"freeform": "shared_by_eras = 7", "kernel": "both-eras"})
    with HttpMcp(http_server, resource="both-eras") as legacy:
        assert out(legacy, "print(shared_by_eras)") == ["7"]
    with HttpMcp(http_server) as legacy:  # a handshake session may name it too
        text, is_error, _ = legacy.call("run_cell", {"freeform": "print(shared_by_eras * 2)",
                                                     "kernel": "both-eras"})
        assert not is_error and text.split("\n")[1] == "14"
    # and a modern call without kernel= takes X-Loommux-Resource when sent
    response = stateless.post(stateless.message("tools/call",
                                          tool_params("run_cell", {"freeform": "print(shared_by_eras)"})),
                           {"X-Loommux-Resource": "both-eras"})
    assert response.json()["result"]["content"][0]["text"].split("\n")[1] == "7"


@pytest.mark.fast
def test_a_resource_rebuilt_from_its_parts_records_goes_on_numbering():
    resource = loommux.Resource(pool=None, name="kept", resource_id="kept", token="secret")
    resource.sequence.restore(loommux.SequenceRecord(3))
    resource.kernel_holder.restore(loommux.HeldKernelRecord("remote-1"))
    assert (resource.id, resource.token, resource.last_number) == ("kept", "secret", 3)
    assert resource.sequence.record() == loommux.SequenceRecord(3, 3)  # a record of before: reserved to 3
    assert resource.kernel_holder.record() == loommux.HeldKernelRecord("remote-1")
    assert resource.sequence.numbering() == ("the output of executions 1 to 3 is gone (no record of it was "
                                             "kept); no cell has run since")
    resource.sequence.keep(finished_execution(4))
    assert resource.select(None).number == 4 and resource.find_numbered(3) is None
    assert resource.kernel_state == "starting" and resource.running is None


@pytest.mark.fast
def test_execution_numbers_are_reserved_in_blocks_and_a_restart_skips_them():
    async def number(cells: int) -> tuple[list[int], list[int]]:
        writes, waited = [], []
        async def record() -> None:
            await asyncio.sleep(0.01)
            writes.append(reservation.bound)
        reservation = loommux.NumberReservation(record)
        for n in range(1, cells + 1):
            before = len(writes)
            await reservation.reach(n)
            if len(writes) > before:
                waited.append(n)
            assert n <= reservation.written
            await asyncio.sleep(0.001)  # the cell runs
        await asyncio.sleep(0.05)
        return writes, waited

    block = loommux.EXECUTION_NUMBER_BLOCK
    writes, waited = asyncio.run(number(2 * block + 1))
    assert writes == [block, 2 * block, 3 * block] and waited == [1]  # a write a block, written ahead
    resource = loommux.Resource(pool=None, name="kept", resource_id="kept", token="secret")
    resource.sequence.restore(loommux.SequenceRecord(42, 200))
    assert resource.last_number == 200 and resource.sequence.record() == loommux.SequenceRecord(42, 200)
    assert resource.sequence.numbering() == (
        "the output of executions 1 to 42 is gone (no record of it was kept); numbers 43 to 200 were "
        "reserved before the restart and are skipped; no cell has run since")
    resource.sequence.restore(loommux.SequenceRecord(0, 1))
    assert resource.sequence.numbering() == ("number 1 was reserved before the restart and is skipped; no "
                                             "cell has run since")


@pytest.mark.fast
def test_a_resource_is_an_orphan_from_its_last_leases_end_until_leased_again():
    tenancy = loommux.Tenancy()
    first, second = object(), object()
    tenancy.add(first)
    tenancy.add(second)
    tenancy.discard(first, "first gone")
    assert tenancy.orphan_since is None
    tenancy.discard(second, "second gone")
    assert tenancy.orphan_since is not None and tenancy.orphan_reason == "second gone"
    tenancy.let_finish(7)
    tenancy.add(first)
    assert (tenancy.orphan_since, tenancy.orphan_execution, tenancy.leases) == (None, None, {first})
    tenancy.retire("evicted")
    with pytest.raises(loommux.KernelUnavailable, match=r"retired \(evicted\)"):
        tenancy.check_not_retired()


# ---------------------------------------------------------------- Notebooks


def strict_json(text: str):
    def no_constant(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=no_constant)


# Every notebook loommux writes or serves is read back with nbformat (strict JSON: no NaN) and validated
# against the nbformat 4.5 schema; a mirror's file is read while the server writes it, too.
def valid_notebook(raw: bytes):
    """A notebook as written (UTF-8, strict JSON), validated against nbformat 4.5, its cell ids unique."""
    import nbformat

    text = raw.decode("utf-8")
    notebook = strict_json(text)
    nbformat.validate(notebook)
    assert (notebook["nbformat"], notebook["nbformat_minor"]) == (4, 5)
    ids = [cell["id"] for cell in notebook["cells"]]
    assert len(set(ids)) == len(ids), ids
    return nbformat.reads(text, as_version=4)  # multiline strings joined, as clients read them


def code_cells(notebook) -> list:
    return [cell for cell in notebook.cells if cell.cell_type == "code"]


class NotebookReader:
    """Reads a notebook file over and over while a server writes it: every version seen must be valid."""

    def __init__(self, path: Path):
        self.path, self.seen, self.problems = path, 0, []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self.read, daemon=True)
        self.thread.start()

    def read(self) -> None:
        last = None
        while not self.stopping.is_set():
            try:
                raw = self.path.read_bytes()
            except FileNotFoundError:
                raw = None
            if raw is not None and raw != last:
                last = raw
                self.seen += 1
                try:
                    valid_notebook(raw)
                except Exception as exc:  # noqa: BLE001 - every problem is reported
                    self.problems.append(f"{type(exc).__name__}: {str(exc)[:300]}")
            time.sleep(0.01)

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(10)
        assert not self.problems, self.problems


def cell_states(path: Path) -> list[tuple[int, str]]:
    try:
        notebook = valid_notebook(path.read_bytes())
    except FileNotFoundError:
        return []
    return [(cell.execution_count, cell.metadata.loommux.state) for cell in code_cells(notebook)]


# A running cell's outputs, rendered again at every tick: each render continues from the last (only new
# marks applied, only new outputs encoded), and shows what a render from scratch shows.
RUNNING_CELL_MESSAGES = [
    ("stream", {"name": "stdout", "text": "one\n"}),
    ("display_data", {"data": {"text/plain": "1"}, "metadata": {}}),
    ("stream", {"name": "stdout", "text": "two "}),
    ("stream", {"name": "stdout", "text": "three\n"}),
    ("display_data", {"data": {"text/plain": "shown"}, "metadata": {}, "transient": {"display_id": "d"}}),
    ("stream", {"name": "stderr", "text": "warning\n"}),
    ("display_data", {"data": {"text/plain": "2"}, "metadata": {}}),
    ("update_display_data", {"data": {"text/plain": "updated"}, "metadata": {},
                             "transient": {"display_id": "d"}}),
    ("stream", {"name": "stdout", "text": "four\n"}),
    ("clear_output", {"wait": True}),
    ("stream", {"name": "stdout", "text": "after the wait\n"}),
    ("display_data", {"data": {"text/plain": "3"}, "metadata": {}}),
    ("clear_output", {"wait": False}),
    ("display_data", {"data": {"text/plain": "4"}, "metadata": {}, "transient": {"display_id": "e"}}),
    ("stream", {"name": "stdout", "text": "five"}),
    ("update_display_data", {"data": {"text/plain": "4 updated"}, "metadata": {},
                             "transient": {"display_id": "e"}}),
    ("stream", {"name": "stdout", "text": " six\n"}),
]


@pytest.mark.fast
@pytest.mark.parametrize("step", [1, 2, 3, 5])
def test_a_running_cell_s_outputs_rendered_again_show_what_a_fresh_render_shows(step):
    execution = loommux.Execution(7, "source", loommux.CellOptions(), kernel_pid=None)
    kept = {}

    def render(kept_outputs):
        return asyncio.run(loommux.encode_cell_outputs(execution, loommux.Pacer(), kept_outputs))

    for first in range(0, len(RUNNING_CELL_MESSAGES), step):
        for msg_type, content in RUNNING_CELL_MESSAGES[first : first + step]:
            execution.ingest(msg_type, content)
        assert render(kept) == render(None)
        assert kept[7].applied == len(execution.marks or ())  # what comes next continues from here
    execution.finish()
    final = render(kept)
    assert final == render(None)
    shown = [json.loads(output) for output in final]
    assert [output.get("text") or output["data"]["text/plain"] for output in shown] == [["4 updated"],
                                                                                        ["five six\n"]]


@pytest.mark.fast
def test_a_long_cell_s_end_waits_for_a_share_of_the_file_write_not_of_rendering():
    writes = loommux.NotebookWrites()
    writes.count(took=1.0, size=100, writing=0.01)  # a first rendering of many outputs took the rest
    assert writes.end_at < writes.next_at
    assert writes.end_at - time.monotonic() <= 0.01 * (1 / loommux.NOTEBOOK_END_SHARE - 1)
    assert writes.next_at - time.monotonic() > 1.0 * (1 / loommux.NOTEBOOK_WRITE_SHARE - 2)


def test_notebook_mirror_of_the_stdio_kernel(spawn, tmp_path):
    path = tmp_path / "session.ipynb"
    server = spawn(LOOMMUX_NOTEBOOK=str(path))
    assert wait_until(path.exists, 60), server.stderr_tail()  # written at once, before any cell
    reader = NotebookReader(path)
    first = valid_notebook(path.read_bytes())
    assert first.cells == [] and first.metadata.loommux.writer == "loommux"
    streams = run(server, "import sys\nprint('out', 1, flush=True)\n"
                          "print('err', file=sys.stderr, flush=True)\nprint('out', 2, flush=True)\n6 * 7")
    header = run(server, "%%loommux --wait 30\nfrom IPython.display import display, clear_output\n"
                         "print('gone', flush=True)\nclear_output()\n"
                         "handle = display('first', display_id=True)\n"
                         "print('kept', flush=True)\nhandle.update('updated')")
    failed = run(server, "raise KeyError('missing')")
    stop = server.workspace / "stop"
    running = run_cell(server, "%%loommux --wait 0.2\nimport os, time\nwhile not os.path.exists('stop'):\n"
                               "    print('tick', flush=True)\n    time.sleep(0.1)\nprint('stopped')")
    assert running.state == "running"
    # while the cell runs, the file shows it running, its output growing
    assert wait_until(lambda: (running.n, "running") in cell_states(path), 60), cell_states(path)
    stop.touch()
    assert finish(server, running).state == "completed"
    server.call("restart")
    killed = run(server, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)")
    assert killed.state == "killed"
    statuses_until_replaced(server, 0)
    own = run(server, "nb = loommux.self.notebook()\nprint(nb['nbformat'], nb['nbformat_minor'], "
                      "nb['metadata']['loommux']['writer'])")
    assert own.body == ["4 5 loommux"], own.text
    status, _, _ = server.call("status")
    assert re.search(rf"^notebook: {re.escape(str(path))} · \d+ writes? · ", status, re.MULTILINE), status
    assert server.close() == 0
    reader.stop()
    assert reader.seen >= 2

    notebook = valid_notebook(path.read_bytes())
    assert (notebook.metadata.kernelspec.name == "python3"
            and notebook.metadata.kernelspec.language == "python")
    assert notebook.metadata.language_info.name == "python" and notebook.metadata.language_info.version
    cells = code_cells(notebook)
    assert [cell.execution_count for cell in cells] == list(range(1, own.n + 1))
    assert text_of(cells[header.n - 1].source) == (
        "%%loommux --wait 30\nfrom IPython.display import display, clear_output\n"
        "print('gone', flush=True)\nclear_output()\nhandle = display('first', display_id=True)\n"
        "print('kept', flush=True)\nhandle.update('updated')")
    outputs = cells[streams.n - 1].outputs
    assert [(o.output_type, o.get("name"), text_of(o.get("text", ""))) for o in outputs[:3]] == [
        ("stream", "stdout", "out 1\n"), ("stream", "stderr", "err\n"), ("stream", "stdout", "out 2\n")]
    assert outputs[3].output_type == "execute_result" and outputs[3].execution_count == streams.n
    assert text_of(outputs[3].data["text/plain"]) == "42" and len(outputs) == 4
    # clear_output dropped what came before it; the update replaced the display's data
    assert [(o.output_type, text_of(o.get("text") or o.get("data", {}).get("text/plain")))
            for o in cells[header.n - 1].outputs] == [("display_data", "'updated'"), ("stream", "kept\n")]
    error = cells[failed.n - 1].outputs[-1]
    assert (error.output_type, error.ename, error.evalue) == ("error", "KeyError", "'missing'")
    assert any("KeyError" in line for line in error.traceback) and "\x1b[" in "".join(error.traceback)
    for cell in cells:
        facts, timing = cell.metadata.loommux, cell.metadata.execution
        assert facts.execution == cell.execution_count and facts.duration >= 0
        assert facts.ran_by == {"kind": "mcp_client", "name": "test_loommux"}
        assert timing["iopub.execute_input"] <= timing["shell.execute_reply"]
    assert [cells[n - 1].metadata.loommux.state for n in (streams.n, failed.n, running.n, killed.n)] == [
        "completed", "error", "completed", "killed"]
    tick = cells[running.n - 1].outputs
    assert len(tick) == 1 and text_of(tick[0].text).endswith("tick\nstopped\n")
    # a restart and a kernel death are markdown cells where they happened
    kinds = [cell.metadata.loommux.get("event") if cell.cell_type == "markdown" else cell.execution_count
             for cell in notebook.cells]
    assert kinds == [*range(1, running.n + 1), "restart", killed.n, "death", own.n], kinds
    death = notebook.cells[kinds.index("death")]
    assert "SIGKILL" in text_of(death.source) and f"execution {killed.n} was killed" in text_of(death.source)


def test_late_output_reaches_a_settled_notebook_cell(spawn, tmp_path):
    """Output for a cell long done (a kernel may route a thread's output to the cell that started it)."""
    path = tmp_path / "late.ipynb"
    server = spawn(LOOMMUX_NOTEBOOK=str(path))
    late = run(server, "ip = get_ipython()\nfirst = ip.kernel.get_parent()\nprint('on time')")
    big = run(server, "print('y' * 400_000)")
    run(server, "1")
    assert wait_until(lambda: len(cell_states(path)) == 3, 60)  # written: the first two are a settled block
    run(server, "ip.kernel.session.send(ip.kernel.iopub_socket, 'stream', "
                "{'name': 'stdout', 'text': 'late\\n'}, parent=first)")
    assert wait_until(lambda: read(server, execution=late.n)[1] == ["on time", "late"], 30)
    assert server.close() == 0
    cells = code_cells(valid_notebook(path.read_bytes()))
    assert [text_of(o.text) for o in cells[late.n - 1].outputs] == ["on time\nlate\n"]
    assert len(text_of(cells[big.n - 1].outputs[0].text)) == 400_001


# Deterministic cells, re-run by nbclient in a fresh kernel: streams, a result, displays (PNG, JPEG, SVG,
# HTML, JSON, a matplotlib plot) and an error.
DETERMINISTIC_CELLS = [
    ("import base64, io, sys\nfrom IPython.display import display, HTML, JSON, SVG, Image\n"
     "from PIL import Image as PIL"),
    ("print('hello', flush=True)\nprint('to stderr', file=sys.stderr, flush=True)\n"
     "print('again', flush=True)\n6 * 7"),
    ("""def picture(fmt, colour):
    buffer = io.BytesIO()
    PIL.new('RGB', (32, 16), colour).save(buffer, fmt)
    return buffer.getvalue()
display(Image(data=picture('PNG', 'red')))
display(Image(data=picture('JPEG', 'blue'), format='jpeg'))
display(SVG('<svg xmlns="http://www.w3.org/2000/svg" width="20" height="20">"""
     """<circle cx="10" cy="10" r="8"/></svg>'))
display(HTML('<b>bold</b> text'))
display(JSON({'a': [1, 2]}))"""),
    "import matplotlib.pyplot as plt\nplt.figure(figsize=(2, 1.5))\nplt.plot([1, 3, 2])\nplt.show()",
    "raise ValueError('boom')",
]


@pytest.fixture(scope="module")
def deterministic_notebook(tmp_path_factory) -> Path:
    """The notebook file of a stdio session of DETERMINISTIC_CELLS (after the server stopped)."""
    base = tmp_path_factory.mktemp("notebook")
    (base / "workspace").mkdir()
    path = base / "deterministic.ipynb"
    server = StdioServer(base / "workspace", base / "server.stderr", server_env(LOOMMUX_NOTEBOOK=str(path)))
    try:
        server.initialize()
        for code in DETERMINISTIC_CELLS:
            run(server, code)
        assert server.close() == 0
    finally:
        server.cleanup()
    server.assert_pure()
    return path


def comparable(outputs: list) -> list[dict]:
    """Outputs as a notebook client makes them: consecutive stream text of one stream joined; multiline
    strings joined, and base64 without its line breaks."""
    found: list[dict] = []
    for output in outputs:
        output = json.loads(json.dumps(output))
        if output["output_type"] == "stream":
            output["text"] = text_of(output["text"])
            if found and found[-1]["output_type"] == "stream" and found[-1]["name"] == output["name"]:
                found[-1]["text"] += output["text"]
                continue
        if "data" in output:
            output["data"] = {mime: re.sub(r"\s+", "", text_of(value)) if mime.startswith("image/") and
                              mime != "image/svg+xml" else text_of(value)
                              if isinstance(value, (str, list)) and not mime.endswith("json") else value
                              for mime, value in output["data"].items()}
        found.append(output)
    return found


def test_notebook_round_trip_with_nbclient(deterministic_notebook, tmp_path):
    from nbclient import NotebookClient

    notebook = valid_notebook(deterministic_notebook.read_bytes())
    cells = code_cells(notebook)
    assert ["".join(cell.source) for cell in cells] == DETERMINISTIC_CELLS
    mimes = {mime for cell in cells for output in cell.outputs for mime in output.get("data", {})}
    assert {"image/png", "image/jpeg", "image/svg+xml", "text/html", "application/json"} <= mimes
    assert cells[-1].outputs[-1].output_type == "error"
    recorded = [comparable(cell.outputs) for cell in cells]
    rerun = valid_notebook(deterministic_notebook.read_bytes())
    for cell in rerun.cells:
        cell.outputs = []
    NotebookClient(rerun, timeout=120, kernel_name="python3", allow_errors=True,
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    assert [comparable(cell.outputs) for cell in code_cells(rerun)] == recorded


def test_notebook_renders_to_html_with_its_images(deterministic_notebook, tmp_path):
    expect, sync_playwright = playwright_or_skip()
    done = subprocess.run([sys.executable, "-m", "nbconvert", "--to", "html", "--output-dir", str(tmp_path),
                           str(deterministic_notebook)],
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    html = tmp_path / "deterministic.html"
    assert "data:image/png;base64," in html.read_text() and "data:image/jpeg;base64," in html.read_text()
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 900})
            page.route("http*://**", lambda route: route.abort())  # the page's CDN scripts: offline
            page.goto(html.as_uri(), wait_until="domcontentloaded")
            expect(page.get_by_text("print('hello', flush=True)")).to_have_count(1)
            expect(page.get_by_text("to stderr")).not_to_have_count(0)
            expect(page.get_by_text("ValueError: boom")).not_to_have_count(0)
            expect(page.locator("b", has_text="bold")).to_have_count(1)
            images = page.locator(".jp-RenderedImage img, .jp-RenderedSVG svg, .jp-RenderedSVG img")
            expect(images).to_have_count(4)
            sizes = page.locator("img").evaluate_all("imgs => imgs.map(i => [i.complete, i.naturalWidth])")
            assert len(sizes) >= 3 and all(complete and width > 0 for complete, width in sizes), sizes
            page.screenshot(path=str(ARTIFACTS / "notebook.png"), full_page=True)
        finally:
            browser.close()


# A kernel that sends JSON escapes, lone surrogates kept (ipykernel itself cannot send them).
ODD_KERNEL_CELL = """import json
ip = get_ipython()
session, packer = ip.kernel.session, ip.kernel.session.pack
session.pack = lambda message: json.dumps(message, default=str).encode()
try:
    session.send(ip.kernel.iopub_socket, 'stream', {'name': 'stdout', 'text': 'lone \\ud800 surrogate\\n'},
                 parent=ip.kernel.get_parent())
    session.send(ip.kernel.iopub_socket, 'display_data', {'data': {'text/plain': 'odd \\udfff', 'text/html':
                 '<i>\\ud801</i>'}, 'metadata': {}}, parent=ip.kernel.get_parent())
    session.send(ip.kernel.iopub_socket, 'display_data', {'data': {'application/json': {'x': float('nan')},
                 'text/plain': 'NaN'}, 'metadata': {'y': float('inf')}}, parent=ip.kernel.get_parent())
finally:
    session.pack = packer"""


@pytest.mark.timeout(600)
def test_notebook_of_bad_output_is_valid_every_time(spawn, tmp_path):
    path = tmp_path / "bad.ipynb"
    server = spawn(LOOMMUX_NOTEBOOK=str(path))
    assert wait_until(path.exists, 60), server.stderr_tail()
    reader = NotebookReader(path)
    odd = run(server, ODD_KERNEL_CELL)
    # invalid UTF-8 on the wire
    escaped = run(server, "import sys\nsys.stdout.write('bytes \\udcff\\udcfe\\n')")
    long_line = run(server, "print('<' + 'x' * 10_000_000 + '>')\nprint('next line')")
    binary = run(server, "from IPython.display import display\n"
                         "display({'image/png': 'not base64 at all!', 'text/plain': 'fallback'}, raw=True)\n"
                         "display({'image/jpeg': '\\xff\\xd8 raw', 'text/html': '<p>kept</p>'}, raw=True)")
    many = run(server, "%%loommux --wait 300\nfrom IPython.display import display\nfor i in range(100_000):\n"
                       "    display(i)")
    assert {cell.state for cell in (odd, escaped, long_line, binary, many)} == {"completed"}
    _, lines = read(server, execution=long_line.n, stream="stdout", line_range="1:1", max_chars=5)
    assert lines[0].startswith("<xxxx…")  # what the notebook's line names: read_output reads it whole
    received = stream_counts(server.call("execution_status", {"execution": many.n})[0], "result")[0]
    assert received > 90_000  # (IOPub may drop some under load: the kernel's socket, not loommux)
    assert server.close() == 0
    reader.stop()

    cells = code_cells(valid_notebook(path.read_bytes()))
    odd_outputs = cells[odd.n - 1].outputs
    assert text_of(odd_outputs[0].text) == "lone \ufffd surrogate\n"
    assert text_of(odd_outputs[1].data["text/html"]) == "<i>\ufffd</i>"
    assert odd_outputs[2].data["application/json"] == {"x": None} and odd_outputs[2].metadata == {"y": None}
    assert text_of(cells[escaped.n - 1].outputs[0].text) == "bytes \ufffd\ufffd\n"
    cut = text_of(cells[long_line.n - 1].outputs[0].text)
    assert len(cut) < (1 << 20) + 200 and cut.startswith("<xxx") and cut.endswith("x>\nnext line\n")
    note = re.search(r"\n\[… ([\d,]+) characters left out; (read_output\(execution=(\d+), stream=\"stdout\", "
                     r"line_range=\"(\d+:\d+)\"\)) reads them\]\n", cut)
    assert note and int(note[3]) == long_line.n and note[4] == "1:1", cut[(1 << 19) - 100 : (1 << 19) + 300]
    assert number(note[1]) + len(cut) - len(note[0]) == len("<>\n") + 10_000_000 + len("next line\n")
    displays = cells[binary.n - 1].outputs
    assert "image/png" not in displays[0].data and text_of(displays[0].data["text/plain"]) == (
        "fallback\n[image/png left out of the notebook: its data is not base64]")
    assert "image/jpeg" not in displays[1].data and text_of(displays[1].data["text/html"]) == "<p>kept</p>"
    outputs = cells[many.n - 1].outputs
    assert len(outputs) == received and text_of(outputs[-1].data["text/plain"]) == "99999"


def one_line_refusal(server) -> str:
    """The single line a server that refused to start wrote before exiting with status 2."""
    assert server.proc.wait(60) == 2
    log = server.stderr_path.read_text() if isinstance(server, StdioServer) else server.log()
    lines = log.strip().splitlines()
    assert len(lines) == 1, log
    return lines[0]


def test_notebook_path_that_is_not_loommux_s_stops_the_server(spawn, tmp_path):
    foreign = tmp_path / "theirs.ipynb"
    foreign.write_text('{"cells": [], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}')
    text = tmp_path / "notes.txt"
    text.write_text("not a notebook\n")
    for path, said in [(foreign, "exists and loommux did not write it"),
                       (text, "exists and loommux did not write it"),
                       (tmp_path / "no-such-dir" / "x.ipynb", "is not a directory"),
                       (tmp_path, "cannot be read")]:
        before = path.read_bytes() if path.is_file() else None
        line = one_line_refusal(spawn(initialize=False, LOOMMUX_NOTEBOOK=str(path)))
        assert str(path) in line and said in line and "LOOMMUX_NOTEBOOK" in line, line
        assert (path.read_bytes() if path.is_file() else None) == before  # never overwritten


def test_a_notebook_loommux_wrote_is_continued_after_a_marker_cell(spawn, tmp_path):
    path = tmp_path / "continued.ipynb"
    first = spawn(LOOMMUX_NOTEBOOK=str(path))
    out(first, "print('first session')")
    out(first, "2 + 2")
    assert first.close() == 0
    second = spawn(LOOMMUX_NOTEBOOK=str(path))
    assert out(second, "print('second session')") == ["second session"]
    assert second.close() == 0
    notebook = valid_notebook(path.read_bytes())
    cells = notebook.cells
    assert [cell.cell_type for cell in cells] == ["code", "code", "markdown", "code"]
    assert [cell.execution_count for cell in code_cells(notebook)] == [1, 2, 1]
    assert cells[2].metadata.loommux.event == "session" and "numbered from 1 again" in cells[2].source
    assert text_of(cells[3].outputs[0].text) == "second session\n"


@pytest.mark.parametrize("args, env, said", [
    (["--server", "--notebook", "x.ipynb"], {}, "--notebook / LOOMMUX_NOTEBOOK mirrors stdio's kernel"),
    (["--server"], {"LOOMMUX_NOTEBOOK": "x.ipynb"}, "--notebook / LOOMMUX_NOTEBOOK mirrors stdio's kernel"),
    (["--notebook-dir", "."], {}, "--notebook-dir / LOOMMUX_NOTEBOOK_DIR needs --server"),
    ([], {"LOOMMUX_NOTEBOOK_DIR": "."}, "--notebook-dir / LOOMMUX_NOTEBOOK_DIR needs --server"),
    (["--server", "--notebook-dir", "missing"], {}, "not a directory this user can write in"),
], ids=["notebook-with-server", "notebook-env-with-server", "dir-without-server", "dir-env-without-server",
        "missing-dir"])
def test_notebook_options_refused_in_one_line(tmp_path, args, env, said):
    done = subprocess.run([sys.executable, str(LOOMMUX), *args], cwd=tmp_path, env=http_env(**env),
                          timeout=60, capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and said in done.stderr, done.stderr


@pytest.mark.fast
def test_a_notebook_file_is_never_read_or_written_through_a_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("kept")
    path = tmp_path / "lab.ipynb"
    planted = tmp_path / f".lab.ipynb.loommux-{os.getpid()}.tmp"  # where the next write begins
    planted.symlink_to(victim)
    assert loommux.write_atomically(path, [b"{}"]) == 2
    assert victim.read_text() == "kept" and path.read_text() == "{}" and not planted.exists()
    path.unlink()
    path.symlink_to("/dev/zero")  # read, it would never end
    with pytest.raises(loommux.NotebookRefused, match="cannot be read \\(a symbolic link\\)"):
        loommux.check_notebook_path(path)
    path.unlink()
    os.mkfifo(path)  # opened, it would wait for a writer
    with pytest.raises(loommux.NotebookRefused, match="cannot be read \\(not a regular file\\)"):
        loommux.check_notebook_path(path)


NOTEBOOK_MIME = "application/x-ipynb+json"


def test_notebook_dir_over_http(http_spawn, tmp_path):
    directory = tmp_path / "notebooks"
    directory.mkdir()
    foreign = directory / "foreign.ipynb"
    foreign.write_text("their own file\n")
    server = http_spawn("--notebook-dir", str(directory), "--token", "secret", LOOMMUX_SPARE_KERNELS="0")
    server.api_headers = {"Authorization": "Bearer secret"}
    auth = {"Authorization": "Bearer secret"}
    with HttpMcp(server, resource="lab", headers=auth) as lab, HttpMcp(server, headers=auth) as private, \
            HttpMcp(server, resource="foreign", headers=auth) as other:
        assert out(lab, "x = 40\nx + 2") == ["Out[1]: 42"]
        assert out(private, "print('private')") == ["private"]
        refused = run(other, "print('goes on')")
        assert refused.state == "completed" and "goes on" in refused.body
        assert "Notebook off:" in refused.text and "loommux did not write it" in refused.text
        status, _, _ = other.call("status")
        assert re.search(rf"^notebook: {re.escape(str(foreign))} · off: .*loommux did not write it", status,
                         re.MULTILINE), status
        assert foreign.read_text() == "their own file\n"
        private_id = next(r["id"] for r in server.resources() if r["kind"] == "private")
        private_file = directory / f"private-{private_id}.ipynb"
        assert wait_until(lambda: cell_states(private_file) == [(1, "completed")], 60)
        # the API serves the notebook, rendered from the records, with the access rules of the other reads
        served = server.api("GET", "/api/resources/lab/notebook")
        assert served.status == 200 and served.headers["content-type"] == NOTEBOOK_MIME
        assert served.headers["content-disposition"] == 'attachment; filename="lab.ipynb"'
        assert text_of(code_cells(valid_notebook(served.body))[0].outputs[0].data["text/plain"]) == "42"
        assert server.api("GET", "/api/resources/lab/notebook", headers={"Authorization": None}).status == 401
        kernel_token = out(lab, "import os\nprint(os.environ['LOOMMUX_KERNEL_TOKEN'])")[0]
        as_kernel = {"Authorization": f"Bearer {kernel_token}"}
        assert server.api("GET", "/api/resources/lab/notebook", headers=as_kernel).status == 403
        assert server.api("GET", f"/api/kernels/{private_id}/notebook", headers=as_kernel).status == 200
        named = server.api("GET", f"/api/resources/{private_id}/notebook")
        assert named.headers["content-disposition"] == f'attachment; filename="private-{private_id}.ipynb"'
        # from a kernel: another kernel's notebook as a dict, its own written to a file
        body = out(private, "nb = loommux['lab'].notebook()\nprint(nb['cells'][0]['source'])\n"
                            "loommux.self.notebook('mine.ipynb')\nimport json\n"
                            "print(len(json.load(open('mine.ipynb'))['cells']))")
        assert body[0] == "['x = 40\\n', 'x + 2']" and int(body[1]) >= 1
        # a retired named kernel: a cell says so; the next kernel of that name continues the file
        assert server.api("POST", "/api/resources/lab/recycle").status == 200
        assert out(lab, "print('fresh lab')")[0] == "fresh lab"  # (then the notice of a fresh kernel)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    notebook = valid_notebook((directory / "lab.ipynb").read_bytes())
    kinds = [cell.metadata.loommux.get("event") or cell.execution_count for cell in notebook.cells]
    assert (kinds[-3:] == ["retirement", "session", 1]
            and "recycled by an operator" in notebook.cells[-3].source)
    assert foreign.read_text() == "their own file\n"
    assert sorted(path.name for path in directory.iterdir()) == sorted(
        ["foreign.ipynb", "lab.ipynb", f"private-{private_id}.ipynb"])  # no temporary file left


def test_api_notebook_without_a_mirror_and_the_console_link(http_server, tmp_path):
    with HttpMcp(http_server, resource="nb-console") as session:
        out(session, "print('in the console')")
        served = http_server.api("GET", "/api/resources/nb-console/notebook")
        assert served.status == 200 and served.headers["content-type"] == NOTEBOOK_MIME
        assert text_of(code_cells(valid_notebook(served.body))[0].outputs[0].text) == "in the console\n"
        assert http_server.api("GET", "/api/resources/no-such/notebook").status == 404
        with console_page(http_server) as (expect, page):
            link = page.locator('tr[data-resource="nb-console"] a.notebook')
            expect(link).to_have_count(1, timeout=15_000)
            assert link.get_attribute("href") == "api/resources/nb-console/notebook"  # relative
            with page.expect_download() as download:
                link.click()
            saved = tmp_path / download.value.suggested_filename
            download.value.save_as(saved)
            assert saved.name == "nb-console.ipynb"
            assert (text_of(code_cells(valid_notebook(saved.read_bytes()))[0].outputs[0].text)
                    == "in the console\n")


# ---------------------------------------------------------------- Instance state


STATE_KERNEL = {"id": "r1", "kind": "named", "name": "n", "handle": "", "token": "t", "remote_id": "g1",
                "executions": 2, "leases": [{"session": "s1", "policy": {}, "signal_at": 1.5}]}


@pytest.mark.fast
@pytest.mark.parametrize("change, said", [
    ({"kernels": [{**STATE_KERNEL, "handle": ["x"]}]}, "KernelRecord.handle is ['x']"),
    ({"kernels": [{**STATE_KERNEL, "executions": True}]}, "KernelRecord.executions is True"),
    ({"kernels": [{**STATE_KERNEL, "leases": [{**STATE_KERNEL["leases"][0], "signal_at": "1e12"}]}]},
     "LeaseRecord.signal_at is '1e12'"),
    ({"kernels": [{**STATE_KERNEL, "leases": [{**STATE_KERNEL["leases"][0], "holder": ["x"]}]}]},
     "LeaseRecord.holder is ['x']"),
    ({"sessions": [{"id": "k.s", "label": "s", "protocol_version": "2025-11-25", "elicits": False,
                    "policy": {}, "resource": ["x"]}]}, "SessionRecord.resource is ['x']"),
    ({"instance": "../x y"}, "the instance name '../x y' is not one"),
    ({"instance": 5}, "InstanceState.instance is 5"),
    ({"kernels": [STATE_KERNEL, STATE_KERNEL]}, "a kernel is recorded twice"),
    ("[" * 200_000, "maximum recursion depth"),
    # the forms loommux writes: an id is a directory's name, a number is within bounds
    ({"kernels": [{**STATE_KERNEL, "id": "../../victim4"}]}, "KernelRecord.id is '../../victim4', not one"),
    ({"kernels": [{**STATE_KERNEL, "id": ".."}]}, "KernelRecord.id is '..', not one loommux writes"),
    ({"kernels": [{**STATE_KERNEL, "kind": "private", "id": "~../x"}]}, "KernelRecord.id is '~../x'"),
    ({"kernels": [{**STATE_KERNEL, "name": "a/b"}]}, "KernelRecord.name is 'a/b'"),
    ({"kernels": [{**STATE_KERNEL, "executions": 10**30}]}, f"KernelRecord.executions is {10**30}, not"),
    ({"kernels": [{**STATE_KERNEL, "executions": -7}]}, "KernelRecord.executions is -7, not one"),
    ({"kernels": [{**STATE_KERNEL, "reserved": 2**31}]}, "KernelRecord.reserved is 2147483648, not"),
    ({"kernels": [{**STATE_KERNEL, "handle": "~k/../x"}]}, "KernelRecord.handle is '~k/../x'"),
    ({"kernels": [{**STATE_KERNEL, "token": "t\r\nX: y"}]}, "KernelRecord.token is 't\\r\\nX: y'"),
    ({"kernels": [{**STATE_KERNEL, "remote_id": "../sessions"}]}, "KernelRecord.remote_id is '../sessions'"),
    ({"kernels": [{**STATE_KERNEL, "leases": [{**STATE_KERNEL["leases"][0], "signal_at": float("inf")}]}]},
     "LeaseRecord.signal_at is inf, not one"),
    ({"kernels": [{**STATE_KERNEL, "leases": [{**STATE_KERNEL["leases"][0], "holder": "../x"}]}]},
     "LeaseRecord.holder is '../x'"),
    ({"sessions": [{"id": "k/s", "label": "s", "protocol_version": "2025-11-25", "elicits": False,
                    "policy": {}}]}, "SessionRecord.id is 'k/s', not one"),
    ({"sessions": [{"id": "k.s", "label": "s", "protocol_version": "1999", "elicits": False,
                    "policy": {}}]}, "SessionRecord.protocol_version is '1999', not one"),
], ids=clipped(8))
def test_a_state_file_of_the_wrong_shape_is_moved_aside(tmp_path, capsys, change, said):
    path = tmp_path / "state.json"
    whole = {"version": 1, "instance": "k", "gateway": "http://127.0.0.1:9", "kernels": [], "sessions": []}
    path.write_text(change if isinstance(change, str) else json.dumps({**whole, **change}))
    assert loommux.read_state(tmp_path, "", None) is None
    line = capsys.readouterr().err
    assert "is not a whole state file (" in line and said in line and "started empty" in line, line
    assert not path.exists() and len(list(tmp_path.glob("state.json.bad-*"))) == 1


@pytest.mark.fast
def test_a_state_file_with_kernels_needs_their_gateway_and_a_lock_it_can_take(tmp_path):
    whole = {"version": 1, "instance": "k", "gateway": "none", "kernels": [STATE_KERNEL], "sessions": []}
    (tmp_path / "state.json").write_text(json.dumps(whole))
    with pytest.raises(loommux.StartupError) as raised:
        loommux.read_state(tmp_path, "", None)  # kernels, and no gateway to find them on
    assert "holds kernels on the gateway none, and this instance's gateway is none" in str(raised.value)
    (tmp_path / "state.lock").mkdir()
    with pytest.raises(loommux.StartupError) as raised:
        loommux.hold_state_dir(tmp_path)
    assert str(raised.value).startswith(f"state directory {tmp_path}: cannot open its lock state.lock (")
    lock, victim = tmp_path / "state.lock", tmp_path / "victim.txt"
    lock.rmdir()
    victim.write_text("kept")
    lock.symlink_to(victim)  # the pid would be written over victim.txt
    with pytest.raises(loommux.StartupError, match="cannot open its lock state.lock"):
        loommux.hold_state_dir(tmp_path)
    lock.unlink()
    os.link(victim, lock)  # and so it would through a second name
    with pytest.raises(loommux.StartupError, match="cannot open its lock state.lock .*a hard link"):
        loommux.hold_state_dir(tmp_path)
    assert victim.read_text() == "kept"


def state_file(directory: Path) -> dict:
    return json.loads((directory / "state.json").read_text())


def kept_server(base: Path, n: int, state: Path, *args: str, port: int = 0, **env: str) -> LoommuxHttp:
    """A server with a state dir (the `n`th started in `base`), on `port` when given."""
    return LoommuxHttp(base, base / f"server-{n}.log", http_env(LOOMMUX_SPARE_KERNELS="0", **env),
                       ("--state-dir", str(state), *(("--port", str(port)) if port else ()), *args))


def run_text(client, code: str, **args) -> str:
    text, is_error, _ = client.call("run_cell", {"freeform": code, **args})
    assert not is_error, text
    return text


@needs_gateway
def test_a_restart_with_its_state_dir_keeps_its_gateway_kernels(gateway, tmp_path):
    state, before = tmp_path / "state", gateway.kernels()
    on_gateway = {"LOOMMUX_GATEWAY_URL": gateway.url, "LOOMMUX_GATEWAY_TOKEN": GATEWAY_TOKEN}
    server = kept_server(tmp_path, 1, state, "--instance", "k", **on_gateway).wait_ready()
    try:
        stateless = StatelessHttp(server)
        assert run_text(stateless, "x = 41", kernel="kept") and run_text(stateless, "x", kernel="kept")
        assert "Out[3]: ('forecast', 'divide')" in run_text(stateless, PUBLISH_CELL, kernel="kept")
        assert run_text(stateless, 'loommux["held"].run("q = 5").state', kernel="kept")  # a holder lease
        mine = handle_of(stateless.call("run_cell", {"freeform": "y = 'mine'", "kernel": "~"})[0])
        stale = handle_of(stateless.call("run_cell", {"freeform": "1", "kernel": "~"})[0])
        assert run_text(stateless, "w = 'lost'", kernel="vanishing")
        session, joined = HttpMcp(server), HttpMcp(server, resource="kept")
        assert session.call("run_cell", {"freeform": "z = 3"})[1] is False
        def recorded_all() -> bool:
            kept = state_file(state)
            return (len(kept["kernels"]) == 6 and len(kept["sessions"]) == 2
                    and all(k["remote_id"] for k in kept["kernels"]))

        assert wait_until(recorded_all, 30)
        port = server.port
        server.remember()
        server.proc.kill()
        server.proc.wait(20)
        recorded = state_file(state)
        remote = {k["name"] if k["kind"] == "named" else k["handle"] or k["id"]: k["remote_id"]
                  for k in recorded["kernels"]}
        assert set(remote.values()) <= gateway.kernels()  # the kernels outlive the server
        # while it is down: one kernel's leases run out, another kernel goes from the gateway
        stale_record = next(k for k in recorded["kernels"] if k["handle"] == stale)
        stale_record["leases"][0]["signal_at"] -= 10_000
        (state / "state.json").write_text(json.dumps(recorded))
        assert gateway.api("DELETE", f"/api/kernels/{remote['vanishing']}").status == 204
        with socket.socket() as busy:  # a start that cannot listen keeps what the state kept
            busy.bind(("127.0.0.1", 0))
            busy.listen()
            refused = kept_server(tmp_path, 3, state, "--instance", "k", port=busy.getsockname()[1],
                                  **on_gateway)
            assert refused.proc.wait(60) == 1 and "cannot listen on" in refused.log(), refused.log()
        assert set(remote.values()) - {remote["vanishing"], remote[stale]} <= gateway.kernels()
        assert state_file(state) == recorded
        server = kept_server(tmp_path, 2, state, "--instance", "k", port=port, **on_gateway).wait_ready()
        log = server.log()
        assert "instance k, 6 gateway kernels and 2 sessions to take back" in log, log
        held = server.resource("held")  # held by kernel kept alone
        assert [lease["session"] for lease in held["leases"]] == ["kernel kept"], held
        assert f"retired resource {stale_record['id']}: its leases ran out while loommux was down" in log
        assert wait_until(lambda: remote[stale] not in gateway.kernels(), 30)  # deleted at start
        text = stateless.call("run_cell", {"freeform": "x + 1", "kernel": "kept"})[0]
        assert text.startswith("In [101]") and "Out[101]: 42" in text, text  # after the reserved numbers
        assert ("Server restarted: loommux restarted and, at " in text and f"joined this kernel (id "
                f"{remote['kept']}) again: its variables are as they were, and the output of executions "
                "1 to 4 is kept; execution numbers continue at 101 "
                "(numbers 5 to 100 were reserved before the restart and are skipped)." in text), text
        answers = []

        def call_forecast() -> bool:  # what the kernel publishes is asked again, after the join
            answers.append(stateless.request("tools/call", {"name": "forecast",
                                                            "arguments": {"city": "Oslo", "kernel": "kept"}}))
            return "result" in answers[-1]

        assert wait_until(call_forecast, 30)
        assert answers[-1]["result"]["content"][1]["text"].startswith("[forecast · In [102] · "), answers
        assert "Server restarted" not in stateless.call("run_cell", {"freeform": "x", "kernel": "kept"})[0]
        text, is_error, _ = stateless.call("read_output", {"execution": 2, "kernel": "kept"})
        assert not is_error and text.endswith("\nOut[2]: 41"), text  # kept over the restart
        text, is_error, _ = stateless.call("read_output", {"execution": 50, "kernel": "kept"})
        assert is_error and text == ("execution_not_found: there is no execution 50; the output of "
                                     "executions 1 to 4 is kept; numbers 5 to 100 were reserved before the "
                                     "restart and are skipped; executions are numbered 101 to 103"), text
        assert "Out[101]: 5" in run_text(stateless, "q", kernel="held")
        # kept's kernel still reaches the control plane, with the credential the state kept
        assert "'completed'" in run_text(stateless, 'loommux["held"].run("r = q + 1").state', kernel="kept")
        assert "Out[103]: 6" in run_text(stateless, "r", kernel="held")
        assert "Out[101]: 'mine'" in stateless.call("run_cell", {"freeform": "y", "kernel": mine})[0]
        text, is_error, _ = stateless.call("status", {"kernel": stale})
        assert is_error and text.startswith(f"kernel_not_found: kernel {stale}"), text
        text = stateless.call("run_cell", {"freeform": "w", "kernel": "vanishing"})[0]
        assert "NameError" in text and "was gone from the gateway: this is a new kernel" in text, text
        session.drop()  # its connection went with the server; the session did not
        text = session.call("run_cell", {"freeform": "z"})[0]
        assert "Out[101]: 3" in text and "joined this kernel" in text, text
        joined.drop()
        assert "Out[105]: 41" in joined.call("run_cell", {"freeform": "x"})[0]
        # each kernel once on the gateway: the ones taken back, and vanishing's new one
        ids = {r["name"] if r["kind"] == "named" else r["id"]: r["kernel_id"] for r in server.resources()}
        # (vanishing's new kernel may have its old id: loommux creates a kernel with the id its state records)
        assert len(ids) == 5 and ids["kept"] == remote["kept"]
        assert set(ids.values()) == gateway.kernels() - before
    finally:
        server.cleanup()
    assert gateway.kernels() == before  # SIGTERM deletes them, and the state says so
    assert state_file(state)["kernels"] == [] and state_file(state)["sessions"] == []


@needs_gateway
def test_a_restart_after_sigkill_keeps_the_output_of_every_earlier_cell(gateway, tmp_path):
    server = kept_on_gateway(gateway, tmp_path, 1)
    try:
        client = StatelessHttp(server)

        def call(tool: str, **args) -> str:
            text, is_error, _ = client.call(tool, {**args, "kernel": "out"})
            assert not is_error, text
            return text

        run_text(client, "for i in range(3000):\n    print(f'line {i}')", kernel="out")
        run_text(client, "import sys\nprint('to out', flush=True)\nprint('to err', file=sys.stderr)\n6 * 7",
                 kernel="out")
        run_text(client, "1 / 0", kernel="out")
        running = run_text(client, "%%loommux --wait 1\nimport time\nfor i in range(30):\n"
                                   "    print(f'tick {i}', flush=True)\n    time.sleep(0.1)", kernel="out")
        assert "running" in running.partition("\n")[0], running
        shown = {(n, stream): call("read_output", execution=n, stream=stream, line_range="1:")
                 for n in (1, 2, 3) for stream in ("combined", "stdout", "stderr", "result", "traceback")}
        found = call("search_output", query=r"line 29\d\d", execution=1)
        ticks = lines_of(call("read_output", execution=4, line_range="1:"))
        notebook = server.api("GET", "/api/resources/out/notebook").body
        port = kill_at_once(server)
        server = kept_on_gateway(gateway, tmp_path, 2, port)
        client = StatelessHttp(server)
        text = run_text(client, "print('after')", kernel="out")
        assert ("its variables are as they were, and the output of executions 1 to 4 is kept (execution 4 "
                "was running: its output from then on is not); execution numbers continue at 101 (numbers 5 "
                "to 100 were reserved before the restart and are skipped)." in text), text
        for (n, stream), before in shown.items():
            assert call("read_output", execution=n, stream=stream, line_range="1:") == before
        assert call("search_output", query=r"line 29\d\d", execution=1) == found
        assert lines_of(call("read_output", execution=4, line_range="1:"))[: len(ticks)] == ticks
        status = call("execution_status", execution=4)
        assert "[execution 4 · killed]" in status, status
        assert "reason: loommux was killed while it ran" in status, status
        assert "error: ZeroDivisionError" in call("execution_status", execution=3)
        listed = call("status")  # the new one, then the earlier ones
        assert re.search(r"^ +101 +completed.*\n +4 +killed.*\n +3 +error", listed, re.MULTILINE), listed
        again = server.api("GET", "/api/resources/out/notebook").body
        for cell in range(3):  # the notebook renders them as before
            assert code_cells(valid_notebook(again))[cell] == code_cells(valid_notebook(notebook))[cell]
    finally:
        server.cleanup()


# A cell whose first message arrives after the cell ended: a hole in the kernel's numbers when the cell ends,
# which the message fills late (a message that shows nothing, or the end of the line the cell left open).
LATE_MESSAGE_CELL = """import threading
kernel = get_ipython().kernel
held = kernel.session.msg({!r}, {!r}, parent=kernel.get_parent())
print('on time\\nopen', end='', flush=True)
threading.Timer(1, kernel.session.send, (kernel.iopub_socket, held)).start()"""


@needs_gateway
@pytest.mark.parametrize("late", [("late_note", {}), ("stream", {"name": "stdout", "text": " late\n"})],
                         ids=["showing-nothing", "printing-late"])
def test_a_restart_says_the_status_of_an_earlier_cell_as_it_was(gateway, tmp_path, late):
    server = kept_on_gateway(gateway, tmp_path, 1)
    try:
        client = StatelessHttp(server)
        cell = LATE_MESSAGE_CELL.format(*late)
        handle = handle_of(client.call("run_cell", {"freeform": cell, "kernel": "~"})[0])
        run_text(client, "print('no line end', end='')", kernel=handle)  # its file holds whole lines

        def status(n: int) -> str:
            return client.call("execution_status", {"execution": n, "kernel": handle})[0]

        assert wait_until(lambda: "never arrived" not in status(1), 30), status(1)
        before = [status(1), status(2)]
        assert "stdout: 2 lines" in before[0] and "output file: " in before[0], before[0]
        assert "stdout: 1 line · 11 characters" in before[1], before[1]
        port = kill_at_once(server)
        server = kept_on_gateway(gateway, tmp_path, 2, port)
        client = StatelessHttp(server)
        run_text(client, "print('after')", kernel=handle)
        for was, now in zip(before, [status(1), status(2)], strict=True):
            assert now == was, f"{was}\n---\n{now}"
    finally:
        server.cleanup()


@needs_gateway
def test_a_tampered_state_dir_reaches_nothing_outside_it(gateway, tmp_path):
    state, victim, remote = tmp_path / "state", tmp_path / "victim.txt", None
    victim.write_text("a person's secret\n")
    server = kept_on_gateway(gateway, tmp_path, 1)
    try:
        client = StatelessHttp(server)
        run_text(client, "from IPython.display import HTML\nHTML('<b>kept</b>' * 500)", kernel="out")
        assert "Out[2]: 42" in run_text(client, "42", kernel="out")
        port = kill_at_once(server)
        journal = state / "output" / "out" / "executions.jsonl"
        records = [json.loads(line) for line in journal.read_text().splitlines()]
        for record in records:  # execution 1's display named as a file outside, of a size beyond any file
            for entry in record.get("end", {}).get("rich", ()):
                if isinstance(entry, dict) and "stored" in entry:
                    entry["stored"] = {"path": str(victim), "offset": 0, "size": 2**31}
        journal.write_text("".join(json.dumps(record) + "\n" for record in records))
        server = kept_on_gateway(gateway, tmp_path, 2, port)
        client = StatelessHttp(server)
        assert "joined this kernel" in run_text(client, "1", kernel="out")
        log = server.log()
        assert re.search(r"resource out: execution 1's record is not one \(a stored display's file is not "
                         r"one of its directory's: .*victim\.txt'\): left out", log), log
        notebook = server.api("GET", "/api/resources/out/notebook").body
        assert b"secret" not in notebook and b"42" in notebook
        text, is_error, _ = client.call("read_output", {"execution": 2, "kernel": "out"})
        assert not is_error and text.endswith("Out[2]: 42"), text  # the other execution is taken back
        port = kill_at_once(server)
        # a kernel whose id is a path, a number out of bounds: the record is moved aside, in one line
        recorded = state_file(state)
        remote = recorded["kernels"][0]["remote_id"]
        recorded["kernels"][0].update(id="../../victim4", executions=10**30)
        (state / "state.json").write_text(json.dumps(recorded))
        (tmp_path / "victim4").mkdir()
        (tmp_path / "victim4" / "1.txt").write_text("a person's")
        server = kept_on_gateway(gateway, tmp_path, 3, port)
        client = StatelessHttp(server)
        lines = [line for line in server.log().splitlines() if "not a whole state file" in line]
        assert len(lines) == 1 and "KernelRecord.id is '../../victim4', not one loommux writes" in lines[0]
        assert "started empty" in lines[0], lines
        assert run_text(client, "print('fresh')", kernel="out").startswith("In [1]")
    finally:
        server.cleanup()
        if remote is not None:
            gateway.api("DELETE", f"/api/kernels/{remote}")  # the kernel the moved-aside state held
    assert (tmp_path / "victim4" / "1.txt").read_text() == "a person's" and victim.exists()
    assert not (tmp_path / "output").exists() and not (state / "victim4").exists()


def kill_at_once(server: LoommuxHttp) -> int:
    """SIGKILL the server (what the state file holds is what it wrote until then); its port."""
    server.remember()
    server.proc.kill()
    server.proc.wait(20)
    return server.port


def kept_on_gateway(gateway, base: Path, n: int, port: int = 0) -> LoommuxHttp:
    """Instance k with its state in base/state, its kernels on the gateway, once it is ready."""
    return kept_server(base, n, base / "state", "--instance", "k", port=port, LOOMMUX_GATEWAY_URL=gateway.url,
                       LOOMMUX_GATEWAY_TOKEN=GATEWAY_TOKEN).wait_ready()


def shown_number(text: str) -> int:
    return int(re.match(r"In \[(\d+)\]", text).group(1))


@needs_gateway
def test_a_sigkill_right_after_a_result_forgets_no_kernel_and_gives_no_number_twice(gateway, tmp_path):
    state, before = tmp_path / "state", gateway.kernels()
    server = kept_on_gateway(gateway, tmp_path, 1)
    try:
        # a new gateway kernel is in the state file before its first result is shown
        assert "Out[1]: 1" in run_text(StatelessHttp(server), "x = 1\nx", kernel="fresh")
        port = kill_at_once(server)
        recorded = {k["name"]: k for k in state_file(state)["kernels"]}
        assert recorded["fresh"]["remote_id"] in gateway.kernels() - before, recorded
        assert recorded["fresh"]["reserved"] >= 1, recorded  # its number too
        server = kept_on_gateway(gateway, tmp_path, 2, port)
        stateless = StatelessHttp(server)
        text = run_text(stateless, "x", kernel="fresh")
        first = shown_number(text)
        assert "joined this kernel" in text and first > 1 and f"Out[{first}]: 1" in text, text
        # numbers shown just before a SIGKILL are never given again: a restart goes on after the reserved ones
        shown = [first, *(shown_number(run_text(stateless, f"{n}", kernel="fresh")) for n in range(3))]
        port = kill_at_once(server)
        server = kept_on_gateway(gateway, tmp_path, 3, port)
        stateless = StatelessHttp(server)
        text = run_text(stateless, "x + 1", kernel="fresh")
        following = shown_number(text)
        assert following > max(shown) and f"Out[{following}]: 2" in text, (shown, text)
        skipped = re.search(r"execution numbers continue at (\d+) \(numbers (\d+) to (\d+) were reserved "
                            r"before the restart and are skipped\)\.", text)
        assert skipped and int(skipped[1]) == following and int(skipped[3]) == following - 1, text
        # a state file of before reserved numbers (no "reserved"): numbers go on after its executions
        assert wait_until(lambda: state_file(state)["kernels"][0]["executions"] == following, 10)
        port = kill_at_once(server)
        older = state_file(state)
        del older["kernels"][0]["reserved"]
        (state / "state.json").write_text(json.dumps(older))
        server = kept_on_gateway(gateway, tmp_path, 4, port)
        stateless = StatelessHttp(server)
        text = run_text(stateless, "x", kernel="fresh")
        assert text.startswith(f"In [{following + 1}]") and (
            f"execution numbers continue at {following + 1}." in text), text
        # a state file that cannot be written holds no kernel up: said once, and the kernel goes on
        def put_in_the_way() -> bool:  # the server may write the file again between the two steps
            with contextlib.suppress(FileNotFoundError):
                (state / "state.json").unlink()
            with contextlib.suppress(FileExistsError, NotADirectoryError):
                (state / "state.json" / "in-the-way").mkdir(parents=True)
            return (state / "state.json").is_dir()

        assert wait_until(put_in_the_way, 10)
        assert "Out[1]: 2" in run_text(stateless, "1 + 1", kernel="unrecorded")
        assert server.log().count("state: cannot write") == 1, server.log()
        shutil.rmtree(state / "state.json")
    finally:
        server.cleanup()
    assert gateway.kernels() == before


def test_a_state_file_that_cannot_be_taken_back_is_one_line(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "state.json").write_text('{"version": 1, "instance": "k", "kernels": [{"id": "ke')  # cut short
    server = kept_server(tmp_path, 1, state, "--instance", "k").wait_ready()
    try:
        moved = [p.name for p in state.iterdir() if p.name.startswith("state.json.bad-")]
        assert len(moved) == 1, list(state.iterdir())
        log = server.log()
        assert ("is not a whole state file (" in log and f"moved it to {moved[0]} and started empty" in log
                and "local kernels are never kept over a restart" in log), log
        second = kept_server(tmp_path, 10, state, "--instance", "k")  # the same directory, while in use
        assert second.proc.wait(60) == 1
        assert (f"state directory {state} is in use by another loommux (pid {server.proc.pid}): refused to "
                "start" in second.log()), second.log()
        written = state / "state.json"
        assert wait_until(lambda: written.exists() and state_file(state)["instance"] == "k", 10)
        assert written.stat().st_mode & 0o777 == 0o600  # it holds credentials
        written.unlink()  # a file that cannot be written: said once, and again once it can
        (written / "in-the-way").mkdir(parents=True)
        for _ in range(3):
            HttpMcp(server).close()  # a new session: a change to record
            time.sleep(0.2)
        assert wait_until(lambda: "state: cannot write" in server.log(), 10)
        assert server.log().count("state: cannot write") == 1, server.log()
        shutil.rmtree(written)
        HttpMcp(server).close()
        assert wait_until(lambda: f"state: {written} is written again" in server.log(), 10), server.log()
        assert written.is_file()
    finally:
        server.cleanup()
    base = {"gateway": "none", "kernels": [], "sessions": []}
    for n, (content, args, said) in enumerate([
            ({**base, "version": 1, "instance": "b"}, ("--instance", "k"),
             ("is loommux instance b's, and this is instance k: refused to start; give each instance its "
              "own --state-dir")),
            ({**base, "version": 99, "instance": "k", "novel": True}, (),
             "is from a newer loommux (state version 99; this one reads 1): refused to start")]):
        (state / "state.json").write_text(json.dumps(content))
        refused = kept_server(tmp_path, n + 2, state, *args)
        assert refused.proc.wait(60) == 1
        lines = [line for line in refused.log().splitlines() if "state" in line]
        assert len(lines) == 1 and f"state file {state / 'state.json'} {said}" in lines[0], refused.log()
        assert json.loads((state / "state.json").read_text()) == content  # never overwritten
    # without --instance, the instance is the one its state names
    (state / "state.json").write_text(json.dumps({**base, "version": 1, "instance": "b"}))
    server = kept_server(tmp_path, 9, state).wait_ready()
    try:
        assert re.search(r"listening on .* · instance b\n", server.log()), server.log()
    finally:
        server.cleanup()


# ---------------------------------------------------------------- Execution resources


@pytest.mark.fast
def test_execution_uris_say_what_a_tool_call_would_say():
    parse = loommux.parse_execution_uri
    for uri in ["loommux://executions/3/combined", "loommux://executions/12/images/2",
                "loommux://kernels/lab/executions/7/stderr?lines=-40:",
                "loommux://kernels/~inst.AbC-_x/executions/1/images/1"]:
        assert str(parse(uri)) == uri
    assert parse("loommux://kernels/lab/executions/7/stdout?lines=1%3A40") == loommux.ExecutionUri(
        7, "stdout", kernel="lab", lines="1:40")
    for bad in ["loommux://executions/0/combined", "loommux://executions/3/everything",
                "loommux://executions/3", "file:///etc/passwd", "loommux://kernels/a b/executions/1/stdout",
                "loommux://executions/3/images/0"]:
        with pytest.raises(loommux.UnknownUri):
            parse(bad)
    for bad_query in ["loommux://executions/3/images/1?lines=1:2", "loommux://executions/3/combined?x=1"]:
        with pytest.raises(ValueError, match="one query parameter"):
            parse(bad_query)


@pytest.mark.fast
def test_a_read_over_the_token_limit_is_cut_where_a_note_says_and_reads_on(monkeypatch):
    if TIKTOKEN_DIR.is_dir():  # the tokenizer's file, as the servers the other tests start find it
        monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(TIKTOKEN_DIR))
    log = log_of("".join(f"row {i} " + "word " * 20 + "\n" for i in range(1, 2001)))
    uri = loommux.parse_execution_uri("loommux://kernels/lab/executions/4/stdout")
    text = loommux.render_stream_read(log, 0, log.line_count, uri)
    *shown, note = text.split("\n")
    assert loommux.count_tokens(text) <= loommux.TOKEN_LIMIT and shown[0].startswith("row 1 ")
    last = len(shown)
    assert shown[-1].startswith(f"row {last} ") and 100 < last < 2000
    assert note == (f"[cut at the 5,000-token limit: lines 1-{last} of 2,000 shown · the rest: "
                    f"loommux://kernels/lab/executions/4/stdout?lines={last + 1}: · or "
                    f'read_output(execution=4, line_range="{last + 1}:", stream="stdout", kernel="lab")]')
    rest = loommux.parse_execution_uri(f"loommux://kernels/lab/executions/4/stdout?lines={last + 1}:")
    first, stop = loommux.parse_line_range(rest.lines, log.line_count)
    assert loommux.render_stream_read(log, first, stop, rest).startswith(f"row {last + 1} ")
    small = loommux.render_stream_read(log, 1994, 2000, uri)  # what fits comes whole, without a note
    assert small.split("\n") == [f"row {i} " + "word " * 20 for i in range(1995, 2001)]
    long_line = log_of("x" * 200_000 + "\nafter\n")
    clipped, note = loommux.render_stream_read(long_line, 0, 2, uri).split("\n")
    assert set(clipped) == {"x"} and 1000 < len(clipped) < 200_000
    assert note.startswith("[cut at the 5,000-token limit: line 1 of 2 is longer: its start is shown · "
                           "the rest: loommux://kernels/lab/executions/4/stdout?lines=2: · ")


LONG_CELL = "%%loommux --wait 60\nfor i in range(1, 6001):\n    print(f'row {i}')"
MANY_IMAGES = ("%%loommux --wait 60\nimport base64, io\nfrom IPython.display import display\n"
               "from PIL import Image as PILImage\nfor i in range(23):\n    buffer = io.BytesIO()\n"
               "    PILImage.new('RGB', (4 + i, 3), 'red').save(buffer, 'PNG')\n"
               "    display({'image/png': base64.b64encode(buffer.getvalue()).decode()}, raw=True)")


def make_official_target(transport: str, http_server, tmp_path):
    from mcp import StdioServerParameters

    (tmp_path / "ws").mkdir(exist_ok=True)
    return (StdioServerParameters(command=sys.executable, args=[str(LOOMMUX)], env=server_env(),
                                  cwd=str(tmp_path / "ws"))
            if transport == "stdio" else http_server.url)


@pytest.mark.anyio
@pytest.mark.parametrize("transport", ["stdio", "http"])
@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_executions_as_resources_through_the_official_client(http_server, tmp_path, transport, mode):
    """A result over the token limit links its output; the link reads back cut at the limit with a note
    naming the rest, which reads on; images beyond a result's limit are linked and read as blobs; the list,
    the templates, caching fields (2026-07-28) and unknown URIs."""
    from mcp import Client, MCPError

    async with Client(make_official_target(transport, http_server, tmp_path), mode=mode,
                      read_timeout_seconds=120) as client:
        long = await client.call_tool("run_cell", {"freeform": LONG_CELL})
        n = Cell.parse(long.content[0].text).n
        assert [block.type for block in long.content] == ["text", "resource_link"]
        link = long.content[1]
        assert (link.uri, link.mime_type) == (f"loommux://executions/{n}/combined", "text/plain")
        assert link.size == sum(len(f"row {i}\n") for i in range(1, 6001))
        read = await client.read_resource(link.uri)
        *rows, note = read.contents[0].text.split("\n")
        assert rows == [f"row {i}" for i in range(1, len(rows) + 1)] and len(rows) > 500
        rest = f"loommux://executions/{n}/combined?lines={len(rows) + 1}:"
        assert f"the rest: {rest} ·" in note and note.startswith("[cut at the 5,000-token limit")
        tail = await client.read_resource(f"loommux://executions/{n}/stdout?lines=-2:")
        assert tail.contents[0].text == "row 5999\nrow 6000"
        assert (await client.read_resource(rest)).contents[0].text.startswith(f"row {len(rows) + 1}\n")

        images = await client.call_tool("run_cell", {"freeform": MANY_IMAGES})
        m = Cell.parse(images.content[0].text).n
        kinds = [block.type for block in images.content]
        assert kinds.count("image") == 20 and kinds[-4:] == ["text", *(["resource_link"] * 3)]
        for display, linked in zip((21, 22, 23), images.content[-3:]):
            assert linked.uri == f"loommux://executions/{m}/images/{display}"
            blob = (await client.read_resource(linked.uri)).contents[0]
            assert blob.mime_type == "image/png" and base64.b64decode(blob.blob).startswith(b"\x89PNG")

        listed = await client.list_resources()
        uris = [resource.uri for resource in listed.resources]
        assert uris[:3] == ["skill://loommux/SKILL.md", f"loommux://executions/{m}/combined",
                            f"loommux://executions/{n}/combined"]
        templates = [t.uri_template for t in (await client.list_resource_templates()).resource_templates]
        assert "loommux://kernels/{kernel}/executions/{execution}/{stream}" in templates
        with pytest.raises(MCPError) as missing:
            await client.read_resource(f"loommux://executions/{m + 50}/combined")
        assert missing.value.error.code == (-32002 if mode == "legacy" else -32602)
        assert f"there is no execution {m + 50}" in missing.value.error.message
        if mode == "auto":  # the caching fields of 2026-07-28
            assert (read.ttl_ms, read.cache_scope) == (3_600_000, "private")
            assert (listed.ttl_ms, listed.cache_scope) == (0, "private")


def test_clients_before_2025_06_18_get_no_resource_links(spawn):
    """resource_link content came with protocol 2025-06-18: an older client's results stay as they were."""
    older = spawn(initialize=False)
    older.initialize("2025-03-26")
    result = older.result("tools/call", tool_params("run_cell", {"freeform": LONG_CELL}))
    assert [block["type"] for block in result["content"]] == ["text"]
    assert "[output omitted: 6,000 lines" in result["content"][0]["text"]


@pytest.mark.anyio
async def test_named_and_private_kernels_have_a_kernel_part_in_their_uris(http_server):
    from mcp import Client

    async with Client(http_server.url, read_timeout_seconds=120) as client:
        named = await client.call_tool("run_cell", {"freeform": LONG_CELL, "kernel": "uri-lab"})
        n = Cell.parse(named.content[0].text).n
        assert named.content[-1].uri == f"loommux://kernels/uri-lab/executions/{n}/combined"
        opened = await client.call_tool("run_cell", {"freeform": LONG_CELL, "kernel": "~"})
        handle = handle_of(opened.content[0].text)
        linked = opened.content[-1].uri
        assert linked == f"loommux://kernels/{handle}/executions/1/combined"
        head = await client.read_resource(linked + "?lines=1:2")
        assert head.contents[0].text == "row 1\nrow 2"
        elsewhere = await client.read_resource(f"loommux://kernels/uri-lab/executions/{n}/combined?lines=3")
        assert elsewhere.contents[0].text == "row 3"


def test_a_running_cell_links_its_output_and_subscribers_hear_it_grow(srv):
    """resources/subscribe (handshake): notifications/resources/updated while the output grows, at most once
    a second, and once at its end; the running notice links the output so far, read with ttl 0."""
    code = ("%%loommux --wait 0.1\nimport time\nfor i in range(40):\n    print('tick', i, flush=True)\n"
            "    time.sleep(0.1)")
    result = srv.result("tools/call", tool_params("run_cell", {"freeform": code}))
    running = Cell.parse(result["content"][0]["text"])
    link = result["content"][-1]
    assert running.state == "running" and link["type"] == "resource_link"
    assert link["uri"] == f"loommux://executions/{running.n}/combined"
    since = len(srv.messages)
    assert srv.result("resources/subscribe", {"uri": link["uri"]}) == {}
    finish(srv, running)
    time.sleep(0.5)  # the end's notification follows the cell's end
    updates = [m for m in srv.messages[since:] if m.get("method") == "notifications/resources/updated"]
    assert updates and all(m["params"] == {"uri": link["uri"]} for m in updates)
    assert 2 <= len(updates) < 40, updates  # not one per print
    text = srv.result("resources/read", {"uri": link["uri"]})["contents"][0]["text"]
    assert text.split("\n") == [f"tick {i}" for i in range(40)]
    assert srv.result("resources/unsubscribe", {"uri": link["uri"]}) == {}
    error = srv.request("resources/subscribe", {"uri": "loommux://executions/999999/stdout"})["error"]
    assert error["code"] == -32002
    for bad in [{"uri": link["uri"] + "?lines=0:3"}, {"uri": link["uri"] + "?page=2"}, {"uri": 7}]:
        assert srv.request("resources/read", bad)["error"]["code"] == -32602, bad


@pytest.mark.anyio
@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_a_2026_07_28_listen_hears_a_running_output_grow(http_server, tmp_path, transport):
    from mcp import Client
    from mcp.client.subscriptions import ResourceUpdated

    code = ("%%loommux --wait 0.1\nimport time\nfor i in range(25):\n    print('tick', i, flush=True)\n"
            "    time.sleep(0.1)")
    target = make_official_target(transport, http_server, tmp_path)
    async with Client(target, read_timeout_seconds=120) as client:
        started = await client.call_tool("run_cell", {"freeform": code, "kernel": "uri-listen"})
        uri = started.content[-1].uri
        assert uri.startswith("loommux://kernels/uri-listen/executions/")
        heard = []
        async with client.listen(resource_subscriptions=[uri, "loommux://executions/999999/stdout"]) as sub:
            assert sub.honored.resource_subscriptions == [uri]
            async for event in sub:
                assert isinstance(event, ResourceUpdated) and event.uri == uri
                heard.append(event)
                text = (await client.read_resource(uri)).contents[0].text
                if text.endswith("tick 24"):
                    break
        assert 1 <= len(heard) < 25


def test_skills_list_and_get_serve_the_loommux_skill(srv, http_server):
    """The Skills extension (declared in both eras): one skill whose entry matches SKILL.md's bytes and
    frontmatter; an unknown skill is -32602."""
    assert srv.init_result["capabilities"]["extensions"] == {"io.modelcontextprotocol/skills": {},
                                                             "io.modelcontextprotocol/ui": {}}
    assert srv.init_result["capabilities"]["resources"] == {"subscribe": True}
    assert "skill://loommux/SKILL.md" in srv.init_result["instructions"]
    stateless = StatelessHttp(http_server)
    for client in (srv, stateless):
        [entry] = client.result("skills/list")["skills"]
        assert client.result("skills/get", {"uri": entry["uri"]})["skill"] == entry
        read = client.result("resources/read", {"uri": "skill://loommux/SKILL.md"})
        text = read["contents"][0]["text"]
        data = text.encode()
        assert entry["resources"] == [{"uri": "skill://loommux/SKILL.md", "size": len(data),
                                       "digest": "sha256:" + hashlib.sha256(data).hexdigest()}]
        frontmatter = dict(line.split(": ", 1) for line in text.split("---\n")[1].splitlines())
        assert frontmatter == entry["frontmatter"] and frontmatter["name"] == "loommux"
        for needed in ("read_output", "search_output", "interrupt", "restart", "%%loommux --wait", "5,000"):
            assert needed in text
        assert len(text) > len(srv.init_result["instructions"])
        other = {"uri": "skill://other/SKILL.md"}
        refused = (client.send("skills/get", other).json() if client is stateless
                   else srv.request("skills/get", other))
        assert refused["error"]["code"] == -32602
    listed = stateless.result("skills/list")
    assert listed["ttlMs"] > 0 and listed["cacheScope"] == "public"
    assert "ttlMs" not in srv.result("skills/list")  # the handshake era has no caching fields


# ---------------------------------------------------------------- Execution view

UI_EXTENSION = "io.modelcontextprotocol/ui"
APPS_CAPABILITIES = {"extensions": {UI_EXTENSION: {"mimeTypes": ["text/html;profile=mcp-app"]}}}


@pytest.mark.fast
def test_hosts_declare_mcp_apps_with_the_html_profile():
    declares = loommux.declares_apps
    assert declares(APPS_CAPABILITIES)
    several = ["text/x-other", "text/html;profile=mcp-app"]
    assert declares({"extensions": {UI_EXTENSION: {"mimeTypes": several}}})
    for undeclared in [None, {}, {"extensions": {}}, {"extensions": {UI_EXTENSION: {}}}, {"extensions": []},
                       {"extensions": {UI_EXTENSION: {"mimeTypes": "text/html;profile=mcp-app"}}},
                       {"extensions": {UI_EXTENSION: {"mimeTypes": ["text/html"]}}}]:
        assert not declares(undeclared), undeclared


@pytest.mark.fast
def test_the_view_reads_a_window_of_lines_and_the_rich_outputs_it_lacks():
    png = {"data": {"image/png": PNG_DATA, "text/plain": "<Figure>"}, "metadata": {}}
    table = {"data": {"text/html": "<table><tr><td>1</td></tr></table>", "text/plain": "df"}, "metadata": {}}
    svg = {"data": {"image/svg+xml": "<svg/>", "text/plain": "<svg>"}, "metadata": {}}
    execution = finished_execution(
        3, ("stream", {"name": "stdout", "text": "".join(f"line {i}\n" for i in range(1, 501))}),
        ("display_data", png), ("display_data", table), ("display_data", svg),
        ("stream", {"name": "stdout", "text": "x" * 5000 + "\n"}))
    execution.source = "%%loommux --wait 5\n\nfor i in range(500): ..."
    tail = asyncio.run(loommux.describe_for_view(execution, None, 0, 0))
    assert (tail["execution"], tail["state"], tail["source"]) == (3, "completed", "for i in range(500): ...")
    assert tail["line_count"] == 504 and tail["first_line"] == 305 and len(tail["lines"]) == 200
    assert tail["lines"][-4:-1] == [execution.images[0].caption, "df", "<svg>"]
    assert tail["lines"][-1] == "x" * 2000  # clipped: read_output reads it whole
    assert [(image["display"], image["line"]) for image in tail["images"]] == [(1, 501)]
    assert [item["mime"] for item in tail["html"]] == ["text/html", "image/svg+xml"]
    # HTML is counted among the three displays: a poll from html_next reads none the view has passed
    assert (tail["html_count"], tail["html_next"], tail["images_next"], tail["image_count"]) == (3, 3, 1, 1)
    window = asyncio.run(loommux.describe_for_view(execution, "10:1000", 1, 2))
    assert window["first_line"] == 10 and window["lines"][0] == "line 10" and len(window["lines"]) == 200
    assert window["images"] == [] and window["html"] == [{"mime": "image/svg+xml", "text": "<svg/>"}]
    with pytest.raises(ValueError, match="comes after"):
        asyncio.run(loommux.describe_for_view(execution, "9:3", 0, 0))
    take = loommux.take_within
    assert take(["aa", "bbb", "c"], 0, len, 5) == (["aa", "bbb"], 2)
    assert take(["aa", "bbb", "c"], 2, len, 5) == (["c"], 3)
    assert take(["toolong", "b"], 0, len, 3) == (["toolong"], 1)  # one at least: the view always moves on
    assert take(["a"], 0, len, 0) == ([], 0) and take(["a"], 1, len, 9) == ([], 1)
    html = {"data": {"text/html": "<b>x</b>"}}
    displays = (png, html, html, svg)
    assert loommux.list_rich(displays, 0, 8) == ([("text/html", "<b>x</b>")], 2)  # the budget: one at least
    both = [("text/html", "<b>x</b>"), ("image/svg+xml", "<svg/>")]
    assert loommux.list_rich(displays, 2, 100) == (both, 4)
    assert loommux.list_rich(displays, 9, 100) == ([], 9)


def without_view_meta(tools: list[dict]) -> list[dict]:
    """tools/list as a host without MCP Apps would see it, given what a host with them saw."""
    plain = []
    for tool in tools:
        if tool.get("_meta", {}).get("ui", {}).get("visibility") == ["app"]:
            continue
        meta = {k: v for k, v in tool.get("_meta", {}).items() if k not in ("ui", "ui/resourceUri")}
        plain.append({**{k: v for k, v in tool.items() if k != "_meta"}, **({"_meta": meta} if meta else {})})
    return plain


def apps_session(server: LoommuxHttp) -> HttpMcp:
    """A handshake session whose client declared MCP Apps (HTML views) at initialize."""
    session = HttpMcp(server, initialize=False)
    params = {**INITIALIZE_PARAMS, "capabilities": APPS_CAPABILITIES}
    response = session.post(session.message("initialize", params))
    assert response.status == 200, response.body[:500]
    session.session_id = response.headers["mcp-session-id"]
    assert response.json()["result"]["capabilities"]["extensions"][UI_EXTENSION] == {}
    assert session.post(jsonrpc("notifications/initialized")).status == 202
    return session


def test_only_hosts_that_declare_mcp_apps_get_the_view_and_its_tool(http_server):
    with HttpMcp(http_server) as plain, apps_session(http_server) as apps:
        plain_tools = plain.result("tools/list")["tools"]
        assert '"ui' not in json.dumps(plain_tools) and "view_output" not in json.dumps(plain_tools)
        refused = plain.request("tools/call", tool_params("view_output", {}))
        assert refused["error"]["message"].startswith("Unknown tool: view_output"), refused
        tools = {tool["name"]: tool for tool in apps.result("tools/list")["tools"]}
        for name in ("run_cell", "wait"):
            assert tools[name]["_meta"]["ui"] == {"resourceUri": loommux.VIEW_URI}
            assert tools[name]["_meta"]["ui/resourceUri"] == loommux.VIEW_URI
        assert tools["view_output"]["_meta"] == {"ui": {"visibility": ["app"]}}
        assert without_view_meta(list(tools.values())) == plain_tools  # model-facing tools stay the same
        page = apps.result("resources/read", {"uri": loommux.VIEW_URI})["contents"]
        assert page == [{"uri": "ui://loommux/execution", "mimeType": "text/html;profile=mcp-app",
                         "text": loommux.VIEW_HTML, "_meta": {"ui": {"prefersBorder": True}}}]
        assert page[0]["text"].startswith("<!DOCTYPE html>")
        assert not re.search(r"""(?:src|href)\s*=\s*["']?[a-z]*:?//|@import|url\(""", page[0]["text"])
        cell = run(apps, "print('a')\nprint('b')")
        text, is_error, _ = apps.call("view_output", {"execution": cell.n})
        seen = json.loads(text.split("\n")[0])
        assert not is_error and seen["lines"] == ["a", "b"] and seen["state"] == "completed"
        assert (seen["execution"], seen["line_count"], seen["first_line"]) == (cell.n, 2, 1)
        bad_range = {"execution": cell.n, "line_range": "5:2"}
        error = tool_error(apps, "view_output", bad_range, "invalid_line_range")
        assert "start 5 comes after stop 2" in error
        big = "<table>" + "<tr><td>cell</td></tr>" * 100 + "</table>"  # kept in the file of displays
        cell = run(apps, f"from IPython.display import HTML, display\ndisplay(HTML({big!r}))")
        text, is_error, _ = apps.call("view_output", {"execution": cell.n})
        seen = json.loads(text.split("\n")[0])
        assert seen["html"] == [{"mime": "text/html", "text": big}] and seen["html_count"] == 1
        noise = "import base64, io, os\nfrom PIL import Image\nfrom IPython.display import display\n" \
            "buf = io.BytesIO(); Image.frombytes('RGB', (40, 30), os.urandom(3600)).save(buf, 'PNG')\n" \
            "display(Image.open(io.BytesIO(buf.getvalue())))"  # over 1 KiB: kept in the file of displays
        cell = run(apps, noise)
        text, is_error, _ = apps.call("view_output", {"execution": cell.n})
        seen = json.loads(text.split("\n")[0])
        assert (seen["image_count"], seen["images_next"]) == (1, 1), seen
        assert [image["mime"] for image in seen["images"]] == ["image/png"]
        assert len(base64.b64decode(seen["images"][0]["data"])) > 1024
    modern = StatelessHttp(http_server)
    assert UI_EXTENSION in modern.result("server/discover")["capabilities"]["extensions"]
    assert '"ui' not in json.dumps(modern.result("tools/list")["tools"])
    declared = {"io.modelcontextprotocol/clientCapabilities": APPS_CAPABILITIES}
    linked = modern.result("tools/list", {"_meta": declared})["tools"]
    assert without_view_meta(linked) == modern.result("tools/list")["tools"] != linked
    run(modern, "print('modern')")
    seen = modern.result("tools/call", {**tool_params("view_output", {}), "_meta": declared})
    assert json.loads(seen["content"][0]["text"])["lines"] == ["modern"]  # the running or last cell
    refused = modern.send("tools/call", tool_params("view_output", {})).json()  # not declared on this request
    assert refused["error"]["message"].startswith("Unknown tool: view_output"), refused
    no_html = {"io.modelcontextprotocol/clientCapabilities": {"extensions": {UI_EXTENSION: {}}}}
    assert '"ui' not in json.dumps(modern.result("tools/list", {"_meta": no_html})["tools"])


# The official host side of MCP Apps (@modelcontextprotocol/ext-apps's AppBridge, with the official MCP client
# it forwards the view's calls through), bundled for the browser by .ci/run; the test page plays the host.
EXT_APPS_BUNDLE = Path(os.environ.get("LOOMMUX_TEST_EXT_APPS", ROOT / ".ci" / "npm" / "host-bridge.js"))
PNG_1X1_B64 = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5E"
               "rkJggg==")
HOST_ORIGIN, SANDBOX_ORIGIN = "http://host.test", "http://sandbox.test"
# The specification's restrictive default, which a host must apply to a view that declares no csp.
DEFAULT_VIEW_CSP = ("default-src 'none'; script-src 'self' 'unsafe-inline'; "
                    "style-src 'self' 'unsafe-inline'; img-src 'self' data:; media-src 'self' data:; "
                    "connect-src 'none'; object-src 'none'; "
                    "frame-src 'none'; base-uri 'self'")
HOST_PAGE = """<!DOCTYPE html><html><body><script type="module">
import { AppBridge, PostMessageTransport, Client, StreamableHTTPClientTransport } from "/host-bridge.js";
const UI = "io.modelcontextprotocol/ui", MIME = "text/html;profile=mcp-app";
window.host = {
  sizes: [],
  async connect(declare) {
    const capabilities = declare ? { extensions: { [UI]: { mimeTypes: [MIME] } } } : {};
    this.client = new Client({ name: "ext-apps-test-host", version: "1.0.0" }, { capabilities });
    await this.client.connect(new StreamableHTTPClientTransport(new URL("/mcp", location.href)));
    this.tools = (await this.client.listTools()).tools;
    return this.tools;
  },
  async call(name, args) {
    return await this.client.callTool({ name, arguments: args });
  },
  // What a host does for a tool linked to a view: read the view, frame it in the sandbox proxy, bridge it,
  // send the arguments, call the tool, send its result.
  async show(name, args) {
    const tool = this.tools.find((t) => t.name === name);
    const page = (await this.client.readResource({ uri: tool._meta.ui.resourceUri })).contents[0];
    document.getElementById("view")?.remove();
    const frame = document.createElement("iframe");
    frame.id = "view"; frame.style = "width: 960px; height: 720px; border: 0";
    frame.sandbox = "allow-scripts allow-same-origin";
    const bridge = new AppBridge(this.client, { name: "test-host", version: "1.0.0" },
      { serverTools: {}, serverResources: {} }, { hostContext: { theme: "light", displayMode: "inline" } });
    bridge.onsizechange = (size) => this.sizes.push(size);
    const resource = { html: page.text, csp: page._meta?.ui?.csp };
    bridge.onsandboxready = () => bridge.sendSandboxResourceReady(resource);
    const initialized = new Promise((resolve) => { bridge.oninitialized = resolve; });
    frame.src = "%SANDBOX%/proxy.html";
    document.body.append(frame);
    await bridge.connect(new PostMessageTransport(frame.contentWindow, frame.contentWindow));
    await initialized;
    await bridge.sendToolInput({ arguments: args });
    const result = await this.client.callTool({ name, arguments: args });
    await bridge.sendToolResult(result);
    this.bridge = bridge;
    return result;
  },
};
</script></body></html>""".replace("%SANDBOX%", SANDBOX_ORIGIN)
# The sandbox proxy (another origin, the default CSP as its header): it loads the view into an inner frame,
# which keeps that policy, and relays every message but its own both ways.
PROXY_PAGE = """<!DOCTYPE html><html><body style="margin: 0"><script>
let inner = null;
window.addEventListener("message", (event) => {
  const message = event.data;
  if (event.source === window.parent) {
    if (message && message.method === "ui/notifications/sandbox-resource-ready") {
      inner = document.createElement("iframe");
      inner.sandbox = message.params.sandbox || "allow-scripts allow-same-origin";
      inner.style = "width: 100%; height: 700px; border: 0";
      inner.srcdoc = message.params.html;
      document.body.append(inner);
    } else if (inner) {
      inner.contentWindow.postMessage(message, "*");
    }
  } else if (inner && event.source === inner.contentWindow) {
    window.parent.postMessage(message, "*");
  }
});
const ready = { jsonrpc: "2.0", method: "ui/notifications/sandbox-proxy-ready", params: {} };
window.parent.postMessage(ready, "*");
</script></body></html>"""
# Rich HTML that tried to run script in the view (issue 35) or to cover it; "alert(1)" is what would run.
SVG_LINK = '<svg width="120" height="40"><a {}><rect width="120" height="40" fill="red"/></a></svg>'
ISSUE_PAYLOADS = {
    "tab-in-scheme": '<a href="java&#9;script:alert(1)">tab</a>',
    "newline-in-scheme": '<a href="java&#10;script:alert(1)">newline</a>',
    "leading-c0-control": '<a href="&#1;javascript:alert(1)">control</a>',
    "svg-a-href": SVG_LINK.format('href="java&#9;script:alert(1)"'),
    "svg-a-xlink-href": SVG_LINK.format('xlink:href="&#1;javascript:alert(1)"'),
    "svg-animate-href": SVG_LINK.format('').replace(
        "<rect", '<animate attributeName="href" values="&#1;javascript:alert(1)"/><rect'),
    "svg-set-href": SVG_LINK.format('').replace(
        "<rect", '<set attributeName="href" to="java&#10;script:alert(1)"/><rect'),
    "area-href": (f'<img src="data:image/png;base64,{PNG_1X1_B64}" usemap="#m" width="120" height="40">'
                  '<map name="m"><area shape="rect" coords="0,0,120,40" '
                  'href="java&#9;script:alert(1)"></map>'),
    "fixed-overlay": ('<div style="position: fixed; inset: 0; z-index: 2147483647; background: red">'
                      "over</div>"),
}
# HTML a kernel displays: shown in the view, without its script or handlers; then the issue's payloads, each
# a display of its own.
RICH_HTML = ('<table><tr><td class="cell" onclick="parent.postMessage(1, \'*\')">bold move</td></tr></table>'
             "<script>document.title = 'ran'</script>")
RICH_OUTPUTS = [RICH_HTML, *(html.replace("alert(1)", "window.__pwned = 1")
                             for html in ISSUE_PAYLOADS.values())]
# Prints a numbered line every 0.1 s, shows an image and HTML after 10 lines, runs on until interrupted.
VIEWED_CELL = ("%%loommux --wait 0.5\nimport base64, time\nfrom IPython.display import HTML, Image, display\n"
               "for i in range(1, 100000):\n    print(f'tick {i}', flush=True)\n"
               "    if i == 10:\n        display(Image(data=base64.b64decode(" + repr(PNG_1X1_B64) + ")))\n"
               "        for html in " + repr(RICH_OUTPUTS) + ":\n            display(HTML(html))\n"
               "    time.sleep(0.1)")


@contextlib.contextmanager
def apps_host_page(server: LoommuxHttp):
    """Headless Chromium with the host page at HOST_ORIGIN: its /mcp forwarded to the server (as a host's
    backend would), the bundled AppBridge at /host-bridge.js, the sandbox proxy at SANDBOX_ORIGIN. Yields
    (expect, page, console messages)."""
    expect, sync_playwright = playwright_or_skip()
    if not EXT_APPS_BUNDLE.exists():
        if os.environ.get("CI"):
            pytest.fail(f"{EXT_APPS_BUNDLE} is missing: .ci/run builds it")
        pytest.skip(f"{EXT_APPS_BUNDLE} is missing (.ci/run builds it with npm)")

    def forward(route) -> None:
        request = route.request
        if request.method == "GET":  # no standalone stream through this forwarder
            route.fulfill(status=405)
            return
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("origin", "referer", "host")}
        route.fulfill(response=route.fetch(url=f"http://127.0.0.1:{server.port}/mcp", headers=headers))

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 800})
            console = []
            page.on("console", lambda message: console.append(message.text))
            page.route(f"{HOST_ORIGIN}/mcp", forward)
            page.route(f"{HOST_ORIGIN}/host-bridge.js", lambda route: route.fulfill(
                path=str(EXT_APPS_BUNDLE), content_type="text/javascript"))
            page.route(f"{HOST_ORIGIN}/", lambda route: route.fulfill(body=HOST_PAGE,
                                                                      content_type="text/html"))
            page.route(f"{SANDBOX_ORIGIN}/proxy.html", lambda route: route.fulfill(
                body=PROXY_PAGE, content_type="text/html",
                headers={"Content-Security-Policy": DEFAULT_VIEW_CSP}))
            page.goto(f"{HOST_ORIGIN}/")
            page.wait_for_function("window.host !== undefined")
            yield expect, page, console
        finally:
            browser.close()


def test_the_execution_view_in_headless_chromium_with_the_official_host_bridge(http_spawn):
    server = http_spawn()
    with apps_host_page(server) as (expect, page, console):
        plain = page.evaluate("host.connect(false)")
        assert '"ui' not in json.dumps(plain) and "view_output" not in json.dumps(plain)
        tools = {tool["name"]: tool for tool in page.evaluate("host.connect(true)")}
        assert tools["run_cell"]["_meta"]["ui"]["resourceUri"] == "ui://loommux/execution"
        assert tools["wait"]["_meta"]["ui"]["resourceUri"] == "ui://loommux/execution"
        assert tools["view_output"]["_meta"]["ui"]["visibility"] == ["app"]
        first = page.evaluate("args => host.show('run_cell', args)", {"freeform": VIEWED_CELL})
        n = int(re.match(r"In \[(\d+)\]", first["content"][0]["text"])[1])
        assert "running" in first["content"][0]["text"]
        view = page.frame_locator("#view").frame_locator("iframe")
        expect(view.locator("#number")).to_have_text(f"In [{n}]", timeout=20_000)
        expect(view.locator("#state")).to_have_text("running")
        tick_11 = view.locator(f'#out [data-line="{12 + len(RICH_OUTPUTS)}"]')  # after the displays' lines
        expect(tick_11).to_contain_text("tick 11", timeout=20_000)
        expect(view.locator('#out [data-line="11"]')).to_contain_text("[image/png 1×1")  # its caption
        expect(view.locator("#out")).to_contain_text("tick 30", timeout=20_000)  # it streams on
        image = view.locator("#images img")
        expect(image).to_have_count(1)
        assert image.get_attribute("src").startswith("data:image/png;base64,")
        assert image.evaluate("img => img.complete && img.naturalWidth") == 1
        assert view.locator("#elapsed").text_content().endswith(" s")
        rich = view.locator("#rich td.cell")
        expect(rich).to_have_text("bold move")
        assert rich.get_attribute("onclick") is None and view.locator("#rich script").count() == 0
        frame = next(f for f in page.frames
                     if f.parent_frame and f.parent_frame.url.startswith(SANDBOX_ORIGIN))
        assert frame.evaluate("document.title") == "loommux execution"
        RichView(page, frame, []).click_everything()
        assert frame.evaluate("window.__pwned") is None
        assert frame.evaluate(CONTROLS_ON_TOP) == ["interrupt", "line", "earlier", "tail"]
        probe = ("new Promise(resolve => { document.addEventListener('securitypolicyviolation', e => "
                 "resolve(e.violatedDirective)); const img = new Image(); img.src = '"
                 + HOST_ORIGIN + "/probe.png'; })")
        assert frame.evaluate(probe) == "img-src"  # the view runs under the default CSP
        view.get_by_role("button", name="Interrupt").click()
        expect(view.locator("#state")).to_have_text("interrupted", timeout=20_000)
        expect(view.get_by_role("button", name="Interrupt")).to_be_disabled()
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "execution-view-interrupted.png"))
        waited = page.evaluate("args => host.show('wait', args)", {"execution": n})
        assert waited["content"][0]["text"].startswith(f"In [{n}]")
        view = page.frame_locator("#view").frame_locator("iframe")
        expect(view.locator("#state")).to_have_text("interrupted", timeout=20_000)
        expect(view.locator("#images img")).to_have_count(1)  # a new view reads the images again
        long_cell = "%%loommux --wait 120\nfor i in range(1, 150001):\n    print(f'row {i}')"
        done = page.evaluate("args => host.show('run_cell', args)", {"freeform": long_cell})
        assert done["content"][0]["text"].startswith(f"In [{n + 1}]") and not done["isError"]
        view = page.frame_locator("#view").frame_locator("iframe")
        expect(view.locator('#out [data-line="150000"]')).to_contain_text("row 150000", timeout=20_000)
        view.get_by_label("Line").fill("100000")
        view.get_by_label("Line").press("Enter")
        target = view.locator('#out [data-line="100000"]')
        expect(target).to_have_text("100000row 100000", timeout=20_000)
        expect(target).to_be_in_viewport()
        expect(view.locator("#where")).to_contain_text("of 150,000")
        private = page.evaluate("args => host.show('run_cell', args)",
                                {"freeform": "print('in private')", "kernel": "~"})
        assert private["content"][0]["text"].startswith("Kernel ~")
        view = page.frame_locator("#view").frame_locator("iframe")
        expect(view.locator("#out")).to_contain_text("in private", timeout=20_000)
        expect(view.locator("#number")).to_have_text("In [1]")  # the new kernel's first cell
        assert page.evaluate("host.sizes.length") > 0
        page.screenshot(path=str(ARTIFACTS / "execution-view.png"))
    blocked = [text for text in console if "Content Security Policy" in text and "probe.png" not in text]
    assert not blocked, blocked


# The payloads of the public XSS cheat sheets (OWASP's filter evasion sheet, PortSwigger's) that apply to HTML
# put in a shadow root, with the relatives of the issue's: other URL attributes, elements that load or
# navigate, handlers in any case, parser quirks (mXSS), CSS, and other ways to cover the view.
XSS_PAYLOADS = {
    "script": "<script>alert(1)</script>",
    "img-onerror": "<img src=x onerror=alert(1)>",
    "img-slashes": "<img/src/onerror=alert(1)>",
    "img-onerror-entities": ('<img src=x onerror="&#0000097&#0000108&#0000101&#0000114&#0000116'
                             '&#0000040&#0000049&#0000041">'),
    "img-eval-src": "<img src=x:alert(1) onerror=eval(src)>",
    "img-unclosed": "<img src=x onerror=alert(1)//",
    "img-malformed-quotes": '<img """><script>alert(1)</script>">',
    "img-src-javascript": '<img src="javascript:alert(1)">',
    "img-srcset": '<img srcset="javascript:alert(1)">',
    "img-mixed-case-src": "<IMG SRC=JaVaScRiPt:alert(1)>",
    "img-backtick-src": "<IMG SRC=`javascript:alert(1)`>",
    "svg-onload": "<svg onload=alert(1)>",
    "svg-slash-onload": "<svg/onload=alert(1)>",
    "svg-script": "<svg><script>alert(1)</script></svg>",
    "svg-script-href": '<svg><script href="data:,alert(1)"/></svg>',
    "body-onload": "<body onload=alert(1)>",
    "frameset-onload": "<frameset onload=alert(1)>",
    "style-onload": "<style onload=alert(1)></style>",
    "details-ontoggle": "<details open ontoggle=alert(1)><summary>s</summary>d</details>",
    "marquee-onstart": "<marquee onstart=alert(1)>m</marquee>",
    "video-source-onerror": "<video><source onerror=alert(1)></video>",
    "video-poster": '<video poster="javascript:alert(1)"></video>',
    "audio-onerror": "<audio src=x onerror=alert(1)>",
    "input-autofocus": "<input autofocus onfocus=alert(1)>",
    "input-image": "<input type=image src=x onerror=alert(1)>",
    "div-onclick": '<div onclick=alert(1) style="width: 120px; height: 40px">click</div>',
    "onclick-upper-case": '<DIV ONCLICK=alert(1) style="width: 120px; height: 40px">CLICK</DIV>',
    "onclick-mixed-case": '<a oNcLiCk=alert(1) href="#">mixed</a>',
    "a-onmouseover": '<a href="#" onmouseover=alert(1)>hover</a>',
    "a-onfocus-tabindex": '<a id=x tabindex=1 onfocus=alert(1) autofocus>focus</a>',
    "animation-event": ('<style>@keyframes k { from { color: red } }</style>'
                        '<div style="animation: k 1ms" onanimationstart=alert(1)>anim</div>'),
    "custom-element": '<x-y onclick=alert(1) style="display: block; height: 40px">custom</x-y>',
    "a-javascript": '<a href="javascript:alert(1)">plain</a>',
    "a-mixed-case-scheme": '<a href="JaVaScRiPt:alert(1)">case</a>',
    "a-leading-spaces": '<a href="   javascript:alert(1)">spaces</a>',
    "a-leading-controls": '<a href=" &#14;  javascript:alert(1)">controls</a>',
    "a-carriage-return": '<a href="java&#x0D;script:alert(1)">cr</a>',
    "a-hex-tab": '<a href="jav&#x09;ascript:alert(1)">hextab</a>',
    "a-named-tab": '<a href="javas&Tab;cript:alert(1)">Tab</a>',
    "a-named-newline": '<a href="javas&NewLine;cript:alert(1)">NewLine</a>',
    "a-named-colon": '<a href="javascript&colon;alert(1)">colon</a>',
    "a-decimal-entities": ('<a href="&#106;&#97;&#118;&#97;&#115;&#99;&#114;&#105;&#112;&#116;&#58;'
                           '&#97;&#108;&#101;&#114;&#116;&#40;&#49;&#41;">decimal</a>'),
    "a-padded-entities": ('<a href="&#0000106&#0000097&#0000118&#0000097&#0000115&#0000099&#0000114'
                          '&#0000105&#0000112&#0000116&#0000058alert(1)">padded</a>'),
    "a-hex-entities": ('<a href="&#x6A&#x61&#x76&#x61&#x73&#x63&#x72&#x69&#x70&#x74&#x3A'
                       'alert(1)">hex</a>'),
    "a-nul": '<a href="&#0;javascript:alert(1)">nul</a>',
    "a-comment-newline": '<a href="javascript://%0aalert(1)">comment</a>',
    "a-replaces-document": '<a href="javascript:\'<img src=x onerror=alert(1)>\'">replace</a>',
    "a-target-self": '<a href="javascript:alert(1)" target="_self">self</a>',
    "a-download": '<a href="javascript:alert(1)" download>download</a>',
    "a-slash-href": '<a/href="javascript:alert(1)">slash</a>',
    "a-vbscript": '<a href="vbscript:msgbox(1)">vb</a>',
    "a-data-html": '<a href="data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==">data</a>',
    "a-data-html-plain": '<a href="data:text/html,<script>alert(1)</script>">data plain</a>',
    "a-data-svg": ('<a href="data:image/svg+xml,<svg xmlns=\'http://www.w3.org/2000/svg\' '
                   'onload=\'alert(1)\'/>">data svg</a>'),
    "a-ping": '<a href="#p" ping="javascript:alert(1)">ping</a>',
    "form-action": '<form action="javascript:alert(1)"><input type=submit value=go></form>',
    "button-formaction": '<form><button formaction="javascript:alert(1)">go</button></form>',
    "button-form-attribute": '<form id=f></form><button form=f formaction="javascript:alert(1)">go</button>',
    "isindex": "<isindex action=javascript:alert(1) type=image>",
    "iframe-src": '<iframe src="javascript:alert(1)"></iframe>',
    "iframe-srcdoc": '<iframe srcdoc="<script>parent.alert(1)</script>"></iframe>',
    "embed-src": '<embed src="javascript:alert(1)">',
    "object-data": '<object data="data:text/html,<script>alert(1)</script>"></object>',
    "base-href": '<base href="javascript:alert(1)//"><a href="x">base</a>',
    "meta-refresh": '<meta http-equiv="refresh" content="0;url=javascript:alert(1)">',
    "link-stylesheet": '<link rel=stylesheet href="javascript:alert(1)">',
    "table-background": '<table background="javascript:alert(1)"><td background="javascript:alert(1)">t</td>',
    "style-url-javascript": '<div style="background-image: url(javascript:alert(1))">css</div>',
    "style-expression": '<div style="width: expression(alert(1))">expr</div>',
    "style-import": "<style>@import 'javascript:alert(1)';</style>",
    "style-list-image": ('<style>li { list-style-image: url("javascript:alert(1)") }</style>'
                         "<ul><li>item</li></ul>"),
    "svg-a-text": ('<svg width="120" height="40"><a href="javascript:alert(1)"><text y="20">t</text></a>'
                   "</svg>"),
    "svg-a-entities": SVG_LINK.format('href="&#x6A;avascript:alert(1)"'),
    "svg-a-plain": SVG_LINK.format('href="javascript:alert(1)"'),
    "svg-a-xlink-newline": SVG_LINK.format('xlink:href="java&#10;script:alert(1)"'),
    "svg-animate-xlink": SVG_LINK.format('').replace(
        "<rect", '<animate attributeName="xlink:href" values="#a;&#1;javascript:alert(1)" dur="1ms" '
        'fill="freeze"/><rect'),
    "svg-set-xlink": SVG_LINK.format('').replace(
        "<rect", '<set attributeName="xlink:href" to="javascript:alert(1)"/><rect'),
    "svg-area-plain": ('<svg><a><set attributeName="href" to="javascript:alert(1)"/></a></svg>'
                       '<map><area href="javascript:alert(1)"></map>'),
    "svg-animate-by-id": ('<svg width="120" height="40"><animate href="#t" attributeName="href" '
                          'values="javascript:alert(1)"/><a id="t"><rect width="120" height="40"/></a>'
                          "</svg>"),
    "svg-animate-onbegin": '<svg><animate onbegin=alert(1) attributeName=x dur=1s></svg>',
    "svg-set-onbegin": '<svg><set onbegin=alert(1) attributeName=x to=1></svg>',
    "svg-set-handler": '<svg><set attributeName="onmouseover" to="alert(1)"/></svg>',
    "svg-discard-onbegin": '<svg><discard onbegin=alert(1)></svg>',
    "svg-use-data": ('<svg><use href="data:image/svg+xml,<svg id=\'x\' xmlns=\'http://www.w3.org/2000/svg\'>'
                     "<a href='javascript:alert(1)'><rect width='120' height='40'/></a></svg>#x\"/></svg>"),
    "svg-image-href": '<svg><image href="javascript:alert(1)" width="20" height="20"/></svg>',
    "svg-feimage": '<svg><filter id="f"><feImage href="javascript:alert(1)"/></filter></svg>',
    "svg-foreignobject": ('<svg width="120" height="40"><foreignObject width="120" height="40">'
                          '<a href="javascript:alert(1)">fo</a></foreignObject></svg>'),
    "svg-style-breakout": "<svg><style><img src=x onerror=alert(1)></style></svg>",
    "svg-title-integration": '<svg><title><a href="javascript:alert(1)">title</a></title></svg>',
    "svg-desc-integration": "<svg><desc><img src=x onerror=alert(1)></desc></svg>",
    "math-href": '<math href="javascript:alert(1)">CLICK</math>',
    "math-maction": ('<math><maction actiontype="statusline" xlink:href="javascript:alert(1)">CLICKME'
                     "<mtext>x</mtext></maction></math>"),
    "math-a-xlink": '<math><a xlink:href="javascript:alert(1)">xlink</a></math>',
    "math-mtext-a": '<math><mtext><a href="javascript:alert(1)">mtext</a></mtext></math>',
    "math-annotation-xml": ('<math><annotation-xml encoding="text/html"><a href="javascript:alert(1)">'
                            "annotation</a></annotation-xml></math>"),
    "mxss-noscript": '<noscript><p title="</noscript><img src=x onerror=alert(1)>"></noscript>',
    "mxss-template": "<template><img src=x onerror=alert(1)></template>",
    "mxss-xmp": '<xmp><p title="</xmp><img src=x onerror=alert(1)>"></xmp>',
    "mxss-noembed": '<noembed><img title="</noembed><img src onerror=alert(1)>"></noembed>',
    "mxss-noframes": '<noframes><img title="</noframes><img src onerror=alert(1)>"></noframes>',
    "mxss-textarea": '<textarea><img title="</textarea><img src onerror=alert(1)>"></textarea>',
    "mxss-title": '<title><img title="</title><img src onerror=alert(1)>"></title>',
    "mxss-svg-p-style": '<svg></p><style><a id="</style><img src=1 onerror=alert(1)>">',
    "mxss-mglyph": "<math><mtext><table><mglyph><style><img src=x onerror=alert(1)>",
    "mxss-form-mglyph": ('<form><math><mtext></form><form><mglyph><svg><mtext><style><path id="</style>'
                         '<img onerror=alert(1) src>">'),
    "declarative-shadow-root": ('<div><template shadowrootmode="open"><img src=x onerror=alert(1)>'
                                '<a href="javascript:alert(1)">dsd</a></template></div>'),
    "svg-in-mathml-link": ('<math><mi><svg width="120" height="40"><a href="java&#9;script:alert(1)">'
                           '<rect width="120" height="40"/></a></svg></mi></math>'),
    "svg-xml-base": ('<svg width="120" height="40" xml:base="javascript:alert(1)//"><a href="x">'
                     '<rect width="120" height="40"/></a></svg>'),
    "a-upper-case-entity": '<a href="&#74;avascript:alert(1)">J</a>',
    "a-about-blank": '<a href="about:blank">about</a>',
    "iframe-src-data": '<iframe src="data:text/html,<script>alert(1)</script>"></iframe>',
    "frameset-frame": '<frameset><frame src="javascript:alert(1)"></frameset>',
    "img-lowsrc-dynsrc": '<img lowsrc="javascript:alert(1)" dynsrc="javascript:alert(1)">',
    "bgsound": '<bgsound src="javascript:alert(1)">',
    "object-param": '<object><param name="src" value="javascript:alert(1)"></object>',
    "style-moz-binding": '<div style="-moz-binding: url(x.xml#xss); behavior: url(x.htc)">binding</div>',
    "host-overlay": ("<style>:host { position: fixed !important; inset: 0 !important; z-index: 2147483647"
                     " !important; contain: none !important; background: red !important }</style>host"),
    "sticky-overlay": '<div style="position: sticky; top: 0; height: 2000px; background: red">sticky</div>',
    "negative-margin": '<div style="margin-top: -2000px; height: 3000px; background: red">up</div>',
    "transform-overlay": ('<div style="transform: translateY(-600px); height: 3000px; background: red">'
                          "t</div>"),
    "popover": '<div popover id=p style="inset: 0">pop</div><button popovertarget=p>open</button>',
    "dialog": "<dialog open style=\"position: fixed; inset: 0\">dialog</dialog>",
}
RICH_VIEW_URL = f"{SANDBOX_ORIGIN}/view.html"
RICH_VIEW_PAGE = ('<!DOCTYPE html><html><body><iframe id="view" src="%VIEW%" '
                  'sandbox="allow-scripts allow-same-origin allow-modals" '
                  'style="width: 960px; height: 720px; border: 0"></iframe></body></html>'
                  ).replace("%VIEW%", RICH_VIEW_URL)
# The shadow roots' hosts in the view's rich outputs.
SHADOW_HOSTS = '[...document.querySelectorAll("#rich *")].filter((node) => node.shadowRoot)'
# Every link and area in the rich box: clicked (a dispatched click, which follows links as a real one does),
# and where each has a box, that box's centre in the view (for a real click of the mouse).
CLICK_LINKS = """() => SHADOW_HOSTS.flatMap((host) => {
  return [...host.shadowRoot.querySelectorAll("a, area, [*|href]")].map((link) => {
    link.dispatchEvent(new MouseEvent("click", { bubbles: true, cancelable: true, composed: true }));
    const r = link.getBoundingClientRect();
    return r.width && r.height ? [r.x + r.width / 2, r.y + r.height / 2] : null;
  }).filter(Boolean);
})""".replace("SHADOW_HOSTS", SHADOW_HOSTS)
# Waits until a condition on the view holds (wait_for_function would evaluate a string, which the view's
# CSP refuses).
WAIT_UNTIL = """async (condition) => {
  const holds = {
    ready: () => typeof addRich === "function",
    images: () => SHADOW_HOSTS.every((host) =>
      [...host.shadowRoot.querySelectorAll("img")].every((img) => img.complete)),
    settled: () => window.__settled === window.__clicked,
  }[condition];
  while (!holds()) await new Promise((resolve) => setTimeout(resolve, 20));
}""".replace("SHADOW_HOSTS", SHADOW_HOSTS)
# A point in the last rich output's box (its middle, or 300 pixels down in a long one).
RICH_MIDDLE = """() => {
  const r = document.querySelector("#rich > :last-child").getBoundingClientRect();
  return [r.x + r.width / 2, r.y + Math.min(r.height / 2, 300)];
}"""
# What is safe in rich HTML stays: a pandas table and its style, links and images by the URLs allowed (links
# then open outside the view), SVG referring to its own parts, MathML, data- and aria- attributes.
SAFE_RICH_HTML = (
    '<style>td { color: green }</style><table class="dataframe" border="1"><thead>'
    '<tr style="text-align: right;"><th>a</th></tr></thead><tbody><tr><td colspan="1" onclick="alert(1)">1'
    '</td></tr></tbody></table>'
    '<a href="https://example.com/docs?x=1#y" title="docs">docs</a><a href="#part">part</a>'
    '<a href="report.html">relative</a><a href="data:image/png;base64,AAAA">data link</a>'
    f'<img src="data:image/png;base64,{PNG_1X1_B64}" alt="dot" width="2"><img src="http://example.com/a.png">'
    '<svg width="20" height="20" viewBox="0 0 20 20"><defs><linearGradient id="g"><stop offset="0" '
    'stop-color="red"/></linearGradient><circle id="c" r="5"/></defs><use href="#c" fill="url(#g)"/>'
    '<use xlink:href="https://example.com/s.svg#c"/><a xlink:href="https://example.com/"><text y="9">t</text>'
    '</a><image href="data:image/png;base64,AAAA" width="2" height="2"/></svg>'
    '<math><mfrac><mi>x</mi><mn>2</mn></mfrac></math>'
    '<details open><summary>more</summary><p data-row="1" aria-label="p">text</p></details>')
SAFE_RICH_KEPT = [
    "style", "table border=1 class=dataframe", "thead", "tr style=text-align: right;", "th", "tbody",
    "tr", "td colspan=1", "a href=https://example.com/docs?x=1#y rel=noreferrer target=_blank title=docs",
    "a href=#part rel=noreferrer target=_blank", "a href=report.html rel=noreferrer target=_blank",
    "a rel=noreferrer target=_blank", f"img alt=dot src=data:image/png;base64,{PNG_1X1_B64} width=2",
    "img src=http://example.com/a.png", "svg height=20 viewBox=0 0 20 20 width=20", "defs",
    "linearGradient id=g", "stop offset=0 stop-color=red", "circle id=c r=5", "use fill=url(#g) href=#c",
    "use", "a rel=noreferrer target=_blank xlink:href=https://example.com/", "text y=9",
    "image height=2 href=data:image/png;base64,AAAA width=2", "math", "mfrac", "mi", "mn", "details open=",
    "summary", "p aria-label=p data-row=1"]
# Each element of the last rich output: its name and its attributes, sorted.
DESCRIBE_RICH = """() => [...SHADOW_HOSTS.at(-1).shadowRoot.querySelectorAll("*")].map((node) =>
  [node.localName, ...[...node.attributes].map((a) => a.name + "=" + a.value).sort()].join(" "))
""".replace("SHADOW_HOSTS", SHADOW_HOSTS)
# What is at the centre of each control above the rich outputs.
CONTROLS_ON_TOP = """() => ["interrupt", "line", "earlier", "tail"].map((id) => {
  const r = document.getElementById(id).getBoundingClientRect();
  return document.elementFromPoint(r.x + r.width / 2, r.y + r.height / 2)?.id;
})"""
# A javascript: link of the test's own, outside the rich box: once it ran, a link the payload's clicks
# followed before it would have run too.
SETTLE = """() => {
  window.__clicked = (window.__clicked || 0) + 1;
  const link = document.body.appendChild(document.createElement("a"));
  link.href = "javascript:window.__settled = (window.__settled || 0) + 1"; link.click(); link.remove();
}"""


@dataclass
class RichView:
    """The view page alone (under the default CSP, in a sandboxed frame that may show dialogs), for rich
    outputs fed straight to its own addRich."""
    page: Any
    frame: Any
    dialogs: list

    def show(self, html: str) -> None:
        """The HTML as the view's only rich output, in a fresh view when the last payload broke it."""
        self.dialogs.clear()
        if self.frame.url.split("#")[0] != RICH_VIEW_URL or self.frame.evaluate("window.__marker") != 1:
            self.frame.goto(RICH_VIEW_URL)
            self.frame.evaluate(WAIT_UNTIL, "ready")
            self.frame.evaluate("window.__marker = 1")
        self.frame.evaluate("html => { clearRich(); addRich({ mime: 'text/html', text: html }); }", html)
        self.frame.evaluate(WAIT_UNTIL, "images")

    def click_everything(self) -> None:
        """Click every link and area of the rich output, then the middle of its box, with the mouse."""
        origin = self.page.locator("#view").bounding_box()
        middle = self.frame.evaluate(RICH_MIDDLE)
        for x, y in [*self.frame.evaluate(CLICK_LINKS), middle]:
            self.page.mouse.click(origin["x"] + x, origin["y"] + y)
        self.frame.evaluate(SETTLE)
        self.frame.evaluate(WAIT_UNTIL, "settled")


@pytest.fixture(scope="class")
def rich_view():
    """One browser for a class of tests: the view page under the default CSP, in a sandboxed frame that may
    show dialogs (so that an alert would be seen)."""
    _, sync_playwright = playwright_or_skip()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1000, "height": 800})
            dialogs: list[str] = []
            page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
            page.route(f"{HOST_ORIGIN}/", lambda route: route.fulfill(body=RICH_VIEW_PAGE,
                                                                      content_type="text/html"))
            page.route(RICH_VIEW_URL, lambda route: route.fulfill(
                body=loommux.VIEW_HTML, content_type="text/html",
                headers={"Content-Security-Policy": DEFAULT_VIEW_CSP}))
            page.goto(f"{HOST_ORIGIN}/")
            yield RichView(page, page.frame(url=RICH_VIEW_URL), dialogs)
        finally:
            browser.close()


class TestViewRichOutput:
    """Rich HTML in the execution view: nothing in it runs script, even once clicked, nor covers the view's
    controls; what is safe stays. The tests share one browser (the class's)."""

    @pytest.mark.parametrize("payload", [pytest.param(html, id=name) for name, html in
                                         {**ISSUE_PAYLOADS, **XSS_PAYLOADS}.items()])
    def test_payload_is_harmless(self, rich_view, payload):
        rich_view.show(payload)
        rich_view.click_everything()
        frame = rich_view.frame
        assert rich_view.dialogs == []
        assert frame.url.split("#")[0] == RICH_VIEW_URL and frame.evaluate("window.__marker") == 1
        assert frame.evaluate(CONTROLS_ON_TOP) == ["interrupt", "line", "earlier", "tail"]

    def test_what_is_safe_stays(self, rich_view):
        rich_view.show(SAFE_RICH_HTML)
        assert rich_view.frame.evaluate(DESCRIBE_RICH) == SAFE_RICH_KEPT
        color = f"() => getComputedStyle({SHADOW_HOSTS}[0].shadowRoot.querySelector('td')).color"
        assert rich_view.frame.evaluate(color) == "rgb(0, 128, 0)"  # its own style applies, inside it


# ---------------------------------------------------------------- README's samples


README_SAMPLE_RE = re.compile(r"<!-- sample: ([\w-]+) -->\n *```[a-z]*\n(.*?)\n *```", re.DOTALL)
# what differs from run to run: replaced by a placeholder in README's text and the product's before comparing
SAMPLE_VARIABLES = [
    (re.compile(r"\d{4}-\d\d-\d\dT[\d:.]+Z"), "<time>"),
    (re.compile(r"\b\d[\d,]*(?:\.\d+)? ?(?:ms|µs|s)\b"), "<duration>"),
    (re.compile(r"\b(pid:?|was|kernel_pid:) \d+"), r"\1 <pid>"),
    (re.compile(r"(?<![\w.])/[\w./+~-]+"), "<path>"),
    (re.compile(r"~[\w-]+\.[\w-]{22}\b"), "<handle>"),
    (re.compile(r"\b0x[0-9a-f]+\b"), "<address>"),
    (re.compile(r"(?i)(python) \d+\.\d+\.\d+"), r"\1 <version>"),
    (re.compile(r"loommux \d+\.\d+\.\d+\S*"), "loommux <version>"),
    (re.compile(r" {2,}"), " "),  # columns aligned to the widths of what varies
]


SAMPLES_CHECKED_ELSEWHERE = {
    "api-resources",     # test_readme_api_samples_have_the_shape_of_the_answers
    "output-in-memory",  # test_a_file_size_limit_keeps_output_in_memory_with_a_notice
    "namespace-transcript",  # test_readme_transcripts_are_what_the_tools_answer
    "publish-transcript",    # the same
}


def readme_samples() -> dict[str, str]:
    """README's samples of results, each a fenced block after a `<!-- sample: NAME -->` line, by NAME."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return {name: textwrap.dedent(body) for name, body in README_SAMPLE_RE.findall(text)}


def unvarying(text: str) -> str:
    for pattern, placeholder in SAMPLE_VARIABLES:
        text = pattern.sub(placeholder, text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def produce_readme_samples(server: StdioServer) -> dict[str, str]:
    """Run, on a fresh stdio server, the session README's samples come from, and return each sample's text."""
    samples: dict[str, str] = {}

    def call(name: str, tool: str, args: dict | None = None) -> str:
        """The result's text blocks, a line each, as README shows them."""
        result = server.result("tools/call", tool_params(tool, args), timeout=120)
        samples[name] = "\n".join(block["text"] for block in result["content"] if block["type"] == "text")
        return samples[name]

    call("quick-start", "run_cell", {"freeform": "value = 6 * 7\nprint('hello')\nvalue"})
    call("run-cell", "run_cell", {"freeform": "for i in range(3): print(f'step {i}')\n{'a': 1}"})
    call("running", "run_cell", {"freeform": "%%loommux --wait 1\nimport time\nfor i in range(100):\n"
                                               "    print(f'tick {i}', flush=True)\n"
                                               "    time.sleep(1.5 if i == 18 else 0)"})
    server.call("wait", {"execution": 3}, timeout=120)
    call("run-cell-error", "run_cell", {"freeform": "1/0"})
    call("status", "status")
    call("execution-status", "execution_status", {"execution": 3})
    call("read-output", "read_output", {"execution": 3, "stream": "stdout", "line_range": "98:"})
    call("search-output", "search_output", {"query": "tick 9\\d", "execution": 3, "max_matches": 2,
                                            "context_before": 1})
    call("omitted", "run_cell", {"freeform": "for i in range(20000): print(f'line {i} ' + 'x' * 10)"})
    call("legacy", "run_cell", {"freeform": "# loommux: --wait 120\nprint('ok')"})
    run_cell(server, "%%loommux --wait 0.5\nimport time\ntime.sleep(60)")
    samples["interrupt"] = server.call("interrupt")[0] + "\n" + server.call("interrupt")[0]
    run_cell(server, "%%loommux --wait 0.5\nimport time\ntime.sleep(60)")
    call("restart", "restart")
    call("killed", "run_cell", {"freeform": "import os\nos._exit(3)"})
    assert run_cell(server, "%%loommux --wait 0.1\nimport time\ntime.sleep(0.3)\nprint('done')").n == 10
    call("wait", "wait", {"execution": 10})
    call("kernel-handle", "run_cell", {"freeform": "1", "kernel": "~"})
    return samples


def refused_start(cwd: Path, *args: str) -> str:
    """What loommux started with `args` says on stderr, exiting with status 2."""
    refused = subprocess.run([sys.executable, str(LOOMMUX), *args], cwd=cwd, stdin=subprocess.DEVNULL,
                             capture_output=True, text=True, env=server_env(), timeout=60, check=False)
    assert refused.returncode == 2, refused
    return refused.stderr


def produce_refusal_samples(tmp_path: Path) -> dict[str, str]:
    """README's samples of a start refused: an --output-dir that is a file, a --state-dir that is a
    symbolic link, and a state directory whose output/ holds a file loommux did not make."""
    (tmp_path / "out.txt").touch()
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to("real")
    (tmp_path / "proj" / "output").mkdir(parents=True, mode=0o700)
    (tmp_path / "proj").chmod(0o700)
    (tmp_path / "proj" / "output" / "mine.txt").touch()
    server = ("--server", "--port", "0", "--state-dir")
    return {"output-dir-refused": refused_start(tmp_path, "--output-dir", str(tmp_path / "out.txt")),
            "state-dir-link-refused": refused_start(tmp_path, *server, "link"),
            "state-output-refused": refused_start(tmp_path, *server, str(tmp_path / "proj"))}


def test_readme_samples_are_what_the_product_answers(spawn, tmp_path):
    """Every sample of a result in README (a block after `<!-- sample: NAME -->`) is what this session
    produces, but for times, pids, paths and versions, so that README cannot drift from the product."""
    expected = readme_samples()
    produced = {**produce_readme_samples(spawn()), **produce_refusal_samples(tmp_path)}
    # to paste from when README's samples are to change
    (tmp_path / "produced.json").write_text(json.dumps(produced, indent=1, ensure_ascii=False))
    expected = {name: text for name, text in expected.items() if name not in SAMPLES_CHECKED_ELSEWHERE}
    assert sorted(expected) == sorted(produced)
    assert {name: unvarying(text) for name, text in expected.items()} == {
        name: unvarying(text) for name, text in produced.items()}


README_NAMESPACE = """import time
import numpy as np
import pandas as pd

grid = np.linspace(-1, 1, 12).reshape(3, 4)


class Model:
    def __init__(self):
        self.config = {"layers": 4}


model = Model()
notes = ["a", "b", "c"]
sales = pd.DataFrame({"city": ["Oslo", "Lima", "Pune", "Kyiv"], "units": [12, 7, 31, 5],
                      "price": [9.5, 12.0, 4.25, 8.0]})


def total(frame, column="units"):
    \"\"\"The sum of one column.\"\"\"
    return frame[column].sum()"""


def transcript_calls(transcript: str) -> list[tuple[str, dict, str]]:
    """A README transcript's `>>> tool(name=value, …)` lines, each with the answer printed under it."""
    calls = []
    for part in re.split(r"^>>> ", transcript, flags=re.MULTILINE)[1:]:
        line, _, answer = part.partition("\n")
        call = ast.parse(line, mode="eval").body
        calls.append((call.func.id, {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}, answer))
    return calls


@pytest.mark.parametrize("sample, setup, tools", [
    ("namespace-transcript", README_NAMESPACE, ["namespace"] * 2 + ["inspect"] * 5 + ["reset"] * 2),
    ("publish-transcript", None, ["run_cell", "forecast", "forecast", "run_cell", "ratio", "reset"]),
])
def test_readme_transcripts_are_what_the_tools_answer(spawn, sample, setup, tools):
    """README's transcripts (of namespace, inspect and reset; of published functions), call by call, each on a
    fresh kernel holding the names they show."""
    server = spawn()
    if setup:
        run(server, setup)
    calls = transcript_calls(readme_samples()[sample])
    assert [tool for tool, _, _ in calls] == tools
    for tool, args, answer in calls:
        result = server.result("tools/call", tool_params(tool, args))
        text = "\n".join(block["text"] for block in result["content"] if block["type"] == "text")
        assert unvarying(text) == unvarying(answer), (tool, args)


def json_shape(value):
    """A JSON value with every leaf replaced by its type: what a sample of an answer must share with it."""
    if isinstance(value, dict):
        return {key: json_shape(item) for key, item in value.items()}
    if isinstance(value, list):
        return [json_shape(item) for item in value]
    return type(value).__name__


def test_readme_api_samples_have_the_shape_of_the_answers(http_spawn):
    """README's /api samples (`<!-- sample: api-… -->`) have the fields, nesting and types the API answers
    with, in the same situation: one named kernel that ran one cell, joined by one session."""
    server = http_spawn(LOOMMUX_SPARE_KERNELS="0")
    with HttpMcp(server, resource="lab", operator="alice") as session:
        run(session, "print('ready')")
        answers = {path: server.api("GET", path).json()
                   for path in ("/api/resources", "/api/resources/lab", "/api/health", "/api/kernels")}
    assert json_shape(json.loads(readme_samples()["api-resources"])) == json_shape(answers["/api/resources"])
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    said = {path: re.search(rf"^\| `GET {re.escape(path)}` \| (.+) \|$", readme, re.MULTILINE)[1]
            for path in ("/api/resources/{id}", "/api/health", "/api/kernels")}
    assert re.findall(r"\w+", said["/api/health"]) == list(answers["/api/health"])
    assert re.findall(r"\w+", said["/api/kernels"]) == ["kernels", *answers["/api/kernels"]["kernels"][0]]
    assert re.findall(r"`(\w+)`", said["/api/resources/{id}"]) == [
        "recent_executions", *answers["/api/resources/lab"]["recent_executions"][0]]


# ---------------------------------------------------------------- Tools


HUNDRED = finished_execution(1, ("stream", {"name": "stdout",
                                            "text": "".join(f"line {i}\n" for i in range(1, 101))}),
                             ("stream", {"name": "stderr", "text": "oops\n"}))


def tool_reply(tool: str, args: dict, execution: loommux.Execution = HUNDRED) -> tuple[str, bool]:
    """(text, isError) of a tool called on a resource without a kernel that holds one finished execution."""
    resource = loommux.Resource(pool=None)
    resource.sequence.keep(execution)
    context = loommux.ToolContext(loommux.Settings(ROOT), resource, time.monotonic())
    result = asyncio.run(loommux.call_tool(context, tool, args))
    return result["content"][0]["text"], result["isError"]


@pytest.mark.fast
@pytest.mark.parametrize("args, text", [
    ({"line_range": "-3:"}, "[execution 1 · combined · lines 99-101 of 101]\nline 99\nline 100\noops"),
    ({"line_range": "2", "stream": "stderr"}, "[execution 1 · stderr · no lines in 2 of 1]"),
    ({"line_range": "1:2", "max_chars": 5},
     "[execution 1 · combined · lines 1-2 of 101]\nline … [+1 chars]\nline … [+1 chars]"),
    ({"stream": "traceback"}, "[execution 1 · traceback · no lines]"),
], ids=clipped())
def test_read_output_resolves_ranges_per_stream(args, text):
    assert tool_reply("read_output", args) == (text, False)


@pytest.mark.fast
def test_read_output_gives_its_lines_as_data_only_to_a_caller_who_sees_them():
    resource = loommux.Resource(pool=None)
    resource.sequence.keep(HUNDRED)

    def data_lines(settings: loommux.Settings, session) -> list:
        context = loommux.ToolContext(settings, resource, time.monotonic(), session)
        args = {"execution": 1, "line_range": "1:2", "max_chars": 50}
        return asyncio.run(loommux.TOOLS["read_output"].run(context, args)).data["lines"]

    plain, structured = loommux.Settings(ROOT), loommux.Settings(ROOT, result_mode="structured")
    shown = [{"number": 1, "text": "line 1"}, {"number": 2, "text": "line 2"}]
    assert data_lines(plain, None) == shown  # /api: its answer is the data
    assert data_lines(structured, object()) == shown  # structuredContent
    assert data_lines(plain, object()) == []  # a session in text mode: 10,000 lines would be 10,000 dicts


@pytest.mark.fast
@pytest.mark.parametrize("tool, args, text", [
    ("read_output", {"line_range": "abc"}, f'invalid_line_range: "abc" {NOT_A_RANGE}'),
    ("read_output", {"line_range": "5:3"}, "invalid_line_range: start 5 comes after stop 3"),
    ("read_output", {"line_range": "0"},
     "invalid_line_range: line numbers start at 1 (use -1 for the last line)"),
    ("read_output", {"line_range": 5}, 'invalid_arguments: "line_range" must be a string, not 5'),
    ("read_output", {"max_chars": 0}, 'invalid_max_chars: "max_chars" must be at least 1, not 0'),
    ("read_output", {"stream": "out"},
     'invalid_stream: "stream" must be one of combined, stdout, stderr, result, traceback, not "out"'),
    ("read_output", {"execution": 2},
     "execution_not_found: there is no execution 2; executions are numbered 1 to 1"),
    ("search_output", {"query": ""}, "invalid_query: the query is empty"),
    ("search_output", {"query": "a(b", "query_mode": "regex"},
     "invalid_query: the regex does not compile: missing ), unterminated subpattern at position 1"),
    ("search_output", {"query": "x*"},
     "invalid_query: the pattern matches the empty string, so it would match every position"),
    ("search_output", {"query": "x", "context_after": 1001},
     'invalid_context: "context_after" must be at most 1000, not 1001'),
], ids=clipped())
def test_tool_errors_without_a_kernel(tool, args, text):
    assert tool_reply(tool, args) == (text, True)


def search_log(log: loommux.Log, query: str, mode: str = "auto", ignore_case: bool = False, before: int = 0,
               after: int = 0, max_matches: int = 500) -> loommux.Found:
    return loommux.find_lines(log, loommux.compile_query(query, mode, ignore_case), before, after,
                              max_matches)


LINES_200 = [f"line {i}" for i in range(1, 201)]


@pytest.mark.fast
def test_search_literal_regex_and_ignore_case():
    log = log_of("\n".join(LINES_200) + "\nTAIL line 7")  # the open line is searched too
    found = search_log(log, "7", "literal")
    assert (found.matching, found.total) == (sum("7" in line for line in [*LINES_200, "TAIL line 7"]),
                                            sum(line.count("7") for line in [*LINES_200, "TAIL line 7"]))
    assert found.shown == found.matching and found.groups[-1] == [(201, "match", "TAIL line 7")]
    assert search_log(log, r"^line 1\d\d$", "regex").matching == 100
    assert search_log(log, r"line 1\d\d", "literal").matching == 0
    assert search_log(log, "^tail", "regex").matching == 0
    assert search_log(log, "^tail", "regex", ignore_case=True).groups == [[(201, "match", "TAIL line 7")]]


@pytest.mark.fast
def test_search_context_groups_and_max_matches():
    log = log_of("\n".join(LINES_200) + "\n")
    assert search_log(log, "^line (10|12)$", before=1, after=1).groups == [[
        (9, "context", "line 9"), (10, "match", "line 10"), (11, "context", "line 11"),
        (12, "match", "line 12"), (13, "context", "line 13")]]
    assert search_log(log, "^line (100|200)$", before=2).groups == [
        [(98, "context", "line 98"), (99, "context", "line 99"), (100, "match", "line 100")],
        [(198, "context", "line 198"), (199, "context", "line 199"), (200, "match", "line 200")]]
    assert search_log(log, "^line 1$", before=5, after=1).groups == [[(1, "match", "line 1"),
                                                                      (2, "context", "line 2")]]
    capped = search_log(log, "line 1", "literal", max_matches=3)
    assert (capped.matching, capped.total, capped.shown) == (111, 111, 3)
    assert capped.groups == [[(1, "match", "line 1")], [(10, "match", "line 10"), (11, "match", "line 11")]]


@pytest.mark.fast
def test_search_output_renders_matches_and_groups():
    text, is_error = tool_reply("search_output", {"query": "line 1", "query_mode": "literal",
                                                  "max_matches": 2})
    assert not is_error and text.split("\n") == [
        '[execution 1 · combined · literal "line 1" · 12 matching lines (first 2 shown) · 12 matches]',
        "M 1 | line 1", "--", "M 10 | line 10"]
    text, is_error = tool_reply("search_output", {"query": "^line 5", "query_mode": "regex",
                                                  "context_after": 1, "max_chars": 4})
    assert not is_error and text.split("\n") == [
        '[execution 1 · combined · regex "^line 5" · 11 matching lines · 11 matches]',
        "M 5 | line… [+2 chars]", "C 6 | line… [+2 chars]", "--",
        *(f"M {n} | line… [+3 chars]" for n in range(50, 60)), "C 60 | line… [+3 chars]"]


@pytest.mark.parametrize("tool, args, field", [
    ("run_cell", {"freeform": 5}, "freeform"),
    ("run_cell", {"code": 5}, "freeform"),  # an alias's error names the advertised argument
    ("run_cell", {}, "freeform"),
    ("run_cell", {"freeform": "1", "bogus": 1}, "bogus"),
    ("run_cell", {"code": "1", "bogus": 1}, "bogus"),
    ("status", {"verbose": True}, "verbose"),
    ("wait", {"execution": "1"}, "execution"),
    ("wait", {"timeout_seconds": "soon"}, "timeout_seconds"),
    ("execution_status", {"execution": [1]}, "execution"),
    ("read_output", {"execution": True}, "execution"),
    ("read_output", {"line_range": 5}, "line_range"),
    ("read_output", {"max_chars": 1.5}, "max_chars"),
    ("search_output", {}, "query"),
    ("search_output", {"query": "x", "ignore_case": "yes"}, "ignore_case"),
    ("search_output", {"query": "x", "context_before": "2"}, "context_before"),
    ("interrupt", {"now": True}, "now"),
    ("restart", {"force": True}, "force"),
])
def test_invalid_arguments(srv, tool, args, field):
    assert field in tool_error(srv, tool, args, "invalid_arguments")


@pytest.mark.parametrize("tool, args, code", [
    ("wait", {"timeout_seconds": -1}, "invalid_timeout"),
    ("wait", {"timeout_seconds": 3601}, "invalid_timeout"),
    ("read_output", {"max_chars": 0}, "invalid_max_chars"),
    ("search_output", {"query": "err", "max_chars": 0}, "invalid_max_chars"),
    ("search_output", {"query": "err", "context_before": -1}, "invalid_context"),
    ("search_output", {"query": "err", "context_after": -1}, "invalid_context"),
    ("read_output", {"stream": "bogus"}, "invalid_stream"),
    ("search_output", {"query": "err", "stream": "bogus"}, "invalid_stream"),
    ("search_output", {"query": ""}, "invalid_query"),
    ("search_output", {"query": "a(b", "query_mode": "regex"}, "invalid_query"),
    ("read_output", {"execution": 999_999}, "execution_not_found"),
    ("wait", {"execution": 999_999}, "execution_not_found"),
    ("execution_status", {"execution": 999_999}, "execution_not_found"),
    ("search_output", {"query": "err", "execution": 999_999}, "execution_not_found"),
])
def test_bad_values(srv, small, tool, args, code):
    tool_error(srv, tool, args, code)


def test_execution_zero_is_rejected(srv, small):
    text, is_error, _ = srv.call("read_output", {"execution": 0})
    assert is_error and text.split(":")[0] in ("invalid_arguments", "execution_not_found"), text


def test_variables_survive_and_results_use_loommux_numbers(srv):
    first = run(srv, "x_survive = 41")
    assert first.state == "completed" and first.body == ["(no output)"]
    second = run(srv, "print('a')\nx_survive + 1")
    assert second.n == first.n + 1
    assert second.body == ["a", f"Out[{second.n}]: 42"]
    assert read(srv, execution=second.n, stream="result")[1] == ["42"]
    assert read(srv, execution=second.n, stream="stdout")[1] == ["a"]
    assert read(srv, execution=second.n, stream="stderr")[1] == []


@pytest.mark.parametrize("alias", ["code", "source", "cell"])
def test_run_cell_aliases(srv, alias):
    text, is_error, _ = srv.call("run_cell", {alias: "6 * 7"})
    assert not is_error, text
    cell = Cell.parse(text)
    assert cell.body == [f"Out[{cell.n}]: 42"]


def test_kernel_runs_in_workspace_and_status(srv):
    cell = run(srv, "import os, sys\nprint(os.getcwd())\nprint(sys.executable)")
    assert cell.body == [str(srv.workspace.resolve()), sys.executable]
    text, is_error, _ = srv.call("status")
    assert not is_error
    assert text.startswith("loommux ")
    assert f"workspace: {srv.workspace.resolve()}" in text
    assert "workspace_resolution: launch_cwd" in text
    assert f"Python {platform.python_version()}" in text
    assert re.search(r"kernel: pid \d+ · idle", text)
    assert f"last execution: {cell.n} · completed" in text
    assert "recent executions" in text
    assert re.search(rf"^\s*{cell.n}\s+completed\s.*import os, sys", text, re.MULTILINE)


def test_output_written_last_is_in_the_result(srv):
    """The kernel replies without ipykernel's sleep before execute_reply: what a cell writes last, unflushed,
    on both streams, and its result, are in that cell's own result every time."""
    code = ("import sys\nprint('out {i}', end='')\nsys.stderr.write('err {i}')\n"  # one write each
            "get_ipython().kernel._execute_sleep + {i}")
    for i in range(60):
        cell = run_cell(srv, code.format(i=i))
        assert cell.state == "completed", cell.text
        assert f"out {i}" in cell.text and f"err {i}" in cell.text, cell.text
        assert f"Out[{cell.n}]: {float(i)}" in cell.text, cell.text


def test_execution_status_fields(srv):
    cell = run(srv, "print('héllo')")
    text, is_error, _ = srv.call("execution_status", {"execution": cell.n})
    assert not is_error and text.startswith(f"[execution {cell.n} · completed]")
    iso = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z"
    assert re.search(rf"^submitted_at: {iso}$", text, re.MULTILINE), text
    assert re.search(rf"^completed_at: {iso}$", text, re.MULTILINE), text
    assert re.search(r"^kernel_pid: \d+", text, re.MULTILINE)
    assert re.search(r"^ipython_execution_count: .*\d", text, re.MULTILINE)
    assert re.search(r"^source: .*print", text, re.MULTILINE)
    lines, chars, size = stream_counts(text, "stdout")
    assert lines == 1 and re.fullmatch(rf"{chars + 1} B", size), (chars, size)  # é is two UTF-8 bytes
    assert stream_counts(text, "combined")[0] == 1
    assert stream_counts(text, "stderr")[:2] == (0, 0)


def test_token_limit_counts_tokens(srv):
    few_tokens = run(srv, "print('word ' * 2000)")  # 10,001 characters, about 2,000 tokens
    assert few_tokens.body == ["word " * 2000]
    # 17,664 chars, ~9k tokens
    many_tokens = run(srv, "print(' '.join(str(i * 7919 % 100003) for i in range(3000)))")
    assert "output omitted" in many_tokens.text and "5,000-token" in many_tokens.text


def test_busy(srv):
    cell = run_cell(srv, "%%loommux --wait 0.1\nimport time\ntime.sleep(2)")
    assert cell.state == "running"
    text = tool_error(srv, "run_cell", {"freeform": "busy_side_effect = 1"}, "busy")
    assert f"execution {cell.n}" in text
    assert finish(srv, cell).state == "completed"
    nxt = run(srv, "'busy_side_effect' in globals()")
    assert nxt.n == cell.n + 1 and nxt.body == [f"Out[{nxt.n}]: False"]


def test_running_notice_and_status_while_busy(srv):
    cell = run_cell(srv, "%%loommux --wait 1\nimport time\nfor i in range(3):\n"
                         "    print(f'tick-{i}', flush=True)\ntime.sleep(30)")
    assert cell.state == "running"
    assert "tick-2" in cell.text and "Last lines:" in cell.text
    for hint in (f"wait(execution={cell.n}", "read_output(", "search_output(", "interrupt("):
        assert hint in cell.text, hint
    status, _, _ = srv.call("status")
    assert re.search(r"kernel: pid \d+ · busy", status) and f"current execution: {cell.n} · running" in status
    assert srv.call("execution_status")[0].startswith(f"[execution {cell.n} · running]")
    waited = Cell.parse(srv.call("wait", {"timeout_seconds": 0.2})[0])  # defaults to the running record
    assert (waited.n, waited.state) == (cell.n, "running")
    header, lines = read(srv)
    assert header.startswith(f"[execution {cell.n} ·") and lines == ["tick-0", "tick-1", "tick-2"]


def test_wait_does_not_delay_later_requests(srv):
    cell = run_cell(srv, "%%loommux --wait 0.2\nimport time\nprint('started', flush=True)\ntime.sleep(30)")
    assert cell.state == "running"
    waiting = srv.send_request("tools/call", {"name": "wait",
                                              "arguments": {"execution": cell.n, "timeout_seconds": 30}})
    later = [
        srv.send_request("tools/call", {"name": "status"}),
        srv.send_request("tools/call", {"name": "read_output", "arguments": {"execution": cell.n}}),
        srv.send_request("tools/call", {"name": "execution_status", "arguments": {"execution": cell.n}}),
        srv.send_request("ping"),
    ]
    for rid in later:
        srv.response(rid, timeout=20)  # well below the wait's 30 s
    assert waiting not in srv.responses  # all the later requests were answered first
    # interrupt may answer once the cell has stopped, i.e. together with the wait, but not after 30 s
    stop = srv.send_request("tools/call", {"name": "interrupt"})
    assert srv.response(stop, timeout=20)["result"]["content"][0]["text"].startswith("interrupt_sent:")
    result = srv.response(waiting, timeout=20)["result"]
    assert Cell.parse(result["content"][0]["text"]).state == "interrupted"


def test_defaults_select_most_recent(srv):
    cell = run(srv, "print('most recent')")
    assert Cell.parse(srv.call("wait")[0]).body == ["most recent"]
    assert read(srv)[1] == ["most recent"]
    assert srv.call("execution_status")[0].startswith(f"[execution {cell.n} · completed]")
    assert matched_numbers(search(srv, "recent")[1]) == [1]


@pytest.fixture(scope="session")
def twenty_k(session_server) -> Cell:
    """A finished execution of the session server that printed 'line 1' .. 'line 20000'."""
    return run(session_server, TWENTY_K)


def test_long_output_is_omitted_with_next_calls(srv, twenty_k):
    text = twenty_k.text
    assert twenty_k.state == "completed"
    assert re.search(r"\[output omitted: 20,000 lines · [\d,]+ characters · [\d.]+ (B|KiB|MiB|GiB)",
                     text), text
    assert f"read_output(execution={twenty_k.n}" in text and "search_output(" in text
    assert "--full-output" in text
    assert "line 20000" in text and "line 5000\n" not in text


@pytest.mark.parametrize("line_range, first, last", [
    (":10", 1, 10), ("-10:", 19_991, 20_000), ("20:40", 20, 40), ("3:3", 3, 3), ("3", 3, 3),
    ("-1", 20_000, 20_000), ("19995:", 19_995, 20_000), ("-3:-2", 19_998, 19_999),
])
def test_read_output_ranges(srv, twenty_k, line_range, first, last):
    for stream in ("combined", "stdout"):
        header, lines = read(srv, execution=twenty_k.n, stream=stream, line_range=line_range)
        assert header.startswith(f"[execution {twenty_k.n} · {stream} ·") and "of 20,000]" in header, header
        assert lines == [f"line {i}" for i in range(first, last + 1)]


def test_read_output_everything_and_outside(srv, twenty_k):
    header, lines = read(srv, execution=twenty_k.n)
    assert lines == [f"line {i}" for i in range(1, 20_001)]
    for outside in ("20001:20010", "30000"):
        header, lines = read(srv, execution=twenty_k.n, line_range=outside)
        assert "no lines" in header and lines == []
    header, lines = read(srv, execution=twenty_k.n, stream="stderr")
    assert "no lines" in header and lines == []


@pytest.mark.parametrize("line_range", ["abc", "1:2:3", "x:5", "5:y", "1.5:3", "1-5"])
def test_read_output_bad_ranges(srv, twenty_k, line_range):
    tool_error(srv, "read_output", {"execution": twenty_k.n, "line_range": line_range}, "invalid_line_range")


def test_max_chars_clips_lines_only_in_the_response(srv, twenty_k):
    header, lines = read(srv, execution=twenty_k.n, line_range="1:2", max_chars=3)
    assert "lines 1-2 of 20,000" in header
    assert lines == ["lin… [+3 chars]", "lin… [+3 chars]"]
    assert read(srv, execution=twenty_k.n, line_range="1:2", max_chars=6)[1] == ["line 1", "line 2"]
    assert read(srv, execution=twenty_k.n, line_range="1:2")[1] == ["line 1", "line 2"]


def test_search_literal(srv, twenty_k):
    header, lines = search(srv, "line 1999", execution=twenty_k.n, query_mode="literal")
    assert "literal" in header and "11 matching lines" in header and "11 matches" in header
    assert matched_numbers(lines) == [1999, *range(19_990, 20_000)]
    assert "M 1999 | line 1999" in lines


def test_search_regex_caps_at_max_matches(srv, twenty_k):
    header, lines = search(srv, r"^line 1\d{4}$", execution=twenty_k.n, query_mode="regex")
    assert ("regex" in header and "10,000 matching lines (first 500 shown)" in header
            and "10,000 matches" in header)
    assert matched_numbers(lines) == list(range(10_000, 10_500))
    header, lines = search(srv, r"^line 1\d{4}$", execution=twenty_k.n, max_matches=3)
    assert "(first 3 shown)" in header and matched_numbers(lines) == [10_000, 10_001, 10_002]


def test_search_context_groups(srv, twenty_k):
    _, lines = search(srv, "^line (100|200)$", execution=twenty_k.n, context_before=1, context_after=1)
    assert lines == ["C 99 | line 99", "M 100 | line 100", "C 101 | line 101", "--",
                     "C 199 | line 199", "M 200 | line 200", "C 201 | line 201"]
    _, lines = search(srv, "^line (10|12)$", execution=twenty_k.n, context_before=1, context_after=1)
    assert lines == ["C 9 | line 9", "M 10 | line 10", "C 11 | line 11", "M 12 | line 12", "C 13 | line 13"]


def test_search_ignore_case_and_max_chars(srv, twenty_k):
    assert matched_numbers(search(srv, "LINE 42$", execution=twenty_k.n, ignore_case=True)[1]) == [42]
    header, lines = search(srv, "LINE 42$", execution=twenty_k.n)
    assert "0 matching lines" in header and matched_numbers(lines) == []
    assert search(srv, "^line 7$", execution=twenty_k.n, max_chars=4)[1] == ["M 7 | line… [+2 chars]"]


def test_search_modes(srv, small):
    header, lines = search(srv, r"err\d+", execution=small.n)
    assert "regex (auto)" in header and "2 matching lines" in header and "3 matches" in header
    assert matched_numbers(lines) == [1, 4]
    header, lines = search(srv, r"err\d+", execution=small.n, ignore_case=True)
    assert "3 matching lines" in header and "4 matches" in header
    header, lines = search(srv, "a(b", execution=small.n)
    assert "literal (auto)" in header and lines == ["M 1 | err1 a(b"]
    header, lines = search(srv, r"err\d+", execution=small.n, query_mode="literal")
    assert "0 matching lines" in header and lines == []
    header, lines = search(srv, "err", execution=small.n, stream="stderr")
    assert "0 matching lines" in header and lines == []


@pytest.mark.timeout(180)
def test_ten_megabyte_source(srv):
    cell = run(srv, 'x_big = "' + "a" * 10_000_000 + '"\nlen(x_big)')
    assert cell.body == [f"Out[{cell.n}]: 10000000"]
    assert srv.result("ping") == {}


@pytest.mark.timeout(240)
def test_fifty_megabyte_read_output(srv):
    cell = run(srv, "import sys\nsys.stdout.write(('y' * 99 + '\\n') * 500_000);", timeout=180)
    assert "output omitted" in cell.text
    text, is_error, _ = srv.call("read_output", {"execution": cell.n, "stream": "stdout"}, timeout=180)
    assert not is_error and len(text) > 50_000_000
    assert "of 500,000]" in text.split("\n", 1)[0]
    assert lines_of(text) == ["y" * 99] * 500_000


def test_content_mode_declares_no_output_schema(srv):
    assert all("outputSchema" not in tool for tool in srv.result("tools/list")["tools"])
    for tool, args in [("status", {}), ("run_cell", {"freeform": "1"}),
                       ("read_output", {"execution": 99_999})]:
        assert "structuredContent" not in srv.call(tool, args)[2]


def test_a_cell_that_cannot_be_encoded_is_refused_before_numbering(srv):
    before = run(srv, "'numbered'").n
    text = tool_error(srv, "run_cell", {"code": "y = 5  # \ud800"}, "invalid_arguments")
    assert "line 1, column 10" in text and "U+D800" in text, text
    text = tool_error(srv, "run_cell", {"code": "x = 1\nz = '\udc80'"}, "invalid_arguments")
    assert "line 2, column 6" in text and "U+DC80" in text, text
    assert "\U0001F600" in run(srv, "print('\U0001F600')").text  # a whole pair is a character, and fine
    assert run(srv, "'after'").n == before + 2


@pytest.mark.parametrize("tool, args, code, words", [
    ("search_output", {"query": "a{4294967296}", "query_mode": "regex"}, "invalid_query", "too large"),
    ("search_output", {"query": "(" * 3000 + "a" + ")" * 3000, "query_mode": "regex"}, "invalid_query",
     "nested too deeply"),
    ("read_output", {"line_range": "1" * 5000 + ":"}, "invalid_line_range", "is not a line range"),
    ("wait", {"timeout_seconds": 10 ** 4000}, "invalid_timeout", "at most 3600"),
], ids=["huge-repeat", "deep-nesting", "long-range", "huge-timeout"])
def test_tool_errors_name_the_problem_in_words(srv, small, tool, args, code, words):
    text = tool_error(srv, tool, {"execution": small.n, **args} if tool != "wait" else args, code)
    assert words in text and "set_int_max_str_digits" not in text and "Error" not in text, text[:300]
    assert len(text) < 400, text[:300]


def test_a_query_too_odd_for_a_regex_is_searched_literally_in_auto_mode(srv, small):
    for query in ["a{4294967296}", "(" * 3000 + "a" + ")" * 3000]:
        text, is_error, _ = srv.call("search_output", {"query": query, "execution": small.n})
        assert not is_error and "literal" in text, text[:300]


OUTPUT_TOOLS = {"run_cell", "wait", "read_output", "search_output"}


def test_freeform_is_advertised_and_output_tools_declare_their_result_size(srv):
    tools = {tool["name"]: tool for tool in srv.result("tools/list")["tools"]}
    schema = tools["run_cell"]["inputSchema"]
    assert (list(schema["properties"]) == ["freeform", "kernel"]
            and schema["properties"]["freeform"]["type"] == "string")
    assert schema["required"] == ["freeform"]
    for name, tool in tools.items():
        size = tool.get("_meta", {}).get("anthropic/maxResultSizeChars")
        assert (size is not None and size >= 200_000) if name in OUTPUT_TOOLS else size is None, (name, size)
    assert '"freeform"' in tool_error(srv, "run_cell", {"source": 5}, "invalid_arguments")
    assert "unknown argument \"bogus\"" in tool_error(srv, "run_cell", {"freeform": "1", "bogus": 2},
                                                      "invalid_arguments")


ALWAYS_LOADED = {"run_cell", "wait", "status", "read_output", "search_output"}


def test_the_tools_an_agent_needs_first_ask_to_be_loaded_at_once(srv):
    """Claude Code defers tools behind its tool search unless _meta["anthropic/alwaysLoad"] is true."""
    for tool in srv.result("tools/list")["tools"]:
        loaded = tool.get("_meta", {}).get("anthropic/alwaysLoad")
        assert loaded is (True if tool["name"] in ALWAYS_LOADED else None), tool


CATASTROPHIC = "(a+)+b"  # backtracks for ~100 s over a line of 30 a's


def search_processes(server: StdioServer) -> list[int]:
    """The server's children that are copies of itself (forked searches), zombies included."""
    pid, found = server.proc.pid, []
    server_command = Path(f"/proc/{pid}/cmdline").read_bytes()
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:  # a fork has the server's command line, a zombie none
            if Path(f"/proc/{child}/cmdline").read_bytes() in (server_command, b""):
                found.append(int(child))
        except FileNotFoundError:  # reaped meanwhile
            pass
    return found


def test_a_runaway_regex_times_out_while_others_are_answered(spawn):
    s = spawn(LOOMMUX_SEARCH_TIMEOUT_SECONDS="1")
    cell = run(s, "print('a' * 30)")
    fds = Path(f"/proc/{s.proc.pid}/fd")
    open_before = len(list(fds.iterdir()))
    search_ids = [s.send_request("tools/call", {"name": "search_output",
                                                "arguments": {"query": CATASTROPHIC, "query_mode": "regex"}})
                  for _ in range(5)]  # more than run at once: the others wait, within the same deadline
    status_id = s.send_request("tools/call", {"name": "status"})
    status, found = s.response(status_id), [s.response(rid) for rid in search_ids]
    assert s.messages.index(status) < min(map(s.messages.index, found)), "status waited for a search"
    assert not status["result"]["isError"]
    for answer in found:
        text = answer["result"]["content"][0]["text"]
        assert answer["result"]["isError"] and text.startswith("search_timeout:"), text
        assert 'query_mode="literal"' in text
    assert wait_until(lambda: not search_processes(s), 10), "the stopped search left a process or a zombie"
    header, lines = search(s, "aaa", execution=cell.n, query_mode="literal")
    assert "literal" in header and matched_numbers(lines) == [1]
    assert matched_numbers(search(s, r"^a{30}$", execution=cell.n, query_mode="regex")[1]) == [1]
    assert wait_until(lambda: not search_processes(s), 10), "a finished search left a process or a zombie"
    assert wait_until(lambda: len(list(fds.iterdir())) <= open_before, 10), "searches left open descriptors"


def test_a_cancelled_search_kills_its_process(spawn):
    s = spawn(LOOMMUX_SEARCH_TIMEOUT_SECONDS="600")
    run(s, "print('a' * 40)")
    rid = s.send_request("tools/call", {"name": "search_output", "arguments": {"query": CATASTROPHIC}})
    assert wait_until(lambda: search_processes(s), 30), "the regex search did not run in a process of its own"
    child = search_processes(s)[0]
    s.notify("notifications/cancelled", {"requestId": rid, "reason": "test"})
    assert gone(child, 30) and wait_until(lambda: not search_processes(s), 30)
    assert s.call("status")[0].startswith("loommux ")


def test_a_search_quadratic_over_line_ends_is_forked_and_stopped(spawn):
    """\\s runs over line ends, so ^\\s*File " rescans a run of blank lines from each of them: in a
    thread a long run would hold the server for a minute."""
    s = spawn(LOOMMUX_SEARCH_TIMEOUT_SECONDS="1")
    cell = run(s, "print('\\n' * 400_000, end='')")
    rid = s.send_request("tools/call", {"name": "search_output",
                                        "arguments": {"query": r'^\s*File "', "execution": cell.n}})
    status = s.response(s.send_request("tools/call", {"name": "status"}))
    answer = s.response(rid)
    assert s.messages.index(status) < s.messages.index(answer), "status waited for the search"
    assert (answer["result"]["isError"]
            and answer["result"]["content"][0]["text"].startswith("search_timeout:"))
    header, lines = search(s, r'^[ \t]*File "', execution=cell.n)  # the same, within lines: linear
    assert "0 matching lines" in header and lines == []



@pytest.mark.fast
def test_tools_list_stays_within_its_token_budget():
    """Every tool's JSON as tools/list gives it to a 2025-11-25 session (the largest listing), in o200k_base
    tokens, both as loommux sends it (compact) and as json.dumps writes it: within 2,700 in all."""
    tokens = [(loommux.count_tokens(json.dumps(tool.describe("content", tasks=True), **style)), tool.name)
              for tool in loommux.TOOLS.values()
              for style in ({"ensure_ascii": False, "separators": (",", ":")}, {})]
    compact, dumped = sum(n for n, _ in tokens[0::2]), sum(n for n, _ in tokens[1::2])
    assert compact <= dumped <= 2700, tokens
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())  # its figures are these
    said = f"`tools/list` holds loommux's {len(loommux.TOOLS)} tools in {compact:,} o200k_base tokens as sent"
    assert said in readme and f"{dumped:,} as `json.dumps` writes it" in readme
    described = [tool.describe("content") for tool in loommux.TOOLS.values()]
    long = [tool["name"] for tool in described
            if len(tool["inputSchema"]["properties"]["kernel"]["description"]) > 60]
    assert long == ["run_cell"]  # the kernel argument is explained once


NAMESPACE_SETUP = """\
import numpy as np, pandas as pd, time
ns_frame = pd.DataFrame({"city": ["Oslo", "Lima", "Pune"], "temp": [4.5, 19.0, 31.25], "rank": [3, 2, 1]})
ns_array = np.arange(12, dtype=np.int32).reshape(3, 4) - 5
class NsSlow:
    runs = 0
    @property
    def counted(self):
        NsSlow.runs += 1
        return "ran"
    def __repr__(self):
        time.sleep(30)
        return "slow"
ns_slow = NsSlow()
ns_gone = [1, 2]
"""


def test_namespace_inspect_and_reset_on_a_real_kernel_leave_no_trace(srv):
    setup = run(srv, NAMESPACE_SETUP)
    text, is_error, _ = srv.call("namespace", {"query": "NS_"})
    assert not is_error and text.startswith("[namespace · 4 of ") and 'names match "NS_" · all shown]' in text
    rows = {line.split()[0]: line for line in lines_of(text)[1:]}
    assert list(rows) == ["ns_array", "ns_frame", "ns_gone", "ns_slow"]
    assert "variable  ndarray" in rows["ns_array"] and "(3, 4) · 48 B" in rows["ns_array"]
    assert "(3, 3)" in rows["ns_frame"] and "columns: city, temp, rank" in rows["ns_frame"]
    assert "len 2" in rows["ns_gone"] and "[repr did not finish within 2 s; still running" in rows["ns_slow"]
    frame, is_error, _ = srv.call("inspect", {"name": "ns_frame"})
    assert not is_error and frame.startswith("[inspect ns_frame · variable · pandas.DataFrame]"), frame
    assert "shape: (3, 3)\nmemory: " in frame and "dtypes (3 columns): city " in frame
    assert "temp float64 · rank int64" in frame
    assert "first rows:\n" in frame and "Lima  19.00" in frame
    column = srv.call("inspect", {"name": "ns_frame.temp"})[0]
    assert column.startswith("[inspect ns_frame.temp · variable · pandas.Series]\nshape: (3,)\n"), column
    assert "dtype: float64\nname: temp\n" in column and "1    19.00" in column
    array, is_error, _ = srv.call("inspect", {"name": "ns_array"})
    assert not is_error and "shape: (3, 4)\nmemory: 48 B\n" in array
    assert "dtype: int32\nmin: -5\nmax: 6" in array
    again = srv.call("inspect", {"name": "ns_slow"})[0]  # its repr still sleeps: not run a second time
    assert "repr: [repr not evaluated: an earlier one still runs, see interrupt()]" in again
    assert "repr: 'ran'" in srv.call("inspect", {"name": "ns_slow.counted"})[0]
    missing = tool_error(srv, "inspect", {"name": "ns_frame.no_such_column"}, "name_not_found")
    assert '"ns_frame.no_such_column" does not exist' in missing
    nowhere = tool_error(srv, "inspect", {"name": "ns_nowhere"}, "name_not_found")
    assert '"ns_nowhere" is not defined' in nowhere
    reset, is_error, _ = srv.call("reset", {"names": ["ns_gone", "In", "loommux", "ns_never"]})
    assert not is_error and reset.split("\n") == [
        "[reset · 1 removed · 2 refused · 1 unknown]", "removed: ns_gone",
        "refused: In (IPython's own), loommux (loommux's)", "unknown: ns_never"]
    again = srv.call("reset", {"names": ["ns_gone"]})[0]
    assert again.startswith("[reset · 0 removed · 0 refused · 1 unknown]")
    after = run(srv, "print(NsSlow.runs, 'ns_gone' in dir(), len(In), get_ipython().execution_count)")
    assert after.n == setup.n + 1  # none of them took an execution number, nor left a trace in In[]
    runs, gone, inputs, count = after.body[0].split()
    assert (runs, gone, int(inputs), int(count)) == ("1", "False", after.n + 1, after.n + 1)
    assert srv.call("execution_status", {"execution": after.n})[0].count("\n") > 3
    run(srv, "del ns_frame, ns_array, ns_slow, NsSlow")


def test_namespace_and_inspect_answer_during_a_busy_cell(srv):
    """On ipykernel 7 they run on a subshell while the cell holds the main shell; reset says busy."""
    running = run_cell(srv, "%%loommux --wait 0.5\nimport time\nns_busy = {'seen': 'while running'}\n"
                       "time.sleep(60)")
    assert running.state == "running"
    listed, is_error, _ = srv.call("namespace", {"query": "ns_busy"})
    assert not is_error and lines_of(listed)[1].split()[:5] == ["ns_busy", "variable", "dict", "len", "1"]
    shown, is_error, _ = srv.call("inspect", {"name": "ns_busy"})
    assert not is_error and "repr: {'seen': 'while running'}" in shown, shown
    busy = tool_error(srv, "reset", {}, "busy")
    assert f"execution {running.n} is still running" in busy
    assert "[running ·" in srv.call("wait", {"execution": running.n, "timeout_seconds": 0})[0]
    srv.call("interrupt")
    assert finish(srv, running).state == "interrupted"
    assert run(srv, "del ns_busy").n == running.n + 1


STUBBORN_REPRS = """\
import time
class NsStubborn:
    def __repr__(self):
        while True:
            try:
                time.sleep(.01)
            except BaseException:
                pass
class NsSleepy:
    def __repr__(self):
        time.sleep(20)
        return "slept"
ns_stubborn, ns_sleepy = NsStubborn(), NsSleepy()
"""


def test_a_repr_that_swallows_every_stop_is_stopped_and_the_kernel_stays_usable(srv):
    """The repr is stopped for real; one that cannot be (a long sleep) runs on in a thread of its own, which
    interrupt reaches and names, and the next cell runs."""
    run(srv, STUBBORN_REPRS)
    stubborn, is_error, _ = srv.call("inspect", {"name": "ns_stubborn"})
    assert not is_error and stubborn.endswith("repr: [repr did not finish within 2 s]"), stubborn
    sleepy = srv.call("inspect", {"name": "ns_sleepy"})[0]
    assert sleepy.endswith("repr: [repr did not finish within 2 s; still running, see interrupt()]"), sleepy
    text, is_error, _ = srv.call("interrupt", {})
    assert not is_error and text.startswith("interrupt_sent: no cell is running"), text
    assert "(the kernel is free for cells): " in text and 'repr of "ns_sleepy" (running ' in text, text
    assert text.endswith("; restart() ends them"), text
    assert run(srv, "print(6 * 7)").body == ["42"]
    running = run_cell(srv, "%%loommux --wait 0.5\ntime.sleep(60)")  # on the subshell, while a cell runs
    rows = lines_of(srv.call("namespace", {"query": "ns_s"})[0])
    assert rows[1].endswith("[repr not evaluated: an earlier one still runs, see interrupt()]"), rows
    assert rows[2].endswith("[repr did not finish within 2 s]"), rows
    text = srv.call("interrupt", {})[0]
    assert text.startswith(f"interrupt_sent: execution {running.n} is now interrupted after "), text
    assert 'repr of "ns_sleepy" (running ' in text, text
    assert finish(srv, running).state == "interrupted"
    run(srv, "ns_hung = NsSleepy()")
    asked = srv.send_request("tools/call", tool_params("inspect", {"name": "ns_hung"}))
    deadline = time.monotonic() + 60
    while 'repr of "ns_hung"' not in (text := srv.call("interrupt", {})[0]):  # it reaches a repr under way
        assert time.monotonic() < deadline, text
    assert 'repr: [repr did not finish within 2 s' in tool_text(srv.response(asked, 90)["result"])[0]
    run(srv, "del ns_stubborn, ns_sleepy, ns_hung, NsStubborn, NsSleepy")


def test_errors_and_answers_quote_unbounded_input_bounded(srv):
    for tool, args, code in (("status", {"kernel": "b" * 100_000}, "invalid_resource_name"),
                             ("status", {"kernel": "~" + "a" * 100_000}, "kernel_not_found"),
                             ("inspect", {"name": "a" * 100_000}, "invalid_arguments"),
                             ("read_output", {"execution": "x" * 100_000}, "invalid_arguments")):
        assert len(tool_error(srv, tool, args, code)) < 400
    for tool, args, code in (("run_cell", {"freeform": f"%%loommux --{'w' * 100_000}\n1"},
                              "invalid_cell_header"),
                             ("run_cell", {"freeform": f"%%loommux --wait {'9' * 100_000}x\n1"},
                              "invalid_cell_header"),
                             ("namespace", {"z" * 100_000: 1}, "invalid_arguments")):
        assert len(tool_error(srv, tool, args, code)) < 400
    assert len(srv.call("namespace", {"query": "q" * 100_000})[0]) < 400
    assert len(srv.call("search_output", {"query": "(" * 100_000})[0].split("\n")[0]) < 400
    assert len(srv.request("no/such" + "m" * 100_000, {})["error"]["message"]) < 400
    names = ["ns_once", "ns_once", *(f"nope{i}" for i in range(20_000))]  # each name is said once
    text, is_error, _ = srv.call("reset", {"names": names})  # 20,001: ns_once is unknown once
    assert not is_error, text
    assert text.startswith("[reset · 0 removed · 0 refused · 20,001 unknown]\nunknown: ns_once, nope0, ")
    assert text.endswith(", nope98, … and 19,901 more")
    error = srv.request("resources/read", {"uri": "loommux://" + "x" * 100_000})["error"]
    assert len(json.dumps(error)) < 1000 and "… [+" in error["message"]


def test_a_kernel_without_subshells_says_busy_with_the_running_execution(spawn, tmp_path):
    """ipykernel before 7 has no subshells: namespace, inspect and reset say busy, as run_cell does."""
    write_spec(tmp_path, "nosub", {"argv": [sys.executable, "-c", NO_SUBSHELLS, "-f", "{connection_file}"],
                                    "language": "python"})
    s = spawn(**kernel_env(tmp_path, LOOMMUX_KERNELSPEC="nosub"))
    run(s, "ns_idle = 1")
    assert lines_of(s.call("namespace", {})[0])[1].split() == ["ns_idle", "variable", "int", "1"]
    running = run_cell(s, "%%loommux --wait 0.5\nimport time\ntime.sleep(60)")
    for tool, args in (("namespace", {}), ("inspect", {"name": "ns_idle"}), ("reset", {})):
        assert f"execution {running.n} is still running" in tool_error(s, tool, args, "busy")
    s.call("interrupt")


@needs_gateway
def test_namespace_and_inspect_on_a_gateway_kernel_while_busy(gw_spawn):
    """The subshell's id travels in the header of a message sent over the gateway's WebSocket."""
    server = gw_spawn()
    running = run_cell(server, "%%loommux --wait 0.5\nimport time\nns_remote = 'far'\ntime.sleep(60)")
    assert running.state == "running"
    rows = [line.split() for line in server.call("namespace", {})[0].split("\n")]
    assert ["ns_remote", "variable", "str", "len", "3", "'far'"] in rows
    assert "repr: 'far'" in server.call("inspect", {"name": "ns_remote"})[0]
    server.call("interrupt")
    assert finish(server, running).state == "interrupted"


# Starts ipykernel 7 with kernel_info saying nothing of subshells, as a kernel before 7 does.
NO_SUBSHELLS = """\
import ipykernel.ipkernel as ipkernel
info = ipkernel.IPythonKernel.kernel_info
ipkernel.IPythonKernel.kernel_info = property(lambda self: {**info.fget(self), "supported_features": []})
from ipykernel.kernelapp import launch_new_instance
launch_new_instance()
"""


@pytest.mark.fast
@pytest.mark.parametrize(("arguments", "said"), [
    ({"city": "Oslo", "kernel": "lab"}, None),
    ({"city": "Oslo", "unit": "F", "tags": ["a"], "weights": {"a": 1, "b": 0.5}, "rows": [[1], []]}, None),
    ({"city": "Oslo", "tags": None, "rows": None}, None),
    ({}, 'missing required argument "city"'),
    ({"city": "Oslo", "extra": 1},
     'unknown argument "extra" (accepted: city, unit, tags, weights, rows, raw, deep, kernel)'),
    ({"city": True}, '"city" must fit {"type": "string"}, not true'),
    ({"city": "Oslo", "unit": "K"}, '"unit" must fit {"enum": ["C", "F"], "default": "C"}, not "K"'),
    ({"city": "Oslo", "tags": [1]}, '"tags" must fit'),
    ({"city": "Oslo", "weights": {"a": "heavy"}}, '"weights" must fit'),
    ({"city": "Oslo", "weights": {"a": float("nan")}}, '"weights" must fit'),
    ({"city": "Oslo", "rows": [[1.5]]}, '"rows" must fit'),
    ([], "arguments must be a JSON object"),
    # valid by the schema, yet no JSON the kernel could take: refused here, never a failure in the kernel
    ({"city": "Oslo", "raw": {"x": float("nan")}},
     '"raw" holds nan, which is not JSON (numbers must be finite)'),
    ({"city": "Oslo", "raw": {"x": [-float("inf")]}}, '"raw" holds -inf, which is not JSON'),
    ({"city": "Oslo", "deep": functools.reduce(lambda inner, _: [inner], range(501), [])},
     '"deep" is nested deeper than 500 levels'),
    ({"city": "Oslo", "deep": functools.reduce(lambda inner, _: [inner], range(300), []), "raw": {"x": -0.0},
      "tags": ["\ud800" * 3, "x" * 100_000]}, None),
], ids=["kernel-argument", "every-argument", "nulls", "missing-city", "unknown-argument", "city-not-a-string",
        "unit-not-in-enum", "tags-not-strings", "weights-not-numbers", "weights-nan", "rows-not-integers",
        "not-an-object", "raw-nan", "raw-inf", "too-deep", "deep-surrogates-and-long-tags"])
def test_published_arguments_are_checked_against_the_announced_schema(arguments, said):
    namespace: dict = {}
    exec("from typing import Literal, Optional\n"  # noqa: S102 - a cell's definition
         "def report(city: str, unit: Literal['C', 'F'] = 'C', tags: list[str] | None = None,\n"
         "           weights: dict[str, float] = {}, rows: Optional[list[list[int]]] = None,\n"
         "           raw: dict = {}, deep: list = []): ...", namespace)
    published = loommux.PublishedFunctions()
    published.publish(namespace["report"], None, None)
    tool = published.tools["report"]
    if said is None:
        checked = loommux.check_published_arguments(tool, arguments)
        assert checked == {k: v for k, v in arguments.items() if k != "kernel"}
        return
    with pytest.raises(loommux.ToolError) as refused:
        loommux.check_published_arguments(tool, arguments)
    assert refused.value.code == "invalid_arguments" and refused.value.message.startswith(said), refused.value


# ---------------------------------------------------------------- MCP protocol


def test_initialize_result(session_server):
    result = session_server.init_result
    assert result["protocolVersion"] == LATEST
    assert result["serverInfo"]["name"] == "loommux"
    assert isinstance(result["serverInfo"]["version"], str) and result["serverInfo"]["version"]
    assert "tools" in result["capabilities"]
    assert isinstance(result.get("instructions"), str) and "run_cell" in result["instructions"]


def test_ping(srv):
    assert srv.result("ping") == {}


READ_ONLY_TOOLS = {"wait", "status", "execution_status", "read_output", "search_output", "namespace",
                   "inspect"}


def test_tools_list(srv):
    tools = srv.result("tools/list")["tools"]
    assert {t["name"] for t in tools} == TOOLS and len(tools) == len(TOOLS)
    for tool in tools:
        schema = tool["inputSchema"]
        assert schema["type"] == "object", tool["name"]
        assert schema.get("additionalProperties") is False, tool["name"]
        assert tool.get("description"), tool["name"]
        annotations = tool["annotations"]
        assert annotations.get("title"), tool["name"]
        if tool["name"] in READ_ONLY_TOOLS:
            assert annotations.get("readOnlyHint") is True, tool["name"]
    restart = next(t for t in tools if t["name"] == "restart")
    assert restart["annotations"].get("destructiveHint") is True
    assert restart["annotations"].get("readOnlyHint") is not True
    paged = srv.request("tools/list", {"cursor": "page-2"})
    assert paged["error"]["code"] == -32602  # one page: any cursor is unknown


def test_batches_in_protocol_2025_03_26(spawn):
    s = spawn(initialize=False)
    s.initialize("2025-03-26")
    s.send([jsonrpc("ping", id="b1"), jsonrpc("notifications/initialized"),
            jsonrpc("tools/call", tool_params("run_cell", {"freeform": "40 + 2"}), "b2")])
    assert s.response("b1")["result"] == {}
    assert s.response("b2")["result"]["content"][0]["text"].endswith("Out[1]: 42")


@pytest.mark.parametrize("method", ["no/such/method", "tasks/update"])  # tasks/update is 2026-07-28's only
def test_unknown_method(srv, method):
    msg = srv.request(method, {}, timeout=10)
    assert msg["error"]["code"] == -32601
    assert srv.result("ping") == {}


@pytest.mark.parametrize("line", [b"{not json\n", b'{"jsonrpc": "2.0", "id": 5, "method":\n',
                                  b"\xff\xfe\x00garbage\n"])
def test_unparseable_line(srv, line):
    mark = len(srv.messages)
    srv.send_raw(line)
    msg = srv.wait_for(lambda m: "error" in m, timeout=10, since=mark)
    assert msg["id"] is None and msg["error"]["code"] == -32700
    assert srv.result("ping") == {}


@pytest.mark.parametrize("line, rid", [
    ('"hello"', None),
    ("42", None),
    ('{"jsonrpc":"2.0","id":"no-method"}', "no-method"),
    ('{"jsonrpc":"2.0","id":"bad-method","method":7}', "bad-method"),
    ('[{"jsonrpc":"2.0","id":"in-batch","method":"ping"}]', "in-batch"),  # no batches after 2025-03-26
])
def test_invalid_request(srv, line, rid):
    mark = len(srv.messages)
    srv.send_raw(line + "\n")
    msg = srv.wait_for(lambda m: "error" in m and m.get("id") in (None, rid), timeout=10, since=mark)
    assert msg["error"]["code"] == -32600
    assert srv.result("ping") == {}


def test_notifications_are_never_answered(srv):
    mark = len(srv.messages)
    srv.notify("notifications/whatever", {"x": 1})
    srv.notify("notifications/cancelled", {"requestId": 987654, "reason": "unknown id"})
    srv.notify("notifications/initialized")
    rid = srv.send_request("ping")
    srv.response(rid, timeout=10)
    time.sleep(0.3)
    assert [m.get("id") for m in srv.messages[mark:]] == [rid]


def test_tools_call_protocol_errors(srv):
    assert srv.request("tools/call", {"name": "no_such_tool", "arguments": {}})["error"]["code"] == -32602
    assert srv.request("tools/call", {"arguments": {}})["error"]["code"] == -32602
    assert srv.result("ping") == {}


def test_input_fails_at_once(srv):
    cell = run_cell(srv, "name = input('name? ')")
    assert cell.state == "error", cell.text


def test_cancelled_wait_is_never_answered_and_cell_continues(srv):
    cell = run_cell(srv, "%%loommux --wait 0.1\nimport time\ntime.sleep(2)\nprint('finished')")
    assert cell.state == "running"
    cancelled = srv.send_request("tools/call", {"name": "wait", "arguments": {"execution": cell.n}})
    srv.notify("notifications/cancelled", {"requestId": cancelled, "reason": "test"})
    done = finish(srv, cell)
    assert done.state == "completed" and done.body == ["finished"]
    time.sleep(0.5)
    assert srv.result("ping") == {}
    assert cancelled not in srv.responses


PROTOCOL_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")


def test_version_negotiation_and_discover_before_initialize(spawn):
    versions = [*PROTOCOL_VERSIONS, "1999-01-01"]
    servers = [spawn(initialize=False) for _ in versions]
    probe = servers[-1].request("server/discover", {"_meta": {}}, timeout=60)
    assert probe["error"]["code"] == -32602  # a 2026-07-28 request without its envelope
    assert servers[-1].result("ping", timeout=60) == {}
    for server, version in zip(servers, versions):
        expected = version if version in PROTOCOL_VERSIONS else LATEST
        assert server.initialize(version)["protocolVersion"] == expected
    for server in servers:
        server.proc.stdin.close()
    for server in servers:
        assert server.proc.wait(15) == 0


def progress_of(server, token, since: int) -> list[dict]:
    return [m["params"] for m in server.messages[since:]
            if m.get("method") == "notifications/progress" and m["params"].get("progressToken") == token]


def test_progress_notifications_over_stdio_only_with_a_token(srv):
    since = len(srv.messages)
    cell = run_cell(srv, "import time\nprint('quiet', flush=True)\ntime.sleep(1.5)")
    assert cell.state == "completed"
    assert not [m for m in srv.messages[since:] if m.get("method") == "notifications/progress"]

    since = len(srv.messages)
    rid = srv.send_request("tools/call",
                           tool_params("run_cell", {"freeform": TICKS.replace("--wait 0.1", "--wait 30")}),
                           progress_token="run-token")
    response = srv.response(rid)
    updates = progress_of(srv, "run-token", since)
    assert len(updates) >= 2, updates
    assert [u["progress"] for u in updates] == sorted(u["progress"] for u in updates)
    assert all(re.fullmatch(r"execution \d+ running · (no|\d+) lines? so far( · last: tick \d)?",
                            u["message"])
               for u in updates), updates
    assert srv.messages.index(response) > max(i for i, m in enumerate(srv.messages)
                                              if m.get("params") in updates)

    running = run_cell(srv, TICKS)
    assert running.state == "running" and re.search(r"· silent for \d+ ms\]", running.text)
    since = len(srv.messages)
    rid = srv.send_request("tools/call", tool_params("wait", {"execution": running.n}), progress_token=7)
    assert Cell.parse(srv.response(rid)["result"]["content"][0]["text"]).state == "completed"
    count = len(progress_of(srv, 7, since))
    assert count >= 2
    time.sleep(1.2)  # progress stops with the response
    assert len(progress_of(srv, 7, since)) == count


@pytest.mark.anyio
@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_official_client_adopts_2026_07_28_and_runs_every_tool(http_server, tmp_path, transport):
    from mcp import Client, StdioServerParameters

    (tmp_path / "ws").mkdir()
    target = (StdioServerParameters(command=sys.executable, args=[str(LOOMMUX)], env=server_env(),
                                    cwd=str(tmp_path / "ws"))
              if transport == "stdio" else http_server.url)
    async with Client(target) as client:
        assert client.protocol_version == STATELESS
        names = [tool.name for tool in (await client.list_tools()).tools]
        assert set(names) == TOOLS
        texts = {}
        for tool, args in [("run_cell",
                            {"freeform": "%%loommux --wait 30\nmodern_value = 6 * 7\nprint(modern_value)"}),
                           ("wait", {}), ("status", {}), ("execution_status", {}), ("read_output", {}),
                           ("search_output", {"query": "42"}), ("interrupt", {}), ("restart", {})]:
            result = await client.call_tool(tool, args)
            texts[tool] = "".join(c.text for c in result.content if c.type == "text")
            assert not result.is_error, (tool, texts[tool])
        assert texts["run_cell"].split("\n")[1] == "42" and "M 1 | 42" in texts["search_output"]
        if transport == "http":
            assert "resource: default ·" in texts["status"]  # a modern HTTP call without kernel=
        handle = handle_of((await client.call_tool("run_cell",
                                                   {"freeform": "h = 1", "kernel": "~"})).content[0].text)
        again = await client.call_tool("run_cell", {"freeform": "print(h + 1)", "kernel": handle})
        assert again.content[0].text.split("\n")[1] == "2"


@pytest.mark.anyio
async def test_official_client_in_legacy_mode_beside_a_stateless_one(http_server):
    from mcp import Client

    async with Client(http_server.url, mode="legacy") as legacy, Client(http_server.url) as stateless:
        assert legacy.protocol_version == LATEST and stateless.protocol_version == STATELESS
        await legacy.call_tool("run_cell", {"freeform": "era = 'handshake'"})
        await stateless.call_tool("run_cell", {"freeform": "era = 'modern'"})
        seen = [(await client.call_tool("run_cell",
                                        {"freeform": "print(era)"})).content[0].text.split("\n")[1]
                for client in (legacy, stateless)]
        assert seen == ["handshake", "modern"]  # each era in its own kernel
        status = (await legacy.call_tool("status", {})).content[0].text
        assert "resource: private ·" in status


def test_stateless_discover_list_and_errors_over_raw_http(http_server):
    stateless = StatelessHttp(http_server)
    discover = stateless.post(stateless.message("server/discover"))
    assert discover.status == 200 and "mcp-session-id" not in discover.headers
    result = discover.json()["result"]
    assert result["supportedVersions"] == SERVED and result["resultType"] == "complete"
    assert (result["capabilities"] == {"tools": {"listChanged": True}, "resources": {"subscribe": True},
                                       "extensions": {"io.modelcontextprotocol/tasks": {},
                                                      "io.modelcontextprotocol/skills": {},
                                                      "io.modelcontextprotocol/ui": {}}}
            and result["instructions"])
    assert result["_meta"]["io.modelcontextprotocol/serverInfo"]["name"] == "loommux"
    assert result["ttlMs"] > 0 and result["cacheScope"] == "public"
    listed = stateless.post(stateless.message("tools/list")).json()["result"]
    assert listed["ttlMs"] == 0 and listed["cacheScope"] == "public" and listed["resultType"] == "complete"
    for tool in listed["tools"]:
        assert tool["inputSchema"]["properties"]["kernel"]["x-mcp-header"] == "Kernel"
    with HttpMcp(http_server) as legacy:  # the handshake path is unchanged
        legacy_list = legacy.result("tools/list")
        assert not {"ttlMs", "cacheScope", "resultType", "_meta"} & set(legacy_list)
        # one tool list for every caller and era, but for 2025-11-25's execution.taskSupport
        # of run_cell and wait
        assert ([{k: v for k, v in tool.items() if k != "execution"} for tool in legacy_list["tools"]]
                == listed["tools"])
        assert {t["name"]: t.get("execution") for t in legacy_list["tools"] if "execution" in t} == {
            "run_cell": {"taskSupport": "optional"}, "wait": {"taskSupport": "optional"}}

    def error(response: HttpResponse, status: int, code: int) -> dict:
        assert response.status == status, (response.status, response.body[:300])
        body = response.json()
        assert body["error"]["code"] == code, body
        return body["error"]

    call = tool_params("status", {})
    no_capabilities = {**call, "_meta": {"io.modelcontextprotocol/protocolVersion": STATELESS}}
    error(stateless.post(jsonrpc("tools/call", no_capabilities, 1)), 400, -32602)
    error(stateless.post(stateless.message("tools/list"), {"Mcp-Method": "tools/call"}), 400, -32020)
    error(stateless.post(stateless.message("tools/list"), {"MCP-Protocol-Version": "2025-11-25"}),
          400, -32020)
    error(stateless.post(stateless.message("tools/call", call), {"Mcp-Name": "wait"}), 400, -32020)
    # the kernel argument without its Mcp-Param-Kernel header
    no_param = stateless.post(stateless.message("tools/call", tool_params("status", {"kernel": "x"})),
                           {"Mcp-Param-Kernel": None})
    assert "Mcp-Param-Kernel" in error(no_param, 400, -32020)["message"]
    error(stateless.post(stateless.message("tools/call", call), {"Mcp-Param-Kernel": "x"}), 400, -32020)
    # the kernel argument's header base64-wrapped: decoded when canonical, refused when not (trailing bits)
    wrapped = tool_params("status", {"kernel": "b64-room"})
    answered = stateless.post(stateless.message("tools/call", wrapped),
                           {"Mcp-Param-Kernel": "=?base64?YjY0LXJvb20=?="})
    assert answered.status == 200 and not answered.json()["result"]["isError"], answered.body[:300]
    for bad in ("=?base64?YjY0LXJvb21=?=", "=?base64?not base64?=", "=?base64?/w==?="):
        assert "base64" in error(stateless.post(stateless.message("tools/call", wrapped),
                                             {"Mcp-Param-Kernel": bad}), 400, -32020)["message"]
    unsupported = error(stateless.post(stateless.message("tools/list",
                                                   {"_meta": {"io.modelcontextprotocol/protocolVersion":
                                                              "2099-01-01"}}),
                                    {"MCP-Protocol-Version": "2099-01-01"}), 400, -32022)
    assert unsupported["data"] == {"supported": SERVED, "requested": "2099-01-01"}
    error(stateless.post(stateless.message("ping")), 404, -32601)
    # initialize at 2026-07-28 (the conformance suite's server-stateless): a method the revision removed
    error(stateless.post(jsonrpc("initialize", INITIALIZE_PARAMS, 1)), 404, -32601)
    error(stateless.post(stateless.message("logging/setLevel", {"level": "info"})), 404, -32601)
    for method in ("GET", "DELETE"):
        conn = RawHttp(http_server.port)
        refused = conn.request(method, "/mcp",
                               {"Accept": "text/event-stream", "MCP-Protocol-Version": STATELESS})
        conn.close()
        assert refused.status == 405 and refused.headers["allow"] == "POST"
    # a modern request never gets, nor uses, a session id
    response = stateless.post(stateless.message("tools/call", call), {"Mcp-Session-Id": "whatever"})
    assert response.status == 200 and "mcp-session-id" not in response.headers


@pytest.mark.anyio
@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_input_through_the_official_clients_elicitation_callback(http_server, tmp_path, transport):
    from mcp import Client, StdioServerParameters, types

    asked: list = []
    answers = iter([types.ElicitResult(action="accept", content={"input": "Ada"}),
                    types.ElicitResult(action="decline"), types.ElicitResult(action="cancel")])

    async def elicit(context, params):
        asked.append(params)
        return next(answers)

    (tmp_path / "ws").mkdir()
    target = (StdioServerParameters(command=sys.executable, args=[str(LOOMMUX)], env=server_env(),
                                    cwd=str(tmp_path / "ws"))
              if transport == "stdio" else http_server.url)
    async with Client(target, mode="legacy", elicitation_callback=elicit) as client:
        result = await client.call_tool("run_cell",
                                        {"freeform": "name = input('Your name? ')\nprint('hello', name)"})
        assert result.content[0].text.split("\n")[1:] == ["hello Ada"]
        assert asked[0].message == "Your name? " and asked[0].mode == "form"
        schema = asked[0].requested_schema
        assert (schema["type"] == "object"
                and [spec["type"] for spec in schema["properties"].values()] == ["string"])
        for _ in range(2):  # decline, then cancel: EOFError saying the person declined; the cell goes on
            result = await client.call_tool("run_cell",
                                            {"freeform": "try:\n    input()\nexcept EOFError as e:\n"
                                                         "    print(type(e).__name__, e)\nprint('went on')"})
            assert result.content[0].text.split("\n")[1:] == [
                "EOFError the person declined to answer this input() prompt", "went on"]
        assert asked[-1].message == "The cell asks for input" and len(asked) == 3
        for code in ("import getpass\ngetpass.getpass()", "input('API key: ')", "input('Password:')"):
            result = await client.call_tool("run_cell", {"freeform": code})  # never a form: fails at once
            text = result.content[0].text
            assert "· error:" in text and "StdinNotImplementedError" in text and "secret" in text, text
        assert len(asked) == 3


def test_input_without_a_caller_that_can_ask_fails_at_once(srv, spawn):
    # URL mode only
    for server in (srv, elicitation_session(spawn, capabilities={"elicitation": {"url": {}}})):
        cell = run_cell(server, "input('name? ')")
        assert cell.state == "error" and "StdinNotImplementedError" in cell.text, cell.text
    stateless = srv.result("tools/call", stateless_params(run_params("input('name? ')")))  # modern, no tasks
    assert "StdinNotImplementedError" in stateless["content"][0]["text"]
    assert not [m for m in srv.messages if m.get("method") == "elicitation/create"]


def test_a_later_call_that_can_ask_asks_and_interrupt_clears_the_question(spawn):
    server = elicitation_session(spawn)
    cell = run_cell(server,
                    "%%loommux --wait 0.2\nimport time\ntime.sleep(0.8)\nprint('said', input('later? '))")
    assert cell.state == "running"
    time.sleep(1.5)  # the cell now waits in input(), and no call waits on it
    status = server.call("status")[0]
    assert "waiting for input: 'later? '" in status, status
    assert "waiting for input: 'later? '" in server.call("execution_status", {"execution": cell.n})[0]
    assert not [m for m in server.messages if m.get("method") == "elicitation/create"]
    mark = len(server.messages)
    rid = server.send_request("tools/call", {"name": "wait", "arguments": {"execution": cell.n}})
    asked = next_elicitation(server, mark)
    assert asked["params"]["message"] == "later? "
    answer(server, asked, {"action": "accept", "content": {"input": "then"}})
    assert Cell.parse(server.response(rid)["result"]["content"][0]["text"]).body == ["said then"]
    # interrupt clears a question: the form is withdrawn, a late answer is ignored, the kernel goes on
    cell = run_cell(server, "%%loommux --wait 0.5\nimport time\ntime.sleep(0.1)\ninput('never answered? ')")
    asked = server.wait_for(lambda m: m.get("method") == "elicitation/create"
                            and m["params"]["message"] == "never answered? ", 30)
    assert "waiting for input" in server.call("status")[0]
    text, _, _ = server.call("interrupt")
    assert text.startswith("interrupt_sent"), text
    withdrawn = server.wait_for(lambda m: m.get("method") == "notifications/cancelled"
                                and m["params"]["requestId"] == asked["id"], 30)
    assert withdrawn["params"]["reason"]
    answer(server, asked, {"action": "accept", "content": {"input": "too late"}})
    assert finish(server, cell).state == "interrupted"
    assert "waiting for input" not in server.call("status")[0]
    assert run(server, "print('still fine')").body == ["still fine"]
    # restart clears it too
    run_cell(server, "%%loommux --wait 0.5\ninput('restart me? ')")
    server.wait_for(lambda m: m.get("method") == "elicitation/create"
                    and m["params"]["message"] == "restart me? ", 30)
    assert not server.call("restart")[1]
    assert "waiting for input" not in server.call("status")[0]


# What a host that declares no extension saw before issue 31: the release this branch began from. Its tools,
# results and their sizes are the same today, but for the alwaysLoad meta and the resource_link blocks.
BASELINE_COMMIT = "8e39643"
DURATION_RE = re.compile(r"\d[\d,.]* (?:ms|s|min|h)\b")
BASELINE_CALLS = [("run_cell", {"freeform": "print('alpha')\n6 * 7"}), ("run_cell", {"freeform": LONG_CELL}),
                  ("run_cell", {"freeform": MANY_IMAGES}), ("wait", {}),
                  ("read_output", {"line_range": "-3:"}), ("search_output", {"query": "row 59\\d\\d"}),
                  ("run_cell", {"freeform": "1 / 0"}), ("read_output", {"execution": 99})]


async def take_surface(path: Path, workspace: Path, mode: str) -> tuple[list[dict], list[dict]]:
    """The tools/list and the results of BASELINE_CALLS of the loommux at ``path``, as JSON, durations
    blanked (a host's view: the official client, declaring no extension)."""
    from mcp import Client, StdioServerParameters

    workspace.mkdir()
    params = StdioServerParameters(command=sys.executable, args=[str(path)], env=server_env(),
                                   cwd=str(workspace))
    async with Client(params, mode=mode, read_timeout_seconds=120) as client:
        tools = [tool.model_dump(mode="json", by_alias=True, exclude_none=True)
                 for tool in (await client.list_tools()).tools]
        results = []
        for name, args in BASELINE_CALLS:
            result = await client.call_tool(name, args)
            shown = json.dumps(result.model_dump(mode="json", by_alias=True, exclude_none=True))
            results.append(json.loads(DURATION_RE.sub("T", shown)))
    return tools, results


def strip_descriptions(schema: Any) -> Any:
    """A JSON schema without its description texts."""
    if isinstance(schema, dict):
        return {k: strip_descriptions(v) for k, v in schema.items() if k != "description"}
    return [strip_descriptions(v) for v in schema] if isinstance(schema, list) else schema


@pytest.fixture
def baseline_loommux(tmp_path) -> Path:
    """loommux.py as it was at BASELINE_COMMIT, from this checkout's history."""
    shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{BASELINE_COMMIT}:loommux.py"],
                           capture_output=True, check=False)
    if shown.returncode != 0:
        pytest.skip(f"the baseline {BASELINE_COMMIT} is not in this checkout's history")
    baseline = tmp_path / "baseline" / "loommux.py"
    baseline.parent.mkdir()
    baseline.write_bytes(shown.stdout)
    return baseline


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["legacy", "auto"])
async def test_a_host_without_extensions_sees_what_it_saw_but_two_additions(baseline_loommux, tmp_path, mode):
    baseline = baseline_loommux
    old_tools, old_results = await take_surface(baseline, tmp_path / "old", mode)
    new_tools, new_results = await take_surface(LOOMMUX, tmp_path / "new", mode)
    old_by_name = {tool["name"]: tool for tool in old_tools}
    for tool in new_tools:
        if tool["name"] not in old_by_name:
            continue  # a tool added since
        meta = dict(tool.get("_meta", {}))
        assert meta.pop("anthropic/alwaysLoad", None) is (True if tool["name"] in ALWAYS_LOADED else None)
        old = old_by_name[tool["name"]]
        assert meta == old.get("_meta", {}) and "ui" not in meta
        # the same arguments and annotations (their texts are shorter since issue 30 asked for it)
        assert strip_descriptions(tool["inputSchema"]) == strip_descriptions(old["inputSchema"])
        assert tool["annotations"] == old["annotations"]
    links = 0
    for (name, _), old, new in zip(BASELINE_CALLS, old_results, new_results):
        kept = [block for block in new["content"] if block["type"] != "resource_link"]
        links += len(new["content"]) - len(kept)
        assert {**new, "content": kept} == old, name
        assert "structuredContent" not in new
    assert links == 1 + 3 + 3  # the long output, and three images beyond the limit (twice: run_cell, wait)


async def wait_for_changes(changes: list, count: int) -> None:
    import anyio

    with anyio.fail_after(20):
        while len(changes) < count:
            await asyncio.sleep(0.05)


@pytest.mark.anyio
@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_published_functions_through_the_official_client(http_server, tmp_path, transport):
    """A handshake session: tools/list_changed as the kernel publishes and withdraws, the call as an
    execution of its own, its value, its exception, a bad argument, a refused annotation, a busy kernel."""
    from mcp import Client, MCPError, StdioServerParameters, types

    changes: list = []

    async def handler(message) -> None:
        if isinstance(message, types.ToolListChangedNotification):
            changes.append(message)

    (tmp_path / "ws").mkdir()
    target = (StdioServerParameters(command=sys.executable, args=[str(LOOMMUX)], env=server_env(),
                                    cwd=str(tmp_path / "ws"))
              if transport == "stdio" else http_server.url)
    async with Client(target, mode="legacy", message_handler=handler) as client:
        assert client.server_capabilities.tools.list_changed is True
        published = await client.call_tool("run_cell", {"freeform": PUBLISH_CELL})
        assert published.content[0].text.endswith("Out[1]: ('forecast', 'divide')"), published.content
        await wait_for_changes(changes, 2)
        tools = {tool.name: tool for tool in (await client.list_tools()).tools}
        assert set(tools) == TOOLS | {"forecast", "divide"}
        assert tools["forecast"].description == "The forecast of a city."
        assert tools["divide"].description == "Divide a by b."
        schema = tools["forecast"].input_schema
        assert schema["required"] == ["city"] and schema["properties"]["unit"] == {"enum": ["C", "F"],
                                                                                   "default": "C"}
        result = await client.call_tool("forecast", {"city": "Oslo", "days": 3})
        assert not result.is_error
        assert json.loads(result.content[0].text) == {"city": "Oslo", "highs": [20, 21, 22], "unit": "C"}
        assert result.content[1].text.startswith("[forecast · In [2] · ")
        assert "it printed 1 line: read_output(execution=2)]" in result.content[1].text
        status = (await client.call_tool("execution_status", {"execution": 2})).content[0].text
        assert """loommux.call('forecast', '{"city": "Oslo", "days": 3}')""" in status, status
        failed = await client.call_tool("divide", {"a": 1, "b": 0})
        text = failed.content[0].text
        assert failed.is_error and text.startswith("function_raised: divide raised ZeroDivisionError: "
                                                   "division by zero [divide · In [3] · "), text
        assert "return a / b" in text and "loommux kernel side" not in text
        bad = await client.call_tool("forecast", {"city": 3})
        assert bad.is_error and bad.content[0].text == (
            'invalid_arguments: "city" must fit {"type": "string"}, not 3')
        refused = (await client.call_tool("run_cell", {"freeform": "def f(y: int, x): pass\n"
                                                                   "loommux.publish(f)"})).content[0].text
        assert "PublishError: parameter 'x' of f has no annotation" in refused, refused
        sleeping = await client.call_tool("run_cell", {"freeform": "%%loommux --wait 0.1\nimport time\n"
                                                                   "time.sleep(30)"})
        busy = await client.call_tool("forecast", {"city": "Lima"})
        assert busy.is_error and busy.content[0].text.startswith("busy: execution 5 is still running"), busy
        assert "In [5]" in sleeping.content[0].text
        await client.call_tool("interrupt", {})
        await client.call_tool("wait", {"execution": 5})
        await client.call_tool("run_cell", {"freeform": "loommux.unpublish('divide')"})
        await wait_for_changes(changes, 3)
        assert {tool.name for tool in (await client.list_tools()).tools} == TOOLS | {"forecast"}
        with pytest.raises(MCPError, match="Unknown tool: divide .*published by its kernel: forecast"):
            await client.call_tool("divide", {"a": 1, "b": 2})


@pytest.mark.anyio
@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_published_functions_for_2026_07_28_clients(http_spawn, tmp_path, transport):
    """A 2026-07-28 client hears of the change through its listen stream (toolsListChanged) and sees the
    tools of the kernel its calls use without a kernel argument (over HTTP: the shared kernel "default")."""
    import anyio
    from mcp import Client, MCPError, StdioServerParameters

    (tmp_path / "ws").mkdir()
    target = (StdioServerParameters(command=sys.executable, args=[str(LOOMMUX)], env=server_env(),
                                    cwd=str(tmp_path / "ws"))
              if transport == "stdio" else http_spawn().url)
    async with Client(target) as client:
        assert client.protocol_version == STATELESS
        async with client.listen(tools_list_changed=True) as subscription:
            assert subscription.honored.tools_list_changed
            await client.call_tool("run_cell", {"freeform": PUBLISH_CELL})
            with anyio.fail_after(20):
                async for event in subscription:
                    assert type(event).__name__ == "ToolsListChanged"
                    break
        assert {"forecast", "divide"} <= {tool.name for tool in (await client.list_tools()).tools}
        result = await client.call_tool("forecast", {"city": "Pune", "unit": "F"})
        assert json.loads(result.content[0].text) == {"city": "Pune", "highs": [20, 21], "unit": "F"}
        with pytest.raises(MCPError, match="Unknown tool: forecast .*published by its kernel: none"):
            await client.call_tool("forecast", {"city": "Pune", "kernel": "elsewhere"})  # publishes nothing


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["auto", "legacy"])
@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_a_published_tool_is_listed_at_once_by_the_official_client(http_spawn, tmp_path, transport,
                                                                         mode):
    """The official client's list_tools() in its default caching: a tool published since its last list is
    in the next one (no cache hint on tools/list may hide it), in both eras."""
    from mcp import Client, StdioServerParameters

    (tmp_path / "ws").mkdir()
    target = (StdioServerParameters(command=sys.executable, args=[str(LOOMMUX)], env=server_env(),
                                    cwd=str(tmp_path / "ws"))
              if transport == "stdio" else http_spawn().url)
    async with Client(target, mode=mode) as client:
        assert client.protocol_version == (STATELESS if mode == "auto" else LATEST)
        assert {tool.name for tool in (await client.list_tools()).tools} == TOOLS
        await client.call_tool("run_cell", {"freeform": PUBLISH_CELL})
        assert {tool.name for tool in (await client.list_tools()).tools} == TOOLS | {"forecast", "divide"}


def test_published_tools_in_structured_mode_after_reset_and_restart(spawn, tmp_path):
    """structuredContent carries the value; reset of a function's name and a restart withdraw its tools and
    the next result says so; the notebook shows the call as a cell."""
    path = tmp_path / "calls.ipynb"
    server = spawn(LOOMMUX_RESULT_MODE="structured", LOOMMUX_NOTEBOOK=str(path))
    run(server, PUBLISH_CELL)
    listed = {tool["name"]: tool for tool in server.result("tools/list")["tools"]}
    assert "outputSchema" not in listed["forecast"]
    assert "kernel" in listed["forecast"]["inputSchema"]["properties"]
    result = server.result("tools/call", {"name": "forecast", "arguments": {"city": "Oslo", "days": 1}})
    assert result["structuredContent"] == {"result": {"city": "Oslo", "highs": [20], "unit": "C"}}
    run(server, "def greet(name: str, /) -> str:\n    return f'hello {name}'\n"
                "loommux.publish(greet), loommux.publish(lambda n: list(range(n)), 'count')")
    greeting = server.result("tools/call", {"name": "greet", "arguments": {"name": "Ada"}})
    assert greeting["content"][0]["text"] == "hello Ada"  # a string as it is
    assert greeting["structuredContent"] == {"result": "hello Ada"}
    run(server, "def count(n: int) -> list:\n    return list(range(n))\nloommux.publish(count)")
    long = server.result("tools/call", {"name": "count", "arguments": {"n": 20_000}})
    assert long["content"][0]["text"].startswith(
        '[count returned 128,890 characters · over the 5,000-token limit] read_output(execution=6, '
        'stream="result", line_range="1:40") reads it by line range'), long
    assert long["structuredContent"] == {"execution": 6, "output_omitted_reason": "token_limit"}
    assert read(server, execution=6, stream="result", line_range="1:3")[1] == ["[", " 0,", " 1,"]
    text = server.call("reset", {"names": ["divide"]})[0]
    assert "unpublished (their functions were removed): divide" in text
    names = [tool["name"] for tool in server.result("tools/list")["tools"]]
    assert names[-3:] == ["forecast", "greet", "count"]
    restarted = server.call("restart")[0]
    assert ("Unpublished: forecast, greet, count (the kernel was restarted); loommux.publish them again in "
            "the new kernel." in restarted), restarted
    assert {tool["name"] for tool in server.result("tools/list")["tools"]} == TOOLS
    assert server.wait_for(lambda m: m.get("method") == "notifications/tools/list_changed")
    assert wait_until(lambda: """loommux.call('forecast', '{\\"city\\": \\"Oslo\\", \\"days\\": 1}')""" in
                      path.read_text(), 30)
    cell = next(cell for cell in valid_notebook(path.read_bytes()).cells
                if "".join(cell.source).startswith("loommux.call("))
    assert cell.outputs[-1]["data"]["text/plain"] == '{"city": "Oslo", "highs": [20], "unit": "C"}'


def test_published_calls_take_arguments_as_data_and_publishing_is_bounded(spawn):
    """A call's arguments reach the kernel as JSON (a 300-deep list, -0.0, a lone surrogate); what no JSON can
    say is invalid_arguments; a burst of publish calls is a few notifications, and the caps refuse clearly."""
    server = spawn()
    run(server, "def measure(value: list, raw: dict = {}) -> list:\n"
                "    depth = 0\n    while isinstance(value, list) and value:\n"
                "        value, depth = value[0], depth + 1\n"
                "    return [depth, repr(raw['zero']), len(raw['text'])]\n"
                "def echo(text: str) -> str:\n    return text\n"
                "loommux.publish(measure), loommux.publish(echo)")
    deep = functools.reduce(lambda inner, _: [inner], range(300), [1])
    text, error, _ = server.call("measure", {"value": deep, "raw": {"zero": -0.0, "text": "a\ud800b"}})
    assert not error and text.startswith('[301, "-0.0", 3][measure · In [2] · '), text
    text, error, _ = server.call("echo", {"text": "a\ud800b"})  # a value the Jupyter wire cannot send as is
    assert not error and text.startswith("a\ud800b[echo · In [3] · "), text
    refused, error, _ = server.call("measure", {"value": [], "raw": {"zero": float("nan")}})
    assert error and refused.startswith('invalid_arguments: "raw" holds nan, which is not JSON'), refused
    before = len(server.messages)
    burst = run(server, "for i in range(100):\n"
                        "    loommux.publish(lambda: i, f'tool{i}', 'A tool.')")
    assert "PublishError: this kernel publishes 100 tools, the most a kernel may" in burst.text, burst.text
    assert server.wait_for(lambda m: m.get("method") == "notifications/tools/list_changed")
    time.sleep(loommux.TOOLS_CHANGED_INTERVAL + loommux.ANNOUNCE_INTERVAL)  # a notification due at the end
    changes = [m for m in server.messages[before:] if m.get("method") == "notifications/tools/list_changed"]
    assert 1 <= len(changes) <= 5, len(changes)  # one per publish before (100)
    assert len(server.result("tools/list")["tools"]) == len(TOOLS) + 100
    long = run(server, "loommux.publish(measure, 'measure', 'x' * 2001)")  # a name published: no new tool
    assert ("PublishError: the description of measure is 2,001 characters, over the 2,000 a tool may have"
            in long.text), long.text


# ---------------------------------------------------------------- MCP over stdio


def test_stdout_purity_with_child_processes_and_fd_writes(srv):
    code = ("import os, subprocess\nsubprocess.run(['echo', 'hi-from-child'])\nos.system('echo via-system')\n"
            "os.write(1, b'raw-fd-1\\n')\nos.write(2, b'raw-fd-2\\n')\nprint('after')")
    cell = run(srv, code)
    assert cell.state == "completed" and "after" in cell.text
    assert srv.result("ping") == {}
    srv.assert_pure()
    # the kernel does not even hold our stdout pipe
    pipe = f"pipe:[{os.fstat(srv.proc.stdout.fileno()).st_ino}]"
    fd_dir = Path(f"/proc/{srv.kernel_pid()}/fd")
    if fd_dir.is_dir():
        links = []
        for fd in fd_dir.iterdir():
            try:
                links.append(os.readlink(fd))
            except OSError:
                pass
        assert pipe not in links


@needs_proc
def test_eof_shutdown_leaves_nothing_behind(spawn):
    s = spawn()
    kernel, launcher, below, kernel_dir = kernel_tree(s)
    connection = json.loads((kernel_dir / "kernel.json").read_text())
    assert connection["transport"] == "ipc" and connection["key"]
    assert connection["signature_scheme"] == "hmac-sha256"
    assert s.close(timeout=5) == 0
    assert_nothing_left(kernel, launcher, below, kernel_dir)
    assert (s.workspace / CLEAN_EXIT).exists()  # at EOF the kernel is asked to shut down


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["auto", "legacy"])
async def test_official_sdk_client(tmp_path, mode):
    from mcp import Client, MCPError, StdioServerParameters
    from mcp.client.session import DISCOVER_TIMEOUT_SECONDS

    env = {k: v for k, v in server_env().items() if k == "TIKTOKEN_CACHE_DIR"}
    params = StdioServerParameters(command=sys.executable, args=[str(LOOMMUX)], env=env, cwd=tmp_path)
    started = time.monotonic()
    async with Client(params, mode=mode, read_timeout_seconds=60) as client:
        # an unanswered server/discover probe would cost DISCOVER_TIMEOUT_SECONDS before initialize
        assert time.monotonic() - started < DISCOVER_TIMEOUT_SECONDS
        # auto mode probes server/discover and adopts 2026-07-28; legacy mode initializes
        assert client.protocol_version == ("2026-07-28" if mode == "auto" else LATEST)
        assert client.server_info.name == "loommux"
        assert {t.name for t in (await client.list_tools()).tools} == TOOLS

        result = await client.call_tool("run_cell", {"freeform": "sdk_value = 6 * 7\nsdk_value"})
        assert not result.is_error and Cell.parse(result.content[0].text).body == ["Out[1]: 42"]
        result = await client.call_tool("read_output", {"execution": 1, "stream": "result"})
        assert not result.is_error and lines_of(result.content[0].text) == ["42"]
        result = await client.call_tool("read_output", {"line_range": 5})
        assert result.is_error and result.content[0].text.startswith("invalid_arguments:")
        with pytest.raises(MCPError) as error:
            await client.call_tool("no_such_tool", {})
        assert error.value.code == -32602
        status = (await client.call_tool("status", {})).content[0].text
        kernel = int(re.search(r"kernel: pid (\d+)", status)[1])
    assert gone(kernel, 10)


def sdk_blocks(content) -> list[tuple]:
    """The same for the official client's pydantic content blocks."""
    return [(b.type, b.text if b.type == "text" else b.data, getattr(b, "mime_type", None),
             (getattr(b, "meta", None) or {}).get("detail")) for b in content]


def sdk_env(**extra: str) -> dict[str, str]:
    """The environment the official stdio client adds to its defaults."""
    return {**{k: v for k, v in server_env().items() if k == "TIKTOKEN_CACHE_DIR"}, **extra}


@pytest.mark.anyio
async def test_official_client_structured_images_and_progress_over_stdio(tmp_path):
    from mcp import Client, StdioServerParameters

    params = StdioServerParameters(command=sys.executable, args=[str(LOOMMUX)],
                                   env=sdk_env(LOOMMUX_RESULT_MODE="structured"), cwd=tmp_path)
    async with Client(params, mode="legacy", read_timeout_seconds=120) as client:
        await call_every_tool_structured(client)

        result = await client.call_tool("run_cell", {"freeform": IMAGE_CELL})
        check_image_blocks(sdk_blocks(result.content))
        data = result.structured_content
        assert data["images"] == 8 and data["state"] == "completed" and data["output_total_lines"] == 11
        again = await client.call_tool("wait", {"execution": data["execution"]})
        assert sdk_blocks(again.content) == sdk_blocks(result.content)

        updates = []

        async def on_progress(progress: float, total: float | None, message: str | None) -> None:
            updates.append((progress, message))

        result = await client.call_tool("run_cell", {"freeform": TICKS.replace("--wait 0.1", "--wait 30")},
                                        progress_callback=on_progress)
        assert result.structured_content["state"] == "completed" and len(updates) >= 2, updates
        assert all("so far" in message for _, message in updates)
        running = await client.call_tool("run_cell", {"freeform": TICKS})
        assert running.structured_content["state"] == "running"
        updates.clear()
        result = await client.call_tool("wait", {"execution": running.structured_content["execution"]},
                                        progress_callback=on_progress)
        assert result.structured_content["state"] == "completed" and len(updates) >= 2, updates
        assert all(re.search(r"lines? so far", message) for _, message in updates)


def test_deep_json_on_stdio_is_a_parse_error_and_the_rest_of_the_chunk_is_served(srv):
    since = len(srv.messages)
    srv.send_raw(DEEP + b"\n" + b'{"jsonrpc":"2.0","id":"after-deep","method":"ping"}\n')  # one write
    error = srv.wait_for(lambda m: m.get("id") is None and "error" in m, 30, since)
    assert error["error"]["code"] == -32700 and "nested too deeply" in error["error"]["message"]
    assert srv.response("after-deep", 30)["result"] == {}
    # a deep value that does parse is refused in words; a deep progress token is ignored
    for depth in (500, 900, 960, 990):
        nested = "[" * depth + "]" * depth
        for rid, params in [(f"deep-args-{depth}", f'{{"name":"wait","arguments":{{"execution":{nested}}}}}'),
                            (f"deep-token-{depth}",
                             f'{{"name":"status","_meta":{{"progressToken":{nested}}}}}')]:
            since = len(srv.messages)
            srv.send_raw(f'{{"jsonrpc":"2.0","id":"{rid}","method":"tools/call","params":{params}}}\n')
            answer = srv.wait_for(lambda m, rid=rid: m.get("id") in (rid, None) and "method" not in m, 30,
                                  since)
            if "error" in answer:
                assert answer["error"]["code"] == -32700, answer  # too deep to parse at all
                continue
            text = answer["result"]["content"][0]["text"]
            if rid.startswith("deep-args"):
                assert text == 'invalid_arguments: "execution" must be an integer, not an array', text
            else:
                assert not answer["result"]["isError"] and text.startswith("loommux"), text
    # a number Python will not convert is a parse error in words
    since = len(srv.messages)
    srv.send_raw(b'{"jsonrpc":"2.0","id":"big","method":"ping","params":{"x":' + b"7" * 5000 + b"}}\n")
    error = srv.wait_for(lambda m: m.get("id") is None and "error" in m, 30, since)
    assert error["error"]["message"] == "Parse error: a number in the JSON has too many digits"
    assert "Traceback" not in srv.stderr_tail(100_000)


INITIALIZE_LINE = json.dumps(jsonrpc("initialize", initialize_params("piped"), 1))


def test_stdin_eof_answers_the_requests_in_flight(tmp_path):
    call = jsonrpc("tools/call", tool_params("run_cell", {"freeform": "print('piped')"}), 2)
    done = subprocess.run([sys.executable, str(LOOMMUX)],
                          input=f"{INITIALIZE_LINE}\n{json.dumps(call)}\n".encode(),
                          capture_output=True, cwd=tmp_path, env=server_env(), timeout=60, check=False)
    assert done.returncode == 0, done.stderr.decode()
    responses = {m["id"]: m for m in map(json.loads, done.stdout.decode().splitlines())}
    assert responses[1]["result"]["serverInfo"]["name"] == "loommux"
    assert responses[2]["result"]["content"][0]["text"].endswith("\npiped")


def test_a_terminal_on_stdin_gets_one_hint_line(tmp_path, session_server):
    import pty

    primary, secondary = pty.openpty()
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen([sys.executable, str(LOOMMUX)], stdin=secondary, stdout=subprocess.PIPE,
                                stderr=err, cwd=tmp_path, env=server_env(), start_new_session=True)
    os.close(secondary)
    try:
        assert wait_until(lambda: b"\n" in (tmp_path / "stderr").read_bytes(), 30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        os.close(primary)
        end_server(proc, lambda: proc.wait(10), set())
    (line,) = (tmp_path / "stderr").read_text().splitlines()
    assert ("MCP server speaking JSON-RPC on stdio" in line
            and f"claude mcp add loommux -- {sys.executable} " in line)
    assert "MCP server speaking" not in session_server.stderr_tail(100_000)  # a pipe gets no hint


def test_stdio_serves_both_eras_and_a_probe_starts_no_kernel(spawn):
    probe = spawn(initialize=False)
    answer = probe.request("server/discover", stateless_params(), timeout=60)
    assert answer["result"]["supportedVersions"] == SERVED
    before = time.monotonic()
    probe.proc.stdin.close()
    assert probe.proc.wait(10) == 0 and time.monotonic() - before < 2
    assert not descendants(probe.proc.pid)
    # a modern tools/call first: the process's own kernel; then ping and initialize keep their era
    server = spawn(initialize=False)
    response = server.request("tools/call",
                              stateless_params({"name": "run_cell", "arguments": {"freeform": "print(3)"}}))
    assert (response["result"]["content"][0]["text"].split("\n")[1] == "3"
            and response["result"]["resultType"] == "complete")
    assert server.request("ping", stateless_params())["error"]["code"] == -32601
    assert server.request("tools/list",
                          stateless_params(**{"io.modelcontextprotocol/protocolVersion": "2025-11-25"}))[
        "error"]["code"] == -32022
    assert server.initialize()["protocolVersion"] == LATEST
    text = server.call("run_cell", {"freeform": "print(3 * 3)"})[0]
    assert (text.split("\n")[1] == "9"
            and "resultType" not in server.responses[max(server.responses)]["result"])


# ---------------------------------------------------------------- Plain HTTP/1.1


@pytest.mark.parametrize("raw", [
    b"NOT A VALID REQUEST LINE\r\n\r\n",
    b"GET /mcp\r\n\r\n",
    b"GET /mcp HTTP/2.0\r\nHost: 127.0.0.1\r\n\r\n",
    b"G3T /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    b"GET /api/health HTTP/1.1\r\nHost 127.0.0.1\r\n\r\n",
    b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: ten\r\n\r\n",
    b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: gzip\r\n\r\n",
], ids=clipped())
def test_http_malformed_requests_get_400_and_close(http_server, raw):
    conn = RawHttp(http_server.port)
    conn.send(raw)
    response = conn.read_response()
    assert response.status == 400 and response.headers.get("connection") == "close", response
    assert conn.closed_by_server()
    conn.close()


def test_http_keep_alive_chunked_bodies_and_deleted_sessions(http_server):
    conn = RawHttp(http_server.port)
    body = mcp_message("initialize", INITIALIZE_PARAMS)
    pieces = [body[:10], body[10:50], body[50:]]
    chunked = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\nX-Trailer: 1\r\n\r\n"
    conn.send(conn.head("POST", "/mcp", {**MCP_HEADERS, "Transfer-Encoding": "chunked"}) + chunked)
    responses = [conn.read_response()]
    assert responses[0].status == 200 and responses[0].json()["result"]["protocolVersion"] == LATEST
    session = {**MCP_HEADERS, "Mcp-Session-Id": responses[0].headers["mcp-session-id"],
               "MCP-Protocol-Version": LATEST}
    notified = conn.request("POST", "/mcp", session, mcp_message("notifications/initialized", id=None))
    assert notified.status == 202 and notified.body == b""
    listed = conn.request("POST", "/mcp", session, mcp_message("tools/list", id=2))
    assert {tool["name"] for tool in listed.json()["result"]["tools"]} == TOOLS
    called = conn.request("POST", "/mcp", session, mcp_message("tools/call", {"name": "status"}, id=3))
    assert "resource: private · 1 session" in called.json()["result"]["content"][0]["text"]
    assert conn.request("POST", "/mcp", session, mcp_message("ping", id=4)).json()["result"] == {}
    responses += [notified, listed, called]
    assert conn.request("DELETE", "/mcp", session).status == 204
    gone_session = conn.request("POST", "/mcp", session, mcp_message("tools/list", id=5))
    assert gone_session.status == 404  # the client must re-initialize
    assert conn.request("DELETE", "/mcp", session).status == 404
    # all of that on one socket, never told to close
    assert all("connection" not in response.headers for response in responses)
    # an HTTP/1.0 request without keep-alive, and Connection: close, end the connection
    for version, headers in [("HTTP/1.1", {"Connection": "close"}), ("HTTP/1.0", {})]:
        closing = conn.request("GET", "/api/health", headers, version=version)
        assert closing.status == 200 and closing.headers["connection"] == "close" and conn.closed_by_server()
        conn.close()
        conn = RawHttp(http_server.port)
    conn.close()


def test_http_client_disconnecting_mid_request_loses_only_its_response(http_server):
    with HttpMcp(http_server, resource="drop-room") as a, HttpMcp(http_server, resource="drop-room") as b:
        cell = run_cell(a, "%%loommux --wait 0.1\nimport time\nprint('start', flush=True)\ntime.sleep(2)\n"
                           "print('finished')")
        assert cell.state == "running"
        # a's wait goes out on its own connection, which drops before the cell ends
        conn = RawHttp(http_server.port)
        a.post_on(conn, a.message("tools/call",
                                  tool_params("wait", {"execution": cell.n, "timeout_seconds": 30})))
        time.sleep(0.5)
        # reset
        conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.close()
        # the cell still finishes, seen by another session of the resource and by a itself
        assert finish(b, Cell(cell.n, "running", "")).body == ["start", "finished"]
        assert finish(a, Cell(cell.n, "running", "")).body == ["start", "finished"]
        # the same for a run_cell whose client disconnects while it waits
        conn = RawHttp(http_server.port)
        a.post_on(conn, a.message("tools/call", tool_params("run_cell", {
            "freeform": "import time\ntime.sleep(1.5)\nprint('ran to the end')"})))
        time.sleep(0.5)
        conn.close()
        assert finish(b, Cell(cell.n + 1, "running", "")).body == ["ran to the end"]
        assert run(a, "1 + 1").body == [f"Out[{cell.n + 2}]: 2"]


def test_stalled_request_head_gets_408_and_close(http_server):
    conn = RawHttp(http_server.port, timeout=30)
    try:
        conn.send(b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and then nothing
        started = time.monotonic()
        response = conn.read_response()
        assert response.status == 408
        assert time.monotonic() - started < 25
        with pytest.raises((ConnectionError, OSError)):
            conn.request("GET", "/api/health")
    finally:
        conn.close()


def http_status(port: int) -> int:
    """The status of a GET /api/health on a fresh connection, 0 when the connection is dropped unanswered."""
    conn = RawHttp(port)
    try:
        return conn.request("GET", "/api/health").status
    except OSError:
        return 0
    finally:
        conn.close()


def test_at_the_connection_cap_the_idlest_goes_and_busy_ones_get_503(http_spawn):
    server = http_spawn(LOOMMUX_MAX_CONNECTIONS="2", LOOMMUX_SPARE_KERNELS="0")
    held = [RawHttp(server.port) for _ in range(2)]
    try:
        for conn in held:  # both are served, and stay open (keep-alive)
            assert conn.request("GET", "/api/health").status == 200
        extra = RawHttp(server.port)  # at the cap: the connection idle the longest makes room
        assert extra.request("GET", "/api/health").status == 200
        assert held[0].closed_by_server()
        assert held[1].request("GET", "/api/health").status == 200  # the other one was kept
        extra.close()
        # connections busy with a request are never closed to make room: then 503
        for conn in held:
            conn.close()
        held = [RawHttp(server.port) for _ in range(2)]
        for conn in held:  # a body announced and never sent keeps each one busy (for up to 30 s)
            conn.send(conn.head("POST", "/api/lease-policy", {"Content-Type": "application/json",
                                                              "Expect": "100-continue"}, length=100))
            assert conn.read_head()[0] == 100  # now reading the body
        assert http_status(server.port) == 503
    finally:
        for conn in held:
            conn.close()


@pytest.mark.parametrize("head", [
    "Content-Length: \u00b2",
    "Transfer-Encoding: chunked",
])
def test_malformed_bodies_get_400(http_server, head):
    conn = RawHttp(http_server.port)
    try:
        body = b"-5\r\nxxxxx\r\n0\r\n\r\n" if "chunked" in head else b""
        request = (f"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept: application/json, text/event-stream\r\n"
                   f"Content-Type: application/json\r\n{head}\r\n\r\n").encode("latin-1") + body
        conn.send(request)
        assert conn.read_response().status == 400
    finally:
        conn.close()


def test_silent_connections_at_the_cap_lock_nobody_out(http_spawn):
    server = http_spawn(LOOMMUX_MAX_CONNECTIONS="8", LOOMMUX_SPARE_KERNELS="0")
    silent = [RawHttp(server.port, timeout=40) for _ in range(8)]  # the cap's worth, sending nothing
    try:
        silent[-1].send(b"G")  # one byte of a head, then nothing
        with HttpMcp(server) as session:  # initialize is answered (asserted inside)
            assert session.result("ping") == {}
            assert server.api("GET", "/api/health").json()["status"] == "ok"
        # the oldest silent ones made room; the others are closed once their 10 s for a head are over,
        # whether they sent one byte or none
        assert silent[-1].read_response().status == 408 and silent[-1].closed_by_server(30)
        assert all(conn.closed_by_server(30) for conn in silent[:-1])
    finally:
        for conn in silent:
            conn.close()


def test_unauthenticated_bodies_are_never_read(http_spawn):
    token = "hardening-token"
    server = http_spawn("--token", token, LOOMMUX_SPARE_KERNELS="0")
    huge = 32 << 20  # the default body limit: declared, never sent
    for headers, status in [({}, 401), ({"Authorization": "Bearer wrong"}, 401),
                            ({"Authorization": f"Bearer {token}", "Origin": "http://evil.example"}, 403),
                            ({"Expect": "100-continue"}, 401)]:  # refused at once, no 100 Continue first
        for _ in range(4):
            conn = RawHttp(server.port)
            try:
                conn.send(conn.head("POST", "/mcp", {**MCP_HEADERS, **headers}, length=huge))
                response = conn.read_response()
                assert response.status == status and response.headers["connection"] == "close", response
                assert conn.closed_by_server()
            finally:
                conn.close()
    # a refused request whose small body was sent along still gets its answer
    refused = HttpMcp(server, initialize=False)
    assert refused.initialize().status == 401
    refused.drop()
    with HttpMcp(server, headers={"Authorization": f"Bearer {token}"}) as session:
        assert session.result("ping") == {}


def first_status(conn: RawHttp) -> int:
    return conn.read_head()[0]


def test_bodies_being_received_share_a_budget_of_four_limits(http_spawn):
    server = http_spawn(LOOMMUX_SPARE_KERNELS="0", LOOMMUX_MAX_BODY_BYTES="1024")
    body = b'{"mode": "ping"}'.ljust(1024)

    def start_body() -> RawHttp:
        conn = RawHttp(server.port)
        conn.send(conn.head("POST", "/api/lease-policy", {"Content-Type": "application/json",
                                                          "Expect": "100-continue"}, length=len(body)))
        return conn

    held = [start_body() for _ in range(4)]
    try:
        assert [first_status(conn) for conn in held] == [100] * 4  # each is now receiving its body
        over = start_body()
        refused = over.read_response()
        assert refused.status == 503 and refused.json()["error_code"] == "service_unavailable", refused
        assert over.closed_by_server()
        over.close()
        held[0].send(body)  # one finishes: its share is free again
        assert held[0].read_response().json()["mode"] == "ping"
        again = start_body()
        assert first_status(again) == 100
        again.send(body)
        assert again.read_response().status == 200
        again.close()
    finally:
        for conn in held:
            conn.close()


def test_duplicate_host_headers_get_400_and_close(http_server):
    conn = RawHttp(http_server.port)
    try:
        conn.send(b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: evil.example\r\n\r\n")
        response = conn.read_response()
        assert response.status == 400 and "Host" in response.json()["error"]["message"]
        assert conn.closed_by_server()
    finally:
        conn.close()


def test_expect_100_continue(http_server):
    conn = RawHttp(http_server.port)
    try:
        body = mcp_message("initialize", INITIALIZE_PARAMS)
        conn.send(conn.head("POST", "/mcp", {**MCP_HEADERS, "Expect": "100-continue"}, length=len(body)))
        assert conn.read_head() == (100, {})  # the head passed: send the body
        conn.send(body)
        response = conn.read_response()
        assert response.status == 200, response
        conn.request("DELETE", "/mcp", {"Mcp-Session-Id": response.headers["mcp-session-id"]})
        conn.send(conn.head("POST", "/mcp", {**MCP_HEADERS, "Expect": "something-else"}, length=len(body)))
        assert conn.read_response().status == 417 and conn.closed_by_server()
    finally:
        conn.close()


def test_a_content_length_too_long_to_convert_gets_413(http_server):
    conn = RawHttp(http_server.port)
    try:
        conn.send(conn.head("POST", "/mcp", {**MCP_HEADERS, "Content-Length": "9" * 5000}))
        assert conn.read_response().status == 413 and conn.closed_by_server()
    finally:
        conn.close()


@pytest.mark.fast
def test_sse_answers_that_wait_send_comment_pings(monkeypatch):
    import asyncio

    import loommux

    monkeypatch.setattr(loommux, "SSE_PING_INTERVAL", 0.01)
    pinged = asyncio.Event()
    written: list[bytes] = []

    class Writer:
        def write(self, data: bytes) -> None:
            written.append(data)
            if sum(b": ping" in piece for piece in written) >= 3:
                pinged.set()

        def is_closing(self) -> bool:
            return False

        async def drain(self) -> None:
            pass

    async def handle(message, notify):
        await pinged.wait()  # answers only once pings went out while it waited
        return {"jsonrpc": "2.0", "id": 1, "result": {"waited": True}}

    async def answer() -> bool:
        stream = loommux.MessageStream(Writer())
        stream.begin()
        work = asyncio.ensure_future(handle({}, stream.send_message))
        finished = await asyncio.wait_for(stream.ping_until(work), 30)
        await stream.finish(work.result())
        return finished

    assert asyncio.run(answer()) is True
    body = b"".join(written)
    assert body.count(b": ping") >= 3
    assert sse_messages(body.split(b"\r\n\r\n", 1)[1])[-1]["result"] == {"waited": True}


# ---------------------------------------------------------------- Console & control API


def test_api_resource_details_actions_and_forced_recycle(http_server):
    api = http_server.api
    health = api("GET", "/api/health").json()
    assert health["status"] == "ok" and health["version"] and health["uptime_seconds"] > 0
    with HttpMcp(http_server, operator="api-target") as a:
        run(a, "before_recycle = 1")
        run(a, "print('two')\nprint('lines')")
        rid = http_server.resource_of("api-target")["id"]
        detail = api("GET", f"/api/resources/{rid}").json()
        kernel = detail["kernel_pid"]
        assert detail["kind"] == "private" and detail["executions"] == 2 and detail["kernel_rss_bytes"] > 0
        assert [(e["execution"], e["state"], e["output_lines"], e["first_line"])
                for e in detail["recent_executions"]] \
            == [(2, "completed", 2, "print('two')"), (1, "completed", 0, "before_recycle = 1")]
        (lease,) = detail["leases"]
        assert (lease["operator"] == "api-target" and lease["mode"] == "activity"
                and lease["standing"] == "live")
        # interrupt and restart through the API
        cell = run_cell(a, SLEEP_LONG)
        listed = http_server.resource(rid)
        assert listed["running_execution"] == cell.n and listed["running_elapsed_seconds"] >= 0
        interrupted = api("POST", f"/api/resources/{rid}/interrupt")
        assert interrupted.status == 200 and interrupted.json() == {"interrupt_sent": True,
                                                                    "execution": cell.n}
        assert finish(a, cell).state == "interrupted"
        restarted = api("POST", f"/api/resources/{rid}/restart").json()
        assert restarted["previous_kernel_pid"] == kernel and restarted["killed_execution"] is None
        assert gone(kernel) and status_kernel(a) == restarted["kernel_pid"]
        kernel = restarted["kernel_pid"]
        # recycling a busy resource needs force=true
        cell = run_cell(a, SLEEP_LONG)
        busy = api("POST", f"/api/resources/{rid}/recycle")
        assert (busy.status == 409 and busy.json()["error_code"] == "busy"
                and "force=true" in busy.json()["message"])
        assert api("POST", f"/api/resources/{rid}/recycle", {"force": False}).status == 409
        assert http_server.resource(rid)["running_execution"] == cell.n and pid_alive(kernel)
        forced = api("POST", f"/api/resources/{rid}/recycle?force=true")
        assert forced.status == 200 and forced.json() == {"recycled": rid}
        assert http_server.resource(rid) is None and gone(kernel)
        again = run(a, "before_recycle")
        assert (again.n, again.state) == (1, "error")
        (line,) = retired_lines(again.text)
        assert f"({rid})" in line and "recycled by an operator" in line
    # errors are JSON with a code
    for method, path, status, code in [
        ("GET", "/api/resources/p-nope", 404, "resource_not_found"),
        ("POST", "/api/resources/p-nope/interrupt", 404, "resource_not_found"),
        ("GET", "/api/nothing-here", 404, "not_found"),
        ("POST", "/api/health", 405, "method_not_allowed"),
    ]:
        response = api(method, path)
        assert response.status == status and response.json()["error_code"] == code, (path, response)
        assert response.headers["content-type"] == "application/json"


ALERT_RED = "rgb(217, 48, 44)"  # the console's .signal.alert background


def test_console_in_headless_chromium(http_spawn):
    expect, sync_playwright = playwright_or_skip()

    server = http_spawn(LOOMMUX_SPARE_KERNELS="1", LOOMMUX_LEASE_MODE="connection")
    with HttpMcp(server, operator="console-worker") as worker, \
            HttpMcp(server, resource="shared-room", operator="alice") as alice, \
            HttpMcp(server, resource="shared-room", operator="bob") as bob:
        streams = [alice.open_stream(), bob.open_stream()]  # two live leases
        run(alice, "import math\nshared = math.pi")
        cell = run_cell(worker, "%%loommux --wait 0.5\nimport time\nfor i in range(1200):\n"
                                "    print('working', i, flush=True)\n    time.sleep(0.1)")
        assert cell.state == "running" and "Lease alert:" in cell.text  # worker never opened its stream
        rid = server.resource_of("console-worker")["id"]
        ARTIFACTS.mkdir(exist_ok=True)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 480})
                page.goto(f"http://127.0.0.1:{server.port}/")
                expect(page.locator("#meta")).to_contain_text("lease policy connection", timeout=15_000)
                row = page.locator(f'tr[data-resource="{rid}"]')
                expect(row).to_contain_text(f"execution {cell.n}", timeout=15_000)  # the running cell
                expect(row.locator(".running")).to_have_count(1)
                expect(row).to_contain_text("console-worker")
                badge = row.locator(".signal.alert")
                expect(badge).to_have_count(1)
                assert badge.evaluate("e => getComputedStyle(e).backgroundColor") == ALERT_RED
                live = page.locator('tr[data-resource="shared-room"] .signal.live')
                expect(live).to_have_count(2)
                assert live.first.evaluate("e => getComputedStyle(e).backgroundColor") != ALERT_RED
                page.screenshot(path=str(ARTIFACTS / "console.png"), full_page=True)
                dialogs = []

                def accept(dialog) -> None:
                    dialogs.append(dialog.message)
                    dialog.accept()

                page.on("dialog", accept)
                row.locator('button[data-action="interrupt"]').click()
                assert finish(worker, cell).state == "interrupted"
                assert dialogs == [f"interrupt resource {rid}?"]
                expect(row.locator(".running")).to_have_count(0, timeout=10_000)
                assert page.locator("#error").text_content() == ""
            finally:
                browser.close()
        for stream in streams:
            stream.close()


@pytest.mark.parametrize("body, words", [
    (b"[]", "the body must be a JSON object of lease settings"),
    (b'{"no_such_window": 3}', '"no_such_window" is not a lease setting'),
    (b'{"orphan_grace_seconds": ' + b"9" * 400 + b"}", "orphan_grace_seconds: "),
    (b'{"orphan_grace_seconds": ' + b"9" * 5000 + b"}", "a number in the JSON has too many digits"),
    (b'{"mode": [[[]]]}', "mode: must be a string, not an array"),
    (b'{"ping_interval_seconds": {"a": 1}}',
     "ping_interval_seconds: must be a number of seconds, not an object"),
    (b"\xff\xfe{", "not JSON"),
], ids=clipped(16))
def test_api_errors_name_the_problem_in_words(http_server, body, words):
    before = http_server.api("GET", "/api/lease-policy").json()
    response = http_server.api("POST", "/api/lease-policy", body)
    assert response.status == 400, response
    message = response.json()["message"]
    assert words in message, message
    for internal in ("object has no attribute", "__init__", "set_int_max_str_digits", "Traceback", "codec"):
        assert internal not in message, message
    assert http_server.api("GET", "/api/lease-policy").json() == before


def test_console_token_on_a_server_without_one_sets_no_cookie(http_server):
    for path in ["/?token=anything", "/?token", "/?token=%ZZ"]:
        response = http_server.api("GET", path)
        assert response.status == 303 and "set-cookie" not in response.headers, (path, response)


def test_api_shows_client_names_running_cells_and_how_to_connect(http_server):
    assert f"· console http://127.0.0.1:{http_server.port}/" in http_server.log()
    health = http_server.api("GET", "/api/health").json()
    assert health["mcp_path"] == "/mcp" and health["token_required"] is False
    with HttpMcp(http_server) as anonymous:
        cell = run_cell(anonymous, "%%loommux --wait 0.1\nimport time\nprint('first tick', flush=True)\n"
                                   "print('second tick', flush=True)\ntime.sleep(60)")
        assert cell.state == "running"
        kernel = status_kernel(anonymous)
        rid = next(r["id"] for r in http_server.resources() if r["kernel_pid"] == kernel)

        def shows_the_last_line() -> bool:
            return http_server.resource(rid)["running_last_output"] == "second tick"

        assert wait_until(shows_the_last_line, 30)
        resource = http_server.resource(rid)
        assert resource["running_first_line"] == "%%loommux --wait 0.1"
        (lease,) = resource["leases"]
        assert lease["operator"] is None and lease["client"] == INITIALIZE_PARAMS["clientInfo"]["name"]
        anonymous.call("interrupt")
        assert finish(anonymous, cell).state == "interrupted"
        resource = http_server.resource(rid)
        assert resource["running_first_line"] is None and resource["running_last_output"] is None


def test_console_names_clients_shows_running_cells_and_says_how_to_connect(http_spawn):
    server = http_spawn(LOOMMUX_SPARE_KERNELS="0")
    with console_page(server) as (expect, page):
        empty = page.locator("#empty")
        expect(empty).to_contain_text("No sessions yet", timeout=15_000)
        expect(empty).to_contain_text(f"claude mcp add --transport http loommux {server.url}")
        with HttpMcp(server) as anonymous:
            cell = run_cell(anonymous, "%%loommux --wait 0.1\nimport time\nprint('tick', flush=True)\n"
                                       "time.sleep(60)")
            row = page.locator("tr[data-resource]")
            expect(row.locator(".lease")).to_contain_text(INITIALIZE_PARAMS["clientInfo"]["name"],
                                                          timeout=15_000)
            expect(row.locator(".first-line")).to_have_text("%%loommux --wait 0.1")
            expect(row.locator(".last-output")).to_have_text("tick")
            expect(empty).to_be_hidden()
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "console-client-names.png"), full_page=True)
            anonymous.call("interrupt")
            assert finish(anonymous, cell).state == "interrupted"


def test_api_and_console_show_a_cell_waiting_for_input(http_server):
    stateless = StatelessHttp(http_server)
    created = stateless.send("tools/call",
                          tasked(run_params("input('console? ')", kernel="asks"))).json()["result"]
    assert created["resultType"] == "task" and created["status"] == "input_required", created
    row = http_server.resource("asks")
    assert row["input_prompt"] == "console? " and row["running_execution"] is not None
    assert "input_prompt" in http_server.api("GET", "/").body.decode()
    assert stateless.send("tasks/cancel", tasked({"taskId": created["taskId"]}),
                       {"Mcp-Name": created["taskId"]}).status == 200
    assert wait_until(lambda: http_server.resource("asks")["input_prompt"] is None, 30)


@needs_gateway
def test_console_shows_where_a_gateway_kernel_runs(http_spawn, gateway):
    server = http_spawn("--gateway", gateway.url, "--gateway-token", GATEWAY_TOKEN, LOOMMUX_SPARE_KERNELS="0")
    with HttpMcp(server, resource="remote-room") as session:
        assert out(session, "print(1)") == ["1"]
        _, kernel_id, _ = gateway_kernel(session)
        with console_page(server) as (expect, page):
            row = page.locator('tr[data-resource="remote-room"]')
            expect(row).to_contain_text(f"gateway {gateway.host} · id {kernel_id} · idle", timeout=15_000)
            expect(row).not_to_contain_text("pid ")
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    assert gateway.none_left(), gateway.kernels()


# ---------------------------------------------------------------- Streamable HTTP


@pytest.mark.fast
def test_each_http_surface_has_one_error_shape():
    """/api and the console answer {error_code, message}; the MCP endpoint a JSON-RPC error, with the id of
    the request it refuses once that is known, and a named refusal's data and message also at the top
    level."""
    plain = loommux.HttpError(404, "Not Found: no such session")
    assert loommux.encode_api_error(plain) == {"error_code": "not_found",
                                             "message": "Not Found: no such session"}
    assert loommux.encode_api_error(loommux.ApiError(409, "busy", "execution 2 is running")) == {
        "error_code": "busy", "message": "execution 2 is running"}
    assert loommux.encode_mcp_error(plain) == {"jsonrpc": "2.0", "id": None, "error": {
        "code": -32600, "message": "Not Found: no such session"}}
    refused = loommux.with_request_id(plain, {"jsonrpc": "2.0", "id": 7, "method": "tools/list"})
    assert loommux.encode_mcp_error(refused)["id"] == 7 and refused.status == 404
    data = {"error_code": "stale_lease_policy", "policy": {"generation": 2}}
    initialize = {"jsonrpc": "2.0", "id": "i", "method": "initialize"}
    stale = loommux.encode_mcp_error(loommux.with_request_id(loommux.McpRefusal(409, "stale", data=data),
                                                           initialize))
    assert stale == {**data, "message": "stale", "jsonrpc": "2.0", "id": "i",
                     "error": {"code": -32600, "message": "stale", "data": data}}


@pytest.mark.anyio
@pytest.mark.parametrize("mode", ["legacy"])  # auto mode (2026-07-28) has its own test
async def test_http_official_client_every_tool(http_server, mode):
    from mcp import Client
    from mcp.client.session import DISCOVER_TIMEOUT_SECONDS

    updates = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        updates.append(message)

    started = time.monotonic()
    async with Client(http_server.url, mode=mode, read_timeout_seconds=120) as client:
        # the server/discover probe gets its 400 at once: no DISCOVER_TIMEOUT_SECONDS wait before initialize
        assert time.monotonic() - started < DISCOVER_TIMEOUT_SECONDS
        assert client.protocol_version == LATEST and client.server_info.name == "loommux"
        tools = (await client.list_tools()).tools
        assert {tool.name for tool in tools} == TOOLS and all(tool.output_schema is None for tool in tools)

        async def text_of(tool: str, args: dict | None = None, **options) -> str:
            result = await client.call_tool(tool, args or {}, **options)
            assert not result.is_error and result.structured_content is None, result
            return "".join(block.text for block in result.content if block.type == "text")

        first = Cell.parse(await text_of("run_cell", {"freeform": "x = 6 * 7\nx"}))
        assert (first.n, first.body) == (1, ["Out[1]: 42"])
        assert Cell.parse(await text_of("run_cell", {"freeform": TICKS})).state == "running"
        # a progress token: the response comes as SSE, progress notifications first
        done = Cell.parse(await text_of("wait", {"execution": 2, "timeout_seconds": 60},
                                        progress_callback=on_progress))
        assert (done.n, done.state, done.body) == (2, "completed", ["tick 0", "tick 1", "tick 2"])
        assert len(updates) >= 2 and all("so far" in message for message in updates), updates
        status = await text_of("status")
        assert "resource: private · 1 session" in status.split("\n")
        kernel = int(re.search(r"kernel: pid (\d+)", status)[1])
        assert (await text_of("execution_status", {"execution": 2})).startswith("[execution 2 · completed]")
        assert lines_of(await text_of("read_output", {"execution": 2, "line_range": "2:3"})) == [
            "tick 1", "tick 2"]
        found = await text_of("search_output", {"query": r"tick \d", "execution": 2})
        assert " · 3 matching lines · 3 matches]" in found.split("\n")[0]
        assert (await text_of("interrupt")).startswith("idle: no cell is running")
        # a result over the client's 1 MiB SSE event limit comes as plain JSON
        big = Cell.parse(await text_of("run_cell", {"freeform": "for i in range(12_000):\n"
                                                                "    print(f'{i:06d} ' + 'y' * 120)"}))
        assert (big.state == "completed"
                and big.text.split("\n")[1].startswith("[output omitted: 12,000 lines"))
        whole = await text_of("read_output", {"execution": big.n})
        assert len(whole) > 1_500_000 and whole.endswith("011999 " + "y" * 120)
        restarted = await text_of("restart")
        assert restarted.startswith("restarted: new kernel pid") and f"(was {kernel})" in restarted
        new_kernel = int(re.search(r"new kernel pid (\d+)", restarted)[1])
    assert gone(kernel) and gone(new_kernel)  # the client's DELETE retired its private resource


@pytest.mark.anyio
async def test_http_structured_mode_with_the_official_client(http_spawn):
    from mcp import Client

    server = http_spawn("--result-mode", "structured", LOOMMUX_SPARE_KERNELS="0")
    async with Client(server.url, mode="legacy", read_timeout_seconds=120) as client:
        results = await call_every_tool_structured(client)
        status = dict(results)["status"].structured_content
        assert status["resource"] == "private" and status["resource_sessions"] == 1


@pytest.mark.anyio
async def test_http_official_client_on_a_named_resource_with_a_token(http_spawn):
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    token = "tok-" + "x" * 20
    server = http_spawn("--token", token, LOOMMUX_SPARE_KERNELS="0")

    def transport(operator: str):
        headers = {"Authorization": f"Bearer {token}", "X-Loommux-Resource": "sdk-room",
                   "X-Loommux-Operator": operator}
        client = httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=300))
        return streamable_http_client(server.url, http_client=client)

    async with Client(transport("sdk-a"), mode="legacy", read_timeout_seconds=120) as a, \
            Client(transport("sdk-b"), mode="legacy", read_timeout_seconds=120) as b:
        first = await a.call_tool("run_cell", {"freeform": "together = 'yes'"})
        assert Cell.parse(first.content[0].text).n == 1
        second = await b.call_tool("run_cell", {"freeform": "together"})
        assert Cell.parse(second.content[0].text).body == ["Out[2]: 'yes'"]
        status = (await b.call_tool("status", {})).content[0].text
        assert "resource: sdk-room · 2 sessions" in status.split("\n")
        server.api_headers = {"Authorization": f"Bearer {token}"}
        resource = server.resource("sdk-room")
        assert sorted(lease["operator"] for lease in resource["leases"]) == ["sdk-a", "sdk-b"]
        assert all(lease["stream_open"] for lease in resource["leases"])  # the client opened its GET streams


def test_http_status_codes(http_server):
    port = http_server.port
    post = HttpClient(http_server, keep_alive=False).post  # outside any session
    initialize = jsonrpc("initialize", INITIALIZE_PARAMS, 1)
    # 400: a request without a session id; the JSON-RPC error body says why
    missing = post(jsonrpc("tools/list", id=41))
    assert missing.status == 400 and "Mcp-Session-Id" in missing.json()["error"]["message"]
    assert missing.json()["id"] == 41  # a parseable request's refusal carries its id
    # 404: an unknown session (the client then re-initializes)
    unknown = post(jsonrpc("tools/list", id="req-42"), {"Mcp-Session-Id": "no-such-session"})
    assert unknown.status == 404 and unknown.json()["id"] == "req-42"
    # 400: malformed JSON (-32700) and an unsupported MCP-Protocol-Version
    parse_error = post(b'{"jsonrpc": "2.0", "id": 1, "method"')
    assert parse_error.status == 400 and parse_error.json()["error"]["code"] == -32700
    unsupported = post(jsonrpc("tools/list", id=43), {"MCP-Protocol-Version": "1999-01-01"})
    assert unsupported.status == 400 and unsupported.json()["id"] == 43
    # the official client's server/discover probe is refused at once (no session, unknown version)
    discover = post(jsonrpc("server/discover", id=1), {"MCP-Protocol-Version": "2026-07-28"})
    assert discover.status == 400 and discover.json()["id"] == 1
    # 400: a resource name outside the rule, named in the message; nothing is created
    before = {r["id"] for r in http_server.resources()}
    for name in ["bad/name", "x" * 65, "spaced name", ""]:
        refused = post(initialize, {"X-Loommux-Resource": name})
        assert refused.status == 400 and "1-64 characters" in refused.json()["error"]["message"], name
        assert refused.json()["id"] == 1, name
        assert "mcp-session-id" not in refused.headers
    assert {r["id"] for r in http_server.resources()} == before
    # 406: Accept must list both types; 415: Content-Type must be JSON
    assert post(initialize, {"Accept": "application/json"}).status == 406
    assert post(initialize, {"Accept": "text/event-stream"}).status == 406
    assert post(initialize, {"Content-Type": "text/plain"}).status == 415
    conn = RawHttp(port)
    assert conn.request("GET", "/mcp", {"Accept": "application/json"}).status == 406
    # 405 with Allow, for the MCP endpoint and (as JSON) for the API
    for method in ("PUT", "PATCH"):
        refused = conn.request(method, "/mcp", {"Content-Type": "application/json"}, b"{}")
        assert refused.status == 405 and refused.headers["allow"] == "GET, POST, DELETE"
    refused = conn.request("DELETE", "/api/resources")
    assert refused.status == 405 and refused.json()["error_code"] == "method_not_allowed"
    # 404 for other paths; 405 (Allow: POST) for a GET stream without a session
    assert conn.request("GET", "/elsewhere").status == 404
    assert conn.request("GET", "/mcp", {"Accept": "text/event-stream"}).status == 405  # no session: POST only
    conn.close()


@pytest.mark.parametrize("headers, status", [
    ({"Origin": "http://evil.example"}, 403),
    ({"Origin": "https://127.0.0.1.evil.example"}, 403),
    ({"Origin": "null"}, 403),
    ({"Host": "evil.example:{port}"}, 403),
    ({"Host": "evil.example"}, 403),
    ({"Host": None}, 403),
    ({"Origin": "http://127.0.0.1:{port}"}, 200),
    ({"Origin": "http://localhost:{port}", "Host": "localhost:{port}"}, 200),
    ({"Host": "[::1]:{port}"}, 200),
    # parsed strictly: exactly scheme://host[:port] and host[:port]
    ({"Origin": "http://evil.com\\@127.0.0.1"}, 403),
    ({"Origin": "http://127.0.0.1@evil.example"}, 403),
    ({"Origin": "http://evil.example#@127.0.0.1"}, 403),
    ({"Origin": "http://127.0.0.1/path"}, 403),
    ({"Origin": "ftp://127.0.0.1"}, 403),
    ({"Origin": "http://127.0.0.1:port"}, 403),
    ({"Origin": "http://127.0.0.1 "}, 200),  # header values are trimmed
    ({"Origin": "HTTPS://LOCALHOST:4321"}, 200),
    ({"Origin": "http://[::1]:4321"}, 200),
    ({"Host": "evil.com\\@127.0.0.1"}, 403),
    ({"Host": "127.0.0.1@evil.example"}, 403),
    ({"Host": "127.0.0.1:{port}/x"}, 403),
])
def test_http_origin_and_host_checks(http_server, headers, status):
    headers = {k: v.format(port=http_server.port) if v else v for k, v in headers.items()}
    sessions = http_server.api("GET", "/api/health").json()["sessions"]
    conn = RawHttp(http_server.port)
    response = conn.request("POST", "/mcp", {**MCP_HEADERS, **headers},
                            mcp_message("initialize", INITIALIZE_PARAMS))
    assert response.status == status, response
    if status == 200:
        conn.request("DELETE", "/mcp", {"Mcp-Session-Id": response.headers["mcp-session-id"], **headers})
    else:
        assert "mcp-session-id" not in response.headers and conn.closed_by_server()  # refused on the head
        assert http_server.api("GET", "/api/health").json()["sessions"] == sessions
        # the API and console alike
        assert http_server.api("GET", "/api/health", headers=headers).status == 403
    conn.close()


def test_http_sse_response_with_progress(http_server):
    with HttpMcp(http_server) as session:
        assert run_cell(session, TICKS).state == "running"
        message = session.request("tools/call", {"name": "wait", "arguments": {"execution": 1}},
                                  progress_token="sse-1")
        response = session.last
        assert response.headers["content-type"] == "text/event-stream"
        assert response.headers["transfer-encoding"] == "chunked"
        *notifications, last = response.messages
        assert last == message and Cell.parse(message["result"]["content"][0]["text"]).state == "completed"
        assert len(notifications) >= 2
        assert all(n["method"] == "notifications/progress" and n["params"]["progressToken"] == "sse-1"
                   for n in notifications)
        # without a token the same request is answered as plain JSON
        session.request("tools/call", {"name": "wait", "arguments": {"execution": 1}})
        assert session.last.headers["content-type"] == "application/json"
        # a second GET stream of one session is refused
        stream = session.open_stream()
        conn = RawHttp(http_server.port)
        assert conn.request("GET", "/mcp",
                            {"Accept": "text/event-stream", **session.session_headers()}).status == 409
        conn.close()
        stream.close()


def test_http_sessions_have_private_namespaces_and_numbering(http_server):
    with HttpMcp(http_server) as a, HttpMcp(http_server) as b:
        assert run(a, "who = 'a'\nwho").body == ["Out[1]: 'a'"]
        assert run(b, "who = 'b'\nwho").body == ["Out[1]: 'b'"]
        assert run(a, "who").body == ["Out[2]: 'a'"]
        assert run(b, "print(who)").body == ["b"]
        texts = [a.call("status")[0], b.call("status")[0]]
        assert all("resource: private · 1 session" in text.split("\n") for text in texts)
        assert status_kernel(a) != status_kernel(b)


def test_token_rules_for_mcp_api_and_console(http_spawn):
    token = "s3cret-T0ken"
    server = http_spawn("--token", token, LOOMMUX_SPARE_KERNELS="0", LOOMMUX_MAX_BODY_BYTES="4096")
    bearer = {"Authorization": f"Bearer {token}"}
    api = server.api
    # the MCP endpoint: bearer only
    for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {token}"},
                    {"Authorization": f"Bearer {token}x"}, {"Cookie": f"loommux_token={token}"}]:
        refused = HttpMcp(server, headers=headers, initialize=False)
        response = refused.initialize()
        refused.drop()
        assert response.status == 401 and response.headers["www-authenticate"].startswith("Bearer"), headers
    with HttpMcp(server, headers={"Authorization": f"bearer {token}"}) as session:
        assert run(session, "1 + 1").body == ["Out[1]: 2"]
    # the API: bearer or the console's cookie
    refused = api("GET", "/api/health")
    assert refused.status == 401 and refused.json()["error_code"] == "unauthorized"
    assert api("GET", "/api/health", headers=bearer).status == 200
    assert api("POST", "/api/lease-policy", {"mode": "ping"}).status == 401
    assert api("GET", "/api/lease-policy", headers=bearer).json()["generation"] == 1
    # the console takes ?token= once, into an HttpOnly SameSite=Strict cookie
    assert api("GET", "/").status == 401
    redirect = api("GET", f"/?token={token}")
    assert redirect.status == 303 and redirect.headers["location"] == "./"
    cookie, *attributes = [part.strip() for part in redirect.headers["set-cookie"].split(";")]
    assert cookie == f"loommux_token={token}" and {"HttpOnly", "SameSite=Strict"} <= set(attributes)
    page = api("GET", "/", headers={"Cookie": cookie})
    assert page.status == 200 and page.headers["content-type"].startswith("text/html")
    assert b"loommux console" in page.body and b"<script src" not in page.body and b"<link" not in page.body
    assert api("GET", "/api/resources", headers={"Cookie": cookie}).status == 200
    wrong = api("GET", "/?token=wrong")
    assert wrong.status == 401 and "set-cookie" not in wrong.headers  # only the right token becomes a cookie
    wrong_cookie = "loommux_token=wrong"
    assert api("GET", "/", headers={"Cookie": wrong_cookie}).status == 401
    assert api("GET", "/api/resources", headers={"Cookie": wrong_cookie}).status == 401
    # Origin and Host rules hold before the token
    assert api("POST", "/api/lease-policy", {"mode": "ping"},
               headers={**bearer, "Origin": "http://evil.example"}).status == 403
    assert api("GET", "/api/lease-policy", headers=bearer).json()["generation"] == 1
    # 413 over the body limit: by Content-Length (before the body is read) and while reading chunks
    conn = RawHttp(server.port)
    conn.send(conn.head("POST", "/mcp", {**MCP_HEADERS, **bearer}, length=5000))
    too_large = conn.read_response()
    assert too_large.status == 413 and too_large.headers["connection"] == "close" and conn.closed_by_server()
    conn.close()
    conn = RawHttp(server.port)
    conn.send(conn.head("POST", "/mcp", {**MCP_HEADERS, **bearer, "Transfer-Encoding": "chunked"})
              + b"%x\r\n%s\r\n" % (3000, b" " * 3000) + b"%x\r\n" % 3000)
    assert conn.read_response().status == 413 and conn.closed_by_server()
    conn.close()


def test_token_from_the_environment(http_spawn):
    server = http_spawn(LOOMMUX_SPARE_KERNELS="0", LOOMMUX_TOKEN="env-token")
    assert server.api("GET", "/api/health").status == 401
    assert server.api("GET", "/api/health", headers={"Authorization": "Bearer env-token"}).status == 200


def test_non_loopback_bind_without_token_warns(http_spawn):
    server = http_spawn("--host", "0.0.0.0", ready=False, LOOMMUX_SPARE_KERNELS="0")
    assert wait_until(lambda: "listening on http://0.0.0.0:" in server.log(), 60), server.log()
    assert "WARNING" in server.log() and "LOOMMUX_TOKEN" in server.log()


def test_http_cancelled_wait_gets_no_response_and_the_cell_continues(http_server):
    with HttpMcp(http_server) as session:
        cell = run_cell(session, "%%loommux --wait 0.1\nimport time\ntime.sleep(2)\nprint('finished')")
        waiting = RawHttp(http_server.port, timeout=30)
        try:
            session.post_on(waiting, session.message("tools/call", tool_params(
                "wait", {"execution": cell.n, "timeout_seconds": 30}), id="w1"))
            time.sleep(0.3)
            assert session.post(jsonrpc("notifications/cancelled", {"requestId": "w1"})).status == 202
            started = time.monotonic()
            with pytest.raises((ConnectionError, OSError)):  # the connection closes with no response
                waiting.read_response()
            assert time.monotonic() - started < 10
        finally:
            waiting.close()
        done = finish(session, cell)
        assert done.state == "completed" and done.body[-1] == "finished"


def test_stateless_header_without_its_envelope_and_bad_resource_header(http_server):
    stateless = StatelessHttp(http_server)
    missing = stateless.post(jsonrpc("tools/list", {}, 1))
    assert missing.status == 400 and missing.json()["error"]["code"] == -32602, missing
    params = {"_meta": {"io.modelcontextprotocol/protocolVersion": "2026-07-28",
                        "io.modelcontextprotocol/clientCapabilities": {}}}
    bad = stateless.post(jsonrpc("tools/list", params, 1), {"X-Loommux-Resource": "bad name!"})
    assert bad.status == 400 and "X-Loommux-Resource" in bad.body.decode()


def test_deep_json_over_http_is_400(http_server):
    with HttpClient(http_server) as outside:
        response = outside.post(DEEP)
        assert response.status == 400 and response.json()["error"]["code"] == -32700
        assert "nested too deeply" in response.json()["error"]["message"]
    for path in ["/api/lease-policy", "/api/resources/no-such/recycle?x=1"]:
        response = http_server.api("POST", path, DEEP)
        assert response.status in (400, 404) and set(response.json()) == {"error_code", "message"}, response
    response = http_server.api("POST", "/api/lease-policy", DEEP)
    assert response.status == 400 and response.json() == {
        "error_code": "invalid_lease_policy",
        "message": "the body is not JSON: the JSON is nested too deeply"}


@pytest.mark.parametrize("body", [b"{}", b"1", b"null", b'"text"', b"[]", b"[{}]", b'{"jsonrpc":"2.0"}',
                                  b'{"jsonrpc":"2.0","id":null,"method":"ping"}',
                                  b'{"jsonrpc":"2.0","id":[1],"method":"ping"}', b'{"id":1,"method":"ping"}'],
                         ids=clipped())
def test_json_that_is_not_a_jsonrpc_message_gets_400(http_server, body):
    with HttpMcp(http_server) as session:
        response = session.post(body)
        assert response.status == 400 and response.json()["error"]["code"] == -32600, response


def test_notifications_responses_and_odd_cancellations_get_202(http_server):
    with HttpMcp(http_server) as session:
        for message in [jsonrpc("notifications/whatever"),
                        {"jsonrpc": "2.0", "id": 5, "result": {}},  # a response to a request never sent
                        jsonrpc("notifications/cancelled", {"requestId": [1]}),
                        jsonrpc("notifications/cancelled", {"requestId": {"a": 1}})]:
            response = session.post(message)
            assert response.status == 202 and response.body == b"", (message, response)
        assert session.result("ping") == {}


def test_stateless_progress_on_sse_and_a_dropped_connection(http_server):
    stateless = StatelessHttp(http_server)
    cell = stateless.call("run_cell", {"freeform": "%%loommux --wait 0.1\nimport time\n"
                                                "print('started', flush=True)\ntime.sleep(3)\n"
                                                "print('finished')",
                                    "kernel": "sse-room"})[0]
    n = int(re.search(r"In \[(\d+)\]", cell)[1])
    # quick answers stay JSON even with a token; a wait that outlives the first progress tick becomes SSE
    quick = stateless.post(stateless.message("tools/call", tool_params("status", {"kernel": "sse-room"}),
                                       progress_token="p0"))
    assert quick.headers["content-type"].startswith("application/json")
    waited = stateless.post(stateless.message("tools/call",
                                        tool_params("wait", {"execution": n, "kernel": "sse-room"}),
                                        progress_token="p1"))
    assert (waited.headers["content-type"].startswith("text/event-stream")
            and waited.headers["x-accel-buffering"] == "no")
    messages = sse_messages(waited.body)
    assert b"\nid:" not in waited.body and not waited.body.startswith(b"id:")
    progress = [m for m in messages if m.get("method") == "notifications/progress"]
    assert progress and all(m["params"]["progressToken"] == "p1" for m in progress)
    assert messages[-1]["result"]["content"][0]["text"].split("\n")[1:] == ["started", "finished"]
    # a client that drops the connection mid-wait ends only its waiting
    cell = stateless.call("run_cell", {"freeform": "%%loommux --wait 0.1\nimport time\ntime.sleep(2)\n"
                                                "print('survived')",
                                    "kernel": "sse-room"})[0]
    n = int(re.search(r"In \[(\d+)\]", cell)[1])
    conn = RawHttp(http_server.port)
    stateless.post_on(conn, stateless.message("tools/call",
                                        tool_params("wait", {"execution": n, "kernel": "sse-room"})))
    time.sleep(0.3)
    conn.close()
    text = stateless.call("wait", {"execution": n, "kernel": "sse-room", "timeout_seconds": 30})[0]
    assert text.split("\n")[1:] == ["survived"]


def test_a_handshake_subscription_over_http_reports_on_the_get_stream(http_server):
    code = ("%%loommux --wait 0.1\nimport time\nfor i in range(20):\n    print('tick', i, flush=True)\n"
            "    time.sleep(0.1)")
    with HttpMcp(http_server) as session:
        stream = session.open_stream()
        result = session.result("tools/call", tool_params("run_cell", {"freeform": code}))
        uri = result["content"][-1]["uri"]
        assert result["content"][-1]["type"] == "resource_link" and uri.endswith("/combined")
        assert session.result("resources/subscribe", {"uri": uri}) == {}
        events = b""
        stream.sock.settimeout(30)
        while events.count(b"notifications/resources/updated") < 2:
            events += stream.sock.recv(1 << 16)
        updates = [m["params"] for m in sse_messages(b"\n".join(
            line for line in events.split(b"\r\n") if not re.fullmatch(rb"[0-9a-f]+", line)))
            if m.get("method") == "notifications/resources/updated"]
        assert updates and all(update == {"uri": uri} for update in updates)
        stream.close()
        finish(session, Cell.parse(result["content"][0]["text"]))
        text = session.result("resources/read", {"uri": uri})["contents"][0]["text"]
        assert text.split("\n") == [f"tick {i}" for i in range(20)]


# ---------------------------------------------------------------- Lease-aware client


def lease_aware_client():
    pytest.importorskip("mcp")
    sys.path.insert(0, str(ROOT))
    try:
        import loommux
    finally:
        sys.path.remove(str(ROOT))
    return loommux.LeaseAwareClient


async def text_result(client, tool: str, args: dict | None = None) -> str:
    result = await client.call_tool(tool, args or {})
    assert not result.is_error, result
    return "".join(block.text for block in result.content if block.type == "text")


@pytest.mark.anyio
async def test_lease_aware_client_pings_under_the_ping_mode(http_spawn):
    import anyio

    client_class = lease_aware_client()
    server = http_spawn(**lease_env("ping", LOOMMUX_PING_INTERVAL_SECONDS="0.3",
                                    LOOMMUX_PING_TIMEOUT_SECONDS="1", LOOMMUX_ORPHAN_GRACE_SECONDS="0.3"))
    async with client_class(server.url, operator="pinging", resource_name="ping-room") as client:
        assert client.policy["mode"] == "ping" and client.policy["generation"] == 1
        assert Cell.parse(await text_result(client, "run_cell", {"freeform": "kept = 7"})).n == 1
        await anyio.sleep(3)  # idle three times the ping timeout: only the client's pings hold the lease
        (resource,) = [r for r in server.resources() if r["name"] == "ping-room"]
        (lease,) = resource["leases"]
        assert lease["operator"] == "pinging" and lease["standing"] == "live" and not resource["orphan"]
        text = await text_result(client, "run_cell", {"freeform": "kept"})
        assert Cell.parse(text).body == ["Out[2]: 7"] and "Kernel retired" not in text
        assert {tool.name for tool in (await client.list_tools()).tools} == TOOLS  # the rest of ClientSession


@pytest.mark.anyio
async def test_lease_aware_client_holds_the_stream_under_the_connection_mode(http_spawn):
    import anyio

    client_class = lease_aware_client()
    server = http_spawn(**lease_env("connection", LOOMMUX_CONNECTION_GRACE_SECONDS="1",
                                    LOOMMUX_PRIVATE_IDLE_SECONDS="1", LOOMMUX_ORPHAN_GRACE_SECONDS="0.3"))
    async with client_class(server.url, operator="streaming") as client:
        texts = [await text_result(client, "run_cell", {"freeform": "kept = 'yes'"}),
                 await text_result(client, "status")]
        await anyio.sleep(2.5)  # past the grace and the activity window: the open stream holds the lease
        texts.append(await text_result(client, "run_cell", {"freeform": "kept"}))
        assert not any("Lease alert" in text or "Kernel retired" in text for text in texts), texts
        assert Cell.parse(texts[-1]).body == ["Out[2]: 'yes'"]
        (lease,) = server.resource_of("streaming")["leases"]
        assert lease["stream_open"] and lease["standing"] == "live" and lease["alert"] is None


@pytest.mark.anyio
async def test_lease_aware_client_retries_once_on_a_stale_policy(http_spawn):
    client_class = lease_aware_client()
    server = http_spawn(LOOMMUX_SPARE_KERNELS="0")

    class Racing(client_class):
        reads = 0

        async def read_policy(self) -> dict:
            policy = await super().read_policy()
            self.reads += 1
            if self.reads == 1:  # the policy changes between reading it and initialize: 409, read again
                assert server.api("POST", "/api/lease-policy", {"orphan_grace_seconds": 5}).status == 200
            return policy

    async with Racing(server.url) as client:
        assert client.reads == 2 and client.policy["generation"] == 2
        assert Cell.parse(await text_result(client, "run_cell", {"freeform": "1 + 1"})).body == ["Out[1]: 2"]
    with pytest.raises(LookupError):  # the caller's own exception, not an exception group
        async with client_class(server.url):
            raise LookupError


def test_lease_aware_client_without_the_sdk_names_the_extra(tmp_path):
    probe = ("import sys\nimport loommux\nassert 'mcp' not in [m for m in sys.modules if sys.modules[m]]\n"
             "try:\n    loommux.LeaseAwareClient('http://127.0.0.1:1/mcp')\n"
             "except ImportError as exc:\n    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT,
                          env=hiding(tmp_path, "mcp"), timeout=60, check=True)
    assert 'pip install "loommux[client]"' in done.stdout, done.stdout + done.stderr


# ---------------------------------------------------------------- CLI


@pytest.mark.fast
def test_settings_defaults():
    assert settings_of([]) == loommux.Settings(ROOT)
    assert vars(loommux.Settings(ROOT)) == {
        "workspace": ROOT, "workspace_resolution": "launch_cwd", "result_mode": "content",
        "host": "127.0.0.1",
        "port": 8801, "path": "/mcp", "token": None, "spare_kernels": 1, "max_body": 32 << 20,
        "max_connections": 512, "search_timeout": 10.0,
        "lease_policy": loommux.LeasePolicy("activity", 4800.0, 86400.0, 15.0, 60.0, 60.0, 30.0),
        "kernel_environ": {}, "startup": None, "inspectors": None, "max_kernels": 32,
        "evict_idle_seconds": 600.0,
        "gateway": None, "public_url": None, "instance": "", "several": False, "state_dir": None,
        "output_dir": None, "output": None, "notebook": None,
        "notebook_dir": None, "existing": {}, "kernelspecs": {}}


@pytest.mark.fast
@pytest.mark.parametrize("argv, environ, field, value", [
    (["--result-mode", "structured"], {}, "result_mode", "structured"),
    ([], {"LOOMMUX_RESULT_MODE": "structured"}, "result_mode", "structured"),
    (["--result-mode", "content"], {"LOOMMUX_RESULT_MODE": "structured"}, "result_mode", "content"),
    (["--host", "0.0.0.0", "--port", "0", "--path", "/x"], {}, "host", "0.0.0.0"),
    (["--port", "0"], {}, "port", 0),
    (["--path", "/x"], {}, "path", "/x"),
    ([], {"LOOMMUX_TOKEN": "t"}, "token", "t"),
    (["--token", "cli"], {"LOOMMUX_TOKEN": "env"}, "token", "cli"),
    ([], {"LOOMMUX_TOKEN": ""}, "token", None),
    ([], {"LOOMMUX_SPARE_KERNELS": "0"}, "spare_kernels", 0),
    ([], {"LOOMMUX_SPARE_KERNELS": " 3 "}, "spare_kernels", 3),
    ([], {"LOOMMUX_SPARE_KERNELS": ""}, "spare_kernels", 1),
    ([], {"LOOMMUX_MAX_BODY_BYTES": "1024"}, "max_body", 1024),
    ([], {"LOOMMUX_MAX_CONNECTIONS": "1"}, "max_connections", 1),
    ([], {"LOOMMUX_SEARCH_TIMEOUT_SECONDS": "0.5"}, "search_timeout", 0.5),
    ([], {"LOOMMUX_MAX_KERNELS": "1"}, "max_kernels", 1),
    ([], {"LOOMMUX_EVICT_IDLE_SECONDS": "0"}, "evict_idle_seconds", 0.0),
    ([], {"LOOMMUX_LEASE_MODE": "ping", "LOOMMUX_PING_INTERVAL_SECONDS": "1",
          "LOOMMUX_PING_TIMEOUT_SECONDS": "2.5",
          "LOOMMUX_PRIVATE_IDLE_SECONDS": "3", "LOOMMUX_SHARED_IDLE_SECONDS": "4",
          "LOOMMUX_CONNECTION_GRACE_SECONDS": "5", "LOOMMUX_ORPHAN_GRACE_SECONDS": "6"},
     "lease_policy", loommux.LeasePolicy("ping", 3.0, 4.0, 1.0, 2.5, 5.0, 6.0)),
    ([], {"LOOMMUX_PUBLIC_URL": "http://host:1/"}, "public_url", "http://host:1"),
    (["--public-url", "https://cli"], {"LOOMMUX_PUBLIC_URL": "http://env"}, "public_url", "https://cli"),
    ([], {"LOOMMUX_INSTANCE": "eu-1"}, "instance", "eu-1"),
    (["--instance", "B2"], {"LOOMMUX_INSTANCE": "eu-1"}, "instance", "B2"),
    (["--server", "--instance", "B2"], {}, "several", True),  # one of several behind a proxy
    (["--server"], {"LOOMMUX_INSTANCE": "eu-1"}, "several", True),
    (["--server"], {}, "several", False),
    ([], {"LOOMMUX_INSTANCE": "eu-1"}, "several", False),  # stdio: one client, no proxy
    ([], {"LOOMMUX_GATEWAY_URL": "http://gw:8888/", "LOOMMUX_GATEWAY_TOKEN": "g", "KERNEL_USERNAME": "ann",
          "LOOMMUX_GATEWAY_KERNEL_NAME": "py"},
     "gateway", loommux.Gateway("http://gw:8888", "g", "py", None, {"KERNEL_USERNAME": "ann"})),
    (["--gateway", "https://cli", "--gateway-token", "c"], {"LOOMMUX_GATEWAY_URL": "http://env"},
     "gateway", loommux.Gateway("https://cli", "c")),
    ([], {"PATH": "/bin", "LOOMMUX_TOKEN": "t", "LOOMMUX_GATEWAY_TOKEN": "g", "LOOMMUX_KERNEL_ID": "k"},
     "kernel_environ", {"PATH": "/bin"}),  # no credential, no identity of an outer kernel
])
def test_settings_from_argv_and_environment(argv, environ, field, value):
    assert getattr(settings_of(argv, **environ), field) == value


@pytest.mark.fast
def test_settings_files(tmp_path):
    startup, config, inner = tmp_path / "startup.py", tmp_path / "config.py", tmp_path / "inner"
    startup.write_text("")
    inner.mkdir()
    config.write_text(f"def resolve_workspace(launch_cwd):\n    return {str(inner)!r}\n")
    settings = settings_of([], LOOMMUX_STARTUP=str(startup), LOOMMUX_WORKSPACE_CONFIG=str(config))
    assert ((settings.startup, settings.workspace, settings.workspace_resolution)
            == (startup, inner, "explicit_config"))
    assert settings_of(["--startup", str(startup)], LOOMMUX_STARTUP="/elsewhere.py").startup == startup
    ca_file = tmp_path / "ca.pem"
    ca_file.write_text("")
    assert settings_of([], LOOMMUX_GATEWAY_URL="https://gw",
                       LOOMMUX_GATEWAY_CA_FILE=str(ca_file)).gateway.ca_file == ca_file


@pytest.mark.fast
def test_settings_state_dir(tmp_path):
    made = tmp_path / "made" / "here"
    assert settings_of(["--server", "--state-dir", str(made)]).state_dir == made and made.is_dir()
    assert settings_of(["--server"], LOOMMUX_STATE_DIR=str(tmp_path)).state_dir == tmp_path
    a_file = tmp_path / "file"
    a_file.write_text("")
    for argv, said in ((["--state-dir", str(tmp_path)], "needs --server"),
                       (["--server", "--state-dir", str(a_file)], "cannot create it"),
                       (["--server", "--state-dir", str(a_file / "x")], "cannot create it")):
        with pytest.raises(loommux.StartupError) as raised:
            settings_of(argv)
        message = str(raised.value)
        assert message.startswith(f"--state-dir / LOOMMUX_STATE_DIR {argv[-1]}: {said}"), message

    assert settings_of(["--server", "--state-dir", str(made)], LOOMMUX_SPARE_KERNELS="2").spare_kernels == 2
    assert settings_of(["--server", "--state-dir", str(made), "--gateway", "http://127.0.0.1:9"],
                       LOOMMUX_SPARE_KERNELS="2").spare_kernels == 0  # the state could not keep a spare
    assert made.stat().st_mode & 0o777 == 0o700  # it holds credentials: made the user's alone


def chown_to_another_user(path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root can give a directory to another user")
    os.chown(path, 65534, 65534)


@pytest.mark.fast
@pytest.mark.parametrize("kind, said", [
    ("a link", "is a symbolic link"),
    ("another user's", "is owned by another user (uid 65534)"),
    ("writable by all", "may be written by other users (mode 777)"),
    ("writable by its group", "may be written by other users (mode 770)"),
], ids=clipped(12))
def test_settings_refuse_a_state_dir_that_is_not_the_users_alone(tmp_path, kind, said):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    if kind == "a link":
        state = tmp_path / "link"
        state.symlink_to(tmp_path / "state")
    elif kind == "another user's":
        chown_to_another_user(state)
    else:
        state.chmod(0o777 if kind == "writable by all" else 0o770)
    with pytest.raises(loommux.StartupError) as raised:
        settings_of(["--server", "--state-dir", str(state)])
    assert str(raised.value).startswith(f"--state-dir / LOOMMUX_STATE_DIR {state} {said}: refused to start; "
                                        "the state directory must be this user's own"), raised.value


@pytest.mark.fast
def test_settings_refuse_an_output_dir_another_user_owns_or_all_may_write_but_not_a_sticky_one(tmp_path):
    out = tmp_path / "out"
    out.mkdir(mode=0o700)
    assert settings_of(["--output-dir", str(out)]).output_dir == out
    link = tmp_path / "link"
    link.symlink_to(out)
    assert settings_of(["--output-dir", str(link)]).output_dir == link  # loommux makes its own in it
    for mode, said in ((0o777, "may be written by other users (mode 777) and has no sticky bit"),
                       (0o1777, None)):  # sticky, as the system's temporary directory: fine
        out.chmod(mode)
        if said is None:
            assert settings_of(["--output-dir", str(out)]).output_dir == out
            continue
        with pytest.raises(loommux.StartupError) as raised:
            settings_of(["--output-dir", str(out)])
        assert str(raised.value) == (f"--output-dir / LOOMMUX_OUTPUT_DIR {out} {said}: refused to start; "
                                     "it must be this user's own, or sticky (as the system's temporary "
                                     "directory is)")
    out.chmod(0o755)
    chown_to_another_user(out)
    with pytest.raises(loommux.StartupError, match=re.escape(f"{out} is owned by another user (uid 65534)")):
        settings_of(["--output-dir", str(out)])
    out.chmod(0o1777)  # another user's, sticky (as /tmp is root's): fine
    assert settings_of(["--output-dir", str(out)]).output_dir == out


WHOLE = "must be a whole number of at least"
URL = "must be an http:// or https:// URL"


@pytest.mark.fast
@pytest.mark.parametrize("argv, environ, message", [
    ([], {"LOOMMUX_RESULT_MODE": "fancy"},
     "LOOMMUX_RESULT_MODE=fancy: the result mode is content or structured"),
    (["--path", "mcp"], {}, "--path mcp: the endpoint path must start with /"),
    ([], {"LOOMMUX_SPARE_KERNELS": "-1"}, f"LOOMMUX_SPARE_KERNELS=-1: {WHOLE} 0"),
    ([], {"LOOMMUX_SPARE_KERNELS": "two"}, f"LOOMMUX_SPARE_KERNELS=two: {WHOLE} 0"),
    ([], {"LOOMMUX_SPARE_KERNELS": "²"}, f"LOOMMUX_SPARE_KERNELS=²: {WHOLE} 0"),  # a digit int() refuses
    ([], {"LOOMMUX_SPARE_KERNELS": "1_000"}, f"LOOMMUX_SPARE_KERNELS=1_000: {WHOLE} 0"),
    ([], {"LOOMMUX_MAX_BODY_BYTES": "100"}, f"LOOMMUX_MAX_BODY_BYTES=100: {WHOLE} 1024"),
    ([], {"LOOMMUX_MAX_CONNECTIONS": "0"}, f"LOOMMUX_MAX_CONNECTIONS=0: {WHOLE} 1"),
    ([], {"LOOMMUX_MAX_KERNELS": "0"}, f"LOOMMUX_MAX_KERNELS=0: {WHOLE} 1"),
    *(([], {"LOOMMUX_SEARCH_TIMEOUT_SECONDS": value},
       f"LOOMMUX_SEARCH_TIMEOUT_SECONDS={value}: must be a positive number of seconds")
      for value in ("0", "inf", "x")),
    ([], {"LOOMMUX_EVICT_IDLE_SECONDS": "-1"}, "LOOMMUX_EVICT_IDLE_SECONDS=-1: must be a number of seconds"),
    ([], {"LOOMMUX_LEASE_MODE": "never"},
     "LOOMMUX_LEASE_MODE: mode: must be one of activity, ping, connection, not 'never'"),
    ([], {"LOOMMUX_PING_INTERVAL_SECONDS": "x"},
     "LOOMMUX_PING_INTERVAL_SECONDS=x: must be a number of seconds"),
    ([], {"LOOMMUX_PING_INTERVAL_SECONDS": "100"},
     "LOOMMUX_PING_TIMEOUT_SECONDS: ping_timeout_seconds: must be greater than ping_interval_seconds"),
    ([], {"LOOMMUX_PRIVATE_IDLE_SECONDS": "-5"},
     ("LOOMMUX_PRIVATE_IDLE_SECONDS: private_idle_seconds: must be a positive finite number of seconds, "
      "not -5.0")),
    ([], {"LOOMMUX_ORPHAN_GRACE_SECONDS": "nan"},
     ("LOOMMUX_ORPHAN_GRACE_SECONDS: orphan_grace_seconds: must be a positive finite number of seconds, "
      "not nan")),
    ([], {"LOOMMUX_STARTUP": "rel.py"},
     "LOOMMUX_STARTUP / --startup rel.py: the startup file must be named by an absolute path"),
    (["--startup", "/nonexistent.py"], {}, "LOOMMUX_STARTUP / --startup /nonexistent.py: no such file"),
    ([], {"LOOMMUX_GATEWAY_URL": "ftp://x"}, f"--gateway / LOOMMUX_GATEWAY_URL ftp://x: {URL}"),
    (["--gateway", "http://gw/?q=1"], {}, f"--gateway / LOOMMUX_GATEWAY_URL http://gw/?q=1: {URL}"),
    ([], {"LOOMMUX_GATEWAY_URL": "http://gw", "LOOMMUX_GATEWAY_CA_FILE": "/nope"},
     "LOOMMUX_GATEWAY_CA_FILE=/nope: no such file"),
    ([], {"LOOMMUX_PUBLIC_URL": "localhost:1"}, f"--public-url / LOOMMUX_PUBLIC_URL localhost:1: {URL}"),
    ([], {"LOOMMUX_WORKSPACE_CONFIG": "rel.py"},
     "LOOMMUX_WORKSPACE_CONFIG=rel.py: must be an absolute path to a Python file"),
    ([], {"LOOMMUX_WORKSPACE_CONFIG": "/nope.py"}, "LOOMMUX_WORKSPACE_CONFIG=/nope.py: no such file"),
    (["--instance", "a.b"], {},
     "--instance / LOOMMUX_INSTANCE 'a.b': an instance name is 1-32 characters of A-Z, a-z, 0-9 and '-'"),
    ([], {"LOOMMUX_INSTANCE": "x" * 33},
     (f"--instance / LOOMMUX_INSTANCE '{'x' * 33}': an instance name is 1-32 characters of A-Z, a-z, "
      "0-9 and '-'")),
], ids=clipped())
def test_bad_settings_are_one_clear_line(argv, environ, message):
    with pytest.raises(loommux.StartupError) as raised:
        settings_of(argv, **environ)
    assert str(raised.value) == message and "\n" not in message


@pytest.mark.fast
@pytest.mark.parametrize("argv, said", [
    (["--result-mode", "x"],
     "argument --result-mode: invalid choice: 'x' (choose from 'content', 'structured')"),
    (["--port", "http"], "argument --port: invalid int value: 'http'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
], ids=clipped())
def test_bad_command_lines_are_usage_errors(argv, said, capsys):
    with pytest.raises(SystemExit) as raised:
        loommux.parse_command_line(argv)
    assert raised.value.code == 2 and capsys.readouterr().err.endswith(f"loommux: error: {said}\n")


@needs_proc
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shutdown(spawn, sig):
    s = spawn()
    kernel, launcher, below, kernel_dir = kernel_tree(s)
    s.proc.send_signal(sig)
    assert s.proc.wait(timeout=5) == 0
    assert_nothing_left(kernel, launcher, below, kernel_dir)
    assert not (s.workspace / CLEAN_EXIT).exists()  # a signal is a hurry: the kernel is killed, never asked


@needs_proc
def test_a_signal_while_the_kernel_starts_leaves_nothing_behind(spawn, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    s = spawn(initialize=False, TMPDIR=str(tmp))
    s.send_request("initialize", {"protocolVersion": LATEST, "capabilities": {},
                                  "clientInfo": {"name": "test_loommux", "version": "0"}})
    assert wait_until(lambda: descendants(s.proc.pid), 60, interval=0.01)  # the launcher; no kernel ready
    below = descendants(s.proc.pid)
    s.tracked_pids |= below
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=15) == 0
    assert all_gone(below, 5) == [] and kernel_dirs(tmp) == []


BAD_CONFIGS = {
    "missing": None,
    "no_function": "x = 1\n",
    "syntax_error": "def resolve_workspace(:\n",
    "raises": "def resolve_workspace(launch_cwd):\n    raise RuntimeError('boom')\n",
    "not_a_directory": "def resolve_workspace(launch_cwd):\n    return launch_cwd / 'does-not-exist'\n",
    "a_file": "def resolve_workspace(launch_cwd):\n    return __file__\n",
    "bad_type": "def resolve_workspace(launch_cwd):\n    return 42\n",
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_bad_workspace_config_stops_startup(spawn, tmp_path, case):
    config = tmp_path / f"resolver_{case}.py"
    if BAD_CONFIGS[case] is not None:
        config.write_text(BAD_CONFIGS[case])
    s = spawn(initialize=False, LOOMMUX_WORKSPACE_CONFIG=str(config))
    try:
        s.send_request("initialize", initialize_params("t"))
    except OSError:
        pass
    assert s.proc.wait(60) != 0
    assert not s.responses
    stderr = s.stderr_tail()
    assert any(word in stderr
               for word in (config.name, "LOOMMUX_WORKSPACE_CONFIG", "resolve_workspace")), stderr


def test_explicit_workspace_config_and_kernel_unavailable(spawn, tmp_path):
    launch = tmp_path / "launch"
    chosen = launch / "chosen"
    chosen.mkdir(parents=True)
    config = tmp_path / "resolver.py"
    config.write_text("from pathlib import Path\n\n\ndef resolve_workspace(launch_cwd: Path) -> Path:\n"
                      "    return launch_cwd / 'chosen'\n")
    s = spawn(workspace=launch, LOOMMUX_WORKSPACE_CONFIG=str(config))
    status = s.call("status")[0]
    assert "workspace_resolution: explicit_config" in status and f"workspace: {chosen.resolve()}" in status
    assert run(s, "import os\nos.getcwd()").body[-1].endswith(repr(str(chosen.resolve())))

    s.kernel_pid()
    shutil.rmtree(chosen)  # the replacement kernel cannot start in a workspace that is gone
    tool_error(s, "restart", None, "kernel_unavailable")
    tool_error(s, "run_cell", {"freeform": "1"}, "kernel_unavailable")
    assert s.result("ping") == {}
    assert not s.call("status")[1]

    chosen.mkdir()
    text, is_error, _ = s.call("restart")
    assert not is_error and text.startswith("restarted:"), text
    s.kernel_pid()
    assert run(s, "1 + 1").body[-1].endswith(": 2")


PUBLISHED_IMPORTS = """
from loommux.client import LeaseAwareClient
from loommux.daemon import Daemon, DaemonError
import loommux.daemon
import loommux
print(loommux.daemon.Daemon() is not None, loommux.daemon.Daemon is Daemon is loommux.Daemon,
      LeaseAwareClient is loommux.LeaseAwareClient, DaemonError.__name__, sorted(loommux.__all__)[:2])
"""


@pytest.mark.parametrize("how", ["copied alone", "installed"])
def test_published_import_paths(tmp_path, how):
    """The published package's import paths work with the single file, copied alone or installed."""
    if how == "copied alone":
        shutil.copy(LOOMMUX, tmp_path / "loommux.py")
        done = python_in(tmp_path, PUBLISHED_IMPORTS)
    else:
        where = python_in(tmp_path, "import importlib.util; print(importlib.util.find_spec('loommux'))", "-I")
        if "loommux" not in where.stdout:
            pytest.skip("loommux is not installed in this interpreter")
        done = python_in(tmp_path, PUBLISHED_IMPORTS, "-I")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True", "True", "DaemonError", "['Daemon',", "'DaemonError']"]


@needs_proc
def test_http_sigterm_leaves_no_kernel_behind(http_spawn):
    server = http_spawn(LOOMMUX_SPARE_KERNELS="1")
    a, b = HttpMcp(server), HttpMcp(server, resource="term-room")
    child = int(run(a, SLEEP_CHILD).body[0])
    assert run_cell(b, SLEEP_LONG).state == "running"  # still running at shutdown
    kernels = {r["kernel_pid"] for r in server.resources()}
    below = server.remember()
    assert len(kernels) == 2 and kernels | {child} <= below
    spare_and_kernels = {pid for pid in below
                         if b"loommux-kernel-launcher" in Path(f"/proc/{pid}/cmdline").read_bytes()}
    assert len(spare_and_kernels) >= 3  # the spare kernel too
    connection_files = [kernel_connection_file(pid) for pid in spare_and_kernels]
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    assert all_gone(below, 10) == []
    for path in connection_files:
        assert subprocess.run(["pgrep", "-f", str(path)], check=False,
                              capture_output=True).returncode == 1, path
        assert not path.parent.exists()
    a.drop()
    b.drop()


BAD_SERVER_ENVS = [
    ({"LOOMMUX_PING_INTERVAL_SECONDS": "2", "LOOMMUX_PING_TIMEOUT_SECONDS": "2"},
     "LOOMMUX_PING_TIMEOUT_SECONDS"),
    ({"LOOMMUX_PING_TIMEOUT_SECONDS": "5"}, "LOOMMUX_PING_TIMEOUT_SECONDS"),  # not above the 15 s interval
    ({"LOOMMUX_PRIVATE_IDLE_SECONDS": "-1"}, "LOOMMUX_PRIVATE_IDLE_SECONDS"),
    ({"LOOMMUX_SHARED_IDLE_SECONDS": "0"}, "LOOMMUX_SHARED_IDLE_SECONDS"),
    ({"LOOMMUX_ORPHAN_GRACE_SECONDS": "abc"}, "LOOMMUX_ORPHAN_GRACE_SECONDS"),
    ({"LOOMMUX_CONNECTION_GRACE_SECONDS": "inf"}, "LOOMMUX_CONNECTION_GRACE_SECONDS"),
    ({"LOOMMUX_PING_INTERVAL_SECONDS": "nan"}, "LOOMMUX_PING_INTERVAL_SECONDS"),
    ({"LOOMMUX_LEASE_MODE": "sometimes"}, "LOOMMUX_LEASE_MODE"),
    ({"LOOMMUX_SPARE_KERNELS": "-1"}, "LOOMMUX_SPARE_KERNELS"),
    ({"LOOMMUX_MAX_BODY_BYTES": "12"}, "LOOMMUX_MAX_BODY_BYTES"),
    ({"LOOMMUX_RESULT_MODE": "fancy"}, "LOOMMUX_RESULT_MODE"),
]


@pytest.mark.parametrize("env, variable", BAD_SERVER_ENVS, ids=[v for _, v in BAD_SERVER_ENVS])
def test_bad_server_settings_stop_startup(http_spawn, env, variable):
    server = http_spawn(ready=False, **env)
    assert server.proc.wait(30) == 2
    log = server.log()
    assert variable in log and "listening" not in log, log


def test_sigusr1_dumps_every_thread_and_keeps_serving(spawn, http_spawn):
    stdio = spawn()
    os.kill(stdio.proc.pid, signal.SIGUSR1)
    assert wait_until(lambda: "most recent call first" in stdio.stderr_path.read_text(errors="replace"), 10)
    assert run(stdio, "6 * 7").body[-1] == "Out[1]: 42"
    http = http_spawn()
    os.kill(http.proc.pid, signal.SIGUSR1)
    assert wait_until(lambda: "most recent call first" in http.log(), 10)
    assert http.proc.poll() is None
    assert http.api("GET", "/api/health").json()["status"] == "ok"


@pytest.mark.parametrize("value", ["relative/startup.py", "/no/such/startup.py"])
def test_bad_startup_path_stops_the_server(spawn, value):
    server = spawn(initialize=False, LOOMMUX_STARTUP=value)
    assert server.proc.wait(30) == 2
    assert value in server.stderr_path.read_text() and "LOOMMUX_STARTUP" in server.stderr_path.read_text()


@pytest.mark.parametrize("transport", [[], ["--server", "--port", "0"]])
@pytest.mark.parametrize("module, package", [("zmq", "pyzmq"), ("ipykernel", "ipykernel")])
def test_a_missing_runtime_package_is_one_line(tmp_path, transport, module, package):
    done = subprocess.run([sys.executable, str(LOOMMUX), *transport], stdin=subprocess.DEVNULL,
                          capture_output=True, cwd=tmp_path, env=hiding(tmp_path, module), timeout=60,
                          check=False)
    assert done.returncode == 2 and done.stdout == b""
    (line,) = done.stderr.decode().splitlines()
    assert f"the Python package {package} is missing" in line and f"-m pip install {package}" in line


def test_help_names_both_transports_and_every_environment_variable():
    done = subprocess.run([sys.executable, str(LOOMMUX), "--help"], capture_output=True, text=True,
                          timeout=60, check=True)
    assert "stdio" in done.stdout and "Streamable HTTP" in done.stdout
    table = (ROOT / "README.md").read_text().split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    variables = re.findall(r"^\| `([A-Z_]+)` \|", table, re.MULTILINE)
    assert len(variables) > 10 and all(variable in done.stdout for variable in variables), variables
    description = re.search(r'^description = "(.*)"$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)[1]
    assert "stdio" in description and "Streamable HTTP" in description


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", "nan"])
def test_a_bad_search_timeout_stops_startup(spawn, value):
    s = spawn(initialize=False, LOOMMUX_SEARCH_TIMEOUT_SECONDS=value)
    assert s.proc.wait(30) == 2
    assert "LOOMMUX_SEARCH_TIMEOUT_SECONDS" in s.stderr_tail()


@pytest.mark.parametrize(("env", "said"), [
    ({"LOOMMUX_GATEWAY_URL": "ftp://gateway.example"},
     "LOOMMUX_GATEWAY_URL ftp://gateway.example: must be an http"),
    ({"LOOMMUX_PUBLIC_URL": "gateway.example:80"}, "LOOMMUX_PUBLIC_URL gateway.example:80: must be an http"),
    ({"LOOMMUX_GATEWAY_URL": "https://gateway.example", "LOOMMUX_GATEWAY_CA_FILE": "/no/ca.pem"},
     "LOOMMUX_GATEWAY_CA_FILE=/no/ca.pem: no such file"),
    ({"LOOMMUX_GATEWAY_URL": "http://gateway.example", "LOOMMUX_GATEWAY_TOKEN": "t0k\r\nX-Injected: 1"},
     "--gateway-token / LOOMMUX_GATEWAY_TOKEN: must be printable characters"),
], ids=clipped())
def test_bad_gateway_settings_stop_the_server(spawn, env, said):
    server = spawn(initialize=False, **env)
    assert server.proc.wait(30) == 2
    assert said in server.stderr_path.read_text()


@pytest.mark.fast
def test_the_module_maps_list_every_section_in_order():
    text = LOOMMUX.read_text()
    banners = re.findall(rf"^{re.escape(loommux.SECTION_BANNER)} (.+)$", text, re.MULTILINE)
    docstring = [line[2:26].strip() for line in loommux.__doc__.splitlines()
                 if line.startswith("  ") and line[2] != " "]
    readme = (ROOT / "README.md").read_text().split("| section | what it owns |\n|---|---|\n", 1)[1]
    rows = [line.split(" | ")[0].lstrip("| ") for line in readme.split("\n\n", 1)[0].splitlines()]
    assert docstring == banners and rows == banners, (banners, docstring, rows)


@pytest.mark.fast
def test_readme_stays_short_and_tells_the_commands_ci_runs():
    """README is at most 2,000 lines; its first screen says how to install, run, connect a host, work
    offline and what is private; its Development section gives the fast loop and the command .ci/run runs."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 2000
    first_screen = readme.split("\n## Contents", 1)[0]
    told = ("pip install .", "loommux --server", "claude mcp add", "TIKTOKEN_CACHE_DIR", "Private and shared")
    assert [said for said in told if said not in first_screen] == []
    development = readme.split("\n## Development\n", 1)[1]
    ci = (ROOT / ".ci" / "run").read_text()
    assert 'pip install -e ".[test]"' in development and "python -m pytest -q -m fast" in development
    assert "-m pytest -q test_loommux.py" in ci and "python -m pytest -q test_loommux.py" in development
