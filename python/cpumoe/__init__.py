from . import _C  # noqa: F401  (loads the ops into torch.ops.cpumoe)
