"""What the notebook mirror (--notebook) costs: loommux over stdio with the mirror on and off, side by side.

Two measures, each on a fresh pair of servers, the two sides alternated so that drift on the machine hits
both alike:

- the round trip of ``1+1`` (median of ``--repeat``, call by call);
- a session of ``--cells`` cells (batch by batch): the time the mirror spent rendering and writing the
  file until it holds every cell (its own count, in ``status``) as a share of the session's wall time
  (from its first cell to its last: both sessions run through the whole alternation), and the server's
  memory growth beside the mirror-less server's, as a multiple of the notebook's size;
- a cell of ``--displays`` small displays (mirror on only): the delay from its result to the file
  showing it completed with all its outputs.

    .venv/bin/python bench/notebook.py [--repeat 500] [--cells 10000] [--batch 100] [--displays 100000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchlib import BenchError, StdioServer, compared, fmt_time, proc_kib, run_and_report, server_env, timed

CLIENT_NAME = "loommux-bench-notebook"
TARGETS = {"round_trip": 1.02, "write_share": 0.01, "memory": 1.1, "displays_delay": 2.0}
CELL = "x = {i}\nprint('cell', x)\nx * 2"
DISPLAYS_CELL = "for i in range({n}):\n    display(i)"
POLL_SECONDS = 0.05  # how often the displays' notebook is looked at
WRITE_TIMEOUT = 300.0  # for the mirror's last write of the session (it waits its share of time)


class NotebookBench:
    def __init__(self, args: argparse.Namespace, scratch: str) -> None:
        self.args, self.scratch = args, Path(scratch)
        self.figures: dict = {}
        self.problems: list[str] = []
        self.alive: list[StdioServer] = []

    def pair(self, name: str) -> tuple[StdioServer, StdioServer, Path]:
        """A server without a mirror and one mirrored to a fresh file, both initialized."""
        workspace = self.scratch / name
        workspace.mkdir()
        notebook = workspace / f"{name}.ipynb"
        off = StdioServer(str(workspace),
                          env=server_env({"LOOMMUX_RESULT_MODE": "structured"}, drop_loommux=True))
        self.alive.append(off)
        on = StdioServer(str(workspace), env=server_env({"LOOMMUX_RESULT_MODE": "structured",
                                                         "LOOMMUX_NOTEBOOK": str(notebook)},
                                                        drop_loommux=True))
        self.alive.append(on)
        for server in (off, on):
            server.initialize(CLIENT_NAME)
        return off, on, notebook

    def stop(self, *servers: StdioServer) -> None:
        for server in servers:
            self.alive.remove(server)
            server.stop(self.problems, check_exit=True)

    def round_trips(self) -> None:
        off, on, _ = self.pair("round-trip")
        cell = ("run_cell", {"freeform": "1+1"})
        for _ in range(20):
            off.tool(*cell)
            on.tool(*cell)
        trips = {on: [], off: []}
        for i in range(self.args.repeat):
            for server in (on, off) if i % 2 else (off, on):  # neither side always goes first
                trips[server].append(timed(server.tool, *cell)[0])
        trips_on, trips_off = trips[on], trips[off]
        self.figures["round_trip"] = statistics.median(trips_on), statistics.median(trips_off)
        self.stop(off, on)

    def session(self) -> None:
        off, on, notebook = self.pair("session")
        for server in (off, on):
            server.tool("run_cell", {"freeform": "import gc"})  # the kernels are up before memory is read
        rss_start = {server: proc_kib(server.proc.pid) for server in (off, on)}
        wall = {off: 0.0, on: 0.0}
        cells = self.args.cells - 1
        started = time.perf_counter()
        for first in range(0, cells, self.args.batch):
            for server in (on, off):
                for i in range(first, min(cells, first + self.args.batch)):
                    elapsed, _ = timed(server.tool, "run_cell", {"freeform": CELL.format(i=i)})
                    wall[server] += elapsed
        span = time.perf_counter() - started
        deadline = time.monotonic() + WRITE_TIMEOUT
        # its next write: all of them
        while len(json.loads(notebook.read_bytes())["cells"]) < self.args.cells:
            if time.monotonic() > deadline:
                raise BenchError(f"the notebook does not hold all {self.args.cells} cells "
                                 f"after {WRITE_TIMEOUT} s")
            time.sleep(0.5)
        status = on.call("status", {})["structuredContent"]["notebook"]
        growth = {server: (proc_kib(server.proc.pid) - rss_start[server]) * 1024 for server in (off, on)}
        self.stop(off, on)
        size = notebook.stat().st_size
        written = json.loads(notebook.read_bytes())
        if len(written["cells"]) != self.args.cells:
            self.problems.append(f"the notebook has {len(written['cells'])} cells, not {self.args.cells}")
        self.figures.update(wall=(wall[on], wall[off]), span=span, write_seconds=status["write_seconds"],
                            writes=status["writes"], size=size, growth=(growth[on], growth[off]))

    def displays(self) -> None:
        """A cell of many small displays: from its result to the file showing it completed, in full."""
        off, on, notebook = self.pair("displays")
        on.run_to_end({"freeform": "1+1"})
        on.run_to_end({"freeform": DISPLAYS_CELL.format(n=self.args.displays)})
        result_at = time.perf_counter()
        deadline, seen = time.monotonic() + WRITE_TIMEOUT, None
        while True:
            if time.monotonic() > deadline:
                raise BenchError(f"the notebook does not show the displays' cell after {WRITE_TIMEOUT} s")
            stamp = notebook.stat().st_mtime_ns if notebook.exists() else None
            if stamp != seen:
                seen, at = stamp, time.perf_counter()
                cell = json.loads(notebook.read_bytes())["cells"][-1]
                if (cell["metadata"]["loommux"]["state"] == "completed"
                        and len(cell["outputs"]) == self.args.displays):
                    break
            time.sleep(POLL_SECONDS)
        self.figures["displays_delay"] = at - result_at
        self.stop(off, on)

    def run(self) -> None:
        try:
            self.round_trips()
            self.session()
            self.displays()
        finally:
            for server in self.alive:
                server.stop(self.problems)

    def rows(self) -> list[tuple[str, ...]]:
        f, args = self.figures, self.args
        share = f["write_seconds"] / f["span"]
        extra = f["growth"][0] - f["growth"][1]
        memory = extra / f["size"]
        mib = 2**20
        return [
            ("measure", "mirror on", "mirror off", "ratio", "target", ""),
            compared(f"round trip 1+1, median of {args.repeat}", *f["round_trip"], TARGETS["round_trip"]),
            compared(f"{args.cells:,}-cell session, its cells' wall time", *f["wall"], None),
            (f"time writing the notebook ({f['writes']} writes)", fmt_time(f["write_seconds"]), "",
             f"{share:.2%} of {fmt_time(f['span'])}", f"≤ {TARGETS['write_share']:.0%}",
             "ok" if share <= TARGETS["write_share"] else "MISS"),
            (f"server RSS growth (notebook {f['size'] / mib:.1f} MiB)", f"{f['growth'][0] / mib:+.1f} MiB",
             f"{f['growth'][1] / mib:+.1f} MiB", f"{memory:.2f}× notebook", f"≤ {TARGETS['memory']:g}×",
             "ok" if memory <= TARGETS["memory"] else "MISS"),
            (f"a cell of {args.displays:,} displays: its result to the file showing it completed",
             fmt_time(f["displays_delay"]), "", "", f"≤ {TARGETS['displays_delay']:g} s",
             "ok" if f["displays_delay"] <= TARGETS["displays_delay"] else "MISS"),
        ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--repeat", type=int, default=500)
    parser.add_argument("--cells", type=int, default=10_000)
    parser.add_argument("--batch", type=int, default=100)
    parser.add_argument("--displays", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="loommux-bench-notebook-") as scratch:
        bench = NotebookBench(args, scratch)
        title = (f"loommux notebook mirror, on vs off (python {sys.version.split()[0]}); "
                 "the mirror's own count of its write time")
        return run_and_report(bench.run, bench.problems, title, bench.rows)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"benchmark failed: {exc}", file=sys.stderr)
        sys.exit(1)
