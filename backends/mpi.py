"""MPI backend (placeholder: being written)."""


def available() -> str | None:
    return "the MPI backend is not built yet in this version of dplab"
