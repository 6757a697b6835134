"""Benchmark code: clients of the library, never imported by it.

- :mod:`opacus_fsdp_sync.bench.compare`: the FSDP1-vs-FSDP2 parameter and gradient access
  comparison suite (CLI ``opacus-fsdp-sync-compare``).
- :mod:`opacus_fsdp_sync.bench.modes`: the profiling suite's modes, read by the harness under
  ``memory_test/fsdp_llama3_profiling/`` and by the tests.
- :mod:`opacus_fsdp_sync.bench.ledger`: the op ledger, one private step against one
  non-private step phase by phase (ops, bytes, FLOPs, live bytes; CLI
  ``python -m opacus_fsdp_sync.bench.ledger``), counted by :mod:`.op_ledger`, reported by
  :mod:`.ledger_report`.
- :mod:`opacus_fsdp_sync.bench.host_overhead`: the host time (dispatch and Python) of a private
  step against a non-private one at a negligible width, what a GPU waits for when the host is
  behind (CLI ``python -m opacus_fsdp_sync.bench.host_overhead``).
- :mod:`opacus_fsdp_sync.bench.results_io`: the end those command lines share (print the
  table, write ``DIR/{name}.json`` and ``.md`` on rank 0, end the process group).
- :mod:`opacus_fsdp_sync.bench.throughput`: the suite's cost per example and tokens per second
  over the measured steps, by which its tables and plots compare modes.

The core package (everything outside this subpackage) does not import it;
``tests/test_bench.py`` checks that. It ships inside the package so that the console script and
``python -m opacus_fsdp_sync.bench.compare`` work from an install, without a second top-level
package.
"""
