"""The harness of ``benchmarks/train_throughput.py`` (single-GPU training throughput, one subprocess per path).

Which module holds what:

- ``paths``: the path names, the default list, the baselines, what a name says (attention suffix, master weights)
- ``shapes``: the model shapes (``--model``, ``--layers``), their table names, FLOPs per token
- ``paths_ours``, ``paths_baseline``, ``paths_titan``, ``paths_lora``: how each family of paths builds its model
  (ours; transformers' as a user builds it; torchtitan's; the LoRA paths' adapters, peft baseline and shared start)
- ``plain_loop``, ``trainer_loop``: how a path steps its model (a plain PyTorch loop, or Lightning's Trainer)
- ``instruments``: batches, CUDA-event timing, the host-sync and host-bound probes, the profiler
- ``worker``: one path in its own process; ``runner``: the parent that launches the workers and writes the files
- ``report``: tokens/s, MFU, the ratios to the baselines, the loss guard, the Markdown tables, the run's metadata

``train_throughput.py`` is the command line and re-exports the names other benchmarks and the tests import; the
modules import each other relatively, and ``benchmarks/`` is on ``sys.path`` wherever the script runs or is
imported (the script's own folder; the tests insert it).
"""
