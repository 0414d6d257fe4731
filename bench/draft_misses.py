"""Where a trained drafter's first draft token misses, and where prompt lookup would not.

The target writes its greedy answers to the held-out prompts (the same ones, after the same
warm-up prompt, as ``specdec eval --suite spec``); then, at every answer position, the
drafter's training face reads the target's features of the whole answer at once and its first
step's argmax is compared with the target's token (teacher-forced: what a chain's first draft
token proposes after any accepted prefix). Printed:

- the agreement, its top-2 share and the share of tokens outside the draft vocabulary;
- the agreement by the target's own top-1 probability at that token;
- where the last n tokens occurred earlier in the context (n = 1 .. --max-ngram): how often,
  how often prompt lookup's copy is the token, the drafter's agreement there, and the
  agreement of a hybrid that copies after matches of at least n tokens and drafts elsewhere
  (what ``prompt_lookup+PATH@min_ngram=n`` proposes first);
- the best hybrid that also copies after a shorter match where the drafter's own top
  probability is below a threshold (one threshold per match length, over a grid).

Not a test: a measurement, in seconds (no decoding loop).

    python bench/draft_misses.py --checkpoint runs/smollm2-135m-eagle3/best --num-prompts 16
"""

from __future__ import annotations

import argparse
import itertools

import torch

from specdec import drafters
from specdec.data.chat import prompt_messages
from specdec.decoding.sampling import SamplingParams
from specdec.scoring.command import load_prompts
from specdec.scoring.run import encode_prompt
from specdec.target import FrozenTarget

EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 0.99, 1.01)


def lookup(lookups: dict, tokens: list[int], end: int) -> tuple[int, int | None]:
    """Prompt lookup's guess for ``tokens[end]`` from ``tokens[:end]``, by the longest n-gram
    that matches (``lookups``: n -> the prompt lookup of a hybrid trusting exactly n-grams,
    longest first): n and the copied token, ``(0, None)`` without a match."""
    for n, finder in lookups.items():
        found = finder.propose(tokens[:end], 1, SamplingParams())
        if len(found):
            return n, int(found.tokens[0])
    return 0, None


@torch.inference_mode()
def positions(drafter, target, prompt: list[int], max_new_tokens: int, longest: int):
    """Per answer position: (target's top-1 probability, drafter agrees, drafter's top-2 holds
    it, in the draft vocabulary, lookup's n-gram length, lookup's copy is the token, the
    drafter's top-1 probability)."""
    model = target.model
    ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    layers = drafter.required_target_layers
    out = target.forward(ids, hidden_layers=layers)
    logits = drafter.module(ids, None, [out.hidden_states[i] for i in layers])[0, 0]
    probs = out.logits[0].float().softmax(-1)
    tokens, ahead = ids[0].tolist(), 1 + drafter.shift  # row t predicts token t + ahead
    # the prompt lookup a hybrid asks first, one per n-gram length (longest first)
    lookups = {
        n: drafters.hybrid(drafter, max_ngram=n, min_ngram=n).lookup for n in range(longest, 0, -1)
    }
    draft_ids = getattr(drafter, "draft_ids", None)
    to_target = (lambda x: x) if draft_ids is None else (lambda x: draft_ids[x])
    # the first answer token comes from the prompt's forward; drafts propose the ones after
    rows = torch.arange(max(len(prompt) + 1 - ahead, 0), len(tokens) - ahead)
    gold = ids[0, rows + ahead]
    top2 = to_target(logits[rows].topk(2, dim=-1).indices)
    inside = torch.ones_like(gold, dtype=torch.bool)
    if draft_ids is not None:
        inside = torch.isin(gold, draft_ids)
    sure = probs[rows + ahead - 1].max(dim=-1).values
    own = logits[rows].float().softmax(dim=-1).max(dim=-1).values
    for j, t in enumerate(rows.tolist()):
        n, copy = lookup(lookups, tokens, t + ahead)
        yield (
            float(sure[j]), bool(top2[j, 0] == gold[j]), bool((top2[j] == gold[j]).any()),
            bool(inside[j]), n, copy == tokens[t + ahead], float(own[j]),
        )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--checkpoint", required=True, help="a trained drafter")
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-ngram", type=int, default=4, help="prompt lookup's longest n-gram")
    args = parser.parse_args()

    rows = load_prompts(("mtbench", "humaneval"), args.num_prompts + 1, stratify=True)[1:]
    target = FrozenTarget.load(args.target)
    drafter = drafters.load(args.checkpoint, target)
    drafter.module.eval()
    found = []
    for row in rows:
        prompt = encode_prompt(target.tokenizer, prompt_messages(row["messages"]))
        found += positions(drafter, target, prompt, args.max_new_tokens, args.max_ngram)
    total = len(found)

    def share(xs) -> float:
        return sum(xs) / max(len(xs), 1)

    print(
        f"{total} answer positions of {len(rows)} prompts: first draft token agrees "
        f"{share([f[1] for f in found]):.3f}, in its top 2 {share([f[2] for f in found]):.3f}; "
        f"target token outside the draft vocabulary {1 - share([f[3] for f in found]):.3f}"
    )
    print("\n| target's top-1 probability | share | agreement | misses (share of all) |")
    print("|---|---|---|---|")
    for low, high in zip(EDGES, EDGES[1:], strict=False):
        there = [f for f in found if low <= f[0] < high]
        misses = sum(1 for f in there if not f[1]) / total
        print(f"| [{low:.2f}, {min(high, 1):.2f}) | {len(there) / total:.3f} | "
              f"{share([f[1] for f in there]):.3f} | {misses:.3f} |")  # fmt: skip
    print("\n| match of at least n tokens | share | lookup's copy right | drafter there | "
          "hybrid (copy there, draft elsewhere) |")  # fmt: skip
    print("|---|---|---|---|---|")
    for n in range(1, args.max_ngram + 1):
        there = [f for f in found if f[4] >= n]
        hybrid = share([f[5] if f[4] >= n else f[1] for f in found])
        print(f"| {n} | {len(there) / total:.3f} | {share([f[5] for f in there]):.3f} | "
              f"{share([f[1] for f in there]):.3f} | {hybrid:.3f} |")  # fmt: skip
    grid, best = (0.0, 0.3, 0.5, 0.7, 0.9, 1.01), (0.0, None)
    for low in range(1, args.max_ngram + 1):  # copy after matches from `low` tokens, always
        for below in itertools.product(grid, repeat=low - 1):  # and after n < low if unsure

            def copies(f, low=low, below=below) -> bool:
                return f[4] >= low or (f[4] >= 1 and f[6] < below[f[4] - 1])

            got = share([f[5] if copies(f) else f[1] for f in found])
            best = max(best, (got, (low, below)), key=lambda x: x[0])
    low, below = best[1]
    unsure = ", ".join(f"after {n} below {p}" for n, p in enumerate(below, 1) if p > 0)
    print(
        f"\nbest with the drafter's confidence: {best[0]:.3f} (copy from {low} tokens"
        f"{'; ' + unsure if unsure else ''})"
    )
    either = share([f[1] or f[5] for f in found])
    print(f"\neither right (an oracle's choice per position): {either:.3f}")


if __name__ == "__main__":
    main()
