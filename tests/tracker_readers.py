"""What the experiment trackers wrote, read back through each library's own reader (tests/test_trackers.py):
``{scalar name: {step: value}}`` per tracker."""

from __future__ import annotations

import csv
import glob
import json
import os
import struct


def tensorboard_scalars(folder: str) -> dict[str, dict[int, float]]:
    """TensorBoard's ``EventAccumulator`` over ``folder`` (purged steps left out, as TensorBoard shows them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(folder)
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def mlflow_scalars(uri: str, run_id: str, names) -> dict[str, dict[int, float]]:
    """MLflow's client on the store at ``uri``: the history of each of ``names`` in run ``run_id``."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    out = {}
    for name in names:
        history = client.get_metric_history(run_id, name)
        if history:
            out[name] = {m.step: m.value for m in history}
    return out


def _wandb_records(path: str):
    """The records of a ``.wandb`` transaction log (LevelDB's log format behind a 7-byte W&B header: 32 KiB
    blocks of chunks ``crc32 u32, length u16, type u8`` (1 full, 2 first, 3 middle, 4 last)), parsed as wandb's
    own ``Record`` protobuf: wandb 0.31 has no Python reader of its own (wandb-core, in Go, reads them)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = open(path, "rb").read()
    assert data[:4] == b":W&B", path
    pos, block, chunk = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header: padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def wandb_run(folder: str) -> tuple[str, dict, dict[str, dict[int, float]]]:
    """``(run id, config, scalars)`` of the one offline run folder under ``folder`` (``offline-run-*``)."""
    [path] = glob.glob(os.path.join(folder, "offline-run-*", "run-*.wandb"))
    run_id, config, out = None, {}, {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            config = {u.key: json.loads(u.value_json) for u in record.run.config.update if u.key != "_wandb"}
        elif kind == "history":
            step = record.history.step.num
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):  # wandb's own (_step, _runtime, _timestamp)
                    out.setdefault(key, {})[step] = float(json.loads(item.value_json))
    return run_id, config, out


def csv_scalars(path: str) -> dict[str, dict[int, float]]:
    """The CSV tracker's ``metrics.csv``, read with the csv module."""
    out: dict[str, dict[int, float]] = {}
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            for name, value in row.items():
                if name not in ("step", "time") and value != "":
                    out.setdefault(name, {})[int(row["step"])] = float(value)
    return out
