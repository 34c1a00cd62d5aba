"""What JAX compiles in this process while a test watches (`jax_log_compiles`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import jax

# JAX logs "Compiling jit(<name>) with global shapes ..." here when jax_log_compiles is on
_LOGGER = "jax._src.interpreters.pxla"


@contextlib.contextmanager
def recorded(when: Callable[[], bool] = lambda: True) -> Iterator[list[str]]:
    """Yields a list that collects ``"Compiling jit(<name>)"`` for every program compiled in
    this process inside the block while `when()` holds.

    Example:
      >>> with recorded() as compiled:
      ...     _ = jax.jit(lambda x: x + 1)(1)
      >>> compiled
      ['Compiling jit(<lambda>)']
    """
    compiled: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if message.startswith("Compiling ") and when():
                compiled.append(message.split(" with ")[0])

    handler = Handler(level=logging.WARNING)
    logger = logging.getLogger(_LOGGER)
    logger.addHandler(handler)
    previous = jax.config.jax_log_compiles
    jax.config.update("jax_log_compiles", True)
    try:
        yield compiled
    finally:
        jax.config.update("jax_log_compiles", previous)
        logger.removeHandler(handler)
