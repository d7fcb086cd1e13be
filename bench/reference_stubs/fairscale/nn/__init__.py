"""Stub: torchscale imports these but calls them only with checkpoint_activations / fsdp."""


def checkpoint_wrapper(module, *args, **kwargs):
    raise NotImplementedError("fairscale stub: install fairscale for checkpoint_activations")


def wrap(module, *args, **kwargs):
    raise NotImplementedError("fairscale stub: install fairscale for fsdp")
