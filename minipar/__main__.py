"""`python -m minipar ...`: see minipar/cli.py.

Ctrl-C can come while the ranks are still importing (NumPy, mpi4py and MPI's start take seconds on a
loaded machine): it ends the process as everywhere else, one line and exit 130, not a traceback.
"""

import os
import sys
from typing import NoReturn


def interrupted_while_starting(argv: list) -> NoReturn:
    command = f"minipar {argv[0]}" if argv else "minipar"
    rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))  # MPI may not be up
    sys.stderr.write(f"{command}: interrupted (rank {rank})\n")
    sys.stderr.flush()
    os._exit(130)  # not sys.exit: a half-started MPI's exit handlers could wait for the other ranks


try:
    from minipar.cli import main
except KeyboardInterrupt:
    interrupted_while_starting(sys.argv[1:])

try:
    code = main()
except KeyboardInterrupt:  # before a command catches it itself (train does, once MPI is up)
    interrupted_while_starting(sys.argv[1:])
sys.exit(code)
