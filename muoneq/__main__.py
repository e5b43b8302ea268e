import sys

from muoneq.cli import main

sys.exit(main())
