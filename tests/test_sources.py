"""Every source file of the package, its examples and benches compiles without a SyntaxWarning (a DeprecationWarning before 3.12): Python 3.12 warns
(and a later Python refuses) on an invalid escape such as ``\\ `` in a docstring, which users then see on import
from a fresh install, where no cached bytecode hides it."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted(p for folder in ("fxq", "examples", "bench", "tests") for p in (ROOT / folder).rglob("*.py"))


def test_sources_found() -> None:
    assert len(SOURCES) > 100


@pytest.mark.parametrize("folder", ["fxq", "examples", "bench", "tests"])
def test_sources_compile_without_syntax_warnings(folder: str) -> None:
    for path in (p for p in SOURCES if p.relative_to(ROOT).parts[0] == folder):
        with warnings.catch_warnings():
            warnings.simplefilter("error", SyntaxWarning)
            warnings.simplefilter("error", DeprecationWarning)  # the same warning before Python 3.12
            try:
                compile(path.read_text(encoding="utf-8"), str(path), "exec")
            except SyntaxError as exc:  # a SyntaxWarning turned error arrives as SyntaxError
                pytest.fail(f"{path.relative_to(ROOT)}: {exc}")
