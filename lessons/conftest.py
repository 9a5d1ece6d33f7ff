"""Every lesson is a test: `make lessons` (or `pytest lessons/`) runs each lessons/*.md with Sybil.

The rules of what runs and what is compared are in lessons/checked_output.py. `<!-- skip: next -->`
before a block skips it (Sybil's own directive). A ```python excerpt PATH block is code shown from
minipar's source, checked to be there word for word (so it cannot drift); ```python notest blocks are
sketches that neither run nor are checked.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

from checked_output import difference, excerpt_missing, matches, parse_options
from sybil import Example, Region, Sybil
from sybil.evaluators.python import PythonEvaluator
from sybil.parsers.markdown import CodeBlockParser, SkipParser
from sybil.parsers.markdown.lexers import FencedCodeBlockLexer

ROOT = Path(__file__).resolve().parent.parent
PRINTED = "__printed_by_the_last_block__"
_run_python = PythonEvaluator()


def unchecked_print(example: Example) -> str | None:
    """What the block before printed, if no output block showed it: every printed line is checked."""
    printed = example.namespace.pop(PRINTED, "")
    if printed.strip():
        return (f"{example.path}:{example.line}: the python block before this point printed\n{printed}\n"
                "but no ```output block (or <!-- output --> table) shows it: add one, or print less")
    return None


def run_python(example: Example) -> str | None:
    """Run the block and keep what it printed for the output block that follows."""
    unchecked = unchecked_print(example)
    if unchecked:
        return unchecked
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        _run_python(example)
    example.namespace[PRINTED] = buffer.getvalue()
    sys.stdout.write(buffer.getvalue())
    return None


def parse_end(document) -> list[Region]:
    """The end of the lesson: what its last block printed must have been shown too."""
    return [Region(len(document.text), len(document.text), None, unchecked_print)]


def compare_output(example: Example) -> str | None:
    arguments, expected = example.parsed
    if PRINTED not in example.namespace:
        return f"{example.path}:{example.line}: an output block must follow a python block that prints"
    printed = example.namespace.pop(PRINTED)
    if not matches(expected, printed, **parse_options(arguments)):
        return difference(expected, printed, f"{example.path}:{example.line}")
    return None


def fence_body(document, region: Region) -> str:
    """The fenced block's lines as written (Sybil's lexeme drops the indentation common to them all)."""
    return document.text[region.start:region.end].split("\n", 1)[1].rsplit("```", 1)[0]


def parse_fenced_outputs(document) -> list[Region]:
    lexer = FencedCodeBlockLexer(r"output(?:[ \t][^\n]*)?",
                                 mapping={"language": "language", "source": "source"})
    regions = []
    for region in lexer(document):
        arguments = region.lexemes["language"][len("output"):]
        body = fence_body(document, region)
        region.parsed = (arguments, body)
        region.evaluator = compare_output
        regions.append(region)
    return regions


TABLE = re.compile(r"^<!-- output(?P<arguments>[^\n]*?)-->\n(?P<table>(?:\|[^\n]*(?:\n|$))+)", re.MULTILINE)


def parse_table_outputs(document) -> list[Region]:
    """A markdown table under `<!-- output -->` is what the block before it printed (renders as a table)."""
    return [Region(m.start(), m.end(), (m.group("arguments"), m.group("table")), compare_output)
            for m in TABLE.finditer(document.text)]


def console_commands(source: str) -> list[tuple[str, str]]:
    """`$ command` lines (a trailing backslash continues one) and what each prints."""
    steps: list[tuple[str, list[str]]] = []
    continued = False
    for line in source.splitlines():
        if continued:
            steps[-1] = (steps[-1][0] + "\n" + line, steps[-1][1])
        elif line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
        else:
            raise ValueError(f"a console block starts with a `$ command` line, not {line!r}")
        continued = line.endswith("\\") and not steps[-1][1]
    return [(command, "\n".join(lines)) for command, lines in steps]


def run_console(example: Example) -> str | None:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MPIEXEC_TIMEOUT": "200"}
    arguments, commands = example.parsed
    for command, expected in commands:
        # stdout only: progress lines go to stderr (a block shows an error message with 2>&1)
        done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=250)
        if not matches(expected, done.stdout, **parse_options(arguments)):
            stderr = f"\n(its stderr:)\n{done.stderr[-2000:]}" if done.stderr else ""
            return difference(expected, done.stdout, f"{example.path}:{example.line}: $ {command}") + stderr
    return None


def parse_consoles(document) -> list[Region]:
    lexer = FencedCodeBlockLexer(r"console(?:[ \t][^\n]*)?",
                                 mapping={"language": "language", "source": "source"})
    regions = []
    for region in lexer(document):
        body = fence_body(document, region)
        region.parsed = (region.lexemes["language"][len("console"):], console_commands(body))
        region.evaluator = run_console
        regions.append(region)
    return regions


def check_excerpt(example: Example) -> str | None:
    path, excerpt = example.parsed
    source = ROOT / path
    if not source.is_file():
        return f"{example.path}:{example.line}: the excerpt names {path}, which does not exist"
    missing = excerpt_missing(excerpt, source.read_text())
    if missing is not None:
        return f"{example.path}:{example.line}: this excerpt is not in {path} (any more): {missing!r}"
    return None


def parse_excerpts(document) -> list[Region]:
    lexer = FencedCodeBlockLexer(r"python excerpt [^\n]+",
                                 mapping={"language": "language", "source": "source"})
    regions = []
    for region in lexer(document):
        body = fence_body(document, region)
        region.parsed = (region.lexemes["language"].split(None, 2)[2].strip(), body)
        region.evaluator = check_excerpt
        regions.append(region)
    return regions


pytest_collect_file = Sybil(
    parsers=[CodeBlockParser("python", run_python), parse_fenced_outputs, parse_table_outputs,
             parse_consoles, parse_excerpts, parse_end, SkipParser()],
    patterns=["*.md"],
).pytest()
