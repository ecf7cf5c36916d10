"""`python -m collector` == the `collector` console script."""

import sys

from collector.cli import main

sys.exit(main())
