"""The store: typed SQLAlchemy models, state Enums and their transitions, the engine
(SQLite pragmas, IMMEDIATE writes, transient retries), guarded updates and SQL views.
Imports nothing from workflows or runners."""
