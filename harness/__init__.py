"""The harness that train.py, data.py and the studies call: flags to configs, checkpoints, evaluation,
the data sources and token files, the synthetic tasks and the frozen bases."""
