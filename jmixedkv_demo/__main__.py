"""``python -m jmixedkv_demo``: the demo's command line (`jmixedkv_demo.cli`), e.g. ``python -m jmixedkv_demo demo``."""
import sys

from .cli import main

sys.exit(main())
