"""Optimisation profiles: one over every input and dynamic axis, trtexec shape flags and named
dimensions.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Mapping, Sequence
import numpy as np

from deploykit.errors import StageError, UsageError
from deploykit.models import parse_dims, parse_input_shape, split_shape_name
from deploykit.onnx.graph import graph_inputs, load_onnx


# --------------------------------------------------------------------------------------------
# Shapes: one optimisation profile over every input and every dynamic axis
# --------------------------------------------------------------------------------------------
def onnx_inputs(path_or_model) -> list[tuple[str, list[int | None], np.dtype]]:
    """Every real graph input of an ONNX file (or model): ``[(name, dims, dtype)]``, dynamic
    dims as None (``deploykit.onnx.graph.graph_inputs``); reads the graph only, not external weights.

    Raises:
        StageError: the file is missing/unreadable or the graph has no input.
    """
    model = path_or_model if hasattr(path_or_model, "graph") else load_onnx(
        path_or_model, external=False)
    inputs = graph_inputs(model)
    if not inputs:
        raise StageError(f"{path_or_model if isinstance(path_or_model, (str, Path)) else 'model'}"
                         ": the graph has no input")
    return inputs


@dataclasses.dataclass(frozen=True)
class InputProfile:
    """Optimisation-profile shapes of one network input.

    Attributes:
        name: the ONNX input name.
        onnx_dims: dims in the ONNX file (None = dynamic).
        min, opt, max: the profile (every dim >= 1; equal where the ONNX dim is static).
        source: how the dynamic dims were chosen (for the record and the dry run).
    """

    name: str
    onnx_dims: tuple
    min: tuple
    opt: tuple
    max: tuple
    source: str

    @property
    def dynamic(self) -> bool:
        return any(d is None for d in self.onnx_dims)

    @property
    def static_profile(self) -> bool:
        return self.min == self.opt == self.max

    def as_dict(self) -> dict:
        return {"name": self.name, "onnx_dims": list(self.onnx_dims), "min": list(self.min),
                "opt": list(self.opt), "max": list(self.max), "source": self.source}


def parse_shape_specs(items: Sequence[str] | None, what: str = "--opt-shapes"
                      ) -> dict[str, tuple[int, ...]]:
    """Parse trtexec-style shape specs: each item ``name:DxDxD[,name2:DxD...]``; a name with
    ``:`` is written quoted (``'input:0':1x3x32x32``) or found by splitting on the last ``:``.

    Raises:
        UsageError: a spec without a name, bad dims, or the same name twice.
    """
    out: dict[str, tuple[int, ...]] = {}
    for item in items or []:
        # trtexec splits the list on every ","; names are quoted only to hold ":".
        for part in re.findall(r"(?:'[^']*'|[^,'])+", item):
            name, dims = split_shape_name(part.strip(), what)
            if not name:
                raise UsageError(f"{what} {part!r}: expected name:DxDxD")
            if name in out:
                raise UsageError(f"{what}: input {name!r} given twice")
            out[name] = parse_dims(dims, f"{what} {part!r}")
    return out


def input_profiles(inputs: Sequence[tuple[str, Sequence[int | None], Any]], *,
                   input_shapes: Sequence[str] = (), min_shapes: Mapping[str, Sequence[int]] = {},
                   opt_shapes: Mapping[str, Sequence[int]] = {},
                   max_shapes: Mapping[str, Sequence[int]] = {}, min_batch: int = 1,
                   opt_batch: int = 1, max_batch: int = 64, static: bool = False,
                   default_hw: int | None = None) -> list[InputProfile]:
    """The optimisation profile for every input.

    For each input: explicit ``--min/--opt/--max-shapes`` win (all three, or opt alone which
    then also sets min and max, as trtexec does; other partial sets are refused: trtexec's
    ``processShapes`` (sampleOptions.cpp, 8.5.1-v11.1) broadcasts them with only a warning for
    the build profile, and 8.5-10.x refuse them for the calibration profile); otherwise a dynamic axis 0 takes
    ``min/opt/max_batch`` and every other dynamic axis (spatial, sequence, ...) takes its size
    from the input's ``--input-shape`` value, else, for a 4-D image input, ``default_hw`` (the
    model's crop) on axes 2 and 3. ``static`` (DLA: "DLA does not support dynamic dimensions, so
    the profile's min, max, and opt values must be equal for wildcard dimensions", TensorRT docs
    "DLA Supported Layers and Restrictions") collapses every profile to its opt shape.

    Args:
        inputs: :func:`onnx_inputs` of the model.
        input_shapes: ``--input-shape`` values (:func:`deploykit.models.parse_input_shape`; an unnamed one is
            the input at its position).
        min_shapes, opt_shapes, max_shapes: :func:`parse_shape_specs` results.
        min_batch, opt_batch, max_batch: batch range for a dynamic axis 0.
        static: min = opt = max (DLA).
        default_hw: size for dynamic H/W of a 4-D input when nothing else gives one.
    Returns:
        one :class:`InputProfile` per input, in graph order.
    Raises:
        UsageError: an unknown input name, a rank or static-dim mismatch, min > opt > max, or a
            dynamic axis nothing gives a size for (the message names input, axis and the fix).
    """
    names = [n for n, _, _ in inputs]
    given: dict[str, tuple[int, ...]] = {}
    for i, item in enumerate(input_shapes or ()):
        name, dims, _ = parse_input_shape(item)
        name = name if name is not None else (names[i] if i < len(names) else None)
        if name not in names:
            raise UsageError(f"--input-shape {item!r}: the model has no input {name!r} "
                             f"(inputs: {', '.join(names)})")
        given[name] = dims
    for flag, spec in (("--min-shapes", min_shapes), ("--opt-shapes", opt_shapes),
                       ("--max-shapes", max_shapes)):
        for n in spec:
            if n not in names:
                raise UsageError(f"{flag}: the model has no input {n!r} (inputs: "
                                 f"{', '.join(names)})")
    if not (1 <= min_batch <= opt_batch <= max_batch):
        raise UsageError(f"batch range must satisfy 1 <= --min-batch ({min_batch}) <= --opt-batch "
                         f"({opt_batch}) <= --max-batch ({max_batch})")
    out = []
    for idx, (name, dims, _dtype) in enumerate(inputs):
        dims = tuple(dims)
        rank = len(dims)

        def check(shape: Sequence[int], what: str) -> tuple[int, ...]:
            shape = tuple(int(d) for d in shape)
            if len(shape) != rank:
                raise UsageError(f"{what} for input {name!r}: {len(shape)} dims, the ONNX input "
                                 f"has {rank} ({fmt_dims(dims)})")
            for ax, (s, d) in enumerate(zip(shape, dims)):
                if d is not None and s != d:
                    raise UsageError(f"{what} for input {name!r}: axis {ax} is {s}, the ONNX "
                                     f"input fixes it to {d} ({fmt_dims(dims)})")
            return shape

        explicit = [name in s for s in (min_shapes, opt_shapes, max_shapes)]
        if any(explicit):
            if explicit != [True] * 3 and explicit != [False, True, False]:
                raise UsageError(f"input {name!r}: give --opt-shapes alone or all of --min-shapes, "
                                 "--opt-shapes, --max-shapes (a partial set is ambiguous: "
                                 "trtexec fills it in with a warning, and refuses it for the "
                                 "calibration profile of --int8 builds)")
            opt = check(opt_shapes[name], "--opt-shapes")
            lo = check(min_shapes.get(name, opt), "--min-shapes")
            hi = check(max_shapes.get(name, opt), "--max-shapes")
            if not all(a <= b <= c for a, b, c in zip(lo, opt, hi)):
                raise UsageError(f"input {name!r}: need min <= opt <= max on every axis, got "
                                 f"{fmt_dims(lo)} / {fmt_dims(opt)} / {fmt_dims(hi)}")
            source = "--min/--opt/--max-shapes"
        else:
            lo, opt, hi, why = [], [], [], []
            user = check(given[name], "--input-shape") if name in given else None
            for ax, d in enumerate(dims):
                if d is not None:
                    lo.append(d), opt.append(d), hi.append(d)
                elif ax == 0:
                    lo.append(min_batch), opt.append(opt_batch), hi.append(max_batch)
                    why.append("axis 0: --min/--opt/--max-batch")
                elif user is not None:
                    lo.append(user[ax]), opt.append(user[ax]), hi.append(user[ax])
                    why.append(f"axis {ax}: --input-shape")
                elif default_hw and rank == 4 and ax in (2, 3):
                    lo.append(default_hw), opt.append(default_hw), hi.append(default_hw)
                    why.append(f"axis {ax}: the model's crop {default_hw}")
                else:
                    raise UsageError(
                        f"input {name!r} axis {ax} is dynamic in the ONNX ({fmt_dims(dims)}) and "
                        f"nothing gives its size: pass --input-shape {_quote(name)}:"
                        f"{','.join(str(x) if x else 'N' for x in dims)} with N replaced, or a "
                        f"range with --min-shapes/--opt-shapes/--max-shapes "
                        f"{_quote(name)}:{'x'.join(str(x) if x else 'N' for x in dims)}")
            lo, opt, hi = tuple(lo), tuple(opt), tuple(hi)
            source = "; ".join(why) if why else "static in the ONNX"
        if static and not (lo == opt == hi):
            lo = hi = opt
            source += "; static for DLA (min = opt = max)"
        out.append(InputProfile(name, dims, lo, opt, hi, source))
    return out


def trt_layer_names(model) -> list[tuple[str, str]]:
    """``[(layer name, op type)]`` of an ONNX model's nodes, in graph order, named as TensorRT's
    ONNX parser names their layers (and build logs print them): the node name, or
    ``node_of_<first output>`` for an unnamed node (onnx-tensorrt ``getNodeName``:
    ``onnx2trt_utils.cpp`` at release/8.5-GA and 8.6-GA, ``importerUtils.cpp`` at 10.0-GA to
    main)."""
    return [(n.name or (f"node_of_{n.output[0]}" if len(n.output) else ""), n.op_type)
            for n in model.graph.node]


def check_named_dims(model, profiles: Sequence[InputProfile]) -> None:
    """Refuse profiles in which inputs that share an ONNX dim name get disjoint ranges.

    "Two network inputs with the same named dimension parameter are considered equal. TensorRT
    supports this feature by checking that in the optimization profile these dimensions have
    overlapping intervals and that at runtime they have the same value" (NVIDIA/TensorRT
    samples/sampleNamedDimensions README, tags 8.5.1 to v11.1), so such a profile fails the build.

    Args:
        model: the ONNX model the profiles were made for (``dim_param`` names are read from it).
        profiles: :func:`input_profiles` of that model.
    Raises:
        UsageError: the dim name, each (input, axis) that holds it with its range, and the fix.
    """
    by_name = {p.name: p for p in profiles}
    users: dict[str, list[tuple[str, int, int, int]]] = {}
    for i in model.graph.input:
        p = by_name.get(i.name)
        if p is None:
            continue
        for ax, d in enumerate(i.type.tensor_type.shape.dim):
            if d.dim_param and ax < len(p.min):
                users.setdefault(d.dim_param, []).append((i.name, ax, p.min[ax], p.max[ax]))
    for dim, uses in users.items():
        if len(uses) > 1 and max(u[2] for u in uses) > min(u[3] for u in uses):
            where = ", ".join(f"{n} axis {ax}: {lo}..{hi}" for n, ax, lo, hi in uses)
            raise UsageError(f"the ONNX names these dims {dim!r}, so TensorRT needs them equal, "
                             f"but their profile ranges do not overlap ({where}): give them the "
                             "same size in --input-shape / --min/--opt/--max-shapes")


def fmt_dims(dims: Sequence[int | None]) -> str:
    """``[None, 3, 224, 224]`` -> ``"?x3x224x224"``."""
    return "x".join("?" if d is None else str(d) for d in dims)


def _quote(name: str) -> str:
    return f"'{name}'" if ":" in name else name


def trtexec_shape_name(name: str) -> str:
    """An input name as trtexec's shape syntax needs it: quoted when it contains ``:``.

    Raises:
        UsageError: a name with ``,`` (separates inputs) or ``'`` (the quote character) cannot be
            written in trtexec's syntax (sampleOptions.cpp ``splitNameAndValue``).
    """
    if "," in name or "'" in name:
        raise UsageError(f"input name {name!r} cannot be written in trtexec's shape syntax ("
                         "',' separates inputs and \"'\" quotes names): rename the input when "
                         "exporting the ONNX model")
    return _quote(name)


def shape_flags(profiles: Sequence[InputProfile]) -> list[str]:
    """``--minShapes/--optShapes/--maxShapes`` for the dynamic inputs (all of them in one
    comma-separated list per flag); ``[]`` when every input is static."""
    dyn = [p for p in profiles if p.dynamic]
    if not dyn:
        return []
    out = []
    for flag, attr in (("--minShapes", "min"), ("--optShapes", "opt"), ("--maxShapes", "max")):
        spec = ",".join(f"{trtexec_shape_name(p.name)}:{'x'.join(str(d) for d in getattr(p, attr))}"
                        for p in dyn)
        out.append(f"{flag}={spec}")
    return out
