"""The lessons' printed output, checked: what a block prints must be what the lesson shows below it.

`make lessons` runs every lesson through Sybil (lessons/conftest.py). Three kinds of blocks matter:

- a ```python block runs, in order, in one namespace per lesson; what it prints is kept;
- a ```console block holds `$ command` lines, each followed by what it prints; every command runs with
  bash from the project's root (`python` and `mpiexec` are the project's .venv ones), and what it
  prints on stdout must be the lines below it (stderr carries progress lines; a block that shows an
  error message says `2>&1`);
- a ```output block, or a markdown table under an `<!-- output -->` comment, is what the python block
  before it printed, line for line.

Comparison is exact (trailing spaces and blank lines at the end aside), so changing one digit of a checked
number fails. Two ways to mark what a machine changes, each visible in the lesson:

- `...` stands for any text, as in doctest's ELLIPSIS (timings: `step ... ms`);
- `output rtol=1e-6` (or `<!-- output rtol=1e-6 -->`, or `console rtol=1e-6`) compares every number
  within that relative tolerance and the text between numbers exactly (a run of spaces matching any
  run of spaces: columns pad a shorter number), `...` still standing for any text. OpenBLAS picks its
  matrix kernel by CPU and NumPy its SIMD loops, so the last bits of a float differ between machines:
  a figure that depends on them is either computed in a fixed order or shown within a tolerance
  measured over the kernels (`make portability`), never as one machine's digits.

A ```python excerpt minipar/x.py block must be in that file word for word (indentation and blank lines
aside); a line `...` stands for lines left out, so an excerpt can skip the parts the lesson does not need.

A ```text block is not checked: diagrams, and measurements whose command the lesson shows (`make bench`).
"""

from __future__ import annotations

import difflib
import doctest
import re

NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")
_ELLIPSIS = doctest.OutputChecker()
EXERCISE_MARKER = re.compile(r"^\s*# (?:exercise \d\d\.\d+: .*|end exercise)\s*$")


def normalise(text: str) -> str:
    """Trailing spaces on each line and blank lines at the end do not count."""
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines()) + "\n"


def parse_options(arguments: str) -> dict[str, float]:
    """`rtol=1e-6` after the block's language (the only option)."""
    options: dict[str, float] = {}
    for word in arguments.split():
        key, _, value = word.partition("=")
        if key != "rtol" or not value:
            raise ValueError(f"unknown output option {word!r}: the one option is rtol=X")
        options[key] = float(value)
    return options


def _text_and_numbers(part: str) -> str:
    """A regex for `part`: its text as written, each number a group that matches one whole number. A
    run of spaces matches any run of spaces: a right-aligned column pads 0.43 where it printed 0.4296."""
    pieces = NUMBER.split(part)
    numbers = [rf"({NUMBER.pattern})(?!\d)" for _ in pieces[1:]]
    texts = [" +".join(re.escape(word) for word in re.split(" +", text)) for text in pieces]
    return "".join(text + number for text, number in zip(texts, numbers + [""]))


def _numbers_close(expected: str, printed: str, rtol: float) -> bool:
    """The text between numbers equal (`...` standing for any text), every number within rtol of the
    lesson's."""
    parts = expected.split("...")
    pattern = "(?:.*?)".join(_text_and_numbers(part) for part in parts)
    found = re.fullmatch(pattern, printed, re.S)
    if found is None:
        return False
    shown = [number for part in parts for number in NUMBER.findall(part)]
    for number, got in zip(shown, found.groups()):
        a, b = float(number.replace(",", "")), float(got.replace(",", ""))
        if abs(a - b) > rtol * max(abs(a), abs(b)):
            return False
    return True


def matches(expected: str, printed: str, rtol: float | None = None) -> bool:
    expected, printed = normalise(expected), normalise(printed)
    if rtol is not None:
        return _numbers_close(expected, printed, rtol)
    return _ELLIPSIS.check_output(expected, printed, doctest.ELLIPSIS)


def difference(expected: str, printed: str, where: str) -> str:
    """The failure message: a diff from what the lesson shows to what the code printed."""
    diff = difflib.unified_diff(normalise(expected).splitlines(), normalise(printed).splitlines(),
                                "the lesson shows", "the code printed", lineterm="")
    return f"{where}: the printed output differs from the lesson\n" + "\n".join(diff)


def excerpt_missing(excerpt: str, source: str) -> str | None:
    """None if every part of the excerpt (parts split at `...` lines) is in source, in order; else the
    first line that is not. The coursework's region markers (`# exercise LL.N: ...`, `# end exercise`)
    are not code: an excerpt reads as if they were not there."""
    lines = [line.strip() for line in source.splitlines()
             if line.strip() and not EXERCISE_MARKER.match(line)]
    start = 0
    part: list[str] = []
    parts = []
    for line in excerpt.splitlines() + ["..."]:
        if line.strip() == "...":
            parts.append(part)
            part = []
        elif line.strip():
            part.append(line.strip())
    for part in filter(None, parts):
        found = next((i for i in range(start, len(lines) - len(part) + 1) if lines[i:i + len(part)] == part),
                     None)
        if found is None:
            return next((line for line in part if line not in lines[start:]), part[0])
        start = found + len(part)
    return None
