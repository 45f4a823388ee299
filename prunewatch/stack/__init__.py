"""The local stack: the docker-compose topology as processes on 127.0.0.1 (`prunewatch stack up` / `down`)."""

from prunewatch.stack.lifecycle import DownReport, StackError, stack_down, stack_up
from prunewatch.stack.settings import StackSettings
from prunewatch.stack.state import StackState

__all__ = ["DownReport", "StackError", "StackSettings", "StackState", "stack_down", "stack_up"]
