"""End-to-end tests for loommux: a real `python loommux.py` over stdio with a real ipykernel.

Most tests share one session-scoped server (one kernel); a fresh server is spawned only where
the point is the process lifecycle (numbering from 1, restart, kernel death, shutdown, startup).
Execution numbers of the shared server keep growing, so tests read them from `In [N]`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
LOOMMUX = ROOT / "loommux.py"
TIKTOKEN_DIR = ROOT.parent / "shared" / "tiktoken"
O200K_URL = "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken"

LATEST = "2025-11-25"
PROTOCOL_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")
TOOLS = {"run_cell", "wait", "status", "execution_status", "read_output", "search_output", "interrupt", "restart"}
READ_ONLY_TOOLS = {"wait", "status", "execution_status", "read_output", "search_output"}

HEAD_RE = re.compile(r"In \[(\d+)\] · ([^·]+?)(?: · (running|error|interrupted|killed))?:")
READ_HEAD_RE = re.compile(r"\[execution (\d+) · (\w+) · lines? (\d+)(?:-(\d+))? of ([\d,]+)\]")
SLEEP_CHILD = "import subprocess\nchild = subprocess.Popen(['sleep', '1000'])\nprint(child.pid)"
TWENTY_K = "for i in range(1, 20_001):\n    print(f'line {i}')"
needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process checks read /proc")


# --------------------------------------------------------------------------- helpers


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


def number(text: str) -> int:
    return int(text.replace(",", ""))


def lines_of(text: str) -> list[str]:
    """Body lines of a tool result (everything after the first line), minus one trailing empty line."""
    lines = text.split("\n")[1:]
    return lines[:-1] if lines and lines[-1] == "" else lines


def kernel_replaced(text: str) -> list[str]:
    return [line for line in text.split("\n") if line.startswith("Kernel replaced:")]


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


class StdioServer:
    """A hand-written MCP client driving one `python loommux.py` process over stdio.

    A reader thread parses every stdout line as JSON (anything else is recorded in `garbage`,
    which the fixtures turn into a failure) and routes responses by id, so a test may have
    several requests in flight and check in which order the answers came.
    """

    def __init__(self, workspace: Path, stderr_path: Path, env: dict[str, str]):
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
        self._ids = itertools.count(1)
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
        self.send({"jsonrpc": "2.0", "method": method, **({"params": params} if params is not None else {})})

    def send_request(self, method: str, params: dict | None = None, id=None):
        rid = next(self._ids) if id is None else id
        msg = {"jsonrpc": "2.0", "id": rid, "method": method}
        if params is not None:
            msg["params"] = params
        self.send(msg)
        return rid

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
                    raise AssertionError(f"no matching message within {timeout} s; stderr:\n{self.stderr_tail()}")
                self._cond.wait(left)

    def response(self, rid, timeout: float = 90.0) -> dict:
        return self.wait_for(lambda m: "id" in m and m["id"] == rid and ("result" in m or "error" in m), timeout)

    def request(self, method: str, params: dict | None = None, timeout: float = 90.0) -> dict:
        return self.response(self.send_request(method, params), timeout)

    def result(self, method: str, params: dict | None = None, timeout: float = 90.0) -> dict:
        msg = self.request(method, params, timeout)
        assert "result" in msg, msg
        return msg["result"]

    def call(self, tool: str, args: dict | None = None, timeout: float = 90.0) -> tuple[str, bool, dict]:
        params = {"name": tool} if args is None else {"name": tool, "arguments": args}
        result = self.result("tools/call", params, timeout)
        text = "".join(c["text"] for c in result["content"] if c.get("type") == "text")
        return text, bool(result.get("isError", False)), result

    def initialize(self, version: str = LATEST, timeout: float = 90.0) -> dict:
        self.init_result = self.result("initialize", {
            "protocolVersion": version, "capabilities": {},
            "clientInfo": {"name": "test_loommux", "version": "0"},
        }, timeout)
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
        if self.proc.poll() is None:
            try:
                self.close(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pid in self.tracked_pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)

    def assert_pure(self) -> None:
        assert not self.garbage, f"non-JSON-RPC lines on stdout: {self.garbage[:5]}"
        assert not self.duplicates, f"ids answered more than once: {self.duplicates}"


def run_cell(server: StdioServer, code: str, timeout: float = 90.0) -> Cell:
    text, is_error, _ = server.call("run_cell", {"code": code}, timeout)
    assert not is_error, text
    return Cell.parse(text)


def finish(server: StdioServer, cell: Cell, timeout: float = 120.0) -> Cell:
    """Wait (without interrupting) until `cell` is no longer running."""
    deadline = time.monotonic() + timeout
    while cell.state == "running":
        assert time.monotonic() < deadline, f"execution {cell.n} still running after {timeout} s"
        text, is_error, _ = server.call("wait", {"execution": cell.n, "timeout_seconds": 30}, timeout=90)
        assert not is_error, text
        cell = Cell.parse(text)
    return cell


def run(server: StdioServer, code: str, timeout: float = 120.0) -> Cell:
    return finish(server, run_cell(server, code), timeout)


def tool_error(server: StdioServer, tool: str, args: dict | None, code: str) -> str:
    text, is_error, _ = server.call(tool, args)
    assert is_error, f"{tool}({args}) should fail with {code}, got: {text[:300]}"
    assert text.startswith(f"{code}:"), text
    return text


def read(server: StdioServer, timeout: float = 90.0, **args) -> tuple[str, list[str]]:
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


def search(server: StdioServer, query: str, **args) -> tuple[str, list[str]]:
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


def child_pid_of(server: StdioServer, cell: Cell) -> int:
    pid = int(cell.body[0])
    server.tracked_pids.add(pid)
    return pid


def settle(server: StdioServer) -> None:
    """Make sure no cell of one test keeps running into the next."""
    text, is_error, _ = server.call("interrupt")
    if not is_error and text.startswith("interrupt_sent"):
        server.call("wait", {"timeout_seconds": 60}, timeout=90)


# --------------------------------------------------------------------------- fixtures


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
def twenty_k(session_server) -> Cell:
    """A finished execution of the session server that printed 'line 1' .. 'line 20000'."""
    return run(session_server, TWENTY_K)


@pytest.fixture(scope="session")
def small(session_server) -> Cell:
    return run(session_server, "print('err1 a(b')\nprint('ERR22 x')\nprint('plain')\nprint('err3 err4')")


@pytest.fixture
def anyio_backend():
    return "asyncio"


# --------------------------------------------------------------------------- protocol


def test_initialize_result(session_server):
    result = session_server.init_result
    assert result["protocolVersion"] == LATEST
    assert result["serverInfo"]["name"] == "loommux"
    assert isinstance(result["serverInfo"]["version"], str) and result["serverInfo"]["version"]
    assert "tools" in result["capabilities"]
    assert isinstance(result.get("instructions"), str) and "run_cell" in result["instructions"]


def test_ping(srv):
    assert srv.result("ping") == {}


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


@pytest.mark.parametrize("method", ["server/discover", "no/such/method"])
def test_unknown_method(srv, method):
    msg = srv.request(method, {}, timeout=10)
    assert msg["error"]["code"] == -32601
    assert srv.result("ping") == {}


@pytest.mark.parametrize("line", [b"{not json\n", b'{"jsonrpc": "2.0", "id": 5, "method":\n', b"\xff\xfe\x00garbage\n"])
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


@pytest.mark.parametrize("tool, args, field", [
    ("run_cell", {"code": 5}, "code"),
    ("run_cell", {}, "code"),
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


# --------------------------------------------------------------------------- cells


def test_variables_survive_and_results_use_loommux_numbers(srv):
    first = run(srv, "x_survive = 41")
    assert first.state == "completed" and first.body == ["(no output)"]
    second = run(srv, "print('a')\nx_survive + 1")
    assert second.n == first.n + 1
    assert second.body == ["a", f"Out[{second.n}]: 42"]
    assert read(srv, execution=second.n, stream="result")[1] == ["42"]
    assert read(srv, execution=second.n, stream="stdout")[1] == ["a"]
    assert read(srv, execution=second.n, stream="stderr")[1] == []


@pytest.mark.parametrize("alias", ["freeform", "source", "cell"])
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


def test_exception_is_an_execution_state(srv):
    cell = run(srv, "def f():\n    return 1 / 0\nf()")
    assert cell.state == "error" and "ZeroDivisionError" in cell.text
    assert "\x1b" not in cell.text
    _, tb = read(srv, execution=cell.n, stream="traceback")
    assert any("ZeroDivisionError" in line for line in tb)
    text, is_error, _ = srv.call("execution_status", {"execution": cell.n})
    assert not is_error and text.startswith(f"[execution {cell.n} · error]") and "ZeroDivisionError" in text


def test_stderr_stream(srv):
    cell = run(srv, "import sys\nprint('to-err', file=sys.stderr)\nprint('to-out')")
    assert read(srv, execution=cell.n, stream="stderr")[1] == ["to-err"]
    assert read(srv, execution=cell.n, stream="stdout")[1] == ["to-out"]
    assert sorted(read(srv, execution=cell.n)[1]) == ["to-err", "to-out"]


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


def test_input_fails_at_once(srv):
    cell = run_cell(srv, "name = input('name? ')")
    assert cell.state == "error", cell.text


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


def test_token_limit_counts_tokens(srv):
    few_tokens = run(srv, "print('word ' * 2000)")  # 10,001 characters, about 2,000 tokens
    assert few_tokens.body == ["word " * 2000]
    many_tokens = run(srv, "print(' '.join(str(i * 7919 % 100003) for i in range(3000)))")  # 17,664 chars, ~9k tokens
    assert "output omitted" in many_tokens.text and "5,000-token" in many_tokens.text


# --------------------------------------------------------------------------- the cell header


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
        text, is_error, _ = srv.call("run_cell", {"code": f"{header}\nheader_side_effect = True"})
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


# --------------------------------------------------------------------------- running cells


def test_busy(srv):
    cell = run_cell(srv, "%%loommux --wait 0.1\nimport time\ntime.sleep(2)")
    assert cell.state == "running"
    text = tool_error(srv, "run_cell", {"code": "busy_side_effect = 1"}, "busy")
    assert f"execution {cell.n}" in text
    assert finish(srv, cell).state == "completed"
    nxt = run(srv, "'busy_side_effect' in globals()")
    assert nxt.n == cell.n + 1 and nxt.body == [f"Out[{nxt.n}]: False"]


def test_running_notice_and_status_while_busy(srv):
    cell = run_cell(srv, "%%loommux --wait 1\nimport time\nfor i in range(3):\n    print(f'tick-{i}', flush=True)\n"
                         "time.sleep(30)")
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


def test_interrupt(srv):
    cell = run_cell(srv, "%%loommux --wait 0.3\nwhile True: pass")
    assert cell.state == "running"
    text, is_error, _ = srv.call("interrupt")
    assert not is_error and text.startswith("interrupt_sent:") and f"execution {cell.n}" in text
    done = finish(srv, cell, timeout=30)
    assert done.state == "interrupted" and "KeyboardInterrupt" in done.text
    assert srv.call("execution_status", {"execution": cell.n})[0].startswith(f"[execution {cell.n} · interrupted]")
    text, is_error, _ = srv.call("interrupt")
    assert not is_error and text.startswith("idle:")


def test_wait_does_not_delay_later_requests(srv):
    cell = run_cell(srv, "%%loommux --wait 0.2\nimport time\nprint('started', flush=True)\ntime.sleep(30)")
    assert cell.state == "running"
    waiting = srv.send_request("tools/call", {"name": "wait", "arguments": {"execution": cell.n, "timeout_seconds": 30}})
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


def test_defaults_select_most_recent(srv):
    cell = run(srv, "print('most recent')")
    assert Cell.parse(srv.call("wait")[0]).body == ["most recent"]
    assert read(srv)[1] == ["most recent"]
    assert srv.call("execution_status")[0].startswith(f"[execution {cell.n} · completed]")
    assert matched_numbers(search(srv, "recent")[1]) == [1]


# --------------------------------------------------------------------------- long outputs


def test_long_output_is_omitted_with_next_calls(srv, twenty_k):
    text = twenty_k.text
    assert twenty_k.state == "completed"
    assert re.search(r"\[output omitted: 20,000 lines · [\d,]+ characters · [\d.]+ (B|KiB|MiB|GiB)", text), text
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
    assert "regex" in header and "10,000 matching lines (first 500 shown)" in header and "10,000 matches" in header
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


# --------------------------------------------------------------------------- fresh servers


def test_numbering_restart_and_leftover_processes(spawn):
    s = spawn()
    for tool, args in [("read_output", {}), ("wait", {}), ("execution_status", {}), ("search_output", {"query": "x"})]:
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
    assert not is_error and text.startswith("restarted:") and re.search(r"execution 3\b.*\bkilled", text), text
    new_kernel = int(re.search(r"new kernel pid (\d+)", text)[1])
    s.tracked_pids.add(new_kernel)
    assert new_kernel != old_kernel and f"was {old_kernel}" in text
    assert gone(old_kernel) and gone(child)
    assert s.kernel_pid() == new_kernel

    assert Cell.parse(s.call("wait", {"execution": 3})[0]).state == "killed"
    assert s.call("execution_status", {"execution": 3})[0].startswith("[execution 3 · killed]")
    after = run(s, "survivor")
    assert (after.n, after.state) == (4, "error") and "NameError" in after.text
    assert read(s, execution=2)[1] == [str(child)]  # records survive a restart

    text, is_error, _ = s.call("restart")
    assert not is_error and text.startswith("restarted:") and "killed" not in text
    assert run(s, "1 + 1").body == ["Out[5]: 2"]


def statuses_until_replaced(server: StdioServer, old_kernel: int, timeout: float = 30.0) -> list[str]:
    """Poll `status` until a kernel other than `old_kernel` is idle; return every status text seen."""
    texts: list[str] = []

    def replaced() -> bool:
        texts.append(server.call("status")[0])
        m = re.search(r"kernel: pid (\d+) · idle", texts[-1])
        return bool(m) and int(m[1]) != old_kernel

    assert wait_until(replaced, timeout, interval=0.3), texts[-3:]
    return texts


def test_kernel_death_is_noticed_and_replaced(spawn):
    s = spawn()
    first_kernel = s.kernel_pid()
    run(s, "x_before = 1")
    cell = run_cell(s, "import os\nos._exit(3)")
    assert (cell.n, cell.state) == (2, "killed") and "kernel exited with code 3" in cell.text
    texts = [cell.text, *statuses_until_replaced(s, first_kernel)]
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


def kernel_connection_file(kernel_pid: int) -> Path:
    args = Path(f"/proc/{kernel_pid}/cmdline").read_bytes().split(b"\0")
    return Path(os.fsdecode(args[args.index(b"-f") + 1]))


@needs_proc
def test_eof_shutdown_leaves_nothing_behind(spawn):
    s = spawn()
    kernel = s.kernel_pid()
    connection_file = kernel_connection_file(kernel)
    connection = json.loads(connection_file.read_text())
    assert connection["transport"] == "ipc" and connection["key"]
    assert connection["signature_scheme"] == "hmac-sha256"
    child = child_pid_of(s, run(s, SLEEP_CHILD))
    below = descendants(s.proc.pid)
    assert {kernel, child} <= below
    s.tracked_pids |= below
    assert s.close(timeout=5) == 0
    assert all_gone(below, 5) == []
    assert not connection_file.parent.exists()


@needs_proc
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_shutdown(spawn, sig):
    s = spawn()
    kernel = s.kernel_pid()
    child = child_pid_of(s, run(s, SLEEP_CHILD))
    below = descendants(s.proc.pid)
    assert {kernel, child} <= below
    s.tracked_pids |= below
    s.proc.send_signal(sig)
    assert s.proc.wait(timeout=5) == 0
    assert all_gone(below, 5) == []


@needs_proc
def test_kernel_follows_a_sigkilled_server(spawn):
    s = spawn()
    kernels = descendants(s.proc.pid)
    assert s.kernel_pid() in kernels
    s.tracked_pids |= kernels
    s.proc.kill()
    s.proc.wait()
    assert all_gone(kernels, 15) == []


def test_version_negotiation_and_discover_before_initialize(spawn):
    versions = [*PROTOCOL_VERSIONS, "1999-01-01"]
    servers = [spawn(initialize=False) for _ in versions]
    probe = servers[-1].request("server/discover", {"_meta": {}}, timeout=60)
    assert probe["error"]["code"] == -32601
    assert servers[-1].result("ping", timeout=60) == {}
    for server, version in zip(servers, versions):
        expected = version if version in PROTOCOL_VERSIONS else LATEST
        assert server.initialize(version)["protocolVersion"] == expected
    for server in servers:
        server.proc.stdin.close()
    for server in servers:
        assert server.proc.wait(15) == 0


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
        s.send_request("initialize", {"protocolVersion": LATEST, "capabilities": {},
                                      "clientInfo": {"name": "t", "version": "0"}})
    except OSError:
        pass
    assert s.proc.wait(60) != 0
    assert not s.responses
    stderr = s.stderr_tail()
    assert any(word in stderr for word in (config.name, "LOOMMUX_WORKSPACE_CONFIG", "resolve_workspace")), stderr


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
    tool_error(s, "run_cell", {"code": "1"}, "kernel_unavailable")
    assert s.result("ping") == {}
    assert not s.call("status")[1]

    chosen.mkdir()
    text, is_error, _ = s.call("restart")
    assert not is_error and text.startswith("restarted:"), text
    s.kernel_pid()
    assert run(s, "1 + 1").body[-1].endswith(": 2")


def test_tokenizer_unavailable_names_the_cache_dir(spawn, tmp_path):
    broken = tmp_path / "broken-tiktoken"
    (broken / hashlib.sha1(O200K_URL.encode()).hexdigest()).mkdir(parents=True)  # unreadable cache entry
    s = spawn(TIKTOKEN_CACHE_DIR=str(broken))
    assert run(s, "print('small')").body == ["small"]  # small outputs never need the tokenizer
    text = tool_error(s, "run_cell", {"code": "print('word ' * 2000)"}, "tokenizer_unavailable")
    assert "TIKTOKEN_CACHE_DIR" in text
    s.call("wait", {"timeout_seconds": 30})
    assert read(s, execution=2)[1] == ["word " * 2000]  # the output itself is kept


# --------------------------------------------------------------------------- official SDK client


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
        assert client.protocol_version == LATEST and client.server_info.name == "loommux"
        assert {t.name for t in (await client.list_tools()).tools} == TOOLS

        result = await client.call_tool("run_cell", {"code": "sdk_value = 6 * 7\nsdk_value"})
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
