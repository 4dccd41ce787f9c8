"""Kernels loommux does not start itself, and kernels of other languages, against jupyter_client.

Each comparison runs both sides on the same kernel, alternating call by call (medians of many runs):

* ``1+1`` on a kernel a person started (jupyter_client's KernelManager), which loommux attached to
  with ``LOOMMUX_EXISTING``, against jupyter_client's own ``BlockingKernelClient`` on that kernel;
* an ``echo`` round trip on bash_kernel (``LOOMMUX_KERNELSPEC=bash``), against a BlockingKernelClient
  joined to the same kernel with the connection file loommux's ``status`` shows;
* 200,000 lines printed by R (IRkernel) and ingested, from the request to the end of the output,
  likewise (skipped, and said, when R with IRkernel is not installed).

Each side's time is a whole round trip: loommux's over MCP stdio (run_cell until the cell's
answer), jupyter_client's from ``execute`` to the cell's reply and idle status, its output read.

    python bench/kernels.py [--repeat 60] [--floods 3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchlib import BenchError, StdioServer, compared, print_table, server_env, timed

CLIENT_NAME = "loommux-bench-kernels"
TIMEOUT = 900.0  # a wait of 600 s on the R flood must not time out the request
WARMUP = 5
LINES = 200_000
CHUNK = 10_000
# 200,000 numbered lines of 80 characters, in 20 top-level calls: R captures a call's output in a text
# connection, which is quadratic in its lines (one call printing them all takes R itself many minutes).
R_FLOOD = "\n".join(f'cat(sprintf("%06d %s\\n", {k * CHUNK} + 1:{CHUNK}, strrep("x", 72)), sep = "")'
                    for k in range(LINES // CHUNK))
TARGETS = {"1+1": 1.05, "echo": 1.05, "flood": 1.2}


def write_specs(base: Path) -> None:
    """The kernelspecs the bench starts, in a Jupyter path of its own."""
    specs = {
        "bash": {"argv": [sys.executable, "-m", "bash_kernel", "-f", "{connection_file}"], "language": "bash",
                 "env": {"PS1": "$"}},
        "ir": {"argv": ["R", "--slave", "-e", "IRkernel::main()", "--args", "{connection_file}"],
               "language": "R"},
    }
    for name, spec in specs.items():
        (base / "kernels" / name).mkdir(parents=True)
        (base / "kernels" / name / "kernel.json").write_text(json.dumps(spec))


def blocking_client(connection_file: str):
    from jupyter_client import BlockingKernelClient

    client = BlockingKernelClient(connection_file=connection_file)
    client.load_connection_file()
    client.start_channels()
    client.wait_for_ready(60)
    return client


def jupyter_round_trip(client, code: str) -> int:
    """jupyter_client's side: run code, read its output to the idle status; the characters it printed."""
    printed = []
    client.execute_interactive(code, timeout=600,
                               output_hook=lambda m: printed.append(m["content"].get("text", "")))
    return sum(map(len, printed))


def loommux_call(server: StdioServer, code: str) -> tuple[float, str]:
    """One timed run_cell (and its waits); a busy answer (the other side's cell not yet seen idle) is not
    counted. No header: on bash_kernel its blank line would cost a prompt of its own."""
    while True:
        try:
            return timed(server.run_to_end, {"freeform": code})
        except BenchError as exc:
            if not str(exc).startswith("run_cell: busy:"):
                raise


def side_by_side(server: StdioServer, client, code: str, runs: int, check,
                 warmup: int) -> tuple[float, float]:
    """Medians of loommux's and jupyter_client's round trips, alternating, after a warm-up."""
    ours, theirs = [], []
    for n in range(warmup + runs):
        seconds, text = loommux_call(server, code)
        check(text)
        drain(client)
        their_seconds, _ = timed(jupyter_round_trip, client, code)
        settle(server)
        if n >= warmup:
            ours.append(seconds)
            theirs.append(their_seconds)
    return statistics.median(ours), statistics.median(theirs)


def drain(client) -> None:
    """Untimed: read what the client received of loommux's cell, so that its own run does not."""
    import queue

    with contextlib.suppress(queue.Empty):
        while True:
            client.get_iopub_msg(timeout=0.2)


def settle(server: StdioServer) -> None:
    """Untimed: until loommux has recorded the other side's cell (its output too), so that neither side's
    run competes with the recording of the other's."""
    while not re.search(r"^kernel: .* · idle$", server.tool("status"), re.MULTILINE):
        time.sleep(0.01)


def connection_file_of(server: StdioServer) -> str:
    return re.search(r"^connection file: (.+)$", server.tool("status"), re.MULTILINE)[1]


def attached(workspace: str, repeat: int) -> tuple[float, float]:
    from jupyter_client import KernelManager

    manager = KernelManager(connection_file=str(Path(workspace) / "kernel-bench.json"))
    manager.start_kernel()
    client = server = None
    try:
        client = blocking_client(manager.connection_file)
        server = StdioServer(workspace, server_env({"LOOMMUX_EXISTING": manager.connection_file}))
        server.initialize(CLIENT_NAME)

        def check(text: str) -> None:
            if "Out[" not in text or not text.rstrip().endswith(": 2"):
                raise BenchError(f"1+1 answered {text[:200]!r}")

        return side_by_side(server, client, "1+1", repeat, check, WARMUP)
    finally:
        if server is not None:
            server.close()
        if client is not None:
            client.stop_channels()
        manager.shutdown_kernel(now=True)


def on_spec(workspace: str, spec: str, code: str, runs: int, check,
            warmup: int = WARMUP) -> tuple[float, float]:
    server = StdioServer(workspace, server_env({"LOOMMUX_KERNELSPEC": spec, "JUPYTER_PATH": workspace}),
                         timeout=TIMEOUT)
    client = None
    try:
        server.initialize(CLIENT_NAME)
        server.tool("run_cell", {"freeform": code.split("\n")[0] if spec == "bash" else "1"})
        client = blocking_client(connection_file_of(server))
        return side_by_side(server, client, code, runs, check, warmup)
    finally:
        if client is not None:
            client.stop_channels()
        server.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--repeat", type=int, default=60, help="round trips per side (default 60)")
    parser.add_argument("--floods", type=int, default=3, help="200,000-line R cells per side (default 3)")
    args = parser.parse_args()
    rows = [("", "loommux", "jupyter_client", "ratio", "goal", "")]
    with tempfile.TemporaryDirectory(prefix="loommux-bench-kernels-") as workspace:
        write_specs(Path(workspace))
        try:
            ours, theirs = attached(workspace, args.repeat)
            rows.append(compared("1+1 on an attached kernel", ours, theirs, TARGETS["1+1"]))

            def echoed(text: str) -> None:
                if "hello" not in text:
                    raise BenchError(f"echo answered {text[:200]!r}")

            ours, theirs = on_spec(workspace, "bash", "echo hello", args.repeat, echoed)
            rows.append(compared("bash_kernel echo round trip", ours, theirs, TARGETS["echo"]))
            has_r = shutil.which("R") and subprocess.run(["R", "--slave", "-e", "library(IRkernel)"],
                                                          check=False, capture_output=True).returncode == 0

            def flooded(text: str) -> None:
                if f"{LINES:,} lines" not in text and f"{LINES - 1:06d}" not in text:
                    raise BenchError(f"the R flood answered {text[:300]!r}")

            if has_r:
                ours, theirs = on_spec(workspace, "ir", R_FLOOD, args.floods, flooded, warmup=1)
                rows.append(compared(f"{LINES:,} lines from R ingested", ours, theirs, TARGETS["flood"]))
            else:
                print("R with IRkernel is not installed: the R flood is skipped")
        except BenchError as exc:
            print(f"benchmark failed: {exc}", file=sys.stderr)
            return 1
    print(f"loommux kernels bench (medians; {args.repeat} round trips, {args.floods} floods per side)")
    print_table(rows)
    missed = [row[0] for row in rows[1:] if row[-1] != "ok"]
    for label in missed:
        print(f"CHECK FAILED: {label} is over its goal")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
