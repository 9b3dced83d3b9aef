"""What a tenant reads of its job's log: the job's own lines and its one-line errors, without the
operator's internals.

Prefect logs a failure with its whole traceback: Prefect's, Ray's and the job's frames, each a path
on the operator's machine (the checkout, site-packages, the Python install, the state dir, home).
A tenant's copy of a line keeps what comes before its traceback and the error the traceback ends
with (`job x failed: RuntimeError: …`), names the operator's folders by what they are (`<state>`,
`<checkout>`, `<python>`, `<site-packages>`, `<models>`, `<tmp>`, `~`), and calls exceptions by
their class names (`JSONDecodeError`, not `json.decoder.JSONDecodeError`; Ray's too). One line stays
one line, so offsets into the log are the operator's too. The whole lines stay the operator's: the
Prefect UI, and `opentinker logs` (or the console) with the operator's access.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from opentinker.core.errors import plain

# Where a traceback starts: its header, or its first frame (Ray's errors print their frames bare).
_TRACEBACK = re.compile(r'^(?:(?:Traceback|Stack) \(most recent call last\):|[ \t]+File "[^"\n]*", line \d+)', re.M)
_PACKAGES = re.compile(r"/(?:site|dist)-packages(?![\w.-])")
_PATH_CHARS = re.compile(r"[^\s'\"()\[\]<>,;=`]")
# The module path before an exception's class (json.decoder.JSONDecodeError: JSONDecodeError), and
# before any name of Ray's; a match starts only where a dotted name does (linear on any text).
_MODULE_PATH = re.compile(r"(?<![\w.])(?:[a-z_]\w*\.)++(?=[A-Z]\w*(?:Error|Exception|Warning|Exit|Interrupt)\b)"
                          r"|(?<![\w.])ray(?:\.[a-z_]\w*)*+\.(?=[A-Z])")
_BETWEEN = ("Traceback (most recent call last):", "Stack (most recent call last):", "During handling of the above exception",
            "The above exception was the direct cause")
ONLY_A_TRACEBACK = "(a traceback: the operator's log has it)"


def operator_folders(settings: Any) -> list[tuple[re.Pattern[str], str]]:
    """(the folder as a whole path, its name for tenants), the longest folders first, so that a
    folder inside another (the virtualenv in the checkout, the state dir in /tmp) gets its own name."""
    import opentinker

    named = {str(Path(opentinker.__file__).resolve().parents[1]): "<checkout>", str(Path(tempfile.gettempdir()).resolve()): "<tmp>",
             str(Path.home()): "~", str(settings.state_dir): "<state>", str(settings.models_folder): "<models>"}
    for prefix in {sys.prefix, sys.base_prefix, sys.exec_prefix}:
        named[str(Path(prefix).resolve())] = named[prefix] = "<python>"
    folders = sorted((folder for folder in named if folder not in ("", "/")), key=len, reverse=True)
    return [(re.compile(r"(?<![\w.-])" + re.escape(folder) + r"(?![\w.-])"), named[folder]) for folder in folders]


def _without_packages_paths(text: str) -> str:
    """Each path into site-packages (any machine's: a job may run on another node) as `<site-packages>`."""
    out, done = [], 0
    for found in _PACKAGES.finditer(text):
        start = found.start()
        while start > done and _PATH_CHARS.match(text[start - 1]):  # back to where the path starts
            start -= 1
        out += [text[done:start], "<site-packages>"]
        done = found.end()
    return "".join(out) + text[done:]


def _error_line(traceback: str) -> str | None:
    """The exception's own line at the end of a traceback: its last line that is no frame, no code
    and no "During handling…" between two exceptions."""
    lines = [line.strip() for line in traceback.splitlines() if line.strip() and not line[:1].isspace()]
    lines = [line for line in lines if not line.startswith(_BETWEEN)]
    return lines[-1] if lines else None


def tenant_message(message: str, folders: list[tuple[re.Pattern[str], str]]) -> str:
    """`message` as a tenant reads it: up to its traceback, then the error the traceback ends with
    (unless the line says it already), colour codes gone, paths named."""
    text = plain(message)
    cut = _TRACEBACK.search(text)
    if cut:
        head, error = text[:cut.start()].rstrip(), _error_line(text[cut.start():])
        if error and (error.partition(": ")[2] or error) not in head:
            head = f"{head.rstrip(':')}: {error}" if head else error
        text = head or ONLY_A_TRACEBACK
    text = _without_packages_paths(text)
    for folder, name in folders:
        text = folder.sub(name, text)
    return _MODULE_PATH.sub("", text)


def tenant_lines(lines: list[dict[str, Any]], settings: Any) -> list[dict[str, Any]]:
    folders = operator_folders(settings)
    return [{**line, "message": tenant_message(line["message"], folders)} for line in lines]
