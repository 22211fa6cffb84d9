"""``python -m jmixedkv``: the command line (`jmixedkv.cli`)."""
import sys

from .cli import main

sys.exit(main())
