"""`python -m elasticfed.cloud [train|serve] [flags]`: what torchrun's `-m elasticfed.cloud` runs.

`python -m elasticfed.cloud serve --mode hybrid` is a hybrid worker (rank 0 hosts the
gateway); `python -m elasticfed.cloud [train] [flags]` is `elasticfed cloud train`.
"""

import sys

from elasticfed.common.cli import main

argv = sys.argv[1:]
action = argv.pop(0) if argv and argv[0] in ("train", "serve") else "train"
sys.exit(main(["cloud", action, *argv]))
