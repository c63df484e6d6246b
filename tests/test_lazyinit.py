"""A deferred package: its config module loads alone, its ``__init__`` runs in the same module object
on the first name asked of it or at finish(), and the CLI checks train's flags without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from streamnmt import lazyinit

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package ``lazypkg`` whose __init__ counts its runs and re-exports its config class."""
    pkg = tmp_path / "lazypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import builtins\nbuiltins.LAZYPKG_RUNS = getattr(builtins, 'LAZYPKG_RUNS', 0) + 1\n"
                                     "from lazypkg.config import Settings\nfrom lazypkg.heavy import HEAVY\n")
    (pkg / "config.py").write_text("class Settings:\n    pass\n")
    (pkg / "heavy.py").write_text("HEAVY = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import builtins
    builtins.LAZYPKG_RUNS = 0
    yield "lazypkg"
    for name in [m for m in sys.modules if m == "lazypkg" or m.startswith("lazypkg.")]:
        del sys.modules[name]
    lazyinit._DEFERRED.pop("lazypkg", None)
    del builtins.LAZYPKG_RUNS


def test_a_deferred_package_runs_its_init_on_first_use(package):
    import builtins

    lazyinit.defer(package)
    from lazypkg.config import Settings

    assert builtins.LAZYPKG_RUNS == 0 and "lazypkg.heavy" not in sys.modules
    assert lazyinit.deferred() == ["lazypkg"]
    import lazypkg

    assert lazypkg.HEAVY == 1 and builtins.LAZYPKG_RUNS == 1  # a name its __init__ defines: run now
    assert lazypkg.Settings is Settings and lazypkg.config.Settings is Settings  # one class, as a plain import
    lazyinit.finish()
    assert builtins.LAZYPKG_RUNS == 1 and lazyinit.deferred() == []


def test_finish_runs_the_init_and_defer_leaves_an_imported_package_alone(package):
    import builtins

    lazyinit.defer(package)
    import lazypkg.config  # noqa: F401

    lazyinit.finish()
    assert builtins.LAZYPKG_RUNS == 1 and sys.modules["lazypkg"].HEAVY == 1
    lazyinit.defer(package)  # imported by now: nothing to defer
    assert lazyinit.deferred() == [] and builtins.LAZYPKG_RUNS == 1


def test_an_init_that_fails_fails_as_an_import_does(package, tmp_path):
    (tmp_path / "lazypkg" / "heavy.py").write_text("raise ImportError('no heavy here')\n")
    lazyinit.defer(package)
    import lazypkg.config  # noqa: F401

    with pytest.raises(ImportError, match="no heavy here"):
        lazyinit.finish()
    assert "lazypkg" not in sys.modules


@pytest.mark.parametrize("argv, code", [(["train", "--help"], 0), (["train", "--max-tokens", "-5"], 2),
                                        (["train", "--no-such-flag"], 2), (["--help"], 0)])
def test_the_cli_answers_help_and_a_bad_flag_without_importing_torch(argv, code):
    """``streamnmt train --help`` and a config error, as the command line runs them (main() reading
    sys.argv, python -m streamnmt): torch is never imported (it is most of a second or more)."""
    script = ("import runpy, sys\n"
              f"sys.argv = ['streamnmt', *{argv!r}]\n"
              "try:\n    runpy.run_module('streamnmt', run_name='__main__')\n"
              "except SystemExit as e:\n    print('exit', e.code, 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert done.stdout.strip().splitlines()[-1] == f"exit {code} False", (done.stdout[-500:], done.stderr[-500:])
    if code == 2:
        assert "streamnmt train: error" in done.stderr or "streamnmt: error: --max-tokens" in done.stderr
