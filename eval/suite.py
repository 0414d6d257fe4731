"""Compare methods side by side over a prompt suite: report.md, results.json and plots.

python eval/suite.py --suite spec --method prompt_lookup --method runs/NAME/best --out DIR
"""

import sys

from specdec.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
