"""``python -m bench.gpu``."""

import sys

from .run import main

sys.exit(main())
