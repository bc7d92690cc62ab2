"""The exercises' shipped answers (``dplab lesson check`` passes every one; CI proves it)."""
