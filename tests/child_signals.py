"""For tests that send Ctrl-C (SIGINT) to a child process."""

from __future__ import annotations

import signal


def default_sigint() -> None:
    """``preexec_fn`` for such children: SIGINT's default action, so the child's Python raises
    KeyboardInterrupt even where the test itself runs with SIGINT ignored (a shell's background
    job inherits an ignored SIGINT, and so would every child)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
