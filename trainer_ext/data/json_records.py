"""JSON and JSON Lines files read record by record, each record that holds no document reported with its file and
line (`BadLines`) instead of stopping the run.

``datasets``' JSON builder stops at the first cut-off line or stray byte that is not UTF-8 (common in web dumps,
e.g. Shift_JIS bytes) with a pyarrow error that names neither the file nor the line, after minutes of reading on a
large corpus. Here every line is decoded as UTF-8 with bad bytes replaced by U+FFFD, as text files are read, and
parsed on its own: a line that holds no document is left out and counted, or refused with ``on_bad_lines="error"``.
Parsing runs at about 400 MB/s on one CPU core, so reading a whole corpus before any work to refuse a bad line
is affordable.
"""

from __future__ import annotations

import codecs
import json
import logging
from collections.abc import Iterator, Sequence

logger = logging.getLogger(__name__)

ON_BAD_LINES = ("skip", "error")  # what a JSON record that holds no document does: left out and counted, or refused
# Records of a JSON file read before any work to see that its documents are where --text_column says.
_PROBE_RECORDS = 100


class BadLines:
    """The records of JSON files that hold no document: a line that is not JSON (cut off, or a stray byte outside
    a string), not an object, or without a string under the text column.

    ``on_bad_lines="skip"`` leaves them out: the first of each file is logged with its file and line when it is
    met, all are counted (`report`); ``"error"`` raises ValueError at the first, naming the file, the line and
    the fix. One instance serves every pass over the files (the BPE training reads the leading documents, the
    packing all of them again): a pass reads each file from its start, so a line is new only past the last one
    counted, and each counts once.
    """

    def __init__(self, on_bad_lines: str = "skip"):
        if on_bad_lines not in ON_BAD_LINES:
            raise ValueError(f"--on_bad_lines={on_bad_lines!r} is not allowed; choose one of {list(ON_BAD_LINES)}.")
        self.on_bad_lines = on_bad_lines
        self.files: dict[str, dict] = {}  # path -> {"count", "first": "line N", "reason", "last": N}

    def __deepcopy__(self, memo):
        # `datasets` deep-copies a generator's arguments when it builds the stream; its copies must count here.
        return self

    def add(self, path: str, unit: str, number: int, reason: str) -> None:
        """Count record `number` (a `unit`: line or item) of `path`, which holds no document for `reason`."""
        where = f"{path}:{number}" if unit == "line" else f"{path}, {unit} {number}"
        if self.on_bad_lines == "error":
            raise ValueError(f"{where}: {reason}. Fix or remove that {unit}, or pass --on_bad_lines skip to leave "
                             f"out such {unit}s (they are counted and reported).")
        entry = self.files.get(path)
        if entry is None:
            self.files[path] = {"count": 1, "first": f"{unit} {number}", "reason": reason, "last": number}
            logger.warning("%s: %s; left out (--on_bad_lines skip). Further bad %ss of this file are counted and "
                           "reported at the end.", where, reason, unit)
        elif number > entry["last"]:
            entry["count"] += 1
            entry["last"] = number

    @property
    def count(self) -> int:
        return sum(entry["count"] for entry in self.files.values())

    def summary(self) -> dict:
        """{path: {"count", "first", "reason"}} of the files with bad records (for the manifest)."""
        return {path: {key: entry[key] for key in ("count", "first", "reason")} for path, entry in self.files.items()}

    def report(self) -> None:
        """Log how many records were left out, per file with the first one; nothing when there were none."""
        if not self.files:
            return
        per_file = "; ".join(f"{path}: {entry['count']:,} (first: {entry['first']}, {entry['reason']})"
                             for path, entry in self.files.items())
        logger.warning("Left out %s JSON record%s that hold%s no document: %s. Repair them at the source to train "
                       "on them, or pass --on_bad_lines error to refuse such files.", f"{self.count:,}",
                       *(("", "s") if self.count == 1 else ("s", "")), per_file)


def json_rows(paths: Sequence[str], text_column: str, bad_lines: BadLines) -> Iterator[dict]:
    """{"text": document} of each JSON record of `paths` that holds one; the others go to `bad_lines`."""
    for path in paths:
        for unit, number, text, reason in _json_documents(path, text_column):
            if reason is None:
                yield {"text": text}
            else:
                bad_lines.add(path, unit, number, reason)


def has_json_records(path: str, text_column: str) -> bool:
    """Whether `path` holds JSON records; ValueError if its first records are objects none of which has a
    `text_column` string (a wrong --text_column: every line would be left out)."""
    records, objects, fields = 0, 0, set()
    for _, _, text, reason in _json_documents(path, text_column, keep_objects=True):
        if reason is None:
            return True
        records += 1
        if isinstance(text, dict):
            objects += 1
            fields.update(text)
        if records >= _PROBE_RECORDS:
            break
    if objects:
        raise ValueError(f"{path}: none of its first {objects} JSON objects has a '{text_column}' string (their "
                         f"fields: {sorted(fields)[:20]}); pass --text_column with the field that holds the document "
                         "text.")
    return records > 0  # lines that are not JSON: left out or refused as they are read, each with its line


def _json_documents(path: str, text_column: str, keep_objects: bool = False):
    """(unit, number, text, None) for each record of the JSON file `path` that holds a document, (unit, number,
    None, why not) for each that does not, in file order; with `keep_objects` an object without the document
    comes as its third element. Bytes that are not UTF-8 become U+FFFD, as in a text file.

    A file is JSON Lines (unit "line", numbered from 1 with blank lines counted and passed over), unless its first
    character is "[": then it is one JSON array, parsed whole, of objects or strings (unit "item"), as
    ``datasets`` reads such files; an array that does not parse raises ValueError with its line and column.
    """
    import fsspec

    if _first_character(path) == "[":
        with fsspec.open(path, "rb", compression="infer") as f:
            data = f.read().decode("utf-8", errors="replace").lstrip("\ufeff")
        try:
            items = json.loads(data)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno}); a file that "
                             "starts with '[' is one JSON array, read whole, so no line of it can be left out: fix "
                             "it, or convert it to JSON Lines (one object per line).") from err
        for number, item in enumerate(items, start=1):
            if isinstance(item, str):
                yield "item", number, item, None
            else:
                yield ("item", number, *_document_of(item, text_column, keep_objects))
        return
    with fsspec.open(path, "rb", compression="infer") as f:
        for number, raw in enumerate(f, start=1):
            line = raw.decode("utf-8", errors="replace")
            if number == 1:
                line = line.lstrip("\ufeff")  # a byte-order mark, which json.loads refuses
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as err:
                yield "line", number, None, f"not valid JSON ({err.msg} at column {err.colno})"
                continue
            yield ("line", number, *_document_of(value, text_column, keep_objects))


def _document_of(value, text_column: str, keep_objects: bool) -> tuple:
    """(text, None) if the parsed record `value` holds a document, else (None or the object, why not)."""
    if not isinstance(value, dict):
        return None, f"a JSON {_json_type(value)} where an object with a '{text_column}' field was expected"
    text = value.get(text_column)
    if isinstance(text, str):
        return text, None
    reason = (f"no '{text_column}' field" if text_column not in value
              else f"its '{text_column}' is a JSON {_json_type(text)}, not a string")
    return (value if keep_objects else None), reason


def _json_type(value) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


def _first_character(path: str, chunk_bytes: int = 1 << 16) -> str:
    """The first character of `path` that is not whitespace or a byte-order mark ("" for none)."""
    import fsspec

    with fsspec.open(path, "rb", compression="infer") as f:
        chunk = f.read(chunk_bytes).removeprefix(codecs.BOM_UTF8)
        while chunk:
            stripped = chunk.lstrip()
            if stripped:
                return stripped[:1].decode("utf-8", errors="replace")
            chunk = f.read(chunk_bytes)
    return ""
