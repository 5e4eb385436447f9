"""`python -m kvindex`: the same as the `kvindex` console script."""

import sys

from kvindex.cli import main

sys.exit(main())
