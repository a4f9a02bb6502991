"""The pipeline's shared API under the name the stages and README have always used.

Everything here is re-exported from the :mod:`deploykit` package, one concern per module:
``deploykit.cli`` (errors, exit codes, shared flags), ``deploykit.layout`` (artifact and result
paths), ``deploykit.io`` (atomic writes, the one ``load_npz``), ``deploykit.results``
(provenance, result rows), ``deploykit.models`` (model table, loading, input shapes),
``deploykit.data`` (images, splits, the uint8 cache), ``deploykit.compare`` (top-k, cosine,
parity, tolerances), ``deploykit.timing`` and ``deploykit.envinfo`` (versions, CPU, GPU).
New code imports from those modules; ``python common.py --env-summary`` prints the
environment (env.sh runs it).
"""
import sys

from deploykit.cli import (  # noqa: F401
    DEFAULT_MODEL,
    HelpFormatter,
    add_shared_args,
    check_positive,
    cli,
    default_model,
    env_assignment,
    int_at_least,
    model_arg,
    progress_bar,
    stage_parser,
    usable_cpus,
)
from deploykit.compare import (  # noqa: F401
    cosine_rows,
    parity,
    topk_accuracy,
)
from deploykit.data.images import (  # noqa: F401
    IMAGE_SUFFIXES,
    LargeImageWarning,
    SUBSET_FLAG,
    imagenet_wnids,
    list_images,
    load_image_rgb,
    normalize,
    preprocess_image,
    to_rgb8,
)
from deploykit.data.splits import (  # noqa: F401
    PREPROCESS_VERSION,
    align_reference,
    build_cache,
    cache_key,
    cache_path,
    drop_content_duplicates,
    load_split,
    load_splits,
    make_splits,
    preprocess_items,
    save_cache,
    split_tuning,
)
from deploykit.envinfo import (  # noqa: F401
    cpu_has_vnni,
    cpu_int8_flags,
    device_info,
    env_summary,
    git_sha,
    gpu_driver,
    ort_eps_that_load,
    versions,
)
from deploykit.errors import (  # noqa: F401
    StageError,
    UsageError,
)
from deploykit.io import (  # noqa: F401
    atomic_path,
    check_writable,
    file_size_mb,
    load_json,
    load_npz,
    require,
    sha256_file,
    write_json,
)
from deploykit.layout import (  # noqa: F401
    DEFAULT_DATA,
    ROOT,
    artifacts_dir,
    check_row_tag,
    model_artifacts,
    model_results,
    model_tag,
    result_sidecars,
    results_dir,
    safe_name,
    splits_path,
)
from deploykit.models import (  # noqa: F401
    IMAGENET_MEAN,
    IMAGENET_STD,
    MODEL_TABLE,
    ModelSpec,
    build_efficientnet_lite0,
    build_model,
    example_inputs,
    load_state_dict_checked,
    model_spec,
    parse_dims,
    parse_input_shape,
    parse_input_shapes,
    split_shape_name,
    torchvision_weights_file,
)
from deploykit.results import (  # noqa: F401
    provenance,
    result_record,
    write_result,
)
from deploykit.timing import (  # noqa: F401
    latency_stats,
)

if __name__ == "__main__":
    if sys.argv[1:] == ["--env-summary"]:
        print(env_summary())
    else:
        print("usage: python common.py --env-summary", file=sys.stderr)
        sys.exit(2)
