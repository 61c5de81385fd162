"""`python -m moetron ...` (what `torchrun -m moetron train ...` runs)."""

import sys

from moetron.cli import main

sys.exit(main())
