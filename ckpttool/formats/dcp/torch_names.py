"""Placeholders named as torch's dtypes and layouts (``float32``, ``bool``, ``strided``, ...),
made by :mod:`.metadata_pickle` when it is imported: a module of its own because those names
would shadow builtins in a module with code in it."""
