"""PyTorch on the CPU at its floor (issue 21): channels-last layout and chunked batches for
:class:`deploykit.runners.TorchRunner`, with the fallbacks that keep any model running; the
chunk sizes of PyTorch and of ORT's CPU EP (:class:`deploykit.runners.OrtRunner`).

Measured (EfficientNet-Lite0 FP32, 128 images, 2-core Intel Xeon with AVX512-VNNI,
2026-12-02, torch 2.14.1, 2 threads): NCHW 6.1 s at batch 64, 4.0 s at 16; channels-last
4.1 s at 64, 2.4 s at 16 and at 8. Channels-last is oneDNN's native layout for convolutions; its
logits differ from NCHW's by FP32 rounding only (max |difference| 9.5e-6 over the 900 eval
images' logits, the same top-1 on every image).
"""
from __future__ import annotations

import numpy as np

from deploykit.errors import out_of_memory_message

#: Samples per forward() of PyTorch on the CPU: a larger accuracy batch runs in chunks of this
#: size (see the module docstring for the figures).
CPU_CHUNK = 16

#: Samples per ``InferenceSession.run`` when ORT's CPU EP runs a large accuracy batch in chunks
#: (``OrtRunner(cpu_chunk=True)``). Chunks of 4 against 16, per image, median of five
#: interleaved passes over 256 eval images (2-core Intel Xeon with AVX512-VNNI, onnxruntime
#: 1.32.0, 2026-12-07, stop 46): EfficientNet-Lite0 FP32 4.16 / 4.39 ms, FP16 graph 6.28 /
#: 7.37, INT8 (ModelOpt, fp32 scales) 7.22 / 7.64, INT4 4.43 / 4.58; ResNet-18 FP32 12.77 /
#: 13.53, FP16 12.79 / 13.15, INT8 20.45 / 20.53; chunks of 2 and 1 no faster (benchmarks/
#: README.md). Outputs are compared bit for bit before chunks are kept
#: (``deploykit.runners.OrtRunner.infer``).
ORT_CPU_CHUNK = 4

#: Feeds shorter than this run whole (a failed row's 32-image first look is not run twice).
ORT_CHUNK_MIN_FEED = 64


def forward_cpu_layout(runner, args: list, model):
    """``model(*args)`` under ``torch.inference_mode()``; on the CPU in channels-last layout
    (weights and 4-D inputs), tried on the first call and dropped for good when the model
    cannot take it (a ``RuntimeError`` such as ``x.view`` of a non-contiguous conv output).

    Args:
        runner: the :class:`deploykit.runners.TorchRunner` (its ``torch``, ``model`` and
            ``channels_last``: None = not tried, True/False = decided; updated here).
        args: the input tensors. model: the module to call (the runner's or a compiled one).
    Returns:
        what ``model`` returns.
    Raises:
        RuntimeError: the model fails in its own layout too, or runs out of memory.
    """
    torch = runner.torch
    if runner.channels_last is False:
        with torch.inference_mode():
            return model(*args)
    cl = torch.channels_last

    def as_cl(xs):
        return [a.contiguous(memory_format=cl) if a.dim() == 4 else a for a in xs]

    if runner.channels_last is None:
        # the layout change outside inference mode: the parameters stay ordinary tensors
        # (export and autograd use the same module later)
        with torch.no_grad():  # Module.to changes the module in place and returns it
            model.to(memory_format=cl)
        try:
            with torch.inference_mode():
                out = model(*as_cl(args))
            runner.channels_last = True
            return out
        except RuntimeError as e:
            if out_of_memory_message(e, None, "") is not None:  # not a layout problem
                raise
            runner.channels_last = False
            with torch.no_grad():
                model.to(memory_format=torch.contiguous_format)
            with torch.inference_mode():
                return model(*args)
    with torch.inference_mode():
        return model(*as_cl(args))


def infer_in_chunks(infer, feed: dict, n: int | None, chunk: int = CPU_CHUNK) -> dict | None:
    """``infer`` of ``feed`` in chunks of ``chunk`` samples (default :data:`CPU_CHUNK`,
    PyTorch's; ORT's CPU EP uses ``deploykit.runners.ORT_CPU_CHUNK``), or None when the feed is
    no larger than a chunk or the model's outputs are not per sample (then the caller runs the
    whole batch; the runners record what they decided in ``chunked``).

    Args:
        infer: what runs one chunk (``{name: array}`` -> ``{output name: array}``).
        feed: ``{name: array [n, ...]}``; arrays whose axis 0 is not ``n`` long go to every
            chunk whole (an array that is ``n`` long by coincidence is cut, and an output whose
            axis 0 is the chunk's size by coincidence is concatenated: ``OrtRunner`` compares
            its first chunked feed with a whole run).
        n: the batch (axis 0).
    Returns:
        ``{output name: array [n, ...]}``, the chunks' outputs concatenated, or None.
    """
    if not n or n <= chunk:
        return None
    starts = range(0, n, chunk)
    parts = [infer({k: v[i:i + chunk] if np.ndim(v) and len(v) == n else v
                    for k, v in feed.items()}) for i in starts]
    sizes = [min(chunk, n - i) for i in starts]
    if all(np.ndim(p[k]) and len(p[k]) == m for p, m in zip(parts, sizes) for k in p):
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    return None
