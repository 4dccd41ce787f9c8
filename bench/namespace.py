"""What `inspect` costs on a busy kernel against `run_cell` of the same inspection on an idle one.

One stdio server, two shared kernels holding the same DataFrame (100,000 × 5) and NumPy array (1,000 ×
1,000): kernel "busy" runs a ``time.sleep`` cell throughout, so its `inspect` answers from a subshell
(ipykernel 7, JEP 91); kernel "idle" runs, with `run_cell`, a cell that prints what `inspect` says (type,
shape, dtypes, memory, first rows; an array's dtype and min/max). Calls alternate between the two, so drift
on the machine hits both alike. The table gives each answer's time and its size in o200k_base tokens.

    .venv/bin/python bench/namespace.py [--repeat 50]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from functools import partial

from benchlib import SERVER, Bench, StdioServer, fmt_time, p95, run_and_report, timed

sys.path.insert(0, str(SERVER.parent))
from loommux import count_tokens

CLIENT_NAME = "loommux-bench-namespace"
SETUP = """\
import numpy as np, pandas as pd, time
rng = np.random.default_rng(0)
df = pd.DataFrame({"id": np.arange(100_000), "x": rng.normal(size=100_000), "y": rng.integers(0, 9, 100_000),
                   "name": [f"row {i}" for i in range(100_000)], "flag": rng.random(100_000) > 0.5})
arr = rng.normal(size=(1000, 1000))
"""
BUSY_CELL = "%%loommux --wait 0.1\ntime.sleep(3600)"
# What run_cell prints to learn what inspect says of each.
BY_CELL = {
    "df": "print(type(df), df.shape, df.memory_usage(deep=False).sum(), 'bytes')\n"
          "print(df.dtypes.to_string())\ndf.head(5)",
    "arr": "print(type(arr), arr.shape, arr.dtype, arr.nbytes, 'bytes', arr.min(), arr.max())\narr",
}
WARMUP = 3


class NamespaceBench(Bench):
    def __init__(self, repeat: int) -> None:
        super().__init__(tempfile.mkdtemp(prefix="loommux-bench-namespace-"))
        self.repeat = repeat
        self.times: dict[tuple[str, str], list[float]] = {}
        self.tokens: dict[tuple[str, str], int] = {}
        self.server: StdioServer | None = None

    def steps(self) -> list:
        return [self.start, self.compare]

    def start(self) -> None:
        self.server = StdioServer(self.workspace)
        self.alive.append(self.server)
        self.server.initialize(CLIENT_NAME)
        for kernel in ("busy", "idle"):
            self.server.run_to_end({"freeform": f"%%loommux --wait 120\n{SETUP}", "kernel": kernel})
        self.server.tool("run_cell", {"freeform": BUSY_CELL, "kernel": "busy"})

    def compare(self) -> None:
        server = self.server
        for name, cell in BY_CELL.items():
            calls = {("inspect", name): partial(server.tool, "inspect", {"name": name, "kernel": "busy"}),
                     ("run_cell", name): partial(server.run_to_end, {"freeform": cell, "kernel": "idle"})}
            for i in range(WARMUP + self.repeat):
                for key, call in calls.items():
                    seconds, text = timed(call)
                    if i >= WARMUP:
                        self.times.setdefault(key, []).append(seconds)
                        self.tokens[key] = count_tokens(text)
        if "· busy" not in server.tool("status", {"kernel": "busy"}):
            self.problems.append("the busy kernel's cell ended before the last inspect")
        server.tool("interrupt", {"kernel": "busy"})

    def rows(self) -> list[tuple[str, ...]]:
        rows = [("answer", "kernel", "median", "p95", "tokens")]
        for (tool, name), times in self.times.items():
            kernel = "busy (subshell)" if tool == "inspect" else "idle"
            rows.append((f"{tool} {name}", kernel, fmt_time(statistics.median(times)), fmt_time(p95(times)),
                         f"{self.tokens[tool, name]:,}"))
        return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeat", type=int, default=50, help="timed calls of each kind (default 50)")
    bench = NamespaceBench(parser.parse_args().repeat)
    title = f"inspect on a busy kernel against run_cell on an idle one ({bench.repeat} calls each)"
    return run_and_report(bench.run, bench.problems, title, bench.rows)


if __name__ == "__main__":
    sys.exit(main())
