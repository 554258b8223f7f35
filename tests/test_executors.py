"""The executor contract (posinterp.executors): the same cells, the same files, under every executor.

Each executor runs a small grid with one failing cell: the failure is reported with the
cell's name and error while every other cell is written; a rerun runs only what is
missing (calls are counted with marker files, which every executor's workers can write);
results come back in the cells' order whatever the completion order. Ray runs on a local
instance started here (``ray.init(num_cpus=2)``) and is skipped when Ray is absent.
"""

import dataclasses
import json
import sys
import time
import uuid

import pytest

from posinterp.executors import (
    Cell,
    CellsFailed,
    LocalExecutor,
    ProcessExecutor,
    RayExecutor,
    make_executor,
    run_cells,
)

RAY_MISSING = "Ray is not installed (pip install 'ray>=2.9'); its executor tests are skipped"


def square(x: int, calls: str, delay: float = 0.0) -> dict:
    """A cell: writes one marker file per call, then returns x^2 and its torch thread count."""
    import torch

    from posinterp.io import atomic_write_text

    atomic_write_text(f"{calls}/{x}-{uuid.uuid4().hex}", "")
    time.sleep(delay)
    return {"x": x, "square": x * x, "threads": torch.get_num_threads()}


def fail(x: int, calls: str) -> dict:
    """A cell that raises after counting its call."""
    square(x, calls)
    raise ValueError(f"cell {x} refuses")


def _calls(folder) -> dict[int, int]:
    out: dict[int, int] = {}
    for p in folder.iterdir():
        x = int(p.name.split("-")[0])
        out[x] = out.get(x, 0) + 1
    return out


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason=RAY_MISSING)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(params=["local", "process", "ray"])
def executor(request):
    if request.param == "ray":
        request.getfixturevalue("ray_cluster")
        return RayExecutor()
    return {"local": LocalExecutor, "process": lambda: ProcessExecutor(2)}[request.param]()


def test_contract_failure_resume_and_order(executor, tmp_path):
    calls = tmp_path / "calls"
    calls.mkdir()
    # later cells finish first under a parallel executor: the result order must not follow
    cells = [Cell(f"x{x}", square, dict(x=x, calls=str(calls), delay=0.3 * (3 - x)))
             for x in range(4)]
    cells[2] = Cell("x2", fail, dict(x=2, calls=str(calls)))
    with pytest.raises(CellsFailed) as info:
        run_cells(cells, tmp_path / "out", executor, progress=False)
    err = info.value
    assert list(err.failures) == ["x2"] and "ValueError: cell 2 refuses" in err.failures["x2"]
    assert "x2: ValueError: cell 2 refuses" in str(err)
    assert sorted(err.results) == ["x0", "x1", "x3"]
    for x in (0, 1, 3):  # the others finished and were written by the driver
        written = json.loads((tmp_path / "out" / f"x{x}.json").read_text())
        assert written["square"] == x * x and written["threads"] == 1
    assert not (tmp_path / "out" / "x2.json").exists()
    assert _calls(calls) == {0: 1, 1: 1, 2: 1, 3: 1}

    # resume: only the failed cell runs again
    cells[2] = Cell("x2", square, dict(x=2, calls=str(calls)))
    results = run_cells(cells, tmp_path / "out", executor, progress=False)
    assert _calls(calls) == {0: 1, 1: 1, 2: 2, 3: 1}
    assert list(results) == ["x0", "x1", "x2", "x3"]
    assert [r["square"] for r in results.values()] == [0, 1, 4, 9]
    seconds = json.loads((tmp_path / "out" / "_seconds.json").read_text())
    assert set(seconds) == {"x0", "x1", "x2", "x3"} and min(seconds.values()) >= 0

    # done: nothing runs
    run_cells(cells, tmp_path / "out", executor, progress=False)
    assert sum(_calls(calls).values()) == 5
    executor.close()


def test_a_cell_runs_with_its_num_cpus_as_torch_threads(tmp_path):
    import torch

    before = torch.get_num_threads()
    calls = tmp_path / "calls"
    calls.mkdir()
    res = run_cells([Cell("two", square, dict(x=1, calls=str(calls)), num_cpus=2)],
                    tmp_path / "out", progress=False)
    assert res["two"]["threads"] == 2 and torch.get_num_threads() == before  # restored


def test_each_cell_records_the_environment_it_ran_in(executor, tmp_path):
    """Threads, CPU and versions of the worker that ran each cell (issue 37 item 1: a
    trained cell reproduces bit for bit only under the same facts), kept across resumes;
    cell_environments maps each cell to one of the distinct environments."""
    from posinterp.executors import cell_environments
    from posinterp.io import cpu_facts, versions

    calls = tmp_path / "calls"
    calls.mkdir()
    cells = [Cell(f"c{i}", square, dict(x=i, calls=str(calls)), num_cpus=1 + i % 2) for i in range(3)]
    run_cells(cells[:2], tmp_path / "out", executor, progress=False)
    run_cells(cells, tmp_path / "out", executor, progress=False)  # resumes: only c2 runs
    table = json.loads((tmp_path / "out" / "_environment.json").read_text())
    assert sorted(table) == ["c0", "c1", "c2"]
    for i in range(3):
        env = table[f"c{i}"]
        assert env["torch_threads"] == 1 + i % 2
        assert {k: env[k] for k in ("cpu", "cpu_flags")} == cpu_facts()
        assert env["torch"] == versions()["torch"] and env["posinterp"] == versions()["posinterp"]
    envs = cell_environments(tmp_path / "out", ["c0", "c1", "c2", "never-ran"])
    assert len(envs["environments"]) == 2  # one thread and two threads
    assert envs["cells"]["c0"] == envs["cells"]["c2"] != envs["cells"]["c1"]
    assert envs["cells"]["never-ran"] is None
    executor.close()


def test_results_in_other_formats_round_trip(tmp_path):
    pd = pytest.importorskip("pandas")
    res = run_cells([Cell("table", pd.DataFrame, dict(data={"a": [1.5, 2.25]}))], tmp_path,
                    fmt="csv", progress=False)
    assert res["table"].a.tolist() == [1.5, 2.25] and (tmp_path / "table.csv").exists()
    res = run_cells([Cell("obj", dict, dict(a=(1, 2)))], tmp_path, fmt="pickle", progress=False)
    assert res["obj"] == {"a": (1, 2)}


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="bogus"), r"executor must be one of \('local', 'process', 'ray'\), got 'bogus'"),
    (dict(name="local", workers=2), "workers applies to executor 'process' only"),
    (dict(name="process", address="x:1"), "address applies to executor 'ray' only"),
    (dict(name="process", workers=0), "workers must be >= 1"),
])
def test_make_executor_names_the_bad_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_executor(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="../up"), "Cell name"), (dict(name="a b"), "Cell name"),
    (dict(name="ok", num_cpus=0), "num_cpus"), (dict(name="ok", num_gpus=-1), "num_gpus")])
def test_bad_cells_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Cell(fn=square, **kwargs)


def test_repeated_names_and_unknown_formats_are_refused(tmp_path):
    cells = [Cell("a", dict), Cell("a", dict)]
    with pytest.raises(ValueError, match="unique"):
        run_cells(cells, tmp_path, progress=False)
    with pytest.raises(ValueError, match="fmt must be one of"):
        run_cells(cells[:1], tmp_path, fmt="xml", progress=False)


def test_ray_missing_names_how_to_install_it(monkeypatch, tmp_path, capsys):
    from posinterp.cli import main

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'ray>=2.9' \(in a clone of posinterp: "
                                          r"pip install '\.\[ray\]'\)"):
        make_executor("ray")
    # the CLI says it in one line, status 2, as for any missing optional package
    assert main(["experiment", "qk-constraints", "--quick", "--executor", "ray",
                 "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert "needs Ray: pip install 'ray>=2.9'" in capsys.readouterr().err


def _tiny_grid():
    from posinterp.experiments.qk_constraints import ConstraintGrid
    from tests.test_qk_constraints import TINY

    # untied cells only: constrained training is TL 3.9 only, and this test runs on both
    return dataclasses.replace(ConstraintGrid(**TINY, workers=1), pes=("absolute", "rotary"),
                               constraints=("none",))


@pytest.fixture(scope="module")
def in_process_run(tmp_path_factory):
    from posinterp.experiments.qk_constraints import run_qk_constraints

    out = tmp_path_factory.mktemp("local")
    run_qk_constraints(_tiny_grid(), out, progress=False, executor=LocalExecutor())
    return out


@pytest.mark.parametrize("name", ["process", "ray"])
def test_the_same_grid_gives_identical_csvs_under_every_executor(name, in_process_run, tmp_path,
                                                                  request):
    """A tiny qk-constraints grid: every table byte for byte as in-process."""
    from posinterp.experiments.qk_constraints import run_qk_constraints

    if name == "ray":
        request.getfixturevalue("ray_cluster")
    with make_executor(name, workers=2 if name == "process" else None) as ex:
        run_qk_constraints(_tiny_grid(), tmp_path, progress=False, executor=ex)
    for f in ("runs.csv", "summary.csv", "heads.csv", "claims.csv"):
        assert (in_process_run / f).read_bytes() == (tmp_path / f).read_bytes(), f
    run = json.loads((tmp_path / "run.json").read_text())
    assert run["calls"][-1]["executor"] == name


def test_a_cell_is_reused_only_under_its_key(tmp_path):
    """A finished cell whose key changed (an architecture derived differently, a setting
    edited) is recomputed; an equal key reads it back; without a key the name decides."""
    calls = tmp_path / "calls"
    calls.mkdir()
    out = tmp_path / "out"

    def cells(key3):
        return [Cell("c1", square, dict(x=1, calls=str(calls)), key={"d_head": 64}),
                Cell("c2", square, dict(x=2, calls=str(calls))),
                Cell("c3", square, dict(x=3, calls=str(calls)), key=key3)]

    run_cells(cells({"d_head": 32, "widths": (64, 192)}), out, progress=False)
    assert _calls(calls) == {1: 1, 2: 1, 3: 1}
    # the same keys (a tuple reads back as a list: keys compare as JSON): nothing reruns
    run_cells(cells({"widths": [64, 192], "d_head": 32}), out, progress=False)
    assert _calls(calls) == {1: 1, 2: 1, 3: 1}
    logged = []
    run_cells(cells({"d_head": 64, "widths": (64, 192)}), out, progress=False, log=logged.append)
    assert _calls(calls) == {1: 1, 2: 1, 3: 2}
    assert any("c3: stale" in line for line in logged)
    assert json.loads((out / "c3.json.key.json").read_text())["d_head"] == 64
    # a result written before keys existed (no key file) is stale for a keyed cell
    (out / "c1.json.key.json").unlink()
    run_cells(cells({"d_head": 64, "widths": (64, 192)}), out, progress=False)
    assert _calls(calls) == {1: 2, 2: 1, 3: 2}
    with pytest.raises(ValueError, match="key must be JSON-serializable"):
        Cell("bad", dict, key={"x": object()})
