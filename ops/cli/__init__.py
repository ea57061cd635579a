"""The ``kvops`` Typer CLI: thin glue over the library modules of ``kvops.ops``."""
