"""The Python names the root tools had before the library moved into ``deploykit/``.

``layerwise.py``, ``qdq_tools.py``, ``export_checks.py``, ``trt_tools.py`` and
``auto_precision.py`` were modules with their functions in them; user scripts imported them
(``import layerwise; layerwise.trt_remedies(...)``). They are thin commands now, and each
resolves a former name on first use from the module that holds it today (:func:`former_api`,
a module ``__getattr__``, PEP 562), so those scripts keep working without the commands paying
for imports they do not use. New code imports from the modules named here.
"""
from __future__ import annotations

import importlib
from typing import Any, Callable

#: ``{root command: {module: (former names it holds now)}}``: the public functions, classes
#: and constants of each root file before the package layout (commit fb8eb44), where they
#: live now (names that left the project are not listed).
FORMER_NAMES: dict[str, dict[str, tuple[str, ...]]] = {
    "layerwise": {
        "deploykit.compare": ("TOLERANCES", "TensorStat", "compare_outputs", "tolerances_for"),
        "deploykit.feeds": ("feed_plan", "input_shape_batch", "load_feed", "match_inputs"),
        "deploykit.layerwise.diff": ("run_layer_diff",),
        "deploykit.layerwise.quant_backend": ("quant_backend_table", "quantization_steps",
                                              "render_quant_backend"),
        "deploykit.layerwise.remedies": ("fp16_remedy_command", "trt_remedies"),
        "deploykit.layerwise.report": ("plot_rows", "plot_similarity", "render_table",
                                       "write_reports"),
        "deploykit.layerwise.torch_vs_onnx": ("node_module_paths", "torch_vs_onnx"),
        "deploykit.onnx.activations": ("LOOK_THROUGH_OPS", "MARKING_NOTE", "chunk_size",
                                       "lookthrough_aliases", "ort_activations",
                                       "trt_activations", "trt_available"),
        "deploykit.trt.rules": ("TRT_RULES",),
    },
    "qdq_tools": {
        "deploykit.io": ("load_npz",),
        "deploykit.numerics": ("FP16_MIN_NORMAL", "FP16_MIN_SUBNORMAL"),
        "deploykit.quant.calibration": ("CALIB_MEMORY_FRACTION", "STATS_MAX_MEAN_SHIFT",
                                        "STATS_MAX_RANGE_RATIO", "STATS_MAX_STD_RATIO",
                                        "STATS_RANGE_MIN_VALUES", "activation_bytes_per_sample",
                                        "calibration_plan", "calibration_reference",
                                        "check_calib_cli", "deployment_shapes", "input_stats",
                                        "validate_calibration"),
        "deploykit.quant.cross_check": ("CROSS_CHECK_FIRST", "X64_QUANT_PRECISION",
                                        "backend_cross_check"),
        "deploykit.quant.inspect": ("activation_stats", "inspect_model", "print_inspect"),
        "deploykit.quant.int4": ("check_blocked_dq", "dequantize_blocked", "fix_int4_axis"),
        "deploykit.quant.modelopt": ("modelopt_quantize",),
        "deploykit.quant.modelopt_log": ("KEEP_WARNINGS", "log_warnings", "ort_smoke"),
        "deploykit.quant.nodes": ("list_depthwise", "list_stem", "weight_shape"),
        "deploykit.quant.record": ("calibration_summary", "check_record", "print_check",
                                   "record_quant", "run_check"),
        "deploykit.tools.qdq_tools": ("layer_diff",),
    },
    "export_checks": {
        "deploykit.checks.base": ("STATUS_ORDER", "format_result", "node_label", "source_line",
                                  "value_shapes", "worst"),
        "deploykit.checks.export": ("RANGE_CHECKS", "capture_warnings",
                                    "check_batch_independence", "check_batch_parity",
                                    "check_data_dependent_ops", "check_dynamic_axes",
                                    "check_export", "check_exporter_warnings",
                                    "check_input_paths", "check_unused_inputs", "keep_list",
                                    "ort_runner", "other_paths", "random_feed", "torch_runner"),
        "deploykit.checks.fp16": ("ACCUMULATING_REDUCTIONS", "CONSTANT_CHANGE_SHARE",
                                  "REFERENCE_SLOWDOWN", "REFERENCE_STRICTER_OPS", "RangeStat",
                                  "UNDERFLOW_MASS_SHARE", "convert_fp16", "fp16_backends",
                                  "fp16_checks", "fp16_converter_changes", "fp16_held_tensors",
                                  "fp16_range_audit", "fp16_true_arithmetic", "keep_fp32_nodes"),
        "deploykit.checks.lint": ("DATA_DEPENDENT_OPS", "DEFAULT_EXAMPLE_BATCH",
                                  "HARDSIGMOID_TORCH", "LINT_CHECKS", "SOFTMAX_OPS", "lint",
                                  "lint_blocked_qdq_opset", "lint_fp16_initializers",
                                  "lint_hardsigmoid", "lint_shape_constants", "lint_softmax_axis",
                                  "lint_squeeze_axes"),
        "deploykit.install": ("install", "install_rejected", "rejected_path"),
        "deploykit.numerics": ("FP16_MAX", "FP16_MIN_NORMAL", "FP16_MIN_SUBNORMAL"),
        "deploykit.tools.export_checks": ("cmd_fp16",),
    },
    "trt_tools": {
        "deploykit.layout": ("engine_paths", "engines_dir"),
        "deploykit.trt.commands": ("build_command", "plan_version_command"),
        "deploykit.trt.detect": ("Detected", "JETPACK_TRTEXEC", "detect",
                                 "detect_with_loader_fix", "find_trtexec", "jetson_info",
                                 "libnvinfer_version", "loaded_libnvinfer", "python_trt_libdirs",
                                 "python_trt_version", "version_conflicts"),
        "deploykit.trt.plans": ("BATCH_INVARIANCE_NOTE", "BATCH_INVARIANCE_REL_TOL",
                                "batch_invariance", "diagnose_plan_load", "fit_batch"),
        "deploykit.trt.profiles": ("InputProfile", "check_named_dims", "fmt_dims",
                                   "input_profiles", "onnx_inputs", "parse_shape_specs",
                                   "shape_flags", "trt_layer_names", "trtexec_shape_name"),
        "deploykit.trt.rules": ("DEFAULT_VARIANTS", "DLA_BACK_IN_11", "DLA_LAST_10X",
                                "DLA_MIN_FRACTION_WARN", "INT8_ROUTES", "MAX_PARSER_OPSET",
                                "MIN_VERSION", "UnsupportedVariant", "check_supported",
                                "dla_allowed", "dla_unavailable", "encode_version_int",
                                "full_version", "int8_route", "opset_advice", "parse_version",
                                "variant_unsupported", "vstr"),
        "deploykit.variants": ("VARIANTS",),
    },
    "auto_precision": {
        "deploykit.onnx.graph": ("INT8_TYPES", "MAC_OPS"),
        "deploykit.quant.auto.inputs": ("base_qdq", "tuning_data"),
        "deploykit.quant.auto.report": ("plot_sensitivity", "publish", "record_paths",
                                        "render_markdown", "write_outputs"),
        "deploykit.quant.auto.search": ("Budget", "CACHE_VERSION", "Cache", "DEFAULT_BUDGET",
                                        "MODE", "SEMANTICS", "VARIANT", "anchored",
                                        "budget_warnings", "cached_outputs", "cosine_error",
                                        "data_digest", "run_model", "search"),
        "deploykit.quant.auto.space": ("Candidate", "QdqSpace"),
        "deploykit.quant.macs": ("mac_summary", "mac_table"),
        "deploykit.tools.auto_precision": ("budget_from_args", "cmd_macs", "cmd_search",
                                           "cmd_verify"),
    },
}


def former_api(root: str) -> Callable[[str], Any]:
    """A module ``__getattr__`` for the root command ``root`` (e.g. ``"layerwise"``): a former
    name is imported from the module that holds it now; any other name raises AttributeError.

    Raises:
        KeyError: ``root`` is not one of :data:`FORMER_NAMES`.
    """
    where = {name: mod for mod, names in FORMER_NAMES[root].items() for name in names}

    def __getattr__(name: str) -> Any:
        mod = where.get(name)
        if mod is None:
            raise AttributeError(f"module {root!r} has no attribute {name!r} (its library "
                                 "lives in deploykit/; deploykit.compat.FORMER_NAMES lists the "
                                 "names kept importable from here)")
        return getattr(importlib.import_module(mod), name)

    return __getattr__


def former_dir(root: str, namespace: dict) -> Callable[[], list[str]]:
    """A module ``__dir__`` for the root command ``root``: its own names (``namespace``, its
    ``globals()``) and the former ones of :data:`FORMER_NAMES`, so ``dir()`` and completion
    list them too."""
    names = {name for names in FORMER_NAMES[root].values() for name in names}

    def __dir__() -> list[str]:
        return sorted(set(namespace) | names)

    return __dir__
