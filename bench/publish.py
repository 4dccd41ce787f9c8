"""Measure publishing kernel functions as tools before and after its bounds, side by side in one run.

"before" is loommux.py at a git revision (``--baseline``, the commit before the change), "after" is this
working tree's; each side is one stdio server with its kernel, driven as an MCP client drives it. Per side:
one cell publishing 100 tools (the most a kernel may now), then one trying to publish ``--tools`` (1,500;
"after" refuses the 101st), each with the time from run_cell to its result, the
notifications/tools/list_changed the session heard and the size and time of tools/list after it (before
them, ``--cells`` cells, 200, each republishing one tool, with the notifications heard); then the calls
whose arguments fit the schema but failed in the kernel (a list nested 300 deep, NaN in an object).

    .venv/bin/python bench/publish.py [--tools 1500] [--cells 200] [--baseline 0f96172]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import tempfile
import time

from benchlib import SERVER, Bench, StdioServer, extract_baseline, fmt_time, jsonrpc_request, run_and_report

DEFAULT_BASELINE = "0f96172"  # the last commit before this change
CLIENT_NAME = "loommux-bench-publish"
LIST_CHANGED = "notifications/tools/list_changed"
BURST = """%%loommux --wait 600
for i in range({count}):
    loommux.publish(lambda: i, f"tool{{i}}", "A tool of the bench.")
"""
REPUBLISH = "loommux.publish(lambda: 1, 'again', 'Published again.')"
PROBE = "def probe(value: list, raw: dict = {}) -> int:\n    return len(value)\nloommux.publish(probe)"
SETTLE = 1.5  # seconds for a notification due at the end of a throttle's interval


class CountingServer(StdioServer):
    """A stdio server whose session counts the tools/list_changed notifications it hears."""

    def __init__(self, workspace: str, server) -> None:
        super().__init__(workspace, server=server)
        self.changes = 0
        self.last_size = 0  # bytes of the last response line

    def request(self, method: str, params: dict) -> dict:
        self._next_id += 1
        self.send(jsonrpc_request(self._next_id, method, params))
        deadline = time.monotonic() + self.timeout
        while True:
            line = self._read_line(deadline)
            message = json.loads(line)
            if message.get("method") == LIST_CHANGED:
                self.changes += 1
            if message.get("id") == self._next_id:
                self.last_size = len(line)
                return message.get("result", {})

    def settled_changes(self) -> int:
        """The notifications heard so far, once those still due have come (ping after SETTLE)."""
        time.sleep(SETTLE)
        self.request("ping", {})
        return self.changes


class PublishBench(Bench):
    def __init__(self, args: argparse.Namespace, scratch: str) -> None:
        super().__init__(tempfile.mkdtemp(prefix="workspace-", dir=scratch))
        self.args, self.scratch = args, scratch
        self.figures: dict[str, dict[str, str]] = {"before": {}, "after": {}}

    def burst(self, side: str, server: CountingServer, count: int) -> None:
        figures, before = self.figures[side], server.settled_changes()
        start = time.perf_counter()
        text = server.run_to_end({"freeform": BURST.format(count=count)})
        figures[f"burst {count}"] = fmt_time(time.perf_counter() - start)
        figures[f"refused {count}"] = "refused at 101" if "PublishError" in text else "accepted"
        figures[f"changes {count}"] = f"{server.settled_changes() - before:,}"
        start = time.perf_counter()
        listed = server.request("tools/list", {})
        figures[f"list time {count}"] = fmt_time(time.perf_counter() - start)
        figures[f"list size {count}"] = f"{server.last_size:,} B ({len(listed.get('tools', [])):,} tools)"

    def republish(self, side: str, server: CountingServer) -> None:
        before = server.settled_changes()
        start = time.perf_counter()
        for _ in range(self.args.cells):
            server.tool("run_cell", {"freeform": REPUBLISH})
        elapsed = time.perf_counter() - start
        self.figures[side]["republish"] = (f"{server.settled_changes() - before:,} in {fmt_time(elapsed)}")
        server.tool("run_cell", {"freeform": "loommux.unpublish('again')"})

    def arguments(self, side: str, server: CountingServer) -> None:
        server.tool("run_cell", {"freeform": "loommux.unpublish('tool0')"})
        server.tool("run_cell", {"freeform": PROBE})
        deep = functools.reduce(lambda inner, _: [inner], range(300), [])
        for key, arguments in (("deep", {"value": deep}), ("nan", {"value": [], "raw": {"x": float("nan")}})):
            result = server.call("probe", arguments)
            text = result["content"][0]["text"]
            self.figures[side][key] = text.split(":", 1)[0] if result.get("isError") else "ok"

    def side_by_side(self) -> None:
        sides = {"before": extract_baseline(self.args.baseline,
                                            tempfile.mkdtemp(prefix="baseline-", dir=self.scratch)),
                 "after": SERVER}
        for side, path in sides.items():
            server = CountingServer(self.workspace, path)
            self.alive.append(server)
            server.initialize(CLIENT_NAME)
            self.republish(side, server)
            self.burst(side, server, 100)
            self.burst(side, server, self.args.tools)
            self.arguments(side, server)
        self.stop_all()
        after = self.figures["after"]
        if after[f"refused {self.args.tools}"] != "refused at 101":
            self.problems.append(f"after: a cell publishing {self.args.tools:,} tools was not refused")
        if (after["deep"], after["nan"]) != ("ok", "invalid_arguments"):
            self.problems.append(f"after: the 300-deep list gave {after['deep']}, NaN {after['nan']}")

    def steps(self) -> list:
        return [self.side_by_side]

    def rows(self) -> list[tuple[str, ...]]:
        tools, cells = self.args.tools, self.args.cells
        labels = [("republish", f"{cells} cells republishing a tool: list_changed heard"),
                  ("burst 100", "a cell publishing 100 tools: run_cell to result"),
                  ("changes 100", "  list_changed heard"),
                  ("list size 100", "  tools/list after it"), ("list time 100", "  tools/list time"),
                  (f"burst {tools}", f"a cell publishing {tools:,} tools: run_cell to result"),
                  (f"refused {tools}", "  publish"), (f"changes {tools}", "  list_changed heard"),
                  (f"list size {tools}", "  tools/list after it"),
                  (f"list time {tools}", "  tools/list time"),
                  ("deep", "call with a list nested 300 deep"), ("nan", "call with NaN in an object")]
        rows = [("", "after", f"before ({self.args.baseline})")]
        after, before = self.figures["after"], self.figures["before"]
        return rows + [(label, after[key], before[key]) for key, label in labels]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools", type=int, default=1500, help="tools the second cell publishes (1500)")
    parser.add_argument("--cells", type=int, default=200, help="cells republishing one tool (200)")
    parser.add_argument("--baseline", default=DEFAULT_BASELINE,
                        help=f"git revision whose loommux.py is the 'before' side ({DEFAULT_BASELINE})")
    args = parser.parse_args()
    if args.tools <= 100 or args.cells < 1:
        parser.error("--tools must be over 100 and --cells at least 1")
    title = f"loommux publish bench · Python {platform.python_version()} · {os.cpu_count()} CPUs"
    with tempfile.TemporaryDirectory(prefix="loommux-bench-publish-") as scratch:
        bench = PublishBench(args, scratch)
        return run_and_report(bench.run, bench.problems, title, bench.rows)


if __name__ == "__main__":
    sys.exit(main())
