"""What every trainer rank imports before it builds its Policy, imported once by the ranks' forkserver
(grpo/distributed.py `rank_context`, which names this module as the server's preload) with the garbage collector off
and the result frozen (`polar_lab._imports.frozen_imports`): 4.7 s instead of 6.3-6.7 s on 2 cores (2026-12-05).
`transformers` alone is lazy: the Policy's `AutoModelForCausalLM` and `get_scheduler` would import their modules in
every rank, ~2.8 s of CPU each (0.1 s once preloaded, the model's own module included)."""

from polar_lab._imports import frozen_imports

with frozen_imports():
    import torch.distributed  # noqa: F401
    import transformers  # noqa: F401
    import transformers.models.auto.modeling_auto  # noqa: F401
    import transformers.optimization  # noqa: F401

    import polar_lab.grpo.policy  # noqa: F401
