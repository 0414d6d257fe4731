"""One micro-batch: rows of the training data padded into tensors, and the drafter's loss on them.

:func:`micro_batch` picks the rows of global micro-batch ``index`` (a seeded permutation per
epoch, optionally grouped by length) and :func:`collate` pads them; :func:`drafter_loss` runs
the target (or reads its cached teacher) and the drafter's S steps and returns the loss with
its metrics. The training loop, the held-out evaluation and the benchmarks share them.
"""

from __future__ import annotations

import torch

from specdec.losses import acceptance_rate, distill_loss, masked_mean, teacher_mass


def micro_batch(
    dataset,
    index: int,
    batch_size: int,
    seed: int,
    pad_id: int,
    lengths: torch.Tensor | None = None,
    group: int = 1,
    cache=None,
    rows: torch.Tensor | None = None,
) -> dict:
    """Global micro-batch ``index`` of a seeded per-epoch permutation of the training ``rows``
    (default: all of ``dataset``; the last partial batch dropped), padded by :func:`collate`.

    With ``group`` > 1 (and the rows' ``lengths``), each window of ``group`` micro-batches of
    the permutation is sorted by length before it is cut, and its micro-batches are taken in a
    seeded shuffled order: rows of a batch have similar lengths, so little of it is padding.
    With a teacher ``cache`` the batch also holds the rows' cached teacher.
    """
    rows = torch.arange(len(dataset)) if rows is None else rows
    per_epoch = len(rows) // batch_size
    epoch, j = divmod(index, per_epoch)
    generator = torch.Generator().manual_seed(seed + epoch)
    order = rows[torch.randperm(len(rows), generator=generator)]
    if group > 1 and lengths is not None:
        size = group * batch_size
        w, i = divmod(j, group)
        window = order[w * size : (w + 1) * size]
        window = window[torch.argsort(lengths[window], stable=True)]
        count = len(window) // batch_size
        pick = torch.randperm(count, generator=torch.Generator().manual_seed(seed + epoch + w))
        j, order = int(pick[i]), window
    return collate(dataset, order[j * batch_size : (j + 1) * batch_size].tolist(), pad_id, cache)


def collate(dataset, indices: list[int], pad_id: int, cache=None) -> dict:
    """Rows ``indices`` of ``dataset`` right-padded to the longest: ``input_ids``,
    ``attention_mask``, ``loss_mask`` ``[B, T]`` and ``rows`` ``[B]`` (the indices); with a
    teacher ``cache`` also the rows' cached teacher."""
    rows = dataset[indices]
    width = max(len(ids) for ids in rows["input_ids"])
    batch = {"input_ids": [], "attention_mask": [], "loss_mask": []}
    for ids, mask in zip(rows["input_ids"], rows["loss_mask"], strict=True):
        pad = width - len(ids)
        batch["input_ids"].append(ids + [pad_id] * pad)
        batch["attention_mask"].append([1] * len(ids) + [0] * pad)
        batch["loss_mask"].append(mask + [0] * pad)
    batch = {key: torch.tensor(value) for key, value in batch.items()}
    batch["rows"] = torch.tensor(indices)
    if cache is not None:
        batch |= cache.batch(indices, width, batch["input_ids"])
    return batch


def drafter_loss(
    drafter,
    model,
    target,
    batch: dict,
    loss_cfg,
    num_tokens: torch.Tensor,
    processes: int = 1,
    detail: bool = True,
) -> tuple[torch.Tensor, dict, tuple[torch.Tensor, torch.Tensor]]:
    """The loss of one micro-batch and its metrics: the target's forward (logits and the layers
    the drafter reads), the drafter's S steps, a loss per step weighted by ``step_weights``.

    Args:
        drafter: the drafter (teacher, masks, step weights).
        model: its trainable module (possibly wrapped by DDP).
        target: the frozen target.
        batch: ``input_ids``, ``attention_mask``, ``loss_mask`` ``[B, T]``.
        loss_cfg: the recipe's ``loss`` section.
        num_tokens: ``[S]`` each step's global count of trained positions divided by the
            process count: every step's loss is its sum over that count.
        processes: the process count (metrics are shares of a sum over processes).
        detail: whether to compute every metric. Without it only the loss, its parts and
            ``train/acc@1`` are returned: the others (top-5 and expected acceptance over the
            draft vocabulary, every step's argmax) cost a fifth of a step on a CPU, and the
            loop logs them only every ``train.log_every`` steps.

    Returns:
        The scalar loss, per-token metric shares (summed over micro-batches and processes,
        they are the step's global means), and per row ``[B]`` of the first step: the
        positions where the draft's argmax is the target's and the positions trained.
    """
    layers = drafter.required_target_layers
    ids, attention = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        if "teacher_log_probs" in batch:  # read from the teacher cache
            log_p, best = batch["teacher_log_probs"], batch["teacher_best"]
            teacher = drafter.shifted_teacher(
                log_p, best, batch["loss_mask"], batch["teacher_rows"]
            )
            features = list(batch["features"]) if layers else []
        else:  # the target's logits only where a step's teacher reads them
            wanted = _shift_left(batch["loss_mask"]).bool()
            out = target.forward(ids, attention, hidden_layers=layers, logits_at=wanted)
            teacher = drafter.teacher(out.logits, batch["loss_mask"], at=wanted)
            features = [out.hidden_states[i] for i in layers]
    at = teacher.mask.any(dim=0)  # [B, T]: the rows some step trains
    logits = model(ids, attention, features, at=at)  # [S, N, D] (or S tensors of their widths)
    if isinstance(logits, torch.Tensor):  # one backward copy of [S, N, D], not S zero-filled
        logits = logits.unbind(0)
    weights = drafter.step_weights()
    loss, metrics = 0.0, {}
    for s in range(len(logits)):
        # every row some step trains: the rows this step does not train are masked out of
        # its loss and metrics (a gradient of zero there, as selecting them out would give)
        log_p, tokens, mask = (x[None] for x in teacher.over(s, at))
        draft = logits[s][None]  # [1, N, D]; the losses and metrics compute in float32
        step_loss, parts = distill_loss(
            draft,
            log_p,
            mask,
            mix=loss_cfg.mix or {loss_cfg.name: 1.0},
            temperature=loss_cfg.temperature,
            beta=loss_cfg.beta,
            teacher_top_k=loss_cfg.teacher_top_k,
            target_tokens=tokens,  # ce: the target's own argmax; none outside the draft's
            num_tokens=num_tokens[s],
        )
        loss = loss + float(weights[s]) * step_loss
        if s == 0:
            metrics |= {f"train/loss/{k}": v.detach() / processes for k, v in parts.items()}
        if s > 0 and not detail:
            continue
        with torch.no_grad():
            # the target's full-vocabulary argmax as a draft index, -1 outside it: a miss
            # there, as when decoding
            agree = draft.argmax(dim=-1) == tokens  # [1, N]
            metrics[f"train/acc@{s + 1}"] = agree.sum() / num_tokens[s] / processes
            if detail:
                total = num_tokens[s] * processes
                metrics |= _more_metrics(draft, log_p, tokens, mask, s, total)
        if s == 0:
            row = at.nonzero(as_tuple=True)[0]  # the batch row of each position
            hits = torch.zeros(at.shape[0], dtype=torch.long, device=row.device)
            counts = teacher.mask[0].sum(dim=1)
            rows = (hits.index_add_(0, row, agree[0].long()), counts)  # per row
    return loss, {"train/loss": loss.detach() / processes, **metrics}, rows


def _more_metrics(draft, log_p, tokens, mask, s: int, total) -> dict:
    """Step ``s``'s top-5 agreement and expected acceptance (of the first step also the
    positions outside the draft vocabulary and the teacher mass it holds), each a share of the
    ``total`` positions of all processes."""
    share = mask.sum() / total
    top5 = draft.topk(min(5, draft.shape[-1]), dim=-1).indices  # [1, N, 5]
    suffix = "" if s == 0 else f"@{s + 1}"
    out = {
        f"train/top5@{s + 1}": (top5 == tokens.unsqueeze(-1)).any(-1).sum() / total,
        f"train/expected_accept{suffix}": acceptance_rate(draft, log_p, mask) * share,
    }
    if s == 0:
        out["train/out_of_vocab"] = masked_mean((tokens < 0).float(), mask) * share
        out["train/teacher_mass"] = teacher_mass(log_p, mask) * share
    return out


def step_counts(drafter, batches: list[dict], accelerator) -> torch.Tensor:
    """``[S]``: each draft step's count of trained positions in ``batches`` over all processes,
    divided by the process count (``drafter_loss``'s ``num_tokens``; DDP averages gradients)."""
    local = torch.zeros(len(drafter.step_weights()), device=accelerator.device)
    for batch in batches:  # a process may hold none (held-out rows fewer than processes)
        local += drafter.loss_masks(batch["loss_mask"]).sum(dim=(1, 2))
    return accelerator.reduce(local, "sum") / accelerator.num_processes


def _shift_left(mask: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: position t is set where token t + 1 is (the teacher rows of every step)."""
    out = torch.zeros_like(mask)
    out[:, :-1] = mask[:, 1:]
    return out
