"""`python -m megaseq` (and `torchrun -m megaseq train ...`)."""

import sys

from megaseq.cli.main import main

sys.exit(main())
