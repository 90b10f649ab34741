"""`python -m cloud [flags]` is `elasticfed cloud train [flags]` (what torchrun's `-m cloud` runs)."""

import sys

from common.cli import main

sys.exit(main(["cloud", "train", *sys.argv[1:]]))
