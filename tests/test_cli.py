"""The command line's refusals: before any model loads, with the message and exit code 2."""

import importlib.util

import pytest

import specpcg.__main__ as cli


def test_serve_without_its_packages_names_them_before_loading_a_model(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "uvicorn" else real(name, *a))

    def no_engine(args):
        raise AssertionError("the engine was built before the check")

    monkeypatch.setattr(cli, "_make_engine", no_engine)
    with pytest.raises(SystemExit) as ended:
        cli.main(["serve", "--device", "cpu"])
    assert ended.value.code == 2
    err = capsys.readouterr().err
    assert "serving needs uvicorn: pip install uvicorn" in err
    assert "fastapi" not in err.split("serving needs")[1].split(":")[0]
    assert "Traceback" not in err


def test_serve_on_another_node_runs_its_ranks_without_the_server_packages(monkeypatch):
    """A node other than 0 serves nothing, so it needs none of the server's packages."""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    ran = []

    def ranks_only(args):
        ran.append(args.node_rank)
        raise SystemExit(0)  # as _make_engine does once that node's ranks end

    monkeypatch.setattr(cli, "_make_engine", ranks_only)
    with pytest.raises(SystemExit) as ended:
        cli.main(["serve", "--device", "cpu", "--nnodes", "2", "--node-rank", "1"])
    assert ended.value.code == 0 and ran == [1]
