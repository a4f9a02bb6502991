"""TensorRT rules, per-version trtexec command lines and detection, for stages 6 and 7.

- Versions: parse and encode TensorRT version numbers.
- Rules per TensorRT version, each with its source: precision flags, DLA availability and its
  INT8 path, the ONNX parser's opset (the rule table is also in the README, "TensorRT").
- Shapes: an optimisation profile for every input and every dynamic axis, from the ONNX model,
  ``--input-shape`` and ``--min/--opt/--max-shapes``, written in trtexec's syntax.
- :func:`build_command`: the trtexec argv for one variant.
- Detection: trtexec, the libnvinfer it really loads, the Python runtime, Jetson facts.
- Stage 7 helpers: the batch-invariance check and plan-load diagnosis.

Log, layer-info and header parsers live in ``deploykit.trt.parsers``; ONNX preparation for a build
(opset-17 Q/DQ for 8.x, calibration cache) in ``deploykit.trt.onnx_prep``; the stage-6 driver in
``6_build_engines.py``. Nothing here imports TensorRT at module level, so everything runs (and is
tested) on machines without TensorRT or a GPU. ``python trt_tools.py detect`` prints what
detection finds.

Sources relied on (read to learn; flag names checked per release in NVIDIA/TensorRT
``samples/common/sampleOptions.cpp`` at tags 8.5.1, v8.6.1, v9.3.0, v10.0.1, v10.1.0, v10.3.0,
v10.16, v11.0, v11.1):
- trtexec flags: ``--onnx``, ``--saveEngine``, ``--loadEngine``, ``--timingCacheFile``,
  ``--min/opt/maxShapes``, ``--memPoolSize=workspace:<size>`` (8.4+),
  ``--profilingVerbosity=detailed`` + ``--exportLayerInfo`` (8.2+), ``--useDLACore`` / ``--allowGPUFallback``, ``--noTF32``,
  ``--calib=<file>`` (8.x-10.x; with ``--int8``).
- Shape specs: ``name:DxDxD``, several inputs comma-separated; "Input names can be wrapped with
  escaped single quotes (ex: 'Input:0')" (trtexec --help); ``splitNameAndValue`` in
  sampleOptions.cpp (8.5+) takes the text inside exactly two single quotes as the name, else
  splits on the last ``:``; the list is split on ``,`` first. So a name with ``,`` or ``'`` cannot
  be written (refused here) and a name with ``:`` is quoted.
- ``--memPoolSize=workspace:N`` is written without a unit suffix: a plain number is MiB in every
  release ("in MiB" in 8.4-10.0's help; "If none of suffixes is appended, the defualt unit is in
  MiB" from 10.1). The ``B/K/M/G`` suffixes are parsed from 10.0.0, but 10.0.0/10.0.1 turn
  ``512M`` into 512 * 2**20 and then ``roundToBytes`` multiplies by 2**20 again (a limit 2**20
  times too large); 10.1.0 fixed it (``workspace = memPoolSize / 1.0_MiB``).
- ``--fp16`` / ``--int8`` / ``--best`` exist up to 10.x and are gone in 11.x ("Unknown option",
  captured in tests/data/trt/trtexec_11.0.0_b200_..._unknown_option_fp16_int8_best.log).
- ``--stronglyTyped`` exists from 9.x; in 11.x it is a documented no-op (strong typing is the only
  mode), so it is not passed there.
- ``--workspace``, ``--explicitBatch``, ``--buildOnly`` were removed in 10.0 (TensorRT docs,
  "Migrating trtexec Usage from TensorRT 8.x to 10.x"); they are never passed.
- ``--getPlanVersionOnly`` exists from 9.x (absent in 8.6.1's sampleOptions.cpp). It prints
  ``Plan was created with TensorRT version A.B.C.D`` (sampleEngines.cpp ``printPlanVersion``).
- The ``[TensorRT vNNNNN]`` banner and the ``TensorRT version: X.Y.Z`` line are both compiled into
  trtexec (``NV_TENSORRT_VERSION`` / ``NV_TENSORRT_MAJOR..PATCH`` macros), so neither tells which
  libnvinfer is really loaded; :func:`loaded_libnvinfer` asks the dynamic loader instead.


The code lives in :mod:`deploykit.trt` and :mod:`deploykit.tools.trt_tools`.
"""
from deploykit.tools.trt_tools import main

if __name__ == "__main__":
    main()
