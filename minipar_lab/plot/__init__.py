"""Pictures: `python -m minipar plot WHAT [--out DIR]` draws the figures the lessons embed, each from data
a command produces (a `minipar train --log` file, a benchmark, the schedule simulator, the ledgers).
registry.py names them; one file per figure holds its data functions (checked by tests/plot against
formulas) and its drawing; bench/canvas.py is the one place that imports matplotlib, lazily. The top
layer beside the course: nothing else in minipar imports it."""
