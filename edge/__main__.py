"""`python -m elasticfed.edge` = `elasticfed edge`."""

import sys

from elasticfed.common.cli import main

sys.exit(main(["edge", *sys.argv[1:]]))
