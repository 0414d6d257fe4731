"""Training metrics that predict decoding: held-out target-written rows, accuracy per source.

Between checkpoints the loss and ``train/acc@i`` of the last step are all a run shows, and
they are measured on the rows it trains on, of every source: answers the target wrote and
answers it did not (``responses: keep``). What the decoder will accept is the target's next
token on its own text, on prompts the drafter never saw. So ``data.heldout_rows`` rows whose
answers the target wrote are kept out of training, and every log interval the drafter is
evaluated on them: ``heldout/acc@i`` is the share of positions where the draft's argmax at
step i is the target's full-vocabulary argmax (on greedy target text: the decoder's chance to
accept draft position i at T = 0, given the earlier ones), ``heldout/expected_accept@i`` the
same at T = 1 (Σ min(p, q)). Training accuracy is also split by source
(``train/acc@1/<source>``), summed over the whole log interval rather than one batch.
"""

from __future__ import annotations

import logging

import torch

from specdec.training.step import collate, drafter_loss, step_counts

logger = logging.getLogger(__name__)


class SourceAccuracy:
    """Agreements and positions of the first draft step per data source, over a window; kept
    on ``device``, so a training step adds no host synchronisation."""

    def __init__(self, sources: list[str], device: torch.device | str = "cpu"):
        self.names = sorted(set(sources))
        self.code = torch.tensor([self.names.index(s) for s in sources], device=device)
        self.sums = torch.zeros(2, len(self.names), device=device)  # agreements, positions

    def add(self, rows: torch.Tensor, agree: torch.Tensor, count: torch.Tensor) -> None:
        """Rows ``[B]`` (dataset indices) with their agreements and positions ``[B]``."""
        codes = self.code[rows.to(self.code.device)]
        self.sums.index_add_(1, codes, torch.stack([agree, count]).detach().float())

    def metrics(self, accelerator) -> dict:
        """``train/acc@1/<source>`` over the window (all processes), then a fresh window."""
        agree, count = accelerator.reduce(self.sums.clone(), "sum").cpu()
        self.sums.zero_()
        return {
            f"train/acc@1/{name}": float(a / c)
            for name, a, c in zip(self.names, agree, count, strict=True)
            if c > 0
        }


@torch.no_grad()
def heldout_metrics(run, batch_size: int) -> dict:
    """The drafter's ``heldout/*`` metrics on the held-out rows (each process takes its share);
    empty when there are none."""
    rows, accelerator = run.heldout_rows, run.accelerator
    if len(rows) == 0:
        return {}
    n, pad = accelerator.num_processes, run.target.tokenizer.pad_token_id or 0
    mine = rows[accelerator.process_index :: n]
    mine = mine[torch.argsort(run.lengths[mine], stable=True)].tolist()  # little padding
    batches = [
        {k: v.to(accelerator.device) for k, v in collate(run.dataset, part, pad, run.cache).items()}
        for part in (mine[i : i + batch_size] for i in range(0, len(mine), batch_size))
    ]
    counts = step_counts(run.drafter, batches, accelerator)
    drafter, model = run.decoding()
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    for batch in batches:
        _, parts, _ = drafter_loss(drafter, model, run.target, batch, run.recipe.loss, counts, n)
        for key, value in parts.items():
            sums[key] = sums.get(key, 0) + value
    model.train()
    steps = len(run.drafter.step_weights())
    keys = [f"train/acc@{s + 1}" for s in range(steps)]
    keys += [f"train/top5@{s + 1}" for s in range(steps)]
    keys += ["train/loss", "train/expected_accept", "train/teacher_mass"]
    keys += [f"train/expected_accept@{s + 1}" for s in range(1, steps)]
    # every process reduces the same keys, those with no held-out rows zeros
    device = accelerator.device
    local = torch.stack([torch.as_tensor(sums.get(k, 0.0), device=device).float() for k in keys])
    total = accelerator.reduce(local, "sum").tolist()
    return {"heldout/" + k.removeprefix("train/"): v for k, v in zip(keys, total, strict=True)}
