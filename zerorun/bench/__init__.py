"""``zerorun bench``: one recipe across hostfiles and ZeRO stages, beside torch's DDP and FSDP2.

- :mod:`zerorun.bench.args`: the stages, baselines and node counts it is given, the overrides it refuses;
- :mod:`zerorun.bench.rows`: the combinations and their metrics from each job's telemetry (Note [Bench metrics]);
- :mod:`zerorun.bench.run`: running every combination as a ``zerorun train`` job, the live table;
- :mod:`zerorun.bench.output`: bench.json, bench.csv, bench.md, bench.png and the tables;
- :mod:`zerorun.bench.baselines`: torch's DDP and FSDP2 behind the engine's interface (imported by the ranks).

This module re-exports the public names of the old ``zerorun.bench`` module; the modules of the package import
each other directly, never through here.
"""

from zerorun.bench.args import (BASELINES, CONTROLLED, ZERO_VARIANTS, check_overrides, parse_baselines,  # noqa: F401
                                parse_nodes, parse_stages, parse_zero_variants)
from zerorun.bench.output import markdown_table, render_table, write_csv, write_json, write_png  # noqa: F401
from zerorun.bench.rows import METRICS, Combination, Row, measure, percentile, read_events, summarize  # noqa: F401
from zerorun.bench.run import (ENV_NOTE, QuietView, check_allocation, combinations, progress_line,  # noqa: F401
                               run_bench)
