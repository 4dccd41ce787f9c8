"""Measure MCP tasks (the 2026-07-28 extension io.modelcontextprotocol/tasks), side by side in one run.

1. stdio, one ``python loommux.py`` process, its one kernel: the ``run_cell(freeform="1+1")`` round trip
   of a 2026-07-28 request that declares the tasks extension against one that does not, alternating
   call by call (a cell that ends in time answers with the plain result either way: the declaration
   may cost nothing measurable). Every result is checked.
2. HTTP, one ``loommux.py --server`` process: a 5 s cell becomes a task; one client holds a
   ``subscriptions/listen`` stream for it (``notifications/tasks``), another polls ``tasks/get`` at the
   ``pollIntervalMs`` each answer gives, and a third (for comparison, no tasks) waits in a plain ``wait``.
   The cell's end is its execution record's ``completed_at`` (the moment the kernel reported it, with
   its output and reply), on the same clock as the clients; each delay is how long after that a client
   held the result. The listener should hold it within 5 ms (the median of the runs: the machine is
   shared), the poller within the interval in force + 5 ms (in every run: a bound). The kernel's own part
   (from the cell's last statement, a ``time.time()``, to its report) is the same for every client and is
   shown apart.

Every server is stopped the way a client stops it (EOF on stdio, SIGTERM over HTTP); a server that does
not exit, exits with an error, or leaves a descendant process running is reported as a failure.

    .venv/bin/python bench/tasks.py [--repeat 400] [--runs 5]
"""

from __future__ import annotations

import argparse
import datetime
import http.client
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import threading
import time

from benchlib import (
    TIMEOUT,
    Bench,
    BenchError,
    HttpClient,
    HttpServer,
    StdioServer,
    compared,
    fmt_time,
    p95,
    run_and_report,
    tool_params,
    tool_text,
)

MODERN_VERSION = "2026-07-28"
TASKS = "io.modelcontextprotocol/tasks"
CLIENT_INFO = {"name": "loommux-bench-tasks", "version": "0"}


def envelope(declared: bool) -> dict:
    capabilities = {"extensions": {TASKS: {}}} if declared else {}
    return {"io.modelcontextprotocol/protocolVersion": MODERN_VERSION,
            "io.modelcontextprotocol/clientCapabilities": capabilities,
            "io.modelcontextprotocol/clientInfo": CLIENT_INFO}


WARMUP = 10  # uncounted calls per side before the counted ones
QUICK_CELL = "1+1"
QUICK_RESULT = re.compile(r"In \[(\d+)\] · [^\n]*:\nOut\[\1\]: 2")
CELL_SECONDS = 5
LONG_CELL = f"%%loommux --wait 0.5\nimport time\ntime.sleep({CELL_SECONDS})\ntime.time()"
ENDED_AT = re.compile(r"Out\[\d+\]: ([0-9.]+)$")
COMPLETED_AT = re.compile(r"^completed_at: (\S+)$", re.MULTILINE)
EXECUTION = re.compile(r"^In \[(\d+)\] running")
NOTIFY_TARGET = 0.005  # seconds from the cell's end to a listener holding the result
POLL_SLACK = 0.005  # and to a poller, beyond the interval it polls at
HTTP_HEADERS = {"MCP-Protocol-Version": MODERN_VERSION}


# --------------------------------------------------------------------------- 1. declared or not, stdio


def run_quick(server: StdioServer, declared: bool) -> None:
    result = server.request("tools/call", {**tool_params("run_cell", {"freeform": QUICK_CELL}),
                                           "_meta": envelope(declared)})
    text, is_error = tool_text(result)
    if is_error or result.get("resultType") != "complete" or not QUICK_RESULT.search(text):
        raise BenchError(f"unexpected run_cell result (declared={declared}): {result}")


def interleave(server: StdioServer, repeat: int) -> tuple[list[float], list[float]]:
    for _ in range(WARMUP):
        run_quick(server, True)
        run_quick(server, False)
    declared, plain = [], []
    for _ in range(repeat):
        for flag, trips in ((True, declared), (False, plain)):
            start = time.perf_counter()
            run_quick(server, flag)
            trips.append(time.perf_counter() - start)
    return declared, plain


# --------------------------------------------------------------------------- 2. a 5 s cell's task, HTTP


def last_statement(result: dict) -> float:
    """When the cell ran its last statement: the time.time() it shows."""
    text, is_error = tool_text(result)
    match = ENDED_AT.search(text)
    if is_error or not match:
        raise BenchError(f"unexpected task result: {text[:300]!r}")
    return float(match[1])


class Listener(threading.Thread):
    """A subscriptions/listen stream for one task: when it held the completed task."""

    def __init__(self, server: HttpServer, task_id: str) -> None:
        super().__init__(daemon=True)
        self.conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
        body = json.dumps({"jsonrpc": "2.0", "id": "listen", "method": "subscriptions/listen", "params": {
            "notifications": {"taskIds": [task_id]}, "_meta": envelope(True)}})
        self.conn.request("POST", "/mcp", body, {"Accept": "application/json, text/event-stream",
                                                 "Content-Type": "application/json", **HTTP_HEADERS,
                                                 "Mcp-Method": "subscriptions/listen"})
        self.response = self.conn.getresponse()
        self.acknowledged = threading.Event()
        self.held: tuple[float, dict] | None = None
        self.problem: str | None = None

    def run(self) -> None:
        try:
            while line := self.response.readline():
                if not line.startswith(b"data:"):
                    continue
                message = json.loads(line[5:])
                if message.get("method") == "notifications/subscriptions/acknowledged":
                    self.acknowledged.set()
                elif (message.get("method") == "notifications/tasks"
                      and message["params"]["status"] == "completed"):
                    self.held = time.time(), message["params"]["result"]
                    return
        except (OSError, ValueError, KeyError) as exc:
            self.problem = f"listen stream: {exc}"
        finally:
            self.acknowledged.set()
            self.conn.close()


class Waiter(threading.Thread):
    """A plain 2026-07-28 ``wait`` on the execution (no tasks): when it held the result."""

    def __init__(self, server: HttpServer, execution: int) -> None:
        super().__init__(daemon=True)
        self.client, self.execution = HttpClient(server), execution
        self.held: tuple[float, dict] | None = None
        self.problem: str | None = None

    def run(self) -> None:
        headers = {**HTTP_HEADERS, "Mcp-Method": "tools/call", "Mcp-Name": "wait"}
        try:
            _, result = self.client.request("tools/call", {**tool_params("wait", {
                "execution": self.execution, "timeout_seconds": TIMEOUT}), "_meta": envelope(False)}, headers)
            self.held = time.time(), result
        except (OSError, BenchError) as exc:
            self.problem = f"waiter: {exc}"
        finally:
            self.client.close()


class Poller(threading.Thread):
    """tasks/get at the pollIntervalMs each answer gives: when it held the completed task, and the interval
    in force then."""

    def __init__(self, server: HttpServer, task_id: str) -> None:
        super().__init__(daemon=True)
        self.client, self.task_id = HttpClient(server), task_id
        self.held: tuple[float, dict] | None = None
        self.interval = 0.0
        self.problem: str | None = None

    def run(self) -> None:
        headers = {**HTTP_HEADERS, "Mcp-Method": "tasks/get", "Mcp-Name": self.task_id}
        try:
            while True:
                _, task = self.client.request("tasks/get", {"taskId": self.task_id, "_meta": envelope(True)},
                                              headers)
                if task["status"] == "completed":
                    self.held = time.time(), task["result"]
                    return
                if task["status"] != "working":
                    raise BenchError(f"the task became {task['status']}")
                self.interval = task["pollIntervalMs"] / 1000
                time.sleep(self.interval)
        except (OSError, BenchError, KeyError) as exc:
            self.problem = f"poller: {exc}"
        finally:
            self.client.close()


def call(server: HttpServer, name: str, arguments: dict, declared: bool) -> dict:
    client = HttpClient(server)
    try:
        headers = {**HTTP_HEADERS, "Mcp-Method": "tools/call", "Mcp-Name": name}
        return client.request("tools/call", {**tool_params(name, arguments), "_meta": envelope(declared)},
                              headers)[1]
    finally:
        client.close()


def watch_one_task(server: HttpServer) -> dict[str, float]:
    """For one 5 s cell run as a task: each client's delay after the cell's end, the poll interval in force
    and the kernel's own part."""
    created = call(server, "run_cell", {"freeform": LONG_CELL}, declared=True)
    if created.get("resultType") != "task":
        raise BenchError(f"the 5 s cell did not become a task: {created}")
    execution = int(EXECUTION.match(created["statusMessage"])[1])
    listener, poller = Listener(server, created["taskId"]), Poller(server, created["taskId"])
    waiter = Waiter(server, execution)
    listener.start()
    listener.acknowledged.wait(TIMEOUT)
    poller.start()
    waiter.start()
    for thread in (listener, poller, waiter):
        thread.join(CELL_SECONDS + TIMEOUT)
        if thread.problem or thread.held is None:
            raise BenchError(thread.problem or "no completed task within the time allowed")
    results = [thread.held[1] for thread in (listener, poller, waiter)]
    if len({tool_text(result)[0] for result in results}) != 1:
        raise BenchError("the three clients hold different results")
    status = tool_text(call(server, "execution_status", {"execution": execution}, declared=False))[0]
    end = datetime.datetime.fromisoformat(COMPLETED_AT.search(status)[1].replace("Z", "+00:00")).timestamp()
    return {"notify": listener.held[0] - end, "poll": poller.held[0] - end, "interval": poller.interval,
            "wait": waiter.held[0] - end, "kernel": end - last_statement(results[0])}


# --------------------------------------------------------------------------- the bench


class TasksBench(Bench):
    strict = True

    def __init__(self, repeat: int, runs: int, workspace: str) -> None:
        super().__init__(workspace)
        self.repeat, self.runs = repeat, runs

    def stdio(self) -> None:
        server = StdioServer(self.workspace)
        self.alive.append(server)
        declared, plain = interleave(server, self.repeat)
        self.figures["median"] = statistics.median(declared), statistics.median(plain)
        self.figures["p95"] = p95(declared), p95(plain)
        self.stop_all()

    def http(self) -> None:
        server = HttpServer(self.workspace)
        self.alive.append(server)
        server.wait_listening()
        self.figures["tasks"] = [watch_one_task(server) for _ in range(self.runs)]
        self.stop_all()

    def steps(self) -> list:
        return [self.stdio, self.http]


def report(bench: TasksBench) -> list[tuple[str, ...]]:
    figures, runs = bench.figures, bench.figures["tasks"]
    rows = [("stdio, one process, one kernel", "declared", "not declared", "ratio", "goal", ""),
            compared(f"round trip 1+1, median of {bench.repeat}", *figures["median"], 1.02),
            compared(f"round trip 1+1, p95 of {bench.repeat}", *figures["p95"], None),
            ("", "", "", "", "", ""),
            (f"HTTP, a {CELL_SECONDS} s cell as a task, {bench.runs} runs", "median", "max", "goal", "", "")]
    interval = max(run["interval"] for run in runs)
    for label, key, target, judged in (
            ("cell's end → held via notifications/tasks", "notify", NOTIFY_TARGET, statistics.median),
            (f"cell's end → held via tasks/get every {interval * 1000:.0f} ms", "poll",
             interval + POLL_SLACK, max),
            ("cell's end → held via a plain wait (no tasks)", "wait", None, None),
            ("cell's last statement → cell's end (the kernel)", "kernel", None, None)):
        delays = [run[key] for run in runs]
        goal = ("" if target is None
                else f"{'median' if judged is statistics.median else 'max'} ≤ {fmt_time(target)}")
        mark = "" if target is None else "ok" if judged(delays) <= target else "MISS"
        rows.append((label, fmt_time(statistics.median(delays)), fmt_time(max(delays)), goal, mark, ""))
    return rows


def check(bench: TasksBench) -> None:
    declared, plain = bench.figures["median"]
    if declared / plain > 1.02:
        bench.problems.append(f"1+1 with the extension declared took {declared / plain:.3f}× as long "
                              f"(goal ≤ 1.02×)")
    notified = statistics.median(run["notify"] for run in bench.figures["tasks"])
    if notified > NOTIFY_TARGET:
        bench.problems.append(f"the listener held the result {fmt_time(notified)} after the cell's end "
                              f"(median), more than {fmt_time(NOTIFY_TARGET)}")
    for number, run in enumerate(bench.figures["tasks"], 1):
        if run["poll"] > run["interval"] + POLL_SLACK:
            bench.problems.append(f"run {number}: the poller held the result {fmt_time(run['poll'])} "
                                  f"after the cell's end, more than its interval "
                                  f"{fmt_time(run['interval'])} + {fmt_time(POLL_SLACK)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=400, help="counted 1+1 round trips per side (400)")
    parser.add_argument("--runs", type=int, default=5, help=f"{CELL_SECONDS} s cells run as tasks (5)")
    args = parser.parse_args()
    if args.repeat < 1 or args.runs < 1:
        parser.error("--repeat and --runs must be at least 1")
    title = (f"loommux tasks bench · Python {platform.python_version()} · {os.cpu_count()} CPUs · "
             f"declared = the request declares {TASKS}; round trips alternate call by call after "
             f"{WARMUP} warm-up calls each")
    with tempfile.TemporaryDirectory(prefix="loommux-bench-tasks-") as workspace:
        bench = TasksBench(args.repeat, args.runs, workspace)

        def run() -> None:
            bench.run()
            check(bench)

        return run_and_report(run, bench.problems, title, lambda: report(bench))


if __name__ == "__main__":
    sys.exit(main())
