"""Parallel techniques, one file each (DDP, ZeRO, tensor, pipeline, 3D): glue between comm and nn."""
