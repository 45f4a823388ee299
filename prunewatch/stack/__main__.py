"""`python -m prunewatch.stack up|down`: the stack commands without the rest of the `prunewatch` app."""

import typer

from prunewatch.stack.cli import stack_down_command, stack_up_command

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="The prunewatch stack as local processes on 127.0.0.1.")
app.command("up")(stack_up_command)
app.command("down")(stack_down_command)
app()
