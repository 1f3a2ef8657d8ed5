"""The ``routeplay`` command line: thin commands over the library's public API."""
