"""What the `jaxkv` and `jaxkv-demo` commands share: their `--help`, quiet start-up logging,
a progress display that suits the output stream, and a clear error when the imported jaxkv
has no compiled modules.

Example:
  >>> import io
  >>> out = io.StringIO()
  >>> show = Progress(2, stream=out)  # a StringIO is no terminal: plain lines
  >>> show(1, "1/2 requests")
  >>> show(1, "1/2 requests")  # unchanged: nothing written
  >>> out.getvalue().startswith("[progress] 1/2 requests")
  True
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import time
from typing import IO

from absl import flags

__all__ = [
    "Progress",
    "check_compiled_modules",
    "quiet_startup_logging",
    "show_module_flags_in_help",
]


def show_module_flags_in_help(module_name: str, doc: str | None) -> None:
    """Makes `--help` list the flags `module_name` defines (with their help) and `doc`.

    absl's `--help` prints the key flags of the main module, which it names by
    ``sys.argv[0]``; a console script or ``python -m`` entry point defines none itself (its
    flags live in the module that `module_name` names), so `--help` would only say "Try
    --helpfull". This registers them as key flags of ``sys.argv[0]`` and, when the main
    module has no docstring of its own (a console script), gives it `doc` for the usage text.

    Args:
      module_name: the module whose flags to show, e.g. ``"jaxkv.demo._cli"``.
      doc: the usage text (the command's module docstring).
    """
    main_name = sys.argv[0] if sys.argv else "__main__"
    for flag in flags.FLAGS.get_flags_for_module(module_name):
        flags.FLAGS.register_key_flag_for_module(main_name, flag)
    main = sys.modules.get("__main__")
    if main is not None and doc and not (main.__doc__ or "").strip():
        main.__doc__ = doc


class _DropBackendProbeFailures(logging.Filter):
    """Drops JAX's "Unable to initialize backend 'tpu'" lines (it probes every platform whose
    plugin is importable; on a machine without one that is expected, not news)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Unable to initialize backend")


_PROBE_FILTER = _DropBackendProbeFailures()


def quiet_startup_logging(verbosity_given: bool) -> None:
    """Silences the start-up noise of JAX and NIXL unless the user asked for verbosity.

    JAX's failed backend probes are dropped always (they are INFO lines about platforms that
    are absent); without an explicit ``--verbosity``, absl logs warnings and up only and NIXL
    (which reads ``NIXL_LOG_LEVEL``, in this and in child processes) warnings and up.

    Args:
      verbosity_given: whether ``--verbosity`` (``-v``) was on the command line.
    """
    probe_logger = logging.getLogger("jax._src.xla_bridge")
    if _PROBE_FILTER not in probe_logger.filters:
        probe_logger.addFilter(_PROBE_FILTER)
    if not verbosity_given:
        from absl import logging as absl_logging

        absl_logging.set_verbosity(absl_logging.WARNING)
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


def check_compiled_modules() -> None:
    """Exits with a message that names the cause when the imported jaxkv lacks its compiled
    CPU module, the case of a source tree that shadows the installed package.

    Raises:
      SystemExit: ``jaxkv._ffi_cpu`` cannot be found next to the imported ``jaxkv``.
    """
    if importlib.util.find_spec("jaxkv._ffi_cpu") is not None:
        return
    import jaxkv

    where = os.path.dirname(os.path.abspath(jaxkv.__file__ or "jaxkv"))
    shadowed = os.path.abspath(os.getcwd()) == os.path.dirname(where)
    hint = (
        "it is the source tree in the current directory, which shadows an installed jaxkv: "
        "run from another directory, use `python -P`, or install jaxkv for development with "
        "`bash scripts/setup.sh` (an editable install: `pip install --no-build-isolation -e .`)"
        if shadowed else
        "install jaxkv with `pip install .` (it builds the custom calls with CMake)"
    )
    sys.exit(f"error: jaxkv imported from {where} has no compiled module jaxkv._ffi_cpu; "
             f"{hint}")


class Progress:
    """Shows progress on a stream (stderr by default): a bar redrawn in place with ``\\r`` on
    a terminal, otherwise one plain line whenever the state changes (logs and pipes get no
    control characters).

    Args:
      total: the count that means finished.
      stream: where to write; None means ``sys.stderr``.
      enabled: False writes nothing.
      width: characters of the bar.
    """

    def __init__(self, total: int, stream: IO[str] | None = None, enabled: bool = True,
                 width: int = 30):
        self.total, self.enabled, self.width = max(total, 1), enabled, width
        self.stream = sys.stderr if stream is None else stream
        isatty = getattr(self.stream, "isatty", None)
        self.terminal = bool(isatty and isatty())
        self.start = time.monotonic()
        self._last: str | None = None

    def __call__(self, done: int, text: str) -> None:
        """Shows `done` of `total` with `text`; a plain line only when `text` changed."""
        if not self.enabled:
            return
        elapsed = f"{time.monotonic() - self.start:5.1f}s"
        if self.terminal:
            filled = int(self.width * min(done, self.total) / self.total)
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r[{bar}] {text} {elapsed}")
            if done >= self.total:
                self.stream.write("\n")
        elif text != self._last:
            self.stream.write(f"[progress] {text} {elapsed.strip()}\n")
        self._last = text
        self.stream.flush()
