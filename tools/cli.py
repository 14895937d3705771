"""What every resilient command line shares."""

from __future__ import annotations

import argparse
import sys


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line on stderr, exit 2 (argparse would print the whole usage first)."""

    def error(self, message: str) -> None:
        sys.stderr.write(f"{self.prog}: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)
