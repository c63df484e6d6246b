import sys

from streamnmt.cli import main

if __name__ == "__main__":  # not again in a child process that re-imports the main module (spawn)
    sys.exit(main())
