"""Measurement and orchestration tools, run as python -m tools.NAME: the training-step benchmark
(bench), decoding latency (bench_decode), the grid runner and its report (sweep, sweep_report),
Parcae's scaling-law fits (flops_fit)."""
