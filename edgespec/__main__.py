"""`python -m edgespec`: the edgespec command line."""

import sys

from .commands import main

sys.exit(main())
