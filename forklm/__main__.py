import sys

from forklm.cli import main

sys.exit(main())
