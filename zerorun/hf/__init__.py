"""Hugging Face sources for zerorun: ``model.hf`` (a ``transformers`` model from a local config or folder,
:mod:`zerorun.hf.model`), the stage-3 slice loader (:mod:`zerorun.hf.load`), the HF folder export
(:mod:`zerorun.hf.export`), ``data.kind: hf`` (:mod:`zerorun.hf.data`) and ``zerorun import-deepspeed``
(:mod:`zerorun.hf.deepspeed`).

Nothing here downloads: :func:`offline` sets the Hugging Face offline flags before ``transformers`` is imported.
"""

from __future__ import annotations

import os


def offline() -> None:
    """Force ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1`` in this process (and its children): every
    Hugging Face object zerorun builds comes from local files only."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # rank output is line-based telemetry
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
