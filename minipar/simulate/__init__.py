"""A cost model of one training step at cluster scale, built from minipar's own formulas.

model.py counts FLOPs and parameters from the architecture, kernels.py times each GEMM on its tiles
and waves and each elementwise pass at HBM bandwidth (cited measurements), machines.py holds GPU
presets (peak FLOP/s, the kernel model, one calibrated scalar, achieved link bandwidths, each sourced),
step.py composes compute, communication (the ring costs `Comm` charges) and the pipeline bubble
(the same schedule simulator `minipar schedule` uses) into a step time, and memory per GPU from the
ZeRO planner and the activation formulas; presets.py holds Megatron 2021's Table 1 to calibrate and
check it against, published.py 20 other published runs (each with its cluster, settings and FLOP
formula) that it predicts.
The command is `python -m minipar simulate` (trainer/commands.py). Lesson: lessons/14_simulate.md.

Layer: below trainer (whose command uses it), above checkpoint, precision, parallel and memory,
whose formulas it composes; it imports no MPI and runs nothing, so any layer above may ask it.
"""
