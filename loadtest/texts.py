"""Texts the load generator speaks, and how the WebSocket client splits them into LLM-like deltas."""

from __future__ import annotations

import re
from pathlib import Path

# Varied on purpose: short and long, questions, numbers, lists, quotes, abbreviations, a little non-ASCII.
BUILTIN_TEXTS = [
    "Hello! How can I help you today?",
    "Sure, I can do that.",
    "Your order number is 48213, and it should arrive on Thursday, the 14th of March.",
    "The weather tomorrow looks mostly sunny, with a high of 22 degrees and a light breeze from the west.",
    "Let me think about that for a second. Okay, here's what I found.",
    "To reset your password, open the settings page, choose Security, and then tap Reset Password.",
    "Did you mean the meeting at 3:30 PM, or the one that was moved to Friday morning?",
    "Welcome back. You have three new messages, two missed calls, and one reminder about Dr. Smith's appointment.",
    "In 1969, Apollo 11 landed on the Moon, and Neil Armstrong said: \"That's one small step for man, "
    "one giant leap for mankind.\"",
    "I'm sorry, I didn't quite catch that. Could you say it again, a little more slowly?",
    "First, preheat the oven to 180 degrees. Second, mix the flour, sugar and butter. Third, bake for 25 minutes.",
    "The quick brown fox jumps over the lazy dog, while the five boxing wizards jump quickly.",
    "Streaming speech synthesis lets a voice assistant start talking before the language model has finished "
    "writing its answer, which makes the conversation feel natural and responsive.",
    "Thanks for calling. Your estimated wait time is about four minutes.",
    "Café, naïve, résumé: a few words with accents, just to keep the tokenizer honest.",
    "Absolutely. Here's a quick summary: revenue grew by 12 percent, costs fell slightly, and the outlook for "
    "next quarter remains positive, although supply chain risks have not gone away entirely.",
    "Wait, really? That's amazing!",
    "Turn left in 200 meters, then continue straight for 1.5 kilometers until you reach the roundabout.",
    "The train to Boston departs from platform nine at 6:45, and it is currently running about ten minutes late.",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker who "
    "could repair anything except his own broken heart.",
]

# word-ish pieces as an LLM emits them: a word with its leading space, or a run of punctuation
_DELTA = re.compile(r"\s*[\w'’\-]+|\s*[^\w\s]+|\s+", re.UNICODE)


def split_deltas(text: str, max_chars: int = 8) -> list[str]:
    """Split ``text`` into word-ish deltas (leading space kept, punctuation separate, long words cut into
    ``max_chars`` pieces like sub-word tokens). Joining the deltas gives ``text`` back exactly."""
    if max_chars < 1:
        raise ValueError(f"max_chars must be at least 1, got {max_chars}")
    out: list[str] = []
    for m in _DELTA.finditer(text):
        piece = m.group(0)
        while len(piece) > max_chars:
            out.append(piece[:max_chars])
            piece = piece[max_chars:]
        if piece:
            out.append(piece)
    joined = "".join(out)
    if joined != text:                      # anything the pattern skipped (never expected): send it whole
        return [text]
    return out


def load_texts(path: str | None) -> list[str]:
    """The built-in list, or one text per line of ``path`` (blank lines and ``#`` comments skipped)."""
    if not path:
        return list(BUILTIN_TEXTS)
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    texts = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    if not texts:
        raise ValueError(f"{path}: no texts (one per line; blank lines and # comments are skipped)")
    return texts
