"""Sweep the pipeline over models x variants x targets on Ray (local by default).

Each (model, target) pipeline is one Ray task that runs the existing stages (run_all.sh and the
stage scripts) in its own artifacts/results folder under ``--out``; a rerun skips pipelines
whose rows are up to date (``deploykit/sweep/stamp.py`` has the rule); the cross-model report
(``REPORT.md``, ``report.json``, ``pareto_<target>.png``) gives the row to ship per target.

    python sweep.py --models efficientnet_lite0 --variants fp16 int8_hp32 --targets cpu --limit 64
    python sweep.py --spec sweep.toml --address ray://head:10001     # a cluster (RAY_ADDRESS too)

Exit status: 0 every pipeline ok or up to date; 1 a pipeline failed or its target is
unavailable (the report is still written); 2 a usage error (message names the fix).
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

from deploykit.sweep.spec import BUILTIN_TARGETS, SpecError, build_spec, load_toml

ROOT = Path(__file__).resolve().parent


def get_args_parser() -> argparse.ArgumentParser:
    """The command line of the sweep.

    Returns:
        the parser (``--help`` lists every flag).
    """
    p = argparse.ArgumentParser(
        prog="sweep.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="targets built in: " + ", ".join(
            f"{n} ({'TensorRT rows' if t.trt else 'ORT CPU rows'}"
            f"{', needs ' + str(dict(t.resources)) if t.resources else ''}"
            f"{', num_gpus=' + str(t.num_gpus) if t.num_gpus else ''})"
            for n, t in BUILTIN_TARGETS.items()) + "; others in a TOML spec ([target.NAME]).")
    p.add_argument("--spec", type=Path, help="TOML sweep spec (the flags below override it)")
    p.add_argument("--models", nargs="+", metavar="MODEL",
                   help="models: built-in names, torchvision classifiers, package.module:factory")
    p.add_argument("--variants", nargs="+", metavar="VARIANT",
                   help="variants of variants.py (default fp32; the PyTorch FP32 reference "
                        "always runs)")
    p.add_argument("--targets", nargs="+", metavar="TARGET", help="targets (default cpu)")
    p.add_argument("--input-shape", action="append", metavar="MODEL=SHAPES",
                   help="INPUT_SHAPE of a custom model, e.g. 'pkg.mod:fn=x:1,3,224,224' "
                        "(repeatable)")
    p.add_argument("--weights", action="append", metavar="MODEL=PATH",
                   help="WEIGHTS (local state dict) of a model (repeatable)")
    p.add_argument("--limit", type=int, help="run_all.sh --limit N: smoke runs on N images")
    p.add_argument("--out", type=Path, default=ROOT / "artifacts" / "sweep",
                   help="sweep folder (default artifacts/sweep)")
    p.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                   help="Ray cluster address (default $RAY_ADDRESS; none: a local Ray)")
    p.add_argument("--num-cpus", type=int,
                   help="CPUs of the local Ray (default: this machine's)")
    p.add_argument("--cpus-per-pipeline", type=float, default=2,
                   help="CPUs each pipeline takes (default 2: a 2-core machine runs one at a "
                        "time)")
    p.add_argument("--timeout", type=float, help="wall-clock limit per pipeline, s")
    p.add_argument("--force", action="store_true", help="rerun up-to-date pipelines too")
    p.add_argument("--min-agreement", type=float, help="budget: top-1 agreement %% (default 99)")
    p.add_argument("--max-top1-drop", type=float,
                   help="budget: top-1 drop vs PyTorch FP32, points (default 0.5)")
    p.add_argument("--min-cosine", type=float,
                   help="budget for rows without accuracy: mean cosine (default 0.999)")
    p.add_argument("--dry-run", action="store_true",
                   help="print each pipeline's commands and whether it is up to date; run nothing")
    return p


def _usage(parser: argparse.ArgumentParser, msg: str) -> None:
    parser.print_usage(sys.stderr)
    print(f"sweep.py: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def main(args: argparse.Namespace) -> int:
    """Run the sweep of ``args`` and print where its report is.

    Args:
        args: from :func:`get_args_parser`.

    Returns:
        0 when every pipeline is ok or up to date, 1 when one failed or was unavailable.

    Raises:
        SystemExit: 2 on a usage error (bad spec, unknown target or variant, no ray).
    """
    parser = get_args_parser()
    for flag in ("num_cpus", "limit"):
        v = getattr(args, flag)
        if v is not None and v < 1:
            _usage(parser, f"--{flag.replace('_', '-')} must be >= 1, got {v}")
    if args.cpus_per_pipeline <= 0:
        _usage(parser, f"--cpus-per-pipeline must be > 0, got {args.cpus_per_pipeline}")
    if args.timeout is not None and args.timeout <= 0:
        _usage(parser, f"--timeout must be > 0 s, got {args.timeout}")
    if args.address and args.num_cpus:
        _usage(parser, "--num-cpus sizes a local Ray; with --address (or RAY_ADDRESS) the "
                       "cluster's nodes say how many CPUs they have: drop one of them")
    try:
        table = load_toml(args.spec) if args.spec else None
        spec = build_spec(table, models=args.models, variants=args.variants,
                          targets=args.targets, input_shapes=args.input_shape,
                          weights=args.weights, limit=args.limit,
                          budget={"min_agreement": args.min_agreement,
                                  "max_top1_drop": args.max_top1_drop,
                                  "min_cosine": args.min_cosine})
    except SpecError as e:
        _usage(parser, str(e))
    if not os.environ.get("PIPELINE_ROOT"):
        _usage(parser, "environment not set up: run  source env.sh  first")
    if args.out.exists() and not args.out.is_dir():
        _usage(parser, f"--out {args.out} is a file: give a folder (it is created if missing)")
    from deploykit.sweep import driver, plan, stamp

    ids: dict[str, str] = {}
    for m in spec.models:
        # the forms the stages take (a torchvision/timm name, package.module:factory): any other
        # name is a usage error here, not a failed Ray task later (the sweep imports no stage
        # code, so this is the shape of the name; the stages judge the rest)
        if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*|[A-Za-z0-9_]+", m.name):
            _usage(parser, f"model {m.name!r}: not a model name: a torchvision or timm name "
                           "(letters, digits, _) or package.module:factory")
        for t in spec.targets:
            pid = plan.pipeline_id(m.name, t.name)
            if pid in ids and ids[pid] != m.name:
                _usage(parser, f"models {ids[pid]!r} and {m.name!r} share the pipeline folder "
                               f"{pid!r}: rename one (or wrap it in another factory name)")
            ids[pid] = m.name

    if args.dry_run:
        try:
            registry = plan.load_registry(ROOT, sys.executable)
            plan.check_variants(spec.variants, registry)
        except SpecError as e:
            _usage(parser, str(e))
        git = stamp.git_state(ROOT)
        out = args.out.resolve()
        for m in spec.models:
            for t in spec.targets:
                pl = plan.build_pipeline(spec, m, t, out, registry, ROOT, sys.executable)
                key, parts = stamp.pipeline_key(pl, git, stamp.model_inputs(pl, ROOT))
                skip, why = stamp.up_to_date(stamp.read_stamp(out / "stamps" / f"{pl.id}.json"),
                                             key, parts, out / "rows" / pl.id,
                                             git["rows_git_sha"])
                print(f"{pl.id}: {'skip' if skip and not args.force else 'run'} ({why})")
                for s in pl.steps:
                    print(f"  {s.shell()}")
                for v, reason in pl.not_applicable:
                    print(f"  ({v}: {reason})")
        return 0
    try:
        res = driver.run_sweep(spec, args.out, ROOT, address=args.address,
                               num_cpus=args.num_cpus, cpus_per_pipeline=args.cpus_per_pipeline,
                               force=args.force, timeout_s=args.timeout)
    except SpecError as e:
        _usage(parser, str(e))
    except (RuntimeError, OSError) as e:
        print(f"sweep.py: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("sweep.py: interrupted; finished pipelines are kept and skipped by a rerun: "
              f"{shlex.join(['python', 'sweep.py', *sys.argv[1:]])}", file=sys.stderr)
        return 130
    counts = ", ".join(f"{n} {s}" for s, n in sorted(res["counts"].items()))
    print(f"sweep: {len(res['pipelines'])} pipelines: {counts}")
    for t, v in res["report"]["verdicts"].items():
        print(f"sweep: verdict {t}: " + (f"{v['model']} {v['variant']} ({v['backend']} "
                                         f"{v['precision']}, p50 {v['p50_ms']:.3f} ms)"
                                         if v else "no row within budget"))
    print(f"sweep: report {res['files']['markdown']}")
    bad = [p for p in res["pipelines"]
           if p["status"] not in ("ok", "up_to_date", "not_applicable")]
    if bad:
        print("sweep: not finished: " + "; ".join(f"{p['id']} {p['status']}" for p in bad),
              file=sys.stderr)
        rerun = ["python", "sweep.py", *sys.argv[1:]]
        print(f"sweep: after fixing, rerun (finished pipelines are skipped): "
              f"{shlex.join(rerun)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(get_args_parser().parse_args()))
