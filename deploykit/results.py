"""Result rows: the self-describing record of one measurement (stage, backend, precision,
provenance: arguments, versions, device, git SHA, input hashes, ARTIFACTS root) and its atomic
write that never replaces a good row by a failed one; what a row and a derived file were measured
against / made from (SHA-256 of the reference, the file evaluated, the fp32.onnx and the
calibration data it came from) and :func:`staleness`, which says when any of those files has
changed since.
"""
from __future__ import annotations

import datetime as _dt
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from deploykit.alloc import policy as alloc_policy
from deploykit.commands import from_record, rerun_record
from deploykit.envinfo import device_info, git_sha, versions
from deploykit.io import sha256_file, write_json
from deploykit.layout import (ROOT, artifacts_dir, check_row_tag, fp32_onnx_path, model_results,
                              result_sidecars, results_dir, safe_name)
from deploykit.variants import EXPORT, INT4, QUANT, VARIANTS


_HASHES: dict[tuple, str] = {}


def file_sha256(path: Path | str) -> str:
    """Hex SHA-256 of a file's bytes, cached for the process: a file is hashed once per
    (real path, inode, size, mtime, ctime), so a rewritten or replaced file is hashed again.

    Raises:
        OSError: the file cannot be read.
    """
    p = Path(path).resolve()
    st = p.stat()
    key = (str(p), st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _HASHES:
        _HASHES[key] = sha256_file(p)
    return _HASHES[key]


def artifacts_root() -> str:
    """The ARTIFACTS folder of this run, absolute (recorded in every row's provenance)."""
    return str(artifacts_dir().resolve())


def provenance(args: Any, inputs: Sequence[Path | str] = (), started: float | None = None,
               torch_device: str | None = None) -> dict:
    """Everything needed to reproduce a result: args, command line, versions, device, git SHA,
    UTC time, SHA-256 of input files (:func:`file_sha256`, cached), the ARTIFACTS root
    (``artifacts_root``, absolute), the stage's wall time (s) and the C allocator's policy
    (``allocator``, :func:`deploykit.alloc.policy`: it changes timings)."""
    hashes = {}
    for p in inputs:
        p = Path(p)
        if p.is_file():
            hashes[str(p)] = file_sha256(p)
    return {
        "args": {k: v for k, v in vars(args).items()} if args is not None else {},
        "command": " ".join(shlex.quote(a) for a in [Path(sys.argv[0]).name] + sys.argv[1:]),
        "rerun": rerun_record(),
        "versions": versions(),
        "device": device_info(torch_device),
        "git_sha": git_sha(),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "input_sha256": hashes,
        "artifacts_root": artifacts_root(),
        "wall_time_s": round(time.time() - started, 3) if started else None,
        "allocator": alloc_policy(),
    }


def result_record(stage: str, backend: str, precision: str, model: str, tag: str,
                  status: str = "ok", reason: str | None = None, **fields) -> dict:
    """A results row, as ``8_report.py`` reads it.

    Args:
        stage: script name, e.g. ``3_onnx_eval``. backend: ``PyTorch``, ``ORT``, ``TensorRT``.
        precision: ``FP32``, ``FP16``, ``INT8``, ``INT4`` (with a variant suffix if needed).
        tag: unique row id within the model (file name ``results/<model>/<tag>.json``).
        status: ``ok``, ``skipped`` (could not run here: reason says why) or ``failed``.
        fields: ``n_images``, ``accuracy`` {top1, top5}, ``latency`` (:func:`latency_stats`),
            ``size_mb``, ``parity`` (:func:`parity`), ``ep_requested``/``ep_used``, ...
    """
    return {"stage": stage, "backend": backend, "precision": precision, "model": model,
            "tag": tag, "status": status, "reason": reason, **fields}


def _read_row(path: Path) -> dict | None:
    """An existing results row (None when absent, unreadable or not an object)."""
    try:
        rec = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) else None


def _row_status(path: Path) -> str | None:
    """``status`` of an existing results row (None when absent or unreadable)."""
    rec = _read_row(path)
    return rec.get("status") if rec is not None else None


def row_artifacts_root(rec: dict) -> str | None:
    """The ARTIFACTS root a row was measured in (``provenance.artifacts_root``; None for rows
    written before it was recorded)."""
    prov = rec.get("provenance")
    root = prov.get("artifacts_root") if isinstance(prov, dict) else None
    return root if isinstance(root, str) else None


def other_artifacts_warning(path: Path, record: dict) -> str | None:
    """The ``WARNING:`` line for a row about to replace ``path`` when the row there was
    measured in another ARTIFACTS folder (two runs sharing one RESULTS folder); None
    otherwise (no row there, the same folder, or an old row that does not say)."""
    old = _read_row(path)
    was, now = (row_artifacts_root(old) if old else None), row_artifacts_root(record)
    if not was or not now or was == now:
        return None
    return (f"WARNING: {path} was measured in ARTIFACTS={was} and is now replaced by a row "
            f"measured in ARTIFACTS={now}: two runs share this RESULTS folder; give each its "
            "own RESULTS (or the same ARTIFACTS) so their rows do not overwrite each other")


def write_result(model: str, tag: str, record: dict, keep_good: bool = True) -> Path:
    """Write ``results/<model>/<tag>.json`` atomically and return the path written.

    A row measured in another ARTIFACTS folder is replaced with a ``WARNING:`` line
    (:func:`other_artifacts_warning`). An earlier good row is never replaced by a failure: when ``record`` is not ``ok`` and
    ``<tag>.json`` holds an ``ok`` row, the record goes to ``<tag>.<status>.json`` beside it
    (the report shows both) and a note says so. An ``ok`` record removes such leftovers.

    Args:
        keep_good: False when the failed run already replaced the artifact the good row
            describes (e.g. an engine rebuilt and then rejected by a check): the row must then
            describe the file on disk and is replaced.
    Raises:
        UsageError: ``tag`` is not a plain file name or names a file that is no row
            (:func:`check_row_tag`).
    """
    path = model_results(model) / f"{check_row_tag(model, tag)}.json"
    status = record.get("status")
    warn = other_artifacts_warning(path, record)
    if warn:
        print(warn, file=sys.stderr)
    if keep_good and status != "ok" and _row_status(path) == "ok":
        side = path.with_name(f"{tag}.{safe_name(str(status), 'status')}.json")
        write_json(side, record)
        print(f"note: {path} holds a good row of an earlier run: kept; this {status} run is "
              f"recorded in {side.name} (the report lists both)", file=sys.stderr)
        return side
    write_json(path, record)
    if status == "ok" or not keep_good:
        for side in result_sidecars(model, tag):
            side.unlink(missing_ok=True)
    return path


# --------------------------------------------------------------------------------------------
# What a row was measured against, what a derived file was made from, and staleness
# --------------------------------------------------------------------------------------------
#: The files a row records (``measured_against``), by role, as :func:`staleness` names them.
ROLES = {"reference": "the PyTorch reference", "evaluated": "the file evaluated",
         "onnx": "the ONNX file the engine was built from",
         "fp32": "the fp32.onnx the file evaluated was made from",
         "calibration": "the calibration data the file evaluated was made from"}

#: Records of the stages that make derived files (their ``source`` block names the output).
SOURCE_RECORDS = ("export.json", "quant_*.json", "trt_build_*.json")


def file_entry(path: Path | str | None) -> dict | None:
    """``{"path": absolute path, "sha256": hex}`` of a regular file (:func:`file_sha256`), None
    when ``path`` is None or no regular file."""
    if path is None:
        return None
    p = Path(path).absolute()
    return {"path": str(p), "sha256": file_sha256(p)} if p.is_file() else None


def _entry(e: Any) -> dict | None:
    """``e`` when it is a well-formed ``{"path": str, "sha256": str}`` entry, else None."""
    if isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("sha256"), str):
        return e
    return None


def rerun_command(prov: Any) -> str | None:
    """The pasteable command that repeats the run recorded in ``prov`` (a ``provenance``
    block), from any folder: ``cd <root> && ARTIFACTS=... RESULTS=... [PYTHONPATH=...] python
    <root>/<script> <args>`` (:mod:`deploykit.commands`: the run's environment, absolute paths,
    every word shell-quoted). A row written before ``rerun`` was recorded gets its ``command``
    with the repository root to ``cd`` into and ARTIFACTS (the recorded one) / RESULTS (this
    process's). None when nothing is recorded."""
    if not isinstance(prov, dict):
        return None
    line = from_record(prov.get("rerun"))
    if line:
        return line
    cmd = prov.get("command")
    if not isinstance(cmd, str) or not cmd:
        return None
    if cmd.split(" ", 1)[0].endswith(".py"):
        cmd = f"python {cmd}"
    env = []
    root = prov.get("artifacts_root")
    if isinstance(root, str) and Path(root) != (ROOT / "artifacts").resolve():
        env.append(f"ARTIFACTS={shlex.quote(root)}")
    if results_dir().resolve() != (ROOT / "results").resolve():
        env.append(f"RESULTS={shlex.quote(str(results_dir().resolve()))}")
    return f"cd {shlex.quote(str(ROOT))} && " + " ".join(env + [cmd])


def source_block(output: Path | str | None, made_by: Sequence[str | None],
                 fp32: Any = None, calibration: Any = None, onnx: Any = None) -> dict:
    """The ``source`` block a stage that makes a derived file records beside it: what the
    output is and what it was made from.

    Args:
        output: the installed file (hashed now). made_by: the commands that made it, upstream
            first (e.g. stage 5's, then stage 6's for an engine).
        fp32 / calibration / onnx: the fp32.onnx, the calibration data and (engines) the ONNX
            it was built from: a path (hashed now) or an entry ``{"path", "sha256"}`` already
            made (e.g. the hash of the bytes read into memory).
    Returns:
        ``{"output", "fp32", "calibration", "onnx": {"path", "sha256"} or None, "made_by": [...]}``.
    """
    def ent(v):
        return v if isinstance(v, dict) else file_entry(v)
    return {"output": file_entry(output), "fp32": ent(fp32), "calibration": ent(calibration),
            "onnx": ent(onnx), "made_by": [c for c in made_by if c]}


def source_of(model: str, path: Path | str) -> dict | None:
    """The ``source`` block of the stage record whose output is the file now at ``path``
    (matched by SHA-256, so a file copied from elsewhere matches nothing): stage 2's
    ``export.json`` (the FP16 file: made from its FP32 file), stage 5/5b's
    ``quant_<variant>.json`` and stage 6's ``trt_build_<variant>.json``.

    Returns:
        :func:`source_block`'s fields plus ``record`` (the record's file name), or None when no
        record names this file (unknown source).
    """
    p = Path(path)
    if not p.is_file():
        return None
    sha = file_sha256(p)
    folder = model_results(model)
    for pattern in SOURCE_RECORDS:
        for f in sorted(folder.glob(pattern)):
            if f.name.endswith((".failed.json", ".skipped.json")):
                continue
            rec = _read_row(f)
            if rec is None:
                continue
            src = rec.get("source")
            if isinstance(src, dict) and (_entry(src.get("output")) or {}).get("sha256") == sha:
                return {**src, "record": f.name}
            files = rec.get("files") if f.name == "export.json" else None
            fp16 = files.get("fp16") if isinstance(files, dict) else None
            fp32 = files.get("fp32") if isinstance(files, dict) else None
            if isinstance(fp16, dict) and fp16.get("sha256") == sha and isinstance(fp32, dict):
                return {"output": {"path": str(p.absolute()), "sha256": sha},
                        "fp32": {"path": str(Path(str(fp32.get("path"))).absolute()),
                                 "sha256": fp32.get("sha256")}
                        if isinstance(fp32.get("sha256"), str) else None,
                        "calibration": None, "onnx": None,
                        "made_by": [c for c in [rerun_command(rec.get("provenance"))] if c],
                        "record": f.name}
    return None


def check_source(model: str, path: Path | str, fp32_path: Path | str,
                 derived: bool = True) -> tuple[dict | None, str | None, str | None]:
    """What the derived file at ``path`` was made from, and whether that is still the current
    ``fp32_path`` (and, for an engine, the ONNX file it was built from).

    Args:
        derived: the file is an FP16/Q/DQ file or an engine (an unknown source is worth a
            warning); False for a float file given explicitly.
    Returns:
        ``(source, stale_source, warning)``: :func:`source_of` (None: unknown); the reason the
        source is stale (None when not, or unknown); the ``WARNING:`` line to print (None when
        there is nothing to say).
    """
    p = Path(path)
    if p.is_file() and Path(fp32_path).is_file() and p.resolve() == Path(fp32_path).resolve():
        return None, None, None  # the fp32.onnx itself
    src = source_of(model, p)
    if src is None:
        if not derived or not p.is_file():
            return None, None, None
        return None, None, (
            f"WARNING: no record in {model_results(model)} names {p} (sha256 "
            f"{file_sha256(p)[:12]}) as its output (export.json, quant_<variant>.json, "
            "trt_build_<variant>.json): which fp32.onnx and calibration data it was made from "
            "is unknown (a file copied from another run passes unnoticed); remake it with its "
            "stage to have it recorded")
    why = []
    rec_fp32, cur = _entry(src.get("fp32")), file_entry(fp32_path)
    if rec_fp32 and cur and rec_fp32["sha256"] != cur["sha256"]:
        why.append(f"it was made from an fp32.onnx with sha256 {rec_fp32['sha256'][:12]} "
                   f"({src['record']}), but {cur['path']} is now {cur['sha256'][:12]} "
                   "(re-exported since)")
    onnx = _entry(src.get("onnx"))
    if onnx and Path(onnx["path"]).is_file() and file_sha256(onnx["path"]) != onnx["sha256"]:
        why.append(f"it was built from {onnx['path']} with sha256 {onnx['sha256'][:12]}, which "
                   f"is now {file_sha256(onnx['path'])[:12]} (remade since)")
    if not why:
        return src, None, None
    stale = "; ".join(why)
    fix = " && ".join(src.get("made_by") or []) or "the stage that makes it"
    return src, stale, f"WARNING: {p} is stale: {stale}; remake it: {fix}"


def measured_against(reference: Path | str | None = None, evaluated: Path | str | None = None,
                     source: dict | None = None) -> dict:
    """The ``measured_against`` field of a row: ``{role: {"path", "sha256"}}`` for the reference
    it was compared with and the file evaluated (hashed now), and, from the derived file's
    ``source`` (:func:`source_of`), the fp32.onnx, calibration data and ONNX file it was made
    from (the hashes its producer recorded). Roles: :data:`ROLES`."""
    out = {"reference": file_entry(reference), "evaluated": file_entry(evaluated)}
    for role in ("fp32", "calibration", "onnx"):
        e = _entry((source or {}).get(role))
        if e:
            out[role] = {"path": e["path"], "sha256": e["sha256"]}
    return {k: v for k, v in out.items() if v}


def row_source(source: dict | None) -> dict | None:
    """The part of a :func:`source_of` block a row keeps (``record``, ``made_by``): its hashes
    go into ``measured_against``."""
    if not source:
        return None
    return {"record": source.get("record"), "made_by": list(source.get("made_by") or [])}


def weights_sha256(model) -> str:
    """SHA-256 of a module's weights: every ``state_dict`` entry's name, dtype, shape and bytes,
    in order. Stage 1 records it in its row and stage 2 in ``export.json``, so a later stage can
    tell an ONNX exported from other weights than the PyTorch reference
    (:func:`weights_mismatch`)."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        if not isinstance(t, torch.Tensor):
            continue
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        flat = t.detach().cpu().contiguous().reshape(-1)  # 0-d too (BatchNorm's counter)
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()


def reference_row(model: str, reference: Path | str) -> dict | None:
    """The stage-1 row that wrote the PyTorch reference file ``reference`` (its ``weights``:
    ``default``, ``random-init`` or the ``--weights`` path; its ``weights_sha256``), or None."""
    for f in sorted(model_results(model).glob("*.json")):
        rec = _read_row(f)
        if (rec and rec.get("stage") == "1_pytorch_baseline"
                and rec.get("reference") == str(reference)):
            return rec
    return None


def weights_mismatch(model: str, reference: Path | str) -> str | None:
    """Why ``fp32.onnx`` and the PyTorch reference ``reference`` cannot be compared: stage 2
    (``export.json``) exported other weights (:func:`weights_sha256`) than the
    stage-1 row that wrote ``reference`` ran; None when they match or either is not recorded."""
    exp, ref_row = _read_row(model_results(model) / "export.json"), reference_row(model,
                                                                                 reference)
    a = (exp or {}).get("weights_sha256")
    b = (ref_row or {}).get("weights_sha256")
    if not (isinstance(a, str) and isinstance(b, str)) or a == b:
        return None
    return (f"fp32.onnx was exported (stage 2, export.json: weights {a[:12]}) from other "
            f"weights than the PyTorch reference {Path(reference).name} (stage 1, row "
            f"{ref_row.get('tag')}: weights {b[:12]}): rerun 2_export_onnx.py with the "
            "reference's weights (--weights / the factory), then this stage")


def staleness(row: dict) -> list[str]:
    """Why ``row`` no longer describes the files now on disk: one line per recorded file
    (``measured_against``) whose SHA-256 differs from the file at its path now (reference
    rewritten, fp32.onnx re-exported, calibration data rewritten, file or engine remade), and
    the ``stale_source`` it was measured with; each names the command(s) to rerun,
    shell-quoted, upstream first.

    Also stale: a recorded file of this ARTIFACTS folder that is gone (removed, or set aside as
    ``fp16.stale.onnx`` by a re-export), and an ``ok``/``warn`` row of a derived file (FP16,
    Q/DQ, engine) that no current producer record names (:func:`unrecorded_reason`).

    A row without ``measured_against`` (written before it was recorded) and a recorded file that
    is not here (another machine's row, another ARTIFACTS folder) are unknown, not stale:
    nothing is said.

    Returns:
        the reasons (empty: not stale, or unknown).
    """
    against = row.get("measured_against")
    if not isinstance(against, dict):
        return []
    src = row.get("source") if isinstance(row.get("source"), dict) else {}
    made_by = [c for c in (src.get("made_by") or []) if isinstance(c, str) and c]
    this = rerun_command(row.get("provenance")) or f"the stage of row {row.get('tag')}"
    out = []
    for role, ent in against.items():
        ent = _entry(ent)
        if ent is None:
            continue
        p = Path(ent["path"])
        try:
            now = file_sha256(p) if p.is_file() else None
        except OSError:
            now = None
        if now is None and not p.exists() and _here(row, p):
            out.append(f"{ROLES.get(role, role)} {p} is gone since this row was measured "
                       "(removed or set aside by a rerun): rerun "
                       + " && ".join(([] if role == "reference" else
                                      [_producer(row)]) + [this]))
            continue
        if now is None or now == ent["sha256"]:
            continue
        cmds = (made_by if role in ("fp32", "calibration") else
                made_by[-1:] if role == "onnx" else []) + [this]
        out.append(f"{ROLES.get(role, role)} {p} has changed since this row was measured "
                   f"(sha256 {ent['sha256'][:12]} then, {now[:12]} now): rerun "
                   + " && ".join(cmds))
    if row.get("stale_source") and not any(
            r.startswith((ROLES["fp32"], ROLES["onnx"])) for r in out):
        out.append(f"measured a stale file: {row['stale_source']}: rerun "
                   + " && ".join(made_by + [this]))
    if not out:
        why = unrecorded_reason(row)
        if why:
            out.append(why)
    return out


def _here(row: dict, path: Path) -> bool:
    """True when ``path`` belongs to this run's ARTIFACTS folder and ``row`` was measured in it
    (so a missing file was removed, not merely made on another machine)."""
    if row.get("_source"):  # results/gpu/...: another machine's row
        return False
    root = artifacts_root()
    if row_artifacts_root(row) != root:
        return False
    try:
        return path.absolute().is_relative_to(Path(root))
    except (OSError, ValueError):
        return False


def _producer(row: dict) -> str:
    """The shell-quoted command that (re)makes the file a row evaluated, from its variant
    (:data:`deploykit.variants.VARIANTS`), or the list of producer stages when it has none."""
    model = shlex.quote(str(row.get("model") or "M"))
    v = VARIANTS.get(str(row.get("variant") or ""))
    if v is None:
        return ("the stage that makes it (python 2_export_onnx.py, bash 5_quantize.sh, "
                "python 5b_quantize_int4.py or bash 6_build_engines.sh)")
    if row.get("backend") == "TensorRT":
        return f"bash 6_build_engines.sh --model {model} {v.name}"
    return {EXPORT: f"python 2_export_onnx.py --model {model}",
            QUANT: f"bash 5_quantize.sh --model {model} {v.name}",
            INT4: f"python 5b_quantize_int4.py --model {model}"}.get(
        v.producer, f"python {v.producer} --model {model}")


def unrecorded_reason(row: dict) -> str | None:
    """Why an ``ok``/``warn`` row of a derived file (FP16, INT8/INT4 Q/DQ, a TensorRT engine; a
    file with Q/DQ nodes whose row says ``qdq_without_int8_macs``) cannot be recommended: no
    current producer record (``export.json``, ``quant_<variant>.json``, ``trt_build_<variant>
    .json``, :func:`source_of`) names the file it evaluated, so which fp32.onnx and calibration
    data it was made from is unknown (a file copied from another run, or measured before a
    re-export replaced the records). None when a record names it, or when that cannot be told
    here (no ``measured_against.evaluated``, the file changed or is not here, the row is the
    fp32.onnx itself, another machine's row, or not ok/warn).

    Returns:
        the reason, ending with the commands to rerun (the producer, then this row's stage).
    """
    if row.get("_source") or row.get("status") not in ("ok", "warn"):
        return None
    derived = (row.get("backend") == "TensorRT" or str(row.get("precision") or "FP32") != "FP32"
               or bool(row.get("qdq_without_int8_macs")))
    against = row.get("measured_against")
    ent = _entry(against.get("evaluated")) if isinstance(against, dict) else None
    if not derived or ent is None or not isinstance(row.get("model"), str):
        return None
    p = Path(ent["path"])
    try:
        if not p.is_file() or file_sha256(p) != ent["sha256"]:
            return None  # changed or gone: said by staleness() itself
        if p.resolve() == fp32_onnx_path(row["model"]).resolve():
            return None
        if source_of(row["model"], p) is not None:
            return None
    except OSError:
        return None
    this = rerun_command(row.get("provenance")) or f"the stage of row {row.get('tag')}"
    return (f"no current record in {model_results(row['model'])} (export.json, "
            "quant_<variant>.json, trt_build_<variant>.json) names the file evaluated "
            f"{p} (sha256 {ent['sha256'][:12]}) as its output: which fp32.onnx and calibration "
            "data it was made from is unknown (copied from another run, or its record was "
            f"replaced by a rerun); remake it so it is recorded: rerun {_producer(row)} && "
            f"{this}")
