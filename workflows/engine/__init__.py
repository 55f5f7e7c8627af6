"""The engine: the registry of obligation kinds that drives every open row, claiming
due rows, recovery on start, history retention. The top of workflows: imports all of it."""
