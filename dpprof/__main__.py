"""python -m dpprof: the dpprof command."""
import sys

from dpprof.cli import main

sys.exit(main())
