"""``python -m asyncinfer`` is the ``asyncinfer`` command."""

import sys

from asyncinfer.ops.cli import main

sys.exit(main())
