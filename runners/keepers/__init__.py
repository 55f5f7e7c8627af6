"""The helper processes that outlive the agent (fd holder, log keeper, fence keeper)
and their clients. Imports runners.base only."""
