"""specdec's decoder vs transformers' assisted generation vs plain generate, one run.

Same target, same draft model, same greedy prompts, same k; every method decodes every prompt
(interleaved, after one warm-up prompt) and the ratios of total tokens/s are printed. Output
identity with plain greedy decoding is checked for each method. specdec runs its target through
transformers' forward (as transformers' own methods do) and through its compact forward (its
default, see ``bench/compact_forward.py``), so each speculative ratio has its own plain
baseline beside it. The draft runs through its transformers forward or the compact one
(float16 or float32 on a CPU, whichever is measured faster), with all k tokens or with a
confidence stop. Not a test: a measurement.

    python bench/assisted_generation.py                         # draft: target's first 4 layers
    python bench/assisted_generation.py --draft-model runs/NAME/export/hf --k 4
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from specdec import drafters
from specdec.data.chat import prompt_messages
from specdec.decoding.compact import target_session
from specdec.decoding.session import ModelSession
from specdec.decoding.speculative import generate
from specdec.scoring.command import load_prompts
from specdec.scoring.run import encode_prompt
from specdec.target import FrozenTarget, eos_token_ids


def truncated(model, num_layers: int):
    """An independent draft model: the target's embeddings, head and first layers."""
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = num_layers
    small = type(model)(config).eval()
    small.load_state_dict(model.state_dict(), strict=False)
    return small


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--target", default="smollm2-135m-instruct")
    parser.add_argument("--draft-model", help="a draft model directory (default: truncated)")
    parser.add_argument("--draft-layers", type=int, default=4)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=6)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--prompts", default="mtbench,humaneval")
    parser.add_argument("--confidence", type=float, default=0.4, help="draft confidence stop")
    args = parser.parse_args()

    target = FrozenTarget.load(args.target)
    model, tokenizer = target.model, target.tokenizer
    if args.draft_model:
        from transformers import AutoModelForCausalLM

        draft = AutoModelForCausalLM.from_pretrained(args.draft_model).eval()
    else:
        draft = truncated(model, args.draft_layers)
    eos = eos_token_ids(model, tokenizer)
    rows = load_prompts(tuple(args.prompts.split(",")), args.num_prompts + 1)
    prompts = [encode_prompt(tokenizer, prompt_messages(r["messages"])) for r in rows]
    slow, fast = ModelSession(model), target_session(model)
    n = args.max_new_tokens

    def hf(ids, **kw):
        x = torch.tensor([ids])
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
            **kw,
        )
        return out[0, len(ids) :].tolist()

    def ours(ids, drafter, session):
        return generate(
            session, ids, drafter=drafter, k=args.k, max_new_tokens=n, eos_token_ids=eos
        ).tokens

    def as_drafter(forward: str, confidence: float = 0.0):
        drafter = drafters.from_model(draft, target)
        drafter.configure(forward, confidence)
        return drafter

    hf_forward = as_drafter("transformers")
    compact = as_drafter("auto")  # the default: compact forward (a measured dtype on a CPU)
    confident = as_drafter("auto", args.confidence)
    lookup = drafters.build(target, drafters.config_for(drafters.training_free()[0]))
    methods = {
        "hf generate (plain)": lambda ids: hf(ids),
        "hf assisted (draft model)": lambda ids: hf(
            ids,
            assistant_model=draft,
            num_assistant_tokens=args.k,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
        ),
        "hf prompt lookup": lambda ids: hf(ids, prompt_lookup_num_tokens=args.k),
        "specdec plain, hf target": lambda ids: ours(ids, None, slow),
        "  draft, hf forward": lambda ids: ours(ids, hf_forward, slow),
        "  draft, compact": lambda ids: ours(ids, compact, slow),
        "  prompt lookup": lambda ids: ours(ids, lookup, slow),
        "specdec plain, compact": lambda ids: ours(ids, None, fast),
        "  draft, compact ": lambda ids: ours(ids, compact, fast),
        f"  draft, confidence {args.confidence}": lambda ids: ours(ids, confident, fast),
        "  prompt lookup ": lambda ids: ours(ids, lookup, fast),
    }
    seconds = dict.fromkeys(methods, 0.0)
    tokens = dict.fromkeys(methods, 0)
    same = dict.fromkeys(methods, 0)
    for i, ids in enumerate(prompts):
        reference = None
        for name, run in methods.items():
            t0 = time.perf_counter()
            out = run(ids)
            elapsed = time.perf_counter() - t0
            reference = out if reference is None else reference
            if i == 0:
                continue  # warm-up prompt
            seconds[name] += elapsed
            tokens[name] += len(out)
            same[name] += out == reference
    base = tokens["hf generate (plain)"] / seconds["hf generate (plain)"]
    print(
        f"target {target.name}, draft {args.draft_model or f'first {args.draft_layers} layers'}"
        f", k={args.k}, {len(prompts) - 1} prompts x {n} tokens, threads "
        f"{torch.get_num_threads()}"
    )
    print(f"{'method':<28}{'tokens/s':>10}{'vs hf plain':>13}{'vs its plain':>14}{'identical':>11}")
    plain = base
    for name in methods:
        tps = tokens[name] / seconds[name]
        if "plain" in name:
            plain = tps
        print(
            f"{name:<28}{tps:>10.2f}{tps / base:>12.2f}x{tps / plain:>13.2f}x"
            f"{same[name]:>8}/{len(prompts) - 1}"
        )


if __name__ == "__main__":
    main()
