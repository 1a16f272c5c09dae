import sys

from batchcraft.cli import main

sys.exit(main())
