import sys

from muoneq.suite.cli import main

sys.exit(main())
