"""``python -m kvxfer.proxy`` (layer: proxy app): the same as ``kvxfer proxy``."""

import sys

from kvxfer.proxy.cli import main

sys.exit(main(sys.argv[1:]))
