"""Coursework: graded assignments cut out of the reference code (`python -m minipar course`).

The idea: the reference is the solution. A region of a function body between `# exercise LL.N: title`
and `# end exercise` is one assignment; `course new` copies the project with the chosen regions replaced
by a `raise NotImplementedError` naming the exercise, and `course check` grades the student's code with
the reference's own property tests (equal to one process, bytes counted, schedule properties; never
time). The registry of exercises is `exercises.py`; extension projects (code the reference does not
have) are wired in through `extensions.py`. Lesson: lessons/course.md.
"""
