"""tinygrad's compiled kernels kept on disk whole, not only their machine code.

tinygrad turns each kernel's AST into a program (optimise, linearise, render C, compile) and keeps the result
in memory for the process; on disk (its kernel cache, `CACHEDB`) it keeps only the compiler's output, keyed
by the rendered source. So every new process renders every kernel again before it can look it up: on a CPU
that is most of the seconds a stage spends capturing a jitted graph, paid again by each daemon and each
`swarmd run`. `keep_compiled_programs_on_disk()` puts the whole program in the same cache, under the same
key tinygrad uses in memory (the AST and the settings that change the code), so a process finds what any
other process built. Processes that miss the same kernel at once (daemons of one host loading alike stages)
build it once: the first takes a file lock for its key, the others wait on it and then read what it stored.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import pickle
import sqlite3
import threading
from collections.abc import Iterator
from importlib.metadata import version
from typing import Any

log = logging.getLogger("models.program_cache")

TABLE = "swarmd_program"
LOCK_STRIPES = 256  # lock files beside the kernel cache; two kernels share one with odds 1/256
_installed = False
_lock = threading.Lock()


def keep_compiled_programs_on_disk() -> None:
    """Make tinygrad look each kernel's program up in its disk cache before building it, and store what it
    builds there (once per process; tinygrad's CACHELEVEL=0 turns it off, as it does the kernel cache)."""
    global _installed
    with _lock:
        if _installed:
            return
        import tinygrad.codegen as codegen
        import tinygrad.engine.realize as realize
        from tinygrad.helpers import diskcache_get, diskcache_put

        build = codegen.to_program
        tinygrad_version = version("tinygrad")

        def settings() -> tuple[Any, ...]:  # what tinygrad's own in-memory key holds besides the AST
            return tuple(x.value for x in (codegen.NOOPT, codegen.EMULATED_DTYPES, codegen.NOLOCALS, codegen.USE_TC,
                                           codegen.IMAGE, codegen.DISABLE_FAST_IDIV, codegen.TRANSCENDENTAL,
                                           codegen.ALLOW_TF32))

        def to_program(ast: Any, renderer: Any) -> Any:
            key = (ast.key, type(renderer), renderer.target, *settings())
            if (prg := codegen.to_program_cache.get(key)) is not None:
                return prg
            disk_key = hashlib.sha256(repr((tinygrad_version, ast.key.hex(), ast.tag is None,
                                            type(renderer).__qualname__, renderer.target, *settings())).encode()).hexdigest()
            prg = stored(disk_key)
            if prg is None:
                with _building(disk_key):
                    prg = stored(disk_key)  # built by another process while this one waited
                    if prg is None:
                        prg = build(ast, renderer)
                        try:
                            diskcache_put(TABLE, disk_key, prg)
                        except (sqlite3.Error, pickle.PicklingError, AttributeError, TypeError, RecursionError) as e:
                            log.debug("kernel program not cached (%s)", e)
            codegen.to_program_cache[key] = prg
            return prg

        def stored(disk_key: str) -> Any:
            try:
                return diskcache_get(TABLE, disk_key)
            except (sqlite3.Error, pickle.UnpicklingError, EOFError, AttributeError, TypeError, RecursionError) as e:
                log.debug("kernel program cache unreadable (%s): building the program", e)
                return None

        realize.to_program = to_program  # realize imported the function by name: its reference is the one used
        _installed = True


@contextlib.contextmanager
def _building(disk_key: str) -> Iterator[None]:
    """Held while this process builds the kernel `disk_key` (an exclusive lock on one of the stripes beside
    tinygrad's kernel cache); without a cache on disk, or where the lock cannot be had, nothing is held."""
    from tinygrad.helpers import CACHEDB, CACHELEVEL

    if CACHELEVEL < 1:
        yield
        return
    stripe = int(disk_key[:8], 16) % LOCK_STRIPES
    path = os.path.join(f"{CACHEDB}.locks", f"{stripe:03d}")
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        log.debug("no kernel build lock (%s): building without one", e)
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock
