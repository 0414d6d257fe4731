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

from specdec.training.step import collate, drafter_loss

logger = logging.getLogger(__name__)


def split_rows(dataset, wanted: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows to train on and the held-out rows: ``wanted`` target-written rows picked with
    ``seed`` (at most a quarter of them; fewer is said in a warning)."""
    written = torch.tensor(dataset["target_written"], dtype=torch.bool)
    candidates = written.nonzero().flatten()
    n = min(wanted, len(candidates) // 4)
    if n < wanted:
        logger.warning(
            "data.heldout_rows: %d asked, %d held out (a quarter of the %d target-written rows)",
            wanted, n, len(candidates),
        )  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    heldout = candidates[torch.randperm(len(candidates), generator=generator)[:n]].sort().values
    train = torch.ones(len(dataset), dtype=torch.bool)
    train[heldout] = False
    return train.nonzero().flatten(), heldout


class SourceAccuracy:
    """Agreements and positions of the first draft step per data source, over a window."""

    def __init__(self, sources: list[str]):
        self.names = sorted(set(sources))
        self.code = torch.tensor([self.names.index(s) for s in sources])
        self.reset()

    def reset(self) -> None:
        self.agree = torch.zeros(len(self.names))
        self.count = torch.zeros(len(self.names))

    def add(self, rows: torch.Tensor, agree: torch.Tensor, count: torch.Tensor) -> None:
        """Rows ``[B]`` (dataset indices) with their agreements and positions ``[B]``."""
        codes = self.code[rows.cpu()]
        self.agree.index_add_(0, codes, agree.detach().float().cpu())
        self.count.index_add_(0, codes, count.detach().float().cpu())

    def metrics(self, accelerator) -> dict:
        """``train/acc@1/<source>`` over the window (all processes), then a fresh window."""
        both = torch.stack([self.agree, self.count]).to(accelerator.device)
        agree, count = accelerator.reduce(both, "sum").cpu()
        self.reset()
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
    steps = len(run.drafter.step_weights())
    local = torch.zeros(steps, device=accelerator.device)
    for batch in batches:
        local += run.drafter.loss_masks(batch["loss_mask"]).sum(dim=(1, 2))
    counts = accelerator.reduce(local, "sum") / n
    model = accelerator.unwrap_model(run.model)
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    for batch in batches:
        _, parts, _ = drafter_loss(
            run.drafter, model, run.target, batch, run.recipe.loss, counts, n
        )
        for key, value in parts.items():
            sums[key] = sums.get(key, 0) + value
    model.train()
    keys = [f"train/acc@{s + 1}" for s in range(steps)]
    keys += ["train/loss", "train/expected_accept"]
    keys += [f"train/expected_accept@{s + 1}" for s in range(1, steps)]
    return {
        "heldout/" + key.removeprefix("train/"): float(
            accelerator.reduce(torch.as_tensor(sums.get(key, 0.0)).to(accelerator.device), "sum")
        )
        for key in keys
    }
