#!/usr/bin/env python3
"""Stage 8: collect ``results/<model>/*.json`` into ``REPORT.md`` and ``REPORT.csv``.

Reads:  every results JSON of the model that describes a backend run (``backend`` key), and the
        GPU rows of ``results/gpu/<model>/`` (benchmarks/gpu_rows.sh on a GPU machine).
Writes: ``results/<model>/REPORT.md``, ``results/<model>/REPORT.csv`` and a copy of the markdown
        at ``results/REPORT.md`` (the last model reported).
Rerun:  ``python 8_report.py --model efficientnet_lite0`` (``--retime``: see Verdict)

Columns: backend, precision, top-1, top-1 agreement with the PyTorch FP32 logits, top-5, delta
top-1 (points vs the PyTorch FP32 row), INT8 MACs % (Q/DQ rows: share of the Conv/Gemm/MatMul
MACs whose input and weight are INT8, from the graph, recorded by stage 5), batch-1
end-to-end p50 ms, GPU Compute Time p50 ms (GPU rows), FPS (batch 1, from the mean), speedup
(PyTorch FP32 end-to-end p50 on the same device / this row's; "n/a" when no PyTorch row ran on
that device; medians resist the stalls of a shared machine), size MB, cosine similarity (vs
PyTorch FP32 logits). With a mixed-precision search (``int8_auto``) the report links its
``auto_precision.md``.
Rows that could not run (skipped / failed) are listed with the reason; numbers are only ever
copied from the JSON of a real run.
Stale rows: a row whose recorded SHA-256 of the reference, the file or engine evaluated, or
the fp32.onnx / calibration data the file was made from no longer matches the file on disk is
marked ``STALE`` in the status column, listed under "Stale rows" with the command(s) to rerun
(shell-quoted, upstream first), and left out of the summary counts and the best-row choice
(``deploykit.report.stale_reasons``); so is an ok/warn row of a derived file (FP16, Q/DQ,
engine) that no current producer record names, or whose recorded file is gone from this
ARTIFACTS folder: never the row to ship. Rows without these hashes (older runs) are unknown,
not stale. Rows measured in different ARTIFACTS folders get a ``WARNING:`` naming both.
Verdict: per deployment group the fastest row within the accuracy budget. With ``--retime``
(run_all.sh passes it in a full run) the CPU EP rows it chooses between are first timed again
in this process, interleaved (``deploykit.ship_timing``: the rows' own p50s come from separate
processes minutes apart, and a drifting host can swap rows 1.3x apart), written to
``results/<model>/ship_timing.json`` and used for the ranking; without it an earlier record is
used while its rows are unchanged.
"""
from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path
from deploykit.cli import add_shared_args, cli, number_in, stage_parser
from deploykit.errors import StageError
from deploykit import ship_timing
from deploykit.io import atomic_path, check_writable, load_json, write_json
from deploykit.layout import model_results, results_dir
from deploykit.models import model_spec
from deploykit.verdict import Budget, verdicts
from deploykit.report import (
    COLUMNS,
    artifacts_warning,
    row_sort_key,
    gpu_rows,
    load_rows,
    missing_rows,
    render_markdown,
    render_plots,
    split_builds,
    summary,
    table_rows,
)


def get_args_parser() -> argparse.ArgumentParser:
    p = stage_parser(__doc__)
    add_shared_args(p, "model")
    p.add_argument("--no-gpu-rows", action="store_true",
                   help="leave out the GPU rows of results/gpu/<model>/ (shown by default)")
    b = Budget()
    p.add_argument("--min-agreement", type=number_in(0, 100, "a percentage"),
                   default=b.min_agreement, metavar="PCT",
                   help="verdict budget: top-1 agreement with the PyTorch FP32 logits, %% "
                   "(default %(default)g)")
    p.add_argument("--max-top1-drop", type=number_in(0, 100, "a number of top-1 points"),
                   default=b.max_top1_drop, metavar="POINTS",
                   help="verdict budget: top-1 points below the PyTorch FP32 row "
                   "(default %(default)g)")
    p.add_argument("--retime", action="store_true",
                   help="time the CPU EP rows within budget again, interleaved in this process, "
                   "and rank them by that (writes ship_timing.json; a few seconds)")
    return p


def main(args: argparse.Namespace) -> Path:
    started = time.time()
    folder = model_results(args.model)
    rows = load_rows(folder) if folder.is_dir() else []
    rows += gpu_rows(args.model, folder) if not args.no_gpu_rows else []
    rows.sort(key=row_sort_key)
    if rows:
        check_writable(folder, results_dir())
    if not rows:
        raise StageError(f"no results in {folder}: run the stages first "
                         "(bash run_all.sh)")
    if model_spec(args.model).classifier:
        rows = sorted(missing_rows(rows, args.model) + rows, key=row_sort_key)
    data_file = folder / "data.json"
    data = load_json(data_file, "0_prepare_data.py") if data_file.exists() else None
    warn = artifacts_warning(args.model, rows)
    if warn:
        print(warn, file=sys.stderr)
    runs = split_builds(rows)[0]
    trs = table_rows(runs)
    budget = Budget(min_agreement=args.min_agreement, max_top1_drop=args.max_top1_drop)
    _ship_timing(args, runs, budget, folder)
    plots = render_plots(runs, folder, budget)
    md = render_markdown(args.model, rows, data, trs, plots, budget)
    md += f"\nGenerated by `python 8_report.py --model {args.model}` in " \
          f"{time.time() - started:.1f} s.\n"
    out_md, out_csv = folder / "REPORT.md", folder / "REPORT.csv"
    with atomic_path(out_md) as tmp:
        tmp.write_text(md)
    with atomic_path(out_csv) as tmp:
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
            w.writeheader()
            w.writerows(trs)
    # The copy one folder up links the plots through the model's folder.
    top = md
    for name in [*plots, "auto_precision.md"]:
        top = top.replace(f"]({name})", f"]({folder.name}/{name})")
    with atomic_path(results_dir() / "REPORT.md") as tmp:
        tmp.write_text(top)
    print(summary(args.model, runs, out_md, budget))
    return out_md


def _ship_timing(args, runs: list[dict], budget: Budget, folder: Path) -> None:
    """``--retime``: re-time the CPU EP candidates (:func:`deploykit.ship_timing.retime`) and
    write the record; then put a valid record's figures on the rows the verdict ranks."""
    path = folder / ship_timing.FILE
    record = None
    if args.retime:
        failed = False
        cands = ship_timing.candidates(runs, budget)
        if cands:
            print(f"ship timing: {len(cands)} CPU EP rows ({', '.join(r['tag'] for r in cands)})"
                  f" timed again interleaved, {ship_timing.ROUNDS} rounds x "
                  f"{ship_timing.ITERS} runs each", flush=True)
            try:
                record = ship_timing.retime(runs, budget, args.model, picked=cands)
            except Exception as e:  # noqa: BLE001 - ORT, a feed, a file: any failure of the
                # re-timing leaves the verdict on the rows' own p50s (said); the report is written
                print(f"WARNING: ship timing failed ({e}); the verdict ranks the rows by their "
                      "own p50s", file=sys.stderr)
                failed = True
        if record is not None:
            write_json(path, record)
            print("ship timing: " + ", ".join(f"{t} {e['p50_ms']:.3f} ms (row {e['row_p50_ms']:.3f})"
                                              for t, e in record["rows"].items())
                  + f"; input: {record['input']} -> {path}")
        else:
            if not failed:
                print("ship timing: nothing to re-time (fewer than two CPU EP rows to choose "
                      "between, or rows measured on another kind of machine): ranked by their "
                      "own p50s")
            path.unlink(missing_ok=True)  # an earlier record describes rows timed before
    elif path.is_file():
        try:
            record = load_json(path)
        except StageError as e:  # a damaged record ranks nothing: the rows' own p50s do
            print(f"WARNING: {path} ignored ({e}); the verdict ranks the rows by their own p50s",
                  file=sys.stderr)
    tags = ship_timing.annotate(runs, record)
    cpu = [v for v in verdicts(runs, budget) if v["group"] == ship_timing.GROUP]
    if tags and cpu and not cpu[0]["interleaved"]:
        print(f"ship timing: {path.name} covers {', '.join(tags)} but not every CPU EP row the "
              "verdict chooses between (a row rerun since, or a file not the one its row "
              "measured): the verdict ranks them by their own p50s")


if __name__ == "__main__":
    cli(get_args_parser, main)
