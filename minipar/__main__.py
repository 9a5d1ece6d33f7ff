"""`python -m minipar ...`: see minipar/cli.py."""

import sys

from minipar.cli import main

sys.exit(main())
