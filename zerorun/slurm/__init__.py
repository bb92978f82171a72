"""The SLURM clients: ``zerorun submit`` (:mod:`zerorun.slurm.submit`, the batch script it writes and
:mod:`zerorun.slurm.sbatch`, what it reads of ``#SBATCH`` lines), the jobs it remembers (:mod:`zerorun.slurm.jobs`)
and ``zerorun attach`` (:mod:`zerorun.slurm.attach`). They talk to SLURM's commands (sbatch, scontrol, scancel);
the SLURM *launcher backend* that runs a job's ranks with srun inside an allocation stays in :mod:`zerorun.launch`.
"""
