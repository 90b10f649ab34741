"""`python -m edge` = `elasticfed edge`."""

import sys

from common.cli import main

sys.exit(main(["edge", *sys.argv[1:]]))
