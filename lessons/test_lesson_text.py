"""The lessons tell the present state: no history of how a figure or a section was reached.

A student reads what the code does and measures now; "cut 5", "an earlier session", "this round" or
"on a loaded machine" are the project's diary, not the lesson (issue 43). The phrases are the ones
that diary used; a lesson that needs the word for another meaning can say it otherwise. The lessons
listed in SHORT_AND_WRAPPED also keep under 600 lines and their prose within 110 characters a line."""

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


# The lessons rewrapped so far (issue 43); a lesson joins the list once it passes both rules below.
SHORT_AND_WRAPPED = ("00_overview.md", "01_autograd.md", "01b_speed_appendix.md", "02_collectives.md",
                     "03_data_parallel.md", "03b_data_parallel_appendix.md", "04_zero.md",
                     "04b_placements.md", "04c_zero_appendix.md", "05_tensor_parallel.md",
                     "05b_tensor_parallel_appendix.md", "06_pipeline.md", "06b_pipeline_schedules.md",
                     "07_3d.md", "08_memory.md", "08b_memory_appendix.md", "09_precision.md", "09b_fp8.md",
                     "09c_precision_appendix.md", "10_fusion.md", "11_gpu.md", "12_reliability.md",
                     "13_context_parallel.md", "14_simulate.md", "15_experts.md", "course.md")
PROSE_WIDTH, MOST_LINES = 110, 599


def long_prose_lines(text: str) -> list[int]:
    """Numbers of the lines over PROSE_WIDTH that are prose: not in a fenced block, not a table row."""
    found, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and not line.startswith("|") and len(line) > PROSE_WIDTH:
            found.append(number)
    return found


def test_listed_lessons_are_short_and_their_prose_wrapped():
    for name in SHORT_AND_WRAPPED:
        text = (LESSONS / name).read_text()
        assert len(text.splitlines()) <= MOST_LINES, f"{name}: {len(text.splitlines())} lines"
        assert not long_prose_lines(text), f"{name}: prose lines over {PROSE_WIDTH}: {long_prose_lines(text)}"


def test_the_width_rule_skips_code_output_and_tables_only():
    long = "word " * 30
    assert long_prose_lines(f"{long}\n```python\n{long}\n```\n| {long} |\n  {long}\n") == [1, 6]
    assert long_prose_lines(f"```output\n{long}\n```\n{'x' * 110}\n") == []
