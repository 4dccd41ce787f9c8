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

    .venv/bin/python bench/stateless.py [--repeat 200]
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import statistics
import sys
import tempfile

from benchlib import (
    Bench,
    BenchError,
    HttpClient,
    HttpServer,
    HttpSession,
    StdioServer,
    fmt_time,
    p95,
    run_and_report,
    timed,
    tool_params,
    tool_text,
)

MODERN_VERSION = "2026-07-28"
CLIENT_NAME = "loommux-bench-stateless"
ENVELOPE = {
    "io.modelcontextprotocol/protocolVersion": MODERN_VERSION,
    "io.modelcontextprotocol/clientCapabilities": {},
    "io.modelcontextprotocol/clientInfo": {"name": CLIENT_NAME, "version": "0"},
}
WARMUP = 10  # uncounted calls per side before the counted ones

CELL = "1+1"
RESULT = re.compile(r"In \[(\d+)\] · [^\n]*:\nOut\[\1\]: 2")
STATUS_RESOURCE = re.compile(r"^resource: (\S+)", re.MULTILINE)
STATUS_KERNEL = re.compile(r"^kernel: pid (\S+)", re.MULTILINE)
SHARED_KERNEL = "default"  # where a 2026-07-28 HTTP call without ``kernel`` runs


# --------------------------------------------------------------------------- clients, one per era


class Client:
    """What both eras offer on either transport; ``call`` is the one thing each client does its way."""

    stateless = False  # only 2026-07-28 results carry ``resultType``

    def call(self, name: str, arguments: dict) -> dict:
        raise NotImplementedError

    def tool_text(self, name: str, arguments: dict) -> str:
        """A tool's text, after checking that it is no error and of this client's era."""
        result = self.call(name, arguments)
        text, is_error = tool_text(result)
        if is_error:
            raise BenchError(f"{name}: {text[:400]!r}")
        era = result.get("resultType")
        if era != ("complete" if self.stateless else None):
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
        server.initialize(CLIENT_NAME)

    def call(self, name: str, arguments: dict) -> dict:
        return self.server.call(name, arguments)


class StdioStateless(Client):
    """Stateless 2026-07-28 requests on a stdio server: the envelope in every ``params._meta``."""

    stateless = True

    def __init__(self, server: StdioServer) -> None:
        self.server = server

    def call(self, name: str, arguments: dict) -> dict:
        return self.server.request("tools/call", {**tool_params(name, arguments), "_meta": ENVELOPE})


class HttpHandshake(HttpSession, Client):
    """A handshake session over HTTP, with its own private kernel."""

    def __init__(self, server: HttpServer) -> None:
        super().__init__(server, CLIENT_NAME)


class HttpStateless(HttpClient, Client):
    """Stateless 2026-07-28 requests: the envelope and the routing headers, no session.

    No call passes ``kernel``, so none sends ``Mcp-Param-Kernel``; the calls run in ``default``."""

    stateless = True

    def call(self, name: str, arguments: dict) -> dict:
        headers = {"MCP-Protocol-Version": MODERN_VERSION, "Mcp-Method": "tools/call", "Mcp-Name": name}
        response, result = self.request("tools/call", {**tool_params(name, arguments), "_meta": ENVELOPE},
                                        headers)
        if response.getheader("Mcp-Session-Id"):
            raise BenchError("a 2026-07-28 request was given an Mcp-Session-Id")
        return result


# --------------------------------------------------------------------------- measuring


def interleave(stateless: Client, handshake: Client, repeat: int) -> tuple[list[float], list[float]]:
    """Time ``run_cell(CELL)`` on both clients alternately, after WARMUP calls each (the first call
    of a side may start its kernel)."""
    for _ in range(WARMUP):
        stateless.run_cell(CELL)
        handshake.run_cell(CELL)
    trips_stateless, trips_handshake = [], []
    for _ in range(repeat):
        for client, trips in ((stateless, trips_stateless), (handshake, trips_handshake)):
            trips.append(timed(client.run_cell, CELL)[0])
    return trips_stateless, trips_handshake


def summarize(trips: tuple[list[float], list[float]]) -> dict[str, tuple[float, float]]:
    stateless, handshake = trips
    return {
        "median": (statistics.median(stateless), statistics.median(handshake)),
        "p95": (p95(stateless), p95(handshake)),
    }


class StatelessBench(Bench):
    strict = True

    def __init__(self, repeat: int, workspace: str) -> None:
        super().__init__(workspace)
        self.repeat = repeat

    def stdio(self) -> None:
        server = StdioServer(self.workspace)
        self.alive.append(server)
        handshake, stateless = StdioHandshake(server), StdioStateless(server)
        self.figures["stdio"] = summarize(interleave(stateless, handshake, self.repeat))
        kernels = stateless.kernel(), handshake.kernel()
        if kernels[0] != kernels[1]:
            self.problems.append(f"stdio: the two eras ran in different kernels: {kernels}")
        self.stop_all()

    def http(self) -> None:
        server = HttpServer(self.workspace)
        self.alive.append(server)
        server.wait_listening()
        handshake, stateless = HttpHandshake(server), HttpStateless(server)
        try:
            self.figures["http"] = summarize(interleave(stateless, handshake, self.repeat))
            placed = stateless.kernel()[0], handshake.kernel()[0]
            if placed != (SHARED_KERNEL, "private"):
                self.problems.append(f"HTTP: calls ran in {placed}, not ({SHARED_KERNEL!r}, 'private')")
        finally:
            handshake.close()
            stateless.close()
        self.stop_all()

    def steps(self) -> list:
        return [self.stdio, self.http]


# --------------------------------------------------------------------------- report


def report(figures: dict[str, dict[str, tuple[float, float]]], repeat: int) -> list[tuple[str, ...]]:
    def compared(transport: str, statistic: str) -> tuple[str, ...]:
        stateless, handshake = figures[transport][statistic]
        return (f"round trip 1+1, {statistic} of {repeat}", fmt_time(stateless), fmt_time(handshake),
                f"{stateless / handshake:.2f}×")

    return [
        ("stdio, one process, one kernel", MODERN_VERSION, "handshake", "ratio"),
        compared("stdio", "median"),
        compared("stdio", "p95"),
        ("", "", "", ""),
        ("HTTP, keep-alive connections", f"{MODERN_VERSION} ({SHARED_KERNEL})", "session (private)", "ratio"),
        compared("http", "median"),
        compared("http", "p95"),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200, help="counted round trips per side (200)")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")

    title = (
        f"loommux MCP-era bench · Python {platform.python_version()} · {os.cpu_count()} CPUs · "
        f"ratio = {MODERN_VERSION} / handshake · round trips alternate call by call after {WARMUP} warm-up "
        "calls each"
    )
    with tempfile.TemporaryDirectory(prefix="loommux-bench-stateless-") as workspace:
        bench = StatelessBench(args.repeat, workspace)
        return run_and_report(bench.run, bench.problems, title, lambda: report(bench.figures, args.repeat))


if __name__ == "__main__":
    sys.exit(main())
