"""The ``dptext`` command line: thin Typer commands, one module per subcommand.

Every module in this package that defines ``register(app)`` is discovered by
``dptext.cli.app`` and adds its command(s); adding a command means adding a file.
Command modules import only typer at module level and import the library (and with it
torch) inside the command body, which keeps ``dptext --help`` fast.
"""
