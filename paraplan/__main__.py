import sys

from paraplan.cli.main import main

sys.exit(main())
