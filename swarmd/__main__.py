import sys

from swarmd.cli.main import main

sys.exit(main())
