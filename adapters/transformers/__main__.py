"""``python -m kvxfer_transformers serve ...`` (same as the ``kvxfer-hf`` console script)."""

import sys

from kvxfer_transformers.cli import main

sys.exit(main())
