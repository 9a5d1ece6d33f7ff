"""Exercise regions in the source: find them, and cut them out into stubs.

A region is the lines between a start marker and an end marker, both comments at the same indentation
inside a function body:

    # exercise 03.1: bucketed all-reduce
    ...the reference's code (the solution)...
    # end exercise

A stub keeps both markers (the student sees where to write) and replaces the lines between them by one
`raise NotImplementedError(...)` at the marker's indentation, naming the exercise and its lesson section.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

START = re.compile(r"^(?P<indent>[ \t]*)# exercise (?P<id>\d\d\.\d+): (?P<title>.+?)\s*$")
END = re.compile(r"^[ \t]*# end exercise\s*$")


@dataclass(frozen=True)
class Region:
    exercise: str
    title: str
    path: str  # relative to the project root
    start: int  # index of the start marker's line
    end: int  # index of the end marker's line
    indent: str


class RegionError(ValueError):
    """Markers that do not pair up (a start without an end, nested regions, an end alone)."""


def regions_in(text: str, path: str) -> list[Region]:
    found, open_region = [], None
    for number, line in enumerate(text.splitlines()):
        start = START.match(line)
        if start and open_region is not None:
            raise RegionError(f"{path}:{number + 1}: exercise {start['id']} starts inside exercise "
                              f"{open_region.group('id')}")
        if start:
            open_region, open_line = start, number
        elif END.match(line):
            if open_region is None:
                raise RegionError(f"{path}:{number + 1}: '# end exercise' without a start")
            found.append(Region(open_region["id"], open_region["title"], path, open_line, number,
                                open_region["indent"]))
            open_region = None
    if open_region is not None:
        raise RegionError(f"{path}:{open_line + 1}: exercise {open_region['id']} has no '# end exercise'")
    return found


def regions_under(root: Path, package: str = "minipar") -> list[Region]:
    """Every region in the .py files of root/package, in path order (but the course's own files, whose
    docstrings show the markers)."""
    found = []
    for source in sorted((root / package).rglob("*.py")):
        if source.parent.name == "course":
            continue
        found += regions_in(source.read_text(), source.relative_to(root).as_posix())
    return found


def stub_text(text: str, path: str, chosen: dict[str, str]) -> str:
    """text with the regions whose exercise is in `chosen` cut out; chosen[id] is the stub's message."""
    lines = text.splitlines(keepends=True)
    for region in reversed(regions_in(text, path)):
        if region.exercise in chosen:
            stub = f"{region.indent}raise NotImplementedError({chosen[region.exercise]!r})\n"
            lines[region.start + 1:region.end] = [stub]
    return "".join(lines)
