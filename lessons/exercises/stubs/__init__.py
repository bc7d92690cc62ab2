"""The exercises' stubs, as ``dplab lesson init DIR`` copies them: signature, task, a wrong body."""
