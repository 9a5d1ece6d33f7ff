"""OneLineParser: argparse whose usage errors are one line, the contract of every minipar command.

A mistake prints `minipar <command>: error: <what is wrong>` on stderr and exits with code 2, instead of
argparse's usage block: under mpiexec every rank prints it, and one line per rank stays readable.
"""

from __future__ import annotations

import argparse


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")
