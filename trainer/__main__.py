"""``python -m resilient.trainer`` (under torchrun): see :mod:`resilient.trainer.train`."""

from __future__ import annotations

import sys

from resilient.trainer.train import main

if __name__ == "__main__":
    sys.exit(main())
