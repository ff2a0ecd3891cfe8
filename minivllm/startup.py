"""Start-up progress: a line as each phase of an engine's start that can take a second or more
begins (imports, a GGUF's first conversion, the kernels' build, tokenizer, weights, the
compiled step, speculation's timed steps) and one with its time as it ends, on the
`minivllm.startup` logger.

The command line and the server's engine process show them (`show_progress`), so a start is
never a silent wait (a first start of a large-vocabulary GGUF takes ~15 s here); a program on
the Python API sees them only if it configures logging, as with any library's INFO lines.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger("minivllm.startup")


@contextmanager
def phase(what: str) -> Iterator[None]:
    """Log `what` as it begins and its seconds as it ends (an error says why it did not)."""
    logger.info("%s ...", what)
    start = time.perf_counter()
    yield
    logger.info("%s: %.1f s", what, time.perf_counter() - start)


def show_progress() -> None:
    """Show the start-up lines whatever the root logger's level (the root's handlers print
    them; `--verbose` shows every INFO line besides)."""
    logger.setLevel(logging.INFO)
