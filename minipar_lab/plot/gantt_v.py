"""ZB-V's step on 4 ranks as a Gantt chart: measured in a real run beside the simulator's placement.

`plot gantt`'s drawing (gantt.py) with lesson 06b's sizes: the last step of `minipar train --pp 4
--schedule zb-v --microbatches 8` on bench pp's model (a GPT of 2K-2 = 6 blocks, so that each of the
2K = 8 chunks has a unit), each rank's F, B and W of its two chunks as the runner timed them, above
`simulate`'s timeline of the same actions with F = B = W = 1.

    python -m minipar plot gantt_v [--stages 4] [--schedule zb-v] [--microbatches 8] [--log FILE] [--out DIR]
Lesson: lessons/06b_pipeline_schedules.md.
"""

from __future__ import annotations

from minipar_lab.plot import gantt

FILE = "06b_gantt_zb_v.png"


def add_arguments(p) -> None:
    gantt.add_arguments(p)
    p.set_defaults(stages=4, schedule="zb-v", microbatches=8)


def draw(args, path) -> None:
    gantt.draw(args, path)
