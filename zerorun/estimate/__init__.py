"""``zerorun estimate``: memory per rank and communication per step for every ZeRO stage, before launching.

A package split by concern: ``sizes`` (parsing and formatting), ``policies`` (precision, optimizer), ``layout``
(the flat buffers counted from), ``states`` (model states), ``activations`` (and the transient working set),
``communication``, ``report`` (every stage and offload variant, the recommendation), ``rendering`` (the table),
``hosts`` (whose memory: the flags', the hostfile's hosts' or this machine's) and ``command`` (the CLI entry
point). This module re-exports their public names.

Pure arithmetic over parameter counts (DESIGN.md): the model is built on the meta device (no memory, any
size) only to count its parameters and lay them out the way the engine will.

Note [What is exact]: model-state bytes per rank (parameters, gradients, optimizer states) are predicted from
the same flat-buffer layout the engine builds (``zero/flat.py`` ``pack``, ``zero/stage3.py`` ``pick_units`` and
``unit_of_params``, ``zero/engine.py`` ``default_param_groups``): one buffer per run of at most ``bucket_mb`` of a
param group (stage 3: per unit), each padded to a multiple of the world size N, a rank holding 1/N of it where
the stage partitions. They equal ``ZeroEngine.memory_bytes()`` and ``offload_bytes()`` (tests/test_estimate.py)
for every precision and ``zero.offload_optimizer``:

- fp32: parameters and gradients 4 bytes; without offload the parameters are their own master (optimizer =
  the states only: fp32 Adam 4Ψ + 4Ψ + 8Ψ, divided by the stage).
- bf16/fp16 (Note [Mixed precision] in ``zero/precision.py``; ZeRO paper §5): parameters and gradients 2
  bytes, and the buffers are packed in 2-byte elements (a ``bucket_mb`` bucket holds twice as many); the
  optimizer keeps an fp32 master of its slice beside the states (Adam: 2Ψ + 2Ψ + 12Ψ with K = 12 = master 4 +
  momentum 4 + variance 4). ``zero.reduce_dtype: fp32`` makes the stage 2-3 gradient slices, and every
  gradient collective, 4 bytes.
- ``offload_optimizer: cpu`` (``zero/offload.py`` ``CpuMasters``): a separate fp32 master always (fp32
  included) plus the states, in host memory (``offload_bytes()["host"]``) on an accelerator; on a CPU-only
  machine the host is the device and they stay in ``memory_bytes()["optimizer"]``.
- ``disk`` (``DiskMasters``): nothing in device memory; a host buffer of ``offload_buffer_mb`` and, per
  rank, a swap file holding master and states of each sub-group (Note [Disk paging]), each region rounded up
  to 64 bytes.
- The optimizer's states are per rank's part of each parameter (Note [Unused parameters] in
  ``zero/masters.py``): none for the padding, a scalar (Adam's ``step``) per part, disk sub-groups within one
  part; ranks differ by a few bytes there, and the estimate is the largest rank's.

Communication per rank per step counts bytes sent as ``zero/comm.py`` does (ring algorithms: reduce-scatter
and all-gather send (N-1)/N of the buffer, all-reduce twice that; ZeRO paper §7: 2Ψ elements for stages 0-2,
3Ψ for stage 3), and of them the bytes to ranks on other nodes as ``Comm`` counts them (Note [Nodes of a group]
in ``zero/topology.py``; with ``zero.hierarchy`` the secondary group's all-gathers, and the secondary shards'
memory, Note [Secondary shards] in ``zero/hierarchy.py``: equal to ``SecondaryShards.nbytes``,
tests/test_hierarchy.py). At stage 3 the root and the outer units, where they hold at most ``zero.keep_root_bytes``
together, are gathered once per micro-step, and the last listed unit too where it fits with them (Note [Kept from
forward to backward] in ``zero/stage3_outer.py``; ``hierarchy.kept_units``).
Without a recipe (``--params``), the layout is one buffer of Ψ elements.

Note [What is approximate]: the working set stage 3 adds (the root unit, which stays gathered through forward
and backward, plus the largest unit being computed and the next one being prefetched, or what ``zero.prefetch_bytes``
lets through), the full gradient
buckets stages 2-3 hold while their reduce-scatters are in flight, and activations (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", §4, generalized to the element size and to
models without dropout); host memory for cpu offload on an accelerator (the masters and states plus the pinned
copies of every gradient and parameter slice its step stages). Not counted: the Python/torch runtime (about
0.3-0.5 GiB per process on CPU), the allocator's cache and fragmentation, activation gradients during backward,
communication buffers.
"""


from __future__ import annotations

from zerorun.estimate.sizes import format_bytes, format_count, parse_bandwidth, parse_bytes, parse_count
from zerorun.estimate.policies import (OFFLOADS, PRECISIONS, OptimizerModel, Precision, grad_accum_bytes,
                                       optimizer_model, precision_of)
from zerorun.estimate.layout import (PERSISTENT, Layout, UnitCount, layout_of, layout_of_count, layout_of_recipe,
                                     suggest_unit_class)
from zerorun.estimate.states import ModelStates, model_states
from zerorun.estimate.activations import INFLIGHT_BUCKETS, WorkingSet, activation_bytes, working_set
from zerorun.estimate.communication import Traffic, comm_bytes, traffic
from zerorun.estimate.hierarchy import gradient_group, group_size, secondary_bytes
from zerorun.estimate.report import MIN_HEADROOM, Estimate, Setup, StageRow, estimate, offload_variants
from zerorun.estimate.rendering import render
from zerorun.estimate.command import detect_memory, from_arguments

__all__ = ["Estimate", "INFLIGHT_BUCKETS", "Traffic", "Layout", "MIN_HEADROOM", "ModelStates", "OFFLOADS",
           "OptimizerModel", "PERSISTENT", "PRECISIONS", "Precision", "Setup", "StageRow", "UnitCount", "WorkingSet",
           "activation_bytes", "comm_bytes", "detect_memory", "gradient_group", "group_size", "estimate",
           "format_bytes", "format_count", "from_arguments",
           "grad_accum_bytes", "layout_of",
           "layout_of_count", "layout_of_recipe", "model_states", "offload_variants", "optimizer_model",
           "parse_bandwidth", "parse_bytes", "parse_count", "precision_of", "render", "secondary_bytes",
           "suggest_unit_class", "traffic", "working_set"]
