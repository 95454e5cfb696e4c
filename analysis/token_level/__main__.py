"""`python -m analysis.token_level`: the same command as `python -m analysis token_level`."""

import sys

from analysis.token_level.cli import main

sys.exit(main())
