"""What the bench scripts share: loommux child processes and their clients, checks, timing, tables.

Imported as ``benchlib`` by the scripts beside it (``python bench/X.py`` puts ``bench/`` on sys.path).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import py_compile
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SERVER = REPO / "loommux.py"
TIKTOKEN_DIR = REPO.parent / "shared" / "tiktoken"
# How a server is started: as the installed ``loommux`` command, or as ``python loommux.py``.
LAUNCHES = {"installed": "installed loommux", "script": "python loommux.py"}

PROTOCOL_VERSION = "2025-11-25"  # the handshake era of MCP
STATELESS_VERSION = "2026-07-28"  # the stateless era: each request carries its envelope
STATELESS_ENVELOPE = {"io.modelcontextprotocol/protocolVersion": STATELESS_VERSION,
                      "io.modelcontextprotocol/clientCapabilities": {},
                      "io.modelcontextprotocol/clientInfo": {"name": "loommux-bench", "version": "0"}}
TIMEOUT = 120.0  # default for any one request, and for a server to come up
STOP_TIMEOUT = 30.0  # seconds a server gets to exit before SIGKILL
LISTENING = re.compile(r"loommux: listening on http://127\.0\.0\.1:(\d+)/mcp")

sys.path.insert(0, str(REPO))
from loommux import list_descendants  # the server's own /proc walk (this checkout's)


class BenchError(RuntimeError):
    pass


# --------------------------------------------------------------------------- timing and the table


def timed(fn, *args):
    """(seconds, value) of ``fn(*args)``."""
    start = time.perf_counter()
    value = fn(*args)
    return time.perf_counter() - start, value


async def timed_async(awaitable: Awaitable):
    """(seconds, value) of awaiting ``awaitable``."""
    start = time.perf_counter()
    value = await awaitable
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


def compared(label: str, ours: float, theirs: float, target: float | None,
             miss: str = "MISS") -> tuple[str, ...]:
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


def proc_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of one process (its children not included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> set[int]:
    """``pid``'s descendants, read from /proc (kernels and their launchers are below the server)."""
    return set(list_descendants(pid))


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


_compiled: set[Path] = set()


def server_command(server: Path = SERVER, launch: str = "script") -> list[str]:
    """The command that starts loommux from ``server`` (a loommux.py). ``script``: ``python loommux.py``,
    which compiles the whole file on every start. ``installed``: what the ``loommux`` console script does,
    import the module (its bytecode cached beside it) and call main(); the bytecode is written here first,
    as pip does at install, since this environment may forbid Python to write it."""
    if launch == "script":
        return [sys.executable, str(server)]
    if server not in _compiled:
        py_compile.compile(str(server), doraise=True)
        _compiled.add(server)
    code = (f"import sys; sys.path.insert(0, {str(server.parent)!r}); from loommux import main; "
            "sys.exit(main())")
    return [sys.executable, "-c", code]


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
            problems.append(f"server {self.proc.pid} had exited before it was stopped "
                            f"(code {self.proc.returncode})")
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


def jsonrpc_request(id: int, method: str, params: dict) -> dict:
    return {"jsonrpc": "2.0", "id": id, "method": method, "params": params}


INITIALIZED = {"jsonrpc": "2.0", "method": "notifications/initialized"}
MCP_ACCEPT = "application/json, text/event-stream"


def reply_in(body: bytes, content_type: str, request_id) -> dict | None:
    """The JSON-RPC reply to request ``request_id`` in an HTTP response body, JSON or an SSE stream."""
    if content_type.startswith("text/event-stream"):
        events = [json.loads(line[5:]) for line in body.decode().splitlines() if line.startswith("data:")]
        return next((e for e in events if e.get("id") == request_id), None)
    return json.loads(body) if body else None


class StdioServer(Child):
    """``python loommux.py`` (or another copy of it, or started as ``launch`` says), spoken to with
    newline-delimited JSON-RPC."""

    def __init__(self, workspace: str, env: dict[str, str] | None = None, server: Path = SERVER,
                 timeout: float = TIMEOUT, launch: str = "script") -> None:
        super().__init__(subprocess.Popen(
            server_command(server, launch), cwd=workspace, env=server_env() if env is None else env,
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
        self.send(jsonrpc_request(self._next_id, method, params))
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
        self.send(INITIALIZED)

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
    """``python loommux.py --server --port 0`` (or started as ``launch`` says); its port is read from its
    stderr."""

    def __init__(self, workspace: str, env: dict[str, str] | None = None, launch: str = "script",
                 args: tuple[str, ...] = ()) -> None:
        super().__init__(subprocess.Popen(
            [*server_command(SERVER, launch), "--server", "--host", "127.0.0.1", "--port", "0", *args],
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
            "Accept": MCP_ACCEPT, "Content-Type": "application/json", **headers,
        })
        response = self.conn.getresponse()
        return response, reply_in(response.read(), response.getheader("Content-Type", ""), message.get("id"))

    def get_json(self, path: str) -> dict:
        """A GET of the control API (``/api/...``), its JSON body."""
        self.conn.request("GET", path)
        response = self.conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise BenchError(f"GET {path}: HTTP {response.status}: {body[:200]!r}")
        return json.loads(body)

    def request(self, method: str, params: dict,
                headers: dict[str, str]) -> tuple[http.client.HTTPResponse, dict]:
        self._next_id += 1
        message = jsonrpc_request(self._next_id, method, params)
        response, reply = self.post(message, headers)
        if response.status != 200 or reply is None or "error" in reply:
            raise BenchError(f"{method}: HTTP {response.status}: {reply}")
        return response, reply["result"]

    def close(self) -> None:
        self.conn.close()


class StatelessClient(HttpClient):
    """2026-07-28 tool calls on one kept-alive connection (to nginx or to an instance)."""

    def call_tool(self, name: str, arguments: dict) -> tuple[str, bool]:
        """(text, isError) of a tool call."""
        headers = {"MCP-Protocol-Version": STATELESS_VERSION, "Mcp-Method": "tools/call", "Mcp-Name": name}
        if "kernel" in arguments:
            headers["Mcp-Param-Kernel"] = arguments["kernel"]
        _, result = self.request("tools/call", {**tool_params(name, arguments), "_meta": STATELESS_ENVELOPE},
                                 headers)
        return tool_text(result)

    def call(self, name: str, arguments: dict) -> str:
        """A tool's text; an error result raises."""
        text, is_error = self.call_tool(name, arguments)
        if is_error:
            raise BenchError(f"{name}: {text[:300]!r}")
        return text


class HttpSession(HttpClient):
    """A handshake session: ``initialize``, then ``Mcp-Session-Id`` on every request; ``headers`` (such as
    ``X-Loommux-Resource``) go with every request, ``initialize`` included."""

    def __init__(self, server: HttpServer, client_name: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(server)
        response, _ = self.request("initialize", initialize_params(client_name), dict(headers or {}))
        session_id = response.getheader("Mcp-Session-Id")
        if not session_id:
            raise BenchError("initialize: no Mcp-Session-Id header in the response")
        self.headers = {**(headers or {}), "Mcp-Session-Id": session_id,
                        "MCP-Protocol-Version": PROTOCOL_VERSION}
        response, _ = self.post(INITIALIZED, self.headers)
        if response.status != 202:
            raise BenchError(f"notifications/initialized: HTTP {response.status}, expected 202")

    def call(self, name: str, arguments: dict) -> dict:
        return self.request("tools/call", tool_params(name, arguments), self.headers)[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


GATEWAY_START_TIMEOUT = 60.0


class Gateway(Child):
    """A Jupyter Kernel Gateway child process on an ephemeral 127.0.0.1 port, without a token
    (jupyter_server's gateway client opens its channels WebSocket without the token header), its IOPub rate
    limit off as README tells operators; SIGTERM stops its kernels too."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        with open(log_path, "wb") as log:
            super().__init__(subprocess.Popen(
                [sys.executable, "-m", "kernel_gateway", "--KernelGatewayApp.ip=127.0.0.1",
                 f"--KernelGatewayApp.port={self.port}", "--KernelGatewayApp.port_retries=0",
                 "--ZMQChannelsWebsocketConnection.limit_rate=False",
                 "--JupyterWebsocketPersonality.list_kernels=True"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
            ))
        deadline = time.monotonic() + GATEWAY_START_TIMEOUT
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise BenchError(f"the gateway did not start:\n{log_path.read_text()[-2000:]}")
            time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kernels(self) -> set[str]:
        """The ids of the kernels the gateway runs."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT)
        try:
            conn.request("GET", "/api/kernels")
            return {kernel["id"] for kernel in json.loads(conn.getresponse().read())}
        finally:
            conn.close()

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"GET /api HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                return s.recv(64).startswith(b"HTTP/1.1 200")
        except OSError:
            return False


# --------------------------------------------------------------------------- the same over asyncio
# For benches that keep many sessions in flight at once from one event loop (bench/http_load.py).

ROUTINE_STDERR = re.compile(r"^loommux: (listening on |retired resource )")


def kernel_children(pid: int) -> set[int]:
    """Pids of the kernel processes (ipykernel launchers) whose parent is ``pid``."""
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


class AsyncChild:
    """A loommux child process on asyncio whose stderr is kept (and drained so the pipe never fills)."""

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
            stdin=pipe if stdio else asyncio.subprocess.DEVNULL,
            stdout=pipe if stdio else asyncio.subprocess.DEVNULL,
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
            raise BenchError(f"{self.label} did not print its listening line within "
                             f"{TIMEOUT:.0f} s") from None

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
                await asyncio.wait_for(self.proc.wait(), STOP_TIMEOUT)
            except asyncio.TimeoutError:
                self.stderr.append(f"(bench: no exit {STOP_TIMEOUT:.0f} s after SIGTERM; sent SIGKILL)")
                self.proc.kill()
                await self.proc.wait()
        if self._drain is not None:
            await self._drain
        return self.proc.returncode

    def unexpected_stderr(self) -> list[str]:
        return [line for line in self.stderr if not ROUTINE_STDERR.search(line)]


async def start_async_server(label: str, workspace: str, spares: int | None = None) -> tuple[AsyncChild, int]:
    """``python loommux.py --server --port 0`` on asyncio, and its port."""
    child = AsyncChild(label)
    await child.spawn(["--server", "--host", "127.0.0.1", "--port", "0"], workspace, spares, stdio=False)
    return child, await child.port()


class AsyncHttpSession:
    """One MCP handshake session over one raw HTTP/1.1 keep-alive connection, on asyncio streams."""

    def __init__(self, port: int, client_name: str, resource: str | None = None) -> None:
        self.port = port
        self.client_name = client_name
        self.resource = resource
        self.session_id: str | None = None
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.next_id = 0
        self.connects = 0

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port, limit=64 << 20)
        self.connects += 1

    async def exchange(self, method: str, body: bytes = b"", headers: dict[str, str] | None = None):
        """Send one request; return (status, headers, body). Reconnects only if the server closed."""
        if self.writer is None or self.writer.is_closing():
            await self._connect()
        head = {"Host": f"127.0.0.1:{self.port}", "Accept": MCP_ACCEPT}
        if body:
            head["Content-Type"] = "application/json"
        head["Content-Length"] = str(len(body))
        if self.session_id:
            head["Mcp-Session-Id"] = self.session_id
            head["MCP-Protocol-Version"] = PROTOCOL_VERSION
        head.update(headers or {})
        lines = [f"{method} /mcp HTTP/1.1", *(f"{k}: {v}" for k, v in head.items())]
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

    async def post(self, message: dict,
                   headers: dict[str, str] | None = None) -> tuple[int, dict, dict | None]:
        status, response_headers, body = await self.exchange("POST", json.dumps(message).encode(), headers)
        return status, response_headers, reply_in(body, response_headers.get("content-type", ""),
                                                  message.get("id"))

    async def request(self, method: str, params: dict,
                      headers: dict[str, str] | None = None) -> tuple[dict, dict]:
        self.next_id += 1
        status, response_headers, reply = await self.post(jsonrpc_request(self.next_id, method, params),
                                                          headers)
        if status != 200 or reply is None or "error" in reply:
            raise BenchError(f"{method}: HTTP {status}: {reply}")
        return reply["result"], response_headers

    async def initialize(self) -> None:
        extra = {"X-Loommux-Resource": self.resource} if self.resource else {}
        _, headers = await self.request("initialize", initialize_params(self.client_name), extra)
        self.session_id = headers.get("mcp-session-id")
        if not self.session_id:
            raise BenchError("initialize: no Mcp-Session-Id header in the response")
        status, _, _ = await self.post(INITIALIZED)
        if status != 202:
            raise BenchError(f"notifications/initialized: HTTP {status}, expected 202")

    async def run_cell(self, code: str) -> tuple[str, bool]:
        """(text, isError) of run_cell."""
        result, _ = await self.request("tools/call", tool_params("run_cell", {"freeform": code}))
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


class AsyncStdioSession:
    """``python loommux.py`` on asyncio, spoken to with newline-delimited JSON-RPC on stdin/stdout."""

    def __init__(self, client_name: str) -> None:
        self.client_name = client_name
        self.child = AsyncChild("stdio server")
        self.next_id = 0

    async def start(self, workspace: str) -> None:
        await self.child.spawn([], workspace, None, stdio=True)
        await self.request("initialize", initialize_params(self.client_name))
        await self._send(INITIALIZED)

    async def _send(self, message: dict) -> None:
        self.child.proc.stdin.write(json.dumps(message).encode() + b"\n")
        await self.child.proc.stdin.drain()

    async def request(self, method: str, params: dict) -> dict:
        self.next_id += 1
        await self._send(jsonrpc_request(self.next_id, method, params))
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
        result = await self.request("tools/call", tool_params("run_cell", {"freeform": code}))
        return tool_text(result)


# --------------------------------------------------------------------------- nginx, README's configuration
# Shared with test_loommux.py, which runs the same configuration.

NGINX = Path("/usr/sbin/nginx")  # Debian's
README_PORTS = {"nginx": 8700, "a": 8701, "b": 8702, "c": 8703}  # what README's configuration uses


def readme_nginx_config() -> str:
    """The nginx configuration README's "Several instances" ships, exactly as written there."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Several instances\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```nginx\n(.*?)```", section, re.DOTALL)[1]


def unique_map_keys(config: str) -> str:
    """With fewer instances than README names, ports repeat; a map lists a key once: keep the first."""
    lines, seen = [], set()
    for line in config.splitlines():
        key = re.match(r"\s+(127\.0\.0\.1:\d+)\s+\S+;$", line)
        if key and key[1] in seen:
            continue
        seen |= {key[1]} if key else set()
        lines.append(line)
    return "\n".join(lines) + "\n"


def nginx_command(base: Path, listen: int, ports: dict[str, int]) -> list[str]:
    """Write README's configuration, verbatim but for its ports (nginx's own, ``listen``; each instance's,
    ``ports``), into ``base`` inside a main configuration of its own (pid, logs and temporary files there, in
    the foreground), and return the command that runs nginx as this user with it."""
    config = readme_nginx_config().replace(f"127.0.0.1:{README_PORTS['nginx']};", f"127.0.0.1:{listen};")
    for name, port in ports.items():
        config = config.replace(f"127.0.0.1:{README_PORTS[name]}", f"127.0.0.1:{port}")
    (base / "loommux.conf").write_text(unique_map_keys(config))
    kinds = ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    temp = " ".join(f"{kind}_temp_path {base / kind};" for kind in kinds)
    (base / "nginx.conf").write_text(
        f"daemon off;\npid {base / 'nginx.pid'};\nerror_log {base / 'error.log'};\n"
        f"events {{ worker_connections 4096; }}\n"
        f"http {{ access_log off; {temp} include {base / 'loommux.conf'}; }}\n")
    return [str(NGINX), "-p", str(base), "-c", str(base / "nginx.conf"), "-e", str(base / "error.log")]
