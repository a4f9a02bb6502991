"""deploykit.blas: numpy's OpenBLAS runs one thread in a pipeline process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from deploykit.blas import ENV, limit_numpy_blas
from deploykit.errors import UsageError
from tests.helpers.stages import ROOT

pytest.importorskip("threadpoolctl")

# numpy's OpenBLAS threads after the policy, and what a child process is started with
_PROBE = textwrap.dedent("""
    import json, os, subprocess, sys
    import numpy
    from threadpoolctl import threadpool_info
    from deploykit.blas import limit_numpy_blas, policy
    set_to = limit_numpy_blas()
    pools = [p["num_threads"] for p in threadpool_info() if p["internal_api"] == "openblas"]
    child = subprocess.run([sys.executable, "-c", "import os; print(os.environ.get("
                            "'OPENBLAS_NUM_THREADS'))"], capture_output=True, text=True)
    print(json.dumps({"set": set_to, "pools": pools, "policy": policy(),
                      "child": child.stdout.strip()}))
""")


def _probe(**env) -> dict:
    import json

    base = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", ENV)}
    p = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env={**base, **env},
                       capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_one_thread_here_and_in_children():
    """By default the OpenBLAS numpy loaded runs one thread (it had one per core), and a child
    process starts with OPENBLAS_NUM_THREADS=1."""
    r = _probe()
    assert r["set"] == 1 and r["pools"] and set(r["pools"]) == {1}
    assert r["child"] == "1" and r["policy"] == "numpy OpenBLAS: 1 thread(s)"


def test_opt_out_and_the_users_own_setting_are_left_alone():
    """DEPLOYKIT_BLAS_THREADS=default changes nothing; a user's OPENBLAS_NUM_THREADS is kept
    (OpenBLAS read it at load) and named as theirs; a count asks for that many."""
    r = _probe(**{ENV: "default"})
    assert r["set"] is None and r["child"] == "None" and r["policy"] == "OpenBLAS default"
    r = _probe(OPENBLAS_NUM_THREADS="2")
    assert r["set"] is None and r["child"] == "2"
    assert r["policy"] == "OPENBLAS_NUM_THREADS=2 (the user's)"
    r = _probe(**{ENV: "2"})
    assert r["set"] == 2 and r["child"] == "2"


def test_a_bad_thread_count_is_a_usage_error():
    for bad in ("0", "-1", "two"):
        with pytest.raises(UsageError, match=f"{ENV}="):
            limit_numpy_blas({ENV: bad})


def test_a_child_stage_reads_the_parents_setting_as_the_policy():
    """A stage started by a stage inherits OPENBLAS_NUM_THREADS=1 and DEPLOYKIT_BLAS_THREADS=1:
    the same policy, not a user's setting."""
    env = {ENV: "1", "OPENBLAS_NUM_THREADS": "1"}
    assert limit_numpy_blas(env) == 1 and env["OPENBLAS_NUM_THREADS"] == "1"


def test_every_stage_entry_point_applies_it_and_refuses_a_bad_count():
    """deploykit.cli.cli (every root script's entry) sets the pool before main runs; a bad
    DEPLOYKIT_BLAS_THREADS is a usage error (exit 2) naming the variable."""
    code = textwrap.dedent("""
        import argparse, os
        import numpy
        from threadpoolctl import threadpool_info
        from deploykit.cli import cli
        cli(lambda: argparse.ArgumentParser(prog="stage.py"), lambda a: print(
            os.environ.get("OPENBLAS_NUM_THREADS"),
            sorted({p["num_threads"] for p in threadpool_info() if p["internal_api"] == "openblas"})))
    """)
    base = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", ENV)}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=base, capture_output=True,
                       text=True)
    assert p.returncode == 0 and p.stdout.split("\n")[0] == "1 [1]", p.stdout + p.stderr
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**base, ENV: "lots"},
                       capture_output=True, text=True)
    assert p.returncode == 2 and f"{ENV}='lots'" in p.stderr


def test_without_threadpoolctl_the_row_says_what_was_set():
    """No threadpoolctl: this process keeps OpenBLAS's pool, its children get one thread, and
    the recorded policy says exactly that (not that the user set OPENBLAS_NUM_THREADS)."""
    code = textwrap.dedent("""
        import os, sys
        sys.modules["threadpoolctl"] = None  # import fails
        from deploykit.blas import limit_numpy_blas, policy
        print(limit_numpy_blas(), os.environ.get("OPENBLAS_NUM_THREADS"), "|", policy())
    """)
    base = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_NUM_THREADS", ENV)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=base, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert out == ("None 1 | OpenBLAS default here (no threadpoolctl), 1 thread(s) in child "
                   "processes"), out
