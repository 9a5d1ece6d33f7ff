"""The lessons tell the present state: no history of how a figure or a section was reached.

A student reads what the code does and measures now; "cut 5", "an earlier session", "this round" or
"on a loaded machine" are the project's diary, not the lesson (issue 43). The phrases are the ones
that diary used; a lesson that needs the word for another meaning can say it otherwise."""

import re
from pathlib import Path

LESSONS = Path(__file__).resolve().parent
HISTORY = re.compile(r"\bcuts? \d|\b(before|after) cut\b|\bsession\b|\b(this|last|earlier|previous) round\b"
                     r"|\bearlier (run|measurement)\b|loaded machine", re.IGNORECASE)


def test_no_lesson_tells_its_history():
    found = [f"{path.name}:{number}: {line.strip()}" for path in sorted(LESSONS.glob("*.md"))
             for number, line in enumerate(path.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not found, "\n".join(found)


def test_the_rule_finds_the_phrases_it_names():
    for phrase in ("Cut 6 removed", "after cut", "an earlier session", "this round", "an earlier run",
                   "on a loaded machine"):
        assert HISTORY.search(phrase), phrase
    assert not HISTORY.search("the cuts of the model into stages, a short run")
