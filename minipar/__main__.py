"""`python -m minipar ...`: see minipar/trainer/cli.py."""

import sys

from minipar.trainer.cli import main

sys.exit(main())
