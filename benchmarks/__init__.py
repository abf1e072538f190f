"""fastckpt's benchmarks (a source checkout only; not installed with the package).

harness.py     the shared measuring pieces: sizes, CPU and device counters, the page cache, fio,
               the machine's description, forked children
workload.py    the synthetic model + AdamW state dict, compare, touch_pages
bench_quick.py ``fastckpt bench`` (quick mode; ``--tune`` runs bench_tune.py's knob sweep)
bench_*.py     the report's scripts (save/load against the peers, engine, DCP, training, GPU)
report.py      ``make bench``: runs them and writes results/REPORT.md
"""
