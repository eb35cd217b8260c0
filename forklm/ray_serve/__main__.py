"""`python -m forklm.ray_serve [forklm serve flags]` is `forklm serve --ray [flags]`."""

import sys

from forklm.cli import main

sys.exit(main(["serve", "--ray", *sys.argv[1:]]))
