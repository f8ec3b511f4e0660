"""``python -m asyncinfer`` is the ``asyncinfer`` command."""

import sys

from asyncinfer.cli import main

sys.exit(main())
