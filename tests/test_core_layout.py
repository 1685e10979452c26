"""The C core's calls go one way.

The engine and batches drive the transports through their tables of operations
(``fmc_transport_ops``), never by name; transports report back through
``engine/fmc_completion.c`` alone; the Mooncake framing is handed the server's operations
instead of calling it.  This test reads ``_cffi_build/src`` as text, maps every function a file
defines (not ``static``) to that file, and fails if the files' calls to each other form a circle:
a change that makes two parts depend on each other again shows up here, with the circle named.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "_cffi_build" / "src"
TRANSPORT_DIRS = ("tcp", "samehost", "mooncake")  # the parts behind fmc_transport_ops
DEFINITION = re.compile(r"^(?!static)[a-zA-Z_][\w\s\*]*?\b(fmc_\w+)\s*\([^;{]*\)\s*\{", re.M)


def call_graph() -> dict[str, set[str]]:
    """File name -> the files whose functions it calls."""
    sources = {p.name: p.read_text() for p in sorted(SRC.glob("*/*.c"))}
    defined = {name: file for file, text in sources.items() for name in DEFINITION.findall(text)}
    calls = re.compile(r"\b(" + "|".join(sorted(defined, key=len, reverse=True)) + r")\s*\(")
    graph: dict[str, set[str]] = defaultdict(set)
    for file, text in sources.items():
        for name in set(calls.findall(text)):
            if defined[name] != file:
                graph[file].add(defined[name])
    return graph


def transport_files() -> set[str]:
    return {p.name for d in TRANSPORT_DIRS for p in (SRC / d).glob("*.c")}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_graph_is_read_at_all():
    graph = call_graph()
    assert "fmc_completion.c" in graph["fmc_stream.c"]  # transports report through completions
    assert "fmc_stream.c" in graph["fmc_tcp_transport.c"]  # the TCP transport drives the streams
    assert "fmc_samehost.c" in graph["fmc_samehost_transport.c"]
    assert {"fmc_tcp_transport.c", "fmc_samehost_transport.c", "fmc_stream.c"} <= transport_files()


def test_batches_drive_transports_only_through_their_tables():
    graph = call_graph()
    assert graph["fmc_batch.c"], "fmc_batch.c calls nothing: the graph was not read"
    called = sorted(graph["fmc_batch.c"] & transport_files())
    assert not called, "fmc_batch.c calls transport files by name: " + ", ".join(called)


def test_transports_never_call_the_batches_that_drive_them():
    graph = call_graph()
    callers = sorted(f for f in transport_files() if "fmc_batch.c" in graph.get(f, ()))
    assert not callers, "transport files call fmc_batch.c: " + ", ".join(callers)


def test_no_two_parts_of_the_core_call_each_other_in_a_circle():
    cycle = find_cycle(call_graph())
    assert cycle is None, "the C core's files call each other in a circle: " + " -> ".join(cycle or [])


def test_a_circle_would_be_found():
    assert find_cycle({"a.c": {"b.c"}, "b.c": {"c.c"}, "c.c": {"a.c"}}) == ["a.c", "b.c", "c.c", "a.c"]
    assert find_cycle({"a.c": {"b.c"}, "b.c": set()}) is None
