"""minipar_lab: the tools around the reference, beside it in this repository: the benchmarks behind the
lessons' figures (`bench`), the pictures the lessons embed (`plot`) and the coursework's tooling
(`course`). The lab imports minipar; minipar never imports the lab. `python -m minipar bench|plot|course`
find it through the entry points in pyproject.toml (group `minipar.commands`).
"""
