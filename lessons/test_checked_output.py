"""The check of the lessons' output can fail: one changed digit in any checked block is a difference."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from checked_output import NUMBER, excerpt_missing, matches, parse_options
from conftest import TABLE, console_commands
from sybil import Document

LESSONS = sorted(Path(__file__).parent.glob("*.md"))
FENCED = re.compile(r"^```(?P<language>output|console)(?P<arguments>[^\n]*)\n(?P<body>.*?)^```", re.S | re.M)


def checked_blocks():
    """(lesson, line, expected, rtol) for every output block, table and console command's output."""
    for path in LESSONS:
        text = path.read_text()
        for m in FENCED.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            rtol = parse_options(m.group("arguments")).get("rtol")
            if m.group("language") == "console":
                for _, expected in console_commands(m.group("body")):
                    yield path.name, line, expected, rtol
            else:
                yield path.name, line, m.group("body"), rtol
        for m in TABLE.finditer(text):
            yield (path.name, text.count("\n", 0, m.start()) + 1, m.group("table"),
                   parse_options(m.group("arguments")).get("rtol"))


def one_digit_changed(text: str):
    """Every text that differs from this one in exactly one digit (the digit + 1, mod 10)."""
    for i, c in enumerate(text):
        if c.isdigit():
            yield text[:i] + str((int(c) + 1) % 10) + text[i + 1:]


FENCE_OPENING = re.compile(r"^(?P<fence>```+)(?P<info>[^\n`]*)$", re.M)
KNOWN = re.compile(r"python|python notest|python excerpt \S+|(output|console)( rtol=\S+)?|text|bash")


def test_every_fence_says_what_it_is():
    """A bare fence would be neither run nor checked without saying so: each names its kind."""
    for path in LESSONS:
        inside = False
        for m in FENCE_OPENING.finditer(path.read_text()):
            if inside:
                inside = False  # a closing fence
                continue
            inside = True
            info = m.group("info").strip()
            line = path.read_text().count("\n", 0, m.start()) + 1
            assert KNOWN.fullmatch(info), f"{path.name}:{line}: fence {info!r} is not one of {KNOWN.pattern}"


def test_every_lesson_is_collected_by_sybil():
    assert LESSONS, "no lessons found"
    for path in LESSONS:
        Document(path.read_text(), str(path))  # parses


@pytest.mark.parametrize("lesson, line, expected, rtol", list(checked_blocks()),
                         ids=lambda v: v if isinstance(v, str) and v.endswith(".md") else None)
def test_one_changed_digit_in_a_checked_block_fails(lesson, line, expected, rtol):
    """The printed output equal to the lesson's passes; the lesson's with any one digit changed does not.

    Under rtol a changed last digit may be within tolerance, so there a changed leading digit of every
    number must fail."""
    assert matches(expected, expected, rtol)
    if rtol is None:
        for changed in one_digit_changed(expected):
            assert not matches(changed, expected), f"{lesson}:{line}: a changed digit went unnoticed"
    else:
        for number in NUMBER.finditer(expected):
            first = number.start() + next(i for i, c in enumerate(number.group()) if c.isdigit())
            changed = expected[:first] + str((int(expected[first]) + 1) % 10) + expected[first + 1:]
            if float(number.group().replace(",", "")) != 0:
                assert not matches(changed, expected, rtol), f"{lesson}:{line}: {number.group()} unchecked"


def test_ellipsis_stands_for_any_text_and_nothing_else():
    assert matches("step ... ms\nloss 1.25\n", "step 12.5 ms\nloss 1.25")
    assert not matches("step ... ms\nloss 1.25\n", "step 12.5 ms\nloss 1.26")
    assert not matches("loss 1.25", "loss 1.25 extra")


def test_rtol_compares_numbers_and_the_text_between_them():
    assert matches("loss 2.000000001, 7 ranks", "loss 2.000000002, 7 ranks", rtol=1e-6)
    assert not matches("loss 2.0, 7 ranks", "loss 2.1, 7 ranks", rtol=1e-6)
    assert not matches("loss 2.0, 7 ranks", "loss 2.0, 7 nodes", rtol=1e-6)
    assert not matches("loss 2.0", "loss 2.01", rtol=1e-6)  # a number is compared whole, not its start
    assert not matches("loss 2.0", "loss 2.0 3", rtol=1e-6)


def test_ellipsis_and_rtol_together():
    """`...` is any text, the numbers outside it are compared within rtol, and nothing inside it is."""
    shown = "loss 0.4939 at 60\nlargest difference ...% (at most 1%)\n"
    assert matches(shown, "loss 0.494 at 60\nlargest difference 0.57% (at most 1%)", rtol=1e-3)
    assert not matches(shown, "loss 0.499 at 60\nlargest difference 0.57% (at most 1%)", rtol=1e-3)
    assert not matches(shown, "loss 0.4939 at 60\nlargest difference 1.2% (at most 2%)", rtol=1e-3)
    assert not matches(shown, "loss 0.4939 at 61\nlargest difference 0.57% (at most 1%)", rtol=1e-3)
    # a right-aligned column pads a shorter number: spaces are layout, but not their absence
    assert matches("  1.461  2\n", "   1.46  2\n", rtol=1e-2)
    assert not matches("1.46 2", "1.462", rtol=1e-2)
    with pytest.raises(ValueError):
        parse_options("atol=1")


def test_console_blocks_split_into_commands_and_their_output():
    block = "$ echo a \\\n  b\na b\n$ true\n"
    assert console_commands(block) == [("echo a \\\n  b", "a b"), ("true", "")]


def test_an_excerpt_must_be_in_the_source_in_order():
    source = "def f(x):\n    y = x + 1\n\n    return y\n\ndef g():\n    pass\n"
    assert excerpt_missing("def f(x):\n    y = x + 1\n    return y\n", source) is None
    assert excerpt_missing("def f(x):\n    ...\ndef g():\n", source) is None
    assert excerpt_missing("def f(x):\n    y = x + 2\n", source) == "y = x + 2"
    assert excerpt_missing("def g():\n...\ndef f(x):\n", source) == "def f(x):"
