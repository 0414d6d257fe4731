"""Score a drafter with specdec's speculative decoder: `python eval/score.py --help`."""

import sys

from specdec.cli import main

if __name__ == "__main__":
    sys.exit(main(["score", *sys.argv[1:]]))
