"""Models whose samples interact: a BatchNorm normalising with the batch's statistics, a
module left in training mode. Stage 1 and stage 2 refuse them (:func:`deploykit.export.
check_batch_statistics`); the export check names them when sample 0 alone and inside a batch
disagree (:func:`deploykit.checks.export.check_batch_independence`).
"""
from __future__ import annotations


def batch_dependent_modules(model) -> tuple[list[tuple[str, str, str]], list[tuple[str, str]]]:
    """The modules whose outputs depend on the rest of the batch or on chance: BatchNorms that
    normalise with the batch's statistics (in training mode, ``track_running_stats=False``, or
    running statistics set to None: they do so even in ``eval()``), and other modules left in
    training mode that then compute differently (a Dropout with p > 0 draws random masks).

    Returns:
        ``(batchnorms, in_training)``: ``[(name, class name, why)]`` and ``[(name, class
        name)]``, in ``named_modules`` order.
    """
    import torch

    bn, train = [], []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            why = ("it is in training mode" if m.training else
                   "track_running_stats=False" if not m.track_running_stats else
                   "its running statistics are None" if m.running_mean is None else None)
            if why:
                bn.append((name or type(m).__name__, type(m).__name__, why))
        elif m.training and isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            # what training mode changes in PyTorch's own layers (a Conv or Linear left in it
            # computes the same; a Dropout with p 0 drops nothing)
            train.append((name or type(m).__name__, type(m).__name__))
    return bn, train


def batch_statistics_problem(model, consequence: str = "nothing exported") -> str | None:
    """The message that names the first module of :func:`batch_dependent_modules` (and how
    many more), why its samples interact, ``consequence`` and the fix; None when there is
    none."""
    bn, train = batch_dependent_modules(model)
    if bn:
        name, kind, why = bn[0]
        more = f" (and {len(bn) - 1} more BatchNorm modules)" if len(bn) > 1 else ""
        return (f"BatchNorm `{name}` ({kind}) uses batch statistics ({why}): the model is not "
                f"in eval mode or has track_running_stats=False{more}. Each sample's output "
                "depends on the other samples of its batch, so batch 1 and batch N deploy "
                f"different models; {consequence}. Fix: train with running statistics "
                "(track_running_stats=True) and return model.eval() from the factory, or "
                "replace it by GroupNorm/InstanceNorm")
    if train:
        name, kind = train[0]
        more = f" (and {len(train) - 1} more)" if len(train) > 1 else ""
        return (f"module `{name}` ({kind}) is in training mode after model.eval(){more} (does "
                "the model override train()/eval() or set .training?): its outputs change from "
                f"run to run or with the batch; {consequence}. Fix: leave every module in eval "
                "mode")
    return None
