"""``data.kind: hf``: local JSONL / Parquet / text files or a ``datasets.save_to_disk`` folder, tokenized once
with a fast tokenizer, cached beside the data and packed into ``seq_len`` blocks.

Note [Token cache]: the token ids of the whole source (documents joined by the tokenizer's eos token, none for
the byte-level fallback; a text file is one document, tokenized in batches of whole lines with no eos between
them) are written to ``<data path>.zerorun-tokens/<key>.bin`` (uint16 when the vocabulary
fits, else int32) with a ``.json`` beside it; ``key`` hashes the source files' paths, sizes and modification
times, the text field, and the tokenizer's own serialization, so a changed file or tokenizer makes a new cache
and the stale one is removed. Local rank 0 of each node writes it (under a temporary name, renamed when
complete); the other ranks wait for it. Tokenizing streams the source in batches of records: the text is never
held whole, let alone twice; progress is reported as ``log`` events. Training reads the cache memory-mapped.

Splits, sampling and resume follow the built-in text data: the last ``val_fraction`` of the tokens is the
validation split, samples are the non-overlapping blocks (``DistributedSampler`` with the recipe's seed), and the
data position of a checkpoint is a block index.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import time
from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import Dataset

from zerorun.errors import ZerorunError
from zerorun.hf.files import refuse_remote_code, remote_code  # noqa: F401 - used here, and by others from here

VERSION = 2  # 2: no eos between a text file's batches of lines
BATCH_BYTES = 4 << 20  # text per tokenizer call


# ----------------------------------------------------------------------------------------------- sources
def source_files(path: str) -> tuple[str, list[str]]:
    """``(format, files)`` of a data path: ``jsonl`` / ``parquet`` / ``text`` file, or ``arrow`` for a
    ``datasets.save_to_disk`` folder (its ``data-*.arrow`` files, in ``state.json`` order).

    Raises:
        ZerorunError: missing path, unknown suffix, a DatasetDict folder or a folder without arrow files.
    """
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "dataset_dict.json")):
            raise ZerorunError(f"data.path: {path} holds a DatasetDict: point data.path at one split's folder "
                               "(e.g. .../train)")
        state = os.path.join(path, "state.json")
        files = []
        if os.path.isfile(state):
            try:
                with open(state, encoding="utf-8") as f:
                    files = [os.path.join(path, d["filename"]) for d in json.load(f).get("_data_files", [])]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ZerorunError(f"data.path: {state}: unreadable datasets state: {e}") from None
        files = files or sorted(glob.glob(os.path.join(path, "*.arrow")))
        if not files:
            raise ZerorunError(f"data.path: {path}: no *.arrow files (not a datasets.save_to_disk folder)")
        return "arrow", files
    if not os.path.isfile(path):
        raise ZerorunError(f"data.path: not found: {path}")
    lower = path.lower()
    if lower.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl", [path]
    if lower.endswith(".parquet"):
        return "parquet", [path]
    if lower.endswith((".txt", ".text", ".md")):
        return "text", [path]
    raise ZerorunError(f"data.path: {path}: unknown format (use .jsonl, .parquet, .txt or a save_to_disk folder)")


def _arrow_reader(path: str):
    import pyarrow as pa

    source = pa.memory_map(path)
    try:
        return pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        return pa.ipc.open_file(source)


def columns_of(path: str) -> list[str] | None:
    """The record fields of the source at ``path`` (``None`` for plain text), read from the first record or
    the schema only."""
    fmt, files = source_files(path)
    if fmt == "text":
        return None
    if fmt == "jsonl":
        with open(files[0], "rb") as f:
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)  # bytes: json reads UTF-8 and says where it is not
                    except ValueError as e:
                        raise ZerorunError(f"data.path: {files[0]}:{i}: not JSON: {e}") from None
                    return list(record) if isinstance(record, dict) else []
        raise ZerorunError(f"data.path: {files[0]}: no records in it (an empty file)")
    _need_pyarrow()
    with _arrow_file(files[0], fmt):
        if fmt == "parquet":
            import pyarrow.parquet as pq

            return list(pq.ParquetFile(files[0]).schema_arrow.names)
        return list(_arrow_reader(files[0]).schema.names)


@contextlib.contextmanager
def _arrow_file(name: str, fmt: str) -> Iterator[None]:
    """pyarrow's errors reading ``name`` (a 0-byte or damaged Parquet or arrow file: ``ArrowInvalid``, which named
    no file) as one line naming it.

    Raises:
        ZerorunError: ``data.path: <file>: not a readable <fmt> file: <pyarrow's reason>``.
    """
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowException, OSError) as e:
        raise ZerorunError(f"data.path: {name}: not a readable {fmt} file: {e}") from None


def _need_pyarrow() -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ZerorunError("data.path: Parquet and save_to_disk folders need pyarrow: pip install 'zerorun[hf]'") from None


def iter_texts(path: str, text_field: str) -> Iterator[tuple[list[str], float]]:
    """Batches of texts of about :data:`BATCH_BYTES` from the source, each with the fraction of the source
    done after it (for progress). Text files: batches of whole lines, one document.

    Raises:
        ZerorunError: a record that is not JSON, lacks ``text_field`` or whose field is not a string (naming
            file and line or row).
    """
    fmt, files = source_files(path)
    if fmt in ("jsonl", "text"):
        name = files[0]
        total = max(1, os.path.getsize(name))
        with open(name, "rb") as f:
            batch, size, lineno = [], 0, 0
            for raw in f:
                lineno += 1
                if fmt == "text":
                    batch.append(raw.decode("utf-8", errors="replace"))
                else:
                    if not raw.strip():
                        continue
                    try:
                        record = json.loads(raw)
                    except ValueError as e:
                        raise ZerorunError(f"{name}:{lineno}: not JSON: {e}") from None
                    text = record.get(text_field) if isinstance(record, dict) else None
                    if not isinstance(text, str):
                        raise ZerorunError(f"{name}:{lineno}: data.text_field {text_field!r}: "
                                           f"{'missing' if text is None else 'not a string'}")
                    batch.append(text)
                size += len(raw)
                if size >= BATCH_BYTES:
                    yield (["".join(batch)] if fmt == "text" else batch), f.tell() / total
                    batch, size = [], 0
            if batch:
                yield (["".join(batch)] if fmt == "text" else batch), 1.0
        return
    _need_pyarrow()
    batch, size = [], 0
    with _arrow_file(path, fmt):
        for texts, fraction in _arrow_batches(fmt, files, text_field):
            for t in texts:
                batch.append(t)
                size += len(t)
                if size >= BATCH_BYTES:
                    yield batch, fraction
                    batch, size = [], 0
    yield batch, 1.0


def _arrow_batches(fmt: str, files: list[str], text_field: str) -> Iterator[tuple[list[str], float]]:
    """Record batches of the text column of Parquet / arrow files, each with the fraction of rows done."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(files[0])
        if text_field not in pf.schema_arrow.names:
            raise ZerorunError(f"{files[0]}: data.text_field {text_field!r}: no such column ({pf.schema_arrow.names})")
        total, done = max(1, pf.metadata.num_rows), 0
        for rb in pf.iter_batches(columns=[text_field], batch_size=64):
            done += rb.num_rows
            yield _strings(rb.column(0), files[0], text_field), done / total
        return
    for k, name in enumerate(files):
        reader = _arrow_reader(name)
        if text_field not in reader.schema.names:
            raise ZerorunError(f"{name}: data.text_field {text_field!r}: no such column ({reader.schema.names})")
        col = reader.schema.get_field_index(text_field)
        for rb in reader:
            yield _strings(rb.column(col), name, text_field), (k + 0.5) / len(files)


def _strings(column, name: str, field: str) -> list[str]:
    values = column.to_pylist()
    for i, v in enumerate(values):
        if not isinstance(v, str):
            raise ZerorunError(f"{name}: data.text_field {field!r}: row value {v!r} is not a string")
    return values


# -------------------------------------------------------------------------------------------- tokenizer
class Tokenizer:
    """A fast tokenizer (``tokenizers`` via ``transformers``' ``AutoTokenizer``, local files only) or, without a
    folder, UTF-8 bytes (vocabulary 256, no eos).

    Attributes:
        vocab_size: ids are in ``[0, vocab_size)``.
        eos: the id put between documents, or ``None``.
        fingerprint: sha256 hex of the tokenizer's serialization (changes when the tokenizer does).
    """

    def __init__(self, folder: str | None) -> None:
        self.folder = folder
        if folder is None:
            self.backend, self.vocab_size, self.eos, self.fingerprint = None, 256, None, "bytes"
            return
        from zerorun.hf import offline

        offline()
        refuse_remote_code(folder)
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
        except Exception as e:  # noqa: BLE001 - transformers raises many kinds for a bad folder
            raise ZerorunError(f"data.tokenizer: cannot load a tokenizer from {folder}: {type(e).__name__}: "
                               f"{str(e).strip().splitlines()[0] if str(e).strip() else ''}") from None
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None:
            raise ZerorunError(f"data.tokenizer: {folder} has no fast tokenizer (tokenizer.json)")
        self.backend = backend
        self.vocab_size = len(tok)
        self.eos = tok.eos_token_id
        self.fingerprint = hashlib.sha256((backend.to_str() + f"|eos={self.eos}").encode()).hexdigest()

    def encode(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of each text (no special tokens added), int64 arrays."""
        if self.backend is None:
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]
        return [np.asarray(e.ids, dtype=np.int64) for e in self.backend.encode_batch(texts, add_special_tokens=False)]


# ------------------------------------------------------------------------------------------------ cache
def cache_paths(path: str, text_field: str, tokenizer: Tokenizer) -> tuple[str, str]:
    """``(cache folder, cache file)`` of Note [Token cache]."""
    _, files = source_files(path)
    h = hashlib.sha256(f"v{VERSION}|{text_field}|{tokenizer.fingerprint}".encode())
    for f in files:
        st = os.stat(f)
        h.update(f"|{os.path.abspath(f)}|{st.st_size}|{st.st_mtime_ns}".encode())
    folder = path.rstrip(os.sep) + ".zerorun-tokens"
    return folder, os.path.join(folder, h.hexdigest()[:24] + ".bin")


def tokenize_to_cache(path: str, text_field: str, tokenizer: Tokenizer,
                      progress: Callable[[str], None] | None = None) -> str:
    """Write the token cache of the source (Note [Token cache]) unless it exists; return its file.

    Raises:
        ZerorunError: as :func:`iter_texts`; the cache folder cannot be written.
    """
    folder, cache = cache_paths(path, text_field, tokenizer)
    if os.path.isfile(cache):
        return cache
    dtype = np.uint16 if tokenizer.vocab_size <= 65535 else np.int32
    eos = tokenizer.eos if source_files(path)[0] != "text" else None  # a text file: one document
    tmp = f"{cache}.{os.getpid()}.tmp"
    try:
        os.makedirs(folder, exist_ok=True)
        t0 = last = time.time()
        n = 0
        with open(tmp, "wb") as out:
            for texts, fraction in iter_texts(path, text_field):
                if not texts:
                    continue
                for ids in tokenizer.encode(texts):
                    if eos is not None and n:
                        out.write(np.asarray([eos], dtype=dtype).tobytes())
                        n += 1
                    out.write(ids.astype(dtype).tobytes())
                    n += len(ids)
                if progress and time.time() - last > 2:
                    last = time.time()
                    bar = "#" * int(20 * fraction)
                    progress(f"tokenizing {os.path.basename(path)}: [{bar:<20}] {100 * fraction:.0f}% {n} tokens")
        with open(cache[:-4] + ".json", "w") as f:
            json.dump({"path": os.path.abspath(path), "text_field": text_field, "tokens": n,
                       "dtype": np.dtype(dtype).name, "tokenizer": tokenizer.folder, "version": VERSION}, f)
        os.replace(tmp, cache)
    except OSError as e:
        raise ZerorunError(f"data.path: cannot write the token cache in {folder}: {e.strerror}") from None
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    for old in glob.glob(os.path.join(folder, "*.bin")) + glob.glob(os.path.join(folder, "*.json")):
        if not old.startswith(cache[:-4]) and not old.endswith(".tmp"):
            os.remove(old)  # a stale cache of a changed file or tokenizer
    if progress:
        progress(f"tokenized {os.path.basename(path)}: {n} tokens in {time.time() - t0:.1f} s, cached in {cache}")
    return cache


class TokenBlocks(Dataset):
    """Non-overlapping blocks of ``seq_len`` tokens of ``tokens[start:end]``: item ``i`` is an int64 tensor of
    shape ``(seq_len,)`` (the model shifts labels itself)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, start: int, end: int) -> None:
        self.tokens, self.seq_len, self.start = tokens, seq_len, start
        self.n = max(0, (end - start) // seq_len)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n:
            raise IndexError(i)
        s = self.start + i * self.seq_len
        return torch.from_numpy(self.tokens[s:s + self.seq_len].astype(np.int64))


def build_hf_datasets(spec, progress: Callable[[str], None] | None = None,
                      local_rank: int = 0) -> tuple[Dataset, Dataset | None]:
    """``(train, validation or None)`` for ``data.kind: hf`` (Note [Token cache]); local rank 0 tokenizes,
    other local ranks wait for its cache file.

    Raises:
        ZerorunError: as :func:`tokenize_to_cache`; fewer tokens than one block.
    """
    tokenizer = Tokenizer(spec.tokenizer)
    if local_rank == 0:
        cache = tokenize_to_cache(spec.path, spec.text_field, tokenizer, progress)
    else:
        _, cache = cache_paths(spec.path, spec.text_field, tokenizer)
        while not os.path.isfile(cache):  # local rank 0 writes it; a failure there ends the job
            time.sleep(0.2)
    with open(cache[:-4] + ".json") as f:
        meta = json.load(f)
    tokens = np.memmap(cache, dtype=meta["dtype"], mode="r") if meta["tokens"] else np.zeros(0, np.uint16)
    n = len(tokens)
    n_val = int(n * spec.val_fraction)
    train = TokenBlocks(tokens, spec.seq_len, 0, n - n_val)
    if len(train) == 0:
        raise ZerorunError(f"data.path: {spec.path}: {n} tokens, fewer than one block of data.seq_len {spec.seq_len}")
    val = TokenBlocks(tokens, spec.seq_len, n - n_val, n) if n_val > spec.seq_len else None
    return train, val
