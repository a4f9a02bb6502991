"""Command-line plumbing shared by every stage and tool: :func:`cli` (errors to exit codes),
the help formatter, the shared flags (``--model``, ``--warmup``, ``--iters``, ``--max-seconds``,
``--threads``) and their argument types, and :func:`progress_bar` (tqdm, one line per step).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from deploykit.alloc import keep_freed_memory
from deploykit.errors import StageError, UsageError
from deploykit.io import disk_full_error
from deploykit.layout import artifacts_dir, results_dir
from deploykit.models import PREPROCESS_ENV, preprocess_arg


def cli(get_args_parser: Callable[[], Any], main: Callable[[Any], Any]) -> None:
    """Run ``main(parser.parse_args())`` with the project's exit-status convention.

    argparse itself exits 2 on unknown flags; :class:`UsageError` also exits 2 (usage line
    and error printed, as argparse does; ``--help`` lists every flag);
    :class:`StageError` exits 1 with its message; Ctrl-C (``KeyboardInterrupt``) exits 130
    with one line, no traceback (every output is written atomically, so nothing half-written is
    left under a final name); ``MemoryError`` exits 1 with a message naming the flags that size
    the arrays; an ``OSError`` of a full disk, quota or file-size limit exits 1 naming the file
    and the free space (:func:`deploykit.io.disk_full_error`); other exceptions propagate
    (traceback, 1).

    Before any of it, glibc's allocator is set to keep freed memory for reuse in this process
    and the processes it starts (:func:`deploykit.alloc.keep_freed_memory`;
    ``DEPLOYKIT_MALLOC=default`` leaves it as it is).
    """
    keep_freed_memory()
    parser = get_args_parser()
    args = parser.parse_args()
    if getattr(args, "preprocess", None):
        # --preprocess is $PREPROCESS for this process and the tools it starts: every reader of
        # a package.module:factory model's spec (deploykit.models.custom_spec) sees the same one
        os.environ[PREPROCESS_ENV] = args.preprocess
    try:
        main(args)
    except UsageError as e:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        sys.exit(2)
    except StageError as e:
        print(f"{parser.prog}: FAILED: {e}", file=sys.stderr)
        sys.exit(1)
    except BrokenPipeError:  # the reader went away (| head): no traceback (Python docs, signal)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except OSError as e:
        full = disk_full_error(e, (artifacts_dir(), results_dir()))
        if full is None:
            raise
        print(f"{parser.prog}: FAILED: {full}", file=sys.stderr)
        sys.exit(1)
    except MemoryError as e:
        sizing = [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in
                  ("batch_size", "latency_batch", "limit") if getattr(args, n, None)]
        print(f"{parser.prog}: FAILED: out of memory ({str(e) or 'MemoryError, no details'}); "
              + (f"this run asked for {', '.join(sizing)}: lower the batch sizes" if sizing
                 else "close other programs or use a machine with more memory")
              + ". Files written before stay as they were (each is written whole or not at "
              "all)", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print(f"\n{parser.prog}: interrupted (Ctrl-C); files it had finished are in place, "
              "nothing half-written was installed: rerun the same command", file=sys.stderr)
        sys.exit(130)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` keeps the description's line breaks and shows every flag's default (unless
    the help text already says it, the flag is a switch, or the default is None)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if ("default" in text or action.default in (None, False, argparse.SUPPRESS)
                or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))):
            return text
        return super()._get_help_string(action)


def load_script(name: str):
    """The root script ``<name>.py`` (e.g. ``3_onnx_eval``) as a module, imported once; its
    name starts with a digit, so no import statement can name it."""
    import importlib

    from deploykit.layout import ROOT

    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    return importlib.import_module(name)


def run_script(name: str, argv: Sequence[str]) -> Any:
    """Run the root script ``<name>.py`` in this process, as ``python <name>.py ARGV`` would:
    its own parser reads ``argv`` (its messages name the script), ``sys.argv`` is that command
    line while it runs (the provenance it records names it, so its rerun command is its own),
    and a ``--preprocess`` among ``argv`` is ``$PREPROCESS`` while it runs, as :func:`cli`
    makes it; both are restored after. Saves the interpreter start and the imports of a
    separate process (stage 5 evaluates its files so).

    Args:
        name: the script's module name, e.g. ``3_onnx_eval``. argv: its arguments.
    Returns:
        whatever its ``main`` returns.
    Raises:
        whatever its ``main`` raises (:class:`UsageError`, :class:`StageError`, ...), for the
        caller's :func:`cli` to turn into an exit status; ``SystemExit`` (2) when ``argv`` is
        not a valid command line of the script.
    """
    mod = load_script(name)
    saved, saved_pp = sys.argv, os.environ.get(PREPROCESS_ENV)
    sys.argv = [f"{name}.py", *argv]  # before the parser exists: its messages name the script
    try:
        args = mod.get_args_parser().parse_args(list(argv))
        if getattr(args, "preprocess", None):  # as cli() does: the spec every reader sees
            os.environ[PREPROCESS_ENV] = args.preprocess
        return mod.main(args)
    finally:
        sys.argv = saved
        if saved_pp is None:
            os.environ.pop(PREPROCESS_ENV, None)
        else:
            os.environ[PREPROCESS_ENV] = saved_pp
        sys.stdout.flush()


def command_argv(parser: argparse.ArgumentParser, args: argparse.Namespace,
                 keep: Iterable[str] = (), **override: Any) -> list[str]:
    """The arguments of a command line that ``parser`` reads back as ``args`` with ``override``
    applied: each option whose value differs from its default (a default read from the
    environment, e.g. ``$PREPROCESS``, stays unsaid: the same environment gives it again), by
    its first option string; a ``store_true`` flag bare, a list one value after another, a
    Path or number as ``str``, a value that starts with ``-`` as ``--flag=value`` (else it
    would read as an option). For one command of several made from one (7_trt_eval.py with
    several engines: each row records, and reruns as, its own command).

    Args:
        parser: the script's parser (``get_args_parser()``). args: what it parsed.
        keep: dests written whenever they hold a value, default or not (``model``: a default
            from ``$MODEL`` is another model in another shell).
        override: ``dest=value`` pairs that replace values of ``args`` (``engine=Path(...)``).
    Returns:
        the arguments, without the program name.
    Raises:
        ValueError: a positional argument, an option of a kind this cannot write back
            (``count``, ``store_const`` other than ``store_true``/``store_false``), or a
            several-value option (``nargs``) with a value that starts with ``-``.
    """
    out: list[str] = []
    for a in parser._actions:  # argparse has no public list of its actions
        if isinstance(a, argparse._HelpAction):
            continue
        if not a.option_strings:
            raise ValueError(f"command_argv: positional argument {a.dest!r} not supported")
        value = override[a.dest] if a.dest in override else getattr(args, a.dest, a.default)
        if value == a.default and (a.dest not in keep or value is None):
            continue
        flag = a.option_strings[0]
        if isinstance(a, argparse._StoreTrueAction):
            out += [flag] if value else []
        elif isinstance(a, argparse._StoreFalseAction):
            out += [] if value else [flag]
        elif isinstance(a, (argparse._StoreAction, argparse._AppendAction)):
            if value is None:
                continue
            values = [str(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
            if isinstance(a, argparse._AppendAction) or a.nargs is None or a.nargs == "?":
                for v in values:
                    out += [f"{flag}={v}"] if v.startswith("-") else [flag, v]
            elif any(v.startswith("-") for v in values):
                raise ValueError(f"command_argv: {flag} takes several values and one starts "
                                 f"with '-' ({values}): argparse cannot read that back")
            else:
                out += [flag, *values]
        else:
            raise ValueError(f"command_argv: option {flag} ({type(a).__name__}) not supported")
    return out


def stage_parser(doc: str, prog: str | None = None) -> argparse.ArgumentParser:
    """An argument parser whose description is the whole module docstring ``doc`` (what the
    stage reads, writes and how to rerun it, in whole sentences) and whose help shows defaults.
    """
    return argparse.ArgumentParser(prog=prog, description=doc.strip(),
                                   formatter_class=HelpFormatter)


def default_model() -> str:
    """``$MODEL``, else the default model ``mobilenet_v3_small``."""
    return os.environ.get("MODEL") or DEFAULT_MODEL


DEFAULT_MODEL = "mobilenet_v3_small"


def model_arg(text: str) -> str:
    """argparse type of ``--model``: a non-empty name without surrounding blanks (an empty
    ``--model ""`` used to reach the stages as a model folder named ``""``)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "empty model name: give mobilenet_v3_small, efficientnet_lite0, a torchvision "
            "classifier or package.module:factory")
    return text.strip()


# Flags shared by several stages, declared once (name -> (flags, add_argument kwargs)). Help
# texts say what the flag does; the formatter appends the default.
_SHARED_FLAGS: dict[str, tuple[tuple[str, ...], Callable[[], dict]]] = {
    "model": (("--model",), lambda: dict(
        default=default_model(), type=model_arg,
        help="mobilenet_v3_small, efficientnet_lite0, a torchvision classifier or "
             "package.module:factory (default from $MODEL)")),
    "weights": (("--weights",), lambda: dict(
        default=None, help="local state-dict checkpoint (torch.save(model.state_dict(), PATH)) "
                           "instead of the model's default weights")),
    "random_init": (("--random-init",), lambda: dict(
        action="store_true", help="random weights: structure runs only, accuracy is meaningless")),
    "input_shape": (("--input-shape",), lambda: dict(
        action="append", default=None, metavar="NAME:D0,D1,...[:DTYPE]",
        help="custom models: one per forward() argument, in order; the first axis is the batch "
             "(repeatable)")),
    "preprocess": (("--preprocess",), lambda: dict(
        type=preprocess_arg, default=os.environ.get(PREPROCESS_ENV) or None,
        metavar="mean=..,std=..[,resize=..][,crop=..][,interpolation=..]",
        help="package.module:factory models returning ImageNet's 1000 logits: their "
             "preprocessing (of x/255, RGB), so the ImageNet images are their data in every "
             "stage (default from $PREPROCESS; a model carrying timm's pretrained_cfg or "
             "torchvision's transforms needs none)")),
    "inputs": (("--inputs",), lambda: dict(
        type=Path, default=None, metavar="NPZ",
        help="models with their own data: evaluation samples, one array per input name "
             "(np.savez(path, name=array); batch on axis 0); stage 1 makes them the reference "
             "every later stage is judged on")),
    "labels": (("--labels",), lambda: dict(
        type=Path, default=None, metavar="FILE",
        help="with --inputs: the class id of each sample (.npy, .npz with one array, or text "
             "with one integer per line): top-1/top-5 of the first output")),
    "calib_inputs": (("--calib-inputs",), lambda: dict(
        type=Path, default=None, metavar="NPZ",
        help="models with their own data: calibration samples keyed like --inputs (never the "
             "evaluation samples)")),
    "logits_output": (("--logits-output",), lambda: dict(
        type=logits_output_arg, default=_env_logits_output(), metavar="NAME|INDEX",
        help="models with several outputs (e.g. (features, logits) or a dict): the output "
             "that holds the logits, by name or graph-order index; accuracy, top-1 agreement "
             "and the row's cosine come from it, and the row names it (default from "
             "$LOGITS_OUTPUT, else the first output)")),
    "limit": (("--limit",), lambda: dict(
        type=int, default=None, help="use the first N evaluation images only (smoke runs)")),
    "batch_size": (("--batch-size",), lambda: dict(
        type=int, default=64, help="batch size of the accuracy pass (capped at the largest "
                                   "batch the model or engine accepts)")),
    "latency_batch": (("--latency-batch",), lambda: dict(
        type=int, default=1, help="batch size of the latency measurement")),
    "warmup": (("--warmup",), lambda: dict(
        type=int, default=20, help="untimed iterations before timing, at most: they stop "
                                   "0.2 s after the first, never before 3")),
    "iters": (("--iters",), lambda: dict(
        type=int, default=200, help="timed iterations (each timed loop also stops after "
                                    "--max-seconds, never before 20 iterations)")),
    "max_seconds": (("--max-seconds",), lambda: dict(
        type=_seconds_arg, default=5.0,
        help="time budget of one timed loop in seconds: it stops after --iters iterations or "
             "this long, whichever comes first (the row records how many ran); 0 = no budget, "
             "exactly --iters")),
    "threads": (("--threads",), lambda: dict(
        type=_threads_arg, default=0,
        help="intra-op CPU threads of the backend (0 = its default; at most the CPUs this "
             "process may use)")),
}


def logits_output_arg(text: str) -> str | int:
    """``--logits-output`` value: an output index (digits, >= 0) or an output name.

    Raises:
        argparse.ArgumentTypeError: empty or blank (exit 2).
    """
    t = text.strip()
    if not t:
        raise argparse.ArgumentTypeError("empty: give the output's name (e.g. logits) or its "
                                         "index in the graph's outputs (e.g. 1)")
    return int(t) if t.isdigit() else t


def _env_logits_output() -> str | int | None:
    """``$LOGITS_OUTPUT`` as :func:`logits_output_arg` reads it (None when unset or empty)."""
    v = os.environ.get("LOGITS_OUTPUT", "").strip()
    return logits_output_arg(v) if v else None


def _seconds_arg(text: str) -> float:
    """``--max-seconds`` value: a finite number >= 0 (exit 2 otherwise)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: must be >= 0 seconds (0 = no budget)")
    return v


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type`` for a count flag: an integer >= ``low``, else a usage error (exit 2)
    naming the flag, e.g. ``argument --rounds: must be an integer >= 1 (got 0)``. For flags
    whose impossible values would otherwise fail deep inside the work (an empty median, a
    DataLoader error)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low} (got {text!r})") \
                from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low} (got {n})")
        return n
    parse.__name__ = f"integer >= {low}"  # argparse's own messages name the type
    return parse


def env_assignment(text: str) -> str:
    """An argparse ``type`` for a ``VAR=value`` environment setting (exit 2 otherwise)."""
    if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not VAR=value "
                                         "(e.g. MODEL=efficientnet_lite0)")
    return text


def usable_cpus() -> int:
    """CPUs this process may run on (``os.sched_getaffinity``, which honours taskset/cgroup
    cpusets, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _threads_arg(text: str) -> int:
    """``--threads`` value: 0 (the backend's default) .. :func:`usable_cpus`.

    More intra-op threads than CPUs only contend (ONNX Runtime's pool spins each thread): on 2
    CPUs ``--threads 9999`` made stage 3 run for minutes without finishing.

    Raises:
        argparse.ArgumentTypeError: not an integer, negative, or above the CPU count (exit 2).
    """
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    cpus = usable_cpus()
    if n < 0 or n > cpus:
        raise argparse.ArgumentTypeError(
            f"{n}: use 0 (the backend's default) or 1..{cpus}, the CPUs this process may use; "
            "more threads than CPUs only contend and make every timing meaningless")
    return n


def add_shared_args(parser: argparse.ArgumentParser, *names: str) -> argparse.ArgumentParser:
    """Add the shared flags ``names`` (keys of ``_SHARED_FLAGS``: ``model``, ``weights``,
    ``random_init``, ``input_shape``, ``limit``, ``batch_size``, ``latency_batch``, ``warmup``,
    ``iters``, ``max_seconds``, ``threads``, ``preprocess``, ``inputs``, ``labels``,
    ``calib_inputs``, ``logits_output``) to ``parser`` and return it. ``model`` brings
    ``--preprocess`` with it: a
    ``package.module:factory`` model's spec depends on it in every stage.

    Raises:
        KeyError: an unknown flag name (a programming error).
    """
    for n in names:
        flags, kwargs = _SHARED_FLAGS[n]
        parser.add_argument(*flags, **kwargs())
        if n == "model" and "preprocess" not in names:
            flags, kwargs = _SHARED_FLAGS["preprocess"]
            parser.add_argument(*flags, **kwargs())
    return parser


def number_in(low: float, high: float, what: str = "a number") -> Callable[[str], float]:
    """An argparse ``type`` for a bounded float flag: a finite number in ``low..high``, else a
    usage error (exit 2) naming the flag, e.g. ``argument --min-agreement: must be a percentage
    0..100 (got 120)``.

    Args:
        low, high: the inclusive bounds. what: the value's kind in the message.
    """
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what} {low:g}..{high:g} (got {text!r})") \
                from None
        if not low <= v <= high:  # NaN fails too
            raise argparse.ArgumentTypeError(f"must be {what} {low:g}..{high:g} (got {text})")
        return v
    parse.__name__ = f"{what} {low:g}..{high:g}"  # argparse's own messages name the type
    return parse


def check_positive(args: Any, *names: str, allow_zero: Sequence[str] = ()) -> None:
    """Raise :class:`UsageError` unless each numeric flag ``names`` of ``args`` is >= 1 (or >= 0
    for those in ``allow_zero``); None values are skipped.

    Raises:
        UsageError: naming the flag and the value.
    """
    for n in names:
        v = getattr(args, n, None)
        low = 0 if n in allow_zero else 1
        if v is not None and v < low:
            raise UsageError(f"--{n.replace('_', '-')} must be >= {low} (got {v})")


def progress_bar(iterable: Iterable | None = None, desc: str = "", total: int | None = None,
                 unit: str = "it"):
    """A tqdm progress bar on stderr for a long loop.

    Shown on a terminal; under ``run_all.sh`` (``PIPELINE_PROGRESS=1``, stderr is the stage's
    log) it is written there too, updated at most every 5 s, and ``run_all.sh`` shows its last
    state on the console. Elsewhere (pipes, CI) it is off.
    """
    from tqdm import tqdm

    forced = os.environ.get("PIPELINE_PROGRESS") == "1"
    tty = sys.stderr.isatty()
    return tqdm(iterable, desc=desc, total=total, unit=unit, file=sys.stderr,
                disable=False if forced else None, mininterval=0.5 if tty else 2.0,
                ncols=None if tty else 100, leave=tty)
