import sys

from netoptim.cli import main

sys.exit(main())
