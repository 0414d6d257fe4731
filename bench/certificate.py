"""The sampling certificate on the real target: a drafter passes it, the same drafter made to
misreport q (it drafts from q but announces q^(1/2), renormalised) fails it.

Not a test (a real target, minutes of CPU): a measurement that the certificate has the power
to catch a lossy decoder where it is used. The test suite runs the same checks on tiny models.

    python bench/certificate.py --draft-model ~/.cache/specdec/models/smollm2-135m-instruct
    python bench/certificate.py --checkpoint runs/smollm2-135m-eagle3/best --samples 2000

A misreported q changes the output's law only through the drafts it decides, so the power
depends on the drafter: the target drafting for itself (``--draft-model`` the target's own
directory: q = p, every draft accepted) moves about 4% of the mass per token under the
misreport; a drafter accepted 4% of the time moves almost none (and the output is then almost
the target's anyway). The per-context chi-square needs repeated contexts, which a real
target's law gives only for the first token; the probability integral transform tests every
token of every draw (README: measured).
"""

from __future__ import annotations

import argparse
import json

from specdec import drafters
from specdec.data.chat import prompt_messages
from specdec.drafters.base import Drafter, Proposal
from specdec.scoring.certificate import sampling_certificate
from specdec.scoring.command import load_prompts
from specdec.scoring.run import encode_prompt
from specdec.target import FrozenTarget


class Misreporting(Drafter):
    """Another drafter's proposals, announced with q^(1/2) renormalised instead of q."""

    def __init__(self, inner: Drafter):
        self.inner = inner
        self.name = f"misreporting {inner.name}"
        self.required_target_layers = inner.required_target_layers

    def begin(self, prompt, target_features=None):
        self.inner.begin(prompt, target_features)

    def propose(self, sequence, k, params, generator=None):
        proposal = self.inner.propose(sequence, k, params, generator)
        wrong = proposal.probs.sqrt()
        return Proposal(proposal.tokens, wrong / wrong.sum(-1, keepdim=True))

    def commit(self, num_accepted, target_features=None):
        self.inner.commit(num_accepted, target_features)


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", help="a specdec checkpoint directory")
    which.add_argument(
        "--draft-model", help="a transformers causal LM with the target's tokenizer (a path)"
    )
    parser.add_argument("--target", help="target spec (default: the checkpoint's, or SmolLM2)")
    parser.add_argument("--samples", type=int, default=400, help="draws for the drafter")
    parser.add_argument("--bug-samples", type=int, default=400, help="draws for the bug")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per draw")
    parser.add_argument("--prompts", default="mtbench,humaneval")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--k", type=int, default=4)
    args = parser.parse_args()

    spec = args.target
    if spec is None and args.checkpoint:
        spec = drafters.read_meta(args.checkpoint)["target"]
    target = FrozenTarget.load(spec or "smollm2-135m-instruct")
    if args.checkpoint:
        drafter = drafters.load(args.checkpoint, target)
    else:
        drafter = drafters.from_model(args.draft_model, target)
    rows = load_prompts(tuple(args.prompts.split(",")), args.num_prompts + 1)[1:]  # past warm-up
    prompts = [encode_prompt(target.tokenizer, prompt_messages(r["messages"])) for r in rows]
    runs = [("drafter", drafter, args.samples)]
    runs.append(("misreported q", Misreporting(drafter), args.bug_samples))
    for name, d, n in runs:
        cert = sampling_certificate(
            target.model, target.tokenizer, d, prompts, n, k=args.k, new_tokens=args.new_tokens
        )
        keep = ("samples", "tokens", "p_value", "passed", "accept_rate", "context_p_value", "pit")
        print(
            f"{name:>14}: "
            + json.dumps({key: cert[key] for key in keep})
            + f", {cert['seconds']:.0f} s"
        )


if __name__ == "__main__":
    main()
