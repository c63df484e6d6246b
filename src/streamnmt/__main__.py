import sys

from streamnmt.cli import main

sys.exit(main())
