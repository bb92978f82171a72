"""What runs on every rank: the entry points that torch's launcher starts (``python -m zerorun.rank.worker``,
``python -m zerorun.rank.script_worker``), the training loop (``loop.py``), the user's model and data
(``userload.py``, ``data.py``), the LR schedule, the SIGTERM stop, and the model check the launcher runs beside
a job (``modelcheck.py``).

Nothing is imported here: the launcher imports ``rank.modelcheck`` without torch.
"""
