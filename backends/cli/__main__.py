"""``python -m dplab.backends.cli``: what ``torchrun ... -m dplab.backends.cli train`` runs."""

import sys

from dplab.backends.cli.commands import main

sys.exit(main())
