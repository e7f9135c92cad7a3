"""llama.cpp's own log lines, filtered by the llama.cpp runtime's ``verbose`` setting.

llama-cpp-python (0.3.36) installs a log callback that reads ggml's old level numbers (INFO 1,
WARN 2, ERROR 3), but the ggml it bundles numbers them NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4,
CONT 5 (ggml.h), so with ``verbose: false`` llama.cpp's warnings still print and its errors do not.
Every llama.cpp with the ``llama_memory_*`` API this runtime needs has those numbers. The callback
here reads them as ggml.h does and keeps llama-cpp-python's switch: its ``llama-cpp-python``
logger's level, which ``set_verbose`` (and ``Llama(verbose=...)``) set to DEBUG or ERROR.
``llama_log_set`` reaches llama.cpp's own lines (model load, context, decode); in llama-cpp-python
0.3.36 it leaves ggml's logger (its backends' lines) on ggml's default printer, as before.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from typing import Any

GGML_LOG_LEVEL_CONT = 5  # continues the previous line, at its level
_LEVELS = {0: logging.CRITICAL, 1: logging.DEBUG, 2: logging.INFO, 3: logging.WARNING, 4: logging.ERROR}

_last_level = logging.CRITICAL  # the level a CONT piece continues
_callback: Any = None  # the installed ctypes callback: llama.cpp keeps its pointer for the process's life


def _threshold() -> int:
    """The level llama-cpp-python's logger passes (NOTSET before any set_verbose: everything)."""
    return logging.getLogger("llama-cpp-python").level


def on_log(level: int, text: bytes | None, user_data: Any = None) -> None:
    """Print one llama.cpp log piece to stderr when its level passes the logger's."""
    global _last_level
    mapped = _last_level if level == GGML_LOG_LEVEL_CONT else _LEVELS.get(level, logging.CRITICAL)
    _last_level = mapped
    if text and _threshold() <= mapped:
        print(text.decode("utf-8", errors="replace"), end="", flush=True, file=sys.stderr)


def set_log_verbosity(L: Any, verbose: bool) -> None:
    """Show llama.cpp's logs (``verbose``) or only its errors; installs the callback once."""
    global _callback
    try:  # imported before ours is installed: importing it installs llama-cpp-python's own callback
        from llama_cpp._logger import set_verbose
    except ImportError:  # older packages: logs stay on
        return
    set_verbose(verbose)
    if _callback is None:
        _callback = L.llama_log_callback(on_log)
        L.llama_log_set(_callback, ctypes.c_void_p(0))
