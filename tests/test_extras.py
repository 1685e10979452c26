"""Optional dependencies: the package imports and runs without them, a feature that needs one names
the extra that installs it, and every extra named that way is one the installed package declares."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest

from flagcx_mc._extras import EXTRAS, install_hint

OPTIONAL = sorted({package for packages in EXTRAS.values() for package in packages})


def test_every_extra_named_in_a_hint_is_declared_with_requirements():
    meta = importlib.metadata.metadata("flagcx_mc")
    declared = set(meta.get_all("Provides-Extra") or ())
    requires = importlib.metadata.requires("flagcx_mc") or []
    for extra in EXTRAS:
        assert extra in declared, f"extra {extra!r} is named in hints but not declared in pyproject.toml"
        assert any(f'extra == "{extra}"' in r for r in requires), f"extra {extra!r} installs nothing"
    assert "matplotlib" in " ".join(r for r in requires if 'extra == "bench"' in r)


def test_a_hint_names_the_package_and_the_extra_and_refuses_a_wrong_pair():
    assert install_hint("redis", "redis") == "needs the 'redis' package: pip install 'flagcx_mc[redis]'"
    with pytest.raises(ValueError, match="no extra 'redis' provides 'matplotlib'"):
        install_hint("redis", "matplotlib")


BLOCK = "import sys\nfor name in {names!r}:\n    sys.modules[name] = None  # import name -> ImportError\n"


def test_the_package_and_its_command_line_import_without_any_extra(tmp_path):
    """No module imports an optional package at import time: with all of them unimportable, the
    public surface, the metadata stores, metrics, the CLI and the bench still import.  (Run from
    an empty directory: `python -c` puts the current one first on sys.path, and a checkout's
    source tree may have no compiled core.)"""
    code = BLOCK.format(names=OPTIONAL) + (
        "import flagcx_mc, flagcx_mc.compat, flagcx_mc.metadata.connect, flagcx_mc.engine.metrics\n"
        "import flagcx_mc.tools.cli, flagcx_mc.tools.bench.runner, flagcx_mc.kv.side_channel\n"
        "assert flagcx_mc.tools.cli.main(['version']) == 0\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_metrics_export_without_prometheus_client_names_the_extra(monkeypatch):
    from flagcx_mc.engine.metrics import export_prometheus

    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    with pytest.raises(ImportError, match=r"pip install 'flagcx_mc\[prometheus\]'"):
        export_prometheus(object())


def test_bench_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path):
    from flagcx_mc.tools.bench.report import draw_png

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    why = draw_png({"rows": [], "baselines": []}, str(tmp_path / "plot.png"))
    assert why is not None and "matplotlib is not installed" in why and "pip install 'flagcx_mc[bench]'" in why
    assert not (tmp_path / "plot.png").exists()


def test_bench_without_mooncake_names_the_extra(monkeypatch):
    from flagcx_mc.tools.bench.runner import TRANSPORTS, BenchOptions, availability

    monkeypatch.setitem(sys.modules, "mooncake", None)
    mooncake = next(t for t in TRANSPORTS if t.engine == "mooncake")
    ok, why = availability(mooncake, BenchOptions())
    assert not ok and "pip install 'flagcx_mc[bench]'" in why
