"""Distil a drafter against a frozen target.

accelerate launch train/distill.py --config recipes/smollm2-135m/draft_model.yaml [KEY=VALUE ...]
"""

import sys

from specdec.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
