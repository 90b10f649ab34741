"""`python -m cloud [train|serve] [flags]`: what torchrun's `-m cloud` runs.

`python -m cloud serve --mode hybrid` is a hybrid worker (rank 0 hosts the
gateway); `python -m cloud [train] [flags]` is `elasticfed cloud train`.
"""

import sys

from common.cli import main

argv = sys.argv[1:]
action = argv.pop(0) if argv and argv[0] in ("train", "serve") else "train"
sys.exit(main(["cloud", action, *argv]))
