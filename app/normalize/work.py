"""What one normalization may cost: a count of the characters its scans and patterns examine, capped in
proportion to the text, and a flag that stops it (the client left). The count does not depend on the machine:
every pattern is matched only at the starts a cheap scan found and within a window the code bounds (the
regular expression engine cannot read past ``endpos``), and each window is counted whole."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

# the measured worst case is ~63 characters examined a character of text (docs/normalization.md); the cap leaves
# room above it, so that it refuses only a pattern that stopped being linear, never a text
WORK_PER_CHAR = 128
WORK_BASE = 16_384                 # a short text's fixed costs (its windows, a said match's words)
SAY_COST = 16                      # a match said in words: the library's call, counted as this many characters


class NormalizationError(Exception):
    """Normalization stopped before its end."""


class BudgetExceeded(NormalizationError):
    """The text took more work than its budget (``Work.limit``)."""


class Cancelled(NormalizationError):
    """Whoever asked for the normalization no longer waits for it (``Work.cancel`` was set)."""


@dataclass
class Work:
    """The work of one normalization: ``examined`` characters so far, refused past ``limit`` (None: no cap)
    with :class:`BudgetExceeded`, stopped with :class:`Cancelled` once ``cancel`` is set. Checked at each
    pattern's attempt, so a cancelled or over-budget normalization stops within one window."""

    limit: int | None = None
    cancel: threading.Event | None = None
    examined: int = 0
    said: int = 0                  # matches said in words
    per_rule: dict[str, int] = field(default_factory=dict)

    @classmethod
    def budget_for(cls, text: str, cancel: threading.Event | None = None) -> "Work":
        """The budget of a request's text: ``WORK_PER_CHAR`` characters examined a character, plus ``WORK_BASE``."""
        return cls(limit=WORK_PER_CHAR * len(text) + WORK_BASE, cancel=cancel)

    def charge(self, n: int) -> None:
        """Count ``n`` characters examined; raise if that is over the budget or the normalization is cancelled."""
        self.examined += n
        if self.limit is not None and self.examined > self.limit:
            raise BudgetExceeded(f"normalization examined over {self.limit} characters (the budget of this text)")
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled("normalization cancelled")
