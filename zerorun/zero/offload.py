"""Where the fp32 master slices and the optimizer states live, and how the optimizer step runs over them: the
design notes, and the public names of ``masters.py`` (device and host), ``disk.py`` (swap file paging) and
``swap.py`` (the swap file).

The engine hands over this rank's parameter slices (one per flat buffer: stage 0 the whole buffer) and, at
each step, this rank's reduced gradient slices; a :class:`Masters` steps the user's ``torch.optim`` optimizer
and writes the updated values back into the parameter slices (cast to their dtype).

- :class:`Masters` (``offload_optimizer: none``): in device memory. fp32 training aliases the master to the
  parameter slice itself (no copy); mixed precision keeps a separate fp32 copy (Note [Mixed precision]).
- :class:`CpuMasters` (``cpu``): masters and states in host memory (pinned when the device is CUDA), the step
  on the CPU (ZeRO-Offload, Ren et al., arXiv:2101.06840, §4), one fused (or foreach) optimizer step over all
  slices (Note [One optimizer step] in ``masters.py``). Note [Offload overlap]: the gradient slices come to
  the host through reused buffers with one wait per step, and the updated parameters go back non-blocking,
  ordered by an event waited for only before the masters are written again (Note [Offload copies] in
  ``staging.py``); the step itself no longer overlaps with the copies (it ran buffer by buffer, each
  ``optimizer.step()`` walking every parameter). On a CPU-only machine the "device" is the host and the
  copies are plain copies through the same buffers.
- :class:`DiskMasters` (``disk``): masters and states in a file under ``offload_path``, paged through a
  bounded host buffer (ZeRO-Infinity's NVMe offload, Rajbhandari et al., arXiv:2104.07857, §5). Note [Disk
  paging]: each master slice is cut into sub-groups of at most ``chunk`` elements within one parameter
  (Note [Unused parameters] in ``masters.py``), each one optimizer parameter; the step reads a sub-group
  (master + its state tensors) into one half of the host buffer while the previous sub-group steps in the
  other half (a reader thread: ``os.preadv`` releases the GIL), then
  writes it back; its gradient comes in and its parameters go out through two reused halves of staging too
  (``staging.ChunkStaging``: non-blocking copies ordered by events). Host memory for optimizer states is the buffer, whatever the model size. Between steps the
  optimizer's parameters are empty tensors and ``optimizer.state`` holds nothing: the states are in the file
  (read them with :meth:`Masters.state_slices`). Note [Swap files]: one file per rank, named
  ``zerorun-offload-rank<R>-<pid>.bin`` (a second engine of the same process and rank: ``-2``, ``-3``, ...;
  parameter offload's: ``zerorun-offload-params-...``), held under an exclusive ``flock`` while the process lives; it is
  removed when the engine is closed or the process exits, and a file left by a crashed run (its lock died
  with it) is removed by the next run that uses the folder. Checkpoints of a disk-offloaded engine are paged
  through the same buffer (Note [Paged checkpoints] in ``state_paging.py``).
"""

from __future__ import annotations

from zerorun.zero.disk import DiskMasters, tensor_state_names
from zerorun.zero.paging_math import subgroup_elements
from zerorun.zero.masters import CpuMasters, Masters
from zerorun.zero.swap import SWAP_ALIGN, SwapFile, remove_stale_swap_files, swap_region_bytes

__all__ = ["SWAP_ALIGN", "CpuMasters", "DiskMasters", "Masters", "SwapFile", "remove_stale_swap_files",
           "subgroup_elements", "swap_region_bytes", "tensor_state_names"]
