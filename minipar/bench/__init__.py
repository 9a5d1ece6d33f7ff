"""Benchmarks: the measured figures that the lessons quote, one file per benchmark (`python -m minipar
bench NAME`). registry.py names them and runs them; timing.py is how every one takes its times. The top
layer: nothing else in minipar imports it."""
