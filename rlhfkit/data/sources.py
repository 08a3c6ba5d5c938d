"""Reading a data source into raw rows: files, DeepSpeed-Chat directories and hub datasets.

A *source* is what one ``--data_path`` entry names. Reading it gives a :class:`RawSource`: every
row in file order (parsed JSON values, TSV cells, or a :class:`BadRow` for a line that could not be
parsed), a way to say where a row sits (``line 13``), and the sha256 of the bytes read. What the
rows *mean* (hh-rlhf dialogues, prompt/chosen/rejected, ...) is decided in ``formats.py``.

The container is recognised by content, not by extension:

* gzip magic ``1f 8b`` -> decompressed, then recognised again (``.jsonl.gz``);
* parquet magic ``PAR1`` -> read with pyarrow;
* text starting with ``[`` -> one JSON list of rows;
* text starting with ``{`` or ``"`` -> JSON lines (one JSON value per line), or a single JSON object;
* text with a tab in its first line -> TSV (with a header line if every cell of the first line is
  a known field name, else headerless cells, e.g. MGSM's ``question <TAB> number``);
* a directory holding ``train.json`` / ``eval.json`` (or ``data/train.json`` ...) -> DeepSpeed-Chat's
  ``local/jsonfile`` layout, train rows then eval rows;
* a path that does not exist and looks like ``org/name`` -> ``datasets.load_dataset(name)``.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rlhfkit.errors import DataError

FORMATS_HELP = """\
Supported data (one --data_path entry each; several entries are blended):
  files: JSON lines (.jsonl, also gzip-compressed .jsonl.gz), a JSON list (.json), parquet, TSV;
         a DeepSpeed-Chat local/jsonfile directory (train.json + eval.json);
         a Hugging Face hub dataset name org/name (needs network).
  rows:  hh-rlhf dialogues        {"chosen": "\\n\\nHuman: ...\\n\\nAssistant: ...", "rejected": "..."}
         prompt/chosen/rejected   {"prompt": str or [{"role", "content"}], "chosen": str, "rejected": str}
         prompt/response          {"prompt": ..., "response": str}
         Alpaca                   {"instruction", "input", "output"} (optional "system", "history")
         ShareGPT / LLaMA-Factory {"conversations": [{"from", "value"}], "chosen"/"rejected": {"from", "value"}}
                                  or {"messages": [{"role", "content"}]}
         seed tasks (self-instruct, BELLE)  {"instruction", "instances": [{"input", "output"}]}
         GSM8K                    {"question", "answer"}
         MGSM TSV without header  question<TAB>number
         prompt-only              {"prompt": ...} (other fields kept), or a JSON list of strings"""

# Field names that mark the first line of a TSV file as a header.
_TSV_HEADER_FIELDS = {
    "prompt", "chosen", "rejected", "response", "question", "answer",
    "instruction", "input", "output", "system",
}
_FILE_SUFFIXES = (".json", ".jsonl", ".gz", ".parquet", ".tsv", ".csv", ".txt", ".arrow")
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass(frozen=True)
class BadRow:
    """A row that could not even be parsed (bad JSON line, wrong number of TSV columns)."""

    reason: str  # short, countable: "bad JSON line"
    detail: str = ""  # specifics for messages: "Expecting ',' delimiter at column 20"


@dataclass
class RawSource:
    """All rows of one source, in file order."""

    path: str  # as the user gave it
    container: str  # "jsonl", "jsonl.gz", "json", "parquet", "tsv", "local/jsonfile", "hub"
    sha256: str  # of the bytes read (for a directory / hub dataset: of its parts)
    rows: list[Any]  # dict | list | str | ... | BadRow, one per row
    _where: Callable[[int], str] = field(repr=False, default=lambda i: f"row {i}")

    def where(self, row: int) -> str:
        """Where row ``row`` (0-based) sits, for messages: ``line 13`` or ``eval.json line 2``."""
        return self._where(row)


def split_paths(paths: str | os.PathLike | list | tuple) -> list[str]:
    """``--data_path`` entries: a list, or one string separated by spaces or commas.

    An entry that exists as a path is kept whole even if it contains a space or a comma.
    """
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: list[str] = []
    for item in items:
        item = os.fspath(item)
        if os.path.exists(item):
            out.append(item)
        else:
            out.extend(p for p in re.split(r"[\s,]+", item) if p)
    return out


def read_source(path: str) -> RawSource:
    """Read one data source (file, local/jsonfile directory or hub name) into raw rows."""
    p = Path(path)
    if p.is_dir():
        return _read_jsonfile_dir(path, p)
    if p.exists():
        container, sha, rows, where = _read_file(p)
        return RawSource(path, container, sha, rows, where)
    if path == "local/jsonfile":
        raise DataError(
            "--data_path local/jsonfile: DeepSpeed-Chat resolves this name relative to its own "
            "checkout; here pass the directory itself, e.g. --data_path /path/to/dir, where dir "
            "holds train.json and eval.json (or data/train.json and data/eval.json)."
        )
    if _looks_like_hub_name(path):
        return _read_hub(path)
    raise DataError(
        f"data file not found: {path} (absolute: {p.absolute()}). Check the --data_path value; "
        f"a hub dataset is given as org/name.\n{FORMATS_HELP}"
    )


# ---------------------------------------------------------------------------------------------
# files


def _read_file(p: Path) -> tuple[str, str, list, Callable[[int], str]]:
    """-> (container, sha256, rows, where)."""
    try:
        data = p.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read data file {p}: {e.strerror or e}. Check its permissions.") from None
    sha = hashlib.sha256(data).hexdigest()
    gz = data[:2] == b"\x1f\x8b"
    if gz:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{p}: looks gzip-compressed but cannot be decompressed ({e}). "
                            "The file is probably truncated or corrupt.") from None
    suffix = ".gz" if gz else ""
    if data[:4] == b"PAR1":
        return "parquet" + suffix, sha, _parquet_rows(p, data), lambda i: f"row {i}"
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{p}: not UTF-8 text, gzip or parquet (undecodable byte at offset {e.start}).\n{FORMATS_HELP}"
        ) from None
    head = text.lstrip()
    if not head:
        raise DataError(f"{p}: the file is empty; it has no rows to train on.")
    first_line = head.split("\n", 1)[0]
    if head[0] == "[":
        return "json" + suffix, sha, _json_list_rows(p, text), lambda i: f"list item {i}"
    if head[0] in "{\"":
        whole = None if _try_json(first_line) is not None else _try_json(text)
        if isinstance(whole, dict):  # one pretty-printed object: {"data": [...]} or a single row
            lists = [v for v in whole.values() if isinstance(v, list) and v and isinstance(v[0], dict)]
            rows = lists[0] if len(whole) == 1 and len(lists) == 1 else [whole]
            return "json" + suffix, sha, rows, lambda i: f"item {i}"
        rows, lines = _jsonl_rows(text)
        return "jsonl" + suffix, sha, rows, lambda i: f"line {lines[i]}"
    if "\t" in first_line:
        rows, lines = _tsv_rows(text)
        return "tsv" + suffix, sha, rows, lambda i: f"line {lines[i]}"
    raise DataError(
        f"{p}: unknown file format (not JSON, JSON lines, parquet or TSV; it starts with "
        f"{first_line[:60]!r}).\n{FORMATS_HELP}"
    )


def _try_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _json_list_rows(p: Path, text: str) -> list:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(
            f"{p}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}). A .json file must hold "
            "one JSON list of rows, or one JSON object per line (JSON lines)."
        ) from None
    return value


def _jsonl_rows(text: str) -> tuple[list, list[int]]:
    """One row per non-blank line; a line that does not parse becomes a BadRow."""
    rows, lines = [], []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            rows.append(BadRow("bad JSON line", f"{e.msg} at column {e.colno}"))
        lines.append(lineno)
    return rows, lines


def _tsv_rows(text: str) -> tuple[list, list[int]]:
    """TSV cells split on tabs (no quoting: MGSM questions contain quote characters)."""
    numbered = [(n, line.split("\t")) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    header = numbered[0][1]
    if all(c.strip() in _TSV_HEADER_FIELDS for c in header):
        names = [c.strip() for c in header]
        rows = [
            dict(zip(names, cells)) if len(cells) == len(names)
            else BadRow("wrong number of columns", f"{len(cells)} columns, the header has {len(names)}")
            for _, cells in numbered[1:]
        ]
        return rows, [n for n, _ in numbered[1:]]
    return [cells for _, cells in numbered], [n for n, _ in numbered]


def _parquet_rows(p: Path, data: bytes) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(io.BytesIO(data)).to_pylist()
    except Exception as e:  # pyarrow raises several unrelated types for a damaged file
        raise DataError(f"{p}: cannot read as parquet ({type(e).__name__}: {e}).") from None


# ---------------------------------------------------------------------------------------------
# DeepSpeed-Chat local/jsonfile directory


def _read_jsonfile_dir(path: str, d: Path) -> RawSource:
    base = d if (d / "train.json").exists() or (d / "eval.json").exists() else d / "data"
    parts = [base / name for name in ("train.json", "eval.json") if (base / name).exists()]
    if not parts:
        raise DataError(
            f"{path} is a directory without train.json / eval.json. A directory is read as "
            "DeepSpeed-Chat's local/jsonfile layout (DIR/train.json and DIR/eval.json, or "
            "DIR/data/train.json and DIR/data/eval.json); otherwise pass a file.\n" + FORMATS_HELP
        )
    rows: list = []
    spans: list[tuple[int, str, Callable[[int], str]]] = []  # (first row, file name, where)
    digest = hashlib.sha256()
    for part in parts:
        _, sha, part_rows, where = _read_file(part)
        digest.update(f"{part.name}:{sha}\n".encode())
        spans.append((len(rows), part.name, where))
        rows.extend(part_rows)

    def where(i: int) -> str:
        start, name, part_where = next(s for s in reversed(spans) if s[0] <= i)
        return f"{name} {part_where(i - start)}"

    return RawSource(path, "local/jsonfile", digest.hexdigest(), rows, where)


# ---------------------------------------------------------------------------------------------
# Hugging Face hub


def _looks_like_hub_name(path: str) -> bool:
    return bool(_HUB_NAME.fullmatch(path)) and not path.lower().endswith(_FILE_SUFFIXES)


def _hub_error(name: str, why: str) -> DataError:
    return DataError(
        f"could not fetch the hub dataset {name!r} ({why}). There is no local file or directory "
        f"of that name either. Download the data where the hub is reachable and pass a local "
        f"file instead, e.g. --data_path /path/to/file.jsonl.\n{FORMATS_HELP}"
    )


def _read_hub(name: str) -> RawSource:
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            raise _hub_error(name, f"offline mode: {var}={os.environ[var]}")
    try:
        import datasets

        dsd = datasets.load_dataset(name)
    except Exception as e:  # network, auth, missing repo: all mean "could not fetch"
        raise _hub_error(name, f"{type(e).__name__}: {str(e)[:300]}") from None
    splits = sorted(dsd, key=lambda s: s != "train")  # train first, then the others in order
    rows: list = []
    spans: list[tuple[int, str]] = []
    digest = hashlib.sha256()
    for split in splits:
        digest.update(f"{split}:{getattr(dsd[split], '_fingerprint', '')}\n".encode())
        spans.append((len(rows), split))
        rows.extend(dsd[split].to_list())

    def where(i: int) -> str:
        start, split = next(s for s in reversed(spans) if s[0] <= i)
        return f"split {split!r} row {i - start}"

    return RawSource(name, "hub", digest.hexdigest(), rows, where)
