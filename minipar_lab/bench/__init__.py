"""Benchmarks: the measured figures that the lessons quote, one file per benchmark (`python -m minipar
bench NAME`). registry.py names them and runs them; timing.py is how every one takes its times;
canvas.py is the one place that imports matplotlib (a benchmark's own `--plot FILE`, and every figure of
plot/). Above trainer: cli, plot and course import it."""
