"""A cost model of one training step at cluster scale, built from minipar's own formulas.

model.py counts FLOPs and parameters from the architecture, machines.py holds GPU presets (peak
FLOP/s, one achieved-efficiency constant, link bandwidths and latencies, each with its source),
step.py composes compute, communication (the ring costs `Comm` charges) and the pipeline bubble
(the same schedule simulator `minipar schedule` uses) into a step time, and memory per GPU from the
ZeRO planner and the activation formulas; presets.py holds published runs to check it against.
The command is `python -m minipar simulate` (trainer/commands.py). Lesson: lessons/14_simulate.md.

Layer: below trainer (whose command uses it), above checkpoint, precision, parallel and memory,
whose formulas it composes; it imports no MPI and runs nothing, so any layer above may ask it.
"""
