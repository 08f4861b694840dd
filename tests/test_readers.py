"""Issue 13: the reader x field matrix. Every batch form trajstore stores (tests/_reader_forms.py),
read by Parquet readers nobody here wrote; each cell asserts the reader reads exactly the values the
spec promises for that column (bf16 / fp16 as their real numbers). A cell that does not hold today
is ``xfail(strict=True)`` with its reason in ``KNOWN``: when a fix lands the cell fails and its entry
must go, so this module is the living compatibility table.

Spark needs a JRE (``apt-get install -y --no-install-recommends openjdk-17-jre-headless``) and
``pyspark``; Ray Data needs ``ray`` (tests/frameworks.txt); the other readers are in the ``test`` extra.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import trajstore
from _provision import ensure_apt
from _reader_forms import FORMS, assert_column, locate

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),  # Ray Data's own settings
              pytest.mark.filterwarnings("ignore:The 'fastparquet' engine is deprecated")]

# ----------------------------------------------------------------------------- readers
_sessions: dict[str, Any] = {}


def _pandas(engine: str) -> Callable:
    def read(target: Any, columns: list[str] | None) -> dict:
        pd = pytest.importorskip("pandas")
        if engine == "fastparquet":
            pytest.importorskip("fastparquet")
        df = pd.read_parquet(target, engine=engine, columns=columns)
        # pandas' str dtype marks a missing string with NaN: that is its None
        return {c: [None if isinstance(df[c].dtype, pd.StringDtype) and pd.isna(x) else x for x in df[c].tolist()]
                for c in df.columns}
    return read


def _polars(target: Any, columns: list[str] | None) -> dict:
    pl = pytest.importorskip("polars")
    return pl.read_parquet(target, columns=columns).to_dict(as_series=False)


def _duckdb(target: Any, columns: list[str] | None) -> dict:
    duckdb = pytest.importorskip("duckdb")
    if isinstance(target, Path) and target.is_dir():
        target = target / "*.parquet"  # DuckDB reads a folder through a glob
    sel = ", ".join(f'"{c}"' for c in columns) if columns else "*"
    rel = duckdb.connect().sql(f"SELECT {sel} FROM read_parquet('{target}')")
    return dict(zip(rel.columns, map(list, zip(*rel.fetchall()))) if rel.shape[0] else {c: [] for c in rel.columns})


def _dataset(target: Any, columns: list[str] | None) -> dict:
    import pyarrow.dataset as ds

    return ds.dataset(target, format="parquet").to_table(columns=columns).to_pydict()


def _datafusion(target: Any, columns: list[str] | None) -> dict:
    datafusion = pytest.importorskip("datafusion")
    df = datafusion.SessionContext().read_parquet(str(target))
    if columns:
        df = df.select(*[datafusion.col(f'"{c}"') for c in columns])
    return df.to_arrow_table().to_pydict()


def _fastparquet(target: Any, columns: list[str] | None) -> dict:
    fastparquet = pytest.importorskip("fastparquet")
    df = fastparquet.ParquetFile(str(target)).to_pandas(columns=columns)
    return {c: df[c].tolist() for c in df.columns}


def _java_major() -> int:
    java = os.path.join(os.environ["JAVA_HOME"], "bin", "java") if os.environ.get("JAVA_HOME") else shutil.which("java")
    if not java:
        return 0
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    m = re.search(r'version "(?:1\.)?(\d+)', out)
    return int(m.group(1)) if m else 0


def _spark(target: Any, columns: list[str] | None) -> dict:
    if "spark" not in _sessions:
        pytest.importorskip("pyspark")
        if _java_major() < 17:  # a fresh CI machine: the tests install the JRE themselves (as root)
            why = ensure_apt("openjdk-17-jre-headless")
            if why or _java_major() < 17:
                pytest.skip(f"Spark 4 needs a JRE >= 17: {why or 'java on PATH is older than 17'}")
        from pyspark.sql import SparkSession

        _sessions["spark"] = (SparkSession.builder.master("local[1]").appName("trajstore-readers")
                              .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "1")
                              .getOrCreate())
        _sessions["spark"].sparkContext.setLogLevel("OFF")
    df = _sessions["spark"].read.parquet(str(target))
    if columns:
        df = df.select(*[f"`{c}`" for c in columns])
    got = [r.asDict(recursive=True) for r in df.collect()]
    return {c: [r[c] for r in got] for c in df.columns}


def _ray(target: Any, columns: list[str] | None) -> dict:
    if "ray" not in _sessions:
        ray = pytest.importorskip("ray")
        pytest.importorskip("ray.data")
        ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, configure_logging=False)
        ray.data.DataContext.get_current().enable_progress_bars = False
        _sessions["ray"] = ray
    got = _sessions["ray"].data.read_parquet(str(target), columns=columns).take_all()
    return {c: [r[c] for r in got] for c in (columns or (list(got[0]) if got else []))}


HEAVY = ("spark", "ray")  # start a JVM / a Ray cluster: marked heavy_readers
READERS: dict[str, Callable] = {
    "pandas": _pandas("pyarrow"), "pandas-fastparquet": _pandas("fastparquet"), "polars": _polars,
    "duckdb": _duckdb, "pyarrow.dataset": _dataset, "datafusion": _datafusion, "fastparquet": _fastparquet,
    "spark": _spark, "ray": _ray,
}


@pytest.fixture(scope="module", autouse=True)
def _stop_sessions():
    yield
    if "spark" in _sessions:
        _sessions.pop("spark").stop()
    if "ray" in _sessions:
        _sessions.pop("ray").shutdown()


# ----------------------------------------------------------------------------- dumps and cells
def _forms() -> dict[str, tuple[Any, list]]:
    out = {}
    for name, build in FORMS.items():
        try:
            out[name] = build()
        except ImportError:  # tensordict not installed: its forms are left out
            continue
    return out


_FORMS = _forms()
CELLS = [(form, *cell) for form, (_, cells) in _FORMS.items() for cell in cells]


def cell_id(form: str, label: str, path: Any, part: str) -> str:
    name = path if isinstance(path, str) else ".".join(path[1:]) or path[0]
    return f"{form}:{name}" + ("" if part == "col" else f":{part}")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, Path]:
    """One dump per form (two identical steps of ``padded``); the step file of each."""
    root = tmp_path_factory.mktemp("readers")
    files = {}
    for name, (batch, _) in _FORMS.items():
        with trajstore.Writer(root / name) as w:
            for s in (0, 1) if name == "padded" else (0,):
                w.append(s, batch)
        files[name] = Path(sorted(glob.glob(str(root / name / "train" / "step_*.parquet")))[0])
    return files


_cache: dict[tuple, Any] = {}


def read_column(reader: str, path: Path, column: str) -> list:
    """Column ``column`` of the file at ``path``: from one whole-file read per reader and file, or,
    where that read fails, from a read of that column alone."""
    key = (reader, path)
    if key not in _cache:
        try:
            _cache[key] = READERS[reader](path, None)
        except (pytest.skip.Exception, KeyboardInterrupt):
            raise
        except Exception as e:  # noqa: BLE001 -- the column alone may still read
            _cache[key] = e
    whole = _cache[key]
    if not isinstance(whole, Exception):
        return whole[column]
    return READERS[reader](path, [column])[column]


# ----------------------------------------------------------------------------- what fails today
PDFP = "pandas' (deprecated) fastparquet engine returns bool / int64 columns as float64"


def known(reader: str, form: str, label: str, part: str) -> str | None:
    """Why cell (reader, form/column) does not hold today, or None where it does."""
    if reader in ("fastparquet", "pandas-fastparquet"):
        if reader == "pandas-fastparquet" and label in ("bool sample", "int64 sample", "int value", "bool value", "span start",
                                                        "int32 cu_seqlens ends (packed)"):
            return PDFP
    return None


def _params() -> list:
    out = []
    for reader in READERS:
        for form, label, path, part, expected in CELLS:
            why = known(reader, form, label, part)
            marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
            marks += [pytest.mark.heavy_readers] if reader in HEAVY else []
            out.append(pytest.param(reader, form, path, part, expected, marks=marks,
                                    id=f"{reader}-{cell_id(form, label, path, part)}"))
    return out


@pytest.mark.parametrize("reader, form, path, part, expected", _params())
def test_cell(dumps, reader, form, path, part, expected):
    f = dumps[form]
    spec = json.loads(pq.read_schema(f).metadata[b"trajstore"])
    column = locate(spec, path, part)
    assert_column(read_column(reader, f, column), expected, f"{reader} {f.name} {column}")


# ----------------------------------------------------------------------------- opt-in encodings
ENC9 = "fastparquet cannot decode BYTE_STREAM_SPLIT (NotImplementedError: Encoding 9): why it is opt-in"
_BSS = ("int16", "int32", "int64", "fp32", "fp64", "bf16", "fp16")  # tensor values stored BYTE_STREAM_SPLIT


def known_compact(reader: str, label: str, part: str) -> str | None:
    """Why cell (reader, column) of a step written with ``encodings="compact"`` does not hold."""
    if reader in ("fastparquet", "pandas-fastparquet") and label.startswith(_BSS) and "value" not in label:
        return ENC9
    return known(reader, "padded", label, part)


def _written(tmp_path_factory, tag: str, **writer_kw) -> dict[str, Path]:
    """The padded and fp16 forms, each one step written with ``Writer(**writer_kw)``."""
    root, files = tmp_path_factory.mktemp(tag), {}
    for name in ("padded", "half"):
        with trajstore.Writer(root / name, **writer_kw) as w:
            w.append(0, _FORMS[name][0])
        files[name] = root / name / "train" / "step_00000000.parquet"
    return files


def _cells(tag: str, why) -> list:
    """The cells of the padded and fp16 forms for every reader, ``why(reader, form, label, part)`` the
    reason a cell does not hold (an expected failure), else None."""
    return [pytest.param(r, form, path, part, expected,
                         marks=([pytest.mark.xfail(strict=True, reason=why(r, form, label, part))]
                                if why(r, form, label, part) else [])
                         + ([pytest.mark.heavy_readers] if r in HEAVY else []),
                         id=f"{r}-{tag}-{cell_id(form, label, path, part)}")
            for r in READERS for form, label, path, part, expected in CELLS if form in ("padded", "half")]


def _check_cell(f: Path, reader: str, path, part, expected, tag: str) -> None:
    column = locate(json.loads(pq.read_schema(f).metadata[b"trajstore"]), path, part)
    assert_column(read_column(reader, f, column), expected, f"{reader} {tag} {column}")


@pytest.fixture(scope="module")
def compact(tmp_path_factory) -> dict[str, Path]:
    """The padded and fp16 forms written with ``Writer(encodings="compact")`` (docs/FORMAT.md 3.5)."""
    return _written(tmp_path_factory, "compact", encodings="compact")


@pytest.mark.parametrize("reader, form, path, part, expected",
                         _cells("compact", lambda r, form, label, part: known_compact(r, label, part)))
def test_cell_compact(compact, reader, form, path, part, expected):
    """The opt-in compact encodings: every reader but fastparquet reads every column."""
    _check_cell(compact[form], reader, path, part, expected, "compact")


@pytest.fixture(scope="module")
def lz4(tmp_path_factory) -> dict[str, Path]:
    """The padded and fp16 forms written with ``Writer(compression="lz4_raw")`` (docs/FORMAT.md 3.5)."""
    return _written(tmp_path_factory, "lz4", compression="lz4_raw")


@pytest.mark.parametrize("reader, form, path, part, expected", _cells("lz4", known))
def test_cell_lz4(lz4, reader, form, path, part, expected):
    """The LZ4_RAW codec (``compression="lz4_raw"``): every reader reads what it reads of a zstd step."""
    _check_cell(lz4[form], reader, path, part, expected, "lz4")


# ----------------------------------------------------------------------------- whole folders


@pytest.mark.parametrize("reader", [
    pytest.param(r, marks=[pytest.mark.heavy_readers] if r in HEAVY else [])
    for r in ("pandas", "polars", "duckdb", "pyarrow.dataset", "datafusion", "spark", "ray")])
def test_split_folder(dumps, reader):
    """``read(split_dir)`` reads exactly the steps (DuckDB through ``split/*.parquet``)."""
    got = READERS[reader](dumps["padded"].parent, ["step", "rewards"])
    order = sorted(range(len(got["step"])), key=lambda i: got["step"][i])
    assert [got["step"][i] for i in order] == [0, 0, 0, 1, 1, 1]
    assert_column([got["rewards"][i] for i in order], [("f", x.hex()) for x in [1.5, -0.25, 3.0] * 2], reader)


@pytest.mark.parametrize("reader", ["duckdb", "polars"])
def test_dump_glob(dumps, reader):
    """``read_parquet('dump/**/*.parquet')`` reads exactly the step files of the dump."""
    got = READERS[reader](str(dumps["padded"].parent.parent / "**" / "*.parquet"), ["step"])
    assert sorted(got["step"]) == [0, 0, 0, 1, 1, 1]


# ----------------------------------------------------------------------------- never silently wrong
def _ids(lengths: list[int]) -> dict:
    m = torch.arange(4)[None, :] < torch.tensor(lengths)[:, None]
    return {"input_ids": torch.arange(12).reshape(3, 4) * m, "attention_mask": m}


def _bf16(dtype: torch.dtype) -> dict:
    return {**_ids([2, 4, 1]), "logprobs": torch.tensor([[0.5, -1.25, 0, 0], [1, 2, 3, 4], [-8, 0, 0, 0]]).to(dtype)}


def _packed_step() -> dict:
    return {"input_ids": torch.arange(5), "cu_seqlens": torch.tensor([0, 2, 2, 5], dtype=torch.int32),
            "score": torch.tensor([3.0, 4.0, 5.0])}


# (steps, column, the right values in step order: numbers as floats, lists as lists of floats)
CHANGING = {
    "int_then_double": ([{**_ids([1, 2, 3]), "score": [1, 2, 3]}, {**_ids([1, 2, 3]), "score": [0.5, 1.5, 2.5]}],
                        "score", [1, 2, 3, 0.5, 1.5, 2.5]),
    "int_then_json": ([{**_ids([1, 2, 3]), "score": [1, 0, 1]}, {**_ids([1, 2, 3]), "score": [1, 0.5, 0]}],
                      "score", [1, 0, 1, 1, 0.5, 0]),
    "bf16_then_fp32": ([_bf16(torch.bfloat16), _bf16(torch.float32)], "logprobs",
                       [[0.5, -1.25], [1, 2, 3, 4], [-8]] * 2),
    "fp32_then_bf16": ([_bf16(torch.float32), _bf16(torch.bfloat16)], "logprobs",
                       [[0.5, -1.25], [1, 2, 3, 4], [-8]] * 2),
    "score_in_later_step": ([_ids([1, 2, 3]), {**_ids([1, 2, 3]), "score": [0.5, 1.5, 2.5]}],
                            "score", [None, None, None, 0.5, 1.5, 2.5]),
    # a step whose column cannot have the split's type: stored under another name (FORMAT.md 3.11),
    # so the field's column is NULL (or the read fails), never a wrong number
    "int64_then_float32_tensor": ([{**_ids([1, 2, 3]), "rewards": torch.tensor([1, 2, 3])},
                                   {**_ids([1, 2, 3]), "rewards": torch.tensor([0.5, 1.5, 2.5])}],
                                  "rewards", [1, 2, 3, None, None, None]),
    "numbers_then_strings": ([{**_ids([1, 2, 3]), "score": [1, 2, 3]}, {**_ids([1, 2, 3]), "score": ["a", "b", "c"]}],
                             "score", [1, 2, 3, None, None, None]),
    "numbers_then_big_ints": ([{**_ids([1, 2, 3]), "score": [1, 2.5, 3]}, {**_ids([1, 2, 3]), "score": [2**60, 1, 2]}],
                              "score", [1, 2.5, 3, None, None, None]),
    "padded_then_packed": ([{**_ids([2, 4, 1]), "score": torch.tensor([0.0, 1.0, 2.0])}, _packed_step()],
                           "score", [0, 1, 2, 3, 4, 5]),
}


def _glob_read(reader: str, split: Path, column: str) -> dict:
    files = sorted(glob.glob(str(split / "step_*.parquet")))
    if reader in ("duckdb", "polars"):
        return READERS[reader](str(split / "*.parquet"), ["step", column])
    if reader == "datafusion":
        return READERS[reader](split, ["step", column])
    return READERS[reader](files, ["step", column])  # pandas, pyarrow.dataset: the list of step files


def _numbers(v: Any) -> Any:
    if v is None or isinstance(v, float) and math.isnan(v):  # pandas shows a NULL number as NaN (none is written)
        return None
    if isinstance(v, np.generic):  # a numpy scalar (pandas' list elements)
        v = v.item()
    if isinstance(v, (list, tuple)) or hasattr(v, "tolist") and not isinstance(v, (int, float)):
        return [_numbers(x) for x in list(v)]
    assert isinstance(v, (int, float)) and not isinstance(v, bool), f"{v!r} is not a number"
    return float(v)


SILENT: dict = {  # (reader, case): the wrong answer it gives today without an error (none left)
}


@pytest.mark.parametrize("reader, case", [
    pytest.param(r, c, id=f"{r}-{c}", marks=[pytest.mark.xfail(strict=True, reason=SILENT[r, c])] if (r, c) in SILENT else [])
    for r in ("duckdb", "polars", "pandas", "pyarrow.dataset", "datafusion") for c in CHANGING])
def test_glob_of_changing_steps(tmp_path, reader, case):
    """A glob over a split whose steps change value kinds or batch forms gives the right numbers or
    raises; it never returns a wrong number."""
    steps, column, right = CHANGING[case]
    with trajstore.Writer(tmp_path) as w:
        for s, batch in enumerate(steps):
            w.append(s, batch)
    try:
        got = _glob_read(reader, tmp_path / "train", column)
    except (pytest.skip.Exception, KeyboardInterrupt):
        raise
    except Exception:  # noqa: BLE001 -- a clear error is an acceptable answer
        return
    order = sorted(range(len(got["step"])), key=lambda i: got["step"][i])
    assert _numbers([got[column][i] for i in order]) == _numbers(right)
