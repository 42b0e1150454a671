import os

# No hub downloads, ever; keep torch to one thread so tests share the 2 cores fairly.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
