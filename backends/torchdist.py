"""torch.distributed backend (placeholder: being written)."""


def available() -> str | None:
    return "the torch backend is not built yet in this version of dplab"
