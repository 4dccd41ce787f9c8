"""loommux: a persistent, inspectable IPython kernel for AI agents, served over MCP.

An agent submits a cell with ``run_cell`` and gets its output, or its execution
number when the cell outlives a short wait; it can then ``wait`` again, read any
output stream by line range, search it, interrupt the cell or restart the
kernel, and nothing the cell printed is ever lost.

One file, read top to bottom, each layer built on the ones above it:

  Text & logs             terminal normalization, append-only line-indexed logs kept in
                          files, line ranges, search, sizes and durations, token counting
  Error codes             one table of the codes every caller reports,   } sent to every
                          and the states an execution is in               } kernel as source,
  Cell input              the ``%%loommux`` cell header's grammar         }
  Published functions     a kernel's functions as MCP tools: the input    }
                          schemas of their annotations, their calls, the  }
                          set announced to the server on IOPub            }
  Namespace               the user's names as the namespace, inspect and  }
                          reset tools see them, with safe, time-bounded   }
                          reprs; answered in the kernel, no cell run      }
  Kernel-side extension   its identity, the ``loommux`` object (also      } self-contained
                          ``loommux.Daemon`` outside a kernel), the header
                          transformer and ``%%loommux --kernel`` forwarding;
                          an IOPub that keeps every message, numbered as sent
  Jupyter wire            signed Jupyter messages over pyzmq
  Kernel process          process helpers (/proc walks, work in a forked child); the
                          kernel's message numbers and the lost messages they reveal;
                          what every kernel does (readiness, the kernel-side bootstrap,
                          cells) and its three kinds: launched here (the launcher,
                          interrupt, death, shutdown) and attached from a person's
                          connection file, both over ZeroMQ channels; installed
                          kernelspecs; on a Jupyter (Enterprise) Gateway: REST over
                          http.client, a hand-written WebSocket client
  Output files            where what cells print is written: the server's own directory
                          (temporary, --output-dir, or kept in --state-dir), a directory per
                          resource, a file per execution and stream; the sweep of what a
                          killed server left
  Execution records       one record per accepted cell, fed by IOPub, kept small once it
                          ends; images
  Instances               the instance's name, carried by every id it mints (handles, MCP
                          session ids, task ids) so that a proxy can route them
  Tasks                   an execution a client tracks as an MCP task (both eras): its
                          status, from working or input_required to its end, and the
                          call's final result; the board that owns them, their watchers
                          and the listen streams' subscriptions (TaskBoard)
  Resources & leases      domain errors; the kernel pool; a resource: its identity and its
                          parts (the kernel it holds, its execution sequence, the question a
                          cell's input() puts, its leases and orphan state); client and
                          holder leases and their transitions, orphans and their
                          retirement; the registry; the one owner of an MCP session
                          (SessionBinding)
  Notebooks               a resource's executions as an nbformat 4.5 notebook; mirrors that keep
                          one in a file (--notebook, --notebook-dir): the cells they keep
                          rendered, written atomically
  Instance state          what --state-dir keeps over a restart: the records of the gateway kernels,
                          their leases and the handshake sessions, in one state file; taking them back
  Execution resources     an execution's streams and images as MCP resources: loommux://
                          URIs, reads bounded by the token rule, resource links, following
                          a growing output for subscribers
  Execution view          the running cell as an MCP App (io.modelcontextprotocol/ui): the ui:// page,
                          self-contained, and what its app-only tool reads of an execution
  Tools                   schemas, argument checks and the text of the eleven tools; the
                          kernel argument that names a kernel per call; namespace
                          requests (on a subshell while a cell runs); calls of the
                          tools a kernel publishes
  MCP protocol            the JSON-RPC 2.0 envelope (McpSession) and one method table per
                          era: the handshake era (initialize) and the stateless 2026-07-28
                          era, classified message by message; both eras' task requests and
                          subscriptions/listen (TaskRequests); resources, the loommux skill
                          and resource subscriptions (ResourceRequests); input() put to the
                          person (Elicitations)
  MCP over stdio          one client on stdin/stdout
  Plain HTTP/1.1          heads, bodies, connections, SSE streams of encoded events;
                          knows nothing of MCP or resources
  Console & control API   the endpoints beside MCP, what their handlers take and give, and
                          their one error shape {error_code, message}: the operator API,
                          the kernel-facing control plane under /api/kernels (and the
                          relay of forwarded cells), and the browser console at /
  Routing                 the route table (method, path, handler, access) of those
                          endpoints, and the router that finds a request's entry
  Streamable HTTP         the access checks of every head, both eras' POSTs and streams,
                          MCP's one error shape (JSON-RPC), the session table; serve_http
  Lease-aware client      ``LeaseAwareClient``: a Python client (official mcp SDK) that
                          keeps its lease
  CLI                     settings from the command line and environment, ``main()``,
                          the published import paths (``loommux.client``, ``loommux.daemon``)

Names: a *kernel* is a kernel process (a ``Kernel``, of three kinds); a *resource* is what clients
and the API name (a name, or a private id and handle) with its execution sequence, which outlives the
kernel processes it adopts. Public surfaces that predate the rule say "kernel" for a resource (the
``kernel`` tool argument, ``/api/kernels``, ``loommux.kernels()``). A *session* is always qualified:
an MCP session (``McpSession``, bound by ``SessionBinding``; ``HttpSession`` on HTTP) or the Jupyter
wire's session id (``WireSession``). The two eras of MCP are the *handshake* era (a session opened by
``initialize``) and the *stateless* era (2026-07-28 requests, each carrying its own envelope).

Runtime dependencies: the standard library, pyzmq, ipykernel and tiktoken (and, for
``LeaseAwareClient`` only, the official ``mcp`` SDK: ``pip install "loommux[client]"``).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import base64
import concurrent.futures
import contextlib
import copy
import ctypes
import datetime
import errno
import faulthandler
import fcntl
import gc
import hashlib
import hmac
import http.client
import importlib.util
import json
import math
import os
import pickle
import re
import secrets
import shlex
import shutil
import signal
import socket
import ssl
import sys
import tempfile
import threading
import time
import traceback
import types
import urllib.parse
import uuid
import warnings
import zlib
from array import array
from bisect import bisect_left, bisect_right
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property, partial
from http import HTTPStatus
from http.cookies import SimpleCookie
from itertools import accumulate
from operator import add, attrgetter
from pathlib import Path
from stat import S_ISDIR, S_ISLNK, S_ISREG, S_ISVTX
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import zmq.asyncio

try:  # Python 3.11 and later
    import re._compiler as sre_compile
    import re._parser as sre_parser
except ImportError:
    import sre_compile
    import sre_parse as sre_parser

__version__ = "0.1.0"
# The public API: the command, the control plane's client and what it returns, and the lease-aware MCP
# client. Everything else stays importable but is internal and may change between releases.
__all__ = ["Daemon", "DaemonError", "ForwardedCellError", "Job", "KernelHandle", "KernelList",
           "LeaseAwareClient", "StalePolicy", "main"]
SECTION_BANNER = "# " + "-" * 64  # each section of this file starts with it and its name


def log(message: str) -> None:
    """Diagnostics go to stderr, never to the protocol stream."""
    print(f"loommux: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- Text & logs

TOKEN_LIMIT = 5000
TOKEN_ENCODING = "o200k_base"
# The longest o200k_base token is 128 UTF-8 bytes, so an output longer than
# TOKEN_LIMIT * 128 bytes is over the limit without being encoded.
MAX_TOKEN_BYTES = 128
LOG_PIECE_BYTES = 1 << 16  # committed text is kept in pieces of about this size
INDEX_WINDOW = 1 << 16  # lines are indexed this many characters at a time
# The line index keeps where every 32nd line starts; a read finds the lines between with str.find, so
# the index costs a quarter of a byte per line.
LINE_MARK_EVERY = 32
LOG_FILE_MODE = 0o600  # output files: what cells print is for this user alone
PIECE_CACHE_ENTRIES = 8  # pieces of log files kept after a read (at most 2 * LOG_PIECE_BYTES each)
READ_RUN_BYTES = 1 << 20  # a search reads a log's file this much at a time

ESCAPE_RE = re.compile(
    r"\x1b(?:\[[0-?]*[ -/]*[@-~]"  # CSI: colours, cursor moves
    r"|\][^\x07\x1b\n]*(?:\x07|\x1b\\)"  # OSC: titles, hyperlinks (never across lines)
    r"|[PX^_][^\x1b\n]*\x1b\\"  # DCS, SOS, PM, APC strings
    r"|[ -/]*[0-~])"  # two-character and nF escapes
    r"|[\x00\x07]"
)
# An escape sequence cut off at the end of an IOPub message waits for the next one.
ESCAPE_TAIL_RE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*|\][^\x07\x1b\n]*\x1b?|[PX^_][^\x1b\n]*\x1b?|[ -/]*)\Z")
MAX_ESCAPE_TAIL = 4096
CR_NEWLINE_RE = re.compile(r"\r+\n")
LONE_SURROGATE_RE = re.compile("[\ud800-\udfff]")  # a JSON string may hold one; UTF-8 cannot
OVERWRITTEN_RE = re.compile(r"[^\n]*\r")  # a line's text up to its last carriage return


def strip_escapes(text: str) -> tuple[str, str]:
    """Remove terminal escapes; return the clean text and an unfinished trailing escape."""
    held = ""
    tail = ESCAPE_TAIL_RE.search(text)
    if tail and len(text) - tail.start() <= MAX_ESCAPE_TAIL:
        held, text = text[tail.start() :], text[: tail.start()]
    return ESCAPE_RE.sub("", text).replace("\x1b", ""), held


def utf8_len(text: str) -> int:
    if text.isascii():
        return len(text)
    return sum(
        len(text[i : i + INDEX_WINDOW].encode("utf-8", "surrogatepass"))
        for i in range(0, len(text), INDEX_WINDOW)
    )


def format_count(n: int) -> str:
    return f"{n:,}"


def format_size(n: int) -> str:
    """A byte count in one binary unit: 345 B, 12.5 KiB, 3.0 MiB, 1.2 GiB."""
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"
    raise AssertionError("unreachable")


def format_duration(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 10:
        return f"{seconds:.2f} s"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def format_iso_utc(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    moment = datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def clip(line: str, max_chars: int | None) -> str:
    """Clip a line for display, saying how much was cut; the stored text is untouched."""
    if max_chars is None or len(line) <= max_chars:
        return line
    return f"{line[:max_chars]}… [+{format_count(len(line) - max_chars)} chars]"


class OutputUnreadable(Exception):
    """A log's text that was written to its file and can no longer be read back (the file was removed or
    cut short under the server): the message names the file and why."""


class LogFile:
    """The append-only file a log's committed text is written to, as plain UTF-8.

    ``append`` writes at once (no buffer in this process: text a read returned survives a SIGKILL). When it
    cannot (the disk is full, the file or its directory is gone or unwritable, someone else changed the
    file), it says why in ``problem``, tells ``report`` once, and writes nothing more: the log keeps its text
    in memory from there. The file stays open for appending while its log is written (``close`` when its
    cell ends; a later write opens it again) and is read back by byte range. A file
    removed while open stays readable through its descriptor, which is then kept open for good.
    """

    __slots__ = ("fd", "path", "problem", "removed", "report", "size")

    def __init__(self, path: str, report: Callable[[LogFile], None] | None = None, size: int = 0) -> None:
        self.path = path
        self.report = report  # told when a write first fails
        self.size = size  # bytes written (a file taken back after a restart: its size then)
        self.fd: int | None = None
        self.problem: str | None = None  # why it takes no more text
        self.removed = False  # it was removed while open: its descriptor is what keeps its text

    def append(self, data: bytes) -> bool:
        """Write data at the end; False (said in ``problem``) when it is not all in the file."""
        if self.problem is not None:
            return False
        try:
            if self.fd is None:  # made by whoever made this (see OutputFiles), never made anew here
                self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
                if os.fstat(self.fd).st_size != self.size:
                    raise OSError(errno.ESTALE, "someone else changed it")
            view, written = memoryview(data), 0
            while written < len(data):
                written += os.write(self.fd, view[written:])
            self.size += written
            if os.fstat(self.fd).st_nlink == 0:
                self.removed = True  # what it holds stays readable: this write counts
                self.stop("it was removed")
        except OSError as exc:
            self.stop(exc.strerror or str(exc))
            return False
        return True

    def stop(self, reason: str) -> None:
        self.problem = f"cannot write {self.path}: {reason}"
        if self.report is not None:
            self.report(self)

    def read(self, offset: int, size: int, into: bytearray | None = None) -> bytes | memoryview:
        """Bytes offset..offset+size-1 of the file (in ``into`` when it holds them: see pread_into);
        OutputUnreadable when they cannot be read."""
        try:
            if self.removed:  # its descriptor, never closed, is all that reads it
                data = pread_into(self.fd, size, offset, into)
            else:  # a descriptor of its own: a worker thread reads while the loop may close the writer's
                fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
                try:
                    found = os.fstat(fd)
                    if not S_ISREG(found.st_mode):
                        raise OSError(errno.EINVAL, "not a regular file")
                    # never more than the file holds: a size that says more is not read into memory
                    data = pread_into(fd, max(0, min(size, found.st_size - offset)), offset, into)
                finally:
                    os.close(fd)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise OutputUnreadable(f"output file {self.path} cannot be read ({reason})") from None
        if len(data) < size:
            held, wanted = format_count(offset + len(data)), format_count(offset + size)
            raise OutputUnreadable(f"output file {self.path} was cut short under loommux (it holds {held} "
                                   f"bytes of {wanted})")
        return data

    def close(self) -> None:
        """Close it for writing; a removed file keeps its descriptor, which alone still reads its text."""
        if self.fd is not None and not self.removed:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


def pread_into(fd: int, size: int, offset: int, into: bytearray | None) -> bytes | memoryview:
    """At most size bytes at offset: as a view of ``into`` when it is that big, else as bytes. A buffer read
    into again and again is mapped once: with glibc's mmap threshold pinned (see pin_mmap_threshold),
    every fresh megabyte is a mapping of its own, faulted in page by page and unmapped once freed."""
    if into is None or len(into) < size:
        return os.pread(fd, size, offset)
    view, done = memoryview(into)[:size], 0
    while done < size:
        read = os.preadv(fd, [view[done:]], offset + done)
        if not read:
            break
        done += read
    return view[:done]


def find_piece_bounds(text: str) -> list[tuple[int, int]]:
    """Where committed text (ending with "\n") is cut into pieces: at line ends, about LOG_PIECE_BYTES apart
    (a longer line is a piece of its own), so that a read of a few lines never reads much more; text of at
    most twice that is one piece."""
    if len(text) <= 2 * LOG_PIECE_BYTES:
        return [(0, len(text))]
    bounds, start = [], 0
    while len(text) - start > LOG_PIECE_BYTES:
        end = start + LOG_PIECE_BYTES
        cut = text.rfind("\n", start, end) + 1 or text.find("\n", end) + 1
        bounds.append((start, cut))
        start = cut
    if start < len(text):
        bounds.append((start, len(text)))
    return bounds


_piece_cache: dict[tuple[LogFile, int, int], str] = {}  # recent reads of log files, oldest first
_piece_cache_lock = threading.Lock()  # searches read logs in worker threads too


def read_text(file: LogFile, start: int, stop: int) -> str:
    """Bytes start..stop-1 of a log's file as text; a piece read is kept a while (reading the last lines
    touches their piece twice, paging through an output its pieces in turn)."""
    key = (file, start, stop)
    text = _piece_cache.get(key)
    if text is None:
        text = file.read(start, stop - start).decode("utf-8", "surrogatepass")
        if stop - start <= LOG_PIECE_BYTES * 2:
            with _piece_cache_lock:
                _piece_cache[key] = text
                if len(_piece_cache) > PIECE_CACHE_ENTRIES:
                    del _piece_cache[next(iter(_piece_cache))]
    return text


class TextPieces:
    """A log's committed text: pieces that each end with "\\n", in its file (see LogFile) or, without one or
    past its failure, in memory; indexed by where each starts in characters and in UTF-8 bytes, and read
    back by character offsets. Append-only: a piece never changes once added."""

    __slots__ = ("bytes", "files", "lines", "pieces", "size", "starts", "utf8")

    def __init__(self, file: LogFile | None = None) -> None:
        self.pieces: list[str | None] = []  # each piece's text (None: in a file)
        self.starts = array("q")  # where each piece starts: in characters ...
        self.bytes = array("q")  # ... and in UTF-8 bytes, both counted from the stream's start
        # The files pieces are in, each as (its first piece, the file, where in the stream's bytes it starts);
        # None: the pieces from there on are in memory.
        self.files: list[tuple[int, LogFile | None, int]] = [(0, file, 0)] if file is not None else []
        self.size = 0  # characters ...
        self.utf8 = 0  # ... UTF-8 bytes ...
        self.lines = 0  # ... and lines, of all the pieces

    def add(self, text: str) -> None:
        """Add committed text (ending with "\\n"), written to the file when it takes it, cut into pieces by
        offsets (no copy of a stored piece is ever made)."""
        data = text.encode("utf-8", "surrogatepass")
        file = self.files[-1][1] if self.files else None
        stored = file is not None and file.append(data)
        for a, b in find_piece_bounds(text):
            whole = a == 0 and b == len(text)
            piece = None if stored else text if whole else text[a:b]
            size = len(data) if whole else b - a if len(data) == len(text) else utf8_len(text[a:b])
            self._add_piece(self.size + a, size, text.count("\n", a, b), piece)
        self.size += len(text)

    def _add_piece(self, start: int, size: int, lines: int, piece: str | None) -> None:
        self.starts.append(start)
        self.bytes.append(self.utf8)
        self.utf8 += size
        self.lines += lines
        self.pieces.append(piece)

    def take_back(self) -> str:
        """Take as its text what its file holds already (written before a restart of the server); text
        after the last line end (a write cut short) is returned, and nothing is written after it. OSError
        when the file cannot be read."""
        file = self.files[0][1]
        rest = b""
        with open(file.path, "rb") as stored:
            for chunk in iter(partial(stored.read, LOG_PIECE_BYTES), b""):
                data = rest + chunk if rest else chunk
                end = data.rfind(b"\n") + 1
                rest = data[end:]
                if end:
                    text = data[:end].decode("utf-8", "surrogatepass")
                    self._add_piece(self.size, end, text.count("\n"), None)
                    self.size += len(text)
                file.size += len(chunk)
        if rest:
            file.stop("it ends in a line cut short")
        return rest.decode("utf-8", "replace")

    def _file_of(self, i: int) -> tuple[LogFile | None, int]:
        """The file piece i is in, and where in the stream's bytes that file starts."""
        at = len(self.files) - 1
        while self.files[at][0] > i:
            at -= 1
        return self.files[at][1], self.files[at][2]

    def _end(self, i: int) -> tuple[int, int]:
        """Where piece i ends, in characters and in bytes."""
        if i + 1 < len(self.pieces):
            return self.starts[i + 1], self.bytes[i + 1]
        return self.size, self.utf8

    def piece(self, i: int) -> str:
        """Piece i's text, read from its file when it is there."""
        piece = self.pieces[i]
        if piece is None:
            file, base = self._file_of(i)
            piece = read_text(file, self.bytes[i] - base, self._end(i)[1] - base)
        return piece

    def read_span(self, first: int, limit: int, into: bytearray | None = None) -> tuple[str, int]:
        """Pieces first, first + 1, ... as one text, and the piece after them: a piece in memory alone, or a
        run of pieces in one file, read at once (at most about ``limit`` bytes, at least one piece; through
        ``into``, see pread_into)."""
        piece = self.pieces[first]
        if piece is not None:
            return piece, first + 1
        file, base = self._file_of(first)
        stop = first + 1
        while (stop < len(self.pieces) and self.pieces[stop] is None and self._file_of(stop)[0] is file
               and self.bytes[stop] - self.bytes[first] < limit):
            stop += 1
        data = file.read(self.bytes[first] - base, self._end(stop - 1)[1] - self.bytes[first], into)
        text = str(data, "utf-8", "surrogatepass")
        if isinstance(data, memoryview):
            data.release()  # into may be read into again
        return text, stop

    def iterate(self, first: int = 0) -> Iterator[tuple[str, int]]:
        """The text from piece ``first`` on in spans (see read_span; runs of READ_RUN_BYTES, read through one
        buffer), each with where it starts. A span starts at a line start and ends with "\n"."""
        i, buffer = first, None
        while i < len(self.pieces):
            if buffer is None and self.pieces[i] is None:
                buffer = bytearray(READ_RUN_BYTES + 2 * LOG_PIECE_BYTES)  # a run and the piece that ends it
            text, after = self.read_span(i, READ_RUN_BYTES, buffer)
            yield text, self.starts[i]
            i = after

    def find(self, offset: int) -> int:
        """The piece holding a character offset."""
        return bisect_right(self.starts, offset) - 1

    def count_newlines(self, start: int, stop: int) -> int:
        """The number of "\\n" between two offsets."""
        count = 0
        i = self.find(start)
        while start < stop:
            piece, piece_start = self.piece(i), self.starts[i]
            count += piece.count("\n", start - piece_start, stop - piece_start)
            start, i = piece_start + len(piece), i + 1
        return count

    def slice(self, start: int, stop: int) -> str:
        """The text between two character offsets."""
        out = []
        i = self.find(start)
        while start < stop:
            text, after = self.read_span(i, stop - start)
            span_start = self.starts[i]
            out.append(text[start - span_start : stop - span_start])
            start, i = span_start + len(text), after
        return out[0] if len(out) == 1 else "".join(out)

    def rfind_newline(self, before: int) -> int:
        """The offset of the last "\\n" before an offset, or -1."""
        i = self.find(before - 1)
        while i >= 0:
            piece_start = self.starts[i]
            found = self.piece(i).rfind("\n", 0, before - piece_start)
            if found >= 0:
                return piece_start + found
            before, i = piece_start, i - 1
        return -1

    def copy(self, split: Callable[[LogFile], LogFile | None] | None = None) -> TextPieces:
        """The same text, its pieces shared. Without ``split``, a copy only to read. With it, what is added to
        the copy goes to the file ``split`` makes, a copy of this one's whole file so far (or, when it cannot,
        to memory: never into this one's file)."""
        copy = TextPieces()
        copy.pieces, copy.starts, copy.bytes = list(self.pieces), self.starts[:], self.bytes[:]
        copy.files, copy.size, copy.utf8, copy.lines = list(self.files), self.size, self.utf8, self.lines
        if split is None:
            return copy
        file = self.files[0][1] if len(self.files) == 1 else None
        own = split(file) if file is not None and file.problem is None else None
        if own is not None:
            copy.files = [(0, own, 0)]
        elif copy.files:
            copy.files.append((len(copy.pieces), None, copy.utf8))
        return copy

    @property
    def path(self) -> str | None:
        """The file its text is written to (None: memory)."""
        file = self.files[0][1] if self.files else None
        return file.path if file is not None else None

    def close(self) -> None:
        if self.files and self.files[-1][1] is not None:
            self.files[-1][1].close()

    def find_memory_start(self) -> tuple[int, str] | None:
        """Where its text is kept in memory because its file failed (a character offset), and why; None while
        every piece is in its file, or it never had one."""
        file = self.files[-1][1] if self.files else None
        if not self.files or file is not None and file.problem is None:
            return None
        first = next((i for i, piece in enumerate(self.pieces) if piece is not None), None)
        why = file.problem if file is not None else "its file could not be made"
        return (self.starts[first] if first is not None else self.size), why


class Log:
    """One append-only output stream, normalized like a terminal and indexed by line.

    Committed lines (ended by ``\\n``) never change again; the last, unfinished
    line may still be rewritten by a carriage return. Committed text goes to the
    log's TextPieces (in its file) before any read of it returns, a piece at a
    time: memory holds the line index, the unfinished line and what is not yet
    added. Neither appending nor reading copies the whole stream.
    """

    __slots__ = ("_cr", "_esc", "_indexed", "_marked", "_marks", "_open", "_recent", "_recent_size", "_text")

    def __init__(self, file: LogFile | None = None) -> None:
        self._text = TextPieces(file)  # the committed text, but for the recent writes
        self._recent: list[str] = []  # committed writes not yet added to it ...
        self._recent_size = 0  # ... and their length
        self._marks = array("q")  # where lines LINE_MARK_EVERY, 2 * LINE_MARK_EVERY, ... start ...
        self._marked = 0  # ... among this many committed lines ...
        self._indexed = 0  # ... which end at this offset: the index is extended when a read needs it
        self._open: list[str] = []  # the unfinished last line, in fragments
        self._cr = False  # a carriage return waits to see whether "\n" follows
        self._esc = ""  # an escape sequence cut off at the end of the last write

    @property
    def _size(self) -> int:
        """Committed characters."""
        return self._text.size + self._recent_size

    def write(self, raw: str) -> None:
        text = self._esc + raw if self._esc else raw
        self._esc = ""
        if "\x1b" in text or "\x07" in text or "\x00" in text:
            text, self._esc = strip_escapes(text)
        if self._cr:
            text, self._cr = "\r" + text, False
        if "\r" in text:
            text = CR_NEWLINE_RE.sub("\n", text)
            if text.endswith("\r"):
                text, self._cr = text.rstrip("\r"), True
            first_newline = text.find("\n")
            if text.find("\r", 0, first_newline if first_newline >= 0 else len(text)) >= 0:
                self._open.clear()
            text = OVERWRITTEN_RE.sub("", text)
        if not text:
            return
        last_newline = text.rfind("\n")
        if last_newline < 0:
            self._open.append(text)
            return
        done = text[: last_newline + 1]
        if self._open:
            done = "".join([*self._open, done])
            self._open.clear()
        self._commit(done)
        if last_newline + 1 < len(text):
            self._open.append(text[last_newline + 1 :])

    def flush(self) -> None:
        """At the end of a cell: an escape sequence that never ended is text after all (nothing is lost);
        what is committed goes to the file, which is then closed."""
        if self._esc:
            held, self._esc = self._esc, ""
            self.write(held[1:])
        self._seal()
        self._text.close()

    def write_block(self, text: str) -> None:
        """Append text as whole lines of its own (results, tracebacks)."""
        if self._open or self._cr:
            self.write("\n")
        self.write(text if text.endswith("\n") else text + "\n")

    def _commit(self, done: str) -> None:
        self._recent.append(done)
        self._recent_size += len(done)
        if self._recent_size >= LOG_PIECE_BYTES:
            self._seal()

    def write_out(self) -> None:
        """Add the recent writes to the text, in its file (a person following the file sees them)."""
        self._seal()

    def _seal(self) -> None:
        """Add the recent writes to the text (to the file): once they add up, before a read, at the end."""
        if self._recent:
            text = self._recent[0] if len(self._recent) == 1 else "".join(self._recent)
            self._recent.clear()
            self._recent_size = 0
            self._text.add(text)

    def take_back(self) -> None:
        """Take as its text what its file holds already (written before a restart of the server); OSError when
        it cannot be read. Text after the last line end (a write cut short) is its open line."""
        rest = self._text.take_back()
        if rest:
            self._open.append(rest)

    @property
    def open_line(self) -> str:
        if len(self._open) > 1:
            self._open[:] = ["".join(self._open)]
        return self._open[0] if self._open else ""

    @property
    def line_count(self) -> int:
        return self._committed_lines() + (1 if self._open else 0)

    def _committed_lines(self) -> int:
        self._seal()
        return self._text.lines

    def _index(self) -> array:
        """The line marks, extended over the text committed since the last read (never re-split)."""
        if self._indexed < self._size:
            self._seal()
            pieces = self._text
            for span, span_start in pieces.iterate(pieces.find(self._indexed)):
                for start in range(max(0, self._indexed - span_start), len(span), INDEX_WINDOW):
                    lines = span[start : start + INDEX_WINDOW].split("\n")
                    lines.pop()  # the text after the window's last "\n" is indexed by the next window
                    ends = list(accumulate(map(partial(add, 1), map(len, lines)),
                                           initial=span_start + start))
                    # ends[k] is where the window's k-th line starts, line self._marked + k overall
                    self._marks.extend(
                        ends[-self._marked % LINE_MARK_EVERY or LINE_MARK_EVERY :: LINE_MARK_EVERY])
                    self._marked += len(lines)
            self._indexed = pieces.size
        return self._marks

    def _line_start(self, n: int, known: tuple[int, int] = (0, 0)) -> int:
        """Where committed line n starts (for n equal to the committed line count: the committed size).

        Found from the nearest line mark before it, or from a known (line, start) pair when nearer.
        """
        marks, pieces = self._index(), self._text
        line, position = known
        if n // LINE_MARK_EVERY * LINE_MARK_EVERY > line:
            line = n // LINE_MARK_EVERY * LINE_MARK_EVERY
            position = marks[line // LINE_MARK_EVERY - 1]
        skip = n - line
        i = pieces.find(position)
        while skip:  # every piece ends with "\n", so the lines skipped in one end where the next starts
            piece, at = pieces.piece(i), position - pieces.starts[i]
            while skip and at < len(piece):
                at, skip = piece.find("\n", at) + 1, skip - 1
            position, i = pieces.starts[i] + at, i + 1
        return position

    @property
    def chars(self) -> int:
        return self._size + len(self.open_line)

    @property
    def utf8_bytes(self) -> int:
        self._seal()
        return self._text.utf8 + utf8_len(self.open_line)

    def lines(self, first: int, stop: int) -> str:
        """Lines first..stop-1 (0-based) joined by newlines, without a final newline."""
        committed = self._committed_lines()
        text = ""
        if first < min(stop, committed):
            start = self._line_start(first)
            text = self._text.slice(start, self._line_start(min(stop, committed), (first, start)) - 1)
        if stop > committed and self._open:
            text = f"{text}\n{self.open_line}" if first < committed else self.open_line
        return text

    def text(self) -> str:
        return self.lines(0, self.line_count)

    def span(self, start: int, stop: int) -> str:
        """Characters start..stop-1 of the text so far, the open line included (a notebook's stream text)."""
        self._seal()
        size = self._text.size
        text = self._text.slice(start, min(stop, size)) if start < size else ""
        if stop > size:
            text += self.open_line[max(0, start - size) : stop - size]
        return text

    def line_at(self, offset: int) -> int:
        """The 0-based line holding a character offset (found from the line index)."""
        marks = self._index()
        offset = min(offset, self._text.size)
        mark = bisect_right(marks, offset)
        line, at = (mark * LINE_MARK_EVERY, marks[mark - 1]) if mark else (0, 0)
        return line + self._text.count_newlines(at, offset)

    def tail(self, count: int) -> list[str]:
        """The last count lines, found from the end without building the index."""
        if count <= 0:
            return []
        wanted = min(self._committed_lines(), count - (1 if self._open else 0))
        lines = []
        if wanted > 0:
            end = position = self._text.size - 1  # the "\n" ending the last committed line
            for _ in range(wanted):
                position = self._text.rfind_newline(position)
                if position < 0:
                    break
            lines = self._text.slice(position + 1, end).split("\n")
        return [*lines, self.open_line] if self._open else lines

    def frozen(self) -> Log:
        """A copy that later writes leave unchanged (the text itself is shared), to read off the event
        loop."""
        self._seal()
        copy = Log()
        copy._text = self._text.copy()
        copy._marks, copy._marked, copy._indexed = self._marks[:], self._marked, self._indexed
        copy._open = [self.open_line] if self._open else []
        return copy

    def copy(self, split: Callable[[LogFile], LogFile | None] | None = None) -> Log:
        """A log that goes on separately from this one: same state, the committed text itself shared. What it
        commits from now on goes to the file ``split`` makes, a copy of this log's whole file so far (else,
        or when it cannot, to memory: never into this log's file)."""
        copy = self.frozen()
        copy._text = self._text.copy(split or (lambda file: None))
        copy._esc, copy._cr = self._esc, self._cr
        return copy

    def settled_text(self) -> str | None:
        """All the text as one string, which write() turns into this same log again (normalized text is
        written as it is); None while a carriage return or the start of an escape sequence waits for the
        next write."""
        if self._cr or self._esc:
            return None
        self._seal()
        return self._text.slice(0, self._text.size) + self.open_line

    @property
    def path(self) -> str | None:
        """The file its text is written to (None: memory)."""
        return self._text.path

    def describe_in_memory(self) -> str | None:
        """Which lines are kept in memory after its file failed, and why (None: none are)."""
        self._seal()
        found = self._text.find_memory_start()
        if found is None:
            return None
        return f"lines {format_count(self.line_at(found[0]) + 1)} on are kept in memory ({found[1]})"

    @property
    def indexed(self) -> bool:
        """Whether every committed line is indexed (else build_index does it)."""
        return self._indexed == self._size

    def build_index(self) -> None:
        """Index every committed line now (off the event loop), so that no later read or search indexes it."""
        self._index()

    def adopt_index(self, copy: Log) -> None:
        """Keep the line index a frozen copy built: the text is append-only, so it holds for this log too."""
        if copy._indexed > self._indexed:
            self._marks, self._marked, self._indexed = copy._marks, copy._marked, copy._indexed

    async def index_in_thread(self) -> None:
        """Index what is not indexed yet on a frozen copy in a worker thread, never on the event loop (a
        gigabyte of output takes seconds to read from its file), and keep that index."""
        if not self.indexed:
            frozen = self.frozen()
            await asyncio.to_thread(frozen.build_index)
            self.adopt_index(frozen)

    def matching_lines(self, query: Query) -> Iterator[int]:
        """The line index of every match, in order; a match never spans the spans text is read in (a piece
        kept in memory, or about READ_RUN_BYTES of a file: see TextPieces.iterate), which start at line
        starts."""
        marks, pieces = self._index(), self._text
        # line `line` holds offset `at`: each match counts the lines from the last one or a mark
        line = at = 0
        for span, span_start in pieces.iterate():
            for offset in query.starts(span):
                offset += span_start
                mark = bisect_right(marks, offset)
                if mark * LINE_MARK_EVERY > line:
                    line, at = mark * LINE_MARK_EVERY, marks[mark - 1]
                if at >= span_start:  # within the span at hand: never read it again
                    line += span.count("\n", at - span_start, offset - span_start)
                else:
                    line += pieces.count_newlines(at, offset)
                at = offset
                yield line
        if self._open:
            for _ in query.starts(self.open_line):
                yield self._committed_lines()


def parse_line_range(spec: str | None, total: int) -> tuple[int, int]:
    """Resolve ``start:stop`` (1-based, inclusive, negatives from the end) to a 0-based [first, stop).

    Raises ValueError with the reason for a malformed range.
    """
    if spec is None or not spec.strip() or spec.strip() == ":":
        return 0, total
    match = re.fullmatch(r"\s*([+-]?\d{1,18})?\s*(?:(:)\s*([+-]?\d{1,18})?)?\s*", spec)
    if not match or (match[1] is None and match[3] is None):
        raise ValueError(f'"{clip(spec, 40)}" is not a line range; use start:stop such as "1:40", "-40:", '
                         '":10" or "3:3"')
    if match[2] is None:  # a single number N means N:N
        start = stop = int(match[1])
    else:
        start = int(match[1]) if match[1] is not None else 1
        stop = int(match[3]) if match[3] is not None else -1
    if start == 0 or stop == 0:
        raise ValueError("line numbers start at 1 (use -1 for the last line)")
    if (start > 0) == (stop > 0) and start > stop:
        raise ValueError(f"start {start} comes after stop {stop}")

    def position(n: int) -> int:
        return n if n > 0 else total + 1 + n

    first, last = max(1, position(start)), min(total, position(stop))
    return first - 1, max(first - 1, last)


# A search runs re's finditer over each piece of a log and over its open line, not line by line, so
# a match runs over line ends wherever its pattern lets it (\s, [^x], (?s).). It runs in a worker
# thread only when its time is linear in the text: a thread cannot be stopped, and re holds the GIL.
# search_is_linear decides that from the parsed pattern, conservatively (anything else is forked,
# see search_log):
# - re tries the pattern at every position (at line starts only, for after_newline) and goes on
#   where a match ended, so the time is linear when no attempt takes more than a bounded number of
#   steps besides the characters its match consumes.
# - A part without unbounded repeats tries at most `ways` paths (a product over a sequence, a sum over
#   alternatives, a sum of powers over a repeat), each reading at most `width` characters: at most
#   ways * (width + 1) <= SEARCH_STEP_BUDGET steps.
# - A scan, a repeat of one character class by a count that varies, reads the run of such characters
#   from where an attempt enters it and backtracks along it, trying the rest at each count: that
#   attempt costs the length of the run. The sum stays linear only when a bounded number of attempts
#   enter any one run: when some literal character before the scan lies outside its class (an attempt
#   then starts before the run, within that part's width of it), or when attempts start only at line
#   starts and the class cannot match "\n" (the run then lies within one line). So `line \d+ ` is linear,
#   but `\d+x` (every digit of a run starts an attempt), `error.*timeout` (every "error" of a long
#   line) and `^\s*File "` (\s runs over line ends: every line of a long run of blank lines rescans
#   the rest of it) are quadratic.
# - A scan that ends the pattern reads its run once: the match ends with it and the search goes on
#   after it. Not in after_newline's lookahead, which consumes nothing: there it is a scan as above.
# - At most one other scan: two multiply (\d+\d+, .*=.*). An unbounded repeat anywhere else (of a group,
#   in an alternative or a lookaround), a backreference or a conditional group: not linear.
SEARCH_STEP_BUDGET = 256  # the most steps an attempt of a part without scans may take
ONE_CHARACTER_OPS = (sre_parser.LITERAL, sre_parser.NOT_LITERAL, sre_parser.IN, sre_parser.ANY)
REPEAT_OPS = tuple(getattr(sre_parser, name) for name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT")
                   if hasattr(sre_parser, name))  # a possessive repeat (Python 3.11) is costed like any other
ATOMIC_GROUP = getattr(sre_parser, "ATOMIC_GROUP", None)
LINE_START_ANCHORS = (  # ^ and \A: attempts that start only at line starts
    (sre_parser.AT, sre_parser.AT_BEGINNING), (sre_parser.AT, sre_parser.AT_BEGINNING_STRING))


def search_is_linear(pattern: re.Pattern[str], lookahead: bool) -> bool:
    """Whether re's finditer over any text takes time linear in it (see above); lookahead: the search is
    after_newline's "\\n(?=rest)" (consuming nothing) and pattern.match at the start."""
    try:
        parsed = sre_parser.parse(pattern.pattern, pattern.flags)
    except (re.error, OverflowError):
        return False
    if not pattern.flags & re.IGNORECASE and all(op is sre_parser.LITERAL for op, _ in parsed):
        return True  # a string: re searches for it like str.find
    items = sequence_pattern(list(parsed), pattern.flags)
    if estimate_part_cost([(op, av) for op, av, _ in items]) is not None:
        return True
    if not lookahead and items and is_scan(*items[-1][:2]):
        items = items[:-1]
    scans = [i for i, (op, av, _) in enumerate(items) if is_scan(op, av)]
    rest = [(op, av) for i, (op, av, _) in enumerate(items) if i not in scans]
    if len(scans) > 1 or estimate_part_cost(rest) is None:
        return False
    if not scans:
        return True
    (_, (_, _, body), flags), before = items[scans[0]], items[: scans[0]]
    run = sre_compile.compile(sre_parser.SubPattern(parsed.state, body), flags)
    if items[0][:2] in LINE_START_ANCHORS and not run.fullmatch("\n"):
        return True
    return any(op is sre_parser.LITERAL and not run.fullmatch(chr(av))
               and (not own & re.IGNORECASE or chr(av).lower() == chr(av).upper()) for op, av, own in before)


def sequence_pattern(items: list, flags: int) -> list[tuple[Any, Any, int]]:
    """The elements of a parsed pattern that match one after the other, groups that do not repeat opened
    up, each with the flags in force there."""
    sequence = []
    for op, av in items:
        if op is sre_parser.SUBPATTERN:
            sequence += sequence_pattern(list(av[3]), (flags | av[1]) & ~av[2])
        elif op is ATOMIC_GROUP:
            sequence += sequence_pattern(list(av), flags)
        else:
            sequence.append((op, av, flags))
    return sequence


def is_scan(op: Any, av: Any) -> bool:
    """A repeat of one character class by a count that varies."""
    if op not in REPEAT_OPS or av[0] == av[1]:
        return False
    body = list(av[2])
    while len(body) == 1 and body[0][0] is sre_parser.SUBPATTERN:
        body = list(body[0][1][3])
    return len(body) == 1 and body[0][0] in ONE_CHARACTER_OPS


def estimate_part_cost(items: list) -> tuple[int, int] | None:
    """(ways, width) of part of a parsed pattern, or None past SEARCH_STEP_BUDGET or for an unbounded
    repeat, a backreference, a conditional group or anything else."""
    ways, width = 1, 0
    for op, av in items:
        if op in ONE_CHARACTER_OPS:
            cost = 1, 1
        elif op is sre_parser.AT:
            cost = 1, 0
        elif op is sre_parser.SUBPATTERN:
            cost = estimate_part_cost(list(av[3]))
        elif op is ATOMIC_GROUP:
            cost = estimate_part_cost(list(av))
        elif op in (sre_parser.ASSERT, sre_parser.ASSERT_NOT):
            cost = estimate_part_cost(list(av[1]))
        elif op is sre_parser.BRANCH:
            costs = [estimate_part_cost(list(branch)) for branch in av[1]]
            cost = None if None in costs else (sum(w for w, _ in costs), max(n for _, n in costs))
        elif op in REPEAT_OPS:
            cost = estimate_repeat_cost(*av)
        else:
            return None
        if cost is None:
            return None
        ways, width = ways * cost[0], width + cost[1]
        if ways * (width + 1) > SEARCH_STEP_BUDGET:
            return None
    return ways, width


def estimate_repeat_cost(low: int, high: int, body: Any) -> tuple[int, int] | None:
    """(ways, width) of a bounded repeat: each count of it, each time any way of its body."""
    cost = estimate_part_cost(list(body))
    if cost is None or high == sre_parser.MAXREPEAT:
        return None
    ways, width = cost
    if ways == 1:
        return high - low + 1, high * width
    if high >= SEARCH_STEP_BUDGET.bit_length():  # ways ** high > SEARCH_STEP_BUDGET
        return None
    return sum(ways**count for count in range(low, high + 1)), high * width


@dataclass
class Query:
    """A compiled search, with a fast form for a regex anchored at line starts."""

    pattern: re.Pattern[str]
    mode: str  # the mode used: "regex", "literal", "regex (auto)" or "literal (auto)"
    # For "^rest": "\n(?=rest)". Python's regex engine cannot skip ahead to a "^", but it
    # scans for a literal "\n" at C speed; one match per matching line start either way.
    after_newline: re.Pattern[str] | None = None

    @property
    def linear(self) -> bool:
        """Whether re finds the pattern in time linear in the text (see search_is_linear)."""
        try:
            return search_is_linear(self.pattern, self.after_newline is not None)
        except RecursionError:  # nested deeper than the analysis follows: not known to be linear
            return False

    def starts(self, text: str) -> Iterator[int]:
        """The offset of every match in text, which starts at a line start."""
        if self.after_newline is None:
            for match in self.pattern.finditer(text):
                yield match.start()
            return
        if self.pattern.match(text):
            yield 0
        for match in self.after_newline.finditer(text):
            yield match.start() + 1


def anchor_lines(query: str, flags: int) -> re.Pattern[str] | None:
    """"\n(?=rest)" for a regex "^rest" whose first element is the line-start anchor (not one branch of
    many)."""
    if not query.startswith("^"):
        return None
    try:
        parsed = sre_parser.parse(query, flags)
        if len(parsed) < 2 or parsed[0] != (sre_parser.AT, sre_parser.AT_BEGINNING):
            return None
        return re.compile(f"\n(?={query[1:]})", flags)
    except (re.error, AttributeError, TypeError):
        return None


def compile_query(query: str, mode: str, ignore_case: bool) -> Query:
    """Compile a search query and say which mode was used."""
    flags = re.MULTILINE | (re.IGNORECASE if ignore_case else 0)
    if mode == "auto":
        try:
            pattern, used = re.compile(query, flags), "regex (auto)"
        except (re.error, OverflowError, RecursionError):
            pattern, used = re.compile(re.escape(query), flags), "literal (auto)"
    elif mode == "regex":
        try:
            pattern, used = re.compile(query, flags), "regex"
        except (re.error, OverflowError) as exc:  # OverflowError: a repetition count too large
            raise ValueError(f"the regex does not compile: {exc}") from None
        except RecursionError:
            raise ValueError("the regex does not compile: it is nested too deeply") from None
    else:
        pattern, used = re.compile(re.escape(query), flags), "literal"
    if pattern.search(""):
        raise ValueError("the pattern matches the empty string, so it would match every position")
    return Query(pattern, used,
                 anchor_lines(pattern.pattern, flags) if used.startswith("regex") else None)


_tokenizer: Any = None
_tokenizer_problem: str | None = None  # why o200k_base did not load: counts are then estimates
_estimate_told = False  # whether a result has said that counts are estimates (one does, once)
_tokenizer_lock = threading.Lock()
PROBLEM_CHARS = 200
ESTIMATE_NOTICE = (
    f"[token counts are estimates: the {TOKEN_ENCODING} tokenizer could not be loaded ({{problem}}), so each "
    "UTF-8 byte counts as a token (never fewer than the real count; some outputs are omitted that would "
    "fit); to give it, set TIKTOKEN_CACHE_DIR in loommux's environment (the host's env entry) to a folder "
    "holding tiktoken's o200k_base cache file, then restart loommux]")


def count_tokens(text: str) -> int:
    """Count o200k_base tokens, loading tiktoken on first use (call from a worker thread). When it cannot be
    loaded (offline, no TIKTOKEN_CACHE_DIR in a host's reduced environment), the text's UTF-8 bytes: an upper
    bound, as every token is at least one byte; the load is not tried again."""
    global _tokenizer, _tokenizer_problem
    with _tokenizer_lock:
        if _tokenizer is None and _tokenizer_problem is None:
            try:
                import tiktoken

                _tokenizer = tiktoken.get_encoding(TOKEN_ENCODING)
            except Exception as exc:  # noqa: BLE001 - offline, corrupt cache, proxy: all mean unavailable
                _tokenizer_problem = clip(" ".join(f"{type(exc).__name__}: {exc}".split()), PROBLEM_CHARS)
    if _tokenizer is None:
        return len(text.encode("utf-8", "surrogatepass"))
    return len(_tokenizer.encode_ordinary(text))


def take_estimate_notice() -> list[str]:
    """The one line saying that token counts are estimates, for the first result after one was made."""
    global _estimate_told
    with _tokenizer_lock:
        if _tokenizer_problem is None or _estimate_told:
            return []
        _estimate_told = True
        return [ESTIMATE_NOTICE.format(problem=_tokenizer_problem)]


async def fits_token_limit(output: Log | str) -> bool:
    """Whether a finished output (or a text) is at most TOKEN_LIMIT tokens, with bounded work."""
    size = output.utf8_bytes if isinstance(output, Log) else len(output.encode("utf-8", "surrogatepass"))
    if size <= TOKEN_LIMIT:  # every token is at least one byte
        return True
    if size > TOKEN_LIMIT * MAX_TOKEN_BYTES:
        return False
    text = output.text() if isinstance(output, Log) else output
    return await asyncio.to_thread(count_tokens, text) <= TOKEN_LIMIT


# ---------------------------------------------------------------- Error codes
# Sent to kernels with the sections after it (see read_kernel_side_source): the in-kernel client names
# its failures from this table too. Every failure a model or a program can act on has one of these
# codes, however it is reported: a tool's "<code>: <message>" result, /api's JSON body
# {"error_code", "message"} with the table's HTTP status, or a kernel's ``DaemonError.code``. The states of
# an execution are here too: results, status, the console, notebooks and the in-kernel client name them.

RUNNING, COMPLETED, ERROR, INTERRUPTED, KILLED = "running", "completed", "error", "interrupted", "killed"
STATES = (RUNNING, COMPLETED, ERROR, INTERRUPTED, KILLED)
BUSY = "busy"
EXECUTION_NOT_FOUND = "execution_not_found"
INVALID_CELL_HEADER = "invalid_cell_header"
INVALID_LINE_RANGE = "invalid_line_range"
INVALID_MAX_CHARS = "invalid_max_chars"
INVALID_QUERY = "invalid_query"
INVALID_STREAM = "invalid_stream"
INVALID_TIMEOUT = "invalid_timeout"
INVALID_CONTEXT = "invalid_context"
INVALID_ARGUMENTS = "invalid_arguments"
KERNEL_UNAVAILABLE = "kernel_unavailable"
KERNEL_NOT_OWNED = "kernel_not_owned"
NAME_NOT_FOUND = "name_not_found"
NOT_IPYTHON = "not_ipython"
NO_ANSWER = "no_answer"
SEARCH_TIMEOUT = "search_timeout"
RESOURCE_NOT_FOUND = "resource_not_found"
KERNEL_NOT_FOUND = "kernel_not_found"
INVALID_RESOURCE_NAME = "invalid_resource_name"
INVALID_BODY = "invalid_body"
INVALID_LEASE_POLICY = "invalid_lease_policy"
STALE_LEASE_POLICY = "stale_lease_policy"
NO_CONTROL_PLANE = "no_control_plane"
NOT_IN_A_KERNEL = "not_in_a_kernel"
OUTPUT_LOST = "output_lost"
FUNCTION_RAISED = "function_raised"

# code: (the HTTP status /api answers it with, when it happens)
ERROR_CODES: dict[str, tuple[int, str]] = {
    BUSY: (409, "a cell is running in the kernel; cells are never queued"),
    EXECUTION_NOT_FOUND: (404, "no execution has that number (or no cell has run yet)"),
    KERNEL_UNAVAILABLE: (503, "the kernel could not be started, or died and is being replaced"),
    KERNEL_NOT_OWNED: (409, "not loommux's kernel (attached with --existing): restart it where it runs"),
    NAME_NOT_FOUND: (404, "inspect: a name or attribute the kernel does not have, or one that raised"),
    NOT_IPYTHON: (409, "namespace, inspect and reset need an IPython kernel; this one is another language's"),
    NO_ANSWER: (504, "the kernel did not answer a namespace, inspect or reset request in time"),
    RESOURCE_NOT_FOUND: (404, "no kernel has that name or id"),
    KERNEL_NOT_FOUND: (404, "no private kernel has that handle"),
    INVALID_RESOURCE_NAME: (400, "a kernel name breaks the naming rule"),
    INVALID_CELL_HEADER: (400, "the cell's %%loommux header is malformed"),
    INVALID_LINE_RANGE: (400, "a line range that cannot be read"),
    INVALID_MAX_CHARS: (400, "max_chars is not a positive integer"),
    INVALID_QUERY: (400, "an empty search query or an invalid regex"),
    INVALID_STREAM: (400, "an output stream that does not exist"),
    INVALID_TIMEOUT: (400, "a timeout that is not a non-negative number in range"),
    INVALID_CONTEXT: (400, "context lines out of range"),
    INVALID_ARGUMENTS: (400, "arguments of the wrong name, type or encoding"),
    SEARCH_TIMEOUT: (400, "a regex search took too long and was stopped"),
    INVALID_BODY: (400, "a request body that is not a JSON object"),
    INVALID_LEASE_POLICY: (400, "a lease setting that is unknown or out of range"),
    STALE_LEASE_POLICY: (409, "the lease policy changed since the client read it"),
    NO_CONTROL_PLANE: (503, "in a kernel: no control plane to reach (stdio), or it cannot be reached"),
    NOT_IN_A_KERNEL: (400, "in a process: it is not a loommux kernel"),
    OUTPUT_LOST: (410, "output whose file was removed or cut short under the server"),
    FUNCTION_RAISED: (422, "a published function raised (or ended without a value): its traceback says why"),
}


# What /api and the console answer for a request the plain HTTP layer refuses, by status. Named here, not
# from the status's phrase, which differs between Python versions (413: "Request Entity Too Large" in 3.11,
# "Content Too Large" in 3.13).
HTTP_ERRORS = {
    400: ("bad_request", "a malformed HTTP request"),
    401: ("unauthorized", "a missing or wrong token"),
    403: ("forbidden", "a credential that does not open this path, or a refused Origin or Host"),
    404: ("not_found", "no endpoint at that path"),
    405: ("method_not_allowed", "a method the path does not take"),
    406: ("not_acceptable", "an Accept header that rules out the answer"),
    408: ("request_timeout", "a request head that did not arrive in time"),
    409: ("conflict", "a request that conflicts with the state of its resource"),
    413: ("payload_too_large", "a body over the size limit"),
    415: ("unsupported_media_type", "a body that is not JSON"),
    417: ("expectation_failed", "an Expect header other than 100-continue"),
    431: ("request_header_fields_too_large", "a request head over the size limit"),
    500: ("internal_server_error", "a fault of the server's own (a bug: please report it)"),
    503: ("service_unavailable", "the server is at a limit; try again"),
}
ERROR_CODES.update({code: (status, meaning) for status, (code, meaning) in HTTP_ERRORS.items()})


def name_http_error(status: int) -> str:
    """A plain HTTP refusal's code (http_<status> for one the table does not name)."""
    return HTTP_ERRORS[status][0] if status in HTTP_ERRORS else f"http_{status}"


def status_of_error(code: str) -> int:
    """The HTTP status of an error code (400 for a code the table does not know)."""
    return ERROR_CODES.get(code, (400, ""))[0]


# ---------------------------------------------------------------- Cell input
# Also sent to kernels, between the error codes and the kernel-side extension (see read_kernel_side_source):
# both ends of the wire read the header with the same grammar.
import math  # noqa: F811  (each section sent to kernels imports what it uses, again here)
import re
from dataclasses import dataclass

HEADER_MAGIC = "loommux"
HEADER_PREFIX = "%%" + HEADER_MAGIC
HEADER_USAGE = "%%loommux [--wait SECONDS] [--full-output] [--kernel NAME]"
DEFAULT_WAIT_SECONDS = 10.0
QUOTED_WORD_CHARS = 80  # of a header word quoted back in an error
DECIMAL_RE = re.compile(r"\d+(?:\.\d*)?|\.\d+")
# . and .. are left out: a name is also a directory's name (its output files), never its parent's
RESOURCE_NAME_RE = re.compile(r"(?!\.\.?$)[A-Za-z0-9._-]{1,64}")
RESOURCE_NAME_RULE = "1-64 characters of A-Z, a-z, 0-9, '.', '_' and '-'"
PRIVATE_ID_PREFIX = "~"  # outside the name alphabet: a private resource can never be joined by name
PRIVATE_ID_RE = re.compile(r"~[0-9a-f]{8}")
HANDLE_BYTES = 16  # a private kernel's handle: 128 random bits, 22 URL-safe characters after "~NAME."
# Older releases read options from comments such as "# loommux: --wait 120"; they are no longer read.
LEGACY_DIRECTIVE_RE = re.compile(r"#\s*loommux:\s*(--.*?)\s*")


class CellHeaderError(ValueError):
    pass


@dataclass
class CellOptions:
    wait: float = DEFAULT_WAIT_SECONDS
    full_output: bool = False
    header: bool = False
    kernel: str | None = None  # hand the cell to this kernel (a resource name or a private id)


def quote_word(word: str) -> str:
    """A header word in quotes, cut to QUOTED_WORD_CHARS characters (saying how many more it had)."""
    if len(word) <= QUOTED_WORD_CHARS:
        return f'"{word}"'
    return f'"{word[:QUOTED_WORD_CHARS]}… [+{len(word) - QUOTED_WORD_CHARS:,} chars]"'


def is_kernel_ref(ref: str) -> bool:
    """A kernel is named by a resource name or by a private resource's id."""
    return bool(RESOURCE_NAME_RE.fullmatch(ref) or PRIVATE_ID_RE.fullmatch(ref))


def parse_header_arguments(arguments: str) -> CellOptions:
    """Parse what follows ``%%loommux`` on the header line; raise CellHeaderError."""
    options, seen = CellOptions(header=True), set()
    words = arguments.split()
    i = 0
    while i < len(words):
        word = words[i]
        name, has_value, value = word.partition("=")
        if name in seen:
            raise CellHeaderError(f"{name} is given more than once")
        if name == "--full-output":
            if has_value:
                raise CellHeaderError("--full-output takes no value")
            options.full_output = True
        elif name in ("--wait", "--kernel"):
            if not has_value:
                i += 1
                if i == len(words):
                    example = "--wait 60" if name == "--wait" else "--kernel lab"
                    raise CellHeaderError(f"{name} needs a value, e.g. {example}")
                value = words[i]
            if name == "--kernel":
                if not is_kernel_ref(value):
                    raise CellHeaderError(f"--kernel takes a kernel name ({RESOURCE_NAME_RULE}) or a private "
                                          f"id, not {quote_word(value)}")
                options.kernel = value
            elif not DECIMAL_RE.fullmatch(value) or float(value) <= 0 or not math.isfinite(float(value)):
                raise CellHeaderError(f"--wait takes a positive number of seconds, not {quote_word(value)}")
            else:
                options.wait = float(value)
        else:
            raise CellHeaderError(f"unknown option {quote_word(word)}")
        seen.add(name)
        i += 1
    return options


def extract_header_arguments(first_line: str) -> str | None:
    """What follows ``%%loommux`` when a cell's first line is the header, else None."""
    first_line = first_line.rstrip("\r\n")
    if first_line != HEADER_PREFIX and not first_line.startswith((HEADER_PREFIX + " ", HEADER_PREFIX + "\t")):
        return None
    return first_line[len(HEADER_PREFIX) :]


def parse_cell_header(source: str) -> CellOptions:
    """Read the options of a cell that starts with ``%%loommux``; other cells get the defaults."""
    arguments = extract_header_arguments(source.split("\n", 1)[0])
    return CellOptions() if arguments is None else parse_header_arguments(arguments)


def find_legacy_directives(source: str) -> list[str]:
    """The options of "# loommux: --..." comments among the cell's leading lines: the blank and
    comment lines before its first line of code (a %%loommux header on line 1 is not code)."""
    found = []
    for number, line in enumerate(source.split("\n")):
        if number == 0 and extract_header_arguments(line) is not None:
            continue
        line = line.strip()
        if line and not line.startswith("#"):
            break
        directive = LEGACY_DIRECTIVE_RE.fullmatch(line)
        if directive:
            found.append(directive.group(1))
    return found


def describe_legacy_directives(source: str) -> str | None:
    """One line saying that the cell's legacy directives were not read, and what to write instead."""
    options = find_legacy_directives(source)
    if not options:
        return None
    quoted = ", ".join(f'"# loommux: {option}"' for option in options)
    verb = "is" if len(options) == 1 else "are"
    return (f'Notice: {quoted} {verb} not read; write "{HEADER_PREFIX} {" ".join(options)}" '
            "as the cell's first line.")


# ---------------------------------------------------------------- Published functions
# Sent to kernels too (see read_kernel_side_source): the functions a kernel publishes as MCP tools of its
# sessions with ``loommux.publish``. A publication is checked here, in the kernel, and a refused one raises
# at once naming what is wrong; the kernel then announces its whole set (bounded, and coalesced: see
# ANNOUNCE_INTERVAL), versioned, on IOPub in a PUBLISHED_MSG_TYPE message, which the server watches for (IOPub
# reaches it over stdio, HTTP and a gateway alike; a person's Jupyter client ignores a message type it does
# not know). A call is a cell, ``loommux.call("name", '{"arg": ...}')``, its arguments a JSON text (data,
# never Python source), whose value comes back as its execute_result, in CALL_RESULT_MIME.
import json  # noqa: F811  (see "Cell input")
import re
import threading
from typing import Any  # noqa: F811

PUBLISHED_MSG_TYPE = "loommux_published"
CALL_RESULT_MIME = "application/vnd.loommux.result+json"
CALL_LINE_CHARS = 100  # a value's JSON up to this long is shown on one line
TOOL_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}")  # MCP's tool name rule
TOOL_NAME_RULE = "1-128 characters of A-Z, a-z, 0-9, '_', '-' and '.'"
# loommux's own tools (TOOLS and APP_TOOLS, as a test checks): no function is published under their names
RESERVED_TOOL_NAMES = ("run_cell", "wait", "status", "execution_status", "read_output", "search_output",
                       "interrupt", "restart", "namespace", "inspect", "reset", "view_output")
RESERVED_PARAMETER = "kernel"  # every tool of a loommux session takes it: it names the kernel
JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}
SUPPORTED_ANNOTATIONS = "str, int, float, bool, None, list or dict of those, Optional, Literal"
# Bounds of what a kernel publishes: every client lists the whole set, and tools/list carries it at once.
MAX_PUBLISHED_TOOLS = 100
MAX_DESCRIPTION_CHARS = 2000
MAX_SCHEMA_CHARS = 4000  # an input schema's JSON (a Literal of many choices)
# A kernel announces its set at most this often: a burst of publish calls (a loop) is one announcement, sent
# at the end of the cell (or of the interval, for a long cell or a thread).
ANNOUNCE_INTERVAL = 0.5


class PublishError(ValueError):
    """A function that cannot be published as it is: the message names the parameter or the name at fault."""

    one_line = True  # shown without the kernel side's frames, which say nothing the message does not


def make_schema(annotation: Any) -> dict | None:
    """The JSON schema of a parameter's annotation, or None when it is not one of SUPPORTED_ANNOTATIONS."""
    import types
    import typing

    if annotation is None or annotation in JSON_TYPES:
        return {"type": JSON_TYPES[type(None) if annotation is None else annotation]}
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation in (list, dict):
        return {"type": "array" if annotation is list else "object"}
    if origin is typing.Literal:
        return {"enum": list(args)} if all(type(arg) in JSON_TYPES for arg in args) else None
    if origin is list and len(args) == 1:
        items = make_schema(args[0])
        return None if items is None else {"type": "array", "items": items}
    if origin is dict and len(args) == 2 and args[0] is str:
        values = make_schema(args[1])
        return None if values is None else {"type": "object", "additionalProperties": values}
    if origin in (typing.Union, types.UnionType):
        members = [make_schema(arg) for arg in args]
        if any(member is None for member in members):
            return None
        if all(list(member) == ["type"] and isinstance(member["type"], str) for member in members):
            return {"type": [member["type"] for member in members]}
        return {"anyOf": members}
    return None


def is_json_value(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return False
    return True


def make_input_schema(fn: Any, label: str) -> tuple[dict, list[str]]:
    """A function's input schema from its annotations and defaults, and its positional-only parameters."""
    import inspect

    try:
        signature = inspect.signature(fn, eval_str=True)
    except (TypeError, ValueError, NameError, SyntaxError) as exc:
        raise PublishError(f"cannot read the signature of {label}: {exc}") from None
    properties, required, positional = {}, [], []
    for parameter in signature.parameters.values():
        where = f"parameter {parameter.name!r} of {label}"
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            raise PublishError(f"{where}: *args and **kwargs cannot be described by a JSON schema")
        if parameter.name == RESERVED_PARAMETER:
            raise PublishError(f"{where}: every loommux tool takes {RESERVED_PARAMETER!r} to name a kernel; "
                               "rename the parameter")
        if parameter.annotation is parameter.empty:
            raise PublishError(f"{where} has no annotation; annotate it with one of {SUPPORTED_ANNOTATIONS}")
        schema = make_schema(parameter.annotation)
        if schema is None:
            annotation = parameter.annotation
            shown = annotation.__qualname__ if isinstance(annotation, type) else repr(annotation)
            raise PublishError(f"{where}: {shown} is not supported; use one of {SUPPORTED_ANNOTATIONS}")
        if parameter.default is parameter.empty:
            required.append(parameter.name)
        elif is_json_value(parameter.default):
            schema = {**schema, "default": parameter.default}
        properties[parameter.name] = schema
        if parameter.kind == parameter.POSITIONAL_ONLY:
            positional.append(parameter.name)
    schema = {"type": "object", "properties": properties}
    return ({**schema, "required": required} if required else schema), positional


class CallResult:
    """What ``loommux.call`` returns: a published function's value, shown as JSON (the cell's execute_result
    carries it to the server in CALL_RESULT_MIME)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict:
        text, carried = json.dumps(self.value, ensure_ascii=False), {"value": self.value}
        if not text.isascii() and not is_utf8(text):  # a lone surrogate, which the Jupyter wire cannot send
            text = json.dumps(self.value)  # as JSON escapes
            carried = {"json": text}
        if len(text) > CALL_LINE_CHARS:  # one line a line range could not cut: a line per item
            try:
                text = json.dumps(self.value, ensure_ascii=text.isascii(), indent=1)
            except RecursionError:  # nested too deep for the indenting encoder: kept on one line
                pass
        return {CALL_RESULT_MIME: carried, "text/plain": text}


def is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class PublishedFunctions:
    """The functions this kernel publishes as MCP tools, by tool name; each change announced to the server
    with a version that only grows."""

    def __init__(self) -> None:
        self.functions: dict[str, Any] = {}
        self.tools: dict[str, dict] = {}  # name -> {"name", "description", "inputSchema"}
        self.positional: dict[str, list[str]] = {}  # name -> its positional-only parameters
        self.version = 0
        self.pending = False  # a change not announced yet
        self.sent_at = float("-inf")  # when the last announcement went (time.monotonic)
        self.lock = threading.Condition()  # publish may be called from a thread too
        self.flusher: Any = None  # the thread that sends a pending announcement at the interval's end

    def publish(self, fn: Any, name: str | None, description: str | None) -> str:
        """Publish ``fn`` as tool ``name`` (its __name__ by default), replacing one of that name."""
        import inspect

        if not callable(fn):
            raise PublishError(f"{fn!r} is not a function")
        name = getattr(fn, "__name__", None) if name is None else name
        if not isinstance(name, str) or not TOOL_NAME_RE.fullmatch(name):
            raise PublishError(f"{name!r} is not a valid tool name ({TOOL_NAME_RULE}); pass name=")
        if name in RESERVED_TOOL_NAMES:
            raise PublishError(f"{name!r} is a loommux tool; pass another name=")
        if name not in self.tools and len(self.tools) >= MAX_PUBLISHED_TOOLS:
            raise PublishError(f"this kernel publishes {MAX_PUBLISHED_TOOLS} tools, the most a kernel may; "
                               "loommux.unpublish one first")
        schema, positional = make_input_schema(fn, name)
        if description is None:
            description = inspect.getdoc(fn) or f"{name}{inspect.signature(fn)}"
        description = str(description)
        if len(description) > MAX_DESCRIPTION_CHARS:
            raise PublishError(f"the description of {name} is {len(description):,} characters, over the "
                               f"{MAX_DESCRIPTION_CHARS:,} a tool may have; pass a shorter description=")
        size = len(json.dumps(schema))
        if size > MAX_SCHEMA_CHARS:
            raise PublishError(f"the input schema of {name} is {size:,} characters of JSON, over the "
                               f"{MAX_SCHEMA_CHARS:,} a tool may have; take fewer parameters or choices")
        self.functions[name], self.positional[name] = fn, positional
        self.tools[name] = {"name": name, "description": description, "inputSchema": schema}
        self.announce()
        return name

    def unpublish(self, name: str) -> bool:
        """Withdraw tool ``name``; whether it was published."""
        if name not in self.tools:
            return False
        for table in (self.functions, self.tools, self.positional):
            del table[name]
        self.announce()
        return True

    def forget(self, name: str, value: Any) -> list[str]:
        """A user name removed by reset: the tools of that name or of that function are withdrawn."""
        gone = [tool for tool, fn in self.functions.items() if tool == name or fn is value]
        for tool in gone:
            self.unpublish(tool)
        return gone

    def call(self, name: str, arguments: dict) -> CallResult:
        """Run tool ``name``'s function with these arguments; its value, which must be JSON-compatible."""
        __tracebackhide__ = True  # IPython leaves this frame out of the function's traceback
        if name not in self.functions:
            raise LookupError(f"no function is published as {name!r} in this kernel")
        given = dict(arguments)
        positional = [given.pop(parameter) for parameter in self.positional[name] if parameter in given]
        value = self.functions[name](*positional, **given)
        if not is_json_value(value):
            raise TypeError(f"{name} returned a {type(value).__name__}, which is not JSON-compatible: return "
                            f"{SUPPORTED_ANNOTATIONS.replace(', Optional, Literal', '')} instead")
        return CallResult(value)

    def snapshot(self) -> dict:
        return {"version": self.version, "tools": list(self.tools.values())}

    def announce(self) -> None:
        """A change: the whole set is announced at once, unless an announcement went within ANNOUNCE_INTERVAL;
        then at the end of the interval or of the cell (flush), whichever comes first."""
        import time

        self.version += 1
        with self.lock:
            self.pending = True
            if time.monotonic() - self.sent_at < ANNOUNCE_INTERVAL:
                if self.flusher is None:  # one thread for the kernel's life: a thread per change costs more
                    self.flusher = threading.Thread(target=self.flush_later, name="loommux-announce",
                                                    daemon=True)
                    self.flusher.start()
                self.lock.notify()
                return
        self.flush()

    def flush_later(self) -> None:
        """The flusher thread: sends a pending announcement once ANNOUNCE_INTERVAL has passed since the last
        one (a cell's end sends it sooner)."""
        import time

        while True:
            with self.lock:
                wait = self.sent_at + ANNOUNCE_INTERVAL - time.monotonic() if self.pending else None
                if wait is None or wait > 0:
                    self.lock.wait(wait)
                    continue
            self.flush()

    def flush(self) -> None:
        """Send the announcement a change awaits, if any (IPython's post_execute calls it: what a cell
        published reaches the server before the cell ends)."""
        import time

        with self.lock:
            if not self.pending:
                return
            self.pending, self.sent_at = False, time.monotonic()
        self.send()

    def send(self) -> None:
        """Tell the server the whole set (on IOPub, as the kernel's other messages go)."""
        from IPython import get_ipython

        kernel = getattr(get_ipython(), "kernel", None)
        if kernel is None or not hasattr(kernel, "iopub_socket"):
            return
        parent = kernel.get_parent() if hasattr(kernel, "get_parent") else {}
        topic = kernel._topic(PUBLISHED_MSG_TYPE) if hasattr(kernel, "_topic") else None
        kernel.session.send(kernel.iopub_socket, PUBLISHED_MSG_TYPE, self.snapshot(), parent=parent,
                            ident=topic)


_published = PublishedFunctions()  # this kernel's (in the server: unused)


# ---------------------------------------------------------------- Namespace
# Sent to kernels too (see read_kernel_side_source), before the kernel-side extension that wires it in: what
# the namespace, inspect and reset tools see of the user's names, computed in the kernel. The server asks with
# an inspect_request whose code is NAMESPACE_REQUEST and a JSON request; the kernel's do_inspect, wrapped by
# answer_namespace_requests, answers in the reply's NAMESPACE_MIME field. An inspect_request runs no cell: no
# execution count, no In[] or history entry, no pre/post-execute hooks, and nothing on IOPub but busy/idle.
# Sent with a subshell's id (JEP 91), it runs on that subshell's thread while a cell holds the main one.
from typing import Any  # noqa: F811  (see "Cell input")

NAMESPACE_REQUEST = "\x1eloommux-namespace\x1e"  # starts the inspect_request's code: never a real cell's
NAMESPACE_MIME = "application/vnd.loommux.namespace+json"
EVALUATION_LIMIT = 2.0  # seconds one repr, len or attribute may take
ANSWER_BUDGET = 6.0  # seconds one answer may spend evaluating; what is left is said, not evaluated
STOP_GRACE = 0.2  # how long an answer waits for an evaluation that overran to stop, before saying it runs
STOP_FIRST_GAP = 0.05  # the watchdog raises a stop in an evaluation that overran again after so long, then
STOP_LAST_GAP = 0.001  # at ever shorter intervals down to this
MAX_LIVE_EVALUATIONS = 16  # evaluations that overran and still run, at most: threads never pile up
STOP_PERSISTENCE = 10.0  # for so long; then the evaluation is abandoned (it runs on in its thread, listed)
NAMESPACE_VALUE_CHARS = 80
INSPECT_REPR_CHARS = 1000
DOC_CHARS = 800
SIGNATURE_CHARS = 300
FRAME_HEAD_ROWS = 5
FRAME_HEAD_CHARS = 1500
DTYPES_SHOWN = 20
MINMAX_MAX_ELEMENTS = 10_000_000  # an array's min/max is computed only up to this size (cheap)
TRUSTED_SHAPES = ("numpy", "pandas")  # whose shape, nbytes and memory use are read through their properties
NOT_USER_NAMES = ("loommux",)  # the kernel's own object; names starting with "_" are IPython's or private
OUTPUT_NAME_RE = re.compile(r"_\d*|__|___")  # IPython's names for cached outputs: _, __, ___, _5
ATOMS = (int, float, complex, str, bytes, bool, type(None))


class EvaluationTimeout(BaseException):  # not an Exception: a user's ``except Exception`` cannot swallow it
    """A repr, len or attribute that ran past its limit and was stopped (``args[0]``: "running" when it still
    runs, being stopped, as the answer goes on)."""


class EvaluationStop(EvaluationTimeout):
    """The stop the watchdog raises in an evaluation's thread. Made in that thread as it is raised, it also
    arms the thread (see arm_stop_tracer): code that swallows it raises the next one at its next line."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        arm_stop_tracer()


class Evaluation:
    """One call of user code (a repr, a len, an attribute), run in a worker thread of its own so that the
    thread answering (the kernel's main one, or a subshell's) is never held by it. One that overruns is
    stopped by the watchdog: an EvaluationStop raised in it, again and again at ever shorter intervals, and
    then at every line it runs. One that outlives STOP_PERSISTENCE is abandoned, and listed until it ends."""

    def __init__(self, fn: Any, subject: str) -> None:
        import threading
        import time

        self.fn, self.subject, self.started = fn, subject, time.monotonic()
        self.outcome: tuple = ("error", EvaluationTimeout())  # unless the call ends
        self.lock, self.done, self.ended = threading.Lock(), threading.Event(), False
        self.watched, self.abandoned = False, False
        self.root: Any = None  # the worker's own frame, below the user's code
        self.thread = threading.Thread(target=self.run, name="loommux-evaluation", daemon=True)

    def call(self, limit: float) -> Any:
        """fn()'s value or what it raised, or EvaluationTimeout after ``limit`` seconds (and a short grace to
        see it stop)."""
        _evaluations.add(self)  # (interrupt stops it even within its limit); run() takes it out
        try:
            self.thread.start()
        except BaseException:
            _evaluations.discard(self)
            raise
        if not self.done.wait(limit):
            self.stop()
            if not self.done.wait(STOP_GRACE):
                raise EvaluationTimeout("running")
        kind, value = self.outcome
        if kind == "error":
            raise value
        return value

    def run(self) -> None:
        """The worker thread: fn(), then done. A stop the watchdog raised as fn ended is taken here: ``work``
        makes sure none is raised after it (the next instruction that checks raises a pending one)."""
        import sys

        try:
            self.work()
        except EvaluationTimeout:
            pass
        sys.settrace(None)  # (armed by a stop)
        self.done.set()
        _evaluations.discard(self)  # one abandoned that ends at last holds its value no longer

    def work(self) -> None:
        import sys

        self.root = sys._getframe()
        try:
            self.outcome = ("value", self.fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, whatever it is
            self.outcome = ("error", exc)
        finally:
            self.ended = True  # no instruction from here to the lock checks for a stop
            with self.lock:  # the watchdog's round under way ends first; it raises no stop after it
                pass

    def stop(self) -> None:
        """Have the watchdog stop it (again, when it is asked to after it was abandoned)."""
        import threading

        self.abandoned = False
        if not self.watched:
            self.watched = True
            threading.Thread(target=self.watch, name="loommux-watchdog", daemon=True).start()

    def watch(self) -> None:
        """Raise a stop in it now and then, ever more often, until it ends or STOP_PERSISTENCE passes; then it
        is abandoned."""
        import time

        gap, give_up = STOP_FIRST_GAP, time.monotonic() + STOP_PERSISTENCE
        while not self.done.is_set() and time.monotonic() < give_up:
            with self.lock:
                if not self.ended:
                    raise_in_thread(self.thread.ident, EvaluationStop)
            self.done.wait(gap)
            gap = max(gap / 2, STOP_LAST_GAP)
        self.abandoned = not self.done.is_set()
        self.watched = False  # asked again (interrupt), it is watched again

    def describe(self) -> dict:
        import time

        return {"what": self.subject, "seconds": round(time.monotonic() - self.started, 2),
                "stopped": self.done.is_set()}


_evaluations: set = set()  # those running: within their limit, or past it (being stopped, or abandoned)


def raise_in_thread(ident: int | None, exception: Any) -> None:
    """Have the thread raise ``exception`` (a class) when it next runs Python code. (Never None, which would
    drop a pending one: that leaves the interpreter's flag set, and traced threads stall.)"""
    import ctypes

    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident or 0), ctypes.py_object(exception))


def arm_stop_tracer() -> None:
    """In an evaluation's thread, as a stop is raised: give each of its frames above the worker's own a local
    tracer that raises an EvaluationStop at every line (and a tracer to the thread, without which local
    tracers are not run). Code that swallows one is stopped at the first line outside its handler. Both
    tracers are C code: one in Python is where the stop would land, and a tracer that raises is removed."""
    import sys
    import threading

    ident = threading.get_ident()
    found = [evaluation for evaluation in list(_evaluations) if evaluation.thread.ident == ident]
    if not found or found[0].ended:  # not an evaluation's thread, or its code has ended
        return
    root, tracer = found[0].root, make_stop_tracer(ident)
    sys.settrace(getattr)  # getattr(frame, "call", None): None, no local tracer for a new frame
    frame = sys._getframe(2)  # where the stop landed (not this function, nor EvaluationStop's __init__)
    while frame is not None and frame is not root:
        frame.f_trace = tracer
        frame = frame.f_back


def make_stop_tracer(ident: int) -> Any:
    """A local tracer in C that only makes an EvaluationStop pending in the thread, raised by the traced
    code's next instruction that checks, typically a loop's jump back, outside any handler. The C function
    is called with the tracer's three arguments after its own two: C calling conventions ignore extra ones."""
    import ctypes
    import functools

    prototype = ctypes.PYFUNCTYPE(None, ctypes.c_ulong, *[ctypes.py_object] * 4)
    set_async_exc = prototype(("PyThreadState_SetAsyncExc", ctypes.pythonapi))
    return functools.partial(set_async_exc, ident, EvaluationStop)


def interrupt_evaluations() -> list[dict]:
    """Stop what runs (the interrupt tool asks it): an evaluation under way, or one that overran and still
    runs, stopped again. What each is, whether the watchdog had abandoned it, and whether it stopped now,
    within STOP_GRACE."""
    import time

    running = sorted((evaluation for evaluation in list(_evaluations) if not evaluation.done.is_set()),
                     key=lambda evaluation: evaluation.started)
    abandoned = [evaluation.abandoned for evaluation in running]
    for evaluation in running:
        evaluation.stop()
    deadline = time.monotonic() + STOP_GRACE
    for evaluation in running:
        evaluation.done.wait(max(0.0, deadline - time.monotonic()))
    return [{**evaluation.describe(), "abandoned": was} for evaluation, was in zip(running, abandoned)]


def describe_failure(exc: BaseException, what: str, limit: float) -> str:
    """``[repr raised ValueError: bad]`` or ``[repr did not finish within 2 s]``. An exception's message is
    not read (its ``__str__`` is the user's code): its arguments are, when they are plain strings."""
    if issubclass(type(exc), EvaluationTimeout) and exc.args == ("earlier",):
        return f"[{what} not evaluated: an earlier one still runs, see interrupt()]"
    if issubclass(type(exc), EvaluationTimeout) and exc.args == ("crowded",):
        return f"[{what} not evaluated: {MAX_LIVE_EVALUATIONS} earlier ones still run, see interrupt()]"
    if issubclass(type(exc), EvaluationTimeout):
        still = "; still running, see interrupt()" if exc.args == ("running",) else ""
        return f"[{what} did not finish within {limit:g} s{still}]"
    args = BaseException.__dict__["args"].__get__(exc)
    message = "; ".join(arg for arg in args if type(arg) is str)
    name = type_field(type(exc), "__name__")
    return f"[{what} raised {name}" + (f": {message[:200]}]" if message else "]")


def cut_text(text: str, limit: int) -> str:
    """Text within ``limit`` characters, saying how long it was when it is cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [cut: {len(text):,} characters in all]"


class Evaluator:
    """Evaluates what an answer shows within its budget: each call at most EVALUATION_LIMIT seconds, all of
    them at most ANSWER_BUDGET; ``subject`` names what is evaluated, should it overrun (``repr of "x"``)."""

    def __init__(self) -> None:
        import time

        self.deadline = time.monotonic() + ANSWER_BUDGET
        self.subject = ""

    def limit(self) -> float:
        import time

        return min(EVALUATION_LIMIT, self.deadline - time.monotonic())

    def call(self, fn: Any, what: str = "reading") -> Any:
        """fn() within the budget: EvaluationTimeout when none is left, or when the same evaluation (of the
        same name) still runs from an earlier answer (threads do not pile up behind a repr that hangs)."""
        limit, subject = self.limit(), f"{what} of {self.subject}"
        if limit <= 0:
            raise EvaluationTimeout
        live = [other for other in list(_evaluations) if not other.done.is_set()]
        if any(other.subject == subject for other in live):
            raise EvaluationTimeout("earlier")
        if len(live) >= MAX_LIVE_EVALUATIONS:
            raise EvaluationTimeout("crowded")
        return Evaluation(fn, subject).call(limit)

    def evaluate(self, fn: Any, what: str) -> tuple[Any, str | None]:
        """(fn(), None), or (None, a note saying why there is no value)."""
        limit = self.limit()
        if limit <= 0:
            return None, f"[{what} not evaluated: this answer's {ANSWER_BUDGET:g} s were spent]"
        try:
            return self.call(fn, what), None
        except BaseException as exc:  # noqa: BLE001 - said in the answer, never raised in the kernel
            return None, describe_failure(exc, what, limit)

    def text(self, fn: Any, what: str, chars: int) -> str:
        """str(fn()) cut to ``chars``, or a note saying why there is none."""
        text, note = self.evaluate(lambda: str.__str__(str(fn())), what)  # an exact str
        return note if note is not None else cut_text(text, chars)

    def attempt(self, fn: Any) -> Any:
        """fn(), or None when it raised or ran late."""
        try:
            return self.call(fn)
        except BaseException:  # noqa: BLE001 - a size that cannot be read is not shown
            return None


def find_user_names(shell: Any) -> dict:
    """The user's top-level names: not IPython's own bindings (unless rebound), no ``_`` names, not
    ``loommux``. Only plain strings are names: no method of any other key runs."""
    hidden, missing = shell.user_ns_hidden, object()
    return {name: value for name, value in list(shell.user_ns.items())
            if type(name) is str and not name.startswith("_") and name not in NOT_USER_NAMES
            and hidden.get(name, missing) is not value}


def classify(value: Any) -> str:
    """module, class, function or variable, by the value's type (as inspect.isroutine, which would read
    ``__class__`` through the object)."""
    import inspect
    import types

    kind = type(value)
    if issubclass(kind, types.ModuleType):
        return "module"
    if issubclass(kind, type):
        return "class"
    routines = (types.BuiltinFunctionType, types.FunctionType, types.MethodType, types.MethodDescriptorType,
                types.WrapperDescriptorType, types.MethodWrapperType, types.ClassMethodDescriptorType)
    # a method descriptor written in C (functools' caches); a user's class with __get__ stays a variable,
    # whose __getattribute__ a function's signature and documentation would run
    get = inspect.getattr_static(kind, "__get__", None)
    in_c = get is not None and not isinstance(get, types.FunctionType)
    descriptor = in_c and not has_static(kind, "__set__")
    return "function" if issubclass(kind, routines) or descriptor else "variable"


def has_static(kind: type, attribute: str) -> bool:
    """Whether a type has an attribute, found in its MRO's dictionaries (no metaclass's code runs)."""
    import inspect

    return inspect.getattr_static(kind, attribute, None) is not None


def type_field(kind: type, field: str) -> str:
    """A type's ``__module__``, ``__name__`` or ``__qualname__`` as ``type`` reads it, past a metaclass's own
    attributes; "" when it is not a plain string."""
    found = type.__dict__[field].__get__(kind)
    return found if type(found) is str else ""


def read_name_field(value: Any, field: str) -> str:
    """A module's or a routine's ``__name__`` or ``__module__``, read statically ("" when there is none, or it
    is not a plain string); a bound method's are its function's."""
    import inspect
    import types

    if type(value) is types.MethodType:
        value = types.MethodType.__dict__["__func__"].__get__(value)
    found = inspect.getattr_static(value, field, None)
    if type(found) in (types.GetSetDescriptorType, types.MemberDescriptorType):  # C code: runs nothing else
        try:
            found = found.__get__(value, type(value))
        except Exception:  # noqa: BLE001 - an empty slot
            return ""
    return found if type(found) is str else ""


def is_trusted(value: Any) -> bool:
    return type_field(type(value), "__module__").split(".")[0] in TRUSTED_SHAPES


def read_static(value: Any, evaluator: Evaluator, attribute: str) -> Any:
    """An attribute that runs no user code: a plain value, a C-level descriptor, or NumPy's and pandas'
    properties; None for a Python property of anything else (properties are not run unasked). Descriptors are
    called directly: the type's ``__getattribute__`` is not."""
    import inspect
    import types

    static = inspect.getattr_static(value, attribute, None)
    kind = type(static)
    if static is None:
        return None
    if not issubclass(kind, (property, types.GetSetDescriptorType, types.MemberDescriptorType)):
        return static if not callable(static) else None
    if issubclass(kind, property) and not is_trusted(value):
        return None
    return evaluator.attempt(lambda: static.__get__(value, type(value)))


def measure(value: Any, evaluator: Evaluator) -> dict:
    """A value's size where it has one: shape, else len; bytes where they are cheap to know."""
    if classify(value) != "variable":
        return {}
    size: dict = {}
    shape = read_static(value, evaluator, "shape")
    if type(shape) is tuple and all(type(n) is int for n in shape):
        size["shape"] = list(shape)
    elif has_static(type(value), "__len__"):
        size.update(measure_len(value, evaluator))
    if type(value) in (bytes, bytearray):
        size["bytes"] = len(value)
    elif is_trusted(value) and callable(getattr(type(value), "memory_usage", None)):  # pandas
        def memory() -> int:
            used = value.memory_usage(deep=False)  # a DataFrame's is per column
            return int(used.sum() if hasattr(used, "sum") else used)

        if isinstance(used := evaluator.attempt(memory), int):
            size["bytes"] = used
    elif type(nbytes := read_static(value, evaluator, "nbytes")) is int:
        size["bytes"] = nbytes
    return size


def measure_len(value: Any, evaluator: Evaluator) -> dict:
    """{"len": n}, or {"len_note": why there is none} when ``len()`` raised or ran late."""
    length, note = evaluator.evaluate(lambda: len(value), "len")
    return {"len": length} if note is None else {"len_note": note}


def name_type(value: Any, qualified: bool = False) -> str:
    kind = type(value)
    module, name = type_field(kind, "__module__"), type_field(kind, "__qualname__")
    if not qualified or module == "builtins":
        return name
    return f"{module}.{name}"


def summarize(value: Any, evaluator: Evaluator) -> str:
    """A namespace row's value: a module's name, a function's signature, a class's qualified name, else a
    one-line repr; at most NAMESPACE_VALUE_CHARS characters."""
    import inspect
    import reprlib

    kind = classify(value)
    if kind == "module":
        return read_name_field(value, "__name__")
    if kind == "class":
        return f"{type_field(value, '__module__')}.{type_field(value, '__qualname__')}"
    if kind == "function":
        signature = evaluator.text(lambda: inspect.signature(value), "signature", NAMESPACE_VALUE_CHARS)
        return f"{read_name_field(value, '__name__')}{signature if signature.startswith('(') else '(…)'}"
    if is_trusted(value) and has_static(type(value), "columns"):  # a DataFrame: its size says the rest
        columns = evaluator.attempt(lambda: ", ".join(map(str, list(value.columns)[:DTYPES_SHOWN])))
        return cut_line(f"columns: {columns}")
    shorter = reprlib.Repr()
    shorter.maxstring = shorter.maxother = NAMESPACE_VALUE_CHARS
    text = evaluator.text(lambda: shorter.repr(value), "repr", NAMESPACE_VALUE_CHARS * 4)
    return cut_line(" ⏎ ".join(line.strip() for line in text.splitlines() if line.strip()))


def cut_line(text: str) -> str:
    """A namespace row's value, within NAMESPACE_VALUE_CHARS (an ellipsis ends one that was cut)."""
    return text if len(text) <= NAMESPACE_VALUE_CHARS else text[: NAMESPACE_VALUE_CHARS - 1] + "…"


def list_namespace(shell: Any, query: str | None, max_items: int) -> dict:
    """The user's names matching ``query`` (in part, any case; an exact match first), sorted, each with its
    kind, type, size and a short value."""
    names = find_user_names(shell)
    wanted = (query or "").lower()
    matched = sorted((name for name in names if wanted in name.lower()),
                     key=lambda name: (name.lower() != wanted, name.lower(), name))
    evaluator, rows = Evaluator(), []
    for name in matched[:max_items]:
        value, evaluator.subject = names[name], f'"{name}"'
        rows.append({"name": name, "kind": classify(value), "type": name_type(value),
                     "size": measure(value, evaluator), "value": summarize(value, evaluator)})
    return {"total": len(names), "matched": len(matched), "names": rows}


def resolve(shell: Any, path: str, evaluator: Evaluator) -> tuple[Any, dict | None]:
    """The value a dotted path names (each attribute it names is read, properties too), or why not:
    {"unresolved": the part that is not there} or {"failed": the part that raised, "message"}."""
    import builtins

    parts = path.split(".")
    evaluator.subject = f'"{path}"'
    namespace = shell.user_ns
    if parts[0] in namespace:
        value = namespace[parts[0]]
    elif hasattr(builtins, parts[0]):
        value = getattr(builtins, parts[0])
    else:
        return None, {"unresolved": parts[0]}
    for i in range(1, len(parts)):
        try:
            value = evaluator.call(lambda owner=value, attribute=parts[i]: getattr(owner, attribute))
        except AttributeError:
            return None, {"unresolved": ".".join(parts[: i + 1])}
        except BaseException as exc:  # noqa: BLE001 - said in the answer, never raised in the kernel
            return None, {"failed": ".".join(parts[: i + 1]),
                          "message": describe_failure(exc, "reading it", EVALUATION_LIMIT)[1:-1]}
    return value, None


def describe_frame(value: Any, evaluator: Evaluator) -> dict:
    """A pandas DataFrame's or Series's dtypes and first rows (its shape and memory are its size)."""
    if hasattr(value, "columns"):
        dtypes = evaluator.attempt(lambda: [[str(column), str(dtype)] for column, dtype
                                            in list(value.dtypes.items())[:DTYPES_SHOWN]]) or []
        columns = evaluator.attempt(lambda: len(value.columns))
        head = evaluator.text(lambda: value.head(FRAME_HEAD_ROWS).to_string(max_cols=12, max_colwidth=30),
                              "first rows", FRAME_HEAD_CHARS)
        return {"series": False, "dtypes": dtypes, "columns": columns, "head": head}
    named = evaluator.attempt(lambda: [[str(value.name), str(value.dtype)]])  # a name is any object
    return {"series": True, "dtypes": named or [["", ""]], "columns": None,
            "head": evaluator.text(lambda: value.head(FRAME_HEAD_ROWS).to_string(max_rows=FRAME_HEAD_ROWS),
                                   "first rows", FRAME_HEAD_CHARS)}


def describe_array(value: Any, numpy: Any, evaluator: Evaluator) -> dict:
    """A NumPy array's dtype and, when numeric (not complex) and at most MINMAX_MAX_ELEMENTS, min and max."""
    import warnings

    found = {"dtype": str(value.dtype)}
    numeric = numpy.issubdtype(value.dtype, numpy.number) and not numpy.issubdtype(value.dtype,
                                                                                   numpy.complexfloating)
    if numeric and 0 < value.size <= MINMAX_MAX_ELEMENTS:
        def extremes() -> list:
            low, high = value.min(), value.max()
            if numpy.isnan(low) or numpy.isnan(high):  # a NaN among them: the rest decide (nanmin is slower)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # an all-NaN array's warning
                    low, high = numpy.nanmin(value), numpy.nanmax(value)
            return [repr(low.item()), repr(high.item())]

        found["min"], found["max"] = evaluator.attempt(extremes) or [None, None]
    return found


def find_module(value: Any, kind: str) -> str:
    """The module a value comes from (a variable: its type's), read statically; "" when unknown."""
    if kind == "module":
        return read_name_field(value, "__name__")
    if kind == "function":
        return read_name_field(value, "__module__")
    return type_field(value if kind == "class" else type(value), "__module__")


def inspect_value(shell: Any, path: str) -> dict:
    """One name (dotted attributes allowed): kind, qualified type, signature, module, documentation, size
    and a safe repr; a DataFrame's or Series's dtypes and first rows, an array's dtype and min/max."""
    import inspect
    import sys

    evaluator = Evaluator()
    value, problem = resolve(shell, path, evaluator)
    if problem is not None:
        return problem
    kind = classify(value)
    found = {"name": path, "kind": kind, "type": name_type(value, qualified=True),
             "size": measure(value, evaluator), "signature": None, "module": None, "doc": None, "repr": None}
    if kind in ("function", "class"):  # not an object's __call__: inspect.signature would read its attributes
        found["signature"] = evaluator.text(lambda: f"{path.rsplit('.', 1)[-1]}{inspect.signature(value)}",
                                            "signature", SIGNATURE_CHARS)
    module = find_module(value, kind)
    found["module"] = module if module and module != "builtins" else None
    if kind != "variable":
        found["doc"] = evaluator.text(lambda: inspect.getdoc(value) or "", "documentation", DOC_CHARS) or None
    pandas, numpy = sys.modules.get("pandas"), sys.modules.get("numpy")
    if pandas is not None and issubclass(type(value), (pandas.DataFrame, pandas.Series)):
        found["frame"] = describe_frame(value, evaluator)
    else:
        if numpy is not None and issubclass(type(value), numpy.ndarray):
            found["array"] = describe_array(value, numpy, evaluator)
        found["repr"] = evaluator.text(lambda: repr(value), "repr", INSPECT_REPR_CHARS)
    return found


def drop_cached_outputs(shell: Any, value: Any) -> None:
    """Forget a removed value that no user name holds any more in IPython's output cache too (Out[n], _n, _,
    __, ___), so that its memory is freed."""
    if issubclass(type(value), ATOMS) or any(other is value for other in find_user_names(shell).values()):
        return  # an atom (1, None, "a") is shared by unrelated outputs: they stay
    history = getattr(shell, "history_manager", None)
    for cache in (shell.user_ns, getattr(history, "output_hist", {})):
        for key in [key for key, held in list(cache.items()) if held is value
                    and (cache is not shell.user_ns or type(key) is str and OUTPUT_NAME_RE.fullmatch(key))]:
            del cache[key]
    for attribute in ("_", "__", "___"):
        if getattr(shell.displayhook, attribute, None) is value:
            setattr(shell.displayhook, attribute, None)


def reset_names(shell: Any, names: list[str] | None) -> dict:
    """Remove the given top-level names (every user name when None): which were removed, which refused
    (IPython's own bindings, ``loommux``, ``_`` names, each with its reason) and which unknown; the tools
    published under a removed name or as its function are withdrawn (and the set as it is now given)."""
    user = find_user_names(shell)
    removed, refused, unknown, unpublished = [], {}, [], []
    for name in sorted(user) if names is None else dict.fromkeys(names):  # each name once
        if name in user:
            removed.append(name)
            value = shell.user_ns.pop(name)
            drop_cached_outputs(shell, value)
            unpublished += _published.forget(name, value)
            user.pop(name)
        elif name not in shell.user_ns:
            unknown.append(name)
        elif name.startswith("_") or name in NOT_USER_NAMES:
            refused[name] = "loommux's" if name in NOT_USER_NAMES else "a _ name"
        else:
            refused[name] = "IPython's own"
    answer = {"removed": removed, "refused": list(refused), "unknown": unknown, "refused_reasons": refused,
              "unpublished": unpublished}
    return {**answer, "published": _published.snapshot()} if unpublished else answer


def answer_namespace_request(shell: Any, request: dict) -> dict:
    """What the namespace, inspect and reset tools ask of the kernel."""
    tool = request.get("tool")
    if tool == "namespace":
        return list_namespace(shell, request.get("query"), request["max_items"])
    if tool == "inspect":
        return inspect_value(shell, request["name"])
    if tool == "reset":
        return reset_names(shell, request.get("names"))
    if tool == "published":  # a server that restarted asks what its kernel publishes
        return _published.snapshot()
    if tool == "interrupt":  # the interrupt tool: what overran is stopped again
        return {"evaluations": interrupt_evaluations()}
    return {"fault": f"{tool!r} is not a namespace request"}


def answer_namespace_requests(kernel: Any) -> None:
    """Answer the server's namespace requests, which come as inspect_requests (see NAMESPACE_REQUEST); any
    other inspect_request is ipykernel's as before."""
    import inspect
    import json

    ipykernel_inspect = kernel.do_inspect

    async def do_inspect(code: str, cursor_pos: int, detail_level: int = 0, omit_sections: Any = ()) -> dict:
        if not code.startswith(NAMESPACE_REQUEST):
            reply = ipykernel_inspect(code, cursor_pos, detail_level, omit_sections)
            return await reply if inspect.isawaitable(reply) else reply
        try:
            answer = answer_namespace_request(kernel.shell, json.loads(code[len(NAMESPACE_REQUEST):]))
        except Exception as exc:  # noqa: BLE001 - a fault of ours: said to the server, never the kernel's end
            answer = {"fault": describe_failure(exc, "answering", 0)[1:-1]}
        return {"status": "ok", "found": True, "data": {NAMESPACE_MIME: answer}, "metadata": {}}

    kernel.do_inspect = do_inspect


# ---------------------------------------------------------------- Kernel-side extension
# Sent with "Error codes", "Cell input", "Published functions" and "Namespace" to every kernel handed to a
# resource (see read_kernel_side_source), so it uses only the standard library, imported where needed, and
# nothing of this file but those four sections. Outside a kernel, ``import loommux`` offers the same client as
# ``loommux.Daemon``.
from typing import Any  # noqa: F811  (see "Cell input")

KERNEL_ID_ENV = "LOOMMUX_KERNEL_ID"
KERNEL_NAME_ENV = "LOOMMUX_KERNEL_NAME"
CONTROL_URL_ENV = "LOOMMUX_CONTROL_URL"
KERNEL_TOKEN_ENV = "LOOMMUX_KERNEL_TOKEN"
TOKEN_ENV = "LOOMMUX_TOKEN"
DEFAULT_CONTROL_URL = "http://127.0.0.1:8801"
CONTROL_TIMEOUT = 30.0  # how long a control request may take beyond the wait it asks the server for
MAX_REQUEST_WAIT = 60.0  # the longest wait one request asks for; Job.wait repeats it
RELAY_WAIT = 1.0  # how long one relay request waits for the target's next output
FORWARD_WAIT = 0.1  # how long a forwarded cell's submission waits for it to end (a short cell: one request)
INTERRUPT_DRAIN = 10.0  # how long an interrupted forwarding cell relays the target's last output
# input() is put to the person only as a form, and a form must never ask for a secret (MCP elicitation): a
# prompt that reads like one fails at once, as input() does without stdin.
SECRET_PROMPT_RE = re.compile(r"\b(?:pass(?:word|phrase|code)|secret|token|api[ _-]?key|"
                              r"(?:private|access|auth)[ _-]?key|credentials?|pin|otp)\b", re.IGNORECASE)
INPUT_DECLINED = "the person declined to answer this input() prompt"
NO_SECRETS = ("{what} asks for a secret, which loommux never puts to the person (MCP forbids secrets in "
              "forms); read it from an environment variable or a file instead")

class DaemonError(Exception):
    """A control-plane request that failed: ``code`` is its error code (ERROR_CODES; ``status`` is the
    same, under its earlier name), ``message`` a sentence."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message

    @property
    def status(self) -> str:
        return self.code


class ForwardedCellError(Exception):
    """A cell handed to another kernel with ``%%loommux --kernel`` ended with an error there."""


class Block(Exception):
    """Raised by a cell inspector (``loommux.Block("why")``): the cell does not run, and its result says which
    inspector blocked it and why."""


# A cell inspector's notes reach the server as a display of this type, before the cell runs; the server shows
# them at the top of the cell's result, never as its output.
INSPECTOR_NOTES_MIME = "application/vnd.loommux.inspector-notes+json"
SERVER_USERNAME = "loommux"  # the username of every message the server sends a kernel: how it tells them


class Daemon:
    """The loommux server's control plane: ``kernels()``, ``d["name"]`` and, inside a kernel, ``d.self``.

    Inside a kernel (the ``loommux`` object) a kernel named by ``d["name"]`` is opened on first use and
    held by this kernel; outside one, ``d["name"]`` finds existing kernels only.
    """

    DaemonError = DaemonError
    ForwardedCellError = ForwardedCellError
    Block = Block

    def __init__(self, url: str | None = None, token: str | None = None) -> None:
        import os

        self.url: str | None = (url or os.environ.get(CONTROL_URL_ENV) or DEFAULT_CONTROL_URL).rstrip("/")
        self.token = token if token is not None else os.environ.get(TOKEN_ENV)
        self.identity: tuple[str, str] | None = None  # (id, name) of the kernel this client runs in
        self.idle: list = []  # kept-alive connections no request is using (http.client's)
        self.pid = os.getpid()  # the process they belong to
        self.notebook_file: str | None = None  # under stdio: the file the server mirrors this kernel to

    @classmethod
    def in_kernel(cls, kernel_id: str, name: str, url: str | None, token: str,
                  notebook_file: str | None = None) -> Daemon:
        daemon = cls(url or "unused", token)
        daemon.url, daemon.identity, daemon.notebook_file = url, (kernel_id, name), notebook_file
        return daemon

    def inspector(self, fn: Any) -> Any:
        """Decorator: ``fn(source, tree)`` inspects each cell an MCP client (or a forwarded cell) runs in this
        kernel, before it runs: it returns a note for the cell's result, or None, or raises ``Block``. One of
        the same name registered before is replaced."""
        if not callable(fn) or not isinstance(getattr(fn, "__name__", None), str):  # named: one replaces it
            raise TypeError(f"an inspector is a named function (source, tree), not {type(fn).__name__}")
        _inspectors[:] = [*(known for known in _inspectors if known.__name__ != fn.__name__), fn]
        return fn

    def load_inspectors(self, source: str, path: str) -> None:
        """Run an inspectors file (the server's --inspectors), in a namespace of its own with ``loommux``."""
        _inspectors.clear()
        namespace = {"__name__": "loommux_inspectors", "__file__": path, "loommux": self}
        exec(compile(source, path, "exec"), namespace)  # noqa: S102 - the operator's file, trusted as --startup

    def __repr__(self) -> str:
        where = f"in kernel {self.identity[1]}" if self.identity else "outside a kernel"
        return f"<loommux control plane {self.url or '(none: stdio)'} · {where}>"

    def request(self, method: str, path: str, body: dict | None = None, wait: float = 0.0) -> dict:
        """One JSON request to the control plane; every failure is a DaemonError."""
        if self.url is None:
            raise DaemonError(NO_CONTROL_PLANE, "kernels can control kernels only under `loommux --server`; "
                              "this kernel's server speaks MCP over stdio")
        import http.client
        import json

        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        try:
            status, reason, payload = self.exchange(method, path, data, headers, wait + CONTROL_TIMEOUT)
            if status < 400:
                return json.loads(payload)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise DaemonError(NO_CONTROL_PLANE, f"cannot reach the loommux control plane at {self.url}: "
                              f"{exc}") from None
        try:
            error = json.loads(payload)
        except ValueError:
            error = {}
        code = error.get("error_code") if isinstance(error, dict) else None
        message = error.get("message") if isinstance(error, dict) else None
        raise DaemonError(code or f"http_{status}", message or f"HTTP {status} {reason}")

    def exchange(self, method: str, path: str, data: bytes | None, headers: dict,
                 timeout: float) -> tuple[int, str, bytes]:
        """(status, reason, body) of one request on a kept-alive connection: one an earlier request left idle
        (any thread may take it; a request has it to itself), else a new one."""
        import http.client
        from urllib.parse import urlsplit

        target = urlsplit(self.url).path.rstrip("/") + path
        connection = self.idle_connection()
        while True:
            reused, connection = connection is not None, connection or self.connect()
            try:
                connection.timeout = timeout
                connection.sock.settimeout(timeout)
                connection.request(method, target, data, headers)
                response = connection.getresponse()
                body = response.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                connection.close()
                if not reused:
                    raise
                connection = None  # the server closed it in between: it never reads a request it drops
                continue
            except BaseException:
                connection.close()  # an answer half read, or a KeyboardInterrupt: the connection is spoilt
                raise
            if response.will_close:
                connection.close()
            else:
                self.idle.append(connection)
            return response.status, response.reason, body

    def idle_connection(self) -> Any:
        """A kept-alive connection this process opened and the server has not closed since, or None."""
        import os
        import selectors

        if self.pid != os.getpid():  # a forked child never shares its parent's sockets
            self.idle, self.pid = [], os.getpid()
        while self.idle:
            connection = self.idle.pop()
            with selectors.DefaultSelector() as selector:
                selector.register(connection.sock, selectors.EVENT_READ)
                if not selector.select(0):  # readable while idle: the server closed it
                    return connection
            connection.close()
        return None

    def connect(self) -> Any:
        """A new connection to the control plane (never through a proxy)."""
        import http.client
        from urllib.parse import urlsplit

        where = urlsplit(self.url)
        kind = http.client.HTTPSConnection if where.scheme == "https" else http.client.HTTPConnection
        connection = kind(where.hostname, where.port, timeout=CONTROL_TIMEOUT)
        connection.connect()
        return connection

    def kernels(self) -> KernelList:
        """Every kernel the server has."""
        listed = self.request("GET", "/api/kernels")["kernels"]
        return KernelList(KernelHandle(self, info) for info in listed)

    def __getitem__(self, ref: str) -> KernelHandle:
        if not isinstance(ref, str) or not is_kernel_ref(ref):
            raise DaemonError(INVALID_RESOURCE_NAME, f"{ref!r} is not a kernel name ({RESOURCE_NAME_RULE}) "
                              "or a private id")
        if self.identity and ref in self.identity:
            return self.self
        from urllib.parse import quote

        if self.identity:  # a kernel holds what it opens
            return KernelHandle(self, self.request("POST", f"/api/kernels/{quote(ref, safe='')}/hold"))
        return KernelHandle(self, self.request("GET", f"/api/kernels/{quote(ref, safe='')}"))

    @property
    def self(self) -> KernelHandle:
        """The kernel this code runs in."""
        self.check_in_kernel()
        return KernelHandle(self, {"id": self.identity[0], "name": self.identity[1]})

    def check_in_kernel(self) -> None:
        if self.identity is None:
            raise DaemonError(NOT_IN_A_KERNEL, "this Python process is not a loommux kernel")

    PublishError = PublishError

    def publish(self, fn: Any, name: str | None = None, description: str | None = None) -> str:
        """Publish ``fn`` as an MCP tool of this kernel's sessions (named ``name``, its __name__ by default;
        described by ``description``, its docstring by default); its input schema comes from its
        annotations. Publishing again replaces the tool (a redefined function is published only so)."""
        self.check_in_kernel()
        return _published.publish(fn, name, description)

    def unpublish(self, name: str) -> bool:
        """Withdraw a published tool; whether it was published."""
        self.check_in_kernel()
        return _published.unpublish(name)

    def published(self) -> dict:
        """The tools this kernel publishes: name -> its description and input schema."""
        return {name: {"description": tool["description"], "inputSchema": tool["inputSchema"]}
                for name, tool in _published.tools.items()}

    def call(self, name: str, json_arguments: str | None = None, /, **arguments: Any) -> CallResult:
        """Run a published tool's function as its MCP calls do (shown as JSON): with keyword arguments, or
        (as MCP calls pass them: data, never Python source) a JSON object of them."""
        __tracebackhide__ = True  # the traceback goes from the call to the function
        self.check_in_kernel()
        given = {} if json_arguments is None else json.loads(json_arguments)
        return _published.call(name, {**given, **arguments})


class KernelHandle:
    """One kernel of the server; its state, busy, pid and executions are read afresh on each access."""

    def __init__(self, daemon: Daemon, info: dict) -> None:
        self.daemon, self.id, self.name, self.info = daemon, info["id"], info["name"], info

    def path(self, tail: str = "") -> str:
        from urllib.parse import quote

        return f"/api/kernels/{quote(self.id, safe='')}{tail}"

    def refresh(self) -> dict:
        self.info = self.daemon.request("GET", self.path())
        return self.info

    state = property(lambda self: self.refresh()["state"], doc="starting, idle, busy or dead")
    busy = property(lambda self: self.refresh()["busy"])
    pid = property(lambda self: self.refresh()["pid"])
    executions = property(lambda self: self.refresh()["executions"], doc="how many cells it has accepted")
    leases = property(lambda self: self.refresh()["leases"])

    def run(self, code: str, wait: float = 5) -> Job:
        """Run a cell there (never queued: a busy kernel raises DaemonError busy); wait up to ``wait``
        seconds."""
        return self.submit(code, wait, relay=False)

    def submit(self, code: str, wait: float, relay: bool, hold: bool = False) -> Job:
        """Run a cell there; ``relay`` keeps what it shows for ``Job.relay`` (the reply is its first batch),
        ``hold`` holds the kernel first (from a kernel: opening a named one on first use)."""
        body = {"code": code, "wait": wait, "relay": relay, "hold": hold}
        reply = self.daemon.request("POST", self.path("/run"), body, wait)
        return Job(self, reply["execution"], reply)

    def interrupt(self) -> int | None:
        """Interrupt its running cell; the number of the cell interrupted, or None when it was idle."""
        return self.daemon.request("POST", self.path("/interrupt"))["execution"]

    def restart(self) -> None:
        """A fresh process: variables are gone; records and numbering are kept."""
        self.daemon.request("POST", self.path("/restart"))

    def recycle(self, force: bool = False) -> None:
        """Retire it: its kernel and records are gone (a running cell refuses unless force=True)."""
        self.daemon.request("POST", self.path("/recycle"), {"force": force})

    def notebook(self, path: str | None = None) -> dict:
        """Its history as a notebook (nbformat 4.5) dict; with ``path``, also written there. Under stdio
        there is no control plane: a kernel reads its own notebook from the server's --notebook file, as
        last written (up to the cell before the running one)."""
        import json

        daemon = self.daemon
        if daemon.url is not None:
            notebook = daemon.request("GET", self.path("/notebook"))
        elif daemon.notebook_file and daemon.identity and self.id == daemon.identity[0]:
            try:
                with open(daemon.notebook_file, encoding="utf-8") as f:
                    notebook = json.load(f)
            except (OSError, ValueError) as exc:
                raise DaemonError(NO_CONTROL_PLANE, f"cannot read the notebook file {daemon.notebook_file}: "
                                  f"{exc}") from None
        else:
            raise DaemonError(NO_CONTROL_PLANE, "under stdio a kernel has a notebook only when the server "
                              "mirrors it to a file (loommux --notebook PATH), and only its own")
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                json.dump(notebook, f, indent=1, ensure_ascii=False)
                f.write("\n")
        return notebook

    def row(self) -> tuple[str, ...]:
        info = self.info
        if "state" not in info:
            return (self.name, self.id, "", "", "", "")
        return (self.name, self.id, info["state"], str(info["pid"] or "-"), str(info["executions"]),
                str(len(info["leases"])))

    def __repr__(self) -> str:
        name, kernel_id, state, pid, executions, leases = self.row()
        if not state:
            return f"<kernel {name} · id {kernel_id}>"
        return (f"<kernel {name} · id {kernel_id} · {state} · pid {pid} · {executions} executions · "
                f"{leases} leases>")


class KernelList(list):
    """Kernels, printed as a table."""

    def __repr__(self) -> str:
        rows = [("name", "id", "state", "pid", "executions", "leases"), *(kernel.row() for kernel in self)]
        widths = [max(len(row[i]) for row in rows) for i in range(6)]
        return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                         for row in rows)


class Job:
    """One cell submitted to a kernel: its execution number there, its state, output and search."""

    def __init__(self, kernel: KernelHandle, execution: int, info: dict) -> None:
        self.kernel, self.execution, self.info = kernel, execution, info
        self.relayed = 0  # relay events received so far

    def path(self, tail: str = "") -> str:
        return self.kernel.path(f"/executions/{self.execution}{tail}")

    @property
    def state(self) -> str:
        """running, completed, error, interrupted or killed."""
        self.info = self.kernel.daemon.request("GET", self.path())
        return self.info["state"]

    def wait(self, timeout: float | None = None) -> str:
        """The state once the cell has ended or ``timeout`` seconds passed (it never interrupts)."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = (MAX_REQUEST_WAIT if deadline is None
                    else max(0.0, min(MAX_REQUEST_WAIT, deadline - time.monotonic())))
            self.info = self.kernel.daemon.request("GET", self.path(f"?wait={step:.3f}"), wait=step)
            if self.info["state"] != RUNNING or (deadline is not None and time.monotonic() >= deadline):
                return self.info["state"]

    def output(self, stream: str = "combined", line_range: str | None = None,
               max_chars: int | None = None) -> str:
        """Output lines, like read_output's (line_range "start:stop", 1-based, negatives from the end)."""
        args = {"stream": stream, "line_range": line_range, "max_chars": max_chars}
        reply = self.kernel.daemon.request("POST", self.path("/output"),
                                           {k: v for k, v in args.items() if v is not None})
        return reply["text"].partition("\n")[2]

    def search(self, query: str, query_mode: str = "auto", ignore_case: bool = False, context_before: int = 0,
               context_after: int = 0) -> str:
        """Matching lines ("M n | text") with context ("C n | text"), like search_output's."""
        args = {"query": query, "query_mode": query_mode, "ignore_case": ignore_case,
                "context_before": context_before, "context_after": context_after}
        return self.kernel.daemon.request("POST", self.path("/search"), args)["text"].partition("\n")[2]

    def interrupt(self) -> bool:
        """Interrupt this cell if it is still running; whether an interrupt was sent."""
        return self.kernel.daemon.request("POST", self.path("/interrupt"))["interrupt_sent"]

    def relay(self, limit: float | None = None, reply: dict | None = None, heading: str = "",
              cell_ends: bool = False) -> dict:
        """Copy the cell's output here as it arrives (stdout to stdout, the rest to stderr) until it ends.
        ``reply`` is a first batch already received (a relayed submission's), shown after ``heading``; when
        this cell ends with the relay (``cell_ends``), the kernel's flush at its end sends the last text."""
        import itertools
        import sys
        import time

        deadline = None if limit is None else time.monotonic() + limit
        while True:
            if reply is None:
                path = self.path(f"/relay?after={self.relayed}&wait={RELAY_WAIT}")
                reply = self.kernel.daemon.request("GET", path, wait=RELAY_WAIT)
            ended = reply["state"] != RUNNING and not reply["more"]
            events = [("stdout", heading), *reply["events"]] if heading else reply["events"]
            runs = [(stream, "".join(text for _, text in run)) for stream, run in
                    itertools.groupby(events, key=lambda event: event[0])]
            for i, (stream, text) in enumerate(runs):
                out = sys.stdout if stream == "stdout" else sys.stderr
                out.write(text)
                if not (ended and cell_ends and i == len(runs) - 1):
                    out.flush()  # each stream is buffered apart: flushing at each change keeps their order
            self.relayed, heading = reply["next"], ""
            if ended:
                return reply
            if deadline is not None and time.monotonic() > deadline:
                return reply
            reply = None

    def __repr__(self) -> str:
        return (f"<job: execution {self.execution} of kernel {self.kernel.name} · "
                f"{self.info.get('state', '?')}>")


_daemon: Daemon | None = None  # the ``loommux`` object of the kernel this runs in
_inspectors: list = []  # its cell inspectors, in the order registered (see Daemon.inspector)


def submit_forwarded(ref: str, source: str) -> tuple[Job, bool]:
    """Hold kernel ``ref`` (opening it on first use), submit the cell there and bring what it shows within
    FORWARD_WAIT (a short cell's all), in one request; and whether this cell was interrupted meanwhile. That
    interrupt is held back until the target's execution is known, so that it can be passed on (a second one
    gets through at once)."""
    import signal
    import threading

    target = KernelHandle(_daemon, {"id": ref, "name": ref})
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        return target.submit(source, FORWARD_WAIT, relay=True, hold=True), False
    interrupts = []

    def hold_back(signum: int, frame: Any) -> None:
        interrupts.append(signum)
        if len(interrupts) > 1:
            raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, hold_back)
    try:
        return target.submit(source, FORWARD_WAIT, relay=True, hold=True), bool(interrupts)
    finally:  # None: a handler set outside Python, which cannot be put back; the kernel's is Python's own
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)


def describe_error(ename: str, evalue: str) -> str:
    """A kernel's error in one line, here and in the server: ``ZeroDivisionError: division by zero``. A kernel
    may give no name: bash_kernel gives a failing last command's exit status as the value, or a message."""
    if ename:
        return f"{ename}: {evalue}"
    if evalue.isdecimal():
        return f"exit status {evalue}"
    return evalue or "an error without a name or a message"


def forward(ref: str, source: str) -> None:
    """Run a ``%%loommux --kernel NAME`` cell's body in kernel NAME, relaying its output into this cell."""
    try:
        job, interrupt = submit_forwarded(ref, source)
    except DaemonError as exc:
        exc.one_line = True  # the forwarding machinery is not the user's traceback
        raise
    reply, heading = job.info, f"[forwarded to kernel {ref} · execution {job.execution}]\n"
    if not interrupt:
        try:
            end = job.relay(reply=reply, heading=heading, cell_ends=True)
        except KeyboardInterrupt:
            interrupt, reply, heading = True, None, ""  # what was shown stays shown
    if interrupt:  # this cell ends interrupted, whatever the target's cell does
        job.interrupt()
        end = {**job.relay(INTERRUPT_DRAIN, reply, heading), "state": INTERRUPTED}
    if end["state"] == INTERRUPTED:
        interrupted = KeyboardInterrupt(f"execution {job.execution} in kernel {ref} was interrupted")
        interrupted.one_line = True
        raise interrupted
    if end["state"] != COMPLETED:
        error = end.get("error")
        what = (f"ended with {describe_error(error['ename'], error['evalue'])}" if error
                else f"ended {end['state']}" + (f" ({end['reason']})" if end.get("reason") else ""))
        error = ForwardedCellError(f"execution {job.execution} in kernel {ref} {what}")
        error.one_line = True
        raise error


def transform_header(lines: list[str]) -> list[str]:
    """IPython input transformer for the ``%%loommux`` header: the header becomes a comment (so line numbers
    stay as written), or goes when another cell magic follows it; a cell for another kernel becomes a call
    that forwards it there."""
    arguments = extract_header_arguments(lines[0]) if lines else None
    if arguments is None:
        return lines
    try:
        options = parse_header_arguments(arguments)
    except CellHeaderError as exc:
        return [f"raise __import__('IPython').core.error.UsageError({f'{HEADER_PREFIX}: {exc}'!r})\n"]
    body = lines[1:]
    if options.kernel is not None and options.kernel not in _daemon.identity:
        return [f"__import__('_loommux_kernel').forward({options.kernel!r}, {''.join(body)!r})\n"]
    if body and body[0].startswith("%%"):
        return body
    return ["# " + lines[0], *body]


PATCH_BEGIN, PATCH_END = "*** Begin Patch", "*** End Patch"
# An opening triple quote (prefix "", r, f, rf or fr) followed by a newline or by the patch's first line.
PATCH_OPENING_RE = re.compile(r'(?<![\w"\'])((?:[rR][fF]?|[fF][rR]?)?)"""(\n?)(?=\*\*\* Begin Patch\n)')


def is_patch_program(ops: list[str]) -> bool:
    """Whether the lines between Begin and End Patch are ``op+`` of the Apply Patch grammar."""
    i, n, count = 0, len(ops), 0
    while i < n:
        line = ops[i]
        if line.startswith("*** Add File: ") and line[14:]:
            i += 1
            while i < n and ops[i].startswith("+"):
                i += 1
        elif line.startswith("*** Delete File: ") and line[17:]:
            i += 1
        elif line.startswith("*** Update File: ") and line[17:]:
            i += 1
            if i < n and ops[i].startswith("*** Move to: ") and ops[i][13:]:
                i += 1
            hunks = 0
            while i < n and (ops[i] == "@@" or ops[i].startswith("@@ ")):
                i, first = i + 1, i + 1
                while i < n and ops[i][:1] in (" ", "-", "+") and ops[i]:
                    i += 1
                if i == first:
                    return False
                if i < n and ops[i] == "*** End of File":
                    i += 1
                hunks += 1
            if not hunks:
                return False
        else:
            return False
        count += 1
    return count > 0


def transform_patch_literals(lines: list[str]) -> list[str]:
    """IPython input transformer: a triple-quoted literal whose whole content is an Apply Patch program
    becomes a plain ``str`` of exactly that program (its quotes, backslashes and braces intact), written
    one literal per line so that line numbers stay as written. Anything else is left to Python."""
    text = "".join(lines)
    if PATCH_BEGIN not in text:
        return lines
    out, at = [], 0
    for opening in PATCH_OPENING_RE.finditer(text):
        if opening.start() < at:
            continue
        body_start = opening.end()
        end = text.find(f"\n{PATCH_END}\n", body_start)
        if end < 0 or not text.startswith('"""', end + len(PATCH_END) + 2):
            continue
        program = text[body_start : end + len(PATCH_END) + 2].split("\n")[:-1]
        if not is_patch_program(program[1:-1]):
            continue
        literals = "\n".join(repr(line + "\n") for line in program)
        out += [text[at : opening.start()], "(", "\n" if opening[2] else "", literals, "\n)"]
        at = end + len(PATCH_END) + 5  # past the closing quotes; the rest of that line goes on as Python
    if not out:
        return lines
    return "".join([*out, text[at:]]).splitlines(keepends=True)


def flag_header_on_a_later_line(line: str) -> None:
    """IPython reads "%%loommux" on a later line as the line magic "%loommux" (a "%" in its name)."""
    from IPython.core.error import UsageError

    raise UsageError(f"{HEADER_PREFIX} must be the first line of the cell; here it is on a later line")


def show_loommux_error(shell: Any, etype: type, value: BaseException, tb: Any,
                       tb_offset: int | None = None) -> Any:
    """loommux's own failures (``one_line``: a forwarding failure, a cell an inspector blocked, a refused
    publication) are one line; any other DaemonError or KeyboardInterrupt gets its usual traceback."""
    if getattr(value, "one_line", False):
        stb = [f"{etype.__name__}: {value}"]
        shell._showtraceback(etype, value, stb)
        return stb
    shell.showtraceback((etype, value, tb), tb_offset=tb_offset, running_compiled_code=True)
    return None


def keep_all_iopub(kernel: Any) -> None:
    """ipykernel's IOPub socket drops messages silently once 1,000 wait for a subscriber slow to take them
    (the server's process not scheduled for a moment, say). loommux takes them all (its socket has no limit):
    the kernel keeps them all too, set on the thread that owns the socket."""
    thread = getattr(kernel, "iopub_thread", None)
    if thread is not None and getattr(thread, "socket", None) is not None:
        thread.schedule(lambda: setattr(thread.socket, "sndhwm", 0))


STREAM_PIECE_CHARS = 1 << 20  # the text a stream message carries at most, about (see send_streams_in_pieces)


def send_streams_in_pieces(stream: Any) -> None:
    """ipykernel sends what a stream buffered in one message: a cell writing gigabytes makes messages of tens
    of megabytes, which each copy on the way (JSON, signing, the server's parsing) holds whole. Send a big
    one as messages of about STREAM_PIECE_CHARS, cut at line ends, numbered in the order they go. The hook
    runs where the stream flushes: registered on its IOPub thread (hooks are per thread)."""
    thread = getattr(stream, "pub_thread", None)
    if thread is None or not hasattr(stream, "register_hook") or not hasattr(stream, "session"):
        return

    def cut(msg: dict) -> dict:
        text = msg["content"].get("text")
        if not isinstance(text, str) or len(text) <= 2 * STREAM_PIECE_CHARS:
            return msg
        start, piece = 0, msg
        while len(text) - start > STREAM_PIECE_CHARS:
            end = text.rfind("\n", start, start + STREAM_PIECE_CHARS) + 1 or start + STREAM_PIECE_CHARS
            piece["content"] = {**msg["content"], "text": text[start:end]}
            stream.session.send(thread, piece, ident=stream.topic)
            start = end
            piece = stream.session.msg("stream", dict(msg["content"]), parent=msg["parent_header"])
        piece["content"]["text"] = text[start:]
        return piece  # sent by ipykernel, after the others

    thread.schedule(lambda: stream.register_hook(cut))


def reply_without_sleeping(kernel: Any) -> None:
    """ipykernel sleeps 0.5 ms (1 ms in practice) before every execute_reply, in case output flushed just
    before it has not reached its clients yet: a quarter of a ``1+1`` round trip. loommux needs no such grace:
    it ends a cell only once it has both the reply and the IOPub idle status, which follows all its output."""
    if hasattr(kernel, "_execute_sleep"):
        kernel._execute_sleep = 0.0


def number_results_when_sent(displayhook: Any) -> None:
    """ipykernel's displayhook takes the next message number when it begins an execute_result, and sends none
    for a value that displays itself (``_ipython_display_``: a plotly figure, say): loommux would count that
    number as a lost message. Begin it unnumbered; number it as it is sent."""
    if not (hasattr(displayhook, "finish_displayhook") and getattr(displayhook, "session", None)):
        return
    session, finish = displayhook.session, displayhook.finish_displayhook

    def start_displayhook() -> None:
        unnumbered = {"msg_id": "", "msg_type": "execute_result"}
        displayhook.msg = session.msg("execute_result", {"data": {}, "metadata": {}},
                                      parent=displayhook.parent_header, header=unnumbered)

    def finish_displayhook() -> None:
        msg = displayhook.msg
        if msg and msg["content"]["data"] and not msg["msg_id"]:
            msg["header"] = session.msg_header("execute_result")
            msg["msg_id"] = msg["header"]["msg_id"]
        finish()

    displayhook.start_displayhook, displayhook.finish_displayhook = start_displayhook, finish_displayhook


def ask_through_the_host(kernel: Any) -> None:
    """input() in a cell that may read stdin: a prompt the person declined raises EOFError saying so; getpass
    and a prompt asking for a secret fail at once, as input() does without stdin. ipykernel points input and
    getpass.getpass at its own methods for every cell (_forward_input); a cell without stdin keeps them."""
    import builtins
    import getpass

    from IPython.core.error import StdinNotImplementedError

    ipykernel_forward = kernel._forward_input

    def asked(prompt: Any = "") -> str:
        __tracebackhide__ = True  # IPython leaves this frame out of tracebacks
        if SECRET_PROMPT_RE.search(str(prompt)):
            raise StdinNotImplementedError(NO_SECRETS.format(what=f"input({str(prompt)!r})"))
        try:
            return kernel.raw_input(prompt)
        except EOFError:
            raise EOFError(INPUT_DECLINED) from None  # loommux answers a decline with end-of-file

    def secret(*args: Any, **kwargs: Any) -> str:
        __tracebackhide__ = True
        raise StdinNotImplementedError(NO_SECRETS.format(what="getpass"))

    def forward_input(allow_stdin: bool = False) -> None:
        ipykernel_forward(allow_stdin)
        if allow_stdin:
            builtins.input, getpass.getpass = asked, secret

    kernel._forward_input = forward_input


class SignalledInterrupt(KeyboardInterrupt):
    """A SIGINT (the interrupt tool) that came while inspectors ran: it interrupts the cell, never fails open
    as an inspector's own KeyboardInterrupt does."""


def run_inspectors(run: Any) -> Any:
    """``run()``, with a SIGINT that comes meanwhile raised as SignalledInterrupt (in the main thread, where
    IPython runs a cell's AST transformers; elsewhere as it is)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return run()

    def interrupted(signum: int, frame: Any) -> None:
        raise SignalledInterrupt

    previous = signal.signal(signal.SIGINT, interrupted)
    try:
        return run()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)


def consult(inspector: Any, name: str, source: str, tree: Any) -> list[dict]:
    """What an inspector says of a cell, as its notes carry it: its note, or its failure; Block (and a
    SignalledInterrupt) go through."""
    try:
        said = inspector(source, tree)
        return [] if said is None else [{"inspector": name, "note": str(said)}]
    except (Block, SignalledInterrupt):
        raise
    # An inspector's bug must never read as a policy; nor may its sys.exit() or KeyboardInterrupt end the
    # cell (IPython would also unregister the transformer that raised it).
    except (Exception, SystemExit, KeyboardInterrupt) as exc:  # noqa: BLE001
        return [{"inspector": name, "warning": f"{type(exc).__name__}: {exc}"}]


def inspect_cells(shell: Any, kernel: Any) -> None:
    """Run the inspectors on each cell the server sends (never another client's cell, nor loommux's own
    silent code) after IPython's transforms, before it runs: an AST transformer, which IPython gives each
    cell's tree. ``Block`` stops the cell as IPython's InputRejected (the cell does not run and ends in an
    error named CellBlocked, shown in one line); any other exception of an inspector fails open, said with
    the notes."""
    import ast

    from IPython.core.error import InputRejected

    class CellBlocked(InputRejected):
        """A cell inspector kept the cell from running."""

        def _render_traceback_(self) -> list[str]:  # what IPython shows of it: one line
            return [f"CellBlocked: {self}"]

    raw = [""]  # the cell about to run, as sent

    def remember(info: Any) -> None:
        raw[0] = getattr(info, "raw_cell", None) or ""

    shell.events.register("pre_run_cell", remember)

    def publish(notes: list) -> None:
        if notes:
            shell.display_pub.publish({INSPECTOR_NOTES_MIME: notes}, metadata={})

    class LoommuxInspection(ast.NodeTransformer):
        def visit(self, node: Any) -> Any:
            parent = kernel.get_parent() or {}
            header = parent.get("header") or {}
            ours = header.get("username") == SERVER_USERNAME and header.get("msg_type") == "execute_request"
            if not _inspectors or not ours or (parent.get("content") or {}).get("silent"):
                return node
            return run_inspectors(lambda: self.inspect(node))

        def inspect(self, node: Any) -> Any:
            source, notes = shell.transform_cell(raw[0]), []
            for inspector in _inspectors:
                name = inspector.__name__
                try:
                    notes.extend(consult(inspector, name, source, node))
                except Block as exc:
                    publish(notes)
                    raise CellBlocked(f"blocked by inspector {name}: {exc}") from None
                except SignalledInterrupt:
                    publish(notes)
                    raise KeyboardInterrupt from None
            publish(notes)
            return node

    others = [t for t in shell.ast_transformers if type(t).__name__ != "LoommuxInspection"]
    shell.ast_transformers[:] = [*others, LoommuxInspection()]  # one, however often it is bootstrapped


def install(ipython: Any, kernel_id: str, name: str, control_url: str | None, token: str,
            notebook_file: str | None = None) -> None:
    """Give the kernel its identity, the ``loommux`` object and the cell header's transformer; have it keep
    and number every message it sends."""
    import os
    import sys

    global _daemon
    os.environ.update({KERNEL_ID_ENV: kernel_id, KERNEL_NAME_ENV: name, KERNEL_TOKEN_ENV: token})
    if control_url:
        os.environ[CONTROL_URL_ENV] = control_url
    else:
        os.environ.pop(CONTROL_URL_ENV, None)
    _daemon = Daemon.in_kernel(kernel_id, name, control_url, token, notebook_file)
    ipython.user_ns["loommux"] = _daemon
    ipython.input_transformers_cleanup.extend([transform_header, transform_patch_literals])
    ipython.register_magic_function(flag_header_on_a_later_line, "line", "%" + HEADER_MAGIC)
    ipython.set_custom_exc((DaemonError, ForwardedCellError, KeyboardInterrupt, PublishError),
                           show_loommux_error)
    kernel = getattr(ipython, "kernel", None)  # None in a plain IPython shell
    keep_all_iopub(kernel)
    for stream in (sys.stdout, sys.stderr):
        send_streams_in_pieces(stream)
    reply_without_sleeping(kernel)
    number_results_when_sent(ipython.displayhook)
    ipython.events.register("post_execute", _published.flush)  # a cell's publish calls: one announcement
    if kernel is not None and hasattr(kernel, "_forward_input") and hasattr(kernel, "raw_input"):
        ask_through_the_host(kernel)
    if kernel is not None and hasattr(kernel, "do_inspect"):
        answer_namespace_requests(kernel)
    if kernel is not None and hasattr(kernel, "get_parent"):
        inspect_cells(ipython, kernel)


# ---------------------------------------------------------------- Jupyter wire

DELIMITER = b"<IDS|MSG>"
WIRE_PROTOCOL_VERSION = "5.3"
CHANNELS = ("shell", "iopub", "stdin", "control", "hb")


@dataclass
class Message:
    msg_type: str
    msg_id: str
    parent_id: str | None
    content: dict
    header: dict = field(default_factory=dict)
    parent: dict = field(default_factory=dict)  # the parent header: who asked

    @property
    def parent_session(self) -> str | None:
        """Who sent the request it answers: ours, or another client's."""
        return self.parent.get("session")

    @property
    def parent_username(self) -> str | None:
        return self.parent.get("username")


class WireSession:
    """Signs what we send and verifies what we receive (HMAC-SHA256 over the exact bytes)."""

    def __init__(self, key: bytes, digest: str = "sha256") -> None:
        self.key = key
        self.digest = digest  # a connection file's signature_scheme names another (hmac-sha512, say)
        self.session = uuid.uuid4().hex

    def use_key(self, key: bytes, digest: str) -> None:
        """Sign and verify with another key and digest from now on (an attached kernel's connection file's,
        read as it is joined); the session id stays, so that replies to it are still ours."""
        self.key, self.digest = key, digest

    def signature(self, parts: list[bytes]) -> bytes:
        mac = hmac.new(self.key, digestmod=self.digest)
        for part in parts:
            mac.update(part)
        return mac.hexdigest().encode()

    def header(self, msg_type: str, subshell: str | None = None) -> dict:
        """A new message's header (a fresh msg_id; our session for life), for a subshell if one is named."""
        header = {
            "msg_id": uuid.uuid4().hex,
            "session": self.session,
            "username": SERVER_USERNAME,
            "date": format_iso_utc(time.time()),
            "msg_type": msg_type,
            "version": WIRE_PROTOCOL_VERSION,
        }
        if subshell is not None:
            header["subshell_id"] = subshell
        return header

    def build(self, msg_type: str, content: dict, subshell: str | None = None) -> tuple[str, list[bytes]]:
        """A signed message; ``subshell``: the kernel subshell (JEP 91) that is to handle it."""
        header = self.header(msg_type, subshell)
        parts = [json.dumps(part).encode() for part in (header, {}, {}, content)]
        return header["msg_id"], [DELIMITER, self.signature(parts), *parts]

    def parse(self, frames: list[bytes]) -> Message | None:
        """Decode a received message; None when it is malformed or its signature fails."""
        try:
            at = frames.index(DELIMITER)
            signature, parts = frames[at + 1], frames[at + 2 : at + 6]
            if len(parts) < 4 or not hmac.compare_digest(signature, self.signature(parts)):
                return None
            # Invalid UTF-8 (a cell printing surrogate-escaped bytes) is replaced, never a lost message.
            header, parent = json.loads(parts[0]), json.loads(parts[1])
            content = json.loads(parts[3].decode("utf-8", "replace"))
            if not isinstance(content, dict):
                return None
            msg_type, msg_id = header["msg_type"], header["msg_id"]
            return Message(msg_type, msg_id, parent.get("msg_id"), content, header, parent)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


# ---------------------------------------------------------------- Kernel process

KERNEL_START_TIMEOUT = 30.0
KERNEL_INFO_RETRY = 1.0
RECONNECT_INTERVAL_MS = 10  # zmq's default, 100 ms, would delay every kernel start
# IOPub messages of this interpreter's ipykernel that may wait in the server, unread: past them zmq stops
# reading the connection, and the rest wait in the kernel, which keeps every message (see keep_all_iopub), so
# that a cell printing gigabytes never fills the server's memory. Any other kernel's publisher drops what its
# subscriber is slow to take: its IOPub may wait here without limit (0), never dropped.
IOPUB_BACKLOG = 64
RECEIVE_BATCH = 256  # messages read from a socket at once, before other tasks run
IOPUB_PROBE_WAIT = 0.2
SHUTDOWN_GRACE = 2.0
TERM_GRACE = 1.0
INPUT_EOF = "\x04"  # the input_reply value that makes the cell's input() raise EOFError
KERNEL_DIR_PREFIX = "loommux-"  # each kernel's private temporary directory: its key, sockets and log
# In that directory: "<pid> <start time> <kernel marker>", the server that made it and the marker.
KERNEL_OWNER_FILE = "owner"
KERNEL_PID_FILE = "kernel.pid"  # written by the launcher: the pid of the ipykernel process
KERNEL_INSTANCE_ENV = "LOOMMUX_KERNEL_INSTANCE"  # a kernel's marker, inherited by everything its cells start
KERNEL_DIR_ENV = "LOOMMUX_KERNEL_DIR"
KERNEL_ARGV_ENV = "LOOMMUX_KERNEL_ARGV"  # a kernelspec's argv (JSON), run by the launcher, not ipykernel
KERNEL_LAUNCHER_FILE = "launcher.py"  # in that directory: the launcher's source (KERNEL_LAUNCHER)
KERNEL_LAUNCHER_NAME = "loommux-kernel-launcher"  # what `ps` shows of a launcher (and of its kernel)
KERNEL_CONFIG = """\
c.HistoryManager.hist_file = ":memory:"
"""
BOOTSTRAP_TIMEOUT = 30.0
SUBSHELL_FEATURE = "kernel subshells"  # in kernel_info's supported_features: JEP 91 (ipykernel 7 and later)
SUBSHELL_TIMEOUT = 5.0
NAMESPACE_TIMEOUT = ANSWER_BUDGET + 10.0  # how long a namespace request may take the kernel, at most
IPYTHON_IMPLEMENTATION = "ipython"  # kernel_info's implementation: only IPython kernels take the kernel side
STARTUP_TIMEOUT = 300.0  # a startup file may import large libraries
INSPECTORS_TIMEOUT = 10.0  # an inspectors file defines functions: initialize is answered within 30 s
USER_FILE_INTERRUPT_GRACE = 5.0  # how long a user file that outlived its time has to end once interrupted
DEATH_POLL = 0.1  # how often loommux's own requests to a kernel check that it lives
STARTUP_TRACEBACK_LINES = 6
NOTICE_LINE_CHARS = 200
STARTUP_CODE = "exec(compile({source!r}, {path!r}, 'exec'), get_ipython().user_ns)"
INSPECTORS_CODE = "__import__('sys').modules['_loommux_kernel']._daemon.load_inspectors({source!r}, {path!r})"
# The sections sent, as source, to every kernel handed to a resource: the error codes, the cell header's
# grammar, published functions, the namespace and the kernel-side extension. They stand together in this
# file and each imports what it uses, so a kernel needs no copy of this file; only the compiler flag of this
# file's first line is added.
KERNEL_SIDE_SECTIONS = ("Error codes", "Cell input", "Published functions", "Namespace",
                        "Kernel-side extension")
KERNEL_SIDE_PRELUDE = "from __future__ import annotations\n"
# Runs the kernel side in a module of its own, then installs it; it leaves no names in the user's namespace.
# The kernel's count is set to loommux's next number, so that its Out[N], _N and tracebacks' Cell In[N] agree
# with loommux's In [N] (after a restart, say): each cell loommux runs then adds one to both. A person's
# kernel (attached) keeps its own count, which their notebook shows.
KERNEL_BOOTSTRAP = """\
def _loommux_bootstrap(source, identity, count):
    import sys, types
    module = types.ModuleType("_loommux_kernel")
    sys.modules[module.__name__] = module
    import linecache
    filename = "<loommux kernel side>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for tracebacks
    exec(compile(source, filename, "exec"), module.__dict__)
    module.install(get_ipython(), **identity)
    if count is not None:
        get_ipython().execution_count = count
_loommux_bootstrap({source!r}, {identity!r}, {count!r})
del _loommux_bootstrap
"""
_kernel_side_source: str | None = None


def read_kernel_side_source() -> str:
    """The kernel side, cut from this file's own text by its section banners (read once)."""
    global _kernel_side_source
    if _kernel_side_source is None:
        text = Path(__file__).read_text(encoding="utf-8")
        parts = [KERNEL_SIDE_PRELUDE]
        for name in KERNEL_SIDE_SECTIONS:  # each up to the next section's banner
            start = text.index(f"{SECTION_BANNER} {name}\n")
            parts.append(text[start : text.index(SECTION_BANNER, start + len(SECTION_BANNER))])
        _kernel_side_source = "\n".join(parts)
    return _kernel_side_source


# The kernel process runs this instead of -m ipykernel_launcher, from the kernel's directory: its command
# line (python -c KERNEL_LOADER loommux-kernel-launcher -f FILE) stays short and says what it is.
# On Linux it becomes a child subreaper, so everything its cells start stays below it however it
# detaches (double fork, setsid), and forks: the child runs ipykernel, the launcher reaps whatever is
# adopted (never a process the cells' own code waits for: those are the ipykernel child's children),
# and when the kernel exits or the server is gone it kills its whole tree and every process carrying
# the kernel's marker, then exits with the kernel's status. It repeats a few lines of /proc reading
# found below rather than import this file, which would slow every kernel start.
KERNEL_LAUNCHER = f"""\
# loommux kernel launcher
INSTANCE_ENV, DIR_ENV, PID_FILE = {KERNEL_INSTANCE_ENV!r}, {KERNEL_DIR_ENV!r}, {KERNEL_PID_FILE!r}
ARGV_ENV = {KERNEL_ARGV_ENV!r}
""" + r"""
import os, signal, sys

if sys.path[0] == "":
    del sys.path[0]  # python -c put the workspace first: none of its files may stand in for a module here
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36
SERVER_POLL_SECONDS = 0.5


def run_kernel(kernel_dir):
    "What python -m ipykernel_launcher -f FILE does (or a kernelspec's argv), once the pid is recorded."
    with open(os.path.join(kernel_dir, PID_FILE), "w") as f:
        f.write(str(os.getpid()))
    argv = os.environ.pop(ARGV_ENV, None)
    if argv is not None:
        import json
        argv = json.loads(argv)
        try:
            os.execvp(argv[0], argv)  # the same process: its pid stays the one recorded
        except OSError as exc:
            what = repr(argv[0]) + ": " + str(exc.strerror)
            sys.stderr.write("cannot run the kernelspec's argv " + what + "\n")
            os._exit(127)
    # Nothing speaks the Jupyter debug protocol to a loommux kernel, and importing debugpy for it is about a
    # fifth of a kernel's start: ipykernel finds none and leaves its debugger off. Cells may still import it.
    sys.modules["debugpy"] = None
    import ipykernel.debugger
    del sys.modules["debugpy"]
    import runpy
    runpy.run_module("ipykernel_launcher", run_name="__main__", alter_sys=True)


def live_parents():
    "pid -> parent pid of every process that has not exited yet (zombies have)."
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open("/proc/" + entry + "/stat", "rb") as f:
                    stat = f.read()
                fields = stat[stat.rindex(b")") + 2:].split()
            except (OSError, ValueError):
                continue
            if fields[0] not in (b"Z", b"X"):
                parents[int(entry)] = int(fields[1])
    return parents


def carries(pid, marker):
    try:
        with open("/proc/" + str(pid) + "/environ", "rb") as f:
            return marker in b"\0" + f.read()
    except OSError:
        return False


def kill_everything(marker):
    "SIGKILL every process below this one or carrying the marker, until a look finds no new one."
    me, killed, unmarked = os.getpid(), set(), set()  # an environment found without the marker never gains it
    while True:
        parents = live_parents()
        children = {}
        for pid, parent in parents.items():
            children.setdefault(parent, []).append(pid)
        found, todo = set(), [me]
        while todo:
            for child in children.get(todo.pop(), ()):
                found.add(child)
                todo.append(child)
        for pid in parents.keys() - found - unmarked - {me}:
            (found if carries(pid, marker) else unmarked).add(pid)
        new = found - killed
        if not new:
            return
        for pid in new:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        killed |= new


def follow_server(server, marker, kernel_dir, leaving):
    "The server is gone (SIGKILLed, say): take everything down, remove the kernel's directory, exit."
    import time
    while os.getppid() == server:
        time.sleep(SERVER_POLL_SECONDS)
    with leaving:
        kill_everything(marker)
        remove(kernel_dir)
        os._exit(1)


def remove(kernel_dir):
    import shutil
    shutil.rmtree(kernel_dir, ignore_errors=True)


def exit_like(status):
    code = os.waitstatus_to_exitcode(status)
    if code < 0:
        try:
            signal.signal(-code, signal.SIG_DFL)
        except (OSError, ValueError):
            pass  # SIGKILL cannot be caught anyway
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


def main():
    marker = ("\0" + INSTANCE_ENV + "=" + os.environ[INSTANCE_ENV] + "\0").encode()
    kernel_dir = os.environ.pop(DIR_ENV)
    server = int(os.environ["JPY_PARENT_PID"])
    libc = None
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
        except (ImportError, OSError):
            pass
    if libc is None or libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        run_kernel(kernel_dir)  # no subreaper here: ipykernel alone, following its parent itself
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # interrupts go to the whole group: they are the kernel's
    launcher = os.getpid()
    kernel = os.fork()
    if kernel == 0:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != launcher:
            os._exit(1)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ["JPY_PARENT_PID"] = str(launcher)
        run_kernel(kernel_dir)
        return

    def forward(signum, frame):
        try:
            os.kill(kernel, signum)
        except OSError:
            pass

    signal.signal(signal.SIGTERM, forward)
    import threading
    leaving = threading.Lock()  # one way out: the kernel's end or the server's, not both at once
    threading.Thread(target=follow_server, args=(server, marker, kernel_dir, leaving), daemon=True).start()
    while True:
        pid, status = os.wait()
        if pid == kernel:
            break
    with leaving:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the kernel is gone; finish the cleanup
        kill_everything(marker)
        try:
            while True:
                os.wait()
        except ChildProcessError:
            pass
        if os.getppid() != server:
            remove(kernel_dir)
        exit_like(status)


main()
"""
# argv[1] only names the launcher for `ps`: ipykernel reads the arguments after it
KERNEL_LOADER = ("import os, sys; del sys.argv[1]; exec(compile(open(os.path.join("
                 f"os.environ[{KERNEL_DIR_ENV!r}], {KERNEL_LAUNCHER_FILE!r})).read(), "
                 f"{KERNEL_LAUNCHER_NAME!r}, 'exec'))")

_zmq_context: zmq.asyncio.Context | None = None


def get_zmq_context() -> zmq.asyncio.Context:
    """The one pyzmq context. pyzmq is imported here, on first use, rather than at the top of
    the file: the server's first kernel then boots while pyzmq loads (~150 ms off every start)."""
    global _zmq_context
    if _zmq_context is None:
        import zmq.asyncio

        _zmq_context = zmq.asyncio.Context()
    return _zmq_context
_live_kernels: set[LaunchedKernel] = set()


class KernelError(Exception):
    pass


class KernelLost(KernelError):
    """The kernel died, or hung past an interrupt, while it ran loommux's own code or a user's file."""


def list_descendants(pid: int) -> list[int]:
    """Every live descendant of a process (Linux /proc; elsewhere none are found)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
                parent = int(stat[stat.rindex(b")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def kill_quietly(pid: int, sig: int, group: bool = False) -> None:
    try:
        (os.killpg if group else os.kill)(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def find_marked_processes(marker: str) -> list[int]:
    """Every process of this user whose environment carries a kernel's instance marker."""
    tag = f"\0{KERNEL_INSTANCE_ENV}={marker}\0".encode()
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if tag in b"\0" + f.read():
                        found.append(int(entry))
            except OSError:
                continue  # gone, or another user's
    return found


def kill_marked_processes(marker: str) -> None:
    """What escaped a kernel's tree (its launcher was killed, say): SIGKILL every process carrying its
    marker, looking again until no new one turns up (they may be forking as we go)."""
    killed: set[int] = set()
    while new := set(find_marked_processes(marker)) - killed:
        for pid in new:
            kill_quietly(pid, signal.SIGKILL)
        killed |= new


def read_process_start_time(pid: int) -> str:
    """When a process started (clock ticks since boot, from /proc), which tells it from a later process
    given the same pid; "-" when there is no such process or no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2 :].split()[19].decode()
    except (OSError, ValueError, IndexError):
        return "-"


def is_process_running(pid: int, started: str) -> bool:
    """Whether the process that had this pid and start time still runs (not another given its pid)."""
    if started != "-":
        return read_process_start_time(pid) == started
    try:  # recorded where there is no /proc: the pid alone
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


# A forked child holds no lock another thread may hold: it only searches, pickles and exits.
warnings.filterwarnings("ignore", r".*multi-threaded, use of fork\(\) may lead to deadlocks",
                        DeprecationWarning)


async def run_forked(work: Callable[[], Any], lifetime: float) -> Any:
    """Run work in a forked child and return its result; cancelling this SIGKILLs the child.

    The child sees the parent's memory as it was at the fork, copy-on-write: nothing is sent to it. It
    ends itself after `lifetime` seconds, should this process die without killing it.
    """
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read_end)
        os.close(write_end)
        raise
    if pid == 0:
        run_child(work, write_end, lifetime)
    os.close(write_end)
    pipe, transport = os.fdopen(read_end, "rb", buffering=0), None
    reader = asyncio.StreamReader()
    try:
        transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe)
        data = await reader.read()
    finally:
        if transport is None:
            pipe.close()
        else:
            transport.close()  # and with it the pipe
        os.kill(pid, signal.SIGKILL)  # a no-op once it exited: the pid stays its own until reaped
        reap_later(pid)
    if not data:
        raise RuntimeError("the search process ended without an answer")
    ok, value = pickle.loads(data)
    if not ok:
        raise RuntimeError(f"the search process failed: {value}")
    return value


def run_child(work: Callable[[], Any], write_end: int, lifetime: float) -> None:
    """The forked child: run work, write (ok, result) to the pipe, exit without any cleanup of the
    parent's."""
    try:
        gc.disable()  # a collection would touch, and so copy, every object of the parent
        signal.alarm(min(math.ceil(lifetime) + 1, 1 << 30))  # SIGALRM's default action ends the process
        os.closerange(0, write_end)  # the parent's sockets and pipes close when the parent closes them
        os.closerange(write_end + 1, os.sysconf("SC_OPEN_MAX"))
        try:
            answer = pickle.dumps((True, work()), pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # noqa: BLE001 - the parent reports it
            answer = pickle.dumps((False, f"{type(exc).__name__}: {exc}"))
        with open(write_end, "wb") as pipe:
            pipe.write(answer)
    finally:
        os._exit(0)


def reap_later(pid: int) -> None:
    """Collect a killed or finished child's exit status in a thread, so that it leaves no zombie."""
    threading.Thread(target=partial(os.waitpid, pid, 0), name=f"loommux-reap-{pid}", daemon=True).start()


def remove_stale_kernel_dirs() -> None:
    """Clean up after servers no longer running (SIGKILLed along with their kernels, say): kill what
    their kernels' cells left (by marker) and remove the kernel directories, each holding a key. A
    directory without a well-formed owner file is left alone: it is being created, or not a kernel's."""
    for path in Path(tempfile.gettempdir()).glob(KERNEL_DIR_PREFIX + "*"):
        try:
            found = path.lstat()  # a link is never followed: the temporary directory is everyone's
            if not S_ISDIR(found.st_mode) or found.st_uid != os.getuid():
                continue  # a link, or another user's
            pid, started, marker = (path / KERNEL_OWNER_FILE).read_text().split()
            if is_process_running(int(pid), started):
                continue
        except (OSError, ValueError):
            continue
        kill_marked_processes(marker)
        shutil.rmtree(path, ignore_errors=True)


# -- Message numbers: jupyter_client's Session gives every message it makes the id "<session>_<pid>_<n>",
# n counting from 0 over all channels. A number that never arrives is a message lost on the way (ipykernel's
# IOPub drops what a subscriber has not taken at its high-water mark), unless it went to another client.

MAX_FOREIGN_REQUESTS = 1000  # other clients' requests in progress remembered at once
MAX_HOLES = 10_000  # holes kept for a late message to fill; older ones stay charged


@dataclass
class Hole:
    """Message numbers start..stop-1, never received, charged to what the owner charged then."""

    start: int
    stop: int
    tag: Any


def split_msg_number(msg_id: Any) -> tuple[str, int | None]:
    """An id's prefix and number: ("<session>_<pid>", n), or (id, None) when it carries no number."""
    prefix, _, digits = str(msg_id).rpartition("_")
    return (prefix, int(digits)) if prefix and digits.isascii() and digits.isdigit() else (str(msg_id), None)


@dataclass
class MessageCounter:
    """The kernel's message numbers as they arrive, and the holes among them.

    IOPub carries nearly every message, nearly in the order of its number (ipykernel sends them all from one
    queue); a reply on another channel may come before IOPub messages numbered below it. So a number becomes a
    hole when IOPub passes it without it having come on any channel, and a late message fills its hole. A
    hole is charged to ``tag`` (the owner's: the running execution) through ``on_loss(tag, count)``, and
    uncharged as it fills.

    Never charged: what came before our IOPub subscription (counting starts at the first IOPub message once
    a kernel_info_reply has named the kernel's main process), other processes' messages (a forked child's ids
    carry its pid), and replies to other clients: each of their requests has one, numbered between the busy
    and idle statuses we do see.
    """

    own_session: str  # the header session of our requests; another is another client's
    tag: Any = None
    on_loss: Callable[[Any, int], None] = lambda tag, count: None
    prefix: str | None = None  # "<session>_<pid>" of the kernel's main process
    decided: bool = False  # a kernel_info_reply came (its ids carry no number: no prefix, nothing counted)
    iopub_seen: bool = False
    early: dict[str, int] = field(default_factory=dict)  # before counting: the highest number of each prefix
    start: int | None = None  # numbers up to this one came before counting began
    high: int = -1  # the highest number IOPub brought
    ahead: set[int] = field(default_factory=set)  # numbers that came on other channels, above high
    holes: list[Hole] = field(default_factory=list)  # in order, disjoint
    foreign: dict[str, int] = field(default_factory=dict)  # other clients' requests in progress: busy number

    def see(self, channel: str, message: Message) -> None:
        if self.start is None:
            self._begin(channel, message)
            return
        prefix, n = split_msg_number(message.msg_id)
        if n is None or n <= self.start or prefix != self.prefix:
            return
        if channel != "iopub":
            if n > self.high:
                self.ahead.add(n)
            else:
                self._fill(n)
            return
        if n == self.high + 1:
            self.high = n
        elif n > self.high:
            self._open(n)
        else:
            self._fill(n)
        if message.msg_type == "status":
            self._status(message, n)

    def _begin(self, channel: str, message: Message) -> None:
        if self.decided and self.prefix is None:
            return
        prefix, n = split_msg_number(message.msg_id)
        self.iopub_seen |= channel == "iopub"
        if n is not None:
            self.early[prefix] = max(n, self.early.get(prefix, n))
        if not self.decided and channel != "iopub" and message.msg_type == "kernel_info_reply":
            self.decided, session = True, message.header.get("session")
            if n is not None and isinstance(session, str) and prefix.startswith(session + "_"):
                self.prefix = prefix
        if self.prefix is not None and self.iopub_seen:
            self.start = self.high = self.early[self.prefix]
            self.early.clear()

    def _open(self, n: int) -> None:
        """IOPub brought n: the numbers between it and the last it brought are holes, but for those that came
        on other channels."""
        start = self.high + 1
        for got in sorted(number for number in self.ahead if number < n):
            self._add_hole(start, got)
            start = got + 1
            self.ahead.discard(got)
        self._add_hole(start, n)
        self.high = n

    def _add_hole(self, start: int, stop: int) -> None:
        if stop > start:
            if len(self.holes) >= MAX_HOLES:
                del self.holes[0]
            self.holes.append(Hole(start, stop, self.tag))
            self.on_loss(self.tag, stop - start)

    def _fill(self, n: int) -> None:
        if not self.holes:
            return
        i = bisect_right(self.holes, n, key=attrgetter("start")) - 1
        if i < 0 or n >= self.holes[i].stop:
            return  # counted before, or a duplicate
        hole = self.holes[i]
        if hole.stop - hole.start == 1:
            del self.holes[i]
        elif n == hole.start:
            hole.start += 1
        elif n == hole.stop - 1:
            hole.stop -= 1
        else:
            self.holes.insert(i + 1, Hole(n + 1, hole.stop, hole.tag))
            hole.stop = n
        self.on_loss(hole.tag, -1)

    def _status(self, message: Message, n: int) -> None:
        """Another client's request: its reply, numbered between its busy and idle statuses, is not lost."""
        parent = message.parent
        theirs = parent.get("session") not in (None, self.own_session)
        if not theirs or not str(parent.get("msg_type")).endswith("_request"):
            return
        key, state = str(parent.get("msg_id")), message.content.get("execution_state")
        if state == "busy":
            if len(self.foreign) >= MAX_FOREIGN_REQUESTS:
                del self.foreign[next(iter(self.foreign))]  # its idle was lost
            self.foreign[key] = n
        elif state == "idle":
            low = self.foreign.pop(key, self.start)
            i = bisect_left(self.holes, n, key=attrgetter("start")) - 1
            if i >= 0 and min(self.holes[i].stop, n) - 1 > low:
                self._fill(min(self.holes[i].stop, n) - 1)


def is_tool_description(tool: Any) -> bool:
    """A published tool as a kernel announces it: a valid name that is not loommux's, a description and an
    object schema."""
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        return False
    schema = tool.get("inputSchema")
    return (TOOL_NAME_RE.fullmatch(tool["name"]) is not None and tool["name"] not in RESERVED_TOOL_NAMES
            and isinstance(tool.get("description"), str) and isinstance(schema, dict)
            and schema.get("type") == "object" and isinstance(schema.get("properties"), dict))


@dataclass
class PublishedRecord:
    """The tools a kernel's functions are published as, as its latest announcement said them (see "Published
    functions")."""

    version: int = 0
    tools: dict[str, dict] = field(default_factory=dict)  # by name, as announced

    def take(self, snapshot: Any) -> bool:
        """An announcement, taken when it is newer than the last one taken (a reset's answer and its IOPub
        message may cross); whether it was."""
        version = snapshot.get("version") if isinstance(snapshot, dict) else None
        if not isinstance(version, int) or version <= self.version:
            return False
        if not isinstance(snapshot.get("tools"), list):
            return False
        self.version = version
        self.tools = {tool["name"]: tool for tool in snapshot["tools"] if is_tool_description(tool)}
        return True


class Kernel:
    """What a resource does with any kernel, whatever carries its messages: replies matched to requests,
    silent runs, the loommux bootstrap, the startup file and cells. Each kind of kernel (launched here,
    attached from a connection file, on a gateway) says whether it lives, why it died, and sends and stops.
    """

    owned = True  # whether loommux may stop and restart it: not a kernel a person has open (AttachedKernel)
    ident_kind = "pid"  # what its ident is, as notices name it: ``pid 123``; a gateway kernel's: ``id <id>``
    remote_id: str | None = None  # the gateway's id for a remote kernel
    connection_file: Path | None = None  # where a local kernel's connection file is, for a client joining it

    def __init__(self, session: WireSession) -> None:
        self.session = session
        self.counter = MessageCounter(session.session)  # its owner charges lost messages (see MessageCounter)
        # Set by the kernel's owner: a spare kernel in the pool ignores its messages.
        self.on_message: Callable[[Kernel, str, Message], None] = lambda kernel, channel, message: None
        self.on_exit: Callable[[Kernel, int | None], None] | None = None
        self.replies: dict[str, asyncio.Future] = {}
        self.iopub_live = asyncio.Event()
        self.stopping: asyncio.Future | None = None
        self.retiring = False
        self.info: dict = {}  # its kernel_info_reply's content (a notebook's kernelspec and language_info)
        self.tasks: list[asyncio.Task] = []  # what watches it and talks to it, cancelled as it stops
        self.subshell: asyncio.Future | None = None  # the id of its subshell for namespace requests (or None)
        self.published = PublishedRecord()  # the tools its functions are published as

    @property
    def ipython(self) -> bool:
        """Whether it is an IPython kernel, which alone takes the kernel side and Python startup files."""
        return self.info.get("implementation") == IPYTHON_IMPLEMENTATION

    @property
    def language(self) -> str:
        """``python 3.11.2``: the language and its version, as the kernel's kernel_info says them."""
        info = self.info.get("language_info") or {}
        return f"{info.get('name', 'unknown')} {info.get('version', '')}".strip()

    @property
    def pid(self) -> int | None:
        """The kernel's process; None where it is not known (it may be another machine's)."""
        return None

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    @property
    def ident(self) -> str:
        """The local pid (a gateway kernel: the gateway's kernel id)."""
        return str(self.pid)

    @property
    def label(self) -> str:
        """How notices name this kernel: ``pid 123`` (a gateway kernel: ``id <gateway id>``)."""
        return f"{self.ident_kind} {self.ident}"

    def exit_reason(self, code: int | None) -> str:
        """Why the kernel died, for the killed cell and the replacement notice."""
        raise NotImplementedError

    async def send(self, channel: str, msg_type: str, content: dict, subshell: str | None = None) -> str:
        raise NotImplementedError

    def interrupt(self) -> None:
        raise NotImplementedError

    async def stop(self, grace: float = SHUTDOWN_GRACE) -> None:
        """Shut the kernel down (once, however often asked). Cancelling the caller (a cancelled restart,
        say) never leaves the work half done."""
        self.retiring = True
        if self.stopping is None:
            self.stopping = asyncio.ensure_future(self._stop(grace))
        await asyncio.shield(self.stopping)

    async def _stop(self, grace: float) -> None:
        raise NotImplementedError

    def _cancel_tasks(self) -> None:
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()

    def expect_reply(self, msg_id: str) -> None:
        self.replies[msg_id] = asyncio.get_running_loop().create_future()

    def route_reply(self, message: Message) -> None:
        waiter = self.replies.pop(message.parent_id, None)
        if waiter and not waiter.done():
            waiter.set_result(message)

    def dispatch(self, channel: str, message: Message) -> None:
        """Hand one received message to the owner (replies are matched first)."""
        if channel == "iopub":
            self.iopub_live.set()
        else:
            self.route_reply(message)
        try:
            self.on_message(self, channel, message)
            self.counter.see(channel, message)  # still before a result is rendered (a later loop turn)
        except Exception:  # noqa: BLE001 - one odd message must not stop the channel
            log(f"could not handle a {channel} {message.msg_type} message:\n{traceback.format_exc()}")

    async def await_ready(self, check: Callable[[], None], channel: str = "shell") -> None:
        """kernel_info_reply received and an IOPub message seen (the late-joiner guard); asked on the control
        channel of a kernel whose shell a cell may hold (one joined again after a restart of ours)."""
        while True:
            check()
            msg_id = await self.send(channel, "kernel_info_request", {})
            try:
                self.info = (await asyncio.wait_for(self.reply(msg_id), KERNEL_INFO_RETRY)).content
                await asyncio.wait_for(self.iopub_live.wait(), IOPUB_PROBE_WAIT)
                return
            except asyncio.TimeoutError:
                continue

    def reply(self, msg_id: str) -> asyncio.Future:
        return self.replies[msg_id]

    @property
    def exit_code(self) -> int | None:
        """The status a dead kernel's process exited with, where it is known."""
        return None

    async def await_reply(self, msg_id: str, timeout: float) -> Message | None:
        """The reply to a request, or None when none came within ``timeout``; KernelLost as soon as the kernel
        dies (noticed within DEATH_POLL, never at the timeout)."""
        reply, deadline = self.reply(msg_id), time.monotonic() + timeout
        while not reply.done():
            if not self.alive:
                raise KernelLost(f"the kernel {self.label} {self.exit_reason(self.exit_code)}")
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            await asyncio.wait({reply}, timeout=min(DEATH_POLL, left))
        return reply.result()

    async def run_silently(self, code: str, timeout: float, grace: float = 0.0) -> dict | None:
        """Execute code that leaves no history, execution count or record; its reply's content, or None
        when it did not finish in time (it is then interrupted). KernelLost when the kernel died meanwhile,
        or (given a ``grace``) did not end the code within it once interrupted."""
        content = {"code": code, "silent": True, "store_history": False, "user_expressions": {},
                   "allow_stdin": False, "stop_on_error": False}
        msg_id = await self.send("shell", "execute_request", content)
        reply = await self.await_reply(msg_id, timeout)
        if reply is not None:
            return reply.content
        self.interrupt()
        if grace and await self.await_reply(msg_id, grace) is None:
            raise KernelLost(f"the kernel {self.label} hung: it did not finish within {timeout:.0f} s, nor "
                             f"{grace:.0f} s after an interrupt")
        return None

    @property
    def has_subshells(self) -> bool:
        """Whether it runs requests on subshells beside the main shell (JEP 91), as ipykernel 7 does."""
        return SUBSHELL_FEATURE in (self.info.get("supported_features") or [])

    async def open_subshell(self) -> str | None:
        """Its subshell for namespace requests, created on first use (create_subshell_request on the control
        channel); None when it could not be created."""
        if self.subshell is None:
            self.subshell = asyncio.ensure_future(self._create_subshell())
        return await asyncio.shield(self.subshell)

    async def _create_subshell(self) -> str | None:
        msg_id = await self.send("control", "create_subshell_request", {})
        try:
            reply = await asyncio.wait_for(self.reply(msg_id), SUBSHELL_TIMEOUT)
        except asyncio.TimeoutError:
            self.replies.pop(msg_id, None)
            return None
        subshell = reply.content.get("subshell_id")
        return subshell if reply.content.get("status") == "ok" and isinstance(subshell, str) else None

    async def ask_namespace(self, request: dict, subshell: str | None,
                            timeout: float = NAMESPACE_TIMEOUT) -> dict | None:
        """The kernel side's answer to a namespace request (see NAMESPACE_REQUEST), from the subshell given or
        the main shell: {} from a kernel side without it, None when none came within ``timeout``."""
        content = {"code": NAMESPACE_REQUEST + json.dumps(request), "cursor_pos": 0, "detail_level": 0}
        msg_id = await self.send("shell", "inspect_request", content, subshell)
        try:
            reply = await asyncio.wait_for(self.reply(msg_id), timeout)
        except asyncio.TimeoutError:
            self.replies.pop(msg_id, None)
            return None
        answer = (reply.content.get("data") or {}).get(NAMESPACE_MIME)
        return answer if isinstance(answer, dict) else {}

    async def bootstrap(self, count: int | None, **identity: str | None) -> None:
        """Install the kernel side, with this kernel's identity; ``count`` (unless None) is the number its
        next cell has."""
        code = KERNEL_BOOTSTRAP.format(source=read_kernel_side_source(), identity=identity, count=count)
        reply = await self.run_silently(code, BOOTSTRAP_TIMEOUT)
        if reply is None:
            raise KernelError(f"the kernel did not run its loommux bootstrap within "
                              f"{BOOTSTRAP_TIMEOUT:.0f} s")
        if reply.get("status") != "ok":
            raise KernelError(f"the loommux bootstrap failed in the kernel: {reply.get('ename')}: "
                              f"{reply.get('evalue')}")

    async def run_user_file(self, path: Path, code: str, timeout: float) -> str | None:
        """Run a trusted file of the user's in the kernel by ``code`` (STARTUP_CODE: in its namespace;
        INSPECTORS_CODE: the cell inspectors). Its text is sent, since the kernel may be remote. None when it
        ran, else why it failed, with the first lines of its traceback; KernelLost when the kernel died
        running it, or hung past an interrupt."""
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, ValueError) as exc:
            return f"cannot read it: {exc}"
        reply = await self.run_silently(code.format(source=source, path=str(path)), timeout,
                                        USER_FILE_INTERRUPT_GRACE)
        if reply is None:
            return f"it did not finish within {timeout:.0f} s and was interrupted"
        if reply.get("status") == "ok":
            return None
        trace = [strip_escapes(str(line))[0] for line in reply.get("traceback") or []]
        lines = [line for line in "\n".join(trace).splitlines() if line.strip() and set(line) != {"-"}]
        # from the file's frame
        lines = lines[next((i for i, line in enumerate(lines) if line.lstrip().startswith(f"File {path}")),
                           0) :]
        first = "".join(f"\n  {clip(line, NOTICE_LINE_CHARS)}" for line in lines[:STARTUP_TRACEBACK_LINES])
        return f"{reply.get('ename')}: {reply.get('evalue')}{first}"

    async def execute(self, code: str, allow_stdin: bool = False) -> str:
        """Send a cell; with ``allow_stdin`` its input() asks us (on stdin) instead of failing at once."""
        content = {"code": code, "silent": False, "store_history": True, "user_expressions": {},
                   "allow_stdin": allow_stdin, "stop_on_error": False}
        msg_id = await self.send("shell", "execute_request", content)
        self.replies.pop(msg_id, None)  # execute replies are routed by the resource
        return msg_id

    async def answer_input(self, value: str) -> None:
        """Answer the cell waiting in input() (INPUT_EOF makes it raise EOFError); nothing replies to this."""
        msg_id = await self.send("stdin", "input_reply", {"value": value})
        self.replies.pop(msg_id, None)


# -- Kernels launched here, over ZeroMQ channels (which the attached kernels below use too)


def make_zmq_url(connection: dict, port: int | str) -> str:
    """A kernel socket's ZeroMQ address, from its connection info: ``tcp://ip:port``; or, with the ipc
    transport, ``ipc://ip-port`` (ip is then a path, and each channel's socket file that path and its port,
    as jupyter_client names them)."""
    ip = connection["ip"]
    return f"ipc://{ip}-{port}" if connection.get("transport", "tcp") == "ipc" else f"tcp://{ip}:{port}"


class ZmqChannels:
    """A kernel's ZeroMQ channels, from its connection info, for a kernel launched here or attached: shell,
    control and stdin, and an IOPub subscription that never drops output. The kernel's wire session signs
    what is sent and verifies what arrives, which goes to the kernel's dispatch; a sent request's reply is
    expected before it can arrive. The heartbeat is no channel of theirs (see answers_heartbeat)."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.sockets: dict[str, zmq.asyncio.Socket] = {}
        self.readers: list[asyncio.Task] = []
        self.monitor: zmq.asyncio.Socket | None = None

    def connect(self, connection: dict, backlog: int = 0) -> None:
        """Connect the channels; ``backlog``: how many IOPub messages may wait in this process (0: any)."""
        context = get_zmq_context()
        import zmq

        # The kernel sends a cell's input_request to the peer of its shell request: stdin shares its identity.
        identity = uuid.uuid4().hex.encode()
        for channel, kind in (("shell", zmq.DEALER), ("control", zmq.DEALER), ("stdin", zmq.DEALER),
                              ("iopub", zmq.SUB)):
            sock = context.socket(kind)
            sock.setsockopt(zmq.LINGER, 0)
            if channel in ("shell", "stdin"):
                sock.setsockopt(zmq.IDENTITY, identity)
            sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_INTERVAL_MS)  # connect soon after the kernel binds
            if kind == zmq.SUB:
                sock.setsockopt(zmq.RCVHWM, backlog)
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(make_zmq_url(connection, connection[f"{channel}_port"]))
            self.sockets[channel] = sock
            self.readers.append(asyncio.create_task(self._receive(channel, sock)))

    def watch_disconnect(self) -> zmq.asyncio.Socket:
        """A socket that receives a message once the shell channel's link closes."""
        import zmq

        self.monitor = self.sockets["shell"].get_monitor_socket(zmq.EVENT_DISCONNECTED)
        return self.monitor

    async def _receive(self, channel: str, sock: zmq.asyncio.Socket) -> None:
        """Read what arrives, a batch at a time: what has arrived already is read without the event loop (its
        per-message cost would be half of ours under a flood of output), then other tasks run."""
        import zmq

        arrived = zmq.Socket.shadow(sock.underlying)
        parse, dispatch = self.kernel.session.parse, self.kernel.dispatch  # its session is one for life
        while True:
            frames, handled = await sock.recv_multipart(), 0
            while True:  # each message handled before the next is read: one held at a time
                message = parse(frames)
                if message is not None:
                    dispatch(channel, message)
                elif DELIMITER in frames:  # else the subscription welcome of an old XPUB
                    log(f"dropped a {channel} message whose signature did not verify")
                handled += 1
                if handled % RECEIVE_BATCH == 0:
                    await asyncio.sleep(0)  # a receive that finds a message waiting does not yield
                try:
                    frames = arrived.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break

    async def send(self, channel: str, msg_type: str, content: dict, subshell: str | None = None) -> str:
        msg_id, frames = self.kernel.session.build(msg_type, content, subshell)
        self.kernel.expect_reply(msg_id)
        await self.sockets[channel].send_multipart(frames)
        return msg_id

    def request_interrupt(self) -> None:
        """An interrupt_request on the control channel (nothing waits for its reply)."""
        if "control" in self.sockets:
            asyncio.ensure_future(self.send("control", "interrupt_request", {}))

    async def request_shutdown(self) -> None:
        """A shutdown_request on the control channel; a channel that cannot send it is let be."""
        if "control" in self.sockets:
            import zmq

            with contextlib.suppress(zmq.ZMQError):
                await self.send("control", "shutdown_request", {"restart": False})

    def close(self) -> None:
        if self.monitor is not None:
            with contextlib.suppress(Exception):
                self.sockets["shell"].disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None
        for task in self.readers:
            task.cancel()
        for sock in self.sockets.values():
            sock.close(linger=0)
        self.sockets.clear()


class LaunchedKernel(Kernel):
    """One ipykernel process (or an installed kernelspec's) that loommux launched, in its own session and
    private directory, behind the launcher: ours to interrupt, kill and shut down with every process its
    cells started."""

    def __init__(self, workspace: Path, environ: dict[str, str], spec: KernelSpec | None = None) -> None:
        super().__init__(WireSession(secrets.token_hex(32).encode()))
        self.workspace = workspace
        self.environ = environ
        self.spec = spec  # None: this interpreter's ipykernel
        self.marker = secrets.token_hex(16)  # the marker its processes carry in KERNEL_INSTANCE_ENV
        self.proc: asyncio.subprocess.Process | None = None  # the launcher (on Linux the kernel's parent)
        self.kernel_pid: int | None = None
        self.dir: Path | None = None
        self.channels = ZmqChannels(self)
        self.killed = False  # by kill(): never asked to shut down

    @property
    def pid(self) -> int | None:
        """The ipykernel process, the cells' os.getpid() (the launcher's until the kernel is ready)."""
        return self.kernel_pid or (self.proc.pid if self.proc else None)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def exit_code(self) -> int | None:
        return self.proc.returncode if self.proc else None

    def exit_reason(self, code: int | None) -> str:
        reason = f"exited with code {code}"
        if code is not None and code < 0 and -code in signal.valid_signals():
            reason += f" ({signal.Signals(-code).name})"
        return reason

    async def start(self, timeout: float = KERNEL_START_TIMEOUT) -> None:
        """Launch the kernel and return once it answers and its IOPub is proven live."""
        self.dir = Path(tempfile.mkdtemp(prefix=KERNEL_DIR_PREFIX))
        owner = f"{os.getpid()} {read_process_start_time(os.getpid())} {self.marker}"
        (self.dir / KERNEL_OWNER_FILE).write_text(owner)
        try:
            await asyncio.wait_for(self._launch(), timeout)
        except asyncio.TimeoutError:
            await self.stop(grace=0)
            raise KernelError(f"the kernel did not become ready within {timeout:.0f} s"
                              f"{self._log_tail()}") from None
        except BaseException:  # a kernel that failed to start, or whose start was cancelled: nothing to keep
            await self.stop(grace=0)
            raise

    async def _launch(self) -> None:
        assert self.dir is not None
        connection = self._write_connection_file()
        await self._spawn()
        if connection["transport"] == "tcp" and self.spec is None:
            connection = await self._await_bound_ports()
        self.channels.connect(connection, IOPUB_BACKLOG if self.spec is None else 0)
        await self.await_ready(self._check_alive)
        try:
            self.kernel_pid = int((self.dir / KERNEL_PID_FILE).read_text())
        except (OSError, ValueError):
            raise KernelError("the kernel launcher recorded no kernel pid") from None

    def _write_connection_file(self) -> dict:
        """The kernel's connection info, written to its file: ipc sockets in its directory where libzmq has
        them (POSIX) and the kernel is this interpreter's ipykernel (IRkernel has none), else tcp ports on
        127.0.0.1 that ipykernel picks itself (0) or, for a kernelspec, free ones picked here."""
        assert self.dir is not None
        use_ipc = os.name == "posix" and self.spec is None
        ports = dict(zip((f"{c}_port" for c in CHANNELS), range(1, 6))) if use_ipc else {}
        if self.spec is not None:
            ports = {f"{c}_port": port for c, port in zip(CHANNELS, free_ports(len(CHANNELS)))}
        connection = {
            "transport": "ipc" if use_ipc else "tcp",
            "ip": str(self.dir / "k") if use_ipc else "127.0.0.1",
            "key": self.session.key.decode(),
            "signature_scheme": "hmac-sha256",
            "kernel_name": "loommux",
            **(ports or {f"{c}_port": 0 for c in CHANNELS}),
        }
        self.connection_file = self.dir / "kernel.json"
        self.connection_file.write_text(json.dumps(connection))
        self.connection_file.chmod(0o600)
        return connection

    async def _spawn(self) -> None:
        """Start the launcher in the workspace, its own session, with the kernel's private IPython profile
        and its output in the kernel's log."""
        assert self.dir is not None and self.connection_file is not None
        ipython_dir = self.dir / "ipython"
        (ipython_dir / "profile_default").mkdir(parents=True)
        (ipython_dir / "profile_default" / "ipython_kernel_config.py").write_text(KERNEL_CONFIG)
        (self.dir / KERNEL_LAUNCHER_FILE).write_text(KERNEL_LAUNCHER, encoding="utf-8")
        env = dict(
            self.environ,
            **(self.spec.launch_env(self.connection_file) if self.spec else {}),
            JPY_PARENT_PID=str(os.getpid()),
            IPYTHONDIR=str(ipython_dir),
            JUPYTER_RUNTIME_DIR=str(self.dir / "runtime"),
            PYDEVD_DISABLE_FILE_VALIDATION="1",
            **{KERNEL_INSTANCE_ENV: self.marker, KERNEL_DIR_ENV: str(self.dir)},
        )
        kernel_log = os.open(self.dir / "kernel.log", os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", KERNEL_LOADER, KERNEL_LAUNCHER_NAME, "-f", str(self.connection_file),
                cwd=self.workspace, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=kernel_log, stderr=kernel_log, start_new_session=True,
            )
        finally:
            os.close(kernel_log)
        _live_kernels.add(self)
        self.tasks.append(asyncio.create_task(self._watch_exit()))

    async def _await_bound_ports(self) -> dict:
        """With tcp, ipykernel picks free ports itself and writes them back into the file."""
        assert self.connection_file is not None
        while True:
            self._check_alive()
            try:
                connection = json.loads(self.connection_file.read_text())
                if all(connection.get(f"{c}_port") for c in CHANNELS):
                    return connection
            except ValueError:
                pass  # the kernel is rewriting the file
            await asyncio.sleep(0.02)

    def _check_alive(self) -> None:
        if not self.alive:
            raise KernelError(f"the kernel exited with code {self.exit_code} while starting"
                              f"{self._log_tail()}")

    def _log_tail(self, lines: int = 15) -> str:
        try:
            tail = (self.dir / "kernel.log").read_text(errors="replace").strip().splitlines()[-lines:]
        except (OSError, TypeError):
            return ""
        return ("; kernel log:\n  " + "\n  ".join(tail)) if tail else ""

    async def _watch_exit(self) -> None:
        assert self.proc is not None
        code = await self.proc.wait()
        _live_kernels.discard(self)
        if not self.retiring and self.on_exit:
            self.on_exit(self, code)

    async def send(self, channel: str, msg_type: str, content: dict, subshell: str | None = None) -> str:
        return await self.channels.send(channel, msg_type, content, subshell)

    def interrupt(self) -> None:
        """SIGINT to the kernel's process group, as Jupyter's signal interrupt mode does (or, for a kernelspec
        whose interrupt_mode is message, an interrupt_request on the control channel)."""
        if not self.alive:
            return
        if self.spec is not None and self.spec.interrupt_mode == "message":
            self.channels.request_interrupt()
        else:
            kill_quietly(self.proc.pid, signal.SIGINT, group=True)

    def kill(self) -> None:
        """SIGKILL the kernel now, never asking it to shut down: its launcher then kills what the cells
        started and exits (before the kernel is ready, its pid unknown, the launcher's process group is
        killed instead). stop() still follows, to wait for the launcher and clean up."""
        self.retiring = self.killed = True
        if self.alive:
            kill_quietly(self.kernel_pid or self.proc.pid, signal.SIGKILL, group=self.kernel_pid is None)

    async def _stop(self, grace: float) -> None:
        """Shut the kernel down with every process it started, then remove its private directory; with no
        grace the kernel is killed at once."""
        if self.proc is not None:
            await self._end_processes(grace)
        self._cancel_tasks()
        self.channels.close()
        _live_kernels.discard(self)
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)

    async def _end_processes(self, grace: float) -> None:
        """Ask the kernel to shut down (unless killed), wait for its launcher, then SIGKILL whatever of its
        tree and its marker is left."""
        assert self.proc is not None
        descendants = list_descendants(self.proc.pid) if self.alive else []
        if grace == 0:
            self.kill()
        elif self.alive and not self.killed:
            await self.channels.request_shutdown()
        await self._await_launcher(grace)
        kill_quietly(self.proc.pid, signal.SIGKILL, group=True)  # what a cell left behind
        for pid in descendants:
            kill_quietly(pid, signal.SIGKILL)
        await asyncio.to_thread(kill_marked_processes, self.marker)

    async def _await_launcher(self, grace: float) -> None:
        """Wait for the launcher to exit: the grace, then after SIGTERM to its group, then after SIGKILL; a
        killed kernel's launcher is only cleaning up."""
        assert self.proc is not None
        steps = ((None, TERM_GRACE),) if self.killed else ((None, grace), (signal.SIGTERM, TERM_GRACE))
        for sig, wait in (*steps, (signal.SIGKILL, None)):
            if not self.alive:
                break
            if sig is not None:
                kill_quietly(self.proc.pid, sig, group=True)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), wait)


def kill_live_kernels() -> None:
    """At a signal: kill every local kernel at once, whatever the server is doing (an MCP host gives a stdio
    server 100 ms to go before SIGTERM); the shutdown that follows finds them dying, waits and cleans up."""
    for kernel in list(_live_kernels):
        kernel.kill()


@atexit.register
def _kill_leftover_kernels() -> None:
    """A last resort when the server exits without shutting its kernels down."""
    for kernel in list(_live_kernels):
        if kernel.proc is not None:
            kill_quietly(kernel.proc.pid, signal.SIGKILL, group=True)
            kill_marked_processes(kernel.marker)
        if kernel.dir is not None:
            shutil.rmtree(kernel.dir, ignore_errors=True)


# -- kernels loommux does not own (a Jupyter connection file, as ``jupyter console --existing`` takes it),
# and installed kernelspecs (found in the Jupyter path, started by the launcher above)

ATTACH_TIMEOUT = 5.0  # a connection file's kernel must answer its heartbeat, then signed requests, by then
HEARTBEAT_PING = b"loommux"
RECONNECT_POLL = 0.5  # how often a lost kernel's connection file is tried again
CONNECTION_FIELDS = ("ip", "key", *(f"{c}_port" for c in CHANNELS))
CONNECTION_TRANSPORTS = ("tcp", "ipc")
JOIN_COMMAND = "jupyter console --existing {path}"
INTERRUPT_MODES = ("signal", "message")
KERNELSPEC_FILE = "kernel.json"


def find_connection_file(value: str, runtime_dir: Path) -> Path:
    """A connection file as ``jupyter console --existing`` finds it: a path; else a name or a glob
    (``kernel-12*``; a bare fragment matches any name containing it) in the runtime directory, the newest
    match winning."""
    path = Path(value).expanduser()
    if path.exists() or os.sep in value:
        return path
    if (runtime_dir / value).exists():
        return runtime_dir / value
    pattern = value if any(c in value for c in "*?[") else f"*{value}*"
    matches = []
    for match in runtime_dir.glob(pattern):
        with contextlib.suppress(OSError):
            matches.append((match.stat().st_mtime, match))
    return max(matches)[1] if matches else runtime_dir / value


def read_connection_file(value: str, runtime_dir: Path) -> tuple[Path, dict]:
    """The file and what it says; KernelError with one line naming the file and what is wrong with it (never
    its key)."""
    path = find_connection_file(value, runtime_dir)
    try:
        info = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise KernelError(f"{path}: no such connection file (names are looked up in {runtime_dir})") from None
    except OSError as exc:
        raise KernelError(f"{path}: cannot read the connection file: {exc.strerror or exc}") from None
    except ValueError:
        raise KernelError(f"{path}: the connection file is not JSON") from None
    if not isinstance(info, dict):
        raise KernelError(f"{path}: the connection file is not a JSON object")
    missing = [name for name in CONNECTION_FIELDS if name not in info]
    if missing:
        raise KernelError(f"{path}: the connection file has no {', '.join(missing)}")
    scheme = info.get("signature_scheme", "hmac-sha256")
    digest = scheme[5:] if isinstance(scheme, str) and scheme.startswith("hmac-") else None
    if digest not in hashlib.algorithms_guaranteed:
        raise KernelError(f"{path}: unknown signature_scheme {str(scheme)[:40]!r} (loommux signs with "
                          "hmac-sha256 and the other hmac-<hashlib digest> schemes)")
    if info.get("transport", "tcp") not in CONNECTION_TRANSPORTS or not isinstance(info["key"], str):
        raise KernelError(f"{path}: the connection file's transport or key is not valid")
    return path.resolve(), info


def free_ports(count: int) -> list[int]:
    """Ports free on 127.0.0.1 now (held together, so that they differ), for a kernel to bind."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class AttachedKernel(Kernel):
    """A kernel a person (JupyterLab, ``jupyter kernel``, a KernelManager) started and loommux only joins:
    its channels, from its connection file. Not loommux's: stopping it closes our sockets only, and it is
    interrupted over its control channel (its process may be another machine's). Its death is seen when its
    channels close; loommux then polls the same connection file and joins the kernel answering there again
    (its owner restarted it)."""

    owned = False

    def __init__(self, value: str, runtime_dir: Path) -> None:
        super().__init__(WireSession(b""))  # keyed with the connection file's key once it is read
        self.value, self.runtime_dir = value, runtime_dir
        self.channels = ZmqChannels(self)
        self.connected = False
        self.lost_reason = "its channels closed"

    @property
    def alive(self) -> bool:
        return self.connected

    @property
    def label(self) -> str:
        return f"at {self.connection_file or self.value}"

    def exit_reason(self, code: int | None) -> str:
        return self.lost_reason

    async def start(self, timeout: float | None = ATTACH_TIMEOUT) -> None:
        """Join the kernel: once it answers its heartbeat, then a signed kernel_info_request. With no timeout
        (after a loss), the connection file is tried again until a kernel answers there."""
        try:
            while not await self._try_join(timeout):
                await asyncio.sleep(RECONNECT_POLL)
        except BaseException:
            await self.stop()
            raise

    async def _try_join(self, timeout: float | None) -> bool:
        try:
            path, info = read_connection_file(self.value, self.runtime_dir)
        except KernelError:
            if timeout is not None:
                raise
            return False
        self.connection_file = path
        self.session.use_key(info["key"].encode(), info.get("signature_scheme", "hmac-sha256")[5:])
        where = (make_zmq_url(info, "*") if info.get("transport") == "ipc"
                 else f"{info['ip']} ports {info['shell_port']}-{info['hb_port']}")
        if not await answers_heartbeat(info, timeout or RECONNECT_POLL * 2):
            if timeout is not None:
                raise KernelError(f"{path}: no kernel answers at {where} (no heartbeat within {timeout:g} s)")
            return False
        self.channels.connect(info)
        monitor = self.channels.watch_disconnect()
        try:
            await asyncio.wait_for(self.await_ready(lambda: None), timeout)
        except asyncio.TimeoutError:
            raise KernelError(f"{path}: the kernel answers its heartbeat but no signed request within "
                              f"{timeout:g} s (a wrong key?)") from None
        self.connected = True
        self.tasks.append(asyncio.create_task(self._watch_channels(monitor)))
        return True

    async def _watch_channels(self, monitor: zmq.asyncio.Socket) -> None:
        await monitor.recv_multipart()  # the shell channel's link closed: the kernel stopped or restarts
        self.connected = False
        self.lost_reason = "stopped: its channels closed (its owner stopped or is restarting it)"
        if not self.retiring and self.on_exit:
            self.on_exit(self, None)

    async def send(self, channel: str, msg_type: str, content: dict, subshell: str | None = None) -> str:
        return await self.channels.send(channel, msg_type, content, subshell)

    def interrupt(self) -> None:
        if self.alive:
            self.channels.request_interrupt()  # its process may be another machine's: the control channel

    async def _stop(self, grace: float) -> None:
        """Leave the kernel running: close our sockets only."""
        self._cancel_tasks()
        self.channels.close()


async def answers_heartbeat(connection: dict, wait: float) -> bool:
    """Whether the kernel echoes a heartbeat ping within the wait (a plain echo, unsigned)."""
    import zmq

    sock = get_zmq_context().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(make_zmq_url(connection, connection["hb_port"]))
        await sock.send(HEARTBEAT_PING)
        return bool(await sock.poll(wait * 1000)) and await sock.recv() == HEARTBEAT_PING
    except zmq.ZMQError:
        return False
    finally:
        sock.close(linger=0)


@dataclass
class KernelSpec:
    """An installed Jupyter kernelspec (``<jupyter path>/kernels/<name>/kernel.json``)."""

    name: str
    argv: list[str]
    env: dict[str, str]
    interrupt_mode: str
    language: str
    resource_dir: Path

    def launch_env(self, connection_file: Path) -> dict[str, str]:
        """What the launcher needs to run its argv, and its env, filled in as jupyter_client fills them."""
        def fill(text: str) -> str:
            return text.replace("{connection_file}", str(connection_file)).replace("{resource_dir}",
                                                                                   str(self.resource_dir))
        argv = [fill(word) for word in self.argv]
        if argv[0] in ("python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info)):
            argv[0] = sys.executable  # as jupyter_client does: "python" is the interpreter running this
        return {**{name: fill(value) for name, value in self.env.items()}, KERNEL_ARGV_ENV: json.dumps(argv)}


def list_installed_kernelspecs(jupyter_path: list[Path]) -> dict[str, Path]:
    """Every kernelspec's directory by name; the Jupyter path's first directory wins, as in jupyter_client."""
    found: dict[str, Path] = {}
    for base in jupyter_path:
        with contextlib.suppress(OSError):
            for entry in sorted((base / "kernels").iterdir()):
                if (entry / KERNELSPEC_FILE).is_file():
                    found.setdefault(entry.name.lower(), entry)
    return found


def find_kernelspec(name: str, jupyter_path: list[Path]) -> KernelSpec:
    """The installed kernelspec of that name; KernelError listing the installed ones when there is none."""
    installed = list_installed_kernelspecs(jupyter_path)
    where = installed.get(name.lower())
    if where is None:
        listed = ", ".join(sorted(installed)) or "none"
        raise KernelError(f"no kernelspec {name!r} is installed; installed: {listed} "
                          f"(looked in {', '.join(str(p / 'kernels') for p in jupyter_path)})")
    try:
        spec = json.loads((where / KERNELSPEC_FILE).read_bytes())
        argv, env = spec["argv"], spec.get("env") or {}
        words = isinstance(argv, list) and argv and all(isinstance(word, str) for word in argv)
        if not (words and isinstance(env, dict)):
            raise ValueError("argv must be a list of strings, env an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KernelError(f"{where / KERNELSPEC_FILE}: not a valid kernelspec: {exc}") from None
    mode = spec.get("interrupt_mode", "signal")
    return KernelSpec(where.name, argv, {str(k): str(v) for k, v in env.items()},
                      mode if mode in INTERRUPT_MODES else "signal", str(spec.get("language", "")), where)


@dataclass
class KernelSource:
    """Where a resource's kernels come from when not the pool's default: an installed kernelspec, or a kernel
    a person has open (a connection file, as given, and the runtime directory its name is looked up in)."""

    spec: KernelSpec | None = None
    existing: str | None = None
    runtime_dir: Path = field(default_factory=Path.cwd)

    @property
    def kernel_class(self) -> type[LaunchedKernel | AttachedKernel]:
        """A person's kernel when a connection file is given, else one launched here."""
        return LaunchedKernel if self.existing is None else AttachedKernel

    @property
    def owned(self) -> bool:
        """Whether loommux may stop and restart its kernels: as their class says."""
        return self.kernel_class.owned

    async def start(self, workspace: Path, environ: dict[str, str], rejoin: bool = False) -> Kernel:
        """A started kernel (``rejoin``: a lost attached kernel, waited for however long it takes)."""
        if self.existing is not None:
            attached = AttachedKernel(self.existing, self.runtime_dir)
            await attached.start(None if rejoin else ATTACH_TIMEOUT)
            return attached
        launched = LaunchedKernel(workspace, environ, self.spec)
        await launched.start()
        return launched


# -- Jupyter gateway: kernels that Jupyter Kernel Gateway or Enterprise Gateway runs, started over REST
# (http.client, on threads) and spoken to over a WebSocket carrying the Jupyter messages as JSON (RFC 6455,
# which the standard library lacks: written here on asyncio streams)

GATEWAY_REQUEST_TIMEOUT = 30.0  # any REST call but a kernel start
GATEWAY_START_TIMEOUT = 120.0  # Enterprise Gateway may first have to schedule a pod for the kernel
GATEWAY_POLL_INTERVAL = 2.0  # how often a kernel's presence on the gateway is checked, idle or not
GATEWAY_DELETE_TIMEOUT = 15.0  # for deleting a kernel, retries included
GATEWAY_DELETE_RETRY = 0.5  # a gateway still restarting a kernel answers DELETE with 500 for a moment
MAX_GATEWAY_HEAD = 64 << 10
MAX_GATEWAY_BODY = 16 << 20  # a REST answer larger than this is refused
MAX_WS_MESSAGE = 1 << 30  # one (reassembled) WebSocket message larger than this ends the channel
WS_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
WS_CONTINUATION, WS_TEXT, WS_BINARY, WS_CLOSE, WS_PING, WS_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
# The gateway's own notice, on the cell's stderr, that it dropped output (jupyter_server's IOPub rate limit).
RATE_LIMIT_NOTICES = ("IOPub data rate exceeded.", "IOPub message rate exceeded.")
OUTPUT_DROPPED_MSG_TYPE = "loommux_output_dropped"  # what such a notice is handed on as
OUTPUT_DROPPED = "output dropped by the gateway's IOPub rate limit"
GATEWAY_DEATHS = {  # IOPub status states the gateway itself sends about a kernel
    "dead": "died and the gateway could not restart it",
    "restarting": "died (the gateway is restarting it)",
}


class GatewayError(KernelError):
    """The gateway cannot be reached or refused a request; said with its status and message."""


class WebSocketError(Exception):
    pass


@dataclass
class Gateway:
    """Where remote kernels run: a Jupyter Kernel Gateway or Enterprise Gateway base URL."""

    url: str
    token: str | None = None
    kernel_name: str = "python3"
    ca_file: Path | None = None
    environ: dict[str, str] = field(default_factory=dict)  # sent with each new kernel (KERNEL_* variables)

    @property
    def host(self) -> str:
        """host:port, as status shows it (never credentials written into the URL)."""
        parts = urllib.parse.urlsplit(self.url)
        host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname
        return f"{host}:{parts.port}" if parts.port else str(host)

    @property
    def shown_url(self) -> str:
        """The URL as messages quote it: never credentials written into it."""
        parts = urllib.parse.urlsplit(self.url)
        return urllib.parse.urlunsplit((parts.scheme, self.host, parts.path, "", ""))

    @cached_property
    def tls(self) -> ssl.SSLContext | None:
        """Certificates are checked; a private CA may be named (LOOMMUX_GATEWAY_CA_FILE)."""
        if not self.url.startswith("https://"):
            return None
        return ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)

    @property
    def address(self) -> tuple[str, int]:
        """Host and port, the port always given (so that a bare IPv6 address is never split at a colon)."""
        parts = urllib.parse.urlsplit(self.url)
        return str(parts.hostname), parts.port or (443 if self.tls else 80)

    def _make_target(self, path: str) -> str:
        return urllib.parse.urlsplit(self.url).path.rstrip("/") + path

    def _add_token(self, headers: dict[str, str]) -> dict[str, str]:
        return {**headers, "Authorization": f"token {self.token}"} if self.token else headers

    def make_refusal(self, method: str, path: str, status: int, body: Any) -> GatewayError:
        """The gateway's status and message, as kernel_unavailable says them."""
        message = (body.get("message") or body.get("reason")) if isinstance(body, dict) else body
        try:
            phrase = f" {HTTPStatus(status).phrase}"
        except ValueError:
            phrase = ""
        said = f": {clip(str(message).strip(), NOTICE_LINE_CHARS)}" if message else ""
        return GatewayError(f"the gateway at {self.shown_url} answered {method} {path} with "
                            f"{status}{phrase}{said}")

    async def request(self, method: str, path: str, body: dict | None = None,
                      timeout: float = GATEWAY_REQUEST_TIMEOUT) -> tuple[int, Any]:
        """One REST call on its own connection: the status and the JSON answer (or its text)."""
        try:
            exchange = run_in_thread(self._exchange, method, path, body, timeout)
            status, raw = await asyncio.wait_for(exchange, timeout)
        except (asyncio.TimeoutError, TimeoutError):  # ours, or the socket's
            raise GatewayError(f"the gateway at {self.shown_url} did not answer {method} {path} within "
                               f"{timeout:.0f} s") from None
        except (OSError, ValueError) as exc:
            raise GatewayError(f"cannot reach the gateway at {self.shown_url}: {exc}") from None
        except http.client.HTTPException as exc:  # a bad status line, a cut body...: quoted on one line
            raise GatewayError(f"cannot reach the gateway at {self.shown_url}: a broken HTTP answer "
                               f"({clip(repr(exc), NOTICE_LINE_CHARS)})") from None
        return status, decode_json_or_text(raw) if raw.strip() else None

    def _exchange(self, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, bytes]:
        """The blocking call, with http.client (whose Host header is host and port, never credentials)."""
        host, port = self.address
        conn = (http.client.HTTPSConnection(host, port, timeout=timeout, context=self.tls) if self.tls
                else http.client.HTTPConnection(host, port, timeout=timeout))
        headers = {"Connection": "close", "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, self._make_target(path), data, self._add_token(headers))
            answer = conn.getresponse()
            raw = answer.read(MAX_GATEWAY_BODY + 1)
        finally:
            conn.close()
        if len(raw) > MAX_GATEWAY_BODY:
            raise ValueError(f"an answer over {format_size(MAX_GATEWAY_BODY)}")
        return answer.status, raw

    async def open_websocket(self, path: str, timeout: float = GATEWAY_REQUEST_TIMEOUT) -> WebSocket:
        """Open a WebSocket (the upgrade handshake, its accept key checked)."""
        try:
            return await asyncio.wait_for(self._websocket(path), timeout)
        except asyncio.TimeoutError:
            raise GatewayError(f"the gateway at {self.shown_url} did not open {path} within "
                               f"{timeout:.0f} s") from None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as exc:
            raise GatewayError(f"cannot reach the gateway at {self.shown_url}: {exc}") from None

    async def _websocket(self, path: str) -> WebSocket:
        """The handshake is written here, on asyncio's streams: http.client's blocking socket, and its TLS,
        cannot be handed over to them for the frames."""
        key = base64.b64encode(secrets.token_bytes(16)).decode()
        upgrade = self._add_token({"Host": self.host, "Upgrade": "websocket", "Connection": "Upgrade",
                              "Sec-WebSocket-Key": key, "Sec-WebSocket-Version": "13"})
        head = "".join(f"{name}: {value}\r\n" for name, value in upgrade.items())
        reader, writer = await asyncio.open_connection(*self.address, ssl=self.tls, limit=MAX_GATEWAY_HEAD)
        try:
            writer.write(f"GET {self._make_target(path)} HTTP/1.1\r\n{head}\r\n".encode("latin-1"))
            status, headers = await read_response_head(reader)
            if status != 101:  # a refusal; its message is read when its length is said (Tornado says it)
                said = await reader.readexactly(min(int(headers.get("content-length", 0)), MAX_GATEWAY_BODY))
                raise self.make_refusal("GET", path.split("?", 1)[0], status, decode_json_or_text(said))
            accept = base64.b64encode(hashlib.sha1((key + WS_GUID).encode()).digest()).decode()
            if headers.get("sec-websocket-accept") != accept:
                raise GatewayError(f"the gateway at {self.shown_url} answered the WebSocket handshake with "
                                   "a wrong key")
        except BaseException:
            writer.close()
            raise
        return WebSocket(reader, writer)


async def run_in_thread(call: Callable[..., Any], *args: Any) -> Any:
    """call(*args) on a daemon thread of its own, for blocking I/O that a hung peer may hold up to its
    timeout: it then holds neither asyncio's shared executor (token counts, large answers) nor the exit."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(call(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
                future.set_exception(exc)

    threading.Thread(target=run, name="loommux-gateway", daemon=True).start()
    return await asyncio.wrap_future(future)


def decode_json_or_text(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


async def read_response_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status and the (lower-cased) headers of an HTTP/1.1 response."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    version, _, rest = head[0].partition(" ")
    if not version.startswith("HTTP/") or not rest[:3].isdigit():
        raise ValueError(f"not an HTTP response: {clip(head[0], 80)!r}")
    headers = {}
    for line in head[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    return int(rest[:3]), headers


def ack_quickly(sock: Any) -> None:
    """Acknowledge at once what arrives next (Linux). A gateway writes each message with Nagle's algorithm
    on: while our delayed ACK (40 ms) is pending, its next message waits, and every round trip pays it."""
    if sock is not None and hasattr(socket, "TCP_QUICKACK"):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)


def mask_payload(payload: bytes, key: bytes) -> bytes:
    """XOR with the repeated 4-byte key, as one big-integer operation (fast for large payloads)."""
    n = len(payload)
    if not n:
        return payload
    return (int.from_bytes(payload, "big")
            ^ int.from_bytes((key * (n // 4 + 1))[:n], "big")).to_bytes(n, "big")


class WebSocket:
    """The client end of an RFC 6455 connection: frames we send are masked, fragments are joined,
    pings answered, and a close is answered once."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.closed = False
        self.sock = writer.get_extra_info("socket")

    def _write(self, opcode: int, payload: bytes) -> None:
        n = len(payload)
        if n < 126:
            length = bytes([0x80 | n])
        elif n < 1 << 16:
            length = bytes([0x80 | 126]) + n.to_bytes(2, "big")
        else:
            length = bytes([0x80 | 127]) + n.to_bytes(8, "big")
        key = secrets.token_bytes(4)
        self.writer.write(bytes([0x80 | opcode]) + length + key + mask_payload(payload, key))

    async def send_text(self, text: str) -> None:
        if self.closed:
            raise WebSocketError("the WebSocket is closed")
        self._write(WS_TEXT, text.encode())
        await self.writer.drain()

    async def _read_frame(self) -> tuple[bool, int, bytes]:
        first, second = await self.reader.readexactly(2)
        n = second & 0x7F
        if n == 126:
            n = int.from_bytes(await self.reader.readexactly(2), "big")
        elif n == 127:
            n = int.from_bytes(await self.reader.readexactly(8), "big")
        if n > MAX_WS_MESSAGE:
            raise WebSocketError(f"a frame over {format_size(MAX_WS_MESSAGE)}")
        key = await self.reader.readexactly(4) if second & 0x80 else None  # servers do not mask, but may
        payload = await self.reader.readexactly(n)
        return bool(first & 0x80), first & 0x0F, mask_payload(payload, key) if key else payload

    async def receive(self) -> str | bytes | None:
        """The next text or binary message; None once the connection is closed."""
        parts: list[bytes] = []
        kind = None
        while not self.closed:
            try:
                ack_quickly(self.sock)
                fin, opcode, payload = await self._read_frame()
            except (OSError, asyncio.IncompleteReadError):
                self.closed = True
                break
            if opcode == WS_PING:
                self._write(WS_PONG, payload)
            elif opcode == WS_CLOSE:
                await self.close()
            elif opcode in (WS_TEXT, WS_BINARY, WS_CONTINUATION):  # a pong needs nothing
                if opcode != WS_CONTINUATION:
                    kind, parts = opcode, []
                parts.append(payload)
                if sum(map(len, parts)) > MAX_WS_MESSAGE:
                    raise WebSocketError(f"a message over {format_size(MAX_WS_MESSAGE)}")
                if fin:
                    data = b"".join(parts)
                    return data.decode() if kind == WS_TEXT else data
        return None

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError, RuntimeError):
                self._write(WS_CLOSE, (1000).to_bytes(2, "big"))
                await asyncio.wait_for(self.writer.drain(), 1.0)
        self.writer.close()


def decode_gateway_frame(raw: str | bytes) -> dict:
    """A channel message sent as JSON text, or in jupyter_server's binary form (buffer count, offsets, then
    the JSON message and its buffers, which loommux does not use)."""
    if isinstance(raw, bytes):
        count = int.from_bytes(raw[:4], "big")
        offsets = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(count)]
        raw = raw[offsets[0] : offsets[1] if count > 1 else None].decode()
    return json.loads(raw)


class GatewayKernel(Kernel):
    """A kernel the gateway runs: started with POST /api/kernels, spoken to over its channels WebSocket,
    interrupted and deleted over REST, and watched for death (a closed channel, a dead or restarting
    status, a shutdown someone else asked for, or its disappearance from the gateway)."""

    ident_kind = "id"

    def __init__(self, gateway: Gateway, remote_id: str | None = None) -> None:
        """``remote_id``: the gateway's kernel this one stands for: one that exists already (adopt, stop), or
        the id to create it with (start; the gateway may give it another)."""
        super().__init__(WireSession(b""))  # for its headers: the gateway signs what it passes on
        self.gateway = gateway
        self.remote_id = remote_id
        self.kernel_session: str | None = None  # the kernel's own header session, told from the gateway's
        self.ws: WebSocket | None = None
        self.death: str | None = None

    @property
    def alive(self) -> bool:
        return self.ws is not None and self.death is None

    @property
    def ident(self) -> str:
        return str(self.remote_id)

    def exit_reason(self, code: int | None) -> str:
        return self.death or "stopped"

    async def start(self, timeout: float = KERNEL_START_TIMEOUT) -> None:
        """Create the kernel on the gateway and return once it answers over its channels."""
        await self._open(timeout, create=True)

    async def adopt(self, remote_id: str, timeout: float = KERNEL_START_TIMEOUT) -> bool:
        """Join the gateway's kernel ``remote_id``, one this instance started before it restarted (its kernel
        side is installed), once it answers over its channels; False when the gateway no longer has it."""
        path = f"/api/kernels/{remote_id}"
        status, answer = await self.gateway.request("GET", path)
        if status == 404:
            return False
        if status >= 300 or not isinstance(answer, dict):
            raise self.gateway.make_refusal("GET", path, status, answer)
        self.remote_id = remote_id
        await self._open(timeout, create=False)
        return True

    async def _open(self, timeout: float, create: bool) -> None:
        try:
            if create:
                await self._create()
            await asyncio.wait_for(self._connect("shell" if create else "control"), timeout)
        except BaseException as exc:
            remote_id = self.remote_id
            if not create:  # a kept kernel a join failed to reach stays on the gateway: the next call retries
                self.remote_id = None
            await self.stop(grace=0)
            if isinstance(exc, asyncio.TimeoutError):
                raise KernelError(f"gateway kernel {remote_id} did not become ready within "
                                  f"{timeout:.0f} s") from None
            raise

    async def _create(self) -> None:
        body = {"name": self.gateway.kernel_name, "env": self.gateway.environ}
        if self.remote_id:  # jupyter_server's kernels API creates it with this id, or answers the one it has
            body["kernel_id"] = self.remote_id
        creating = asyncio.ensure_future(self.gateway.request("POST", "/api/kernels", body,
                                                              GATEWAY_START_TIMEOUT))
        try:
            status, answer = await asyncio.shield(creating)
        except asyncio.CancelledError:
            await asyncio.wait({creating})  # learn the id of the kernel being created: stop() then deletes it
            if not creating.exception() and isinstance(creating.result()[1], dict):
                self.remote_id = creating.result()[1].get("id")
            raise
        if status not in (200, 201) or not isinstance(answer, dict) or not isinstance(answer.get("id"), str):
            raise self.gateway.make_refusal("POST", f"/api/kernels (kernelspec {self.gateway.kernel_name})",
                                       status, answer)
        self.remote_id = answer["id"]

    async def _connect(self, channel: str) -> None:
        path = f"/api/kernels/{self.remote_id}/channels?session_id={self.session.session}"
        self.ws = await self.gateway.open_websocket(path)
        self.tasks += [asyncio.create_task(self._receive()), asyncio.create_task(self._watch_presence())]
        await self.await_ready(self._check_alive, channel)

    def _check_alive(self) -> None:
        if self.death:
            raise KernelError(f"gateway kernel {self.remote_id} {self.death} while starting")

    async def _receive(self) -> None:
        assert self.ws is not None
        try:
            while (raw := await self.ws.receive()) is not None:
                self._handle(raw)
        except WebSocketError as exc:
            log(f"gateway kernel {self.remote_id}: {exc}")
        self._died("lost its channel (the gateway closed it)")

    def _handle(self, raw: str | bytes) -> None:
        try:
            message = decode_gateway_frame(raw)
            header, parent, content = (message["header"], message.get("parent_header") or {},
                                       message["content"])
            channel, msg_type = message.get("channel", ""), header["msg_type"]
            if not isinstance(content, dict) or not isinstance(parent, dict):
                raise TypeError("content or parent_header is not an object")
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            log(f"gateway kernel {self.remote_id}: dropped a malformed message ({exc})")
            return
        own = header.get("session") == self.kernel_session
        if msg_type == "kernel_info_reply" and self.kernel_session is None:
            self.kernel_session = header.get("session")
        elif (channel == "iopub" and not own and msg_type == "status"
              and content.get("execution_state") in GATEWAY_DEATHS):
            self._died(GATEWAY_DEATHS[content["execution_state"]])
            return
        elif channel == "iopub" and msg_type == "shutdown_reply":
            # we delete kernels over REST, never ask this
            self._died("was shut down on the gateway")
        elif (channel == "iopub" and not own and self.kernel_session and msg_type == "stream"
              and str(content.get("text", "")).startswith(RATE_LIMIT_NOTICES)):
            log(f"gateway kernel {self.remote_id}: {OUTPUT_DROPPED}")
            msg_type = OUTPUT_DROPPED_MSG_TYPE
        self.dispatch(channel, Message(msg_type, str(header.get("msg_id", "")), parent.get("msg_id"), content,
                                       header, parent))

    async def _watch_presence(self) -> None:
        """A kernel deleted or culled on the gateway may leave its channel open for a while: ask."""
        while self.death is None:
            await asyncio.sleep(GATEWAY_POLL_INTERVAL)
            try:
                status, _ = await self.gateway.request("GET", f"/api/kernels/{self.remote_id}")
            except GatewayError:
                continue  # unreachable for now; a lost channel is noticed by the receiver
            if status == 404:
                self._died("vanished from the gateway")

    def _died(self, reason: str) -> None:
        if self.death is not None:
            return
        self.death = reason
        if not self.retiring and self.on_exit:
            self.on_exit(self, None)

    async def send(self, channel: str, msg_type: str, content: dict, subshell: str | None = None) -> str:
        header = self.session.header(msg_type, subshell)
        self.expect_reply(header["msg_id"])
        message = {"header": header, "parent_header": {}, "metadata": {}, "content": content,
                   "channel": channel, "buffers": []}
        if self.ws is not None and not self.ws.closed:
            with contextlib.suppress(OSError, WebSocketError):  # a lost channel is the receiver's to report
                await self.ws.send_text(json.dumps(message))
        return header["msg_id"]

    def interrupt(self) -> None:
        """POST …/interrupt: the gateway interrupts the kernel as its kernelspec says."""
        if self.alive:
            self.tasks.append(asyncio.ensure_future(self._interrupt()))

    async def _interrupt(self) -> None:
        path = f"/api/kernels/{self.remote_id}/interrupt"
        try:
            status, answer = await self.gateway.request("POST", path)
            if status >= 300:
                raise self.gateway.make_refusal("POST", path, status, answer)
        except GatewayError as exc:
            log(f"cannot interrupt gateway kernel {self.remote_id}: {exc}")

    async def _stop(self, grace: float) -> None:
        """Close the channel and delete the kernel (the gateway shuts it down); 404 means it is gone."""
        self._cancel_tasks()
        if self.ws is not None:
            await self.ws.close()
        if self.remote_id is None:
            return
        path = f"/api/kernels/{self.remote_id}"
        deadline = time.monotonic() + GATEWAY_DELETE_TIMEOUT
        while True:
            try:
                status, answer = await self.gateway.request("DELETE", path, timeout=GATEWAY_DELETE_TIMEOUT)
                if status < 300 or status == 404:
                    return
                problem = self.gateway.make_refusal("DELETE", path, status, answer)
                if status < 500:
                    break
            except GatewayError as exc:
                problem = exc
            if time.monotonic() + GATEWAY_DELETE_RETRY > deadline:
                break
            await asyncio.sleep(GATEWAY_DELETE_RETRY)
        log(f"cannot delete gateway kernel {self.remote_id}: {problem}")


# ---------------------------------------------------------------- Output files
# What cells print is kept on disk (see Log and LogFile), in a directory of the server's own: by default a
# private one under the system's temporary directory, or under --output-dir, removed when the server exits;
# with --state-dir, inside the state directory, kept for the next start. Each resource has a directory in it,
# removed when the resource is retired; execution N's combined output is N.txt, a file a person can follow
# with tail -f. A server killed with SIGKILL leaves its directory behind, locked no more: the next start
# removes it.
#
# Nothing there is loommux's but what it made: each directory it makes bears a mark (OUTPUT_MARK), and it
# removes only marked directories and, in them, the files it names; what a person put there stays. It opens
# nothing there through a symbolic link (O_NOFOLLOW, from the directory's descriptor), and keeps files only in
# directories of this user that no one else may write in (see describe_unsafe_directory).

OUTPUT_DIR_PREFIX = "loommux-output-"  # a server's own directory, in the temporary directory or --output-dir
OUTPUT_LOCK = ".lock"  # held by the server whose directory it is, for as long as it runs
OUTPUT_KEPT = "output"  # with --state-dir: the state directory's subdirectory for output
OUTPUT_MARK = ".loommux"  # in each directory loommux made for output: what it may remove bears it
OUTPUT_MARK_TEXT = b"made by loommux: it removes this directory, and the files it names in it, when done\n"
OUTPUT_DIR_MODE = 0o700
OTHERS_WRITE = 0o022  # the mode bits that let other users write in a directory
# The files loommux names in a resource's directory (see name_output_file, name_displays_file, OUTPUT_JOURNAL)
OWN_FILE_RE = re.compile(r"\d+(\.(stdout|stderr|result|traceback))?\.txt|\d+\.displays\.jsonl|"
                         r"executions\.jsonl")
DISPLAYS_FILE_RE = re.compile(r"\d+\.displays\.jsonl")
OUTPUT_JOURNAL = "executions.jsonl"  # a kept directory's record of its executions, one JSON line each
STORED_DISPLAY_CHARS = 1024  # a display's content bigger than this (as JSON) is kept in a file, not in memory


def name_displays_file(number: int) -> str:
    """Execution ``number``'s file of displays (images, HTML, ...): one JSON object per line."""
    return f"{number}.displays.jsonl"


@dataclass(frozen=True, slots=True)
class StoredDisplay:
    """A display's content (display_data, execute_result, ...) kept in its execution's file of displays:
    where, to read it back."""

    path: str
    offset: int
    size: int

    def load(self) -> Any:
        """The content; OutputUnreadable when the file no longer holds it (or holds something else there)."""
        try:
            return json.loads(LogFile(self.path).read(self.offset, self.size))
        except ValueError as exc:
            raise OutputUnreadable(f"{self.path} holds no display at {self.offset}: {exc}") from None

    def record(self) -> dict:
        """What a journal keeps of it: the file by its name alone (see OutputFiles.find_stored)."""
        return {"path": os.path.basename(self.path), "offset": self.offset, "size": self.size}


def describe_unsafe_directory(path: Path, shared: bool = False) -> str | None:
    """Why loommux must not keep files in a directory (said after its name), None when it may: a symbolic
    link, another user's, or one others may write in (as OpenSSH judges ~/.ssh). ``shared``: a directory
    loommux only makes a private directory of its own in (--output-dir): a link to one is fine, and so is a
    sticky one (as the system's temporary directory) whoever owns it."""
    try:
        found = os.stat(path) if shared else os.lstat(path)
    except OSError as exc:
        return f"cannot be checked ({exc.strerror or exc})"
    if S_ISLNK(found.st_mode):
        return "is a symbolic link"
    if not S_ISDIR(found.st_mode):
        return "is not a directory"
    if shared and found.st_mode & S_ISVTX:
        return None
    if found.st_uid != os.geteuid():
        return f"is owned by another user (uid {found.st_uid})"
    if found.st_mode & OTHERS_WRITE:
        sticky = " and has no sticky bit" if shared else ""
        return f"may be written by other users (mode {found.st_mode & 0o7777:o}){sticky}"
    return None


def open_in_directory(directory: str, name: str, flags: int) -> int:
    """A descriptor of a file in one of loommux's directories, opened from the directory's descriptor with no
    symbolic link followed (neither the directory nor the file); OSError for anything but a regular file."""
    at = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, LOG_FILE_MODE, dir_fd=at)
    finally:
        os.close(at)
    if not S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"{os.path.join(directory, name)} is not a regular file")
    return fd


def mark_directory(directory: str) -> None:
    """Mark a directory loommux made as its own (OSError when it cannot)."""
    fd = open_in_directory(directory, OUTPUT_MARK, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, OUTPUT_MARK_TEXT)
    finally:
        os.close(fd)


def list_unmarked_output(directory: str) -> list[str] | None:
    """The resource directories of an output directory an earlier loommux kept before it marked what it made
    (each holding only files named as loommux names them), to be marked now; None when it holds anything
    else."""
    found = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                return None
            with os.scandir(entry.path) as inner:
                items = list(inner)  # (one it made holds a file at least: it was made with the first)
            if not items or not all(item.is_file(follow_symlinks=False) and OWN_FILE_RE.fullmatch(item.name)
                                    for item in items):
                return None
            found.append(entry.path)
    return found


def is_marked(directory: str) -> bool:
    """Whether loommux made a directory (it bears the mark, a regular file)."""
    try:
        return S_ISREG(os.lstat(os.path.join(directory, OUTPUT_MARK)).st_mode)
    except OSError:
        return False


def remove_marked(directory: str) -> None:
    """Remove a directory loommux made: the files it names in it (the lock, output files) and its marked
    subdirectories, then it, when nothing else is left. What a person put there stays, and so do the
    directories holding it; a directory without the mark is left alone, and no symbolic link is followed."""
    try:
        at = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        if not is_marked(directory):
            return
        with os.scandir(at) as entries:
            for entry in list(entries):
                if entry.is_dir(follow_symlinks=False):
                    remove_marked(os.path.join(directory, entry.name))
                elif OWN_FILE_RE.fullmatch(entry.name) or entry.name == OUTPUT_LOCK:
                    with contextlib.suppress(OSError):
                        os.unlink(entry.name, dir_fd=at)
        with contextlib.suppress(OSError):
            os.unlink(OUTPUT_MARK, dir_fd=at)
    finally:
        os.close(at)
    with contextlib.suppress(OSError):
        os.rmdir(directory)


def name_output_file(number: int, stream: str) -> str:
    """Execution ``number``'s file of a stream: N.txt for combined, N.stdout.txt and so on."""
    return f"{number}.txt" if stream == "combined" else f"{number}.{stream}.txt"


class OutputFiles:
    """One resource's output files, in a directory of its own (made with the first). A stream that has had
    all of an execution's output so far shares the combined stream's file under a second name (a hard link);
    once other output arrives, ``split`` gives it a file of its own, a copy so far. A file that cannot be
    made or written is said to ``report`` once (until one works again): that output stays in memory."""

    def __init__(self, directory: Path, report: Callable[[str], None], kept: bool = False) -> None:
        self.directory = str(directory)  # names are joined as strings: pathlib would intern each one for good
        self.report = report
        self.kept = kept  # for the next start: OUTPUT_JOURNAL records each execution
        self.problem: str | None = None  # the last failure said, until a file works again

    def path_of(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def _make_directory(self) -> None:
        """Make the directory, marked as loommux's, when it is missing."""
        try:
            os.mkdir(self.directory, OUTPUT_DIR_MODE)
        except FileExistsError:
            return
        mark_directory(self.directory)

    def _append(self, name: str, data: bytes) -> int:
        """Append data to a file of the directory (made when missing) in one write; where it begins. OSError
        when it is not all written."""
        self._make_directory()
        fd = open_in_directory(self.directory, name, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            offset = os.fstat(fd).st_size
            if os.write(fd, data) < len(data):
                raise OSError(errno.EIO, "it was cut short")
        finally:
            os.close(fd)
        return offset

    def note(self, record: dict) -> None:
        """Append a record to a kept directory's journal, written before it returns (one write of one line:
        a SIGKILL leaves whole lines, and at most a last one cut short)."""
        if not self.kept:
            return
        try:
            self._append(OUTPUT_JOURNAL, encode_utf8(json.dumps(record, separators=(",", ":"))) + b"\n")
        except OSError as exc:
            self.fail(f"cannot write {self.path_of(OUTPUT_JOURNAL)}: {exc.strerror or exc}")

    def read_journal(self) -> list[dict]:
        """The records a kept directory's journal holds (a line cut short, or not a record, is skipped)."""
        try:
            with open(open_in_directory(self.directory, OUTPUT_JOURNAL, os.O_RDONLY), "rb") as journal:
                data = journal.read()
        except OSError:
            return []
        records = []
        for line in data.splitlines():
            with contextlib.suppress(ValueError, RecursionError):
                record = json.loads(line)
                if isinstance(record, dict) and type(record.get("n")) is int:
                    records.append(record)
        return records

    def take_back(self, number: int) -> dict[str, Log]:
        """Execution ``number``'s logs as its files hold them (a stream and combined that share a file share
        a log); the streams whose file cannot be read are left out."""
        logs: dict[str, Log] = {}
        by_file: dict[tuple[int, int], Log] = {}
        for stream in STREAMS:
            path = self.path_of(name_output_file(number, stream))
            try:
                found = os.lstat(path)
                if not S_ISREG(found.st_mode):
                    continue  # only a file loommux made is read back
                key = (found.st_dev, found.st_ino)
                if key not in by_file:
                    taken = Log(LogFile(path, self.on_problem))
                    taken.take_back()
                    by_file[key] = taken
            except OSError:
                continue
            logs[stream] = by_file[key]
        return logs

    def open(self, number: int, stream: str, also: str | None = None) -> LogFile | None:
        """A new file for execution ``number``'s stream (and under ``also``'s name too); None: it cannot be
        made (said)."""
        path = self.path_of(name_output_file(number, stream))
        try:
            self._make_directory()
            os.close(open_in_directory(self.directory, name_output_file(number, stream),
                                       os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            if also is not None:
                os.link(path, self.path_of(name_output_file(number, also)))
        except OSError as exc:
            self.fail(f"cannot make {path}: {exc.strerror or exc}")
            return None
        self.problem = None
        return LogFile(path, self.on_problem)

    def keep_display(self, number: int, content: Any) -> StoredDisplay | None:
        """Append a display's content to execution ``number``'s file of displays; None: it stays in memory
        (small, or the file cannot be written: said)."""
        data = encode_utf8(json.dumps(content, separators=(",", ":")))
        if len(data) <= STORED_DISPLAY_CHARS:
            return None
        name = name_displays_file(number)
        try:
            offset = self._append(name, data + b"\n")
        except OSError as exc:
            self.fail(f"cannot write {self.path_of(name)}: {exc.strerror or exc}")
            return None
        return StoredDisplay(self.path_of(name), offset, len(data))

    def split(self, number: int, stream: str, shared: LogFile) -> LogFile | None:
        """Give a stream that shared ``shared`` (its text so far all written) a file of its own, a copy of it;
        None: it cannot (said), and the stream's text goes on in memory."""
        path = self.path_of(name_output_file(number, stream))
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            copy = open_in_directory(self.directory, name_output_file(number, stream),
                                     os.O_WRONLY | os.O_CREAT | os.O_EXCL)
            try:
                source = shared.fd if shared.removed else os.open(shared.path,
                                                                  os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                try:
                    copy_file(source, copy, shared.size)
                finally:
                    if source != shared.fd:
                        os.close(source)
            finally:
                os.close(copy)
        except OSError as exc:
            self.fail(f"cannot make {path}: {exc.strerror or exc}")
            return None
        return LogFile(path, self.on_problem, shared.size)

    def on_problem(self, file: LogFile) -> None:
        self.fail(file.problem or "")

    def fail(self, problem: str) -> None:
        if self.problem is None:
            self.report(problem)
        self.problem = problem

    def remove(self) -> None:
        remove_marked(self.directory)

    def find_stored(self, recorded: dict) -> StoredDisplay:
        """A display kept in a file of this directory, as a journal recorded it (StoredDisplay.record);
        ValueError unless it names a file of displays here (by its name; older journals gave the whole
        path) that holds what it says."""
        path, offset, size = recorded["path"], recorded["offset"], recorded["size"]
        if (type(path) is not str or os.path.dirname(path) not in ("", self.directory)
                or not DISPLAYS_FILE_RE.fullmatch(os.path.basename(path))):
            raise ValueError("a stored display's file is not one of its directory's: "
                             f"{clip(repr(path), QUOTED_ID_CHARS)}")
        if type(offset) is not int or type(size) is not int or offset < 0 or size < 0:
            raise ValueError(f"a stored display's place is not one: {offset!r}, {size!r}")
        path = self.path_of(os.path.basename(path))
        try:
            found = os.lstat(path)
        except OSError as exc:
            raise ValueError(f"{path} cannot be read ({exc.strerror or exc})") from None
        if not S_ISREG(found.st_mode) or offset + size > found.st_size:
            raise ValueError(f"{path} does not hold {size} bytes at {offset}")
        return StoredDisplay(path, offset, size)


def copy_file(source: int, target: int, size: int) -> None:
    """Copy the first ``size`` bytes of one file to another, in the kernel (no copy through this process)."""
    offset = 0
    while offset < size:
        copied = os.copy_file_range(source, target, size - offset, offset, offset)
        if copied == 0:
            raise OSError(errno.EIO, "the file was cut short")
        offset += copied


@dataclass
class OutputDirectory:
    """The server's own output directory (see the section's comment): each resource's files in a
    subdirectory named by its id; ``kept`` (with --state-dir) outlives the server, else it is removed when
    the server exits."""

    path: Path
    kept: bool = False

    def files_for(self, resource_id: str, report: Callable[[str], None]) -> OutputFiles:
        return OutputFiles(self.path / resource_id, report, self.kept)

    def keep_only(self, resource_ids: set[str]) -> None:
        """Remove the directories of resources a restart did not take back (a kept directory; one removed
        under the server leaves nothing to do; only what loommux made goes, see remove_marked)."""
        with contextlib.suppress(OSError):
            for entry in self.path.iterdir():
                if entry.name not in resource_ids:
                    remove_marked(str(entry))

    def close(self) -> None:
        if not self.kept:
            remove_marked(str(self.path))


def open_output_directory(parent: Path | None, state_dir: Path | None) -> OutputDirectory:
    """Make the server's output directory: in the state directory, or a new one of its own in ``parent``
    (None: the temporary directory), locked while the server runs. StartupError when it cannot be."""
    if state_dir is not None:
        return OutputDirectory(open_kept_output(state_dir), kept=True)
    where = parent or Path(tempfile.gettempdir())
    try:
        path = Path(tempfile.mkdtemp(prefix=OUTPUT_DIR_PREFIX, dir=where))  # mode 0700
        fd = open_in_directory(str(path), OUTPUT_LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # its descriptor stays open, holding the lock
        mark_directory(str(path))
    except OSError as exc:
        named = f"--output-dir / {OUTPUT_DIR_ENV} {parent}" if parent else f"the temporary directory {where}"
        raise StartupError(f"{named}: cannot make an output directory in it ({exc.strerror or exc}): "
                           "refused to start") from None
    threading.Thread(target=sweep_output_directories, args=(where, path), name="stale output dirs",
                     daemon=True).start()
    return OutputDirectory(path)


def open_kept_output(state_dir: Path) -> Path:
    """The state directory's output directory, made (and marked) when missing; StartupError, naming it, when
    it is not one loommux may keep output in: a link, another user's, open to others, or one that holds files
    loommux did not make (never removed: the start is refused)."""
    path = state_dir / OUTPUT_KEPT
    try:
        path.mkdir(mode=OUTPUT_DIR_MODE)
    except FileExistsError:
        pass
    except OSError as exc:
        raise StartupError(f"state directory {state_dir}: cannot make {path} for output: "
                           f"{exc.strerror or exc}: refused to start") from None
    problem = describe_unsafe_directory(path)
    if problem is not None:
        raise StartupError(f"state directory {state_dir}: {path} {problem}: refused to start")
    try:
        if is_marked(str(path)):
            return path
        kept_before = list_unmarked_output(str(path))
    except OSError as exc:
        raise StartupError(f"state directory {state_dir}: cannot read {path}: {exc.strerror or exc}: refused "
                           "to start") from None
    if kept_before is None:
        raise StartupError(f"state directory {state_dir}: {path} holds files loommux did not make: "
                           "refused to start; move them away (loommux keeps its output there)")
    try:
        for directory in (*kept_before, str(path)):
            mark_directory(directory)
    except OSError as exc:
        raise StartupError(f"state directory {state_dir}: cannot mark {path} as loommux's: "
                           f"{exc.strerror or exc}: refused to start") from None
    return path


def sweep_output_directories(where: Path, own: Path) -> None:
    """Remove the output directories that servers killed with SIGKILL left in ``where``: those loommux
    marked whose lock nobody holds (a server that is running holds its own; another user's cannot be
    opened), with what loommux made in them alone (see remove_marked)."""
    for path in where.glob(OUTPUT_DIR_PREFIX + "*"):
        if path == own or not is_marked(str(path)):
            continue
        try:
            fd = open_in_directory(str(path), OUTPUT_LOCK, os.O_RDWR)
        except OSError:
            continue  # being made, or not a server's
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its server runs
        finally:
            os.close(fd)
        log(f"removed the output directory {path}, left by a loommux that was killed")
        remove_marked(str(path))


# ---------------------------------------------------------------- Execution records

STREAMS = ("combined", "stdout", "stderr", "result", "traceback")
DISPLAY_TYPES = ("execute_result", "display_data", "update_display_data")
IMAGE_MIMES = ("image/png", "image/jpeg", "image/webp", "image/gif")  # in order of preference
IMAGE_DETAILS = ("low", "high", "original")
DEFAULT_IMAGE_DETAIL = "high"
MAX_IMAGE_BYTES = 10 << 20


@dataclass
class Image:
    """One displayed image, kept with its execution and shown in the text streams as one caption line."""

    display: int  # its ordinal among the execution's images
    mime: str
    data: str  # base64, as MCP sends it ("" when it could not be decoded, or once ``stored``)
    size: int  # decoded bytes
    width: int = 0
    height: int = 0
    detail: str = DEFAULT_IMAGE_DETAIL
    problem: str | None = None  # why it is not sent, with what to do instead
    line: int = 0  # the caption's line index in the combined stream
    stored: StoredDisplay | None = None  # its display's content, kept in a file: its data is read from there

    @property
    def decoded(self) -> bool:
        """Whether it has data to send (a corrupt one has none)."""
        return bool(self.data) or self.stored is not None

    def load_data(self) -> str:
        """Its base64 data, read from its display's file when it is kept there."""
        if self.stored is None:
            return self.data
        return re.sub(r"\s+", "", self.stored.load()["data"][self.mime])

    @property
    def caption(self) -> str:
        dims = f" {self.width}×{self.height}" if self.width else ""
        refused = f" · not sent: {self.problem}" if self.problem else ""
        return f"[{self.mime}{dims} · {format_size(self.size)} · display {self.display}{refused}]"

    def encode_block(self) -> dict:
        return {"type": "image", "data": self.load_data(), "mimeType": self.mime,
                "_meta": {"detail": self.detail}}


def measure_image(mime: str, raw: bytes) -> tuple[int, int, int]:
    """Width, height and frame count read from an image's header; ValueError when it is not valid."""
    if mime == "image/png":
        if raw[:8] != b"\x89PNG\r\n\x1a\n" or raw[12:16] != b"IHDR":
            raise ValueError("not a PNG file")
        return int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big"), 1
    if mime == "image/gif":
        if raw[:6] not in (b"GIF87a", b"GIF89a"):
            raise ValueError("not a GIF file")
        return int.from_bytes(raw[6:8], "little"), int.from_bytes(raw[8:10], "little"), count_gif_frames(raw)
    if mime == "image/jpeg":
        return (*measure_jpeg(raw), 1)
    if raw[:4] != b"RIFF" or raw[8:12] != b"WEBP":
        raise ValueError("not a WebP file")
    chunk = raw[12:16]
    if chunk == b"VP8 " and raw[23:26] == b"\x9d\x01\x2a":
        return int.from_bytes(raw[26:28], "little") & 0x3FFF, int.from_bytes(raw[28:30], "little") & 0x3FFF, 1
    if chunk == b"VP8L" and raw[20:21] == b"\x2f":
        bits = int.from_bytes(raw[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1, 1
    if chunk == b"VP8X" and len(raw) >= 30:
        frames = 2 if raw[20] & 0x02 else 1  # the animation flag
        return int.from_bytes(raw[24:27], "little") + 1, int.from_bytes(raw[27:30], "little") + 1, frames
    raise ValueError("unknown WebP layout")


def measure_jpeg(raw: bytes) -> tuple[int, int]:
    if raw[:2] != b"\xff\xd8":
        raise ValueError("not a JPEG file")
    at = 2
    while at + 9 <= len(raw):
        if raw[at] != 0xFF:
            raise ValueError("corrupt JPEG segment")
        marker = raw[at + 1]
        if marker == 0xFF:
            at += 1
            continue
        length = int.from_bytes(raw[at + 2 : at + 4], "big")
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # a start-of-frame segment
            return int.from_bytes(raw[at + 7 : at + 9], "big"), int.from_bytes(raw[at + 5 : at + 7], "big")
        at += 2 + length
    raise ValueError("no JPEG frame header")


def count_gif_frames(raw: bytes) -> int:
    """Count a GIF's image descriptors by walking its blocks."""
    at, frames = 13, 0
    if raw[10] & 0x80:
        at += 3 << ((raw[10] & 0x07) + 1)  # the global colour table
    while at < len(raw):
        block = raw[at]
        if block == 0x3B:  # trailer
            return frames
        if block == 0x21:  # extension: label, then data sub-blocks
            at += 2
        elif block == 0x2C:  # image descriptor
            frames += 1
            flags = raw[at + 9]
            at += 10 + ((3 << ((flags & 0x07) + 1)) if flags & 0x80 else 0) + 1  # local table, LZW code size
        else:
            raise ValueError("corrupt GIF block")
        while at < len(raw) and raw[at]:
            at += raw[at] + 1
        at += 1
    raise ValueError("truncated GIF")


def make_image(display: int, mime: str, payload: Any, metadata: dict) -> Image:
    """Decode and check one displayed image; a problem is recorded, never raised."""
    data = re.sub(r"\s+", "", payload) if isinstance(payload, str) else ""
    mime_meta = metadata.get(mime) if isinstance(metadata.get(mime), dict) else {}
    detail = metadata.get("detail", mime_meta.get("detail", DEFAULT_IMAGE_DETAIL))
    try:
        raw = base64.b64decode(data, validate=True)
    except ValueError:
        return Image(display, mime, "", len(data) * 3 // 4,
                     problem="corrupt base64 data; display the image again")
    image = Image(display, mime, data, len(raw), detail=detail if isinstance(detail, str) else repr(detail))
    try:
        image.width, image.height, frames = measure_image(mime, raw)
    except (ValueError, IndexError) as exc:
        image.problem = f"corrupt image ({exc}); save it to a file and check it"
        return image
    if image.detail not in IMAGE_DETAILS:
        image.problem = (f'detail "{image.detail}" is not low, high or original; display it again with '
                         'one of those')
    elif frames > 1:
        image.problem = ("animated images are not supported; display one frame as PNG, or save the "
                         "animation to a file")
    elif image.size > MAX_IMAGE_BYTES:
        image.problem = (f"over the {format_size(MAX_IMAGE_BYTES)} limit per image; display it smaller "
                         "(lower dpi or size, or JPEG) or save it to a file")
    return image


COMPACT_CHARS = 1 << 12  # a finished execution's output up to this size is kept as its streams' text
DEFAULT_OPTIONS = CellOptions()  # a cell without a header: one object for all of them
EMPTY_LOG = Log()  # how a stream that nothing was written to reads: one for all of them, never written
# What a notebook needs beyond the text logs (see "Notebooks"), kept compactly: three integers per output
# that is not stream text and per switch between stdout and stderr (a code, then how long stdout and stderr
# were when it arrived, so that stream text and the other outputs interleave in arrival order), and the
# message content such an output needs in ``rich`` (a display of text alone: just its text).
MARK_SWITCH, MARK_DISPLAY, MARK_RESULT, MARK_UPDATE, MARK_ERROR, MARK_CLEAR, MARK_CLEAR_WAIT = range(7)
MARK_STDERR = 8  # in a mark's code: stderr is the stream from this mark on
MARK_PAYLOAD = 16  # a mark's code: its kind, the stream bit, and MARK_PAYLOAD times its content's rich index
MARK_KINDS = {"display_data": MARK_DISPLAY, "execute_result": MARK_RESULT, "update_display_data": MARK_UPDATE}
OTHER_CLIENT = "jupyter_client"  # Execution.by's kind for a cell another Jupyter client ran


def rebuild_log(text: str) -> Log:
    """The log a settled text was taken from (Log.settled_text), built again."""
    if not text:
        return EMPTY_LOG
    rebuilt = Log()
    rebuilt.write(text)
    return rebuilt


@dataclass(eq=False, slots=True)
class Execution:
    """One accepted cell: its source, state, times and output streams, kept for as long as its kernel is.

    Kept small, since a session may run many thousands of cells: a stream gets its log when first written
    (until then it reads as EMPTY_LOG), and combined is that log too while one stream has had all the
    output; the done event exists only while someone waits; and once the cell ends, an output of at
    most COMPACT_CHARS is kept as the streams' text alone, from which each read builds its log again.
    """

    number: int
    source: str
    options: CellOptions
    kernel_pid: int | None
    # Told what the cell shows, as (stdout or stderr, text), then (None, "") when it ends: only a cell whose
    # output a kernel relays has one (the control plane's Relay).
    listener: Callable[[str | None, str], None] | None = None
    state: str = RUNNING
    submitted_at: float = field(default_factory=time.time)
    started: float = field(default_factory=time.monotonic)
    finished: float | None = None
    completed_at: float | None = None
    ipython_count: int | None = None
    ename: str | None = None  # "" for an error without a name (bash_kernel's failing command); None: none
    evalue: str | None = None
    reason: str | None = None
    interrupt_sent: bool = False
    output_dropped: bool = False  # a gateway's IOPub rate limit dropped some of its output
    lost: int = 0  # kernel messages that never arrived while it was the latest (see MessageCounter)
    replied: bool = False
    idle: bool = False
    last_output: float | None = None  # while it runs: when it last showed something
    fits: bool | None = None  # the token decision, once made for the finished output
    images: list[Image] | tuple[()] = ()  # a list from its first image on
    logs: dict[str, Log] | None = None  # by stream, those written to (None: none yet, or texts holds them)
    texts: tuple[str, ...] | None = None  # a small finished output: the streams' settled texts, as STREAMS
    ended: asyncio.Event | None = None  # set when it ends, for those waiting meanwhile
    marks: array | tuple[int, ...] | None = None  # for its notebook cell: see MARK_SWITCH
    rich: list | tuple | None = None
    # Who ran it: mcp_client, kernel, control_api or jupyter_client (OTHER_CLIENT), and its name.
    by: tuple[str, str | None] | None = None
    files: OutputFiles | None = None  # where its logs are written (None: memory)
    unwritten: str | None = None  # why a log of it has no file though it has files (it is kept in memory)
    notes: list[dict] | None = None  # what cell inspectors said of it (see inspect_cells), before it ran

    @property
    def elapsed(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    @property
    def done(self) -> bool:
        return self.state != RUNNING

    async def wait(self, timeout: float) -> None:
        """Until the cell ends, at most timeout seconds."""
        if self.state == RUNNING:
            if self.ended is None:
                self.ended = asyncio.Event()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.ended.wait(), timeout)

    def log(self, stream: str) -> Log:
        """One stream's log (a compacted one built again from its text: read it, never write it)."""
        if self.texts is not None:
            at = STREAMS.index(stream)
            return rebuild_log(self.texts[at]) if at < len(self.texts) else EMPTY_LOG
        return self.logs.get(stream, EMPTY_LOG) if self.logs else EMPTY_LOG

    @property
    def output(self) -> Log:
        return self.log("combined")

    @property
    def first_line(self) -> str:
        return self.source.split("\n", 1)[0]

    def ingest(self, msg_type: str, content: dict) -> None:
        """Apply one IOPub message of this execution to its logs."""
        if msg_type == "stream":
            stream = "stdout" if content.get("name") == "stdout" else "stderr"
            self.mark(MARK_SWITCH, stream=MARK_STDERR if stream == "stderr" else 0)
            self.record(stream, content.get("text", ""))
            self.tell(stream, content.get("text", ""))
        elif msg_type in DISPLAY_TYPES:
            data = content.get("data") or {}
            if type(data) is dict and isinstance(data.get(INSPECTOR_NOTES_MIME), list):
                self.notes = [note for note in data[INSPECTOR_NOTES_MIME] if isinstance(note, dict)]
                return
            plain = (msg_type != "update_display_data" and type(data) is dict and len(data) == 1
                     and type(data.get("text/plain")) is str and not content.get("metadata")
                     and not content.get("transient"))
            kept = self.mark(MARK_KINDS[msg_type], data["text/plain"] if plain else content)
            mime = next((mime for mime in IMAGE_MIMES if mime in data), None)
            if mime is not None:
                metadata = content.get("metadata") if isinstance(content.get("metadata"), dict) else {}
                image = make_image(len(self.images) + 1, mime, data[mime], metadata)
                if isinstance(kept, StoredDisplay) and image.data:  # read from the file when it is sent
                    image.data, image.stored = "", kept
                if not self.images:
                    self.images = []
                self.images.append(image)
                self.record("result", image.caption, block=True)
                image.line = self.output.line_count - 1
                self.tell("stdout", image.caption + "\n")
            else:
                text = str(data.get("text/plain",
                                    f"[{', '.join(data) or 'empty'} display without a text form]"))
                shown = f"Out[{self.number}]: {text}" if msg_type == "execute_result" else None
                self.record("result", text, block=True, combined=shown)
                self.tell("stdout", (shown or text) + "\n")
        elif msg_type == "error":
            self.mark(MARK_ERROR, content)
            self.ename, self.evalue = str(content.get("ename", "")), str(content.get("evalue", ""))
            text = "\n".join(map(str, content.get("traceback") or [describe_error(self.ename, self.evalue)]))
            self.record("traceback", text, block=True)
            self.tell("stderr", text + "\n")
        elif msg_type == "execute_input":
            self.ipython_count = content.get("execution_count")
            return
        elif msg_type == OUTPUT_DROPPED_MSG_TYPE:
            self.output_dropped = True
            return
        elif msg_type == "clear_output":
            self.mark(MARK_CLEAR_WAIT if content.get("wait") else MARK_CLEAR)
        else:
            return
        if self.state == RUNNING:
            self.last_output = time.monotonic()

    def mark(self, kind: int, payload: Any = None, stream: int | None = None) -> Any:
        """Note, for the notebook, an output that is not stream text (or a switch to ``stream``), where it
        arrived; a switch to the stream already current is no mark. The payload is kept in the execution's
        file of displays when it is big (see OutputFiles.keep_display): what is kept is returned."""
        marks = self.marks
        current = marks[-3] & MARK_STDERR if marks else 0
        if kind == MARK_SWITCH:
            if stream == current:
                return None
            current = stream
        code = kind | current
        if payload is not None:
            if not isinstance(self.rich, list):  # none yet, or kept as a tuple by compact()
                self.rich = list(self.rich or ())
            code |= len(self.rich) * MARK_PAYLOAD
            if self.files is not None and not isinstance(payload, str):
                payload = self.files.keep_display(self.number, payload) or payload
            self.rich.append(payload)
        if not isinstance(marks, array):
            marks = self.marks = array("q", marks or ())
        marks.extend((code, self.log("stdout").chars, self.log("stderr").chars))
        return payload

    def record(self, stream: str, text: str, block: bool = False, combined: str | None = None) -> None:
        """Append text to a stream and to combined (there as combined, when that differs).

        While one stream has had all the output, combined is that stream's own log, so its text is
        stored once; other output first makes combined a copy of its own, which shares the text so far.
        """
        logs = self.open_logs()
        shared, own = logs.get("combined"), logs.get(stream)
        if own is None and shared is None and combined is None:
            own = shared = logs[stream] = logs["combined"] = self.make_log("combined", also=stream)
        if shared is own and combined is None:
            (own.write_block if block else own.write)(text)
            return
        if own is None:
            own = logs[stream] = self.make_log(stream)
        if shared is None:
            shared = logs["combined"] = self.make_log("combined")
        for name in STREAMS[1:]:
            if logs.get(name) is shared:  # from now on a file of its own, combined's so far
                logs[name] = shared.copy(partial(self.files.split, self.number, name) if self.files else None)
        own = logs[stream]
        for stream_log, written in ((own, text), (shared, text if combined is None else combined)):
            (stream_log.write_block if block else stream_log.write)(written)

    def make_log(self, stream: str, also: str | None = None) -> Log:
        """A new log of a stream (and of ``also`` while they are alike), in a file when there are files (when
        its file cannot be made, in memory: ``unwritten`` says why)."""
        if self.files is None:
            return Log()
        file = self.files.open(self.number, stream, also)
        if file is None:
            self.unwritten = self.files.problem
        return Log(file)

    def open_logs(self) -> dict[str, Log]:
        """The logs, made first when none was written yet, or again from the texts of a compacted output (a
        thread the cell left prints after its end): its files' when they hold those texts, so that what it
        prints goes on in them; else in memory."""
        if self.logs is None:
            texts, self.texts = self.texts or ("",), None
            self.logs = self._reopen_files(texts)
            if self.logs is not None:
                return self.logs
            self.logs = {name: rebuild_log(text) for name, text in zip(STREAMS[1:], texts[1:]) if text}
            if texts[0]:  # combined shares the log of a stream with its text: alike until they differ
                alike = (self.logs[name] for name, text in zip(STREAMS[1:], texts[1:]) if text == texts[0])
                self.logs["combined"] = next(alike, None) or rebuild_log(texts[0])
        return self.logs

    def _reopen_files(self, texts: tuple[str, ...]) -> dict[str, Log] | None:
        """The logs of its files, when they hold the texts of its compacted output, but for unfinished last
        lines (a file holds whole lines), given again here; None: no files, or one failed."""
        if self.files is None or not any(texts):
            return None
        taken = self.files.take_back(self.number)
        rests = {}
        padded = (*texts, *("",) * len(STREAMS))  # the streams left out at the end were never written to
        for name, text in zip(STREAMS, padded):
            stream_log = taken.get(name)
            held = stream_log.settled_text() if stream_log is not None else ""
            if held is None or not text.startswith(held) or "\n" in text[len(held) :]:
                return None
            if stream_log is not None:
                rests[id(stream_log)] = (stream_log, text[len(held) :])  # a stream and combined may share one
            elif text:
                return None
        for stream_log, rest in rests.values():
            stream_log.write(rest)
        return taken

    def describe_files(self) -> tuple[str | None, list[str]]:
        """The file its combined output is written to (a person can follow it with tail -f), and which
        streams' lines are kept in memory because a file failed."""
        if self.files is None or not self.texts and not self.logs:
            return None, []
        unwritten = [f"is kept in memory ({self.unwritten})"] if self.unwritten else []
        if self.logs is None:
            path = None if unwritten else self.files.path_of(name_output_file(self.number, "combined"))
            return path, unwritten
        kept = {name: stream_log.describe_in_memory() for name, stream_log in self.logs.items()}
        return self.logs["combined"].path, [*unwritten, *(f"{name}: {note}" for name, note in kept.items()
                                                          if note)]

    def write_out(self) -> None:
        """Write what its logs committed and hold to their files."""
        for stream_log in set((self.logs or {}).values()):
            stream_log.write_out()

    def compact(self) -> None:
        """At the end: keep a small output as its streams' settled text alone, and share what is shared."""
        if self.options == DEFAULT_OPTIONS:
            self.options = DEFAULT_OPTIONS
        if self.marks is not None:  # a tuple and a tuple: what a notebook needs, in fewer bytes
            self.marks, self.rich = tuple(self.marks), self.rich and tuple(self.rich)
        logs = self.logs
        if logs is None or sum(stream_log.chars for stream_log in set(logs.values())) > COMPACT_CHARS:
            return
        # combined and a stream may be one log: one text
        settled = {id(stream_log): stream_log.settled_text() for stream_log in logs.values()}
        if None not in settled.values():
            texts = [settled[id(logs[name])] if name in logs else "" for name in STREAMS]
            while texts and not texts[-1]:
                texts.pop()  # the streams nothing was written to at the end are left out
            self.texts, self.logs = tuple(texts), None

    def tell(self, stream: str, text: str) -> None:
        if self.listener is not None:
            self.listener(stream, text)

    def on_reply(self, content: dict) -> None:
        self.replied = True
        self.ipython_count = content.get("execution_count", self.ipython_count)
        if content.get("status") == "error" and self.ename is None:
            self.ename, self.evalue = str(content.get("ename") or ""), str(content.get("evalue") or "")
        elif content.get("status") == "aborted" and self.ename is None:
            self.ename, self.evalue = "Aborted", "the kernel aborted this request"

    def finish(self, state: str | None = None, reason: str | None = None) -> None:
        if self.state != RUNNING:
            return
        if state is None:
            if self.interrupt_sent or self.ename == "KeyboardInterrupt":
                state = INTERRUPTED
            else:
                state = COMPLETED if self.ename is None else ERROR
        for output in (self.logs or {}).values():
            output.flush()
        self.state, self.reason = state, reason
        self.finished, self.completed_at, self.last_output = time.monotonic(), time.time(), None
        if self.files is not None:
            self.files.note(describe_end(self))
        self.compact()
        if self.ended is not None:
            self.ended.set()
            self.ended = None
        if self.listener is not None:
            self.listener(None, "")



# What a kept output directory's journal records of an execution (see OutputFiles.note): a line when it
# begins and one when it ends, enough to take it back after a restart of the server with its files; then a
# line amending its end for each change of its lost messages (a message that came late after all, or one a
# thread it left lost), as a later end record's fields replace the earlier one's.
BEGIN_FIELDS = ("source", "submitted_at", "kernel_pid", "by")
CUT_OFF_REASON = "loommux was killed while it ran: its output up to then is kept, any later output is not"
END_FIELDS = ("state", "reason", "completed_at", "ipython_count", "ename", "evalue", "output_dropped", "lost",
              "notes")
# The JSON types of those fields (a record whose field holds another is not one: it is left out)
NULL = types.NoneType
JOURNAL_FIELD_TYPES = {
    "source": (str,), "submitted_at": (int, float), "kernel_pid": (int, NULL), "by": (list, NULL),
    "state": (str,), "reason": (str, NULL), "completed_at": (int, float, NULL), "ipython_count": (int, NULL),
    "ename": (str, NULL), "evalue": (str, NULL), "output_dropped": (bool,), "lost": (int,),
    "notes": (list, NULL), "elapsed": (int, float), "marks": (list,), "rich": (list,), "images": (list,),
    "open": (dict,)}
JOURNAL_NUMBER_LIMIT = 2.0**53  # a time, size or count beyond it (or not finite) is no record of ours


def describe_begin(e: Execution) -> dict:
    return {"n": e.number, "begin": {**{name: getattr(e, name) for name in BEGIN_FIELDS},
                                     "options": asdict(e.options)}}


def describe_end(e: Execution) -> dict:
    rich = [{"stored": entry.record()} if isinstance(entry, StoredDisplay) else entry
            for entry in e.rich or ()]
    images = [{**asdict(image), "stored": image.stored and image.stored.record()} for image in e.images]
    ended = {**{name: getattr(e, name) for name in END_FIELDS}, "elapsed": e.elapsed,
             "marks": list(e.marks or ()), "rich": rich, "images": images, "open": describe_open_lines(e)}
    return {"n": e.number, "end": ended}


def describe_open_lines(e: Execution) -> dict[str, list]:
    """The unfinished last line of each stream that ends with one, which its file does not hold (a file holds
    whole lines), after how many characters of the file."""
    return {name: [stream_log.chars - len(stream_log.open_line), stream_log.open_line]
            for name, stream_log in (e.logs or {}).items() if stream_log.open_line}


def restore_open_lines(e: Execution, open_lines: dict) -> None:
    """Give the logs taken back from its files the unfinished last lines the journal recorded, but for a file
    that grew since (a thread the cell left ended the line after all); ValueError for one that is not one."""
    logs = {}
    for name, recorded in open_lines.items():
        after, text = recorded if isinstance(recorded, list) and len(recorded) == 2 else (None, None)
        if name not in STREAMS or type(after) is not int or not isinstance(text, str) or "\n" in text:
            raise ValueError(f"its open line of {clip(repr(name), QUOTED_ID_CHARS)} is not one")
        if e.logs and name in e.logs and e.logs[name].chars == after:
            logs[id(e.logs[name])] = (e.logs[name], text)  # a stream and combined may share a log
    for stream_log, text in logs.values():
        stream_log.write(text)


def describe_lost_since_end(e: Execution) -> dict:
    return {"n": e.number, "end": {"lost": e.lost}}


def restore_execution(number: int, begin: dict, end: dict | None, files: OutputFiles) -> Execution:
    """An execution as the journal recorded it, its logs read from its files; one that had not ended when
    the server was killed ends killed. ValueError, TypeError or KeyError for a record that is not one."""
    check_journal_fields(begin)
    check_journal_fields(end or {})
    e = Execution(number, str(begin["source"]), CellOptions(**begin["options"]), begin["kernel_pid"],
                  submitted_at=float(begin["submitted_at"]), files=files)
    e.by = tuple(begin["by"]) if begin["by"] else None
    if end is None:
        end = {"state": KILLED, "reason": CUT_OFF_REASON, "elapsed": 0.0}
    for name in END_FIELDS:
        if name in end:
            setattr(e, name, end[name])
    if e.state not in STATES[1:]:
        raise ValueError(f"execution {number} ended in state {e.state!r}")
    e.started = time.monotonic() - float(end["elapsed"])
    e.finished = time.monotonic()
    e.marks = tuple(map(int, end.get("marks", ())))
    e.rich = tuple(restore_display(entry, files) for entry in end.get("rich", ()))
    check_marks(e.marks, len(e.rich))
    e.images = [Image(**{**image, "stored": image["stored"] and files.find_stored(image["stored"])})
                for image in end.get("images", ())] or ()
    e.logs = files.take_back(number) or None
    restore_open_lines(e, end.get("open", {}))
    e.compact()
    return e


def check_journal_fields(recorded: dict) -> None:
    """ValueError unless each field of a journal's record holds its type (JOURNAL_FIELD_TYPES)."""
    for name, kinds in JOURNAL_FIELD_TYPES.items():
        value = recorded.get(name)
        if name in recorded and (not isinstance(value, kinds) or type(value) is bool and bool not in kinds
                                 or type(value) in (int, float) and not abs(value) < JOURNAL_NUMBER_LIMIT):
            raise ValueError(f"its {name} is {clip(repr(value), QUOTED_ID_CHARS)}")


def check_marks(marks: tuple[int, ...], rich_count: int) -> None:
    """ValueError unless a journal's marks are whole ones (see MARK_PAYLOAD): triples of a code and two stream
    lengths, none negative, each content they point to among the ``rich_count`` recorded."""
    if len(marks) % 3 or any(value < 0 for value in marks):
        raise ValueError("its marks are not whole")
    for code in marks[::3]:
        if MARK_DISPLAY <= code & 7 <= MARK_ERROR and code // MARK_PAYLOAD >= rich_count:
            raise ValueError(f"a mark points to display {code // MARK_PAYLOAD} of {rich_count}")


def restore_display(entry: Any, files: OutputFiles) -> Any:
    """A display's content as the journal recorded it: a StoredDisplay for one kept in a file of ``files``."""
    if isinstance(entry, dict) and entry.keys() == {"stored"}:
        return files.find_stored(entry["stored"])
    return entry


def load_display(entry: Any) -> Any:
    """A display's content, read from its execution's file of displays when it is kept there."""
    return entry.load() if isinstance(entry, StoredDisplay) else entry


def is_other_client(execution: Execution) -> bool:
    """Whether another Jupyter client (a person's console or notebook) ran it, seen on IOPub."""
    return execution.by is not None and execution.by[0] == OTHER_CLIENT


def describe_other_client(execution: Execution) -> str | None:
    """``by another client (alice)`` for another client's cell (status, busy, the console), else None."""
    if not is_other_client(execution):
        return None
    return f"by another client ({execution.by[1]})" if execution.by[1] else "by another client"


# ---------------------------------------------------------------- Instances
# Several loommux instances can stand behind one proxy (README: "Several instances"). Each has a name, and
# every id it mints for clients (a private kernel's handle, an MCP session id, a task id) carries that name
# before its first dot: ~NAME.RANDOM for a handle, NAME.RANDOM for the others. A proxy routes any of them
# to the instance that minted it with one regular expression, ^~?(NAME)\.; an instance that is handed
# another's id says which instance minted it, and never serves it from a kernel of its own.

INSTANCE_NAME_RE = re.compile(r"[A-Za-z0-9-]{1,32}")
INSTANCE_NAME_RULE = "1-32 characters of A-Z, a-z, 0-9 and '-'"
MINTED_ID_RE = re.compile(r"([A-Za-z0-9-]{1,32})\.")  # after the kind's prefix (a handle's ~): the minter
RANDOM_INSTANCE_BYTES = 3  # a name given at start when none is set: 6 hex digits
QUOTED_ID_CHARS = 80  # of an unknown id a client sent, in the error that quotes it back


def make_instance_name() -> str:
    return secrets.token_hex(RANDOM_INSTANCE_BYTES)


def mint_id(instance: str, random_bytes: int, prefix: str = "") -> str:
    """A new unguessable id carrying the instance's name: prefix, name, a dot, URL-safe random characters."""
    return f"{prefix}{instance}.{secrets.token_urlsafe(random_bytes)}"


def find_minting_instance(value: str, prefix: str = "") -> str | None:
    """The instance an id names as its minter, or None for an id no instance minted this way (a kind of id
    minted with ``prefix``, a handle's ``~``, starts with it; the others never do)."""
    match = MINTED_ID_RE.match(value, len(prefix)) if value.startswith(prefix) else None
    return match.group(1) if match else None


def explain_unknown_id(what: str, value: str, instance: str, prefix: str = "") -> str:
    """Why this instance does not know an id it was handed: another instance minted it (the request was routed
    here by mistake), or this one did before it restarted without its state (or the thing is gone)."""
    minter, value = find_minting_instance(value, prefix), clip(value, QUOTED_ID_CHARS)
    if minter is None:
        return f"{what} {value} was not minted by any loommux instance"
    if minter != instance:
        return (f"{what} {value} was minted by loommux instance {minter}, and this is instance {instance}: "
                f"the request was routed to the wrong instance (route it by the name before the first dot)")
    return (f"{what} {value} is unknown to instance {instance}, which minted it: it ended, expired, or this "
            "instance restarted without its state")


# ---------------------------------------------------------------- Tasks
# An execution an MCP client tracks as a task (the 2026-07-28 extension io.modelcontextprotocol/tasks, or the
# 2025-11-25 experimental tasks of a handshake session): its status from working (or input_required while
# the cell waits in input() for a client that can answer) to one terminal status, and the final result of
# the call it stands for. The board below is the one owner of every task's state and of who hears of its
# changes (watch, subscribe); the protocol layer only shows tasks in the wire form of each era.

TASK_WORKING, TASK_INPUT_REQUIRED = "working", "input_required"
TASK_COMPLETED, TASK_FAILED, TASK_CANCELLED = "completed", "failed", "cancelled"
TERMINAL_STATUSES = (TASK_COMPLETED, TASK_FAILED, TASK_CANCELLED)
TASK_ID_BYTES = 24  # 192 random bits, 32 URL-safe characters after the instance's name (see "Instances")
TASK_KEEP_MS = 3_600_000  # a task and its result are kept this long after its cell ended (and while it runs)
MIN_TASK_KEEP_MS, MAX_TASK_KEEP_MS = 10_000, 86_400_000  # what a handshake client's requested ttl is held to
# How often a client should poll, by the cell's age: fast while a short cell may end, slower for old cells.
POLL_INTERVALS_MS = ((10.0, 250), (60.0, 1000), (600.0, 5000), (math.inf, 15000))
TASK_PRUNE_INTERVAL = 10.0  # how often finished tasks past their time are dropped
TASK_LINE_CHARS = 120  # of the last output line, in a status message
LISTEN_FLUSH = 0.05  # at shutdown, how long the listen streams' last messages get to be written


async def wait_for_any(timeout: float | None, *events: asyncio.Event | None) -> bool:
    """Whether one of the events (None ones left out) was set within the timeout."""
    waiters = [asyncio.ensure_future(event.wait()) for event in events if event is not None]
    try:
        done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        return bool(done)
    finally:
        for waiter in waiters:
            waiter.cancel()


@dataclass(eq=False, slots=True)
class Task:
    """One execution tracked for a client. ``owner`` is the handshake session it belongs to (only that session
    finds it); None for a 2026-07-28 task, whose id is its only key. ``elicits``: its client can answer the
    cell's input() (the task then goes input_required)."""

    id: str
    owner: Any
    resource: Any  # the Resource running its execution
    execution: Execution | None  # None for a handshake call refused before any cell ran
    keep_ms: int
    elicits: bool
    status: str = TASK_WORKING
    result: dict | None = None  # the call's result, once the cell ended
    reason: str | None = None  # why it failed without a result (its JSON-RPC error's message)
    cancel_asked: bool = False
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)
    ended: float | None = None
    watchers: list[Callable[[Task], None]] = field(default_factory=list)  # told of every status change
    follower: asyncio.Future | None = None  # while it follows the cell (to its result, after a cancel too)

    @property
    def terminal(self) -> bool:
        return self.status in TERMINAL_STATUSES

    @property
    def settled(self) -> bool:
        """Terminal with its outcome in place (a cancelled handshake task gets its result when it ends)."""
        return self.terminal and self.follower is None

    @property
    def ttl_ms(self) -> int | None:
        """Kept while its cell runs (null: unlimited), then keep_ms more."""
        return None if self.ended is None else round((self.ended - self.created) * 1000) + self.keep_ms

    @property
    def poll_ms(self) -> int:
        execution = self.execution
        age = execution.elapsed if execution is not None else time.time() - self.created
        return next(interval for limit, interval in POLL_INTERVALS_MS if age < limit)

    def question(self) -> Any:
        """The input() its cell waits in, if its client can answer it."""
        if not self.elicits or self.terminal or self.execution is None:
            return None
        return self.resource.find_question(self.execution)

    def expired(self, now: float) -> bool:
        return self.ended is not None and (now - self.ended) * 1000 > self.keep_ms

    def describe_status(self) -> str:
        """``In [7] running · 12 s · 3,402 lines · last: epoch 3/10``, or what waits, or how it ended."""
        e = self.execution
        if self.reason:
            return self.reason
        if e is None:  # a refused call: its error's first line
            content = (self.result or {}).get("content", ())
            texts = [block["text"] for block in content if block.get("type") == "text"]
            return texts[0].split("\n", 1)[0] if texts else "the call failed"
        count = e.output.line_count
        lines = f"{format_count(count)} line{'' if count == 1 else 's'}"
        if self.terminal:
            return f"In [{e.number}] {e.state} · {format_duration(e.elapsed)} · {lines}"
        question = self.question()
        if question is not None:
            elapsed = format_duration(e.elapsed)
            return f"In [{e.number}] waiting for input · {elapsed} · prompt: {question.prompt!r}"
        tail = e.output.tail(1)
        last = f" · last: {clip(tail[0], TASK_LINE_CHARS)}" if tail else ""
        return f"In [{e.number}] running · {format_duration(e.elapsed)} · {lines}{last}"


class TaskBoard:
    """Every task of a server, by id, one per execution and owner; followers that move them as their cells
    run, ask and end; and who hears of them: a task's watchers (``watch``) and the listen streams
    (``subscribe``). Only the board touches those."""

    def __init__(self, instance: str) -> None:
        self.instance = instance  # whose name its task ids carry
        self.tasks: dict[str, Task] = {}
        self.by_execution: dict[tuple[Execution, Any], Task] = {}
        self.listeners: dict[asyncio.Queue, asyncio.Task] = {}  # a listen stream's queue -> its request
        self.pruned = time.monotonic()
        self.closed = False

    def get(self, task_id: Any, owner: Any) -> Task | None:
        """The task of that id, if the owner may see it and it has not expired."""
        task = self.tasks.get(task_id) if isinstance(task_id, str) else None
        if task is None or task.owner is not owner or task.expired(time.time()):
            return None
        return task

    def of(self, owner: Any) -> list[Task]:
        """The owner's tasks, newest first."""
        now = time.time()
        return [task for task in reversed(self.tasks.values())
                if task.owner is owner and not task.expired(now)]

    def _add(self, task: Task) -> Task:
        if time.monotonic() - self.pruned > TASK_PRUNE_INTERVAL:
            self.prune()
        self.tasks[task.id] = task
        return task

    def track(self, resource: Any, execution: Execution, finish: Callable[[], Awaitable[dict]],
              owner: Any = None, keep_ms: int = TASK_KEEP_MS, elicits: bool = True) -> Task:
        """The task of an execution for this owner: the one it has, else a new one, following the cell until
        ``finish`` (once the cell ended) gives the call's result."""
        task = self.by_execution.get((execution, owner))
        if task is not None and not task.expired(time.time()):
            return task
        task_id = mint_id(self.instance, TASK_ID_BYTES)
        task = self._add(Task(task_id, owner, resource, execution, keep_ms, elicits))
        self.by_execution[(execution, owner)] = task
        self.refresh(task)  # its first status (input_required when the cell already asks)
        task.follower = asyncio.ensure_future(self._follow(task, finish))
        return task

    def refused(self, owner: Any, resource: Any, result: dict, keep_ms: int) -> Task:
        """A handshake task whose call failed before any cell ran: failed at once, with that result."""
        task = self._add(Task(mint_id(self.instance, TASK_ID_BYTES), owner, resource, None, keep_ms, False))
        self._end(task, TASK_FAILED, result)
        return task

    def watch(self, task: Task, watcher: Callable[[Task], None]) -> Callable[[], None]:
        """Call ``watcher`` at every status change of the task (once, however often it is given) until the
        returned callable is called or the task is dropped."""
        if watcher not in task.watchers:
            task.watchers.append(watcher)

        def unwatch() -> None:
            with contextlib.suppress(ValueError):
                task.watchers.remove(watcher)

        return unwatch

    @contextlib.contextmanager
    def subscribe(self, tasks: list[Task]) -> Iterator[asyncio.Queue]:
        """A listen stream's queue, for the request that runs this: each of the tasks at every status change;
        None when the server stops (``close`` then waits a moment for that request to end)."""
        queue: asyncio.Queue = asyncio.Queue()
        self.listeners[queue] = asyncio.current_task()
        unwatches = [self.watch(task, queue.put_nowait) for task in tasks]
        try:
            yield queue
        finally:
            del self.listeners[queue]
            for unwatch in unwatches:
                unwatch()

    def _set(self, task: Task, status: str) -> None:
        if status != task.status and not task.terminal:
            task.status, task.updated = status, time.time()
            for watcher in list(task.watchers):
                watcher(task)

    def _end(self, task: Task, status: str, result: dict | None = None, reason: str | None = None) -> None:
        """The terminal status (a cancelled handshake task keeps its status and gets its result)."""
        if result is not None:
            task.result = result
        if reason is not None:
            task.reason = reason
        if task.ended is None:
            task.ended = time.time()
        self._set(task, status)

    def refresh(self, task: Task) -> None:
        """Its status as its cell is now: input_required while the cell asks its client, else working."""
        self._set(task, TASK_INPUT_REQUIRED if task.question() is not None else TASK_WORKING)

    async def _follow(self, task: Task, finish: Callable[[], Awaitable[dict]]) -> None:
        try:
            await self._follow_cell(task, finish)
        finally:
            task.follower = None

    async def _follow_cell(self, task: Task, finish: Callable[[], Awaitable[dict]]) -> None:
        execution, resource = task.execution, task.resource
        while not execution.done:
            self.refresh(task)
            await resource.news.wait()
        if resource.retired:
            self._end(task, TASK_FAILED, reason=f"the kernel's resource was retired ({resource.retired}) "
                      f"before execution {execution.number} ended")
            return
        try:
            result = await finish()
        except Exception as exc:  # noqa: BLE001 - a fault of ours fails this task, not the server
            log(f"task {task.id}: rendering execution {execution.number} failed:\n{traceback.format_exc()}")
            self._end(task, TASK_FAILED, reason=f"rendering execution {execution.number} failed: {exc}")
            return
        if task.owner is not None and task.status != TASK_CANCELLED and result.get("isError"):
            self._end(task, TASK_FAILED, result)  # 2025-11-25: a result with isError fails the task
        elif task.cancel_asked and execution.state == INTERRUPTED:
            self._end(task, TASK_CANCELLED, None if task.owner is None else result)
        else:
            self._end(task, TASK_COMPLETED, result)

    def cancel(self, task: Task, now: bool) -> None:
        """Interrupt the task's cell (as the interrupt tool does); ``now`` moves it to cancelled at once
        (2025-11-25), else it is cancelled once the interrupt ended the cell (2026-07-28: cooperative, it may
        still complete)."""
        if task.terminal:
            return
        task.cancel_asked = True
        if task.execution is not None and task.resource.running is task.execution:
            task.resource.interrupt()
        if now:
            self._set(task, TASK_CANCELLED)

    def prune(self) -> None:
        """Drop finished tasks past their time (the executions' records are the resource's, and stay)."""
        now, self.pruned = time.time(), time.monotonic()
        for task in [task for task in self.tasks.values() if task.expired(now)]:
            self._drop(task)

    def _drop(self, task: Task) -> None:
        self.tasks.pop(task.id, None)
        if task.execution is not None and self.by_execution.get((task.execution, task.owner)) is task:
            del self.by_execution[(task.execution, task.owner)]
        if task.follower is not None:
            task.follower.cancel()
        task.watchers.clear()

    def forget(self, owner: Any) -> None:
        """An ended handshake session's tasks: no one can reach them any more."""
        for task in [task for task in self.tasks.values() if task.owner is owner]:
            self._drop(task)

    async def close(self, reason: str = "the server stopped before the cell ended") -> None:
        """The server stops: every live task fails, then every listen stream ends (with its last messages)."""
        if self.closed:
            return
        self.closed = True
        for task in list(self.tasks.values()):
            if not task.settled:  # (a cancelled one stays cancelled, its outcome this failure)
                if task.follower is not None:
                    task.follower.cancel()
                    task.follower = None
                self._end(task, TASK_FAILED, reason=reason)
        for queue in self.listeners:
            queue.put_nowait(None)
        if self.listeners:
            await asyncio.wait(list(self.listeners.values()), timeout=1.0)
            await asyncio.sleep(LISTEN_FLUSH)  # their transports write the final results


@dataclass
class TaskOffer:
    """A tool call that may become a task: a 2026-07-28 call whose client declared the extension (a task only
    when its cell outlives the call's own wait), or a handshake call that asked for one (``immediate``)."""

    board: TaskBoard
    owner: Any = None
    immediate: bool = False
    keep_ms: int = TASK_KEEP_MS
    elicits: bool = True

    def start(self, resource: Any, execution: Execution, finish: Callable[[], Awaitable[dict]]) -> Task:
        return self.board.track(resource, execution, finish, self.owner, self.keep_ms, self.elicits)


# ---------------------------------------------------------------- Resources & leases

RECENT_EXECUTIONS = 10
IDLE_STATUS = ("status", "idle")  # an IOPub status: the request it answers is done
# What status, the console and /api say of a resource's kernel (busy: a cell runs in it).
KERNEL_STARTING, KERNEL_IDLE, KERNEL_BUSY, KERNEL_DEAD = "starting", "idle", "busy", "dead"
NOT_IPYTHON_NOTICE = ("Notice: this is not an IPython kernel ({language}): the in-kernel loommux "
                      "object{startup} and %%loommux --kernel forwarding are IPython-only and off here; "
                      "the %%loommux header works (the server reads it and sends the cell with that line "
                      "blank).")
REPLY_AFTER_IDLE_GRACE = 1.0  # how long an idle kernel's execute_reply may lag behind
# A SIGINT before ipykernel runs a cell is lost (ignored between requests, or caught while the cell is being
# prepared, which ends it without a reply or not at all): an interrupt is sent once the cell's execute_input
# is this old, or, from a kernel that never says a cell began, this long after it was asked for.
INTERRUPT_SETTLE = 0.05
INTERRUPT_DUE_LIMIT = 1.0
# A resource's sessions hear of changes to the tools its kernel publishes (notifications/tools/list_changed)
# at most this often: changes within it are one notification at its end.
TOOLS_CHANGED_INTERVAL = 0.5
# What an IPython kernel is sent for a cell of blanks: it would not count those, and its count follows
# loommux's numbers (see KERNEL_BOOTSTRAP)
BLANK_CELL_CODE = "# (a blank cell)"


class ResourceError(Exception):
    """A failure of the resource layer, said in words; each kind's ``code`` (see ERROR_CODES) names it for
    every caller."""

    code: str

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Busy(ResourceError):
    code = BUSY

    def __init__(self, execution: Execution) -> None:
        by = f", {describe_other_client(execution)}," if is_other_client(execution) else ""
        super().__init__(f"execution {execution.number}{by} is still running "
                         f"({format_duration(execution.elapsed)}); cells are never queued")
        self.execution = execution


class ExecutionNotFound(ResourceError):
    code = EXECUTION_NOT_FOUND


class KernelUnavailable(ResourceError):
    code = KERNEL_UNAVAILABLE


class ResourceNotFound(ResourceError):
    code = RESOURCE_NOT_FOUND


class InvalidResourceName(ResourceError):
    code = INVALID_RESOURCE_NAME


class KernelNotFound(ResourceError):
    code = KERNEL_NOT_FOUND


class KernelNotOwned(ResourceError):
    code = KERNEL_NOT_OWNED


class ForwardingNotHere(ResourceError):
    code = INVALID_CELL_HEADER  # %%loommux --kernel, which only an IPython kernel's side forwards


@dataclass
class KernelReplacement:
    old: str  # the dead kernel's label: pid 123, or id <gateway id>
    reason: str
    execution: int | None


class KernelPool:
    """Starts kernels in the workspace, keeping ``spares`` of them warm for the next resource."""

    def __init__(self, workspace: Path, environ: dict[str, str], spares: int = 0, startup: Path | None = None,
                 gateway: Gateway | None = None, spec: KernelSpec | None = None,
                 inspectors: Path | None = None) -> None:
        self.workspace = workspace
        self.environ = environ
        self.gateway = gateway  # kernels run there when set
        self.spec = spec  # the kernelspec of every kernel (--kernelspec); None: this interpreter's ipykernel
        self.startup = startup  # the user's startup file, run in every kernel a resource adopts
        self.inspectors = inspectors  # the user's cell inspectors, loaded into each IPython kernel
        self.room: Callable[[], bool] = lambda: True  # whether another kernel may start (the registry's cap)
        self.size = spares
        self.spares: list[asyncio.Task] = []

    def limit(self, room: Callable[[], bool]) -> None:
        """Start a kernel only while ``room()`` says another may start (the registry's cap)."""
        self.room = room

    def fill(self) -> None:
        while len(self.spares) < self.size and self.room():
            self.spares.append(asyncio.ensure_future(self._start()))

    async def _start(self, kernel_id: str | None = None) -> Kernel:
        gateway = self.gateway
        kernel = (GatewayKernel(gateway, kernel_id) if gateway
                  else LaunchedKernel(self.workspace, self.environ, self.spec))
        await kernel.start()
        kernel.on_exit = self._spare_died  # replaced when a resource adopts it
        return kernel

    def _spare_died(self, kernel: Kernel, code: int | None) -> None:
        log(f"spare kernel {kernel.label} {kernel.exit_reason(code)}; starting another")
        self.spares = [t for t in self.spares
                       if not (t.done() and not t.exception() and t.result() is kernel)]
        asyncio.ensure_future(kernel.stop(grace=0))
        self.fill()

    async def take(self, kernel_id: str | None = None) -> Kernel:
        """A started kernel: a warm spare when there is one (then replaced in the background), else a new one
        (on the gateway, created with ``kernel_id`` when given)."""
        if self.spares:
            spare = self.spares.pop(0)
            self.fill()
            try:
                kernel = await spare
                if kernel.alive:
                    return kernel
            except KernelError as exc:
                log(f"a spare kernel failed to start: {exc}")
        return await self._start(kernel_id)

    async def close(self) -> None:
        spares, self.spares, self.size = self.spares, [], 0
        for spare in spares:
            if spare.done() and not spare.cancelled() and not spare.exception():
                await spare.result().stop()
            else:
                spare.cancel()
        await asyncio.gather(*spares, return_exceptions=True)  # a cancelled start stops what it started


# -- a resource's parts: the kernel it holds, its execution sequence, the question input() puts, its tenancy


@dataclass
class HeldKernelRecord:
    """What the instance's state keeps of the kernel a resource holds: its id on the gateway (None: it has
    none running; restored, "" too: it had none)."""

    remote_id: str | None


@dataclass(frozen=True)
class UserFile:
    """A user's file run in each new IPython kernel: what it is called in the log and the next result, and
    what its failure leaves out."""

    path: Path
    code: str
    timeout: float
    what: str  # "Inspectors file"
    without: str = ""  # "; cells run without inspectors."


async def try_user_file(kernel: Kernel, user_file: UserFile, notices: list[str]) -> tuple[str | None, bool]:
    """A user's file run in a new kernel (see Kernel.run_user_file): why it failed (None: it ran), said in
    the log and in ``notices``, and whether it lost the kernel, which a new kernel without that file then
    replaces."""
    try:
        failure, lost = await kernel.run_user_file(user_file.path, user_file.code, user_file.timeout), False
    except KernelLost as exc:
        said = str(exc) if kernel.alive else f"{exc} while it ran"  # it died, or it hung
        failure, lost = f"{said}; a new kernel was started without it", True
    if failure:
        log(f"the {user_file.what.lower()} {user_file.path} failed in kernel {kernel.label}: {failure}")
        notices.append(f"{user_file.what} failed: {failure}{user_file.without}")
    return failure, lost


async def adopt_gateway_kernel(gateway: Gateway, resource: Resource, remote_id: str) -> Kernel | None:
    """The gateway kernel a resource had before the server restarted ("": none had started yet), joined
    again with its variables as they were; None when the gateway no longer has it (a new one is started).
    The next result says which, once."""
    kernel = GatewayKernel(gateway)
    found = bool(remote_id) and await kernel.adopt(remote_id)
    sequence = resource.sequence
    if found:
        log(f"joined gateway kernel {remote_id} again for resource {resource.id}")
        how = f"joined this kernel (id {remote_id}) again: its variables are as they were"
    else:
        what = f"its kernel (id {remote_id}) was gone from the gateway" if remote_id else "it had no kernel"
        log(f"resource {resource.id}: {what} after the restart: starting a new kernel")
        sequence.event("restart", f"loommux restarted and {what}: variables are gone")
        how = f"{what}: this is a new kernel, variables are gone"
    last, skipped = sequence.ran_before, sequence.describe_skipped()
    following = f"{sequence.first} ({skipped})" if skipped else f"{sequence.first}"
    gone = (sequence.describe_ran_before() if last
            else "the output of any cell run in it is gone" if skipped else "no cell had run in it")
    at = time.strftime("%H:%M:%S")
    resource.notices.append(f"Server restarted: loommux restarted and, at {at}, {how}, and {gone}; execution "
                            f"numbers continue at {following}.")
    return kernel if found else None


class KernelHolder:
    """The kernel a resource holds, the same way whichever source its kernels come from (the pool, its spares
    and the gateway's; or a ``KernelSource``: a kernelspec, a person's kernel attached with --existing):
    started, adopted (the gateway kernel a restart of the server kept), joined again (an attached kernel that
    answers again after it was lost) and replaced (after a death, or on restart). ``state`` is starting, idle
    or dead: the resource says busy while a cell runs."""

    def __init__(self, resource: Resource, pool: KernelPool, source: KernelSource | None) -> None:
        self.resource = resource
        self.pool = pool
        self.source = source  # where its kernels come from when not the pool: a kernelspec, a person's kernel
        self.kernel: Kernel | None = None
        self.state = KERNEL_STARTING
        self.ready: asyncio.Future | None = None
        # done once the kernel being started runs the startup file (which may take minutes: see settled)
        self.booted: asyncio.Future | None = None
        self.after: asyncio.Future | None = None  # an eviction to finish before it starts a kernel
        # kept over a restart of the server: the gateway kernel it had, to join again ("": it had none)
        self.adopting: str | None = None
        self.detached_reason: str | None = None  # why its attached kernel is gone, until it answers again
        self.startup_failure: str | None = None  # why the startup file failed in the current kernel
        self.replacements: list[KernelReplacement] = []
        self.starting: Kernel | None = None  # a new kernel being prepared: recorded before it is ready
        self.creating: str | None = None  # the id a gateway kernel is being created with: recorded first

    def record(self) -> HeldKernelRecord:
        kernel = self.starting or self.kernel
        remote_id = kernel.remote_id if kernel is not None else None
        return HeldKernelRecord(self.adopting or remote_id or self.creating)

    def restore(self, record: HeldKernelRecord) -> None:
        """Hold again, once started, the gateway kernel a restart of the server kept."""
        self.adopting = record.remote_id or ""

    def wait_for(self, eviction: asyncio.Future | None) -> None:
        """Start no kernel before this eviction has made room."""
        self.after = eviction

    def start(self) -> asyncio.Future:
        """Start a kernel in the background; the returned future is done when it is ready."""
        if self.ready is not None and not self.ready.done():
            self.ready.cancel()  # never two kernels starting for one resource
        self.state = KERNEL_STARTING
        self.booted = asyncio.get_running_loop().create_future()
        self.ready = asyncio.ensure_future(self._start())
        return self.ready

    async def _start(self) -> Kernel:
        if self.after is not None:
            await asyncio.shield(self.after)
        try:
            adopted = None if self.adopting is None else await self._adopt(self.adopting)
            kernel = adopted if adopted is not None else await self._take()
        except BaseException:
            self.state = KERNEL_DEAD
            raise
        self._attend(kernel)
        if adopted is None:  # an adopted one has its kernel side, identity and startup file in it already
            kernel = await self._prepare_new(kernel)
        elif kernel.ipython:  # the tools it publishes were announced to the server before the restart
            kernel.tasks.append(asyncio.ensure_future(self._recall_published(kernel)))
        self.kernel, self.state = kernel, KERNEL_IDLE
        self.resource.reports.changed()
        return kernel

    def _attend(self, kernel: Kernel) -> None:
        """Make a kernel's messages, death and lost messages this holder's."""
        kernel.on_message, kernel.on_exit = self._on_message, self._on_exit
        kernel.counter.on_loss = self.resource.sequence.on_loss

    async def _prepare_new(self, kernel: Kernel) -> Kernel:
        """Prepare a new kernel; one that a user's file lost (it died, or hung past an interrupt, running it)
        is replaced at once by a kernel that runs the other file only (two files: three kernels at most)."""
        skipped: set[Path] = set()
        while True:
            self.starting = kernel
            try:
                lost = await self._prepare(kernel, skipped)
            finally:
                if self.starting is kernel:
                    self.starting = None
            if lost is None:
                return kernel
            skipped.add(lost)
            await kernel.stop(grace=0)
            try:
                kernel = await self._take()
            except BaseException:
                self.state = KERNEL_DEAD
                raise
            self._attend(kernel)

    async def _take(self) -> Kernel:
        """A new kernel: the pool's, or its source's (after a loss, the attached kernel joined again)."""
        pool = self.pool
        if self.source is not None:
            rejoin = self.detached_reason is not None
            return await self.source.start(pool.workspace, pool.environ, rejoin=rejoin)
        if pool.gateway is None:
            return await pool.take()
        # A gateway kernel is created with an id of its own, which the instance's state records first: a
        # SIGKILL while the gateway creates it leaves no kernel there that the state does not know (the
        # restart creates it with that id, and the gateway answers the one it made meanwhile).
        self.creating = self.creating or str(uuid.uuid4())
        try:
            await self.resource.reports.record()
            return await pool.take(self.creating)
        finally:
            self.creating = None

    async def _prepare(self, kernel: Kernel, skipped: set[Path]) -> Path | None:
        """Give a new kernel its loommux side and the user's files but those ``skipped``; the notices say
        what it is. The file that lost the kernel, if one did."""
        resource = self.resource
        try:
            # The instance's state records it before a result from it can reach a client: a SIGKILL from now
            # on leaves no kernel on the gateway that the state does not know (see StateKeeper.flush).
            await resource.reports.record()
            if kernel.ipython:
                notebook = resource.notebook
                local = notebook is not None and self.pool.gateway is None  # a file a local kernel reads
                count = resource.sequence.last_number + 1 if kernel.owned else None
                await kernel.bootstrap(count, kernel_id=resource.id, name=resource.kernel_name,
                                       control_url=resource.control_url, token=resource.token,
                                       notebook_file=str(notebook.path) if local else None)
        except BaseException:
            self.state = KERNEL_DEAD
            await kernel.stop(grace=0)
            raise
        if not kernel.ipython and resource.sequence.last_number == 0 and not resource.notices:
            startup = ", the startup file" if self.pool.startup else ""
            resource.notices.append(NOT_IPYTHON_NOTICE.format(language=kernel.language, startup=startup))
        if self.detached_reason is not None:
            resource.notices.append(f"Kernel reconnected: the kernel {kernel.label} answers again "
                                    f"({kernel.language}); its variables are as its owner left them.")
            self.detached_reason = None
        return await self._run_user_files(kernel, skipped) if kernel.ipython else None

    async def _run_user_files(self, kernel: Kernel, skipped: set[Path]) -> Path | None:
        """The inspectors file, then the startup file, in a new IPython kernel; a failure is said in the log
        and in the next result, and the kernel goes on without it. The file that lost the kernel (which is
        then replaced: see _prepare_new), if one did."""
        pool, notices = self.pool, self.resource.notices
        if pool.inspectors is not None and pool.inspectors not in skipped:
            inspectors = UserFile(pool.inspectors, INSPECTORS_CODE, INSPECTORS_TIMEOUT, "Inspectors file",
                                  "; cells run without inspectors.")
            if (await try_user_file(kernel, inspectors, notices))[1]:
                return pool.inspectors
        if self.booted is not None and not self.booted.done():
            self.booted.set_result(None)
        if pool.startup is not None and pool.startup not in skipped:
            startup = UserFile(pool.startup, STARTUP_CODE, STARTUP_TIMEOUT, "Startup file")
            self.startup_failure, lost = await try_user_file(kernel, startup, notices)
            if lost:
                return pool.startup
        return None

    async def _adopt(self, remote_id: str) -> Kernel | None:
        """The gateway kernel the resource had before the server restarted, joined again (see
        adopt_gateway_kernel); an unreachable gateway fails this start: the next call tries again."""
        assert self.pool.gateway is not None
        kernel = await adopt_gateway_kernel(self.pool.gateway, self.resource, remote_id)
        self.adopting = None
        if kernel is None:
            self.creating = remote_id or None  # made with that id: one the gateway still created is joined
        return kernel

    def _on_message(self, kernel: Kernel, channel: str, message: Message) -> None:
        """A message of its kernel: an announcement of the tools it publishes, else one for its cells."""
        if channel == "iopub" and message.msg_type == PUBLISHED_MSG_TYPE:
            self.take_published(kernel, message.content)
        else:
            self.resource.sequence.on_message(kernel, channel, message)

    def take_published(self, kernel: Kernel, snapshot: Any) -> None:
        """The tools a kernel publishes now (announced on IOPub, or in a reset's answer); sessions hear of a
        change."""
        if kernel.published.take(snapshot):
            self.resource.reports.tools()

    async def _recall_published(self, kernel: Kernel) -> None:
        """Ask a kernel joined again after a restart of the server what it publishes (answered once no cell
        holds its main shell)."""
        answer = await kernel.ask_namespace({"tool": "published"}, None)
        if answer:
            self.take_published(kernel, answer)

    def _drop_published(self, old: Kernel | None, why: str) -> None:
        """A kernel replaced: the tools it published are gone, said in the next result."""
        if old is not None and old.published.tools:
            names = ", ".join(old.published.tools)
            self.resource.notices.append(f"Unpublished: {names} ({why}); loommux.publish them again in the "
                                         "new kernel.")
            self.resource.reports.tools()

    async def settled(self) -> BaseException | None:
        """Wait until the kernel being started is ready (or runs the startup file, which the first call
        waits for) or has failed; return the failure."""
        ready = self.ready
        if ready is None:
            return None
        await asyncio.wait({ready, self.booted}, return_when=asyncio.FIRST_COMPLETED)
        return None if not ready.done() or ready.cancelled() else ready.exception()

    async def ensure(self) -> Kernel:
        """The ready kernel, starting a new one if the last one died."""
        self.resource.tenancy.check_not_retired()
        ready = self.ready
        if self.detached_reason is not None and ready is not None and not ready.done():
            raise KernelUnavailable(self.detached_reason)
        if ready is None or (ready.done()
                             and (ready.cancelled() or ready.exception() or not ready.result().alive)):
            self.start()
        try:
            return await asyncio.shield(self.ready)
        except (KernelError, OSError) as exc:
            raise KernelUnavailable(f"the kernel could not start: {exc}") from None

    def check_owned(self) -> None:
        """KernelNotOwned when its kernel is a person's (attached with --existing): never restarted here."""
        if self.source is not None and not self.source.owned:
            where = self.kernel.label if self.kernel else f"at {self.source.existing}"
            raise KernelNotOwned(f"the kernel {where} is not loommux's (attached with --existing): "
                                 "restart it where it was started (JupyterLab: Kernel > Restart Kernel; "
                                 "or its owner); loommux joins it again when it answers")

    async def replace(self) -> Kernel:
        """A new kernel for the one held (a restart): the new one boots while the old one shuts down."""
        old, self.kernel = self.kernel, None
        self._drop_published(old, "the kernel was restarted")
        self.start()
        if old is not None:
            await old.stop(grace=1.0)
        return await self.ensure()

    def _on_exit(self, kernel: Kernel, code: int | None) -> None:
        if kernel is not self.kernel:
            return
        if not kernel.owned:
            self._detached(kernel)
            return
        sequence = self.resource.sequence
        killed = sequence.running
        reason = kernel.exit_reason(code)
        log(f"kernel {kernel.label} died: {reason}")
        sequence.kill_running(f"kernel {reason}")
        self.replacements.append(KernelReplacement(kernel.label, reason, killed.number if killed else None))
        was_killed = f"; execution {killed.number} was killed" if killed else ""
        sequence.event("death", f"kernel {kernel.label} {reason}{was_killed}; a new kernel was started")
        self._start_after(kernel)

    def _detached(self, kernel: Kernel) -> None:
        """An attached kernel stopped: said once; joined again when a kernel answers on its connection
        file."""
        sequence = self.resource.sequence
        reason = kernel.exit_reason(None)
        log(f"kernel {kernel.label} {reason}")
        killed = sequence.running.number if sequence.running else None
        sequence.kill_running(f"the kernel {reason}")
        self.detached_reason = (f"the kernel {kernel.label} {reason} at {time.strftime('%H:%M:%S')}; loommux "
                                "joins it again when a kernel answers on that connection file")
        was_killed = f"; execution {killed} was killed." if killed else "."
        self.resource.notices.append(f"Kernel lost: {self.detached_reason}{was_killed}")
        self._start_after(kernel)
        self.state = KERNEL_DEAD  # until a kernel answers again

    def _start_after(self, dead: Kernel) -> None:
        self.kernel = None
        self._drop_published(dead, "the kernel was replaced")
        self.start()
        asyncio.ensure_future(dead.stop(grace=0))

    def take_replacements(self) -> list[str]:
        """One line per kernel replacement since they were last taken."""
        lines = []
        for event in self.replacements:
            killed = f"; execution {event.execution} was killed" if event.execution else ""
            new = self.kernel if self.kernel and self.kernel.alive else None
            state = f"replacement kernel {new.label} is ready" if new else "a replacement kernel is starting"
            lines.append(f"Kernel replaced: kernel {event.old} {event.reason}{killed}; {state}.")
        self.replacements.clear()
        return lines

    async def close(self) -> None:
        """Stop the kernel, or the start under way (a cancelled start stops what it started)."""
        if self.ready is not None and not self.ready.done():
            self.ready.cancel()
            await asyncio.wait({self.ready})
        if self.kernel is not None:
            await self.kernel.stop()
        elif self.adopting and self.pool.gateway is not None:  # kept over a restart, never joined again
            await GatewayKernel(self.pool.gateway, self.adopting).stop(grace=0)


@dataclass
class SequenceRecord:
    """What the instance's state keeps of an execution sequence: its last number, and how far numbers are
    reserved (output is never kept)."""

    last_number: int
    reserved: int = 0  # a record without it: reserved as far as its last number


EXECUTION_NUMBER_BLOCK = 100  # execution numbers reserved in the instance's state at a time
FOLLOW_DELAY = 0.5  # a running cell's output is in its files at most this long after it arrived


class NumberReservation:
    """Execution numbers reserved ahead in the instance's state, a block at a time, so that a number shown to
    a client is never given to another cell after a SIGKILL (a restart numbers on after the reserved ones).
    The next block is reserved, its write under way, once the current one is half used; a cell waits for that
    write only when it reaches the bound already written. Without a state directory the write does
    nothing."""

    def __init__(self, record: Callable[[], Awaitable[None]]) -> None:
        self.record = record  # writes the instance's state now
        self.bound = 0  # numbers up to this are reserved: what the state records
        self.written = 0  # numbers up to this are reserved in the state written
        self.writing: asyncio.Future | None = None  # the write of the latest bound, under way

    def restore(self, bound: int) -> None:
        self.bound = self.written = bound

    def reserve(self, number: int) -> None:
        """Number ``number`` is about to be given: reserve the next block once the current one is half
        used (another client's cell, seen after it began, cannot wait for the write)."""
        if number > self.bound - EXECUTION_NUMBER_BLOCK // 2:
            self.bound = max(self.bound, number - 1) + EXECUTION_NUMBER_BLOCK
            self.writing = asyncio.ensure_future(self._write(self.bound))

    async def _write(self, bound: int) -> None:
        await self.record()
        self.written = max(self.written, bound)

    async def reach(self, number: int) -> None:
        """Reserve number ``number``, and return once the state written reserves it (a write that failed
        was said, and does not hold the cell up)."""
        self.reserve(number)
        if number > self.written and self.writing is not None:
            await asyncio.shield(self.writing)


class ExecutionSequence:
    """A resource's executions, numbered in the order they began (its own cells, and cells other Jupyter
    clients run in its kernel): the running cell, the kernel's messages routed to each, an interrupt held
    until its cell has begun, and the restarts and deaths its notebook shows among them."""

    def __init__(self, resource: Resource) -> None:
        self.resource = resource
        self.executions: list[Execution] = []  # execution n at n - first
        self.by_request: dict[str, Execution] = {}  # by the msg_id of its execute_request
        self.last_number = 0  # the last execution's number
        self.first = 1  # the first execution kept (after a restart of the server, the one after its record's)
        self.ran_before = 0  # the last number the state recorded as given before a restart of the server
        self.reservation = NumberReservation(lambda: resource.reports.record())
        self.files: OutputFiles | None = None  # where its executions' output is written (None: memory)
        self.earlier: dict[int, Execution] = {}  # those a restart of the server took back, by number
        self.following = False  # the running cell's output is due to be written out (see _follow)
        self.running: Execution | None = None
        self.others: dict[str, Execution] = {}  # cells other Jupyter clients run, by their request's msg_id
        self.interrupt_due: Execution | None = None  # an interrupt held until the cell has begun
        self.begun_at: float | None = None  # when the running cell's first IOPub message came
        # For its notebook: restarts and deaths, as (the next execution's number, when, kind, what happened).
        self.events: list[tuple[int, float, str, str]] = []

    def record(self) -> SequenceRecord:
        """Its last number given (before a restart of the server, when none since), and the reserved ones."""
        given = self.last_number if self.last_number >= self.first else self.ran_before
        return SequenceRecord(given, self.reservation.bound)

    def restore(self, record: SequenceRecord) -> None:
        """Go on after the executions a restart of the server lost, and the numbers it had reserved: numbered
        from the one after."""
        reserved = max(record.reserved, record.last_number)
        self.ran_before, self.last_number, self.first = record.last_number, reserved, reserved + 1
        self.reservation.restore(reserved)

    def describe_skipped(self) -> str:
        """The numbers reserved before a restart of the server and never given since, said ("": none)."""
        first, last = self.ran_before + 1, self.first - 1
        if first > last:
            return ""
        if first == last:
            return f"number {first} was reserved before the restart and is skipped"
        return f"numbers {first} to {last} were reserved before the restart and are skipped"

    def keep_files(self, files: OutputFiles) -> None:
        """Write the output of executions from now on to these files."""
        self.files = files

    def take_back(self) -> None:
        """After a restart of the server: the executions the kept output directory recorded before it, with
        their output (a record that is not one is left out, said in the log)."""
        ends, begins = {}, {}
        for record in self.files.read_journal() if self.files is not None else ():
            if "end" not in record:
                begins[record["n"]] = record.get("begin")
            elif isinstance(ended := ends.get(record["n"]), dict) and isinstance(record["end"], dict):
                ends[record["n"]] = {**ended, **record["end"]}  # an amendment (see describe_lost_since_end)
            else:
                ends[record["n"]] = record["end"]
        for number in sorted(n for n in begins if 0 < n < self.first):
            try:
                self.earlier[number] = restore_execution(number, begins[number], ends.get(number), self.files)
            except (ValueError, TypeError, KeyError, AttributeError, ArithmeticError) as exc:
                log(f"resource {self.resource.id}: execution {number}'s record is not one ({exc}): left out")

    def keep(self, execution: Execution) -> None:
        """Keep a new execution, numbered the next number (reserved: see NumberReservation), and record it
        in a kept output directory."""
        self.last_number = execution.number
        self.resource.reports.changed()
        self.executions.append(execution)
        if self.files is not None:
            self.files.note(describe_begin(execution))

    def check_idle(self) -> None:
        """Busy while a cell runs, ours or another client's (the kernel would queue ours behind it)."""
        if self.running is not None:
            raise Busy(self.running)
        for other in self.others.values():
            raise Busy(other)

    async def begin(self, kernel: Kernel, source: str, options: CellOptions,
                    listener: Callable[[str | None, str], None] | None, stdin: bool,
                    by: tuple[str, str | None] | None) -> Execution:
        """Number a cell (its number reserved in the instance's state first) and send it to the kernel."""
        await self.reservation.reach(self.last_number + 1)
        execution = Execution(self.last_number + 1, source, options, kernel.pid, listener, by=by,
                              files=self.files)
        self.keep(execution)
        self.running, self.begun_at = execution, None
        kernel.counter.tag = execution
        sent = source if kernel.ipython or not options.header else "\n" + source.partition("\n")[2]
        if kernel.ipython and not sent.strip():
            sent = BLANK_CELL_CODE
        self.by_request[await kernel.execute(sent, allow_stdin=stdin)] = execution
        self.resource.changed(execution)
        return execution

    def on_message(self, kernel: Kernel, channel: str, message: Message) -> None:
        """Route a message of the held kernel to its execution."""
        held = self.resource.kernel
        execution = self.by_request.get(message.parent_id)
        if execution is None and kernel is held and channel == "iopub":
            execution = self._seen_other_client(kernel, message)
        if kernel is not held or execution is None:
            return
        if channel == "stdin":
            if message.msg_type == "input_request":
                self.resource.asking.requested(execution, message.content)
        elif execution is self.running:
            self._to_running(execution, channel, message)
        else:
            self._to_not_running(execution, channel, message)

    def _to_running(self, execution: Execution, channel: str, message: Message) -> None:
        if channel == "iopub":
            if (message.msg_type, message.content.get("execution_state")) == IDLE_STATUS:
                execution.idle = True
                if not execution.replied:  # a kernel whose handler failed never replies at all
                    asyncio.get_running_loop().call_later(REPLY_AFTER_IDLE_GRACE, self.finish, execution)
            elif message.msg_type != "status":
                execution.ingest(message.msg_type, message.content)
                self._follow()
                if self.begun_at is None:  # its execute_input: the kernel has begun the cell
                    self.begun_at = time.monotonic()
                    if self.interrupt_due is execution:
                        self._interrupt_later(INTERRUPT_SETTLE, execution)
        elif channel == "shell" and message.msg_type == "execute_reply":
            execution.on_reply(message.content)
        if execution.replied and execution.idle:
            # Output between the reply and the idle status belongs to the cell: finish only now.
            self.finish(execution)

    def _follow(self) -> None:
        """The running cell printed: its files get what it printed within FOLLOW_DELAY, for a person following
        them with tail -f (a read writes it at once; a cell printing fast fills a piece sooner)."""
        if not self.following and self.files is not None:
            self.following = True
            asyncio.get_running_loop().call_later(FOLLOW_DELAY, self._write_out)

    def _write_out(self) -> None:
        self.following = False
        if self.running is not None:
            self.running.write_out()

    def _to_not_running(self, execution: Execution, channel: str, message: Message) -> None:
        """Output a thread an ended cell left prints later; the end of another client's cell."""
        if channel == "iopub" and message.msg_type != "status":
            execution.ingest(message.msg_type, message.content)
            execution.fits = None
            self.resource.changed(execution)
        elif (is_other_client(execution)
              and (message.msg_type, message.content.get("execution_state")) == IDLE_STATUS):
            self.others.pop(message.parent_id, None)
            execution.finish()
            self.resource.changed(execution)

    def on_loss(self, execution: Execution | None, count: int) -> None:
        """Messages of the kernel's that never arrived (or, count < 0, arrived late after all): the latest
        execution's (a thread a cell left prints into it too), or nobody's before the first cell."""
        if execution is not None:
            execution.lost += count
            if execution.done and execution.files is not None:  # its end is journaled: amend it
                execution.files.note(describe_lost_since_end(execution))

    def _seen_other_client(self, kernel: Kernel, message: Message) -> Execution | None:
        """A cell another Jupyter client (a person's console or notebook) runs in this kernel, seen by its
        execute_input: recorded in the same sequence, its output gathered like any other's."""
        if message.msg_type != "execute_input" or message.parent_session in (None, kernel.session.session):
            return None
        user = message.parent_username
        by = (OTHER_CLIENT, user if user and user != "username" else None)
        code = str(message.content.get("code", ""))
        self.reservation.reserve(self.last_number + 1)  # already begun: it cannot wait for the write
        execution = Execution(self.last_number + 1, code, CellOptions(), kernel.pid, by=by, files=self.files)
        self.keep(execution)
        self.by_request[message.parent_id] = self.others[message.parent_id] = execution
        self.resource.changed(execution)
        return execution

    def finish(self, execution: Execution) -> None:
        """The running cell ended (replied and idle, or idle and never replying)."""
        if execution is self.running:
            asking = self.resource.asking
            asking.clear()
            self.resource.touch()
            execution.finish()
            self.running = None
            asking.pulse()
            self.resource.changed(execution)

    def kill_running(self, reason: str) -> None:
        """End the running cells, ours and other clients', as killed for the reason given."""
        if self.running is not None:
            asking = self.resource.asking
            asking.clear()
            killed, self.running = self.running, None
            killed.finish(KILLED, reason)
            asking.pulse()
            self.resource.changed(killed)
        others, self.others = list(self.others.values()), {}
        for other in others:
            other.finish(KILLED, reason)
            self.resource.changed(other)

    def forget(self) -> None:
        """Drop the records and their files (the resource was retired)."""
        self.executions.clear()
        self.by_request.clear()
        if self.files is not None:
            self.files.remove()

    def event(self, kind: str, text: str) -> None:
        """A restart or a death, where it happened among the executions (a notebook shows it there)."""
        self.events.append((self.last_number + 1, time.time(), kind, text))
        self.resource.changed(None)

    def find_numbered(self, number: int) -> Execution | None:
        """Execution ``number``, if there is one (they are numbered first, first + 1, ... in the list; those
        before, from a restart of the server, kept by number)."""
        index = number - self.first
        return self.executions[index] if 0 <= index < len(self.executions) else self.earlier.get(number)

    def select(self, number: int | None) -> Execution:
        """The given execution; else the running one; else the most recent one."""
        if number is not None:
            execution = self.find_numbered(number)
            if execution is None:
                raise ExecutionNotFound(f"there is no execution {clip(str(number), QUOTED_ID_CHARS)}; "
                                        f"{self.numbering()}")
            return execution
        if self.running is not None:
            return self.running
        if self.last is None:
            raise ExecutionNotFound(self.numbering())
        return self.last

    def describe_ran_before(self) -> str:
        """What became of the executions before a restart of the server: kept (its output directory kept their
        records and files), or gone ("": none ran)."""
        if not self.ran_before:
            return ""
        ran = "execution 1" if self.ran_before == 1 else f"executions 1 to {self.ran_before}"
        missing = self.ran_before - len(self.earlier)
        if not self.earlier:
            return f"the output of {ran} is gone (no record of it was kept)"
        gone = f" but for {pluralize(missing, 'execution')} whose record is gone" if missing else ""
        cut = [e.number for e in self.earlier.values() if e.reason == CUT_OFF_REASON]
        running = f" (execution {cut[0]} was running: its output from then on is not)" if cut else ""
        return f"the output of {ran} is kept{gone}{running}"

    def numbering(self) -> str:
        """Which executions there are, and which were lost to a restart of the server."""
        before = "; ".join(part for part in (self.describe_ran_before(), self.describe_skipped()) if part)
        if self.last_number >= self.first:
            now = f"executions are numbered {self.first} to {self.last_number}"
        else:
            now = "no cell has run yet" if not before else "no cell has run since"
        return f"{before}; {now}" if before else now

    def interrupt(self) -> Execution | None:
        """Interrupt the running cell. A kernel ignores SIGINT until it begins a cell (ipykernel sets SIG_IGN
        between cells), so an interrupt asked for before the cell's execute_input is sent when that
        arrives."""
        execution = self.running
        if execution is not None and self.resource.kernel is not None:
            execution.interrupt_sent = execution.interrupt_sent or not execution.replied
            self.resource.asking.clear()  # input() raises KeyboardInterrupt
            self.interrupt_due = execution
            if self.begun_at is None:  # sent once it has begun and settled, or after a while anyway
                self._interrupt_later(INTERRUPT_DUE_LIMIT, execution)
            else:
                self._interrupt_later(self.begun_at + INTERRUPT_SETTLE - time.monotonic(), execution)
        return execution

    def _interrupt_later(self, delay: float, execution: Execution) -> None:
        asyncio.get_running_loop().call_later(max(0.0, delay), self._interrupt_due, execution)

    def _interrupt_due(self, execution: Execution) -> None:
        """Send a due interrupt. One sent before the kernel said it began the cell may have been ignored: it
        stays due, and is sent again once the cell begins."""
        if self.interrupt_due is execution:
            if self.begun_at is not None:
                self.interrupt_due = None
            kernel = self.resource.kernel
            if execution is self.running and kernel is not None:
                kernel.interrupt()

    @property
    def last(self) -> Execution | None:
        if self.executions:
            return self.executions[-1]
        return self.earlier[max(self.earlier)] if self.earlier else None

    def list_recent(self, count: int = RECENT_EXECUTIONS) -> list[Execution]:
        """The last count executions, newest first (what status shows: it never walks them all)."""
        recent = self.executions[: -count - 1 : -1]
        if len(recent) < count and self.earlier:
            recent += [self.earlier[n] for n in sorted(self.earlier, reverse=True)[: count - len(recent)]]
        return recent


@dataclass(eq=False)
class Question:
    """A cell waiting in input() for the person's answer, until it is answered or cleared (an interrupt, a
    restart, the cell's end). ``key`` names it in a 2026-07-28 task's inputRequests (unique per resource)."""

    resource: Resource
    execution: Execution
    prompt: str
    key: str
    cleared: asyncio.Event = field(default_factory=asyncio.Event)


def asks_for_secret(content: dict) -> bool:
    """An input_request that must never become a form: getpass, or a prompt that reads like a secret's."""
    return bool(content.get("password")) or bool(SECRET_PROMPT_RE.search(str(content.get("prompt", ""))))


class Asking:
    """The question the running cell's input() puts to the person (through a client that can ask), until it
    is answered or cleared; and ``news``, set and replaced when the running cell asks, is answered or ends:
    whoever waits on it looks again (one event for all three: a wait costs no more than before)."""

    def __init__(self, resource: Resource) -> None:
        self.resource = resource
        self.question: Question | None = None
        self.news = asyncio.Event()
        self.asked = 0  # questions asked so far: the next one's key

    def requested(self, execution: Execution, content: dict) -> None:
        """The kernel's input_request: a question when the running cell asks for no secret, else input() ends
        at once."""
        if execution is not self.resource.running or asks_for_secret(content):
            asyncio.ensure_future(self._reply(None))  # never a form
            return
        self.asked += 1
        self._pose(Question(self.resource, execution, str(content.get("prompt", "")), f"input-{self.asked}"))

    def clear(self) -> None:
        """Clear the question asked, if any."""
        if self.question is not None:
            self._pose(None)

    def _pose(self, question: Question | None) -> None:
        old, self.question = self.question, question
        if old is not None:
            old.cleared.set()
        self.pulse()

    def pulse(self) -> None:
        """Whoever waits on the news looks again."""
        news, self.news = self.news, asyncio.Event()
        news.set()

    def find_question(self, execution: Execution) -> Question | None:
        question = self.question
        return question if question is not None and question.execution is execution else None

    async def answer(self, question: Question, text: str | None) -> bool:
        """Answer a question still asked: the text input() returns, or None (declined: it raises EOFError);
        False when the question was cleared meanwhile (the answer is then ignored)."""
        if question is not self.question:
            return False
        self.clear()
        await self._reply(text)
        return True

    async def _reply(self, text: str | None) -> None:
        kernel = self.resource.kernel
        if kernel is not None and kernel.alive:
            await kernel.answer_input(INPUT_EOF if text is None else text)


class Tenancy:
    """Who holds a resource: its leases; since when none does (an orphan, retired once its grace is over)
    and why, and the cell it lets finish first; its retirement, after which it is never held again."""

    def __init__(self) -> None:
        self.leases: set[Lease] = set()
        self.orphan_since: float | None = None
        self.orphan_reason = ""
        self.orphan_execution: int | None = None  # a cell allowed to finish before retirement
        self.retired: str | None = None

    def add(self, lease: Lease) -> None:
        self.leases.add(lease)
        self.orphan_since, self.orphan_execution = None, None

    def discard(self, lease: Lease, reason: str) -> None:
        """A lease ended; the last one's reason is the orphan's."""
        self.leases.discard(lease)
        if not self.leases and self.orphan_since is None:
            self.orphan_since, self.orphan_reason = time.monotonic(), reason

    def let_finish(self, number: int) -> None:
        """An orphan whose grace is over waits for its running cell, execution ``number``."""
        self.orphan_execution = number

    def retire(self, reason: str) -> None:
        self.retired = reason

    def check_not_retired(self) -> None:
        """KernelUnavailable once retired: its sessions get a fresh resource at their next call."""
        if self.retired:
            raise KernelUnavailable(f"this resource was retired ({self.retired}); call again to get a fresh "
                                    "one")


async def record_nothing() -> None:
    """What a resource no registry has adopted records: nothing."""


@dataclass(frozen=True)
class StateReports:
    """Where a resource tells the instance's state of a change to what it records: ``changed`` (written
    soon, behind the answer) or ``record`` (written now: awaited before what it records is shown); and its
    registry of a change to the tools its kernel publishes (``tools``)."""

    changed: Callable[[], None] = lambda: None
    record: Callable[[], Awaitable[None]] = record_nothing
    tools: Callable[[], None] = lambda: None  # the tools its kernel publishes changed: its sessions hear it


class Throttle:
    """Calls ``fire`` at once when poked, then at most once an interval: the pokes within an interval are one
    call at its end."""

    def __init__(self, interval: float, fire: Callable[[], None]) -> None:
        self.interval, self.fire = interval, fire
        self.fired_at = float("-inf")  # time.monotonic() of the last call
        self.later: asyncio.TimerHandle | None = None  # the call due at the interval's end

    def poke(self) -> None:
        if self.later is not None:
            return
        wait = self.fired_at + self.interval - time.monotonic()
        if wait > 0:
            self.later = asyncio.get_running_loop().call_later(wait, self._fire)
        else:
            self._fire()

    def _fire(self) -> None:
        self.later, self.fired_at = None, time.monotonic()
        self.fire()


def delegate_to(path: str) -> property:
    """A read-only attribute of an object that reads ``part.name`` of one of its parts: the part keeps the
    state, the owner shows it to its callers."""
    return property(attrgetter(path))


class Resource:
    """A kernel with its execution sequence and records: what MCP sessions work in. It keeps its identity
    (id, name, kind, handle, the kernel's credential and control URL), its notices and its notebook, and
    delegates the rest: the kernel to its ``kernel_holder`` (KernelHolder), the executions to its ``sequence``
    (ExecutionSequence), input() to its ``asking`` (Asking), the leases and orphan state to its
    ``tenancy`` (Tenancy)."""

    def __init__(self, pool: KernelPool, name: str | None = None, control_url: str | None = None,
                 source: KernelSource | None = None, handle: str = "", resource_id: str | None = None,
                 token: str | None = None) -> None:
        self.kind = "named" if name else "private"
        self.name = name or "private"
        self.id = resource_id or name or f"{PRIVATE_ID_PREFIX}{secrets.token_hex(4)}"
        # what a tool's kernel argument names it by: a private one by the unguessable handle its registry
        # minted, never its short id
        self.handle = name or handle
        self.control_url = control_url  # the control plane, as the kernel reaches it; None under stdio
        self.token = token or secrets.token_urlsafe(32)  # the kernel's own credential for the control plane
        self.reports = StateReports()  # where it tells the instance's state of its changes
        self.notices: list[str] = []  # for the next tool result
        # its last cell or tool call: who is evicted first at the kernel cap
        self.last_active = time.monotonic()
        self.admission = asyncio.Lock()
        self.notebook: NotebookMirror | None = None  # the mirror keeping it in a file (see "Notebooks")
        self.kernel_holder = KernelHolder(self, pool, source)
        self.sequence = ExecutionSequence(self)
        self.asking = Asking(self)
        self.tenancy = Tenancy()

    # -- what its parts hold, as callers read it (read-only: each part changes its own)

    pool = delegate_to("kernel_holder.pool")
    source = delegate_to("kernel_holder.source")
    kernel = delegate_to("kernel_holder.kernel")
    running = delegate_to("sequence.running")
    last_number = delegate_to("sequence.last_number")
    last = delegate_to("sequence.last")
    question = delegate_to("asking.question")
    news = delegate_to("asking.news")
    leases = delegate_to("tenancy.leases")
    retired = delegate_to("tenancy.retired")

    @property
    def kernel_state(self) -> str:
        """starting, idle, busy (a cell runs: ours or another client's) or dead."""
        sequence, state = self.sequence, self.kernel_holder.state
        return KERNEL_BUSY if state == KERNEL_IDLE and (sequence.running or sequence.others) else state

    @property
    def sessions(self) -> int:
        """How many sessions use it: one per lease."""
        return len(self.leases)

    @property
    def kernel_name(self) -> str:
        """The name kernels know it by: a private resource's is its id."""
        return self.name if self.kind == "named" else self.id

    # -- what it does

    def report_changes(self, reports: StateReports) -> None:
        """Tell ``reports`` whenever what the instance's state records of it changes."""
        self.reports = reports

    def touch(self) -> None:
        """A cell or tool call used it now (the kernel cap evicts the private one idle the longest)."""
        self.last_active = time.monotonic()

    def mirror(self, notebook: NotebookMirror | None) -> None:
        """Keep it in this notebook file from now on (None: no more)."""
        self.notebook = notebook

    def join_kept(self, listening_at: str | None) -> None:
        """Join the kernel a restart of the server kept again, in the background, telling a kernel that
        replaces it where the control plane listens."""
        self.control_url = listening_at
        self.kernel_holder.start()

    def start_kernel(self) -> asyncio.Future:
        """Start a kernel in the background; the returned future is done when it is ready."""
        return self.kernel_holder.start()

    async def settled(self) -> BaseException | None:
        """Wait until the kernel being started is ready (or runs the startup file) or has failed; return the
        failure."""
        return await self.kernel_holder.settled()

    async def ensure_kernel(self) -> Kernel:
        """The ready kernel, starting a new one if the last one died."""
        return await self.kernel_holder.ensure()

    def changed(self, execution: Execution | None) -> None:
        """An execution started or ended, output came after one ended, or an event came: tell the mirror."""
        if self.notebook is not None:
            self.notebook.changed(self, execution)

    async def submit(self, source: str, options: CellOptions,
                     listener: Callable[[str | None, str], None] | None = None,
                     stdin: bool = False, by: tuple[str, str | None] | None = None) -> Execution:
        """Accept a cell and send it to the kernel, or fail with ``busy``; a listener is told what it shows
        (Execution.listener); ``stdin``: its input() asks (else it fails at once); ``by`` says who ran it
        (see Execution.by)."""
        async with self.admission:
            self.sequence.check_idle()
            kernel = await self.kernel_holder.ensure()
            self.sequence.check_idle()
            if options.kernel not in (None, self.id, self.name) and not kernel.ipython:
                raise ForwardingNotHere(f"--kernel {options.kernel}: forwarding a cell to another kernel is "
                                        f"IPython-only, and this kernel is {kernel.language}")
            return await self.sequence.begin(kernel, source, options, listener, stdin, by)

    def find_numbered(self, number: int) -> Execution | None:
        return self.sequence.find_numbered(number)

    def select(self, number: int | None) -> Execution:
        return self.sequence.select(number)

    def list_recent(self, count: int = RECENT_EXECUTIONS) -> list[Execution]:
        return self.sequence.list_recent(count)

    def interrupt(self) -> Execution | None:
        return self.sequence.interrupt()

    def find_question(self, execution: Execution) -> Question | None:
        return self.asking.find_question(execution)

    async def answer(self, question: Question, text: str | None) -> bool:
        return await self.asking.answer(question, text)

    async def restart(self) -> tuple[Kernel | None, Kernel, Execution | None]:
        """Replace the kernel; return the old kernel, the new one and the execution it killed."""
        async with self.admission:
            self.tenancy.check_not_retired()
            self.kernel_holder.check_owned()
            killed, old = self.running, self.kernel
            self.sequence.kill_running("the kernel was restarted")
            self.sequence.event("restart", "the kernel was restarted: variables are gone" +
                                (f"; execution {killed.number} was killed" if killed else ""))
            return old, await self.kernel_holder.replace(), killed

    def warn_output_in_memory(self, problem: str) -> None:
        """An output file failed (see OutputFiles): the next result says so, the log says so."""
        log(f"resource {self.id}: {problem}; output is kept in memory from here")
        self.notices.append(f"Output in memory: {problem}; what cells print from here on is kept in memory "
                            "(nothing is lost, but it does not outlive the server).")

    def take_notices(self) -> list[str]:
        """One line per kernel replacement since the last tool result, then other notices (a startup
        failure)."""
        lines = [*self.kernel_holder.take_replacements(), *self.notices]
        self.notices.clear()
        return lines

    async def close(self, reason: str = "the server shut down") -> None:
        """Stop the kernel (and a running cell, killed for the reason given)."""
        self.sequence.kill_running(reason)
        await self.kernel_holder.close()


LEASE_MODES = ("activity", "ping", "connection")
# The lease a 2026-07-28 (stateless) call's kernel argument holds: its session label and mode in /api, named
# before the era was called stateless and kept so, as clients read it.
STATELESS_LEASE_LABEL = "modern"
MAX_SWEEP_INTERVAL = 1.0
DEFAULT_MAX_KERNELS = 32
DEFAULT_EVICT_IDLE_SECONDS = 600.0


def check_resource_ref(ref: str) -> None:
    if not is_kernel_ref(ref):
        shown = clip(ref, QUOTED_ID_CHARS)
        raise InvalidResourceName(f"{shown!r} is not a kernel name ({RESOURCE_NAME_RULE}) or a private id "
                                  "(~ and 8 hex digits)")


@dataclass
class LeasePolicy:
    """How a lease proves its client is still there; changing it bumps the generation."""

    mode: str = "activity"
    private_idle_seconds: float = 4800.0
    shared_idle_seconds: float = 86400.0
    ping_interval_seconds: float = 15.0
    ping_timeout_seconds: float = 60.0
    connection_grace_seconds: float = 60.0
    orphan_grace_seconds: float = 30.0
    generation: int = 1

    def check(self) -> None:
        """Raise ValueError naming the first setting that is not valid."""
        if self.mode not in LEASE_MODES:
            raise ValueError(f"mode: must be one of {', '.join(LEASE_MODES)}, not {self.mode!r}")
        for name, value in self.list_windows().items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
                raise ValueError(f"{name}: must be a positive finite number of seconds, not {value!r}")
        if self.ping_timeout_seconds <= self.ping_interval_seconds:
            raise ValueError("ping_timeout_seconds: must be greater than ping_interval_seconds")

    def list_windows(self) -> dict[str, float]:
        return {name: value for name, value in vars(self).items() if name.endswith("_seconds")}

    def as_dict(self) -> dict:
        return {"generation": self.generation, "mode": self.mode, **self.list_windows()}


@dataclass
class LeaseStream:
    """A session's event stream as its lease sees it (a connection lease holds while it is open): whether it
    is open, since when it is closed, and whether tools were called without it (``fallback``: the connection
    lease fell back to the activity window)."""

    open: bool = False
    closed_at: float | None = None
    fallback: bool = False

    def opened(self) -> None:
        self.open, self.fallback = True, False

    def closed(self) -> None:
        self.open, self.closed_at = False, time.monotonic()


@dataclass(eq=False)
class Lease:
    """One hold on a resource: a client session's, under the policy it was granted with, or a holder
    kernel's (``holder``), which is live exactly while the holder's own resource is held."""

    session: str  # a short label of the session, for the console
    resource: Resource
    policy: LeasePolicy
    endpoint: str  # the MCP path, where the session opens its event stream
    operator: str | None = None
    holder: Resource | None = None  # the kernel holding this resource, for a holder lease
    client: str | None = None  # the client's own name (clientInfo.name), shown without an operator label
    by_argument: bool = False  # the hold of the callers naming this kernel with a tool's kernel argument
    created: float = field(default_factory=time.monotonic)
    last_signal: float = field(default_factory=time.monotonic)
    stream: LeaseStream = field(default_factory=LeaseStream)
    requests: int = 0  # requests of the session in progress
    lapsed: str | None = None  # why it lapsed
    lapsed_at: float | None = None

    # -- transitions: the transports report what happened, the lease decides what it means

    def renew(self) -> None:
        self.last_signal = time.monotonic()

    def resume(self, client: str | None, by_argument: bool, last_signal: float) -> None:
        """A lease a restart of the server kept: its client, kind and last signal as recorded (never later
        than now); a connection lease's stream is given its grace from now."""
        self.client, self.by_argument = client, by_argument
        self.last_signal = min(last_signal, time.monotonic())
        self.stream.closed_at = time.monotonic()

    def begin_request(self, tool_call: bool) -> None:
        """A request in progress holds the lease, however long it waits."""
        if tool_call:
            self.tool_called()
        self.requests += 1

    def tool_called(self) -> None:
        if self.policy.mode == "connection" and not self.stream.open:
            self.stream.fallback = True  # tools called without the stream that should hold the lease

    def end_request(self) -> None:
        self.requests -= 1
        self.renew()

    def stream_opened(self) -> None:
        self.stream.opened()

    def stream_closed(self) -> None:
        self.stream.closed()

    # -- standing

    @property
    def idle_window(self) -> float:
        return (self.policy.private_idle_seconds if self.resource.kind == "private"
                else self.policy.shared_idle_seconds)

    def compute_expiry(self) -> float | None:
        """When the lease lapses unless renewed; None while a request in progress, an open stream or
        (for a holder lease) a held holder keeps it."""
        if self.requests or self.holder is not None:
            return None
        mode = self.policy.mode
        if self.by_argument:  # an activity window, whatever the mode: pings and streams belong to sessions
            return self.last_signal + self.idle_window
        if mode == "activity":
            return self.last_signal + self.idle_window
        if mode == "ping":
            return self.last_signal + self.policy.ping_timeout_seconds
        if self.stream.open:
            return None
        expiry = (self.stream.closed_at or self.created) + self.policy.connection_grace_seconds
        return max(expiry, self.last_signal + self.idle_window) if self.stream.fallback else expiry

    def lapse_reason(self) -> str:
        mode = self.policy.mode
        if self.holder is not None:
            return f"its holder, kernel {self.holder.id}, is no longer held"
        if self.by_argument:
            return f"no request named it for {self.idle_window:g} s ({STATELESS_LEASE_LABEL} lease)"
        if mode == "activity":
            return f"no request for {self.idle_window:g} s (activity lease)"
        if mode == "ping":
            return f"no ping for {self.policy.ping_timeout_seconds:g} s (ping lease)"
        if self.stream.fallback:
            return (f"no request for {self.idle_window:g} s (connection lease fallen back to the activity "
                    "window)")
        return f"no open event stream for {self.policy.connection_grace_seconds:g} s (connection lease)"

    @property
    def alert(self) -> str | None:
        if not self.stream.fallback or self.stream.open:
            return None
        return (f"Lease alert: this session holds its kernel with a connection lease but has no open event "
                f"stream (GET {self.endpoint}), so the lease fell back to the {self.idle_window:g} s "
                "activity window and lapses after that much inactivity. The person running loommux should "
                "look at the console.")

    @property
    def standing(self) -> str:
        if self.lapsed:
            return "lapsed"
        return "alert" if self.alert else "live"


@dataclass
class KernelCapSettings:
    """How many kernels a server runs at most (spares included), and how long a private one must have been
    idle to be evicted for a new one at that cap."""

    max_kernels: int
    evict_idle_seconds: float


@dataclass(frozen=True)
class RegistryObservers:
    """Who a registry tells of new resources, retirements and changes to what the state records."""

    on_new: Callable[[Resource], None] = lambda resource: None
    on_retire: Callable[[Resource], Awaitable[None]] | None = None
    on_change: Callable[[], None] = lambda: None
    on_record: Callable[[Resource], Awaitable[None]] | None = None  # the state written now, with it


class Registry:
    """Every resource of a server, its leases and their transitions, and the sweep that retires orphans."""

    def __init__(self, pool: KernelPool, policy: LeasePolicy, endpoint: str,
                 max_kernels: int = DEFAULT_MAX_KERNELS,
                 evict_idle_seconds: float = DEFAULT_EVICT_IDLE_SECONDS, instance: str = "",
                 sources: dict[str, KernelSource] | None = None, several: bool = False,
                 output: OutputDirectory | None = None) -> None:
        self.pool = pool
        self.output = output  # where resources keep their output files (None: in memory)
        self.instance = instance or make_instance_name()  # the name every id it mints carries
        self.policy = policy
        self.endpoint = endpoint
        self.cap = KernelCapSettings(max_kernels, evict_idle_seconds)
        pool.limit(lambda: self.kernels() < self.cap.max_kernels)
        self.resources: dict[str, Resource] = {}  # by id: the name of a named one, an opaque id otherwise
        self.control_url: str | None = None  # set once the HTTP server listens (listen_at)
        self.handles: dict[str, Resource] = {}  # private kernels opened with kernel="~", by handle
        self.sources = sources or {}  # names bound to a kernelspec or an existing kernel (HTTP)
        self.started = time.monotonic()  # when the server started
        self.tasks = TaskBoard(self.instance)  # the executions clients track as tasks
        # One of several instances behind a proxy, which routes a handshake session by its id, never by the
        # names its calls give: such a call may not open a named kernel here (its hash may put it elsewhere).
        self.several = several
        self.observers = RegistryObservers()
        self.tool_watchers: list[Callable[[Resource], None]] = []  # told when a kernel's tools change

    def acquire(self, name: str | None = None, source: KernelSource | None = None) -> Resource:
        """A named resource (created on first use) or a new private one, its kernel starting (from the source
        bound to its name, or the one given, when not from the pool)."""
        resource = self.resources.get(name) if name else None
        if resource is None or resource.kind != "named":
            source = self.sources.get(name, source) if name else source
            eviction = None if source is not None and not source.owned else self.make_room()
            handle = "" if name else mint_id(self.instance, HANDLE_BYTES, PRIVATE_ID_PREFIX)
            resource = Resource(self.pool, name, self.control_url, source, handle)
            resource.kernel_holder.wait_for(eviction)
            self.adopt(resource)
            resource.start_kernel()
        return resource

    def adopt(self, resource: Resource, handed_out: bool = False) -> None:
        """Make a resource this registry's (a new one, or one its state kept over a restart); ``handed_out``:
        a client was given its handle (kernel="~"), which names it from now on."""
        tools = Throttle(TOOLS_CHANGED_INTERVAL, partial(self.tools_changed, resource))
        resource.report_changes(StateReports(self.changed, partial(self.record, resource), tools.poke))
        if self.output is not None:
            resource.sequence.keep_files(self.output.files_for(resource.id, resource.warn_output_in_memory))
        self.observers.on_new(resource)
        self.resources[resource.id] = resource
        if handed_out:
            self.handles[resource.handle] = resource
        self.changed()

    def changed(self) -> None:
        self.observers.on_change()

    async def record(self, resource: Resource) -> None:
        """Return once the instance's state records the resource as it is now (at once without one)."""
        if self.observers.on_record is not None:
            await self.observers.on_record(resource)

    def observe(self, on_new: Callable[[Resource], None] | None = None,
                on_retire: Callable[[Resource], Awaitable[None]] | None = None,
                on_change: Callable[[], None] | None = None,
                on_record: Callable[[Resource], Awaitable[None]] | None = None) -> None:
        """Tell these callbacks of every new resource, of a retirement before its records go (notebook
        mirrors), of a change to what the instance's state records, and of one it must record before going
        on (None: as before)."""
        given = {"on_new": on_new, "on_retire": on_retire, "on_change": on_change, "on_record": on_record}
        self.observers = replace(self.observers, **{k: v for k, v in given.items() if v is not None})

    def watch_tools(self, watcher: Callable[[Resource], None]) -> Callable[[], None]:
        """Call ``watcher`` with each resource whose kernel's published tools change, until the returned
        callable is called."""
        self.tool_watchers.append(watcher)
        return partial(self.tool_watchers.remove, watcher)

    def tools_changed(self, resource: Resource) -> None:
        for watcher in list(self.tool_watchers):
            watcher(resource)

    def listen_at(self, url: str) -> None:
        """The control plane listens at ``url``, as kernels reach it: tell every resource created from now."""
        self.control_url = url

    def change_policy(self, policy: LeasePolicy) -> LeasePolicy:
        """Make ``policy`` the one new leases get, as the next generation; the policy as now in force."""
        self.policy = replace(policy, generation=self.policy.generation + 1)
        return self.policy

    def open_kernel(self, ref: str, client: str | None,
                    routed_by_name: bool = True) -> tuple[Resource, str, str | None, Lease]:
        """The kernel a tool's ``kernel`` argument names: a resource name (created on first use, unless one of
        several instances is asked by a call the proxy did not route by that name), "~" (a new private
        kernel) or a private kernel's handle. Returns the resource, the ref that names it from now on, a
        notice giving a new kernel's handle, and the lease that holds it for every caller naming it."""
        notice = None
        if ref == PRIVATE_ID_PREFIX:
            resource = self.acquire(None)
            ref = resource.handle
            self.handles[ref] = resource
            self.changed()
            notice = f'Kernel {ref}: pass kernel="{ref}" to keep working in this kernel.'
        elif ref.startswith(PRIVATE_ID_PREFIX):
            resource = self.handles.get(ref)
            if resource is None:
                raise KernelNotFound(self.explain_unknown_handle(ref))
        elif RESOURCE_NAME_RE.fullmatch(ref):
            if self.several and not routed_by_name and ref not in self.resources:
                raise KernelNotFound(
                    f"kernel {ref} is not on loommux instance {self.instance}, and this session cannot open "
                    "it here: it is one of several instances, and the proxy takes a session to the instance "
                    "that owns a name only when it joins it at initialize (the X-Loommux-Resource header); "
                    "or name the kernel in 2026-07-28 requests (Mcp-Param-Kernel), which go to its instance")
            resource = self.acquire(ref)
        else:
            raise InvalidResourceName(f'kernel {clip(ref, QUOTED_ID_CHARS)!r} is not a name '
                                      f'({RESOURCE_NAME_RULE}), "~" or a handle')
        lease = next((lease for lease in resource.leases if lease.by_argument), None)
        if lease is None:
            lease = self.grant(resource, STATELESS_LEASE_LABEL, None)
            lease.by_argument = True
        lease.renew()
        lease.client = client or lease.client
        return resource, ref, notice, lease

    def explain_unknown_handle(self, ref: str) -> str:
        words = explain_unknown_id("kernel", ref, self.instance, PRIVATE_ID_PREFIX)
        return f'{words}; pass kernel="~" to start a new private kernel'

    def kernels(self) -> int:
        """Kernels running or starting: one per resource (not an attached one: not ours), and the spares."""
        owned = [r for r in self.resources.values() if r.source is None or r.source.owned]
        return len(owned) + len(self.pool.spares)

    def make_room(self) -> asyncio.Future | None:
        """Before a new resource: at the kernel cap, retire the private resource idle the longest (named ones
        are never evicted); the retirement to wait for, if any."""
        cap = self.cap
        if self.pool.spares or self.kernels() < cap.max_kernels:
            return None  # a spare is handed over, or there is room for one more
        now = time.monotonic()
        idle = [r for r in self.resources.values()
                if r.kind == "private" and r.running is None
                and now - r.last_active >= cap.evict_idle_seconds]
        if not idle:
            raise KernelUnavailable(f"the server is at its kernel cap ({cap.max_kernels} kernels) and no "
                                    f"private kernel has been idle for {cap.evict_idle_seconds:g} s; try "
                                    "again later, or ask the operator to raise LOOMMUX_MAX_KERNELS or "
                                    "recycle a kernel")
        victim = min(idle, key=lambda r: r.last_active)
        del self.resources[victim.id]  # counted out at once; its kernel stops before the new one starts
        self.handles.pop(victim.handle, None)
        return asyncio.ensure_future(self.retire(victim, "evicted: the server is at its kernel cap"))

    def find(self, ref: str) -> Resource:
        """An existing resource by name or id."""
        check_resource_ref(ref)
        resource = self.resources.get(ref)
        if resource is None:
            raise ResourceNotFound(f"no kernel {ref!r}; loommux.kernels() (GET /api/kernels) lists them")
        return resource

    def find_by_token(self, token: str) -> Resource | None:
        """The resource whose kernel holds this credential."""
        given = token.encode()
        return next((r for r in self.resources.values() if hmac.compare_digest(given, r.token.encode())),
                    None)

    # -- lease transitions

    def grant(self, resource: Resource, session: str, operator: str | None, holder: Resource | None = None,
              policy: LeasePolicy | None = None) -> Lease:
        """A new lease, under the policy given (the one a session was granted at initialize) or the current
        one."""
        lease = Lease(session, resource, policy or self.policy, self.endpoint, operator, holder)
        resource.tenancy.add(lease)
        self.changed()
        return lease

    def hold(self, holder: Resource, ref: str) -> Resource:
        """A kernel opens or joins another by name or id and holds it (one holder lease per pair)."""
        if ref in (holder.id, holder.name):
            return holder
        check_resource_ref(ref)
        resource = self.find(ref) if ref.startswith(PRIVATE_ID_PREFIX) else self.acquire(ref)
        if not any(lease.holder is holder for lease in resource.leases):
            self.grant(resource, f"kernel {holder.id}", None, holder)
        return resource

    def release(self, lease: Lease, reason: str) -> None:
        lease.lapsed = lease.lapsed or reason
        lease.lapsed_at = lease.lapsed_at or time.monotonic()
        lease.resource.tenancy.discard(lease, reason)
        self.changed()

    def relet(self, lease: Lease) -> tuple[Lease | None, str | None]:
        """Renew a session's lease; after a lapse, lease its resource again, or, when that was retired, no
        lease (the session gets a fresh resource at its next tool call) and a notice saying so."""
        if not lease.lapsed:
            lease.renew()
            return lease, None
        old = lease.resource
        if old.retired:
            what = f"resource {old.name}" if old.kind == "named" else f"the earlier private kernel ({old.id})"
            return None, (f"Kernel retired: {what} was retired ({old.retired}); this is a fresh kernel: "
                          "variables are gone and executions are numbered from 1 again.")
        renewed = self.grant(old, lease.session, lease.operator, policy=lease.policy)
        renewed.stream.open, renewed.client = lease.stream.open, lease.client
        return renewed, None

    async def end(self, lease: Lease, reason: str) -> None:
        """A session ended: its lease is released, and a private resource with no running cell retired at
        once."""
        resource = lease.resource
        self.release(lease, reason)
        if resource.kind == "private" and resource.running is None and not resource.retired:
            await self.retire(resource, reason)

    def find_held(self) -> set[Resource]:
        """Resources held by a live client lease or, transitively, by a held holder (a cycle holds
        nothing)."""
        held = {r for r in self.resources.values() if any(lease.holder is None for lease in r.leases)}
        todo = list(held)
        while todo:
            holder = todo.pop()
            for resource in self.resources.values():
                if resource not in held and any(lease.holder is holder for lease in resource.leases):
                    held.add(resource)
                    todo.append(resource)
        return held

    async def retire(self, resource: Resource, reason: str) -> None:
        """Stop the resource's kernel and drop its records; its sessions start afresh on their next call."""
        if self.resources.get(resource.id) is resource:
            del self.resources[resource.id]
        resource.tenancy.retire(reason)
        self.handles.pop(resource.handle, None)
        for lease in list(resource.leases):
            self.release(lease, reason)
        self.changed()
        log(f"retired resource {resource.id}: {reason}")
        await resource.close(f"its resource was retired: {reason}")
        if self.observers.on_retire is not None:
            await self.observers.on_retire(resource)
        resource.sequence.forget()

    async def sweep(self) -> None:
        """Lapse expired leases, then holder leases whose holder is no longer held; retire orphans whose
        grace is over once their running cell has finished."""
        now = time.monotonic()
        for resource in list(self.resources.values()):
            for lease in list(resource.leases):
                expiry = lease.compute_expiry()
                if expiry is not None and expiry <= now:
                    self.release(lease, lease.lapse_reason())
        held = self.find_held()
        for resource in list(self.resources.values()):
            for lease in list(resource.leases):
                if lease.holder is not None and lease.holder not in held:
                    self.release(lease, lease.lapse_reason())
        for resource in list(self.resources.values()):
            tenancy = resource.tenancy
            if tenancy.orphan_since is None or now - tenancy.orphan_since < self.policy.orphan_grace_seconds:
                continue
            if resource.running is not None:
                tenancy.let_finish(resource.running.number)  # let it finish first
                continue
            await self.retire(resource, f"orphaned: {tenancy.orphan_reason}")

    def sweep_interval(self) -> float:
        return min(MAX_SWEEP_INTERVAL, max(0.02, min(self.policy.list_windows().values()) / 4))

    async def run_sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval())
            try:
                await self.sweep()
            except Exception as exc:  # noqa: BLE001 - the sweeper must outlive one bad pass
                log(f"lease sweep failed: {type(exc).__name__}: {exc}")

    async def close(self) -> None:
        await self.tasks.close()
        resources = list(self.resources.values())
        self.resources.clear()
        await asyncio.gather(*(resource.close() for resource in resources))


# -- sessions: what one MCP session works on


@dataclass
class PrivateKernelStart:
    """How a session's private kernel starts: from ``source`` (stdio's --existing, say; None: the pool), and,
    when ``eager``, at initialize (stdio, so that a server whose kernel cannot start never serves), with
    ``failed`` set when it could not."""

    source: KernelSource | None = None
    eager: bool = False
    failed: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(eq=False)
class SessionBinding:
    """Binds one MCP session (either era, either transport) to its resource, lease and notices.

    Stdio and HTTP build it the same way and hand it to ``McpSession``; the transports only report what
    happened (a request, an event stream opened or closed, the end). A session naming its resource
    (``resource_name``) leases it at once; a private one gets its kernel at its first tool call, or at
    initialize when its ``start`` is eager (see PrivateKernelStart). A session
    with a ``default_kernel`` (a 2026-07-28 HTTP request) never attaches: each call names its kernel, held
    by the registry's per-kernel lease. ``routing_headers`` are the HTTP headers of a 2026-07-28 request,
    which must say what its body says.
    """

    registry: Registry
    label: str  # a short label of the session, for the console
    resource_name: str | None = None
    operator: str | None = None
    policy: LeasePolicy | None = None  # the policy it was granted at initialize (else the registry's)
    default_kernel: str | None = None
    routing_headers: dict[str, str] | None = None
    client: str | None = None  # clientInfo.name, once initialize told it
    start: PrivateKernelStart = field(default_factory=PrivateKernelStart)
    lease: Lease | None = None
    stream_open: bool = False  # its event stream (HTTP's GET stream; stdio's pipe) is open
    notices: list[str] = field(default_factory=list)
    last_seen: float = field(default_factory=time.monotonic)
    # Sends a message on the session's own stream while one is open (stdio's pipe, HTTP's GET stream): the
    # status notifications of its 2025-11-25 tasks.
    push: Callable[[dict], Awaitable[None]] | None = None
    on_attach: Callable[[Resource], None] | None = None  # told of each resource it leases (stdio's notebook)

    @property
    def resource(self) -> Resource | None:
        return self.lease.resource if self.lease else None

    def attach(self, tool_call: bool = True) -> Resource:
        """The session's resource, leased now if it has none (after a lapse, a fresh one)."""
        if self.lease is not None:
            return self.lease.resource
        resource = self.registry.acquire(self.resource_name, self.start.source)
        if self.on_attach is not None:
            self.on_attach(resource)
        self.lease = self.registry.grant(resource, self.label, self.operator, policy=self.policy)
        self.lease.client = self.client
        if tool_call:
            self.lease.tool_called()
        if self.stream_open:
            self.lease.stream_opened()
        return resource

    async def ready(self) -> BaseException | None:
        """At initialize: an eager session's kernel is started and, when local, waited for (up to its startup
        file, which the first call waits for); why it failed."""
        if not self.start.eager:
            return None
        resource = self.attach(tool_call=False)
        if self.registry.pool.gateway is not None:
            return None  # a gateway may be down for now: each call tries again
        failure = await resource.settled()  # a local kernel that cannot start never will
        if failure is not None:
            log(f"cannot start the IPython kernel: {failure}")
            self.start.failed.set()
        return failure

    def open_kernel(self, ref: str | None, client: str | None) -> tuple[Resource, str, str | None, Lease]:
        """The kernel a call's kernel argument names (None: the session's default kernel)."""
        # A handshake session's calls reach the instance that minted it, whatever kernel they name.
        by_name = self.default_kernel is not None
        return self.registry.open_kernel(self.default_kernel if ref is None else ref, client, by_name)

    def renew(self) -> None:
        """A request arrived: renew the lease, or lease again after a lapse (maybe on a fresh resource)."""
        self.last_seen = time.monotonic()
        if self.lease is None:
            return
        self.lease, notice = self.registry.relet(self.lease)
        if notice:
            self.notices.append(notice)

    @contextlib.contextmanager
    def serving(self, tool_call: bool) -> Iterator[None]:
        """Around one request: renewed, a private kernel given at the first tool call, the lease held while
        the request is in progress."""
        self.renew()
        if self.lease is None and tool_call and self.default_kernel is None:
            with contextlib.suppress(ResourceError):  # (the tool call meets the error again and reports it)
                self.attach(tool_call=False)
        lease = self.lease
        if lease is not None:
            lease.begin_request(tool_call)
        try:
            yield
        finally:
            if lease is not None:
                lease.end_request()
            elif self.lease is not None:  # granted during this request
                self.lease.renew()
            if self.lease is not None and self.lease.client is None:  # known once initialize is answered
                self.lease.client = self.client

    def take_notices(self) -> list[str]:
        """The session's own notices for its next tool result: a lapse, a lease alert."""
        notices, self.notices = self.notices, []
        alert = self.lease.alert if self.lease else None
        return [*notices, alert] if alert else notices

    def check_headers(self, method: str, params: dict) -> None:
        if self.routing_headers is not None:
            check_routing_headers(self.routing_headers, method, params)

    def stream_opened(self) -> None:
        self.stream_open = True
        if self.lease is not None:
            self.lease.stream_opened()

    def stream_closed(self) -> None:
        self.stream_open = False
        if self.lease is not None:
            self.lease.stream_closed()

    def quiet_since(self) -> float | None:
        """Since when nothing holds the session: its lease's lapse, or its last request when it has none."""
        return self.lease.lapsed_at if self.lease else self.last_seen

    async def end(self, reason: str) -> None:
        self.registry.tasks.forget(self)  # its tasks are its own
        if self.lease is not None:
            await self.registry.end(self.lease, reason)


@contextlib.asynccontextmanager
async def make_kernel_registry(settings: Settings, endpoint: str, spares: int = 0) -> AsyncIterator[Registry]:
    """A server's kernel pool (keeping ``spares`` warm kernels) and its registry, swept while the server runs;
    both closed when it stops (the resources' kernels first, then the spares)."""
    pool = KernelPool(settings.workspace, settings.kernel_environ, spares, settings.startup, settings.gateway,
                      settings.kernelspecs.get(None), settings.inspectors)
    sources = {name: KernelSource(spec=spec) for name, spec in settings.kernelspecs.items() if name}
    sources.update({name: source for name, source in settings.existing.items() if name})
    registry = Registry(pool, settings.lease_policy, endpoint, settings.max_kernels,
                        settings.evict_idle_seconds, settings.instance, sources, settings.several,
                        settings.output)
    sweeper = asyncio.ensure_future(registry.run_sweeper())
    try:
        yield registry
    finally:
        sweeper.cancel()
        await registry.close()
        await pool.close()


# ---------------------------------------------------------------- Notebooks
# A resource's executions as a Jupyter notebook (nbformat 4.5), written with the standard library's json:
# a code cell per execution with its outputs in arrival order (the stream text from the logs, the rest from
# the execution's marks), a markdown cell for each restart, kernel death and retirement. A mirror keeps a
# file up to date: it keeps what it rendered (settled cells joined in compressed blocks), renders only what
# changed, in steps between which the event loop runs, and writes on a thread of its own: a file in full
# beside the old one, then renamed over it. Writing takes at most a small share of the time.

NOTEBOOK_MIME = "application/x-ipynb+json"
NBFORMAT, NBFORMAT_MINOR = 4, 5
NOTEBOOK_WRITER = "loommux"  # metadata.loommux.writer: a file loommux wrote, which it may continue
NOTEBOOK_OUTPUT_CHARS = 1 << 20  # an output's text (stream, text/plain, traceback) is cut in the middle to it
NOTEBOOK_VALUE_CHARS = MAX_IMAGE_BYTES * 4 // 3 + 4  # any other MIME value longer (10 MiB images) is left out
NOTEBOOK_TICK = 2.0  # while a cell runs and has new output, the file is brought up to date this often
NOTEBOOK_WRITE_SHARE = 0.005  # writing takes at most this share of the wall time: the next write waits
# but the end of a cell the file shows running, that ran a tick or more, waits only for this share of the
# last write of the file itself: a cell of much output (whose first rendering takes long) shows as ended
# soon after its result; at most once per such cell
NOTEBOOK_END_SHARE = 0.05
NOTEBOOK_BLOCK_BYTES = 256 << 10  # settled cells are kept rendered, joined in blocks of about this size
NOTEBOOK_STEP_SECONDS = 0.002  # rendering gives the event loop a turn at least this often
DEFAULT_KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
JSON_MIME_RE = re.compile(r"application/(?:.*\+)?json")
BINARY_MIME_RE = re.compile(r"(?:image/(?!svg\+xml)|audio/|video/|application/pdf$)")  # base64 in a notebook
SPLIT_MIME_RE = re.compile(r"text/|application/javascript$|image/svg\+xml$")  # as lines, like nbformat writes
STREAM_NAMES = ("stdout", "stderr")
NOTEBOOK_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False)  # json.dumps would make one per call


class NotebookRefused(Exception):
    """A file at a notebook's path that loommux did not write, or cannot read."""


class Packed(bytes):
    """A run of rendered cells kept compressed: a mirror holds a fraction of its notebook's size."""


def pack(run: bytes) -> Packed:
    return Packed(zlib.compress(run, 1))  # zlib lets other threads run meanwhile


class Pacer:
    """Gives the event loop a turn every few milliseconds of rendering, so that no request waits long."""

    def __init__(self) -> None:
        self.since = time.perf_counter()

    async def step(self) -> None:
        if time.perf_counter() - self.since > NOTEBOOK_STEP_SECONDS:
            await asyncio.sleep(0)
            self.since = time.perf_counter()


def encode_json(value: Any) -> str:
    """Compact JSON; a NaN or infinity (which JSON lacks, and a display may hold) becomes null."""
    try:
        return NOTEBOOK_JSON.encode(value)
    except ValueError:
        return NOTEBOOK_JSON.encode(replace_nonfinite(value))


def replace_nonfinite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: replace_nonfinite(item) for key, item in value.items()}
    if isinstance(value, list):
        return [replace_nonfinite(item) for item in value]
    return value


def encode_utf8(text: str) -> bytes:
    """UTF-8 of text whose lone surrogates (which UTF-8 cannot hold, and a kernel may send) become U+FFFD."""
    try:
        return text.encode()
    except UnicodeEncodeError:
        return LONE_SURROGATE_RE.sub("\ufffd", text).encode()


def encode_json_lines(encoded: list[str]) -> str:
    """A JSON array of encoded values, one per line, as a field of a cell."""
    return "[\n    " + ",\n    ".join(encoded) + "\n   ]" if encoded else "[]"


def encode_cell(members: dict[str, str]) -> str:
    """A cell of encoded fields, indented as a member of the notebook's cells."""
    return "  {\n" + ",\n".join(f'   "{name}": {value}' for name, value in members.items()) + "\n  }"


def encode_multiline(text: str) -> str:
    """A multiline string as nbformat writes it: its lines, with their newlines, one per line."""
    return encode_json_lines([encode_json(line) for line in text.splitlines(keepends=True)])


def join_ends(head: str, tail: str, total: int, reader: Callable[[int, int], str]) -> str:
    """The two ends of a text too long for a notebook, at line ends where there are any, and a line between
    saying how much was left out and which call (``reader`` of the offsets left out) reads it."""
    newline = head.rfind("\n")
    if newline >= len(head) // 2:
        head = head[: newline + 1]
    newline = tail.find("\n")
    if 0 <= newline < len(tail) // 2:
        tail = tail[newline + 1 :]
    left_out, call = total - len(head) - len(tail), reader(len(head), total - len(tail))
    note = f"[… {format_count(left_out)} characters left out; {call} reads them]\n"
    return head + ("" if head.endswith("\n") or not head else "\n") + note + tail


def bound_text(text: str, number: int, stream: str) -> str:
    """text, or its two ends when longer than NOTEBOOK_OUTPUT_CHARS (read_output reads it in ``stream``)."""
    if len(text) <= NOTEBOOK_OUTPUT_CHARS:
        return text
    half, call = NOTEBOOK_OUTPUT_CHARS // 2, f'read_output(execution={number}, stream="{stream}")'
    return join_ends(text[:half], text[-half:], len(text), lambda first, last: call)


def make_stream_output(stream_log: Log, name: str, start: int, stop: int, number: int) -> dict:
    """The stream text between two offsets of a log, cut in the middle when too long."""
    if stop - start <= NOTEBOOK_OUTPUT_CHARS:
        return {"name": name, "output_type": "stream", "text": stream_log.span(start, stop)}

    def reader(first: int, last: int) -> str:
        lines = f"{stream_log.line_at(start + first) + 1}:{stream_log.line_at(start + last - 1) + 1}"
        return f'read_output(execution={number}, stream="{name}", line_range="{lines}")'

    half = NOTEBOOK_OUTPUT_CHARS // 2
    head, tail = stream_log.span(start, start + half), stream_log.span(stop - half, stop)
    text = join_ends(head, tail, stop - start, reader)
    return {"name": name, "output_type": "stream", "text": text}


def is_base64(value: str) -> bool:
    try:
        base64.b64decode(re.sub(r"\s+", "", value), validate=True)
    except ValueError:
        return False
    return True


def make_mime_bundle(data: Any, number: int) -> dict:
    """A display's data as a notebook holds it: every MIME type the kernel sent, text/plain cut in the middle
    when too long; a value a notebook cannot hold (binary data that is not base64, a value that is not text,
    one over NOTEBOOK_VALUE_CHARS) is left out, and a line of text/plain says so."""
    bundle, notes = {}, []
    for mime, value in (data.items() if isinstance(data, dict) else ()):
        json_mime = JSON_MIME_RE.fullmatch(mime) is not None
        if isinstance(value, list) and all(isinstance(line, str) for line in value) and not json_mime:
            value = "".join(value)
        size = len(value) if isinstance(value, str) else len(encode_json(value))
        if not json_mime and not isinstance(value, str):
            notes.append(f"[{mime} left out of the notebook: its data is not text]")
        elif mime == "text/plain":
            bundle[mime] = bound_text(value, number, "result")
        elif BINARY_MIME_RE.match(mime) and not is_base64(value):
            notes.append(f"[{mime} left out of the notebook: its data is not base64]")
        elif size > NOTEBOOK_VALUE_CHARS:
            notes.append(f"[{mime} left out of the notebook: {format_count(size)} characters, over its limit "
                         f"of {format_count(NOTEBOOK_VALUE_CHARS)}]")
        else:
            bundle[mime] = value
    if notes:
        plain = bundle.get("text/plain", "")
        bundle["text/plain"] = plain + ("\n" if plain and not plain.endswith("\n") else "") + "\n".join(notes)
    return {mime: value.splitlines(keepends=True) if isinstance(value, str) and SPLIT_MIME_RE.match(mime)
            else value for mime, value in bundle.items()}


def make_display_output(kind: int, payload: Any, number: int) -> dict:
    """An execute_result or display_data output (a display of text alone was kept as its text)."""
    if isinstance(payload, str):  # what make_mime_bundle makes of it, made faster: a cell may have many
        data, metadata = {"text/plain": bound_text(payload, number, "result").splitlines(keepends=True)}, {}
    else:
        data, metadata = make_mime_bundle(payload.get("data"), number), payload.get("metadata")
    output = {"data": data, "metadata": metadata if isinstance(metadata, dict) else {},
              "output_type": "display_data"}
    if kind == MARK_RESULT:
        output.update(execution_count=number, output_type="execute_result")
    return output


def make_error_output(content: dict, number: int) -> dict:
    """ename, evalue and the traceback as the kernel sent them (a traceback too long: cut in the middle)."""
    trace = content.get("traceback")
    trace = [str(line) for line in trace] if isinstance(trace, list) else []
    if sum(map(len, trace)) > NOTEBOOK_OUTPUT_CHARS:
        trace = bound_text("\n".join(trace), number, "traceback").split("\n")
    return {"ename": str(content.get("ename", "")), "evalue": str(content.get("evalue", "")),
            "output_type": "error", "traceback": trace}


def find_display_id(payload: Any) -> str | None:
    transient = payload.get("transient") if isinstance(payload, dict) else None
    found = transient.get("display_id") if isinstance(transient, dict) else None
    return found if isinstance(found, str) else None


class CellOutputs:
    """An execution's outputs in arrival order, as a notebook client builds them: the stream text between its
    marks (consecutive text of one stream is one output, kept as (stream, start, stop) until encoded), its
    displays, results and error; clear_output and update_display_data applied as a notebook client applies
    them (an update only to a display of the same cell)."""

    def __init__(self, execution: Execution) -> None:
        self.execution, self.number = execution, execution.number
        self.ends = (0, 0)  # how long stdout and stderr are
        self.applied = 0  # how many of the execution's marks (3 entries each) are applied
        self.items: list[tuple[int, int, int] | dict | str] = []  # str: an item encoded (see freeze)
        self.taken = [0, 0]  # how much of each stream the items hold
        self.current = 0  # the stream written last before the next mark: 0 stdout, 1 stderr
        self.clear_next = False  # a clear_output(wait=True) clears when the next output comes
        self.displays: dict[str, list[dict]] = {}  # the outputs of each display id, for its updates
        self.updatable: set[int] = set()  # the ids of those outputs (kept by displays: never another's)
        self.frozen = 0  # the items before this one that can be are encoded for good (see freeze)

    def add(self, item: tuple[int, int, int] | dict) -> None:
        if self.clear_next:
            self.clear()
        self.items.append(item)

    def clear(self) -> None:
        self.items.clear()
        self.clear_next, self.frozen = False, 0

    def ended(self) -> list[tuple[int, int, int] | dict]:
        """The items with the stream text after the last mark too, leaving these outputs as they are (the
        marks that come later continue from them)."""
        rest = copy.copy(self)
        rest.items, rest.taken = list(self.items), list(self.taken)
        rest.take(self.ends)
        return rest.items

    async def freeze(self, logs: tuple[Log, Log], pacer: Pacer) -> None:
        """Encode for good the items that never change again: all but the last (whose stream text may grow)
        and the displays an update may change. A running cell's next render encodes only what is new."""
        items = self.items
        for i in range(self.frozen, len(items) - 1):
            if not isinstance(items[i], str) and id(items[i]) not in self.updatable:
                items[i] = await encode_output(items[i], logs, self.number)
                await pacer.step()
        self.frozen = max(self.frozen, len(items) - 1)

    def take(self, positions: tuple[int, int]) -> None:
        """The stream text written before a mark at ``positions`` (of the stream current before it, last)."""
        for which in (1 - self.current, self.current):
            stop, taken = min(positions[which], self.ends[which]), self.taken[which]
            if stop <= taken:
                continue
            last = self.items[-1] if self.items else None
            if not self.clear_next and isinstance(last, tuple) and (last[0], last[2]) == (which, taken):
                self.items[-1] = (which, last[1], stop)
            else:
                self.add((which, taken, stop))
            self.taken[which] = stop

    def apply(self, code: int, payload: Any) -> None:
        """One mark (see MARK_SWITCH), after the stream text before it was taken."""
        kind, self.current = code & 7, 1 if code & MARK_STDERR else 0
        if kind == MARK_CLEAR:
            self.clear()
        elif kind == MARK_CLEAR_WAIT:
            self.clear_next = True
        elif kind == MARK_ERROR:
            self.add(make_error_output(payload if isinstance(payload, dict) else {}, self.number))
        elif kind == MARK_UPDATE:
            self.update(payload)
        elif kind != MARK_SWITCH:
            output = make_display_output(kind, payload, self.number)
            self.add(output)
            if find_display_id(payload) is not None:
                self.displays.setdefault(find_display_id(payload), []).append(output)
                self.updatable.add(id(output))

    def update(self, payload: Any) -> None:
        """update_display_data: the new data and metadata in every output of its display id."""
        displayed = self.displays.get(find_display_id(payload) or "")
        if displayed:
            updated = make_display_output(MARK_UPDATE, payload, self.number)
            for output in displayed:
                output.update(data=updated["data"], metadata=updated["metadata"])


async def encode_cell_outputs(e: Execution, pacer: Pacer,
                              kept: dict[int, CellOutputs] | None = None) -> list[str]:
    """An execution's outputs in arrival order (see CellOutputs), encoded. With ``kept`` (the outputs of
    running executions as last rendered, by number), only the marks and outputs that are new since are
    applied and encoded."""
    outputs = kept.get(e.number) if kept is not None else None
    if outputs is None or outputs.execution is not e:
        outputs = CellOutputs(e)
        if kept is not None and e.state == RUNNING:  # (a pass over many settled cells never holds them all)
            kept[e.number] = outputs
    logs = (e.log("stdout"), e.log("stderr"))
    # what is there now: marks that come while this renders wait for the next render, with their text
    marks, rich, outputs.ends = e.marks or array("q"), e.rich or [], (logs[0].chars, logs[1].chars)
    for i in range(outputs.applied, len(marks) - 2, 3):
        code = marks[i]
        outputs.take((marks[i + 1], marks[i + 2]))
        outputs.apply(code, load_display(rich[code // MARK_PAYLOAD]) if MARK_DISPLAY <= code & 7 <= MARK_ERROR
                      else None)
        outputs.applied = i + 3
        await pacer.step()
    await outputs.freeze(logs, pacer)
    encoded = []
    for item in outputs.ended():
        if not isinstance(item, str):
            item = await encode_output(item, logs, e.number)
            await pacer.step()
        encoded.append(item)
    return encoded


async def encode_output(item: tuple[int, int, int] | dict, logs: tuple[Log, Log], number: int) -> str:
    """One of CellOutputs' items, encoded: a stream's text between two offsets, or an output."""
    if isinstance(item, tuple):
        stream, start, end = item
        item = await make_stream_text_output(logs[stream], STREAM_NAMES[stream], start, end, number)
    return encode_json(item)


async def make_stream_text_output(stream: Log, name: str, start: int, stop: int, number: int) -> dict:
    """A stream output as a notebook holds it (make_stream_output, its text as lines)."""
    if stop - start > NOTEBOOK_OUTPUT_CHARS:  # its cut names line numbers
        await stream.index_in_thread()
    output = make_stream_output(stream, name, start, stop, number)
    output["text"] = output["text"].splitlines(keepends=True)
    return output


def describe_runner(by: tuple[str, str | None] | None) -> dict | None:
    return None if by is None else {"kind": by[0], "name": by[1]}


async def make_code_cell(e: Execution, cell_id: str, pacer: Pacer,
                         kept: dict[int, CellOutputs] | None = None) -> str:
    """One execution as a code cell: the source as submitted, loommux's number, its outputs (``kept``: see
    encode_cell_outputs); the Jupyter timestamps in metadata.execution, and in metadata.loommux its state,
    duration and who ran it."""
    timing = {"iopub.execute_input": format_iso_utc(e.submitted_at)}
    if e.completed_at is not None:
        timing["shell.execute_reply"] = format_iso_utc(e.completed_at)
    facts = {"execution": e.number, "state": e.state, "duration": round(e.elapsed, 3),
             "ran_by": describe_runner(e.by)}
    if e.reason:
        facts["reason"] = e.reason
    if e.output_dropped:
        facts["output_dropped"] = OUTPUT_DROPPED
    outputs = await encode_cell_outputs(e, pacer, kept)
    metadata = encode_json({"execution": timing, "loommux": facts})
    return encode_cell({"cell_type": '"code"', "execution_count": str(e.number), "id": encode_json(cell_id),
                        "metadata": metadata, "outputs": encode_json_lines(outputs),
                        "source": encode_multiline(e.source)})


def make_markdown_cell(cell_id: str, kind: str, at: float, text: str) -> str:
    """What happened to the kernel, as a markdown cell at that point."""
    when = format_iso_utc(at)
    source = f"*loommux · {when}:* {text[:1].upper()}{text[1:]}."
    metadata = encode_json({"loommux": {"event": kind, "at": when}})
    return encode_cell({"cell_type": '"markdown"', "id": encode_json(cell_id), "metadata": metadata,
                      "source": encode_multiline(source)})


def group_events_by_execution(resource: Resource) -> dict[int, list[tuple[int, tuple[int, float, str, str]]]]:
    """The resource's events by the execution they follow (0: before the first), numbered per execution."""
    found: dict[int, list] = {}
    for event in resource.sequence.events:
        after = found.setdefault(event[0] - 1, [])
        after.append((len(after) + 1, event))
    return found


async def render_group(resource: Resource, number: int, tag: str, events: dict, pacer: Pacer,
                       kept: dict[int, CellOutputs] | None = None) -> bytes:
    """Execution ``number``'s cell and the markdown cells of the events after it, as one run of cells
    (``kept``: see encode_cell_outputs)."""
    cells = []
    execution = resource.find_numbered(number)
    if execution is not None:
        cells.append(await make_code_cell(execution, f"{tag}-{number}", pacer, kept))
    for k, (_, at, kind, text) in events.get(number, ()):
        cells.append(make_markdown_cell(f"{tag}-{number}-{k}", kind, at, text))
    await pacer.step()
    return encode_utf8(",\n".join(cells))


def make_notebook_metadata(resource: Resource | None, earlier: dict | None = None) -> dict:
    """The notebook's metadata: kernelspec and language_info from the kernel's kernel_info_reply (an earlier
    file's otherwise, else Python's), and metadata.loommux, which marks a file loommux wrote."""
    metadata = dict(earlier or {})
    kernel = resource.kernel if resource is not None else None
    language = kernel.info.get("language_info") if kernel is not None else None
    if isinstance(language, dict) and isinstance(language.get("name"), str):
        gateway = resource.pool.gateway
        metadata["kernelspec"] = ({"name": gateway.kernel_name, "display_name": gateway.kernel_name,
                                   "language": language["name"]} if gateway else DEFAULT_KERNELSPEC)
        metadata["language_info"] = language
    metadata.setdefault("kernelspec", DEFAULT_KERNELSPEC)
    metadata.setdefault("language_info", {"name": "python"})
    mark = {"writer": NOTEBOOK_WRITER, "version": __version__}
    if resource is not None:
        mark["kernel"] = resource.kernel_name
    metadata["loommux"] = mark
    return metadata


def join_notebook_parts(cells: list[bytes], metadata: dict) -> list[bytes]:
    """The whole file: runs of encoded cells joined, then the metadata (as json writes it, indented)."""
    cells = [run for run in cells if run]
    parts = [b'{\n "cells": [\n']
    for run in cells:
        parts += [run, b",\n"]
    if cells:
        parts[-1] = b"\n ],\n"
    else:
        parts = [b'{\n "cells": [],\n']
    indented = json.dumps(replace_nonfinite(metadata), indent=1, sort_keys=True, ensure_ascii=False)
    indented = indented.replace("\n", "\n ")
    tail = f' "metadata": {indented},\n "nbformat": {NBFORMAT},\n "nbformat_minor": {NBFORMAT_MINOR}\n}}\n'
    return [*parts, encode_utf8(tail)]


async def render_resource_notebook(resource: Resource) -> bytes:
    """A resource's notebook rendered afresh from its records (what /api serves, with or without a mirror)."""
    events, pacer = group_events_by_execution(resource), Pacer()
    groups = [await render_group(resource, n, "loommux", events, pacer)
              for n in range(resource.last_number + 1)]
    return b"".join(join_notebook_parts(groups, make_notebook_metadata(resource)))


def name_notebook_file(resource: Resource) -> str:
    """Its file's name: NAME.ipynb for a named resource, private-<id>.ipynb for a private one."""
    return f"{resource.name}.ipynb" if resource.kind == "named" else f"private-{resource.id}.ipynb"


def read_notebook_on_disk(path: Path) -> dict | None:
    """The notebook loommux wrote before at ``path``; None when there is no file; NotebookRefused for any
    other file, or one that cannot be read."""
    try:  # never through a link, nor from what is not a file (a FIFO, a device: it would never end)
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as file:
            if not S_ISREG(os.fstat(file.fileno()).st_mode):
                raise OSError(errno.EINVAL, "not a regular file")
            raw = file.read()
    except FileNotFoundError:
        return None
    except OSError as exc:
        reason = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror or exc
        raise NotebookRefused(f"{path} cannot be read ({reason})") from None
    try:
        notebook = json.loads(raw)
    except ValueError:
        notebook = None
    mark = notebook.get("metadata", {}).get("loommux") if isinstance(notebook, dict) else None
    if (not isinstance(mark, dict) or mark.get("writer") != NOTEBOOK_WRITER
            or not isinstance(notebook.get("cells"), list)):
        raise NotebookRefused(f"{path} exists and loommux did not write it")
    return notebook


def read_earlier_notebook(path: Path) -> tuple[dict, bytes] | None:
    """The metadata and the cells (encoded as this file writes them) of the notebook loommux wrote at path."""
    notebook = read_notebook_on_disk(path)
    if notebook is None:
        return None
    cells = (json.dumps(cell, indent=1, ensure_ascii=False).replace("\n", "\n  ")
             for cell in notebook["cells"])
    return notebook["metadata"], pack(encode_utf8(",\n".join("  " + cell for cell in cells)))


def check_notebook_path(path: Path) -> None:
    """At startup: a file loommux may write (and continue); NotebookRefused saying why not."""
    if not path.parent.is_dir():
        raise NotebookRefused(f"{path.parent} is not a directory")
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise NotebookRefused(f"cannot write in {path.parent}")
    read_notebook_on_disk(path)


def write_atomically(path: Path, parts: list[bytes], mode: int = 0o666) -> int:
    """The file in full beside ``path``, synced, then renamed over it: readers see the old file or the new.
    Returns its size."""
    temporary = path.with_name(f".{path.name}.loommux-{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)  # one a SIGKILL left, or a link put in its place: never written through
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    size = 0
    try:
        for part in parts:
            view = memoryview(zlib.decompress(part) if isinstance(part, Packed) else part)
            size += len(view)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)  # renamed only once written: even after a crash, the file is the old one or the new
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    finally:
        os.close(fd)
    return size


@dataclass
class NotebookWrites:
    """A mirror's writes so far: how many, how long they took, the file's size; and when the next may start
    (NOTEBOOK_WRITE_SHARE)."""

    writes: int = 0
    seconds: float = 0.0
    size: int = 0
    next_at: float = 0.0
    end_at: float = 0.0  # when the next may start once a long cell ended (NOTEBOOK_END_SHARE)

    def count(self, took: float, size: int, writing: float) -> None:
        """A write that took ``took`` in all, ``writing`` of it for the file alone (rendering apart: a running
        cell's outputs, once rendered, are not rendered again)."""
        self.writes += 1
        self.seconds += took
        self.size = size
        now = time.monotonic()
        self.next_at = now + took * (1 / NOTEBOOK_WRITE_SHARE - 1)
        self.end_at = now + writing * (1 / NOTEBOOK_END_SHARE - 1)


class RenderedCells:
    """One resource's cells as a mirror renders them: its settled executions joined in compressed blocks, the
    others (with the events after each) one by one; each render does only what changed."""

    def __init__(self, resource: Resource) -> None:
        self.resource = resource
        self.tag = secrets.token_hex(4)  # its cell ids start with it: unique among the file's sessions
        self.blocks: list[tuple[int, int, Packed]] = []  # the settled executions lo..hi, rendered
        self.recent: dict[int, bytes] = {}  # the other executions (with the events after each), rendered
        self.dirty: set[int] = set()
        self.seen = -1  # executions up to this one have been rendered
        self.output_seen: float | None = None  # the running execution's last output, when it was rendered
        self.kept: dict[int, CellOutputs] = {}  # the running executions' outputs, as last rendered
        self.long_ended = False  # a cell rendered running, a tick long or more, ended since the last render

    def changed(self, execution: Execution | None) -> None:
        self.dirty.add(execution.number if execution is not None else self.resource.last_number)
        if (execution is not None and execution.number in self.kept and execution.done
                and execution.elapsed >= NOTEBOOK_TICK):
            self.long_ended = True

    async def render(self) -> bool:
        """Render what changed since the last time (a settled block again when output came late to one of its
        executions); whether anything did."""
        numbers = self.changed_numbers()
        if not numbers:
            return False
        resource = self.resource
        events, pacer = group_events_by_execution(resource), Pacer()
        starts = [lo for lo, _, _ in self.blocks]
        stale = {bisect_right(starts, n) - 1 for n in numbers if self.blocks and n <= self.blocks[-1][1]}
        unsealed = 0
        for n in sorted(numbers):
            if not self.blocks or n > self.blocks[-1][1]:
                self.recent[n] = await render_group(resource, n, self.tag, events, pacer, self.kept)
                unsealed += len(self.recent[n])
                if unsealed >= NOTEBOOK_BLOCK_BYTES:  # as it goes: a long pass never holds much uncompressed
                    self.seal()
                    unsealed = 0
        for i in sorted(stale):
            lo, hi, _ = self.blocks[i]
            runs = [await render_group(resource, n, self.tag, events, pacer) for n in range(lo, hi + 1)]
            self.blocks[i] = (lo, hi, pack(b",\n".join(run for run in runs if run)))
        self.seal()
        self.kept = {n: kept for n, kept in self.kept.items() if kept.execution.state == RUNNING}
        return True

    def changed_numbers(self) -> set[int]:
        """The executions to render again: those changed, those new, the running one when it showed more."""
        resource = self.resource
        numbers, self.dirty, self.long_ended = self.dirty, set(), False
        numbers.update(range(self.seen + 1, resource.last_number + 1))
        numbers.difference_update(resource.sequence.earlier)  # the file it continues holds them already
        running = resource.running
        if running is not None and running.last_output != self.output_seen:
            numbers.add(running.number)
            self.output_seen = running.last_output
        self.seen = resource.last_number
        return numbers

    def seal(self) -> None:
        """Join the settled executions (ended, a later one accepted) rendered so far, lowest first, into
        blocks of about NOTEBOOK_BLOCK_BYTES."""
        resource, settled, size = self.resource, [], 0
        for n in sorted(self.recent):
            execution = resource.find_numbered(n)
            if n >= resource.last_number or (execution is not None and execution.state == RUNNING):
                break
            settled.append(n)
            size += len(self.recent[n])
            if size >= NOTEBOOK_BLOCK_BYTES:
                runs = [self.recent.pop(n) for n in settled]
                self.blocks.append((settled[0], settled[-1], pack(b",\n".join(run for run in runs if run))))
                settled, size = [], 0

    def runs(self) -> list[bytes]:
        """The cells, as rendered: the blocks, then the other executions' runs, lowest first."""
        return [*(data for _, _, data in self.blocks), *(self.recent[n] for n in sorted(self.recent))]

    def finalize(self) -> list[bytes]:
        """The cells for good (their resource retired): the blocks and the other runs in one block more."""
        recent = b",\n".join(run for _, run in sorted(self.recent.items()) if run)
        return [data for _, _, data in self.blocks] + ([pack(recent)] if recent else [])


class NotebookMirror:
    """One notebook file kept up to date with the resources that write to it, one after another (stdio's
    file after an eviction, a named resource retired and used again), after the cells of a notebook loommux
    wrote there before (each new session starts after a markdown cell saying so)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.cells: RenderedCells | None = None  # the resource it follows, and its cells
        self.done: list[bytes] = []  # runs of cells that never change again: earlier sessions' and resources'
        self.metadata: dict | None = None  # the earlier file's
        self.loaded = False
        self.unwritten = True  # the file is behind what the mirror holds (besides what render finds)
        self.pending: Resource | None = None  # to follow once the one it follows, being retired, is
        self.problem: str | None = None  # why the mirror is off
        self.writes = NotebookWrites()
        self.wake = asyncio.Event()
        self.hurry = asyncio.Event()  # a long cell the file shows running ended (see wait_turn)
        self.lock = asyncio.Lock()
        self.loading = asyncio.ensure_future(self.load())
        self.task = asyncio.ensure_future(self.keep())

    # -- what it mirrors

    @property
    def resource(self) -> Resource | None:
        return self.cells.resource if self.cells is not None else None

    def follow(self, resource: Resource) -> None:
        """From now on, the resource's executions (after a marker cell when the file has cells already); after
        the retirement of the one it follows, when that is under way."""
        resource.mirror(self)
        if self.resource is not None and self.resource.retired:
            self.pending = resource
            return
        if self.loaded and self.done:
            self.done.append(self.mark_new_session(resource))
        self.cells, self.unwritten = RenderedCells(resource), True
        if self.problem:
            resource.notices.append(f"Notebook off: {self.problem}.")
        self.wake.set()

    def mark_new_session(self, resource: Resource) -> bytes:
        text = (f"a new loommux session starts here: kernel {resource.kernel_name}, executions numbered "
                f"from 1 again (server pid {os.getpid()})")
        cell = make_markdown_cell(f"{secrets.token_hex(4)}-session", "session", time.time(), text)
        return encode_utf8(cell)

    def changed(self, resource: Resource, execution: Execution | None) -> None:
        if resource is self.resource:
            self.cells.changed(execution)
            self.wake.set()
            if self.cells.long_ended:
                self.hurry.set()

    async def retire(self, resource: Resource) -> None:
        """Before a retired resource's records go: its cells are final, then a cell says it was retired."""
        if resource is not self.resource:
            return
        await asyncio.shield(self.loading)
        async with self.lock:
            await self.cells.render()
            self.done += self.cells.finalize()
            retired = f"kernel {resource.kernel_name} was retired ({resource.retired}); its records are gone"
            cell = make_markdown_cell(f"{self.cells.tag}-retired", "retirement", time.time(), retired)
            self.done.append(encode_utf8(cell))
            self.metadata = make_notebook_metadata(resource, self.metadata)
            self.cells, self.unwritten = None, True
            resource.mirror(None)
            await self.write()
        if self.pending is not None:
            self.follow(self.pending)
            self.pending = None

    def turn_off(self, problem: str) -> None:
        self.problem = problem
        log(f"notebook mirror off: {problem}")
        if self.resource is not None:
            self.resource.notices.append(f"Notebook off: {problem}; the kernel goes on without it.")

    # -- rendering and writing

    async def load(self) -> None:
        """The notebook loommux wrote at the path before: its cells come first (read and encoded off the
        event loop)."""
        try:
            earlier = await run_in_thread(read_earlier_notebook, self.path)
        except NotebookRefused as exc:
            self.turn_off(str(exc))
            return
        if earlier is not None:
            self.metadata, cells = earlier
            self.done = [cells] if cells else []
            if self.done and self.resource is not None:
                self.done.append(self.mark_new_session(self.resource))
        self.loaded = self.unwritten = True

    def parts(self) -> list[bytes]:
        # the last kernel's metadata while one starts
        self.metadata = make_notebook_metadata(self.resource, self.metadata)
        return join_notebook_parts([*self.done, *(self.cells.runs() if self.cells else ())], self.metadata)

    async def write(self) -> None:
        """Render what changed and write the file, when it is behind."""
        started = time.monotonic()
        try:
            rendered = self.cells is not None and await self.cells.render()
            if not rendered and not self.unwritten:
                return
            parts, self.unwritten = self.parts(), False  # (what changes while it is written is written next)
        except OutputUnreadable as exc:
            self.turn_off(str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a fault of the mirror's own must not stop the server
            log(f"rendering the notebook {self.path} failed:\n{traceback.format_exc()}")
            self.turn_off(f"rendering it failed ({type(exc).__name__}: {exc}; a bug: please report it)")
            return
        writing = time.monotonic()
        try:
            size = await run_in_thread(write_atomically, self.path, parts)
        except OSError as exc:
            self.turn_off(f"cannot write {self.path}: {exc.strerror or exc}")
            return
        now = time.monotonic()
        self.writes.count(now - started, size, now - writing)

    async def keep(self) -> None:
        """After loading the earlier file, write after every change (an execution's start and end, late
        output, an event) and every NOTEBOOK_TICK while a cell runs; each write waits its turn
        (NOTEBOOK_WRITE_SHARE)."""
        await asyncio.shield(self.loading)
        while self.problem is None:
            ticking = self.resource is not None and self.resource.running is not None
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), NOTEBOOK_TICK if ticking else None)
            self.wake.clear()
            await self.wait_turn()
            async with self.lock:
                if self.problem is None:
                    await self.write()

    async def wait_turn(self) -> None:
        """Until the next write may start (NOTEBOOK_WRITE_SHARE), or sooner once a long cell the file shows
        running ended (NOTEBOOK_END_SHARE)."""
        while True:
            ended = self.cells is not None and self.cells.long_ended
            due = (self.writes.end_at if ended else self.writes.next_at) - time.monotonic()
            if due <= 0:
                return
            with contextlib.suppress(asyncio.TimeoutError):  # other changes wait: no wake-up for each cell
                await asyncio.wait_for(self.hurry.wait(), due)
            self.hurry.clear()

    async def close(self) -> None:
        """At shutdown: the last write, whatever the share of time."""
        async with self.lock:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            await self.loading
            if self.problem is None:
                await self.write()

    def summarize(self) -> dict:
        return {"file": str(self.path), "state": "off" if self.problem else "on", "problem": self.problem,
                "writes": self.writes.writes, "write_seconds": round(self.writes.seconds, 3),
                "bytes": self.writes.size}


class Notebooks:
    """A server's notebook mirrors: stdio's kernel to one file (``path``), or each resource over HTTP to a
    file of its own in ``directory``; every mirror writes a last time at shutdown."""

    def __init__(self, path: Path | None, directory: Path | None) -> None:
        self.path, self.directory = path, directory
        self.mirrors: dict[Path, NotebookMirror] = {}

    def watch(self, registry: Registry, binding: SessionBinding | None = None) -> None:
        """Mirror the resources of a registry: the one a stdio session leases (``binding``), or all."""
        if self.path is None and self.directory is None:
            return
        registry.observe(on_retire=self.retire)
        if binding is not None and self.path is not None:
            binding.on_attach = self.mirror
        elif self.directory is not None:
            registry.observe(on_new=self.mirror)

    def mirror(self, resource: Resource) -> None:
        path = self.path or self.directory / name_notebook_file(resource)
        if path not in self.mirrors:
            self.mirrors[path] = NotebookMirror(path)
        self.mirrors[path].follow(resource)

    async def retire(self, resource: Resource) -> None:
        mirror = resource.notebook
        if mirror is not None:
            await mirror.retire(resource)
            if resource.kind == "private" and self.path is None:  # its file is never continued: done
                await mirror.close()
                self.mirrors.pop(mirror.path, None)

    async def close(self) -> None:
        await asyncio.gather(*(mirror.close() for mirror in self.mirrors.values()))


@contextlib.asynccontextmanager
async def make_notebook_mirrors(settings: Settings) -> AsyncIterator[Notebooks]:
    """The server's mirrors, written a last time when it stops (after its resources: its killed cells too)."""
    notebooks = Notebooks(settings.notebook, settings.notebook_dir)
    try:
        yield notebooks
    finally:
        await notebooks.close()


# ---------------------------------------------------------------- Instance state

# An instance started with --state-dir keeps, over a restart, what lets its clients go on: its gateway kernels
# (each resource's name or handle, credential, gateway id, leases and highest execution number) and its
# handshake-era HTTP sessions, in one JSON file rewritten atomically as they change. Their executions and
# output are kept beside it, in its output directory (see "Output files"), and taken back with them. Tasks are
# not kept; local kernels stop with the server, so they are never recorded.
STATE_FILE = "state.json"
STATE_LOCK = "state.lock"  # held by the instance using the directory, for as long as it runs
STATE_FILE_MODE = 0o600  # it holds credentials: the kernels' control-plane tokens, the session ids
STATE_DIR_MODE = 0o700  # a state directory loommux makes: the user's alone
STATE_VERSION = 1  # a file of a newer version is refused, never misread
STATE_WRITE_DELAY = 0.05  # the changes of this long are written together
STATE_RENEW_INTERVAL = 1.0  # renewals alone rewrite the file at most this often (a lease's last signal)
STATE_RETIRED = "its leases ran out while loommux was down"
# What a state file's fields may hold: the forms loommux writes (a file that says otherwise is moved aside)
STATE_MAX_NUMBER = 2**31 - 1  # an execution number it records is never more (nor negative)
MINTED_HANDLE_RE = re.compile(r"~[A-Za-z0-9-]{1,32}\.[A-Za-z0-9_-]{1,64}")  # mint_id's, with the handle's ~
MINTED_SESSION_RE = re.compile(r"[A-Za-z0-9-]{1,32}\.[A-Za-z0-9_-]{1,64}")  # mint_id's
KERNEL_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{1,128}")  # a kernel's credential (token_urlsafe's)
REMOTE_ID_RE = re.compile(r"(?!\.\.?$)[A-Za-z0-9._-]{1,128}")  # a gateway kernel's id: one segment of a URL


@dataclass
class LeaseRecord:
    """A lease as the state file keeps it; its last signal in wall-clock time (monotonic time dies with the
    process)."""

    session: str
    policy: dict
    signal_at: float
    operator: str | None = None
    client: str | None = None
    by_argument: bool = False
    holder: str | None = None  # the id of the holding resource, for a holder lease


@dataclass
class KernelRecord:
    """A resource whose kernel runs on the gateway (``remote_id`` None: it had none at that moment)."""

    id: str
    kind: str
    name: str
    handle: str  # its handle when kernel="~" opened it, else ""
    token: str
    remote_id: str | None
    executions: int
    leases: list[LeaseRecord]
    reserved: int = 0  # execution numbers are reserved up to this one (a file without it: up to executions)


@dataclass
class SessionRecord:
    """A handshake-era HTTP session: its id, what its initialize settled, and the resource it leases (its
    lease is the one of that resource's labelled ``label``)."""

    id: str
    label: str
    protocol_version: str
    elicits: bool
    policy: dict
    resource_name: str | None = None
    operator: str | None = None
    client: str | None = None
    resource: str | None = None


@dataclass
class InstanceState:
    """The state file's content."""

    instance: str
    gateway: str  # the gateway's URL, as shown (never credentials)
    kernels: list[KernelRecord] = field(default_factory=list)
    sessions: list[SessionRecord] = field(default_factory=list)
    version: int = STATE_VERSION


# The JSON types a record's annotated fields may hold (a list of records is checked record by record).
RECORD_FIELD_TYPES = {"str": (str,), "str | None": (str, type(None)), "int": (int,), "float": (int, float),
                      "bool": (bool,), "dict": (dict,)}


def check_record(record: Any) -> None:
    """ValueError unless every field of a record read from the state file holds its annotated type."""
    for declared in fields(record):
        kinds, value = RECORD_FIELD_TYPES.get(declared.type), getattr(record, declared.name)
        if kinds is None or isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool)):
            continue
        raise ValueError(f"{type(record).__name__}.{declared.name} is {clip(repr(value), QUOTED_ID_CHARS)}")


def parse_state(data: dict) -> InstanceState:
    """The state of a file's JSON object; ValueError, TypeError or KeyError when it is not a whole one."""
    kernels = [KernelRecord(**{**k, "leases": [LeaseRecord(**lease) for lease in k["leases"]]})
               for k in data["kernels"]]
    state = InstanceState(data["instance"], data["gateway"], kernels,
                          [SessionRecord(**s) for s in data["sessions"]], data["version"])
    check_record(state)
    if not INSTANCE_NAME_RE.fullmatch(state.instance):
        raise ValueError(f"the instance name {clip(repr(state.instance), QUOTED_ID_CHARS)} is not one")
    if len({k.id for k in kernels}) < len(kernels):
        raise ValueError("a kernel is recorded twice")
    for k in kernels:
        check_kernel_record(k)
    for s in state.sessions:
        check_record(s)
        named = s.resource_name is None or RESOURCE_NAME_RE.fullmatch(s.resource_name)
        check_forms(s, {"id": MINTED_SESSION_RE.fullmatch(s.id),
                        "protocol_version": s.protocol_version in PROTOCOL_VERSIONS,
                        "resource": s.resource is None or is_kernel_ref(s.resource), "resource_name": named})
        restore_lease_policy(s.policy)
    return state


def check_kernel_record(k: KernelRecord) -> None:
    """ValueError unless a kernel's record holds what loommux writes: ids of the forms it mints (an id is a
    directory's name: never a path), execution numbers within bounds, whole leases."""
    check_record(k)
    if k.kind not in ("named", "private"):
        raise ValueError(f"a kernel record that is not one: {clip(repr(k.id), QUOTED_ID_CHARS)}")
    named = k.kind == "named"
    handle = k.handle in ("", k.name) if named else not k.handle or MINTED_HANDLE_RE.fullmatch(k.handle)
    check_forms(k, {"id": (RESOURCE_NAME_RE if named else PRIVATE_ID_RE).fullmatch(k.id),
                    "name": not named or RESOURCE_NAME_RE.fullmatch(k.name), "handle": handle,
                    "token": KERNEL_TOKEN_RE.fullmatch(k.token),
                    "remote_id": k.remote_id is None or REMOTE_ID_RE.fullmatch(k.remote_id),
                    "executions": 0 <= k.executions <= STATE_MAX_NUMBER,
                    "reserved": 0 <= k.reserved <= STATE_MAX_NUMBER})
    for lease in k.leases:
        check_record(lease)
        check_forms(lease, {"signal_at": math.isfinite(lease.signal_at) and lease.signal_at >= 0,
                            "holder": lease.holder is None or is_kernel_ref(lease.holder)})
        restore_lease_policy(lease.policy)


def check_forms(record: Any, forms: dict[str, Any]) -> None:
    """ValueError naming the first of a record's fields whose check (true when it holds a form loommux
    writes) failed."""
    for name, holds in forms.items():
        if not holds:
            value = clip(repr(getattr(record, name)), QUOTED_ID_CHARS)
            raise ValueError(f"{type(record).__name__}.{name} is {value}, not one loommux writes")


def restore_lease_policy(recorded: dict) -> LeasePolicy:
    policy = LeasePolicy(**recorded)
    policy.check()
    return policy


def hold_state_dir(directory: Path) -> None:
    """Lock the state directory for this process (the lock ends with it, however it ends); StartupError when
    another loommux holds it: two instances taking back the same kernels would share them."""
    try:
        fd = open_in_directory(str(directory), STATE_LOCK, os.O_RDWR | os.O_CREAT)
        if os.fstat(fd).st_nlink != 1:  # another name of a file elsewhere, which the pid would overwrite
            os.close(fd)
            raise OSError(errno.EMLINK, "it has another name (a hard link)")
    except OSError as exc:
        raise StartupError(f"state directory {directory}: cannot open its lock {STATE_LOCK} ({exc}): "
                           "refused to start") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise StartupError(f"state directory {directory} is in use by another loommux (pid {holder}): "
                           "refused to start; give each instance its own --state-dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())  # its descriptor stays open, holding the lock


def read_state(directory: Path, instance: str, gateway: Gateway | None) -> InstanceState | None:
    """The state an instance left in ``directory``, said in one line: None (start empty) when there is none or
    it is not a whole file (moved aside); StartupError when it is another instance's, a newer loommux's or
    another gateway's, which must not be overwritten (refused)."""
    path = directory / STATE_FILE
    for left in directory.glob(f".{STATE_FILE}.loommux-*.tmp"):  # a write a SIGKILL cut short
        with contextlib.suppress(OSError):
            left.unlink()
    try:
        with open(open_in_directory(str(directory), STATE_FILE, os.O_RDONLY), "rb") as file:
            data = json.loads(file.read())
        version = data["version"] if isinstance(data, dict) else None
        if not isinstance(version, int) or version < 1:
            raise ValueError("it has no state version")
        state = parse_state(data) if version <= STATE_VERSION else None
    except FileNotFoundError:
        log(f"state: no {path} yet: starting empty")
        return None
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        aside = path.with_name(f"{STATE_FILE}.bad-{time.strftime('%Y%m%dT%H%M%S')}")
        if aside.exists():  # another bad file this second: keep both
            aside = aside.with_name(f"{aside.name}-{os.getpid()}")
        try:
            os.replace(path, aside)
        except OSError as move:
            raise StartupError(f"state file {path} is not a whole state file ({exc}), and cannot be moved "
                               f"aside ({move}): refused to start") from None
        log(f"state: {path} is not a whole state file ({clip(str(exc), NOTICE_LINE_CHARS)}): moved it to "
            f"{aside.name} and started empty")
        return None
    except OSError as exc:
        raise StartupError(f"state file {path}: cannot read it ({exc}): refused to start") from None
    move = "move it away to start empty"
    if state is None:
        raise StartupError(f"state file {path} is from a newer loommux (state version {version}; this one "
                           f"reads {STATE_VERSION}): refused to start; run that loommux, or {move}")
    if instance and state.instance != instance:
        raise StartupError(f"state file {path} is loommux instance {state.instance}'s, and this is instance "
                           f"{instance}: refused to start; give each instance its own --state-dir")
    shown = gateway.shown_url if gateway else "none"
    if state.kernels and (gateway is None or state.gateway != shown):
        raise StartupError(f"state file {path} holds kernels on the gateway {state.gateway}, and this "
                           f"instance's gateway is {shown}: refused to start; {move}")
    log(f"state: {path}: instance {state.instance}, {len(state.kernels)} gateway kernels and "
        f"{len(state.sessions)} sessions to take back")
    return state


def is_kept(resource: Resource) -> bool:
    """Whether the state records a resource: one whose kernels the gateway runs."""
    return resource.source is None and resource.pool.gateway is not None and not resource.retired


def record_lease(lease: Lease, offset: float) -> LeaseRecord:
    return LeaseRecord(lease.session, lease.policy.as_dict(), round(lease.last_signal + offset, 3),
                       lease.operator, lease.client, lease.by_argument,
                       lease.holder.id if lease.holder is not None else None)


def record_kernel(resource: Resource, registry: Registry, offset: float) -> KernelRecord:
    handle = resource.handle if registry.handles.get(resource.handle) is resource else ""
    numbers = resource.sequence.record()
    return KernelRecord(resource.id, resource.kind, resource.name, handle, resource.token,
                        resource.kernel_holder.record().remote_id, numbers.last_number,
                        [record_lease(lease, offset) for lease in resource.leases], numbers.reserved)


def record_session(session_id: str, binding: SessionBinding, protocol_version: str,
                   elicits: bool) -> SessionRecord | None:
    """What the state keeps of a handshake session (None: it leases a kernel that is not kept)."""
    resource = binding.resource
    if resource is not None and not is_kept(resource):
        return None
    return SessionRecord(session_id, binding.label, protocol_version, elicits,
                         (binding.policy or binding.registry.policy).as_dict(), binding.resource_name,
                         binding.operator, binding.client, resource.id if resource is not None else None)


def restore_lease(registry: Registry, resource: Resource, record: LeaseRecord, holder: Resource | None,
                   offset: float) -> Lease:
    policy = restore_lease_policy(record.policy)
    lease = registry.grant(resource, record.session, record.operator, holder, policy)
    # a signal the file places in the future is taken as now: no file makes a lease outlast its window
    lease.resume(record.client, record.by_argument, min(record.signal_at, time.time()) - offset)
    return lease


async def restore(registry: Registry, state: InstanceState) -> list[tuple[SessionRecord, SessionBinding]]:
    """Make the recorded gateway kernels the registry's again (join_kept_kernels joins them), and retire,
    deleting its kernel, each that no live lease holds any more; the sessions' bindings, each on its lease (or
    with a notice that its kernel was not kept)."""
    offset = time.time() - time.monotonic()
    resources: dict[str, tuple[Resource, KernelRecord]] = {}
    for record in state.kernels:
        resource = Resource(registry.pool, record.name if record.kind == "named" else None,
                            registry.control_url, None, record.handle, record.id, record.token)
        resource.sequence.restore(SequenceRecord(record.executions, record.reserved))
        resource.kernel_holder.restore(HeldKernelRecord(record.remote_id))
        registry.adopt(resource, handed_out=bool(record.handle))
        resource.sequence.take_back()
        resources[record.id] = resource, record
    for resource, record in resources.values():
        for lease in record.leases:
            holder = resources.get(lease.holder) if lease.holder else None
            if lease.holder is None or holder is not None:
                restore_lease(registry, resource, lease, holder[0] if holder else None, offset)
    bindings = [(s, restore_binding(registry, s, resources)) for s in state.sessions]
    now = time.monotonic()
    for resource, _ in resources.values():
        for lease in list(resource.leases):
            expiry = lease.compute_expiry()
            if expiry is not None and expiry <= now:
                registry.release(lease, lease.lapse_reason())
    held = registry.find_held()
    await asyncio.gather(*(registry.retire(resource, STATE_RETIRED) for resource, _ in resources.values()
                           if resource not in held))  # at once: a gateway that is down holds each up
    return bindings


def join_kept_kernels(registry: Registry) -> None:
    """Once the control plane listens (a kernel that replaces one gone from the gateway is told its URL),
    join the kept kernels again, each in the background: checked on the gateway, then its channels opened."""
    for resource in registry.resources.values():
        if resource.kernel_holder.adopting is not None:
            resource.join_kept(registry.control_url)


def restore_binding(registry: Registry, record: SessionRecord,
                     resources: dict[str, tuple[Resource, KernelRecord]]) -> SessionBinding:
    resource = resources.get(record.resource)[0] if record.resource in resources else None
    leases = resource.leases if resource is not None else ()
    lease = next((lease for lease in leases if lease.session == record.label and not lease.by_argument
                  and lease.holder is None), None)
    binding = SessionBinding(registry, record.label, record.resource_name, record.operator,
                             restore_lease_policy(record.policy), client=record.client, lease=lease)
    if record.resource is not None and lease is None:
        binding.notices.append(f"Server restarted: loommux restarted, and the kernel this session worked in "
                               f"({record.resource}) was not kept: this is a fresh kernel, variables are "
                               "gone.")
    return binding


class StateKeeper:
    """The instance's state file, rewritten whenever what it records changes (changes close together written
    once, renewals at most every STATE_RENEW_INTERVAL), or at once when a kept resource must be recorded
    before it goes on (its new gateway kernel, its next block of execution numbers: ``flush``), written a
    last time when the server stops: by then without the kernels it deleted. One write at a time, never
    cancelled (its thread would go on beside the next)."""

    def __init__(self, path: Path, registry: Registry,
                 sessions: Callable[[], list[SessionRecord]]) -> None:
        self.path = path
        self.registry = registry
        self.sessions = sessions
        self.dirty = asyncio.Event()
        self.written = time.monotonic()  # when the last write began: later renewals are not in the file
        self.closing = False
        self.problem: str | None = None  # why the last write failed: said once, until a write succeeds
        self.writing = asyncio.Lock()
        self.flushed: asyncio.Future | None = None  # the write the flushes asked for wait for, not yet begun
        registry.observe(on_change=self.dirty.set, on_record=self.record)
        self.dirty.set()  # what a restart took back, and retired
        self.writer = asyncio.ensure_future(self.write_on_change())

    def take_snapshot(self) -> bytes:
        registry, offset = self.registry, time.time() - time.monotonic()
        gateway = registry.pool.gateway
        state = InstanceState(registry.instance, gateway.shown_url if gateway else "none",
                              [record_kernel(r, registry, offset) for r in registry.resources.values()
                               if is_kept(r)], self.sessions())
        return encode_utf8(json.dumps(asdict(state), indent=1))

    def renewed(self) -> bool:
        return any(lease.last_signal > self.written for r in self.registry.resources.values() if is_kept(r)
                   for lease in r.leases)

    async def write_on_change(self) -> None:
        """Write what changed, a while after it did; the last write once the server has stopped."""
        while not self.closing:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.dirty.wait(), STATE_RENEW_INTERVAL)
            if self.closing or (not self.dirty.is_set() and not self.renewed()):
                continue
            await asyncio.sleep(STATE_WRITE_DELAY)
            async with self.writing:
                await self.write()
        async with self.writing:
            await self.write()

    async def record(self, resource: Resource) -> None:
        if is_kept(resource):
            await self.flush()

    async def flush(self) -> None:
        """Return once a write begun after this call has ended: after a write under way, one more; the
        flushes asked for meanwhile share it. A write that fails was said, and the caller goes on."""
        if self.closing:
            return
        if self.flushed is None:
            self.flushed = asyncio.ensure_future(self.write_flushed())
        await asyncio.shield(self.flushed)

    async def write_flushed(self) -> None:
        async with self.writing:
            self.flushed = None  # a flush asked for from now on needs a later write
            if not self.closing:  # the last write is under way, or done
                await self.write()

    async def write(self) -> None:
        self.dirty.clear()
        self.written = time.monotonic()
        try:
            await run_in_thread(write_atomically, self.path, [self.take_snapshot()], STATE_FILE_MODE)
        except OSError as exc:
            if str(exc) != self.problem:
                log(f"state: cannot write {self.path}: {exc}")
            self.problem = str(exc)
            return
        if self.problem is not None:
            log(f"state: {self.path} is written again")
            self.problem = None

    async def close(self) -> None:
        self.registry.observe(on_change=lambda: None)
        self.closing = True
        self.dirty.set()
        await self.writer


# ---------------------------------------------------------------- Execution resources
# An execution's streams and images as MCP resources (README "Executions as resources"), named by loommux://
# URIs that say what a tool call would say: the kernel (as its kernel argument, left out for the caller's own
# kernel), the execution, then a stream (with a line range, as read_output's) or an image (its display
# number):
#   loommux://executions/{execution}/{stream}, ?lines=start:stop  loommux://executions/{execution}/images/{image}
#   loommux://kernels/{kernel}/executions/...                 the same in a named kernel or a private one
# A read gives what fits the token limit of results, then a note where it was cut and the URI of the rest.

RESOURCE_SCHEME = "loommux"
EXECUTION_URI_RE = re.compile(
    RESOURCE_SCHEME + r"://(?:kernels/(?P<kernel>[^/?#]+)/)?executions/(?P<execution>[1-9]\d{0,17})/"
    r"(?:images/(?P<image>[1-9]\d{0,8})|(?P<stream>[a-z]+))(?:\?(?P<query>[^#]*))?")
STREAM_MIME = "text/plain"
QUOTED_URI_CHARS = 200  # of a URI that names nothing, in the error that quotes it back
FINISHED_TTL_MS = 3_600_000  # a finished execution's streams never change, nor does any image
RUNNING_TTL_MS = 0  # a running execution's output grows: read it again
RECENT_TTL_MS = 0  # the recent executions change with every cell
TEMPLATES_TTL_MS = 3_600_000  # the URI templates change only with the server
CUT_NOTE_TOKENS = 200  # what a cut read leaves of the token limit for its note
UPDATE_INTERVAL = 1.0  # a growing output's subscribers hear of it at most this often
FIRST_READ_LINES = 64  # a read gathers lines in growing batches, from this many
STREAM_TEMPLATE_TEXT = (
    "One output stream of an execution (combined, stdout, stderr, result or traceback), as read_output reads "
    "it; ?lines=start:stop after it (1-based, negatives from the end: ?lines=-40:) reads part of it. A read "
    f"returns what fits {format_count(TOKEN_LIMIT)} tokens, then says where the rest is.")
IMAGE_TEMPLATE_TEXT = "An image an execution displayed, by its display number (as its caption says)."
RESOURCE_TEMPLATES = (
    {"uriTemplate": "loommux://executions/{execution}/{stream}", "name": "execution-stream",
     "title": "Execution output", "description": STREAM_TEMPLATE_TEXT, "mimeType": STREAM_MIME},
    {"uriTemplate": "loommux://executions/{execution}/images/{image}", "name": "execution-image",
     "title": "Execution image", "description": IMAGE_TEMPLATE_TEXT},
    {"uriTemplate": "loommux://kernels/{kernel}/executions/{execution}/{stream}",
     "name": "kernel-execution-stream", "title": "Execution output in a named kernel",
     "description": STREAM_TEMPLATE_TEXT + " kernel: a kernel name, or a private kernel's handle.",
     "mimeType": STREAM_MIME},
    {"uriTemplate": "loommux://kernels/{kernel}/executions/{execution}/images/{image}",
     "name": "kernel-execution-image", "title": "Execution image in a named kernel",
     "description": IMAGE_TEMPLATE_TEXT + " kernel: a kernel name, or a private kernel's handle."},
)


class UnknownUri(LookupError):
    """A URI that names no resource of this server (or nothing there now)."""


@dataclass(frozen=True)
class ExecutionUri:
    """What a loommux:// URI names: an execution's stream (some of its lines) or image, in the caller's own
    kernel (``kernel`` None) or in the kernel a tool's kernel argument would name."""

    execution: int
    stream: str | None = None
    image: int | None = None
    kernel: str | None = None
    lines: str | None = None

    def __str__(self) -> str:
        where = f"kernels/{self.kernel}/" if self.kernel else ""
        part = f"images/{self.image}" if self.image is not None else self.stream
        query = f"?lines={self.lines}" if self.lines is not None else ""
        return f"{RESOURCE_SCHEME}://{where}executions/{self.execution}/{part}{query}"


def parse_execution_uri(uri: str) -> ExecutionUri:
    """The URI's parts; UnknownUri when it is not one of ours, ValueError for a query it cannot take."""
    match = EXECUTION_URI_RE.fullmatch(uri)
    kernel = urllib.parse.unquote(match["kernel"]) if match and match["kernel"] else None
    named = kernel is None or RESOURCE_NAME_RE.fullmatch(kernel) or kernel[:1] == PRIVATE_ID_PREFIX
    if match is None or match["stream"] not in (None, *STREAMS) or not named:
        raise UnknownUri(f"{clip(uri, QUOTED_URI_CHARS)!r} is not a loommux:// URI of an execution's stream "
                         "or image")
    lines = None
    if match["query"] is not None:
        query = urllib.parse.parse_qsl(match["query"], keep_blank_values=True)
        if match["stream"] is None or [name for name, _ in query] != ["lines"]:
            raise ValueError('a stream\'s URI takes one query parameter, lines="start:stop"; an image, none')
        lines = query[0][1]
    return ExecutionUri(int(match["execution"]), match["stream"],
                        int(match["image"]) if match["image"] else None, kernel, lines)


def find_uri_kernel(binding: SessionBinding, kernel: str | None) -> Resource | None:
    """The kernel a URI's kernel part names, as a tool's kernel argument would (None: the caller's own, as a
    call without it), when it exists: a read never starts one."""
    kernel = kernel or binding.default_kernel
    if kernel is None:
        return binding.resource
    if kernel.startswith(PRIVATE_ID_PREFIX):
        return binding.registry.handles.get(kernel)
    found = binding.registry.resources.get(kernel)
    return found if found is not None and found.kind == "named" else None


def find_uri_execution(binding: SessionBinding, uri: ExecutionUri) -> Execution:
    resource = find_uri_kernel(binding, uri.kernel)
    if resource is None:
        which = f"there is no kernel {uri.kernel}" if uri.kernel else "this session has no kernel yet"
        raise UnknownUri(f"{which} ({clip(str(uri), QUOTED_URI_CHARS)})")
    execution = resource.find_numbered(uri.execution)
    if execution is None:
        raise UnknownUri(f"there is no execution {uri.execution} ({uri}); {resource.sequence.numbering()}")
    images = execution.images
    if uri.image is not None and not (uri.image <= len(images) and images[uri.image - 1].decoded):
        raise UnknownUri(f"execution {uri.execution} has no image {uri.image} that could be decoded ({uri})")
    return execution


def make_stream_link(execution: Execution, kernel: str | None, stream: str = "combined") -> dict:
    """A resource_link to an execution's stream, for a result that leaves it out."""
    n, output = execution.number, execution.log(stream)
    so_far = " so far" if execution.state == RUNNING else ""
    size = f"{pluralize(output.line_count, 'line')}{so_far} · {format_size(output.utf8_bytes)}"
    return {"type": "resource_link", "uri": str(ExecutionUri(n, stream, kernel=kernel)),
            "name": f"execution-{n}-{stream}", "title": f"In [{n}] {stream}", "description": size,
            "mimeType": STREAM_MIME, "size": output.utf8_bytes}


def make_image_link(execution: Execution, image: Image, kernel: str | None) -> dict:
    """A resource_link to an image a result leaves out."""
    n, display = execution.number, image.display
    return {"type": "resource_link", "uri": str(ExecutionUri(n, image=display, kernel=kernel)),
            "name": f"execution-{n}-image-{display}", "title": f"In [{n}] display {display}",
            "description": image.caption, "mimeType": image.mime, "size": image.size}


def describe_execution_resource(execution: Execution) -> dict:
    """An execution as resources/list shows it: its combined output, in the caller's own kernel."""
    n, output = execution.number, execution.output
    return {"uri": str(ExecutionUri(n, "combined")), "name": f"execution-{n}",
            "title": f"In [{n}] {clip(execution.first_line, 60)}",
            "description": (f"{execution.state} · {format_duration(execution.elapsed)} · "
                            f"{pluralize(output.line_count, 'line')} of output"),
            "mimeType": STREAM_MIME, "size": output.utf8_bytes,
            "annotations": {"lastModified": format_iso_utc(execution.completed_at or execution.submitted_at)}}


async def read_execution_part(execution: Execution, uri: ExecutionUri) -> tuple[dict, int]:
    """What resources/read returns of a URI of the execution (an image's blob; a stream's lines, cut at the
    token limit) and for how many milliseconds it stays fresh; ValueError for a bad line range."""
    if uri.image is not None:
        image = execution.images[uri.image - 1]
        return {"uri": str(uri), "mimeType": image.mime, "blob": image.load_data()}, FINISHED_TTL_MS
    log_read = output = execution.log(uri.stream)
    running = execution.state == RUNNING
    if running:
        output = output.frozen()  # read off the event loop while the cell writes on
    first, stop = parse_line_range(uri.lines, output.line_count)
    text = await asyncio.to_thread(render_stream_read, output, first, stop, uri)
    log_read.adopt_index(output)  # the next read indexes only what came since
    ttl = RUNNING_TTL_MS if running else FINISHED_TTL_MS
    return {"uri": str(uri), "mimeType": STREAM_MIME, "text": text}, ttl


def render_stream_read(output: Log, first: int, stop: int, uri: ExecutionUri) -> str:
    """Lines first..stop-1, all of them when they fit the token limit; else the first ones that fit (a line
    longer than the limit clipped), then the note (call from a worker thread)."""
    lines, clipped = take_fitting_lines(output, first, stop, TOKEN_LIMIT)
    if not clipped and first + len(lines) >= stop:
        return "\n".join(lines)
    lines, clipped = take_fitting_lines(output, first, stop, TOKEN_LIMIT - CUT_NOTE_TOKENS)
    return "\n".join([*lines, describe_cut(uri, first, first + len(lines), stop, output.line_count, clipped)])


def take_fitting_lines(output: Log, first: int, stop: int, budget: int) -> tuple[list[str], bool]:
    """The most lines from ``first`` (before ``stop``) whose text is at most ``budget`` tokens, and whether
    the first line alone is longer (then it is returned clipped to fit)."""
    bound = budget * MAX_TOKEN_BYTES  # no longer text fits: no token is longer than MAX_TOKEN_BYTES
    lines, size, at, batch = [], 0, first, FIRST_READ_LINES
    while at < stop and size <= bound:
        more = output.lines(at, min(stop, at + batch)).split("\n")
        lines += more
        size += sum(map(len, more)) + len(more)
        at, batch = at + len(more), batch * 2
    kept, used = [], 0
    for line in lines:
        used += count_tokens(line[:bound]) + 1
        if used > budget:
            break
        kept.append(line)
    while kept and count_tokens("\n".join(kept)) > budget:
        kept.pop()
    if kept or not lines:
        return kept, False
    return [clip_to_tokens(lines[0], budget)], True


def clip_to_tokens(line: str, budget: int) -> str:
    """The longest start of a line that is at most ``budget`` tokens, found in a few counts."""
    size = min(len(line), budget * MAX_TOKEN_BYTES)
    while (tokens := count_tokens(line[:size])) > budget:
        size = int(size * budget / tokens * 0.95)
    return line[:size]


def describe_cut(uri: ExecutionUri, first: int, end: int, stop: int, total: int, clipped: bool) -> str:
    """The note ending a read cut at the token limit: what it shows (lines first..end-1, or the start of a
    line too long), and the URI and the call that read on."""
    also = ("" if uri.stream == "combined" else f', stream="{uri.stream}"') + (
        f', kernel="{uri.kernel}"' if uri.kernel else "")
    if clipped:
        what = f"line {format_count(first + 1)} of {format_count(total)} is longer: its start is shown"
        after, call_range = first + 2, f"{first + 1}:{first + 1}"
    else:
        what = f"lines {format_count(first + 1)}-{format_count(end)} of {format_count(total)} shown"
        after, call_range = end + 1, f"{end + 1}:"
    rest = replace(uri, lines=f"{after}:{stop if stop < total else ''}")
    where = f"the rest: {rest} · " if after <= stop else ""
    call = f'read_output(execution={uri.execution}, line_range="{call_range}"{also})'
    return f"[cut at the {format_count(TOKEN_LIMIT)}-token limit: {what} · {where}or {call}]"


async def follow_output(execution: Execution, stream: str, tell: Callable[[], None]) -> None:
    """Tell of a running execution's stream as it grows, at most once an UPDATE_INTERVAL, and once at its
    end."""
    seen = execution.log(stream).chars
    while not execution.done:
        await execution.wait(UPDATE_INTERVAL)
        size = execution.log(stream).chars
        if execution.done or size != seen:
            seen = size
            tell()


# ---------------------------------------------------------------- Execution view
# The running cell as an MCP App (the io.modelcontextprotocol/ui extension, SEP-1865; README "The execution
# view"): for a host that declared the extension, run_cell and wait link one ui:// page, which the host shows
# in its sandbox under the specification's default CSP. The page is self-contained (inline script and style,
# images as data: URIs, no network), speaks the view's side of the protocol by hand, and reads what it shows
# through the app-only tool view_output (the model never sees it, nor the lines and images it returns).

UI_EXTENSION = "io.modelcontextprotocol/ui"
VIEW_MIME = "text/html;profile=mcp-app"
VIEW_URI = "ui://loommux/execution"
VIEW_LINKED_TOOLS = ("run_cell", "wait")
VIEW_TOOL = "view_output"
APP_VISIBILITY = ["app"]  # an app-only tool: hosts list it to views, never to the model
DEPRECATED_VIEW_KEY = "ui/resourceUri"  # the flat key older hosts read (removed before the spec's GA)
VIEW_PAGE_LINES = 200  # lines one view_output call returns at most
VIEW_LINE_CHARS = 2000  # a longer line is clipped for the view (read_output reads it whole)
VIEW_RICH_MIMES = ("text/html", "image/svg+xml")  # rich outputs the view renders (images come as images)
VIEW_READ_CHARS = 8 << 20  # of images and HTML in one view_output result (at least one item); the rest next
VIEW_RESOURCE_META = {"ui": {"prefersBorder": True}}  # no csp: the page contacts nothing


def declares_apps(capabilities: Any) -> bool:
    """Whether a client's capabilities declare the MCP Apps extension with HTML views (mimeTypes is required,
    and must name the MIME type of our page)."""
    extensions = capabilities.get("extensions") if isinstance(capabilities, dict) else None
    settings = extensions.get(UI_EXTENSION) if isinstance(extensions, dict) else None
    mimes = settings.get("mimeTypes") if isinstance(settings, dict) else None
    return isinstance(mimes, list) and VIEW_MIME in mimes


def describe_view_meta(name: str, app_only: bool) -> dict:
    """A tool's ``_meta`` keys for a host that renders views: the linked page, or the app-only visibility."""
    if app_only:
        return {"ui": {"visibility": APP_VISIBILITY}}
    if name in VIEW_LINKED_TOOLS:
        return {"ui": {"resourceUri": VIEW_URI}, DEPRECATED_VIEW_KEY: VIEW_URI}
    return {}


def read_view_page() -> dict:
    """resources/read of the view: the page, as the specification wants it served."""
    return {"uri": VIEW_URI, "mimeType": VIEW_MIME, "text": VIEW_HTML, "_meta": VIEW_RESOURCE_META}


async def describe_for_view(execution: Execution, line_range: str | None, images_after: int,
                            rich_after: int) -> dict:
    """What the view shows of an execution: its number, state, elapsed time and first source line, a window
    of its combined output (the tail when no range is given), and the images and HTML outputs it has not
    yet got (those after the counts it gives, as many as VIEW_READ_CHARS allow: ``images_next`` and
    ``html_next`` say where the next read starts; HTML is counted among all the displays, so that a poll
    reads none of those the view has passed). ValueError for a bad line range."""
    output = execution.output
    if execution.state == RUNNING:
        output = output.frozen()  # read off the event loop while the cell writes on
    total = output.line_count
    first, stop = parse_line_range(line_range or f"-{VIEW_PAGE_LINES}:", total)
    stop = min(stop, first + VIEW_PAGE_LINES)
    text = await asyncio.to_thread(output.lines, first, stop) if stop > first else ""
    execution.output.adopt_index(output)  # each poll indexes only what came since the last
    images, images_next = take_within(execution.images, images_after, measure_base64, VIEW_READ_CHARS)
    sent = await asyncio.to_thread(load_view_images, images)
    used = sum(len(image["data"]) for image in sent)
    displays = tuple(execution.rich or ())
    shown, html_next = await asyncio.to_thread(list_rich, displays, rich_after, VIEW_READ_CHARS - used)
    return {
        "execution": execution.number, "state": execution.state,
        "elapsed_seconds": round(execution.elapsed, 3),
        "source": clip(describe_cell_start(execution.source), 200), "line_count": total,
        "first_line": first + 1,
        "lines": [line[:VIEW_LINE_CHARS] for line in text.split("\n")] if stop > first else [],
        "images": sent,
        "images_next": images_next, "image_count": len(execution.images),
        "html": [{"mime": mime, "text": body} for mime, body in shown],
        "html_next": html_next, "html_count": len(displays),
    }


def measure_base64(image: Image) -> int:
    """The length of an image's base64 data, whether it is in memory or kept in the file of displays."""
    return (len(image.data) or (image.size + 2) // 3 * 4) if image.decoded else 0


def load_view_images(images: list[Image]) -> list[dict]:
    """The images a view is sent, with their data, read back from the file of displays where kept there (one
    no longer there, or never decoded, is left out)."""
    sent = []
    for image in images:
        with contextlib.suppress(OutputUnreadable, KeyError, TypeError):
            if image.decoded:
                sent.append({"display": image.display, "mime": image.mime, "data": image.load_data(),
                             "line": image.line + 1})
    return sent


def take_within(items: list | tuple, start: int, size: Callable[[Any], int], budget: int) -> tuple[list, int]:
    """The items from ``start`` on whose sizes fit ``budget`` (the first one always, when the budget is
    not spent), and the index after the last one taken."""
    taken, used = [], 0
    for item in items[start:]:
        used += size(item)
        if used > budget and (taken or budget <= 0):
            break
        taken.append(item)
    return taken, start + len(taken)


def describe_cell_start(source: str) -> str:
    """The cell's first line that says what it does: not its header, not a blank one."""
    lines = source.split("\n")
    return next((line for line in lines if line.strip() and not line.startswith(HEADER_PREFIX)), lines[0])


def list_rich(displays: tuple, start: int, budget: int) -> tuple[list[tuple[str, str]], int]:
    """The HTML and SVG outputs among an execution's displays from position ``start`` on, as (MIME type,
    text), as many as ``budget`` characters allow (the first always, when the budget is not spent), a big one
    read back from the execution's file of displays (one no longer there is left out); and the position
    after the last display looked at."""
    rich, used = [], 0
    for position in range(start, len(displays)):
        with contextlib.suppress(OutputUnreadable):
            item = load_display(displays[position])
            if mime := pick_rich_mime(item):
                used += len(item["data"][mime])
                if used > budget and (rich or budget <= 0):
                    return rich, position
                rich.append((mime, item["data"][mime]))
    return rich, max(start, len(displays))


def pick_rich_mime(item: Any) -> str | None:
    """The MIME type of a display the view renders as HTML (a kept display's content), if it is one."""
    data = item.get("data") if isinstance(item, dict) else None
    if not isinstance(data, dict):
        return None
    return next((mime for mime in VIEW_RICH_MIMES if isinstance(data.get(mime), str)), None)


# The page: a header (number, state, elapsed time, first source line, the Interrupt button), a line finder
# ("Line"), the output window with its line numbers, then the images and HTML outputs.
VIEW_PAGE = r"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>loommux execution</title>
<style>
:root { color-scheme: light dark; --fg: light-dark(#1b1b1b, #e8e8e8); --bg: light-dark(#fff, #1e1e1e);
  --muted: light-dark(#666, #a0a0a0); --line: light-dark(#e4e4e4, #3a3a3a);
  --hit: light-dark(#fff3b0, #5a4a00);
  --run: #1a7f37; --bad: #cf222e; }
* { box-sizing: border-box; }
body { margin: 0; padding: 8px; font: 13px/1.4 system-ui, sans-serif; color: var(--fg);
  background: var(--bg); }
header { display: flex; flex-wrap: wrap; gap: 8px; align-items: center; }
#number { font-weight: 600; font-family: ui-monospace, monospace; }
#state { padding: 1px 6px; border-radius: 8px; border: 1px solid var(--line); }
#state.running { color: var(--run); border-color: var(--run); }
#state.error, #state.interrupted { color: var(--bad); }
#source { color: var(--muted); font-family: ui-monospace, monospace; white-space: pre; overflow: hidden;
  text-overflow: ellipsis; flex: 1 1 200px; }
nav { display: flex; flex-wrap: wrap; gap: 6px; align-items: center; margin: 6px 0; }
nav input { width: 8em; } #where { color: var(--muted); }
#out { max-height: 360px; overflow: auto; border: 1px solid var(--line); border-radius: 4px;
  font: 12px/1.35 ui-monospace, monospace; white-space: pre; }
.l { display: flex; } .l.hit { background: var(--hit); }
.l .n { flex: none; min-width: 5.5em; padding: 0 8px 0 4px; text-align: right; color: var(--muted);
  user-select: none; } .l .t { flex: 1; }
#images img, .rich > img { max-width: 100%; display: block; margin: 6px 0; }
.rich { position: relative; contain: layout paint; overflow: auto; }
#error { color: var(--bad); }
</style></head>
<body>
<header><span id="number">In [ ]</span><span id="state">waiting</span><span id="elapsed"></span>
<span id="source"></span><button id="interrupt" type="button" disabled>Interrupt</button></header>
<nav><label for="line">Line</label><input id="line" type="number" min="1" inputmode="numeric">
<button id="earlier" type="button">Earlier</button><button id="later" type="button">Later</button>
<button id="tail" type="button">Tail</button><span id="where"></span></nav>
<div id="out" role="log" aria-label="Output" tabindex="0"></div>
<div id="images"></div><div id="rich"></div><div id="error" role="alert"></div>
<script>
"use strict";
const PAGE = %PAGE%, POLL_MS = 1000, TOOL = "view_output";
const $ = (id) => document.getElementById(id);
const view = { execution: null, kernel: undefined, first: 1, count: 0, follow: true, hit: null, state: null,
  elapsed: 0, at: 0, images: 0, html: 0, timer: null, busy: false, closed: false, starting: false,
  opening: false };
let nextId = 1;
const pending = new Map();

function post(message) { window.parent.postMessage({ jsonrpc: "2.0", ...message }, "*"); }
function request(method, params) {
  const id = nextId++;
  post({ id, method, params });
  return new Promise((resolve, reject) => pending.set(id, { resolve, reject }));
}
function notify(method, params) { post({ method, params }); }

window.addEventListener("message", (event) => {
  if (event.source !== window.parent) return;
  const m = event.data;
  if (!m || m.jsonrpc !== "2.0") return;
  if (m.method === undefined && pending.has(m.id)) {
    const call = pending.get(m.id); pending.delete(m.id);
    if (m.error) call.reject(new Error(m.error.message || "error")); else call.resolve(m.result);
  } else if (m.method !== undefined && m.id !== undefined) {
    answer(m);
  } else if (m.method !== undefined) {
    hear(m.method, m.params || {});
  }
});

function answer(m) {
  if (m.method === "ui/resource-teardown") { view.closed = true; clearTimeout(view.timer); }
  if (m.method === "ping" || m.method === "ui/resource-teardown") post({ id: m.id, result: {} });
  else post({ id: m.id, error: { code: -32601, message: "Method not found: " + m.method } });
}

function hear(method, params) {
  if (method === "ui/notifications/tool-input") takeInput(params.arguments || {});
  else if (method === "ui/notifications/tool-result") takeResult(params);
  else if (method === "ui/notifications/tool-cancelled") cancelled(params.reason);
  else if (method === "ui/notifications/host-context-changed") applyContext(params);
}

function applyContext(context) {
  if (context && (context.theme === "light" || context.theme === "dark"))
    document.documentElement.style.colorScheme = context.theme;
}

function takeInput(args) {
  if (typeof args.kernel === "string" && args.kernel !== "~") view.kernel = args.kernel;
  if (Number.isInteger(args.execution)) view.execution = args.execution;
  view.starting = typeof args.freeform === "string";  // run_cell: its cell is the running one, if any
  view.opening = args.kernel === "~";  // a new private kernel: its handle comes with the result
  if (!view.opening) schedule(0);
}

function takeResult(result) {
  const texts = (result.content || []).filter((b) => b.type === "text").map((b) => b.text);
  const data = result.structuredContent || {};
  let number = Number.isInteger(data.execution) ? data.execution : null;
  for (const text of texts) {
    const found = number === null && /^In \[(\d+)\]/.exec(text);
    if (found) number = Number(found[1]);
    const handle = view.opening && /^Kernel (~[^\s:]+): pass kernel=/m.exec(text);
    if (handle) view.kernel = handle[1];
  }
  if (typeof data.kernel === "string") view.kernel = data.kernel;
  if (view.opening && view.kernel === undefined) number = null;  // never the session's own kernel instead
  view.starting = false;
  if (number === null) { if (result.isError) showError(texts.join("\n")); return; }
  if (number !== view.execution) { view.execution = number; view.images = view.html = 0; clearRich(); }
  schedule(0);
}

function cancelled(reason) {
  if (view.execution === null) showError("The call was cancelled" + (reason ? ": " + reason : ""));
}

function showError(text) { $("error").textContent = text; }

function schedule(ms) {
  clearTimeout(view.timer);
  if (!view.closed) view.timer = setTimeout(refresh, ms);
}

// A tool's result; its text when it failed, as an Error. view_output's data is its first text block's first
// line (JSON), also where a host strips structuredContent and the server appended notices.
async function callTool(name, args) {
  const result = await request("tools/call", { name, arguments: args });
  const texts = (result.content || []).filter((b) => b.type === "text").map((b) => b.text);
  if (result.isError) throw new Error(texts.join("\n"));
  return result;
}
async function readView(args) {
  const result = await callTool(TOOL, args);
  const json = (result.content || []).find((b) => b.type === "text" && b.text.startsWith("{"));
  return result.structuredContent || JSON.parse(json.text.split("\n")[0]);
}

function viewArgs(extra) {
  const args = { ...extra };
  if (view.execution !== null) args.execution = view.execution;
  if (view.kernel !== undefined) args.kernel = view.kernel;
  return args;
}

async function refresh(range) {
  if (view.busy) { schedule(200); return; }
  view.busy = true;
  let more = false;
  try {
    if (range === undefined && !view.follow) range = view.first + ":" + (view.first + PAGE - 1);
    const args = viewArgs({ images_after: view.images, html_after: view.html });
    if (range !== undefined) args.line_range = range;
    const data = await readView(args);
    showError("");
    more = show(data) && (view.images < data.image_count || view.html < data.html_count);
  } catch (error) {
    showError(String(error.message || error));
  } finally {
    view.busy = false;
  }
  if (more) schedule(0);
  else if (view.state === "running" || view.state === null) schedule(POLL_MS);
}

function show(data) {
  if (view.starting && data.state !== "running") return false;  // an earlier cell: wait for the result
  if (view.execution !== data.execution) { view.images = view.html = 0; clearRich(); }
  view.execution = data.execution; view.state = data.state;
  view.elapsed = data.elapsed_seconds; view.at = performance.now();
  view.first = data.first_line; view.count = data.line_count;
  $("number").textContent = "In [" + data.execution + "]";
  $("state").textContent = data.state; $("state").className = data.state;
  $("source").textContent = data.source;
  $("interrupt").disabled = data.state !== "running";
  tick();
  renderLines(data.lines);
  for (const image of data.images) addImage(image);
  view.images = data.images_next;
  for (const item of data.html) addRich(item);
  view.html = data.html_next;
  return true;
}

function tick() {
  const running = view.state === "running";
  const seconds = view.elapsed + (running ? (performance.now() - view.at) / 1000 : 0);
  $("elapsed").textContent = formatSeconds(seconds);
}
setInterval(() => { if (view.state === "running") tick(); }, 250);

function formatSeconds(s) {
  if (s < 60) return s.toFixed(1) + " s";
  const m = Math.floor(s / 60);
  return m < 60 ? m + " min " + Math.floor(s % 60) + " s" : Math.floor(m / 60) + " h " + (m % 60) + " min";
}

const ANSI = /\x1b\[[0-9;?]*[A-Za-z]/g;
function renderLines(lines) {
  const out = $("out"), fragment = document.createDocumentFragment();
  lines.forEach((text, i) => {
    const n = view.first + i, row = document.createElement("div");
    row.className = n === view.hit ? "l hit" : "l"; row.dataset.line = n;
    const number = document.createElement("span"), body = document.createElement("span");
    number.className = "n"; number.textContent = n;
    body.className = "t"; body.textContent = text.replace(ANSI, "");
    row.append(number, body); fragment.append(row);
  });
  out.replaceChildren(fragment);
  const last = view.first + lines.length - 1;
  $("where").textContent = view.count ? "lines " + view.first.toLocaleString("en") + "\u2013"
    + last.toLocaleString("en") + " of " + view.count.toLocaleString("en") : "no output yet";
  const hit = view.hit !== null && out.querySelector('[data-line="' + view.hit + '"]');
  if (hit) out.scrollTop = hit.offsetTop - out.offsetTop - out.clientHeight / 2;
  else if (view.follow) out.scrollTop = out.scrollHeight;
}

function addImage(image) {
  const img = document.createElement("img");
  img.src = "data:" + image.mime + ";base64," + image.data;
  img.alt = "display " + image.display + " (output line " + image.line + ")";
  $("images").append(img);
}

// HTML a kernel displayed (and SVG inside it), sanitised as the browser parsed it, in a shadow root inside a
// box of its own. The nodes are cleaned in place, never serialised and parsed again. Only the elements and
// attributes listed stay (no script, handler, frame, form, area, SVG animation); a URL stays when the
// browser's own URL parser (which drops tabs and newlines, and trims leading controls and spaces) reads it
// as http:, https: or a #fragment, or data:image/… for an image; links open outside the view. The box
// contains its layout and paint: even position: fixed stays inside it, below the header and its buttons.
const HTML_NS = "http://www.w3.org/1999/xhtml", SVG_NS = "http://www.w3.org/2000/svg",
  MATH_NS = "http://www.w3.org/1998/Math/MathML";
const splitWords = (text) => new Set(text.trim().split(/\s+/));
const RICH_ELEMENTS = {
  [HTML_NS]: splitWords(`a abbr article aside b bdi bdo big blockquote br caption center cite code col
    colgroup dd del details dfn div dl dt em figcaption figure font footer h1 h2 h3 h4 h5 h6 header hr i img
    ins kbd li main mark nav ol p pre q rp rt ruby s samp section small span strike strong style sub summary
    sup table tbody td tfoot th thead time tr tt u ul var wbr`),
  [SVG_NS]: splitWords(`a circle clipPath defs desc ellipse feBlend feColorMatrix feComponentTransfer
    feComposite feConvolveMatrix feDiffuseLighting feDisplacementMap feDistantLight feDropShadow feFlood
    feFuncA feFuncB feFuncG feFuncR feGaussianBlur feMerge feMergeNode feMorphology feOffset fePointLight
    feSpecularLighting feSpotLight feTile feTurbulence filter g image line linearGradient marker mask path
    pattern polygon polyline radialGradient rect stop style svg switch symbol text textPath title tspan use`),
  [MATH_NS]: splitWords(`math mfrac mi mmultiscripts mn mo mover mpadded mphantom mprescripts mroot mrow ms
    mspace msqrt mstyle msub msubsup msup mtable mtd mtext mtr munder munderover none semantics`),
};
const RICH_ATTRIBUTES = {
  [HTML_NS]: splitWords(`abbr align alt bgcolor border cellpadding cellspacing class color colspan datetime
    dir face headers height hidden href id lang nowrap open reversed role rowspan scope size span src start
    style summary title type valign value width`),
  [SVG_NS]: splitWords(`alignment-baseline amplitude azimuth baseFrequency baseline-shift bias class clip
    clip-path clip-rule clipPathUnits color color-interpolation color-interpolation-filters cx cy d
    diffuseConstant direction display divisor dominant-baseline dx dy edgeMode elevation exponent fill
    fill-opacity fill-rule filter filterUnits flood-color flood-opacity font-family font-size
    font-size-adjust font-stretch font-style font-variant font-weight fr fx fy gradientTransform
    gradientUnits height href id image-rendering in in2 intercept isolation k1 k2 k3 k4 kernelMatrix
    kernelUnitLength lang lengthAdjust letter-spacing lighting-color limitingConeAngle marker-end marker-mid
    marker-start markerHeight markerUnits markerWidth mask maskContentUnits maskUnits method mix-blend-mode
    mode numOctaves offset opacity operator order orient overflow paint-order pathLength patternContentUnits
    patternTransform patternUnits pointer-events points pointsAtX pointsAtY pointsAtZ preserveAlpha
    preserveAspectRatio primitiveUnits r radius refX refY result role rotate rx ry scale seed
    shape-rendering side slope spacing specularConstant specularExponent spreadMethod startOffset
    stdDeviation stitchTiles stop-color stop-opacity stroke stroke-dasharray stroke-dashoffset
    stroke-linecap stroke-linejoin stroke-miterlimit stroke-opacity stroke-width style surfaceScale
    tableValues targetX targetY text-anchor text-decoration text-rendering textLength transform type
    unicode-bidi vector-effect viewBox visibility width word-spacing writing-mode x x1 x2 xChannelSelector
    xlink:href xml:space y y1 y2 yChannelSelector z`),
  [MATH_NS]: splitWords(`accent accentunder class columnalign columnspan depth dir display displaystyle
    fence height id largeop linethickness lspace mathbackground mathcolor mathsize mathvariant movablelimits
    rowalign rowspan rspace scriptlevel separator stretchy style symmetric voffset width`),
};
const ANY_ELEMENT_ATTRIBUTE = /^(?:aria|data)-[\w.-]+$/;
const URL_ATTRIBUTES = splitWords("href src xlink:href");
const URL_BASE = "https://rich.invalid/";  // a relative URL takes its scheme from the base: http(s) in a view

// Whether the browser, given this URL on this element, would fetch or open something allowed.
function allowsUrl(node, value) {
  let url;
  try { url = new URL(value, URL_BASE); } catch { return false; }
  if (url.href.startsWith(URL_BASE + "#")) return true;
  if (node.localName !== "a" && node.localName !== "img" && node.localName !== "image") return false;
  if (url.protocol === "http:" || url.protocol === "https:") return true;
  return node.localName !== "a" && url.protocol === "data:" && /^image\//i.test(url.pathname);
}

function cleanAttributes(node) {
  const allowed = RICH_ATTRIBUTES[node.namespaceURI];
  for (const attribute of [...node.attributes]) {
    const name = attribute.name;
    const kept = (allowed.has(name) || ANY_ELEMENT_ATTRIBUTE.test(name))
      && (!URL_ATTRIBUTES.has(name) || allowsUrl(node, attribute.value));
    if (!kept) node.removeAttributeNode(attribute);
  }
  if (node.localName !== "a") return;
  node.setAttribute("target", "_blank"); node.setAttribute("rel", "noreferrer");
}

function cleanTree(parent) {
  for (const node of [...parent.childNodes]) {
    if (node.nodeType === Node.TEXT_NODE) continue;
    const names = node.nodeType === Node.ELEMENT_NODE && RICH_ELEMENTS[node.namespaceURI];
    if (!names || !names.has(node.localName)) { node.remove(); continue; }
    cleanAttributes(node);
    cleanTree(node);
  }
}

function sanitize(html) {
  const template = document.createElement("template");  // an inert parse: nothing runs, nothing loads
  template.innerHTML = html;
  cleanTree(template.content);
  return template.content;
}

function addRich(item) {
  const box = document.createElement("div"); box.className = "rich";
  if (item.mime === "image/svg+xml") {  // as an image: no script, no link
    const img = box.appendChild(document.createElement("img"));
    img.src = "data:image/svg+xml;charset=utf-8," + encodeURIComponent(item.text);
    img.alt = "SVG display";
  } else {
    box.appendChild(document.createElement("div")).attachShadow({ mode: "open" }).append(sanitize(item.text));
  }
  $("rich").append(box);
}
function clearRich() { $("images").replaceChildren(); $("rich").replaceChildren(); }

function goToLine(n) {
  if (!Number.isInteger(n) || n < 1 || view.execution === null) return;
  view.follow = false; view.hit = n;
  view.first = Math.max(1, n - PAGE / 2);
  refresh(view.first + ":" + (view.first + PAGE - 1));
}
$("line").addEventListener("keydown", (e) => { if (e.key === "Enter") goToLine(Number($("line").value)); });
$("line").addEventListener("change", () => goToLine(Number($("line").value)));
$("earlier").addEventListener("click", () => {
  view.follow = false; view.hit = null; view.first = Math.max(1, view.first - PAGE); refresh();
});
$("later").addEventListener("click", () => {
  view.hit = null;
  if (view.first + PAGE > view.count) { view.follow = true; refresh(); return; }
  view.follow = false; view.first += PAGE; refresh();
});
$("tail").addEventListener("click", () => { view.follow = true; view.hit = null; refresh(); });
$("interrupt").addEventListener("click", async () => {
  $("interrupt").disabled = true;
  try {
    await callTool("interrupt", view.kernel === undefined ? {} : { kernel: view.kernel });
  } catch (error) {
    showError(String(error.message || error));
  }
  schedule(0);
});

new ResizeObserver(() => {
  const root = document.documentElement;
  notify("ui/notifications/size-changed", { width: root.scrollWidth, height: root.scrollHeight });
}).observe(document.documentElement);

request("ui/initialize", {
  protocolVersion: "2026-01-26", appInfo: { name: "loommux-execution", version: "%VERSION%" },
  appCapabilities: { availableDisplayModes: ["inline"] },
}).then((result) => {
  applyContext(result.hostContext || {});
  notify("ui/notifications/initialized", {});
}, (error) => showError("The host refused the view: " + error.message));
</script>
</body></html>
"""
VIEW_HTML = VIEW_PAGE.replace("%PAGE%", str(VIEW_PAGE_LINES)).replace("%VERSION%", __version__)


# ---------------------------------------------------------------- Tools

DEFAULT_WAIT_TIMEOUT = 30.0
INSPECTOR_NOTE_CHARS = 2000  # of what an inspector said, in a result
MAX_ARGUMENT_DEPTH = 500  # how deeply a published tool's argument may nest (JSON's decoders recurse)
MAX_WAIT_TIMEOUT = 3600.0
DEFAULT_MAX_MATCHES = 500
# Searches running at once in processes of their own: more would only share the CPUs.
MAX_SEARCH_PROCESSES = max(2, os.cpu_count() or 1)
# Process-wide, as the CPUs are: the forked searches of every server in this process share these slots.
_search_slots = asyncio.Semaphore(MAX_SEARCH_PROCESSES)
MAX_CONTEXT_LINES = 1000
NOTICE_TAIL_LINES = 5
PROGRESS_INTERVAL = 1.0
PROGRESS_LINE_CHARS = 120
MAX_IMAGES_PER_RESULT = 20
MAX_IMAGE_BYTES_PER_RESULT = 30 << 20
RESULT_MODES = ("content", "structured")
DEFAULT_NAMESPACE_ITEMS = 100
RESET_NAMES_SHOWN = 100  # of each list a reset answers (removed, refused, unknown); the rest are counted
MAX_PATH_CHARS = 1000  # of the dotted path inspect takes
STOP_EVALUATIONS_TIMEOUT = 2.0  # how long interrupt waits to hear what the namespace tools left running
MAX_NAMESPACE_ITEMS = 1000
NAME_KINDS = ("module", "class", "function", "variable")  # as the kernel side's classify says them
SHOWN_CHARS = 80  # of a bad argument's value, in its error message
# Claude Code spills a tool result longer than its default cap to a file unless the tool declares a
# larger size: the tools that return output declare one, so output asked for in full reaches the agent.
RESULT_SIZE_META = "anthropic/maxResultSizeChars"
MAX_RESULT_SIZE_CHARS = 500_000
# Claude Code hides a server's tools behind its tool search unless a tool asks to be loaded at once: the
# tools an agent needs from its first turn do.
ALWAYS_LOAD_META = "anthropic/alwaysLoad"
ALWAYS_LOADED_TOOLS = ("run_cell", "wait", "status", "read_output", "search_output")

# A value of the right type but out of range gets the code its parameter names.
VALUE_ERROR_CODES = {
    "timeout_seconds": INVALID_TIMEOUT,
    "max_chars": INVALID_MAX_CHARS,
    "context_before": INVALID_CONTEXT,
    "context_after": INVALID_CONTEXT,
    "stream": INVALID_STREAM,
}
CELL_ARGUMENT = "freeform"  # run_cell's one argument, named as in the published contract
CELL_ALIASES = ("code", "source", "cell")  # other names agents use for it: accepted, not advertised

KERNEL_PARAM = {
    "type": "string",
    "x-mcp-header": "Kernel",  # routable by gateways as the Mcp-Param-Kernel header
    "description": 'Which kernel (every tool takes it): a name (1-64 of A-Za-z0-9._-) is a shared kernel, '
    'created on first use; "~" starts a new private kernel and the result gives its handle; a handle "~…" '
    "from such a result is that private kernel (it is retired after idling). Omit it to use this session's "
    'own kernel (for a 2026-07-28 client over HTTP: the shared kernel "default").',
}
# The kernel argument is explained once, on run_cell (the tool a client reads first); the others refer to it.
KERNEL_REF_PARAM = {**KERNEL_PARAM, "description": "Which kernel, as for run_cell; omit for this session's."}
EXECUTION_PARAM = {
    "type": "integer",
    "minimum": 1,
    "description": "Execution number; default: the running cell, else the most recent one.",
}
STREAM_PARAM = {
    "type": "string",
    "enum": list(STREAMS),
    "default": "combined",
    "description": "combined (everything in arrival order), stdout, stderr, result (values and displays) "
    "or traceback.",
}
MAX_CHARS_PARAM = {
    "type": "integer",
    "minimum": 1,
    "description": "Clip each returned line to this many characters (marked, stored text unchanged).",
}


class ToolError(Exception):
    """A tool failure the model can act on: rendered as ``<code>: <message>`` with isError."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message

    @classmethod
    def of(cls, exc: ResourceError, ctx: ToolContext | None = None) -> ToolError:
        """A domain error as the tools report it: its code, and what to call next (in the kernel the call
        named)."""
        code, message = exc.code, exc.message
        via, only = (ctx.via, ctx.only_via) if ctx else ("", "")
        if isinstance(exc, Busy):
            n = exc.execution.number
            message += (f"; wait(execution={n}{via}) for it, interrupt({only}) to stop it or restart({only}) "
                        "the kernel")
        elif code == EXECUTION_NOT_FOUND and message == "no cell has run yet":
            message += "; start one with run_cell"
        return cls(code, message)


def make_nullable(kind: str) -> dict:
    return {"type": [kind, "null"]}


INTEGER, NUMBER, STRING, BOOLEAN = ({"type": kind} for kind in ("integer", "number", "string", "boolean"))
LINES_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"number": INTEGER, "text": STRING,
                       "kind": {"type": "string", "enum": ["match", "context"]}},
        "required": ["number", "text"],
    },
}
EXECUTION_SCHEMA = {
    "execution": INTEGER,
    "state": {"type": "string", "enum": list(STATES)},
    "elapsed_seconds": NUMBER,
    "submitted_at": STRING,
    "completed_at": make_nullable("string"),
    "output_total_lines": INTEGER,
    "output_total_characters": INTEGER,
    "output_total_utf8_bytes": INTEGER,
    "output_delivered": BOOLEAN,
    "output_omitted_reason": {"type": ["string", "null"], "enum": ["running", "token_limit", None]},
    "error": {
        "type": ["object", "null"],
        "properties": {"ename": STRING, "evalue": STRING},
        "required": ["ename", "evalue"],
    },
    "kernel_pid": make_nullable("integer"),
    "images": INTEGER,
    "output_dropped": make_nullable("string"),
    "lost_messages": INTEGER,
}
STATUS_SCHEMA = {
    "version": STRING,
    "uptime_seconds": NUMBER,
    "workspace": STRING,
    "workspace_resolution": {"type": "string", "enum": ["launch_cwd", "explicit_config"]},
    "interpreter": STRING,
    "python_version": STRING,
    "resource": STRING,
    "resource_sessions": INTEGER,
    "kernel_pid": make_nullable("integer"),
    "kernel_location": {"type": "string", "enum": ["local", "gateway", "attached"]},
    "kernel_gateway": make_nullable("string"),
    "kernel_id": make_nullable("string"),
    "kernel_state": {"type": "string", "enum": [KERNEL_STARTING, KERNEL_IDLE, KERNEL_BUSY, KERNEL_DEAD]},
    "kernel_language": make_nullable("string"),
    "kernel_ipython": make_nullable("boolean"),
    "kernel_lost": make_nullable("string"),
    "kernel_connection_file": make_nullable("string"),
    "kernel_join_command": make_nullable("string"),
    "current_execution": make_nullable("integer"),
    "input_prompt": make_nullable("string"),
    "last_execution": make_nullable("integer"),
    "executions": INTEGER,
    "startup": {"type": ["object", "null"],
                "properties": {"path": STRING, "ok": BOOLEAN, "error": make_nullable("string")}},
    "notebook": {"type": ["object", "null"], "properties": {
        "file": STRING, "state": {"type": "string", "enum": ["on", "off"]},
        "problem": make_nullable("string"), "writes": INTEGER, "write_seconds": NUMBER, "bytes": INTEGER}},
    "recent_executions": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"execution": INTEGER, "state": STRING, "elapsed_seconds": NUMBER,
                           "output_lines": INTEGER, "first_line": STRING, "by": make_nullable("string")},
        },
    },
}
EXECUTION_STATUS_SCHEMA = {
    **EXECUTION_SCHEMA,
    "source": STRING,
    "by": make_nullable("string"),
    "ipython_execution_count": make_nullable("integer"),
    "reason": make_nullable("string"),
    "input_prompt": make_nullable("string"),
    "options": {"type": "object",
                "properties": {"wait_seconds": NUMBER, "full_output": BOOLEAN, "kernel": STRING}},
    "output_file": make_nullable("string"),
    "output_in_memory": {"type": "array", "items": STRING},
    "streams": {
        "type": "object",
        "properties": {
            name: {"type": "object",
                   "properties": {"lines": INTEGER, "characters": INTEGER, "utf8_bytes": INTEGER}}
            for name in STREAMS
        },
    },
}
READ_SCHEMA = {"execution": INTEGER, "stream": STRING, "first_line": make_nullable("integer"),
               "last_line": make_nullable("integer"), "total_lines": INTEGER, "running": BOOLEAN,
               "lines": LINES_SCHEMA}
SEARCH_SCHEMA = {"execution": INTEGER, "stream": STRING, "query": STRING,
                 "query_mode": {"type": "string", "enum": ["regex", "literal"]}, "matching_lines": INTEGER,
                 "total_matches": INTEGER, "shown_matching_lines": INTEGER, "lines": LINES_SCHEMA}
INTERRUPT_SCHEMA = {"interrupt_sent": BOOLEAN, "execution": make_nullable("integer"),
                    "state": make_nullable("string"),
                    "evaluations": {"type": "array", "items": {  # what the namespace tools left running
                        "type": "object", "properties": {"what": STRING, "seconds": NUMBER,
                                                         "stopped": BOOLEAN, "abandoned": BOOLEAN}}}}
SIZE_SCHEMA = {"type": "object", "properties": {"shape": {"type": "array", "items": INTEGER}, "len": INTEGER,
                                                "len_note": STRING, "bytes": INTEGER}}
NAMESPACE_SCHEMA = {
    "total": INTEGER, "matched": INTEGER, "shown": INTEGER, "query": make_nullable("string"),
    "names": {"type": "array", "items": {
        "type": "object", "properties": {"name": STRING, "kind": STRING, "type": STRING, "size": SIZE_SCHEMA,
                                         "value": STRING}}},
}
INSPECT_SCHEMA = {
    "name": STRING, "kind": {"type": "string", "enum": list(NAME_KINDS)}, "type": STRING, "size": SIZE_SCHEMA,
    "signature": make_nullable("string"), "module": make_nullable("string"), "doc": make_nullable("string"),
    "repr": make_nullable("string"),
    "frame": {"type": ["object", "null"],  # a pandas DataFrame or Series
              "properties": {"series": BOOLEAN, "dtypes": {"type": "array", "items": {"type": "array"}},
                             "columns": make_nullable("integer"), "head": STRING}},
    "array": {"type": ["object", "null"],  # a NumPy array
              "properties": {"dtype": STRING, "min": make_nullable("string"),
                             "max": make_nullable("string")}},
}
RESET_SCHEMA = {
    "removed": {"type": "array", "items": STRING},
    "refused": {"type": "array", "items": STRING},
    "unknown": {"type": "array", "items": STRING},
    "refused_reasons": {"type": "object", "additionalProperties": STRING},
    "unpublished": {"type": "array", "items": STRING},
    "left_out": {"type": "object", "additionalProperties": INTEGER},  # names not listed, by list
}
RESTART_SCHEMA = {
    "kernel_pid": make_nullable("integer"),
    "previous_kernel_pid": make_nullable("integer"),
    "killed_execution": make_nullable("integer"),
    "next_execution": INTEGER,
}


def make_output_schema(properties: dict) -> dict:
    """A tool's outputSchema: its own fields, or the error shape of an isError result."""
    notices = {"notices": {"type": "array", "items": STRING}, "kernel": make_nullable("string")}
    return {
        "type": "object",
        "anyOf": [
            {"properties": {**properties, **notices}, "required": list(properties)},
            {"properties": {"error_code": STRING, "message": STRING, **notices},
             "required": ["error_code", "message"]},
        ],
    }


@dataclass
class Reply:
    """What a tool returns: content blocks (text and images) and the same facts as plain data."""

    content: list[dict]
    data: dict
    notices: list[str] = field(default_factory=list)  # lines that end the result (see add_notices)
    # A run_cell or wait whose cell a task follows instead: the execution, and what renders it once it ended.
    pending: Execution | None = None
    then: Callable[[], Awaitable[Reply]] | None = None

    @classmethod
    def text(cls, text: str, data: dict) -> Reply:
        return cls([{"type": "text", "text": text}], data)


@dataclass
class Tool:
    name: str
    title: str
    description: str
    run: Callable[[ToolContext, dict], Awaitable[Reply]]
    output: dict
    properties: dict = field(default_factory=dict)
    required: tuple[str, ...] = ()
    read_only: bool = False
    destructive: bool = False
    idempotent: bool = False

    def __post_init__(self) -> None:
        kernel = KERNEL_PARAM if self.name == "run_cell" else KERNEL_REF_PARAM  # every tool acts on a kernel
        self.properties = {**self.properties, "kernel": kernel}
    returns_output: bool = False  # its results carry cell output, possibly long
    task_support: bool = False  # a 2025-11-25 client may call it as a task (its cell outlives the call)
    app_only: bool = False  # only the execution view calls it (listed to hosts that render views)

    def describe(self, result_mode: str, tasks: bool = False, apps: bool = False) -> dict:
        """The tool as tools/list shows it; ``tasks``: for a 2025-11-25 session (execution.taskSupport);
        ``apps``: for a host that renders views (the view it links, or its app-only visibility)."""
        tool_annotations = {"title": self.title, "readOnlyHint": self.read_only, "openWorldHint": False}
        if not self.read_only:
            tool_annotations.update(destructiveHint=self.destructive, idempotentHint=self.idempotent)
        schema = {"type": "object", "properties": self.properties, "additionalProperties": False}
        if self.required:
            schema["required"] = list(self.required)
        described = {
            "name": self.name,
            "title": self.title,
            "description": self.description,
            "inputSchema": schema,
            "annotations": tool_annotations,
        }
        if result_mode == "structured":
            described["outputSchema"] = make_output_schema(self.output)
        meta = {RESULT_SIZE_META: MAX_RESULT_SIZE_CHARS} if self.returns_output else {}
        if self.name in ALWAYS_LOADED_TOOLS:
            meta[ALWAYS_LOAD_META] = True
        if apps:
            meta.update(describe_view_meta(self.name, self.app_only))
        if meta:
            described["_meta"] = meta
        if tasks and self.task_support:
            described["execution"] = {"taskSupport": "optional"}
        return described


@dataclass
class ToolContext:
    """What one tool call works on: the server's settings, the caller's resource and session, its progress
    channel. A call from /api has no session: its resource is given."""

    settings: Settings
    resource: Resource | None  # None until the session's binding gives it its kernel
    started: float  # when the server started
    session: SessionBinding | None = None
    progress: Callable[[float, str], Awaitable[None]] | None = None
    client: str | None = None  # what the caller is called (clientInfo.name)
    kernel_ref: str | None = None  # the kernel the call named, repeated in the calls it suggests
    task: TaskOffer | None = None  # a task may carry the cell past the call
    ask: Callable[[Question], None] | None = None  # puts a cell's input() to the person (a client can ask)
    stdin: bool = False  # the cells it submits may read stdin: someone can answer their input()
    links: bool = False  # its results link what they leave out (resource_link: protocol 2025-06-18 on)

    @property
    def shows_data(self) -> bool:
        """Whether the caller sees a reply's data: in structured mode, or from /api (which has no session)."""
        return self.settings.result_mode == "structured" or self.session is None

    @property
    def via(self) -> str:
        """The kernel argument to repeat in a suggested call that has other arguments."""
        return f', kernel="{self.kernel_ref}"' if self.kernel_ref else ""

    @property
    def only_via(self) -> str:
        """The same, for a suggested call without other arguments."""
        return f'kernel="{self.kernel_ref}"' if self.kernel_ref else ""


def check_arguments(tool: Tool, arguments: Any) -> dict:
    """Validate arguments against the tool's input schema; return them with integral floats as ints."""
    if arguments is None:
        arguments = {}
    if not isinstance(arguments, dict):
        raise ToolError(INVALID_ARGUMENTS, "arguments must be a JSON object")
    if tool.name == "run_cell" and CELL_ARGUMENT not in arguments:
        aliases = [name for name in CELL_ALIASES if name in arguments]
        if len(aliases) == 1:
            arguments = {(CELL_ARGUMENT if k == aliases[0] else k): v for k, v in arguments.items()}
    checked = {}
    for name, value in arguments.items():
        spec = tool.properties.get(name)
        if spec is None:
            known = ", ".join(tool.properties) or "none"
            raise ToolError(INVALID_ARGUMENTS, f'unknown argument "{clip(name, SHOWN_CHARS)}" '
                            f'(accepted: {known})')
        checked[name] = check_value(name, spec, value)
    for name in tool.required:
        if name not in checked:
            raise ToolError(INVALID_ARGUMENTS, f'missing required argument "{name}"')
    return checked


def describe_value(value: Any) -> str:
    """A short JSON rendering of an argument's value for an error message, whatever its size or depth."""
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "an array"
    text = json.dumps(value[:SHOWN_CHARS] if isinstance(value, str) else value, ensure_ascii=False)
    return clip(text, SHOWN_CHARS) + ("…" if isinstance(value, str) and len(value) > SHOWN_CHARS else "")


def find_lone_surrogate(name: str, text: str) -> str | None:
    """Where a string first holds half of a UTF-16 surrogate pair, which cannot be encoded for the kernel."""
    found = LONE_SURROGATE_RE.search(text)
    if found is None:
        return None
    at = found.start()
    line, column = text.count("\n", 0, at) + 1, at - (text.rfind("\n", 0, at) + 1) + 1
    return (f'"{name}" holds a lone surrogate (U+{ord(found.group()):04X}) at line {line}, column {column} '
            f"(character {at + 1}): it cannot be encoded as UTF-8 (remove it, or write it as a \\u escape "
            "in a string)")


def check_items(name: str, spec: dict, value: Any) -> list:
    """An array argument: a list whose every item passes its item schema."""
    if not isinstance(value, list):
        raise ToolError(INVALID_ARGUMENTS, f'"{name}" must be an array, not {describe_value(value)}')
    return [check_value(f"{name}[{i}]", spec["items"], item) for i, item in enumerate(value)]


def check_value(name: str, spec: dict, value: Any) -> Any:
    kind = spec["type"]
    if kind == "array":
        return check_items(name, spec, value)
    if kind == "integer" and isinstance(value, float) and value.is_integer():
        value = int(value)
    valid_type = {
        "string": isinstance(value, str),
        "integer": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "boolean": isinstance(value, bool),
    }[kind]
    if not valid_type:
        article = "an" if kind == "integer" else "a"
        raise ToolError(INVALID_ARGUMENTS, f'"{name}" must be {article} {kind}, not {describe_value(value)}')
    if kind == "string" and (surrogate := find_lone_surrogate(name, value)):
        raise ToolError(INVALID_ARGUMENTS, surrogate)
    code = VALUE_ERROR_CODES.get(name, INVALID_ARGUMENTS)
    if isinstance(value, float) and not math.isfinite(value):  # an integer is finite, however long
        raise ToolError(code, f'"{name}" must be a finite number')
    if "enum" in spec and value not in spec["enum"]:
        choices = ", ".join(spec["enum"])
        raise ToolError(code, f'"{name}" must be one of {choices}, not {describe_value(value)}')
    if "minimum" in spec and value < spec["minimum"]:
        raise ToolError(code, f'"{name}" must be at least {spec["minimum"]}, not {describe_value(value)}')
    if "maximum" in spec and value > spec["maximum"]:
        raise ToolError(code, f'"{name}" must be at most {spec["maximum"]}, not {describe_value(value)}')
    return value


def pluralize(n: int, word: str, words: str | None = None) -> str:
    return f"{format_count(n)} {word if n == 1 else words or word + 's'}"


async def wait_until_done(ctx: ToolContext, execution: Execution, timeout: float,
                          questions: bool = False) -> None:
    """Wait for the execution to finish, at most timeout seconds, reporting progress if asked to. With
    ``questions`` (run_cell, wait), an input() the cell waits in is put to the person by a caller that can
    ask, or ends the wait of a caller whose task will carry the question."""
    deadline = time.monotonic() + timeout
    watch = questions and (ctx.ask is not None or ctx.task is not None)
    while not execution.done:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        step = min(remaining, PROGRESS_INTERVAL) if ctx.progress else remaining
        if watch:
            question = ctx.resource.find_question(execution)
            if question is not None and ctx.ask is None:
                return  # a 2026-07-28 call: its task asks (it may not send requests of its own)
            if question is not None:
                ctx.ask(question)
            # the running cell asked, its question cleared, or it ended
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(ctx.resource.news.wait(), step)
        else:
            await execution.wait(step)
        if ctx.progress and not execution.done:
            await ctx.progress(round(execution.elapsed, 3), describe_progress(execution))


def describe_progress(execution: Execution) -> str:
    output = execution.output
    tail = output.tail(1)
    last = f" · last: {clip(tail[0], PROGRESS_LINE_CHARS)}" if tail else ""
    return f"execution {execution.number} running · {pluralize(output.line_count, 'line')} so far{last}"


def indent_tail(output: Log) -> list[str]:
    return ["Last lines:", *(f"  {clip(line, NOTICE_LINE_CHARS)}" for line in output.tail(NOTICE_TAIL_LINES))]


def describe_execution_data(e: Execution, omitted_reason: str | None) -> dict:
    output = e.output
    return {
        "execution": e.number,
        "state": e.state,
        "elapsed_seconds": round(e.elapsed, 6),
        "submitted_at": format_iso_utc(e.submitted_at),
        "completed_at": format_iso_utc(e.completed_at),
        "output_total_lines": output.line_count,
        "output_total_characters": output.chars,
        "output_total_utf8_bytes": output.utf8_bytes,
        "output_delivered": omitted_reason is None,
        "output_omitted_reason": omitted_reason,
        "error": None if e.ename is None else {"ename": e.ename, "evalue": e.evalue or ""},
        "kernel_pid": e.kernel_pid,
        "images": len(e.images),
        "output_dropped": OUTPUT_DROPPED if e.output_dropped else None,
        "lost_messages": e.lost,
    }


def describe_lost_messages(lost: int) -> str:
    """The one line that says messages of the kernel's never arrived, in results and execution_status."""
    said = "never arrived (lost between the kernel and loommux): output is missing"
    return f"{pluralize(lost, 'kernel message')} {said}"


class BlockWriter:
    """Builds a content list: text joined line by line, images in between, within the per-result limits, and
    last a resource_link to each part it leaves out, when given the ``execution`` and the kernel its URIs
    name (a client that reads links)."""

    def __init__(self, execution: Execution | None = None, kernel: str | None = None) -> None:
        self.content: list[dict] = []
        self.links: list[dict] = []
        self.images = self.image_bytes = 0
        self.execution, self.kernel = execution, kernel

    def collect(self) -> list[dict]:
        return [*self.content, *self.links]

    def link_output(self) -> None:
        if self.execution is not None:
            self.links.append(make_stream_link(self.execution, self.kernel))

    def text(self, text: str) -> None:
        if self.content and self.content[-1]["type"] == "text":
            self.content[-1]["text"] += "\n" + text
        else:
            self.content.append({"type": "text", "text": text})

    def image(self, image: Image) -> None:
        if image.problem:
            return  # its caption already says why and what to do
        if self.images >= MAX_IMAGES_PER_RESULT or self.image_bytes + image.size > MAX_IMAGE_BYTES_PER_RESULT:
            self.text(f"[display {image.display} not sent: one result carries at most "
                      f"{MAX_IMAGES_PER_RESULT} images and {format_size(MAX_IMAGE_BYTES_PER_RESULT)}; "
                      "display fewer or smaller images per cell, or save them to files]")
            if self.execution is not None:
                self.links.append(make_image_link(self.execution, image, self.kernel))
            return
        self.images, self.image_bytes = self.images + 1, self.image_bytes + image.size
        self.content.append(image.encode_block())


async def render_execution(execution: Execution, ctx: ToolContext) -> Reply:
    """The run_cell/wait surface: a head line, then the output or a notice saying what to call next."""
    head = f"In [{execution.number}] · {format_duration(execution.elapsed)}"
    head += ":" if execution.state == COMPLETED else f" · {execution.state}:"
    if execution.state == RUNNING:
        return reply_running(execution, ctx, head)
    if execution.fits is None:
        execution.fits = execution.options.full_output or await fits_token_limit(execution.output)
    blocks = BlockWriter(execution if ctx.links else None, ctx.kernel_ref)
    blocks.text("\n".join([head, *describe_inspector_notes(execution)]))
    if execution.fits:
        write_output(blocks, execution)
    else:
        write_omitted_output(blocks, execution, ctx.via)
    if execution.reason:
        blocks.text(f"[{execution.state}: {execution.reason}]")
    if execution.output_dropped:
        blocks.text(f"[{OUTPUT_DROPPED}: lines are missing from this output]")
    if execution.lost:
        blocks.text(f"[{describe_lost_messages(execution.lost)}]")
    omitted = None if execution.fits else "token_limit"
    return Reply(blocks.collect(), describe_execution_data(execution, omitted))


def describe_inspector_notes(execution: Execution) -> list[str]:
    """What cell inspectors said of the cell before it ran (see inspect_cells), for the top of its result."""
    lines = []
    for said in execution.notes or ():
        name = clip(str(said.get("inspector")), QUOTED_ID_CHARS)
        if "note" in said:
            lines.append(f"Inspector {name}: {clip(str(said['note']), INSPECTOR_NOTE_CHARS)}")
        else:
            failure = clip(str(said.get("warning")), INSPECTOR_NOTE_CHARS)
            lines.append(f"Warning: inspector {name} failed ({failure}); the cell ran without its check.")
    return lines


def reply_running(execution: Execution, ctx: ToolContext, head: str) -> Reply:
    """A running cell's surface: how long it ran and was silent, its last lines, what to call next."""
    n, output, via = execution.number, execution.output, ctx.via
    silent = format_duration(time.monotonic() - (execution.last_output or execution.started))
    count = output.line_count
    so_far = f"{pluralize(count, 'line')} so far" if count else "no output yet"
    lines = [head, *describe_inspector_notes(execution),
             f"[running · {format_duration(execution.elapsed)} elapsed · {so_far} · silent for {silent}]"]
    if count:
        lines += indent_tail(output)
    if execution.lost:
        lines.append(f"[{describe_lost_messages(execution.lost)}]")
    question = ctx.resource.find_question(execution) if ctx.resource is not None else None
    if question is not None:
        lines.append(f"[waiting for input: {question.prompt!r} · a call from a client that can ask the "
                     "person (elicitation) puts it to them]")
    lines.append(
        f'Next: wait(execution={n}{via}) to keep waiting · '
        f'read_output(execution={n}, line_range="-40:"{via}) · '
        f'search_output(query="…", execution={n}{via}) · interrupt({ctx.only_via}) to stop it'
    )
    reply = Reply.text("\n".join(lines), describe_execution_data(execution, "running"))
    if ctx.links:  # the output so far, which a client may subscribe to
        reply.content.append(make_stream_link(execution, ctx.kernel_ref))
    return reply


def write_output(blocks: BlockWriter, execution: Execution) -> None:
    """A finished output that fits the token limit, whole: its text, each image after its caption line."""
    output, start = execution.output, 0
    for image in execution.images:
        blocks.text(output.lines(start, image.line + 1))
        blocks.image(image)
        start = image.line + 1
    if start < output.line_count or not output.line_count:
        blocks.text(output.lines(start, output.line_count) if output.line_count else "(no output)")


def write_omitted_output(blocks: BlockWriter, execution: Execution, via: str) -> None:
    """A finished output over the token limit: its size, last lines, the calls that read it and its images."""
    n, output = execution.number, execution.output
    blocks.text(
        f"[output omitted: {pluralize(output.line_count, 'line')} · {pluralize(output.chars, 'character')} · "
        f"{format_size(output.utf8_bytes)} · over the {format_count(TOKEN_LIMIT)}-token limit]"
    )
    blocks.text("\n".join(indent_tail(output)))
    blocks.text(
        f'Next: read_output(execution={n}, line_range="-40:"{via}) for the tail · '
        f'read_output(execution={n}, line_range="1:40"{via}) for the head · '
        f'search_output(query="…", execution={n}{via}) to find lines · '
        "or rerun the cell with %%loommux --full-output as its first line to get it all at once"
    )
    blocks.link_output()
    for image in execution.images:
        blocks.text(image.caption)
        blocks.image(image)


async def tool_run_cell(ctx: ToolContext, args: dict) -> Reply:
    source = args[CELL_ARGUMENT]
    try:
        options = parse_cell_header(source)
    except CellHeaderError as exc:
        raise ToolError(INVALID_CELL_HEADER, f"{exc} (header: {HEADER_USAGE})") from None
    execution = await ctx.resource.submit(source, options, stdin=ctx.stdin, by=("mcp_client", ctx.client))
    notice = describe_legacy_directives(source)
    return await reply_execution(ctx, execution, options.wait, (notice,) if notice else ())


async def tool_wait(ctx: ToolContext, args: dict) -> Reply:
    execution = ctx.resource.select(args.get("execution"))
    return await reply_execution(ctx, execution, args.get("timeout_seconds", DEFAULT_WAIT_TIMEOUT))


async def reply_execution(ctx: ToolContext, execution: Execution, timeout: float,
                          notices: tuple[str, ...] = ()) -> Reply:
    """run_cell's and wait's end: the wait, then the execution's surface. A reply a task takes over is
    pending: the cell still runs after a 2026-07-28 call's wait, or a 2025-11-25 client asked for a task (then
    there is no wait)."""
    offer = ctx.task
    immediate = offer is not None and offer.immediate
    await wait_until_done(ctx, execution, 0 if immediate else timeout, questions=True)

    async def surface() -> Reply:
        reply = await render_execution(execution, ctx)
        reply.notices.extend(notices)
        return reply

    if offer is not None and (offer.immediate or not execution.done):
        return Reply([], {}, pending=execution, then=surface)
    return await surface()


def describe_execution_brief(execution: Execution) -> str:
    return f"{execution.number} · {execution.state} · {format_duration(execution.elapsed)}"


async def tool_status(ctx: ToolContext, args: dict) -> Reply:
    resource, settings = ctx.resource, ctx.settings
    kernel = resource.kernel
    last = resource.last
    data = {
        "version": __version__,
        "uptime_seconds": round(time.monotonic() - ctx.started, 3),
        "workspace": str(settings.workspace),
        "workspace_resolution": settings.workspace_resolution,
        "interpreter": sys.executable,
        "python_version": sys.version.split()[0],
        "resource": resource.name,
        "kernel": ctx.kernel_ref,
        "resource_sessions": resource.sessions,
        "kernel_pid": kernel.pid if kernel and kernel.alive else None,
        **locate_kernel(resource),
        "kernel_state": resource.kernel_state,
        **describe_kernel_language(resource),
        **describe_kernel_join(resource, shown=resource.control_url is None),  # stdio: the person running it
        "current_execution": resource.running.number if resource.running else None,
        "input_prompt": resource.question.prompt if resource.question else None,
        "last_execution": last.number if last else None,
        "executions": resource.last_number,
        "startup": None if resource.pool.startup is None else {
            "path": str(resource.pool.startup), "ok": resource.kernel_holder.startup_failure is None,
            "error": resource.kernel_holder.startup_failure},
        "notebook": resource.notebook.summarize() if resource.notebook else None,
        "recent_executions": [
            {"execution": e.number, "state": e.state, "elapsed_seconds": round(e.elapsed, 6),
             "output_lines": e.output.line_count, "first_line": e.first_line, "by": describe_other_client(e)}
            for e in resource.list_recent()
        ],
    }
    return Reply.text(render_status_text(data), data)


def locate_kernel(resource: Resource) -> dict:
    """Where the resource's kernels run: here, or on a gateway (its host, and the kernel's id there), or
    where a person runs the kernel it is attached to."""
    gateway, kernel = resource.pool.gateway, resource.kernel
    where = ("attached" if resource.source and not resource.source.owned
             else "gateway" if gateway else "local")
    return {"kernel_location": where, "kernel_gateway": gateway.host if gateway else None,
            "kernel_id": kernel.remote_id if kernel and kernel.alive else None}


def describe_kernel_language(resource: Resource) -> dict:
    """The kernel's language and version (from its kernel_info), whether it is IPython, and why it is gone."""
    kernel = resource.kernel if resource.kernel and resource.kernel.alive else None
    return {"kernel_language": kernel.language if kernel else None,
            "kernel_ipython": kernel.ipython if kernel else None,
            "kernel_lost": resource.kernel_holder.detached_reason}


def describe_kernel_join(resource: Resource, shown: bool = True) -> dict:
    """A local kernel's connection file and the command that joins it: for the person running loommux only
    (stdio's status, the operator's /api), never an MCP client over HTTP (not ``shown``: both null)."""
    kernel = resource.kernel if shown and resource.kernel and resource.kernel.alive else None
    path = kernel.connection_file if kernel else None
    return {"kernel_connection_file": str(path) if path else None,
            "kernel_join_command": JOIN_COMMAND.format(path=shlex.quote(str(path))) if path else None}


def describe_kernel_place(data: dict) -> str:
    """``gateway <host> · id <kernel id>`` for a remote kernel, ``pid <pid>`` for a local one."""
    if data["kernel_location"] == "gateway":
        return f"gateway {data['kernel_gateway']} · id {data['kernel_id'] or 'none'}"
    if data["kernel_location"] == "attached":
        return "attached (not loommux's: --existing)"
    return f"pid {data['kernel_pid'] or 'none'}"


def render_status_text(data: dict) -> str:
    """The status tool's text, rendered from its data."""
    lines = [
        f"loommux {data['version']} · uptime {format_duration(data['uptime_seconds'])}",
        f"workspace: {data['workspace']}",
        f"workspace_resolution: {data['workspace_resolution']}",
        f"interpreter: {data['interpreter']} · Python {data['python_version']}",
        f"resource: {data['resource']}" + (f' (kernel="{data["kernel"]}")' if data["kernel"] else "")
        + f" · {pluralize(data['resource_sessions'], 'session')}",
        f"kernel: {describe_kernel_place(data)} · {data['kernel_state']}",
    ]
    recent = data["recent_executions"]
    if data["current_execution"] is not None or data["last_execution"] is not None:
        which = "current" if data["current_execution"] is not None else "last"
        e = recent[0]
        lines.append(f"{which} execution: {e['execution']} · {e['state']} · "
                     f"{format_duration(e['elapsed_seconds'])}")
        if data["input_prompt"] is not None:
            lines.append(f"waiting for input: {data['input_prompt']!r} (execution "
                         f"{data['current_execution']})")
    else:
        lines.append("executions: none yet")
    startup = data["startup"]
    if startup is not None:
        failure = startup["error"] and startup["error"].split("\n", 1)[0]
        lines.append(f"startup: {startup['path']} · " + ("ok" if startup["ok"] else f"failed: {failure}"))
    notebook = data["notebook"]
    if notebook is not None:
        state = (f"off: {notebook['problem']}" if notebook["problem"] else
                 f"{pluralize(notebook['writes'], 'write')} · {format_size(notebook['bytes'])}")
        lines.append(f"notebook: {notebook['file']} · {state}")
    if recent:
        rows = [(str(e["execution"]), e["state"], format_duration(e["elapsed_seconds"]),
                 pluralize(e["output_lines"], "line"), clip(e["first_line"].split("\n", 1)[0], 60)
                 + (f"  [{e['by']}]" if e.get("by") else "")) for e in recent]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines.append(f"recent executions (newest first, {len(recent)} of {data['executions']}):")
        for number, state, elapsed, count, first_line in rows:
            lines.append(f"  {number.rjust(widths[0])}  {state.ljust(widths[1])}  "
                         f"{elapsed.rjust(widths[2])}  {count.rjust(widths[3])}  {first_line}")
    if data.get("kernel_language"):
        lines.append(f"language: {data['kernel_language']}" + (" (IPython)" if data["kernel_ipython"] else
                     " · not IPython: the loommux object, --kernel forwarding and the startup file are off"))
    if data.get("kernel_lost"):
        lines.append(f"lost: {data['kernel_lost']}")
    if data.get("kernel_join_command"):
        lines.append(f"connection file: {data['kernel_connection_file']}")
        lines.append(f"join: {data['kernel_join_command']}")
    return "\n".join(lines)


async def tool_execution_status(ctx: ToolContext, args: dict) -> Reply:
    e = ctx.resource.select(args.get("execution"))
    omitted = "running" if e.state == RUNNING else None if e.fits is not False else "token_limit"
    path, in_memory = e.describe_files()
    data = {
        **describe_execution_data(e, omitted),
        "source": e.source,
        "by": describe_other_client(e),
        "ipython_execution_count": e.ipython_count,
        "reason": e.reason,
        "input_prompt": question.prompt if (question := ctx.resource.find_question(e)) else None,
        "options": {"wait_seconds": e.options.wait, "full_output": e.options.full_output},
        "output_file": path,
        "output_in_memory": in_memory,
        "streams": {name: {"lines": stream_log.line_count, "characters": stream_log.chars,
                           "utf8_bytes": stream_log.utf8_bytes}
                    for name, stream_log in zip(STREAMS, map(e.log, STREAMS))},
    }
    if e.options.kernel:
        data["options"]["kernel"] = e.options.kernel
    return Reply.text(render_execution_status_text(data), data)


def render_execution_status_text(data: dict) -> str:
    """The execution_status tool's text, rendered from its data."""
    source, error, options = data["source"], data["error"], data["options"]
    source_lines = source.count("\n") + 1
    lines = [
        f"[execution {data['execution']} · {data['state']}"
        + (f" · {data['by']}]" if data.get("by") else "]"),
        f"source: {clip(source.split(chr(10), 1)[0], 120)}"
        + (f"  ({source_lines} lines)" if source_lines > 1 else ""),
        f"submitted_at: {data['submitted_at']}",
        f"completed_at: {data['completed_at'] or '(still running)'}",
        f"elapsed: {format_duration(data['elapsed_seconds'])}",
        f"kernel_pid: {data['kernel_pid']}",
        f"ipython_execution_count: {data['ipython_execution_count']} (diagnostic only)",
        f"error: {describe_error(error['ename'], error['evalue'])}" if error else "error: none",
    ]
    if data["reason"]:
        lines.append(f"reason: {data['reason']}")
    if data["input_prompt"] is not None:
        lines.append(f"waiting for input: {data['input_prompt']!r}")
    if data["output_dropped"]:
        lines.append(f"warning: {data['output_dropped']}")
    if data["lost_messages"]:
        lines.append(f"warning: {describe_lost_messages(data['lost_messages'])}")
    if data["images"]:
        lines.append(f"images: {data['images']}")
    forwarded = f" · kernel={options['kernel']}" if "kernel" in options else ""
    lines.append(f"options: wait={options['wait_seconds']:g} s · "
                 f"full_output={str(options['full_output']).lower()}{forwarded}")
    if data["output_file"]:
        lines.append(f"output file: {data['output_file']}")
    lines.extend(f"warning: output {note}" for note in data["output_in_memory"])
    lines.append("streams:")
    for name, stream in data["streams"].items():
        lines.append(f"  {name}: {pluralize(stream['lines'], 'line')} · "
                     f"{pluralize(stream['characters'], 'character')} · {format_size(stream['utf8_bytes'])}")
    return "\n".join(lines)


async def tool_read_output(ctx: ToolContext, args: dict) -> Reply:
    e = ctx.resource.select(args.get("execution"))
    stream = args.get("stream", "combined")
    output = e.log(stream)
    total = output.line_count
    try:
        first, stop = parse_line_range(args.get("line_range"), total)
    except ValueError as exc:
        raise ToolError(INVALID_LINE_RANGE, str(exc)) from None
    where = f"execution {e.number} · {stream}"
    running = " · still running" if e.state == RUNNING else ""
    data = {"execution": e.number, "stream": stream, "first_line": None, "last_line": None,
            "total_lines": total, "running": e.state == RUNNING, "lines": []}
    if total == 0:
        return Reply.text(f"[{where} · no lines{running}]", data)
    if first >= stop:
        return Reply.text(f"[{where} · no lines in {args.get('line_range')} of "
                          f"{format_count(total)}{running}]", data)
    await output.index_in_thread()
    text = output.lines(first, stop)
    max_chars = args.get("max_chars")
    if max_chars is not None or ctx.shows_data:
        lines = text.split("\n")
        if max_chars is not None and max(map(len, lines)) > max_chars:  # (most reads clip no line)
            lines = [clip(line, max_chars) for line in lines]
            text = "\n".join(lines)
        if ctx.shows_data:  # 10,000 lines make 10,000 dicts: only for a caller who sees them
            data["lines"] = [{"number": n, "text": line} for n, line in enumerate(lines, first + 1)]
    data.update(first_line=first + 1, last_line=stop)
    return Reply.text(f"[{where} · lines {first + 1}-{stop} of {format_count(total)}{running}]\n{text}", data)


async def tool_search_output(ctx: ToolContext, args: dict) -> Reply:
    e = ctx.resource.select(args.get("execution"))
    stream, query = args.get("stream", "combined"), args["query"]
    if not query:
        raise ToolError(INVALID_QUERY, "the query is empty")
    try:
        compiled = compile_query(query, args.get("query_mode", "auto"), args.get("ignore_case", False))
    except ValueError as exc:
        raise ToolError(INVALID_QUERY, str(exc)) from None
    before, after = args.get("context_before", 0), args.get("context_after", 0)
    max_matches, max_chars = args.get("max_matches", DEFAULT_MAX_MATCHES), args.get("max_chars")
    output = e.log(stream)
    frozen = output.frozen()  # searched off the event loop: a big output never stalls other requests
    found = await search_log(frozen, compiled, before, after, max_matches, ctx.settings.search_timeout)
    output.adopt_index(frozen)
    counted = pluralize(found.matching, "matching line")
    if found.matching > found.shown:
        counted += f" (first {format_count(found.shown)} shown)"
    matches = pluralize(found.total, "match", "matches")
    lines = [(f"[execution {e.number} · {stream} · {compiled.mode} {describe_value(query)} · {counted} · "
              f"{matches}]")]
    shown_lines = []
    for group in found.groups:
        if shown_lines:
            lines.append("--")
        for n, kind, text in group:
            lines.append(f"{kind[0].upper()} {n} | {clip(text, max_chars)}")
            shown_lines.append({"number": n, "kind": kind, "text": clip(text, max_chars)})
    data = {"execution": e.number, "stream": stream, "query": query, "query_mode": compiled.mode.split()[0],
            "matching_lines": found.matching, "total_matches": found.total,
            "shown_matching_lines": found.shown, "lines": shown_lines}
    return Reply.text("\n".join(lines), data)


@dataclass
class Found:
    matching: int  # matching lines
    total: int  # matches
    shown: int  # matching lines shown
    groups: list[list[tuple[int, str, str]]]  # runs of adjacent (line number, "match" or "context", text)


def find_lines(output: Log, query: Query, before: int, after: int, max_matches: int) -> Found:
    """Count the matches and matching lines; gather the first max_matches with their context."""
    shown: list[int] = []
    matching = total = 0
    last = -1
    for index in output.matching_lines(query):
        total += 1
        if index != last:
            matching, last = matching + 1, index
            if len(shown) < max_matches:
                shown.append(index)
    groups: list[list[tuple[int, str, str]]] = []
    matched, line_count, previous = set(shown), output.line_count, -1
    for index in shown:
        start, stop = max(index - before, previous + 1), min(index + after, line_count - 1)
        if start > stop:
            continue
        if not groups or start > previous + 1:
            groups.append([])
        groups[-1].extend((n + 1, "match" if n in matched else "context", text)
                          for n, text in enumerate(output.lines(start, stop + 1).split("\n"), start))
        previous = stop
    return Found(matching, total, len(shown), groups)


async def search_log(output: Log, query: Query, before: int, after: int, max_matches: int,
                     timeout: float) -> Found:
    """find_lines without ever holding the event loop, and stopped at the timeout.

    Indexing, and a search whose time is linear in the text (a string, most regexes: see
    search_is_linear), run in a worker thread. A regex that may backtrack for hours ("(a+)+b" over a line
    of 30 a's) holds the GIL, which a thread would not release, so it runs in a forked child, killed at
    the deadline.
    """
    if not output.indexed:
        await asyncio.to_thread(output.build_index)  # before the fork: the child inherits the index
    search = partial(find_lines, output, query, before, after, max_matches)
    if query.linear:
        return await asyncio.to_thread(search)

    async def in_a_child() -> Found:
        async with _search_slots:
            return await run_forked(search, timeout)

    try:
        return await asyncio.wait_for(in_a_child(), timeout)
    except asyncio.TimeoutError:
        raise ToolError(SEARCH_TIMEOUT, f"the search did not finish within {timeout:g} s and was stopped (a "
                        "regex with nested or adjacent repeats, such as (a+)+ or .*.*, can backtrack for "
                        'hours); search for a fixed string with query_mode="literal" (and '
                        "ignore_case=false), or use a more specific regex") from None


async def tool_interrupt(ctx: ToolContext, args: dict) -> Reply:
    resource = ctx.resource
    execution = resource.interrupt()
    evaluations = await stop_evaluations(resource, execution is not None)
    stopped = describe_evaluations(evaluations, ctx)
    if execution is None:
        last = resource.last
        since = f" (last execution {describe_execution_brief(last)})" if last else ""
        data = {"interrupt_sent": bool(evaluations), "execution": None, "state": None,
                "evaluations": evaluations}
        if evaluations:
            return Reply.text(f"interrupt_sent: no cell is running{since}{stopped}", data)
        return Reply.text(f"idle: no cell is running, nothing to interrupt{since}", data)
    n = execution.number
    await wait_until_done(replace(ctx, progress=None), execution, 1.0)
    data = {"interrupt_sent": True, "execution": n, "state": execution.state, "evaluations": evaluations}
    if execution.state == RUNNING:
        return Reply.text(f"interrupt_sent: execution {n}; still running after 1 s (it ends when the kernel "
                          f"reports idle). wait(execution={n}{ctx.via}) to follow it; "
                          f"restart({ctx.only_via}) if it ignores the interrupt{stopped}", data)
    return Reply.text(f"interrupt_sent: execution {n} is now {execution.state} after "
                      f"{format_duration(execution.elapsed)}{stopped}", data)


async def stop_evaluations(resource: Resource, cell_running: bool) -> list[dict]:
    """Have the kernel side stop what the namespace tools run (a repr under way, or one that overran): what
    they were, each stopped or not. Asked on the subshell where the kernel has one, so that an answer under
    way on the main shell does not hold the question up; else on the main shell of an idle kernel (none while
    a cell runs). [] from a kernel that does not answer within STOP_EVALUATIONS_TIMEOUT."""
    kernel = resource.kernel
    if kernel is None or not kernel.ipython:
        return []
    subshell = await kernel.open_subshell() if kernel.has_subshells else None
    if subshell is None and cell_running:
        return []
    answer = await kernel.ask_namespace({"tool": "interrupt"}, subshell, STOP_EVALUATIONS_TIMEOUT)
    evaluations = (answer or {}).get("evaluations")
    return evaluations if isinstance(evaluations, list) else []


def describe_evaluations(evaluations: list[dict], ctx: ToolContext) -> str:
    """``; stopped what a namespace tool left running in the kernel: repr of "x" (running 12.3 s)``, and
    what still runs (one the watchdog gave up on: it ignored every stop)."""
    def name(item: dict) -> str:
        given_up = ", it ignored every stop" if item.get("abandoned") else ""
        return f"{item['what']} (running {format_duration(item['seconds'])}{given_up})"

    said = {stopped: [name(item) for item in evaluations if bool(item.get("stopped")) is stopped]
            for stopped in (True, False)}
    text = ""
    if said[True]:
        text += f"; stopped what a namespace tool left running in the kernel: {', '.join(said[True])}"
    if said[False]:
        text += (f"; still running, each in a thread of its own (the kernel is free for cells): "
                 f"{', '.join(said[False])}; restart({ctx.only_via}) ends them")
    return text


async def tool_view_output(ctx: ToolContext, args: dict) -> Reply:
    """The execution view's read: its data as one line of JSON (the first line of the text, where notices may
    follow), and as the same data."""
    execution = ctx.resource.select(args.get("execution"))
    try:
        data = await describe_for_view(execution, args.get("line_range"), args.get("images_after", 0),
                                       args.get("html_after", 0))
    except ValueError as exc:
        raise ToolError(INVALID_LINE_RANGE, str(exc)) from None
    return Reply.text(json.dumps(data, ensure_ascii=False, separators=(",", ":")), data)


async def tool_restart(ctx: ToolContext, args: dict) -> Reply:
    old, new, killed = await ctx.resource.restart()
    text = f"restarted: new kernel {new.label} (was {old.ident if old else 'none'})"
    if killed is not None:
        text += f"; execution {killed.number} was running and is now killed"
    following = ctx.resource.last_number + 1
    data = {"kernel_pid": new.pid, "previous_kernel_pid": old and old.pid,
            "killed_execution": killed.number if killed else None,
            "next_execution": following}
    return Reply.text(f"{text}. Variables and imports are gone; records and outputs are kept, "
                      f"and the next cell is execution {following}.", data)


async def ask_kernel(ctx: ToolContext, request: dict, during_cell: bool = False) -> dict:
    """The kernel side's answer to a namespace request. An idle kernel answers on its main shell, and no cell
    begins before it has; while a cell runs, a kernel with subshells answers ``during_cell`` requests on one
    (else: busy, as run_cell says it)."""
    resource = ctx.resource
    async with resource.admission:
        kernel = await resource.ensure_kernel()
        if not kernel.ipython:
            raise ToolError(NOT_IPYTHON, f"{request['tool']} reads the namespace of an IPython kernel; this "
                            f"kernel is {kernel.language}: use run_cell in its language")
        try:
            resource.sequence.check_idle()
        except Busy as busy:
            refusal = busy
        else:
            return check_answer(await kernel.ask_namespace(request, None), request)
    subshell = await kernel.open_subshell() if during_cell and kernel.has_subshells else None
    if subshell is None:
        raise refusal
    return check_answer(await kernel.ask_namespace(request, subshell), request)


def check_answer(answer: dict | None, request: dict) -> dict:
    """The kernel's answer, or the tool error it says (a name it does not have, one that raised)."""
    tool = request["tool"]
    if answer is None:
        raise ToolError(NO_ANSWER, f"the kernel did not answer the {tool} request within "
                        f"{NAMESPACE_TIMEOUT:g} s; it may be stuck in code that holds the interpreter")
    if not answer:
        raise ToolError(NO_ANSWER, f"this kernel's loommux side predates {tool}; restart() the kernel to "
                        "use it")
    if "unresolved" in answer:
        missing = answer["unresolved"]
        what = "is not defined in the kernel" if "." not in missing else "does not exist (no such attribute)"
        raise ToolError(NAME_NOT_FOUND, f'"{missing}" {what}; namespace() lists the names there are')
    if "failed" in answer:
        raise ToolError(NAME_NOT_FOUND, f'"{answer["failed"]}" could not be read: {answer["message"]}')
    if "fault" in answer:  # a bug of the kernel side's
        raise ToolError(name_http_error(500), f"the kernel side could not answer {tool}: {answer['fault']}")
    return answer


def list_size_facts(size: dict) -> list[tuple[str, str]]:
    """A value's size as (label, text): its shape as Python writes it, ``(1000, 3)``, else its len (or why
    there is none); its memory."""
    facts = []
    if "shape" in size:
        facts.append(("shape", repr(tuple(size["shape"]))))
    if "len" in size:
        facts.append(("len", format_count(size["len"])))
    elif "len_note" in size:  # a len() that raised or ran late
        facts.append(("len", size["len_note"]))
    if "bytes" in size:
        facts.append(("memory", format_size(size["bytes"])))
    return facts


def describe_size(size: dict) -> str:
    """``(1000, 3) · 23.6 KiB`` or ``len 5``: a value's size in a namespace row."""
    return " · ".join(text if label != "len" else f"len {text}" for label, text in list_size_facts(size))


def render_table(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows as lines of left-aligned columns (the last one unpadded)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join([*(cell.ljust(width) for cell, width in zip(row, widths)), row[-1]]).rstrip()
            for row in rows]


async def tool_namespace(ctx: ToolContext, args: dict) -> Reply:
    query, max_items = args.get("query") or None, args.get("max_items", DEFAULT_NAMESPACE_ITEMS)
    answer = await ask_kernel(ctx, {"tool": "namespace", "query": query, "max_items": max_items}, True)
    names, matched = answer["names"], answer["matched"]
    counted = pluralize(answer["total"], "name")
    if query is not None:
        counted = f"{format_count(matched)} of {counted} match {describe_value(query)}"
    shown = "all shown" if len(names) == matched else f"first {format_count(len(names))} shown"
    lines = [f"[namespace · {counted} · {shown}]" if matched else f"[namespace · {counted}]"]
    if names:
        rows = [(row["name"], row["kind"], row["type"], describe_size(row["size"]), row["value"])
                for row in names]
        lines += render_table([("name", "kind", "type", "size", "value"), *rows])
    data = {**answer, "shown": len(names), "query": query}
    return Reply.text("\n".join(lines), data)


def check_dotted_name(name: str) -> None:
    if not name or len(name) > MAX_PATH_CHARS or not all(part.isidentifier() for part in name.split(".")):
        raise ToolError(INVALID_ARGUMENTS, f'"name" must be a name or a dotted path such as "df" or '
                        f'"model.config" (at most {MAX_PATH_CHARS:,} characters), not {describe_value(name)}')


async def tool_inspect(ctx: ToolContext, args: dict) -> Reply:
    check_dotted_name(args["name"])
    found = {"frame": None, "array": None,
             **await ask_kernel(ctx, {"tool": "inspect", "name": args["name"]}, True)}
    lines = [f"[inspect {found['name']} · {found['kind']} · {found['type']}]"]
    facts = [*list_size_facts(found["size"]), ("module", found["module"]), ("signature", found["signature"])]
    if found["array"]:
        ndarray = found["array"]
        facts.append(("dtype", ndarray["dtype"]))
        if ndarray.get("min") is not None:
            facts += [("min", ndarray["min"]), ("max", ndarray["max"])]
    frame = found["frame"]
    if frame and frame["series"]:  # its one dtype, and its name
        name, dtype = frame["dtypes"][0]
        facts += [("dtype", dtype), ("name", name if name != "None" else "")]
    elif frame:
        columns = f" ({pluralize(frame['columns'], 'column')})" if frame["columns"] is not None else ""
        facts.append((f"dtypes{columns}", " · ".join(f"{name} {dtype}" for name, dtype in frame["dtypes"])))
    lines += [f"{label}: {value}" for label, value in facts if value]
    for label, text in (("first rows", (frame or {}).get("head")), ("doc", found["doc"]),
                        ("repr", found["repr"])):
        if text:
            lines += [f"{label}:", text] if "\n" in text else [f"{label}: {text}"]
    return Reply.text("\n".join(lines), found)


async def tool_reset(ctx: ToolContext, args: dict) -> Reply:
    names = args.get("names")
    answer = await ask_kernel(ctx, {"tool": "reset", "names": names})
    kernel = ctx.resource.kernel
    if "published" in answer and kernel is not None:
        ctx.resource.kernel_holder.take_published(kernel, answer.pop("published"))
    counts = " · ".join(f"{format_count(len(answer[key]))} {key}" for key in ("removed", "refused",
                                                                                 "unknown"))
    answer = cut_reset_answer(answer)
    reasons, left_out = answer["refused_reasons"], answer["left_out"]
    lines = [f"[reset · {counts}]"]
    for key, label, shown in (
            ("removed", "removed", answer["removed"]),
            ("refused", "refused", [f"{name} ({reasons[name]})" for name in answer["refused"]]),
            ("unknown", "unknown", answer["unknown"]),
            ("unpublished", "unpublished (their functions were removed)", answer["unpublished"])):
        if shown:
            more = f", … and {format_count(left_out[key])} more" if key in left_out else ""
            lines.append(f"{label}: {', '.join(shown)}{more}")
    if names is None:
        lines.append("kept: IPython's own names, loommux and _ names")
    return Reply.text("\n".join(lines), answer)


def cut_reset_answer(answer: dict) -> dict:
    """A reset's answer with at most RESET_NAMES_SHOWN names in each list, each name clipped (a name given
    that the kernel does not have can be of any length); ``left_out`` counts the rest, by list ({} when
    nothing was left out)."""
    cut, left_out = dict(answer), {}
    for key in ("removed", "refused", "unknown", "unpublished"):
        cut[key] = [clip(name, QUOTED_ID_CHARS) for name in answer[key][:RESET_NAMES_SHOWN]]
        if len(answer[key]) > RESET_NAMES_SHOWN:
            left_out[key] = len(answer[key]) - RESET_NAMES_SHOWN
    reasons = answer["refused_reasons"]
    cut["refused_reasons"] = {clip(name, QUOTED_ID_CHARS): reasons[name]
                              for name in answer["refused"][:RESET_NAMES_SHOWN]}
    return {**cut, "left_out": left_out}


class UnknownTool(Exception):
    """A tools/call naming neither a loommux tool nor one that the kernel it names publishes."""


def find_published(resource: Resource | None) -> dict[str, dict]:
    """The tools a resource's kernel publishes, by name (none before it has a kernel)."""
    kernel = resource.kernel if resource is not None else None
    return kernel.published.tools if kernel is not None else {}


def describe_published(tool: dict) -> dict:
    """A published tool as tools/list shows it: as its kernel announced it, taking the kernel argument too."""
    schema = tool["inputSchema"]
    properties = {**schema["properties"], "kernel": KERNEL_REF_PARAM}
    return {**tool, "inputSchema": {**schema, "properties": properties, "additionalProperties": False}}


JSON_TYPE_CHECKS = {
    "string": lambda value: isinstance(value, str),
    "integer": lambda value: isinstance(value, int) and not isinstance(value, bool),
    "number": lambda value: (isinstance(value, (int, float)) and not isinstance(value, bool)
                             and math.isfinite(value)),
    "boolean": lambda value: isinstance(value, bool),
    "null": lambda value: value is None,
    "array": lambda value: isinstance(value, list),
    "object": lambda value: isinstance(value, dict),
}


def fits_schema(schema: dict, value: Any) -> bool:
    """Whether a value fits a published parameter's schema (the subset make_schema writes)."""
    if "anyOf" in schema:
        return any(fits_schema(member, value) for member in schema["anyOf"])
    if "enum" in schema and not any(type(value) is type(choice) and value == choice
                                    for choice in schema["enum"]):
        return False
    kinds = schema.get("type", [])
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if kinds and not any(JSON_TYPE_CHECKS.get(kind, lambda _: False)(value) for kind in kinds):
        return False
    if isinstance(value, list) and "items" in schema:
        return all(fits_schema(schema["items"], item) for item in value)
    if isinstance(value, dict) and "additionalProperties" in schema:
        return all(fits_schema(schema["additionalProperties"], item) for item in value.values())
    return True


def encode_arguments(arguments: dict) -> str:
    """A call's arguments as the JSON text its cell passes (ASCII: a lone surrogate is escaped, as JSON
    can)."""
    return json.dumps(arguments, allow_nan=False)


def check_json_values(arguments: dict) -> None:
    """invalid_arguments for what fits a schema yet is no JSON the kernel could take: NaN or Infinity in an
    object or an array, or nesting past MAX_ARGUMENT_DEPTH."""
    for name, value in arguments.items():
        stack = [(value, 1)]
        while stack:
            item, depth = stack.pop()
            if isinstance(item, float) and not math.isfinite(item):
                raise ToolError(INVALID_ARGUMENTS, f'"{name}" holds {item!r}, which is not JSON (numbers '
                                "must be finite)")
            if depth > MAX_ARGUMENT_DEPTH:
                raise ToolError(INVALID_ARGUMENTS, f'"{name}" is nested deeper than {MAX_ARGUMENT_DEPTH} '
                                "levels")
            if isinstance(item, (list, dict)):
                stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict)
                                                               else item))


def check_published_arguments(tool: dict, arguments: Any) -> dict:
    """A published tool's arguments, checked against its schema; the kernel argument as every tool's."""
    if not isinstance(arguments, dict):
        raise ToolError(INVALID_ARGUMENTS, "arguments must be a JSON object")
    properties = tool["inputSchema"]["properties"]
    for name, value in arguments.items():
        if name == "kernel":
            continue
        if name not in properties:
            raise ToolError(INVALID_ARGUMENTS, f'unknown argument "{clip(name, SHOWN_CHARS)}" (accepted: '
                            f'{", ".join([*properties, "kernel"])})')
        if not fits_schema(properties[name], value):
            raise ToolError(INVALID_ARGUMENTS, f'"{name}" must fit {json.dumps(properties[name])}, not '
                            f"{describe_value(value)}")
    for name in tool["inputSchema"].get("required", ()):
        if name not in arguments:
            raise ToolError(INVALID_ARGUMENTS, f'missing required argument "{name}"')
    given = {name: value for name, value in arguments.items() if name != "kernel"}
    check_json_values(given)
    return given


def find_call_value(execution: Execution) -> dict | None:
    """What ``loommux.call`` returned, as its cell's execute_result carried it ({"value": ...}; a value with
    a lone surrogate as {"json": its JSON text}), or None."""
    for entry in reversed(execution.rich or ()):
        payload = load_display(entry)  # a big one is kept in the execution's file of displays
        data = payload.get("data") if isinstance(payload, dict) else None
        found = data.get(CALL_RESULT_MIME) if isinstance(data, dict) else None
        if isinstance(found, dict) and "value" in found:
            return found
        if isinstance(found, dict) and isinstance(found.get("json"), str):
            with contextlib.suppress(ValueError, RecursionError):
                return {"value": json.loads(found["json"])}
    return None


async def tool_call_published(ctx: ToolContext, args: dict, name: str) -> Reply:
    """A published function run once, as an execution of its own, ``loommux.call(name, '{"arg": value}')``,
    waited for as a cell is (a call that outlives the wait gets the running surface)."""
    tool = find_published(ctx.resource).get(name)
    if tool is None:
        raise UnknownTool(name, ", ".join(find_published(ctx.resource)))
    arguments = check_published_arguments(tool, args)
    # the arguments go as data, a JSON text the kernel decodes: never as Python source, which cannot say NaN
    # nor nest deeply
    given = [repr(encode_arguments(arguments))] if arguments else []
    source = f"loommux.call({', '.join([repr(name), *given])})"
    execution = await ctx.resource.submit(source, CellOptions(), stdin=ctx.stdin,
                                          by=("mcp_client", ctx.client))
    await wait_until_done(replace(ctx, task=None), execution, DEFAULT_WAIT_SECONDS, questions=True)
    if not execution.done:
        return await render_execution(execution, ctx)
    return await render_call(ctx, execution, name)


async def render_call(ctx: ToolContext, execution: Execution, name: str) -> Reply:
    """An ended call: the function's value (a string as it is, else JSON) then a line naming the execution;
    its exception, an error with the traceback."""
    n, found = execution.number, find_call_value(execution)
    printed = execution.log("stdout").line_count + execution.log("stderr").line_count
    head = f"[{name} · In [{n}] · {format_duration(execution.elapsed)}"
    if printed:
        head += f" · it printed {pluralize(printed, 'line')}: read_output(execution={n}{ctx.via})"
    head += "]"
    if execution.state != COMPLETED or found is None:
        trace = execution.log("traceback")
        if execution.ename is not None:
            error = describe_error(execution.ename, execution.evalue or "")
            traceback_text = trace.lines(0, trace.line_count)
            raise ToolError(FUNCTION_RAISED, f"{name} raised {error} {head}\n{traceback_text}")
        reason = f" ({execution.reason})" if execution.reason else ""
        raise ToolError(FUNCTION_RAISED, f"{name} did not return: execution {n} ended {execution.state}"
                        f"{reason} {head}")
    value = found["value"]
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if not await fits_token_limit(text):
        return Reply.text(f"[{name} returned {pluralize(len(text), 'character')} · over the "
                          f"{format_count(TOKEN_LIMIT)}-token limit] read_output(execution={n}, "
                          f'stream="result", line_range="1:40"{ctx.via}) reads it by line range',
                          {"execution": n, "output_omitted_reason": "token_limit"})
    return Reply([{"type": "text", "text": text}, {"type": "text", "text": head}], {"result": value})


TOOLS = {
    tool.name: tool
    for tool in (
        Tool(
            "run_cell", "Run a cell",
            "Run Python (IPython syntax: magics, !shell) in the persistent kernel; variables, imports and "
            "definitions persist across cells. Returns the output (text and images) when the cell finishes "
            "within its wait (10 s; a first line `%%loommux --wait 60` waits longer, `--full-output` returns "
            "long output whole), else its execution number: then use wait, read_output, search_output or "
            "interrupt. One cell runs at a time.",
            tool_run_cell, EXECUTION_SCHEMA,
            {CELL_ARGUMENT: {"type": "string", "description": "The cell source, optionally starting with a "
                             "%%loommux [--wait SECONDS] [--full-output] [--kernel NAME] header line."}},
            required=(CELL_ARGUMENT,), destructive=True, returns_output=True, task_support=True,
        ),
        Tool(
            "wait", "Wait for a cell",
            "Wait for a running cell to finish (never interrupts it) and return the same result as run_cell. "
            "Use it after run_cell returned a running notice; for a finished cell it returns at once.",
            tool_wait, EXECUTION_SCHEMA,
            {"execution": EXECUTION_PARAM,
             "timeout_seconds": {"type": "number", "minimum": 0, "maximum": MAX_WAIT_TIMEOUT,
                                 "default": DEFAULT_WAIT_TIMEOUT,
                                 "description": "How long to wait, in seconds."}},
            read_only=True, returns_output=True, task_support=True,
        ),
        Tool(
            "status", "Kernel status",
            "The workspace, interpreter, kernel pid and state, the current or last execution and the 10 most "
            "recent executions. Use execution_status for one execution's details.",
            tool_status, STATUS_SCHEMA, read_only=True,
        ),
        Tool(
            "execution_status", "Execution details",
            "One execution's state, times, error and per-stream line/size totals, without its output. "
            "Use read_output or search_output to see the output itself.",
            tool_execution_status, EXECUTION_STATUS_SCHEMA, {"execution": EXECUTION_PARAM}, read_only=True,
        ),
        Tool(
            "read_output", "Read output lines",
            'Read an execution\'s output by line range: "start:stop", 1-based inclusive, negatives count '
            'from the end ("-40:" is the tail, ":10" the head, "3:3" one line); no range returns every line. '
            "Works while the cell runs. Use search_output to find lines by content.",
            tool_read_output, READ_SCHEMA,
            {"execution": EXECUTION_PARAM, "stream": STREAM_PARAM,
             "line_range": {"type": "string", "description": 'Lines "start:stop", e.g. "-40:" or "20:40".'},
             "max_chars": MAX_CHARS_PARAM},
            read_only=True, returns_output=True,
        ),
        Tool(
            "search_output", "Search output",
            "Search an execution's output for a regex or literal text; returns matching lines with their "
            "line numbers (M = match, C = context) for a follow-up read_output. query_mode auto uses a regex "
            "when the query compiles, else literal text.",
            tool_search_output, SEARCH_SCHEMA,
            {"query": {"type": "string", "description": "Regex or literal text to find."},
             "execution": EXECUTION_PARAM, "stream": STREAM_PARAM,
             "query_mode": {"type": "string", "enum": ["auto", "literal", "regex"], "default": "auto"},
             "ignore_case": {"type": "boolean", "default": False},
             "context_before": {"type": "integer", "minimum": 0, "maximum": MAX_CONTEXT_LINES, "default": 0,
                                "description": "Context lines shown before each match."},
             "context_after": {"type": "integer", "minimum": 0, "maximum": MAX_CONTEXT_LINES, "default": 0,
                               "description": "Context lines shown after each match."},
             "max_chars": MAX_CHARS_PARAM,
             "max_matches": {"type": "integer", "minimum": 1, "default": DEFAULT_MAX_MATCHES,
                             "description": "Matching lines shown; the rest are counted."}},
            required=("query",), read_only=True, returns_output=True,
        ),
        Tool(
            "interrupt", "Interrupt the running cell",
            "Send KeyboardInterrupt to the running cell (like Ctrl-C); the kernel and its variables survive. "
            "Use restart only when a cell ignores the interrupt.",
            tool_interrupt, INTERRUPT_SCHEMA, idempotent=True,
        ),
        Tool(
            "restart", "Restart the kernel",
            "Kill the kernel (and a running cell, and every process it started) and start a fresh one in the "
            "same workspace. All variables and imports are lost; execution records, outputs and numbering "
            "are kept.",
            tool_restart, RESTART_SCHEMA, destructive=True,
        ),
        Tool(
            "namespace", "List variables",
            "The kernel's user-defined names, sorted, with kind, type, size and a short value; also while a "
            "cell runs. No cell is run.",
            tool_namespace, NAMESPACE_SCHEMA,
            {"query": {"type": "string", "description": "Only names containing this (any case)."},
             "max_items": {"type": "integer", "minimum": 1, "maximum": MAX_NAMESPACE_ITEMS,
                           "default": DEFAULT_NAMESPACE_ITEMS}},
            read_only=True,
        ),
        Tool(
            "inspect", "Inspect a variable",
            "One name or dotted attribute: type, signature, docs, size and a safe repr; a DataFrame's dtypes "
            "and first rows, an array's dtype and min/max. Also while a cell runs; no cell is run.",
            tool_inspect, INSPECT_SCHEMA,
            {"name": {"type": "string", "description": 'e.g. "df" or "model.config"'}},
            required=("name",), read_only=True,
        ),
        Tool(
            "reset", "Remove variables",
            "Delete the given top-level names, or every user-defined name, without restarting the kernel.",
            tool_reset, RESET_SCHEMA,
            {"names": {"type": "array", "items": {"type": "string"}, "description": "Omit for all."}},
            destructive=True, idempotent=True,
        ),
    )
}
# The tools only the execution view calls (see "Execution view"): listed, with their visibility, to hosts that
# render views, and refused to others.
APP_TOOLS = {
    tool.name: tool
    for tool in (
        Tool(
            VIEW_TOOL, "Read an execution for its view",
            "For the execution view only: an execution's number, state, elapsed time, a window of its output "
            f"lines (the last {VIEW_PAGE_LINES} unless line_range says which, at most {VIEW_PAGE_LINES}) and "
            "the images and HTML outputs after those the view has; as JSON.",
            tool_view_output, {},
            {"execution": EXECUTION_PARAM,
             "line_range": {"type": "string", "description": 'Lines "start:stop" as read_output\'s.'},
             "images_after": {"type": "integer", "minimum": 0, "default": 0,
                              "description": "Images the view has: only later ones are sent."},
             "html_after": {"type": "integer", "minimum": 0, "default": 0,
                            "description": "Displays the view has passed (html_next): only HTML "
                                           "outputs after them are sent."}},
            read_only=True, app_only=True,
        ),
    )
}


async def call_tool(ctx: ToolContext, name: str, arguments: Any) -> dict | Task:
    """Run a tool and build its MCP result; tool failures become isError results. A call whose cell a task
    carries on returns that task; its result comes when the cell has ended."""
    tool, lease, opened = TOOLS.get(name) or APP_TOOLS.get(name), None, None
    try:
        try:
            args = check_arguments(tool, arguments) if tool else check_kernel_argument(arguments)
            ref = args.pop("kernel", None)
            session = ctx.session
            if session is not None and (ref is not None or session.default_kernel is not None):
                resource, named, opened, lease = session.open_kernel(ref, ctx.client)
                ctx = replace(ctx, resource=resource, kernel_ref=None if ref is None else named)
                lease.begin_request(tool_call=False)  # a call in progress holds the kernel it names
            elif ctx.resource is None and session is not None:
                ctx = replace(ctx, resource=session.attach())
            ctx.resource.touch()
            run = tool.run if tool else partial(tool_call_published, name=name)
            reply, is_error = await run(ctx, args), False
        except ResourceError as exc:
            raise ToolError.of(exc, ctx) from None
        except OutputUnreadable as exc:
            raise ToolError(OUTPUT_LOST, str(exc)) from None
        finally:
            if lease is not None:
                lease.end_request()
    except ToolError as exc:
        reply, is_error = reply_error(exc), True
    if reply.pending is not None:
        return ctx.task.start(ctx.resource, reply.pending, partial(finish_call, ctx, reply.then, opened))
    return make_tool_result(ctx, reply, is_error, opened)


def check_kernel_argument(arguments: Any) -> dict:
    """A published tool's arguments before its kernel is known: an object whose kernel argument, if any, is
    checked as every tool's is (the rest once the kernel says what the tool takes)."""
    if not isinstance(arguments, dict | None):
        raise ToolError(INVALID_ARGUMENTS, "arguments must be a JSON object")
    arguments = dict(arguments or {})
    if "kernel" in arguments:
        check_value("kernel", KERNEL_REF_PARAM, arguments["kernel"])
    return arguments


def reply_error(exc: ToolError) -> Reply:
    return Reply.text(str(exc), {"error_code": exc.code, "message": exc.message})


async def finish_call(ctx: ToolContext, then: Callable[[], Awaitable[Reply]], opened: str | None) -> dict:
    """The result of a call a task carried on, once its cell ended: what the call would have returned then."""
    try:
        reply, is_error = await then(), False
    except ToolError as exc:
        reply, is_error = reply_error(exc), True
    return make_tool_result(ctx, reply, is_error, opened)


def make_tool_result(ctx: ToolContext, reply: Reply, is_error: bool, opened: str | None) -> dict:
    """A tool's MCP result: content, structured data in that mode, and the notices that end it."""
    if opened:  # a new private kernel: its handle comes first, so that the caller keeps using it
        reply.content.insert(0, {"type": "text", "text": opened})
    if ctx.kernel_ref:
        reply.data["kernel"] = ctx.kernel_ref
    result = {"content": reply.content, "isError": is_error}
    if ctx.settings.result_mode == "structured":
        result["structuredContent"] = reply.data
    add_notices(result, [*reply.notices, *(ctx.resource.take_notices() if ctx.resource else []),
                         *take_estimate_notice()])
    return result


def add_notices(result: dict, notices: list[str]) -> None:
    """End a tool result with one-line notices (a legacy directive, kernel replaced, lease alert), in text and
    data alike."""
    if not notices:
        return
    texts = [block for block in result["content"] if block["type"] == "text"]
    texts[-1]["text"] += "\n\n" + "\n".join(notices)
    if "structuredContent" in result:
        result["structuredContent"].setdefault("notices", []).extend(notices)


# ---------------------------------------------------------------- MCP protocol

PROTOCOL_VERSIONS = ("2025-11-25", "2025-06-18", "2025-03-26", "2024-11-05")  # the handshake era (initialize)
BATCH_PROTOCOL_VERSION = "2025-03-26"  # the one revision with JSON-RPC batches
# stateless: every request carries its version, client and capabilities in _meta
STATELESS_VERSION = "2026-07-28"
SERVED_VERSIONS = (STATELESS_VERSION, *PROTOCOL_VERSIONS)
PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS, INTERNAL_ERROR = (
    -32700, -32600, -32601, -32602, -32603)
HEADER_MISMATCH, MISSING_CAPABILITY, UNSUPPORTED_VERSION = -32020, -32021, -32022
META_VERSION = "io.modelcontextprotocol/protocolVersion"
META_CAPABILITIES = "io.modelcontextprotocol/clientCapabilities"
META_CLIENT = "io.modelcontextprotocol/clientInfo"
META_SERVER = "io.modelcontextprotocol/serverInfo"
# The routing headers of a 2026-07-28 request over HTTP, which must say what its body says (-32020).
MCP_VERSION_HEADER = "mcp-protocol-version"
MCP_METHOD_HEADER = "mcp-method"
MCP_NAME_HEADER = "mcp-name"
KERNEL_PARAM_HEADER = "mcp-param-kernel"  # the kernel argument's x-mcp-header
BASE64_SENTINEL = ("=?base64?", "?=")  # a header value sent as =?base64?…?=
SERVER_INFO = {"name": "loommux", "title": "loommux IPython kernel", "version": __version__}
SKILLS_EXTENSION = "io.modelcontextprotocol/skills"  # declared in both eras' capabilities (see SKILL_ENTRY)
# MCP Apps (UI_EXTENSION, see "Execution view") is declared in both eras too: hosts render only for a server
# that declares it; tools link the view only for a host that declared it. The tool list changes as kernels
# publish functions (see "Published functions").
CAPABILITIES = {"tools": {"listChanged": True}, "resources": {"subscribe": True},
                "extensions": {SKILLS_EXTENSION: {}, UI_EXTENSION: {}}}
# Tasks, in each era's own form: the 2026-07-28 extension, declared per request by the client (its methods
# carry Mcp-Name = the task id over HTTP), and the experimental tasks of 2025-11-25 handshake sessions.
TASKS_EXTENSION = "io.modelcontextprotocol/tasks"
STATELESS_CAPABILITIES = {**CAPABILITIES, "extensions": {**CAPABILITIES["extensions"], TASKS_EXTENSION: {}}}
STATELESS_TASK_METHODS = ("tasks/get", "tasks/update", "tasks/cancel")
TASKS_VERSION = "2025-11-25"  # the first handshake version with tasks
HANDSHAKE_TASKS = {"list": {}, "cancel": {}, "requests": {"tools": {"call": {}}}}
HANDSHAKE_TASK_METHODS = ("tasks/get", "tasks/result", "tasks/list", "tasks/cancel")
TASKS_PAGE = 50  # tasks/list page size
META_RELATED_TASK = "io.modelcontextprotocol/related-task"
META_IMMEDIATE_RESPONSE = "io.modelcontextprotocol/model-immediate-response"
META_SUBSCRIPTION = "io.modelcontextprotocol/subscriptionId"
# A cell's input() asks the person with a form of one string field (elicitation/create, form mode).
INPUT_FIELD = "input"
DEFAULT_INPUT_MESSAGE = "The cell asks for input"
ELICITATION_ACTIONS = ("accept", "decline", "cancel")
TOOLS_TTL_MS = 3_600_000  # what server/discover says changes only with the server
# tools/list changes whenever a kernel publishes a function: not to be cached, or a client's next list (the
# official SDK's default caching honours the hint) would hide a tool its own cell just published
TOOL_LIST_TTL_MS = 0
TOOL_LIST_CHANGED = "notifications/tools/list_changed"
TOOLS_CHANGED = ("tools",)  # a listen stream's queue item: the tool list changed (see TaskRequests.listen)
LARGE_MESSAGE_CHARS = 1 << 20  # encode bigger responses off the event loop
CLIENT_NAME_CHARS = 80
SERVER_INSTRUCTIONS = """\
loommux runs your Python in one persistent IPython kernel: variables, imports and definitions live on \
from cell to cell, in the workspace directory.
- run_cell(freeform) returns the cell's output if it finishes within 10 s; otherwise its execution number \
and a running notice. A first line `%%loommux --wait 120` waits longer for that cell; \
`--full-output` returns long output whole.
- wait(execution=N) keeps waiting; read_output(execution=N, line_range="-40:") and search_output(query=..., \
execution=N) read or search any stream, also while the cell runs. Output over 5,000 tokens is never lost: \
it is summarized, then read by range. Search or read it instead of running the cell again.
- One cell runs at a time: interrupt() stops it (Ctrl-C) and keeps your variables, so try it before \
restart(), which gives a fresh kernel (numbering goes on).
- status() shows the kernel and recent executions; execution_status(execution=N) one execution's details.
- namespace(), inspect(name="df") and reset(names=[...]) read and tidy variables without running a cell \
(the first two also while a cell runs).
- Every tool takes kernel=: "~" starts a private kernel and its result gives the handle to pass on later \
calls; a name (e.g. kernel="lab") is a shared kernel. Without it you use this session's kernel.
- The skill skill://loommux/SKILL.md teaches these patterns in full."""
# Executions as resources (see "Execution resources"), and one skill that teaches loommux (the Skills
# extension, SEP-2640: skills/list, skills/get, its files read as resources).
LINKS_VERSION = "2025-06-18"  # the first handshake revision with resource_link content
UNKNOWN_RESOURCE = -32002  # the handshake era's code; 2026-07-28 answers an unknown URI with -32602
SKILL_NAME = "loommux"
SKILL_URI = f"skill://{SKILL_NAME}/SKILL.md"
SKILL_MIME = "text/markdown"
SKILL_FRONTMATTER = {
    "name": SKILL_NAME,
    "description": "How to work in loommux's persistent Python kernels - run and wait for cells, read and "
    "search long output by line range instead of running it again, stop cells safely. Use it whenever you "
    "run code with the loommux tools.",
}
RESOURCE_METHODS = ("resources/list", "resources/templates/list", "resources/read", "skills/list",
                    "skills/get")
SUBSCRIBE_METHODS = ("resources/subscribe", "resources/unsubscribe")  # the handshake era's only


def render_skill() -> str:
    """The loommux skill's SKILL.md: its frontmatter, then the working patterns with the numbers that
    matter (the namespace tools' part only where this server has them)."""
    head = "".join(f"{key}: {value}\n" for key, value in SKILL_FRONTMATTER.items())
    body = f"""# Working in loommux

loommux keeps an IPython kernel alive between your calls: variables, imports and definitions persist from
cell to cell, and nothing a cell prints is ever lost. These patterns keep your context small and your work
safe.

## Run, then wait
- `run_cell(freeform="...")` returns the output when the cell ends within its wait \
({DEFAULT_WAIT_SECONDS:g} s). A longer cell returns its execution number N, a running notice and its last \
lines; the cell keeps running.
- `wait(execution=N)` waits on ({DEFAULT_WAIT_TIMEOUT:g} s by default, `timeout_seconds` up to \
{format_count(int(MAX_WAIT_TIMEOUT))} s) and never interrupts the cell. Call it again while it says running.
- The header, a cell's first line, sets its options: `%%loommux --wait 300` waits that long in the same \
call, `--full-output` returns long output whole (sparingly: it costs context), `--kernel NAME` runs the \
cell in another kernel.
- One cell runs at a time: run_cell during another cell answers `busy` with that cell's number.
- A host that supports MCP tasks may get a task for a cell that outlives the call; its result is what \
`wait` would return. Otherwise use `wait`.

## Read what you need; never run a cell again to see its output
- Output over {format_count(TOKEN_LIMIT)} tokens is not returned whole: the result gives its size, its \
last lines and the calls that read it.
- `read_output(execution=N, line_range="-40:")` reads the tail, `"1:40"` the head, `"200:260"` a slice; \
`stream=` picks stdout, stderr, result or traceback. It works while the cell runs.
- `search_output(query="Error|Traceback", execution=N, context_after=3)` finds lines (regex or text) with \
their numbers, for a follow-up `read_output`. Search instead of printing more or running again.
- `status()` shows the kernel and the recent executions; `execution_status(execution=N)` one execution's \
times, error and the size of each stream.
- A result carries at most {MAX_IMAGES_PER_RESULT} images; images beyond that, and output over the limit, \
are linked as resources (`loommux://executions/N/combined`, `loommux://executions/N/images/K`).
{render_namespace_patterns()}
## Stop before you restart
- `interrupt()` sends Ctrl-C to the running cell; the kernel and its variables survive. Try it first.
- `restart()` only when a cell ignores the interrupt or the kernel is broken: it kills the kernel and \
every process it started; variables are lost, records, outputs and numbering stay.

## Kernels
- Every tool takes `kernel=`: a name (`"lab"`) is a shared kernel; `"~"` starts a private kernel and its \
result gives a handle `~...` to pass on later calls. Without it you use this session's kernel.
"""
    return f"---\n{head}---\n\n{body}"


def render_namespace_patterns() -> str:
    """The skill's part on the namespace tools, where this server has them (else nothing)."""
    if not {"namespace", "inspect", "reset"} <= set(TOOLS):
        return ""
    return """
## Look at the namespace instead of printing it
- `namespace()` lists your variables with their types and sizes; `inspect(name="df")` shows one (a
DataFrame's shape, dtypes and first rows), also while a cell runs where the kernel can.
- `reset(names=[...])` removes names without a restart.
"""


SKILL_TEXT = render_skill()
SKILL_BYTES = SKILL_TEXT.encode()
SKILL_DIGEST = "sha256:" + hashlib.sha256(SKILL_BYTES).hexdigest()
SKILL_ENTRY = {"uri": SKILL_URI, "frontmatter": SKILL_FRONTMATTER,
               "resources": [{"uri": SKILL_URI, "digest": SKILL_DIGEST, "size": len(SKILL_BYTES)}]}
FIXED_URIS = (SKILL_URI, VIEW_URI)  # resources of ours that never change: nothing to follow
SKILL_RESOURCE = {"uri": SKILL_URI, "name": SKILL_NAME, "title": "Working in loommux",
                  "description": SKILL_FRONTMATTER["description"], "mimeType": SKILL_MIME,
                  "size": len(SKILL_BYTES)}

Notify = Callable[[dict], Awaitable[None]]


class McpError(Exception):
    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, data


def make_jsonrpc_error(request_id: Any, code: int, message: str, data: Any = None) -> dict:
    error = ({"code": code, "message": message} if data is None
             else {"code": code, "message": message, "data": data})
    return {"jsonrpc": "2.0", "id": request_id, "error": error}


def is_stateless(message: Any) -> bool:
    """Whether a message is served statelessly under 2026-07-28: server/discover, or anything but initialize
    carrying the per-request protocol version in _meta (the body decides, not a header)."""
    if not isinstance(message, dict) or not isinstance(message.get("method"), str):
        return False
    params = message.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    if message["method"] == "server/discover":
        return True
    return message["method"] != "initialize" and isinstance(meta, dict) and META_VERSION in meta


def read_stateless_envelope(params: dict) -> dict:
    """The request's _meta envelope, present and well typed (-32602), its version served (-32022)."""
    meta = params.get("_meta")
    missing = [key for key in (META_VERSION, META_CAPABILITIES)
               if not isinstance(meta, dict) or key not in meta]
    if missing:
        raise McpError(INVALID_PARAMS,
                       f"Invalid params: a {STATELESS_VERSION} request needs _meta {missing[0]}")
    if not isinstance(meta[META_VERSION], str) or not isinstance(meta[META_CAPABILITIES], dict):
        raise McpError(INVALID_PARAMS, f"Invalid params: _meta {META_VERSION} must be a string and "
                       f"{META_CAPABILITIES} an object")
    return meta


def check_stateless_version(meta: dict) -> None:
    if meta[META_VERSION] != STATELESS_VERSION:
        raise McpError(UNSUPPORTED_VERSION, "Unsupported protocol version",
                       {"supported": list(SERVED_VERSIONS), "requested": meta[META_VERSION]})


def decode_header_value(value: str) -> str:
    """A routing header's value, decoded when it is sent as =?base64?…?= (non-ASCII or edge whitespace)."""
    if value.startswith(BASE64_SENTINEL[0]) and value.endswith(BASE64_SENTINEL[1]):
        payload = value[len(BASE64_SENTINEL[0]) : -len(BASE64_SENTINEL[1])]
        try:
            decoded = base64.b64decode(payload, validate=True)
            if base64.b64encode(decoded).decode() != payload:  # non-canonical: no encoder writes it
                raise ValueError
            return decoded.decode()
        except ValueError:
            raise McpError(HEADER_MISMATCH, f"Header mismatch: {value!r} is not valid base64") from None
    return value


def check_routing_headers(headers: dict[str, str], method: str, params: dict) -> None:
    """A stateless request's routing headers must say what its body says (-32020)."""
    arguments = params.get("arguments") if isinstance(params.get("arguments"), dict) else {}
    kernel = arguments.get("kernel") if method == "tools/call" else None
    expected = {MCP_VERSION_HEADER: params["_meta"][META_VERSION], MCP_METHOD_HEADER: method}
    if method == "tools/call":
        expected[MCP_NAME_HEADER] = params.get("name")
    elif method == "resources/read" and isinstance(params.get("uri"), str):
        expected[MCP_NAME_HEADER] = params["uri"]
    elif method in STATELESS_TASK_METHODS and isinstance(params.get("taskId"), str):
        expected[MCP_NAME_HEADER] = params["taskId"]  # (a taskId that is no string is -32602, later)
    if kernel is not None:
        expected[KERNEL_PARAM_HEADER] = kernel
    elif KERNEL_PARAM_HEADER in headers:
        raise McpError(HEADER_MISMATCH,
                       "Header mismatch: Mcp-Param-Kernel is sent but the kernel argument is not")
    for name, value in expected.items():
        given = headers.get(name)
        if given is None:
            raise McpError(HEADER_MISMATCH, f"Header mismatch: the {name.title()} header is required (body "
                           f"value {value!r})")
        if decode_header_value(given) != str(value):
            raise McpError(HEADER_MISMATCH, f"Header mismatch: {name.title()} header value {given!r} does "
                           f"not match body value {value!r}")


def declares_tasks(meta: dict) -> bool:
    """Whether a 2026-07-28 request's client declared the tasks extension (on this request: nothing carries
    over from earlier ones)."""
    extensions = meta[META_CAPABILITIES].get("extensions")
    return isinstance(extensions, dict) and TASKS_EXTENSION in extensions


def missing_tasks_extension() -> McpError:
    return McpError(MISSING_CAPABILITY, f"Missing required client capability: the {TASKS_EXTENSION} "
                    "extension", {"requiredCapabilities": {"extensions": {TASKS_EXTENSION: {}}}})


def elicits_forms(capabilities: Any) -> bool:
    """Whether a handshake client declared form elicitation ({} means form mode: backwards compatibility)."""
    elicitation = capabilities.get("elicitation") if isinstance(capabilities, dict) else None
    return isinstance(elicitation, dict) and (not elicitation or "form" in elicitation)


def stamped(result: dict) -> dict:
    """A 2026-07-28 result: its resultType ("complete" unless it has one), the server's identity in _meta."""
    meta = {**result.get("_meta", {}), META_SERVER: SERVER_INFO}
    return {"resultType": "complete", **result, "_meta": meta}


def make_elicitation_params(prompt: str) -> dict:
    """The form that puts a cell's input() prompt to the person."""
    field_spec = {"type": "string", "title": "Input", "description": "What the cell's input() returns"}
    return {"mode": "form", "message": prompt if prompt.strip() else DEFAULT_INPUT_MESSAGE,
            "requestedSchema": {"type": "object", "properties": {INPUT_FIELD: field_spec}}}


def is_elicitation_result(value: Any) -> bool:
    return (isinstance(value, dict) and value.get("action") in ELICITATION_ACTIONS
            and isinstance(value.get("content", {}), dict))


def read_elicited_text(result: Any) -> str | None:
    """What input() returns for an elicitation result: the text accepted, else None (declined, cancelled or
    malformed: input() raises EOFError)."""
    if not is_elicitation_result(result) or result["action"] != "accept":
        return None
    value = result.get("content", {}).get(INPUT_FIELD, "")
    return value if isinstance(value, str) else json.dumps(value)


@dataclass(frozen=True)
class Era:
    """What the two eras of MCP say differently in the answers both give: the names of a task's timing
    fields, the code of a resource URI that names nothing, and whether results carry caching fields."""

    task_ttl_key: str
    task_poll_key: str
    unknown_resource: int
    caches: bool  # results carry ttlMs and cacheScope


HANDSHAKE_ERA = Era("ttl", "pollInterval", UNKNOWN_RESOURCE, caches=False)
STATELESS_ERA = Era("ttlMs", "pollIntervalMs", INVALID_PARAMS, caches=True)


def describe_task_fields(task: Task, era: Era) -> dict:
    """A task as its era names its fields (ttlMs, pollIntervalMs in 2026-07-28; ttl, pollInterval before)."""
    return {"taskId": task.id, "status": task.status, "statusMessage": task.describe_status(),
            "createdAt": format_iso_utc(task.created), "lastUpdatedAt": format_iso_utc(task.updated),
            era.task_ttl_key: task.ttl_ms, era.task_poll_key: task.poll_ms}


def describe_task(task: Task) -> dict:
    """A 2026-07-28 task with the fields of its status, as tasks/get and notifications/tasks show it."""
    described = describe_task_fields(task, STATELESS_ERA)
    if task.status == TASK_INPUT_REQUIRED:
        question = task.question()
        described["inputRequests"] = {} if question is None else {
            question.key: {"method": "elicitation/create",
                           "params": make_elicitation_params(question.prompt)}}
    elif task.status == TASK_COMPLETED:
        described["result"] = stamped(task.result)
    elif task.status == TASK_FAILED:
        described["error"] = make_task_error(task)
    return described


def make_task_error(task: Task) -> dict:
    """The JSON-RPC error of a task that failed with no result (its resource retired, the server stopped)."""
    return {"code": INTERNAL_ERROR, "message": f"Internal error: {task.reason}"}


def make_immediate_response(task: Task) -> str:
    """What a 2025-11-25 host may show the model while the task runs."""
    e = task.execution
    if e is None:
        return task.describe_status()
    return (f"Execution {e.number} runs as task {task.id}; its result arrives when the cell ends. Meanwhile "
            f"read_output(execution={e.number}) shows its output so far and interrupt() stops it.")


def read_client_name(info: Any) -> str | None:
    name = info.get("name") if isinstance(info, dict) else None
    return clip(name, CLIENT_NAME_CHARS) if isinstance(name, str) and name else None


def parse_json(data: bytes | str) -> Any:
    """Parse one JSON text; every way it can fail is a ValueError whose message names the problem in words."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("the JSON is nested too deeply") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"the message is not valid UTF-8 (byte {exc.start})") from None
    except json.JSONDecodeError:
        raise
    except ValueError:  # Python's limit on the digits of an integer
        raise ValueError("a number in the JSON has too many digits") from None


def encode_message(message: Any) -> bytes:
    """One JSON-RPC message as one line of UTF-8; lone surrogates become JSON escapes."""
    text = json.dumps(message, ensure_ascii=False, separators=(",", ":"))
    return text.encode("utf-8", "backslashreplace")


async def encode_message_async(message: Any) -> bytes:
    """Encode a message, off the event loop when it is large (a long read, images)."""
    result = message.get("result") if isinstance(message, dict) else None
    content = result.get("content", ()) if isinstance(result, dict) else ()
    size = sum(len(block.get("text") or block.get("data") or "")
               for block in content if isinstance(block, dict))
    return (await asyncio.to_thread(encode_message, message) if size > LARGE_MESSAGE_CHARS
            else encode_message(message))


def valid_request_id(value: Any) -> bool:
    return isinstance(value, (str, int)) and not isinstance(value, bool)


def request_of(message: Any) -> tuple[str | int, str] | None:
    """(id, method) when the message is a well-formed request, else None."""
    if (isinstance(message, dict) and message.get("jsonrpc") == "2.0" and valid_request_id(message.get("id"))
            and isinstance(message.get("method"), str)):
        return message["id"], message["method"]
    return None


def is_tool_call(message: Any) -> bool:
    return isinstance(message, dict) and message.get("method") == "tools/call"


def read_progress_token(message: Any) -> str | int | None:
    """The request's progress token; one that is not a string or an integer is ignored (it is echoed back)."""
    params = message.get("params") if isinstance(message, dict) else None
    meta = params.get("_meta") if isinstance(params, dict) else None
    token = meta.get("progressToken") if isinstance(meta, dict) else None
    return token if valid_request_id(token) else None


def refuse_request(message: dict) -> dict | None:
    """The error response to a request (a message with an id) whose id, method or params are malformed."""
    request_id, method, params = message["id"], message.get("method"), message.get("params")
    if not valid_request_id(request_id):
        return make_jsonrpc_error(None, INVALID_REQUEST,
                                  "Invalid Request: the id must be a string or an integer")
    if not isinstance(method, str):
        return make_jsonrpc_error(request_id, INVALID_REQUEST, "Invalid Request: the method must be a string")
    if params is not None and not isinstance(params, dict):
        return make_jsonrpc_error(request_id, INVALID_PARAMS, "Invalid params: params must be an object")
    return None


@dataclass(frozen=True, slots=True)
class McpRequest:
    """One well-formed JSON-RPC request as its era's method handler sees it; ``notify`` writes messages
    related to it (progress, notifications, elicitations) on its stream ahead of its response."""

    id: str | int
    method: str
    params: dict
    notify: Notify

    @property
    def meta(self) -> dict:
        """A stateless request's _meta envelope (checked before its handler runs)."""
        return self.params["_meta"]


class Elicitations:
    """What a handshake session asks its client: a cell's input() put to the person with elicitation/create
    (once per question while it is asked), on the stream of the call that waits; the client's response,
    matched by its request id, goes to the kernel if the cell still asks by then. Only for a client that
    declared form elicitation at initialize (``enabled``)."""

    def __init__(self) -> None:
        self.enabled = False
        self.sent = 0  # requests this server sent to the client
        self.outgoing: dict[str, asyncio.Future] = {}  # their ids -> their responses
        self.asking: dict[Question, asyncio.Task] = {}  # the questions it is putting to the person

    def asker(self, notify: Notify) -> Callable[[Question], None] | None:
        """How a tool call asks on the stream ``notify`` writes to (None: this client cannot be asked)."""
        return partial(self.ask, notify=notify) if self.enabled else None

    def ask(self, question: Question, notify: Notify, related: Task | None = None) -> None:
        """Put a cell's input() to the person, unless it is being put already or no longer asked."""
        if question not in self.asking and not question.cleared.is_set():
            self.asking[question] = asyncio.ensure_future(self._ask(question, notify, related))

    def receive(self, response: dict) -> None:
        """A response from the client: the answer to an elicitation; any other response is ignored."""
        reply = self.outgoing.get(response.get("id")) if valid_request_id(response.get("id")) else None
        if reply is not None and not reply.done():
            reply.set_result(response)

    async def _ask(self, question: Question, notify: Notify, related: Task | None) -> None:
        self.sent += 1
        request_id = f"loommux-{self.sent}"
        reply = self.outgoing[request_id] = asyncio.get_running_loop().create_future()
        params = make_elicitation_params(question.prompt)
        if related is not None:
            params["_meta"] = {META_RELATED_TASK: {"taskId": related.id}}
        try:
            await notify({"jsonrpc": "2.0", "id": request_id, "method": "elicitation/create",
                          "params": params})
            cleared = asyncio.ensure_future(question.cleared.wait())
            try:
                await asyncio.wait({reply, cleared}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                cleared.cancel()
            if reply.done():
                await question.resource.answer(question, read_elicited_text(reply.result().get("result")))
            else:  # interrupted, restarted or ended meanwhile: the form is moot
                reason = "the cell no longer waits for this input"
                await notify({"jsonrpc": "2.0", "method": "notifications/cancelled",
                              "params": {"requestId": request_id, "reason": reason}})
        finally:
            self.outgoing.pop(request_id, None)
            self.asking.pop(question, None)

    def close(self) -> None:
        for asking in list(self.asking.values()):
            asking.cancel()


def make_listen_notification(item: Task | str | tuple, subscription: dict) -> dict:
    """What a listen stream sends for an item of its queue: a task, a resource's URI or TOOLS_CHANGED."""
    if item is TOOLS_CHANGED:
        method, params = TOOL_LIST_CHANGED, {}
    elif isinstance(item, str):
        method, params = "notifications/resources/updated", {"uri": item}
    else:
        method, params = "notifications/tasks", describe_task(item)
    return {"jsonrpc": "2.0", "method": method, "params": {**params, "_meta": subscription}}


class TaskRequests:
    """A session's task requests over the server's TaskBoard, in each era's wire form: the 2026-07-28
    extension's tasks/get, tasks/update, tasks/cancel and subscriptions/listen (any task, by its id), and a
    2025-11-25 handshake session's tasks/get, tasks/result, tasks/list, tasks/cancel and the task a tools/call
    asks for (its own tasks only, their status changes pushed on its stream)."""

    def __init__(self, binding: SessionBinding, elicitations: Elicitations) -> None:
        self.binding = binding
        self.elicitations = elicitations  # tasks/result asks the person what a task's cell waits for

    @property
    def board(self) -> TaskBoard:
        return self.binding.registry.tasks

    async def find(self, params: dict, owner: SessionBinding | None) -> Task:
        """The task a request names by taskId: one the caller may see (its session's, in the handshake era);
        once its cell has ended, with its outcome (never working after the end)."""
        task_id = params.get("taskId")
        if not isinstance(task_id, str):
            raise McpError(INVALID_PARAMS, "Invalid params: taskId must be a string")
        task = self.board.get(task_id, owner)
        if task is None:
            words = explain_unknown_id("task", task_id, self.board.instance)
            raise McpError(INVALID_PARAMS, f"Failed to retrieve task: Task not found (or expired): {words}")
        if task.follower is not None and task.execution is not None and task.execution.done:
            await asyncio.wait({task.follower})  # rendering the ended cell's result: a moment
        self.board.refresh(task)
        return task

    # -- the stateless era (2026-07-28)

    async def request_stateless(self, request: McpRequest) -> dict:
        """tasks/get, tasks/update or tasks/cancel of the 2026-07-28 extension."""
        if not declares_tasks(request.meta):
            raise missing_tasks_extension()
        task = await self.find(request.params, None)
        if request.method == "tasks/get":
            return describe_task(task)
        if request.method == "tasks/cancel":
            self.board.cancel(task, now=False)  # cooperative: the interrupt path
            return {}
        await self.update(task, request.params.get("inputResponses"))
        return {}

    @staticmethod
    async def update(task: Task, responses: Any) -> None:
        """tasks/update: the answer to the input() the task's cell waits in (keys not outstanding are
        ignored)."""
        if not isinstance(responses, dict):
            raise McpError(INVALID_PARAMS, "Invalid params: inputResponses must be an object")
        question = task.question()
        if question is not None and question.key in responses:
            response = responses[question.key]
            if not is_elicitation_result(response):
                raise McpError(INVALID_PARAMS, f"Invalid params: inputResponses[{question.key!r}] must be an "
                               "elicitation result (action accept, decline or cancel)")
            await task.resource.answer(question, read_elicited_text(response))

    async def listen(self, request: McpRequest, resources: ResourceRequests,
                     watch_tools: Callable[[Callable[[], None]], contextlib.AbstractContextManager]) -> dict:
        """subscriptions/listen: the acknowledgement (the task ids, resource URIs and tool list changes it
        will report; nothing else is published), then notifications/tasks with the full task at each change
        of those tasks, notifications/resources/updated as those resources change (``resources`` follows
        them) and notifications/tools/list_changed as the session's tool list does (``watch_tools``), until
        the client leaves (its stream closes, or it cancels the request) or the server stops (then the
        graceful result)."""
        wanted = request.params.get("notifications")
        if not isinstance(wanted, dict):
            raise McpError(INVALID_PARAMS, "Invalid params: subscriptions/listen needs notifications, an "
                           "object")
        honoured, tasks = {}, []
        task_ids = wanted.get("taskIds")
        if task_ids is not None:
            if not declares_tasks(request.meta):
                raise missing_tasks_extension()
            if not isinstance(task_ids, list) or not all(isinstance(task_id, str) for task_id in task_ids):
                raise McpError(INVALID_PARAMS, "Invalid params: notifications.taskIds must be an array of "
                               "task ids")
            tasks = [task for task_id in dict.fromkeys(task_ids) if (task := self.board.get(task_id, None))]
            honoured["taskIds"] = [task.id for task in tasks]
        uris = resources.pick(wanted.get("resourceSubscriptions"))
        if uris is not None:
            honoured["resourceSubscriptions"] = uris
        if wanted.get("toolsListChanged") is True:
            honoured["toolsListChanged"] = True
        subscription = {META_SUBSCRIPTION: request.id}
        with (self.board.subscribe(tasks) as queue, resources.watching(uris or [], queue.put_nowait),
              watch_tools(partial(queue.put_nowait, TOOLS_CHANGED)) if "toolsListChanged" in honoured
              else contextlib.nullcontext()):
            await request.notify({"jsonrpc": "2.0", "method": "notifications/subscriptions/acknowledged",
                          "params": {"notifications": honoured, "_meta": subscription}})
            for task in tasks:
                if task.status != TASK_WORKING:
                    queue.put_nowait(task)  # what it already is: its question, or its end
            if self.board.closed:
                queue.put_nowait(None)
            while (item := await queue.get()) is not None:
                await request.notify(make_listen_notification(item, subscription))
        return {"_meta": subscription}

    # -- the handshake era (2025-11-25)

    def offer(self, tool: str, spec: Any) -> TaskOffer:
        """What a tools/call's params.task asks for: a task at once, kept for its ttl (held to our bounds)."""
        ttl = spec.get("ttl") if isinstance(spec, dict) else None
        number = isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and 0 <= ttl < math.inf
        if not isinstance(spec, dict) or ttl is not None and not number:
            raise McpError(INVALID_PARAMS, "Invalid params: task must be an object with an optional ttl (a "
                           "number of milliseconds, at least 0)")
        if tool not in TOOLS or not TOOLS[tool].task_support:
            raise McpError(METHOD_NOT_FOUND, f"Method not found: {tool} does not run as a task (taskSupport "
                           "is forbidden; run_cell and wait do)")
        keep = TASK_KEEP_MS if ttl is None else int(min(max(ttl, MIN_TASK_KEEP_MS), MAX_TASK_KEEP_MS))
        return TaskOffer(self.board, self.binding, immediate=True, keep_ms=keep,
                         elicits=self.elicitations.enabled)

    def created(self, outcome: dict | Task, offer: TaskOffer) -> dict:
        """The CreateTaskResult of a call made with the offer (a call refused before its cell runs is a
        failed task holding that result); the session hears of every status change of the task."""
        task = (outcome if isinstance(outcome, Task)
                else self.board.refused(self.binding, self.binding.resource, outcome, offer.keep_ms))
        self.board.watch(task, self.report)
        meta = {META_IMMEDIATE_RESPONSE: make_immediate_response(task)}
        return {"task": describe_task_fields(task, HANDSHAKE_ERA), "_meta": meta}

    def report(self, task: Task) -> None:
        """notifications/tasks/status for a task of this session, on its stream while one is open."""
        push = self.binding.push
        if push is not None:
            params = describe_task_fields(task, HANDSHAKE_ERA)
            message = {"jsonrpc": "2.0", "method": "notifications/tasks/status", "params": params}
            asyncio.ensure_future(push(message))

    async def request_handshake(self, request: McpRequest) -> dict:
        """tasks/get, tasks/result, tasks/list or tasks/cancel of a 2025-11-25 session: its own tasks only."""
        if request.method == "tasks/list":
            return self.list_page(request.params)
        task = await self.find(request.params, self.binding)
        if request.method == "tasks/get":
            return describe_task_fields(task, HANDSHAKE_ERA)
        if request.method == "tasks/cancel":
            if task.terminal:
                raise McpError(INVALID_PARAMS, "Cannot cancel task: already in terminal status "
                               f"'{task.status}'")
            self.board.cancel(task, now=True)
            return describe_task_fields(task, HANDSHAKE_ERA)
        return await self.result(task, request.notify)

    async def result(self, task: Task, notify: Notify) -> dict:
        """tasks/result: the call's result once the task ended, asking the person meanwhile what the cell's
        input() waits for."""
        changed = asyncio.Event()
        unwatch = self.board.watch(task, lambda _: changed.set())
        try:
            while not task.terminal:
                changed.clear()
                question = task.question()
                if question is not None and self.elicitations.enabled:
                    self.elicitations.ask(question, notify, related=task)
                await wait_for_any(None, changed, task.resource.news)
        finally:
            unwatch()
        if task.follower is not None:
            await asyncio.wait({task.follower})  # a cancelled task's result comes when its cell has ended
        if task.result is None:
            raise McpError(INTERNAL_ERROR, f"Internal error: {task.reason}")
        meta = {**task.result.get("_meta", {}), META_RELATED_TASK: {"taskId": task.id}}
        return {**task.result, "_meta": meta}

    def list_page(self, params: dict) -> dict:
        """This session's tasks, newest first, a page at a time (a cursor: the next page's first task id)."""
        tasks = self.board.of(self.binding)
        cursor, start = params.get("cursor"), 0
        if cursor is not None:
            start = next((i for i, task in enumerate(tasks) if task.id == cursor), -1)
            if start < 0:
                raise McpError(INVALID_PARAMS, "Invalid params: unknown cursor")
        page = tasks[start : start + TASKS_PAGE]
        result: dict = {"tasks": [describe_task_fields(task, HANDSHAKE_ERA) for task in page]}
        if start + TASKS_PAGE < len(tasks):
            result["nextCursor"] = tasks[start + TASKS_PAGE].id
        return result


class ResourceRequests:
    """A session's MCP resources, in both eras: the recent executions of its own kernel and the loommux skill
    (resources/list), the loommux:// URI templates, reads of streams, images and SKILL.md, skills/list and
    skills/get; the subscriptions of a handshake session (resources/subscribe: notifications on its stream)
    and those of a 2026-07-28 listen (``watching``). 2026-07-28 results carry their caching fields."""

    def __init__(self, binding: SessionBinding) -> None:
        self.binding = binding
        self.followers: dict[str, asyncio.Task] = {}  # a handshake session's subscriptions, by URI

    async def serve(self, request: McpRequest, era: Era) -> dict:
        """One of RESOURCE_METHODS (or, in the handshake era, SUBSCRIBE_METHODS)."""
        handler = {"resources/list": self.list_recent, "resources/templates/list": self.list_templates,
                   "resources/read": self.read, "skills/list": self.list_skills, "skills/get": self.get_skill,
                   "resources/subscribe": self.subscribe, "resources/unsubscribe": self.unsubscribe,
                   }[request.method]
        result, ttl, scope = await handler(request.params, era)
        return {**result, "ttlMs": ttl, "cacheScope": scope} if era.caches else result

    @staticmethod
    def check_no_cursor(params: dict) -> None:
        if params.get("cursor") is not None:
            raise McpError(INVALID_PARAMS, "Invalid params: unknown cursor (the list has one page)")

    @staticmethod
    def read_uri(params: dict) -> str:
        uri = params.get("uri")
        if not isinstance(uri, str):
            raise McpError(INVALID_PARAMS, "Invalid params: uri must be a string")
        return uri

    def find(self, uri: str, era: Era) -> tuple[ExecutionUri, Execution]:
        """What a loommux:// URI says and the execution it names; a JSON-RPC error for a URI that names
        nothing (-32002 in the handshake era, -32602 in 2026-07-28) or asks with a bad query."""
        try:
            parsed = parse_execution_uri(uri)
            execution = find_uri_execution(self.binding, parsed)
        except UnknownUri as exc:
            raise McpError(era.unknown_resource, f"Resource not found: {exc}",
                           {"uri": clip(uri, QUOTED_URI_CHARS)}) from None
        except ValueError as exc:
            raise McpError(INVALID_PARAMS, f"Invalid params: {exc}") from None
        return parsed, execution

    async def list_recent(self, params: dict, era: Era) -> tuple[dict, int, str]:
        self.check_no_cursor(params)
        resource = find_uri_kernel(self.binding, None)
        executions = resource.list_recent() if resource is not None else []
        resources = [SKILL_RESOURCE, *map(describe_execution_resource, executions)]
        return {"resources": resources}, RECENT_TTL_MS, "private"

    async def list_templates(self, params: dict, era: Era) -> tuple[dict, int, str]:
        self.check_no_cursor(params)
        return {"resourceTemplates": list(RESOURCE_TEMPLATES)}, TEMPLATES_TTL_MS, "public"

    async def read(self, params: dict, era: Era) -> tuple[dict, int, str]:
        uri = self.read_uri(params)
        if uri == SKILL_URI:
            content = {"uri": SKILL_URI, "mimeType": SKILL_MIME, "text": SKILL_TEXT}
            return {"contents": [content]}, TEMPLATES_TTL_MS, "public"
        if uri == VIEW_URI:
            return {"contents": [read_view_page()]}, TEMPLATES_TTL_MS, "public"
        parsed, execution = self.find(uri, era)
        try:
            content, ttl = await read_execution_part(execution, parsed)
        except ValueError as exc:
            raise McpError(INVALID_PARAMS, f"Invalid params: line range of {uri}: {exc}") from None
        return {"contents": [content]}, ttl, "private"

    async def list_skills(self, params: dict, era: Era) -> tuple[dict, int, str]:
        self.check_no_cursor(params)
        return {"skills": [SKILL_ENTRY]}, TEMPLATES_TTL_MS, "public"

    async def get_skill(self, params: dict, era: Era) -> tuple[dict, int, str]:
        uri = self.read_uri(params)
        if uri != SKILL_URI:
            raise McpError(INVALID_PARAMS, f"Invalid params: {uri!r} is not a skill of this server (its one "
                           f"skill is {SKILL_URI})")
        return {"skill": SKILL_ENTRY}, TEMPLATES_TTL_MS, "public"

    # -- subscriptions

    async def subscribe(self, params: dict, era: Era) -> tuple[dict, int, str]:
        """resources/subscribe: a running execution's stream is followed, each change pushed on the session's
        stream while one is open; any other resource of ours never changes (nothing to send)."""
        uri = self.read_uri(params)
        if uri not in FIXED_URIS:
            parsed, execution = self.find(uri, era)
            if uri not in self.followers and parsed.stream is not None and not execution.done:
                tell = partial(self.push_update, uri)
                self.followers[uri] = asyncio.ensure_future(follow_output(execution, parsed.stream, tell))
                self.followers[uri].add_done_callback(lambda done: self.forget(uri, done))
        return {}, 0, "private"

    async def unsubscribe(self, params: dict, era: Era) -> tuple[dict, int, str]:
        follower = self.followers.pop(self.read_uri(params), None)
        if follower is not None:
            follower.cancel()
        return {}, 0, "private"

    def forget(self, uri: str, follower: asyncio.Task) -> None:
        if self.followers.get(uri) is follower:
            del self.followers[uri]

    def push_update(self, uri: str) -> None:
        push = self.binding.push
        if push is not None:
            update = {"jsonrpc": "2.0", "method": "notifications/resources/updated", "params": {"uri": uri}}
            asyncio.ensure_future(push(update))

    def pick(self, uris: Any) -> list[str] | None:
        """The resourceSubscriptions of a 2026-07-28 listen that it honours: the URIs of resources that exist
        (None: it asks for none)."""
        if uris is None:
            return None
        if not isinstance(uris, list) or not all(isinstance(uri, str) for uri in uris):
            raise McpError(INVALID_PARAMS, "Invalid params: notifications.resourceSubscriptions must be an "
                           "array of URIs")
        honoured = []
        for uri in dict.fromkeys(uris):
            with contextlib.suppress(McpError):
                if uri not in FIXED_URIS:
                    self.find(uri, STATELESS_ERA)
                honoured.append(uri)
        return honoured

    @contextlib.contextmanager
    def watching(self, uris: list[str], tell: Callable[[str], None]) -> Iterator[None]:
        """While a listen streams: ``tell`` each URI of a running execution's stream as it changes."""
        followers = []
        for uri in (uri for uri in uris if uri not in FIXED_URIS):
            parsed, execution = self.find(uri, STATELESS_ERA)
            if parsed.stream is not None and not execution.done:
                follower = follow_output(execution, parsed.stream, partial(tell, uri))
                followers.append(asyncio.ensure_future(follower))
        try:
            yield
        finally:
            for follower in followers:
                follower.cancel()

    def close(self) -> None:
        for follower in list(self.followers.values()):
            follower.cancel()


class McpSession:
    """One MCP session, whatever its transport: the JSON-RPC envelope (batches, notifications, the client's
    responses, requests in flight), the negotiated version, and one method table per era: HANDSHAKE_METHODS
    for sessions that began with initialize, STATELESS_METHODS for 2026-07-28 requests, each carrying its
    version and capabilities. Tasks are its TaskRequests', MCP resources and the skill its ResourceRequests',
    what it asks the client its Elicitations'; what it works on (resource, lease, notices) is its
    binding's."""

    def __init__(self, settings: Settings, binding: SessionBinding, stateless: bool = False) -> None:
        self.settings = settings
        self.binding = binding
        self.stateless = stateless  # every request is a 2026-07-28 one (an HTTP request's header said so)
        self.protocol_version: str | None = None
        self.apps = False  # its client declared the MCP Apps extension at initialize (it renders views)
        self.inflight: dict[Any, asyncio.Task] = {}
        self.elicitations = Elicitations()
        self.task_requests = TaskRequests(binding, self.elicitations)
        self.resource_requests = ResourceRequests(binding)
        self.unwatch_tools: Callable[[], None] | None = None  # a handshake session hears of tool changes

    def find_publisher(self) -> Resource | None:
        """The kernel whose published tools this session lists: its own; for a 2026-07-28 HTTP request, the
        kernel its calls use without a kernel argument."""
        binding = self.binding
        if binding.default_kernel is not None:
            return binding.registry.resources.get(binding.default_kernel)
        return binding.resource

    @contextlib.contextmanager
    def watching_tools(self, tell: Callable[[], None]) -> Iterator[None]:
        """While it lasts: ``tell`` whenever the tools this session lists change."""
        unwatch = self.binding.registry.watch_tools(
            lambda resource: tell() if resource is self.find_publisher() else None)
        try:
            yield
        finally:
            unwatch()

    def watch_tools(self) -> None:
        """A handshake session: notifications/tools/list_changed on its stream (while one is open) whenever
        its tool list changes, until it closes."""
        if self.unwatch_tools is None:
            self.unwatch_tools = self.binding.registry.watch_tools(self.push_tools_changed)

    def push_tools_changed(self, resource: Resource) -> None:
        if resource is self.find_publisher() and self.binding.push is not None:
            asyncio.ensure_future(self.binding.push({"jsonrpc": "2.0", "method": TOOL_LIST_CHANGED}))

    @property
    def elicits(self) -> bool:
        """Its client declared form elicitation at initialize (Instance state keeps it with the version)."""
        return self.elicitations.enabled

    def resume(self, protocol_version: str, elicits: bool) -> None:
        """Serve again as its initialize left it, before a restart of the server (see "Instance state")."""
        self.protocol_version, self.elicitations.enabled = protocol_version, elicits
        self.watch_tools()

    async def handle(self, message: Any, notify: Notify) -> Any:
        """The response to a message or a batch, or None when nothing is sent back.

        ``notify`` sends messages related to the request ahead of its response: progress, a listen's
        notifications, and the elicitation requests of a call waiting on a cell's input().
        """
        if not isinstance(message, list):
            with self.binding.serving(tool_call=is_tool_call(message)):
                return await self.answer(message, notify)
        if self.protocol_version != BATCH_PROTOCOL_VERSION or not message:
            return make_jsonrpc_error(None, INVALID_REQUEST, "Invalid Request: batches are only allowed in "
                                 f"protocol {BATCH_PROTOCOL_VERSION}")
        with self.binding.serving(tool_call=any(map(is_tool_call, message))):
            answers = await asyncio.gather(*(self.answer(m, notify) for m in message), return_exceptions=True)
        responses = [a for a in answers if isinstance(a, dict)]
        return responses or None

    async def answer(self, message: Any, notify: Notify) -> dict | None:
        """The response to one message, or None for notifications and client responses."""
        if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
            request_id = message.get("id") if isinstance(message, dict) else None
            return make_jsonrpc_error(request_id if valid_request_id(request_id) else None, INVALID_REQUEST,
                                 'Invalid Request: expected a JSON-RPC 2.0 object with "jsonrpc": "2.0"')
        method, params = message.get("method"), message.get("params")
        if "method" not in message and ("result" in message or "error" in message):
            self.elicitations.receive(message)
            return None
        if "id" not in message:
            if isinstance(method, str):
                self.notify(method, params if isinstance(params, dict) else {})
                return None
            return make_jsonrpc_error(None, INVALID_REQUEST, "Invalid Request: no method")
        return refuse_request(message) or await self.serve(message, notify)

    async def serve(self, message: dict, notify: Notify) -> dict:
        """The response to a well-formed request, by its era's method table; a fault of ours is an internal
        error (-32603), never the session's end."""
        request = McpRequest(message["id"], message["method"], message.get("params") or {}, notify)
        self.inflight[request.id] = asyncio.current_task()
        try:
            if self.stateless or is_stateless(message):
                result = await self.call_stateless(request)
            else:
                result = await self.call_handshake(request)
        except McpError as exc:
            return make_jsonrpc_error(request.id, exc.code, exc.message, exc.data)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - a server fault must not end the session
            log(f"internal error in {request.method}:\n{''.join(traceback.format_exception(exc))}")
            return make_jsonrpc_error(request.id, INTERNAL_ERROR,
                                      f"Internal error: {type(exc).__name__}: {exc}")
        finally:
            self.inflight.pop(request.id, None)
        return {"jsonrpc": "2.0", "id": request.id, "result": result}

    def notify(self, method: str, params: dict) -> None:
        if method == "notifications/cancelled" and valid_request_id(params.get("requestId")):
            task = self.inflight.get(params["requestId"])
            if task is not None:
                task.cancel()  # ends only the waiting; the cell keeps running

    async def call_handshake(self, request: McpRequest) -> dict:
        """A request of the handshake era (2024-11-05 to 2025-11-25); the task methods only once 2025-11-25
        is negotiated."""
        handler = self.HANDSHAKE_METHODS.get(request.method)
        if handler is None or request.method in HANDSHAKE_TASK_METHODS and not self.has_tasks:
            raise McpError(METHOD_NOT_FOUND, f"Method not found: {clip(request.method, QUOTED_ID_CHARS)}")
        return await handler(self, request)

    async def call_stateless(self, request: McpRequest) -> dict:
        """A stateless 2026-07-28 request: its envelope checked (then the transport's headers, then its
        version), its result stamped with resultType and the server's identity."""
        meta = read_stateless_envelope(request.params)
        self.binding.check_headers(request.method, request.params)
        check_stateless_version(meta)
        handler = self.STATELESS_METHODS.get(request.method)
        if handler is None:
            raise McpError(METHOD_NOT_FOUND,
                           f"Method not found: {clip(request.method, QUOTED_ID_CHARS)} (at protocol "
                           f"{STATELESS_VERSION})")
        return stamped(await handler(self, request))

    @property
    def has_tasks(self) -> bool:
        """A handshake session that negotiated 2025-11-25 (or later) has its experimental tasks."""
        return self.protocol_version is not None and self.protocol_version >= TASKS_VERSION

    def list_tools(self, params: dict, tasks: bool = False, apps: bool = False) -> dict:
        """The tools, for a host that renders views (``apps``) the app-only ones with their view meta, then
        those the session's kernel publishes."""
        if params.get("cursor") is not None:
            raise McpError(INVALID_PARAMS, "Invalid params: unknown cursor (the tool list has one page)")
        tools = [*TOOLS.values(), *(APP_TOOLS.values() if apps else ())]
        published = find_published(self.find_publisher()).values()
        return {"tools": [*(tool.describe(self.settings.result_mode, tasks, apps) for tool in tools),
                          *map(describe_published, published)]}

    @staticmethod
    def read_tool_name(params: dict, apps: bool) -> str:
        """The called tool's name: loommux's (an app-only one only for a host that renders views), or one a
        kernel may publish (which the call's kernel then says)."""
        name = params.get("name")
        if not isinstance(name, str):
            raise McpError(INVALID_PARAMS, "Invalid params: tools/call needs a tool name")
        if name in APP_TOOLS and not apps or not TOOL_NAME_RE.fullmatch(name):
            raise McpError(INVALID_PARAMS, f"Unknown tool: {clip(name, SHOWN_CHARS)} (tools: "
                           f"{', '.join(TOOLS)})")
        return name

    async def call_tool(self, params: dict, notify: Notify, client: str | None, apps: bool,
                        offer: TaskOffer | None = None,
                        ask: Callable[[Question], None] | None = None) -> dict | Task:
        name = self.read_tool_name(params, apps)
        token = read_progress_token({"params": params})
        ctx = ToolContext(self.settings, self.binding.resource, self.binding.registry.started, self.binding,
                          client=client,
                          progress=None if token is None else make_progress_reporter(token, notify),
                          task=offer, ask=ask, stdin=ask is not None or (offer is not None and offer.elicits),
                          links=self.protocol_version is None or self.protocol_version >= LINKS_VERSION)
        try:
            return await call_tool(ctx, name, params.get("arguments"))
        except UnknownTool as exc:
            raise McpError(INVALID_PARAMS, f"Unknown tool: {name} (tools: {', '.join(TOOLS)}; published by "
                           f"its kernel: {exc.args[1] or 'none'})") from None

    def close(self) -> None:
        if self.unwatch_tools is not None:
            self.unwatch_tools()
        for task in list(self.inflight.values()):
            task.cancel()
        self.elicitations.close()
        self.resource_requests.close()

    # -- the handshake era's methods

    async def initialize(self, request: McpRequest) -> dict:
        failure = await self.binding.ready()
        if failure is not None:  # never a half-working server
            raise McpError(INTERNAL_ERROR, f"Internal error: the IPython kernel could not start: {failure}")
        requested = request.params.get("protocolVersion")
        self.protocol_version = requested if requested in PROTOCOL_VERSIONS else PROTOCOL_VERSIONS[0]
        self.binding.client = read_client_name(request.params.get("clientInfo"))
        self.elicitations.enabled = elicits_forms(request.params.get("capabilities"))
        self.apps = declares_apps(request.params.get("capabilities"))
        self.watch_tools()
        return {
            "protocolVersion": self.protocol_version,
            "capabilities": {**CAPABILITIES, "tasks": HANDSHAKE_TASKS} if self.has_tasks else CAPABILITIES,
            "serverInfo": SERVER_INFO,
            "instructions": SERVER_INSTRUCTIONS,
        }

    async def ping(self, request: McpRequest) -> dict:
        return {}

    async def list_handshake_tools(self, request: McpRequest) -> dict:
        return self.list_tools(request.params, tasks=self.has_tasks, apps=self.apps)

    async def call_handshake_tool(self, request: McpRequest) -> dict:
        """tools/call: its result with the binding's notices, or (2025-11-25, params.task) a task at once,
        whose result comes later from tasks/result."""
        params, notify, ask = request.params, request.notify, self.elicitations.asker(request.notify)
        if self.has_tasks and "task" in params:
            offer = self.task_requests.offer(self.read_tool_name(params, self.apps), params["task"])
            outcome = await self.call_tool(params, notify, self.binding.client, self.apps, offer, ask)
            return self.task_requests.created(outcome, offer)
        result = await self.call_tool(params, notify, self.binding.client, self.apps, ask=ask)
        add_notices(result, self.binding.take_notices())
        return result

    async def request_handshake_task(self, request: McpRequest) -> dict:
        return await self.task_requests.request_handshake(request)

    async def request_handshake_resources(self, request: McpRequest) -> dict:
        return await self.resource_requests.serve(request, HANDSHAKE_ERA)

    HANDSHAKE_METHODS = types.MappingProxyType({
        "initialize": initialize, "ping": ping, "tools/list": list_handshake_tools,
        "tools/call": call_handshake_tool, **dict.fromkeys(HANDSHAKE_TASK_METHODS, request_handshake_task),
        **dict.fromkeys((*RESOURCE_METHODS, *SUBSCRIBE_METHODS), request_handshake_resources),
    })

    # -- the stateless era's methods

    async def discover(self, request: McpRequest) -> dict:
        return {"supportedVersions": list(SERVED_VERSIONS), "capabilities": STATELESS_CAPABILITIES,
                "instructions": SERVER_INSTRUCTIONS, "ttlMs": TOOLS_TTL_MS, "cacheScope": "public"}

    async def list_stateless_tools(self, request: McpRequest) -> dict:
        listed = self.list_tools(request.params, apps=declares_apps(request.meta[META_CAPABILITIES]))
        return {**listed, "ttlMs": TOOL_LIST_TTL_MS, "cacheScope": "public"}

    async def call_stateless_tool(self, request: McpRequest) -> dict:
        """tools/call: its result, or a CreateTaskResult when its client declared tasks on this request and
        the cell outlived the call's wait."""
        offer = TaskOffer(self.binding.registry.tasks) if declares_tasks(request.meta) else None
        client = read_client_name(request.meta.get(META_CLIENT))
        apps = declares_apps(request.meta[META_CAPABILITIES])
        result = await self.call_tool(request.params, request.notify, client, apps, offer)
        if isinstance(result, Task):
            return {**describe_task_fields(result, STATELESS_ERA), "resultType": "task"}
        return result

    async def request_stateless_task(self, request: McpRequest) -> dict:
        return await self.task_requests.request_stateless(request)

    async def listen(self, request: McpRequest) -> dict:
        return await self.task_requests.listen(request, self.resource_requests, self.watching_tools)

    async def request_stateless_resources(self, request: McpRequest) -> dict:
        return await self.resource_requests.serve(request, STATELESS_ERA)

    STATELESS_METHODS = types.MappingProxyType({
        "server/discover": discover, "tools/list": list_stateless_tools, "tools/call": call_stateless_tool,
        **dict.fromkeys(STATELESS_TASK_METHODS, request_stateless_task), "subscriptions/listen": listen,
        **dict.fromkeys(RESOURCE_METHODS, request_stateless_resources),
    })


def make_progress_reporter(token: Any, notify: Notify) -> Callable[[float, str], Awaitable[None]]:
    async def report(progress: float, message: str) -> None:
        await notify({"jsonrpc": "2.0", "method": "notifications/progress",
                      "params": {"progressToken": token, "progress": progress, "message": message}})

    return report


# ---------------------------------------------------------------- MCP over stdio

MAX_LINE_BYTES = 512 << 20
READ_CHUNK = 1 << 20
STDIO_ENDPOINT = "stdio"  # the label of the stdio session and its registry
EOF_GRACE = 10.0  # at stdin EOF, requests in flight (initialize too) are answered if they finish within this


class LineReader(asyncio.Protocol):
    """Splits a byte stream into lines of any length up to MAX_LINE_BYTES."""

    def __init__(self, on_line: Callable[[bytes | None], None], on_eof: Callable[[], None]) -> None:
        self.on_line, self.on_eof = on_line, on_eof
        self.buffer = bytearray()
        self.scanned = 0
        self.discarding = False

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            newline = self.buffer.find(b"\n", self.scanned)
            if newline < 0:
                self.scanned = len(self.buffer)
                if self.scanned > MAX_LINE_BYTES:
                    self.buffer.clear()
                    self.scanned = 0
                    if not self.discarding:
                        self.discarding = True
                        self.on_line(None)
                return
            line = bytes(self.buffer[:newline])
            del self.buffer[: newline + 1]
            self.scanned = 0
            if self.discarding:
                self.discarding = False
            else:
                self.on_line(line)

    def eof_received(self) -> None:
        self.on_eof()

    def connection_lost(self, exc: Exception | None) -> None:
        self.on_eof()


class StdioConnection:
    """MCP over stdio: newline-delimited JSON-RPC, every request served concurrently."""

    def __init__(self, session: McpSession, write: Callable[[bytes], None]) -> None:
        self.session = session
        self.write = write
        self.pending: set[asyncio.Task] = set()  # requests read and not yet answered
        session.binding.push = self.send  # the pipe is the session's stream: its task status notifications

    async def send(self, message: Any) -> None:
        if message is not None:
            self.write(await encode_message_async(message) + b"\n")

    def feed_line(self, line: bytes | None) -> None:
        """Take one line from stdin (None: a line too long to read)."""
        if line is None:
            asyncio.ensure_future(self.send(make_jsonrpc_error(None, PARSE_ERROR,
                                                          "Parse error: message too large")))
        elif line.strip():
            try:
                message = parse_json(line)
            except ValueError as exc:
                asyncio.ensure_future(self.send(make_jsonrpc_error(None, PARSE_ERROR, f"Parse error: {exc}")))
                return
            task = asyncio.ensure_future(self.respond(message))
            self.pending.add(task)
            task.add_done_callback(self.pending.discard)

    async def answer_pending(self, grace: float, interrupted: asyncio.Event) -> None:
        """After EOF: let the requests in flight finish and be answered, within grace or until interrupted."""
        if not self.pending:
            return
        answered = asyncio.gather(*self.pending)
        signal_task = asyncio.ensure_future(interrupted.wait())
        await asyncio.wait({answered, signal_task}, timeout=grace, return_when=asyncio.FIRST_COMPLETED)
        signal_task.cancel()

    async def respond(self, message: Any) -> None:
        try:
            response = await self.session.handle(message, self.send)
        except asyncio.CancelledError:
            return  # cancelled by the client: it expects no response
        await self.send(response)


async def open_stdin(reader: LineReader) -> None:
    """Feed stdin to the reader: as an asyncio pipe, or from a thread when stdin is a plain file."""
    loop = asyncio.get_running_loop()
    stdin = os.fdopen(os.dup(0), "rb", buffering=0)
    try:
        await loop.connect_read_pipe(lambda: reader, stdin)
    except ValueError:

        def pump() -> None:
            while data := stdin.read(READ_CHUNK):
                loop.call_soon_threadsafe(reader.data_received, data)
            loop.call_soon_threadsafe(reader.on_eof)

        threading.Thread(target=pump, name="loommux-stdin", daemon=True).start()


async def open_protocol_stdout() -> Callable[[bytes], None]:
    """Keep the real stdout for protocol messages only; everything else that writes to fd 1 goes to stderr."""
    protocol_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    pipe = os.fdopen(protocol_fd, "wb", buffering=0)
    try:
        transport, _ = await asyncio.get_running_loop().connect_write_pipe(asyncio.Protocol, pipe)
    except ValueError:  # a plain file never blocks

        def write_file(data: bytes) -> None:
            pipe.write(data)

        return write_file

    def write_pipe(data: bytes) -> None:
        if not transport.is_closing():
            transport.write(data)  # buffered by asyncio; never blocks the loop

    return write_pipe


async def wait_for_first(*events: asyncio.Event) -> None:
    """Return once any of the events is set."""
    waiters = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


def stop_on_signals(stopping: asyncio.Event, at_once: Callable[[], None] = lambda: None) -> None:
    """SIGTERM and SIGINT set ``stopping``, and run ``at_once`` in the handler itself."""

    def stop() -> None:
        stopping.set()
        at_once()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)


async def serve_stdio(settings: Settings) -> int:
    """Serve one MCP client on stdin/stdout, until EOF, SIGTERM or SIGINT: the session's own kernel, started
    at initialize or at the first tool call (a process that is only probed starts none), and the kernels
    that calls name with their kernel argument."""
    signaled, at_eof = asyncio.Event(), asyncio.Event()
    stop_on_signals(signaled, kill_live_kernels)  # a signal is a hurry: the kernels are killed, not shut down
    write = await open_protocol_stdout()
    async with (make_notebook_mirrors(settings) as notebooks,
                make_kernel_registry(settings, STDIO_ENDPOINT) as registry):
        # The pipe is the session's connection: its lease holds while the process runs.
        binding = SessionBinding(registry, STDIO_ENDPOINT, policy=replace(registry.policy, mode="connection"),
                                 start=PrivateKernelStart(settings.existing.get(None), eager=True))
        notebooks.watch(registry, binding)
        binding.stream_opened()
        session = McpSession(settings, binding)
        connection = StdioConnection(session, write)
        await open_stdin(LineReader(connection.feed_line, at_eof.set))
        await wait_for_first(signaled, at_eof, binding.start.failed)
        await registry.tasks.close()  # live tasks fail; listen requests get their graceful result
        if not signaled.is_set():
            await connection.answer_pending(EOF_GRACE, signaled)
        session.close()
    return 1 if binding.start.failed.is_set() else 0


# ---------------------------------------------------------------- Plain HTTP/1.1

HEADER_TIMEOUT = 10.0  # a client must send its request head within this (from connecting, or its first byte)
BODY_TIMEOUT = 30.0  # and its body within this
KEEPALIVE_TIMEOUT = 30.0  # an idle keep-alive connection is closed after this
LINGER_SECONDS = 1.0  # after refusing a request whose body was not read, how long its bytes are drained
LINGER_BYTES = 1 << 20  # and how many, so that the refusal reaches the client before the connection closes
BODY_BUDGET_FACTOR = 4  # all bodies being received at once take at most this many body limits
SSE_PING_INTERVAL = 15.0
MAX_HEADER_BYTES = 64 << 10
MAX_LENGTH_DIGITS = 18  # a Content-Length this long is over any body limit
CHUNK_SIZE_RE = re.compile(rb"[0-9A-Fa-f]{1,16}")
# host[:port], nothing else
AUTHORITY_RE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._~-]+)(?::[0-9]{1,5})?")
ORIGIN_RE = re.compile(r"(?:[Hh][Tt][Tt][Pp][Ss]?)://(" + AUTHORITY_RE.pattern + ")")
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class HttpError(Exception):
    """A refusal: its status, its words and the headers it needs (Allow, Retry-After); the server that
    answers it says what its body is (``HttpServer.error_body``)."""

    def __init__(self, status: int, message: str, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


@dataclass
class Request:
    method: str
    path: str
    query: str
    version: str
    headers: dict[str, str]
    body: bytes = b""

    @property
    def keep_alive(self) -> bool:
        connection = self.headers.get("connection", "").lower()
        return "close" not in connection if self.version == "HTTP/1.1" else "keep-alive" in connection

    @property
    def params(self) -> dict[str, str]:
        """The query string's parameters (the last value of each)."""
        return dict(urllib.parse.parse_qsl(self.query, keep_blank_values=True))

    def accepts(self, *media_types: str) -> bool:
        accept = self.headers.get("accept", "")
        return all(kind in accept for kind in media_types) or "*/*" in accept


async def read_head(reader: asyncio.StreamReader, fresh: bool) -> Request | None:
    """Read one request head (the body is read once the head passed the checks); None when the client closed
    the connection, or left it idle: a fresh connection for HEADER_TIMEOUT, a keep-alive one for
    KEEPALIVE_TIMEOUT. A head begun must be complete within HEADER_TIMEOUT of its first byte or of
    connecting."""
    started = time.monotonic()
    try:
        first = await asyncio.wait_for(reader.read(1), HEADER_TIMEOUT if fresh else KEEPALIVE_TIMEOUT)
    except asyncio.TimeoutError:
        return None
    if not first:
        return None
    left = HEADER_TIMEOUT - (time.monotonic() - started) if fresh else HEADER_TIMEOUT
    rest = await read_within(reader.readuntil(b"\r\n\r\n"), max(left, 0.0), "request head",
                             HttpError(431, "Request Header Fields Too Large"))
    if rest is None:
        return None
    lines = (first + rest).decode("latin-1").lstrip("\r\n").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[1] or parts[2] not in ("HTTP/1.1", "HTTP/1.0") or not parts[0].isalpha():
        raise HttpError(400, "Bad Request: malformed request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip() or line[0] in " \t":
            raise HttpError(400, "Bad Request: malformed header line")
        name, value = name.lower(), value.strip()
        if name == "host" and name in headers:
            raise HttpError(400, "Bad Request: more than one Host header")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    path, _, query = parts[1].partition("?")
    return Request(parts[0], path, query, parts[2], headers)


async def read_within(step: Awaitable[bytes], timeout: float, what: str, too_long: HttpError) -> bytes | None:
    """One part of a request, read in time; None when the client closed the connection."""
    try:
        return await asyncio.wait_for(step, timeout)
    except asyncio.TimeoutError:
        raise HttpError(408, f"Request Timeout: the {what} was not sent in time") from None
    except asyncio.LimitOverrunError:
        raise too_long from None
    except asyncio.IncompleteReadError:
        return None


class BodyBudget:
    """The bytes that all request bodies being received may take together; a body past it gets 503."""

    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    def take(self, size: int) -> None:
        if self.used + size > self.limit:
            raise HttpError(503, "Service Unavailable: too many request bodies are being received at once; "
                            "retry shortly", {"Retry-After": "1"})
        self.used += size

    def give_back(self, size: int) -> None:
        self.used -= size


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str], max_body: int, budget: BodyBudget,
                    ready: Callable[[], None]) -> bytes:
    """Read a request's body within the body limit and the budget; ``ready`` is called before its first byte
    is awaited (to answer Expect: 100-continue)."""
    too_large = HttpError(413, f"Content Too Large: the body limit is {format_size(max_body)}")
    taken = 0
    try:
        if "transfer-encoding" in headers:
            if headers["transfer-encoding"].lower() != "chunked" or "content-length" in headers:
                raise HttpError(400, "Bad Request: only chunked transfer encoding, without Content-Length")
            ready()
            body = bytearray()
            while True:
                size_line = (await reader.readuntil(b"\r\n")).split(b";")[0].strip()
                if not CHUNK_SIZE_RE.fullmatch(size_line):
                    raise HttpError(400, "Bad Request: malformed chunk size")
                size = int(size_line, 16)
                if size == 0:
                    while (await reader.readuntil(b"\r\n")) != b"\r\n":
                        pass  # trailers are ignored
                    return bytes(body)
                if len(body) + size > max_body:
                    raise too_large
                budget.take(size)
                taken += size
                body += await reader.readexactly(size)
                if await reader.readexactly(2) != b"\r\n":
                    raise HttpError(400, "Bad Request: malformed chunk")
        length = headers.get("content-length", "0")
        if not (length.isascii() and length.isdigit()):
            raise HttpError(400, "Bad Request: malformed Content-Length")
        if len(length) > MAX_LENGTH_DIGITS or int(length) > max_body:
            raise too_large
        if int(length) == 0:
            return b""
        budget.take(int(length))
        taken = int(length)
        ready()
        return await reader.readexactly(int(length))
    finally:
        budget.give_back(taken)


def parse_authority_host(authority: str) -> str | None:
    """The lower-case host of "host[:port]" (an IPv6 address without its brackets); None when malformed."""
    match = AUTHORITY_RE.fullmatch(authority)
    return match[1].strip("[]").lower() if match else None


def parse_origin_host(origin: str) -> str | None:
    """The lower-case host of an Origin, which must be exactly http(s)://host[:port]; None otherwise."""
    match = ORIGIN_RE.fullmatch(origin)
    return parse_authority_host(match[1]) if match else None


def encode_response_head(status: int, headers: dict[str, str]) -> bytes:
    lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def encode_chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def encode_event(data: bytes) -> bytes:
    """One server-sent event of the default type, carrying one line of data."""
    return b"event: message\r\ndata: " + data + b"\r\n\r\n"


class EventStream:
    """A ``text/event-stream`` response on a chunked HTTP/1.1 connection: its head is sent with the first
    event (or by ``begin``), and comment pings keep it open across proxies while the work it reports runs.
    Each event carries one line of data, already encoded."""

    def __init__(self, writer: asyncio.StreamWriter, headers: dict[str, str] | None = None) -> None:
        self.writer, self.headers, self.begun = writer, headers or {}, False
        self.ended = False  # what is sent after the end (a late elicitation's cancellation) is dropped

    def begin(self) -> None:
        if not self.begun:
            self.begun = True
            self.writer.write(encode_response_head(200, {**self.headers, "Content-Type": "text/event-stream",
                                                  "Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                                  "Transfer-Encoding": "chunked"}))

    async def send(self, data: bytes) -> None:
        """One event; a client that left loses it, and nothing else."""
        self.begin()
        await self.write(encode_event(data))

    async def ping(self) -> None:
        await self.write(b": ping\r\n\r\n")

    async def write(self, data: bytes) -> None:
        if not self.writer.is_closing() and not self.ended:
            self.writer.write(encode_chunk(data))
            with contextlib.suppress(ConnectionError):
                await self.writer.drain()

    async def ping_until(self, work: asyncio.Future, reader: asyncio.StreamReader | None = None) -> bool:
        """Wait for ``work``, pinging every SSE_PING_INTERVAL once the stream has begun; False when the client
        closed its side first (watched on ``reader``, when given)."""
        closed = asyncio.ensure_future(reader.read(1)) if reader is not None else None
        try:
            while not work.done():
                await asyncio.wait({work, *filter(None, [closed])}, timeout=SSE_PING_INTERVAL,
                                   return_when=asyncio.FIRST_COMPLETED)
                if closed is not None and closed.done() and not work.done():
                    return False
                if self.begun and not work.done():
                    await self.ping()
            return True
        finally:
            if closed is not None:
                closed.cancel()

    async def end(self, last: bytes | None = None) -> None:
        """The last event, if any, and the end of the response."""
        self.ended = True
        self.writer.write((encode_chunk(encode_event(last)) if last is not None else b"") + encode_chunk(b""))
        await self.writer.drain()


class HttpServer:
    """HTTP/1.1 on asyncio streams: connections up to a cap, keep-alive, request heads and bodies read within
    their limits and times, responses with a length, and errors that end a connection cleanly.

    It knows nothing of what it serves. A subclass checks each head before its body is read (``check``,
    whose findings, opaque here, are handed on), answers each request (``respond``, which returns whether
    the connection stays open) and says what an error's JSON body is (``error_body``).
    """

    def __init__(self, host: str, port: int, max_connections: int, max_body: int) -> None:
        self.host, self.port = host, port
        self.max_connections = max_connections
        self.max_body = max_body
        # -> since when it waits for a request
        self.connections: dict[asyncio.StreamWriter, float | None] = {}
        self.bodies = BodyBudget(BODY_BUDGET_FACTOR * max_body)

    async def listen(self) -> asyncio.Server:
        server = await asyncio.start_server(self.serve_connection, self.host, self.port,
                                            limit=MAX_HEADER_BYTES)
        self.port = server.sockets[0].getsockname()[1]
        return server

    def check(self, request: Request) -> Any:
        """Raise HttpError to refuse a request on its head alone; what it returns is handed to ``respond``."""

    async def respond(self, request: Request, checked: Any, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> bool:
        raise NotImplementedError

    def error_body(self, error: HttpError, request: Request | None) -> bytes:
        """The JSON body of an error response (``request`` is None when its head could not be read)."""
        raise NotImplementedError

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self.connections) >= self.max_connections:
            self.close_idlest_connection()
        self.connections[writer] = time.monotonic()
        try:
            if len(self.connections) > self.max_connections:
                await self.refuse(reader, writer, HttpError(503, "Service Unavailable: too many connections"))
                return
            fresh = True
            while True:
                self.connections[writer] = time.monotonic()
                try:
                    request = await read_head(reader, fresh)
                except HttpError as exc:
                    await self.refuse(reader, writer, exc)
                    return
                if request is None:
                    return
                self.connections[writer], fresh = None, False
                if not await self.serve_request(request, reader, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away: only its response is lost
        except asyncio.CancelledError:
            pass  # the server is shutting down
        finally:
            self.connections.pop(writer, None)
            writer.close()

    async def serve_request(self, request: Request, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> bool:
        """Check, read and answer one request; whether the connection stays open."""
        try:
            checked = self.check(request)
            body = await self.receive_body(request, reader, writer)
        except HttpError as exc:
            await self.refuse(reader, writer, exc, request)
            return False
        if body is None:
            return False
        request.body = body
        try:
            return await self.respond(request, checked, reader, writer)
        except HttpError as exc:
            keep_alive = request.keep_alive and exc.status < 500
            await self.send_error(writer, exc, keep_alive, request)
            return keep_alive
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the server down
            log(f"internal error serving {request.method} {request.path}:\n"
                f"{''.join(traceback.format_exception(exc))}")
            await self.send_error(writer, HttpError(500, f"Internal Server Error: {exc}"), False, request)
            return False

    def close_idlest_connection(self) -> None:
        """At the connection cap, make room by closing the connection that has waited longest for a request
        (idle keep-alive, or connected and silent); connections serving a request are never closed."""
        waiting = [(since, writer) for writer, since in self.connections.items() if since is not None]
        if waiting:
            _, idlest = min(waiting, key=lambda pair: pair[0])
            del self.connections[idlest]
            idlest.close()  # its reader sees the end of the stream

    async def receive_body(self, request: Request, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> bytes | None:
        """Check Expect, then read the body; None when the client left."""
        expect = request.headers.get("expect")
        if expect is not None and expect.lower() != "100-continue":
            raise HttpError(417, "Expectation Failed: only Expect: 100-continue is understood")

        def ready() -> None:
            if expect is not None and request.version == "HTTP/1.1":
                writer.write(CONTINUE)

        return await read_within(read_body(reader, request.headers, self.max_body, self.bodies, ready),
                                 BODY_TIMEOUT, "body",
                                 HttpError(400, "Bad Request: a chunk-size or trailer line is too long"))

    async def refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, error: HttpError,
                     request: Request | None = None) -> None:
        """Answer with an error and end the connection; what the client still sends (a body that was not read)
        is drained for a moment first, so that closing does not reset the connection before the answer is
        read."""
        await self.send_error(writer, error, False, request)
        if writer.can_write_eof():
            writer.write_eof()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.drain_input(reader), LINGER_SECONDS)

    async def drain_input(self, reader: asyncio.StreamReader) -> None:
        drained = 0
        while drained < LINGER_BYTES and (data := await reader.read(1 << 16)):
            drained += len(data)

    async def send(self, writer: asyncio.StreamWriter, status: int, headers: dict[str, str], body: bytes,
                   keep_alive: bool) -> None:
        headers = {**headers, "Content-Length": str(len(body))}
        if not keep_alive:
            headers["Connection"] = "close"
        writer.write(encode_response_head(status, headers) + body)
        await writer.drain()

    async def send_json(self, writer: asyncio.StreamWriter, status: int, body: bytes, keep_alive: bool,
                        headers: dict[str, str] | None = None) -> None:
        """A JSON body, already encoded."""
        await self.send(writer, status, {"Content-Type": "application/json", **(headers or {})}, body,
                        keep_alive)

    async def send_error(self, writer: asyncio.StreamWriter, error: HttpError, keep_alive: bool,
                         request: Request | None) -> None:
        await self.send_json(writer, error.status, self.error_body(error, request), keep_alive, error.headers)

    def close(self) -> None:
        for writer in list(self.connections):
            writer.close()


# ---------------------------------------------------------------- Console & control API
# The endpoints beside MCP: what a handler takes (Call) and gives (Response), and the one shape of their
# errors, {"error_code", "message"}; the routes that lead to them are the next section's.

RECENT_API_EXECUTIONS = 20
MAX_RELAY_CHARS = 1 << 20  # text one relay reply carries at most; the rest follows in the next
RELAY_KEEP_SECONDS = 60.0  # a relay is dropped when unread this long, or this long after it ends
RUN_SPEC = {"type": "number", "minimum": 0, "maximum": MAX_WAIT_TIMEOUT}
API_LINE_CHARS = 120
TOKEN_COOKIE = "loommux_token"  # the console's copy of the token


class ApiError(HttpError):
    """An error of a non-MCP endpoint with its code, answered as JSON ``{error_code, message}``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(status, message)
        self.code = code

    @classmethod
    def of(cls, exc: ResourceError | ToolError) -> ApiError:
        """A domain or argument error with its code and that code's HTTP status (ERROR_CODES)."""
        return cls(status_of_error(exc.code), exc.code, exc.message)


def encode_api_error(error: HttpError) -> dict:
    """The endpoints' one error shape: an ApiError's code, else the code of a plain refusal's status."""
    code = error.code if isinstance(error, ApiError) else name_http_error(error.status)
    return {"error_code": code, "message": error.message}


@dataclass
class Response:
    status: int
    body: Any  # JSON-able, or bytes sent as they are
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Call:
    """What a route's handler works on; it knows nothing else of the HTTP server."""

    request: Request
    params: dict[str, str]  # the path's named parts, percent-decoded
    operator: bool  # the request carries the server's token (or none is needed)
    caller: Resource | None  # the kernel whose own credential the request carries
    settings: Settings
    registry: Registry
    sessions: int  # MCP sessions the server has
    relays: dict[Execution, Relay]  # the server's relays of forwarded cells, by execution


def read_process_rss(pid: int | None) -> int | None:
    """Resident memory of a process in bytes, from /proc (None where unavailable)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, TypeError):
        pass
    return None


def summarize_lease(lease: Lease, now: float) -> dict:
    expiry = lease.compute_expiry()
    return {
        "session": lease.session,
        "operator": lease.operator,
        "client": lease.client,
        "holder": lease.holder.id if lease.holder else None,
        "mode": ("holder" if lease.holder else STATELESS_LEASE_LABEL if lease.by_argument
                 else lease.policy.mode),
        "policy_generation": lease.policy.generation,
        "last_signal_age_seconds": round(now - lease.last_signal, 3),
        "expires_in_seconds": None if expiry is None else round(max(0.0, expiry - now), 3),
        "stream_open": lease.stream.open,
        "standing": lease.standing,
        "alert": lease.alert,
    }


def summarize_resource(resource: Resource, now: float) -> dict:
    kernel, running, tenancy = resource.kernel, resource.running, resource.tenancy
    pid = kernel.pid if kernel and kernel.alive else None
    last_output = running.output.tail(1) if running else []
    return {
        "id": resource.id,
        "name": resource.name,
        "kind": resource.kind,
        "kernel_pid": pid,
        **locate_kernel(resource),
        "kernel_state": resource.kernel_state,
        **describe_kernel_language(resource),
        **describe_kernel_join(resource),  # the operator's view only: /api is never an MCP client's
        "kernel_rss_bytes": read_process_rss(pid),
        "running_execution": running.number if running else None,
        "running_elapsed_seconds": round(running.elapsed, 3) if running else None,
        "running_first_line": clip(running.first_line, API_LINE_CHARS) if running else None,
        "running_last_output": clip(last_output[0], API_LINE_CHARS) if last_output else None,
        "input_prompt": clip(resource.question.prompt, API_LINE_CHARS) if resource.question else None,
        "orphan_execution": tenancy.orphan_execution
        if running and running.number == tenancy.orphan_execution else None,
        "executions": resource.last_number,
        "orphan": tenancy.orphan_since is not None,
        "orphan_seconds": None if tenancy.orphan_since is None else round(now - tenancy.orphan_since, 3),
        "leases": [summarize_lease(lease, now)
                   for lease in sorted(resource.leases, key=lambda lease: lease.created)],
        "notebook": resource.notebook.summarize() if resource.notebook else None,
    }


def summarize_kernel(resource: Resource, now: float) -> dict:
    """A resource as the kernel-facing control plane shows it (the ``loommux`` object's kernels)."""
    summary = summarize_resource(resource, now)
    return {"name": resource.kernel_name, "id": resource.id, "kind": resource.kind,
            "state": resource.kernel_state, "busy": resource.running is not None,
            "pid": summary["kernel_pid"], "executions": resource.last_number,
            "running_execution": summary["running_execution"], "leases": summary["leases"]}


def parse_json_body(request: Request, code: str = INVALID_BODY) -> dict:
    """A request's JSON object body ({} when empty); else an error with the given code."""
    try:
        body = parse_json(request.body) if request.body.strip() else {}
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise ApiError(400, code, "the body must be a JSON object")
    return body


def read_request_flag(request: Request, name: str) -> bool:
    """A boolean from the query string or a JSON body."""
    query = request.params
    if name in query:
        return query[name].lower() in ("1", "true", "yes")
    return parse_json_body(request).get(name) is True


def read_query_number(call: Call, name: str, spec: dict) -> float:
    """A number from the query string, checked like a tool argument of that spec."""
    raw = call.request.params.get(name, "0")
    try:
        value = float(raw)
    except ValueError:
        raise ApiError(400, INVALID_ARGUMENTS, f"{name} must be a number, not {raw!r}") from None
    return check_value(name, spec, value)


def make_tool_context(call: Call, resource: Resource) -> ToolContext:
    return ToolContext(call.settings, resource, call.registry.started)


# -- operator endpoints: health, the lease policy, resources and their actions


async def api_health(call: Call) -> Response:
    return Response(200, {"status": "ok", "version": __version__, "instance": call.registry.instance,
                          "uptime_seconds": round(time.monotonic() - call.registry.started, 3),
                          "resources": len(call.registry.resources), "sessions": call.sessions,
                          "mcp_path": call.settings.path, "token_required": bool(call.settings.token)})


async def api_lease_policy(call: Call) -> Response:
    return Response(200, call.registry.policy.as_dict())


def change_lease_policy(current: LeasePolicy, body: bytes) -> LeasePolicy:
    """The policy with the changes of a POSTed JSON object applied; 400 naming the first bad setting."""
    try:
        changes = parse_json(body or b"{}")
    except ValueError as exc:
        raise ApiError(400, INVALID_LEASE_POLICY, f"the body is not JSON: {exc}") from None
    if not isinstance(changes, dict):
        raise ApiError(400, INVALID_LEASE_POLICY, "the body must be a JSON object of lease settings")
    windows = current.list_windows()
    checked: dict[str, Any] = {}
    for name, value in changes.items():
        if name == "generation":
            continue  # the server counts generations
        if name == "mode" and isinstance(value, str):
            checked[name] = value
        elif name in windows and isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                checked[name] = float(value)
            except OverflowError:
                raise ApiError(400, INVALID_LEASE_POLICY,
                               f"{name}: {describe_value(value)} seconds is too long") from None
        elif name == "mode" or name in windows:
            what = "a string" if name == "mode" else "a number of seconds"
            raise ApiError(400, INVALID_LEASE_POLICY, f"{name}: must be {what}, not {describe_value(value)}")
        else:
            raise ApiError(400, INVALID_LEASE_POLICY, f"{describe_value(name)} is not a lease setting "
                           f"(settings: mode, {', '.join(windows)})")
    policy = replace(current, **checked)
    try:
        policy.check()
    except ValueError as exc:
        raise ApiError(400, INVALID_LEASE_POLICY, str(exc)) from None
    return policy


async def api_change_lease_policy(call: Call) -> Response:
    registry = call.registry
    policy = registry.change_policy(change_lease_policy(registry.policy, call.request.body))
    return Response(200, policy.as_dict())


async def api_resources(call: Call) -> Response:
    now = time.monotonic()
    resources = call.registry.resources.values()
    return Response(200, {"resources": [summarize_resource(r, now) for r in resources]})


async def api_resource(call: Call) -> Response:
    resource = call.registry.find(call.params["ref"])
    recent = [{"execution": e.number, "state": e.state, "elapsed_seconds": round(e.elapsed, 3),
               "output_lines": e.output.line_count, "first_line": clip(e.first_line, 120)}
              for e in resource.list_recent(RECENT_API_EXECUTIONS)]
    return Response(200, {**summarize_resource(resource, time.monotonic()), "recent_executions": recent})


async def api_resource_action(call: Call) -> Response:
    """interrupt, restart or recycle a resource, for the console and for kernels alike."""
    resource, action = call.registry.find(call.params["ref"]), call.params["action"]
    if action == "interrupt":
        execution = resource.interrupt()
        return Response(200, {"interrupt_sent": execution is not None,
                              "execution": execution and execution.number})
    if action == "restart":
        old, new, killed = await resource.restart()
        return Response(200, {"kernel_pid": new.pid, "previous_kernel_pid": old and old.pid,
                              "killed_execution": killed and killed.number})
    if resource.running is not None and not read_request_flag(call.request, "force"):
        raise ApiError(409, BUSY, f"execution {resource.running.number} is running; recycle with force=true "
                       "to kill it")
    await call.registry.retire(resource, "recycled by an operator" if call.caller is None
                               else f"recycled by kernel {call.caller.id}")
    return Response(200, {"recycled": resource.id})


# -- the kernel-facing control plane: kernels, their cells, and the relay of forwarded cells


@dataclass(eq=False)
class Relay:
    """What a forwarded cell shows, kept for the kernel that forwarded it in the server's relays (by
    execution): fed by the cell's execution (its listener), read from event ``after`` on, each read dropping
    the events before ``after`` (received)."""

    relays: dict[Execution, Relay]  # the server's, which it leaves when dropped
    execution: Execution | None = None
    events: list[tuple[str, str]] = field(default_factory=list)  # (stdout or stderr, text), not yet received
    relayed: int = 0  # events received and dropped from the list
    read_at: float = field(default_factory=time.monotonic)  # when the relaying kernel last asked
    news: asyncio.Event = field(default_factory=asyncio.Event)

    def show(self, stream: str | None, text: str) -> None:
        """The execution's listener: an event, or (None) the cell's end."""
        if stream is None:
            asyncio.get_running_loop().call_later(RELAY_KEEP_SECONDS, self.drop)
        elif time.monotonic() - self.read_at > RELAY_KEEP_SECONDS:
            self.drop()  # nobody relays it any more: never keep the output twice for nothing
            return
        else:
            self.events.append((stream, text))
        self.news.set()

    def read_since(self, after: int) -> tuple[int, list[tuple[str, str]]]:
        """The index of the first event from ``after`` on, and those events."""
        self.read_at = time.monotonic()
        if after > self.relayed:
            del self.events[: after - self.relayed]
            self.relayed = after
        return self.relayed, self.events[:]

    def drop(self) -> None:
        """Stop keeping what the cell shows: its relaying kernel has it all, or stopped asking."""
        if self.relays.get(self.execution) is self:
            del self.relays[self.execution]
            self.execution.listener = None
        self.news.set()


async def api_kernels(call: Call) -> Response:
    now = time.monotonic()
    return Response(200, {"kernels": [summarize_kernel(r, now) for r in call.registry.resources.values()]})


async def api_kernel(call: Call) -> Response:
    return Response(200, summarize_kernel(call.registry.find(call.params["ref"]), time.monotonic()))


async def api_hold(call: Call) -> Response:
    """A kernel opens or joins a kernel and holds it; without a kernel's credential, existing ones only."""
    ref, registry = call.params["ref"], call.registry
    resource = registry.hold(call.caller, ref) if call.caller else registry.find(ref)
    return Response(200, summarize_kernel(resource, time.monotonic()))


async def api_run(call: Call) -> Response:
    """Submit a cell (never queued), wait up to ``wait`` seconds, and say how far it got. With ``hold``, a
    kernel holds the target first (as /hold). A ``relay`` cell's answer is also its first relay batch (as
    /relay's from event 0): a cell that ends within ``wait`` is forwarded in this one request."""
    body = parse_json_body(call.request)
    code = check_value("code", STRING, body.get("code"))
    wait = check_value("wait", RUN_SPEC, body.get("wait", 0))
    try:
        options = parse_cell_header(code)
    except CellHeaderError as exc:
        raise ToolError(INVALID_CELL_HEADER, f"{exc} (header: {HEADER_USAGE})") from None
    by = ("kernel", call.caller.kernel_name) if call.caller else ("control_api", None)
    ref, hold = call.params["ref"], body.get("hold") is True
    resource = call.registry.hold(call.caller, ref) if hold and call.caller else call.registry.find(ref)
    relay = Relay(call.relays) if body.get("relay") is True else None
    execution = await resource.submit(code, options, None if relay is None else relay.show, by=by)
    if relay is not None:
        relay.execution, call.relays[execution] = execution, relay
    await wait_until_done(make_tool_context(call, resource), execution, wait)
    if relay:
        return Response(200, await await_relay_reply(call.relays, execution, 0, 0))
    return Response(200, {**describe_execution_data(execution, None), "reason": execution.reason})


async def api_notebook(call: Call) -> Response:
    """The resource's notebook (nbformat 4.5), rendered from its records, as a file to save."""
    resource = call.registry.find(call.params["ref"])
    return Response(200, await render_resource_notebook(resource), {
        "Content-Type": NOTEBOOK_MIME, "Cache-Control": "no-store",
        "Content-Disposition": f'attachment; filename="{name_notebook_file(resource)}"'})


def find_execution(call: Call) -> tuple[Resource, Execution]:
    resource = call.registry.find(call.params["ref"])
    return resource, resource.select(int(call.params["number"]))


async def api_execution(call: Call) -> Response:
    resource, execution = find_execution(call)
    wait = read_query_number(call, "wait", RUN_SPEC)
    await wait_until_done(make_tool_context(call, resource), execution, wait)
    return Response(200, {**describe_execution_data(execution, None), "reason": execution.reason})


async def api_read(call: Call) -> Response:
    """output and search: the read_output and search_output tools, their arguments and their text."""
    resource, execution = find_execution(call)
    tool = TOOLS["read_output" if call.params["what"] == "output" else "search_output"]
    args = check_arguments(tool, {**parse_json_body(call.request), "execution": execution.number})
    reply = await tool.run(make_tool_context(call, resource), args)
    return Response(200, {**reply.data, "text": reply.content[0]["text"]})


async def api_interrupt_execution(call: Call) -> Response:
    resource, execution = find_execution(call)
    sent = execution is resource.running and resource.interrupt() is execution
    return Response(200, {"interrupt_sent": sent, "execution": execution.number, "state": execution.state})


async def api_relay(call: Call) -> Response:
    """What a forwarded cell showed from event ``after`` on, waiting up to ``wait`` seconds for news."""
    _, execution = find_execution(call)
    after = int(read_query_number(call, "after", {"type": "integer", "minimum": 0}))
    wait = read_query_number(call, "wait", RUN_SPEC)
    return Response(200, await await_relay_reply(call.relays, execution, after, wait))


async def await_relay_reply(relays: dict[Execution, Relay], execution: Execution, after: int,
                            wait: float) -> dict:
    """The relay events from ``after`` on and the execution's state: once there are events or the cell has
    ended, or after ``wait`` seconds."""
    relay = relays.get(execution)
    if relay is not None and not relay.read_since(after)[1] and execution.state == RUNNING:
        relay.news.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(relay.news.wait(), wait)
    relay = relays.get(execution)  # dropped meanwhile, maybe
    first, pending = relay.read_since(after) if relay is not None else (after, [])
    events, size = [], 0
    for stream, text in pending:
        if events and size + len(text) > MAX_RELAY_CHARS:
            break
        events.append((stream, text))
        size += len(text)
    return {**describe_execution_data(execution, None), "reason": execution.reason, "events": events,
            "next": first + len(events), "more": len(pending) > len(events)}


CONSOLE_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>loommux console</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:1.2em;color:#1d2228;background:#f6f7f9}
h1{font-size:1.3em;margin:0 0 .2em}
#meta{color:#555;margin-bottom:1em}
table{border-collapse:collapse;width:100%;background:#fff}
th,td{border-bottom:1px solid #e3e6ea;padding:.35em .5em;text-align:left;vertical-align:top}
th{background:#eef0f3;position:sticky;top:0}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.lease{font-size:.92em;white-space:nowrap}
.signal{padding:.1em .4em;border-radius:3px;background:#dff3e3}
.signal.alert,.signal.lapsed{background:#d9302c;color:#fff}
.running{color:#b35c00;font-weight:600}
.cell{display:block;font:12px/1.3 ui-monospace,monospace;color:#444;max-width:40em;overflow:hidden;
text-overflow:ellipsis;white-space:nowrap}
.first-line::before{content:"in: ";color:#888}
.last-output::before{content:"out: ";color:#888}
.input{color:#b35c00}.input::before{content:"waiting for input: ";color:#888}
#empty{background:#fff;padding:1em;border:1px solid #e3e6ea}
#empty code{background:#eef0f3;padding:.1em .3em}
.orphan{color:#8a2be2}
button{margin:0 .2em .2em 0;cursor:pointer}
#error{color:#d9302c}
</style></head><body>
<h1>loommux console</h1>
<div id="meta">loading…</div><div id="error"></div>
<table><thead><tr><th>resource</th><th>kernel</th><th>running</th><th class="num">executions</th>
<th>leases (session · mode · last signal · standing)</th><th>actions</th></tr></thead>
<tbody id="rows"></tbody></table>
<div id="empty" hidden></div>
<script>
const esc = s => String(s ?? "").replace(/[&<>"']/g,
  c => ({"&":"&amp;","<":"&lt;",">":"&gt;",'"':"&quot;","'":"&#39;"}[c]));
const dur = s => s == null ? "" : s < 1 ? Math.round(s * 1000) + " ms" : s < 120 ? s.toFixed(1) + " s"
  : Math.floor(s / 60) + " min";
const mib = b => b == null ? "" : (b / 1048576).toFixed(0) + " MiB";
async function api(path, options) {
  const response = await fetch(path, Object.assign({credentials: "same-origin"}, options));
  const body = await response.json();
  if (!response.ok) throw new Error(body.message || response.statusText);
  return body;
}
async function act(id, action) {
  const force = action === "recycle" ? "?force=true" : "";
  if (!confirm(action + " resource " + id + "?")) return;
  try { await api("api/resources/" + encodeURIComponent(id) + "/" + action + force, {method: "POST"}); }
  catch (e) { document.getElementById("error").textContent = action + " failed: " + e.message; }
  refresh();
}
function leaseRow(l) {
  const label = l.operator || l.client;  // an operator label, else the client's own name
  const who = esc(l.holder ? "held by kernel " + l.holder
    : label ? label + " (" + l.session + ")" : l.session);
  const title = esc(l.alert || "");
  const signal = l.stream_open ? "stream open" : dur(l.last_signal_age_seconds) + " ago";
  return '<div class="lease">' + who + " · " + esc(l.mode) + " · " + signal + ' · '
    + '<span class="signal ' + esc(l.standing) + '" title="' + title + '">' + esc(l.standing)
    + "</span></div>";
}
function row(r) {
  const running = r.running_execution == null ? "idle"
    : '<span class="running">execution ' + r.running_execution + " · " + dur(r.running_elapsed_seconds)
    + (r.orphan_execution ? ' · <span class="orphan">orphan</span>' : "")
    + '</span><span class="cell first-line" title="first source line">' + esc(r.running_first_line)
    + "</span>"
    + '<span class="cell last-output" title="last output line">'
    + esc(r.running_last_output ?? "(no output yet)")
    + "</span>"
    + (r.input_prompt == null ? ""
       : '<span class="cell input" title="the prompt of its input()">' + esc(r.input_prompt) + "</span>");
  const orphan = r.orphan ? ' <span class="orphan">orphan ' + dur(r.orphan_seconds) + "</span>" : "";
  const buttons = ["interrupt", "restart", "recycle"].map(a =>
    '<button data-id="' + esc(r.id) + '" data-action="' + a + '">' + a + "</button>").join("")
    + '<a class="notebook" download href="api/resources/' + esc(encodeURIComponent(r.id)) + '/notebook"'
    + ' title="' + esc(r.notebook ? "mirrored to " + r.notebook.file
      + (r.notebook.problem ? " (off: " + r.notebook.problem + ")" : "") : "download its notebook")
    + '">notebook</a>';
  return "<tr data-resource=\\"" + esc(r.id) + "\\"><td><b>" + esc(r.name === "private" ? r.id : r.name)
    + "</b> "
    + esc(r.kind) + orphan + "</td><td>" + (r.kernel_location === "gateway"
      ? "gateway " + esc(r.kernel_gateway) + " · id " + esc(r.kernel_id ?? "none") + " · "
        + esc(r.kernel_state)
      : r.kernel_location === "attached" ? "attached · " + esc(r.kernel_state)
      : "pid " + esc(r.kernel_pid ?? "none") + " · " + esc(r.kernel_state) + " · " + mib(r.kernel_rss_bytes))
    + (r.kernel_language ? "<br>" + esc(r.kernel_language) : "")
    + (r.kernel_lost ? "<br>lost: " + esc(r.kernel_lost) : "")
    + (r.kernel_join_command ? "<br><code>" + esc(r.kernel_join_command) + "</code>" : "")
    + "</td><td>" + running + '</td><td class="num">' + r.executions + "</td><td>"
    + (r.leases.map(leaseRow).join("") || "none") + "</td><td>" + buttons + "</td></tr>";
}
async function refresh() {
  try {
    const [health, policy, list] = await Promise.all([api("api/health"), api("api/lease-policy"),
                                                      api("api/resources")]);
    document.getElementById("meta").textContent = "loommux " + health.version + " · up "
      + dur(health.uptime_seconds)
      + " · " + list.resources.length + " resources · lease policy " + policy.mode + " (generation "
      + policy.generation + ", orphan grace " + policy.orphan_grace_seconds + " s)";
    document.getElementById("rows").innerHTML = list.resources.map(row).join("");
    const empty = document.getElementById("empty");
    empty.hidden = list.resources.length > 0;
    if (!empty.hidden) {
      const url = location.origin + health.mcp_path;
      empty.innerHTML = "No sessions yet. Connect an MCP client to <code>" + esc(url) + "</code>"
        + (health.token_required ? " with the header <code>Authorization: Bearer &lt;token&gt;</code>" : "")
        + ", e.g. <code>claude mcp add --transport http loommux " + esc(url) + "</code>"
        + "; each session gets a private kernel, or shares a named one with "
        + "<code>X-Loommux-Resource: NAME</code>.";
    }
    document.getElementById("error").textContent = "";
  } catch (e) { document.getElementById("error").textContent = "refresh failed: " + e.message; }
}
document.getElementById("rows").addEventListener("click", e => {
  const b = e.target.closest("button"); if (b) act(b.dataset.id, b.dataset.action);
});
refresh(); setInterval(refresh, 2000);
</script></body></html>
"""


async def serve_console(call: Call) -> Response:
    """The console page; ?token= is taken once and kept in an HttpOnly, SameSite=Strict cookie."""
    query, token = call.request.params, call.settings.token
    if "token" in query:
        if token and not hmac.compare_digest(query["token"].encode(), token.encode()):
            raise HttpError(401, "Unauthorized: wrong token", {"WWW-Authenticate": 'Bearer realm="loommux"'})
        headers = {"Location": "./"}  # relative: the console may be served under a proxy's /NAME/
        if token:  # without a token there is nothing to remember
            headers["Set-Cookie"] = (f"{TOKEN_COOKIE}={urllib.parse.quote(token)}; HttpOnly; "
                                     "SameSite=Strict; Path=/")
        return Response(303, b"", headers)
    if not call.operator:
        raise HttpError(401, "Unauthorized: open the console as /?token=<token>",
                        {"WWW-Authenticate": 'Bearer realm="loommux"'})
    headers = {"Content-Type": "text/html; charset=utf-8", "Cache-Control": "no-store",
               "Content-Security-Policy":
                   "default-src 'self'; style-src 'unsafe-inline'; script-src 'unsafe-inline'",
               "X-Frame-Options": "DENY"}
    return Response(200, CONSOLE_HTML.encode(), headers)


# ---------------------------------------------------------------- Routing
# Every endpoint beside MCP in one table: its method, path pattern, handler and who may call it (the
# server's token, a kernel's credential too, or anyone); the router finds a request's entry and runs its
# handler. The Streamable HTTP server is handed the table, and checks an entry's access on the head.


@dataclass
class Route:
    """One endpoint beside MCP, in the table the HTTP server is handed."""

    method: str
    pattern: re.Pattern[str]  # matches the whole path
    handler: Callable[[Call], Awaitable[Response]]
    access: str = "operator"  # operator: the server's token; kernel: a kernel's credential too; public: none


def define_route(method: str, pattern: str, handler: Callable[[Call], Awaitable[Response]],
          access: str = "operator") -> Route:
    return Route(method, re.compile(pattern), handler, access)


KERNEL_PATH = r"/api/kernels/(?P<ref>[^/]+)"
EXECUTION_PATH = KERNEL_PATH + r"/executions/(?P<number>[0-9]{1,9})"
API_ROUTES = [
    define_route("GET", "/", serve_console, "public"),
    define_route("GET", "/api/health", api_health, "kernel"),
    define_route("GET", "/api/lease-policy", api_lease_policy, "kernel"),
    define_route("POST", "/api/lease-policy", api_change_lease_policy),
    define_route("GET", "/api/resources", api_resources),
    define_route("GET", r"/api/resources/(?P<ref>[^/]+)", api_resource),
    define_route("POST", r"/api/resources/(?P<ref>[^/]+)/(?P<action>interrupt|restart|recycle)",
          api_resource_action),
    define_route("GET", r"/api/resources/(?P<ref>[^/]+)/notebook", api_notebook),
    define_route("GET", "/api/kernels", api_kernels, "kernel"),
    define_route("GET", KERNEL_PATH, api_kernel, "kernel"),
    define_route("GET", KERNEL_PATH + "/notebook", api_notebook, "kernel"),
    define_route("POST", KERNEL_PATH + "/hold", api_hold, "kernel"),
    define_route("POST", KERNEL_PATH + "/run", api_run, "kernel"),
    define_route("POST", KERNEL_PATH + "/(?P<action>interrupt|restart|recycle)", api_resource_action,
                 "kernel"),
    define_route("GET", EXECUTION_PATH, api_execution, "kernel"),
    define_route("POST", EXECUTION_PATH + "/(?P<what>output|search)", api_read, "kernel"),
    define_route("POST", EXECUTION_PATH + "/interrupt", api_interrupt_execution, "kernel"),
    define_route("GET", EXECUTION_PATH + "/relay", api_relay, "kernel"),
]


def find_route(routes: list[Route], method: str, path: str, mcp_path: str) -> tuple[Route, dict[str, str]]:
    """The entry of the route table for a method and path, with the path's named parts percent-decoded;
    404 or 405 when there is none."""
    found = [(entry, match) for entry in routes if (match := entry.pattern.fullmatch(path))]
    if not found:
        raise ApiError(404, "not_found", f"no endpoint {path} (MCP is at {mcp_path})")
    chosen = next(((entry, match) for entry, match in found if entry.method == method), None)
    if chosen is None:
        allowed = ", ".join(sorted({entry.method for entry, _ in found}))
        raise ApiError(405, "method_not_allowed", f"{method} is not allowed on {path}; use {allowed}")
    entry, match = chosen
    return entry, {name: urllib.parse.unquote(value) for name, value in match.groupdict().items()}


async def call_route(entry: Route, call: Call) -> Response:
    """Run a route's handler; its domain and argument errors become JSON errors by the one mapping."""
    try:
        return await entry.handler(call)
    except (ResourceError, ToolError) as exc:
        raise ApiError.of(exc) from None
    except OutputUnreadable as exc:
        raise ApiError.of(ToolError(OUTPUT_LOST, str(exc))) from None


# ---------------------------------------------------------------- Streamable HTTP

SESSION_FORGET_SECONDS = 86400.0  # a session whose lease lapsed this long ago is forgotten
MCP_SESSION_HEADER = "mcp-session-id"
SESSION_ID_BYTES = 24  # 192 random bits after the instance's name (see "Instances")
RESOURCE_HEADER = "x-loommux-resource"
LEASE_POLICY_HEADER = "x-loommux-lease-policy"
OPERATOR_HEADER = "x-loommux-operator"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
MCP_METHODS = "GET, POST, DELETE"
STATELESS_400_CODES = (PARSE_ERROR, INVALID_REQUEST, INVALID_PARAMS, HEADER_MISMATCH, MISSING_CAPABILITY,
                       UNSUPPORTED_VERSION)
DEFAULT_KERNEL = "default"  # the shared kernel of a stateless HTTP call that names none


class McpRefusal(HttpError):
    """A refusal on the MCP endpoint, answered in that endpoint's one error shape: a JSON-RPC error response
    with its code, its data and the refused request's id (null when unknown).

    A refusal named by ERROR_CODES (``data["error_code"]``) repeats its data and message at the top level,
    where that body had them before it was a JSON-RPC response: README promises a stale lease policy's 409
    "with the current policy", and clients read it there.
    """

    def __init__(self, status: int, message: str, code: int = INVALID_REQUEST, data: dict | None = None,
                 request_id: Any = None, headers: dict | None = None) -> None:
        super().__init__(status, message, headers)
        self.code, self.data, self.request_id = code, data, request_id

    @classmethod
    def answering(cls, status: int, response: dict) -> McpRefusal:
        """A refusal whose JSON-RPC error response the MCP session made."""
        error = response["error"]
        return cls(status, error["message"], error["code"], error.get("data"), response.get("id"))

    def body(self) -> dict:
        named = ({**self.data, "message": self.message} if self.data is not None and "error_code" in self.data
                 else {})
        return {**named, **make_jsonrpc_error(self.request_id, self.code, self.message, self.data)}


def encode_mcp_error(error: HttpError) -> dict:
    """The MCP endpoint's one error shape, also for a plain refusal (an Invalid Request with a null id)."""
    refusal = error if isinstance(error, McpRefusal) else McpRefusal(error.status, error.message)
    return refusal.body()


def with_request_id(error: HttpError, message: Any) -> McpRefusal:
    """A refusal of a parsed message, as a JSON-RPC error carrying the message's id (when it is valid)."""
    refusal = error if isinstance(error, McpRefusal) else McpRefusal(error.status, error.message,
                                                                     headers=error.headers)
    request_id = message.get("id") if isinstance(message, dict) else None
    if refusal.request_id is None and valid_request_id(request_id):
        refusal.request_id = request_id
    return refusal


def read_resource_header(request: Request) -> str | None:
    """The named resource a request asks for with X-Loommux-Resource, if any."""
    name = request.headers.get(RESOURCE_HEADER)
    if name is not None and not RESOURCE_NAME_RE.fullmatch(name):
        raise HttpError(400, f"Bad Request: X-Loommux-Resource must be {RESOURCE_NAME_RULE}")
    return name


def make_control_url(host: str, port: int) -> str:
    """The server's base URL as its own kernels reach it (a wildcard bind is reached on loopback)."""
    host = "127.0.0.1" if host in WILDCARD_HOSTS else host
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# -- the checks every request's head passes


@dataclass
class Access:
    """What the checks of a request's head found: whom it acts for, and its entry in the route table."""

    operator: bool  # it carries the server's token (or none is needed)
    caller: Resource | None  # the kernel whose own credential it carries
    route: tuple[Route, dict[str, str]] | None = None  # none on the MCP endpoint, or for no endpoint at all


def check_access(request: Request, settings: Settings, registry: Registry, routes: list[Route]) -> Access:
    """DNS-rebinding and cross-site protection, then the credentials the path needs: all on the head, before
    any body is read."""
    check_host_and_origin(request, settings)
    access = check_credentials(request, settings, registry)
    if request.path == settings.path:
        if not access.operator:
            raise refuse_unauthorized(access.caller, "the MCP endpoint")
        return access
    try:
        access.route = find_route(routes, request.method, request.path, settings.path)
        needed = access.route[0].access
    except ApiError:
        needed = "operator"  # no such endpoint: said after the body, to a caller allowed everywhere
    if not access.operator and not (needed == "public" or (needed == "kernel" and access.caller)):
        raise refuse_unauthorized(access.caller, request.path)
    return access


def check_host_and_origin(request: Request, settings: Settings) -> None:
    """The Host must name this server, and an Origin, when sent, too."""
    allowed = (*LOOPBACK_HOSTS, settings.host.lower())
    host = request.headers.get("host", "")
    # On a wildcard address with a token, any name of this machine may be used: the token is the guard.
    any_host = settings.host in WILDCARD_HOSTS and settings.token
    if not any_host and parse_authority_host(host) not in allowed:
        raise HttpError(403, f"Forbidden: Host {host!r} is not this server")
    origin = request.headers.get("origin")
    if origin is not None and parse_origin_host(origin) not in allowed:
        raise HttpError(403, f"Forbidden: Origin {origin!r} is not allowed")


def check_credentials(request: Request, settings: Settings, registry: Registry) -> Access:
    """Whether the request acts for the operator, and the kernel whose own credential it carries.

    A bearer token is the server's (``--token``) or a kernel's; the console and API also take the console's
    cookie.
    """
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    given = given.strip() if scheme.lower() == "bearer" else ""
    if not given and request.path != settings.path:
        cookies = SimpleCookie(request.headers.get("cookie", ""))
        given = urllib.parse.unquote(cookies[TOKEN_COOKIE].value) if TOKEN_COOKIE in cookies else ""
    kernel = registry.find_by_token(given) if given else None
    if kernel is not None:
        return Access(False, kernel)
    token = settings.token
    return Access(not token or (bool(given) and hmac.compare_digest(given.encode(), token.encode())), None)


def refuse_unauthorized(caller: Resource | None, what: str) -> HttpError:
    if caller is not None:
        return HttpError(403, f"Forbidden: a kernel's credential does not open {what}")
    return HttpError(401, "Unauthorized: send Authorization: Bearer <token>",
                     {"WWW-Authenticate": 'Bearer realm="loommux"'})


# -- the session table


@dataclass(eq=False)
class HttpSession:
    """A handshake-era MCP session over HTTP, a row of the session table: its id, the MCP session (whose
    binding holds its resource and lease) and its standalone GET stream while one is open."""

    id: str
    mcp: McpSession
    stream: asyncio.Task | None = None

    @property
    def binding(self) -> SessionBinding:
        return self.mcp.binding


class HttpSessionTable:
    """The handshake-era sessions of the HTTP server by id: opened by ``initialize``, found by their
    Mcp-Session-Id, ended by DELETE or the server's end, forgotten once their lease lapsed long ago; what the
    instance's state keeps of them, and taking that back."""

    def __init__(self, settings: Settings, registry: Registry) -> None:
        self.settings = settings
        self.registry = registry
        self.sessions: dict[str, HttpSession] = {}
        self.pruner: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self.sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self.sessions

    def start(self) -> None:
        """Begin forgetting abandoned sessions."""
        self.pruner = asyncio.ensure_future(self.forget_abandoned())

    async def forget_abandoned(self) -> None:
        """Drop sessions whose lease lapsed long ago (their id then gets 404 and the client
        re-initializes)."""
        while True:
            await asyncio.sleep(SESSION_FORGET_SECONDS / 60)
            now = time.monotonic()
            for session in list(self.sessions.values()):
                quiet_since = session.binding.quiet_since()
                if (quiet_since is not None and now - quiet_since > SESSION_FORGET_SECONDS
                        and session.stream is None):
                    del self.sessions[session.id]
                    self.registry.tasks.forget(session.binding)
                    self.registry.changed()

    def open(self, request: Request) -> HttpSession:
        """A session for an initialize: a named resource it asks for is leased now, a private one at its first
        tool call (a client that only lists tools costs no kernel)."""
        name = read_resource_header(request)
        pinned = request.headers.get(LEASE_POLICY_HEADER)
        policy = self.registry.policy
        if pinned is not None and pinned.strip() != str(policy.generation):
            raise McpRefusal(409, f"Conflict: lease policy generation {pinned} is stale; the current one is "
                             f"{policy.generation}: re-read GET /api/lease-policy and initialize again",
                             data={"error_code": STALE_LEASE_POLICY, "policy": policy.as_dict()})
        binding = SessionBinding(self.registry, f"s-{secrets.token_hex(3)}", name,
                                 request.headers.get(OPERATOR_HEADER), policy)
        if name is not None:
            try:
                binding.attach(tool_call=False)
            except ResourceError as exc:
                status = status_of_error(exc.code)
                raise McpRefusal(status, exc.message, data={"error_code": exc.code}) from None
        session_id = mint_id(self.registry.instance, SESSION_ID_BYTES)
        session = HttpSession(session_id, McpSession(self.settings, binding))
        self.sessions[session.id] = session
        self.registry.changed()
        return session

    def find(self, request: Request) -> HttpSession:
        """The session a request names with Mcp-Session-Id."""
        session_id = request.headers.get(MCP_SESSION_HEADER)
        # as 2026-07-28 has it: no sessions, POST only
        if not session_id and request.method in ("GET", "DELETE"):
            raise HttpError(405, "Method Not Allowed: GET and DELETE need the Mcp-Session-Id of an "
                            "initialized session; use POST", {"Allow": "POST"})
        if not session_id:
            raise HttpError(400, "Bad Request: Mcp-Session-Id header is required")
        session = self.sessions.get(session_id)
        if session is None:
            words = explain_unknown_id("session", session_id, self.registry.instance)
            raise HttpError(404, f"Not Found: {words}; initialize a new one")
        return session

    def records(self) -> list[SessionRecord]:
        """What the instance's state keeps of the table: its initialized sessions."""
        records = (record_session(s.id, s.binding, s.mcp.protocol_version, s.mcp.elicits)
                   for s in self.sessions.values() if s.mcp.protocol_version is not None)
        return [record for record in records if record is not None]

    def take_back(self, sessions: list[tuple[SessionRecord, SessionBinding]]) -> None:
        """The sessions the instance's state kept over a restart, as their initialize left them."""
        for record, binding in sessions:
            mcp = McpSession(self.settings, binding)
            mcp.resume(record.protocol_version, record.elicits)
            self.sessions[record.id] = HttpSession(record.id, mcp)

    async def end(self, session: HttpSession, reason: str = "its session was deleted") -> None:
        if self.sessions.pop(session.id, None) is None:
            return
        self.registry.changed()
        session.mcp.close()
        if session.stream is not None:
            session.stream.cancel()
        await session.binding.end(reason)

    async def close(self) -> None:
        """End every session (the server shuts down)."""
        if self.pruner is not None:
            self.pruner.cancel()
        await asyncio.gather(*(self.end(s, "the server shut down") for s in list(self.sessions.values())))


# -- the server


class MessageStream(EventStream):
    """An event stream of JSON-RPC messages, one an event."""

    async def send_message(self, message: Any) -> None:
        await self.send(encode_message(message))

    async def finish(self, last: Any) -> None:
        """The last message, if any (the response), and the end of the stream."""
        await self.end(None if last is None else encode_message(last))


class StreamableHttpServer(HttpServer):
    """MCP Streamable HTTP on one path, both eras, and the route table's endpoints beside it.

    Every head passes the access checks (``check_access``) before its body is read. A 2026-07-28 request is
    answered on its own; a handshake-era one belongs to a session of the session table, opened by
    ``initialize`` and named by ``Mcp-Session-Id``. Each surface has one error shape: a JSON-RPC error on the
    MCP endpoint (and for a head that could not be read), ``{error_code, message}`` on every other path.
    """

    def __init__(self, settings: Settings, registry: Registry, routes: list[Route]) -> None:
        super().__init__(settings.host, settings.port, settings.max_connections, settings.max_body)
        self.settings = settings
        self.registry = registry
        self.routes = routes
        self.sessions = HttpSessionTable(settings, registry)
        self.relays: dict[Execution, Relay] = {}  # the relays of forwarded cells, while they are kept

    async def listen(self) -> asyncio.Server:
        server = await super().listen()
        self.sessions.start()
        return server

    def check(self, request: Request) -> Access:
        return check_access(request, self.settings, self.registry, self.routes)

    def error_body(self, error: HttpError, request: Request | None) -> bytes:
        if request is not None and request.path != self.settings.path:
            return encode_message(encode_api_error(error))
        return encode_message(encode_mcp_error(error))

    async def respond(self, request: Request, checked: Access, reader: asyncio.StreamReader,
                      writer: asyncio.StreamWriter) -> bool:
        """Answer one request (its head already checked); return whether the connection stays open."""
        if request.path != self.settings.path:
            response = await self.serve_route(request, checked)
            if isinstance(response.body, bytes):
                await self.send(writer, response.status, response.headers, response.body, request.keep_alive)
            else:
                await self.send_json(writer, response.status, await encode_message_async(response.body),
                                     request.keep_alive, response.headers)
            return request.keep_alive
        if request.method == "POST":
            return await self.post(request, reader, writer)
        if request.method == "GET":
            return await self.open_stream(request, reader, writer)
        if request.method == "DELETE":
            await self.sessions.end(self.sessions.find(request))
            await self.send(writer, 204, {}, b"", request.keep_alive)
            return request.keep_alive
        raise HttpError(405, f"Method Not Allowed: use {MCP_METHODS}", {"Allow": MCP_METHODS})

    async def serve_route(self, request: Request, access: Access) -> Response:
        """An endpoint of the route table (found, and its access checked, on the head)."""
        entry, params = access.route or find_route(self.routes, request.method, request.path,
                                                   self.settings.path)
        return await call_route(entry, Call(request, params, access.operator, access.caller, self.settings,
                                            self.registry, len(self.sessions), self.relays))

    # -- POST: a message of either era

    async def post(self, request: Request, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter) -> bool:
        if not request.accepts("application/json", "text/event-stream"):
            raise HttpError(406, "Not Acceptable: Accept must list application/json and text/event-stream")
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            raise HttpError(415, "Unsupported Media Type: Content-Type must be application/json")
        try:
            message = parse_json(request.body)
        except ValueError as exc:
            raise McpRefusal(400, f"Parse error: {exc}", PARSE_ERROR) from None
        try:
            return await self.post_message(request, message, reader, writer)
        except HttpError as exc:
            raise with_request_id(exc, message) from None

    async def post_message(self, request: Request, message: Any, reader: asyncio.StreamReader,
                           writer: asyncio.StreamWriter) -> bool:
        version = request.headers.get(MCP_VERSION_HEADER)
        if version == STATELESS_VERSION and (request_of(message) or (None, None))[1] == "initialize":
            # the revision removed the handshake: an unknown method (404), as the official conformance suite
            # expects; a handshake client sends no such header on initialize
            raise McpRefusal(404, f"Method not found: initialize (removed at protocol {STATELESS_VERSION})",
                             METHOD_NOT_FOUND)
        # The body decides; a body that lacks the envelope its header announces is a malformed stateless
        # request.
        if is_stateless(message) or (version == STATELESS_VERSION and isinstance(message, dict)
                                   and message.get("method") != "initialize"):
            return await self.post_stateless(request, message, reader, writer)
        if version is not None and version not in PROTOCOL_VERSIONS:
            raise HttpError(400, f"Bad Request: unsupported MCP-Protocol-Version {version}; supported: "
                            f"{', '.join(PROTOCOL_VERSIONS)}")
        initialize = (request_of(message) or (None, None))[1] == "initialize"
        session = self.sessions.open(request) if initialize else self.sessions.find(request)
        headers = {"Mcp-Session-Id": session.id} if initialize else {}
        if request_of(message) is None and not isinstance(message, list):
            refusal = await session.mcp.handle(message, send_no_notifications)
            if refusal is not None:  # JSON, but neither a request, a notification nor a response
                raise McpRefusal.answering(400, refusal)
            await self.send(writer, 202, {}, b"", request.keep_alive)
            return request.keep_alive
        # An event stream when progress is due (at once), or when the server sends something ahead of the
        # response (an elicitation: the stream begins with it); otherwise plain JSON.
        stream = MessageStream(writer, headers)
        if read_progress_token(message) is not None:
            stream.begin()
        task = asyncio.ensure_future(session.mcp.handle(message, stream.send_message))
        try:
            await stream.ping_until(task)
            response = task.result()
        except asyncio.CancelledError:
            task.cancel()
            return False  # cancelled by the client: no response, close this connection
        if initialize:
            self.registry.changed()  # its version and client are known now
        if stream.begun:
            await stream.finish(response)
            return True
        if isinstance(message, list) and isinstance(response, dict):  # a batch refused as a whole
            raise McpRefusal.answering(400, response)
        if response is None:
            await self.send(writer, 202, headers, b"", request.keep_alive)
        else:
            await self.send_json(writer, 200, await encode_message_async(response), request.keep_alive,
                                 headers)
        return request.keep_alive

    async def post_stateless(self, request: Request, message: dict, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> bool:
        """A 2026-07-28 request: no session (any Mcp-Session-Id is ignored), its kernel named by the call
        (else X-Loommux-Resource, else the shared kernel "default"); JSON unless progress is due before the
        answer (or it is a listen), then SSE. A closed connection ends only the waiting, never the cell."""
        # this revision defines none over HTTP
        if "id" not in message and isinstance(message.get("method"), str):
            await self.send(writer, 202, {}, b"", request.keep_alive)
            return request.keep_alive
        binding = SessionBinding(self.registry, STATELESS_LEASE_LABEL,
                                 default_kernel=read_resource_header(request) or DEFAULT_KERNEL,
                                 routing_headers=request.headers)
        mcp = McpSession(self.settings, binding, stateless=True)
        # begun by the first notification (progress, a listen's acknowledgement)
        stream = MessageStream(writer)
        task = asyncio.ensure_future(mcp.handle(message, stream.send_message))
        if not await stream.ping_until(task, reader):
            task.cancel()  # only the waiting: the cell runs on
            return False
        response = task.result()
        if stream.begun:
            await stream.finish(response)
            return request.keep_alive
        code = response.get("error", {}).get("code") if isinstance(response, dict) else None
        status = 404 if code == METHOD_NOT_FOUND else 400 if code in STATELESS_400_CODES else 200
        await self.send_json(writer, status, await encode_message_async(response), request.keep_alive)
        return request.keep_alive

    # -- GET: the standalone stream

    async def open_stream(self, request: Request, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> bool:
        """The standalone server-to-client event stream, kept open with comment pings; while it is open, a
        connection lease holds."""
        if not request.accepts("text/event-stream"):
            raise HttpError(406, "Not Acceptable: Accept must list text/event-stream")
        session = self.sessions.find(request)
        session.binding.renew()
        if session.stream is not None:
            raise HttpError(409, "Conflict: this session already has a GET stream open")
        stream = MessageStream(writer)
        stream.begin()
        session.stream = asyncio.current_task()
        session.binding.stream_opened()
        session.binding.push = stream.send_message  # its tasks' status notifications
        closed = asyncio.ensure_future(reader.read(1))  # the client closing its side ends the stream
        try:
            await stream.ping()
            await stream.ping_until(closed)
        except asyncio.CancelledError:
            if session.id in self.sessions:
                raise
        finally:
            closed.cancel()
            if session.stream is asyncio.current_task():
                session.stream = None
                session.binding.push = None
                session.binding.stream_closed()
        return False

    async def close(self) -> None:
        await self.registry.tasks.close()  # live tasks fail; listen streams end with their graceful result
        super().close()
        await self.sessions.close()


async def send_no_notifications(message: dict) -> None:
    """What a posted notification or response has sent ahead of its 202: nothing."""


async def take_back_state(registry: Registry, http_server: StreamableHttpServer,
                          state: InstanceState | None) -> None:
    """With --state-dir: take back what the state kept (its gateway kernels with their output, the handshake
    sessions); the output of kernels it did not take back goes."""
    if registry.pool.gateway is None or registry.sources:
        log("state: local kernels are never kept over a restart (they stop with the server); only gateway "
            "kernels are")
    http_server.sessions.take_back(await restore(registry, state) if state is not None else [])
    if registry.output is not None:
        registry.output.keep_only(set(registry.resources))


async def serve_http(settings: Settings, routes: list[Route]) -> int:
    """Serve MCP over Streamable HTTP until SIGTERM or SIGINT: the kernel pool and registry, the state kept
    over restarts (written a last time once the registry has deleted its kernels), and the listener, each
    closed by what opened it."""
    stopping = asyncio.Event()
    stop_on_signals(stopping)
    state = None
    try:
        if settings.state_dir is not None:
            hold_state_dir(settings.state_dir)  # until this process ends
            state = read_state(settings.state_dir, settings.instance, settings.gateway)
    except StartupError as exc:
        log(str(exc))
        return 1
    if state is not None and not settings.instance:
        settings = replace(settings, instance=state.instance)
    async with make_notebook_mirrors(settings) as notebooks, contextlib.AsyncExitStack() as last, \
            make_kernel_registry(settings, settings.path, settings.spare_kernels) as registry:
        notebooks.watch(registry)
        pool = registry.pool
        pool.fill()
        if pool.spares and settings.gateway is None:  # a gateway may come back: each call tries again
            try:
                await asyncio.shield(pool.spares[0])  # a server that cannot start a kernel must not serve
            except KernelError as exc:
                log(f"cannot start the IPython kernel: {exc}")
                return 1
        http_server = StreamableHttpServer(settings, registry, routes)
        if settings.state_dir is not None:
            await take_back_state(registry, http_server, state)
        try:
            server = await http_server.listen()
        except OSError as exc:
            log(f"cannot listen on {settings.host}:{settings.port}: {exc}")
            registry.resources.clear()  # what a state kept stays on the gateway, for a start that can listen
            return 1
        if settings.state_dir is not None:
            keeper = StateKeeper(settings.state_dir / STATE_FILE, registry, http_server.sessions.records)
            last.push_async_callback(keeper.close)  # after the registry has deleted its kernels
        registry.listen_at(settings.public_url or make_control_url(settings.host, http_server.port))
        join_kept_kernels(registry)
        if settings.host not in LOOPBACK_HOSTS and not settings.token:
            log("WARNING: listening on a non-loopback address without a token: anyone who can reach "
                f"{settings.host}:{http_server.port} can run code as this user. Set --token or "
                "LOOMMUX_TOKEN.")
        base = f"http://{settings.host}:{http_server.port}"
        console = f"{base}/" + (" (open /?token=TOKEN once)" if settings.token else "")
        log(f"listening on {base}{settings.path} · console {console} · instance {registry.instance}")
        await stopping.wait()
        server.close()
        await http_server.close()
    if registry.output is not None and registry.output.kept:
        # The stop deleted the kernels the state kept: their output goes too, after the notebooks' last
        # writes, which read it.
        registry.output.keep_only(set())
    return 0


# ---------------------------------------------------------------- Lease-aware client

CLIENT_EXTRA = "loommux[client]"
LEASE_POLICY_API = "/api/lease-policy"
CLIENT_CONNECT_TIMEOUT = 30.0
# a POST is answered when its tool call ends: wait may take an hour
CLIENT_READ_TIMEOUT = MAX_WAIT_TIMEOUT + 60.0
STREAM_OPEN_TIMEOUT = 10.0  # under connection leases, how long entering waits for the GET stream


def import_client_sdk() -> tuple[Any, Any, Any]:
    """ClientSession, streamable_http_client and the SDK's HTTP client factory, imported on use."""
    try:
        from mcp import ClientSession
        from mcp.client.streamable_http import create_mcp_http_client, streamable_http_client
    except ImportError as exc:
        raise ImportError(f'loommux.LeaseAwareClient needs the official mcp SDK: pip install '
                          f'"{CLIENT_EXTRA}" ({exc})') from exc
    return ClientSession, streamable_http_client, create_mcp_http_client


class StalePolicy(Exception):
    """The server's lease policy changed while a LeaseAwareClient was initializing under it (a 409)."""


class LeaseAwareClient:
    """An MCP client session on a loommux HTTP server that keeps its lease the way the server's policy asks.

    ``async with LeaseAwareClient(url, operator=None, resource_name=None, **client_options) as client``
    reads ``/api/lease-policy``, pins its generation on ``initialize`` (a 409 means the policy changed
    meanwhile: it is read again and initialize retried once), names the resource and operator in
    headers, then keeps the lease: under ``ping`` it sends MCP ping every ``ping_interval_seconds``;
    under ``connection`` it waits until the SDK's standalone GET stream is open (the SDK opens it after
    initialize and reopens it when the server ends it). Everything else is the official SDK's
    ``ClientSession``: ``call_tool``, ``list_tools`` and the rest are reached through this object.

    ``client_options`` go to ``ClientSession`` (``client_info``, ``read_timeout_seconds``, callbacks),
    except ``headers``: extra HTTP headers for every request, e.g. ``{"Authorization": "Bearer …"}``.
    """

    def __init__(self, url: str, operator: str | None = None, resource_name: str | None = None,
                 **client_options: Any) -> None:
        self.sdk = import_client_sdk()
        self.url = url
        self.headers = {str(k): str(v) for k, v in (client_options.pop("headers", None) or {}).items()}
        if resource_name is not None:
            self.headers[RESOURCE_HEADER] = resource_name
        if operator is not None:
            self.headers[OPERATOR_HEADER] = operator
        self.client_options = client_options
        self.policy: dict | None = None  # the lease policy this session was initialized under
        self.session: Any = None  # the SDK's ClientSession, once entered
        self.stack: contextlib.AsyncExitStack | None = None

    def __getattr__(self, name: str) -> Any:
        session = self.__dict__.get("session")
        if session is None:
            raise AttributeError(f"LeaseAwareClient has no {name!r} before it is entered (async with)")
        return getattr(session, name)

    async def __aenter__(self) -> LeaseAwareClient:  # noqa: PYI034 - typing.Self needs Python 3.11
        try:
            await self.connect()
        except StalePolicy:
            await self.connect()  # the policy changed between reading and initialize: once more
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Close the session; an exception of the caller's goes on as it was (the SDK's task groups, told of
        it, would wrap it in an exception group)."""
        stack, self.stack, self.session = self.stack, None, None
        if stack is not None:
            await stack.aclose()

    async def read_policy(self) -> dict:
        import urllib.request

        request = urllib.request.Request(urllib.parse.urljoin(self.url, LEASE_POLICY_API),
                                         headers=self.headers)

        def fetch() -> dict:
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
                    request, timeout=CLIENT_CONNECT_TIMEOUT) as response:
                return json.loads(response.read())

        return await asyncio.to_thread(fetch)

    async def connect(self) -> None:
        """Read the policy, initialize under it and start keeping the lease; StalePolicy on a 409."""
        client_session, streamable_http_client, create_http_client = self.sdk
        policy = await self.read_policy()
        stale, stream_open = False, asyncio.Event()

        async def watch(response: Any) -> None:
            nonlocal stale
            if response.request.method == "POST" and response.status_code == HTTPStatus.CONFLICT:
                stale = True
            elif response.request.method == "GET" and response.status_code == HTTPStatus.OK:
                stream_open.set()

        headers = {**self.headers, LEASE_POLICY_HEADER: str(policy["generation"])}
        # Failures are raised after the stack is closed: raised inside it, the SDK's task groups would
        # wrap them in exception groups.
        stack = contextlib.AsyncExitStack()
        try:
            http_client = await stack.enter_async_context(create_http_client(headers=headers))
            http_client.timeout = (CLIENT_CONNECT_TIMEOUT, CLIENT_READ_TIMEOUT, CLIENT_CONNECT_TIMEOUT,
                            CLIENT_CONNECT_TIMEOUT)
            http_client.event_hooks = {"response": [watch]}
            transport = streamable_http_client(self.url, http_client=http_client)
            read, write = await stack.enter_async_context(transport)
            session = await stack.enter_async_context(client_session(read, write, **self.client_options))
            await session.initialize()
            if policy["mode"] == "connection":
                await asyncio.wait_for(stream_open.wait(), STREAM_OPEN_TIMEOUT)
            elif policy["mode"] == "ping":
                stop = asyncio.Event()
                pinger = asyncio.ensure_future(
                    self.keep_pinging(session, float(policy["ping_interval_seconds"]), stop))

                async def stop_pinging() -> None:
                    stop.set()
                    await pinger  # a ping in flight finishes before the session closes

                stack.push_async_callback(stop_pinging)
        except Exception:
            await stack.aclose()
            if stale:
                raise StalePolicy(f"the lease policy changed while initializing under generation "
                                  f"{policy['generation']}") from None
            raise
        self.policy, self.session, self.stack = policy, session, stack

    async def keep_pinging(self, session: Any, interval: float, stop: Any) -> None:
        """Ping every interval until stop is set. A ping in flight is let finish rather than cancelled:
        the SDK would deliver its late answer to a closed session and fail the close."""
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            if stop.is_set():
                return
            with contextlib.suppress(Exception):  # one lost ping is not fatal; the next may get through
                await asyncio.wait_for(session.send_ping(), CLIENT_CONNECT_TIMEOUT)


# ---------------------------------------------------------------- CLI

WORKSPACE_CONFIG_ENV = "LOOMMUX_WORKSPACE_CONFIG"
RESULT_MODE_ENV = "LOOMMUX_RESULT_MODE"
STARTUP_ENV = "LOOMMUX_STARTUP"
MAX_KERNELS_ENV = "LOOMMUX_MAX_KERNELS"
EVICT_IDLE_ENV = "LOOMMUX_EVICT_IDLE_SECONDS"
SPARE_KERNELS_ENV = "LOOMMUX_SPARE_KERNELS"
MAX_BODY_ENV = "LOOMMUX_MAX_BODY_BYTES"
MAX_CONNECTIONS_ENV = "LOOMMUX_MAX_CONNECTIONS"
LEASE_MODE_ENV = "LOOMMUX_LEASE_MODE"
GATEWAY_URL_ENV = "LOOMMUX_GATEWAY_URL"
GATEWAY_TOKEN_ENV = "LOOMMUX_GATEWAY_TOKEN"
GATEWAY_KERNEL_NAME_ENV = "LOOMMUX_GATEWAY_KERNEL_NAME"
GATEWAY_CA_FILE_ENV = "LOOMMUX_GATEWAY_CA_FILE"
PUBLIC_URL_ENV = "LOOMMUX_PUBLIC_URL"
INSTANCE_ENV = "LOOMMUX_INSTANCE"
STATE_DIR_ENV = "LOOMMUX_STATE_DIR"
OUTPUT_DIR_ENV = "LOOMMUX_OUTPUT_DIR"
INSPECTORS_ENV = "LOOMMUX_INSPECTORS"
INSPECTORS_DEFAULT = Path("loommux") / "inspectors.py"  # in $XDG_CONFIG_HOME (~/.config), when it is there
NOTEBOOK_ENV = "LOOMMUX_NOTEBOOK"
NOTEBOOK_DIR_ENV = "LOOMMUX_NOTEBOOK_DIR"
EXISTING_ENV = "LOOMMUX_EXISTING"
KERNELSPEC_ENV = "LOOMMUX_KERNELSPEC"
GATEWAY_KERNEL_ENV_PREFIX = "KERNEL_"  # what Enterprise Gateway passes on to a kernel's environment
LEASE_WINDOW_ENVS = {
    "private_idle_seconds": "LOOMMUX_PRIVATE_IDLE_SECONDS",
    "shared_idle_seconds": "LOOMMUX_SHARED_IDLE_SECONDS",
    "ping_interval_seconds": "LOOMMUX_PING_INTERVAL_SECONDS",
    "ping_timeout_seconds": "LOOMMUX_PING_TIMEOUT_SECONDS",
    "connection_grace_seconds": "LOOMMUX_CONNECTION_GRACE_SECONDS",
    "orphan_grace_seconds": "LOOMMUX_ORPHAN_GRACE_SECONDS",
}
DEFAULT_HOST, DEFAULT_PORT, DEFAULT_PATH = "127.0.0.1", 8801, "/mcp"
DEFAULT_SPARE_KERNELS = 1
DEFAULT_MAX_BODY = 32 << 20
DEFAULT_MAX_CONNECTIONS = 512
SEARCH_TIMEOUT_ENV = "LOOMMUX_SEARCH_TIMEOUT_SECONDS"
DEFAULT_SEARCH_TIMEOUT = 10.0


# glibc's mallopt parameter, and its default value, which glibc raises once a block that big is freed.
M_MMAP_THRESHOLD, MMAP_THRESHOLD = -3, 128 << 10
RUNTIME_PACKAGES = {"zmq": "pyzmq", "ipykernel": "ipykernel", "tiktoken": "tiktoken"}  # module: distribution
ENVIRONMENT_HELP = {
    "TIKTOKEN_CACHE_DIR": "where tiktoken finds or caches o200k_base (offline machines)",
    WORKSPACE_CONFIG_ENV: "absolute path of a trusted resolve_workspace(launch_cwd) file",
    RESULT_MODE_ENV: "content (default) or structured",
    TOKEN_ENV: "bearer token for HTTP",
    SPARE_KERNELS_ENV: f"warm spare kernels for HTTP (default {DEFAULT_SPARE_KERNELS})",
    MAX_BODY_ENV: f"HTTP request body limit in bytes (default {DEFAULT_MAX_BODY})",
    MAX_CONNECTIONS_ENV: f"concurrent HTTP connections (default {DEFAULT_MAX_CONNECTIONS})",
    LEASE_MODE_ENV: "HTTP lease mode: activity (default), ping or connection",
    STARTUP_ENV: "absolute path of a trusted Python file every kernel runs first",
    MAX_KERNELS_ENV: f"kernels at most, spares included (default {DEFAULT_MAX_KERNELS})",
    EVICT_IDLE_ENV: f"a private kernel idle this long may be evicted at the cap "
                    f"(default {DEFAULT_EVICT_IDLE_SECONDS:g})",
    SEARCH_TIMEOUT_ENV: f"seconds a search may run (default {DEFAULT_SEARCH_TIMEOUT:g})",
    OUTPUT_DIR_ENV: "keep output files in this directory (--output-dir; default a private temporary one)",
    INSPECTORS_ENV: "a Python file of cell inspectors loaded into IPython kernels (--inspectors)",
    **{variable: f"lease policy {name}" for name, variable in LEASE_WINDOW_ENVS.items()},
    GATEWAY_URL_ENV: "run kernels on this Jupyter Kernel/Enterprise Gateway (--gateway)",
    GATEWAY_TOKEN_ENV: "the gateway's token (--gateway-token)",
    GATEWAY_KERNEL_NAME_ENV: "the kernelspec started on the gateway (default python3)",
    GATEWAY_CA_FILE_ENV: "CA file for an https:// gateway",
    PUBLIC_URL_ENV: "the server's URL as kernels reach it (--public-url)",
    NOTEBOOK_ENV: "mirror stdio's kernel to this notebook file (--notebook)",
    NOTEBOOK_DIR_ENV: "over HTTP, mirror each kernel to a notebook in this directory (--notebook-dir)",
    EXISTING_ENV: "work in this running kernel: a Jupyter connection file (--existing)",
    KERNELSPEC_ENV: "start kernels from this installed kernelspec (--kernelspec)",
    "JUPYTER_RUNTIME_DIR": "where bare connection-file names are looked up",
    "JUPYTER_PATH": "more directories whose kernels/ hold kernelspecs",
}


class StartupError(Exception):
    pass


@dataclass
class Settings:
    """Everything loommux reads from its command line and environment, read in one place."""

    workspace: Path
    workspace_resolution: str = "launch_cwd"  # or explicit_config
    result_mode: str = "content"  # or structured
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    path: str = DEFAULT_PATH
    token: str | None = None
    spare_kernels: int = DEFAULT_SPARE_KERNELS
    max_body: int = DEFAULT_MAX_BODY
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    search_timeout: float = DEFAULT_SEARCH_TIMEOUT
    lease_policy: LeasePolicy = field(default_factory=LeasePolicy)
    kernel_environ: dict[str, str] = field(default_factory=dict)  # what kernels inherit
    startup: Path | None = None  # a trusted Python file every kernel runs before its resource's first cell
    inspectors: Path | None = None  # a trusted Python file of cell inspectors, loaded into IPython kernels
    max_kernels: int = DEFAULT_MAX_KERNELS
    evict_idle_seconds: float = DEFAULT_EVICT_IDLE_SECONDS
    gateway: Gateway | None = None  # where kernels run when not here
    public_url: str | None = None  # the server's URL as kernels reach it, when not the bound address
    instance: str = ""  # the name the ids it mints carry ("": its state's, else a random one, given at start)
    several: bool = False  # a server named with --instance: one of several instances behind a proxy
    state_dir: Path | None = None  # where the instance keeps its gateway kernels over a restart
    output_dir: Path | None = None  # where output files go (None: the temporary directory, or state_dir)
    output: OutputDirectory | None = None  # the server's own output directory, made at start (None: memory)
    notebook: Path | None = None  # stdio's kernel is mirrored to this notebook file
    notebook_dir: Path | None = None  # over HTTP, each resource to a notebook file in this directory
    # Kernels not of this interpreter's ipykernel, by resource name (None: stdio's kernel, all kernels' spec)
    existing: dict[str | None, KernelSource] = field(default_factory=dict)
    kernelspecs: dict[str | None, KernelSpec] = field(default_factory=dict)


def read_env_int(environ: dict[str, str], name: str, default: int, minimum: int) -> int:
    value = environ.get(name)
    if value is None or value == "":
        return default
    if not value.strip().isdecimal() or int(value) < minimum:
        raise StartupError(f"{name}={value}: must be a whole number of at least {minimum}")
    return int(value)


def read_env_seconds(environ: dict[str, str], name: str, default: float, zero_allowed: bool = False) -> float:
    value = environ.get(name)
    if value is None or value == "":
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not (0 <= seconds if zero_allowed else 0 < seconds) or not seconds < math.inf:
        raise StartupError(f"{name}={value}: must be a {'' if zero_allowed else 'positive '}number of "
                           "seconds")
    return seconds


def read_lease_policy(environ: dict[str, str]) -> LeasePolicy:
    policy = LeasePolicy(mode=environ.get(LEASE_MODE_ENV) or "activity")
    for name, variable in LEASE_WINDOW_ENVS.items():
        if environ.get(variable):
            try:
                setattr(policy, name, float(environ[variable]))
            except ValueError:
                raise StartupError(f"{variable}={environ[variable]}: must be a number of seconds") from None
    try:
        policy.check()
    except ValueError as exc:
        name = str(exc).split(":", 1)[0]
        raise StartupError(f"{LEASE_WINDOW_ENVS.get(name, LEASE_MODE_ENV)}: {exc}") from None
    return policy


def read_settings(environ: dict[str, str], launch_cwd: Path, args: argparse.Namespace) -> Settings:
    """Build the settings; a command-line option wins over its environment variable."""
    result_mode = args.result_mode or environ.get(RESULT_MODE_ENV) or "content"
    if result_mode not in RESULT_MODES:
        raise StartupError(f"{RESULT_MODE_ENV}={result_mode}: the result mode is content or structured")
    if not args.path.startswith("/"):
        raise StartupError(f"--path {args.path}: the endpoint path must start with /")
    settings = Settings(
        launch_cwd,
        result_mode=result_mode,
        host=args.host,
        port=args.port,
        path=args.path,
        token=args.token or environ.get(TOKEN_ENV) or None,
        spare_kernels=read_env_int(environ, SPARE_KERNELS_ENV, DEFAULT_SPARE_KERNELS, 0),
        max_body=read_env_int(environ, MAX_BODY_ENV, DEFAULT_MAX_BODY, 1024),
        max_connections=read_env_int(environ, MAX_CONNECTIONS_ENV, DEFAULT_MAX_CONNECTIONS, 1),
        search_timeout=read_env_seconds(environ, SEARCH_TIMEOUT_ENV, DEFAULT_SEARCH_TIMEOUT),
        lease_policy=read_lease_policy(environ),
        kernel_environ=make_kernel_environ(environ),
        startup=read_startup_file(args.startup or environ.get(STARTUP_ENV)),
        inspectors=find_inspectors_file(args.inspectors or environ.get(INSPECTORS_ENV), environ, launch_cwd),
        max_kernels=read_env_int(environ, MAX_KERNELS_ENV, DEFAULT_MAX_KERNELS, 1),
        evict_idle_seconds=read_env_seconds(environ, EVICT_IDLE_ENV, DEFAULT_EVICT_IDLE_SECONDS,
                                       zero_allowed=True),
        gateway=read_gateway(environ, args),
        public_url=parse_http_url(args.public_url or environ.get(PUBLIC_URL_ENV),
                            f"--public-url / {PUBLIC_URL_ENV}"),
        instance=read_instance_name(args.instance or environ.get(INSTANCE_ENV)),
        several=bool(args.server and (args.instance or environ.get(INSTANCE_ENV))),
        state_dir=open_state_directory(args.state_dir or environ.get(STATE_DIR_ENV), launch_cwd, args.server),
        output_dir=open_output_parent(args.output_dir or environ.get(OUTPUT_DIR_ENV), launch_cwd),
    )
    if settings.state_dir is not None and settings.output_dir is not None:
        log(f"--output-dir / {OUTPUT_DIR_ENV} {settings.output_dir} is not used: with --state-dir, output "
            f"is kept in {settings.state_dir / OUTPUT_KEPT}")
    if settings.state_dir is not None and settings.gateway is not None:
        settings.spare_kernels = 0  # a spare: a gateway kernel no resource holds, which the state cannot keep
    settings.notebook, settings.notebook_dir = read_notebook_targets(environ, launch_cwd, args)
    runtime_dir, jupyter_path = find_jupyter_dirs(environ)
    existing = args.existing or read_env_list(environ, EXISTING_ENV)
    settings.existing = read_existing(existing, args.server, runtime_dir)
    specs = args.kernelspec or read_env_list(environ, KERNELSPEC_ENV)
    if settings.gateway is not None and specs:  # the gateway's kernel name
        settings.gateway.kernel_name = specs[-1]
    else:
        settings.kernelspecs = read_kernelspecs(specs, args.server, jupyter_path)
    config = environ.get(WORKSPACE_CONFIG_ENV)
    if config:
        settings.workspace = resolve_workspace(Path(config), launch_cwd)
        settings.workspace_resolution = "explicit_config"
    return settings


def read_instance_name(value: str | None) -> str:
    """The instance's name (--instance / LOOMMUX_INSTANCE); "" when not set (the registry picks one)."""
    if not value:
        return ""
    if not INSTANCE_NAME_RE.fullmatch(value):
        raise StartupError(f"--instance / {INSTANCE_ENV} {value!r}: an instance name is {INSTANCE_NAME_RULE}")
    return value


def open_state_directory(value: str | None, launch_cwd: Path, server: bool) -> Path | None:
    """The instance's state directory (--state-dir / LOOMMUX_STATE_DIR), created (0700) when missing; one this
    user cannot write in, or that is not the user's alone (a link, another user's, one others may write in,
    or holding a link where loommux keeps a file), stops the server."""
    if not value:
        return None
    where = f"--state-dir / {STATE_DIR_ENV} {value}"
    if not server:
        raise StartupError(f"{where}: needs --server (a stdio server's kernel ends with its client)")
    directory = make_writable_directory(launch_cwd / value, where, STATE_DIR_MODE)
    problem = describe_unsafe_directory(directory)
    if problem is not None:
        raise StartupError(f"{where} {problem}: refused to start; the state directory must be this user's "
                           "own, and no one else's to write in")
    for name in (STATE_LOCK, STATE_FILE, OUTPUT_KEPT):
        if (directory / name).is_symlink():
            raise StartupError(f"{where}: {directory / name} is a symbolic link: refused to start; loommux "
                               "never writes through one")
    return directory


def open_output_parent(value: str | None, launch_cwd: Path) -> Path | None:
    """The directory output files go in (--output-dir / LOOMMUX_OUTPUT_DIR), created when missing; one this
    user cannot write in, or that is another user's or others may write in without the sticky bit, stops
    the server."""
    if not value:
        return None
    where = f"--output-dir / {OUTPUT_DIR_ENV} {value}"
    directory = make_writable_directory(launch_cwd / value, where, OUTPUT_DIR_MODE)
    problem = describe_unsafe_directory(directory, shared=True)
    if problem is not None:
        raise StartupError(f"{where} {problem}: refused to start; it must be this user's own, or sticky (as "
                           "the system's temporary directory is)")
    return directory


def make_writable_directory(directory: Path, where: str, mode: int) -> Path:
    """A directory named by a setting (``where``), created when missing; StartupError, in one line, when it
    cannot be, or is not a directory this user can write in."""
    try:
        directory.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as exc:
        raise StartupError(f"{where}: cannot create it ({exc.strerror or exc}): refused to start") from None
    if not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK):
        raise StartupError(f"{where}: not a directory this user can write in: refused to start")
    return directory


def parse_http_url(value: str | None, where: str) -> str | None:
    """An http:// or https:// base URL without its trailing slash; None when not given."""
    if not value:
        return None
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise StartupError(f"{where} {value}: must be an http:// or https:// URL")
    return value.rstrip("/")


def read_gateway(environ: dict[str, str], args: argparse.Namespace) -> Gateway | None:
    """The gateway kernels run on (--gateway / LOOMMUX_GATEWAY_URL), or None for local kernels."""
    url = parse_http_url(args.gateway or environ.get(GATEWAY_URL_ENV), f"--gateway / {GATEWAY_URL_ENV}")
    if url is None:
        return None
    ca_file = environ.get(GATEWAY_CA_FILE_ENV) or None
    if ca_file is not None and not Path(ca_file).is_file():
        raise StartupError(f"{GATEWAY_CA_FILE_ENV}={ca_file}: no such file")
    token = args.gateway_token or environ.get(GATEWAY_TOKEN_ENV) or None
    if token is not None and not token.isprintable():  # a header value; an error would quote it
        raise StartupError(f"--gateway-token / {GATEWAY_TOKEN_ENV}: must be printable characters")
    forwarded = {name: value for name, value in make_kernel_environ(environ).items()
                 if name.startswith(GATEWAY_KERNEL_ENV_PREFIX)}
    return Gateway(url, token, environ.get(GATEWAY_KERNEL_NAME_ENV) or "python3",
                   Path(ca_file) if ca_file else None, forwarded)


def read_notebook_targets(environ: dict[str, str], launch_cwd: Path,
                     args: argparse.Namespace) -> tuple[Path | None, Path | None]:
    """Where notebooks are mirrored: stdio's kernel to a file (--notebook), or, with --server, each resource
    to a file in a directory (--notebook-dir); a path that cannot be written, or a file loommux did not
    write, stops the server."""
    path = args.notebook or environ.get(NOTEBOOK_ENV)
    directory = args.notebook_dir or environ.get(NOTEBOOK_DIR_ENV)
    if path and args.server:
        raise StartupError(f"--notebook / {NOTEBOOK_ENV} mirrors stdio's kernel; with --server, use "
                           "--notebook-dir DIR")
    if directory and not args.server:
        raise StartupError(f"--notebook-dir / {NOTEBOOK_DIR_ENV} needs --server; for stdio's kernel, use "
                           "--notebook PATH")
    if path:
        path = launch_cwd / path
        try:
            check_notebook_path(path)
        except NotebookRefused as exc:
            raise StartupError(f"--notebook / {NOTEBOOK_ENV} {path}: {exc}") from None
        return path, None
    if directory:
        directory = launch_cwd / directory
        if not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK):
            raise StartupError(f"--notebook-dir / {NOTEBOOK_DIR_ENV} {directory}: not a directory this user "
                               "can write in")
        return None, directory
    return None, None


def read_env_list(environ: dict[str, str], name: str) -> list[str]:
    """A variable standing for a repeatable option: one value, or NAME=VALUE pairs split at commas."""
    value = environ.get(name) or ""
    if "=" in value.split(",")[0]:
        return [part for part in value.split(",") if part]
    return [value] if value else []


def find_jupyter_dirs(environ: dict[str, str]) -> tuple[Path, list[Path]]:
    """Jupyter's runtime directory and its path (where kernelspecs are), as jupyter_core finds them."""
    home = Path(environ.get("HOME") or Path.home())
    default_data = home / "Library" / "Jupyter" if sys.platform == "darwin" else (
        Path(environ.get("XDG_DATA_HOME") or home / ".local" / "share") / "jupyter")
    data = Path(environ.get("JUPYTER_DATA_DIR") or default_data)
    runtime = Path(environ.get("JUPYTER_RUNTIME_DIR") or data / "runtime")
    extra = [Path(p) for p in environ.get("JUPYTER_PATH", "").split(os.pathsep) if p]
    system = [Path(sys.prefix, "share", "jupyter"), Path("/usr/local/share/jupyter"),
              Path("/usr/share/jupyter")]
    return runtime, list(dict.fromkeys([*extra, data, *system]))


def read_named_values(values: list[str], server: bool) -> dict[str | None, str]:
    """``--flag VALUE`` (stdio: the session's kernel; HTTP: every kernel) and, over HTTP, ``NAME=VALUE``."""
    named: dict[str | None, str] = {}
    for value in values:
        name, has_name, rest = value.partition("=")
        if server and has_name and RESOURCE_NAME_RE.fullmatch(name):
            named[name] = rest
        else:
            named[None] = value
    return named


def read_existing(values: list[str], server: bool, runtime_dir: Path) -> dict[str | None, KernelSource]:
    """The kernels a person has open that resources work in; a bad connection file stops stdio at once, and
    over HTTP only its resource is refused (each use says why)."""
    named = read_named_values(values, server)
    if server and None in named:
        raise StartupError(f"--existing {named[None]}: over HTTP, name the resource that works in it: "
                           "--existing NAME=FILE")
    for name, value in named.items():
        try:
            read_connection_file(value, runtime_dir)
        except KernelError as exc:
            if not server:
                raise StartupError(f"--existing / {EXISTING_ENV}: {exc}") from None
            log(f"--existing {name}={value}: {exc}; the resource {name} is refused until the file is fixed")
    return {name: KernelSource(existing=value, runtime_dir=runtime_dir) for name, value in named.items()}


def read_kernelspecs(values: list[str], server: bool,
                     jupyter_path: list[Path]) -> dict[str | None, KernelSpec]:
    """The installed kernelspecs kernels start from (an unknown name stops the server, listing those)."""
    try:
        return {name: find_kernelspec(value, jupyter_path)
                for name, value in read_named_values(values, server).items()}
    except KernelError as exc:
        raise StartupError(f"--kernelspec / {KERNELSPEC_ENV}: {exc}") from None


def make_kernel_environ(environ: dict[str, str]) -> dict[str, str]:
    """The environment kernels start with: never the server's or the gateway's token, and no identity of a
    kernel this server may itself run in (each kernel gets its own at adoption)."""
    private = (TOKEN_ENV, GATEWAY_TOKEN_ENV, KERNEL_ID_ENV, KERNEL_NAME_ENV, KERNEL_TOKEN_ENV,
               CONTROL_URL_ENV)
    return {name: value for name, value in environ.items() if name not in private}


def read_startup_file(value: str | None) -> Path | None:
    if not value:
        return None
    where = f"{STARTUP_ENV} / --startup {value}"
    path = Path(value)
    if not path.is_absolute():
        raise StartupError(f"{where}: the startup file must be named by an absolute path")
    if not path.is_file():
        raise StartupError(f"{where}: no such file")
    return path


def find_inspectors_file(value: str | None, environ: dict[str, str], launch_cwd: Path) -> Path | None:
    """The cell inspectors file (--inspectors / LOOMMUX_INSPECTORS), which must exist; else
    $XDG_CONFIG_HOME/loommux/inspectors.py when it exists."""
    if value:
        path = launch_cwd / value
        if not path.is_file():
            raise StartupError(f"--inspectors / {INSPECTORS_ENV} {value}: no such file")
        return path
    config = Path(environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    default = config / INSPECTORS_DEFAULT
    return default if default.is_file() else None


def resolve_workspace(config: Path, launch_cwd: Path) -> Path:
    """Run the trusted resolver file named by LOOMMUX_WORKSPACE_CONFIG; any failure stops startup."""
    where = f"{WORKSPACE_CONFIG_ENV}={config}"
    if not config.is_absolute():
        raise StartupError(f"{where}: must be an absolute path to a Python file")
    if not config.is_file():
        raise StartupError(f"{where}: no such file")
    try:
        spec = importlib.util.spec_from_file_location("_loommux_workspace_config", config)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the trusted file may raise anything
        raise StartupError(f"{where}: loading it failed: {type(exc).__name__}: {exc}") from None
    resolver = getattr(module, "resolve_workspace", None)
    if not callable(resolver):
        raise StartupError(f"{where}: it defines no function resolve_workspace(launch_cwd)")
    try:
        result = resolver(launch_cwd)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the trusted file may raise anything
        raise StartupError(f"{where}: resolve_workspace raised {type(exc).__name__}: {exc}") from None
    if not isinstance(result, (str, os.PathLike)) or not str(result):
        raise StartupError(f"{where}: resolve_workspace returned {result!r}, not a path")
    workspace = (launch_cwd / result).resolve()
    if not workspace.is_dir():
        raise StartupError(f"{where}: resolve_workspace returned {result!r}, which is not an existing "
                           "directory")
    return workspace


def check_runtime_packages() -> None:
    """Stop with one line naming a missing runtime package and how to install it."""
    for module, package in RUNTIME_PACKAGES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise StartupError(f"the Python package {package} is missing from {sys.executable}; install it "
                               f"with: {sys.executable} -m pip install {package}")


def describe_stdio_hint() -> str:
    """What a person who started the stdio server in a terminal needs to know."""
    command = f"{sys.executable} {Path(__file__).resolve()}"
    return (f"this is an MCP server speaking JSON-RPC on stdio, waiting for an MCP host to talk to it. "
            f"Add it to a host instead, e.g. claude mcp add loommux -- {command} "
            "(or serve HTTP with --server; --help for more). Ctrl-C to quit.")


def pin_mmap_threshold() -> None:
    """Have glibc give every large block back to the system when it is freed.

    glibc raises its mmap threshold to the size of any large block freed (up to 32 MiB): after the
    first big IOPub message, the transient copies of the next ones (frames, decoded text) come from
    the heap and stay in the process once freed, doubling the memory a big output costs. A pinned
    threshold keeps large blocks in mappings of their own. Elsewhere (no mallopt) nothing changes.
    """
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


def parse_command_line(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's options (the environment is read_settings' part)."""
    variables = "\n".join(f"  {name:34} {meaning}" for name, meaning in ENVIRONMENT_HELP.items())
    parser = argparse.ArgumentParser(
        prog="loommux",
        description="An MCP server that gives AI agents a persistent, inspectable IPython kernel, over\n"
                    "stdio (the default: one private kernel for the MCP host that starts it) or\n"
                    "Streamable HTTP (--server: sessions with private or shared kernels, and a console).",
        epilog=f"environment variables (README.md, 'Environment variables', has the details):\n{variables}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"loommux {__version__}")
    parser.add_argument("--result-mode", choices=RESULT_MODES,
                        help=f"structured adds outputSchema and structuredContent (env {RESULT_MODE_ENV})")
    parser.add_argument("--server", action="store_true", help="serve MCP Streamable HTTP instead of stdio")
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"HTTP address to bind (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help=f"HTTP port, 0 for any (default {DEFAULT_PORT})")
    parser.add_argument("--path", default=DEFAULT_PATH,
                        help=f"the MCP endpoint path (default {DEFAULT_PATH})")
    parser.add_argument("--token", help=f"require Authorization: Bearer TOKEN over HTTP (env {TOKEN_ENV})")
    parser.add_argument("--gateway", metavar="URL", help="run kernels on this Jupyter Kernel Gateway or "
                        f"Enterprise Gateway (env {GATEWAY_URL_ENV})")
    parser.add_argument("--gateway-token", metavar="TOKEN", help="sent to the gateway as Authorization: "
                        f"token TOKEN (env {GATEWAY_TOKEN_ENV})")
    parser.add_argument("--instance", metavar="NAME", help="this instance's name, carried by every kernel "
                        "handle, session id and task id it mints, for a proxy in front of several instances "
                        f"(env {INSTANCE_ENV}; default a random one, or the one its --state-dir recorded)")
    parser.add_argument("--state-dir", metavar="DIR", help="with --server: keep this instance's gateway "
                        "kernels, their handles, leases and sessions over a restart, in DIR/state.json "
                        f"(DIR must be this user's alone; env {STATE_DIR_ENV})")
    parser.add_argument("--output-dir", metavar="DIR", help="keep what cells print in files in DIR (made "
                        "when missing; the server's files are removed when it exits; default a private "
                        f"directory in the temporary directory; env {OUTPUT_DIR_ENV})")
    parser.add_argument("--public-url", metavar="URL", help="this server's URL as kernels reach it, when not "
                        f"the bound address (env {PUBLIC_URL_ENV})")
    parser.add_argument("--startup", metavar="PATH", help="a trusted Python file every kernel runs in its "
                        f"namespace before its first cell and after each restart (env {STARTUP_ENV})")
    parser.add_argument("--inspectors", metavar="FILE", help="a trusted Python file whose @loommux.inspector "
                        "functions see each cell before it runs, in IPython kernels (env "
                        f"{INSPECTORS_ENV}; default $XDG_CONFIG_HOME/loommux/inspectors.py when it exists)")
    parser.add_argument("--notebook", metavar="PATH", help="keep stdio's kernel as a notebook (.ipynb) in "
                        f"this file, up to date while it works (env {NOTEBOOK_ENV})")
    parser.add_argument("--notebook-dir", metavar="DIR", help="with --server: keep each kernel as a notebook "
                        f"DIR/NAME.ipynb or DIR/private-<id>.ipynb (env {NOTEBOOK_DIR_ENV})")
    parser.add_argument("--existing", metavar="FILE", action="append",
                        help="work in this running kernel (a Jupyter connection file: a path, or a name or "
                        "glob in the runtime directory); over HTTP NAME=FILE binds the resource NAME, "
                        f"repeatable (env {EXISTING_ENV})")
    parser.add_argument("--kernelspec", metavar="SPEC", action="append",
                        help="start kernels from this installed kernelspec; over HTTP NAME=SPEC binds the "
                        f"resource NAME, repeatable (env {KERNELSPEC_ENV})")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_command_line(argv)
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    pin_mmap_threshold()
    try:
        check_runtime_packages()
        settings = read_settings(dict(os.environ), Path.cwd(), args)
        settings.output = open_output_directory(settings.output_dir, settings.state_dir)
    except StartupError as exc:
        log(str(exc))
        sys.exit(2)
    threading.Thread(target=remove_stale_kernel_dirs, name="stale kernel dirs", daemon=True).start()
    if not args.server and sys.stdin.isatty():
        log(describe_stdio_hint())
    if args.server:
        code = asyncio.run(serve_http(settings, API_ROUTES))
        settings.output.close()  # after the notebooks' last writes, which read it
        sys.exit(code)
    code = asyncio.run(serve_stdio(settings))
    settings.output.close()
    # Everything the server started is gone now, and an MCP host stopping it may be counting (SIGTERM after
    # 100 ms): the interpreter's teardown, freeing every module and object (~25 ms), is skipped.
    _kill_leftover_kernels()  # the one exit handler that matters, had a kernel survived
    sys.stderr.flush()
    os._exit(code)


# The published loommux is a package; these are its import paths, served by this one file: ``from
# loommux.client import LeaseAwareClient``, ``from loommux.daemon import Daemon`` and ``import
# loommux.daemon``. Registered in sys.modules, they are found before any search for a submodule.
PUBLISHED_SUBMODULES = {
    "client": ("LeaseAwareClient", "StalePolicy"),
    "daemon": ("Daemon", "DaemonError", "ForwardedCellError", "Job", "KernelHandle", "KernelList"),
}


def register_submodules() -> None:
    this = sys.modules[__name__]
    for name, exported in PUBLISHED_SUBMODULES.items():
        module = types.ModuleType(f"{__name__}.{name}", f"loommux's {name} API (one file: {__file__})")
        module.__dict__.update({attribute: getattr(this, attribute) for attribute in exported})
        module.__all__ = list(exported)
        sys.modules[module.__name__] = module
        setattr(this, name, module)


if __name__ == "__main__":
    main()
else:
    register_submodules()
