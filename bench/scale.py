"""Measure several loommux instances behind Debian's nginx, with README's configuration, in one run.

1. ``run_cell(freeform="1+1")`` (2026-07-28, the shared kernel ``default``) through nginx against the
   same call straight to the instance that owns ``default``, alternating call by call on kept-alive
   connections, so that drift on the machine hits both alike (target: ≤ 1.1×).
2. Requests per second of 64 concurrent light clients (``status`` on eight named kernels, each
   client its own connection to nginx) with 1, 2 and 3 instances behind it. README's configuration
   names three instances: with fewer, their ports repeat. The instances share this machine's CPUs,
   so the figures show the shape, not a speed-up.
3. On a kernel of a real Jupyter Kernel Gateway: ``1+1`` with ``--state-dir`` against without (the cost
   of keeping the state), alternating call by call; then the server with the state is killed with SIGKILL
   and started again on its port, timed from the start to its first result in the old namespace,
   against a fresh server's first result (a new gateway kernel).

nginx runs as this user from a temporary directory: README's ``nginx`` block verbatim but for its
ports. Every server is stopped with SIGTERM and checked to leave no process behind.

    .venv/bin/python bench/scale.py [--repeat 200] [--seconds 5]
"""

from __future__ import annotations

import argparse
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchlib import (
    NGINX,
    Bench,
    BenchError,
    Child,
    Gateway,
    HttpServer,
    StatelessClient,
    compared,
    free_port,
    nginx_command,
    p95,
    run_and_report,
    server_env,
    timed,
)

INSTANCES = ("a", "b", "c")
CLIENTS = 64
NAMES = [f"load-{i}" for i in range(8)]
WARMUP = 10
RESULT = re.compile(r"Out\[\d+\]: 2")


class Nginx(Child):
    """nginx serving README's configuration; ``ports`` gives each instance name the port it listens on."""

    def __init__(self, base: Path, ports: dict[str, int]) -> None:
        self.port = free_port()
        super().__init__(subprocess.Popen(nginx_command(base, self.port, ports), stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (base / "error.log").read_text()[-500:]
                    raise BenchError(f"nginx did not start: {log}") from None
                time.sleep(0.05)


class Modern(StatelessClient):
    def one_plus_one(self) -> None:
        if not RESULT.search(self.call("run_cell", {"freeform": "1+1"})):
            raise BenchError("1+1 did not answer 2")


class ScaleBench(Bench):
    def __init__(self, repeat: int, seconds: float, workspace: str) -> None:
        super().__init__(workspace)
        self.repeat, self.seconds = repeat, seconds
        self.servers: dict[str, HttpServer] = {}

    def start(self, count: int) -> Nginx:
        """``count`` instances (started when not yet running) behind a fresh nginx."""
        for name in INSTANCES[:count]:
            if name not in self.servers:
                server = HttpServer(self.workspace, server_env({"LOOMMUX_INSTANCE": name,
                                                                 "LOOMMUX_SPARE_KERNELS": "0"}))
                self.alive.append(server)
                server.wait_listening()
                self.servers[name] = server
        running = [self.servers[name].port for name in INSTANCES[:count]]
        base = Path(tempfile.mkdtemp(dir=self.workspace))
        nginx = Nginx(base, {name: running[i % count] for i, name in enumerate(INSTANCES)})
        self.alive.append(nginx)
        return nginx

    def through_nginx(self) -> None:
        nginx = self.start(3)
        proxied = Modern(nginx)
        proxied.one_plus_one()
        owner = next(name for name, server in self.servers.items()
                     if any(r["id"] == "default"
                            for r in Modern(server).get_json("/api/resources")["resources"]))
        direct = Modern(self.servers[owner])
        for _ in range(WARMUP):
            proxied.one_plus_one()
            direct.one_plus_one()
        trips: dict[str, list[float]] = {"nginx": [], "direct": []}
        for _ in range(self.repeat):
            trips["nginx"].append(timed(proxied.one_plus_one)[0])
            trips["direct"].append(timed(direct.one_plus_one)[0])
        self.figures["roundtrip"] = trips
        nginx.stop(self.problems)
        self.alive.remove(nginx)

    def load(self) -> None:
        for count in (1, 2, 3):
            nginx = self.start(count)
            self.figures[f"load{count}"] = self.requests_per_second(nginx, count)
            nginx.stop(self.problems)
            self.alive.remove(nginx)

    def requests_per_second(self, nginx: Nginx, count: int) -> float:
        """CLIENTS threads, each on its own connection, calling status for ``seconds``."""
        clients = [Modern(nginx) for _ in range(CLIENTS)]
        for i, client in enumerate(clients):
            client.call("status", {"kernel": NAMES[i % len(NAMES)]})
        done, failures = [0] * CLIENTS, []
        stop_at = time.monotonic() + self.seconds

        def work(i: int) -> None:
            try:
                while time.monotonic() < stop_at:
                    clients[i].call("status", {"kernel": NAMES[i % len(NAMES)]})
                    done[i] += 1
            except (BenchError, OSError) as exc:
                failures.append(str(exc))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(CLIENTS)]
        started = time.monotonic()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for client in clients:
            client.close()
        if failures:
            raise BenchError(f"{len(failures)} clients failed with {count} instances: {failures[0]}")
        return sum(done) / (time.monotonic() - started)

    def kept_state(self) -> None:
        gateway = Gateway(Path(self.workspace) / "gateway.log")
        self.alive.append(gateway)
        env = server_env({"LOOMMUX_GATEWAY_URL": gateway.url, "LOOMMUX_SPARE_KERNELS": "0"},
                         drop_loommux=True)
        keeping = ("--state-dir", str(Path(self.workspace) / "state"), "--instance", "s")
        servers = {"state": HttpServer(self.workspace, env, args=keeping),
                   "plain": HttpServer(self.workspace, env)}
        for server in servers.values():
            self.alive.append(server)
            server.wait_listening()
        clients = {side: Modern(server) for side, server in servers.items()}
        for client in clients.values():
            client.call("run_cell", {"freeform": "kept = 41"})
            for _ in range(WARMUP):
                client.one_plus_one()
        trips: dict[str, list[float]] = {side: [] for side in clients}
        for _ in range(self.repeat):
            for side, client in clients.items():
                trips[side].append(timed(client.one_plus_one)[0])
        self.figures["state"] = trips
        killed = servers["state"]
        killed.proc.kill()
        killed.proc.wait()
        self.alive.remove(killed)
        self.figures["restart"] = (timed(self.first_result, env, (*keeping, "--port", str(killed.port)),
                                         "kept + 1", r"Out\[\d+\]: 42")[0],
                                   timed(self.first_result, env, (), "1+1", r"Out\[\d+\]: 2")[0])

    def first_result(self, env: dict[str, str], args: tuple[str, ...], code: str, expected: str) -> None:
        """Start a server and run one cell on it, whose result must match ``expected``."""
        server = HttpServer(self.workspace, env, args=args)
        self.alive.append(server)
        server.wait_listening()
        text = Modern(server).call("run_cell", {"freeform": code})
        if not re.search(expected, text):
            raise BenchError(f"{code} answered {text[:200]!r}")

    def steps(self) -> list:
        return [self.through_nginx, self.load, self.kept_state]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=200, help="1+1 calls per side (default 200)")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each load run (default 5)")
    args = parser.parse_args()
    if not NGINX.exists():
        print(f"benchmark failed: {NGINX} is not installed (Debian's nginx)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory() as workspace:
        bench = ScaleBench(args.repeat, args.seconds, workspace)

        def rows() -> list[tuple[str, ...]]:
            trips = bench.figures["roundtrip"]
            median = {side: statistics.median(values) for side, values in trips.items()}
            tail = {side: p95(values) for side, values in trips.items()}
            table = [("", "nginx", "direct", "ratio", "target", ""),
                     compared("1+1 median", median["nginx"], median["direct"], 1.1),
                     compared("1+1 p95", tail["nginx"], tail["direct"], None)]
            table += [(f"{CLIENTS} clients, {n} instance{'s' if n > 1 else ''}",
                       f"{bench.figures[f'load{n}']:.0f} req/s", "", "", "", "") for n in (1, 2, 3)]
            kept = {side: statistics.median(values) for side, values in bench.figures["state"].items()}
            restart, fresh = bench.figures["restart"]
            table += [("", "state", "none", "ratio", "", ""),
                      compared("gateway 1+1 median, --state-dir", kept["state"], kept["plain"], None),
                      ("", "restart", "fresh", "ratio", "", ""),
                      compared("start to first result", restart, fresh, None)]
            return table

        title = (f"loommux behind nginx: 1+1 through nginx vs direct ({args.repeat} calls each); "
                 f"{CLIENTS} concurrent status clients for {args.seconds:g} s; a gateway kernel with and "
                 "without --state-dir, and a restart that keeps it")
        return run_and_report(bench.run, bench.problems, title, rows)


if __name__ == "__main__":
    sys.exit(main())
