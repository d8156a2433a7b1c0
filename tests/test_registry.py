"""The draft registry: the engine finds drafts by name, and no module of `specpcg` imports the
`drafts` package (imports run one way)."""

import ast
from pathlib import Path

import pytest

from specpcg.speculative import registry

ROOT = Path(__file__).resolve().parent.parent


def _imports(path: Path) -> set:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_no_specpcg_module_imports_drafts():
    offenders = [str(p.relative_to(ROOT)) for p in (ROOT / "specpcg").rglob("*.py")
                 if "drafts" in _imports(p)]
    assert offenders == []


def test_standalone_and_wiring_do_not_import_each_other():
    assert "drafts" not in {m for m in _imports(ROOT / "drafts" / "wiring.py")}
    assert "drafts.wiring" in (ROOT / "drafts" / "standalone.py").read_text()


def test_every_algorithm_is_registered_and_unknown_names_are_refused(monkeypatch):
    from specpcg.speculative.registry import DraftContext, create_draft

    class Spec:
        algorithm = "MEDUSA"

    ctx = DraftContext(Spec(), None, None, None, None, None, None, 0)
    with pytest.raises(ValueError, match=r"speculative_algorithm 'MEDUSA' has no draft worker"):
        create_draft(ctx)
    assert {"NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "NEXTN"} <= set(registry._FACTORIES)
    made = []
    monkeypatch.setitem(registry._FACTORIES, "MEDUSA", lambda c: made.append(c) or "draft")
    assert create_draft(ctx) == "draft" and made == [ctx]
