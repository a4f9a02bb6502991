"""deploykit.alloc: glibc's allocator keeps freed memory in a pipeline process."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

from deploykit.alloc import OPT_OUT_ENV, keep_freed_memory
from tests.helpers.stages import ROOT

glibc = pytest.mark.skipif(not sys.platform.startswith("linux")
                           or platform.libc_ver()[0] != "glibc", reason="glibc only")

# malloc()s, fills and frees a 64 MB block six times (the C allocator itself, as PyTorch's CPU
# tensors use it; numpy asks the kernel for huge pages); prints the minor page faults of the
# last five.
_FAULTS = textwrap.dedent("""
    import ctypes, ctypes.util, resource, sys
    from deploykit.alloc import keep_freed_memory
    print(keep_freed_memory(), file=sys.stderr)
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    def once():
        p = libc.malloc(64 << 20)
        ctypes.memset(p, 1, 64 << 20)
        libc.free(p)
    def faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    once()
    f0 = faults()
    for _ in range(5):
        once()
    print(faults() - f0)
""")


def _thp_always() -> bool:
    """Transparent huge pages for every mapping (then glibc's default faults far less too)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


def _faults(**env_over) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT_ENV)}
    env.update(env_over, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True,
                       check=True)
    return int(p.stdout), p.stderr.strip()


@glibc
def test_freed_memory_is_reused_without_new_page_faults():
    """With the policy a freed 64 MB block is taken again from the heap (no page is faulted in
    again); glibc's default maps it afresh each time (16384 faults of 4 KiB pages per time)."""
    on, applied = _faults()
    off, not_applied = _faults(**{OPT_OUT_ENV: "default"})
    assert applied == "True" and not_applied == "False"
    assert on < 2000, on
    if not _thp_always():
        assert off > 5 * 16384 // 2, off


@glibc
def test_the_policy_reaches_child_processes_and_respects_the_user():
    env = {"GLIBC_TUNABLES": "glibc.cpu.hwcaps=-AVX512F"}
    assert keep_freed_memory(env)
    assert env["GLIBC_TUNABLES"].startswith("glibc.cpu.hwcaps=-AVX512F:glibc.malloc.mmap_max=0:")
    child, _ = _faults(GLIBC_TUNABLES=env["GLIBC_TUNABLES"].split(":", 1)[1],
                       **{OPT_OUT_ENV: "default"})  # the tunables alone, from the start
    assert child < 2000, child
    theirs = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert not keep_freed_memory(theirs)  # a user's own malloc tunables win
    assert theirs == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    off = {OPT_OUT_ENV: "Default"}
    assert not keep_freed_memory(off) and "GLIBC_TUNABLES" not in off


def test_every_stage_entry_point_applies_it(monkeypatch, capsys):
    """deploykit.cli.cli (every root script's entry) applies the policy before main runs."""
    import argparse

    from deploykit.cli import cli

    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv(OPT_OUT_ENV, raising=False)
    monkeypatch.setattr("sys.argv", ["stage.py"])
    seen = []
    cli(lambda: argparse.ArgumentParser(prog="stage.py"),
        lambda args: seen.append(os.environ.get("GLIBC_TUNABLES")))
    expected = keep_freed_memory({})  # False off glibc
    assert (seen[0] is not None and "glibc.malloc.mmap_max=0" in seen[0]) is expected


@glibc
def test_opt_out_values_release_and_the_recorded_policy():
    """Every documented opt-out value leaves glibc's defaults; a process that applied the policy
    can hand its free heap back (malloc_trim) before a heavy child, and its rows record it."""
    for v in ("default", "off", "0", "NO", "false"):
        env = {OPT_OUT_ENV: v}
        assert not keep_freed_memory(env) and "GLIBC_TUNABLES" not in env
    code = textwrap.dedent("""
        import sys
        from deploykit import alloc
        before = (alloc.release_freed_memory(), alloc.policy())
        applied = alloc.keep_freed_memory()
        print(before, applied, alloc.release_freed_memory(), alloc.policy())
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT_ENV)}
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == ("(False, 'C library default') True True "
                   "keep freed memory (deploykit.alloc)"), out


@glibc
def test_a_child_of_a_pipeline_process_records_the_policy_it_inherited():
    """Stage 5's INT4 child and ModelOpt worker start with the parent's GLIBC_TUNABLES: glibc
    applied them, so the child's rows record the policy (they said "C library default": review
    of stop 46); a user's own malloc tunables still win."""
    from deploykit import alloc

    code = textwrap.dedent("""
        from deploykit import alloc
        print(alloc.keep_freed_memory(), alloc.policy())
    """)
    base = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT_ENV)}

    def child(tunables):
        env = dict(base, PYTHONPATH=str(ROOT), GLIBC_TUNABLES=tunables)
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, check=True).stdout.strip()

    assert child(alloc._TUNABLES) == "True keep freed memory (deploykit.alloc)"
    assert child("glibc.malloc.trim_threshold=1") == "False C library default"


@glibc
def test_a_waiting_parent_hands_its_free_memory_back():
    """With the policy, 200 MB freed stay resident until release_freed_memory() returns them."""
    code = textwrap.dedent("""
        import ctypes, ctypes.util, os
        from deploykit import alloc
        assert alloc.keep_freed_memory()
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
        libc.free.argtypes = (ctypes.c_void_p,)
        def rss_mb():
            return (int(open("/proc/self/statm").read().split()[1])
                    * os.sysconf("SC_PAGE_SIZE") / 2**20)
        p = libc.malloc(200 << 20); ctypes.memset(p, 1, 200 << 20); libc.free(p)
        kept = rss_mb()
        alloc.release_freed_memory()
        print(round(kept - rss_mb()))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", OPT_OUT_ENV)}
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, check=True).stdout
    assert int(out) > 150, out  # MB handed back
